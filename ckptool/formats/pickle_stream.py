"""Consecutive pickles in a byte stream, split for scan without unpickling anything.

A legacy torch file is five pickles then raw bytes; a pickle may also hide another after its
STOP. Each is cut at its end as the guard finds it (:func:`ckptool.pickles.read_pickle`), or,
for one the guard refuses, from a bounded prefix as its opcodes lie (:func:`ckptool.pickles.frames.pickle_end`).
"""

from __future__ import annotations

from typing import Any

from ckptool import pickles
from ckptool.base.errors import InputError
from ckptool.formats import PICKLE_FIRST_BYTES
from ckptool.pickles.frames import pickle_end

_UNCHECKED_PICKLE_BYTES = 64 << 20  # how much of a pickle the guard refused is still listed statically


def split_pickles(
    stream: Any, label: str, limit: int, cache: pickles.GuardCache | None = None
) -> list[tuple[str, bytes]]:
    """Up to ``limit`` consecutive pickles from ``stream``'s position (a pickle may hide another after STOP)."""
    blobs: list[tuple[str, bytes]] = []
    for index in range(limit):
        start = stream.tell()
        first = stream.read(1)
        if not first or first[0] not in PICKLE_FIRST_BYTES:
            break
        stream.seek(start)
        try:
            data = pickles.read_pickle(stream, cache)
        except InputError:  # refused or malformed: list what its opcodes name anyway, from a bounded prefix
            stream.seek(start)
            data = stream.read(_UNCHECKED_PICKLE_BYTES)
            data = data[: pickle_end(data)]
            stream.seek(start + len(data))
        blobs.append((label if index == 0 else f"{label} (after STOP, pickle {index + 1})", data))
        if not data:
            break
    return blobs
