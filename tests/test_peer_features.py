"""--dry-run on every write; convert's --drop, --rename and --weights-only, checked against torch's reading."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from ckptool.cli.main import main


def run(*args: object) -> tuple[int, str, str]:
    result = CliRunner().invoke(main, [str(a) for a in args])
    return result.exit_code, result.stdout, result.stderr


def listing(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


@pytest.mark.parametrize("args", [
    ("strip", "ddp_lenet_wrapped.pt", "-o", "{out}/s.pt"),
    ("add-prefix", "single_lenet.pt", "-o", "{out}/a.pt"),
    ("remap", "gpu_cuda1_ddp_lenet.pt", "-o", "{out}/r.pt", "--to", "cpu"),
    ("convert", "ddp_lenet_wrapped.pt", "-o", "{out}/c.safetensors", "--strip"),
    ("convert", "ddp_lenet_wrapped.pt", "-o", "{out}/shards", "--max-shard-size", "100KB"),
])
def test_dry_run_writes_nothing_and_says_what_would_be(fixtures_dir: Path, tmp_path: Path,
                                                       args: tuple[str, ...]) -> None:
    out = tmp_path / "out"
    out.mkdir()
    argv = [str(fixtures_dir / a) if a.endswith((".pt",)) and "{" not in a else a.format(out=out) for a in args]
    code, stdout, err = run(*argv, "--dry-run", "--json")
    assert code == 0, err
    assert listing(out) == [] and not list(tmp_path.glob("**/*.tmp*"))
    data = json.loads(stdout)
    report = data["converted"][0] if args[0] == "convert" else data
    assert report["dry_run"] is True and report["checked"] == 0 and report["tensors"] > 0
    # the real run writes exactly the files the dry run named
    code, _, err = run(*argv)
    assert code == 0, err
    assert sorted(report["files"]) == sorted(str(p) for p in out.rglob("*") if p.is_file())
    code, _, err = run(*argv, "--dry-run")
    assert code == 3 and ("exists" in err or "already holds" in err)  # an existing output is refused as the real run refuses it


def test_dry_run_makes_the_real_runs_refusals(fixtures_dir: Path, tmp_path: Path) -> None:
    taken = tmp_path / "taken.pt"
    taken.write_bytes(b"mine")
    code, _, err = run("strip", fixtures_dir / "ddp_lenet_wrapped.pt", "-o", taken, "--dry-run")
    assert code == 3 and "already exists" in err and taken.read_bytes() == b"mine"
    code, _, err = run("strip", fixtures_dir / "single_lenet.pt", "-o", tmp_path / "n.pt", "--dry-run")
    assert code == 1 and "nothing to strip" in err
    code, out, _ = run("convert", fixtures_dir / "single_lenet.pt", "-o", tmp_path / "x.safetensors", "--dry-run")
    assert out.startswith("dry run, nothing written: ") and f"would write {tmp_path / 'x.safetensors'}" in out
    assert not (tmp_path / "x.safetensors").exists()


def test_drop_rename_and_weights_only_against_torch(fixtures_dir: Path, tmp_path: Path) -> None:
    source = fixtures_dir / "ddp_lenet_wrapped.pt"
    original = torch.load(source, weights_only=True)
    out = tmp_path / "published.pt"
    code, stdout, err = run("convert", source, "-o", out, "--strip", "--drop", "fc2.*", "--drop", "optimizer",
                            "--rename", r"^conv(\d)\.=features.\1.", "--json")
    assert code == 0, err
    notes = json.loads(stdout)["converted"][0]["notes"]
    assert "renamed 4 keys" in notes and "dropped entries: optimizer" in notes
    written = torch.load(out, weights_only=True)
    assert "optimizer" not in written and written["epoch"] == original["epoch"]
    expected = {}
    for key, value in original["model"].items():
        key = key.removeprefix("module.")
        if key.startswith("fc2."):
            continue
        for number in "12":
            key = key.replace(f"conv{number}.", f"features.{number}.", 1) if key.startswith("conv") else key
        expected[key] = value
    assert list(written["model"]) == list(expected)
    assert all(torch.equal(written["model"][k], v) for k, v in expected.items())

    bare = tmp_path / "bare.pt"
    code, _, err = run("convert", source, "-o", bare, "--weights-only")
    assert code == 0, err
    alone = torch.load(bare, weights_only=True)
    assert list(alone) == list(original["model"]) and all(torch.equal(alone[k], v) for k, v in original["model"].items())
    # a safetensors output of --weights-only carries no container in its metadata
    st = tmp_path / "bare.safetensors"
    code, _, err = run("convert", source, "-o", st, "--weights-only")
    from safetensors import safe_open

    with safe_open(str(st), "pt") as reader:
        assert "ckptool.entries" not in (reader.metadata() or {})


def test_drop_and_rename_refuse_what_would_be_a_mistake(fixtures_dir: Path, tmp_path: Path) -> None:
    source = fixtures_dir / "lightning_mlp.ckpt"
    cases = {
        ("--drop", "nothing*"): (2, "no weight key or entry matches"),
        ("--drop", "state_*"): (2, "holds the weights"),
        ("--rename", "zzz=y"): (2, "change no weight key"),
        ("--rename", "(=y"): (2, "not a regular expression"),
        ("--rename", "no-equals-sign"): (2, "PATTERN=REPLACEMENT"),
        ("--rename", r"^model\.(.*)=\2"): (2, "rename"),
        ("--rename", "^model\\.[^.]*=x"): (3, "maps both"),
    }
    for extra, (code, message) in cases.items():
        exit_code, _, err = run("convert", source, "-o", tmp_path / "x.pt", *extra)
        assert exit_code == code and message in err and err.count("\n") == 1, (extra, err)
        assert not (tmp_path / "x.pt").exists()
    assert os.listdir(tmp_path) == []
    shutil.rmtree(tmp_path)


def test_a_trailing_slash_asks_for_a_folder(fixtures_dir: Path, tmp_path: Path) -> None:
    """`-o out/ --to safetensors` writes a folder of shards (as `-o out/` does), never a file named `out`."""
    code, _, err = run("convert", fixtures_dir / "single_lenet.pt", "-o", f"{tmp_path / 'out'}/", "--to", "safetensors")
    assert code == 0, err
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["model-00001-of-00001.safetensors",
                                                                  "model.safetensors.index.json"]
    code, _, err = run("diff", tmp_path / "out", fixtures_dir / "single_lenet.pt")
    assert code == 0, err
