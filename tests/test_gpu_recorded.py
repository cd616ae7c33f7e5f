"""Checkpoints a real GPU wrote (``fixtures/gpu/``), read on this CPU-only machine against what torch read there.

``scripts/gpu_check.py`` saved them on a CUDA machine (a single-process run, DataParallel, an nccl DDP run, a
Lightning Trainer) and described each with torch on that machine: every tensor's place in the object, saved
location tag, dtype, shape and sha256 (``fixtures/gpu/recorded.json``). Nothing here re-makes them: they are files
ckptool did not write, with expectations ckptool did not compute.
"""

from __future__ import annotations

import collections
import hashlib
import json
import io
import pathlib
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner

import ckptool
from ckptool.cli.main import main

REPO = Path(__file__).resolve().parents[1]
GPU_DIR = REPO / "fixtures" / "gpu"
RECORDED: dict[str, Any] = json.loads((GPU_DIR / "recorded.json").read_text())
NAMES = sorted(RECORDED["files"])
PATH_GLOBALS = [pathlib.PosixPath, pathlib.WindowsPath]  # Lightning's hyper-parameters hold paths


def tensors(name: str) -> list[dict[str, Any]]:
    return RECORDED["files"][name]["tensors"]


def test_the_files_were_saved_on_a_gpu_and_are_the_ones_recorded() -> None:
    assert RECORDED["machine"]["devices"], "recorded.json must come from a CUDA machine"
    assert {"single_lenet.pt", "dp_mlp_wrapped.pt", "ddp_nccl_lenet_wrapped.pt"} == set(TRAINING_RUNS)
    on_disk = {path.name for path in GPU_DIR.iterdir()} - {"recorded.json", "README.md"}
    assert on_disk == set(NAMES)
    for name in NAMES:
        assert hashlib.sha256((GPU_DIR / name).read_bytes()).hexdigest() == RECORDED["files"][name]["sha256"], name
        assert any(entry["location"].startswith("cuda:") for entry in tensors(name)), name


@pytest.mark.parametrize("name", NAMES)
def test_ckptool_reads_every_weight_as_torch_read_it_where_it_was_saved(name: str) -> None:
    checkpoint = ckptool.load(GPU_DIR / name)
    recorded = tensors(name)
    parents = set()
    for key, ref in checkpoint.tensors.items():
        matches = [entry for entry in recorded if entry["path"][-1] == key]
        assert len(matches) == 1, (key, matches)
        entry = matches[0]
        parents.add(tuple(entry["path"][:-1]))
        assert ref.location == entry["location"], key
        assert ref.dtype.torch_name == entry["dtype"], key
        assert list(ref.shape) == entry["shape"], key
        assert hashlib.sha256(bytes(ref.read_bytes())).hexdigest() == entry["sha256"], key
    assert len(parents) == 1, parents  # one state_dict, and all of it
    (parent,) = parents
    assert {entry["path"][-1] for entry in recorded if tuple(entry["path"][:-1]) == parent} == set(checkpoint.tensors)


@pytest.mark.parametrize("name", NAMES)
def test_inspect_counts_the_location_tags_torch_saw(name: str) -> None:
    summary = ckptool.inspect(GPU_DIR / name)
    assert summary.saved_devices == dict(collections.Counter(entry["location"] for entry in tensors(name)))


@pytest.mark.parametrize("name", NAMES)
def test_plain_torch_load_fails_here_and_remap_to_cpu_fixes_every_tensor(name: str, tmp_path: Path,
                                                                         load_script) -> None:
    source = GPU_DIR / name
    if not torch.cuda.is_available():
        with torch.serialization.safe_globals(PATH_GLOBALS), pytest.raises(
                RuntimeError, match=r"Attempting to deserialize object on a CUDA device but torch\.cuda\.is_available"):
            torch.load(source, weights_only=True)
    out = tmp_path / name
    result = CliRunner().invoke(main, ["remap", str(source), "--to", "cpu", "-o", str(out)])
    assert result.exit_code == 0, result.stderr
    expected = [dict(entry, location="cpu") for entry in tensors(name)]
    assert load_script("scripts/gpu_check.py").describe(out) == expected  # torch's own reading: every tensor, every value, now "cpu"
    assert source.read_bytes() != out.read_bytes()


def test_the_gpu_saved_lenet_verifies_on_this_machine() -> None:
    report = ckptool.verify(GPU_DIR / "single_lenet.pt", model_spec="training:lenet")
    assert report.ok, report.failure
    assert [row.device for row in report.devices][0] == "cpu"


# The training runs' files. Not Lightning's: its pickle shares one string between a PosixPath hyper-parameter's parts
# and a tuple, a sharing that no re-pickle of the loaded object can know of (it is not about the tensors).
TRAINING_RUNS = [name for name in NAMES if RECORDED["files"][name]["made_by"].startswith(("python -m training",
                                                                                          "torchrun"))]


@pytest.mark.parametrize("name", TRAINING_RUNS)
def test_a_tagged_save_from_the_cpu_reproduces_the_gpu_file_byte_for_byte(name: str, load_script) -> None:
    """What the CPU-only suite stands on (fixtures/gpu_cuda*.pt are made so): torch.save from the CPU, with
    make_fixtures' tagger naming each storage's location, writes the very file the GPU machine wrote, down to the
    pickle's memo of the tag strings (its torch, 2.11, older than the one here)."""
    tagger = load_script("fixtures/make_fixtures.py").saved_locations
    obj, saved = load_script("scripts/gpu_check.py").load_keeping_tags(GPU_DIR / name)
    tags = {pointer: "cpu" if location == "cpu" else "cuda:0" for pointer, location in saved.items()}  # constants:
    assert set(tags.values()) == {"cpu", "cuda:0"}  # the tagger must hand over a string of its own per storage
    buffer = io.BytesIO()  # the runs saved through a file object too: the archive's folder is "archive"
    with tagger(lambda storage: tags[storage.data_ptr()]):
        torch.save(obj, buffer)
    assert buffer.getvalue() == (GPU_DIR / name).read_bytes()


@pytest.mark.parametrize("name", NAMES)
def test_every_command_passes_the_realworld_checks_on_the_gpu_file(name: str, tmp_path: Path, load_script) -> None:
    """`make realworld`'s checks (inspect, scan, add-prefix, strip, remap, convert both ways, verify --against,
    diff, each against torch's reading) on each GPU-saved file, offline."""
    realworld = load_script("scripts/realworld.py")
    layout = ["state_dict"] if name.endswith(".ckpt") else ["model"]
    prefix = "module." if "wrapped" in name else "model." if name.endswith(".ckpt") else ""
    path = GPU_DIR / name
    real = realworld.RealFile(f"gpu-{name}", "(recorded)", "-", "-", name, RECORDED["files"][name]["sha256"],
                              path.stat().st_size, "saved on a GPU", layout, prefix)
    outcomes = realworld.check_file(real, path, tmp_path)
    assert [o for o in outcomes if not o.passed] == []
    assert {o.command for o in outcomes} == {"torch-reference", "inspect", "inspect --json", "scan", "add-prefix",
                                             "strip", "remap --to cpu", "convert .safetensors", "convert .pt",
                                             "verify --against", "diff"}
