"""The byte-I/O layer: the file cache, exact positional reads, and the copy engine's two paths."""

from __future__ import annotations

import os
import zlib
from pathlib import Path

import pytest

from ckptool.files import copying
from ckptool.files.byteio import FileCache, read_exact, read_into
from ckptool.base.errors import InputError
from ckptool.files.ranges import ByteRange


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts descriptors through /proc")
def test_the_cache_opens_each_file_once_keeps_at_most_its_limit_and_closes_all(tmp_path: Path) -> None:
    paths = [tmp_path / f"f{n}" for n in range(3)]
    for n, path in enumerate(paths):
        path.write_bytes(bytes([n]) * 10)
    before = _open_fds()
    with FileCache(limit=2) as files:
        first = files.get(paths[0])
        assert files.get(paths[0]) == first  # opened once
        files.get(paths[1])
        files.get(paths[2])  # the least recently used (paths[0]) is closed
        assert _open_fds() == before + 2
        assert read_exact(files.get(paths[0]), 0, 10, paths[0]) == bytes([0]) * 10  # and reopened
    assert _open_fds() == before


def test_a_read_past_the_end_is_one_truncation_error_naming_the_file(tmp_path: Path) -> None:
    path = tmp_path / "short.bin"
    path.write_bytes(b"x" * 100)
    with FileCache() as files:
        assert read_exact(files.get(path), 90, 10, path) == b"x" * 10
        view = memoryview(bytearray(20))
        read_into(files.get(path), view, 80, path)
        with pytest.raises(InputError, match="file is truncated: .* re-save or re-download") as caught:
            read_exact(files.get(path), 95, 10, path)
        assert caught.value.path == path
        with pytest.raises(InputError, match="file is truncated") as caught:
            read_into(files.get(path), view, 90, path)
        assert caught.value.path == path


@pytest.mark.parametrize("small", [0, 1 << 20], ids=["kernel-copy", "through-the-buffer"])
def test_a_copy_lands_the_same_bytes_and_reports_them_whichever_path_it_takes(tmp_path: Path, small: int,
                                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(copying, "SMALL_MEMBER", small)
    monkeypatch.setattr(copying, "COPY_STEP", 1000)
    source = tmp_path / "source.bin"
    data = os.urandom(5000)
    source.write_bytes(data)
    regions: list[tuple[int, int]] = []
    with open(tmp_path / "out.bin", "w+b") as handle:
        handle.write(b"head")
        out = copying.DataOut(handle, lambda offset, length: regions.append((offset, length)))
        out.copy(source, 100, 3000, 4)
        end = out.copy_pieces((ByteRange(source, 0, 50), ByteRange(source, 4000, 1000)), 3004)
        out.report()
        out.release()
        assert end == handle.tell() == 4054
    written = (tmp_path / "out.bin").read_bytes()
    assert written == b"head" + data[100:3100] + data[:50] + data[4000:]
    assert sorted(regions)[0][0] == 4 and sum(length for _, length in regions) == 4050
    assert copying.pieces_crc([ByteRange(source, 0, 50, zlib.crc32(data[:50])),
                               ByteRange(source, 4000, 1000, zlib.crc32(data[4000:]))]) == \
        zlib.crc32(data[:50] + data[4000:])


def test_a_copy_from_a_source_cut_short_names_the_source(tmp_path: Path) -> None:
    source = tmp_path / "source.bin"
    source.write_bytes(b"y" * 10)
    with open(tmp_path / "out.bin", "w+b") as handle:
        out = copying.DataOut(handle, None)
        with pytest.raises(InputError, match="file is truncated") as caught:
            out.copy(source, 0, 20, 0)
        out.release()
    assert caught.value.path == source
