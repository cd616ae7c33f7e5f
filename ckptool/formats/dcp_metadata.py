"""The ``.metadata`` pickle of a torch.distributed.checkpoint (DCP) directory, read and validated.

``.metadata`` goes through the restricted unpickler with an allowlist of exactly DCP's metadata
classes (:data:`METADATA_GLOBALS`: inert placeholders, nothing named is imported), and the records
it builds are interpreted here into :class:`Metadata`: every entry of the flattened state dict, the
chunks of each tensor (checked to tile it exactly) and where each chunk's or value's bytes lie in
the ``.distcp`` files. Reading those bytes is :mod:`ckptool.formats.dcp`'s part.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ckptool import pickles
from ckptool.base.errors import InputError, UnsupportedFormatError
from ckptool.files import inputs
from ckptool.pickles.placeholders import refuse_build
from ckptool.tensors import dtypes
from ckptool.tensors.refs import DTypeRef

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
    **{
        f"{module}.{cls}": _path
        for module in ("pathlib", "pathlib._local")
        for cls in ("PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath")
    },
}


for _function in (_get_layout, _mem_format, _path):
    # BUILD on a shared function would change it (its __defaults__) for every later load
    _function.__setstate__ = refuse_build  # type: ignore[union-attr]


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


# ---------------------------------------------------------------------------------------------
# interpreting the metadata records


@dataclass(frozen=True)
class Storage:
    """Where one entry (a tensor chunk or a bytes value) lies: ``length`` bytes of ``file`` at ``offset``."""

    file: Path
    offset: int
    length: int


@dataclass
class Chunk:
    """One saved piece of a tensor: ``sizes`` elements along each dimension from ``offsets``."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    storage: Storage


@dataclass
class TensorEntry:
    """A tensor of the flattened state dict and the chunks that tile it."""

    fqn: str
    dtype: dtypes.DType
    size: tuple[int, ...]
    chunks: list[Chunk]


@dataclass
class BytesEntry:
    """Any other value of the flattened state dict (``torch.save``'d whole)."""

    fqn: str
    storage: Storage


@dataclass
class Metadata:
    """What ``.metadata`` says: the entries, DCP's key paths, and the data files they name."""

    entries: list[TensorEntry | BytesEntry]
    paths: dict[str, tuple[str | int, ...]]
    files: list[Path]


def corrupt(message: str, directory: Path) -> InputError:
    """The error for a ``.metadata`` that contradicts itself or the data files."""
    return InputError(
        f"DCP {METADATA_NAME}: {message} — the checkpoint is corrupt or was tampered with", path=directory
    )


def _record(obj: Any, cls: str, directory: Path, what: str) -> dict[str, Any]:
    """The fields of a data-class record built by NEWOBJ + BUILD (a dict, or {} with no state)."""
    if not isinstance(obj, pickles.OpaqueObject) or obj.global_name != cls:
        raise corrupt(f"{what} is {type(obj).__name__}, not {cls.rsplit('.', 1)[-1]}", directory)
    if obj._mode != "newobj" or obj._args or obj._items or obj._setitems:
        raise corrupt(f"{what} is not built the way DCP pickles it", directory)
    state = obj.state
    if state is None:
        return {}
    if isinstance(state, tuple) and len(state) == 2 and state[0] is None and isinstance(state[1], dict):
        state = state[1]  # (None, slot state)
    if not isinstance(state, dict) or not all(isinstance(k, str) for k in state):
        raise corrupt(f"{what} has malformed fields", directory)
    return state


def _ints(value: Any, directory: Path, what: str) -> tuple[int, ...]:
    if (
        not isinstance(value, tuple | list)
        or len(value) > _MAX_DIMS
        or not all(type(v) is int and v >= 0 for v in value)
    ):
        raise corrupt(f"{what} is {pickles.brief(value)}, not a tuple of non-negative integers", directory)
    return tuple(value)


def _int(value: Any, directory: Path, what: str) -> int:
    if type(value) is not int or value < 0:
        raise corrupt(f"{what} is {pickles.brief(value)}, not a non-negative integer", directory)
    return value


def _dtype(properties: Any, directory: Path, fqn: str) -> dtypes.DType:
    cls = f"{_META}.TensorProperties"
    if (
        not isinstance(properties, pickles.OpaqueObject)
        or properties.global_name != cls
        or properties._mode != "newobj"
        or properties._args
    ):
        raise corrupt(f"{fqn!r}: tensor properties are malformed", directory)
    state = properties.state
    if isinstance(state, tuple) and len(state) == 5:  # TensorProperties.__getstate__
        dtype, layout = state[0], state[1]
    elif isinstance(state, dict):  # older torch pickled the fields
        dtype, layout = state.get("dtype"), state.get("layout", "torch.strided")
    else:
        raise corrupt(f"{fqn!r}: tensor properties are malformed", directory)
    if isinstance(layout, str) and layout not in _LAYOUTS:
        raise UnsupportedFormatError(
            f"DCP entry {fqn!r} is a {layout} tensor; ckptool reads dense tensors only", path=directory
        )
    if not isinstance(dtype, DTypeRef) or dtype.name not in dtypes.BY_TORCH_NAME:
        raise corrupt(f"{fqn!r}: dtype {dtype!r} is not one ckptool knows", directory)
    return dtypes.BY_TORCH_NAME[dtype.name]


def _data_file(directory: Path, name: Any, sizes: dict[str, int]) -> Path:
    """The data file ``name`` refers to: a plain file name inside the checkpoint directory."""
    if isinstance(name, str) and name in sizes:
        return directory / name
    if (
        not isinstance(name, str)
        or not name
        or len(name) > 255
        or name in (".", "..", METADATA_NAME)
        or any(ch in name for ch in "/\\\0")
        or ":" in name
    ):
        raise InputError(
            f"DCP {METADATA_NAME} points at {str(name)[:80]!r}, outside the checkpoint directory — refused",
            path=directory,
        )
    path = directory / name
    # a regular file inside the checkpoint directory (a link may point inside it, or into a hub cache's blobs/)
    sizes[name] = inputs.check_member(directory, path, what=f"DCP data file {name!r}", report=directory).st_size
    return path


def _storage_info(info: Any, directory: Path, sizes: dict[str, int], what: str) -> Storage:
    fields = _record(info, f"{_FS}._StorageInfo", directory, what)
    if fields.get("transform_descriptors"):
        raise UnsupportedFormatError(
            f"DCP entry {what} was saved through storage transforms {list(fields['transform_descriptors'])[:4]} "
            "(e.g. compression); ckptool reads untransformed DCP checkpoints only",
            path=directory,
        )
    path = _data_file(directory, fields.get("relative_path"), sizes)
    offset = _int(fields.get("offset"), directory, f"{what} offset")
    length = _int(fields.get("length"), directory, f"{what} length")
    if offset + length > sizes[path.name]:
        raise InputError(
            f"DCP entry {what} lies at bytes {offset}..{offset + length} of {path.name}, which has "
            f"{sizes[path.name]} — the checkpoint is truncated or corrupt",
            path=directory,
        )
    return Storage(path, offset, length)


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
        if (
            not isinstance(path, tuple | list)
            or not path
            or len(path) > 256
            or not all(isinstance(p, str) or (type(p) is int and p >= 0) for p in path)
            or not isinstance(path[0], str)
        ):
            raise corrupt(f"the key path of {fqn[:80]!r} is malformed", directory)
        paths[fqn] = tuple(path)
    return paths


def read_metadata_bytes(directory: Path, limit: int) -> bytes:
    """Up to ``limit`` bytes of ``directory``'s ``.metadata``, opened as a member of the checkpoint directory."""
    meta_path = directory / METADATA_NAME
    try:
        with inputs.open_member(directory, meta_path, what=f"DCP {METADATA_NAME}", report=directory) as handle:
            return handle.read(limit)
    except OSError as e:
        raise InputError(f"DCP {METADATA_NAME} cannot be read ({e.strerror})", path=directory) from e


def parse_metadata(directory: Path, resolver: pickles.GlobalResolver) -> Metadata:
    """Read and validate ``.metadata``: every entry, its chunks and where their bytes lie."""
    data = read_metadata_bytes(directory, pickles.MAX_PICKLE_BYTES + 1)
    if not data:
        raise InputError(f"DCP {METADATA_NAME} is empty — the save did not finish", path=directory)
    if len(data) > pickles.MAX_PICKLE_BYTES:
        raise InputError(f"DCP {METADATA_NAME} is over {pickles.MAX_PICKLE_BYTES} bytes — refused", path=directory)
    metadata = pickles.loads(data, MetadataResolver(resolver))
    fields = _record(metadata, f"{_META}.Metadata", directory, "the top-level object")
    state_dict_metadata = fields.get("state_dict_metadata")
    storage_data = fields.get("storage_data")
    if not isinstance(state_dict_metadata, dict) or not all(isinstance(k, str) for k in state_dict_metadata):
        raise corrupt("state_dict_metadata is not a mapping of names", directory)
    if not isinstance(storage_data, dict):
        raise corrupt("storage_data is not a mapping (was this saved by a FileSystemWriter?)", directory)
    index = _storage_index(storage_data, directory)
    sizes: dict[str, int] = {}
    entries: list[TensorEntry | BytesEntry] = []
    # a chunk record takes dozens of bytes; a pickle listing more than this re-uses records (memo)
    # to make the reader do unbounded work
    budget = len(data) // 16
    for fqn, entry in state_dict_metadata.items():
        what = repr(fqn[:120])
        if isinstance(entry, pickles.OpaqueObject) and entry.global_name == f"{_META}.BytesStorageMetadata":
            _record(entry, entry.global_name, directory, what)
            info = index.get((fqn, None))
            if info is None:
                raise corrupt(f"value {what} has no storage record", directory)
            entries.append(BytesEntry(fqn, _storage_info(info, directory, sizes, what)))
            continue
        tensor_fields = _record(entry, f"{_META}.TensorStorageMetadata", directory, what)
        dtype = _dtype(tensor_fields.get("properties"), directory, fqn)
        size = _ints(tensor_fields.get("size"), directory, f"{what} size")
        raw_chunks = tensor_fields.get("chunks")
        if not isinstance(raw_chunks, list) or (not raw_chunks and math.prod(size) != 0):
            raise corrupt(f"tensor {what} lists no chunks", directory)
        budget -= len(raw_chunks)
        if budget < 0:
            raise corrupt("lists more chunks than it could describe", directory)
        chunks = _chunks(fqn, size, raw_chunks, index, directory, sizes)
        _check_tiling(fqn, size, chunks, directory)
        entries.append(TensorEntry(fqn, dtype, size, chunks))
    paths = _planner_paths(fields.get("planner_data"), directory)
    return Metadata(entries, paths, [directory / name for name in sorted(sizes)])


_Index = dict[tuple[str, str | None], Any]


def _storage_index(storage_data: dict, directory: Path) -> _Index:
    """storage_data: MetadataIndex(fqn, offset) -> _StorageInfo, the infos validated lazily per entry used.

    Keyed by text, not by the offsets tuple: tuples of ints hash predictably, so a crafted
    .metadata could make every insertion collide (50 s for a few MB); str hashes are salted.
    """
    index: _Index = {}
    for key, info in storage_data.items():
        key_fields = _record(key, f"{_META}.MetadataIndex", directory, "a storage_data key")
        fqn = key_fields.get("fqn")
        if not isinstance(fqn, str):
            raise corrupt("a storage_data key has no name", directory)
        offset = key_fields.get("offset")
        lookup = (fqn, None if offset is None else _offsets_key(_ints(offset, directory, f"{fqn!r} chunk offset")))
        if lookup in index and not _same_info(index[lookup], info):
            raise corrupt(f"{fqn[:80]!r} has two different storage records for one chunk", directory)
        index[lookup] = info
    return index


def _chunks(
    fqn: str, size: tuple[int, ...], raw_chunks: list, index: _Index, directory: Path, sizes: dict[str, int]
) -> list[Chunk]:
    """Tensor ``fqn``'s chunk records, each inside the tensor and with its storage record (a repeat taken once)."""
    what = repr(fqn[:120])
    chunks: list[Chunk] = []
    seen: dict[str, tuple[int, ...]] = {}  # by text, as index
    for number, raw in enumerate(raw_chunks):
        chunk_fields = _record(raw, f"{_META}.ChunkStorageMetadata", directory, f"{what} chunk {number}")
        offsets = _ints(chunk_fields.get("offsets"), directory, f"{what} chunk offsets")
        chunk_sizes = _ints(chunk_fields.get("sizes"), directory, f"{what} chunk sizes")
        if len(offsets) != len(size) or len(chunk_sizes) != len(size):
            raise corrupt(f"tensor {what} of {len(size)} dims has a chunk of {len(offsets)}", directory)
        if any(o + s > d for o, s, d in zip(offsets, chunk_sizes, size)):
            raise corrupt(
                f"tensor {what} of size {list(size)} has a chunk at {list(offsets)} of size "
                f"{list(chunk_sizes)} that reaches outside it",
                directory,
            )
        key = _offsets_key(offsets)
        if key in seen:  # the same chunk listed twice (a replicated tensor): taken once
            if seen[key] != chunk_sizes:
                raise corrupt(f"tensor {what} has two different chunks at {list(offsets)}", directory)
            continue
        seen[key] = chunk_sizes
        info = index.get((fqn, key))
        if info is None:
            raise corrupt(f"tensor {what}: the chunk at {list(offsets)} has no storage record", directory)
        chunks.append(Chunk(offsets, chunk_sizes, _storage_info(info, directory, sizes, what)))
    return chunks


def _offsets_key(offsets: tuple[int, ...]) -> str:
    return ",".join(map(str, offsets))


def _same_info(a: Any, b: Any) -> bool:
    if a is b:
        return True
    if not (isinstance(a, pickles.OpaqueObject) and isinstance(b, pickles.OpaqueObject)):
        return False
    return a.global_name == b.global_name and a.state == b.state


def _check_tiling(fqn: str, size: tuple[int, ...], chunks: list[Chunk], directory: Path) -> None:
    """The chunks cover the tensor exactly: inside it (checked before), disjoint, volumes summing up."""
    boxes = [c for c in chunks if math.prod(c.sizes)]
    total = sum(math.prod(c.sizes) for c in boxes)
    numel = math.prod(size)
    if total != numel:
        raise corrupt(
            f"tensor {fqn[:120]!r} of size {list(size)}: its chunks hold {total} of {numel} elements", directory
        )
    if len(boxes) < 2:
        return
    # sweep along the dimension with the most distinct chunk starts: neighbours there are few
    ndim = len(size)
    axis = max(range(ndim), key=lambda d: len({c.offsets[d] for c in boxes}))
    boxes.sort(key=lambda c: c.offsets[axis])
    active: list[Chunk] = []
    for box in boxes:
        start = box.offsets[axis]
        active = [a for a in active if a.offsets[axis] + a.sizes[axis] > start]
        for other in active:
            if all(
                box.offsets[d] < other.offsets[d] + other.sizes[d] and other.offsets[d] < box.offsets[d] + box.sizes[d]
                for d in range(ndim)
            ):
                raise corrupt(
                    f"tensor {fqn[:120]!r}: chunks at {list(other.offsets)} and {list(box.offsets)} overlap", directory
                )
        active.append(box)
