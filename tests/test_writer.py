"""Rewrites and conversions: what is written loads in torch, and the weights are unchanged."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import ckptool
from ckptool.base.errors import NothingToDoError, OutputError
from ckptool.io.writer import save

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from training.models import build_model  # noqa: E402

MANIFEST = json.loads((REPO / "fixtures" / "manifest.json").read_text())
ENTRIES = MANIFEST["fixtures"] if isinstance(MANIFEST, dict) else MANIFEST
CHECKPOINTS = [e for e in ENTRIES if e["format"] != "torchscript"]
WRAPPED = [e for e in CHECKPOINTS if e["prefix"] and e["model"] in ("lenet", "mlp")]


def _torch_weights(path: Path, layout: list) -> dict:
    obj = torch.load(path, weights_only=True, map_location="cpu")
    for key in layout:
        obj = obj[key]
    return obj


@pytest.mark.parametrize("entry", WRAPPED, ids=lambda e: e["file"])
def test_strip_loads_strictly_into_bare_model(entry: dict, fixtures_dir: Path, tmp_path: Path) -> None:
    source = fixtures_dir / entry["file"]
    out = tmp_path / "stripped.pt"
    save(ckptool.load(source).strip_prefix(), out)
    stripped = _torch_weights(out, entry["layout"])
    original = _torch_weights(source, entry["layout"])
    model = build_model(entry["model"])
    model.load_state_dict(stripped, strict=True)
    for key, value in original.items():
        assert torch.equal(stripped[key[len(entry["prefix"]):]], value)
    # the rest of the container is kept
    full = torch.load(out, weights_only=True, map_location="cpu")
    if entry["layout"]:
        assert sorted(k for k in full if k != entry["layout"][0]) == entry["entries"]


def test_add_prefix_round_trips(fixtures_dir: Path, tmp_path: Path) -> None:
    source = ckptool.load(fixtures_dir / "single_lenet.pt")
    save(source.add_prefix("module."), tmp_path / "ddp.pt")
    wrapped = ckptool.load(tmp_path / "ddp.pt")
    assert wrapped.prefix == "module."
    save(wrapped.strip_prefix(), tmp_path / "back.pt")
    assert ckptool.fingerprint(ckptool.load(tmp_path / "back.pt").tensors) == ckptool.fingerprint(source.tensors)
    ddp_like = torch.nn.DataParallel(build_model("lenet"))
    ddp_like.load_state_dict(_torch_weights(tmp_path / "ddp.pt", ["model"]), strict=True)


def test_strip_without_prefix_is_nothing_to_do(fixtures_dir: Path) -> None:
    with pytest.raises(NothingToDoError):
        ckptool.load(fixtures_dir / "single_lenet.pt").strip_prefix()


def test_remap_cuda_to_cpu_loads_with_plain_torch_load(fixtures_dir: Path, tmp_path: Path) -> None:
    from ckptool.model.devices import location_mapper

    source = fixtures_dir / "gpu_cuda1_ddp_lenet.pt"
    if torch.cuda.device_count() < 2:  # a machine with a second GPU loads it as saved
        with pytest.raises(RuntimeError, match="CUDA"):
            torch.load(source, weights_only=True)
    save(ckptool.load(source).remap(location_mapper(to="cpu")), tmp_path / "cpu.pt")
    loaded = torch.load(tmp_path / "cpu.pt", weights_only=True)
    assert all(t.device.type == "cpu" for t in loaded["model"].values())
    save(ckptool.load(source).remap(location_mapper(mapping=["cuda:1=cuda:0"])), tmp_path / "cuda0.pt")
    assert set(ckptool.load(tmp_path / "cuda0.pt").saved_devices()) <= {"cpu", "cuda:0"}
    assert "cuda:0" in ckptool.load(tmp_path / "cuda0.pt").saved_devices()


@pytest.mark.parametrize("entry", CHECKPOINTS, ids=lambda e: e["file"])
def test_convert_round_trip_keeps_fingerprint(entry: dict, fixtures_dir: Path, tmp_path: Path) -> None:
    source = ckptool.load(fixtures_dir / entry["file"])
    st = save(source, tmp_path / "w.safetensors", fingerprint=True)
    assert st.fingerprint == entry["fingerprint"]
    back = save(ckptool.load(tmp_path / "w.safetensors"), tmp_path / "w.pt", fingerprint=True)
    assert back.fingerprint == entry["fingerprint"]
    reloaded = torch.load(tmp_path / "w.pt", weights_only=True)
    for key in source.layout:  # the container comes back around the weights (ckptool.entries)
        reloaded = reloaded[key]
    stock = load_file(tmp_path / "w.safetensors")
    aliases = set(st.aliases)
    for key, value in reloaded.items():
        if key not in aliases:
            assert torch.equal(stock[key], value), key
    # tied tensors (one storage, the same view) come back tied in torch; views of one storage
    # that differ (q/k/v slices of a fused weight) are stored as separate tensors
    tensors = source.tensors
    for group in entry["tied"]:
        views = {(tensors[k].offset, tensors[k].shape, tensors[k].stride) for k in group}
        pointers = {reloaded[k].untyped_storage().data_ptr() for k in group}
        assert len(pointers) == (1 if len(views) == 1 else len(group)), group


def test_tied_weights_stored_once_and_retied(fixtures_dir: Path, tmp_path: Path) -> None:
    report = save(ckptool.load(fixtures_dir / "tied_lm.pt"), tmp_path / "tied.safetensors")
    assert len(report.aliases) == 1
    retied = ckptool.load(tmp_path / "tied.safetensors").tensors
    first, second = sorted(retied)
    assert retied[first].storage is retied[second].storage
    duplicated = save(ckptool.load(fixtures_dir / "tied_lm.pt"), tmp_path / "dup.safetensors", duplicate_tied=True)
    assert duplicated.aliases == {}
    assert set(load_file(tmp_path / "dup.safetensors")) == set(retied)


def test_sharded_output_matches_index_layout(fixtures_dir: Path, tmp_path: Path) -> None:
    source = ckptool.load(fixtures_dir / "single_lenet.pt")
    out = tmp_path / "shards"
    report = save(source, out, max_shard_size=100_000, fingerprint=True)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(p.name for p in out.glob("*.safetensors"))
    assert len(shards) > 1 and set(index["weight_map"].values()) == set(shards)
    assert shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    assert index["metadata"]["total_size"] == sum(t.nbytes for t in source.tensors.values())
    merged = {}
    for shard in shards:
        merged.update(load_file(out / shard))
    assert set(merged) == set(index["weight_map"])
    assert ckptool.fingerprint(ckptool.load(out).tensors) == report.fingerprint == ckptool.fingerprint(source.tensors)
    assert index["metadata"]["ckptool.fingerprint"] == report.fingerprint
    assert ckptool.fingerprint(ckptool.load(out / "model.safetensors.index.json").tensors) == report.fingerprint


def test_dtype_cast_touches_floats_only(fixtures_dir: Path, tmp_path: Path) -> None:
    from ckptool.model.cast import cast_weights

    source = ckptool.load(fixtures_dir / "views.pt")
    save(cast_weights(source, "bf16"), tmp_path / "bf16.safetensors")
    cast = load_file(tmp_path / "bf16.safetensors")
    original = _torch_weights(fixtures_dir / "views.pt", [])
    for key, value in original.items():
        if value.is_floating_point():
            assert cast[key].dtype == torch.bfloat16
            assert torch.equal(cast[key], value.to(torch.bfloat16)), key
        else:
            assert torch.equal(cast[key], value), key


def test_existing_output_and_input_are_protected(fixtures_dir: Path, tmp_path: Path) -> None:
    source_path = tmp_path / "in.pt"
    source_path.write_bytes((fixtures_dir / "ddp_lenet_wrapped.pt").read_bytes())
    before = source_path.read_bytes()
    checkpoint = ckptool.load(source_path).strip_prefix()
    with pytest.raises(OutputError, match="is the input"):
        save(checkpoint, source_path)
    (tmp_path / "link.pt").symlink_to(source_path)
    with pytest.raises(OutputError, match="is the input"):
        save(checkpoint, tmp_path / "link.pt")
    (tmp_path / "taken.pt").write_bytes(b"keep me")
    with pytest.raises(OutputError, match="force=True"):
        save(checkpoint, tmp_path / "taken.pt")
    assert (tmp_path / "taken.pt").read_bytes() == b"keep me"
    assert source_path.read_bytes() == before
    save(checkpoint, source_path, in_place=True)
    assert ckptool.load(source_path).prefix == ""
    assert not list(tmp_path.glob(".ckptool-tmp-*"))


def test_fingerprint_recorded_in_safetensors_metadata_only_when_asked(fixtures_dir: Path, tmp_path: Path) -> None:
    from safetensors import safe_open

    source = ckptool.load(fixtures_dir / "single_lenet.pt")
    plain = save(source, tmp_path / "plain.safetensors")
    assert plain.fingerprint is None and plain.checked == len(source.tensors)
    with safe_open(tmp_path / "plain.safetensors", "pt") as handle:
        metadata = handle.metadata()
    assert "ckptool.fingerprint" not in metadata
    assert json.loads(metadata["ckptool.entries"])["container"]["epoch"] == 1
    hashed = save(source, tmp_path / "hashed.safetensors", fingerprint=True)
    with safe_open(tmp_path / "hashed.safetensors", "pt") as handle:
        assert handle.metadata()["ckptool.fingerprint"] == hashed.fingerprint == ckptool.fingerprint(source.tensors)


@pytest.mark.parametrize("suffix", [".safetensors", ".pt"])
def test_a_byte_changed_on_the_way_is_caught_and_nothing_written(fixtures_dir: Path, tmp_path: Path, suffix: str,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """A copy that lands one wrong byte (a writer bug, a bad disk): the re-read check refuses and deletes it."""
    import os as os_

    from ckptool.files import copying
    from ckptool.base.errors import FingerprintMismatchError

    real_copy = copying.copy_range  # every kernel copy (zip members, safetensors tensors) goes through it
    calls = {"n": 0}

    def corrupting_copy(source, offset, size, out, out_offset):
        real_copy(source, offset, size, out, out_offset)
        calls["n"] += 1
        if calls["n"] == 1 and size:  # a byte in the middle of the first copy
            byte = os_.pread(out.fileno(), 1, out_offset + size // 2)
            os_.pwrite(out.fileno(), bytes([byte[0] ^ 0xFF]), out_offset + size // 2)

    real_read = copying.read_exact

    def corrupting_read(fd, offset, size, path):  # small tensors are read (alone, in windows or spans) and written
        data = real_read(fd, offset, size, path)
        calls["n"] += 1
        middle = size // 2
        return data[:middle] + bytes([data[middle] ^ 0xFF]) + data[middle + 1:] if calls["n"] == 1 and size else data

    monkeypatch.setattr(copying, "copy_range", corrupting_copy)
    monkeypatch.setattr(copying, "read_exact", corrupting_read)
    with pytest.raises(FingerprintMismatchError, match="reads back different"):
        save(ckptool.load(fixtures_dir / "dp_mlp_wrapped.pt"), tmp_path / f"out{suffix}")
    assert calls["n"] >= 1
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("suffix", [".pt", ".safetensors"])
def test_writeback_is_started_for_every_byte_written(fixtures_dir: Path, tmp_path: Path, suffix: str,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """The early writeback covers the output's data end to end (no region left for the final fsync
    alone), and a platform without sync_file_range still writes correctly (fdatasync thread)."""
    import ckptool.io.write_check as write_check

    kicks: list[tuple[int, int]] = []
    real = write_check.writeback_starter()
    if real is not None:
        def recording(fd: int, offset: int, length: int, flags: int) -> int:
            kicks.append((offset, length))
            return real(fd, offset, length, flags)

        monkeypatch.setattr(write_check, "writeback_starter", lambda: recording)
        monkeypatch.setattr(write_check, "KICK_EVERY", 4096)
        out = tmp_path / f"kicked{suffix}"
        save(ckptool.load(fixtures_dir / "single_lenet.pt"), out)
        assert kicks, "no writeback was started"
        position = kicks[0][0]
        for offset, length in kicks:  # contiguous, in order, each region once
            assert offset == position and length > 0
            position += length
        data_end = max(t.contiguous_byte_range().offset + t.nbytes for t in ckptool.load(out).tensors.values())
        assert position >= data_end
    monkeypatch.setattr(write_check, "writeback_starter", lambda: None)
    out = tmp_path / f"flushed{suffix}"
    save(ckptool.load(fixtures_dir / "single_lenet.pt"), out)
    assert ckptool.fingerprint(ckptool.load(out).tensors) == ckptool.fingerprint(
        ckptool.load(fixtures_dir / "single_lenet.pt").tensors)


def test_a_wrong_crc_recorded_in_the_output_zip_is_caught(fixtures_dir: Path, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Right bytes under a wrong recorded CRC still load in torch (it does not check), but fail a
    zip check later: the write check compares the CRC the output records with its bytes."""
    from ckptool.base.errors import FingerprintMismatchError
    from ckptool.formats import zipio

    real_add_copy_columns = zipio.ZipWriter.add_copy_columns  # (add_copy and add_copies write through it)

    def wrong(name, crc):
        return crc ^ 0x1 if crc is not None and name.endswith("/data/1") else crc

    def wrong_crcs(self, names, sources, offsets, sizes, crcs):
        return real_add_copy_columns(self, names, sources, offsets, sizes, list(map(wrong, names, crcs)))

    monkeypatch.setattr(zipio.ZipWriter, "add_copy_columns", wrong_crcs)
    with pytest.raises(FingerprintMismatchError, match="CRC recorded in the output"):
        save(ckptool.load(fixtures_dir / "dp_mlp_wrapped.pt").strip_prefix(), tmp_path / "out.pt")
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("suffix", [".pt", ".safetensors"])
def test_copies_in_steps_are_checked_from_the_trailing_sums(fixtures_dir: Path, tmp_path: Path, suffix: str,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """Large copies are made and re-read in steps; the write check combines the steps' CRCs into each
    tensor's instead of reading the output a second time, and still catches a wrong byte."""
    import os

    from ckptool.files import copying
    from ckptool.base.errors import FingerprintMismatchError
    from ckptool.tensors.refs import TensorRef

    monkeypatch.setattr(copying, "COPY_STEP", 1000)  # odd steps: CRCs combined across unaligned boundaries
    monkeypatch.setattr(copying, "SMALL_MEMBER", 0)  # every tensor through the kernel copy
    reads = {"n": 0}
    real_iter = TensorRef.iter_reused

    def counting(self, *args, **kwargs):
        reads["n"] += 1
        return real_iter(self, *args, **kwargs)

    monkeypatch.setattr(TensorRef, "iter_reused", counting)
    source = ckptool.load(fixtures_dir / "dp_mlp_wrapped.pt")
    report = save(source.strip_prefix(), tmp_path / f"ok{suffix}")
    assert report.checked == len(source.tensors) and reads["n"] == 0
    real_copy = copying.copy_range
    calls = {"n": 0}

    def corrupting_copy(src, offset, size, out, out_offset):
        real_copy(src, offset, size, out, out_offset)
        calls["n"] += 1
        if calls["n"] == 50:  # one byte inside a step in the middle of the first weight
            position = out_offset + size // 2
            os.pwrite(out.fileno(), bytes([os.pread(out.fileno(), 1, position)[0] ^ 1]), position)

    monkeypatch.setattr(copying, "copy_range", corrupting_copy)
    with pytest.raises(FingerprintMismatchError):
        save(source.strip_prefix(), tmp_path / f"bad{suffix}")
    assert not (tmp_path / f"bad{suffix}").exists()


@pytest.mark.parametrize("max_shard_size", [None, 1 << 20], ids=["file", "folder"])
def test_a_safetensors_output_of_a_checkpoint_without_weights_is_refused(max_shard_size: int | None,
                                                                        tmp_path: Path) -> None:
    source = tmp_path / "state.pt"
    torch.save({"epoch": 3, "config": {"lr": 0.1}}, source)
    out = tmp_path / ("out" if max_shard_size else "out.safetensors")
    with pytest.raises(ckptool.InputError, match="holds no weights"):
        save(ckptool.load(source), out, max_shard_size=max_shard_size)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["state.pt"]


@pytest.mark.parametrize("suffix", [".safetensors", ".pt"])
def test_dtype_cast_includes_empty_tensors(tmp_path: Path, suffix: str) -> None:
    # a zero-element float tensor is a weight too: left in F32 it would make a bf16 output mixed
    from click.testing import CliRunner

    from ckptool.cli.main import main

    source = tmp_path / "empty.pt"
    torch.save({"empty": torch.empty(0, 3), "w": torch.ones(2), "steps": torch.zeros(0, dtype=torch.int64)}, source)
    out = tmp_path / f"out{suffix}"
    result = CliRunner().invoke(main, ["convert", str(source), "-o", str(out), "--dtype", "bf16"])
    assert result.exit_code == 0, result.output
    loaded = load_file(out) if suffix == ".safetensors" else torch.load(out, weights_only=True)
    assert {k: (v.dtype, tuple(v.shape)) for k, v in loaded.items()} == {
        "empty": (torch.bfloat16, (0, 3)), "w": (torch.bfloat16, (2,)), "steps": (torch.int64, (0,))}


def test_the_write_check_reads_back_its_own_pickle_without_walking_or_checking_it_again(fixtures_dir: Path,
                                                                                      tmp_path: Path,
                                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """The pickle a write emitted is read back by its check, bytes known: no opcode walk, no tree check (the tree is
    the one the write was given). Any other read of the same file walks and checks it."""
    from ckptool.pickles import unpickle

    calls = {"walk": 0, "tree": 0}
    real_walk, real_tree = unpickle.guard_stats, unpickle.check_tree

    def walk(*args, **kwargs):
        calls["walk"] += 1
        return real_walk(*args, **kwargs)

    def tree(*args, **kwargs):
        calls["tree"] += 1
        return real_tree(*args, **kwargs)

    monkeypatch.setattr(unpickle, "guard_stats", walk)
    monkeypatch.setattr(unpickle, "check_tree", tree)
    source = ckptool.load(fixtures_dir / "dp_mlp_wrapped.pt").strip_prefix()
    assert calls == {"walk": 1, "tree": 1}
    report = save(source, tmp_path / "out.pt")
    assert report.checked == len(source.tensors) and calls == {"walk": 1, "tree": 1}
    ckptool.load(tmp_path / "out.pt")
    assert calls == {"walk": 2, "tree": 2}


@pytest.mark.parametrize("with_headers", [False, True])
@pytest.mark.parametrize("report_every", [None, 4096])
def test_copy_all_writes_and_reports_what_a_copy_of_each_piece_would(tmp_path: Path, with_headers: bool,
                                                                     report_every: int | None,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """DataOut.copy_all (runs of small pieces read in windows in file order, written together) against the bytes of each piece read alone: drawn pieces in any order, overlapping,
    empty, past a window, larger than a small piece, from two files; every non-empty piece reported as one region
    where it landed."""
    import random

    from ckptool.files import copying

    if report_every is not None:  # runs cut often
        monkeypatch.setattr(copying, "REPORT_EVERY", report_every)
    rng = random.Random(20261127)
    sources = [tmp_path / "a.bin", tmp_path / "b.bin"]
    contents = [rng.randbytes(3 << 20), rng.randbytes(1 << 16)]
    for path, data in zip(sources, contents):
        path.write_bytes(data)
    for round_ in range(40):
        count = rng.randint(0, 300)
        picks = []
        usual = round_ % 2 == 0  # small pieces of one file only (copy_all's runs cut by running total)
        for _ in range(count):
            which = 0 if usual or rng.random() < 0.9 else 1
            size = rng.choice([0, 1, 7, 64, 4096, 300_000, copying.SMALL_MEMBER + 5]) if rng.random() < 0.3 \
                else rng.randint(0, 600)
            size = min(size, copying.SMALL_MEMBER) if usual else size
            size = min(size, len(contents[which]))
            offset = rng.randint(0, len(contents[which]) - size)
            picks.append((which, offset, size))
        headers = [rng.randbytes(rng.randint(0, 40)) for _ in picks] if with_headers else None
        out_path = tmp_path / f"out{round_}.bin"
        reported: list[tuple[int, int]] = []
        with open(out_path, "w+b") as handle:
            handle.write(b"H" * 13)
            out = copying.DataOut(handle, lambda offset, length: reported.append((offset, length)))
            end = out.copy_all([sources[w] for w, _, _ in picks], [o for _, o, _ in picks], [s for _, _, s in picks],
                               13, headers)
            out.report()
            out.release()
            handle.flush()
        expected, regions, position = bytearray(b"H" * 13), [], 13
        for index, (which, offset, size) in enumerate(picks):
            if headers is not None:
                expected += headers[index]
                position += len(headers[index])
            expected += contents[which][offset:offset + size]
            if size:
                regions.append((position, size))
            position += size
        assert end == position == len(expected)
        assert out_path.read_bytes() == bytes(expected)
        assert sorted(reported) == regions  # (no piece here is past COPY_STEP, reported in steps)


def test_copy_all_of_a_source_cut_short_says_the_file_ends(tmp_path: Path) -> None:
    """A run of small pieces whose source file is cut short after it was read is refused as a file that ends early, naming it; nothing is written of that run."""
    from ckptool.files import copying
    from ckptool.base.errors import InputError

    source = tmp_path / "src.bin"
    source.write_bytes(bytes(range(256)) * 40)
    offsets = [index * 100 for index in range(100)]
    with open(source, "r+b") as handle:
        handle.truncate(5000)
    with open(tmp_path / "out.bin", "w+b") as handle:
        out = copying.DataOut(handle, lambda offset, length: None)
        with pytest.raises(InputError, match="src.bin"):
            out.copy_all([source] * 100, offsets, [60] * 100, 0)
        out.release()
        handle.flush()
    assert (tmp_path / "out.bin").stat().st_size == 0
