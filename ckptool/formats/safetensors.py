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
import math
import re
import struct
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from itertools import accumulate
from json.encoder import encode_basestring_ascii
from operator import mul
from pathlib import Path
from typing import BinaryIO

from ckptool.base import progress
from ckptool.base.errors import InputError, OutputError, UnsupportedFormatError, UsageError
from ckptool.base.gcpause import paused
from ckptool.base.suggest import option
from ckptool.files import inputs, placement
from ckptool.files.byteio import file_size as handle_size
from ckptool.files.byteio import read_capped
from ckptool.files.copying import SMALL_MEMBER, DataOut
from ckptool.formats import Contents, Format, Pickles, ReadOptions
from ckptool.formats.hf_index import INDEX_NAME as INDEX_NAME
from ckptool.formats.hf_index import find_index
from ckptool.pickles.unpickle import FAST, _fastload
from ckptool.tensors import dtypes
from ckptool.tensors.refs import (
    _DTYPE_NAME,
    _ITEMSIZE,
    _OFFSET,
    _PATH,
    _SHAPE,
    ByteRange,
    StorageRef,
    TensorRef,
    contiguous_stride,
    shared_storages,
    whole_plain,
)

MAX_HEADER_BYTES = 100_000_000  # the safetensors library's own limit
_INT64_MAX = (1 << 63) - 1  # no dimension or element count torch can hold is larger
ALIASES_KEY = "ckptool.aliases"
ENTRIES_KEY = "ckptool.entries"  # the container around the weights, encoded by ckptool.formats.entries
_SHARD_NAME = re.compile(r"^[^/\\]+\.safetensors$")
# The dtypes the safetensors format defines (its Dtype enum) that ckptool knows. complex128 is not
# one: the safetensors library refuses a header naming "C128" ("unknown variant"), so ckptool
# neither writes nor reads it.
FORMAT_DTYPES = frozenset(
    {
        "BOOL",
        "U8",
        "I8",
        "U16",
        "I16",
        "U32",
        "I32",
        "U64",
        "I64",
        "F16",
        "BF16",
        "F32",
        "F64",
        "C64",
        "F8_E4M3",
        "F8_E5M2",
        "F8_E4M3FNUZ",
        "F8_E5M2FNUZ",
    }
)


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


# ---------------------------------------------------------------------------------------------
# writing

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B?|B)?\s*$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """``"5GB"`` -> 5_000_000_000, ``"512MiB"`` -> 536_870_912 (Hugging Face's units)."""
    match = _SIZE.match(text)
    if not match:
        raise UsageError(f"size {text!r} is not like 500MB, 2GB or 1GiB")
    number, unit = float(match.group(1)), (match.group(2) or "B").upper()
    base = 1024 if "I" in unit else 1000
    power = {"B": 0, "K": 1, "M": 2, "G": 3, "T": 4}[unit[0]]
    size = int(number * base**power)
    if size <= 0:
        raise UsageError(f"size {text!r} must be positive")
    return size


def check_dtypes(tensors: Mapping[str, TensorRef], *, out: Path | None = None) -> None:
    """Refuse, before anything is written, tensors whose dtype the safetensors format does not define, or
    whose name holds a lone surrogate (a pickle's key may; JSON text may not), naming them: the safetensors
    library would not open the file."""
    names = list(tensors)
    if not all(map(str.isascii, names)):  # (the usual names: one C pass)
        unpaired = [name for name in names if _unpaired(name)]
        if unpaired:
            shown = ", ".join(repr(name[:80]) for name in unpaired[:3]) + (", ..." if len(unpaired) > 3 else "")
            raise OutputError(
                f"safetensors cannot store {len(unpaired)} tensor name(s) holding a lone surrogate "
                f"({shown}: not Unicode, which the format's JSON header is) — write a .pt instead ("
                + option("to", "pt")
                + "), or rename them",
                path=out,
            )
    outside: dict[str, list[str]] = {}
    for name, tensor in tensors.items():
        if tensor.dtype.name not in FORMAT_DTYPES:
            outside.setdefault(tensor.dtype.torch_name, []).append(name)
    if outside:
        count = sum(len(names) for names in outside.values())
        kinds = ", ".join(
            f"{dtype} ({len(names)}: {', '.join(repr(n) for n in names[:3])}{', ...' if len(names) > 3 else ''})"
            for dtype, names in outside.items()
        )
        raise OutputError(
            f"safetensors has no dtype for {count} tensor(s): {kinds} — write a .pt instead "
            "(" + option("to", "pt") + "), or leave these tensors out",
            path=out,
        )


def plan_aliases(tensors: Mapping[str, TensorRef]) -> dict[str, str]:
    """Tied tensors (same storage, offset, shape, stride, dtype and bits): ``{alias: stored_name}``.

    The name stored is the one that comes first in ``tensors`` — the state dict's order, i.e. the
    module that registered the weight first (GPT-2's input embedding ``transformer.wte.weight``, not
    ``lm_head.weight``), as transformers' own save keeps it: a loader that re-ties from the model's
    config (``from_pretrained``) then finds the weight it owns, not only the one it ties to it.
    """
    first: dict[tuple, str] = {}
    aliases: dict[str, str] = {}
    shared = shared_storages(tensors.values())  # a tensor alone on its storage is nobody's alias
    if not shared:
        return aliases
    for name in tensors:
        tensor = tensors[name]
        if id(tensor.storage) not in shared or tensor.numel == 0:
            continue
        # a conjugate or negative view of a storage holds other values than the plain view
        identity = (
            id(tensor.storage),
            tensor.offset,
            tensor.shape,
            tensor.stride,
            tensor.dtype.name,
            tensor.conj,
            tensor.neg,
        )
        if identity in first:
            aliases[name] = first[identity]
        else:
            first[identity] = name
    return aliases


def _unpaired(text: str) -> bool:
    """Whether ``text`` holds a lone surrogate (a pickle's key, a file name that is not UTF-8)."""
    if text.isascii():
        return False
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def _unicode_metadata(metadata: Mapping[str, str]) -> dict[str, str]:
    """``metadata`` as a JSON header can hold it: a lone surrogate (``ckptool.source``'s file name when it is not
    UTF-8, its bytes kept as surrogates) written as the escape text printing shows (``\\udcff``)."""
    if all(not _unpaired(key) and not _unpaired(value) for key, value in metadata.items()):
        return dict(metadata)
    return {_printable_surrogates(key): _printable_surrogates(value) for key, value in metadata.items()}


def _printable_surrogates(text: str) -> str:
    """``text`` with each lone surrogate written as its escape (``\\udcff``), other characters kept."""
    return (
        "".join(f"\\u{ord(char):04x}" if 0xD800 <= ord(char) <= 0xDFFF else char for char in text)
        if _unpaired(text)
        else text
    )


def _encode_header(
    order: list[str],
    dtype_names: list[str],
    shapes: list[tuple[int, ...]],
    nbytes: list[int],
    metadata: Mapping[str, str],
) -> bytes:
    """The header's JSON for the tensors ``order`` names (their dtypes' names, shapes and byte counts) laid out end
    to end in that order: the bytes of ``json.dumps`` of it, compact.

    Written from columns (100,000 entries): names escaped by json's ASCII encoder, each dtype's and shape's text
    made once by ``json.dumps``, the entries formatted by one ``str.format`` mapped over them.
    """
    parts = ['"__metadata__":' + json.dumps(_unicode_metadata(metadata), separators=(",", ":"))] if metadata else []
    dtype_texts = {name: json.dumps(name) for name in set(dtype_names)}
    keys = list(map(repr, shapes))  # by repr: 2 and True are equal keys, but json writes them apart
    shape_texts = {
        key: json.dumps(list(shape), separators=(",", ":")) for key, shape in dict(zip(keys, shapes)).items()
    }
    ends = list(accumulate(nbytes))
    parts += map(
        '{}:{{"dtype":{},"shape":{},"data_offsets":[{},{}]}}'.format,
        map(encode_basestring_ascii, order),
        map(dtype_texts.__getitem__, dtype_names),
        map(shape_texts.__getitem__, keys),
        [0, *ends],
        ends,
    )
    return ("{" + ",".join(parts) + "}").encode("utf-8")


def write_tensors(
    handle: BinaryIO,
    tensors: Mapping[str, TensorRef],
    metadata: Mapping[str, str],
    on_data: Callable[[int, int], None] | None = None,
) -> None:
    """Write one safetensors file holding each of ``tensors`` as stored (no aliasing: ties are
    planned by the caller) and ``metadata`` as given; one shard of a sharded checkpoint."""
    # Columns are taken in the mapping's order, where the records lie in memory in the order they were read (a
    # pass in another order waits on memory for each of 100,000 records), and then put in the file's order:
    # larger element types first keeps every tensor aligned to its element size (as safetensors does), by
    # name within each element size (a stable sort of the sorted names).
    names, views = list(tensors), list(tensors.values())
    whole = whole_plain(views)  # the usual file: every tensor all of its storage (then copied in one call)
    itemsizes = list(map(_ITEMSIZE, views))
    nbytes = whole[1] if whole is not None else list(map(mul, map(math.prod, map(_SHAPE, views)), itemsizes))
    index = sorted(range(len(names)), key=names.__getitem__)
    if len(set(itemsizes)) > 1:
        index.sort(key=itemsizes.__getitem__, reverse=True)

    def in_order(column: list) -> list:  # a column put in the file's order
        return list(map(column.__getitem__, index))

    # large tensors each where the kernel copies whole pages (ckptool/files/placement.py)
    placing = whole is not None and max(nbytes, default=0) > SMALL_MEMBER
    offsets_in_order = in_order(list(map(_OFFSET, whole[0]))) if whole is not None else []
    if placing:
        placed = placement.safetensors_order(offsets_in_order, in_order(nbytes), in_order(itemsizes))
        if placed is not None:
            index = list(map(index.__getitem__, placed))
            offsets_in_order = list(map(offsets_in_order.__getitem__, placed))
    order, nbytes_in_order = in_order(names), in_order(nbytes)
    encoded = _encode_header(
        order, in_order(list(map(_DTYPE_NAME, views))), in_order(list(map(_SHAPE, views))), nbytes_in_order, metadata
    )
    encoded += b" " * (-len(encoded) % 8)
    if placing:
        encoded += b" " * placement.header_padding(8 + len(encoded), offsets_in_order, nbytes_in_order)
    if len(encoded) > MAX_HEADER_BYTES:  # no reader would open it: refuse before a byte is written
        entries = len(metadata.get("ckptool.entries", ""))
        raise OutputError(
            f"the safetensors header would be {len(encoded)} bytes, over the format's "
            f"{MAX_HEADER_BYTES}-byte limit ({entries} of them the container's other entries) — "
            "write a .pt instead (" + option("to", "pt") + ")"
        )
    handle.write(struct.pack("<Q", len(encoded)) + encoded)
    handle.flush()
    progress.expect(sum(nbytes))
    out_offset = 8 + len(encoded)
    out = DataOut(handle, on_data)
    try:
        if whole is not None:
            out_offset = out.copy_all(
                in_order(list(map(_PATH, whole[0]))), offsets_in_order, nbytes_in_order, out_offset
            )
        else:
            out_offset = _write_each(handle, out, in_order(views), out_offset)
        out.report()
    finally:
        out.release()
    handle.seek(out_offset)
    handle.truncate()


def _write_each(handle: BinaryIO, out: DataOut, views: list[TensorRef], out_offset: int) -> int:
    """Write each tensor's bytes end to end from ``out_offset`` (the output stands there); returns where they end."""
    for tensor in views:
        nbytes = tensor.nbytes
        data = tensor.plain_data()
        if data is not None:  # the usual tensor: its bytes where its storage lies, as they are
            if nbytes:
                out.copy(data.path, data.offset + tensor.offset * tensor.dtype.itemsize, nbytes, out_offset)
            out_offset += nbytes
            continue
        span = tensor.contiguous_byte_range()
        if span is not None and span.length:
            out.copy(span.path, span.offset, span.length, out_offset)
        elif (pieces := tensor.whole_pieces()) is not None:  # a DCP tensor sharded by rows: shard by shard
            out.copy_pieces(pieces, out_offset)
        elif tensor.whole_derived() is not None:  # a cast: computed chunk by chunk as it is written
            out.stream(tensor.iter_reused(), out_offset, nbytes)
        elif nbytes:
            for chunk in tensor.iter_bytes():
                handle.write(chunk)
            out.written(out_offset, nbytes)
        out_offset += nbytes
    return out_offset


def write_file(
    handle: BinaryIO,
    tensors: Mapping[str, TensorRef],
    metadata: Mapping[str, str],
    *,
    duplicate_tied: bool = False,
    on_data: Callable[[int, int], None] | None = None,
) -> dict[str, str]:
    """Write one safetensors file; returns the aliases recorded (empty with ``duplicate_tied``)."""
    aliases = {} if duplicate_tied else plan_aliases(tensors)
    stored = {name: tensor for name, tensor in tensors.items() if name not in aliases} if aliases else tensors
    metadata = dict(metadata)
    if aliases:
        metadata[ALIASES_KEY] = json.dumps(aliases, sort_keys=True)
    write_tensors(handle, stored, metadata, on_data)
    return aliases


def plan_shards(tensors: Mapping[str, TensorRef], max_shard_size: int) -> list[list[str]]:
    """Split names in order into shards of at most ``max_shard_size`` bytes (a larger tensor stands alone)."""
    shards: list[list[str]] = [[]]
    size = 0
    for name, tensor in tensors.items():
        if shards[-1] and size + tensor.nbytes > max_shard_size:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += tensor.nbytes
    return [shard for shard in shards if shard] or [[]]


def shard_file_name(index: int, count: int) -> str:
    return f"model-{index + 1:05d}-of-{count:05d}.safetensors"


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
