"""A torch archive's storages: the unpickler's ``persistent_load`` over ``<archive>/data/<key>`` members.

Shared by the torch zip reader, TorchScript archives and DCP's ``.distcp`` files (archives embedded in a
larger file).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from ckptool import pickles
from ckptool.base.errors import InputError
from ckptool.files.ranges import ByteRange, LazyByteRange
from ckptool.formats import zipio
from ckptool.tensors.refs import StorageRef


def storage_loader(
    path: Path,
    members: dict[str, zipio.Member],
    top: str,
    storages: dict[str, StorageRef],
    *,
    data_file: Path | None = None,
    base_offset: int = 0,
    context: str = "",
    big_endian: bool = False,
) -> Callable[[Any], StorageRef]:
    """The unpickler's ``persistent_load`` for a torch archive: each storage record becomes a StorageRef
    over the bytes of ``<top>/data/<key>``, validated against the archive.

    ``data_file``/``base_offset`` locate an archive embedded in a larger file (DCP's ``.distcp``);
    ``context`` prefixes error messages (e.g. which DCP entry). A ``big_endian`` archive's storages
    read as their bytes swapped, as torch swaps them on load (so a rewrite writes them little-endian).
    """
    source = data_file or path
    prefix = f"{top}/data/"
    headers = getattr(members, "headers", None)  # a remote archive's members are placed when first read
    type_globals: dict[Any, str] = {}  # by placeholder (held, so by identity): each class's name made once

    storage_type_ref = pickles.StorageTypeRef
    # no two names alike but for case (every archive torch writes): a name's member is the one of that exact name
    exact = dict.get if isinstance(members, zipio.Members) and not members.folded_alike else None
    not_read = zipio.NOT_READ

    def persistent_load(pid: Any) -> StorageRef:
        storage_type, key, location, numel = _storage_record(pid, context, path)
        dtype = storage_type.dtype
        cached = storages.get(key)
        if cached is not None and (cached.nbytes or cached.dtype is dtype):
            return cached
        nbytes = numel * dtype.itemsize
        member, crc32 = _storage_member(members, exact, prefix + key, key, nbytes, context, path)
        data_offset = member.data_offset
        type_global = type_globals.get(storage_type)
        if type_global is None:
            type_global = type_globals[storage_type] = f"{storage_type.module}.{storage_type.name}"
        storage = StorageRef(
            key,
            dtype,
            numel,
            location,
            ByteRange(source, base_offset + data_offset, nbytes, crc32)
            if data_offset != not_read or headers is None
            else _data_range(source, base_offset, member, headers, nbytes, crc32),
            type_global,
        )
        if big_endian:
            storage.producer = _swapped(storage)
        # torch keeps an allocated storage by key for later references (whatever dtype they name);
        # an empty one is not kept (its data pointer is null), so each reference gets its own dtype
        if nbytes or key not in storages:
            storages[key] = storage
        return storage

    # its usual case (a storage in this archive, read where it lies) is also done by the C run of the
    # unpickler, over these same records (ckptool/native/_fastload.c); not for a big-endian archive's
    # storages (swapped on read) or members named alike but for case (found by their folded names)
    if exact is not None and not big_endian:
        persistent_load.fast_storages = (  # type: ignore[attr-defined]
            storages,
            type_globals,
            members,
            prefix,
            source,
            base_offset,
            not_read,
            headers is None,
            ByteRange,
            storage_type_ref,
            zipio.Member,
        )
    return persistent_load


def _storage_record(pid: Any, context: str, path: Path) -> tuple[pickles.StorageTypeRef, str, str, int]:
    """A persistent record's storage class, key, location and element count, or the file's refusal."""
    if not isinstance(pid, tuple) or len(pid) != 5 or pid[0] != "storage":
        raise InputError(
            f"{context}unexpected persistent record {pickles.brief(pid)} — not a weights checkpoint", path=path
        )
    _, storage_type, key, location, numel = pid
    return storage_fields(storage_type, key, location, numel, context, path)


def storage_fields(
    storage_type: Any, key: Any, location: Any, numel: Any, context: str, path: Path
) -> tuple[pickles.StorageTypeRef, str, str, int]:
    """A storage record's fields as torch writes them (a storage class, a str key and location tag, a
    count), in a zip archive's record or a legacy file's, or the file's refusal."""
    if (
        not isinstance(storage_type, pickles.StorageTypeRef)
        or not isinstance(key, str)
        or not isinstance(location, str)
        or type(numel) is not int
        or numel < 0
    ):
        raise InputError(
            f"{context}malformed storage record for key {pickles.brief(key)} — the file is corrupt", path=path
        )
    return storage_type, key, location, numel


def _storage_member(
    members: dict[str, zipio.Member],
    exact: Callable[[dict[str, zipio.Member], str], zipio.Member | None] | None,
    name: str,
    key: str,
    nbytes: int,
    context: str,
    path: Path,
) -> tuple[zipio.Member, int | None]:
    """The member holding storage ``key`` (``exact``: the lookup by exact name, where the archive allows
    it), checked to be stored and to hold ``nbytes``, and the CRC recorded for those bytes, if any."""
    member = exact(members, name) if exact is not None else None
    if member is None:
        member = members.get(name)
        if member is None:
            raise InputError(
                f"{context}storage {pickles.brief(key)} is missing from the archive — the file is truncated or corrupt",
                path=path,
            )
    if member.compressed:
        raise InputError(
            f"{context}storage {pickles.brief(key)} is compressed; PyTorch writes storages "
            "uncompressed — re-save with torch.save",
            path=path,
        )
    size = member.size
    if size < nbytes:
        raise InputError(
            f"{context}storage {pickles.brief(key)} declares {nbytes} bytes but the archive holds "
            f"{size} — the file is corrupt",
            path=path,
        )
    # a CRC of 0 is what torch records with CRCs turned off (set_crc32_options(False)): none
    crc32: int | None = member.crc32
    if size != nbytes or not (crc32 or not nbytes):
        crc32 = None
    return member, crc32


def _data_range(
    source: Path,
    base_offset: int,
    member: zipio.Member,
    headers: zipio.LocalHeaders | None,
    nbytes: int,
    crc32: int | None,
) -> ByteRange:
    """Where a storage's bytes lie: at once, or — for a remote member whose local header is not read
    yet — when first needed (inspect never reads the headers of the storages)."""
    if member.data_offset != zipio.NOT_READ or headers is None:
        return ByteRange(source, base_offset + member.data_offset, nbytes, crc32)
    return LazyByteRange(source, None, nbytes, crc32, resolve=lambda: base_offset + headers.resolve(member))


def _swapped(storage: StorageRef) -> Callable[[], bytes] | None:
    """A big-endian storage's bytes made little-endian, as torch's ``storage.byteswap(dtype)`` does: by
    the storage's element size (half of it for complex types, whose parts swap alone). An untyped
    storage (uint8 to torch) and one-byte types are not swapped. None: nothing to swap."""
    import numpy as np

    unit = storage.dtype.itemsize // 2 if storage.dtype.name.startswith("C") else storage.dtype.itemsize
    if unit <= 1:
        return None
    source = storage.byte_range()

    def produce() -> bytes:
        raw = b"".join(source.iter_chunks())
        return np.frombuffer(raw, dtype=f">u{unit}").astype(f"<u{unit}").tobytes()

    return produce
