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
and validated here), and each embedded archive through the same reader as a ``.pt`` file, its
storage bytes left where they lie. A tensor saved as one chunk is a plain lazy tensor over that
chunk's bytes; a tensor split into chunks gets a storage whose bytes are assembled on demand, one
tensor at a time. The flattened keys (``model.fc1.weight``) are nested back
(``{"model": {"fc1.weight": ...}}``) with the key paths DCP records in ``planner_data``.
"""

from __future__ import annotations

import io
import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from .. import dtypes, inputs, pickles
from ..checkpoint import Checkpoint, find_layout
from ..errors import InputError, UnsupportedFormatError
from ..refs import DTypeRef, StorageRef, TensorRef, contiguous_stride, human_size
from . import torch_zip, zipio

FORMAT = "dcp"
METADATA_NAME = ".metadata"

_META = "torch.distributed.checkpoint.metadata"
_FS = "torch.distributed.checkpoint.filesystem"
_LAYOUTS = frozenset({"torch.strided"})
_MAX_DIMS = 64


# ---------------------------------------------------------------------------------------------
# the metadata allowlist: placeholders only, nothing named is imported


def _get_layout(name: Any = None) -> str:
    # torch pickles a torch.layout as torch.serialization._get_layout("torch.strided")
    if not isinstance(name, str) or not name.startswith("torch.") or len(name) > 64:
        raise InputError(f"DCP metadata names layout {str(name)[:40]!r} — the file is corrupt")
    return name


def _mem_format(value: Any = None) -> int:
    # _MEM_FORMAT_ENCODING(n): 0 contiguous, 1 channels_last, 2 preserve
    if type(value) is not int or value not in (0, 1, 2):
        raise InputError(f"DCP metadata has memory format {pickles.brief(value)} — the file is corrupt")
    return value


def _path(*parts: Any) -> str:
    # StorageMeta.checkpoint_id may be a pathlib path; it is kept as text, never built
    if not all(isinstance(p, str) for p in parts):
        raise InputError("DCP metadata has a malformed checkpoint path — the file is corrupt")
    return "/".join(parts)


_DATACLASSES = (
    f"{_META}.Metadata",
    f"{_META}.TensorStorageMetadata",
    f"{_META}.ChunkStorageMetadata",
    f"{_META}.TensorProperties",
    f"{_META}.BytesStorageMetadata",
    f"{_META}.MetadataIndex",
    f"{_META}.StorageMeta",
    f"{_FS}._StorageInfo",
)

# The globals a DCP .metadata pickle needs beyond torch's own (torch.Size and dtypes are in
# pickles.TORCH_GLOBALS already). Data classes become OpaqueObject records; the three callables
# are replaced by validating functions.
METADATA_GLOBALS: dict[str, Any] = {
    **{name: pickles.opaque_type(name) for name in _DATACLASSES},
    f"{_META}._MEM_FORMAT_ENCODING": _mem_format,
    "torch.serialization._get_layout": _get_layout,
    **{f"{module}.{cls}": _path for module in ("pathlib", "pathlib._local")
       for cls in ("PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath")},
}


def _refuse_build(state: Any) -> None:
    raise InputError("DCP metadata sets state (BUILD) on a function — torch never writes that; refused")


for _function in (_get_layout, _mem_format, _path):
    # BUILD on a shared function would change it (its __defaults__) for every later load
    _function.__setstate__ = _refuse_build  # type: ignore[attr-defined]


class MetadataResolver(pickles.GlobalResolver):
    """A resolver for ``.metadata``: DCP's classes on top of ``base``'s allowlist, sharing its records."""

    def __init__(self, base: pickles.GlobalResolver) -> None:  # noqa: D107 — shares base's state
        vars(self).update(vars(base))

    def is_allowed(self, full_name: str) -> bool:  # noqa: D102
        return full_name in METADATA_GLOBALS or super().is_allowed(full_name)

    def resolve(self, module: str, name: str) -> Any:  # noqa: D102
        full_name = f"{module}.{name}"
        if full_name in METADATA_GLOBALS:
            self.seen[full_name] = self.seen.get(full_name, 0) + 1
            return METADATA_GLOBALS[full_name]
        return super().resolve(module, name)


def is_dcp(path: Path) -> bool:
    """A directory holding a DCP ``.metadata`` file."""
    return path.is_dir() and (path / METADATA_NAME).is_file()


# ---------------------------------------------------------------------------------------------
# interpreting the metadata records


@dataclass(frozen=True)
class _Storage:
    """Where one entry (a tensor chunk or a bytes value) lies: ``length`` bytes of ``file`` at ``offset``."""

    file: Path
    offset: int
    length: int


@dataclass
class _Chunk:
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    storage: _Storage


@dataclass
class _TensorEntry:
    fqn: str
    dtype: dtypes.DType
    size: tuple[int, ...]
    chunks: list[_Chunk]


@dataclass
class _BytesEntry:
    fqn: str
    storage: _Storage


@dataclass
class _Metadata:
    entries: list[_TensorEntry | _BytesEntry]
    paths: dict[str, tuple[str | int, ...]]
    files: list[Path]


def _corrupt(message: str, directory: Path) -> InputError:
    return InputError(f"DCP {METADATA_NAME}: {message} — the checkpoint is corrupt or was tampered with",
                      path=directory)


def _record(obj: Any, cls: str, directory: Path, what: str) -> dict[str, Any]:
    """The fields of a data-class record built by NEWOBJ + BUILD (a dict, or {} with no state)."""
    if not isinstance(obj, pickles.OpaqueObject) or obj.global_name != cls:
        raise _corrupt(f"{what} is {type(obj).__name__}, not {cls.rsplit('.', 1)[-1]}", directory)
    if obj._mode != "newobj" or obj._args or obj._items or obj._setitems:
        raise _corrupt(f"{what} is not built the way DCP pickles it", directory)
    state = obj.state
    if state is None:
        return {}
    if isinstance(state, tuple) and len(state) == 2 and state[0] is None and isinstance(state[1], dict):
        state = state[1]  # (None, slot state)
    if not isinstance(state, dict) or not all(isinstance(k, str) for k in state):
        raise _corrupt(f"{what} has malformed fields", directory)
    return state


def _ints(value: Any, directory: Path, what: str) -> tuple[int, ...]:
    if not isinstance(value, tuple | list) or len(value) > _MAX_DIMS \
            or not all(type(v) is int and v >= 0 for v in value):
        raise _corrupt(f"{what} is {pickles.brief(value)}, not a tuple of non-negative integers", directory)
    return tuple(value)


def _int(value: Any, directory: Path, what: str) -> int:
    if type(value) is not int or value < 0:
        raise _corrupt(f"{what} is {pickles.brief(value)}, not a non-negative integer", directory)
    return value


def _dtype(properties: Any, directory: Path, fqn: str) -> dtypes.DType:
    cls = f"{_META}.TensorProperties"
    if not isinstance(properties, pickles.OpaqueObject) or properties.global_name != cls \
            or properties._mode != "newobj" or properties._args:
        raise _corrupt(f"{fqn!r}: tensor properties are malformed", directory)
    state = properties.state
    if isinstance(state, tuple) and len(state) == 5:  # TensorProperties.__getstate__
        dtype, layout = state[0], state[1]
    elif isinstance(state, dict):  # older torch pickled the fields
        dtype, layout = state.get("dtype"), state.get("layout", "torch.strided")
    else:
        raise _corrupt(f"{fqn!r}: tensor properties are malformed", directory)
    if isinstance(layout, str) and layout not in _LAYOUTS:
        raise UnsupportedFormatError(f"DCP entry {fqn!r} is a {layout} tensor; ckptool reads dense tensors only",
                                     path=directory)
    if not isinstance(dtype, DTypeRef) or dtype.name not in dtypes.BY_TORCH_NAME:
        raise _corrupt(f"{fqn!r}: dtype {dtype!r} is not one ckptool knows", directory)
    return dtypes.BY_TORCH_NAME[dtype.name]


def _data_file(directory: Path, name: Any, sizes: dict[str, int]) -> Path:
    """The data file ``name`` refers to: a plain file name inside the checkpoint directory."""
    if isinstance(name, str) and name in sizes:
        return directory / name
    if not isinstance(name, str) or not name or len(name) > 255 or name in (".", "..", METADATA_NAME) \
            or any(ch in name for ch in "/\\\0") or ":" in name:
        raise InputError(f"DCP {METADATA_NAME} points at {str(name)[:80]!r}, outside the checkpoint directory — "
                         "refused", path=directory)
    path = directory / name
    # a regular file inside the checkpoint directory (a link may point inside it, or into a hub cache's blobs/)
    sizes[name] = inputs.check_member(directory, path, what=f"DCP data file {name!r}", report=directory).st_size
    return path


def _storage_info(info: Any, directory: Path, sizes: dict[str, int], what: str) -> _Storage:
    fields = _record(info, f"{_FS}._StorageInfo", directory, what)
    if fields.get("transform_descriptors"):
        raise UnsupportedFormatError(
            f"DCP entry {what} was saved through storage transforms {list(fields['transform_descriptors'])[:4]} "
            "(e.g. compression); ckptool reads untransformed DCP checkpoints only", path=directory)
    path = _data_file(directory, fields.get("relative_path"), sizes)
    offset = _int(fields.get("offset"), directory, f"{what} offset")
    length = _int(fields.get("length"), directory, f"{what} length")
    if offset + length > sizes[path.name]:
        raise InputError(f"DCP entry {what} lies at bytes {offset}..{offset + length} of {path.name}, which has "
                         f"{sizes[path.name]} — the checkpoint is truncated or corrupt", path=directory)
    return _Storage(path, offset, length)


def _planner_paths(planner_data: Any, directory: Path) -> dict[str, tuple[str | int, ...]]:
    """DCP's flattening map fqn -> key path (``{"model.fc1.weight": ("model", "fc1.weight")}``)."""
    if planner_data is None:
        return {}
    if not isinstance(planner_data, dict):
        return {}  # a custom planner's own data: the keys stay flat
    paths: dict[str, tuple[str | int, ...]] = {}
    for fqn, path in planner_data.items():
        if not isinstance(fqn, str):
            continue
        if not isinstance(path, tuple | list) or not path or len(path) > 256 \
                or not all(isinstance(p, str) or (type(p) is int and p >= 0) for p in path) \
                or not isinstance(path[0], str):
            raise _corrupt(f"the key path of {fqn[:80]!r} is malformed", directory)
        paths[fqn] = tuple(path)
    return paths


def parse_metadata(directory: Path, resolver: pickles.GlobalResolver) -> _Metadata:
    """Read and validate ``.metadata``: every entry, its chunks and where their bytes lie."""
    meta_path = directory / METADATA_NAME
    try:
        with inputs.open_member(directory, meta_path, what=f"DCP {METADATA_NAME}", report=directory) as handle:
            data = handle.read(pickles.MAX_PICKLE_BYTES + 1)
    except OSError as e:
        raise InputError(f"DCP {METADATA_NAME} cannot be read ({e.strerror})", path=directory) from e
    if not data:
        raise InputError(f"DCP {METADATA_NAME} is empty — the save did not finish", path=directory)
    if len(data) > pickles.MAX_PICKLE_BYTES:
        raise InputError(f"DCP {METADATA_NAME} is over {pickles.MAX_PICKLE_BYTES} bytes — refused", path=directory)
    metadata = pickles.loads(data, MetadataResolver(resolver))
    fields = _record(metadata, f"{_META}.Metadata", directory, "the top-level object")
    state_dict_metadata = fields.get("state_dict_metadata")
    storage_data = fields.get("storage_data")
    if not isinstance(state_dict_metadata, dict) or not all(isinstance(k, str) for k in state_dict_metadata):
        raise _corrupt("state_dict_metadata is not a mapping of names", directory)
    if not isinstance(storage_data, dict):
        raise _corrupt("storage_data is not a mapping (was this saved by a FileSystemWriter?)", directory)

    # storage_data: MetadataIndex(fqn, offset) -> _StorageInfo, validated lazily per entry used.
    # Keyed by text, not by the offsets tuple: tuples of ints hash predictably, so a crafted
    # .metadata could make every insertion collide (50 s for a few MB); str hashes are salted.
    index: dict[tuple[str, str | None], Any] = {}
    for key, info in storage_data.items():
        key_fields = _record(key, f"{_META}.MetadataIndex", directory, "a storage_data key")
        fqn = key_fields.get("fqn")
        if not isinstance(fqn, str):
            raise _corrupt("a storage_data key has no name", directory)
        offset = key_fields.get("offset")
        lookup = (fqn, None if offset is None else _offsets_key(_ints(offset, directory, f"{fqn!r} chunk offset")))
        if lookup in index and not _same_info(index[lookup], info):
            raise _corrupt(f"{fqn[:80]!r} has two different storage records for one chunk", directory)
        index[lookup] = info

    sizes: dict[str, int] = {}
    entries: list[_TensorEntry | _BytesEntry] = []
    # a chunk record takes dozens of bytes; a pickle listing more than this re-uses records (memo)
    # to make the reader do unbounded work
    budget = len(data) // 16
    for fqn, entry in state_dict_metadata.items():
        what = repr(fqn[:120])
        if isinstance(entry, pickles.OpaqueObject) and entry.global_name == f"{_META}.BytesStorageMetadata":
            _record(entry, entry.global_name, directory, what)
            info = index.get((fqn, None))
            if info is None:
                raise _corrupt(f"value {what} has no storage record", directory)
            entries.append(_BytesEntry(fqn, _storage_info(info, directory, sizes, what)))
            continue
        tensor_fields = _record(entry, f"{_META}.TensorStorageMetadata", directory, what)
        dtype = _dtype(tensor_fields.get("properties"), directory, fqn)
        size = _ints(tensor_fields.get("size"), directory, f"{what} size")
        raw_chunks = tensor_fields.get("chunks")
        if not isinstance(raw_chunks, list) or (not raw_chunks and math.prod(size)):
            raise _corrupt(f"tensor {what} lists no chunks", directory)
        chunks: list[_Chunk] = []
        seen: dict[str, tuple[int, ...]] = {}  # by text, as index
        budget -= len(raw_chunks)
        if budget < 0:
            raise _corrupt("lists more chunks than it could describe", directory)
        for number, raw in enumerate(raw_chunks):
            chunk_fields = _record(raw, f"{_META}.ChunkStorageMetadata", directory, f"{what} chunk {number}")
            offsets = _ints(chunk_fields.get("offsets"), directory, f"{what} chunk offsets")
            chunk_sizes = _ints(chunk_fields.get("sizes"), directory, f"{what} chunk sizes")
            if len(offsets) != len(size) or len(chunk_sizes) != len(size):
                raise _corrupt(f"tensor {what} of {len(size)} dims has a chunk of {len(offsets)}", directory)
            if any(o + s > d for o, s, d in zip(offsets, chunk_sizes, size)):
                raise _corrupt(f"tensor {what} of size {list(size)} has a chunk at {list(offsets)} of size "
                               f"{list(chunk_sizes)} that reaches outside it", directory)
            key = _offsets_key(offsets)
            if key in seen:  # the same chunk listed twice (a replicated tensor): taken once
                if seen[key] != chunk_sizes:
                    raise _corrupt(f"tensor {what} has two different chunks at {list(offsets)}", directory)
                continue
            seen[key] = chunk_sizes
            info = index.get((fqn, key))
            if info is None:
                raise _corrupt(f"tensor {what}: the chunk at {list(offsets)} has no storage record", directory)
            chunks.append(_Chunk(offsets, chunk_sizes, _storage_info(info, directory, sizes, what)))
        _check_tiling(fqn, size, chunks, directory)
        entries.append(_TensorEntry(fqn, dtype, size, chunks))
    paths = _planner_paths(fields.get("planner_data"), directory)
    return _Metadata(entries, paths, [directory / name for name in sorted(sizes)])


def _offsets_key(offsets: tuple[int, ...]) -> str:
    return ",".join(map(str, offsets))


def _same_info(a: Any, b: Any) -> bool:
    if a is b:
        return True
    if not (isinstance(a, pickles.OpaqueObject) and isinstance(b, pickles.OpaqueObject)):
        return False
    return a.global_name == b.global_name and a.state == b.state


def _check_tiling(fqn: str, size: tuple[int, ...], chunks: list[_Chunk], directory: Path) -> None:
    """The chunks cover the tensor exactly: inside it (checked before), disjoint, volumes summing up."""
    boxes = [c for c in chunks if math.prod(c.sizes)]
    total = sum(math.prod(c.sizes) for c in boxes)
    numel = math.prod(size)
    if total != numel:
        raise _corrupt(f"tensor {fqn[:120]!r} of size {list(size)}: its chunks hold {total} of {numel} elements", directory)
    if len(boxes) < 2:
        return
    # sweep along the dimension with the most distinct chunk starts: neighbours there are few
    ndim = len(size)
    axis = max(range(ndim), key=lambda d: len({c.offsets[d] for c in boxes}))
    boxes.sort(key=lambda c: c.offsets[axis])
    active: list[_Chunk] = []
    for box in boxes:
        start = box.offsets[axis]
        active = [a for a in active if a.offsets[axis] + a.sizes[axis] > start]
        for other in active:
            if all(box.offsets[d] < other.offsets[d] + other.sizes[d] and other.offsets[d] < box.offsets[d] + box.sizes[d]
                   for d in range(ndim)):
                raise _corrupt(f"tensor {fqn[:120]!r}: chunks at {list(other.offsets)} and {list(box.offsets)} overlap",
                               directory)
        active.append(box)


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
        got = self._handle.readinto(view[:count])
        self._position += got or 0
        return got or 0


class _Files:
    """Open data files, each opened once per read."""

    def __init__(self) -> None:
        self.handles: dict[Path, BinaryIO] = {}

    def get(self, path: Path) -> BinaryIO:
        handle = self.handles.get(path)
        if handle is None:
            # the same rule as when the metadata named it: a regular file of the checkpoint directory
            handle = self.handles[path] = inputs.open_member(path.parent, path, what=f"DCP data file {path.name!r}",
                                                             report=path.parent)
        return handle

    def close(self) -> None:
        for handle in self.handles.values():
            handle.close()


def _archive(files: _Files, storage: _Storage, what: str, directory: Path
             ) -> tuple[_Window, dict[str, zipio.Member], str]:
    window = _Window(files.get(storage.file), storage.offset, storage.length)
    head = window.read(4)
    window.seek(0)
    if head != b"PK\x03\x04":
        raise UnsupportedFormatError(
            f"DCP entry {what} in {storage.file.name} is not a torch.save archive (saved with another "
            "serialization format?); ckptool reads DCP checkpoints written by FileSystemWriter's default format",
            path=directory)
    where = Path(f"{storage.file}@{storage.offset}")
    members = zipio.read_members(where, window, size=storage.length)
    return window, members, torch_zip.archive_folder(where, members)


def _pickle_bytes(window: _Window, members: dict[str, zipio.Member], top: str, where: Path) -> bytes:
    member = members.get(f"{top}/data.pkl")
    if member is None:
        raise InputError("embedded archive has no data.pkl — the checkpoint is corrupt", path=where)
    return zipio.read_member(where, window, member, limit=pickles.MAX_PICKLE_BYTES)


def _read_archive(files: _Files, storage: _Storage, resolver: pickles.GlobalResolver, what: str,
                  directory: Path) -> Any:
    """Unpickle one embedded ``torch.save`` archive; storages point at their bytes in the data file."""
    window, members, top = _archive(files, storage, what, directory)
    where = Path(f"{storage.file}@{storage.offset}")
    data = _pickle_bytes(window, members, top, where)
    storages: dict[str, StorageRef] = {}
    persistent_load = torch_zip.storage_loader(directory, members, top, storages, data_file=storage.file,
                                               base_offset=storage.offset, context=f"DCP entry {what}: ")
    return pickles.loads(data, resolver, persistent_load)


# ---------------------------------------------------------------------------------------------
# tensors


def _assembler(entry: _TensorEntry, parts: list[tuple[_Chunk, TensorRef]]) -> Callable[[], bytearray]:
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


def _row_pieces(entry: _TensorEntry, parts: list[tuple[_Chunk, TensorRef]]) -> tuple | None:
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


def _tensor(entry: _TensorEntry, files: _Files, resolver: pickles.GlobalResolver, directory: Path) -> TensorRef:
    what = repr(entry.fqn[:120])
    parts: list[tuple[_Chunk, TensorRef]] = []
    for chunk in entry.chunks:
        tensor = _read_archive(files, chunk.storage, resolver, what, directory)
        if not isinstance(tensor, TensorRef):
            raise InputError(f"DCP tensor {what}: a chunk holds {type(tensor).__name__}, not a tensor — "
                             "the checkpoint is corrupt", path=directory)
        if tensor.dtype != entry.dtype or tuple(tensor.shape) != chunk.sizes:
            raise InputError(f"DCP tensor {what}: the chunk at {list(chunk.offsets)} holds {tensor.dtype.name} "
                             f"{list(tensor.shape)}, not {entry.dtype.name} {list(chunk.sizes)} as listed — "
                             "the checkpoint is corrupt", path=directory)
        if len(entry.chunks) > 1 and tensor.expands():
            # assembling allocates the whole tensor: what the chunks promise must lie on disk, or a
            # few KB of stride-0 chunks would make the reader allocate gigabytes
            raise InputError(f"DCP tensor {what}: the chunk at {list(chunk.offsets)} promises "
                             f"{human_size(tensor.nbytes)} but stores {human_size(tensor.span_bytes())} (a stride-0 "
                             "or overlapping view) — DCP never "
                             "saves a shard so; the checkpoint is corrupt or crafted", path=directory)
        parts.append((chunk, tensor))
    if len(parts) == 1 and parts[0][0].sizes == entry.size:
        return parts[0][1]  # one chunk covering the tensor: its bytes are copied raw
    numel = math.prod(entry.size)
    pieces = _row_pieces(entry, parts)
    if entry.dtype.storage_class:
        storage = StorageRef(key=entry.fqn, dtype=entry.dtype, numel=numel, location="cpu",
                             type_global=f"torch.{entry.dtype.storage_class}", producer=_assembler(entry, parts),
                             pieces=pieces)
        rebuild = "torch._utils._rebuild_tensor_v2"
    else:
        storage = StorageRef(key=entry.fqn, dtype=dtypes.BY_NAME["U8"], numel=numel * entry.dtype.itemsize,
                             location="cpu", type_global="torch.storage.UntypedStorage",
                             producer=_assembler(entry, parts), pieces=pieces)
        rebuild = "torch._utils._rebuild_tensor_v3"
    return TensorRef(storage=storage, dtype=entry.dtype, shape=entry.size, stride=contiguous_stride(entry.size),
                     rebuild=rebuild)


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
                raise _corrupt(f"the key path of {fqn[:80]!r} indexes a list where there is none", directory)
            if isinstance(key, str) and not isinstance(node, dict):
                raise _corrupt(f"the key path of {fqn[:80]!r} names a key inside a list", directory)
            if isinstance(node, list):
                node.extend([None] * (key + 1 - len(node)))
            if last:
                existing = node[key] if isinstance(node, list) else node.get(key)
                if existing is not None:
                    raise _corrupt(f"two entries nest to the same place as {fqn[:80]!r}", directory)
                node[key] = value
                break
            child = node[key] if isinstance(node, list) else node.get(key)
            if child is None:
                child = {} if isinstance(path[position + 1], str) else []
                node[key] = child
            elif not isinstance(child, dict | list):
                raise _corrupt(f"the key path of {fqn[:80]!r} runs through a value", directory)
            node = child
    return root


# ---------------------------------------------------------------------------------------------
# entry points


def read(directory: Path, resolver: pickles.GlobalResolver) -> Checkpoint:
    """Read a DCP checkpoint directory into a :class:`Checkpoint` (format ``dcp``) without torch.

    Raises:
        InputError: missing, truncated or inconsistent metadata or data files, or paths outside the directory.
        UnsupportedFormatError: entries saved with storage transforms or a non-torch.save serialization.
        pickles.RefusedGlobal: a pickle names a global outside the allowlist (the reader reports it).
    """
    metadata = parse_metadata(directory, resolver)
    files = _Files()
    values: list[tuple[str, Any]] = []
    split = 0
    try:
        for entry in metadata.entries:
            if isinstance(entry, _BytesEntry):
                values.append((entry.fqn, _read_archive(files, entry.storage, resolver, repr(entry.fqn[:120]),
                                                        directory)))
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
    return Checkpoint(path=directory, format=FORMAT, container=container, layout=find_layout(container),
                      globals=dict(resolver.seen), files=[directory / METADATA_NAME, *metadata.files], notes=notes)


def pickle_blobs(directory: Path, allow_globals: tuple[str, ...] | list[str] = (),
                 guard_cache: pickles.GuardCache | None = None) -> list[tuple[str, bytes]]:
    """The pickles of a DCP checkpoint, for scanning: ``.metadata``, then each embedded ``data.pkl``.

    The embedded ones are listed only when ``.metadata`` itself reads under the allowlist (otherwise
    where they lie cannot be trusted); nothing is unpickled beyond that placeholder read.
    """
    meta_path = directory / METADATA_NAME
    try:
        with inputs.open_member(directory, meta_path, what=f"DCP {METADATA_NAME}", report=directory) as handle:
            blobs = [(METADATA_NAME, handle.read(pickles.MAX_PICKLE_BYTES))]
    except OSError as e:
        raise InputError(f"DCP {METADATA_NAME} cannot be read ({e.strerror})", path=directory) from e
    try:
        metadata = parse_metadata(directory, pickles.GlobalResolver(allow_globals, guard_cache=guard_cache))
    except (pickles.RefusedGlobal, InputError):
        return blobs
    files = _Files()
    try:
        for entry in metadata.entries:
            storages = [entry.storage] if isinstance(entry, _BytesEntry) else [c.storage for c in entry.chunks]
            for storage in storages:
                window, members, top = _archive(files, storage, repr(entry.fqn[:120]), directory)
                where = Path(f"{storage.file}@{storage.offset}")
                blobs.append((f"{storage.file.name}@{storage.offset}/{top}/data.pkl",
                              _pickle_bytes(window, members, top, where)))
    finally:
        files.close()
    return blobs
