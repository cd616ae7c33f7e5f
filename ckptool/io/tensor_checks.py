"""What every tensor of a write must read back as, and what it does: :data:`TensorCheck` (dtype, shape, CRC32 of
its bytes, view) by name, from a source archive's recorded CRCs, the output's re-read sums or the bytes
themselves (:func:`tensor_checks`). :mod:`ckptool.io.write_check` compares the two."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from itertools import repeat
from operator import itemgetter
from pathlib import Path
from typing import Any

from ckptool.files.byteio import RANGE_CRCS
from ckptool.files.copying import pieces_crc
from ckptool.files.crc import crc32
from ckptool.tensors.refs import (
    _CRC32,
    _DTYPE_NAME,
    _OFFSET,
    _PATH,
    _SHAPE,
    ByteRange,
    TensorRef,
    shared_storages,
    whole_plain,
)

# What one tensor must read back as: (dtype name, shape, CRC32 of its C-order bytes, view). For a view that
# expands its storage (stride 0, overlaps) written to a ``.pt`` — where the storage is copied raw, not
# expanded — the CRC is that of the storage bytes it spans, and the view is its (offset, strides), which
# must read back the same; else the view is None. A tuple: 100,000 of them are made and compared in C.
TensorCheck = tuple


@dataclass
class Checks:
    """Every tensor's :data:`TensorCheck`, by name.

    ``recorded``: the names whose CRC is the one the source archive recorded, not one summed from its
    bytes. torch never checks those (a file saved with CRCs off records 0; one written through
    ``skip_data`` or patched later records stale ones), so a mismatch on a recorded CRC is settled by
    summing the source's bytes.
    """

    values: dict[str, TensorCheck]
    recorded: set[str]


def describe(check: TensorCheck) -> str:
    """A check for a message: ``float32 (4, 4) crc32 1a2b3c4d``."""
    dtype, shape, crc, view = check
    return f"{dtype} {tuple(shape)} crc32 {crc:08x}" + (f" view {view}" if view is not None else "")


class StaleSourceCrc(Exception):
    """The source archive recorded CRCs that are not its bytes', and a .pt output copied them."""


def _stored_crc(tensor: TensorRef) -> int | None:
    """The CRC a zip archive recorded for the tensor's bytes, when the tensor is its whole storage
    (or, for a storage lying in pieces — DCP row shards — combined from the pieces' recorded CRCs)."""
    data = tensor.plain_data()
    if data is not None:  # the usual tensor (100,000 of them)
        return _whole_crc(tensor, data)
    if tensor.conj or tensor.neg:
        return None  # the archive's CRC is of the stored bytes, not of the values
    pieces = tensor.whole_pieces()
    if pieces is not None:
        return pieces_crc(pieces)
    storage = tensor.storage
    data = storage.data
    if storage.producer is not None or data is None or data.crc32 is None or not tensor.is_contiguous():
        return None
    if tensor.offset != 0 or tensor.nbytes != data.length:
        return None
    return data.crc32


def _whole_crc(tensor: TensorRef, data: ByteRange) -> int | None:
    """The CRC recorded for ``data``, the usual tensor's storage bytes (:meth:`TensorRef.plain_data`), when the
    tensor is all of them."""
    return data.crc32 if tensor.offset == 0 and tensor.nbytes == data.length else None


def _span_crc(tensor: TensorRef) -> int:
    """CRC32 of the storage bytes an expanding view spans (read once, never expanded)."""
    start = tensor.offset * tensor.dtype.itemsize
    if tensor.storage.producer is not None:  # computed bytes (a quantized tensor's converted parameter)
        return crc32(bytes(tensor.storage.producer())[start : start + tensor.span_bytes()])
    crc = 0
    data = tensor.storage.byte_range()
    for chunk in data.iter_reused(start, tensor.span_bytes()):
        crc = crc32(chunk, crc)
    return crc


class Summed:
    """The CRCs of byte ranges of the output that its re-read already summed (:class:`OutputSums`, by file)."""

    def __init__(self, sums: Iterable[Any]) -> None:  # write_check.OutputSums
        self.by_path = {str(output_sums.path): output_sums for output_sums in sums}

    def __call__(self, path: str, offset: int, length: int) -> int | None:
        """The CRC32 of ``length`` bytes of ``path`` at ``offset``, or None if they were not summed so."""
        output_sums = self.by_path.get(path)
        return output_sums.crc_of(offset, length) if output_sums is not None else None

    def whole(self, datas: list[ByteRange], nbytes: list[int]) -> list[int | None]:
        """``self(str(data.path), data.offset, n)`` for each data and byte count, without a call each where a
        region was summed as it is (the usual tensor, written in one piece)."""
        paths = list(map(_PATH, datas))
        ids = list(map(id, paths))
        files = {key: self.by_path.get(str(path)) for key, path in dict(zip(ids, paths)).items()}
        offsets = list(map(_OFFSET, datas))
        if len(files) == 1:
            (output_sums,) = files.values()
            if output_sums is None:
                return [None] * len(datas)
            regions = list(map(output_sums.sums.get, offsets))
            if None not in regions and list(map(itemgetter(0), regions)) == nbytes:  # each summed as it is
                return list(map(itemgetter(1), regions))
            return [
                region[1] if region is not None and region[0] == length else output_sums.crc_of(offset, length)
                for region, offset, length in zip(regions, offsets, nbytes)
            ]
        return [
            files[key].crc_of(offset, length) if files[key] is not None else None  # type: ignore[union-attr]
            for key, offset, length in zip(ids, offsets, nbytes)
        ]


_UNKNOWN: Any = object()


def recorded_checks(tensors: Mapping[str, TensorRef]) -> Checks | None:
    """:func:`tensor_checks` with ``trust_stored`` when every tensor is all of its storage and its archive
    records that storage's CRC (the usual source: nothing to read); else None."""
    return _whole_checks(list(tensors), list(tensors.values()), _UNKNOWN, trust_stored=True, known=None)


def _whole_checks(
    names: list[str],
    views: list[TensorRef],
    whole: tuple[list[ByteRange], list[int]] | None,
    *,
    trust_stored: bool,
    known: Summed | None,
) -> Checks | None:
    """The usual file's checks: every tensor all of its storage, each CRC known as a whole; else None."""
    if whole is _UNKNOWN:
        whole = whole_plain(views)
    if whole is None:
        return None
    datas, nbytes = whole
    crcs = list(map(_CRC32, datas)) if trust_stored else known.whole(datas, nbytes) if known is not None else None
    if crcs is None or None in crcs:
        return None
    values = dict(zip(names, zip(map(_DTYPE_NAME, views), map(_SHAPE, views), crcs, repeat(None))))
    return Checks(values, set(names) if trust_stored else set())


def tensor_checks(
    tensors: Mapping[str, TensorRef],
    *,
    trust_stored: bool,
    known: Summed | None = None,
    views_raw: bool = False,
    whole: tuple[list[ByteRange], list[int]] | None = _UNKNOWN,
) -> Checks:
    """The content of every tensor.

    ``trust_stored`` takes a source archive's own CRCs where they apply; ``known`` gives CRCs of byte
    ranges already summed (by :class:`OutputSums`). ``views_raw`` (a ``.pt`` output, whose storages
    are copied as they are) checks an expanding view by the bytes it spans and its strides, so a
    stride-0 view is never expanded to be summed. ``whole``: :func:`whole_plain` of the tensors, if the caller has it.
    """
    names = list(tensors)
    views = list(tensors.values())
    usual = _whole_checks(names, views, whole, trust_stored=trust_stored, known=known)
    if usual is not None:
        return usual
    checks: dict[str, TensorCheck] = {}
    recorded_names: set[str] = set()
    by_storage: dict[tuple, int] = {}  # tied tensors are summed once
    shared = shared_storages(views)  # ... and only views of one storage can be tied
    remote_crcs = bool(RANGE_CRCS)
    plain = not shared  # then each tensor is tried first as the usual one (below; it never expands: views_raw alike)
    for name, tensor in tensors.items():
        # the usual tensor: its CRC the one its zip member records (the whole storage), or the one the re-read
        # summed; else the full path below
        data = tensor.plain_data() if plain else None
        if data is not None:
            crc = _whole_crc(tensor, data) if trust_stored else None
            if crc is not None:
                checks[name] = (tensor.dtype.name, tuple(tensor.shape), crc, None)
                recorded_names.add(name)
                continue
            if known is not None:
                crc = known(str(data.path), data.offset + tensor.offset * tensor.dtype.itemsize, tensor.nbytes)
                if crc is not None:
                    checks[name] = (tensor.dtype.name, tuple(tensor.shape), crc, None)
                    continue
        # a conjugate or negative view of a storage holds other values than the plain view
        identity = (
            (id(tensor.storage), tensor.offset, tensor.shape, tensor.stride, tensor.dtype.name, tensor.conj, tensor.neg)
            if id(tensor.storage) in shared
            else None
        )
        if views_raw and tensor.storage.pieces is None and tensor.expands():
            crc = by_storage.get(identity) if identity is not None else None
            if crc is None:
                crc = _span_crc(tensor)
                if identity is not None:
                    by_storage[identity] = crc
            checks[name] = (tensor.dtype.name, tuple(tensor.shape), crc, (tensor.offset, tensor.stride))
            continue
        crc = by_storage.get(identity) if identity is not None else None
        if crc is None:
            crc = _stored_crc(tensor) if trust_stored else None
            if crc is not None:
                recorded_names.add(name)
        if crc is None and known:
            span = tensor.contiguous_byte_range()
            if span is not None:
                crc = known(str(span.path), span.offset, span.length)
        if crc is None and remote_crcs:  # a remote source's bytes, summed as the write streamed them
            span = tensor.contiguous_byte_range()
            if span is not None and not isinstance(span.path, Path):
                crc = RANGE_CRCS.get((span.path, span.offset, span.length))
        if crc is None:
            crc = 0
            for chunk in tensor.iter_reused():
                crc = crc32(chunk, crc)
        if identity is not None:
            by_storage[identity] = crc
        checks[name] = (tensor.dtype.name, tuple(tensor.shape), crc, None)
    return Checks(checks, recorded_names)


def _computed_checks(tensors: Mapping[str, TensorRef]) -> dict[str, TensorCheck]:
    """The checks of computed tensors: the CRC their write summed as it produced them (computed now
    for any the write did not produce in full)."""
    checks = {}
    for name, tensor in tensors.items():
        derived = tensor.whole_derived()
        crc = derived.crc32 if derived is not None else None
        checks[name] = (
            (tensor.dtype.name, tuple(tensor.shape), crc, None)
            if crc is not None
            else tensor_checks({name: tensor}, trust_stored=False).values[name]
        )
    return checks


def _later(work: Callable[[], Any]) -> Callable[[], Any]:
    """``work`` done once, when its result is first asked for (and raised again if it failed)."""
    done: dict[str, Any] = {}

    def join() -> Any:
        if not done:
            try:
                done["value"] = work()
            except BaseException as e:
                done["error"] = e
        if "error" in done:
            raise done["error"]
        return done["value"]

    return join
