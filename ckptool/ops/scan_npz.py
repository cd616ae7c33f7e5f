"""scan of an ``.npz`` archive: its object arrays' pickles, which ``numpy.load`` runs.

``numpy.load`` with ``allow_pickle`` unpickles an object array; an archive of plain arrays holds no
pickle: safe, with nothing pickled."""

from __future__ import annotations

import io
import zipfile
import zlib
from pathlib import Path
from typing import Any

from ckptool import formats
from ckptool.files import inputs
from ckptool.files.byteio import learnt_size
from ckptool.formats import npy, pickle_stream, zipio

MEMBER_LIMIT = 256 << 20  # a compressed member holding a pickle is inflated whole; a larger one is refused
HEAD_STORED = 64 << 10  # a deflated member's first stored bytes, inflated to read its array header


def pickles(path: Path) -> list[formats.PickleBlob]:
    """The archive's object arrays' pickles, for ``scan`` to judge as it judges a checkpoint's.

    Every member is looked at, whatever its name: ``numpy.load(...)[key]`` reads any member that opens
    with the ``.npy`` magic as an array (``arr_0.npy`` is ``"arr_0"``, ``weights.dat`` is
    ``"weights.dat"``), and unpickles it when it is an object array."""
    blobs: list[formats.PickleBlob] = []
    with inputs.open_regular(path, size=learnt_size(path)) as handle:
        members = zipio.read_members(path, handle)
        for name, member in members.items():
            if member.compressed:
                head = _inflated_head(handle, member)
                if head is not None and npy.pickle_offset(head) is None:
                    continue  # a plain array: its header says so, and its data is never inflated
                stream = io.BytesIO(zipio.read_member(path, handle, member, limit=MEMBER_LIMIT))
                start = 0
            else:
                stream, start = handle, zipio.data_offset(handle, member)  # type: ignore[assignment]
            stream.seek(start)
            offset = npy.pickle_offset(stream.read(npy.HEAD_BYTES))
            if offset is None:
                continue
            stream.seek(start + offset)
            label = f"{name}: the array's objects (numpy.load with allow_pickle runs them)"
            blobs += [
                formats.PickleBlob(found, data, read_by_load=False, file=name)
                for found, data in pickle_stream.split_pickles(stream, label, 1)
            ]
    return blobs


def _inflated_head(handle: Any, member: zipio.Member) -> bytes | None:
    """The first :data:`npy.HEAD_BYTES` of a deflated member, inflated from its first stored bytes only;
    None where that cannot tell (another method, a corrupt stream, a header past them): the whole member
    is then read and checked as ever."""
    if member.compression_method != zipfile.ZIP_DEFLATED:
        return None
    handle.seek(zipio.data_offset(handle, member))
    try:
        head = zlib.decompressobj(-15).decompress(handle.read(min(member.stored_size, HEAD_STORED)), npy.HEAD_BYTES)
    except zlib.error:
        return None
    return head if len(head) == min(npy.HEAD_BYTES, member.size) else None
