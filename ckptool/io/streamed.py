"""A URL output whose bytes go to the store while they are written and checked, with no whole-file staging.

The write is the usual checked write into a local file (:func:`ckptool.io.write_check.checked_output`): kernel
copies, the re-read sums behind the writer, the final re-read of its structure. :class:`StreamedFile` stands for
that file's handle and sees every byte land: structure written through ``write`` and data regions as the
writer reports them. Each :data:`PART_SIZE` bytes of the written prefix are read back from the page cache and
handed to the upload (:meth:`Feed.feed`; it blocks while the store is behind, so memory stays a few parts),
and once the re-read has summed them, their data regions are punched out of the local file
(``fallocate(PUNCH_HOLE)``): the file keeps its size and its structure (a safetensors header), and holds on disk
no more than the parts not yet sent. The check then reads the structure from the file and each tensor's CRC
from the sums, as a local write's does; the upload stays open until the check passes and the set completes.

Only bytes that are final are sent: a format whose writer goes back over what it wrote (a zip's CRCs patched
into local headers, a fingerprint patched into a header) is not streamed. Should a write reach bytes already
sent, the write fails and the upload is aborted: nothing is visible.
"""

from __future__ import annotations

import bisect
import contextlib
import contextvars
import ctypes
import ctypes.util
import heapq
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO, Protocol

from ckptool.base.errors import OutputError

PART_SIZE = 8 * 1024 * 1024
_PUNCH_HOLE = 0x02 | 0x01  # FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE


class Feed(Protocol):
    """Where a streamed file's parts go (an upload held open: :class:`ckptool.io.upload.FedUpload`)."""

    part_size: int

    def feed(self, data: bytes) -> None: ...

    def fed(self) -> None: ...


# while a URL output is written: a file's name -> the feed of its parts, or None to stage it whole
STREAMS: contextvars.ContextVar[Callable[[str], Feed | None] | None] = contextvars.ContextVar(
    "ckptool_streams", default=None
)


def feed_for(name: str) -> Feed | None:
    """The feed of the file ``name`` being written, if it is streamed."""
    streams = STREAMS.get()
    return streams(name) if streams is not None else None


def _puncher() -> Callable[[int, int, int, int], int] | None:
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name, use_errno=True)
        function = libc.fallocate
    except (OSError, AttributeError, TypeError):
        return None
    function.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_longlong, ctypes.c_longlong]
    function.restype = ctypes.c_int
    return function


_PUNCH = _puncher()


class StreamedFile:
    """The handle a streamed output is written through (the file's own, watched): see the module."""

    def __init__(self, handle: BinaryIO, path: Path, feed: Feed, sums: Any) -> None:
        self._handle = handle
        self._feed = feed
        self._sums = sums  # write_check.OutputSums: its ``summed`` count says what it has re-read
        self._read_fd = os.open(path, os.O_RDONLY)
        self.part_size = feed.part_size
        self.sent = 0  # bytes [0, sent) are with the store
        self.covered = 0  # bytes [0, covered) are written
        self._segments: list[tuple[int, int]] = []  # written spans beyond ``covered``
        self.data_from: int | None = None  # where the first data region starts: the structure before it stays
        self.reported = 0  # data regions reported (so queued for the re-read) up to here, from ``data_from``
        self._reports: list[tuple[int, int]] = []  # reported spans beyond ``reported``
        self._runs: list[list[int]] = []  # the spans written through ``write`` ([start, end], merged)
        self._punches: list[list[int]] = []  # [start, end, the sums' count to wait for (-1: not reported yet)]
        sums.listener = self._landed

    # -- what the writers call -----------------------------------------------------------------------
    def write(self, data: Any) -> int:
        position = self._handle.tell()
        if position < self.sent:
            self._rewrote(position)
        written = self._handle.write(data)
        end = position + memoryview(data).nbytes
        if self._runs and self._runs[-1][1] == position:
            self._runs[-1][1] = end
        elif end > position:
            self._runs.append([position, end])
        self._add(position, end)
        return written

    def __getattr__(self, name: str) -> Any:  # seek, tell, flush, fileno...: the file's own
        return getattr(self._handle, name)

    def _landed(self, offset: int, length: int) -> None:
        """A data region is in the file (and queued for the re-read)."""
        end = offset + length
        if offset < self.sent and not self._wrote(offset, end):  # bytes sent, then written again
            self._rewrote(offset)
        if self.data_from is None or offset < self.data_from:
            self.data_from = offset
            self.reported = max(self.reported, offset)
        heapq.heappush(self._reports, (offset, end))
        while self._reports and self._reports[0][0] <= self.reported:
            self.reported = max(self.reported, heapq.heappop(self._reports)[1])
        for punch in self._punches:
            if punch[2] < 0 and punch[1] <= self.reported:
                punch[2] = self._sums.queued  # summed once the worker has taken what is queued now
        self._add(offset, end)

    def _wrote(self, start: int, end: int) -> bool:
        """Whether bytes [start, end) were written through :meth:`write` (their report comes after the fact)."""
        at = bisect.bisect_right(self._runs, [start, float("inf")]) - 1
        return at >= 0 and self._runs[at][0] <= start and end <= self._runs[at][1]

    def _rewrote(self, offset: int) -> None:
        raise OutputError(
            f"internal: the write went back to byte {offset}, already sent to the store — the upload was aborted"
        )

    # -- sending -------------------------------------------------------------------------------------
    def _add(self, start: int, end: int) -> None:
        if end <= start:
            return
        heapq.heappush(self._segments, (start, end))
        while self._segments and self._segments[0][0] <= self.covered:
            self.covered = max(self.covered, heapq.heappop(self._segments)[1])
        if self.covered - self.sent >= self.part_size:
            self._send(self.covered - (self.covered - self.sent) % self.part_size)

    def _send(self, upto: int) -> None:
        """Hand the parts of bytes [sent, upto) to the store (the file flushed first: structure is buffered)."""
        self._handle.flush()
        while self.sent < upto:
            size = min(self.part_size, upto - self.sent)
            data = os.pread(self._read_fd, size, self.sent)
            if len(data) != size:
                raise OutputError(f"internal: the output holds {self.sent + len(data)} bytes, not {upto}")
            self._feed.feed(data)
            del data
            end = self.sent + size
            self._punches.append([self.sent, end, self._sums.queued if end <= self.reported else -1])
            self.sent = end
        self._punch()

    def _punch(self) -> None:
        """Free the sent parts' data on disk once the re-read has summed them."""
        while self._punches and 0 <= self._punches[0][2] <= self._sums.summed:
            start, end, _ = self._punches.pop(0)
            start = max(start, self.data_from if self.data_from is not None else end)
            if _PUNCH is not None and end > start:
                _PUNCH(self._handle.fileno(), _PUNCH_HOLE, start, end - start)  # a failure only keeps the bytes

    def finish(self) -> None:
        """The file is complete: send what is left and tell the feed it has every part."""
        self._handle.flush()
        end = os.fstat(self._read_fd).st_size
        if self.covered < end or self._segments:
            raise OutputError(f"internal: bytes {self.covered}-{end} of the output were never written")
        self._send(end)
        self._feed.fed()

    def close(self) -> None:
        """Stop watching; the last parts' data punched once the re-read has summed them (it runs right behind)."""
        self._sums.listener = None
        if self._punches and self._read_fd >= 0:
            deadline = time.monotonic() + 10
            while 0 <= self._sums.summed < self._punches[-1][2] and time.monotonic() < deadline:
                time.sleep(0.002)
            with contextlib.suppress(OSError, ValueError):
                self._punch()
        if self._read_fd >= 0:
            os.close(self._read_fd)
            self._read_fd = -1
