"""comparison.diff and `ckptool diff`: keys, dtypes, shapes and streamed values, across formats."""

from __future__ import annotations

import importlib
import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import safetensors.torch
import torch
from click.testing import CliRunner

from ckptool.cli.main import main
from ckptool.tensors.dtypes import by_name
from training.models import LeNet

# the module behind `ckptool.diff` (the function)
diff_module = importlib.import_module("ckptool.ops.diff")
diff = diff_module.diff


def lenet_state(seed: int = 0) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    return LeNet().state_dict()


def invoke(*args: Any) -> Any:
    return CliRunner().invoke(main, [str(a) for a in args])


@pytest.fixture
def lenet_pt(tmp_path: Path) -> Path:
    path = tmp_path / "lenet.pt"
    torch.save({"model": lenet_state(), "optimizer": {"state": {}, "param_groups": []}, "epoch": 3}, path)
    return path


def test_pt_and_safetensors_copies_are_identical(lenet_pt: Path, tmp_path: Path) -> None:
    copy = tmp_path / "lenet.safetensors"
    safetensors.torch.save_file(lenet_state(), copy)
    report = diff(lenet_pt, copy)
    assert report.identical and report.compared == 8 and report.byte_identical == 8
    result = invoke("diff", lenet_pt, copy)
    assert result.exit_code == 0, result.output
    assert result.output.splitlines()[-1] == "identical: 8 tensors byte for byte"


def test_one_changed_element_is_named(lenet_pt: Path, tmp_path: Path) -> None:
    state = lenet_state()
    state["fc1.weight"] = state["fc1.weight"].clone()
    state["fc1.weight"][17, 300] += 1e-3
    changed = tmp_path / "changed.safetensors"
    safetensors.torch.save_file(state, changed)
    result = invoke("diff", lenet_pt, changed, "--json")
    assert result.exit_code == 1
    report = json.loads(result.stdout)
    assert report["identical"] is False and report["byte_identical"] == 7
    [change] = report["changed"]
    assert change["name"] == "fc1.weight" and change["kinds"] == ["values"]
    assert change["differing"] == 1 and change["beyond_atol"] == 1
    assert change["max_abs_diff"] == pytest.approx(1e-3, rel=1e-3)
    human = invoke("diff", lenet_pt, changed)
    assert "  changed    fc1.weight: max abs diff 0.001 (1 of 102400 elements beyond atol 0)" in human.output
    # within a tolerance it is the same model
    assert invoke("diff", lenet_pt, changed, "--atol", "1e-2").exit_code == 0


def test_prefix_difference_shows_as_keys_and_is_named(lenet_pt: Path, tmp_path: Path) -> None:
    ddp = tmp_path / "ddp.pt"
    torch.save({"module." + k: v for k, v in lenet_state().items()}, ddp)
    report = diff(ddp, lenet_pt)
    assert not report.identical and report.compared == 0
    assert report.only_in_a[0] == "module.conv1.weight" and report.only_in_b[0] == "conv1.weight"
    assert report.notes == [f'the keys differ only by the prefix "module." on A — run: ckptool strip {ddp} '
                            f"-o {tmp_path / 'ddp.stripped.pt'}"]
    aligned = diff(ddp, lenet_pt, align_prefixes=True)
    assert aligned.identical and aligned.aligned == ("module.", "")


def test_dtype_and_shape_changes(lenet_pt: Path, tmp_path: Path) -> None:
    state = lenet_state()
    state["fc2.weight"] = state["fc2.weight"].to(torch.bfloat16)
    state["fc2.bias"] = torch.zeros(5)
    del state["conv1.bias"]
    state["extra.scale"] = torch.ones(1)
    other = tmp_path / "other.safetensors"
    safetensors.torch.save_file(state, other)
    report = diff(lenet_pt, other)
    changes = {change.name: change for change in report.changed}
    assert changes["fc2.weight"].kinds == ["dtype", "values"]
    # the bf16 rounding error: at most half a bf16 ulp of the largest weight
    largest = float(lenet_state()["fc2.weight"].abs().max())
    assert 0 < changes["fc2.weight"].max_abs_diff <= largest * 2**-8
    assert changes["fc2.bias"].kinds == ["shape"] and changes["fc2.bias"].max_abs_diff is None
    assert report.only_in_a == ["conv1.bias"] and report.only_in_b == ["extra.scale"]


def test_nan_handling(tmp_path: Path) -> None:
    base = torch.tensor([1.0, float("nan"), 3.0, float("inf")])
    a, b, c = tmp_path / "a.pt", tmp_path / "b.safetensors", tmp_path / "c.safetensors"
    torch.save({"w": base}, a)
    safetensors.torch.save_file({"w": base.clone()}, b)
    safetensors.torch.save_file({"w": torch.tensor([1.0, 2.0, 3.0, float("inf")])}, c)
    assert diff(a, b).identical  # NaN against the same NaN: same bits
    report = diff(a, c)
    assert report.changed[0].max_abs_diff == float("inf") and report.changed[0].differing == 1
    assert report.to_json()["changed"][0]["max_abs_diff"] == "inf"  # strict JSON: no Infinity literal


def test_streaming_across_chunks_and_dtypes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(diff_module, "CHUNK_SIZE", 64)  # 16 floats per chunk: many chunks, odd boundaries
    values = torch.randn(1001)
    changed = values.clone()
    changed[997] += 0.25  # in the last, partial chunk
    a, b, half = tmp_path / "a.pt", tmp_path / "b.pt", tmp_path / "half.safetensors"
    torch.save({"w": values, "t": values[:1000].reshape(20, 50).t()}, a)  # t: non-contiguous view
    torch.save({"w": changed, "t": values[:1000].reshape(20, 50).t().contiguous()}, b)
    report = diff(a, b)
    assert [c.name for c in report.changed] == ["w"]
    assert report.changed[0].max_abs_diff == pytest.approx(0.25, abs=1e-6) and report.changed[0].differing == 1
    safetensors.torch.save_file({"w": values.half(), "t": values[:1000].reshape(20, 50).t().contiguous().half()}, half)
    mixed = diff(a, half)
    expected = float((values.double() - values.half().double()).abs().max())
    assert {c.name: c.kinds for c in mixed.changed} == {"w": ["dtype", "values"], "t": ["dtype", "values"]}
    assert mixed.changed[0].max_abs_diff == pytest.approx(expected)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.uint8, torch.bool,
                                   torch.complex64, torch.float8_e4m3fn])
def test_decode_matches_torch(dtype: torch.dtype) -> None:
    source = (torch.randn(37) * 4).to(dtype) if dtype != torch.bool else torch.rand(37) > 0.5
    raw = source.view(torch.uint8).numpy().tobytes() if source.element_size() == 1 else \
        source.contiguous().view(torch.uint8).numpy().tobytes()
    name = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float64: "F64", torch.int64: "I64",
            torch.uint8: "U8", torch.bool: "BOOL", torch.complex64: "C64", torch.float8_e4m3fn: "F8_E4M3"}[dtype]
    decoded = diff_module.decode(raw, by_name(name))
    expected = source.to(torch.complex128 if dtype.is_complex else torch.float64).numpy()
    np.testing.assert_array_equal(decoded, expected)


def test_diff_reads_sharded_and_legacy_fixtures(fixtures_dir: Path) -> None:
    # the sharded copy was made from single_lenet.pt's weights, mlp.safetensors from the legacy file's
    for a, b in (("sharded", "single_lenet.pt"), ("legacy_mlp.pt", "mlp.safetensors")):
        report = diff(fixtures_dir / a, fixtures_dir / b)
        assert report.identical and report.byte_identical == report.compared > 0, (a, b)
    other_run = diff(fixtures_dir / "sharded", fixtures_dir / "ddp_lenet_unwrapped.pt")
    assert other_run.compared == 8 and len(other_run.changed) == 8 and not other_run.only_in_a


def test_unreadable_input_exits_3(tmp_path: Path, lenet_pt: Path) -> None:
    (tmp_path / "notes.txt").write_text("hello")
    result = invoke("diff", lenet_pt, tmp_path / "notes.txt")
    assert result.exit_code == 3
    assert result.stderr == f"ckptool: error: {tmp_path / 'notes.txt'}: is a text file, not a PyTorch checkpoint\n"


def test_prefixes_on_both_sides_name_both_strip_commands(tmp_path: Path) -> None:
    state = lenet_state()
    ddp, compiled, nested = tmp_path / "ddp.pt", tmp_path / "compiled.safetensors", tmp_path / "nested.pt"
    torch.save({"module." + k: v for k, v in state.items()}, ddp)
    safetensors.torch.save_file({"_orig_mod." + k: v for k, v in state.items()}, compiled)
    torch.save({"model." + k: v for k, v in state.items()}, nested)  # no Lightning markers: strip needs --prefix
    report = diff(ddp, compiled)
    assert report.notes == [f'the keys differ only by the prefixes "module." on A and "_orig_mod." on B — run: '
                            f"ckptool strip {ddp} -o {tmp_path / 'ddp.stripped.pt'} && ckptool strip {compiled} "
                            f"-o {tmp_path / 'compiled.stripped.safetensors'}"]
    assert diff(nested, ddp).notes[0].endswith(f"ckptool strip {nested} -o {tmp_path / 'nested.stripped.pt'} "
                                               "--prefix model. && "
                                               f"ckptool strip {ddp} -o {tmp_path / 'ddp.stripped.pt'}")


# ---------------------------------------------------------------------------------------------- chunked reads


@pytest.mark.parametrize("where", ["first", "middle", "last-full", "last-partial", "last"])
def test_one_flipped_bit_is_found_in_any_chunk_of_a_large_tensor(tmp_path: Path, where: str) -> None:
    """Large tensors are read in CHUNK_SIZE pieces into reused buffers: a one-bit change anywhere is found."""
    per_chunk = diff_module.CHUNK_SIZE // 4
    elements = per_chunk * 3 + 1001  # three full chunks and a partial one
    index = {"first": 0, "middle": elements // 2, "last-full": per_chunk * 3 - 1, "last-partial": per_chunk * 3 + 500,
             "last": elements - 1}[where]
    values = torch.randn(elements)
    changed = values.clone()
    changed.view(torch.int32)[index] ^= 1  # the lowest mantissa bit: one byte of the file differs
    a, b, c = tmp_path / "a.pt", tmp_path / "b.pt", tmp_path / "c.safetensors"
    torch.save({"small": torch.ones(3), "w": values}, a)
    torch.save({"w": changed, "small": torch.ones(3)}, b)  # another order: other offsets in the file
    safetensors.torch.save_file({"w": changed, "small": torch.ones(3)}, c)
    for other in (b, c):
        report = diff(a, other)
        assert [change.name for change in report.changed] == ["w"], other
        change = report.changed[0]
        assert change.differing == 1 and change.beyond_atol == 1 and report.byte_identical == 1
        assert change.max_abs_diff == pytest.approx(abs(float(changed[index]) - float(values[index])))
    assert diff(a, tmp_path / "a.pt").identical


def _raw_tensor(storage_data: Any = None, pieces: Any = None, count: int = 100) -> Any:
    from ckptool.tensors.refs import StorageRef, TensorRef

    f32 = by_name("F32")
    return TensorRef(storage=StorageRef(key="w", dtype=f32, numel=count, location="cpu", data=storage_data,
                                        pieces=pieces), dtype=f32, shape=(count,), stride=(1,))


def test_a_tensor_in_pieces_is_compared_across_piece_and_chunk_boundaries(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """DCP row shards lie in several places: read end to end, boundaries not on chunk boundaries."""
    from ckptool.base.errors import InputError
    from ckptool.files.ranges import ByteRange

    monkeypatch.setattr(diff_module, "CHUNK_SIZE", 64)  # 16 floats per chunk
    raw = np.arange(100, dtype="<f4").tobytes()
    pieces_file, whole_file = tmp_path / "pieces.bin", tmp_path / "whole.bin"
    pieces_file.write_bytes(b"J" * 8 + raw[132:] + b"JUNK" + raw[:132])  # out of order, with gaps
    whole_file.write_bytes(raw)
    pieces = (ByteRange(pieces_file, 8 + 268 + 4, 132), ByteRange(pieces_file, 8, 268))
    in_pieces, whole = _raw_tensor(pieces=pieces), _raw_tensor(ByteRange(whole_file, 0, 400))
    assert diff_module.compare_values(in_pieces, whole) == (True, 0.0, 0, 0)
    changed = bytearray(raw)
    changed[4 * 70 + 3] ^= 0x80  # element 70, in the second piece: its sign
    whole_file.write_bytes(bytes(changed))
    assert diff_module.compare_values(in_pieces, whole) == (False, 140.0, 1, 1)
    # one descriptor open at a time: each side's reads close the other's, which must reopen its own
    files = diff_module.OpenFiles(limit=1)
    assert diff_module.compare_values(in_pieces, whole, files=files) == (False, 140.0, 1, 1)
    assert diff_module.compare_values(whole, in_pieces, files=files) == (False, 140.0, 1, 1)
    files.close()
    files = diff_module.OpenFiles()
    assert b"".join(bytes(chunk) for chunk in diff_module.tensor_chunks(in_pieces, files=files)) == raw
    files.close()
    size = pieces_file.stat().st_size
    short = (pieces[0], ByteRange(pieces_file, size - 100, 104))  # the second piece promises 4 bytes past the end
    with pytest.raises(InputError, match="truncated") as caught:
        diff_module.compare_values(_raw_tensor(pieces=short, count=59), _raw_tensor(ByteRange(whole_file, 0, 236),
                                                                                     count=59))
    assert caught.value.path == pieces_file


def test_a_file_cut_short_after_loading_is_an_input_error_naming_it(tmp_path: Path) -> None:
    from ckptool.base.errors import InputError
    from ckptool.io.reader import load

    values = torch.randn(diff_module.CHUNK_SIZE // 4 * 2 + 5)
    a, b = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    safetensors.torch.save_file({"w": values}, a)
    safetensors.torch.save_file({"w": values}, b)
    left, right = load(a), load(b)
    os.truncate(b, b.stat().st_size - 10)  # inside the last, partial chunk
    with pytest.raises(InputError, match="file is truncated") as caught:
        diff(left, right)
    assert caught.value.path == b


@pytest.mark.parametrize("make", [
    lambda t: t,                                  # a bare tensor: named "tensor"
    lambda t: [torch.ones(2), t],                 # a list: by index
    lambda t: (torch.ones(2), {"x": [t]}),        # nested places: "1.x.0"
    lambda t: {1: torch.ones(2), 2: t},           # integer keys: no mapping of names
])
def test_files_without_named_weights_are_compared_by_place(tmp_path: Path, make: Any) -> None:
    values = torch.arange(6, dtype=torch.float32)
    flipped = values.clone()
    flipped.view(torch.int32)[3] ^= 1  # one low bit: values torch tells apart
    torch.save(make(values), tmp_path / "a.pt")
    torch.save(make(values.clone()), tmp_path / "same.pt")
    torch.save(make(flipped), tmp_path / "b.pt")
    runner = CliRunner()
    same = runner.invoke(main, ["diff", str(tmp_path / "a.pt"), str(tmp_path / "same.pt"), "--json"])
    assert same.exit_code == 0, same.output
    assert json.loads(same.stdout)["identical"] is True
    changed = runner.invoke(main, ["diff", str(tmp_path / "a.pt"), str(tmp_path / "b.pt"), "--json"])
    assert changed.exit_code == 1, changed.output
    report = json.loads(changed.stdout)
    assert [entry["name"] for entry in report["changed"]] == [
        {torch.Tensor: "tensor", list: "1", tuple: "1.x.0", dict: "2"}[type(make(values))]]
    inspected = runner.invoke(main, ["inspect", str(tmp_path / "a.pt"), "--json"])
    assert any("outside any mapping of names, by place" in note for note in json.loads(inspected.stdout)["notes"])


def test_places_that_cannot_be_told_apart_are_refused(tmp_path: Path) -> None:
    cases = {
        "clash.pt": {1: torch.ones(2), "1": torch.zeros(2)},  # two places spell "1"
        "sparse.pt": [torch.ones(3).to_sparse()],              # its values are more than its parts' bytes
        "nothing.pt": {"epoch": 3},                             # no tensor to compare
    }
    for name, value in cases.items():
        torch.save(value, tmp_path / name)
        result = CliRunner().invoke(main, ["diff", str(tmp_path / name), str(tmp_path / name)])
        assert result.exit_code == 3, (name, result.output)
        assert result.stderr.count("\n") == 1 and name in result.stderr, result.stderr


def test_storages_saved_on_their_own_are_compared_as_their_bytes(tmp_path: Path) -> None:
    values = torch.arange(4, dtype=torch.float32)
    torch.save(values.untyped_storage(), tmp_path / "a.pt")
    torch.save(values.clone().untyped_storage(), tmp_path / "same.pt")
    values[2] = -1
    torch.save(values.untyped_storage(), tmp_path / "b.pt")
    runner = CliRunner()
    assert runner.invoke(main, ["diff", str(tmp_path / "a.pt"), str(tmp_path / "same.pt")]).exit_code == 0
    changed = runner.invoke(main, ["diff", str(tmp_path / "a.pt"), str(tmp_path / "b.pt"), "--json"])
    assert changed.exit_code == 1, changed.output
    assert [entry["name"] for entry in json.loads(changed.stdout)["changed"]] == ["storage"]
