"""safetensors written by hand: the header first, then each tensor's bytes streamed from wherever they lie, so
memory stays flat in the file size (:mod:`ckptool.formats.safetensors` reads them, and names these too)."""

from __future__ import annotations

import json
import math
import re
import struct
from collections.abc import Callable, Mapping
from itertools import accumulate
from json.encoder import encode_basestring_ascii
from operator import mul
from pathlib import Path
from typing import BinaryIO

from ckptool.base import progress
from ckptool.base.errors import OutputError, UsageError
from ckptool.base.suggest import option
from ckptool.files import placement
from ckptool.files.copying import SMALL_MEMBER, DataOut
from ckptool.tensors.refs import (
    _DTYPE_NAME,
    _ITEMSIZE,
    _OFFSET,
    _PATH,
    _SHAPE,
    TensorRef,
    shared_storages,
    whole_plain,
)

MAX_HEADER_BYTES = 100_000_000  # the safetensors library's own limit
ALIASES_KEY = "ckptool.aliases"
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


def shard_file_name(index: int, count: int, stem: str = "model", variant: str | None = None) -> str:
    """A shard's name as transformers and diffusers write it: ``model-00001-of-00002.safetensors``,
    ``diffusion_pytorch_model.fp16-00001-of-00002.safetensors`` for a variant."""
    return f"{stem}{'.' + variant if variant else ''}-{index + 1:05d}-of-{count:05d}.safetensors"


def index_file_name(stem: str = "model", variant: str | None = None) -> str:
    """The index of a sharded set: ``model.safetensors.index.json``, ``model.safetensors.index.fp16.json``."""
    return f"{stem}.safetensors.index{'.' + variant if variant else ''}.json"
