"""Quantized tensors: a placeholder for torch's ``_rebuild_qtensor``, read with the values torch reads.

``torch.save`` writes a quantized tensor as ``_rebuild_qtensor(storage, offset, size, stride,
qparams, requires_grad, hooks)`` over a quantized storage (``torch.QUInt8Storage``...), where
``qparams`` is ``(torch.per_tensor_affine, scale, zero_point)`` or ``(torch.per_channel_affine,
scales, zero_points, axis)`` — per-channel scales and zero points as tensors (older torch wrote
lists). :class:`QuantizedTensor` keeps that call as it was (the writer re-emits it; ``remap``
retags its storages with every other) and says what torch builds from it:

- its integer representation (``int_repr()``): a view of the storage in the matching integer
  type (uint8, int8, int32); for the sub-byte types (quint4x2, quint2x4) the packed bytes, which
  is what torch's ``int_repr`` returns for them;
- its quantization parameters as torch's quantizer holds them: the scheme follows the zero
  points' type (floating zero points make ``per_channel_affine_float_qparams``, whatever scheme
  the pickle names), scales become float64 and zero points int64 — or both float32 for float
  zero points — converted as torch's ``.to()`` converts them.

``Checkpoint.tensors`` lists these as its parts (``key[qint8 4x3/int_repr]``, ``.../scale``,
``.../zero_point`` or ``.../scales``, ``.../zero_points``, ``.../axis``), so diff, the fingerprint
and verify cover the integers and every parameter. :meth:`QuantizedTensor.build` makes torch's
own quantized tensor from them, as ``_rebuild_qtensor`` does. Anything torch would refuse, or
that torch reads past its storage for (a sub-byte tensor whose packed bytes end past it), is
refused here.
"""

from __future__ import annotations

import math
import struct
import zlib
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

from ckptool.base.errors import InputError, UsageError
from ckptool.pickles.layouts import LayoutTensor
from ckptool.pickles.limits import brief
from ckptool.pickles.placeholders import StorageTypeRef
from ckptool.tensors.dtypes import BY_NAME, DType
from ckptool.tensors.refs import DTypeRef, StorageRef, TensorRef

if TYPE_CHECKING:
    import torch

_INT64 = (-(1 << 63), (1 << 63) - 1)


class QuantizedType:
    """A quantized dtype: its storage's element type, the integer type of its representation, its bits."""

    def __init__(self, torch_name: str, storage_class: str, itemsize: int, repr_name: str, bits: int) -> None:
        # not registered in dtypes.BY_NAME: no plain tensor, safetensors file or cast has this type
        self.dtype = DType(torch_name.upper(), itemsize, torch_name, storage_class, False)
        self.storage_class = storage_class
        self.repr_dtype = BY_NAME[repr_name]
        self.bits = bits


QUANTIZED_TYPES: dict[str, QuantizedType] = {
    q.dtype.torch_name: q
    for q in (
        QuantizedType("quint8", "QUInt8Storage", 1, "U8", 8),
        QuantizedType("qint8", "QInt8Storage", 1, "I8", 8),
        QuantizedType("qint32", "QInt32Storage", 4, "I32", 32),
        QuantizedType("quint4x2", "QUInt4x2Storage", 1, "U8", 4),
        QuantizedType("quint2x4", "QUInt2x4Storage", 1, "U8", 2),
    )
}
_BY_DTYPE = {id(q.dtype): q for q in QUANTIZED_TYPES.values()}

PER_TENSOR_AFFINE = "per_tensor_affine"
PER_CHANNEL_AFFINE = "per_channel_affine"
FLOAT_QPARAMS = "per_channel_affine_float_qparams"
# what torch's quantizer converts a per-channel tensor's parameters from (other types: refused)
_FLOATING = {"F64": "<f8", "F32": "<f4", "F16": "<f2", "BF16": None}
_INTEGRAL = {"I64": "<i8", "I32": "<i4", "I16": "<i2", "I8": "i1", "U8": "u1", "U16": "<u2", "U32": "<u4", "U64": "<u8"}


def _corrupt(what: str) -> InputError:
    return InputError(f"a quantized tensor's {what} — torch.load refuses it too; the file is corrupt")


def _int(value: Any, what: str, low: int = 0) -> int:
    if type(value) is not int or not low <= value <= _INT64[1]:
        raise _corrupt(f"{what} is {brief(value)}, not an integer torch accepts")
    return value


def _ints(value: Any, what: str) -> tuple[int, ...]:
    if not isinstance(value, tuple | list) or len(value) > 64:
        raise _corrupt(f"{what} is {brief(value)}, not a list of sizes")
    return tuple(_int(v, what) for v in value)


def _scalar(role: str, data: bytes, dtype: DType, location: str) -> TensorRef:
    """A 0-dimensional tensor of computed bytes: a parameter the pickle holds as a number."""
    storage = StorageRef(key=f"quantized {role}", dtype=dtype, numel=1, location=location, producer=lambda: data)
    return TensorRef(storage=storage, dtype=dtype, shape=(), stride=())


def _vector(role: str, values: Any, dtype: DType, location: str) -> TensorRef:
    """A 1-dimensional tensor whose bytes ``values()`` computes (read only when asked)."""
    count = values.count
    storage = StorageRef(key=f"quantized {role}", dtype=dtype, numel=count, location=location, producer=values)
    return TensorRef(storage=storage, dtype=dtype, shape=(count,), stride=(1,))


def _converted(role: str, source: TensorRef, target: DType, location: str) -> TensorRef:
    """A saved per-channel parameter tensor as torch's quantizer converts it to ``target``.

    A stride-0 view is converted as the one element it stores and stays a stride-0 view: what it
    promises is counted as the expansion it is (:func:`ckptool.tensors.refs.expansion`), never as stored
    bytes. Any other view is converted chunk by chunk as it is streamed (bounded memory)."""
    if source.numel > 1 and source.stride == (0,):
        one = TensorRef(
            storage=source.storage,
            dtype=source.dtype,
            shape=(1,),
            stride=(1,),
            offset=source.offset,
            conj=source.conj,
            neg=source.neg,
        )
        single = _Converted(one, target)
        storage = StorageRef(key=f"quantized {role}", dtype=target, numel=1, location=location, producer=single.read)
        return TensorRef(storage=storage, dtype=target, shape=source.shape, stride=(0,))
    converted = _Converted(source, target)
    storage = StorageRef(
        key=f"quantized {role}",
        dtype=target,
        numel=source.numel,
        location=location,
        producer=converted.read,
        derived=converted,
    )
    return TensorRef(storage=storage, dtype=target, shape=(source.numel,), stride=(1,))


# elements converted at a time: 8 MiB of float64 or int64 out
_CONVERT_CHUNK = 1 << 20


class _Converted:
    """The bytes of a saved tensor converted to ``target`` as torch's ``.to()`` converts on the CPU:
    widening exactly, float64 to float32 rounding to nearest even (NaN payloads kept as the CPU
    keeps them), integers to int64 by value. Computed chunk by chunk whenever they are read (the
    :class:`ckptool.tensors.refs.Derived` protocol); ``crc32`` once a pass has produced them all."""

    def __init__(self, source: TensorRef, target: DType) -> None:
        self.source, self.target = source, target
        self.nbytes = source.numel * target.itemsize
        self.crc32: int | None = None if self.nbytes else 0

    def chunks(self) -> Iterator[memoryview]:
        import numpy as np

        item = self.source.dtype.itemsize
        crc, pending = 0, b""
        for chunk in self.source.iter_bytes(chunk_size=_CONVERT_CHUNK * item):
            data = pending + bytes(chunk) if pending else chunk
            usable = len(data) - len(data) % item
            pending = bytes(data[usable:])
            if usable:
                out = _convert(np, memoryview(data)[:usable], self.source.dtype.name, self.target.name)
                crc = zlib.crc32(out, crc)
                yield memoryview(out)
        if pending:  # the storage check makes this unreachable
            raise InputError(
                f"a quantized tensor's parameters end inside a {self.source.dtype.torch_name} element "
                "— the file is corrupt"
            )
        self.crc32 = crc

    def read(self) -> bytearray:
        """All the converted bytes at once (to build a tensor from them)."""
        data = bytearray()
        for chunk in self.chunks():
            data += chunk
        return data


def _convert(np: Any, data: memoryview, source: str, target: str) -> bytes:
    if source == "BF16":  # numpy has no bfloat16: it is float32's top half
        values = (np.frombuffer(data, dtype="<u2").astype("<u4") << 16).view("<f4")
    else:
        values = np.frombuffer(data, dtype=_FLOATING.get(source) or _INTEGRAL[source])
    with np.errstate(all="ignore"):
        return values.astype({"F64": "<f8", "F32": "<f4", "I64": "<i8"}[target]).tobytes()


class _Listed:
    """Bytes of a list of Python numbers as ``torch.tensor(values, dtype=...)`` makes them."""

    def __init__(self, values: list, target: DType) -> None:
        self.values, self.target, self.count = values, target, len(values)

    def __call__(self) -> bytes:
        import numpy as np

        # Python floats are doubles: float32 is a rounding of the double, as torch's cast does
        array = np.array(
            [float(v) for v in self.values] if self.target.is_floating else self.values,
            dtype="<f8" if self.target.is_floating else "<i8",
        )
        return array.astype({"F64": "<f8", "F32": "<f4", "I64": "<i8"}[self.target.name]).tobytes()


def _list(values: list, *, integers: bool, what: str) -> list:
    for value in values:
        if integers and (type(value) is not int or not _INT64[0] <= value <= _INT64[1]):
            raise InputError(
                f"a quantized tensor's {what} list holds {brief(value)}, not an int64 — torch would "
                "truncate or refuse it; refused"
            )
        # exact in float32 and float64 alike, whatever path torch takes to convert them
        if not integers and not (type(value) is float or (type(value) is int and abs(value) <= 1 << 24)):
            raise InputError(f"a quantized tensor's {what} list holds {brief(value)}, not a float — refused")
    return values


class QuantizedTensor(LayoutTensor):
    """``torch._utils._rebuild_qtensor(storage, offset, size, stride, qparams, requires_grad, hooks)``.

    The first argument is held as the tensor's integer representation (a :class:`TensorRef` over
    the quantized storage), so every walk over tensors (remap, saved devices) sees its storage;
    :meth:`reduce_args` gives the storage back for the pickle.

    Example:
        >>> q = ckptool.load("quantized.pt").state_dict["fc.weight"]    # doctest: +SKIP
        >>> q.qscheme(), q.q_per_channel_axis(), q.int_repr().dtype.torch_name   # doctest: +SKIP
        ('per_channel_affine', 0, 'int8')
    """

    _global = "torch._utils._rebuild_qtensor"

    def __init__(self, *args: Any) -> None:
        self._mode = "reduce"
        if len(args) != 7:
            raise _corrupt(f"record has {len(args)} arguments, not 7")
        storage, offset, size, stride, qparams, requires_grad, _ = args
        kind = _BY_DTYPE.get(id(storage.dtype)) if isinstance(storage, StorageRef) else None
        if kind is None:
            raise _corrupt(f"storage is {brief(storage)}, not a quantized storage (torch.QUInt8Storage...)")
        if requires_grad is not False:
            raise _corrupt(f"requires_grad is {brief(requires_grad)} (a quantized tensor cannot require gradients)")
        shape, strides, offset = _ints(size, "size"), _ints(stride, "stride"), _int(offset, "storage offset")
        if len(shape) != len(strides):
            raise _corrupt(f"size {shape} and stride {strides} differ in length")
        if math.prod(shape) > _INT64[1]:
            raise _corrupt("size holds 2^63 or more elements")
        self._args = (self._int_repr(storage, kind, offset, shape, strides), *args[1:])
        self._check_qparams(qparams, shape)

    @staticmethod
    def _int_repr(
        storage: StorageRef, kind: QuantizedType, offset: int, shape: tuple[int, ...], strides: tuple[int, ...]
    ) -> TensorRef:
        if kind.bits >= 8:
            view = TensorRef(storage=storage, dtype=kind.repr_dtype, shape=shape, stride=strides, offset=offset)
            view.validate(name="quantized")
            return view
        # torch's int_repr of a sub-byte tensor is its packed bytes from the data pointer (strides
        # ignored); its storage check counts elements of bits/8 bytes from the offset counted in bytes
        count = math.prod(shape)
        packed = -(-count * kind.bits // 8)
        if not TensorRef(storage=storage, dtype=kind.repr_dtype, shape=shape, stride=strides).is_contiguous():
            raise InputError(
                f"a {kind.dtype.torch_name} tensor has strides {strides}; torch.save writes packed "
                "sub-byte tensors contiguous only — refused"
            )
        if offset + packed > storage.numel or -(-(offset + count) * kind.bits // 8) > storage.numel:
            raise InputError(
                f"a {kind.dtype.torch_name} tensor's packed bytes end past its storage ({storage.numel} "
                "bytes): torch would read memory outside it — the file is corrupt; refused"
            )
        return TensorRef(storage=storage, dtype=kind.repr_dtype, shape=(packed,), stride=(1,), offset=offset)

    def _check_qparams(self, qparams: Any, shape: tuple[int, ...]) -> None:
        scheme = qparams[0] if isinstance(qparams, tuple | list) and qparams else None
        name = scheme.name if isinstance(scheme, DTypeRef) and scheme.module == "torch" else None
        if name == PER_TENSOR_AFFINE:
            if len(qparams) != 3:
                raise _corrupt(f"per-tensor parameters have {len(qparams)} entries, not 3")
            _, scale, zero_point = qparams
            if type(scale) not in (float, int, bool) or (type(scale) is int and abs(scale) > 1 << 53):
                raise _corrupt(f"scale is {brief(scale)}, not a float")
            _int(zero_point, "zero point", _INT64[0])
            return
        if name not in (PER_CHANNEL_AFFINE, FLOAT_QPARAMS):
            raise _corrupt(
                f"scheme is {brief(scheme)}; torch reads per_tensor_affine, per_channel_affine and "
                "per_channel_affine_float_qparams"
            )
        if len(qparams) != 4:
            raise _corrupt(f"per-channel parameters have {len(qparams)} entries, not 4")
        _, scales, zero_points, axis = qparams
        if type(axis) is not int or not 0 <= axis < len(shape):
            raise _corrupt(f"axis {brief(axis)} is not a dimension of its size {shape}")
        for what, value in (("scales", scales), ("zero points", zero_points)):
            if type(value) is list:
                if type(scales) is not list or type(zero_points) is not list:
                    raise _corrupt("scales and zero points are not both lists or both tensors")
                _list(value, integers=what == "zero points" and name == PER_CHANNEL_AFFINE, what=what)
                count = len(value)
            elif isinstance(value, TensorRef) and value.parameter is None and value.subclass is None:
                known = _FLOATING if what == "scales" else {**_FLOATING, **_INTEGRAL}
                if value.dtype.name not in known:
                    raise InputError(
                        f"a quantized tensor's {what} are {value.dtype.torch_name}; ckptool reads "
                        f"{', '.join(BY_NAME[n].torch_name for n in known)} — refused"
                    )
                if len(value.shape) != 1:
                    raise _corrupt(f"{what} have {len(value.shape)} dimensions, not 1")
                count = value.numel
            else:
                raise _corrupt(f"{what} are {brief(value)}, not a tensor or a list")
            if count != shape[axis]:
                raise _corrupt(f"{count} {what} for size {shape[axis]} of axis {axis}")

    # the pickle -------------------------------------------------------------------------------
    def reduce_args(self) -> tuple:
        """The arguments as torch wrote them: the storage, not its integer view."""
        return (self._args[0].storage, *self._args[1:])

    # what torch builds ------------------------------------------------------------------------
    @property
    def layout(self) -> str:
        return "quantized"

    @property
    def kind(self) -> QuantizedType:
        return _BY_DTYPE[id(self._args[0].storage.dtype)]

    @property
    def dtype(self) -> DType:
        """The quantized element type (``quint8``, ``qint8``, ``qint32``, ``quint4x2``, ``quint2x4``)."""
        return self.kind.dtype

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self._args[2])

    @property
    def offset(self) -> int:
        return self._args[1]

    @property
    def stride(self) -> tuple[int, ...]:
        return tuple(self._args[3])

    def qscheme(self) -> str:
        """torch's ``qscheme()``: per-channel zero points of a floating type make the float-qparams scheme."""
        qparams = self._args[4]
        if qparams[0].name == PER_TENSOR_AFFINE:
            return PER_TENSOR_AFFINE
        zero_points = qparams[2]
        floating = (
            qparams[0].name == FLOAT_QPARAMS if type(zero_points) is list else zero_points.dtype.name in _FLOATING
        )
        return FLOAT_QPARAMS if floating else PER_CHANNEL_AFFINE

    def _per(self, wanted: str, method: str) -> tuple:
        per_tensor = self.qscheme() == PER_TENSOR_AFFINE
        if per_tensor != (wanted == PER_TENSOR_AFFINE):
            raise UsageError(
                f"{method}() of a {self.qscheme()} tensor: torch raises the same — use "
                f"{'q_scale()/q_zero_point()' if per_tensor else 'q_per_channel_scales()/...'}"
            )
        return self._args[4]

    def q_scale(self) -> float:
        """The per-tensor scale, as torch's ``q_scale()`` gives it (a float64)."""
        return float(self._per(PER_TENSOR_AFFINE, "q_scale")[1])

    def q_zero_point(self) -> int:
        return int(self._per(PER_TENSOR_AFFINE, "q_zero_point")[2])

    def q_per_channel_axis(self) -> int:
        return int(self._per(PER_CHANNEL_AFFINE, "q_per_channel_axis")[3])

    def q_per_channel_scales(self) -> TensorRef:
        """float64 scales (float32 for float zero points), as torch's quantizer holds them."""
        self._per(PER_CHANNEL_AFFINE, "q_per_channel_scales")
        return dict(self.components())["scales"]

    def q_per_channel_zero_points(self) -> TensorRef:
        """int64 zero points (float32 when they were saved floating), as torch's quantizer holds them."""
        self._per(PER_CHANNEL_AFFINE, "q_per_channel_zero_points")
        return dict(self.components())["zero_points"]

    def int_repr(self) -> TensorRef:
        """The stored integers: a view in the matching integer type (packed bytes for quint4x2/quint2x4)."""
        return self._args[0]

    def components(self) -> list[tuple[str, TensorRef]]:
        cached = self.__dict__.get("_components")
        if cached is not None and cached[0] is self._args:
            return cached[1]
        qparams, location = self._args[4], self._args[0].location
        parts = [("int_repr", self._args[0])]
        if qparams[0].name == PER_TENSOR_AFFINE:
            parts += [
                ("scale", _scalar("scale", struct.pack("<d", float(qparams[1])), BY_NAME["F64"], location)),
                ("zero_point", _scalar("zero point", struct.pack("<q", qparams[2]), BY_NAME["I64"], location)),
            ]
        else:
            floating = self.qscheme() == FLOAT_QPARAMS
            targets = (BY_NAME["F32"], BY_NAME["F32"]) if floating else (BY_NAME["F64"], BY_NAME["I64"])
            for role, value, target in (("scales", qparams[1], targets[0]), ("zero_points", qparams[2], targets[1])):
                if type(value) is list:
                    parts.append((role, _vector(role, _Listed(value, target), target, location)))
                elif value.dtype == target:
                    parts.append((role, value))  # as torch.save writes them: read as saved
                else:
                    parts.append((role, _converted(role, value, target, location)))
            parts.append(("axis", _scalar("axis", struct.pack("<q", qparams[3]), BY_NAME["I64"], location)))
        self.__dict__["_components"] = (self._args, parts)
        return parts

    def saved_parameters(self) -> list[TensorRef]:
        """The per-channel scale and zero point tensors as the pickle holds them (none for lists)."""
        qparams = self._args[4]
        return (
            [value for value in qparams[1:3] if isinstance(value, TensorRef)]
            if qparams[0].name != PER_TENSOR_AFFINE
            else []
        )

    def label(self) -> str:
        return f"quantized {self.dtype.torch_name}"

    def name_tag(self) -> str:
        return f"{self.dtype.torch_name} {'x'.join(str(d) for d in self.shape)}"

    def describe(self) -> str:
        shape = "[" + ", ".join(str(d) for d in self.shape) + "]"
        qparams = self._args[4]
        if qparams[0].name == PER_TENSOR_AFFINE:
            detail = f"scale {float(qparams[1])!r}, zero point {qparams[2]}"
        else:
            parts = dict(self.components())
            detail = (
                f"axis {qparams[3]}, {parts['scales'].numel} {parts['scales'].dtype.torch_name} scales and "
                f"{parts['zero_points'].dtype.torch_name} zero points"
            )
        return f"quantized {self.dtype.torch_name} {shape} {self.qscheme()} ({detail})"

    def build(self, parts: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """torch's ``_rebuild_qtensor`` on the materialized storage and parameters."""
        import warnings

        import torch

        qdtype = getattr(torch, self.dtype.torch_name)
        storage = parts["int_repr"].untyped_storage()
        qparams = self._args[4]
        # torch warns that quantized creation and TypedStorage are deprecated: its own load warns the same
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                if qparams[0].name == PER_TENSOR_AFFINE:
                    tensor = torch._empty_affine_quantized(
                        self.shape, scale=float(qparams[1]), zero_point=qparams[2], dtype=qdtype
                    )
                else:
                    tensor = torch._empty_per_channel_affine_quantized(
                        self.shape,
                        scales=parts["scales"].contiguous(),
                        zero_points=parts["zero_points"].contiguous(),
                        axis=qparams[3],
                        dtype=qdtype,
                    )
                typed = torch.storage.TypedStorage(wrap_storage=storage, dtype=qdtype, _internal=True)
                tensor.set_(typed, self.offset, self.shape, self.stride)
            except (RuntimeError, ValueError, TypeError) as e:
                raise InputError(
                    f"quantized tensor is inconsistent ({str(e).splitlines()[0][:160]}) — torch.load "
                    "refuses it too; the file is corrupt"
                ) from e
        return tensor


def cast_exempt(state_dict: Mapping[str, Any]) -> set[int]:
    """Ids of the tensors a cast must leave as they are: a quantized tensor's parts and saved parameters
    (its scales are no weights; casting them would change every value torch computes from them)."""
    items = dict.items(state_dict) if isinstance(state_dict, dict) else state_dict.items()
    exempt: set[int] = set()
    for _, value in items:
        if isinstance(value, QuantizedTensor):
            exempt.update(id(part) for _, part in value.components())
            exempt.update(id(part) for part in value.saved_parameters())
    return exempt


class _QuantizedStorageType(StorageTypeRef):
    __slots__ = ()


# torch's weights_only unpickler allows each of these (ckptool.pickles.allowlist builds TORCH_GLOBALS from this table)
GLOBALS: dict[str, Any] = {
    "torch._utils._rebuild_qtensor": QuantizedTensor,
    **{
        f"torch.{q.storage_class}": _QuantizedStorageType("torch", q.storage_class, q.dtype)
        for q in QUANTIZED_TYPES.values()
    },
    **{f"torch.{name}": DTypeRef("torch", name) for name in QUANTIZED_TYPES},  # a dtype is data
    **{
        f"torch.{scheme}": DTypeRef("torch", scheme)  # recorded as the global it is, like a dtype
        for scheme in (
            "per_tensor_affine",
            "per_tensor_symmetric",
            "per_channel_affine",
            "per_channel_symmetric",
            FLOAT_QPARAMS,
        )
    },
}
