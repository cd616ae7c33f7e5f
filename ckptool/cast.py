"""Casting floating weights to another dtype, one tensor at a time (the only rewrite that needs torch)."""

from __future__ import annotations

import math
from dataclasses import replace

from . import dtypes
from .checkpoint import Checkpoint
from .errors import InputError, UsageError
from .quantized import cast_exempt
from .refs import StorageRef, TensorRef, check_expansion, contiguous_stride
from .suggest import given, option
from .tree import map_tensors


def _cast_bytes(tensor: TensorRef, target: dtypes.DType) -> bytes:
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
            values = np.frombuffer(chunk, dtype={"F64": np.float64, "F32": np.float32, "F16": np.float16}[
                tensor.dtype.name])
        if values.size:
            largest = max(largest, float(np.max(np.abs(values), initial=0, where=np.isfinite(values))))
    return largest


_WIDENING = frozenset({("F16", "F32"), ("F16", "F64"), ("BF16", "F32"), ("BF16", "F64"), ("F32", "F64"),
                       ("F16", "BF16")})


def overflowing(tensors: dict[str, TensorRef], target: dtypes.DType) -> list[str]:
    """Names of floating tensors holding finite values that ``target`` cannot hold (they would become Inf).

    Rounding is monotonic, so a tensor overflows exactly when its largest finite magnitude does:
    that one value is cast with torch, the tensor itself is only scanned.
    """
    import torch

    names = []
    done: dict[tuple, bool] = {}
    for name, tensor in tensors.items():
        if tensor.dtype == target or tensor.dtype.name not in ("F64", "F32", "F16", "BF16") or not tensor.numel:
            continue
        if (tensor.dtype.name, target.name) in _WIDENING:
            continue  # the target holds every finite value of the source
        identity = (id(tensor.storage), tensor.offset, tensor.shape, tensor.stride, tensor.dtype.name)
        if identity not in done:
            largest = _largest_finite(tensor)
            cast = torch.tensor(largest, dtype=torch.float64).to(getattr(torch, target.torch_name))
            done[identity] = not math.isfinite(float(cast.to(torch.float64)))
        if done[identity]:
            names.append(name)
    return names


def cast_weights(checkpoint: Checkpoint, dtype: str, *, allow_overflow: bool = False,
                 allow_expansion: bool = False) -> Checkpoint:
    """Cast floating weights to ``dtype`` (``bf16``, ``fp16`` or ``fp32``); integer buffers stay as they are.

    Tied tensors stay tied. Bytes are computed when written, tensor by tensor. A cast that would
    turn finite values into Inf (1e5 in fp16) is refused, naming the tensors, unless
    ``allow_overflow``; views that expand their storage (stride 0) need ``allow_expansion``.

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
        names = overflowing(tensors, target)
        if names:
            shown = ", ".join(repr(name) for name in names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3
                                                                   else "")
            raise InputError(f"casting to {dtype} would turn finite values into Inf in {len(names)} tensor(s): "
                             f"{shown} — choose a wider " + option("dtype", None) + " (bf16 keeps fp32's range), or "
                             "pass " + option("allow_overflow") + " to accept it", path=checkpoint.path)
    memo: dict[tuple, TensorRef] = {}

    def convert(tensor: TensorRef) -> TensorRef:
        if not tensor.dtype.is_floating or tensor.dtype == target or id(tensor) in exempt:
            return tensor
        # a conjugate or negative view of a storage holds other values than the plain view
        identity = (id(tensor.storage), tensor.offset, tensor.shape, tensor.stride, tensor.dtype.name,
                    tensor.conj, tensor.neg)
        if identity not in memo:
            storage = StorageRef(
                key=f"cast:{len(memo)}", dtype=target, numel=tensor.numel, location=tensor.location,
                type_global=f"torch.{target.storage_class}" if target.storage_class else "torch.storage.UntypedStorage",
                producer=lambda tensor=tensor: _cast_bytes(tensor, target),
            )
            rebuild = "torch._utils._rebuild_tensor_v2" if target.storage_class else "torch._utils._rebuild_tensor_v3"
            if not target.storage_class:
                storage = replace(storage, dtype=dtypes.BY_NAME["U8"], numel=tensor.numel * target.itemsize)
            # the cast bytes are values (bits applied): the result carries no bits and no metadata
            memo[identity] = replace(tensor, storage=storage, dtype=target, stride=contiguous_stride(tensor.shape),
                                     offset=0, rebuild=rebuild, extra=(), conj=False, neg=False)
        return memo[identity]

    return checkpoint.with_state_dict(map_tensors(checkpoint.state_dict, convert))
