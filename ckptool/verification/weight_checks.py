"""verify's weight checks: NaN/Inf counted, and every weight proven bit-identical on each device.

The CPU row needs no torch: weights on CPU are the file's bytes, streamed chunk by chunk and counted
with numpy (with ``--against``, in the same pass as the diff reads them, so the file is read once).
Another device gets each weight materialized, moved there and back, one tensor at a time.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import TYPE_CHECKING

from ckptool.model.checkpoint import Checkpoint
from ckptool.model.devices import Device
from ckptool.ops.diff import Chunk, ChunkCallback, DiffReport, OpenFiles, diff, tensor_chunks
from ckptool.tensors.refs import TensorRef
from ckptool.verification.report import DeviceResult, error_line

if TYPE_CHECKING:  # pragma: no cover - typing only; torch is imported lazily at run time
    import torch

_FLOAT_DTYPES = ("F64", "F32", "F16", "BF16")
# the exceptions a device raises for a tensor it cannot take (out of memory, unsupported dtype...)
DEVICE_ERRORS = (RuntimeError, TypeError, ValueError, AssertionError)


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape and bytes (NaN payloads and -0.0 included), unlike ``torch.equal``."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.numel() == 0:
        return True
    return bool(
        a.detach()
        .contiguous()
        .reshape(-1)
        .view(_byte_view(a))
        .equal(b.detach().contiguous().reshape(-1).view(_byte_view(b)))
    )


def _byte_view(tensor: torch.Tensor) -> torch.dtype:
    import torch

    return {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}.get(tensor.element_size(), torch.uint8)


def _count_nonfinite(chunk: bytes | bytearray | memoryview, name: str) -> tuple[int, int]:
    """``(nan, inf)`` in a chunk of whole elements of the floating dtype ``name`` (numpy; no torch)."""
    import numpy as np

    if name == "BF16":  # no numpy bf16: an all-ones exponent is NaN (mantissa set) or Inf
        bits = np.frombuffer(chunk, dtype=np.uint16)
        if not bits.size or int((bits & 0x7FFF).max()) < 0x7F80:  # the usual case: one cheap pass
            return 0, 0
        special = (bits & 0x7F80) == 0x7F80
        mantissa = (bits & 0x007F) != 0
        return int(np.count_nonzero(special & mantissa)), int(np.count_nonzero(special & ~mantissa))
    values = np.frombuffer(chunk, dtype={"F64": np.float64, "F32": np.float32, "F16": np.float16}[name])
    if np.isfinite(values).all():  # the usual case: one cheap pass
        return 0, 0
    return int(np.count_nonzero(np.isnan(values))), int(np.count_nonzero(np.isinf(values)))


def _nonfinite_on_cpu(tensor: TensorRef, files: OpenFiles | None = None) -> dict[str, int] | None:
    """NaN/Inf counts of a floating tensor read straight from the file (numpy, chunk by chunk; no torch)."""
    name = tensor.dtype.name
    if name not in _FLOAT_DTYPES:
        return None
    nan = inf = 0
    for chunk in tensor_chunks(tensor, files=files):
        more_nan, more_inf = _count_nonfinite(chunk, name)
        nan, inf = nan + more_nan, inf + more_inf
    return {"nan": nan, "inf": inf} if nan or inf else None


def check_cpu_weights(
    tensors: Mapping[str, TensorRef], counted: Mapping[str, dict[str, int] | None] | None = None
) -> DeviceResult:
    """The CPU row without torch: weights on CPU are the file's bytes, so only NaN/Inf are counted.

    Every byte is read once (a truncated or unreadable file fails here), one chunk at a time.
    ``counted``: NaN/Inf counts (None: none) of tensors already read, by :func:`check_cpu_weights_against`.
    """
    result = DeviceResult(device="cpu", ok=True, weights_identical=True)
    with contextlib.closing(OpenFiles()) as files:
        for name, tensor in tensors.items():
            if counted is not None and name in counted:
                counts = counted[name]
            elif tensor.dtype.name in _FLOAT_DTYPES:
                counts = _nonfinite_on_cpu(tensor, files)
            else:
                counts = None
                for _ in tensor_chunks(tensor, files=files):
                    pass  # other dtypes: still prove the bytes are there
            if counts:
                result.nonfinite[name] = counts
    return result


def check_cpu_weights_against(
    checkpoint: Checkpoint, other: Checkpoint, atol: float | None
) -> tuple[DeviceResult, DiffReport]:
    """The CPU row and the --against weight diff with A read once: every chunk of A the diff reads is
    also counted for NaN/Inf (while it is in cache); only the tensors the diff does not read (keys only
    in A, other shapes) are read afterwards. The same results as :func:`check_cpu_weights`, then ``diff``."""
    tensors = checkpoint.tensors
    tallies: dict[str, list[int] | None] = {}  # A's key -> [nan, inf] (None: not floating), for each tensor read

    def hook(key: str, tensor: TensorRef) -> ChunkCallback | None:
        name = tensor.dtype.name
        if name not in _FLOAT_DTYPES:
            tallies[key] = None
            return None
        tally = tallies[key] = [0, 0]

        def count(chunk: Chunk) -> None:
            nan, inf = _count_nonfinite(chunk, name)
            tally[0] += nan
            tally[1] += inf

        return count

    try:
        weights = diff(checkpoint, other, atol=atol or 0.0, align_prefixes=True, chunk_hook=hook)
    except Exception:
        check_cpu_weights(tensors)  # A's own error first, as when A was read whole before the diff
        raise
    counted = {
        key: {"nan": tally[0], "inf": tally[1]} if tally and (tally[0] or tally[1]) else None
        for key, tally in tallies.items()
    }
    return check_cpu_weights(tensors, counted), weights


def check_device_weights(state_dict: Mapping[str, torch.Tensor], device: Device) -> DeviceResult:
    """Each weight moved to ``device`` (one at a time: device memory stays bounded), counted for NaN/Inf
    there, and compared bit for bit once back on CPU."""
    import torch

    result = DeviceResult(device=device.name, ok=False, weights_identical=False)
    try:
        for name, tensor in state_dict.items():
            moved = device.move(tensor)
            device.synchronize([moved])
            if moved.is_floating_point() or moved.is_complex():
                nan, inf = int(torch.isnan(moved).sum()), int(torch.isinf(moved).sum())
                if nan or inf:
                    result.nonfinite[name] = {"nan": nan, "inf": inf}
            if not bits_equal(moved.cpu(), tensor):
                result.differing_weights.append(name)
            del moved
    except DEVICE_ERRORS as e:
        result.error = error_line(e)
        return result
    result.weights_identical = not result.differing_weights
    result.ok = result.weights_identical
    return result


def nonfinite_in_state(state: Mapping[str, torch.Tensor]) -> dict[str, dict[str, int]]:
    """``{name: {"nan": n, "inf": m}}`` for the tensors of ``state`` holding NaN or Inf."""
    import torch

    found = {}
    for name, tensor in state.items():
        if tensor.is_floating_point() or tensor.is_complex():
            nan, inf = int(torch.isnan(tensor).sum()), int(torch.isinf(tensor).sum())
            if nan or inf:
                found[name] = {"nan": nan, "inf": inf}
    return found
