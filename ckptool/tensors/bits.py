"""A tensor's conjugate and negative bits: which dtypes can carry them, and their values from the stored bytes.

torch saves a conjugated (``x.conj()``) or negated (``torch._neg_view``) view as the un-conjugated,
un-negated bytes plus a bit in the tensor's metadata; a reader applies the bits to give the values.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from ckptool.base.errors import InputError
from ckptool.tensors.dtypes import DType


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
