"""convert --to dcp: a torch checkpoint into a torch.distributed.checkpoint folder that torch's dcp.load gives back
whole, and that python -m training --resume continues from exactly as from the file."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from ckptool.cli.main import main

SMALL = ["--train-size", "512", "--test-size", "128"]


def run(*args: object) -> tuple[int, str, str]:
    result = CliRunner().invoke(main, [str(a) for a in args])
    return result.exit_code, result.stdout, result.stderr


# torch's own reading of a DCP folder (format_utils.dcp_to_torch_save), then the two objects compared deep
COMPARE = r"""
import sys, torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

def same(a, b, path="top"):
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape, path
        assert torch.equal(a, b), path
    elif isinstance(a, dict):  # DCP keys are strings: an optimizer's parameter ids come back as '0', '1', ...
        assert isinstance(b, dict) and [str(k) for k in a] == list(b), (path, list(a), list(b))
        for key in a:
            same(a[key], b[str(key)], f"{path}/{key}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for index, (x, y) in enumerate(zip(a, b)):
            same(x, y, f"{path}/{index}")
    else:
        assert a == b, (path, a, b)

dcp_to_torch_save(sys.argv[1], sys.argv[2])
same(torch.load(sys.argv[3], weights_only=True), torch.load(sys.argv[2], weights_only=True))
"""


def test_dcp_output_reads_back_in_torch_as_the_whole_checkpoint(fixtures_dir: Path, tmp_path: Path,
                                                                  python_executable: str,
                                                                  subprocess_env: dict[str, str]) -> None:
    source = fixtures_dir / "ddp_lenet_wrapped.pt"  # {model, optimizer, epoch, config, metrics}
    out = tmp_path / "run.dcp"
    code, stdout, err = run("convert", source, "-o", out, "--to", "dcp", "--fingerprint", "--json")
    assert code == 0, err
    [report] = json.loads(stdout)["converted"]
    assert report["format"] == "dcp" and report["checked"] == 8 and report["fingerprint"].startswith("sha256:")
    assert sorted(p.name for p in out.iterdir()) == [".metadata", "__0_0.distcp"]
    completed = subprocess.run([python_executable, "-c", COMPARE, str(out), str(tmp_path / "back.pt"), str(source)],
                               env=subprocess_env, capture_output=True, text=True, timeout=300)
    assert completed.returncode == 0, completed.stderr[-3000:]
    code, _, err = run("diff", out, source)  # and ckptool reads it back the same
    assert code == 0, err


def test_dcp_output_refusals_and_out_dir(fixtures_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "w.dcp"
    out.mkdir()
    code, _, err = run("convert", fixtures_dir / "single_lenet.pt", "-o", out, "--to", "dcp")
    assert code == 3 and "already exists" in err
    code, _, err = run("convert", fixtures_dir / "single_lenet.pt", "-o", tmp_path / "s.dcp", "--to", "dcp",
                       "--max-shard-size", "1MB")
    assert code == 2 and not (tmp_path / "s.dcp").exists()
    code, out_text, err = run("convert", fixtures_dir / "single_lenet.pt", "-o", tmp_path / "d.dcp", "--to", "dcp",
                              "--dry-run")
    assert code == 0 and "would write" in out_text and not (tmp_path / "d.dcp").exists()
    many = tmp_path / "many"
    many.mkdir()
    code, _, err = run("convert", fixtures_dir / "single_lenet.pt", fixtures_dir / "mlp.safetensors", "--out-dir",
                       many, "--to", "dcp")
    assert code == 0, err
    assert sorted(p.name for p in many.iterdir()) == ["mlp.dcp", "single_lenet.dcp"]
    assert not list(tmp_path.glob("**/.ckptool-*"))


def test_training_resumes_from_the_dcp_output_as_from_the_file(train, tmp_path: Path) -> None:
    first, from_file, from_dcp = tmp_path / "first.pt", tmp_path / "from_file.pt", tmp_path / "from_dcp.pt"
    args = ["--mode", "single", "--model", "mlp", *SMALL]
    train(*args, "--epochs", "1", "--out", str(first))
    code, _, err = run("convert", first, "-o", tmp_path / "first.dcp", "--to", "dcp")
    assert code == 0, err
    train(*args, "--epochs", "1", "--resume", str(first), "--out", str(from_file))
    train(*args, "--epochs", "1", "--resume", str(tmp_path / "first.dcp"), "--out", str(from_dcp))
    a, b = torch.load(from_file, weights_only=True), torch.load(from_dcp, weights_only=True)
    assert a["epoch"] == b["epoch"] == 2
    assert list(a["model"]) == list(b["model"]) and all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
