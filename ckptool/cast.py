"""Casting floating weights to another dtype, one tensor at a time (the only rewrite that needs torch)."""

from __future__ import annotations

from dataclasses import replace

from . import dtypes
from .checkpoint import Checkpoint
from .errors import UsageError
from .refs import StorageRef, TensorRef, contiguous_stride
from .tree import map_tensors


def _cast_bytes(tensor: TensorRef, target: dtypes.DType) -> bytes:
    import torch

    raw = bytearray(tensor.read_bytes())
    source = torch.frombuffer(raw, dtype=getattr(torch, tensor.dtype.torch_name)).reshape(tensor.shape)
    cast = source.to(getattr(torch, target.torch_name)).contiguous()
    return cast.reshape(-1).view(torch.uint8).numpy().tobytes()


def cast_weights(checkpoint: Checkpoint, dtype: str) -> Checkpoint:
    """Cast floating weights to ``dtype`` (``bf16``, ``fp16``, ``fp32``...); integer buffers stay as they are.

    Tied tensors stay tied. Bytes are computed when written, tensor by tensor.

    Example:
        >>> ckptool.save(cast_weights(ckptool.load("model.pt"), "bf16"), "model.bf16.safetensors")  # doctest: +SKIP
    """
    try:
        target = dtypes.by_name(dtype)
    except KeyError as e:
        raise UsageError(f"--dtype {dtype!r}: choose bf16, fp16 or fp32") from e
    if not target.is_floating:
        raise UsageError(f"--dtype {dtype!r} is not a floating type: choose bf16, fp16 or fp32")
    memo: dict[tuple, TensorRef] = {}

    def convert(tensor: TensorRef) -> TensorRef:
        if not tensor.dtype.is_floating or tensor.dtype == target or tensor.numel == 0:
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
