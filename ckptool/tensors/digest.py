"""The content fingerprint: one hash for the same weights in any format.

sha256 over the weights sorted by key; for each: a length-prefixed JSON header
``[key, dtype, shape]`` then the length-prefixed C-order bytes. Tied tensors count under each key.
The .pt, safetensors and sharded copies of the same weights hash alike; any changed byte,
key, dtype or shape changes it.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping

from ckptool.base import progress
from ckptool.tensors.refs import TensorRef, check_expansion

PREFIX = "sha256:"


def header_bytes(key: str, tensor: TensorRef) -> bytes:
    return json.dumps([key, tensor.dtype.name, list(tensor.shape)], separators=(",", ":")).encode("utf-8")


def fingerprint(tensors: Mapping[str, TensorRef], *, allow_expansion: bool = False) -> str:
    """The fingerprint of a weights mapping (non-tensor values are skipped).

    Views that expand their storage (stride 0, overlaps) past :data:`ckptool.tensors.refs.EXPANSION_FACTOR`
    are hashed in full only with ``allow_expansion``; otherwise :class:`~ckptool.base.errors.InputError`.
    """
    check_expansion(tensors, allow=allow_expansion, doing="hash")
    total = sum(value.nbytes for value in tensors.values() if isinstance(value, TensorRef))
    with progress.task(total, "fingerprint") as job:
        return compute(tensors, allow_expansion=True, job=job)


def compute(
    tensors: Mapping[str, TensorRef], *, allow_expansion: bool = False, job: progress.Task = progress.SILENT
) -> str:
    """:func:`fingerprint`, each chunk hashed counted on ``job`` (none: silent, as beside a write's copy)."""
    if not allow_expansion:
        check_expansion(tensors, allow=False, doing="hash")
    digest = hashlib.sha256()
    for key in sorted(k for k, v in tensors.items() if isinstance(v, TensorRef)):
        tensor = tensors[key]
        header = header_bytes(key, tensor)
        digest.update(len(header).to_bytes(8, "little"))
        digest.update(header)
        digest.update(tensor.nbytes.to_bytes(8, "little"))
        for chunk in tensor.iter_reused():
            digest.update(chunk)
            job.advance(len(chunk))
    return PREFIX + digest.hexdigest()
