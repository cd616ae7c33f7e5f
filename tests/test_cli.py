"""The CLI: exit codes, one-line errors, --json, help text, and the README tour."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

from ckptool.cli import main

REPO = Path(__file__).resolve().parent.parent


def run(*args: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(main, [str(a) for a in args])
    return result.exit_code, result.stdout, result.stderr


def test_every_command_has_help_and_is_in_the_readme() -> None:
    readme = (REPO / "README.md").read_text()
    for name, command in main.commands.items():
        assert command.help and "Example:" in command.help, name
        assert f"ckptool {name}" in readme, f"README does not show ckptool {name}"
        code, out, _ = run(name, "--help")
        assert code == 0 and "Usage:" in out


def test_version() -> None:
    code, out, _ = run("--version")
    assert code == 0 and re.search(r"ckptool, version \d+\.\d+", out)


def test_inspect_json_has_the_documented_keys(fixtures_dir: Path) -> None:
    code, out, _ = run("inspect", fixtures_dir / "ddp_lenet_wrapped.pt", "--json", "--fingerprint")
    assert code == 0
    data = json.loads(out)
    for key in ("format", "layout", "prefix", "tensors", "parameters", "bytes", "dtypes", "saved_devices", "tied",
                "entries", "globals", "fingerprint"):
        assert key in data, key
    assert data["prefix"] == "module." and data["layout"] == ["model"]


def test_inspect_text_names_problem_and_fix(fixtures_dir: Path) -> None:
    code, out, _ = run("inspect", fixtures_dir / "gpu_cuda1_ddp_lenet.pt")
    assert code == 0
    assert "ckptool strip gpu_cuda1_ddp_lenet.pt -o" in out
    assert "ckptool remap gpu_cuda1_ddp_lenet.pt -o" in out and "--to cpu" in out


def test_scan_verdicts(fixtures_dir: Path, tmp_path: Path) -> None:
    code, out, _ = run("scan", fixtures_dir / "single_lenet.pt", "--json")
    assert code == 0 and json.loads(out)["safe"] is True
    evil = tmp_path / "evil.pkl"
    # protocol 0: GLOBAL posix system, then REDUCE — never executed, only read
    evil.write_bytes(b"cposix\nsystem\n(S'touch " + str(tmp_path / "CANARY").encode() + b"'\ntR.")
    code, out, _ = run("scan", evil, "--json")
    assert code == 1
    assert json.loads(out)["unsafe"] == ["posix.system"]
    code, _, err = run("inspect", evil)
    assert code == 3 and "posix.system" in err and err.count("\n") == 1
    assert not (tmp_path / "CANARY").exists()


def test_strip_cli_json_and_exit_codes(fixtures_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "model.pt"
    code, stdout, _ = run("strip", fixtures_dir / "ddp_lenet_wrapped.pt", "-o", out, "--json", "--fingerprint")
    assert code == 0
    data = json.loads(stdout)
    assert data["prefix"] == "module." and data["renamed"] == 8 and data["fingerprint"].startswith("sha256:")
    code, _, err = run("strip", out, "-o", tmp_path / "again.pt")
    assert code == 1 and "nothing to strip" in err and not (tmp_path / "again.pt").exists()
    code, _, err = run("strip", fixtures_dir / "ddp_lenet_wrapped.pt", "-o", out)
    assert code == 3 and err == f"ckptool: error: {out}: already exists — pass --force to overwrite it, or choose another -o\n"


def test_in_place_strip(fixtures_dir: Path, tmp_path: Path) -> None:
    target = tmp_path / "ddp.pt"
    shutil.copy(fixtures_dir / "ddp_lenet_wrapped.pt", target)
    code, _, err = run("strip", target, "-o", target)
    assert code == 3 and "is the input" in err
    code, _, _ = run("strip", target, "--in-place")
    assert code == 0
    code, out, _ = run("inspect", target, "--json")
    assert json.loads(out)["prefix"] == ""


def test_remap_cli(fixtures_dir: Path, tmp_path: Path) -> None:
    code, stdout, _ = run("remap", fixtures_dir / "gpu_cuda1_ddp_lenet.pt", "-o", tmp_path / "c0.pt",
                          "--map", "cuda:1=cuda:0", "--json")
    assert code == 0
    data = json.loads(stdout)
    assert data["devices_before"] == {"cpu": 8, "cuda:1": 24} and data["devices_after"] == {"cpu": 8, "cuda:0": 24}
    code, _, err = run("remap", fixtures_dir / "gpu_cuda0_lenet.pt", "-o", tmp_path / "x.pt")
    assert code == 2 and "--to cpu" in err
    code, _, err = run("remap", fixtures_dir / "gpu_cuda0_lenet.pt", "-o", tmp_path / "x.pt", "--to", "gpu7")
    assert code == 2 and "not a device" in err


def test_convert_cli(fixtures_dir: Path, tmp_path: Path) -> None:
    code, stdout, _ = run("convert", fixtures_dir / "ddp_lenet_wrapped.pt", "-o", tmp_path / "m.safetensors",
                          "--strip", "--json")
    assert code == 0 and json.loads(stdout)["format"] == "safetensors"
    code, stdout, _ = run("convert", fixtures_dir / "single_lenet.pt", fixtures_dir / "dp_mlp_wrapped.pt",
                          "--out-dir", tmp_path, "--json")
    assert code == 0 and len(json.loads(stdout)["converted"]) == 2
    assert (tmp_path / "single_lenet.safetensors").exists() and (tmp_path / "dp_mlp_wrapped.safetensors").exists()
    code, _, err = run("convert", fixtures_dir / "single_lenet.pt", "-o", tmp_path / "x.onnx")
    assert code == 2 and "cannot tell the format" in err
    code, _, err = run("convert", fixtures_dir / "single_lenet.pt", "-o", tmp_path / "s", "--max-shard-size", "lots")
    assert code == 2 and "500MB" in err


@pytest.mark.parametrize("name", ["torchscript_mlp.pt"])
def test_non_checkpoints_refused_in_one_line(name: str, fixtures_dir: Path, tmp_path: Path) -> None:
    for args in (["inspect"], ["strip", "-o", str(tmp_path / "o.pt")], ["convert", "-o", str(tmp_path / "o.safetensors")]):
        code, _, err = run(args[0], fixtures_dir / name, *args[1:])
        assert code == 3 and "TorchScript" in err and err.count("\n") == 1 and "Traceback" not in err
    assert not list(tmp_path.iterdir())
