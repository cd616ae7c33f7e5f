"""The reader against the fixtures' ground truth (fixtures/manifest.json, computed with torch)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

import ckptool
from ckptool.ops.inspect import summarize

MANIFEST = json.loads((Path(__file__).resolve().parent.parent / "fixtures" / "manifest.json").read_text())
ENTRIES = MANIFEST["fixtures"] if isinstance(MANIFEST, dict) else MANIFEST
CHECKPOINTS = [e for e in ENTRIES if e["format"] != "torchscript"]


@pytest.mark.parametrize("entry", CHECKPOINTS, ids=lambda e: e["file"])
def test_fixture_described_truly(entry: dict, fixtures_dir: Path) -> None:
    checkpoint = ckptool.load(fixtures_dir / entry["file"])
    summary = summarize(checkpoint, with_fingerprint=True)
    assert summary.format == entry["format"]
    assert summary.layout == entry["layout"]
    assert summary.prefix == entry["prefix"]
    assert summary.tensors == entry["tensors"]
    assert summary.parameters == entry["parameters"]
    assert summary.bytes == entry["bytes"]
    assert summary.dtypes == entry["dtypes"]
    assert summary.saved_devices == entry["saved_devices"]
    assert summary.tied == entry["tied"]
    assert sorted(summary.entries) == entry["entries"]
    assert summary.fingerprint == entry["fingerprint"]


def test_torchscript_gives_its_state_dict(fixtures_dir: Path) -> None:
    import warnings

    checkpoint = ckptool.load(fixtures_dir / "torchscript_mlp.pt")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.jit.load is deprecated, still what reads such archives
        reference = torch.jit.load(str(fixtures_dir / "torchscript_mlp.pt")).state_dict()
    assert checkpoint.format == "torchscript" and list(checkpoint.tensors) == list(reference)
    for name, tensor in reference.items():
        assert checkpoint.tensors[name].read_bytes() == tensor.contiguous().view(-1).view(torch.uint8).numpy().tobytes()


def test_inspect_imports_no_torch(fixtures_dir: Path) -> None:
    import subprocess

    code = ("import sys, ckptool; ckptool.inspect(sys.argv[1]); ckptool.scan(sys.argv[1]); "
            "assert 'torch' not in sys.modules, 'torch was imported'")
    subprocess.run([sys.executable, "-c", code, str(fixtures_dir / "ddp_lenet_wrapped.pt")], check=True)


def test_tensor_bytes_match_torch(tmp_path: Path) -> None:
    path = tmp_path / "views.pt"
    base = torch.arange(24, dtype=torch.float32)
    state = {"q": base[0:8], "k": base[8:16].view(2, 4), "t": base.view(4, 6).t(), "bf": torch.ones(3, dtype=torch.bfloat16),
             "u16": torch.arange(5).to(torch.uint16), "scalar": torch.tensor(3.5), "empty": torch.zeros(0, 4)}
    torch.save(state, path)
    tensors = ckptool.load(path).tensors
    for name, tensor in state.items():
        expected = tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        assert tensors[name].read_bytes() == expected, name
        assert list(tensors[name].shape) == list(tensor.shape)
    assert tensors["q"].storage is tensors["t"].storage


def test_legacy_and_zip_agree(tmp_path: Path) -> None:
    state = torch.nn.Linear(3, 2).state_dict()
    torch.save(state, tmp_path / "zip.pt")
    torch.save(state, tmp_path / "legacy.pt", _use_new_zipfile_serialization=False)
    zip_ckpt, legacy_ckpt = ckptool.load(tmp_path / "zip.pt"), ckptool.load(tmp_path / "legacy.pt")
    assert (zip_ckpt.format, legacy_ckpt.format) == ("torch-zip", "torch-legacy")
    assert ckptool.fingerprint(zip_ckpt.tensors) == ckptool.fingerprint(legacy_ckpt.tensors)


def test_unsafe_global_refused_naming_flag(tmp_path: Path) -> None:
    import argparse
    import fractions

    path = tmp_path / "custom.pt"
    torch.save({"model": {"w": torch.ones(2)}, "ratio": fractions.Fraction(1, 3)}, path)
    with pytest.raises(ckptool.UnsafeCheckpointError, match=r"fractions\.Fraction.*allow_globals=\['fractions\.Fraction'\]"):
        ckptool.load(path)
    checkpoint = ckptool.load(path, allow_globals=("fractions.Fraction",))
    assert list(checkpoint.tensors) == ["w"]
    # argparse.Namespace is allowed by default (training scripts save their args)
    torch.save({"model": {"w": torch.ones(2)}, "args": argparse.Namespace(lr=0.1)}, tmp_path / "args.pt")
    assert ckptool.load(tmp_path / "args.pt").layout == ("model",)


def test_missing_and_empty_inputs(tmp_path: Path) -> None:
    with pytest.raises(ckptool.InputError, match="does not exist"):
        ckptool.load(tmp_path / "nope.pt")
    (tmp_path / "empty.pt").write_bytes(b"")
    with pytest.raises(ckptool.InputError, match="empty"):
        ckptool.load(tmp_path / "empty.pt")


def test_persistent_id_outside_a_checkpoint_is_refused(tmp_path: Path) -> None:
    """A bare pickle with a persistent id (BINPERSID) names data no file holds: refused, as torch's
    weights_only loader refuses it, with the reason."""
    path = tmp_path / "persid.pkl"
    path.write_bytes(b"\x80\x02X\x03\x00\x00\x00abcQ.")
    with pytest.raises(ckptool.InputError, match="persistent id"):
        ckptool.load(path)
    with pytest.raises(Exception):  # torch refuses it too (no persistent_load outside its archives)
        torch.load(path, weights_only=True)


def test_tensor_values_walk_as_iter_tensors(fixtures_dir: Path) -> None:
    """tree.tensor_values (the fast walk that counts storages and devices) yields exactly the tensors
    iter_tensors yields, in its order: on every fixture's container and on a tree that shares
    containers, nests tuples and lists, and holds a cycle."""
    from ckptool.tensors.refs import StorageRef, TensorRef
    from ckptool.model.tree import iter_tensors, tensor_values

    containers = [ckptool.load(fixtures_dir / entry["file"]).container for entry in CHECKPOINTS]
    storage = StorageRef("0", ckptool.tensors.dtypes.BY_NAME["F32"], 16, "cpu")
    t = [TensorRef(storage, storage.dtype, (2,), (1,), offset=2 * i) for i in range(6)]
    shared = {"x": t[1], "y": [t[2], (t[3], [])]}
    cycle: list = [t[4]]
    cycle.append(cycle)
    containers.append({"a": t[0], "s": shared, "again": shared, "l": [[], {}, "text", 3, t[1], cycle],
                       "t": (t[5], t[0]), "n": None})
    # dicts of tensors only (taken at once), one tied within, one seen before, one holding the same dict twice
    tensors_only = {"p": t[0], "q": t[1], "r": t[1], "s": t[2]}
    containers.append({"a": t[2], "sd": tensors_only, "more": [tensors_only, {"z": t[3], "w": t[2]}], "b": t[4]})
    containers.append(tensors_only)
    assert len(containers) > 10
    for container in containers:
        assert [id(v) for v in tensor_values(container)] == [id(v) for _, v in iter_tensors(container)]


GC_PROBE = """
import contextlib, gc, io, sys
import ckptool
from ckptool.cli.main import main
before = gc.get_freeze_count()  # a site hook or another package may freeze at start-up: only the read's share counts
if sys.argv[2] == "cli":
    with contextlib.redirect_stdout(io.StringIO()):
        main(["inspect", sys.argv[1]], standalone_mode=False)
else:
    ckptool.inspect(sys.argv[1])
print(gc.get_freeze_count() - before)
"""


def test_only_a_command_hands_what_a_read_built_to_the_collectors_permanent_generation(fixtures_dir: Path) -> None:
    """A library caller's objects stay collectable (frozen cycles would never be freed); a command, which keeps
    its checkpoint to the end, freezes them as the collector resumes so it never scans them again."""
    import subprocess

    def frozen(mode: str) -> int:
        run = subprocess.run([sys.executable, "-c", GC_PROBE, str(fixtures_dir / "single_lenet.pt"), mode],
                             capture_output=True, text=True, check=True)
        return int(run.stdout)

    assert frozen("library") == 0
    assert frozen("cli") > 1000  # the modules imported and the records read, at least
