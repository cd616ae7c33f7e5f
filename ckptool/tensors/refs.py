"""Lazy references to tensors and the bytes behind them.

The reader never materializes tensor data: it yields :class:`TensorRef` objects (dtype, shape,
stride, storage offset) pointing at a :class:`StorageRef` (saved location tag, size, and the
:class:`ByteRange` of the file where its bytes lie). Commands that only describe a checkpoint stop
there; commands that move bytes stream them from the :class:`ByteRange`; only verification builds
real tensors.
"""

from __future__ import annotations

import functools
import math
import os
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from itertools import compress, repeat
from operator import attrgetter, contains, gt, mul, or_
from pathlib import Path
from typing import Any, NamedTuple, Protocol, cast

from ckptool.base.errors import InputError
from ckptool.base.suggest import option
from ckptool.files.ranges import CHUNK_SIZE, ByteRange
from ckptool.tensors.dtypes import DType

_INT64_MAX = (1 << 63) - 1  # torch's element counts are int64: SECURITY.md's "< 2^63" limit


def contiguous_stride(shape: tuple[int, ...] | list[int]) -> tuple[int, ...]:
    """Strides (in elements) of a C-contiguous tensor of ``shape``."""
    return _contiguous_stride(shape if type(shape) is tuple else tuple(shape))


@functools.lru_cache(maxsize=4096)  # a checkpoint's tensors share few shapes (100,000 tensors: a few dozen)
def _contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    stride, running = [], 1
    for size in reversed(shape):
        stride.append(running)
        running *= size
    return tuple(reversed(stride))


class Derived(Protocol):
    """Bytes a storage computes from others, chunk by chunk (:class:`ckptool.model.cast.CastBytes`)."""

    nbytes: int
    crc32: int | None  # of all the bytes, once a pass has produced them all

    def chunks(self) -> Iterator[memoryview]:
        """The bytes in order; each chunk is valid until the next is asked for."""
        ...


@dataclass(eq=False, slots=True)
class StorageRef:
    """One saved storage: the unit of sharing (tied tensors point at the same StorageRef).

    Attributes:
        key: the storage's name inside its file (zip record name, legacy key, safetensors tensor name).
        dtype: element type the storage was saved with (``U8`` for untyped storages).
        numel: number of ``dtype`` elements as saved.
        location: the saved location tag, e.g. ``"cpu"`` or ``"cuda:1"``.
        data: where the bytes lie; ``None`` until a legacy file's data section has been located.
        type_global: the pickle global naming the storage class (kept to re-emit the pickle unchanged).
    """

    key: str
    dtype: DType
    numel: int
    location: str
    data: ByteRange | None = None
    type_global: str = ""
    producer: Callable[[], bytes | bytearray] | None = None  # bytes computed on demand (a cast, DCP chunks)
    # bytes computed from other bytes chunk by chunk (a cast): streamed, never held whole; ``producer``
    # then gives them whole for the few readers that need that (a tensor built from them)
    derived: Derived | None = None
    # bytes that lie in several places, end to end (DCP row shards): streamed piece by piece, no assembly
    pieces: tuple[ByteRange, ...] | None = None

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    def byte_range(self) -> ByteRange:
        if self.data is None:
            raise InputError(f"storage {self.key!r} has no data in the file")
        return self.data


@dataclass(eq=False, slots=True)
class TensorRef:
    """A tensor as saved: a strided view of ``storage``. No bytes are read until asked.

    Its bytes (:meth:`iter_bytes`, :meth:`read_bytes`) are the tensor's *values* as
    ``torch.load`` gives them: a tensor saved with its conjugate bit (``x.conj()``) or negative bit
    (``torch._neg_view``) stores the un-conjugated, un-negated bytes plus the bit, and both are
    applied here. The raw storage stays reachable through ``storage`` for rewrites that copy it.

    Attributes:
        rebuild: the pickle global that rebuilds it (``torch._utils._rebuild_tensor_v2``...).
        extra: trailing rebuild arguments kept verbatim (the tensor metadata dict), so a rewrite re-emits them.
        parameter: ``None`` for a plain tensor; for an ``nn.Parameter``, the arguments that wrapped it.
        conj, neg: the conjugate and negative bits (from the metadata in ``extra``); a tensor whose bytes
            ckptool computed (a cast) has neither and no metadata.
    """

    storage: StorageRef
    dtype: DType
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int = 0
    requires_grad: bool = False
    rebuild: str = "torch._utils._rebuild_tensor_v2"
    extra: tuple = ()
    backward_hooks: object = None
    parameter: tuple | None = field(default=None)
    # ``(type global, state)`` when rebuilt through ``torch._tensor._rebuild_from_type_v2`` (a tensor saved
    # with Python attributes): re-emitted so torch sets the same attributes again
    subclass: tuple | None = field(default=None)
    conj: bool = False
    neg: bool = False

    # computed on each call, not cached on the instance: a cache in each TensorRef's __dict__ (added in varying
    # order) un-shares the instances' dict keys, +100 MiB for 100,000 tensors
    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    @property
    def location(self) -> str:
        return self.storage.location

    def is_contiguous(self) -> bool:
        """C-contiguous in its storage (size-1 dimensions may carry any stride)."""
        if self.stride == contiguous_stride(self.shape):  # the usual case: one lookup of the shape's strides
            return True
        expected = 1
        for size, stride in zip(reversed(self.shape), reversed(self.stride)):
            if size != 1 and stride != expected:
                return False
            expected *= size
        return True

    def validate(self, *, path: Path | None = None, name: str = "") -> None:
        """Check shape, strides and offset against the storage's bytes; raise InputError if they lie."""
        shape, strides, offset = self.shape, self.stride, self.offset
        where = f"tensor {name!r}: " if name else "tensor: "
        if len(shape) != len(strides):
            raise InputError(
                f"{where}shape {shape} and stride {strides} differ in length — the file is corrupt", path=path
            )
        for value in (*shape, *strides, offset):
            if type(value) is not int or value < 0:
                raise InputError(f"{where}negative or non-integer shape/stride/offset — the file is corrupt", path=path)
        # torch counts elements in int64: a larger count (stride-0 views need no bytes for it) is no tensor
        if math.prod(shape) > _INT64_MAX:
            raise InputError(
                f"{where}its shape ({len(shape)} dimensions) holds 2^63 or more elements — the file is corrupt",
                path=path,
            )
        if 0 in shape:
            return
        last = offset
        for size, stride in zip(shape, strides):
            last += (size - 1) * stride
        if self.storage.dtype.itemsize * self.storage.numel < (last + 1) * self.dtype.itemsize:
            raise InputError(
                f"{where}needs {(last + 1) * self.dtype.itemsize} bytes but its storage holds "
                f"{self.storage.nbytes} — the file is corrupt or truncated",
                path=path,
            )

    def plain_data(self) -> ByteRange | None:
        """The storage's bytes where they lie, when this is the usual tensor: its exact C-contiguous strides, no
        conjugate or negative bit, bytes neither computed nor in pieces; else None (the general paths decide).
        Inline attribute tests only: writers and checks ask it of each of 100,000 tensors."""
        storage = self.storage
        data = storage.data
        if (
            data is None
            or self.conj
            or self.neg
            or storage.producer is not None
            or storage.pieces is not None
            or self.stride != contiguous_stride(self.shape)
        ):
            return None
        return data

    def contiguous_byte_range(self) -> ByteRange | None:
        """The exact bytes of the tensor when it is C-contiguous in its storage (and they are its
        values: no conjugate or negative bit), else None."""
        storage = self.storage
        if self.conj or self.neg or storage.producer is not None or not self.is_contiguous():
            return None
        base = storage.data
        if base is None:
            base = storage.byte_range()  # raises why there are no bytes
        itemsize = self.dtype.itemsize
        return ByteRange(base.path, base.offset + self.offset * itemsize, math.prod(self.shape) * itemsize)

    def iter_bytes(self, chunk_size: int = CHUNK_SIZE) -> Iterator[bytes]:
        """The tensor's values as bytes in C order, streamed (a non-contiguous tensor is gathered once;
        a conjugate or negative bit is applied chunk by chunk)."""
        if self.conj or self.neg:
            yield from apply_bits(self._iter_stored(chunk_size), self.dtype, conj=self.conj, neg=self.neg)
            return
        yield from self._iter_stored(chunk_size)

    def _iter_stored(self, chunk_size: int) -> Iterator[bytes]:
        """The bytes of the view in C order as the storage holds them (no bits applied)."""
        if self.numel == 0:
            return
        derived = self.whole_derived()
        if derived is not None:
            for chunk in derived.chunks():
                yield bytes(chunk)
            return
        if self.storage.pieces is not None and self.offset == 0 and self.nbytes == self.storage.nbytes:
            for piece in self.storage.pieces:
                yield from piece.iter_chunks(chunk_size=chunk_size)
            return
        if self.storage.producer is not None:
            data = self.storage.producer()
            if not self.is_contiguous():  # a view of computed bytes (a big-endian file's transpose)
                yield from self._gather(chunk_size, data)
                return
            start = self.offset * self.dtype.itemsize
            # the usual case (a cast, an assembled DCP tensor) is the whole storage: no slicing copy
            yield (
                cast(bytes, data)
                if start == 0 and len(data) == self.nbytes
                else bytes(data[start : start + self.nbytes])
            )
            return
        span = self.contiguous_byte_range()
        if span is not None:
            yield from span.iter_chunks(chunk_size=chunk_size)
            return
        yield from self._gather(chunk_size)

    def iter_reused(self, chunk_size: int = CHUNK_SIZE) -> Iterator[bytes | bytearray | memoryview]:
        """:meth:`iter_bytes` for consumers that use each chunk at once: contiguous bytes come in one
        reused buffer (valid until the next chunk), sparing an allocation per chunk."""
        pieces = self.whole_pieces()
        if pieces is not None:
            for piece in pieces:
                yield from piece.iter_reused(chunk_size=chunk_size)
            return
        derived = self.whole_derived()
        if derived is not None:
            yield from derived.chunks()
            return
        span = self.contiguous_byte_range() if self.numel else None
        if span is None:
            yield from self.iter_bytes(chunk_size)
        else:
            yield from span.iter_reused(chunk_size=chunk_size)

    def whole_pieces(self) -> tuple[ByteRange, ...] | None:
        """The byte ranges that make up this tensor end to end, when its storage is so described."""
        storage = self.storage
        if (
            storage.pieces is None
            or self.conj
            or self.neg
            or self.offset != 0
            or self.nbytes != storage.nbytes
            or not self.is_contiguous()
        ):
            return None
        return storage.pieces

    def whole_derived(self) -> Derived | None:
        """The computed bytes (a cast) that are this tensor's, all of them in order, else None."""
        derived = self.storage.derived
        if (
            derived is None
            or self.conj
            or self.neg
            or self.offset != 0
            or self.nbytes != derived.nbytes
            or not self.is_contiguous()
        ):
            return None
        return derived

    def read_bytes(self) -> bytes:
        """All of the tensor's values as bytes in C order (conjugate/negative bits applied)."""
        return b"".join(self.iter_bytes())

    def span_bytes(self) -> int:
        """Bytes of its storage the view touches, from its first element to its last (0 when empty)."""
        if self.numel == 0:
            return 0
        if self.is_contiguous():  # its elements end to end (a size-1 dimension's stride moves nothing)
            return self.nbytes
        last = sum((size - 1) * stride for size, stride in zip(self.shape, self.stride))
        return (last + 1) * self.dtype.itemsize

    def expands(self) -> bool:
        """True when the view promises more bytes than the storage span it reads (stride 0, overlaps)."""
        if self.stride == contiguous_stride(self.shape):  # the usual tensor: its elements end to end
            return False
        return self.nbytes > self.span_bytes()

    def _gather(self, chunk_size: int, produced: bytes | bytearray | None = None) -> Iterator[bytes]:
        import numpy as np

        base = self.storage.byte_range() if produced is None else ByteRange(Path(), 0, len(produced))
        item = self.dtype.itemsize
        length = self.offset * item + self.span_bytes()
        if produced is None and not isinstance(base.path, Path):  # a URL: the view's span fetched, then gathered
            produced, base = b"".join(base.iter_chunks(0, length)), ByteRange(Path(), 0, length)
        if (os.path.getsize(base.path) if produced is None else len(produced)) < base.offset + length:
            raise InputError.truncated(base.path)
        unit = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}.get(item, np.dtype((np.void, item)))
        flat = (
            np.memmap(base.path, dtype=np.uint8, mode="r", offset=base.offset, shape=(length,))
            if produced is None
            else np.frombuffer(produced, dtype=np.uint8, count=length)
        )
        view = np.lib.stride_tricks.as_strided(
            flat.view(unit)[self.offset :],
            shape=self.shape,
            strides=tuple(s * item for s in self.stride),
            writeable=False,
        )
        yield from _gather_chunks(view, chunk_size)


def bits_supported(dtype: DType, *, conj: bool, neg: bool) -> str | None:
    """Why ckptool cannot apply these bits to ``dtype`` (None when it can).

    Conjugation exists for complex types only (torch refuses it elsewhere); negation for floating,
    complex and signed integer types and uint8, where torch's ``neg`` is defined (bool, float8 and
    the wider unsigned types have no ``neg`` kernel, so torch cannot produce their values either).
    """
    if conj and dtype.name not in _COMPLEX_PART:
        return f"a conjugate bit on a {dtype.torch_name} tensor (only complex tensors have one)"
    if neg and dtype.name not in _SIGN_MASK and dtype.name not in _COMPLEX_PART and dtype.name not in _NEGATABLE_INT:
        return f"a negative bit on a {dtype.torch_name} tensor (torch has no negation for {dtype.torch_name})"
    return None


# the sign bit of each IEEE float type, by its byte size: negation flips it (NaN payloads kept)
_SIGN_MASK = {"F64": 1 << 63, "F32": 1 << 31, "F16": 1 << 15, "BF16": 1 << 15}
# complex types: (the unsigned type of one part, its sign bit)
_COMPLEX_PART = {"C64": ("<u4", 1 << 31), "C128": ("<u8", 1 << 63)}
_NEGATABLE_INT = {"I64": "<i8", "I32": "<i4", "I16": "<i2", "I8": "i1", "U8": "u1"}


def apply_bits(chunks: Iterator[bytes | bytearray], dtype: DType, *, conj: bool, neg: bool) -> Iterator[bytes]:
    """Stored bytes -> values: conjugate (flip each imaginary part's sign) and/or negate, chunk by chunk.

    Floating values are negated by flipping the sign bit — IEEE negation, which is what torch's
    ``neg`` computes for every number (its vectorized kernels may differ from that only on the sign
    of a zero or the payload of a NaN). Integers wrap (two's complement), as in torch.
    """
    import numpy as np

    item = dtype.itemsize
    pending = b""
    for chunk in chunks:
        data = pending + bytes(chunk) if pending else chunk
        usable = len(data) - len(data) % item
        pending = bytes(data[usable:])
        if usable:
            yield _apply_bits_aligned(np, memoryview(data)[:usable], dtype, conj=conj, neg=neg)
    if pending:  # the bytes end inside an element: the storage check makes this unreachable
        raise InputError(f"tensor bytes end inside a {dtype.torch_name} element — the file is corrupt")


def _apply_bits_aligned(np: Any, data: memoryview, dtype: DType, *, conj: bool, neg: bool) -> bytes:
    name = dtype.name
    if name in _COMPLEX_PART:
        unit, sign = _COMPLEX_PART[name]
        parts = np.frombuffer(data, dtype=unit).copy()
        if neg and conj:
            parts[0::2] ^= np.array(sign, dtype=unit)  # the imaginary part is flipped twice
        elif neg:
            parts ^= np.array(sign, dtype=unit)
        else:
            parts[1::2] ^= np.array(sign, dtype=unit)
        return parts.tobytes()
    if name in _SIGN_MASK:
        unit = f"<u{dtype.itemsize}"
        values = np.frombuffer(data, dtype=unit).copy()
        values ^= np.array(_SIGN_MASK[name], dtype=unit)
        return values.tobytes()
    values = np.frombuffer(data, dtype=_NEGATABLE_INT[name])
    with np.errstate(over="ignore"):
        return np.negative(values).tobytes()


# How far the views a command materializes may expand the bytes their storages hold before it
# refuses them (unless the caller allows expansion): a stride-0 view of one stored float can
# promise gigabytes, so a 2 KB file would write, hash or compare them all. Real checkpoints' views
# (slices, transposes, tied weights) never exceed their storage; an expanded buffer or two
# (``arange(n).expand(...)``) stays far below the slack.
EXPANSION_FACTOR = 4
EXPANSION_SLACK = 64 << 20


@dataclass(frozen=True)
class Expansion:
    """What materializing a set of views costs against the bytes behind them.

    Attributes:
        stored: bytes of the distinct storages the views read.
        logical: bytes of the distinct views in C order (what a write, a hash or a compare streams).
        expanding: ``(name, view bytes, span bytes)`` of each view that promises more than it reads.
    """

    stored: int
    logical: int
    expanding: tuple[tuple[str, int, int], ...]

    @property
    def excessive(self) -> bool:
        return self.logical > EXPANSION_FACTOR * self.stored + EXPANSION_SLACK


def expansion(tensors: Mapping[str, Any], *, shared: bool | None = None) -> Expansion:
    """Measure the views of ``tensors`` (no bytes read); tied tensors (one view under two names) count once.
    ``shared``: whether any storage is viewed twice among them, if the caller knows (:func:`census`)."""
    values = list(tensors.values())
    if all(map(_IS_TENSOR_REF, values)):
        views_of = list(map(_STORAGE, values))
        untied = not shared if shared is not None else len(set(views_of)) == len(views_of)  # (identity hashes)
        if untied:  # a storage per tensor: nothing is tied
            whole = whole_plain(values)
            if whole is not None:  # each all of its storage, end to end: none expands
                return Expansion(sum(map(mul, map(_NUMEL, views_of), map(_ITEMSIZE, views_of))), sum(whole[1]), ())
            return _expansion_untied(list(tensors), values, views_of)
    storages: dict[int, int] = {}
    first_view: dict[int, TensorRef] = {}  # a storage's first view, until a second one shows up
    views: set[tuple] = set()
    logical = 0
    expanding = []

    def identity(view: TensorRef) -> tuple:
        return (id(view.storage), view.offset, view.shape, view.stride, view.dtype.name)

    prod = math.prod
    for name, tensor in tensors.items():  # one pass; views are told apart only where storages are shared
        if type(tensor) is not TensorRef and not isinstance(tensor, TensorRef):
            continue
        storage = tensor.storage
        key = id(storage)
        stored = storages.get(key)
        if stored is None:
            stored = storages[key] = storage.numel * storage.dtype.itemsize  # StorageRef.nbytes, inline
            first_view[key] = tensor
        else:
            first = first_view.pop(key, None)
            if first is not None:
                views.add(identity(first))
            this = identity(tensor)
            if this in views:
                continue  # tied: the same view under another name
            views.add(this)
        nbytes = prod(tensor.shape) * tensor.dtype.itemsize  # TensorRef.nbytes, inline (100,000 calls)
        logical += nbytes
        if (nbytes > stored or 0 in tensor.stride) and tensor.expands():  # only overlapping views can
            expanding.append((str(name), nbytes, tensor.span_bytes()))
    expanding.sort(key=lambda item: -item[1])
    return Expansion(sum(storages.values()), logical, tuple(expanding))


def _expansion_untied(names: list[Any], views: list[TensorRef], storages: list[StorageRef]) -> Expansion:
    """:func:`expansion` where each view has a storage of its own, in C-speed passes (100,000 tensors)."""
    stored = list(map(mul, map(_NUMEL, storages), map(_ITEMSIZE, storages)))  # StorageRef.nbytes
    logical = list(map(mul, map(math.prod, map(_SHAPE, views)), map(_ITEMSIZE, views)))  # TensorRef.nbytes
    # only a view promising more bytes than its storage holds, or with a stride of 0, can overlap itself
    suspects = map(or_, map(gt, logical, stored), map(contains, map(_STRIDE, views), repeat(0)))
    expanding = [
        (str(names[i]), logical[i], views[i].span_bytes())
        for i in compress(range(len(views)), suspects)
        if views[i].expands()
    ]
    expanding.sort(key=lambda item: -item[1])
    return Expansion(sum(stored), sum(logical), tuple(expanding))


_STORAGE, _SHAPE, _STRIDE, _NUMEL = (
    attrgetter("storage"),
    attrgetter("shape"),
    attrgetter("stride"),
    attrgetter("numel"),
)
_ITEMSIZE = attrgetter("dtype.itemsize")
_DATA, _OFFSET, _LENGTH, _CONJ, _NEG = (
    attrgetter("data"),
    attrgetter("offset"),
    attrgetter("length"),
    attrgetter("conj"),
    attrgetter("neg"),
)
_PRODUCER, _PIECES, _DERIVED = attrgetter("producer"), attrgetter("pieces"), attrgetter("derived")
_PATH, _CRC32, _DTYPE_NAME = attrgetter("path"), attrgetter("crc32"), attrgetter("dtype.name")
_IS_TENSOR_REF = functools.partial(type.__instancecheck__, TensorRef)  # isinstance(value, TensorRef), from C


def total_nbytes(views: Iterable[TensorRef]) -> int:
    """The bytes of all ``views`` (their :attr:`TensorRef.nbytes` summed, in C-speed passes)."""
    views = list(views)
    whole = whole_plain(views) if all(map(_IS_TENSOR_REF, views)) else None
    if whole is not None:
        return sum(whole[1])
    return sum(map(mul, map(math.prod, map(_SHAPE, views)), map(_ITEMSIZE, views)))


def whole_plain(views: list[TensorRef]) -> tuple[list[ByteRange], list[int]] | None:
    """When every one of ``views`` is the usual tensor (:meth:`TensorRef.plain_data`) and all of its storage's
    bytes: each one's ``plain_data()`` and byte count, in order. Else None (the per-tensor paths decide).

    C-speed passes over the columns (100,000 tensors), no call per tensor."""
    storages = list(map(_STORAGE, views))
    datas = list(map(_DATA, storages))
    shapes = list(map(_SHAPE, views))
    if (
        not all(datas)
        or any(map(_OFFSET, views))
        or any(map(_CONJ, views))
        or any(map(_NEG, views))
        or any(map(_PRODUCER, storages))
        or any(map(_PIECES, storages))
        or set(map(type, shapes)) - {tuple}
    ):
        return None
    if list(map(_STRIDE, views)) != list(map(_contiguous_stride, shapes)):
        return None
    nbytes = list(map(mul, map(math.prod, shapes), map(_ITEMSIZE, views)))  # TensorRef.nbytes
    if nbytes != list(map(_LENGTH, datas)):
        return None
    return datas, nbytes


class Census(NamedTuple):
    """What a summary counts of a checkpoint's tensors."""

    parameters: int  # elements, summed
    nbytes: int
    dtypes: dict[str, int]  # tensors by dtype name, first met first
    bits: bool  # whether any has a conjugate or negative bit
    shared: bool  # whether any storage is viewed by more than one of them


def census(views: list[TensorRef]) -> Census:
    """The :class:`Census` of ``views``, in C-speed passes over their columns (100,000 tensors: ~80 ms)."""
    numels = list(map(math.prod, map(_SHAPE, views)))
    storages = list(map(_STORAGE, views))
    return Census(
        sum(numels),
        sum(map(mul, numels, map(_ITEMSIZE, views))),
        dict(Counter(map(_DTYPE_NAME, views))),
        any(map(_CONJ, views)) or any(map(_NEG, views)),
        len(set(storages)) != len(storages),
    )


def shared_storages(tensors: Iterable[Any]) -> set[int]:
    """The ids of the storages more than one of ``tensors`` view (only their views can be tied)."""
    storages = list(map(_STORAGE, tensors))
    if len(set(storages)) == len(storages):  # the usual file: a storage per tensor (identity hashes, in C)
        return set()
    counts = Counter(map(id, storages))
    return {key for key, count in counts.items() if count > 1}


def human_size(count: int) -> str:
    """``count`` bytes for a message: ``4 B``, ``256.0 MiB``."""
    value = float(count)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"):
        if value < 1024 or unit == "EiB":
            return f"{count} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{count} B"


class PartRef(TensorRef):
    """A part of a tensor torch builds from parts (a sparse or nested tensor: :mod:`ckptool.pickles.layouts`), as
    ``Checkpoint.tensors`` lists it: the saved tensor, and the tensor it is a part of (``whole``, which
    has ``check(name=..., path=...)``). What reads parts' values checks their wholes first
    (:func:`check_wholes`)."""

    __slots__ = ("whole",)
    whole: Any
    made = 0  # how many this process made: none, and no mapping needs looking through for them

    @classmethod
    def of(cls, tensor: TensorRef, whole: Any) -> PartRef:
        PartRef.made += 1
        part = cls.__new__(cls)
        for name in TensorRef.__slots__:  # (the dataclass's fields)
            object.__setattr__(part, name, getattr(tensor, name))
        part.whole = whole
        return part


def check_wholes(tensors: Mapping[str, Any], *, path: Path | None = None) -> None:
    """Refuse, as torch.load does, the sparse and nested tensors whose parts (:class:`PartRef`) are
    among ``tensors``: their index parts are read once. A mapping without parts costs one C-speed pass at most.

    Raises:
        InputError: torch.load refuses one of them (an index past the size, a piece past its buffer...).
    """
    if not PartRef.made or PartRef not in map(type, tensors.values()):  # (100,000 tensors: 0 ms, or ~3 ms)
        return
    wholes: dict[int, tuple[str, Any]] = {}
    for name, value in tensors.items():
        whole = getattr(value, "whole", None) if type(value) is PartRef else None
        if whole is not None and id(whole) not in wholes:
            # a part is named "key[layout size/role]": the whole's key is what comes before the last "["
            wholes[id(whole)] = (str(name).rpartition("[")[0] or str(name), whole)
    for name, whole in wholes.values():
        whole.check(name=name, path=path)


def check_expansion(
    tensors: Mapping[str, Any], *, allow: bool, path: Path | None = None, doing: str = "materialize"
) -> Expansion:
    """Refuse views that would expand their storages past EXPANSION_FACTOR (plus EXPANSION_SLACK), and
    the sparse and nested tensors torch.load refuses among what they are parts of (:func:`check_wholes`):
    every command that streams or materializes the views calls this first.

    Raises:
        InputError: the views expand too far and ``allow`` is False; the message gives the size
            they would become and the option that allows it. Or torch.load refuses a sparse or
            nested tensor the views are parts of.
    """
    check_wholes(tensors, path=path)
    measured = expansion(tensors)
    if measured.excessive and not allow:
        name, view_bytes, span = measured.expanding[0] if measured.expanding else ("", measured.logical, 0)
        first = f"; largest {name!r}: {human_size(span)} viewed as {human_size(view_bytes)}" if name else ""
        raise InputError(
            f"{len(measured.expanding)} tensor view(s) (stride 0 or overlapping) would expand "
            f"{human_size(measured.stored)} of stored bytes to {human_size(measured.logical)}{first} — refusing to "
            f"{doing} them; pass " + option("allow_expansion") + " if that size is what you want",
            path=path,
        )
    return measured


def _gather_chunks(view: Any, chunk_size: int) -> Iterator[bytes]:
    """C-order bytes of a strided numpy view, a block of leading rows at a time (bounded memory)."""
    import numpy as np

    if view.ndim == 0 or view.nbytes <= chunk_size:
        yield np.ascontiguousarray(view).tobytes()
        return
    row = view[0].nbytes if view.shape[0] else 0
    if row == 0:
        return
    if row <= chunk_size:
        step = max(1, chunk_size // row)
        for start in range(0, view.shape[0], step):
            yield np.ascontiguousarray(view[start : start + step]).tobytes()
    else:
        for index in range(view.shape[0]):
            yield from _gather_chunks(view[index], chunk_size)


@dataclass(frozen=True)
class DeviceRef:
    """A ``torch.device`` found in a pickle, kept as its constructor arguments."""

    args: tuple

    def __str__(self) -> str:
        return ":".join(str(a) for a in self.args)


@dataclass(frozen=True)
class DTypeRef:
    """A ``torch.<dtype>`` global found in a pickle (e.g. an optimizer's saved dtype)."""

    module: str
    name: str


class SizeRef(tuple):
    """A ``torch.Size`` found in a pickle: a tuple that re-emits as torch.Size."""
