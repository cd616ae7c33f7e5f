"""Cluster -> laptop in one command: a DDP checkpoint saved on cuda:1 is fixed by the one command inspect prints."""

from __future__ import annotations

import shlex
import shutil
import subprocess
from pathlib import Path

import torch
from click.testing import CliRunner

from ckptool.cli.main import main


def run(*args: object) -> tuple[int, str, str]:
    result = CliRunner().invoke(main, [str(a) for a in args])
    return result.exit_code, result.stdout, result.stderr


def test_one_printed_fix_makes_a_gpu_ddp_checkpoint_load_on_a_laptop(fixtures_dir: Path, tmp_path: Path,
                                                                     python_executable: str,
                                                                     subprocess_env: dict[str, str]) -> None:
    source = tmp_path / "ddp cuda1.pt"
    shutil.copy(fixtures_dir / "gpu_cuda1_ddp_lenet.pt", source)
    code, out, _ = run("inspect", source)
    fixes = [line.split("fix: ", 1)[1] for line in out.splitlines() if "fix: " in line]
    assert code == 0 and len(fixes) == 1, out
    words = shlex.split(fixes[0])
    assert words[:2] == ["ckptool", "strip"] and "--to" in words
    code, out, err = run(*words[1:])
    assert code == 0, err
    fixed = Path(words[words.index("-o") + 1])
    code, out, _ = run("inspect", fixed)
    assert "fix: " not in out and "wrapper prefix (none)" in out and "saved devices  cpu: 32" in out
    # torch itself, in a process that sees no GPU, loads it and gets the same weights under bare names
    check = ("import sys, torch; a = torch.load(sys.argv[1], weights_only=True)['model']; "
             "b = torch.load(sys.argv[2], weights_only=True, map_location='cpu')['model']; "
             "assert list(a) == [k.removeprefix('module.') for k in b], list(a); "
             "assert all(torch.equal(a[k.removeprefix('module.')], v) for k, v in b.items())")
    env = {**subprocess_env, "CUDA_VISIBLE_DEVICES": ""}
    completed = subprocess.run([python_executable, "-c", check, str(fixed), str(source)], env=env,
                               capture_output=True, text=True, timeout=300)
    assert completed.returncode == 0, completed.stderr


def test_strip_maps_device_tags_in_the_same_write(fixtures_dir: Path, tmp_path: Path) -> None:
    code, out, err = run("strip", fixtures_dir / "gpu_cuda1_ddp_lenet.pt", "-o", tmp_path / "c0.pt",
                         "--map", "cuda:1=cuda:0")
    assert code == 0, err
    assert "devices {'cuda:1': 24, 'cpu': 8} -> {'cuda:0': 24, 'cpu': 8}" in out
    code, out, err = run("strip", fixtures_dir / "mlp.safetensors", "-o", tmp_path / "x.safetensors", "--prefix",
                         "fc", "--to", "cpu")
    assert code == 2 and "no device tags" in err and not (tmp_path / "x.safetensors").exists()


def test_convert_says_the_output_still_carries_the_prefix(fixtures_dir: Path, tmp_path: Path) -> None:
    out_path = tmp_path / "m.safetensors"
    code, out, err = run("convert", fixtures_dir / "ddp_lenet_wrapped.pt", "-o", out_path)
    assert code == 0, err
    [note] = [line for line in out.splitlines() if 'still carry "module."' in line]
    command = shlex.split(note.split("to drop it: ", 1)[1])
    assert "--strip" in command and "--force" in command
    code, out, err = run(*command[1:])
    assert code == 0 and "still carry" not in out, err
    from safetensors import safe_open

    with safe_open(str(out_path), "pt") as reader:
        assert sorted(reader.keys()) == sorted(k.removeprefix("module.") for k in torch.load(
            fixtures_dir / "ddp_lenet_wrapped.pt", weights_only=True)["model"])
