"""crc32_combine (ckptool.files.copying's pure-Python port of zlib's) and ZipWriter.add_pieces, which uses it.

A member made of pieces whose CRCs are all known (DCP row shards, each a whole zip member of its
own) gets its CRC combined and its bytes copied by the kernel; a piece without a CRC makes the
member stream and sum instead. Either way the archive must check out with Python's zipfile.
"""

from __future__ import annotations

import random
import zipfile
import zlib
from pathlib import Path

import pytest

from ckptool.files import copying
from ckptool.files.copying import crc32_combine, pieces_crc
from ckptool.formats import zipio
from ckptool.formats.zipio import ZipWriter
from ckptool.files.ranges import ByteRange

# ------------------------------------------------------------------------------------------------ reference
# An independent model of the same algebra, used only where zlib cannot be run (lengths of GiBs):
# CRC-32 as polynomials over GF(2) in plain (not bit-reflected) order, x^(8n) by square-and-multiply.

_P = 0x104C11DB7  # x^32 + ... + 1, CRC-32's generator


def _reflect32(value: int) -> int:
    return int(f"{value:032b}"[::-1], 2)


def _mulmod(a: int, b: int) -> int:
    product = 0
    while b:
        if b & 1:
            product ^= a
        b >>= 1
        a <<= 1
        if a >> 32:
            a ^= _P
    return product


def _x_pow_mod(exponent: int) -> int:
    result, base = 1, 2  # 1 and x
    while exponent:
        if exponent & 1:
            result = _mulmod(result, base)
        base = _mulmod(base, base)
        exponent >>= 1
    return result


def reference_combine(crc1: int, crc2: int, length2: int) -> int:
    shifted = _mulmod(_reflect32(crc1), _x_pow_mod(8 * length2))
    return _reflect32(shifted) ^ crc2


# ------------------------------------------------------------------------------------------------ combine

LENGTHS = [0, 1, 2, 3, 4, 5, 7, 8, 9, 15, 16, 17, 31, 63, 64, 65, 255, 256, 1000, 1023, 4096, 4097, 65537]


@pytest.mark.parametrize("length2", LENGTHS)
def test_combine_matches_zlib_on_the_concatenation(length2: int) -> None:
    rng = random.Random(length2)
    for length1 in (0, 1, 3, 64, 1001):
        a, b = rng.randbytes(length1), rng.randbytes(length2)
        assert crc32_combine(zlib.crc32(a), zlib.crc32(b), length2) == zlib.crc32(a + b), (length1, length2)


def test_combine_of_many_pieces_is_the_crc_of_all_of_them() -> None:
    rng = random.Random(7)
    parts = [rng.randbytes(rng.choice([0, 1, 2, 5, 77, 4096, 9999])) for _ in range(40)]
    crc = 0
    for part in parts:
        crc = crc32_combine(crc, zlib.crc32(part), len(part))
    assert crc == zlib.crc32(b"".join(parts))


def test_combine_with_an_empty_second_part_keeps_the_first_crc() -> None:
    for crc in (0, 1, 0xFFFFFFFF, 0x12345678):
        assert crc32_combine(crc, 0, 0) == crc


def test_the_reference_model_agrees_with_zlib() -> None:
    # so that where zlib cannot run (the lengths below), agreeing with the model means agreeing with zlib
    rng = random.Random(3)
    for length2 in (0, 1, 2, 3, 9, 100, 4097):
        a, b = rng.randbytes(13), rng.randbytes(length2)
        assert reference_combine(zlib.crc32(a), zlib.crc32(b), length2) == zlib.crc32(a + b)


@pytest.mark.parametrize("length2", [
    2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**32 + 1, 5 * 2**30 + 7, 3 * 2**32 + 12345, 2**40 + 3, 2**63 - 1, 2**64 + 9,
])
def test_combine_over_gigabytes_matches_the_polynomial_model(length2: int) -> None:
    for crc1, crc2 in ((0, 0), (0xDEADBEEF, 0x01234567), (0xFFFFFFFF, 1)):
        assert crc32_combine(crc1, crc2, length2) == reference_combine(crc1, crc2, length2)


def test_combine_is_associative_at_large_lengths() -> None:
    # (a|b)|c == a|(b|c): the zip member of three shards does not depend on how they are grouped
    a, b, c = 0x1BADB002, 0xCAFEBABE, 0x8BADF00D
    lb, lc = 3 * 2**31 + 5, 2**33 + 1
    assert crc32_combine(crc32_combine(a, b, lb), c, lc) == crc32_combine(a, crc32_combine(b, c, lc), lb + lc)


def test_combine_refuses_a_negative_length() -> None:
    with pytest.raises(ValueError):
        crc32_combine(1, 2, -1)


def test_pieces_crc_needs_every_non_empty_piece_to_know_its_crc(tmp_path: Path) -> None:
    where = tmp_path / "x"
    a, b = b"hello ", b"world"
    known = [ByteRange(where, 0, len(a), zlib.crc32(a)), ByteRange(where, 9, 0, None), ByteRange(where, 6, len(b), zlib.crc32(b))]
    assert pieces_crc(known) == zlib.crc32(a + b)
    assert pieces_crc([known[0], ByteRange(where, 6, len(b), None)]) is None
    assert pieces_crc([]) == 0


# ------------------------------------------------------------------------------------------------ ZipWriter


def _sources(tmp_path: Path) -> tuple[list[ByteRange], bytes]:
    """Three pieces of two files (one empty, one odd-sized), with their CRCs, and their concatenation."""
    rng = random.Random(11)
    first, second = rng.randbytes(3 * 4096 + 5), rng.randbytes(70001)
    (tmp_path / "a.bin").write_bytes(b"junk" + first + b"tail")
    (tmp_path / "b.bin").write_bytes(second + b"more")
    pieces = [
        ByteRange(tmp_path / "a.bin", 4, len(first), zlib.crc32(first)),
        ByteRange(tmp_path / "b.bin", 0, 0, None),
        ByteRange(tmp_path / "b.bin", 0, len(second), zlib.crc32(second)),
    ]
    return pieces, first + second


def _write(path: Path, pieces: list[ByteRange]) -> list[tuple[int, int]]:
    regions: list[tuple[int, int]] = []
    with open(path, "w+b") as handle:
        writer = ZipWriter(handle, on_data=lambda offset, length: regions.append((offset, length)))
        writer.add_bytes("archive/data.pkl", b"not really a pickle")
        writer.add_pieces("archive/data/0", tuple(pieces))
        writer.add_bytes("archive/version", b"3\n")
        writer.close()
    return regions


def test_pieces_with_known_crcs_are_copied_by_the_kernel_under_their_combined_crc(tmp_path: Path,
                                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    pieces, expected = _sources(tmp_path)

    def no_streaming(*args, **kwargs):
        raise AssertionError("streamed although every piece's CRC was known")

    monkeypatch.setattr(copying, "stream_with_crc", no_streaming)
    regions = _write(tmp_path / "out.zip", pieces)
    with zipfile.ZipFile(tmp_path / "out.zip") as archive:
        assert archive.testzip() is None  # every member's bytes match its recorded CRC
        assert archive.getinfo("archive/data/0").CRC == zlib.crc32(expected)
        assert archive.read("archive/data/0") == expected
        assert archive.read("archive/version") == b"3\n"
    data = (tmp_path / "out.zip").read_bytes()
    member = regions[1:-1]  # the member's data, reported piece by piece (between data.pkl and version)
    offset = member[0][0]
    for (start, length), (following, _) in zip(member, member[1:]):
        assert start + length == following  # end to end, nothing skipped
    total = sum(length for _, length in member)
    assert offset % zipio.ALIGNMENT == 0 and data[offset : offset + total] == expected


def test_a_piece_without_a_crc_makes_the_member_stream_and_sum(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pieces, expected = _sources(tmp_path)
    pieces[2].crc32 = None
    streamed: list[int] = []
    original = copying.stream_with_crc

    def counting(*args, **kwargs):
        streamed.append(args[2])
        return original(*args, **kwargs)

    monkeypatch.setattr(copying, "stream_with_crc", counting)
    _write(tmp_path / "out.zip", pieces)
    assert sorted(streamed) == sorted(p.length for p in pieces if p.length)
    with zipfile.ZipFile(tmp_path / "out.zip") as archive:
        assert archive.testzip() is None
        assert archive.read("archive/data/0") == expected


# ------------------------------------------------------------------------------------------------ crc.crc32
def test_crc32_is_zlibs_on_every_kind_of_buffer() -> None:
    """ckptool.files.crc.crc32 (ISA-L's where installed) gives zlib.crc32's value: lengths around SIMD block
    sizes, running start values, bytes, bytearray, memoryview slices at odd offsets, typed views."""
    from ckptool.files import crc

    rng = random.Random(7)
    data = bytearray(rng.randbytes(1 << 17))
    view = memoryview(data)
    lengths = [0, 1, 2, 3, 7, 8, 15, 16, 17, 31, 63, 64, 65, 127, 128, 129, 255, 256, 257, 1023, 4096, 65537,
               len(data) - 5]
    for length in lengths:
        for start in (0, 1, 13):
            piece = view[start:start + length]
            for value in (0, 1, 0xFFFFFFFF, rng.getrandbits(32)):
                expected = zlib.crc32(piece, value)
                assert crc.crc32(piece, value) == expected
                assert crc.crc32(bytes(piece), value) == expected
                assert crc.crc32(bytearray(piece), value) == expected
    assert crc.crc32(view[:4096].cast("I"), 0) == zlib.crc32(view[:4096])  # a typed view sums its bytes
    assert crc.crc32(b"") == 0 and crc.crc32(b"", 5) == 5


def test_crc32_uses_isal_where_installed_and_zlib_when_told() -> None:
    """Where the isal package imports, its CRC is the one used (a silent fallback would cost a 1 GiB
    write a second of summing); CKPTOOL_CRC=zlib selects zlib's."""
    import subprocess
    import sys

    pytest.importorskip("isal", reason="isal has no wheel for this platform: zlib's CRC is used")
    code = "from ckptool.files import crc; print(crc.IMPLEMENTATION, crc.crc32.__module__)"
    env = {k: v for k, v in __import__("os").environ.items() if k != "CKPTOOL_CRC"}
    used = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True).stdout
    assert used.split()[0] == "isal" and "isal" in used.split()[1]
    told = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={**env, "CKPTOOL_CRC": "zlib"}, check=True).stdout
    assert told.split() == ["zlib", "zlib"]
