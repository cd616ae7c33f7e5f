"""safetensors, single file or sharded (``*.safetensors.index.json``), read and written by hand.

Reading parses and validates the header only (length, JSON, dtypes, shapes, offsets that tile
the data section exactly); tensors stay on disk as byte ranges. Writing puts the header first and
streams each tensor's bytes from wherever they lie, so memory stays flat in the file size.

Tied tensors: safetensors has no aliases, so ckptool stores a tied group once and records the
other names in the metadata entry ``ckptool.aliases`` (JSON ``{alias: stored_name}``); ckptool's
reader re-ties them onto one storage. Stock readers see every stored tensor.

The container a training checkpoint kept around its weights (epoch, configs, scheduler) rides in
``ckptool.entries`` (:mod:`ckptool.formats.entries`); the reader puts the weights back inside it.
"""

from __future__ import annotations

import json
import re
import struct
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

from ckptool.base.errors import InputError, UnsupportedFormatError
from ckptool.base.gcpause import paused
from ckptool.files import inputs
from ckptool.files.byteio import file_size as handle_size
from ckptool.files.byteio import read_capped
from ckptool.formats import Contents, Format, Pickles, ReadOptions
from ckptool.formats.hf_index import INDEX_NAME as INDEX_NAME
from ckptool.formats.hf_index import find_index
from ckptool.formats.safetensors_write import (  # noqa: F401 — the writer's names, importable from here too
    ALIASES_KEY,
    FORMAT_DTYPES,
    MAX_HEADER_BYTES,
    _encode_header,
    check_dtypes,
    encode_basestring_ascii,
    parse_size,
    plan_aliases,
    plan_shards,
    shard_file_name,
    write_file,
    write_tensors,
)
from ckptool.pickles.unpickle import FAST, _fastload
from ckptool.tensors import dtypes
from ckptool.tensors.refs import (
    ByteRange,
    StorageRef,
    TensorRef,
    contiguous_stride,
)

_INT64_MAX = (1 << 63) - 1  # no dimension or element count torch can hold is larger
ENTRIES_KEY = "ckptool.entries"  # the container around the weights, encoded by ckptool.formats.entries
_SHARD_NAME = re.compile(r"^[^/\\]+\.safetensors$")


@dataclass
class SafetensorsContents:
    tensors: dict[str, TensorRef]
    metadata: dict[str, str] = field(default_factory=dict)
    files: list[Path] = field(default_factory=list)


def looks_like_safetensors(head: bytes) -> bool:
    """A safetensors file starts with a u64 header length then ``{``."""
    return len(head) >= 9 and head[8:9] == b"{"


def sniff(head: bytes | None, path: Path) -> bool:
    """One safetensors file."""
    return head is not None and looks_like_safetensors(head)


def sniff_index(head: bytes | None, path: Path) -> bool:
    """A JSON file: a sharded checkpoint's index if its name ends ``.json`` (refused otherwise)."""
    return head is not None and head.lstrip().startswith(b"{")


def read(path: Path, options: ReadOptions) -> Contents:
    """One safetensors file: its tensors (re-tied), metadata and file."""
    assert options.handle is not None
    return _contents(read_file(path, options.handle), path)


def read_sharded(path: Path, options: ReadOptions) -> Contents:
    """A sharded checkpoint read through its index: every shard's tensors and metadata."""
    if not path.name.endswith(".json"):
        raise UnsupportedFormatError("is a JSON file, not a checkpoint", path=path)
    torch_sharded = _torch_index(path, options)
    if torch_sharded is not None:  # an index of .bin shards under another name: read as the torch index it is
        contents = torch_sharded.read(path, options)
        contents.format = torch_sharded.FORMAT.name
        return contents
    return _contents(read_index(path), path)


def _torch_index(path: Path, options: ReadOptions):  # noqa: ANN202 — the torch_sharded module, or None
    """The torch shard format when an index not named ``*.safetensors.index.json`` maps its weights to torch files."""
    from ckptool.formats import torch_sharded

    if options.handle is None or path.name.endswith(".safetensors.index.json"):
        return None
    return torch_sharded if torch_sharded.names_torch_shards(path, options) else None


def pickle_blobs_sharded(path: Path, options: ReadOptions) -> Pickles:
    """No pickles, unless the index is a torch index under another name (then its shards')."""
    torch_sharded = _torch_index(path, options)
    return torch_sharded.pickle_blobs(path, options) if torch_sharded is not None else Pickles(SHARDED.name, [])


def _contents(contents: SafetensorsContents, path: Path) -> Contents:
    """The weights, inside the container ``ckptool.entries`` carries when a ckptool wrote one
    (:mod:`ckptool.formats.entries`); malformed entries refuse the file, as malformed aliases do."""
    raw = contents.metadata.get(ENTRIES_KEY)
    if raw is None:
        return Contents(container=contents.tensors, files=contents.files, metadata=contents.metadata)
    from ckptool.formats import entries

    try:
        decoded = entries.decode(raw, contents.tensors)
    except entries.EntriesError as e:
        raise type(e)(e.message, path=path) from None
    if decoded.layout is None:  # an older ckptool's top-level entries, which record no place for the weights
        return Contents(container=contents.tensors, files=contents.files, metadata=contents.metadata)
    return Contents(
        container=entries.restore(decoded, contents.tensors),
        files=contents.files,
        metadata=contents.metadata,
        layout=decoded.layout,
        flattened=decoded.flattened,
    )


def read_header(path: Path, handle: BinaryIO) -> tuple[dict, int]:
    """The validated header dict and the absolute offset where the data section starts."""
    raw, data_start = _raw_header(path, handle)
    return _parsed(path, raw), data_start


def _raw_header(path: Path, handle: BinaryIO) -> tuple[bytes, int]:
    """The header's bytes (its length checked against the file's) and where the data section starts."""
    file_size = handle_size(handle)
    handle.seek(0)
    prefix = handle.read(8)
    if len(prefix) != 8:
        raise InputError.truncated(path, "too short to be a safetensors file")
    (length,) = struct.unpack("<Q", prefix)
    if length < 2:
        raise InputError(f"safetensors header length is {length} — the file is corrupt", path=path)
    if length > MAX_HEADER_BYTES:
        raise InputError(f"safetensors header claims {length} bytes (limit {MAX_HEADER_BYTES}) — refused", path=path)
    if 8 + length > file_size:
        raise InputError.truncated(path, f"safetensors header claims {length} bytes but the file has {file_size}")
    return handle.read(length), 8 + length


def _parsed(path: Path, raw: bytes) -> dict:
    """The header as the safetensors library reads it, or refused where that library refuses it: besides
    invalid UTF-8 or JSON, an entry naming a field twice or a second ``__metadata__`` (serde's "duplicate
    field"; a plain dict would keep the last), ``-0`` for a count (a float to serde; ``0`` to Python's
    json), and a lone surrogate escape (``\\ud800``, not Unicode; serde refuses it, json decodes it)."""
    repeated: list[tuple[dict, list[str]]] = []

    def pairs_hook(pairs: list[tuple[str, object]]) -> dict:
        mapping = dict(pairs)
        if len(mapping) < len(pairs):
            counted = Counter(key for key, _ in pairs)
            repeated.append((mapping, [key for key, count in counted.items() if count > 1]))
        return mapping

    try:
        header = json.loads(raw.decode("utf-8"), object_pairs_hook=pairs_hook, parse_int=_json_int)
    except (ValueError, RecursionError) as e:  # bad UTF-8, bad JSON, a 5000-digit number, deep nesting
        raise InputError(
            f"safetensors header is not valid UTF-8 JSON ({type(e).__name__}) — the file is corrupt", path=path
        ) from e
    if not isinstance(header, dict):
        raise InputError("safetensors header is not a JSON object — the file is corrupt", path=path)
    for mapping, keys in repeated:  # (a name twice keeps its last entry, as serde's map does; metadata too)
        if mapping is header:
            if "__metadata__" in keys:
                raise InputError("safetensors header holds __metadata__ twice — the file is corrupt", path=path)
            continue
        if mapping is not header.get("__metadata__"):  # an entry's fields, also one a later entry replaces
            name = next((name for name, entry in header.items() if entry is mapping), None)
            raise InputError(
                f"safetensors entry {'' if name is None else repr(name[:80]) + ' '}names "
                f"{keys[0][:20]!r} twice — the file is corrupt",
                path=path,
            )
    if b"\\u" in raw:  # (only an escape spells a surrogate: strict UTF-8 refuses one written raw)
        _refuse_surrogates(header, path)
    return header


def _json_int(text: str) -> int | float:
    """json's int, but ``-0`` as the float serde reads it (JSON writes no such int: refused as a count)."""
    return -0.0 if text == "-0" else int(text)


def _refuse_surrogates(header: dict, path: Path) -> None:
    """Refuse a name, dtype or metadata string holding a lone surrogate (only an escape can spell one)."""
    metadata = header.get("__metadata__")
    texts = [*header, *(entry.get("dtype") for entry in header.values() if isinstance(entry, dict))]
    if isinstance(metadata, dict):
        texts += [*metadata, *metadata.values()]
    for text in texts:
        if isinstance(text, str) and not text.isascii():
            try:
                text.encode("utf-8")
            except UnicodeEncodeError:
                raise InputError(
                    f"safetensors header holds a lone surrogate escape in {text[:80]!r}, which is not "
                    "Unicode (the safetensors library refuses it too) — the file is corrupt",
                    path=path,
                ) from None


_ENTRY_KEYS = frozenset({"dtype", "shape", "data_offsets"})
_DTYPES = {name: dtypes.BY_NAME[name] for name in FORMAT_DTYPES if name in dtypes.BY_NAME}  # what a header may name
_HEADER_CONSTANTS = (ByteRange, StorageRef, TensorRef, _DTYPES, contiguous_stride, "cpu", json.loads)  # the C parse's
# True: every header is read with json and the entry checks (the reference of the C parse; the tests turn it on)
PURE_PYTHON_HEADER = False


def read_file(path: Path, handle: BinaryIO) -> SafetensorsContents:
    """Read one safetensors file's tensors as lazy references."""
    with paused():  # a header of 100,000 entries: the collector rescanned its dicts and records, 0.5 s of 1.2
        return _read_file(path, handle)


def _read_file(path: Path, handle: BinaryIO) -> SafetensorsContents:
    raw, data_start = _raw_header(path, handle)
    file_size = handle_size(handle)
    parsed = (
        _fastload.parse_header(raw, path, data_start, file_size, _HEADER_CONSTANTS)
        if FAST and not PURE_PYTHON_HEADER
        else None
    )
    if parsed is not None:  # the usual header, parsed in C straight into its tensors (100,000: 0.05 s, not 0.5)
        tensors, metadata = parsed
    else:  # json's parse, and the checks that say what is wrong
        header = _parsed(path, raw)
        metadata = header.pop("__metadata__", None) or {}
        if not isinstance(metadata, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()
        ):
            raise InputError("safetensors __metadata__ must map strings to strings — the file is corrupt", path=path)
        tensors = _each_tensor(header, path, data_start, file_size)
    # names in sorted order, as the safetensors library lists them
    contents = SafetensorsContents(tensors=dict(sorted(tensors.items())), metadata=dict(metadata), files=[path])
    _retie(contents, path)
    return contents


def _each_tensor(header: dict, path: Path, data_start: int, file_size: int) -> dict[str, TensorRef]:
    """The header's tensors entry by entry, each checked: the first that is not valid raises why."""
    spans: list[tuple[int, int, str]] = []
    tensors: dict[str, TensorRef] = {}
    by_name, entry_keys = dtypes.BY_NAME, _ENTRY_KEYS
    for name, entry in header.items():
        if type(entry) is not dict or entry.keys() != entry_keys:
            raise InputError(f"safetensors entry {name[:80]!r} is malformed — the file is corrupt", path=path)
        dtype_name = entry["dtype"]
        dtype = by_name.get(dtype_name) if type(dtype_name) is str and dtype_name in FORMAT_DTYPES else None
        if dtype is None:
            raise InputError(f"tensor {name[:80]!r} has unknown dtype {str(dtype_name)[:20]!r}", path=path)
        shape, offsets = entry["shape"], entry["data_offsets"]
        numel = _valid_count(shape)
        if numel is None:
            raise InputError(f"tensor {name[:80]!r} has an invalid shape — the file is corrupt", path=path)
        if type(offsets) is not list or len(offsets) != 2:
            raise InputError(f"tensor {name[:80]!r} has invalid data offsets — the file is corrupt", path=path)
        begin, end = offsets
        if type(begin) is not int or type(end) is not int or begin < 0 or end < 0:
            raise InputError(f"tensor {name[:80]!r} has invalid data offsets — the file is corrupt", path=path)
        nbytes = numel * dtype.itemsize
        if end - begin != nbytes:
            raise InputError(
                f"tensor {name[:80]!r} needs {nbytes} bytes but its offsets span {end - begin} — the file is corrupt",
                path=path,
            )
        spans.append((begin, end, name))
        shape = tuple(shape)
        storage = StorageRef(name, dtype, numel, "cpu", ByteRange(path, data_start + begin, nbytes))
        tensors[name] = TensorRef(storage, dtype, shape, contiguous_stride(shape))
    # the data section must be tiled exactly: no gaps, no overlaps, nothing trailing
    position = 0
    for begin, end, name in sorted(spans):
        if begin != position:
            cause = "overlaps another tensor" if begin < position else "leaves a gap before it"
            raise InputError(f"tensor {name[:80]!r} {cause} in the data section — the file is corrupt", path=path)
        position = end
    if data_start + position != file_size:
        cause = "ends before" if data_start + position > file_size else "has trailing bytes after"
        raise InputError(
            f"safetensors data section {cause} the last tensor — the file is corrupt or truncated", path=path
        )
    return tensors


def _valid_count(shape: object) -> int | None:
    """The element count of a header's shape (a list of at most 64 ints in [0, 2^63), counting
    under 2^63), else None."""
    if type(shape) is not list or len(shape) > 64:
        return None
    count = 1
    for size in shape:
        if type(size) is not int or size < 0 or size > _INT64_MAX:
            return None
        count *= size
    return count if count <= _INT64_MAX else None


def _retie(contents: SafetensorsContents, path: Path) -> None:
    raw = contents.metadata.get(ALIASES_KEY)
    if raw is None:
        return
    try:
        aliases = json.loads(raw)
    except (ValueError, RecursionError) as e:
        raise InputError(f"metadata {ALIASES_KEY} is not JSON — the file is corrupt", path=path) from e
    if not isinstance(aliases, dict) or not all(isinstance(target, str) for target in aliases.values()):
        raise InputError(f"metadata {ALIASES_KEY} is not a JSON object of names — the file is corrupt", path=path)
    for alias, target in aliases.items():
        stored = contents.tensors.get(target)
        if stored is None or alias in contents.tensors:
            raise InputError(
                f"alias {alias[:80]!r} points at {target[:80]!r}, which is not stored — the file is corrupt", path=path
            )
        contents.tensors[alias] = TensorRef(
            storage=stored.storage, dtype=stored.dtype, shape=stored.shape, stride=stored.stride
        )
    # keep the names in sorted order, as they would read from a file without aliases
    contents.tensors = dict(sorted(contents.tensors.items()))


def read_index(index_path: Path) -> SafetensorsContents:
    """Read a sharded checkpoint through its ``*.safetensors.index.json``."""
    try:
        with inputs.open_regular(index_path) as handle:
            raw = read_capped(handle, MAX_HEADER_BYTES)
    except OSError as e:
        raise InputError(f"cannot read ({e.strerror}) — check the path and permissions", path=index_path) from e
    if raw is None:
        raise InputError("index file is larger than any real index — refused", path=index_path)
    try:
        index = json.loads(raw.decode("utf-8"))
    except (ValueError, RecursionError) as e:
        raise InputError("index is not valid UTF-8 JSON — the file is corrupt", path=index_path) from e
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise InputError(
            "index has no weight_map of key -> shard file — not a sharded safetensors index", path=index_path
        )
    shard_names = sorted(set(weight_map.values()))
    for shard in shard_names:
        if not _SHARD_NAME.match(shard) or shard in (".", ".."):
            raise InputError(
                f"index names shard {shard[:80]!r}, which is not a file beside it — refused", path=index_path
            )
    contents = SafetensorsContents(tensors={})
    metadata = index.get("metadata") if isinstance(index.get("metadata"), dict) else {}
    directory = index_path.parent
    for shard in shard_names:
        shard_path = directory / shard
        try:
            # a shard must be a regular file inside the index's folder (or its hub cache's blobs/)
            with inputs.open_member(
                directory, shard_path, what=f"shard {shard} named by the index", report=index_path
            ) as handle:
                shard_contents = read_file(shard_path, handle)
        except OSError as e:
            raise InputError(f"shard {shard} named by the index cannot be read ({e.strerror})", path=index_path) from e
        for name, tensor in shard_contents.tensors.items():
            if name in contents.tensors:
                raise InputError(
                    f"tensor {name!r} is stored in two shards — the checkpoint is inconsistent", path=index_path
                )
            contents.tensors[name] = tensor
        contents.files.append(shard_path)
        contents.metadata.update(shard_contents.metadata)
    missing = [key for key, shard in weight_map.items() if key not in contents.tensors]
    if missing:
        raise InputError(f"index lists {len(missing)} tensors no shard holds (e.g. {missing[0]!r})", path=index_path)
    contents.metadata.update({str(k): str(v) for k, v in metadata.items() if k != "total_size"})
    contents.tensors = dict(sorted(contents.tensors.items()))
    return contents


# how ckptool (and huggingface_hub) name shards; only files named so are ever removed from a folder output
SHARD_FILE = re.compile(r"^model-\d{5,}-of-\d{5,}\.safetensors$")


def shards_named_by(index_path: Path) -> list[str] | None:
    """The shard files named like ckptool's (``model-NNNNN-of-NNNNN.safetensors``) that an existing
    index lists, or None when it cannot be read as an index."""
    try:
        with inputs.open_regular(index_path) as handle:
            raw = read_capped(handle, MAX_HEADER_BYTES)
    except (InputError, OSError):
        return None
    return shards_named_in(raw) if raw is not None else None


def shards_named_in(raw: bytes) -> list[str] | None:
    """:func:`shards_named_by` for an index's bytes (one read from a URL)."""
    try:
        index = json.loads(raw.decode("utf-8")) if len(raw) <= MAX_HEADER_BYTES else None
    except (ValueError, RecursionError):
        return None
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict):
        return None
    return sorted({name for name in weight_map.values() if isinstance(name, str) and SHARD_FILE.match(name)})


FORMAT = Format(
    name="safetensors",
    sniff=sniff,
    read=read,
    default_suffix=".safetensors",
    rewrite_target="safetensors",
    target="safetensors",
    suffixes=(".safetensors",),
    weights_only=True,
    has_location_tags=False,
)
SHARDED = Format(
    name="safetensors-sharded",
    sniff=sniff_index,
    read=read_sharded,
    find_in_folder=find_index,
    pickle_blobs=pickle_blobs_sharded,
    default_suffix=".safetensors",
    rewrite_target="safetensors",
    target="safetensors",
    sharded=True,
    folder_output=True,
    weights_only=True,
    has_location_tags=False,
)
