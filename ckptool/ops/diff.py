"""diff: what differs between the weights of two checkpoints, in any formats.

Keys are compared as stored (a ``module.`` prefix on one side shows as keys only in A / only in
B, with a note naming the prefix). For tensors both hold, bytes are streamed pairwise chunk by
chunk: equal chunks cost a comparison, and only a chunk whose bytes differ is decoded (numpy; bf16
by bit shifting, float8 by table) to find its largest absolute difference. Memory stays
bounded by one chunk per side, never a whole tensor or file.

Contiguous tensors (nearly all) are read with ``os.preadv`` into one reused buffer per side, through one
descriptor per file for the whole diff, in pieces small enough to stay in the CPU cache: the memcmp
(and verify's NaN/Inf check, see ``chunk_hook``) then runs on bytes still in cache, so comparing two
files costs about what reading them does.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ckptool import formats
from ckptool.base import progress, suggest
from ckptool.files.byteio import FileCache, Source, is_remote, read_exact, read_into, use_storage_options
from ckptool.files.inputs import located
from ckptool.files.ranges import ByteRange
from ckptool.io.reader import load
from ckptool.model.checkpoint import Checkpoint
from ckptool.model.keys import detect_prefix
from ckptool.tensors.dtypes import BIT_PATTERNS, DType
from ckptool.tensors.refs import TensorRef, check_expansion

# Bytes per side per comparison step. Small enough that both sides stay in L2 while they are compared
# (and checked for NaN/Inf): with 8 MiB pieces every byte went through memory twice and diff took ~2x
# as long as reading both files; at 256 KiB the compare is nearly free. Per-step overhead is ~µs.
CHUNK_SIZE = 256 * 1024

# called with each chunk of A's bytes (element-aligned, valid only during the call)
Chunk = bytes | bytearray | memoryview  # a piece of a tensor's bytes, maybe a reused buffer
ChunkCallback = Callable[[Chunk], None]
# called with (A's key as stored, its TensorRef) before A's bytes are read; returns a ChunkCallback or None
ChunkHook = Callable[[str, TensorRef], ChunkCallback | None]


@dataclass
class TensorChange:
    """One tensor both checkpoints hold that differs.

    Attributes:
        kinds: what changed: ``dtype``, ``shape`` and/or ``values``.
        max_abs_diff: the largest element-wise absolute difference (None when shapes differ);
            ``inf`` when one side has NaN or Inf where the other does not.
        differing: elements whose values differ at all; beyond_atol: those differing by more than ``atol``.
    """

    name: str
    kinds: list[str]
    a_dtype: str
    b_dtype: str
    a_shape: tuple[int, ...]
    b_shape: tuple[int, ...]
    max_abs_diff: float | None = None
    differing: int = 0
    beyond_atol: int = 0

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "kinds": list(self.kinds),
            "a_dtype": self.a_dtype,
            "b_dtype": self.b_dtype,
            "a_shape": list(self.a_shape),
            "b_shape": list(self.b_shape),
            "max_abs_diff": json_float(self.max_abs_diff),
            "differing": self.differing,
            "beyond_atol": self.beyond_atol,
        }


@dataclass
class DiffReport:
    """The result of :func:`diff`; ``identical`` when no key, dtype, shape or value (beyond ``atol``) differs.

    Attributes:
        only_in_a / only_in_b: weight keys one side lacks.
        changed: tensors that differ (dtype, shape, or values beyond ``atol``).
        compared: tensors both hold; byte_identical: those equal byte for byte.
        max_abs_diff: the largest difference over all compared tensors of equal shape.
        aligned: the wrapper prefixes stripped from A and B before comparing (``align_prefixes``).
    """

    a: str
    b: str
    a_format: str
    b_format: str
    a_tensors: int
    b_tensors: int
    atol: float
    only_in_a: list[str] = field(default_factory=list)
    only_in_b: list[str] = field(default_factory=list)
    changed: list[TensorChange] = field(default_factory=list)
    compared: int = 0
    byte_identical: int = 0
    max_abs_diff: float = 0.0
    aligned: tuple[str, str] | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def identical(self) -> bool:
        return not self.only_in_a and not self.only_in_b and not self.changed

    def to_json(self) -> dict[str, Any]:
        return {
            "identical": self.identical,
            "a": {"path": self.a, "format": self.a_format, "tensors": self.a_tensors},
            "b": {"path": self.b, "format": self.b_format, "tensors": self.b_tensors},
            "atol": self.atol,
            "only_in_a": list(self.only_in_a),
            "only_in_b": list(self.only_in_b),
            "changed": [change.to_json() for change in self.changed],
            "compared": self.compared,
            "byte_identical": self.byte_identical,
            "max_abs_diff": json_float(self.max_abs_diff),
            "aligned_prefixes": list(self.aligned) if self.aligned else None,
            "notes": list(self.notes),
        }


def json_float(value: float | None) -> float | str | None:
    """A float JSON can carry: ``inf``/``nan`` become strings (strict JSON has no Infinity)."""
    if value is None or math.isfinite(value):
        return value
    return str(value)


# ---------------------------------------------------------------------------------------------- streaming


def element_chunks(tensor: TensorRef, elements: int) -> Iterator[Chunk]:
    """The tensor's C-order bytes in pieces of ``elements`` elements (the last may be shorter).

    A piece may be a reused buffer: compare or decode it before asking for the next.
    """
    size = elements * tensor.dtype.itemsize
    pending = b""
    for chunk in tensor.iter_reused(chunk_size=size):
        if not pending and len(chunk) == size:  # the usual case: contiguous bytes come in exactly this size
            yield chunk
            continue
        pending += chunk
        start = 0
        while len(pending) - start >= size:
            yield pending[start : start + size]
            start += size
        pending = pending[start:]
    if pending:
        yield pending


def decode(raw: Chunk, dtype: DType) -> Any:
    """Raw little-endian bytes of ``dtype`` as a numpy array of float64 (complex128 for complex)."""
    import numpy as np

    simple = {
        "F64": np.float64,
        "F32": np.float32,
        "F16": np.float16,
        "I64": np.int64,
        "I32": np.int32,
        "I16": np.int16,
        "I8": np.int8,
        "U64": np.uint64,
        "U32": np.uint32,
        "U16": np.uint16,
        "U8": np.uint8,
        "BOOL": np.uint8,
        "C64": np.complex64,
        "C128": np.complex128,
    }
    if dtype.name in simple:
        values = np.frombuffer(raw, dtype=np.dtype(simple[dtype.name]).newbyteorder("<"))
        return values.astype(np.complex128 if dtype.name.startswith("C") else np.float64)
    if dtype.name == "C32":  # complex32: a pair of float16
        pairs = np.frombuffer(raw, dtype="<f2").astype(np.float64)
        return pairs[0::2] + 1j * pairs[1::2]
    if dtype.name == "BF16":  # bfloat16 is the top half of a float32
        halves = np.frombuffer(raw, dtype="<u2").astype(np.uint32) << 16
        return halves.view(np.float32).astype(np.float64)
    table = float8_table(dtype.name)  # float8: each of the 256 bit patterns looked up (numpy has no float8)
    if table is None:
        raise ValueError(f"no decoding for dtype {dtype.name}")
    return table[np.frombuffer(raw, dtype=np.uint8)]


# float8 layouts: (exponent bits, mantissa bits, bias, kind) — "fn": no infinities, S.1111.111 is NaN
# (OCP e4m3); "ieee": infinities and NaNs as in IEEE 754 (e5m2); "fnuz": no -0.0, 0x80 the only NaN
# (Graphcore/AMD); "e8m0": unsigned powers of two, 0xFF NaN (the OCP MX scale)
_FLOAT8 = {
    "F8_E4M3": (4, 3, 7, "fn"),
    "F8_E5M2": (5, 2, 15, "ieee"),
    "F8_E4M3FNUZ": (4, 3, 8, "fnuz"),
    "F8_E5M2FNUZ": (5, 2, 16, "fnuz"),
    "F8_E8M0": (8, 0, 127, "e8m0"),
}
_float8_tables: dict[str, Any] = {}


def float8_table(name: str) -> Any:
    """The float64 value of each of the 256 bit patterns of a float8 dtype (as torch decodes them), or None."""
    import numpy as np

    if name not in _FLOAT8 or name in _float8_tables:
        return _float8_tables.get(name)
    exponent_bits, mantissa_bits, bias, kind = _FLOAT8[name]
    values = []
    for bits in range(256):
        if kind == "e8m0":
            values.append(math.nan if bits == 0xFF else math.ldexp(1.0, bits - bias))
            continue
        sign = -1.0 if bits >> 7 else 1.0
        exponent = (bits >> mantissa_bits) & ((1 << exponent_bits) - 1)
        mantissa = bits & ((1 << mantissa_bits) - 1)
        top = exponent == (1 << exponent_bits) - 1
        if kind == "fnuz" and bits == 0x80:
            values.append(math.nan)
        elif (kind == "fn" and top and mantissa == (1 << mantissa_bits) - 1) or (kind == "ieee" and top and mantissa):
            values.append(math.copysign(math.nan, sign))
        elif kind == "ieee" and top:
            values.append(sign * math.inf)
        elif exponent == 0:  # subnormal
            values.append(sign * math.ldexp(mantissa, 1 - bias - mantissa_bits))
        else:
            values.append(sign * math.ldexp((1 << mantissa_bits) + mantissa, exponent - bias - mantissa_bits))
    table = _float8_tables[name] = np.array(values, dtype=np.float64)
    return table


_INTEGER_UNITS = {
    "I64": "<i8",
    "I32": "<i4",
    "I16": "<i2",
    "I8": "i1",
    "U64": "<u8",
    "U32": "<u4",
    "U16": "<u2",
    "U8": "u1",
    "BOOL": "u1",
}


def exact_diff(raw_a: Chunk, raw_b: Chunk, dtype: DType) -> Any:
    """Element-wise ``|a - b|`` of two integer (or bool) chunks of one dtype, exact, as uint64.

    ``max - min`` taken modulo 2**64 is the exact distance, since no two 64-bit integers lie 2**64
    apart; it is reported as a float (a difference of 1 at 2**62 is 1.0, not 0).
    """
    import numpy as np

    unit = _INTEGER_UNITS.get(dtype.name) or {1: "u1", 2: "<u2"}[dtype.itemsize]  # bit patterns: unsigned
    a = np.frombuffer(raw_a, dtype=unit)
    b = np.frombuffer(raw_b, dtype=unit)
    high, low = np.maximum(a, b), np.minimum(a, b)
    with np.errstate(over="ignore"):
        return high.astype(np.uint64) - low.astype(np.uint64)


def abs_diff(a: Any, b: Any) -> Any:
    """Element-wise ``|a - b|`` where equal values (and NaN against NaN) count 0 and a NaN against a number counts
    inf."""
    import numpy as np

    with np.errstate(invalid="ignore", over="ignore"):
        difference = np.abs(a - b)
        difference = np.where(a == b, 0.0, difference)
        both_nan = np.isnan(a) & np.isnan(b)
        difference = np.where(both_nan, 0.0, difference)
        return np.where(np.isnan(difference), np.inf, difference)


# the descriptors a diff shares across tensors (not an open() per tensor and side): a byteio.FileCache;
# the name is imported from here too
OpenFiles = FileCache


def _spans(tensor: TensorRef) -> tuple[ByteRange, ...] | None:
    """The byte ranges holding the tensor's C-order bytes end to end (as :meth:`TensorRef.iter_reused`
    reads them), or None when they must be gathered or computed."""
    pieces = tensor.whole_pieces()
    if pieces is not None:
        return pieces
    if not tensor.numel:
        return ()
    span = tensor.contiguous_byte_range()
    return None if span is None else (span,)


def _read_spans(spans: tuple[ByteRange, ...], size: int, files: FileCache[Source]) -> Iterator[Chunk]:
    """The bytes of ``spans`` end to end in pieces of ``size`` bytes (the last may be shorter), read
    straight into one reused buffer: each piece is valid only until the next is asked for."""
    total = sum(span.length for span in spans)
    if total <= 0:
        return
    if len(spans) == 1 and total <= size:  # a small tensor: one read, no buffer to set up
        span = spans[0]
        yield read_exact(files.get(span.path), span.offset, total, span.path)
        return
    buffer = bytearray(min(size, total))
    view = memoryview(buffer)
    filled = 0
    for span in spans:
        position, end = span.offset, span.offset + span.length
        while position < end:
            piece = view[filled : filled + min(len(buffer) - filled, end - position)]
            read_into(files.get(span.path), piece, position, span.path)
            filled += len(piece)
            position += len(piece)
            total -= len(piece)
            if filled == len(buffer):
                yield buffer  # a bytearray of exactly the piece: == against it is a memcmp
                filled = 0
                if 0 < total < len(buffer):
                    buffer = bytearray(total)
                    view = memoryview(buffer)


def tensor_chunks(
    tensor: TensorRef, elements: int | None = None, files: FileCache[Source] | None = None
) -> Iterator[Chunk]:
    """:func:`element_chunks` (by default of :data:`CHUNK_SIZE` bytes), read with ``os.preadv`` through
    ``files`` when the bytes lie in the file as they are. A chunk may be a reused buffer."""
    if elements is None:
        elements = max(1, CHUNK_SIZE // tensor.dtype.itemsize)
    spans = _spans(tensor) if files is not None and hasattr(os, "preadv") else None
    if spans and is_remote(spans[0].path):
        spans = None  # a URL's bytes: streamed by parts fetched one ahead, not a request per chunk
    chunks = (
        element_chunks(tensor, elements)
        if spans is None or files is None  # (spans are found only with files to read them through)
        else _read_spans(spans, elements * tensor.dtype.itemsize, files)
    )
    for chunk in chunks:
        progress.advance(len(chunk))  # the running diff's or verify's bar, if one is shown
        yield chunk


def compare_values(
    a: TensorRef,
    b: TensorRef,
    *,
    atol: float = 0.0,
    files: FileCache[Source] | None = None,
    on_a_chunk: ChunkCallback | None = None,
) -> tuple[bool, float, int, int]:
    """Stream two equal-shape tensors: ``(byte_identical, max_abs_diff, differing, beyond_atol)``.

    Every byte of both is read, chunk by chunk (A's chunk, then B's). ``files`` shares descriptors across
    calls; ``on_a_chunk`` is called with each chunk of A (for a check that wants A's bytes read once).
    """
    if files is None:
        with FileCache() as own:
            return compare_values(a, b, atol=atol, files=own, on_a_chunk=on_a_chunk)
    elements = max(1, CHUNK_SIZE // max(a.dtype.itemsize, b.dtype.itemsize))
    same_dtype = a.dtype == b.dtype
    # integers and bools of one dtype compare exactly (float64 cannot tell 2**62 from 2**62 + 1);
    # only floating values have the -0.0 == 0.0 / NaN-payload rule
    exact = same_dtype and (a.dtype.name in _INTEGER_UNITS or a.dtype.name in BIT_PATTERNS)
    byte_identical = same_dtype
    max_diff = 0.0
    differing = beyond = 0
    for raw_a, raw_b in zip(tensor_chunks(a, elements, files), tensor_chunks(b, elements, files), strict=True):
        if on_a_chunk is not None:
            on_a_chunk(raw_a)
        if same_dtype and raw_a == raw_b:
            continue
        byte_identical = False
        if exact:
            difference = exact_diff(raw_a, raw_b, a.dtype)
            if difference.size:
                max_diff = max(max_diff, float(difference.max()))
                differing += int((difference > 0).sum())
                beyond += int((difference > atol).sum())
            continue
        difference = abs_diff(decode(raw_a, a.dtype), decode(raw_b, b.dtype))
        if difference.size:
            max_diff = max(max_diff, float(difference.max()))
            differing += int((difference > 0).sum())
            beyond += int((difference > atol).sum())
    return byte_identical, max_diff, differing, beyond


# ---------------------------------------------------------------------------------------------- diff


def _note_prefixes(
    report: DiffReport,
    left: Checkpoint,
    right: Checkpoint,
    a_tensors: dict[str, TensorRef],
    b_tensors: dict[str, TensorRef],
    align_prefixes: bool,
) -> tuple[dict[str, TensorRef], dict[str, TensorRef], dict[str, str]]:
    """Keys that differ only by wrapper prefixes: stripped with ``align_prefixes``, else a note says how.
    Returns the tensors to compare and, for each compared key, A's key as stored."""
    a_keys = {key: key for key in a_tensors}  # the key as compared -> A's key as stored
    prefixes = prefix_note(left, right) if left.has_weights and right.has_weights else None
    if prefixes is not None and align_prefixes:
        report.aligned = prefixes
        a_keys = {
            (key[len(prefixes[0]) :] if prefixes[0] and key.startswith(prefixes[0]) else key): key for key in a_tensors
        }  # as _strip: on a clash the last key wins
        a_tensors, b_tensors = _strip(a_tensors, prefixes[0]), _strip(b_tensors, prefixes[1])
        report.notes.append(f'keys compared without their wrapper prefixes (A: "{prefixes[0]}", B: "{prefixes[1]}")')
    elif prefixes is not None:
        sides = [
            (side, prefix, checkpoint)
            for side, prefix, checkpoint in (("A", prefixes[0], left), ("B", prefixes[1], right))
            if prefix
        ]
        which = " and ".join(f'"{prefix}" on {side}' for side, prefix, _ in sides)
        commands = suggest.each([_strip_command(checkpoint, prefix) for _, prefix, checkpoint in sides])
        noun = "prefix" if len(sides) == 1 else "prefixes"
        report.notes.append(f"the keys differ only by the {noun} {which} — run: {commands}")
    return a_tensors, b_tensors, a_keys


def _compare_tensors(
    report: DiffReport,
    a_tensors: dict[str, TensorRef],
    b_tensors: dict[str, TensorRef],
    a_keys: dict[str, str],
    *,
    atol: float,
    chunk_hook: ChunkHook | None,
) -> None:
    """Compare the tensors both sides hold under one key, into ``report``: dtypes, shapes, then values."""
    total = sum(
        tensor.nbytes + b_tensors[name].nbytes
        for name, tensor in a_tensors.items()
        if name in b_tensors and tuple(tensor.shape) == tuple(b_tensors[name].shape)
    )
    with progress.task(total, "diff"), FileCache() as files:
        for name, tensor_a in a_tensors.items():
            tensor_b = b_tensors.get(name)
            if tensor_b is None:
                continue
            report.compared += 1
            change = TensorChange(
                name, [], tensor_a.dtype.name, tensor_b.dtype.name, tuple(tensor_a.shape), tuple(tensor_b.shape)
            )
            if tensor_a.dtype != tensor_b.dtype:
                change.kinds.append("dtype")
            if tuple(tensor_a.shape) != tuple(tensor_b.shape):
                change.kinds.append("shape")
            else:
                on_a_chunk = chunk_hook(a_keys[name], tensor_a) if chunk_hook is not None else None
                identical, max_diff, differing, beyond = compare_values(
                    tensor_a, tensor_b, atol=atol, files=files, on_a_chunk=on_a_chunk
                )
                report.byte_identical += identical
                report.max_abs_diff = max(report.max_abs_diff, max_diff)
                change.max_abs_diff, change.differing, change.beyond_atol = max_diff, differing, beyond
                if beyond:
                    change.kinds.append("values")
                elif not identical and not change.kinds and differing == 0:
                    report.notes.append(
                        f"{name}: bytes differ but every value is equal (-0.0 against 0.0 or NaN payloads)"
                    )
            if change.kinds:
                report.changed.append(change)


def _is_folder(path: Path | str | Checkpoint) -> bool:
    """Whether the other side of a comparison is a folder (the variant asked of one side reads in it too)."""
    if isinstance(path, Checkpoint):
        return False
    where = located(path)
    return not isinstance(where, Path) or where.is_dir()


def _open(
    path: Path | str | Checkpoint,
    allow_globals: tuple[str, ...] | list[str],
    weights: str | None = None,
    variant: str | None = None,
) -> Checkpoint:
    if isinstance(path, Checkpoint):
        return path if weights is None else path.select_weights(weights)
    return load(path, allow_globals=allow_globals, weights=weights, variant=variant)


def _strip(tensors: Mapping[str, TensorRef], prefix: str) -> dict[str, TensorRef]:
    return {(key[len(prefix) :] if prefix and key.startswith(prefix) else key): value for key, value in tensors.items()}


def _strip_command(checkpoint: Checkpoint, prefix: str) -> str:
    return suggest.strip(
        checkpoint.path,
        suffix=formats.for_name(checkpoint.format).default_suffix,
        prefix=None if prefix == checkpoint.prefix else prefix,
        allow_globals=checkpoint.allow_globals,
    )


def prefix_note(a: Checkpoint, b: Checkpoint) -> tuple[str, str] | None:
    """``(prefix_a, prefix_b)`` when the two key sets differ only by wrapper prefixes, else None."""
    a_keys, b_keys = a.tensors, b.tensors
    if set(a_keys) == set(b_keys):
        return None
    prefix_a = detect_prefix(a_keys, lightning=True)
    prefix_b = detect_prefix(b_keys, lightning=True)
    if prefix_a == prefix_b:
        return None
    if set(_strip(a_keys, prefix_a)) != set(_strip(b_keys, prefix_b)):
        return None
    return prefix_a, prefix_b


def diff(
    a: Path | str | Checkpoint,
    b: Path | str | Checkpoint,
    *,
    atol: float = 0.0,
    allow_globals: tuple[str, ...] | list[str] = (),
    align_prefixes: bool = False,
    chunk_hook: ChunkHook | None = None,
    allow_expansion: bool = False,
    weights_a: str | None = None,
    weights_b: str | None = None,
    storage_options: Mapping[str, Any] | None = None,
    variant: str | None = None,
) -> DiffReport:
    """Compare the weights of two checkpoints: keys, dtypes, shapes and values.

    Works across formats (.pt against .safetensors or a sharded directory). Values are compared
    by streaming bytes; a tensor whose bytes differ is reported with its largest absolute
    difference, and counts as changed when that exceeds ``atol``.

    Args:
        a, b: checkpoints (paths or loaded :class:`~ckptool.Checkpoint`).
        atol: value differences up to this are not changes (0: every bit counts, except -0.0 vs 0.0 and
            NaN payloads in floating tensors; integers and bools are compared exactly, not through float64).
        allow_globals: extra pickle globals to accept by name.
        align_prefixes: when the keys differ only by wrapper prefixes (``module.``...), strip them
            and compare the tensors (``report.aligned`` says which).
        chunk_hook: called as ``chunk_hook(key, tensor)`` (A's key as stored) before each tensor of A whose
            values are compared; a callable it returns gets every chunk of that tensor's bytes, so a
            check over A (``verify``'s NaN/Inf count) needs no second read. Tensors not compared (keys
            only in A, shapes that differ) are not read.
        allow_expansion: compare views that expand their storage (stride 0, overlaps) past
            :data:`ckptool.tensors.refs.EXPANSION_FACTOR` in full; without it such a checkpoint is refused.
        weights_a, weights_b: which set of weights of A / B to compare (``"state_dict_ema"``; see
            :func:`ckptool.load`); None: the default one.
        variant: a model folder's weights variant to read in both (``"fp16"``; see :func:`ckptool.load`).

    Example:
        >>> report = ckptool.diff("model.pt", "model.safetensors")   # doctest: +SKIP
        >>> report.identical, report.byte_identical                 # doctest: +SKIP
        (True, 8)
    """
    use_storage_options(storage_options)
    left = _open(a, allow_globals, weights_a, variant)
    right = _open(b, allow_globals, weights_b, variant if _is_folder(b) else None)
    if left.has_weights or right.has_weights:
        a_tensors, b_tensors = left.tensors, right.tensors
    else:  # neither names its weights (bare tensors, lists): compare every tensor by where it lies
        a_tensors, b_tensors = left.tensors_by_place(), right.tensors_by_place()
    for side, tensors in ((left, a_tensors), (right, b_tensors)):
        check_expansion(tensors, allow=allow_expansion, path=side.path, doing="compare")
    report = DiffReport(
        a=str(left.path),
        b=str(right.path),
        a_format=left.format,
        b_format=right.format,
        a_tensors=len(a_tensors),
        b_tensors=len(b_tensors),
        atol=atol,
    )
    a_tensors, b_tensors, a_keys = _note_prefixes(report, left, right, a_tensors, b_tensors, align_prefixes)
    report.only_in_a = [key for key in a_tensors if key not in b_tensors]
    report.only_in_b = [key for key in b_tensors if key not in a_tensors]
    _compare_tensors(report, a_tensors, b_tensors, a_keys, atol=atol, chunk_hook=chunk_hook)
    return report
