"""The copy engine every writer uses: source bytes into the output, each region reported once it is in the file.

A storage or tensor is copied raw from where it lies: large ones by the kernel
(``copy_file_range``) in :data:`COPY_STEP` steps, small ones (biases, norms: up to
:data:`SMALL_MEMBER`) read once and written through the output's buffer. Each region written is
told to ``on_data(offset, length)`` once it is in the file, so the write check re-reads it right
behind the writer. A member lying in pieces (DCP row shards) is copied piece by piece, under a CRC
combined from the pieces' own (:func:`crc32_combine`) when each piece's is known.
"""

from __future__ import annotations

import os
from bisect import bisect_left
from collections.abc import Callable, Iterable, Sequence
from itertools import accumulate, chain, repeat
from operator import add, is_, sub
from pathlib import Path
from typing import BinaryIO

from ckptool.base.errors import InputError
from ckptool.files.byteio import FileCache, Source, is_remote, iter_range, read_exact, read_into
from ckptool.files.crc import crc32
from ckptool.files.ranges import ByteRange

SMALL_MEMBER = 1 << 20  # copied pieces up to this size are read and written through the buffer
READ_AHEAD = 256 << 10  # small pieces read in order come from windows of this many bytes
READ_GAP = 4096  # ... when each starts at most this far after the last (a zip header and padding apart)
REPORT_EVERY = 8 << 20  # small pieces' regions are reported to ``on_data`` in batches of this many bytes
COPY_STEP = 16 << 20  # large copies are made (and reported) in steps, so the re-read and writeback follow closely
_BUFFER = 8 << 20  # the buffer of a copy the kernel cannot make, and of a copy that sums its bytes

OnData = Callable[[int, int], None]


class DataOut:
    """A writer's output and its ``on_data`` reports; small pieces are read through cached descriptors.

    ``on_data(offset, length)`` is told of each data region once it is in the file (flushed). Regions
    written through the buffer (small pieces, biases and norms) are told in batches of about
    ``REPORT_EVERY`` bytes, and the rest at :meth:`report`; so a thousand small tensors cost neither a
    flush nor an ``open`` each.
    """

    def __init__(self, handle: BinaryIO, on_data: OnData | None) -> None:
        self.handle = handle
        self.on_data = on_data
        # the batch form of ``on_data`` when it is a ``written`` method whose object has one (a write
        # check's OutputSums): 100,000 small tensors are then one hand-over per batch, not one each
        self._report_many: Callable[[list[tuple[int, int]], int, int], None] | None = (
            getattr(getattr(on_data, "__self__", None), "written_many", None)
            if getattr(on_data, "__name__", None) == "written"
            else None
        )
        self._pending: list[tuple[int, int]] = []
        self._pending_bytes = 0
        self._pending_end = 0  # where the furthest pending region ends
        self._sources: FileCache[Source] = FileCache()
        self._window: tuple[Path, int, bytes] | None = None  # (source, offset, bytes) read ahead
        self._last_end: tuple[Path, int] | None = None  # where the last small piece ended

    def written(self, offset: int, length: int) -> None:
        """``length`` bytes at ``offset`` were written through the buffer."""
        if self.on_data is not None:
            self._pending.append((offset, length))
            self._pending_bytes += length
            self._pending_end = max(self._pending_end, offset + length)
            if self._pending_bytes >= REPORT_EVERY:
                self.report()

    def report(self) -> None:
        """Flush and tell ``on_data`` of every region written so far (in one call where ``on_data``
        is a write check's ``written``, whose ``written_many`` takes the whole batch)."""
        if self._pending and self.on_data is not None:
            self.handle.flush()
            if self._report_many is not None:
                self._report_many(self._pending, self._pending_end, self._pending_bytes)
                self._pending = []
            else:
                for offset, length in self._pending:
                    self.on_data(offset, length)
        self._pending.clear()
        self._pending_bytes = self._pending_end = 0

    def read_source(self, source: Path, offset: int, size: int) -> bytes:
        """``size`` bytes of ``source`` at ``offset`` (a small piece: one read).

        Pieces read in the order they lie (a checkpoint's storages, a zip header apart) come from one
        read of :data:`READ_AHEAD` bytes each run of them, not a read each: once a piece starts
        within :data:`READ_GAP` bytes after the last one ended, the next window is read ahead (from a
        local file)."""
        window = self._window
        if window is not None and (window[0] is source or window[0] == source):
            start = offset - window[1]
            if 0 <= start and start + size <= len(window[2]):
                self._last_end = (source, offset + size)
                return window[2][start : start + size]
        last_end = self._last_end
        sequential = (
            last_end is not None
            and (last_end[0] is source or last_end[0] == source)
            and 0 <= offset - last_end[1] <= READ_GAP
        )
        self._last_end = (source, offset + size)
        opened = self._sources.get(source)
        # a local file only: a remote one records the CRC of each range it reads (RANGE_CRCS), piece by piece
        if sequential and size < READ_AHEAD and isinstance(opened, int):
            try:
                data = read_exact(opened, offset, READ_AHEAD, source)
            except InputError:  # the file ends within the window: the piece alone
                pass
            else:
                self._window = (source, offset, data)
                return data[:size]
        return read_exact(opened, offset, size, source)

    def copy(self, source: Path, offset: int, size: int, out_offset: int) -> None:
        """Copy ``size`` bytes of ``source`` at ``offset`` to the output at ``out_offset``, where it stands.

        Up to :data:`SMALL_MEMBER` bytes are read once and written through the buffer (no flush, no
        syscall storm for a thousand biases); more are copied by the kernel, in reported steps.
        The output stands after the bytes copied.
        """
        if size <= SMALL_MEMBER:
            self.handle.write(self.read_source(source, offset, size))
            self.written(out_offset, size)
            return
        self.report()
        copy_reporting(source, offset, size, self.handle, out_offset, self.on_data)
        self.handle.seek(out_offset + size)

    def copy_all(
        self,
        paths: list[Path],
        offsets: list[int],
        sizes: list[int],
        out_offset: int,
        headers: list[bytes] | None = None,
    ) -> int:
        """:meth:`copy` of ``sizes[i]`` bytes of ``paths[i]`` at ``offsets[i]`` for each i, end to end from
        ``out_offset`` where the output stands, each after ``headers[i]`` if given; returns where they end.

        Runs of small pieces from one local file (a checkpoint's 100,000 biases and norms) are copied
        together: read in windows taken in the order they lie in the file, each window once, and written
        in one write per :data:`REPORT_EVERY` bytes — no call, read or write per piece.
        """
        position, i, count = out_offset, 0, len(paths)
        # the usual copy: small pieces of one local file, cut into runs by their running total (no scan per piece)
        ends = (
            list(accumulate(sizes))
            if count
            and max(sizes) <= SMALL_MEMBER
            and all(map(is_, paths, repeat(paths[0])))
            and not is_remote(paths[0])
            else None
        )
        while i < count:
            path, j, run_bytes = paths[i], i, 0
            if ends is not None:  # up to the piece that brings the run to REPORT_EVERY bytes, as the scan below
                j = min(bisect_left(ends, (ends[i - 1] if i else 0) + REPORT_EVERY, i) + 1, count)
            else:
                while j < count and paths[j] is path and sizes[j] <= SMALL_MEMBER and run_bytes < REPORT_EVERY:
                    run_bytes += sizes[j]
                    j += 1
            if j - i < 2 or is_remote(path):  # a large piece, a lone one, or a remote file's (each range summed)
                j = i + 1
                if headers is not None:
                    self.handle.write(headers[i])
                    position += len(headers[i])
                if sizes[i]:  # an empty piece is no region
                    self.copy(path, offsets[i], sizes[i], position)
                position += sizes[i]
            else:
                position = self._copy_run(
                    path, offsets[i:j], sizes[i:j], position, headers[i:j] if headers is not None else None
                )
            i = j
        return position

    def _copy_run(
        self, path: Path, offsets: list[int], sizes: list[int], out_offset: int, headers: list[bytes] | None
    ) -> int:
        fd = self._sources.get(path)
        count = len(offsets)
        low, high = min(offsets), max(map(add, offsets, sizes))
        if high - low <= 2 * sum(sizes) + READ_AHEAD:  # they lie close together (a storage after each other): one
            window = memoryview(read_exact(fd, low, high - low, path))  # read, sliced in C-speed passes
            starts = list(map(sub, offsets, repeat(low)))
            slices = list(map(window.__getitem__, map(slice, starts, map(add, starts, sizes))))
            return self._write_run(slices, sizes, out_offset, headers)
        parts: list[bytes | memoryview] = [b""] * count
        order = sorted(range(count), key=offsets.__getitem__)
        k = 0
        while k < count:  # a window: pieces in file order, each within READ_GAP of the last, READ_AHEAD at most
            start = offsets[order[k]]
            end, m = start + sizes[order[k]], k + 1
            while m < count:
                at = offsets[order[m]]
                if at - end > READ_GAP or at + sizes[order[m]] - start > READ_AHEAD:
                    break
                end = max(end, at + sizes[order[m]])
                m += 1
            window = memoryview(read_exact(fd, start, end - start, path))
            for index in order[k:m]:
                at = offsets[index] - start
                parts[index] = window[at : at + sizes[index]]
            k = m
        return self._write_run(parts, sizes, out_offset, headers)

    def _write_run(
        self, parts: Sequence[bytes | memoryview], sizes: list[int], out_offset: int, headers: list[bytes] | None
    ) -> int:
        """Write a run's pieces (each after its header, if given) in one write, their regions reported in a batch."""
        if headers is None:
            self.handle.write(b"".join(parts))
        else:
            self.handle.write(b"".join(chain.from_iterable(zip(headers, parts))))
        return self._report_run(sizes, out_offset, headers)

    def _report_run(self, sizes: list[int], out_offset: int, headers: list[bytes] | None) -> int:
        """A run just written at ``out_offset`` (each piece after its header, if given): its regions reported in a
        batch; returns where it ends."""
        count = len(sizes)
        if headers is None:
            starts = list(accumulate(sizes, initial=out_offset))
        else:
            lengths = list(map(add, map(len, headers), sizes))
            starts = list(map(add, accumulate(lengths, initial=out_offset), map(len, headers)))
        self._last_end = None
        if self.on_data is not None:
            regions = [region for region in zip(starts, sizes) if region[1]]  # an empty piece is no region
            self._pending.extend(regions)
            self._pending_bytes += sum(sizes)
            if regions:  # (in order: the last one ends furthest)
                self._pending_end = max(self._pending_end, regions[-1][0] + regions[-1][1])
            if self._pending_bytes >= REPORT_EVERY:
                self.report()
        return (starts[count - 1] + sizes[count - 1]) if count else out_offset

    def copy_pieces(self, pieces: Iterable[ByteRange], out_offset: int) -> int:
        """Copy the pieces end to end to ``out_offset`` by the kernel; returns where they end (the output stands
        there)."""
        self.report()
        position = out_offset
        for piece in pieces:
            copy_reporting(piece.path, piece.offset, piece.length, self.handle, position, self.on_data)
            position += piece.length
        self.handle.seek(position)
        return position

    def stream_pieces(self, pieces: Iterable[ByteRange]) -> int:
        """Write the pieces end to end where the output stands, summing them: their CRC-32.

        Nothing is reported: the caller reports the whole region (:meth:`written`) once it is complete.
        """
        crc = 0
        for piece in pieces:
            if piece.length:
                crc = stream_with_crc(piece.path, piece.offset, piece.length, self.handle, crc)
        return crc

    def stream(self, chunks: Iterable[bytes | bytearray | memoryview], out_offset: int, size: int | None = None) -> int:
        """Write computed bytes (a cast) where the output stands, reporting them in :data:`COPY_STEP`
        steps as they land; returns where they end. A chunk may be a reused buffer: it is written at once.
        Bytes known (``size``) to be at most :data:`SMALL_MEMBER` go through the buffer and are reported
        in a batch, as a small copied piece is (no flush each)."""
        if size is not None and size <= SMALL_MEMBER:
            position = out_offset
            for chunk in chunks:
                self.handle.write(chunk)
                position += len(chunk)
            self.written(out_offset, position - out_offset)
            return position
        self.report()
        position = reported = out_offset
        for chunk in chunks:
            self.handle.write(chunk)
            position += len(chunk)
            if position - reported >= COPY_STEP:
                self.handle.flush()
                if self.on_data is not None:
                    self.on_data(reported, position - reported)
                reported = position
        if position > reported:
            self.handle.flush()
            if self.on_data is not None:
                self.on_data(reported, position - reported)
        return position

    def release(self) -> None:
        """Close the source descriptors (also after a failed write)."""
        self._sources.close()


def copy_reporting(
    source: Path, offset: int, size: int, out: BinaryIO, out_offset: int, on_data: OnData | None
) -> None:
    """Copy ``size`` bytes of ``source`` at ``offset`` to ``out`` at ``out_offset`` (the kernel copies),
    telling ``on_data`` of each step once it is in the file."""
    if is_remote(source):  # one stream of ranges fetched ahead, reported as it lands
        out.seek(out_offset)
        done = 0
        for chunk in iter_range(source, offset, size, COPY_STEP):
            out.write(chunk)
            out.flush()
            if on_data is not None:
                on_data(out_offset + done, len(chunk))
            done += len(chunk)
        return
    done = 0
    while done < size:
        step = min(COPY_STEP, size - done)
        copy_range(source, offset + done, step, out, out_offset + done)
        if on_data is not None:
            on_data(out_offset + done, step)
        done += step


# errors with which copy_file_range says it cannot copy between these files (the bytes are then
# read and written): EXDEV, ENOSYS, EOPNOTSUPP, EINVAL, EPERM
_NO_KERNEL_COPY = (18, 38, 95, 22, 1)


def copy_range(source: Path, offset: int, size: int, out: BinaryIO, out_offset: int) -> None:
    """Copy ``size`` bytes of ``source`` at ``offset`` to ``out`` at ``out_offset``: the one place bytes
    are copied by the kernel (``copy_file_range``), read and written where it cannot.

    Raises:
        InputError: ``source`` ends first.
    """
    if is_remote(source):  # a URL: fetched by ranges, a chunk ahead, and written
        out.seek(out_offset)
        for chunk in iter_range(source, offset, size, _BUFFER):
            out.write(chunk)
        return
    out.flush()
    with open(source, "rb") as src:
        in_fd, out_fd = src.fileno(), out.fileno()
        copied = 0
        try:
            while copied < size:
                n = os.copy_file_range(in_fd, out_fd, min(size - copied, 1 << 30), offset + copied, out_offset + copied)
                if n == 0:
                    raise InputError.truncated(source)
                copied += n
            return
        except (AttributeError, OSError) as e:
            if copied or (isinstance(e, OSError) and e.errno not in _NO_KERNEL_COPY):
                raise
        out.seek(out_offset)
        buffer = memoryview(bytearray(min(size, _BUFFER)))
        done = 0
        while done < size:
            piece = buffer[: min(len(buffer), size - done)]
            read_into(in_fd, piece, offset + done, source)
            out.write(piece)
            done += len(piece)


def stream_with_crc(source: Path, offset: int, size: int, out: BinaryIO, crc: int = 0) -> int:
    """Write ``size`` bytes of ``source`` at ``offset`` where ``out`` stands, continuing ``crc`` over them."""
    if is_remote(source):  # a URL: fetched by ranges, a chunk ahead
        for chunk in iter_range(source, offset, size, _BUFFER):
            crc = crc32(chunk, crc)
            out.write(chunk)
        return crc
    buffer = memoryview(bytearray(min(size, _BUFFER) or 1))
    with open(source, "rb", buffering=0) as src:
        fd = src.fileno()
        done = 0
        while done < size:
            piece = buffer[: min(len(buffer), size - done)]
            read_into(fd, piece, offset + done, source)
            crc = crc32(piece, crc)
            out.write(piece)
            done += len(piece)
    return crc


# ---------------------------------------------------------------------------------------------
# CRC-32 of a concatenation from the parts' CRCs (zlib's crc32_combine, which Python's zlib lacks)

_CRC_POLY = 0xEDB88320  # CRC-32 (zip, zlib), bit-reflected: bit 31 is the coefficient of x^0


def _multmodp(a: int, b: int) -> int:
    """a * b modulo the CRC polynomial (reflected representation)."""
    m, p = 1 << 31, 0
    while m:
        if a & m:
            p ^= b
            if not a & (m - 1):  # no lower powers left
                break
        m >>= 1
        b = (b >> 1) ^ _CRC_POLY if b & 1 else b >> 1  # b * x
    return p


def _x2n_table() -> tuple[int, ...]:
    table, p = [], 1 << 30  # x^1
    for _ in range(32):
        table.append(p)
        p = _multmodp(p, p)
    return tuple(table)


_X2N = _x2n_table()  # x^(2^k) mod P; x^(2^32) == x (the order of x divides 2^32 - 1), so k wraps at 32


def _x8nmodp(length: int) -> int:
    """x^(8 * length) modulo the CRC polynomial."""
    p, k = 1 << 31, 3  # x^0; 8 * length = length * 2^3
    while length:
        if length & 1:
            p = _multmodp(_X2N[k & 31], p)
        length >>= 1
        k += 1
    return p


def crc32_combine(crc1: int, crc2: int, length2: int) -> int:
    """``zlib.crc32(a + b)`` from ``crc1 = zlib.crc32(a)``, ``crc2 = zlib.crc32(b)`` and ``length2 = len(b)``."""
    if length2 < 0:
        raise ValueError("length2 must be non-negative")
    return _multmodp(_x8nmodp(length2), crc1 & 0xFFFFFFFF) ^ (crc2 & 0xFFFFFFFF)


def pieces_crc(pieces: tuple[ByteRange, ...] | list[ByteRange]) -> int | None:
    """The CRC-32 of the pieces' bytes end to end, from their stored CRCs; None if one is unknown."""
    crc = 0
    for piece in pieces:
        if not piece.length:
            continue  # the CRC of nothing is 0, whatever was recorded
        if piece.crc32 is None:
            return None
        crc = crc32_combine(crc, piece.crc32, piece.length)
    return crc
