"""Tensors as saved: strided views (:class:`TensorRef`) of saved storages (:class:`StorageRef`), read lazily.

A :class:`TensorRef` holds dtype, shape, stride and storage offset; its :class:`StorageRef` holds the saved
location tag, the size, and the :class:`ByteRange` of the file where its bytes lie (or how they are computed).
No bytes are read until asked for, and then streamed. :mod:`ckptool.tensors.refs` gathers these records with
the passes that measure many of them at once.
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, cast

from ckptool.base.errors import InputError
from ckptool.files.ranges import CHUNK_SIZE, ByteRange
from ckptool.tensors.bits import apply_bits
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


class PartRef(TensorRef):
    """A part of a tensor torch builds from parts (a sparse or nested tensor: :mod:`ckptool.pickles.layouts`), as
    ``Checkpoint.tensors`` lists it: the saved tensor, and the tensor it is a part of (``whole``, which
    has ``check(name=..., path=...)``). What reads parts' values checks their wholes first
    (:func:`ckptool.tensors.refs.check_wholes`)."""

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
