"""PyTorch's legacy stream format (``_use_new_zipfile_serialization=False``, torch < 1.6).

A file of consecutive pickles — magic number, protocol version, system info, the object tree,
the list of storage keys — followed by each storage as an 8-byte element count and raw bytes.
Read-only: ckptool writes the zip format (and says so).
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any, BinaryIO

from ckptool import pickles
from ckptool.base.errors import InputError, NotACheckpointError, UnsafeCheckpointError, UnsupportedFormatError
from ckptool.files.byteio import file_size as handle_size
from ckptool.files.byteio import is_remote
from ckptool.files.ranges import ByteRange
from ckptool.formats import (
    PICKLE_FIRST_BYTES,
    Contents,
    Format,
    PickleBlob,
    Pickles,
    ReadOptions,
    describe,
    looks_like_text,
)
from ckptool.formats.pickle_stream import split_pickles
from ckptool.formats.zip_storages import storage_fields
from ckptool.tensors.refs import StorageRef

MAGIC_NUMBER = 0x1950A86A20F9469CFC6C
PROTOCOL_VERSION = 1001


def sniff(head: bytes | None, path: Path) -> bool:
    """A file opening with a pickle opcode (checked after every other format's signature)."""
    return bool(head and head[0] in PICKLE_FIRST_BYTES)


def read(path: Path, options: ReadOptions) -> Contents:
    """Read a legacy checkpoint: refuse a file that is another kind of file (a GIF and a GGUF open
    with a byte that is also a pickle opcode), and name a text file as such."""
    what = describe(options.head)
    if what is not None:
        raise NotACheckpointError(f"is {what}, not a PyTorch checkpoint", path=path)
    assert options.handle is not None
    try:
        container = _read(path, options.handle, options.resolver)
    except InputError as e:
        if looks_like_text(options.head) and not isinstance(e, (UnsafeCheckpointError, NotACheckpointError)):
            raise NotACheckpointError("is a text file, not a PyTorch checkpoint", path=path) from e
        raise
    return Contents(
        container=container,
        files=[path],
        notes=["legacy (pre-1.6) serialization: rewrites are written in the zip format"],
    )


def _read(path: Path, handle: BinaryIO, resolver: pickles.GlobalResolver) -> Any:
    """The object tree of a legacy checkpoint; the first pickle must be torch's magic number."""
    handle.seek(0)
    plain = pickles.GlobalResolver()  # the preamble pickles hold plain values only
    _check_preamble(path, handle, plain)
    loader = _StorageLoader(path)
    container = pickles.loads(handle, resolver, loader.persistent_load)
    keys = pickles.loads(handle, plain)
    if not isinstance(keys, list) or not all(isinstance(k, str) for k in keys):
        raise InputError("legacy storage key list is malformed — the file is corrupt", path=path)
    _place_storages(path, handle, keys, loader)
    return container


def _check_preamble(path: Path, handle: BinaryIO, plain: pickles.GlobalResolver) -> None:
    """The three pickles before the object tree: torch's magic number, protocol version, system info."""
    magic = pickles.loads(handle, plain)
    if magic != MAGIC_NUMBER:
        raise NotACheckpointError(
            "is a plain pickle, not a PyTorch checkpoint (no torch magic number) — ckptool reads torch.save files",
            path=path,
        )
    if pickles.loads(handle, plain) != PROTOCOL_VERSION:
        raise UnsupportedFormatError("is a legacy torch file with an unknown protocol version", path=path)
    # system info (byte order, type sizes): torch ignores it, its little_endian flag included, and
    # reads every storage little-endian; so does ckptool
    pickles.loads(handle, plain)


class _StorageLoader:
    """The object tree's ``persistent_load``: storage records become ``StorageRef``s (bytes placed later)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.storages: dict[str, StorageRef] = {}
        self.views: dict[str, tuple[StorageRef, StorageRef, int]] = {}  # view key -> (view, root, byte offset)

    def persistent_load(self, pid: Any) -> StorageRef:
        path, storages = self.path, self.storages
        if isinstance(pid, tuple) and pid and pid[0] == "module":
            raise UnsupportedFormatError(
                "pickles a whole nn.Module object, not weights — load it where its code lives and save "
                "model.state_dict() instead",
                path=path,
            )
        if not isinstance(pid, tuple) or len(pid) != 6 or pid[0] != "storage":
            raise InputError(f"unexpected persistent record {pickles.brief(pid)} — not a weights checkpoint", path=path)
        _, storage_type, key, location, numel, view_metadata = pid
        storage_type, key, location, numel = storage_fields(storage_type, key, location, numel, "", path)
        cached = storages.get(key)
        if cached is None:
            cached = storages[key] = StorageRef(
                key=key,
                dtype=storage_type.dtype,
                numel=numel,
                location=location,
                type_global=f"{storage_type.module}.{storage_type.name}",
            )
        elif not cached.nbytes and cached.dtype is not storage_type.dtype:
            # torch re-types an empty storage for each reference naming another dtype
            if view_metadata is not None:
                raise UnsupportedFormatError(
                    "takes a storage view of an empty storage — the file is corrupt", path=path
                )
            return StorageRef(
                key=key,
                dtype=storage_type.dtype,
                numel=0,
                location=cached.location,
                data=ByteRange(path, 0, 0),
                type_global=f"{storage_type.module}.{storage_type.name}",
            )
        if view_metadata is not None:
            return self.storage_view(cached, storage_type, view_metadata)
        return cached

    def storage_view(self, root: StorageRef, storage_type: pickles.StorageTypeRef, view_metadata: Any) -> StorageRef:
        """A pre-0.4 storage slice ``(view key, offset, size)`` of ``root``, in elements of the record's
        dtype; torch makes it once per view key and hands the same slice to every later reference."""
        path, views = self.path, self.views
        if (
            not isinstance(view_metadata, tuple)
            or len(view_metadata) != 3
            or not isinstance(view_metadata[0], str)
            or not all(type(v) is int and v >= 0 for v in view_metadata[1:])
        ):
            raise InputError(
                f"malformed storage view record {pickles.brief(view_metadata)} — the file is corrupt", path=path
            )
        view_key, offset, size = view_metadata
        if view_key in views:
            return views[view_key][0]
        if view_key in self.storages:
            # torch keeps views and storages under one set of keys: a view named like a storage is that storage
            raise UnsupportedFormatError(
                f"names storage view {pickles.brief(view_key)} like a storage — refused", path=path
            )
        item = storage_type.dtype.itemsize
        if (offset + size) * item > root.nbytes:
            raise InputError(
                f"storage view {pickles.brief(view_key)} ends past its storage — the file is corrupt", path=path
            )
        view = StorageRef(
            key=view_key,
            dtype=storage_type.dtype,
            numel=size,
            location=root.location,
            type_global=f"{storage_type.module}.{storage_type.name}",
        )
        views[view_key] = (view, root, offset * item)
        return view


def _remote_counts(
    handle: BinaryIO, position: int, keys: list[str], storages: dict[str, StorageRef], file_size: int
) -> dict[int, bytes] | None:
    """For a remote file, each storage's 8-byte element count, fetched at once where the pickle says
    they lie (parallel ranges, not a request per storage in turn); None for a local file."""
    if not is_remote(handle):
        return None
    places = []
    for key in keys:
        storage = storages.get(key)
        if storage is None or position + 8 > file_size:
            break
        places.append(position)
        position += 8 + storage.nbytes
    return dict(zip(places, handle.pread_ranges([(place, 8) for place in places])))  # type: ignore[attr-defined]


def _place_storages(path: Path, handle: BinaryIO, keys: list[str], loader: _StorageLoader) -> None:
    """Point each storage at its bytes after the pickles (an 8-byte element count, then the data), in
    ``keys`` order, and each view into its storage's; every storage the tree names must get bytes."""
    storages, views = loader.storages, loader.views
    file_size = handle_size(handle)
    position = handle.tell()
    counts = _remote_counts(handle, position, keys, storages, file_size)
    for key in keys:
        storage = storages.get(key)
        if storage is None:
            raise InputError(
                f"legacy storage {pickles.brief(key)} is listed but never used — the file is corrupt", path=path
            )
        header = handle.read(8) if counts is None else counts.get(position, b"")
        if len(header) != 8:
            raise InputError.truncated(path, f"legacy storage {pickles.brief(key)} is missing")
        (numel,) = struct.unpack("<q", header)
        if numel != storage.numel:
            raise InputError(
                f"legacy storage {pickles.brief(key)} holds {numel} elements but the pickle says {storage.numel} "
                "— corrupt file",
                path=path,
            )
        start = position + 8
        if start + storage.nbytes > file_size:
            raise InputError.truncated(path, f"legacy storage {pickles.brief(key)} ends past the end of the file")
        storage.data = ByteRange(path, start, storage.nbytes)
        position = start + storage.nbytes
        handle.seek(position)
    for view, root, start in views.values():
        if root.data is not None:
            view.data = ByteRange(path, root.data.offset + start, view.nbytes)
    missing = [key for key, storage in storages.items() if storage.data is None]
    missing += [key for key, (view, _, _) in views.items() if view.data is None]
    if missing:
        raise InputError.truncated(path, f"legacy storages {missing[:3]} have no data")


def pickle_blobs(path: Path, options: ReadOptions) -> Pickles:
    """The file's consecutive pickles (five in a legacy checkpoint; one in a plain pickle file);
    scan calls the file a ``pickle`` until a load reads it as a checkpoint."""
    assert options.handle is not None
    options.handle.seek(0)
    blobs = split_pickles(options.handle, "pickle", 5, options.resolver.guard_cache)
    return Pickles("pickle", [PickleBlob(f"pickle {index}", data) for index, (_, data) in enumerate(blobs)])


FORMAT = Format(
    name="torch-legacy",
    sniff=sniff,
    read=read,
    pickle_blobs=pickle_blobs,
    rewrite_note="the input used the legacy (pre-1.6) format; the output is in the zip format",
)
