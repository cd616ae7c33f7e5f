"""Lazy references to tensors and the bytes behind them, and the passes that measure many at once.

The reader never materializes tensor data: it yields :class:`TensorRef` objects (dtype, shape,
stride, storage offset) pointing at a :class:`StorageRef` (saved location tag, size, and the
:class:`ByteRange` of the file where its bytes lie). Commands that only describe a checkpoint stop
there; commands that move bytes stream them from the :class:`ByteRange`; only verification builds
real tensors.

The records live in :mod:`ckptool.tensors.views` (the bits they apply in :mod:`ckptool.tensors.bits`) and
are imported from here. This module adds what reads the views of a whole checkpoint in C-speed passes over
their columns (:func:`census`, :func:`expansion`, :func:`whole_plain`...), the checks every command that
materializes them runs first (:func:`check_expansion`), and the other references a pickle holds
(:class:`DeviceRef`, :class:`DTypeRef`, :class:`SizeRef`).
"""

from __future__ import annotations

import functools
import math
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from itertools import compress, repeat
from operator import attrgetter, contains, gt, mul, or_
from pathlib import Path
from typing import Any, NamedTuple

from ckptool.base.errors import InputError
from ckptool.base.suggest import option
from ckptool.files.ranges import ByteRange as ByteRange
from ckptool.tensors.bits import apply_bits as apply_bits
from ckptool.tensors.bits import bits_supported as bits_supported
from ckptool.tensors.views import Derived as Derived
from ckptool.tensors.views import PartRef as PartRef
from ckptool.tensors.views import StorageRef as StorageRef
from ckptool.tensors.views import TensorRef as TensorRef
from ckptool.tensors.views import _contiguous_stride
from ckptool.tensors.views import contiguous_stride as contiguous_stride

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
