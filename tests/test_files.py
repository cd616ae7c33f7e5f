"""File-system safety: inputs stay inside what was named; nothing of the user's is deleted.

Inputs: a folder's files (shards, a folder's one ``.safetensors``, DCP ``.metadata`` and ``.distcp``)
are read only when they are regular files inside the folder, or links into it — or, for a Hugging
Face hub cache snapshot, links into the repo's ``blobs/``. A FIFO never blocks a read.

Outputs: a folder output replaces only ckptool's own files (its shards and index), removing the
shards of an earlier set its old index named, never anything else; several inputs are planned
before anything is written; the suffix of ``-o`` decides the format; ``--fingerprint`` writes its
own field only.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

import ckptool
from ckptool.cli.main import main

TEMP_PREFIX = ".ckptool-tmp-"
SECRET = "s3cr3t-bytes-that-must-never-be-shown"


def invoke(*args: object, **kwargs: object):
    return CliRunner().invoke(main, [str(a) for a in args], **kwargs)


def weights(seed: int = 0, count: int = 6) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {f"layer{i}.weight": torch.rand(64, 64, generator=generator) for i in range(count)}


def sharded(directory: Path, seed: int = 0, count: int = 6, shard_size: str = "40KB") -> Path:
    """A sharded safetensors folder written by ckptool (one 16 KB tensor... per shard, roughly)."""
    source = directory.parent / f"{directory.name}-source.safetensors"
    save_file(weights(seed, count), source)
    result = invoke("convert", source, "-o", directory, "--max-shard-size", shard_size)
    assert result.exit_code == 0, result.output
    source.unlink()
    return directory


def one_line_error(result, code: int = 3) -> str:
    lines = result.stderr.strip().splitlines()
    assert result.exit_code == code and len(lines) == 1 and lines[0].startswith("ckptool: error: "), result.stderr
    return lines[0]


# ------------------------------------------------------------------------------------------------ inputs


def test_a_fifo_shard_is_refused_without_blocking(tmp_path: Path, subprocess_env: dict[str, str]) -> None:
    folder = sharded(tmp_path / "model")
    shard = sorted(folder.glob("model-*.safetensors"))[1]
    shard.unlink()
    os.mkfifo(shard)
    # a blocked open would never return: the timeout only keeps a broken build from hanging the suite
    result = subprocess.run([sys.executable, "-m", "ckptool", "inspect", str(folder)], env=subprocess_env,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 3, result.stderr
    assert shard.name in result.stderr and "FIFO" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_a_shard_linked_outside_the_folder_is_refused(tmp_path: Path) -> None:
    folder = sharded(tmp_path / "model")
    shard = sorted(folder.glob("model-*.safetensors"))[0]
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    outside = elsewhere / shard.name
    shard.rename(outside)
    shard.symlink_to(outside)
    for command in (["inspect", folder], ["inspect", folder / "model.safetensors.index.json"],
                    ["convert", folder, "-o", tmp_path / "out.pt"], ["scan", folder]):
        line = one_line_error(invoke(*command))
        assert shard.name in line and "outside the folder" in line and "copy the file into the folder" in line
    assert not (tmp_path / "out.pt").exists()


def test_a_shard_linked_inside_the_folder_reads(tmp_path: Path) -> None:
    folder = sharded(tmp_path / "model")
    before = ckptool.fingerprint(ckptool.load(folder).tensors)
    shard = sorted(folder.glob("model-*.safetensors"))[0]
    (folder / "store").mkdir()
    shard.rename(folder / "store" / shard.name)
    shard.symlink_to(Path("store") / shard.name)
    assert ckptool.fingerprint(ckptool.load(folder).tensors) == before


def test_a_folder_whose_only_safetensors_links_outside_is_refused(tmp_path: Path) -> None:
    outside = tmp_path / "outside.safetensors"
    save_file(weights(), outside)
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "model.safetensors").symlink_to(outside)
    for command in (["inspect", folder], ["convert", folder, "-o", tmp_path / "out.pt"]):
        line = one_line_error(invoke(*command))
        assert "model.safetensors" in line and "outside the folder" in line
    assert not (tmp_path / "out.pt").exists()
    # a link named on the command line is the user's own choice: it is read
    result = invoke("inspect", folder / "model.safetensors")
    assert result.exit_code == 0, result.output


@pytest.fixture(scope="module")
def dcp_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import torch.distributed.checkpoint as dcp

    directory = tmp_path_factory.mktemp("dcp") / "ckpt"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no process group: DCP warns and saves from this one process
        dcp.save({"model": {"w": torch.arange(12.0).reshape(3, 4), "b": torch.ones(3)}}, checkpoint_id=str(directory))
    return directory


def copy_tree(source: Path, target: Path) -> Path:
    import shutil

    shutil.copytree(source, target)
    return target


def test_dcp_metadata_linked_outside_is_refused_without_reading_it(dcp_checkpoint: Path, tmp_path: Path) -> None:
    directory = copy_tree(dcp_checkpoint, tmp_path / "ckpt")
    secret = tmp_path / "passwd"
    secret.write_text(f"root:x:0:0:{SECRET}:/root:/bin/bash\n")
    (directory / ".metadata").unlink()
    (directory / ".metadata").symlink_to(secret)
    for command in ("inspect", "scan"):
        result = invoke(command, directory)
        line = one_line_error(result)
        assert ".metadata" in line and "outside the folder" in line
        assert SECRET not in result.output and SECRET not in result.stderr


def test_dcp_data_file_linked_inside_the_folder_reads(dcp_checkpoint: Path, tmp_path: Path) -> None:
    directory = copy_tree(dcp_checkpoint, tmp_path / "ckpt")
    expected = ckptool.fingerprint(ckptool.load(directory).tensors)
    (directory / "data").mkdir()
    (directory / "__0_0.distcp").rename(directory / "data" / "__0_0.distcp")
    (directory / "__0_0.distcp").symlink_to(Path("data") / "__0_0.distcp")
    assert ckptool.fingerprint(ckptool.load(directory).tensors) == expected
    result = invoke("convert", directory, "-o", tmp_path / "out.safetensors")
    assert result.exit_code == 0, result.output


def hub_snapshot(cache: Path, files: dict[str, bytes]) -> Path:
    """A hub cache repo as huggingface_hub lays it out: blobs by sha256, snapshot files linking to them."""
    repo = cache / "models--org--name"
    snapshot = repo / "snapshots" / "0123abcd"
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0123abcd")
    for name, data in files.items():
        digest = hashlib.sha256(data).hexdigest()
        (repo / "blobs" / digest).write_bytes(data)
        (snapshot / name).symlink_to(Path("..") / ".." / "blobs" / digest)
    return snapshot


def test_a_hub_cache_snapshot_reads(tmp_path: Path) -> None:
    single = tmp_path / "single.safetensors"
    save_file(weights(), single)
    snapshot = hub_snapshot(tmp_path / "hub1", {"model.safetensors": single.read_bytes(), "config.json": b"{}"})
    expected = ckptool.fingerprint(ckptool.load(single).tensors)
    for path in (snapshot, snapshot / "model.safetensors"):
        assert ckptool.fingerprint(ckptool.load(path).tensors) == expected
        result = invoke("inspect", path)
        assert result.exit_code == 0, result.output


def test_a_sharded_hub_cache_snapshot_reads(tmp_path: Path) -> None:
    folder = sharded(tmp_path / "model")
    expected = ckptool.fingerprint(ckptool.load(folder).tensors)
    snapshot = hub_snapshot(tmp_path / "hub2", {p.name: p.read_bytes() for p in folder.iterdir()})
    for path in (snapshot, snapshot / "model.safetensors.index.json"):
        assert ckptool.fingerprint(ckptool.load(path).tensors) == expected
    result = invoke("convert", snapshot, "-o", tmp_path / "out.pt")
    assert result.exit_code == 0, result.output
    # a snapshot's link that leaves the repo's blobs/ is refused like any other
    shard = sorted(snapshot.glob("model-*.safetensors"))[0]
    outside = tmp_path / "outside.safetensors"
    outside.write_bytes(shard.read_bytes())
    shard.unlink()
    shard.symlink_to(outside)
    line = one_line_error(invoke("inspect", snapshot))
    assert shard.name in line and "outside the folder" in line


# ------------------------------------------------------------------------------------------------ folder outputs

USER_FILES = {"config.json": b'{"model_type": "mine"}', "tokenizer.json": b'{"v": 1}', "README.md": b"# my model\n",
              # named like a shard, but no index of ckptool's names it: the user's, kept
              "model-00001-of-00009.safetensors": b"not ours"}


def model_folder(directory: Path) -> Path:
    """A model folder: the user's files beside an earlier set of 3 shards."""
    sharded(directory, seed=1, count=6, shard_size="40KB")
    assert len(list(directory.glob("model-*-of-00003.safetensors"))) == 3
    for name, data in USER_FILES.items():
        (directory / name).write_bytes(data)
    return directory


def new_weights(tmp_path: Path) -> Path:
    source = tmp_path / "new.safetensors"
    save_file(weights(seed=2, count=4), source)
    return source


def folder_state(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir()) if p.is_file()}


def check_replaced(directory: Path, source: Path) -> None:
    names = sorted(p.name for p in directory.iterdir())
    assert names == sorted([*USER_FILES, "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
                            "model.safetensors.index.json"]), names
    for name, data in USER_FILES.items():
        assert (directory / name).read_bytes() == data
    assert ckptool.fingerprint(ckptool.load(directory).tensors) == ckptool.fingerprint(ckptool.load(source).tensors)
    reloaded = {}
    for shard in directory.glob("model-0000?-of-00002.safetensors"):
        reloaded.update(load_file(shard))
    assert reloaded.keys() == load_file(source).keys()


def test_force_into_a_model_folder_replaces_only_its_own_files(tmp_path: Path) -> None:
    directory = model_folder(tmp_path / "model")
    source = new_weights(tmp_path)
    before = folder_state(directory)
    line = one_line_error(invoke("convert", source, "-o", directory, "--max-shard-size", "40KB"))
    assert "--force" in line and "model.safetensors.index.json" in line
    assert folder_state(directory) == before
    result = invoke("convert", source, "-o", directory, "--max-shard-size", "40KB", "--force")
    assert result.exit_code == 0, result.output
    check_replaced(directory, source)  # the 3 earlier shards are gone, the user's files are not
    assert "removed 3 shard(s) of the earlier set" in result.output
    assert not [p for p in tmp_path.rglob(f"{TEMP_PREFIX}*")]


def test_an_existing_folder_without_a_set_needs_no_force(tmp_path: Path) -> None:
    directory = tmp_path / "model"
    directory.mkdir()
    (directory / "config.json").write_bytes(USER_FILES["config.json"])
    result = invoke("convert", new_weights(tmp_path), "-o", directory, "--max-shard-size", "40KB")
    assert result.exit_code == 0, result.output
    assert (directory / "config.json").read_bytes() == USER_FILES["config.json"]
    assert (directory / "model.safetensors.index.json").is_file()


@pytest.mark.parametrize("spelling", ["absolute", "dot"])
def test_force_into_the_current_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, spelling: str) -> None:
    directory = model_folder(tmp_path / "model")
    source = new_weights(tmp_path)
    monkeypatch.chdir(directory)
    out = str(Path.cwd()) if spelling == "absolute" else "."
    result = invoke("convert", source, "-o", out, "--max-shard-size", "40KB", "--force")
    assert result.exit_code == 0, result.output
    check_replaced(directory, source)
    assert not [p for p in tmp_path.rglob(f"{TEMP_PREFIX}*")]


def test_a_folder_output_never_replaces_its_input(tmp_path: Path) -> None:
    directory = model_folder(tmp_path / "model")
    before = folder_state(directory)
    for command in (["convert", directory, "-o", directory, "--force"],  # the folder itself
                    # one earlier shard as the input: the new set would remove it
                    ["convert", directory / "model-00003-of-00003.safetensors", "-o", directory, "--to", "safetensors",
                     "--max-shard-size", "40KB", "--force"]):
        line = one_line_error(invoke(*command))
        assert "input" in line
    assert folder_state(directory) == before


def test_strip_in_place_of_a_sharded_folder_keeps_the_users_files(tmp_path: Path) -> None:
    directory = tmp_path / "model"
    source = tmp_path / "ddp.safetensors"
    save_file({f"module.{k}": v for k, v in weights(3).items()}, source)
    assert invoke("convert", source, "-o", directory, "--max-shard-size", "40KB").exit_code == 0
    (directory / "config.json").write_bytes(USER_FILES["config.json"])
    result = invoke("strip", directory, "--in-place")
    assert result.exit_code == 0, result.output
    assert (directory / "config.json").read_bytes() == USER_FILES["config.json"]
    assert sorted(ckptool.load(directory).tensors) == sorted(weights(3))
    assert sorted(p.name for p in directory.glob("model-*.safetensors")) == ["model-00001-of-00001.safetensors"]


class FailingRename:
    """A rename that fails the first time it is asked to move something new to ``fail_into``
    (the seam atomic's folder writers take); putting the previous file back there works."""

    def __init__(self, fail_into: Path) -> None:
        self.fail_into = fail_into
        self.calls: list[tuple[Path, Path]] = []
        self.failed = False

    def __call__(self, source: Path, target: Path) -> None:
        self.calls.append((Path(source), Path(target)))
        if Path(target) == self.fail_into and not self.failed:
            self.failed = True
            raise OSError(5, "Input/output error")
        os.replace(source, target)


def test_atomic_directory_puts_the_old_folder_back_when_the_final_rename_fails(tmp_path: Path) -> None:
    from ckptool.files.atomic import atomic_directory
    from ckptool.base.errors import OutputError

    out = tmp_path / "out"
    out.mkdir()
    (out / "old.bin").write_bytes(b"old")
    rename = FailingRename(out)
    with pytest.raises(OutputError):
        with atomic_directory(out, rename=rename) as tmp:
            (tmp / "new.bin").write_bytes(b"new")
    assert rename.calls and rename.calls[-1][1] == out  # the previous folder was moved back last
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    assert (out / "old.bin").read_bytes() == b"old" and not (out / "new.bin").exists()


@pytest.mark.parametrize("fail_at", ["model.safetensors.index.json", "model-00002-of-00002.safetensors"])
def test_a_failed_move_into_a_folder_output_puts_everything_back(tmp_path: Path, fail_at: str) -> None:
    from ckptool.files.atomic import update_directory
    from ckptool.base.errors import OutputError

    directory = model_folder(tmp_path / "model")
    before = folder_state(directory)
    rename = FailingRename(directory / fail_at)
    with pytest.raises(OutputError):
        with update_directory(directory, last="model.safetensors.index.json",
                              remove=["model-00003-of-00003.safetensors"], rename=rename) as staging:
            for name in ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
                         "model.safetensors.index.json"):
                (staging / name).write_bytes(b"new " + name.encode())
    assert folder_state(directory) == before
    assert not [p for p in directory.iterdir() if p.name.startswith(TEMP_PREFIX)]
    # the earlier index was the first file moved aside, so no reader saw it beside new shards
    assert rename.calls[0][0] == directory / "model.safetensors.index.json"


# ------------------------------------------------------------------------------------------------ many inputs


def test_two_inputs_onto_one_output_are_refused_before_anything_is_written(tmp_path: Path) -> None:
    for folder, seed in (("a", 0), ("b", 1)):
        (tmp_path / folder).mkdir()
        torch.save(weights(seed), tmp_path / folder / "model.pt")
    out = tmp_path / "out"
    out.mkdir()
    (out / "model.safetensors").write_bytes(b"earlier")
    result = invoke("convert", tmp_path / "a" / "model.pt", tmp_path / "b" / "model.pt", "--out-dir", out, "--force")
    line = one_line_error(result)
    assert str(tmp_path / "a" / "model.pt") in line and str(tmp_path / "b" / "model.pt") in line
    assert result.stdout == ""
    assert [p.name for p in out.iterdir()] == ["model.safetensors"] and (out / "model.safetensors").read_bytes() == \
        b"earlier"


def test_an_output_that_is_another_input_is_refused_even_with_force(tmp_path: Path) -> None:
    save_file(weights(0), tmp_path / "first.safetensors")
    torch.save(weights(1), tmp_path / "first.pt")
    before = (tmp_path / "first.pt").read_bytes()
    # first.safetensors -> ./first.pt, the second input (which would itself be written there too)
    line = one_line_error(invoke("convert", tmp_path / "first.safetensors", tmp_path / "first.pt", "--out-dir",
                                 tmp_path, "--to", "pt", "--force"))
    assert "both be written" in line
    assert (tmp_path / "first.pt").read_bytes() == before


# ------------------------------------------------------------------------------------------------ -o decides the format


def file_format(path: Path) -> str:
    return ckptool.load(path).format


def test_strip_writes_the_format_its_output_is_named_for(tmp_path: Path) -> None:
    torch.save({f"module.{k}": v for k, v in weights().items()}, tmp_path / "ddp.pt")
    result = invoke("strip", tmp_path / "ddp.pt", "-o", tmp_path / "model.safetensors")
    assert result.exit_code == 0, result.output
    stock = load_file(tmp_path / "model.safetensors")  # the safetensors library reads it: it is safetensors
    assert stock.keys() == weights().keys() and all(torch.equal(stock[k], v) for k, v in weights().items())
    # and back: a .pt name from a safetensors input is a torch zip torch.load reads
    save_file({f"module.{k}": v for k, v in weights().items()}, tmp_path / "ddp.safetensors")
    for command in (["strip", tmp_path / "ddp.safetensors", "-o", tmp_path / "model.pt"],
                    ["add-prefix", tmp_path / "model.safetensors", "-o", tmp_path / "prefixed.pth"]):
        result = invoke(*command)
        assert result.exit_code == 0, result.output
    loaded = torch.load(tmp_path / "model.pt", weights_only=True)
    assert loaded.keys() == weights().keys() and all(torch.equal(loaded[k], v) for k, v in weights().items())
    assert sorted(torch.load(tmp_path / "prefixed.pth", weights_only=True)) == sorted(f"module.{k}" for k in weights())
    # a suffix that names no format keeps the input's
    assert invoke("strip", tmp_path / "ddp.pt", "-o", tmp_path / "model.weights").exit_code == 0
    assert file_format(tmp_path / "model.weights") == "torch-zip"


def test_a_rewrite_refuses_a_safetensors_name_that_would_drop_the_container(tmp_path: Path) -> None:
    torch.save({"model": {f"module.{k}": v for k, v in weights().items()}, "optimizer": {"lr": 0.1}, "epoch": 3},
               tmp_path / "train.pt")
    for command, hint in (("strip", "convert"), ("add-prefix", "convert")):
        line = one_line_error(invoke(command, tmp_path / "train.pt", "-o", tmp_path / "x.safetensors"), code=2)
        assert "'optimizer'" in line and hint in line
    line = one_line_error(invoke("remap", tmp_path / "train.pt", "--to", "cpu", "-o", tmp_path / "x.safetensors"),
                          code=2)
    assert "device tags" in line
    assert not (tmp_path / "x.safetensors").exists()


def test_convert_refuses_a_to_that_contradicts_the_name(tmp_path: Path) -> None:
    save_file(weights(), tmp_path / "w.safetensors")
    line = one_line_error(invoke("convert", tmp_path / "w.safetensors", "-o", tmp_path / "w.pt", "--to", "safetensors"),
                          code=2)
    assert "--to safetensors" in line and "w.pt" in line
    assert not (tmp_path / "w.pt").exists()


# ------------------------------------------------------------------------------------------------ --fingerprint

OLD_PLACEHOLDER = "sha256:" + "0" * 64  # what the fingerprint's field held before the hash was known


def test_fingerprint_goes_to_its_own_field_only(tmp_path: Path) -> None:
    from safetensors import safe_open

    torch.save({"model": weights(), "note": OLD_PLACEHOLDER}, tmp_path / "train.pt")
    save_file(weights(), tmp_path / "w.safetensors", metadata={"mine": OLD_PLACEHOLDER})
    expected = ckptool.fingerprint(ckptool.load(tmp_path / "w.safetensors").tensors)
    for source, out in ((tmp_path / "train.pt", tmp_path / "a.safetensors"),
                        (tmp_path / "w.safetensors", tmp_path / "b.safetensors"),
                        (tmp_path / "w.safetensors", tmp_path / "sharded")):
        extra = ["--max-shard-size", "40KB"] if out.name == "sharded" else []
        result = invoke("convert", source, "-o", out, "--fingerprint", "--json", *extra)
        assert result.exit_code == 0, result.output
        assert json.loads(result.stdout)["converted"][0]["fingerprint"] == expected
        files = sorted(out.glob("*.safetensors")) if out.is_dir() else [out]
        for file in files:
            with safe_open(file, "pt") as handle:
                metadata = handle.metadata()
            assert metadata["ckptool.fingerprint"] == expected
            if source.name == "train.pt":
                assert json.loads(metadata["ckptool.entries"])["container"]["note"] == OLD_PLACEHOLDER
            else:
                assert metadata["mine"] == OLD_PLACEHOLDER
