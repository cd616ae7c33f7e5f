"""CRC-32 — zip's, the one ``zlib.crc32`` computes — at memory speed where it can be.

Every write is checked by re-reading what it wrote and summing it, and a cast sums what it
produces: a 1 GiB write sums 1-2 GiB. ``zlib.crc32`` does ~2.4 GB/s on this project's reference
machine; ISA-L's (the ``isal`` package: SIMD folding, the same CRC, the GIL released) ~9.8 GB/s.
``isal`` is installed with ckptool where it has wheels; elsewhere (or with
``CKPTOOL_CRC=zlib``) zlib's is used. Both give the same value for the same bytes.
"""

from __future__ import annotations

import os
import zlib
from typing import Any, Protocol


class _Crc32(Protocol):
    """``crc32(data, value=0)``: zlib's signature, which ISA-L's shares."""

    def __call__(self, data: Any, value: int = 0, /) -> int: ...


crc32: _Crc32
IMPLEMENTATION = "zlib"

if os.environ.get("CKPTOOL_CRC", "").lower() != "zlib":
    try:
        from isal.isal_zlib import crc32 as _isal_crc32
    except ImportError:  # no wheel for this platform: zlib's
        pass
    else:
        IMPLEMENTATION = "isal"

if IMPLEMENTATION == "isal":
    crc32 = _isal_crc32
else:
    crc32 = zlib.crc32
