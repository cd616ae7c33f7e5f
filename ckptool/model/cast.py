"""Casting floating weights to another dtype: a byte transform streamed chunk by chunk, in numpy.

A cast among fp64, fp32, fp16 and bf16 never imports torch and never holds a whole tensor: the
cast tensor's storage carries a :class:`CastBytes`, which reads the source tensor in
:data:`CAST_CHUNK` steps, converts each step with a few vectorised numpy operations into reused
buffers, and sums the CRC-32 of what it produced (the writer's content check takes it from there).

Bit for bit what ``tensor.to(dtype)`` gives on CPU: rounding to nearest even, subnormals in and
out, ±0 and ±Inf kept; fp64 to fp16 or bf16 rounds through fp32, as torch does. NaN stays NaN,
with the bits torch's vectorised (AVX2/AVX-512) kernels write — which differ from its scalar
code's, so even torch gives a tensor's last few elements other NaN bits than the rest:

=================  ==========================================================================
fp32/fp64 → bf16   ``0xFFFF``, whatever the sign or payload
fp16 → bf16        ``0x7FC0``
→ fp16             sign, quiet bit and the top 9 payload bits of the fp32 value (``0x7E00`` …)
fp16 → fp32/fp64   sign and payload kept, quiet bit set
bf16 → fp32        the same bits, widened (a signalling NaN stays signalling)
fp32 → fp64, fp64 → fp32, bf16 → fp64   as the CPU converts: quiet bit set, payload kept
=================  ==========================================================================

A cast that turns finite values into Inf is refused (unless allowed) as the bytes are computed —
in the write's single pass; the refusal then scans every cast tensor once more to name them all,
and the write is discarded before anything is put in place. Other floating types (float8) go
through torch, one tensor at a time, as before.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

from ckptool.base.errors import InputError, UsageError
from ckptool.base.suggest import given, option
from ckptool.files.crc import crc32
from ckptool.model.checkpoint import Checkpoint
from ckptool.model.tree import map_tensors
from ckptool.pickles.quantized import cast_exempt
from ckptool.tensors import dtypes
from ckptool.tensors.refs import StorageRef, TensorRef, check_expansion, contiguous_stride

NUMPY_CASTS = ("F64", "F32", "F16", "BF16")  # every pair among these is cast in numpy
CAST_CHUNK = 1 << 18  # elements per step: each step's arrays stay in the CPU's cache

_UNSIGNED = {8: "<u8", 4: "<u4", 2: "<u2"}
# the bits of each type's +Inf; a magnitude's bits above it are NaN
_INF_BITS = {"F64": 0x7FF0000000000000, "F32": 0x7F800000, "F16": 0x7C00, "BF16": 0x7F80}
_SIGN_BITS = {"F64": 1 << 63, "F32": 1 << 31, "F16": 1 << 15, "BF16": 1 << 15}
# the largest magnitude (as the source's bits) that casts to a finite value of the target with no
# check: the target's largest finite value, or the source's own (a wider target). A step whose
# largest magnitude is at most this holds no NaN, Inf or overflow and takes the plain path.
_PLAIN_BELOW = {
    ("F32", "BF16"): 0x7F7F0000,
    ("F32", "F16"): 0x477FE000,
    ("F32", "F64"): 0x7F7FFFFF,
    ("F64", "F32"): 0x47EFFFFFE0000000,
    ("F64", "F16"): 0x40EFFC0000000000,
    ("F64", "BF16"): 0x47EFE00000000000,
    ("F16", "F32"): 0x7BFF,
    ("F16", "F64"): 0x7BFF,
    ("F16", "BF16"): 0x7BFF,
    ("BF16", "F32"): 0x7F7F,
    ("BF16", "F64"): 0x7F7F,
    ("BF16", "F16"): 0x477F,
}


def numpy_cast(source: str, target: str) -> bool:
    """Whether ckptool casts ``source`` to ``target`` (canonical names) in numpy, without torch."""
    return source != target and source in NUMPY_CASTS and target in NUMPY_CASTS


class _Steps:
    """One cast's reused buffers and its per-step conversion (``convert``), for one source/target pair."""

    def __init__(self, source: str, target: str, count: int = CAST_CHUNK) -> None:
        import numpy as np

        self.np = np
        self.source, self.target = source, target
        self.in_item = dtypes.BY_NAME[source].itemsize
        self.out_item = dtypes.BY_NAME[target].itemsize
        self.magnitude = np.empty(count, _UNSIGNED[self.in_item])
        self.wide = np.empty(count, "<u4")  # the fp32 bits every cast goes through (none from fp32 or to/from fp64)
        self.rounding = np.empty(count, "<u4")
        self.out = np.empty(count, _UNSIGNED[self.out_item])

    def convert(self, raw: Any) -> tuple[Any, bool]:
        """Cast one step's source bytes; returns the target's bytes (a view of a reused buffer) and
        whether a finite value became Inf."""
        np = self.np
        source, target = self.source, self.target
        bits = np.frombuffer(raw, _UNSIGNED[self.in_item])
        n = bits.size
        magnitude = np.bitwise_and(bits, _SIGN_BITS[source] - 1, out=self.magnitude[:n])
        plain = not n or int(magnitude.max()) <= _PLAIN_BELOW[(source, target)]
        out = self.out[:n]
        with np.errstate(all="ignore"):
            wide = self._to_f32(bits, n, plain)
            if target == "BF16":
                self._round_bf16(wide, out, n)
            elif target == "F16":
                np.copyto(out.view("<f2"), wide.view("<f4"), casting="same_kind")
            elif target == "F64":  # (to fp32, _to_f32 wrote ``out`` itself)
                np.copyto(out.view("<f8"), wide.view("<f4"))
        if plain:
            return out.data.cast("B"), False
        return out.data.cast("B"), self._specials(bits, magnitude, wide, out)

    def _to_f32(self, bits: Any, n: int, plain: bool) -> Any:
        """The source as fp32 bits (written into the output itself when fp32 is the target)."""
        np, source = self.np, self.source
        if source == "F32":
            return bits
        wide = self.out[:n] if self.target == "F32" else self.wide[:n]
        if source == "BF16":
            return np.left_shift(bits, 16, out=wide, dtype="<u4")
        if source == "F16":
            np.copyto(wide.view("<f4"), bits.view("<f2"))
            if not plain:  # numpy widens a NaN's payload but leaves its quiet bit as it was: the CPU sets it
                wide[(bits & 0x7FFF) > 0x7C00] |= 0x00400000
            return wide
        # fp64: to fp32 first, and from there to a half type (rounding twice, as torch does)
        np.copyto(wide.view("<f4"), bits.view("<f8"), casting="same_kind")
        return wide

    def _round_bf16(self, wide: Any, out: Any, n: int) -> None:
        """fp32 bits to bf16, rounding to nearest even: add 0x7FFF plus the lowest kept bit, keep the top half."""
        np = self.np
        rounding = np.bitwise_and(wide, 0x10000, out=self.rounding[:n])
        rounding >>= 16
        rounding += 0x7FFF
        rounding += wide
        np.right_shift(rounding, 16, out=out, casting="unsafe")  # the top half, stored as uint16

    def _specials(self, bits: Any, magnitude: Any, wide: Any, out: Any) -> bool:
        """Set NaN outputs to torch's bits; whether a finite value became Inf."""
        np, source, target = self.np, self.source, self.target
        finite = magnitude < _INF_BITS[source]
        out_magnitude = out & (_SIGN_BITS[target] - 1)
        overflowed = bool(np.any(finite & (out_magnitude == _INF_BITS[target])))
        nan = magnitude > _INF_BITS[source]
        if np.any(nan):
            if target == "BF16":
                out[nan] = 0x7FC0 if source == "F16" else 0xFFFF
            elif target == "F16":  # F16C's rule: sign, quiet bit, the top payload bits of the fp32 NaN
                w = wide[nan]
                out[nan] = (((w >> 16) & 0x8000) | 0x7E00 | ((w & 0x007FFFFF) >> 13)).astype("<u2")
        return overflowed


class CastBytes:
    """The bytes of ``source`` cast to ``target``, computed chunk by chunk whenever they are read.

    ``crc32`` is the CRC-32 of the bytes, once a pass has produced them all (the write's content
    check takes it from there instead of casting again). A chunk that turns a finite value into
    Inf raises the refusal ``overflow`` builds, unless it is None (overflow allowed).
    """

    def __init__(self, source: TensorRef, target: dtypes.DType, overflow: Any = None) -> None:
        self.source = source
        self.target = target
        self.overflow = overflow
        self.nbytes = source.numel * target.itemsize
        self.crc32: int | None = None if self.nbytes else 0

    def _steps(self) -> Iterator[tuple[memoryview, bool]]:
        """Each step's cast bytes (valid until the next step) and whether a finite value became Inf there."""
        count = min(CAST_CHUNK, max(1, self.source.numel))
        steps = _Steps(self.source.dtype.name, self.target.name, count)  # a small tensor's buffers: its size
        item, step = steps.in_item, count * steps.in_item
        pending = b""
        for chunk in self.source.iter_reused(chunk_size=step):
            data: Any = chunk
            if pending or len(chunk) % item:  # a gathered view may end a chunk inside an element
                joined = pending + bytes(chunk)
                usable = len(joined) - len(joined) % item
                data, pending = memoryview(joined)[:usable], joined[usable:]
            view = memoryview(data)
            for start in range(0, len(view), step):
                yield steps.convert(view[start : start + step])
        if pending:
            raise InputError(f"tensor bytes end inside a {self.source.dtype.torch_name} element — the file is corrupt")

    def chunks(self) -> Iterator[memoryview]:
        """The cast bytes in steps of :data:`CAST_CHUNK` elements; each is valid until the next is asked for."""
        if not self.nbytes:
            return
        crc = 0
        for produced, overflowed in self._steps():
            if overflowed and self.overflow is not None:
                raise self.overflow()
            crc = crc32(produced, crc)
            yield produced
        self.crc32 = crc

    def read(self) -> bytearray:
        """All the cast bytes at once (to build a tensor from them)."""
        data = bytearray()
        for chunk in self.chunks():
            data += chunk
        return data

    def overflows(self) -> bool:
        """Whether the cast turns a finite value into Inf (a pass that only looks)."""
        return bool(self.nbytes) and any(overflowed for _, overflowed in self._steps())


def _cast_bytes(tensor: TensorRef, target: dtypes.DType) -> bytes:
    """A cast numpy has no type for (float8): with torch, the whole tensor at once."""
    import torch

    if tensor.numel == 0:  # nothing to cast (torch.frombuffer refuses an empty buffer)
        return b""
    raw = bytearray(tensor.read_bytes())
    source = torch.frombuffer(raw, dtype=getattr(torch, tensor.dtype.torch_name)).reshape(tensor.shape)
    cast = source.to(getattr(torch, target.torch_name)).contiguous()
    return cast.reshape(-1).view(torch.uint8).numpy().tobytes()


def _largest_finite(tensor: TensorRef) -> float:
    """The largest absolute finite value of a floating tensor (numpy, chunk by chunk; 0 when none)."""
    import numpy as np

    largest = 0.0
    for chunk in tensor.iter_reused():
        if tensor.dtype.name == "BF16":  # no numpy bf16: widen to float32 (bf16 is its top half)
            values = (np.frombuffer(chunk, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)
        else:
            values = np.frombuffer(
                chunk, dtype={"F64": np.float64, "F32": np.float32, "F16": np.float16}[tensor.dtype.name]
            )
        if values.size:
            largest = max(largest, float(np.max(np.abs(values), initial=0, where=np.isfinite(values))))
    return largest


_WIDENING = frozenset(
    {("F16", "F32"), ("F16", "F64"), ("BF16", "F32"), ("BF16", "F64"), ("F32", "F64"), ("F16", "BF16")}
)


def overflowing(tensors: Mapping[str, TensorRef], target: dtypes.DType) -> list[str]:
    """Names of floating tensors holding finite values that ``target`` cannot hold (they would become Inf).

    Among fp64/fp32/fp16/bf16 each tensor is cast in numpy and looked at (no torch). For another
    type, rounding being monotonic, a tensor overflows exactly when its largest finite magnitude
    does: that one value is cast with torch.
    """
    names = []
    done: dict[tuple, bool] = {}
    for name, tensor in tensors.items():
        if tensor.dtype == target or tensor.dtype.name not in NUMPY_CASTS or not tensor.numel:
            continue
        if (tensor.dtype.name, target.name) in _WIDENING:
            continue  # the target holds every finite value of the source
        identity = (id(tensor.storage), tensor.offset, tensor.shape, tensor.stride, tensor.dtype.name)
        if identity not in done:
            if numpy_cast(tensor.dtype.name, target.name):
                done[identity] = CastBytes(tensor, target).overflows()
            else:
                import torch

                largest = _largest_finite(tensor)
                cast = torch.tensor(largest, dtype=torch.float64).to(getattr(torch, target.torch_name))
                done[identity] = not math.isfinite(float(cast.to(torch.float64)))
        if done[identity]:
            names.append(name)
    return names


def _overflow_error(names: list[str], dtype: str, path: Path | None) -> InputError:
    shown = ", ".join(repr(name) for name in names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
    return InputError(
        f"casting to {dtype} would turn finite values into Inf in {len(names)} tensor(s): "
        f"{shown} — choose a wider " + option("dtype", None) + " (bf16 keeps fp32's range), or "
        "pass " + option("allow_overflow") + " to accept it",
        path=path,
    )


def _cast_tensor(
    tensor: TensorRef, target: dtypes.DType, key: str, refusal: Callable[[], InputError] | None
) -> TensorRef:
    """``tensor`` cast to ``target``: a new storage ``key`` whose bytes are computed when read (``refusal``:
    what a finite value turning Inf raises; None: allowed)."""
    if numpy_cast(tensor.dtype.name, target.name):
        derived = CastBytes(tensor, target, refusal)
        producer: Any = derived.read
    else:
        derived, producer = None, (lambda tensor=tensor: _cast_bytes(tensor, target))
    storage = StorageRef(
        key=key,
        dtype=target,
        numel=tensor.numel,
        location=tensor.location,
        type_global=f"torch.{target.storage_class}" if target.storage_class else "torch.storage.UntypedStorage",
        producer=producer,
        derived=derived,
    )
    rebuild = "torch._utils._rebuild_tensor_v2" if target.storage_class else "torch._utils._rebuild_tensor_v3"
    if not target.storage_class:
        storage = replace(storage, dtype=dtypes.BY_NAME["U8"], numel=tensor.numel * target.itemsize)
    # the cast bytes are values (bits applied): the result carries no bits and no metadata
    return replace(
        tensor,
        storage=storage,
        dtype=target,
        stride=contiguous_stride(tensor.shape),
        offset=0,
        rebuild=rebuild,
        extra=(),
        conj=False,
        neg=False,
    )


def cast_weights(
    checkpoint: Checkpoint, dtype: str, *, allow_overflow: bool = False, allow_expansion: bool = False
) -> Checkpoint:
    """Cast floating weights to ``dtype`` (``bf16``, ``fp16`` or ``fp32``); integer buffers stay as they are.

    Tied tensors stay tied. Bytes are computed when read (by the write), chunk by chunk, as
    ``tensor.to(dtype)`` computes them (see the module's notes on NaN). A cast that would turn
    finite values into Inf (1e5 in fp16) is refused, naming the tensors, unless
    ``allow_overflow``: among fp64/fp32/fp16/bf16 when the bytes are computed (a write then
    puts nothing in place), for float8 here. Views that expand their storage (stride 0) need
    ``allow_expansion``.

    Raises:
        UsageError: ``dtype`` is not a floating type ckptool knows.
        InputError: finite values would overflow ``dtype``, or views would expand too far.

    Example:
        >>> ckptool.save(cast_weights(ckptool.load("model.pt"), "bf16"), "model.bf16.safetensors")  # doctest: +SKIP
    """
    try:
        target = dtypes.by_name(dtype)
    except KeyError as e:
        raise UsageError(given("dtype", dtype) + ": choose bf16, fp16 or fp32") from e
    if not target.is_floating:
        raise UsageError(given("dtype", dtype) + " is not a floating type: choose bf16, fp16 or fp32")
    tensors = checkpoint.tensors if checkpoint.has_weights else {}
    check_expansion(tensors, allow=allow_expansion, path=checkpoint.path, doing="cast")
    # a quantized tensor's scales and zero points are no weights: cast, they would change its values
    exempt = cast_exempt(checkpoint.state_dict) if checkpoint.has_weights else set()
    tensors = {name: tensor for name, tensor in tensors.items() if id(tensor) not in exempt}
    if not allow_overflow:
        # float8 and other types torch casts: checked now (their bytes come whole from torch)
        names = overflowing(
            {name: tensor for name, tensor in tensors.items() if not numpy_cast(tensor.dtype.name, target.name)}, target
        )
        if names:
            raise _overflow_error(names, dtype, checkpoint.path)

    found: list[list[str]] = []

    def refusal() -> InputError:
        # the rare path: a second pass over every cast tensor, so that the message names them all
        # (once: a fingerprint's pass over the same bytes refuses them too)
        if not found:
            found.append(overflowing(tensors, target))
        return _overflow_error(found[0], dtype, checkpoint.path)

    memo: dict[tuple, TensorRef] = {}

    def convert(tensor: TensorRef) -> TensorRef:
        if not tensor.dtype.is_floating or tensor.dtype == target or id(tensor) in exempt:
            return tensor
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
        if identity not in memo:
            memo[identity] = _cast_tensor(tensor, target, f"cast:{len(memo)}", None if allow_overflow else refusal)
        return memo[identity]

    return checkpoint.with_state_dict(map_tensors(checkpoint.state_dict, convert))
