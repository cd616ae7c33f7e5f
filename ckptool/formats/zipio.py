"""A minimal, validating zip layer for torch archives: read the directory (the writer: :mod:`.zip_writer`).

The central directory is read exactly as Python's ``zipfile`` reads it (in one pass over its
bytes, ``zipfile`` itself for a directory that pass refuses); this module adds what a checkpoint reader
needs on top — the exact offset of each member's bytes (so storages are copied raw), members
located as PyTorch's reader locates them (by the central directory, names compared ignoring ASCII
case, of duplicates the one its zip library's sort and search reach), checks against zip tricks (overlapping
members, size lies,
encryption). The writer's names (:class:`ZipWriter`, :data:`ALIGNMENT`) are importable from here too.
"""

from __future__ import annotations

import weakref
import zipfile
import zlib
from collections.abc import Iterable
from dataclasses import dataclass
from itertools import repeat
from pathlib import Path
from typing import Any, BinaryIO, NamedTuple

from ckptool.base.errors import InputError
from ckptool.base.gcpause import paused
from ckptool.files.byteio import file_size as handle_size
from ckptool.files.byteio import is_remote

# the copy engine and CRC combining live in ckptool.files.copying, the writer in .zip_writer; these names are
# imported from here too
from ckptool.files.copying import SMALL_MEMBER, DataOut, copy_reporting, crc32_combine, pieces_crc  # noqa: F401
from ckptool.formats.zip_directory import LOCAL_HEADER as _LOCAL_HEADER
from ckptool.formats.zip_directory import LOCAL_SIG as _LOCAL_SIG
from ckptool.formats.zip_directory import directory as _directory
from ckptool.formats.zip_writer import ALIGNMENT, ZipWriter  # noqa: F401

# deflate reaches ~1000:1 on zeros; real pickles compress 2-5:1 (100k tensors: 4.7:1). The bound is
# tight because a pickle's cost is per byte of opcodes: 85:1 let a 3 MB file take minutes to read.
MAX_COMPRESSION_RATIO = 16
MAX_DUPLICATE_SORT = 100_000  # members: above it, which duplicate torch reads is not worked out (seconds in Python)


class Member(NamedTuple):
    """One stored zip member: where its bytes lie in the file (a tuple: an archive lists 100,000 of them)."""

    name: str
    data_offset: int
    size: int
    crc32: int
    compressed: bool
    stored_size: int = -1  # bytes in the archive (less than ``size`` when compressed)
    header_offset: int = -1
    encrypted: bool = False
    compression_method: int = 0
    raw_name: bytes = b""  # the name's bytes in the central directory, as miniz compares them


@dataclass(frozen=True)
class Listing:
    """What the central directory lists: the members located, why others were not, where it starts."""

    members: list[Member]
    problems: list[str]
    directory_start: int
    headers: LocalHeaders | None = None  # a remote archive's: its members are placed when first read


NOT_READ = -1  # the data offset of a remote archive's member whose local header is not read yet
_HEADERS: weakref.WeakKeyDictionary[Any, LocalHeaders] = weakref.WeakKeyDictionary()  # remote handle -> its


class LocalHeaders:
    """A remote archive's local headers, read when a member's data offset is first needed.

    Reading each header while listing would cost a request per member, scattered over the file;
    ``inspect`` needs only the pickle's, which lies in the window already read. A member listed with
    :data:`NOT_READ` is placed on first use (:func:`data_offset`) with the checks the listing and
    :func:`read_members` make of a local file, raised then; a header not in a window yet is fetched
    together with every other unread one, as parallel ranges.
    """

    def __init__(self, path: Path, handle: Any, file_size: int) -> None:  # handle: a RemoteFile
        self.path = path
        self.handle = handle
        self.file_size = file_size
        self.members: list[Member] = []
        self.offsets: dict[int, int] = {}  # header offset -> data offset, once read and checked
        self.limits: dict[int, tuple[int, str]] = {}  # header offset -> (where the data must end, the refusal past it)

    def resolve(self, member: Member) -> int:
        placed = self.offsets.get(member.header_offset)
        if placed is not None:
            return placed
        raw = self.handle.cached(member.header_offset, _LOCAL_HEADER.size)
        if raw is None:  # fetch every unread header not in a window, at once
            batch = [m for m in self.members if m.header_offset not in self.offsets]
            for other, data in zip(
                batch, self.handle.pread_ranges([(m.header_offset, _LOCAL_HEADER.size) for m in batch])
            ):
                if other.header_offset == member.header_offset:
                    raw = data
                else:
                    self._place(other, data, raise_=False)
        placed = self._place(member, raw or b"", raise_=True)
        assert placed is not None
        return placed

    def _place(self, member: Member, raw: bytes, *, raise_: bool) -> int | None:
        problem, offset = None, None
        fields = _LOCAL_HEADER.unpack(raw) if len(raw) == _LOCAL_HEADER.size else None
        if fields is None or fields[0] != _LOCAL_SIG:
            problem = f"zip member {member.name!r} has no local header — the archive is corrupt"
        else:
            offset = member.header_offset + _LOCAL_HEADER.size + fields[9] + fields[10]
            limit = self.limits.get(member.header_offset)
            if offset + member.stored_size > self.file_size:
                problem = f"zip member {member.name!r} ends past the end of the file — the file is truncated"
            elif limit is not None and offset + member.stored_size > limit[0]:
                problem = limit[1]
        if problem is None:
            self.offsets[member.header_offset] = offset  # type: ignore[assignment]
            return offset
        if raise_:
            raise InputError(problem, path=self.path)
        return None

    def bound(self, directory_start: int) -> None:
        """Where each member's bytes must end (the next member's header, or the directory), and the
        refusal past it: the overlap checks :func:`read_members` makes of a local archive."""
        order = sorted(
            self.members, key=lambda m: (m.header_offset, m.header_offset + _LOCAL_HEADER.size + m.stored_size, m.name)
        )
        for member, following in zip(order, order[1:]):
            self.limits[member.header_offset] = (
                following.header_offset,
                f"zip members {member.name!r} and {following.name!r} overlap — refusing a zip bomb",
            )
        if order:
            self.limits[order[-1].header_offset] = (
                directory_start,
                f"zip member {order[-1].name!r} overlaps the central directory — the archive is corrupt",
            )


def data_offset(handle: Any, member: Member) -> int:
    """Where ``member``'s bytes start in the archive ``handle`` reads: as listed, or — a remote
    member not placed yet — from its local header, read and checked now."""
    if member.data_offset != NOT_READ:
        return member.data_offset
    headers = _HEADERS.get(handle)
    if headers is None:
        raise InputError(f"zip member {member.name!r} was listed without its place — the archive is corrupt")
    return headers.resolve(member)


def list_members(path: Path, handle: BinaryIO, *, size: int | None = None) -> Listing:
    """Every member the central directory lists, in its order, and why any other could not be located.

    Members are found as PyTorch's zip reader (miniz) finds them: by the central directory, the
    local header read only for the lengths that place the data (the name it repeats is not
    compared). Nothing here judges names; :func:`read_members` adds the rules for loading, and
    ``scan`` reads every pickle member this returns.

    The directory is parsed in one pass over its bytes (:func:`_directory`), exactly as Python's
    ``zipfile`` reads it; a directory that pass does not take whole (a record ``zipfile`` would
    refuse) is read by ``zipfile`` itself, for its exact refusal.
    """
    try:
        directory = _directory(handle)
    except InputError:
        if is_remote(handle):  # the store's own failure (a refused answer, a timeout): it says why
            raise
        directory = None
    except Exception:  # noqa: BLE001 — whatever the one pass trips on, zipfile's own reading names
        directory = None
    try:
        if directory is None:
            directory = _zipfile_directory(handle)
    except InputError:  # only a remote file's read raises it here: the store's failure, which says why
        raise
    except Exception as e:  # zipfile parses hostile bytes: OverflowError, KeyError... all mean "corrupt"
        raise InputError(
            f"zip archive is corrupt ({_short(e)}) — re-save or re-download the checkpoint", path=path
        ) from e
    records, directory_start = directory
    file_size = size if size is not None else handle_size(handle)
    if not is_remote(handle) or size is not None:
        # a local archive's headers read now (a window at a time)
        found, placing = _members(
            records, _local_headers(handle, [record[2] for record in records], file_size), file_size
        )
        return Listing(found, [_PLACING[kind].format(name) for kind, name in placing], directory_start)
    # a remote one's when a member is read
    lazy = LocalHeaders(path, handle, file_size)
    found = []
    problems: list[str] = []
    header_size = _LOCAL_HEADER.size
    make = tuple.__new__
    for name, raw_name, header_offset, file_size_, compress_size, crc, flags, method in records:
        if header_offset < 0 or header_offset + header_size > file_size:
            problems.append(_PLACING[0].format(name))
            continue
        member = make(
            Member,
            (
                name,
                NOT_READ,
                file_size_,
                crc,
                method != zipfile.ZIP_STORED,
                compress_size,
                header_offset,
                bool(flags & 0x1),
                method,
                raw_name,
            ),
        )
        lazy.members.append(member)
        found.append(member)
    _HEADERS[handle] = lazy
    return Listing(found, problems, directory_start, lazy)


def _zipfile_directory(handle: BinaryIO) -> tuple[list[tuple[Any, ...]], int]:
    """The records and directory start as :func:`_directory` gives them, read by ``zipfile`` itself (for a directory
    that one pass does not take whole: ``zipfile`` raises its own refusal)."""
    archive = zipfile.ZipFile(handle)
    records = [
        (
            info.filename,
            info.orig_filename.encode("utf-8" if info.flag_bits & 0x800 else "cp437", "surrogateescape"),
            info.header_offset,
            info.file_size,
            info.compress_size,
            info.CRC,
            info.flag_bits,
            info.compress_type,
        )
        for info in archive.infolist()
    ]
    start = archive.start_dir
    archive.close()
    return records, start


# why a listed member is not located: (kind, name) pairs of _members
_PLACING = (
    "zip member {!r} lies outside the file — the file is truncated or corrupt",
    "zip member {!r} has no local header — the archive is corrupt",
    "zip member {!r} ends past the end of the file — the file is truncated",
)


def _members(
    records: list[tuple[Any, ...]], headers: list[int | None], file_size: int
) -> tuple[list[Member], list[tuple[int, str]]]:
    """A local archive's members, each placed by its local header's lengths (``headers``), and the
    records that could not be: (kind, name), kind an index of :data:`_PLACING`."""
    found: list[Member] = []
    problems: list[tuple[int, str]] = []
    header_size = _LOCAL_HEADER.size
    make = tuple.__new__
    for i, (name, raw_name, header_offset, file_size_, compress_size, crc, flags, method) in enumerate(records):
        if header_offset < 0 or header_offset + header_size > file_size:
            problems.append((0, name))
            continue
        header = headers[i]
        if header is None:
            problems.append((1, name))
            continue
        data_offset = header_offset + header_size + header
        if data_offset + compress_size > file_size:
            problems.append((2, name))
            continue
        found.append(
            make(
                Member,
                (
                    name,
                    data_offset,
                    file_size_,
                    crc,
                    method != zipfile.ZIP_STORED,
                    compress_size,
                    header_offset,
                    bool(flags & 0x1),
                    method,
                    raw_name,
                ),
            )
        )
    return found, problems


_LOCAL_WINDOW = 1 << 20  # local headers within this many bytes of each other are read in one read


def _local_headers(handle: BinaryIO, offsets: list[int], file_size: int) -> list[int | None]:
    """For each local header offset, the lengths of its name and extra field (which place the data),
    or None where no local header signature lies. Headers lying close together (a checkpoint's
    small members) are read together, a window at a time; each other header alone (30 bytes)."""
    header_size = _LOCAL_HEADER.size
    results: list[int | None] = [None] * len(offsets)
    order = sorted((offset, i) for i, offset in enumerate(offsets) if 0 <= offset and offset + header_size <= file_size)
    count = len(order)
    k = 0
    unpack_from = _LOCAL_HEADER.unpack_from
    while k < count:
        start = order[k][0]
        last = k
        while last + 1 < count and order[last + 1][0] + header_size - start <= _LOCAL_WINDOW:
            last += 1
        handle.seek(start)
        window = handle.read(order[last][0] + header_size - start)
        for offset, i in order[k : last + 1]:
            at = offset - start
            if at + header_size > len(window):
                continue
            fields = unpack_from(window, at)
            if fields[0] == _LOCAL_SIG:
                results[i] = fields[9] + fields[10]
        k = last + 1
    return results


def fold_name(name: str) -> str:
    """A member name as miniz compares it when torch looks a record up: ASCII letters case-insensitively."""
    # str.lower maps only ASCII letters in an ASCII string; other text lowers more than miniz does
    return name.lower() if name.isascii() else name.translate(_ASCII_LOWER)


_ASCII_LOWER = str.maketrans("ABCDEFGHIJKLMNOPQRSTUVWXYZ", "abcdefghijklmnopqrstuvwxyz")


class Members(dict):
    """An archive's members by exact name; :meth:`get` finds the member torch's reader finds.

    torch asks miniz for ``<archive>/data.pkl``, ``byteorder``, ``data/<key>``. miniz compares names
    ignoring ASCII case, by binary search over the directory heap-sorted by name; of several
    members matching a name it returns whichever that (unstable) sort and search reach, which
    depends on every other name in the archive. :func:`miniz_order` and :func:`miniz_locate`
    reproduce both steps, so a duplicated name reads the member torch reads.
    """

    def __init__(self, path: Path, entries: list[Member]) -> None:
        super().__init__()
        self.path = path
        self.entries = entries
        # each folded name's first member; the folded names several members share, apart
        self._folded: dict[str, Member] = {}
        self._shared: set[str] = set()
        _fold(self, entries, self._folded, self._shared)
        self._order: list[int] | None = None
        self.folded_alike = bool(self._shared)  # whether any two names are alike but for ASCII case
        self.headers: LocalHeaders | None = None  # a remote archive's (see :func:`data_offset`)

    def get(self, name: str, default: Member | None = None) -> Member | None:  # type: ignore[override]
        """The member torch would read for ``name``; ``default`` when none matches."""
        key = name.lower() if name.isascii() else name.translate(_ASCII_LOWER)
        first = self._folded.get(key)
        if first is None:
            return default
        if key not in self._shared:
            return first
        matches = [member for member in self.entries if fold_name(member.name) == key]
        names = [member.raw_name for member in self.entries]
        if len(names) > MAX_DUPLICATE_SORT:
            raise InputError(
                f"zip archive holds {len(matches)} members torch would take for {name!r} among "
                f"{len(names)} members, too many to work out which one torch reads — refusing an "
                "ambiguous archive (ckptool scan lists what each holds)",
                path=self.path,
            )
        if self._order is None:
            self._order = miniz_order(names)
        index = miniz_locate(names, self._order, name.encode("utf-8"))
        return self.entries[index] if index is not None else default

    def any_under(self, folder: str) -> bool:
        """Whether a member's name starts with ``folder``, ASCII letters compared as miniz compares them."""
        return starting(self._folded, fold_name(folder), every=False)


def starting(names: Iterable[str], prefix: str, *, every: bool) -> bool:
    """Whether every name (``every``) or any name starts with ``prefix`` (a dict's keys or a list)."""
    tests = map(str.startswith, names, repeat(prefix))
    return all(tests) if every else any(tests)


def _fold(by_name: dict[str, Member], entries: list[Member], folded: dict[str, Member], shared: set[str]) -> None:
    """Fill ``by_name`` (each name's last member), ``folded`` (each folded name's first member) and
    ``shared`` (the folded names several members share)."""
    by_name.update((member.name, member) for member in entries)
    for member in entries:
        name = member.name
        key = name.lower() if name.isascii() else name.translate(_ASCII_LOWER)
        if folded.setdefault(key, member) is not member:
            shared.add(key)


def _lower(name: bytes) -> bytes:
    return name.translate(_ASCII_LOWER_BYTES)


_ASCII_LOWER_BYTES = bytes.maketrans(b"ABCDEFGHIJKLMNOPQRSTUVWXYZ", b"abcdefghijklmnopqrstuvwxyz")
# miniz compares names as lower-cased unsigned bytes, a shorter name first when one is the other's
# prefix: exactly how Python orders the lower-cased bytes objects.


def miniz_order(names: list[bytes]) -> list[int]:
    """The directory's indices in the order miniz's heap sort (``mz_zip_reader_sort_central_dir_offsets_by_filename``)
    leaves them; equal names end up in an order that depends on every name."""
    keys = [_lower(name) for name in names]
    order = list(range(len(names)))
    size = len(order)

    def sift(root: int, end: int) -> None:
        while True:
            child = 2 * root + 1
            if child >= end:
                return
            if child + 1 < end and keys[order[child]] < keys[order[child + 1]]:
                child += 1
            if not keys[order[root]] < keys[order[child]]:
                return
            order[root], order[child] = order[child], order[root]
            root = child

    if size <= 1:
        return order
    for start in range((size - 2) >> 1, -1, -1):
        sift(start, size)
    for end in range(size - 1, 0, -1):
        order[end], order[0] = order[0], order[end]
        sift(0, end)
    return order


def miniz_locate(names: list[bytes], order: list[int], target: bytes) -> int | None:
    """The index miniz's binary search (``mz_zip_locate_file_binary_search``) finds for ``target``."""
    wanted = _lower(target)
    low, high = 0, len(order) - 1
    while low <= high:
        middle = low + ((high - low) >> 1)
        key = _lower(names[order[middle]])
        if key == wanted:
            return order[middle]
        if key < wanted:
            low = middle + 1
        else:
            high = middle - 1
    return None


def read_members(path: Path, handle: BinaryIO, *, size: int | None = None) -> Members:
    """Validate the archive's directory for loading and return its members (looked up as torch does).

    ``size`` is the archive's length when ``handle`` is a window onto part of a file (a DCP chunk)
    rather than a whole file; member offsets are then relative to the window.
    """
    with paused():  # 100,000 members are 100,000 records, none of them garbage
        return _read_members(path, handle, size)


def _read_members(path: Path, handle: BinaryIO, size: int | None) -> Members:
    listing = list_members(path, handle, size=size)
    if listing.problems:
        raise InputError(listing.problems[0], path=path)
    entries = listing.members
    refusal = _spans(entries, listing.directory_start)
    if refusal is not None:
        raise InputError(_REFUSALS[refusal[0]].format(*refusal[1:]), path=path)
    members = Members(path, entries)
    if listing.headers is not None:
        listing.headers.bound(listing.directory_start)
        members.headers = listing.headers
    return members


# what _spans finds first: (kind, *values), kind an index here
_REFUSALS = (
    "zip member {!r} is encrypted — not a PyTorch checkpoint",
    "zip member {!r} is stored but claims {} bytes in {} — the archive is corrupt",
    "zip members {!r} and {!r} overlap — refusing a zip bomb",
    "zip member {!r} overlaps the central directory — the archive is corrupt",
)


def _spans(entries: list[Member], directory_start: int) -> tuple[Any, ...] | None:
    """The first reason to refuse the members for loading (see :data:`_REFUSALS`); None: none."""
    spans: list[tuple[int, int, str]] = []
    append = spans.append
    for name, data_offset, size_, _, compressed, stored_size, header_offset, encrypted, _, _ in entries:
        if encrypted:
            return 0, name
        if not compressed and stored_size != size_:
            # readers copy a stored member's file_size bytes: a larger claim would reach into other members
            return 1, name, size_, stored_size
        # a remote member not placed yet: the least its end can be (checked exactly once placed)
        start = data_offset if data_offset != NOT_READ else header_offset + _LOCAL_HEADER.size
        append((header_offset, start + stored_size, name))
    # members sharing bytes are how small zips inflate to terabytes; torch never writes them
    spans.sort()
    for (_, previous_end, previous), (start, _, name) in zip(spans, spans[1:]):
        if start < previous_end:
            return 2, previous, name
    if spans and spans[-1][1] > directory_start:
        return 3, spans[-1][2]
    return None


def _short(error: BaseException) -> str:
    text = str(error).splitlines()[0] if str(error) else type(error).__name__
    return text[:160]


def read_member(path: Path, handle: BinaryIO, member: Member, *, limit: int) -> bytes:
    """A small member's bytes; compressed members are inflated with a size cap."""
    if member.size > limit:
        raise InputError(
            f"zip member {member.name!r} is {member.size} bytes, over the {limit}-byte limit — refused", path=path
        )
    handle.seek(data_offset(handle, member))
    if member.compressed:
        # torch writes every record stored; a compressed one is allowed, but not a bomb
        if (
            member.size > max(MAX_COMPRESSION_RATIO * member.stored_size, 1 << 20)
            or member.stored_size > member.size + (member.size >> 6) + 1024
        ):  # deflate never grows more
            raise InputError(
                f"zip member {member.name!r} would inflate {member.stored_size} bytes to {member.size} "
                "— refusing a zip bomb",
                path=path,
            )
        # inflated here, not through zipfile: it would take the last member of that name, compare
        # the local header's name and check the CRC, none of which torch's reader does
        if member.compression_method != zipfile.ZIP_DEFLATED:
            raise InputError(
                f"zip member {member.name!r} uses compression method {member.compression_method}; "
                "PyTorch's reader inflates only deflate — the archive is corrupt",
                path=path,
            )
        try:
            inflater = zlib.decompressobj(-15)
            data = inflater.decompress(handle.read(member.stored_size), member.size + 1)
        except zlib.error as e:
            raise InputError(f"zip member {member.name!r} cannot be inflated ({_short(e)})", path=path) from e
    else:
        data = handle.read(member.size)
    if len(data) != member.size:
        raise InputError.truncated(path, f"zip member {member.name!r} holds fewer than its {member.size} bytes")
    # A member's recorded CRC is not checked, as torch does not check it: large-model savers
    # turn CRCs off (torch then records 0) and files patched after saving record stale ones. What a
    # member holds is validated by what reads it (the pickle guard, the byteorder test).
    return data
