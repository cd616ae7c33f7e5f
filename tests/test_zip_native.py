"""The C loops of ``ckptool.native._zipfast`` give exactly what zipio's Python loops give.

Each C function is checked against its Python reference (``zipio._records_py``, ``_local_headers_py``,
``_members_py``, ``_fold_py``, ``_spans_py``) on the same input, and whole archives are read both
ways (``_directory``, ``list_members``, ``read_members``): the records, None, the Members and their
dicts, the problems, the exceptions and their messages must be equal, and of the same types. The
inputs: every zip of the repository's fixtures and of the public picklescan corpus, the hostile
corpus (tests/hostile.py), torch-written archives (many members, names in other scripts), zip64
archives, over 65,535 members, crafted extra fields and names, and seeded random mutations and
truncations of real central directories and archives.

Skipped where the extension is not built (``python -c "from setuptools import setup; setup()" build_ext
--inplace``); ``CKPTOOL_PURE_PYTHON=1`` does not skip these (they call both loops themselves).
"""

from __future__ import annotations

import importlib
import io
import os
import random
import struct
import subprocess
import sys
import warnings
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from ckptool.formats import zipio
from ckptool.formats.zipio import Member

sys.path.insert(0, str(Path(__file__).parent))
import hostile  # noqa: E402 — the corpus generator beside this file

try:
    native: Any = importlib.import_module("ckptool.native._zipfast")
except ImportError:
    native = None

needs_native = pytest.mark.skipif(native is None, reason="ckptool.native._zipfast is not built (no C compiler "
                                  "when installed; build it with: python -c \"from setuptools import setup; "
                                  "setup()\" build_ext --inplace)")
REPO = Path(__file__).resolve().parent.parent
PICKLESCAN = Path(os.environ.get("CKPTOOL_PICKLESCAN_CORPUS", "/work/shared/corpus/picklescan/tests"))
BENCH_100K = Path("/tmp/ckptool-bench/many-100000-v1.pt")  # bench/'s 100,000-tensor checkpoint, where it was made
MAX_VERSION = zipfile.MAX_EXTRACT_VERSION  # type: ignore[attr-defined]


# ------------------------------------------------------------------------------------------------
# comparing


def shape(value: Any) -> Any:
    """``value`` with every type spelled out: True and 1, a Member and a tuple, are not alike here."""
    if isinstance(value, zipio.Members):
        return ("Members", shape(list(value.items())), shape(list(value._folded.items())), sorted(value._shared),
                value.folded_alike, shape(value.entries), value.headers, value.path)
    if isinstance(value, zipio.Listing):
        return ("Listing", shape(value.members), shape(value.problems), shape(value.directory_start), value.headers)
    if isinstance(value, list) and len(value) > 100:  # tens of thousands of members: compared as they are
        return ("list", value, [(type(item), tuple(map(type, item))) if isinstance(item, tuple) else type(item)
                                for item in value])
    if isinstance(value, (tuple, list)):
        return (type(value).__name__, [shape(item) for item in value])
    if isinstance(value, dict):
        return ("dict", [shape(item) for item in value.items()])
    if isinstance(value, set):
        return ("set", sorted(value))
    return (type(value).__name__, value)


def outcome(call: Callable[[], Any]) -> Any:
    try:
        return "returned", shape(call())
    except Exception as error:  # noqa: BLE001 — the exception is part of the result compared
        return "raised", type(error).__name__, str(error)


class Declines:
    """The native module, noting each call it hands back to Python (NotImplemented)."""

    def __init__(self) -> None:
        self.declined: list[str] = []

    def __getattr__(self, name: str) -> Callable[..., Any]:
        function = getattr(native, name)

        def call(*args: Any) -> Any:
            result = function(*args)
            if result is NotImplemented:
                self.declined.append(name)
            return result
        return call


def both(call: Callable[[], Any], *, declines: bool = False) -> Any:
    """``call()``'s outcome with the C loops and with the Python loops, which must be equal."""
    saved = zipio._native
    spy = Declines()
    try:
        zipio._native = spy
        fast = outcome(call)
        zipio._native = None
        slow = outcome(call)
    finally:
        zipio._native = saved
    assert fast == slow
    if not declines:  # real files' values are all within what the C loops take
        assert spy.declined == []
    return fast


def compare_archive(data: bytes, path: Path = Path("archive.pt")) -> Any:
    """An archive's bytes read both ways: its directory, its listing and its members for loading."""
    handle = io.BytesIO(data)
    directory = both(lambda: zipio._directory(handle))
    listing = both(lambda: zipio.list_members(path, handle, size=len(data)))
    members = both(lambda: zipio.read_members(path, handle, size=len(data)))
    return directory, listing, members


def compare_file(path: Path) -> Any:
    with open(path, "rb") as handle:
        directory = both(lambda: zipio._directory(handle))
        listing = both(lambda: zipio.list_members(path, handle))
        members = both(lambda: zipio.read_members(path, handle))
    return directory, listing, members


def central_directory(data: bytes) -> tuple[bytes, int]:
    """An archive's central directory bytes, and the count of records it holds."""
    handle = io.BytesIO(data)
    endrec = zipfile._EndRecData(handle)  # type: ignore[attr-defined]
    size, offset = endrec[zipfile._ECD_SIZE], endrec[zipfile._ECD_OFFSET]  # type: ignore[attr-defined]
    return data[offset:offset + size], endrec[zipfile._ECD_ENTRIES_TOTAL]  # type: ignore[attr-defined]


def records_both(data: bytes, size_cd: int, concat: int, max_version: int = MAX_VERSION) -> Any:
    fast = native.records(data, size_cd, concat, max_version)
    assert fast is not NotImplemented
    saved = zipfile.MAX_EXTRACT_VERSION  # type: ignore[attr-defined]
    zipfile.MAX_EXTRACT_VERSION = max_version  # type: ignore[attr-defined]
    try:
        slow = zipio._records_py(data, size_cd, concat)
    finally:
        zipfile.MAX_EXTRACT_VERSION = saved  # type: ignore[attr-defined]
    assert shape(fast) == shape(slow), (data, size_cd, concat, max_version)
    return fast


# ------------------------------------------------------------------------------------------------
# archives to read


def torch_archive(obj: Any, folder: bytes = b"archive/") -> bytes:
    """``torch.save(obj)``'s bytes; its folder (torch names it ``archive``) renamed to ``folder``, 8 bytes."""
    import torch

    buffer = io.BytesIO()
    torch.save(obj, buffer)
    data = buffer.getvalue()
    if folder != b"archive/":
        assert len(folder) == 8 and data.count(b"archive/") == 2 * central_directory(data)[1]
        data = data.replace(b"archive/", folder)
    return data


def with_raw_names(tails: list[bytes], flags: int) -> bytes:
    """A zip (tests/hostile.py's writer) whose member names are ``archive/`` + each tail's raw bytes."""
    padded = [tail + b"_pad" for tail in tails]  # each placeholder is unique: 4 digits, then '#'
    placeholders = [f"{i:04d}".encode() + b"#" * (len(tail) - 4) for i, tail in enumerate(padded)]
    data = hostile.make_zip([hostile.Member("archive/" + placeholder.decode(), b"data", flags=flags)
                             for placeholder in placeholders])
    for placeholder, tail in zip(placeholders, padded):
        assert data.count(b"archive/" + placeholder) == 2  # its local header and its central record
        data = data.replace(b"archive/" + placeholder, b"archive/" + tail)
    return data


def as_zip64(data: bytes, *, fields: tuple[bool, bool, bool] = (True, True, True), pad: bytes = b"") -> bytes:
    """``data`` with each central record's sizes and offset (those ``fields`` pick) moved into a zip64
    extra field, as a writer of a > 4 GiB archive records them; ``pad`` after the field."""
    directory, count = central_directory(data)
    start = data.index(directory)
    out = bytearray()
    at = 0
    for _ in range(count):
        head = bytearray(directory[at:at + 46])
        name_length, extra_length, comment_length = struct.unpack_from("<3H", head, 28)
        rest = directory[at + 46:at + 46 + name_length + extra_length + comment_length]
        compress_size, file_size = struct.unpack_from("<2L", head, 20)
        offset, = struct.unpack_from("<L", head, 42)
        values = []
        if fields[0]:
            values.append(file_size)
            struct.pack_into("<L", head, 24, 0xFFFFFFFF)
        if fields[1]:
            values.append(compress_size)
            struct.pack_into("<L", head, 20, 0xFFFFFFFF)
        if fields[2]:
            values.append(offset)
            struct.pack_into("<L", head, 42, 0xFFFFFFFF)
        extra = struct.pack(f"<HH{len(values)}Q", 1, 8 * len(values), *values) + pad
        struct.pack_into("<H", head, 30, extra_length + len(extra))
        out += head + rest[:name_length] + rest[name_length:name_length + extra_length] + extra \
            + rest[name_length + extra_length:]
        at += 46 + name_length + extra_length + comment_length
    tail = bytearray(data[start + len(directory):])
    struct.pack_into("<L", tail, tail.rfind(b"PK\x05\x06") + 12, len(out))
    if tail.startswith(b"PK\x06\x06"):  # torch's archives end in zip64 records: the directory's size is there,
        struct.pack_into("<Q", tail, 40, len(out))  # and the locator's offset of the record moves with it
        locator = tail.rfind(b"PK\x06\x07")
        record_offset, = struct.unpack_from("<Q", tail, locator + 8)
        struct.pack_into("<Q", tail, locator + 8, record_offset + len(out) - len(directory))
        # consistent as zipfile checks it since 3.12.3 (directory offset + size == the record's offset)
        assert struct.unpack_from("<Q", tail, 48)[0] + len(out) == start + len(out), "zip64 record"
        assert struct.unpack_from("<Q", tail, locator + 8)[0] == start + len(out), "zip64 locator"
    return data[:start] + bytes(out) + bytes(tail)


def zipfile_archive(count: int, *, zip64: bool, comments: bool = False) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_STORED) as archive:
        for i in range(count):
            info = zipfile.ZipInfo(f"archive/data/{i}")
            if comments:
                info.comment = b"c" * (i % 7)
                info.extra = struct.pack("<HH", 0xCAFE, i % 5) + b"e" * (i % 5)
            with archive.open(info, "w", force_zip64=zip64) as member:
                member.write(bytes([i % 256]) * (i % 13))
    return buffer.getvalue()


@pytest.fixture(scope="module")
def hostile_corpus(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    root = tmp_path_factory.mktemp("hostile") / "corpus"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.jit's deprecation warnings
        hostile.build_corpus(root)
    return sorted(path for path in root.rglob("*") if path.is_file())


@pytest.fixture(scope="module")
def seeds() -> dict[str, bytes]:
    """Real archives whose directories and bytes are mutated."""
    import torch

    state = {"weight": torch.arange(6, dtype=torch.float32), "bias": torch.tensor([7, -8])}
    cp437_tails = [bytes(range(128, 160)), b"\x00hidden", b"A\x00B", bytes(range(1, 32)), bytes(range(224, 256))]
    return {
        "torch": torch_archive(state),
        "torch_unicode_folder": torch_archive(state, "ΩChive/".encode()),
        "hostile_good": hostile.good_zip(),
        "cp437_names": with_raw_names(cp437_tails, flags=0),
        "utf8_names": with_raw_names([name.encode() for name in ("é", "ΩMEGA", "😀", "a\0b", "Ab")], flags=0x800),
        "zip64": as_zip64(torch_archive(state)),
        "zip64_partial": as_zip64(hostile.good_zip(), fields=(False, True, True), pad=b"\x46\x42\x02\x00zz"),
        "zipfile_zip64_comments": zipfile_archive(12, zip64=True, comments=True),
    }


# ------------------------------------------------------------------------------------------------
# whole archives


def test_pure_python_is_forced_by_the_environment() -> None:
    environment = dict(os.environ, CKPTOOL_PURE_PYTHON="1", PYTHONPATH=str(REPO))
    code = "from ckptool.formats import zipio; print(zipio.NATIVE, zipio._native)"
    out = subprocess.run([sys.executable, "-c", code], env=environment, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "None"]


@needs_native
def test_the_native_loops_are_used_when_built() -> None:
    environment = {key: value for key, value in os.environ.items() if key != "CKPTOOL_PURE_PYTHON"}
    environment["PYTHONPATH"] = str(REPO)
    code = "from ckptool.formats import zipio; print(zipio.NATIVE, zipio._native.__name__)"
    out = subprocess.run([sys.executable, "-c", code], env=environment, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["True", "ckptool.native._zipfast"]


@needs_native
def test_every_fixture_and_picklescan_file_reads_alike() -> None:
    files = sorted(path for path in (REPO / "fixtures").rglob("*") if path.is_file())
    if PICKLESCAN.is_dir():
        files += sorted(path for path in PICKLESCAN.rglob("*") if path.is_file())
    read = 0
    for path in files:
        with open(path, "rb") as handle:
            if handle.read(4) != b"PK\x03\x04" and not zipfile.is_zipfile(path):
                continue
        compare_file(path)
        read += 1
    assert read >= 20


@needs_native
def test_the_hostile_corpus_reads_alike(hostile_corpus: list[Path]) -> None:
    zips = [path for path in hostile_corpus if zipfile.is_zipfile(path) or path.read_bytes()[:2] == b"PK"]
    assert len(zips) >= 100
    refused = 0
    for path in zips:
        _, _, members = compare_file(path)
        refused += members[0] == "raised"
    assert refused >= 5  # the zip tricks are refused, alike


@needs_native
def test_the_zip_tricks_of_the_other_tests_read_alike() -> None:
    import test_zip_like_torch as tricks

    for change in tricks.HOSTILE.values():
        members = tricks.saved_members(tricks.STATE)
        change(members, tricks.payload(Path("/nonexistent/canary")))
        compare_archive(hostile.make_zip(members))
    for benign in tricks.BENIGN.values():
        members = tricks.saved_members(tricks.STATE)
        benign(members)
        compare_archive(hostile.make_zip(members))


@needs_native
def test_torch_archives_with_many_members_and_unicode_names() -> None:
    import torch

    state = {f"layer.{i}.weight": torch.full((i % 3,), float(i)) for i in range(3000)}
    for folder in ("archive/", "ΩChive/", "ARCHIVE/", "😀Chi/", "ΩChié/"):
        _, listing, members = compare_archive(torch_archive(state, folder.encode()))
        assert listing[0] == members[0] == "returned"
        assert len(listing[1][1][1]) > 3000  # every storage's member listed


@needs_native
def test_names_in_cp437_in_utf8_and_cut_at_nul(seeds: dict[str, bytes]) -> None:
    every_byte = [bytes([b]) * 3 for b in range(1, 256)]
    for data in (seeds["cp437_names"], seeds["utf8_names"], with_raw_names(every_byte, flags=0)):
        _, listing, _ = compare_archive(data)
        assert listing[0] == "returned"
    listing = compare_archive(seeds["cp437_names"])[1]
    names = [member[1][0][1] for member in listing[1][1][1]]
    assert "archive/" in names and "archive/A" in names  # cut at the NUL, as zipfile cuts
    assert any("Ç" in name for name in names)  # 0x80 in cp437
    # bytes that are not UTF-8 under the UTF-8 flag: refused alike (zipfile's own message)
    bad = with_raw_names([b"ok", b"\xff\xfe", b"\xed\xa0\x80"], flags=0x800)
    _, listing, members = compare_archive(bad)
    assert listing[0] == "raised" and "codec can't decode" in listing[2]


@needs_native
def test_zip64_archives(seeds: dict[str, bytes]) -> None:
    for name in ("zip64", "zip64_partial", "zipfile_zip64_comments"):
        _, listing, members = compare_archive(seeds[name])
        assert listing[0] == members[0] == "returned" and listing[1][2] == ("list", [])  # nothing refused
    # the zip64 values decoded are the real ones: the same members as the plain archive
    assert compare_archive(seeds["zip64"])[1] == compare_archive(seeds["torch"])[1]


@needs_native
def test_more_than_65535_members() -> None:
    buffer = io.BytesIO()
    writer = zipio.ZipWriter(buffer)
    writer.add_bytes("archive/data.pkl", hostile.whole(hostile.integer(1)))
    for i in range(70_000):
        writer.add_bytes(f"archive/data/{i}", b"", crc=0)
    writer.close()
    data = buffer.getvalue()
    assert zipfile._EndRecData(io.BytesIO(data))[0] == zipfile.stringEndArchive64  # type: ignore[attr-defined]
    _, listing, members = compare_archive(data)
    assert members[0] == "returned" and len(listing[1][1][1]) == 70_001


@needs_native
@pytest.mark.skipif(not BENCH_100K.is_file(), reason=f"{BENCH_100K} not made (python -m bench makes it)")
def test_the_100000_tensor_benchmark_checkpoint() -> None:
    _, listing, members = compare_file(BENCH_100K)
    assert members[0] == "returned" and len(listing[1][1][1]) > 100_000


# ------------------------------------------------------------------------------------------------
# the central directory: crafted and mutated


def central_record(name: bytes, *, flags: int = 0x800, version: int = 20, sizes: tuple[int, int] = (5, 5),
                   offset: int = 0, extra: bytes = b"", comment: bytes = b"", lengths: tuple[int, int, int] | None = None
                   ) -> bytes:
    name_length, extra_length, comment_length = lengths or (len(name), len(extra), len(comment))
    return struct.pack("<4s4B4HL2L5H2L", b"PK\x01\x02", 20, 3, version, 0, flags, 0, 0, 0, 0x12345678, sizes[0],
                       sizes[1], name_length, extra_length, comment_length, 0, 0, 0, offset) + name + extra + comment


@needs_native
def test_zip64_extra_fields_decode_alike() -> None:
    """Every arrangement of zip64 fields, lengths and markers: decoded, or refused, alike."""
    marks = (0x1234, 0xFFFFFFFF)
    values = [struct.pack("<Q", value) for value in (7, 0xFFFFFFFF, 0xFFFF_FFFF_FFFF_FFFF, 1 << 40)]
    cases = 0
    for file_size in marks:
        for compress_size in marks:
            for offset in (0, 0xFFFFFFFF):
                for count in range(4):
                    for cut in (0, 1, 5, 8):
                        for value in values:
                            payload = (value * count)[:max(0, 8 * count - cut)]
                            blocks = [struct.pack("<HH", 1, len(payload)) + payload,
                                      struct.pack("<HH", 1, len(payload) + cut) + payload,  # oversized: refused
                                      struct.pack("<HH", 0xCAFE, 2) + b"zz" + struct.pack("<HH", 1, len(payload))
                                      + payload + b"\x01",  # a foreign field first, a stray byte after
                                      # a second zip64 field: read again where the first left a marker
                                      struct.pack("<HH", 1, len(payload)) + payload + struct.pack("<HH", 1, 24)
                                      + struct.pack("<3Q", 12345, 0xFFFFFFFF, 678),
                                      struct.pack("<HH", 1, len(payload)) + payload + b"\x01\x00\x08"]
                            for extra in blocks:
                                record = central_record(b"archive/x", sizes=(compress_size, file_size), offset=offset,
                                                        extra=extra)
                                for concat in (0, 3, -2):
                                    records_both(record * 2, 2 * len(record), concat)
                                    cases += 1
    assert cases > 5000


@needs_native
def test_names_lengths_versions_and_short_directories() -> None:
    names = [b"", b"a", b"\x00", b"ab\x00cd", b"\x00\x00", "é😀".encode(), b"\xff\xfe", b"\xc3", b"\xed\xa0\x80",
             bytes(range(256)), b"A" * 300]
    for name in names:
        for flags in (0, 0x800, 0x801, 0xFFFF):
            for version in (0, 45, 63, 64, 255):
                record = central_record(name, flags=flags, version=version, comment=b"note")
                for size_cd in (0, 1, 45, 46, len(record) - 1, len(record), len(record) + 1, 2 * len(record),
                                (1 << 64) - 1):
                    records_both(record + record[:20], size_cd, 0)
                for max_version in (0, 45, 255):
                    records_both(record, len(record), 0, max_version)
    # lengths past the end of the bytes: zipfile's short reads, a record that then cannot be read
    record = central_record(b"archive/x", lengths=(60000, 60000, 60000))
    for size_cd in (46, 47, 10**6, 1 << 63):
        records_both(record, size_cd, 0)
    for concat in (-(1 << 70), -(1 << 64), -1, 1 << 63, 1 << 64, 1 << 80):
        records_both(central_record(b"a", offset=0xFFFFFFFF) * 3, 3 * 47, concat)


MUTATIONS = ("byte", "field", "truncate", "splice", "insert", "flag")
# a central record's fields (offset, width): version, flags, method, sizes, the three lengths, the offset
FIELDS = ((6, 1), (8, 2), (10, 2), (20, 4), (24, 4), (28, 2), (30, 2), (32, 2), (42, 4))


def mutate(rng: random.Random, data: bytes, starts: list[int]) -> bytes:
    out = bytearray(data)
    for _ in range(rng.randint(1, 3)):
        kind = rng.choice(MUTATIONS)
        if not out:
            return bytes(out)
        if kind == "byte":
            out[rng.randrange(len(out))] = rng.randrange(256)
        elif kind == "field" and starts:
            field, width = rng.choice(FIELDS)
            at = rng.choice(starts) + field
            value = rng.choice((0, 1, 0x800, 0xFF, 0xFFFF, 0xFFFFFFFF, rng.randrange(1 << 32)))
            if 0 <= at and at + width <= len(out):
                out[at:at + width] = (value & ((1 << 8 * width) - 1)).to_bytes(width, "little")
        elif kind == "truncate":
            del out[rng.randrange(len(out)):]
        elif kind == "splice":
            a, b = sorted(rng.randrange(len(out) + 1) for _ in range(2))
            at = rng.randrange(len(out) + 1)
            out[at:at] = out[a:b]
        elif kind == "insert":
            at = rng.randrange(len(out) + 1)
            out[at:at] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 12)))
        elif kind == "flag" and starts:
            at = rng.choice(starts) + 8
            if at + 1 < len(out):
                out[at + 1] ^= 0x08  # the UTF-8 flag
    return bytes(out)


def record_starts(directory: bytes, count: int) -> list[int]:
    starts, at = [], 0
    for _ in range(count):
        starts.append(at)
        at += 46 + sum(struct.unpack_from("<3H", directory, at + 28))
    return starts


@needs_native
def test_mutated_central_directories(seeds: dict[str, bytes]) -> None:
    rng = random.Random(20261126)  # fixed: the same cases every run
    directories = [central_directory(data) for data in seeds.values()]
    refused = read = 0
    for trial in range(6000):
        directory, count = rng.choice(directories)
        data = mutate(rng, directory, record_starts(directory, count))
        size_cd = rng.choice((len(data), len(data), len(directory), rng.randrange(len(data) + 64)))
        concat = rng.choice((0, 0, 0, rng.randrange(-5000, 5000), 1 << 64, -(1 << 66)))
        if records_both(data, size_cd, concat) is None:
            refused += 1
        else:
            read += 1
    assert refused > 500 and read > 500  # both outcomes reached often


@needs_native
def test_mutated_and_truncated_archives(seeds: dict[str, bytes]) -> None:
    rng = random.Random(1126)
    archives = list(seeds.values())
    outcomes = set()
    for trial in range(700):
        data = rng.choice(archives)
        directory, count = central_directory(data)
        start = data.index(directory)
        if rng.random() < 0.2:
            data = data[:rng.randrange(len(data))]
        else:
            starts = [start + at for at in record_starts(directory, count)]
            if rng.random() < 0.3:
                starts = [at - start for at in starts]  # fields of local headers, where offsets lie differently
            data = mutate(rng, data, starts)
        handle = io.BytesIO(data)
        directory_outcome = both(lambda: zipio._directory(handle), declines=True)
        listing = both(lambda: zipio.list_members(Path("m.pt"), handle, size=len(data)), declines=True)
        members = both(lambda: zipio.read_members(Path("m.pt"), handle, size=len(data)), declines=True)
        outcomes.add((directory_outcome[0], listing[0], members[0]))
    assert len(outcomes) >= 3


# ------------------------------------------------------------------------------------------------
# local headers, members, folding, spans: the other loops against their references


class Logged(io.BytesIO):
    """A file whose seeks and reads are written down."""

    def __init__(self, data: bytes, log: list[tuple], fail_after: int | None = None,
                 kind: type = bytes) -> None:
        super().__init__(data)
        self.log, self.fail_after, self.kind = log, fail_after, kind

    def seek(self, position: int, whence: int = 0) -> int:
        self.log.append(("seek", position, whence))
        return super().seek(position, whence)

    def read(self, size: int | None = -1) -> Any:  # type: ignore[override]
        self.log.append(("read", size))
        if self.fail_after is not None and sum(entry[0] == "read" for entry in self.log) > self.fail_after:
            raise OSError(5, "Input/output error")
        return self.kind(super().read(size))


@needs_native
def test_local_headers_read_alike(seeds: dict[str, bytes], monkeypatch: pytest.MonkeyPatch) -> None:
    rng = random.Random(7)
    for trial in range(400):
        data = bytearray(rng.choice(list(seeds.values())))
        directory = central_directory(bytes(data))[0]
        offsets = [record[2] for record in zipio._records_py(directory, len(directory), 0)]
        for _ in range(rng.randint(0, 4)):  # a broken signature or two
            data[rng.randrange(len(data))] = rng.randrange(256)
        offsets += [rng.choice((-1, -(1 << 70), 1 << 64, len(data) - 30, len(data) - 29, rng.randrange(len(data) + 40)))
                    for _ in range(rng.randint(0, 6))]
        rng.shuffle(offsets)
        offsets += offsets[:rng.randint(0, 3)]  # duplicates
        window = rng.choice((30, 31, 64, 200, 1 << 20))
        file_size = rng.choice((len(data), len(data) - rng.randint(0, 40), len(data) + 100))
        monkeypatch.setattr(zipio, "_LOCAL_WINDOW", window)
        fail_after = rng.choice((None, None, None, 0, 1, 2))
        logs: list[list[tuple]] = [[], []]
        results = []
        for log, function in zip(logs, (zipio._local_headers, zipio._local_headers_py)):
            handle = Logged(bytes(data), log, fail_after)
            saved = zipio._native
            zipio._native = native
            try:
                results.append(outcome(lambda: function(handle, list(offsets), file_size)))
            finally:
                zipio._native = saved
        assert results[0] == results[1] and logs[0] == logs[1], trial  # the same reads, the same answers
    # a file cut inside a local header, or its signature only, claiming its whole length
    for data in seeds.values():
        directory = central_directory(data)[0]
        offsets = [record[2] for record in zipio._records_py(directory, len(directory), 0)]
        for offset in offsets[1:4]:
            for keep in (3, 4, 26, 28, 29, 30):
                cut = data[:offset + keep]
                for window in (30, 1 << 20):
                    monkeypatch.setattr(zipio, "_LOCAL_WINDOW", window)
                    assert native.local_headers(io.BytesIO(cut), offsets, len(data), window) \
                        == zipio._local_headers_py(io.BytesIO(cut), offsets, len(data))
    # a handle whose read is not bytes: the C loop hands it to Python, which reads it again
    data = seeds["torch"]
    directory = central_directory(data)[0]
    offsets = [record[2] for record in zipio._records_py(directory, len(directory), 0)]
    assert native.local_headers(Logged(data, [], kind=bytearray), offsets, len(data), 1 << 20) is NotImplemented
    placed = both(lambda: zipio._local_headers(Logged(data, [], kind=bytearray), offsets, len(data)), declines=True)
    assert placed == outcome(lambda: zipio._local_headers_py(io.BytesIO(data), offsets, len(data)))
    assert ("NoneType", None) not in placed[1][1]


def random_records(rng: random.Random, count: int) -> list[tuple]:
    big = (-(1 << 70), -(1 << 63) - 1, -1, 0, 1 << 62, (1 << 63) - 1, 1 << 63, 1 << 64, 1 << 70)
    records = []
    for i in range(count):
        def value(small: int) -> int:
            return rng.choice(big) if rng.random() < 0.08 else rng.randrange(small)
        records.append((rng.choice(("a", "B", "é", "a\udcff")) + str(i), b"raw%d" % i, value(3000), value(400),
                        value(400), value(1 << 32), rng.choice((0, 1, 0x800, 0x801, 1 << 70, -1, -2)),
                        rng.choice((0, 8, 12, 1 << 65, -1))))
    return records


@needs_native
def test_members_are_made_alike() -> None:
    rng = random.Random(99)
    for trial in range(1500):
        records = random_records(rng, rng.randint(0, 12))
        headers = [rng.choice((None, 0, 4, 100, 131070)) for _ in records]
        file_size = rng.choice((0, 29, 30, 500, 3000, 4000, 1 << 62, (1 << 62) + 1, 1 << 64, -5))
        fast = outcome(lambda: native.members(records, headers, file_size, Member))
        slow = outcome(lambda: zipio._members_py(records, headers, file_size))
        if fast != ("returned", ("NotImplementedType", NotImplemented)):
            assert fast == slow, (records, headers, file_size)
        assert both(lambda: zipio._members(records, headers, file_size), declines=True) == slow
    # in range: the C loop takes them all
    records = [(f"n{i}", b"n", i * 40, 10, 10, 0, i % 2, (0, 8)[i % 2]) for i in range(50)]
    assert native.members(records, [i % 3 or None for i in range(50)], 1500, Member) is not NotImplemented
    # at the edges: a header or a member's bytes ending exactly at the end of the file, or a byte past it
    for header_offset, header, stored in ((0, 0, 0), (100, 7, 50), (1 << 40, 131070, 1 << 41)):
        record = ("edge", b"edge", header_offset, stored, stored, 0, 0, 0)
        for file_size in (header_offset + 29, header_offset + 30, header_offset + 30 + header + stored - 1,
                          header_offset + 30 + header + stored, header_offset + 31 + header + stored):
            fast = native.members([record], [header], file_size, Member)
            assert shape(fast) == shape(zipio._members_py([record], [header], file_size)), (record, file_size)


def random_members(rng: random.Random, count: int, names: list[str]) -> list[Member]:
    members = []
    for i in range(count):
        header_offset = rng.choice((rng.randrange(0, 400, 10), rng.randrange(400), 1 << 63, -(1 << 64)))
        size = rng.randrange(60)
        stored = rng.choice((size, size, size, size + 1, rng.randrange(60), 1 << 64))
        data_offset = rng.choice((zipio.NOT_READ, header_offset + 30, header_offset + 31, rng.randrange(500),
                                  -rng.randrange(2, 50)))
        members.append(Member(rng.choice(names), data_offset, size, 0, rng.random() < 0.2, stored, header_offset,
                              rng.random() < 0.03, 0, b""))
    return members


@needs_native
def test_spans_are_judged_alike() -> None:
    rng = random.Random(5)
    names = ["a", "b", "A", "é", "Ω", "😀", "data.pkl", "z\0"]
    kinds = set()
    for trial in range(4000):
        entries = random_members(rng, rng.randint(0, 8), names)
        start = rng.choice((0, 100, 400, 1 << 20, 1 << 64))
        result = both(lambda: zipio._spans(entries, start), declines=True)
        kinds.add(result[1][1][0][1] if result[1][0] == "tuple" else None)
    assert kinds == {None, 0, 1, 2, 3}  # every refusal reached, and acceptance
    # ties in offset and end: the names decide which pair is named, as Python's tuple order does
    for order in ([("b", 0), ("a", 0), ("c", 100)], [("ü", 0), ("u", 0)], [("😀", 5), ("Ω", 5), ("a", 5)]):
        entries = [Member(name, offset + 30, 10, 0, False, 10, offset, False, 0, b"") for name, offset in order]
        assert both(lambda: zipio._spans(entries, 1000))[1][0] == "tuple"


@needs_native
def test_members_are_folded_alike() -> None:
    rng = random.Random(3)
    stems = ["archive/data.pkl", "archive/DATA.pkl", "Archive/Data.PKL", "archive/é", "ARCHIVE/É", "archive/ΩΣ",
             "ARCHIVE/ΩΣ", "archive/😀X", "archive/😀x", "ÿZ", "ÿz", "a", "A", ""]
    for trial in range(1500):
        entries = [Member(rng.choice(stems), i, 0, 0, False, 0, i, False, 0, b"") for i in range(rng.randint(0, 10))]
        both(lambda: zipio.Members(Path("f.pt"), entries))
        name = rng.choice(stems)
        both(lambda: zipio.Members(Path("f.pt"), entries).get(name))  # the member torch reads, found alike
    # the folded dict holds each folded name's first member, by identity
    entries = [Member(name, i, 0, 0, False, 0, i, False, 0, b"") for i, name in enumerate(stems)]
    saved = zipio._native
    try:
        zipio._native = native
        folded = zipio.Members(Path("f.pt"), entries)
    finally:
        zipio._native = saved
    assert folded._folded["archive/data.pkl"] is entries[0] and folded._folded["archive/ΩΣ"] is entries[5]
    assert folded._folded["archive/😀x"] is entries[7] and folded._folded["ÿz"] is entries[9]
    assert folded._shared == {"archive/data.pkl", "archive/ΩΣ", "archive/😀x", "ÿz", "a"}  # é and É: not ASCII
    # not a list of Members: the Python loop
    assert native.fold({}, [("a",)], Member, {}, set()) is NotImplemented


@needs_native
def test_nothing_is_leaked(seeds: dict[str, bytes]) -> None:
    """The C loops free what they make on every path, refusals and errors included."""
    data = seeds["utf8_names"]
    directory = central_directory(data)[0]
    bad_utf8 = central_record(b"\xff", flags=0x800)
    bad_extra = central_record(b"x", sizes=(0xFFFFFFFF, 0xFFFFFFFF), extra=b"\x01\x00\x04\x00abcd")
    records = zipio._records_py(directory, len(directory), 0)
    offsets = [record[2] for record in records]
    headers = zipio._local_headers_py(io.BytesIO(data), offsets, len(data))
    found, _ = zipio._members_py(records, headers, len(data))
    overlapping = [Member("a", 30, 10, 0, False, 10, 0, False, 0, b""), Member("b", 35, 10, 0, False, 10, 5, False, 0,
                                                                                 b"")]

    def work() -> None:
        native.records(directory, len(directory), 0, MAX_VERSION)
        native.records(directory, len(directory), -(1 << 70), MAX_VERSION)
        native.records(directory + bad_utf8, len(directory) + len(bad_utf8), 0, MAX_VERSION)
        native.records(directory + bad_extra, len(directory) + len(bad_extra), 0, MAX_VERSION)
        native.local_headers(io.BytesIO(data), offsets, len(data), 64)
        native.local_headers(io.BytesIO(data), offsets, len(data), 1 << 20)
        try:
            native.local_headers(Logged(data, [], fail_after=1), offsets, len(data), 64)
        except OSError:
            pass
        native.local_headers(Logged(data, [], kind=bytearray), offsets, len(data), 64)
        native.members(records, headers, len(data), Member)
        native.members(records, headers, 10, Member)
        native.fold({}, found, Member, {}, set())
        native.fold({}, found + found, Member, {}, set())
        native.spans(found, Member, len(data), -1)
        native.spans(overlapping, Member, 100, -1)
        native.spans(found, Member, 0, -1)

    for _ in range(20):
        work()
    before = sys.getallocatedblocks()
    for _ in range(300):
        work()
    assert sys.getallocatedblocks() - before < 300  # a leak per call would be 300 blocks or more


@needs_native
def test_the_headers_and_directory_a_write_makes_are_made_alike() -> None:
    """What ZipWriter writes for its members, in C (local_headers_for, central_directory) against the Python loops
    (_headers_for_py, _central_directory_py): drawn names (non-ASCII, empty, long), sizes and offsets around the
    zip64 limits, CRCs to 2**32 - 1, positions at every alignment; the same bytes, offsets and flags. What the C
    loops do not write themselves (a lone surrogate, a CRC or name past the format, a float) they hand back as
    NotImplemented, and the Python loop decides."""
    rng = random.Random(20261127)
    alphabet = ["a", "é", "/", "data", "😀", "\x00", "Z" * 40]
    edges = [0, 1, 63, 64, 0xFFFFFFFE, 0xFFFFFFFF, 0x100000000, 2**40]
    declined = 0
    for _ in range(3000):
        count = rng.randint(0, 6)
        names = ["".join(rng.choice(alphabet) for _ in range(rng.randint(0, 5))) for _ in range(count)]
        sizes = [rng.choice(edges) if rng.random() < 0.3 else rng.randint(0, 5000) for _ in range(count)]
        crcs = [rng.choice([0, 1, 0xFFFFFFFF, rng.getrandbits(32)]) for _ in range(count)]
        position = rng.choice([0, 13, 64, rng.randint(0, 1 << 20), 0xFFFFFFF0])
        if count and rng.random() < 0.05:  # what the C loop hands back
            bend = rng.randrange(4)
            if bend == 0:
                names[0] = "x\ud800"
            elif bend == 1:
                crcs[0] = 1 << 32
            elif bend == 2:
                names[0] = "n" * 70000
            else:
                sizes[0] = 1.0
        try:
            expected: Any = zipio._headers_for_py(names, sizes, crcs, position)
        except (UnicodeEncodeError, struct.error, TypeError) as e:
            expected = type(e)
        got = native.local_headers_for(names, sizes, crcs, position, zipio.ALIGNMENT)
        if got is NotImplemented:
            declined += 1
        else:
            assert shape(got) == shape(expected)
            headers, encoded, offsets, _ = got
            assert all((len(header) + offset) % zipio.ALIGNMENT == 0 for header, offset in zip(headers, offsets))
            entries = list(zip(encoded, [offset + rng.choice([0, 0, 0xFFFFFFFF]) for offset in offsets], sizes, crcs))
            assert shape(native.central_directory(entries)) == shape(zipio._central_directory_py(entries))
    assert 50 < declined < 500


@needs_native
def test_whether_names_start_with_a_prefix_is_said_alike() -> None:
    """``starting`` (an archive's single folder, a TorchScript code folder) in C against all()/any() of
    str.startswith: drawn names of one-, two- and four-byte characters, a dict's keys or a list, prefixes empty,
    longer than the names or a name's own; anything but a dict or list of exact str is handed back."""
    rng = random.Random(27)
    alphabet = ["a", "A", "/", "é", "λ", "😀", "data"]
    for _ in range(4000):
        names = ["".join(rng.choice(alphabet) for _ in range(rng.randint(0, 4))) for _ in range(rng.randint(0, 6))]
        prefix = rng.choice(names) if names and rng.random() < 0.3 else \
            "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 3)))
        if names and rng.random() < 0.4:  # most names under one folder
            names = [prefix + name if rng.random() < 0.9 else name for name in names]
        for every in (True, False):
            tests = map(str.startswith, names, [prefix] * len(names))
            expected = all(tests) if every else any(tests)
            assert native.starting(names, prefix, every) is expected
            assert native.starting(dict.fromkeys(names), prefix, every) is expected
            assert zipio.starting(names, prefix, every=every) is expected
    assert native.starting(("a",), "a", True) is NotImplemented and native.starting([b"a"], "a", True) is NotImplemented
    assert native.starting({1: 0}, "a", False) is NotImplemented
    with pytest.raises(TypeError):
        zipio.starting([b"a"], "a", every=True)
