"""The zip writer of torch archives: stored members, their data aligned to 64 bytes as torch aligns it
(so loaders can mmap storages), zip64 where sizes, offsets or counts need it; storages copied raw by the
copy engine (:mod:`ckptool.files.copying`)."""

from __future__ import annotations

import struct
from collections.abc import Callable
from itertools import compress, repeat
from operator import gt
from pathlib import Path
from typing import BinaryIO

from ckptool.base.errors import OutputError
from ckptool.files import placement
from ckptool.files.byteio import is_remote
from ckptool.files.copying import SMALL_MEMBER, DataOut, pieces_crc
from ckptool.files.crc import crc32
from ckptool.files.ranges import ByteRange
from ckptool.formats.zip_directory import CENTRAL_SIG as _CENTRAL_SIG
from ckptool.formats.zip_directory import LOCAL_HEADER as _LOCAL_HEADER
from ckptool.formats.zip_directory import LOCAL_SIG as _LOCAL_SIG
from ckptool.formats.zip_directory import ZIP64_ID as _ZIP64_ID
from ckptool.tensors.refs import Derived

ALIGNMENT = 64
_PADDING_ID = 0x4246  # "FB": the extra-field id torch's writer pads with
# the padding extra field of each length a local header needs to align its data (as _local_header writes it)
_PADDING = [struct.pack("<HH", _PADDING_ID, padding) + b"Z" * padding for padding in range(ALIGNMENT)]


def _local_header(name: bytes, size: int, crc: int, position: int, residue: int | None = None) -> bytes:
    """The local header of a stored member whose header starts at ``position``: zip64 from 4 GiB, its data
    padded with torch's "FB" extra field to :data:`ALIGNMENT`, or to ``residue`` within a page where given
    (:func:`ckptool.files.placement.zip_padding`)."""
    zip64 = size >= 0xFFFFFFFF
    extra = struct.pack("<HHQQ", _ZIP64_ID, 16, size, size) if zip64 else b""
    start = position + _LOCAL_HEADER.size + len(name) + len(extra)
    if residue is not None:
        padding = placement.zip_padding(start, residue)
        if padding:
            extra += struct.pack("<HH", _PADDING_ID, padding - 4) + b"Z" * (padding - 4)
    elif start % ALIGNMENT:
        extra += _PADDING[(-(start + 4)) % ALIGNMENT]
    stored = 0xFFFFFFFF if zip64 else size
    version = 45 if zip64 else 20
    return (
        _LOCAL_HEADER.pack(_LOCAL_SIG, version, 0x0800, 0, 0, 0x21, crc, stored, stored, len(name), len(extra))
        + name
        + extra
    )


def _headers_for(
    names: list[str], sizes: list[int], crcs: list[int], position: int
) -> tuple[list[bytes], list[bytes], list[int], int]:
    """Members written end to end from ``position``: each one's local header, name's UTF-8 and header offset, and
    where the last one's data ends."""
    headers, encoded, offsets = [], [], []
    for name, size, crc in zip(names, sizes, crcs):
        encoded_name = name.encode("utf-8")
        header = _local_header(encoded_name, size, crc, position)
        headers.append(header)
        encoded.append(encoded_name)
        offsets.append(position)
        position += len(header) + size
    return headers, encoded, offsets, position


def _central_directory(entries: list[tuple[bytes, int, int, int]]) -> tuple[bytes, bool]:
    """The central directory's records of ``entries`` (name, header offset, size, CRC) end to end, and whether one
    needed a zip64 extra field."""
    records: list[bytes] = []
    needs_zip64 = False
    for name, offset, size, crc in entries:
        extra_values = []
        if size >= 0xFFFFFFFF:
            extra_values += [size, size]
        if offset >= 0xFFFFFFFF:
            extra_values.append(offset)
        extra = (
            struct.pack(f"<HH{len(extra_values)}Q", _ZIP64_ID, 8 * len(extra_values), *extra_values)
            if extra_values
            else b""
        )
        needs_zip64 = needs_zip64 or bool(extra_values)
        stored_size = 0xFFFFFFFF if size >= 0xFFFFFFFF else size
        stored_offset = 0xFFFFFFFF if offset >= 0xFFFFFFFF else offset
        version = 45 if extra_values else 20
        record = struct.pack(
            "<IHHHHHHIIIHHHHHII",
            _CENTRAL_SIG,
            version,
            version,
            0x0800,
            0,
            0,
            0x21,
            crc,
            stored_size,
            stored_size,
            len(name),
            len(extra),
            0,
            0,
            0,
            0,
            stored_offset,
        )
        records.append(record + name + extra)
    return b"".join(records), needs_zip64


class ZipWriter:
    """Write stored (uncompressed) members with 64-byte-aligned data, zip64 where needed."""

    def __init__(self, handle: BinaryIO, on_data: Callable[[int, int], None] | None = None) -> None:
        """``on_data(offset, length)`` is told of each member's data once it is in the file (see :class:`DataOut`)."""
        self.handle = handle
        self.entries: list[tuple[bytes, int, int, int]] = []  # name, header offset, size, crc
        self.position = handle.tell()
        self.out = DataOut(handle, on_data)

    def release(self) -> None:
        """Close the source files small members were read from (also after a failed write)."""
        self.out.release()

    def _local_header(self, name: bytes, size: int, crc: int) -> bytes:
        """The local header of a member whose header starts where the archive stands."""
        return _local_header(name, size, crc, self.position)

    def add_bytes(self, name: str, data: bytes | bytearray, crc: int | None = None) -> None:
        """Add a member from memory, under ``crc`` when one is recorded for it (else its CRC is computed)."""
        encoded = name.encode("utf-8")
        crc = crc32(data) if crc is None else crc
        header = self._local_header(encoded, len(data), crc)
        self.entries.append((encoded, self.position, len(data), crc))
        self.handle.write(header)
        self.handle.write(data)
        self.out.written(self.position + len(header), len(data))
        self.position += len(header) + len(data)

    def add_copy(self, name: str, source: Path, offset: int, size: int, crc: int | None) -> None:
        """Add a member whose bytes are ``size`` bytes of ``source`` at ``offset``.

        With a known ``crc`` (the bytes are a zip member copied unchanged) they are copied as they
        are (:meth:`DataOut.copy`) and nothing is checksummed; otherwise they are streamed and summed.
        """
        if crc is None:
            self.add_pieces(name, (ByteRange(source, offset, size),))
            return
        self.add_copies([(name, source, offset, size, crc)])

    def add_copies(self, copies: list[tuple[str, Path, int, int, int]]) -> None:
        """:meth:`add_copy` for each ``(name, source, offset, size, crc)``, a recorded ``crc`` each: the headers
        made in one loop, the bytes copied in one call (:meth:`DataOut.copy_all`: a checkpoint's 100,000 small
        storages read in windows and written together)."""
        names, sources, offsets, sizes, crcs = (list(column) for column in zip(*copies)) if copies else ([],) * 5
        self.add_copy_columns(names, sources, offsets, sizes, crcs)

    def add_copy_columns(
        self, names: list[str], sources: list[Path], offsets: list[int], sizes: list[int], crcs: list[int]
    ) -> None:
        """:meth:`add_copies` of its columns (what a caller holding columns passes: no tuple per copy).

        A large member the kernel copies from a local file is placed at its source's offset within a page
        (:func:`ckptool.files.placement.page_residue`): its own header, padded to that."""
        start = 0
        large = (
            compress(range(len(sizes)), map(gt, sizes, repeat(SMALL_MEMBER)))
            if max(sizes, default=0) > SMALL_MEMBER
            else ()
        )
        for index in large:
            residue = placement.page_residue(offsets[index], sizes[index])
            if residue is None or is_remote(sources[index]):
                continue
            self._add_copy_run(
                names[start:index], sources[start:index], offsets[start:index], sizes[start:index], crcs[start:index]
            )
            encoded = names[index].encode("utf-8")
            header = _local_header(encoded, sizes[index], crcs[index], self.position, residue)
            self.entries.append((encoded, self.position, sizes[index], crcs[index]))
            self.position = self.out.copy_all(
                [sources[index]], [offsets[index]], [sizes[index]], self.position, [header]
            )
            start = index + 1
        if start:
            names, sources, offsets, sizes, crcs = (
                names[start:],
                sources[start:],
                offsets[start:],
                sizes[start:],
                crcs[start:],
            )
        self._add_copy_run(names, sources, offsets, sizes, crcs)

    def _add_copy_run(
        self, names: list[str], sources: list[Path], offsets: list[int], sizes: list[int], crcs: list[int]
    ) -> None:
        """Members end to end from where the archive stands, each one's data at a multiple of :data:`ALIGNMENT`."""
        if not names:
            return
        headers, encoded, member_offsets, position = _headers_for(names, sizes, crcs, self.position)
        self.entries.extend(zip(encoded, member_offsets, sizes, crcs))
        end = self.out.copy_all(sources, offsets, sizes, self.position, headers)
        if end != position:
            raise OutputError(f"internal: the archive's members end at {end}, not {position}")
        self.position = end

    def add_pieces(self, name: str, pieces: tuple[ByteRange, ...]) -> None:
        """Add a member whose bytes are several byte ranges end to end.

        When every piece carries the CRC its own archive stored (DCP row shards are each a whole
        zip member), the member's CRC is combined from them (:func:`crc32_combine`) and the kernel
        copies the pieces (``copy_file_range``); otherwise they are streamed and summed.
        """
        encoded = name.encode("utf-8")
        size = sum(piece.length for piece in pieces)
        header_offset = self.position
        crc = pieces_crc(pieces)
        header = self._local_header(encoded, size, 0 if crc is None else crc)
        self.handle.write(header)
        data_start = self.position + len(header)
        if crc is not None:
            self.out.copy_pieces(pieces, data_start)
        else:
            crc = self.out.stream_pieces(pieces)
            self.handle.flush()
            self.handle.seek(header_offset + 14)
            self.handle.write(struct.pack("<I", crc))
            self.out.written(data_start, size)
            self.handle.seek(data_start + size)
        self.entries.append((encoded, header_offset, size, crc))
        self.position = data_start + size

    def add_derived(self, name: str, derived: Derived) -> None:
        """Add a member whose bytes are computed chunk by chunk (a cast), under the CRC their pass sums."""
        encoded = name.encode("utf-8")
        header_offset = self.position
        header = self._local_header(encoded, derived.nbytes, 0)
        self.handle.write(header)
        data_start = self.position + len(header)
        end = self.out.stream(derived.chunks(), data_start)
        if end - data_start != derived.nbytes or derived.crc32 is None:
            raise OutputError(f"internal: member {name} was computed as {end - data_start} bytes, not {derived.nbytes}")
        self.handle.seek(header_offset + 14)
        self.handle.write(struct.pack("<I", derived.crc32))
        self.handle.seek(end)
        self.entries.append((encoded, header_offset, derived.nbytes, derived.crc32))
        self.position = end

    def close(self) -> None:
        """Write the central directory (zip64 records when sizes, offsets or counts need them)."""
        self.out.report()
        self.release()
        central_start = self.position
        needs_zip64 = len(self.entries) >= 0xFFFF
        written, zip64 = _central_directory(self.entries)
        self.handle.write(written)
        self.position += len(written)
        needs_zip64 = needs_zip64 or zip64
        central_size = self.position - central_start
        count = len(self.entries)
        if needs_zip64 or central_start >= 0xFFFFFFFF:
            zip64_end = self.position
            self.handle.write(
                struct.pack("<IQHHIIQQQQ", 0x06064B50, 44, 45, 45, 0, 0, count, count, central_size, central_start)
            )
            self.handle.write(struct.pack("<IIQI", 0x07064B50, 0, zip64_end, 1))
            self.handle.write(struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, 0xFFFF, 0xFFFF, 0xFFFFFFFF, 0xFFFFFFFF, 0))
        else:
            self.handle.write(struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, count, count, central_size, central_start, 0))
        self.handle.flush()
