"""What ``torch.load`` checks of a sparse or nested tensor, checked from its parts with numpy (no torch).

``torch.load`` builds a sparse tensor unchecked, then checks each one it loaded with
``torch._validate_sparse_coo_tensor_args`` / ``_validate_sparse_compressed_tensor_args`` (the sparse
invariants), and builds a nested tensor with ``torch._nested_view_from_buffer``, which computes each
piece's storage size with overflow checks and refuses a piece that ends past the buffer's storage.
The functions here make the same checks from the parts' values (the index tensors are read; the
values of the tensor are not), so every command that reads values — not only the ones that build
the tensor with torch — refuses what torch refuses. Each returns ``None`` when torch accepts the
tensor, else the invariant it breaks (a short phrase for a message).

Where ckptool is stricter than torch it says so: a nested piece must lie inside its buffer (the
bytes the file stores for it, which diff and the fingerprint read), where torch only bounds it by
the buffer's storage, and negative sizes, strides and offsets are refused outright.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ckptool.base.errors import InputError
from ckptool.tensors.refs import TensorRef

if TYPE_CHECKING:
    import numpy as np

INT64_MAX = (1 << 63) - 1
INT32_MAX = (1 << 31) - 1
# index elements handled at a time where a check can go chunk by chunk (8 MiB of int64)
CHUNK = 1 << 20
_INDEX_DTYPES = {"I64": "<i8", "I32": "<i4"}


def read_ints(tensor: TensorRef) -> np.ndarray:
    """The values of an int64 or int32 tensor as an int64 array of its shape: mapped read-only where the
    bytes lie whole in a local file, else read (byte order and negative bits applied as for any tensor)."""
    import numpy as np

    unit = _INDEX_DTYPES[tensor.dtype.name]
    values: np.ndarray
    span = tensor.contiguous_byte_range()
    if span is not None and isinstance(span.path, Path) and span.length:
        if os.path.getsize(span.path) < span.offset + span.length:
            raise InputError.truncated(span.path)
        values = np.memmap(span.path, dtype=unit, mode="r", offset=span.offset, shape=tuple(tensor.shape))
    else:
        values = np.frombuffer(tensor.read_bytes(), dtype=unit).reshape(tensor.shape)
    return values if unit == "<i8" else values.astype(np.int64)


def _numel_overflows(size: tuple[int, ...]) -> bool:
    return math.prod(size) > INT64_MAX


def _chunks(count: int, step: int = CHUNK) -> Iterator[slice]:
    for start in range(0, count, step):
        yield slice(start, min(start + step, count))


# ---------------------------------------------------------------------------------------------- sparse COO


def coo_problem(indices: TensorRef, values: TensorRef, size: tuple[int, ...], coalesced: bool | None) -> str | None:
    """torch's checks of a loaded COO tensor (``sparse_coo_tensor`` unchecked, then
    ``_validate_sparse_coo_tensor_args(indices, values, size, is_coalesced)``)."""
    sparse_dim, nnz = indices.shape
    # torch expands 0-dimensional values to one element
    values_shape = tuple(values.shape) if values.shape else (1,)
    dense_dim = len(values_shape) - 1
    if len(size) != sparse_dim + dense_dim:
        return f"len(size) == sparse_dim + dense_dim is not satisfied ({len(size)} != {sparse_dim} + {dense_dim})"
    if values_shape[0] != nnz:
        return f"indices and values hold {nnz} and {values_shape[0]} entries"
    if values_shape[1:] != tuple(size[sparse_dim:]):
        return f"values have the dense size {list(values_shape[1:])}, the size says {list(size[sparse_dim:])}"
    if _numel_overflows(size):
        return "its size holds 2^63 or more elements (torch: numel overflows)"
    if not sparse_dim or not nnz:
        return None
    import numpy as np

    array = read_ints(indices)
    limits = np.array(size[:sparse_dim], dtype=np.int64)
    for columns in _chunks(nnz):
        block = array[:, columns]
        low, high = block.min(axis=1), block.max(axis=1)
        if (low < 0).any():
            return f"found negative index {int(low.min())}"
        if (high >= limits).any():
            dim = int(np.argmax(high >= limits))
            return f"for dim {dim}, size is {size[dim]} but found index {int(high[dim])}"
    if coalesced and nnz > 1:
        # strictly increasing in row-major order; indices are in bounds and numel fits int64, so no wrap
        strides = np.array([math.prod(size[d + 1 : sparse_dim]) for d in range(sparse_dim)], dtype=np.int64)
        previous = None
        for columns in _chunks(nnz):
            flat = (array[:, columns] * strides[:, None]).sum(axis=0)
            steps = np.diff(flat) if previous is None else np.diff(flat, prepend=previous)
            if (steps <= 0).any():
                return "it is marked coalesced but its indices are not sorted and distinct"
            previous = flat[-1]
    return None


# ---------------------------------------------------------------------------------------------- compressed


def compressed_problem(
    layout: str, compressed: TensorRef, plain: TensorRef, values: TensorRef, size: tuple[int, ...]
) -> str | None:
    """torch's checks of a loaded CSR/CSC/BSR/BSC tensor (``_validate_sparse_compressed_tensor_args``:
    dtypes, dimensions, batch and block sizes, then the compressed index invariants)."""
    row = layout in ("sparse_csr", "sparse_bsr")
    c_name, p_name = ("crow_indices", "col_indices") if row else ("ccol_indices", "row_indices")
    if compressed.dtype.name != plain.dtype.name:
        return f"{c_name} and {p_name} have different dtypes"
    if len(compressed.shape) < 1:
        return f"{c_name} has no dimensions"
    if len(compressed.shape) != len(plain.shape):
        return f"{c_name} and {p_name} have different dimensionalities"
    batch_ndim = len(compressed.shape) - 1
    block_ndim = 2 if layout in ("sparse_bsr", "sparse_bsc") else 0
    dense_ndim = len(values.shape) - batch_ndim - block_ndim - 1
    if dense_ndim < 0:
        return "values have fewer dimensions than its batch and block dimensions need"
    for name, tensor in ((p_name, plain), (c_name, compressed)):
        if tensor.stride[-1] != 1:
            return f"{name} is not contiguous per batch"
    if len(size) != batch_ndim + 2 + dense_ndim:
        return f"its size has {len(size)} dimensions, not {batch_ndim} + 2 + {dense_ndim}"
    blocksize = (max(1, values.shape[batch_ndim + 1]), max(1, values.shape[batch_ndim + 2])) if block_ndim else (1, 1)
    batch = tuple(size[:batch_ndim])
    if (
        not tuple(compressed.shape[:batch_ndim])
        == tuple(plain.shape[:batch_ndim])
        == tuple(values.shape[:batch_ndim])
        == batch
    ):
        return "the batch dimensions of its indices and values differ from its size's"
    for i in range(block_ndim):
        if size[batch_ndim + i] % blocksize[i]:
            return f"size[{batch_ndim + i}] ({size[batch_ndim + i]}) is no multiple of the block size {blocksize[i]}"
    nrows, ncols = size[batch_ndim] // blocksize[0], size[batch_ndim + 1] // blocksize[1]
    compressed_dim, plain_dim = (nrows, ncols) if row else (ncols, nrows)
    nnz = values.shape[batch_ndim]
    if compressed.shape[-1] != compressed_dim + 1:
        return f"{c_name} holds {compressed.shape[-1]} entries per batch, not {compressed_dim + 1}"
    if plain.shape[-1] != nnz:
        return f"{p_name} holds {plain.shape[-1]} entries per batch, not nnz ({nnz})"
    if _numel_overflows(size):
        return "its size holds 2^63 or more elements (torch: numel overflows)"
    if compressed.dtype.name == "I32" and max(plain_dim, compressed_dim, nnz) > INT32_MAX:
        return "a dimension or nnz overflows its int32 indices"
    return _compressed_indices_problem(compressed, plain, plain_dim, nnz, c_name, p_name)


def _compressed_indices_problem(
    compressed: TensorRef, plain: TensorRef, plain_dim: int, nnz: int, c_name: str, p_name: str
) -> str | None:
    import numpy as np

    batches = math.prod(compressed.shape[:-1])
    if not batches:
        return None
    c_all = read_ints(compressed).reshape(batches, compressed.shape[-1])
    p_all = read_ints(plain).reshape(batches, nnz)
    # a few batches at a time (one, if it is big): the temporaries stay near CHUNK elements
    for rows in _chunks(batches, max(1, CHUNK // max(nnz, compressed.shape[-1]))):
        cidx, idx = c_all[rows], p_all[rows]
        for part in _chunks(nnz):
            block = idx[:, part]
            if block.size and (block.min() < 0 or block.max() >= plain_dim):
                return f"0 <= {p_name} < {plain_dim} is not satisfied"
        if (cidx[:, 0] != 0).any():
            return f"{c_name}[..., 0] == 0 is not satisfied"
        if (cidx[:, -1] != nnz).any():
            return f"{c_name}[..., -1] == nnz is not satisfied"
        steps = np.diff(cidx, axis=1)
        if steps.size and (steps.min() < 0 or steps.max() > plain_dim):
            return f"0 <= {c_name}[..., 1:] - {c_name}[..., :-1] <= {plain_dim} is not satisfied"
        if nnz > 1:
            # within each compressed slice the plain indices rise strictly; a slice starts where cidx points
            # (0 <= cidx <= nnz: checked above)
            starts = np.zeros((len(cidx), nnz + 1), dtype=bool)
            np.put_along_axis(starts, cidx, True, axis=1)
            for part in _chunks(nnz - 1):
                following = slice(part.start + 1, part.stop + 1)
                if not ((idx[:, following] > idx[:, part]) | starts[:, following]).all():
                    return f"{p_name} are not sorted and distinct within each slice of {c_name}"
    return None


# ---------------------------------------------------------------------------------------------- nested


def nested_problem(buffer: TensorRef, sizes: TensorRef, strides: TensorRef, offsets: TensorRef) -> str | None:
    """``_nested_view_from_buffer``'s checks: each piece's extent computed without overflow and inside the
    buffer's storage (ckptool: inside the buffer itself, and nothing negative)."""
    for name, tensor in (("sizes", sizes), ("strides", strides), ("offsets", offsets)):
        if tensor.dtype.name != "I64":
            return f"its {name} are {tensor.dtype.torch_name}, not int64"
    count, dims = sizes.shape
    if not count:
        return None
    import numpy as np

    all_sizes, all_strides, all_offsets = read_ints(sizes), read_ints(strides), read_ints(offsets)
    first, end = buffer.offset, buffer.offset + buffer.numel  # the buffer's elements in its storage
    for rows in _chunks(count, max(1, CHUNK // max(dims, 1))):
        size, stride, offset = all_sizes[rows], all_strides[rows], all_offsets[rows]
        if (size < 0).any() or (stride < 0).any() or (offset < 0).any():
            return "a piece has a negative size, stride or offset"
        # torch skips a piece with a size of 0 (it needs no storage)
        live = ~(size == 0).any(axis=1) if dims else np.ones(len(offset), dtype=bool)
        last, overflow = offset.copy(), np.zeros(len(offset), dtype=bool)
        for d in range(dims):
            reach, step = np.where(live, size[:, d] - 1, 0), stride[:, d]
            overflow |= (step > 0) & (reach > INT64_MAX // np.maximum(step, 1))
            term = np.where(overflow, 0, reach * np.where(overflow, 0, step))
            overflow |= term > INT64_MAX - last
            last = np.where(overflow, 0, last + term)
        if (overflow & live).any():
            return "a piece's storage size overflows (torch: storage size calculation overflowed)"
        if (live & ((offset < first) | (last >= end))).any():
            return "a piece reaches past its buffer"
    return None


def refuse(layout: str, problem: str, *, name: str = "", path: Any = None) -> InputError:
    """The one-line refusal of a tensor torch.load refuses."""
    which = f"{layout} tensor {name!r}" if name else f"a {layout} tensor"
    return InputError(
        f"{which} is inconsistent ({problem}) — torch.load refuses it too; the file is corrupt", path=path
    )
