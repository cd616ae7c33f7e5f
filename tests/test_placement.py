"""Large tensors are written at their source's offset within a page (ckptool/files/placement.py), and nothing else changes.

The kernel copies page-cache page by page: a region placed at another offset within a page costs each page two
partial writes. These tests read the written files' layouts themselves (zip local headers, the safetensors header)
and the values with torch and the safetensors library; each fails if the placement is taken out.
"""

from __future__ import annotations

import json
import struct
import zipfile
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from hypothesis import example, given, settings, strategies as st
from safetensors.torch import load_file

from ckptool.files import placement
from ckptool.cli.main import main
from ckptool.files.copying import SMALL_MEMBER

PAGE = placement.PAGE
LARGE = SMALL_MEMBER // 4 + 4096  # float32 elements of a tensor over SMALL_MEMBER bytes


def _state() -> dict[str, torch.Tensor]:
    """Three large tensors of two dtypes (two of them not a multiple of the page in bytes), and small ones of every
    size from 64 to 4032 bytes in steps of 64: between any two large ones some small one fits."""
    g = torch.Generator().manual_seed(0)
    state = {"a.weight": torch.randn(LARGE, generator=g),
             "b.weight": torch.randn(LARGE + 6, generator=g),
             "c.weight": torch.randn(2 * LARGE + 64, generator=g).to(torch.bfloat16)}
    for j in range(1, 64):
        state[f"norm.{j}"] = torch.randn(16 * j, generator=g)
    state["steps"] = torch.arange(5)  # an int64 tensor: larger element type, first in the usual order
    return state


def _member_data_offsets(path: Path) -> dict[str, int]:
    """Each zip member's data offset, read from its local header as torch's reader reads it."""
    offsets = {}
    with zipfile.ZipFile(path) as archive, path.open("rb") as handle:
        for info in archive.infolist():
            handle.seek(info.header_offset)
            header = handle.read(30)
            name_length, extra_length = struct.unpack("<HH", header[26:30])
            offsets[info.filename.rsplit("/", 1)[-1]] = info.header_offset + 30 + name_length + extra_length
    return offsets


def _safetensors_offsets(path: Path) -> dict[str, tuple[int, int]]:
    with path.open("rb") as handle:
        (length,) = struct.unpack("<Q", handle.read(8))
        header = json.loads(handle.read(length))
    header.pop("__metadata__", None)
    return {name: (8 + length + entry["data_offsets"][0], entry["data_offsets"][1] - entry["data_offsets"][0])
            for name, entry in header.items()}


def _source_offsets(path: Path) -> dict[int, int]:
    """Each storage's data offset in a torch archive, by its byte count (the large ones' counts differ here)."""
    offsets = _member_data_offsets(path)
    with zipfile.ZipFile(path) as archive:
        return {info.file_size: offsets[info.filename.rsplit("/", 1)[-1]]
                for info in archive.infolist() if "/data/" in info.filename}


@pytest.fixture()
def source(tmp_path: Path) -> Path:
    path = tmp_path / "in.pt"
    torch.save({"module." + name: tensor for name, tensor in _state().items()}, path)
    return path


def _large_nbytes() -> list[int]:
    return [t.numel() * t.element_size() for t in _state().values() if t.numel() * t.element_size() > SMALL_MEMBER]


def test_a_rewritten_archive_places_each_large_storage_as_its_source_and_keeps_every_value(
        source: Path, tmp_path: Path) -> None:
    out = tmp_path / "out.pt"
    result = CliRunner().invoke(main, ["strip", str(source), "-o", str(out)])
    assert result.exit_code == 0, result.output
    before, after = _source_offsets(source), _source_offsets(out)
    for nbytes in _large_nbytes():
        assert after[nbytes] % PAGE == before[nbytes] % PAGE, nbytes
    assert all(offset % 64 == 0 for offset in after.values())  # torch's alignment, small members included
    with zipfile.ZipFile(out) as archive:
        assert archive.testzip() is None  # the padding is a well-formed extra field; every CRC holds
    loaded = torch.load(out, weights_only=True)
    expected = _state()
    assert loaded.keys() == expected.keys()
    for name, tensor in expected.items():
        assert loaded[name].dtype == tensor.dtype and torch.equal(loaded[name], tensor), name


@pytest.mark.parametrize("shards", [False, True])
def test_a_safetensors_file_places_each_large_tensor_as_its_source_and_keeps_every_value(
        source: Path, tmp_path: Path, shards: bool) -> None:
    out = tmp_path / ("shards" if shards else "out.safetensors")
    result = CliRunner().invoke(main, ["convert", str(source), "-o", str(out)]
                                + (["--max-shard-size", "3MB"] if shards else []))
    assert result.exit_code == 0, result.output
    files = sorted(out.glob("*.safetensors")) if shards else [out]
    assert len(files) > 1 if shards else len(files) == 1
    before = _source_offsets(source)
    placed, values = {}, {}
    for path in files:
        in_file = _safetensors_offsets(path)
        placed.update(in_file)
        values.update(load_file(path))
        # a shard of two large tensors and nothing to put between them places the larger
        largest = max(in_file.values(), key=lambda place: place[1])
        if largest[1] > SMALL_MEMBER:
            assert largest[0] % PAGE == before[largest[1]] % PAGE, path.name
    if not shards:  # among the small tensors some bring each large one to its place
        for nbytes in _large_nbytes():
            (offset,) = [start for start, length in placed.values() if length == nbytes]
            assert offset % PAGE == before[nbytes] % PAGE, nbytes
    expected = {"module." + name: tensor for name, tensor in _state().items()}
    assert values.keys() == expected.keys()
    for name, tensor in expected.items():
        start, _ = placed[name]
        assert start % min(tensor.element_size(), 8) == 0, name  # each tensor aligned to its element size
        assert values[name].dtype == tensor.dtype and torch.equal(values[name], tensor), name


@st.composite
def _columns(draw: st.DrawFn) -> tuple[list[int], list[int], list[int]]:
    """Regions in a safetensors file's usual order (larger element types first): sources mostly at multiples of
    64, as torch's storages lie; sizes small and large, multiples of their element size."""
    itemsizes = sorted(draw(st.lists(st.sampled_from([1, 2, 4, 8, 16]), min_size=1, max_size=40)), reverse=True)
    sizes, offsets = [], []
    for itemsize in itemsizes:
        large = draw(st.booleans())
        elements = draw(st.integers(SMALL_MEMBER // itemsize + 1, 3 * SMALL_MEMBER // itemsize) if large
                        else st.integers(0, 1200))
        sizes.append(elements * itemsize)
        offsets.append(draw(st.integers(0, 1 << 30)) * draw(st.sampled_from([64, 64, 64, 8, 1])))
    return offsets, sizes, itemsizes


@settings(max_examples=300, deadline=None)
@given(_columns(), st.integers(1, 1 << 16).map(lambda n: 8 * n))
# two large float32 regions and one small byte region of 3 bytes: put first, it would leave the large ones unaligned
@example(([64, 4096 + 128, 192], [SMALL_MEMBER + 64, SMALL_MEMBER + 64, 3], [4, 4, 1]), 4096)
# small regions leading by 12 bytes: the large int64 one would lie at 4 past a multiple of 8 for a float32 one's place
@example(([0] * 7, [SMALL_MEMBER + 8, SMALL_MEMBER + 4, SMALL_MEMBER + 12, 0, 0, 6, 6], [8, 4, 4, 2, 2, 2, 1]), 8)
def test_an_order_and_padding_keep_alignment_and_place_no_fewer_bytes_than_the_usual_order(
        columns: tuple[list[int], list[int], list[int]], header_end: int) -> None:
    offsets, sizes, itemsizes = columns
    order = placement.safetensors_order(offsets, sizes, itemsizes) or list(range(len(sizes)))
    assert sorted(order) == list(range(len(sizes)))
    ordered_offsets, ordered_sizes = [offsets[i] for i in order], [sizes[i] for i in order]
    padding = placement.header_padding(header_end, ordered_offsets, ordered_sizes)
    assert padding % 8 == 0 and 0 <= padding < PAGE
    position = header_end + padding

    def placed(order_: list[int], start: int) -> int:
        total = 0
        for index in order_:
            if sizes[index] > SMALL_MEMBER and offsets[index] % 64 == 0 and start % PAGE == offsets[index] % PAGE:
                total += sizes[index]
            start += sizes[index]
        return total

    for index in order:
        assert position % min(itemsizes[index], 8) == 0, (index, position)
        position += sizes[index]
    usual = list(range(len(sizes)))
    usual_padding = placement.header_padding(header_end, offsets, sizes)
    assert placed(order, header_end + padding) >= placed(usual, header_end + usual_padding)


def test_fillers_bring_every_large_region_to_its_place_when_small_sizes_allow() -> None:
    # the benchmark's shape: four large regions 128 bytes apart within a page, small sizes of 8 to 3072 bytes
    offsets = [1984, 2240, 2112, 2368] + [64 * k for k in range(40)] + [64 * k for k in range(20)]
    sizes = [1 << 28] * 4 + [8, 256, 512, 1024, 2048, 3072, 0, 4096] * 5 + [8] * 20
    itemsizes = [4, 4, 2, 2] + [8, 4, 4, 4, 4, 4, 4, 4] * 5 + [8] * 20
    order = sorted(range(len(sizes)), key=lambda i: -itemsizes[i])
    offsets, sizes, itemsizes = ([column[i] for i in order] for column in (offsets, sizes, itemsizes))
    placed_order = placement.safetensors_order(offsets, sizes, itemsizes)
    assert placed_order is not None
    padding = placement.header_padding(4000, [offsets[i] for i in placed_order], [sizes[i] for i in placed_order])
    position = 4000 + padding
    for index in placed_order:
        if sizes[index] > SMALL_MEMBER:
            assert position % PAGE == offsets[index] % PAGE, index
        position += sizes[index]


@pytest.mark.parametrize("position", [0, 1, 60, 61, 62, 63, 64, 4093, 4095, 8191])
@pytest.mark.parametrize("residue", [0, 64, 3, 4032])
def test_a_zip_padding_puts_data_where_asked(position: int, residue: int) -> None:
    padding = placement.zip_padding(position, residue)
    assert padding == 0 or padding >= 4  # an extra field's own header is 4 bytes
    assert (position + padding) % PAGE == residue and padding < PAGE + 4
