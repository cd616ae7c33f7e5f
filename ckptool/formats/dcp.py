"""torch.distributed.checkpoint (DCP) directories: ``.metadata`` + ``__<rank>_<n>.distcp`` files.

``torch.distributed.checkpoint.save`` writes one pickle, ``.metadata``, describing every entry of
the (flattened) state dict, and per-rank ``.distcp`` files holding the data:

* a tensor is saved as one or more *chunks* (a DTensor or ShardedTensor as its shards, a plain or
  replicated tensor as one chunk); each chunk is a complete ``torch.save`` zip archive embedded in
  a ``.distcp`` file at ``(offset, length)``;
* any other value (an int, a float, an optimizer's ``param_groups`` entries) is ``torch.save``'d
  the same way as a "bytes" entry.

Reading never imports torch and never runs pickle code: ``.metadata`` goes through the restricted
unpickler with an allowlist of exactly DCP's metadata classes (inert placeholders, interpreted
and validated in :mod:`.dcp_metadata`), and each embedded archive through the same reader as a
``.pt`` file, its storage bytes left where they lie. A tensor saved as one chunk is a plain lazy tensor over that
chunk's bytes; a tensor split into chunks gets a storage whose bytes are assembled on demand, one
tensor at a time. The flattened keys (``model.fc1.weight``) are nested back
(``{"model": {"fc1.weight": ...}}``) with the key paths DCP records in ``planner_data``.
"""

from __future__ import annotations

import io
import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO, cast

from ckptool import pickles
from ckptool.base.errors import InputError, UnsupportedFormatError
from ckptool.files import inputs
from ckptool.files.byteio import FileCache
from ckptool.files.inputs import located
from ckptool.formats import Contents, Format, PickleBlob, Pickles, ReadOptions, torch_zip, zip_storages, zipio
from ckptool.formats.dcp_metadata import (
    METADATA_NAME,
    BytesEntry,
    Chunk,
    MetadataResolver,
    Storage,
    TensorEntry,
    corrupt,
    parse_metadata,
    read_metadata_bytes,
)
from ckptool.tensors import dtypes
from ckptool.tensors.refs import StorageRef, TensorRef, contiguous_stride, human_size


def sniff(head: bytes | None, path: Path) -> bool:
    """A folder holding a DCP ``.metadata`` file."""
    return head is None and (path / METADATA_NAME).is_file()


# ---------------------------------------------------------------------------------------------
# the embedded torch.save archives


class _Window(io.RawIOBase):
    """A read-only, seekable window of ``length`` bytes at ``offset`` of an open file."""

    def __init__(self, handle: BinaryIO, offset: int, length: int) -> None:
        super().__init__()
        self._handle, self._offset, self._length, self._position = handle, offset, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._position

    def seek(self, position: int, whence: int = os.SEEK_SET) -> int:
        base = {os.SEEK_SET: 0, os.SEEK_CUR: self._position, os.SEEK_END: self._length}[whence]
        if base + position < 0:
            raise OSError(22, "seek before the start of the window")
        self._position = base + position
        return self._position

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        count = max(0, min(len(view), self._length - self._position))
        if not count:
            return 0
        self._handle.seek(self._offset + self._position)
        got = self._handle.readinto(view[:count])  # type: ignore[attr-defined]  # open_member's files are buffered
        self._position += got or 0
        return got or 0


def _handle(window: _Window) -> BinaryIO:
    """The window as zipio takes an archive: a seekable binary file, which a window (an io.RawIOBase) is."""
    return cast(BinaryIO, window)


class _Files(FileCache[BinaryIO]):
    """Open data files, each opened once per read (none closed before the read ends: windows share them)."""

    def __init__(self) -> None:
        super().__init__(_open_data_file, lambda handle: handle.close(), limit=None)


def _open_data_file(path: Path) -> BinaryIO:
    # the same rule as when the metadata named it: a regular file of the checkpoint directory
    return inputs.open_member(path.parent, path, what=f"DCP data file {path.name!r}", report=path.parent)


def _archive(
    files: _Files, storage: Storage, what: str, directory: Path
) -> tuple[_Window, dict[str, zipio.Member], str]:
    window = _Window(files.get(storage.file), storage.offset, storage.length)
    head = window.read(4)
    window.seek(0)
    if head != b"PK\x03\x04":
        raise UnsupportedFormatError(
            f"DCP entry {what} in {storage.file.name} is not a torch.save archive (saved with another "
            "serialization format?); ckptool reads DCP checkpoints written by FileSystemWriter's default format",
            path=directory,
        )
    where = located(f"{storage.file}@{storage.offset}")
    members = zipio.read_members(where, _handle(window), size=storage.length)
    return window, members, torch_zip.archive_folder(where, members)


def _pickle_bytes(window: _Window, members: dict[str, zipio.Member], top: str, where: Path) -> bytes:
    member = members.get(f"{top}/data.pkl")
    if member is None:
        raise InputError("embedded archive has no data.pkl — the checkpoint is corrupt", path=where)
    return zipio.read_member(where, _handle(window), member, limit=pickles.MAX_PICKLE_BYTES)


def _read_archive(files: _Files, storage: Storage, resolver: pickles.GlobalResolver, what: str, directory: Path) -> Any:
    """Unpickle one embedded ``torch.save`` archive; storages point at their bytes in the data file."""
    window, members, top = _archive(files, storage, what, directory)
    where = located(f"{storage.file}@{storage.offset}")
    data = _pickle_bytes(window, members, top, where)
    storages: dict[str, StorageRef] = {}
    persistent_load = zip_storages.storage_loader(
        directory,
        members,
        top,
        storages,
        data_file=storage.file,
        base_offset=storage.offset,
        context=f"DCP entry {what}: ",
    )
    return pickles.loads(data, resolver, persistent_load)


# ---------------------------------------------------------------------------------------------
# tensors


def _assembler(entry: TensorEntry, parts: list[tuple[Chunk, TensorRef]]) -> Callable[[], bytearray]:
    """Bytes of a tensor saved in chunks, put together by offset (numpy; one tensor in memory)."""
    itemsize = entry.dtype.itemsize

    def assemble() -> bytearray:
        import numpy as np

        buffer = bytearray(math.prod(entry.size) * itemsize)
        row = math.prod(entry.size[1:]) * itemsize if entry.size else itemsize
        whole = np.frombuffer(buffer, dtype=np.uint8).reshape(*entry.size, itemsize)
        view = memoryview(buffer)
        for chunk, tensor in parts:
            if not tensor.numel:
                continue
            span = tensor.contiguous_byte_range()
            if span is not None and tuple(chunk.sizes[1:]) == tuple(entry.size[1:]):
                # a block of whole rows (Shard(0), FSDP's flat shards): read it straight into place
                start = chunk.offsets[0] * row if entry.size else 0
                position = start
                for piece in span.iter_reused():
                    view[position : position + len(piece)] = piece
                    position += len(piece)
                continue
            block = np.frombuffer(tensor.read_bytes(), dtype=np.uint8).reshape(*chunk.sizes, itemsize)
            whole[tuple(slice(o, o + s) for o, s in zip(chunk.offsets, chunk.sizes))] = block
        del whole, view
        return buffer

    return assemble


def _row_pieces(entry: TensorEntry, parts: list[tuple[Chunk, TensorRef]]) -> tuple | None:
    """The chunks' byte ranges in order when they are blocks of whole rows tiling the tensor
    (Shard(0), FSDP's flat shards): then the tensor's bytes are those ranges end to end and
    writers copy them into place without assembling the tensor in memory. Each range carries the
    CRC-32 its embedded archive stored when the chunk is that archive's whole storage member."""
    if not entry.size:
        return None
    ordered = sorted(parts, key=lambda part: part[0].offsets[0])
    row = 0
    pieces = []
    for chunk, tensor in ordered:
        if tuple(chunk.sizes[1:]) != tuple(entry.size[1:]) or any(chunk.offsets[1:]) or chunk.offsets[0] != row:
            return None
        span = tensor.contiguous_byte_range()
        if span is None:
            return None
        # a chunk that is its whole storage keeps the CRC its archive stored for it: writers then
        # combine the pieces' CRCs and let the kernel copy the bytes
        data = tensor.storage.data
        if data is not None and data.crc32 is not None and tensor.offset == 0 and span.length == data.length:
            span.crc32 = data.crc32
        pieces.append(span)
        row += chunk.sizes[0]
    return tuple(pieces) if row == entry.size[0] else None


def _tensor(entry: TensorEntry, files: _Files, resolver: pickles.GlobalResolver, directory: Path) -> TensorRef:
    what = repr(entry.fqn[:120])
    parts: list[tuple[Chunk, TensorRef]] = []
    for chunk in entry.chunks:
        tensor = _read_archive(files, chunk.storage, resolver, what, directory)
        if not isinstance(tensor, TensorRef):
            raise InputError(
                f"DCP tensor {what}: a chunk holds {type(tensor).__name__}, not a tensor — the checkpoint is corrupt",
                path=directory,
            )
        if tensor.dtype != entry.dtype or tuple(tensor.shape) != chunk.sizes:
            raise InputError(
                f"DCP tensor {what}: the chunk at {list(chunk.offsets)} holds {tensor.dtype.name} "
                f"{list(tensor.shape)}, not {entry.dtype.name} {list(chunk.sizes)} as listed — "
                "the checkpoint is corrupt",
                path=directory,
            )
        if len(entry.chunks) > 1 and tensor.expands():
            # assembling allocates the whole tensor: what the chunks promise must lie on disk, or a
            # few KB of stride-0 chunks would make the reader allocate gigabytes
            raise InputError(
                f"DCP tensor {what}: the chunk at {list(chunk.offsets)} promises "
                f"{human_size(tensor.nbytes)} but stores {human_size(tensor.span_bytes())} (a stride-0 "
                "or overlapping view) — DCP never "
                "saves a shard so; the checkpoint is corrupt or crafted",
                path=directory,
            )
        parts.append((chunk, tensor))
    if len(parts) == 1 and parts[0][0].sizes == entry.size:
        return parts[0][1]  # one chunk covering the tensor: its bytes are copied raw
    numel = math.prod(entry.size)
    pieces = _row_pieces(entry, parts)
    if entry.dtype.storage_class:
        storage = StorageRef(
            key=entry.fqn,
            dtype=entry.dtype,
            numel=numel,
            location="cpu",
            type_global=f"torch.{entry.dtype.storage_class}",
            producer=_assembler(entry, parts),
            pieces=pieces,
        )
        rebuild = "torch._utils._rebuild_tensor_v2"
    else:
        storage = StorageRef(
            key=entry.fqn,
            dtype=dtypes.BY_NAME["U8"],
            numel=numel * entry.dtype.itemsize,
            location="cpu",
            type_global="torch.storage.UntypedStorage",
            producer=_assembler(entry, parts),
            pieces=pieces,
        )
        rebuild = "torch._utils._rebuild_tensor_v3"
    return TensorRef(
        storage=storage, dtype=entry.dtype, shape=entry.size, stride=contiguous_stride(entry.size), rebuild=rebuild
    )


# ---------------------------------------------------------------------------------------------
# nesting


def _nest(values: list[tuple[str, Any]], paths: dict[str, tuple[str | int, ...]], directory: Path) -> dict:
    """Rebuild the nested state dict DCP flattened (keys without a recorded path stay at the top)."""
    root: dict = {}
    max_index = len(values)
    for fqn, value in values:
        path = paths.get(fqn, (fqn,))
        node: Any = root
        for position, key in enumerate(path):
            last = position == len(path) - 1
            if isinstance(key, int) and (not isinstance(node, list) or key > max_index):
                raise corrupt(f"the key path of {fqn[:80]!r} indexes a list where there is none", directory)
            if isinstance(key, str) and not isinstance(node, dict):
                raise corrupt(f"the key path of {fqn[:80]!r} names a key inside a list", directory)
            if isinstance(node, list) and isinstance(key, int):  # a str key into a list was refused above
                node.extend([None] * (key + 1 - len(node)))
            if last:
                existing = node.get(key) if isinstance(node, dict) else node[key]
                if existing is not None:
                    raise corrupt(f"two entries nest to the same place as {fqn[:80]!r}", directory)
                node[key] = value
                break
            child = node.get(key) if isinstance(node, dict) else node[key]
            if child is None:
                child = {} if isinstance(path[position + 1], str) else []
                node[key] = child
            elif not isinstance(child, dict | list):
                raise corrupt(f"the key path of {fqn[:80]!r} runs through a value", directory)
            node = child
    return root


# ---------------------------------------------------------------------------------------------
# entry points


def read(directory: Path, options: ReadOptions) -> Contents:
    """Read a DCP checkpoint directory without torch: the nested state dict, ``.metadata`` and the data files.

    Raises:
        InputError: missing, truncated or inconsistent metadata or data files, or paths outside the directory.
        UnsupportedFormatError: entries saved with storage transforms or a non-torch.save serialization.
        pickles.RefusedGlobal: a pickle names a global outside the allowlist (the reader reports it).
    """
    resolver = options.resolver
    metadata = parse_metadata(directory, resolver)
    files = _Files()
    values: list[tuple[str, Any]] = []
    split = 0
    try:
        for entry in metadata.entries:
            if isinstance(entry, BytesEntry):
                values.append(
                    (entry.fqn, _read_archive(files, entry.storage, resolver, repr(entry.fqn[:120]), directory))
                )
            else:
                tensor = _tensor(entry, files, resolver, directory)
                split += tensor.storage.producer is not None
                values.append((entry.fqn, tensor))
    finally:
        files.close()
    order = {fqn: n for n, fqn in enumerate(metadata.paths)}
    values.sort(key=lambda item: order.get(item[0], len(order)))
    container = _nest(values, metadata.paths, directory)
    notes = []
    if split:
        notes.append(f"{split} tensor(s) were saved in several chunks (sharded); their bytes are assembled on read")
    return Contents(container=container, files=[directory / METADATA_NAME, *metadata.files], notes=notes)


def pickle_blobs(directory: Path, options: ReadOptions) -> Pickles:
    """The pickles of a DCP checkpoint, for scanning: ``.metadata``, then each embedded ``data.pkl``.

    The embedded ones are listed only when ``.metadata`` itself reads under the allowlist of
    ``options.resolver`` (otherwise where they lie cannot be trusted); nothing is unpickled beyond
    that placeholder read. A load reads every one of them.
    """
    return Pickles(FORMAT.name, [PickleBlob(label, data) for label, data in _pickle_blobs(directory, options.resolver)])


def _pickle_blobs(directory: Path, resolver: pickles.GlobalResolver) -> list[tuple[str, bytes]]:
    blobs = [(METADATA_NAME, read_metadata_bytes(directory, pickles.MAX_PICKLE_BYTES))]
    try:
        metadata = parse_metadata(directory, resolver)
    except (pickles.RefusedGlobal, InputError):
        return blobs
    files = _Files()
    try:
        for entry in metadata.entries:
            storages = [entry.storage] if isinstance(entry, BytesEntry) else [c.storage for c in entry.chunks]
            for storage in storages:
                window, members, top = _archive(files, storage, repr(entry.fqn[:120]), directory)
                where = located(f"{storage.file}@{storage.offset}")
                blobs.append(
                    (f"{storage.file.name}@{storage.offset}/{top}/data.pkl", _pickle_bytes(window, members, top, where))
                )
    finally:
        files.close()
    return blobs


FORMAT = Format(
    name="dcp",
    sniff=sniff,
    read=read,
    pickle_blobs=pickle_blobs,
    scan_resolver=MetadataResolver,
    target="dcp",
    own_saver=True,
    torch_load_refuses="a torch.distributed.checkpoint directory: torch.load and single-file loaders cannot read it",
    owns=lambda folder: lambda path: True,  # every file of the folder is its own
)
