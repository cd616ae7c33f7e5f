"""Sharded .bin repositories (``pytorch_model.bin.index.json`` + ``pytorch_model-0000N-of-0000M.bin``):
read like sharded safetensors in every command, each shard through the restricted unpickler and the
folder's bounds, the weight_map deciding which tensor comes from which shard."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

import ckptool
from ckptool.cli.main import main
from ckptool.ops.load_into import to_state_dict

INDEX = "pytorch_model.bin.index.json"


def _shards() -> list[dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    embed = torch.randn(8, 4)
    return [
        {"model.embed_tokens.weight": embed, "model.layers.0.self_attn.q_proj.weight": torch.randn(4, 4),
         "model.layers.0.input_layernorm.weight": torch.ones(4, dtype=torch.bfloat16)},
        {"model.layers.1.self_attn.q_proj.weight": torch.randn(4, 4).t(),  # a view, saved as one
         "model.layers.1.mlp.down_proj.weight": torch.randn(2, 4, dtype=torch.float16),
         "model.position_ids": torch.arange(6, dtype=torch.int64)},
        {"lm_head.weight": torch.randn(8, 4), "model.norm.weight": torch.full((4,), 2.0)},
    ]


def write_repo(folder: Path, *, legacy: tuple[int, ...] = (1,), index_name: str = INDEX) -> Path:
    """A transformers-style sharded .bin checkpoint: shard 2 (by default) in the legacy stream format."""
    folder.mkdir(parents=True, exist_ok=True)
    shards = _shards()
    weight_map = {}
    for number, state_dict in enumerate(shards):
        name = f"pytorch_model-{number + 1:05d}-of-{len(shards):05d}.bin"
        torch.save(state_dict, folder / name, _use_new_zipfile_serialization=number not in legacy)
        weight_map.update({key: name for key in state_dict})
    total = sum(t.numel() * t.element_size() for shard in shards for t in shard.values())
    (folder / index_name).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))
    return folder


def merged(folder: Path) -> dict[str, torch.Tensor]:
    """What the shards hold, read by torch itself and merged in sorted shard order (as transformers loads them)."""
    weight_map = json.loads((folder / INDEX).read_text())["weight_map"]
    state_dict: dict[str, torch.Tensor] = {}
    for shard in sorted(set(weight_map.values())):
        state_dict.update(torch.load(folder / shard, weights_only=True, map_location="cpu"))
    return state_dict


def same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], *, ordered: bool = True) -> None:
    assert (list(got) == list(want)) if ordered else (sorted(got) == sorted(want))
    for key, tensor in want.items():
        assert got[key].dtype == tensor.dtype and got[key].shape == tensor.shape, key
        assert torch.equal(got[key], tensor), key


def cli(*args: object) -> tuple[int, str, str]:
    result = CliRunner().invoke(main, [str(a) for a in args])
    return result.exit_code, result.stdout, result.stderr


@pytest.mark.parametrize("legacy", [(), (1,), (0, 1, 2)], ids=["zip", "mixed", "legacy"])
def test_folder_and_index_read_as_torch_reads_the_shards(tmp_path: Path, legacy: tuple[int, ...]) -> None:
    folder = write_repo(tmp_path / "repo", legacy=legacy)
    want = merged(folder)
    for source in (folder, folder / INDEX):
        checkpoint = ckptool.load(source)
        assert checkpoint.format == "torch-sharded"
        assert [path.name for path in checkpoint.files] == sorted({p.name for p in folder.glob("*.bin")})
        same(to_state_dict(checkpoint.tensors), want)


def test_inspect_names_the_format(tmp_path: Path) -> None:
    folder = write_repo(tmp_path / "repo")
    code, out, err = cli("inspect", folder)
    assert code == 0 and "torch-sharded" in out and err == ""
    summary = ckptool.inspect(folder)
    assert summary.tensors == 8 and summary.saved_devices == {"cpu": 8}


def test_an_index_under_another_name_is_read_for_what_it_names(tmp_path: Path) -> None:
    # a .bin index not named *.bin.index.json used to be refused: "not a file beside it"
    folder = write_repo(tmp_path / "repo")
    (folder / INDEX).rename(folder / "weights.index.json")
    checkpoint = ckptool.load(folder / "weights.index.json")
    assert checkpoint.format == "torch-sharded" and len(checkpoint.tensors) == 8


def test_convert_to_safetensors_single_sharded_and_pt(tmp_path: Path) -> None:
    folder = write_repo(tmp_path / "repo")
    want = merged(folder)
    assert cli("convert", folder, "-o", tmp_path / "one.safetensors")[0] == 0
    same(load_file(tmp_path / "one.safetensors"), want, ordered=False)
    assert cli("convert", folder / INDEX, "-o", tmp_path / "sharded", "--max-shard-size", "100B")[0] == 0
    index = json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    written: dict[str, torch.Tensor] = {}
    for shard in set(index["weight_map"].values()):
        written.update(load_file(tmp_path / "sharded" / shard))
    same(written, want, ordered=False)
    code, out, _ = cli("convert", folder, "-o", tmp_path / "all.pt")
    assert code == 0
    same(torch.load(tmp_path / "all.pt", weights_only=True), want)


def test_diff_and_verify_accept_it(tmp_path: Path) -> None:
    folder = write_repo(tmp_path / "repo")
    assert cli("convert", folder, "-o", tmp_path / "one.safetensors")[0] == 0
    code, out, _ = cli("diff", folder, tmp_path / "one.safetensors")
    assert code == 0 and "identical" in out
    assert cli("verify", folder, "--against", tmp_path / "one.safetensors")[0] == 0


def test_scan_reads_every_shard_s_pickles(tmp_path: Path) -> None:
    folder = write_repo(tmp_path / "repo")
    report = ckptool.scan(folder)
    assert report.safe and report.format == "torch-sharded"
    assert {label.split(":")[0] for label in report.pickles} == {p.name for p in folder.glob("*.bin")}


def test_the_weight_map_decides(tmp_path: Path) -> None:
    folder = write_repo(tmp_path / "repo")
    first = folder / "pytorch_model-00001-of-00003.bin"
    torch.save({**torch.load(first, weights_only=True), "stray.weight": torch.zeros(2)}, first)
    checkpoint = ckptool.load(folder)
    assert "stray.weight" not in checkpoint.tensors
    assert any("stray.weight" in note and "left out" in note for note in checkpoint.notes)


def test_a_folder_with_safetensors_too_is_read_through_them(tmp_path: Path) -> None:
    folder = write_repo(tmp_path / "repo")
    save_file({"only": torch.ones(2)}, folder / "model.safetensors")
    assert ckptool.load(folder).format == "safetensors"  # as transformers prefers them


def test_a_hub_cache_snapshot_reads_its_blobs(tmp_path: Path) -> None:
    source = write_repo(tmp_path / "source")
    repo = tmp_path / "models--org--model"
    blobs, snapshot = repo / "blobs", repo / "snapshots" / "abc123"
    blobs.mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for number, path in enumerate(sorted(source.iterdir())):
        shutil.copy(path, blobs / f"blob{number}")
        (snapshot / path.name).symlink_to(Path("..", "..", "blobs", f"blob{number}"))
    same(to_state_dict(ckptool.load(snapshot).tensors), merged(source))


def _refused(source: Path, match: str, out: Path) -> None:
    for args in (["inspect", source], ["scan", source], ["convert", source, "-o", out]):
        code, _, err = cli(*args)
        assert code == 3 and err.count("\n") == 1 and match in err and "Traceback" not in err, (args, err)
    assert not out.exists()


def test_an_index_naming_a_shard_outside_the_folder_is_refused(tmp_path: Path) -> None:
    folder = write_repo(tmp_path / "repo")
    (tmp_path / "elsewhere.bin").write_bytes((folder / "pytorch_model-00001-of-00003.bin").read_bytes())
    index = json.loads((folder / INDEX).read_text())
    index["weight_map"] = {key: ("../elsewhere.bin" if shard.startswith("pytorch_model-00001") else shard)
                           for key, shard in index["weight_map"].items()}
    (folder / INDEX).write_text(json.dumps(index))
    _refused(folder, "'../elsewhere.bin', which is not a file name in the index's folder", tmp_path / "o.safetensors")


def test_a_missing_shard_is_refused(tmp_path: Path) -> None:
    folder = write_repo(tmp_path / "repo")
    (folder / "pytorch_model-00002-of-00003.bin").unlink()
    _refused(folder, "shard pytorch_model-00002-of-00003.bin named by the index is missing", tmp_path / "o.safetensors")


def test_a_tensor_absent_from_its_shard_is_refused(tmp_path: Path) -> None:
    folder = write_repo(tmp_path / "repo")
    index = json.loads((folder / INDEX).read_text())
    index["weight_map"]["model.layers.9.w"] = "pytorch_model-00003-of-00003.bin"
    (folder / INDEX).write_text(json.dumps(index))
    _refused(folder, "does not hold them (e.g. 'model.layers.9.w')", tmp_path / "o.safetensors")


def test_a_shard_linked_outside_is_refused(tmp_path: Path) -> None:
    folder = write_repo(tmp_path / "repo")
    shard = folder / "pytorch_model-00003-of-00003.bin"
    shard.rename(tmp_path / "outside.bin")
    shard.symlink_to(tmp_path / "outside.bin")
    _refused(folder, "is a link to", tmp_path / "o.safetensors")


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
def test_a_fifo_shard_is_refused_without_waiting(tmp_path: Path) -> None:
    folder = write_repo(tmp_path / "repo")
    shard = folder / "pytorch_model-00003-of-00003.bin"
    shard.unlink()
    os.mkfifo(shard)
    _refused(folder, "is a FIFO, not a regular file", tmp_path / "o.safetensors")


def test_a_shard_that_is_not_a_torch_file_is_refused(tmp_path: Path) -> None:
    folder = write_repo(tmp_path / "repo")
    save_file({"x": torch.ones(1)}, folder / "pytorch_model-00003-of-00003.bin")
    _refused(folder, "is not a torch.save file", tmp_path / "o.safetensors")


def test_in_place_is_refused_and_the_repository_kept(tmp_path: Path) -> None:
    folder = tmp_path / "repo"
    write_repo(folder)
    before = {path.name: path.read_bytes() for path in folder.iterdir()}
    for source in (folder, folder / INDEX):
        code, _, err = cli("add-prefix", source, "--in-place")
        assert code == 2 and "would replace its index and leave its shards behind" in err and err.count("\n") == 1
    assert {path.name: path.read_bytes() for path in folder.iterdir()} == before
    code, out, _ = cli("add-prefix", folder, "-o", tmp_path / "prefixed.pt")  # a rewrite beside it: one .pt
    assert code == 0 and "one .pt file" in out
    same(torch.load(tmp_path / "prefixed.pt", weights_only=True),
         {"module." + key: tensor for key, tensor in merged(folder).items()})
