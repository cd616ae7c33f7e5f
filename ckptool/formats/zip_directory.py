"""A zip's records as torch's archives lay them out, and its central directory read in one pass.

The layout constants (local header, signatures, the zip64 extra field's id) are shared by the reader
(:mod:`ckptool.formats.zipio`) and the writer (:mod:`ckptool.formats.zip_writer`); :func:`_directory`
reads the central directory exactly as Python's ``zipfile`` does, without a ``ZipInfo`` per member.
"""

from __future__ import annotations

import struct
import zipfile
from typing import Any, BinaryIO

LOCAL_HEADER = struct.Struct("<IHHHHHIIIHH")
LOCAL_SIG = 0x04034B50
CENTRAL_SIG = 0x02014B50
ZIP64_ID = 0x0001
_ZIP64_ID = ZIP64_ID
_CENTRAL = struct.Struct("<4s4B4HL2L5H2L")  # zipfile's structCentralDir
_CENTRAL_MAGIC = b"PK\x01\x02"


def directory(handle: BinaryIO) -> tuple[list[tuple], int] | None:
    """The central directory's records as ``zipfile`` reads them (name, the name's bytes, header
    offset, file size, stored size, CRC, flags, method), and where the directory starts; None
    when a record is one ``zipfile`` refuses (it is then asked, for its own message).

    This is ``zipfile.ZipFile._RealGetContents`` without a ``ZipInfo`` per member: the same end
    record (``zipfile._EndRecData``), the same offset adjustment for bytes before the archive, the
    same reads (short reads past the directory's end included), zip64 extra fields decoded alike.
    """
    endrec = zipfile._EndRecData(handle)  # type: ignore[attr-defined]
    if endrec is None:
        return None
    size_cd, offset_cd = endrec[zipfile._ECD_SIZE], endrec[zipfile._ECD_OFFSET]  # type: ignore[attr-defined]
    concat = endrec[zipfile._ECD_LOCATION] - size_cd - offset_cd  # type: ignore[attr-defined]
    if endrec[zipfile._ECD_SIGNATURE] == zipfile.stringEndArchive64:  # type: ignore[attr-defined]
        concat -= zipfile.sizeEndCentDir64 + zipfile.sizeEndCentDir64Locator  # type: ignore[attr-defined]
    start_dir = offset_cd + concat
    if start_dir < 0:
        return None
    handle.seek(start_dir, 0)
    records = _records(handle.read(size_cd), size_cd, concat)
    return None if records is None else (records, start_dir)


def _records(data: bytes, size_cd: int, concat: int) -> list[tuple[Any, ...]] | None:
    """The records of the directory's bytes ``data`` (``size_cd`` of them claimed); None where
    ``zipfile`` refuses one."""
    unpack_from = _CENTRAL.unpack_from
    record_size = _CENTRAL.size
    end = len(data)
    records: list[tuple[Any, ...]] = []
    append = records.append
    total = 0
    try:
        while total < size_cd:
            if total + record_size > end:
                return None
            (
                magic,
                _,
                _,
                extract_version,
                _,
                flags,
                method,
                _,
                _,
                crc,
                compress_size,
                file_size,
                name_length,
                extra_length,
                comment_length,
                _,
                _,
                _,
                header_offset,
            ) = unpack_from(data, total)
            if magic != _CENTRAL_MAGIC or extract_version > zipfile.MAX_EXTRACT_VERSION:
                return None
            at = total + record_size
            raw = data[at : at + name_length]
            name = raw.decode("utf-8") if flags & 0x800 else raw.decode("cp437")
            if extra_length:
                extra = data[at + name_length : at + name_length + extra_length]
                decoded = _decode_extra(extra, file_size, compress_size, header_offset)
                if decoded is None:
                    return None
                file_size, compress_size, header_offset = decoded
            null = name.find("\0")
            append(
                (
                    name if null < 0 else name[:null],
                    raw,
                    header_offset + concat,
                    file_size,
                    compress_size,
                    crc,
                    flags,
                    method,
                )
            )
            total += record_size + name_length + extra_length + comment_length
    except UnicodeDecodeError:
        return None
    return records


def _decode_extra(extra: bytes, file_size: int, compress_size: int, header_offset: int) -> tuple[int, int, int] | None:
    """``zipfile.ZipInfo._decodeExtra``: the zip64 sizes and offset; None where it raises."""
    unpack = struct.unpack
    while len(extra) >= 4:
        kind, length = unpack("<HH", extra[:4])
        if length + 4 > len(extra):
            return None
        if kind == _ZIP64_ID:
            data = extra[4 : length + 4]
            try:
                if file_size in (0xFFFF_FFFF_FFFF_FFFF, 0xFFFF_FFFF):
                    (file_size,) = unpack("<Q", data[:8])
                    data = data[8:]
                if compress_size == 0xFFFF_FFFF:
                    (compress_size,) = unpack("<Q", data[:8])
                    data = data[8:]
                if header_offset == 0xFFFF_FFFF:
                    (header_offset,) = unpack("<Q", data[:8])
            except struct.error:
                return None
        extra = extra[length + 4 :]
    return file_size, compress_size, header_offset
