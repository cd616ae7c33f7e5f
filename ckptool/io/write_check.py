"""The content check every write passes before it is put in place.

Before the copy starts, a thread works out what every tensor must read back as (:class:`TensorCheck`: name,
dtype, shape, CRC32 of its bytes), taking the CRC a source zip already stores for a storage copied whole
(:class:`Expectations`). While the bytes are copied, :class:`OutputSums` re-reads each region of the output
right behind the writer and starts its writeback (and a URL output's parts go to the store:
:mod:`ckptool.io.streamed`). When the write ends, the output is fsync'd in one thread while the main thread
re-reads its structure through the reader and compares every tensor (:func:`verify_output`). A writer gets all
of it from one context: :func:`checked_output` for a file, :func:`checked_folder` for a folder of shards.
"""

from __future__ import annotations

import contextlib
import functools
import mmap
import os
import queue
import sys
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from itertools import repeat
from operator import add, itemgetter, sub
from pathlib import Path
from typing import Any, BinaryIO, cast

from ckptool.base import progress
from ckptool.base.errors import CkptError, FingerprintMismatchError
from ckptool.base.gcpause import keep
from ckptool.files.atomic import atomic_output, folder_output
from ckptool.files.byteio import RANGE_CRCS, read_into
from ckptool.files.copying import crc32_combine
from ckptool.files.crc import crc32
from ckptool.io.streamed import StreamedFile, feed_for
from ckptool.io.tensor_checks import (
    Checks,
    StaleSourceCrc,
    Summed,
    TensorCheck,
    _computed_checks,
    _later,
    _stored_crc,
    describe,
    recorded_checks,
    tensor_checks,
)
from ckptool.tensors.digest import compute as weights_fingerprint  # silent: the write's own task counts its bytes
from ckptool.tensors.refs import (
    _CRC32,
    _DATA,
    _DERIVED,
    _PATH,
    _STORAGE,
    ByteRange,
    TensorRef,
    whole_plain,
)

__all__ = ["Checks", "StaleSourceCrc", "TensorCheck", "describe", "recorded_checks", "tensor_checks"]

# reads an output back: its tensors as the reader finds them
ReadBack = Callable[[Path], Mapping[str, TensorRef]]


class OutputSums:
    """CRC32s of the output's data regions, summed by a worker thread right behind the writer.

    The writer reports each region once it is in the file; the worker reads it back (from the page
    cache) while the next one is copied, so the re-read costs no extra pass after the copy.
    Writeback starts as the data comes: every ``KICK_EVERY`` bytes are handed to the disk with
    ``sync_file_range(SYNC_FILE_RANGE_WRITE)`` (Linux; it does not wait), so the final fsync has
    little left to wait for — a durable write then costs about the copy, not the copy plus the
    flush. Elsewhere a thread calls ``fdatasync`` every ``FLUSH_EVERY`` bytes instead.

    One read-only descriptor of the output serves the re-read, the writeback and the flushes; it is
    closed by :meth:`finish`. Where it cannot be opened nothing is summed: the check re-reads the
    output itself.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self.sums: dict[int, tuple[int, int]] = {}  # region offset -> (length, CRC32)
        self._queue: queue.SimpleQueue[tuple[int, int] | list[tuple[int, int]] | None] = queue.SimpleQueue()
        self.queued = self.summed = 0  # hand-overs to the worker, and those it has summed (in order)
        self.listener: Callable[[int, int], None] | None = None  # told of each region too (a streamed output)
        self._error: BaseException | None = None
        self._can_map = True
        self._mapped: dict[int, mmap.mmap] = {}  # the mapping behind each piece handed out, by the piece
        try:
            self._fd = os.open(self.path, os.O_RDONLY)
        except OSError as e:
            self._fd, self._error = -1, e
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        self._unflushed = 0
        self._done = False
        self._kick = writeback_starter() if self._fd >= 0 else None
        self._kicked = self._end = 0
        self._flusher: threading.Thread | None = None
        self._flush_wanted = threading.Event()
        if self._kick is None and self._fd >= 0:
            self._flusher = threading.Thread(target=self._flush_loop, daemon=True)
            self._flusher.start()

    def written(self, offset: int, length: int) -> None:
        self._queue.put((offset, length))
        self.queued += 1
        self._landed(offset + length, length)
        if self.listener is not None:
            self.listener(offset, length)

    def written_many(self, regions: list[tuple[int, int]], end: int, length: int) -> None:
        """:meth:`written` for many regions at once (a batch of small tensors): one hand-over to the
        worker, not one per region. ``regions`` is the worker's from now on; ``end`` is where the furthest
        ends and ``length`` their bytes summed (kept by the caller as it reported them)."""
        if not regions:
            return
        listener = self.listener
        told = list(regions) if listener is not None else ()  # the listener's own copy: the worker extends its
        self._queue.put(regions)
        self.queued += 1
        self._landed(end, length)
        if listener is not None:
            for offset, size in told:
                listener(offset, size)

    def _landed(self, end: int, length: int) -> None:
        """``length`` more bytes are in the file, up to ``end`` at most: start their writeback."""
        progress.advance(length)
        if self._kick is not None:
            self._end = max(self._end, end)
            if self._end - self._kicked >= KICK_EVERY:
                self._start_writeback()
            return
        self._unflushed += length
        if self._unflushed >= FLUSH_EVERY:
            self._unflushed = 0
            self._flush_wanted.set()

    def _start_writeback(self) -> None:
        if self._kick is not None and self._end > self._kicked:
            # a failure here only loses the head start: the final fsync reports real errors
            self._kick(self._fd, self._kicked, self._end - self._kicked, _SYNC_FILE_RANGE_WRITE)
            self._kicked = self._end

    def _flush_loop(self) -> None:
        while True:
            self._flush_wanted.wait()
            self._flush_wanted.clear()
            if self._done:
                return
            try:
                os.fdatasync(self._fd)
            except OSError:  # the final fsync reports real errors
                return

    def _run(self) -> None:
        view = memoryview(bytearray(CHUNK)) if self._fd >= 0 else None  # one buffer, reused: no allocation per read
        pending = self._queue
        ended = False
        while not ended and (item := pending.get()) is not None:
            # what else is queued was reported too (it is in the file): summed with it, small regions
            # lying close together (a checkpoint's biases and norms) read back in one read
            batch = item if isinstance(item, list) else [item]
            taken = 1
            while len(batch) < _BATCH:
                try:
                    more = pending.get_nowait()
                except queue.Empty:
                    break
                if more is None:
                    ended = True
                    break
                taken += 1
                if isinstance(more, list):
                    batch.extend(more)
                else:
                    batch.append(more)
            if self._error is None and view is not None:
                try:
                    self._sum(batch, view)
                except (OSError, CkptError) as e:  # re-read errors surface as a missing sum: the check re-reads
                    self._error = e
            self.summed += taken

    def _sum(self, regions: list[tuple[int, int]], view: memoryview) -> None:
        """Sum each region; consecutive ones that fit in one buffer together are read in one read."""
        i, count = 0, len(regions)
        while i < count:
            offset, length = regions[i]
            end, j = offset + length, i + 1
            while j < count and regions[j][0] >= end and regions[j][0] + regions[j][1] - offset <= CHUNK:
                end = regions[j][0] + regions[j][1]
                j += 1
            if j == i + 1:
                crc, done = 0, 0
                while done < length:
                    size = min(CHUNK, length - done)
                    piece = self._bytes_at(offset + done, size, view)
                    try:
                        crc = crc32(piece, crc)
                    finally:
                        self._done_with(piece)
                    done += size
                self.sums[offset] = (length, crc)
            else:  # many small regions of one window: their slices summed in C-speed passes
                window = self._bytes_at(offset, end - offset, view)
                try:
                    starts, sizes = list(map(itemgetter(0), regions[i:j])), list(map(itemgetter(1), regions[i:j]))
                    at = list(map(sub, starts, repeat(offset)))
                    crcs = map(crc32, map(window.__getitem__, map(slice, at, map(add, at, sizes))))
                    self.sums.update(zip(starts, zip(sizes, crcs)))
                finally:
                    self._done_with(window)
            i = j

    def _bytes_at(self, offset: int, length: int, view: memoryview) -> memoryview:
        """``length`` (at most CHUNK) bytes of the output at ``offset``: from a read-only mapping of the
        page cache where it is worth one (summed where they lie, not copied first: a 1 GiB write's
        re-read costs ~0.2 s of CPU less), else read into ``view``. Hand it back to :meth:`_done_with`."""
        if length >= MAP_FROM and self._can_map:
            start = offset - offset % mmap.ALLOCATIONGRANULARITY
            try:
                mapped = mmap.mmap(self._fd, offset + length - start, prot=mmap.PROT_READ, offset=start)
            except (OSError, ValueError, OverflowError):  # a file system that cannot map: read from now on
                self._can_map = False
            else:
                whole = memoryview(mapped)
                piece = whole[offset - start : offset - start + length]
                whole.release()
                self._mapped[id(piece)] = mapped
                return piece
        piece = view[:length]
        read_into(self._fd, piece, offset, self.path)
        return piece

    def _done_with(self, piece: memoryview) -> None:
        mapped = self._mapped.pop(id(piece), None)
        if mapped is not None:
            piece.release()
            mapped.close()

    def crc_of(self, offset: int, length: int) -> int | None:
        """The CRC32 of ``length`` bytes at ``offset``, from the regions summed end to end; None unless
        they cover exactly that span (a large copy is reported in steps: their CRCs are combined)."""
        if length == 0:
            return 0
        crc, position, end = 0, offset, offset + length
        while position < end:
            region = self.sums.get(position)
            if region is None or position + region[0] > end:
                return None
            crc = region[1] if position == offset else crc32_combine(crc, region[1], region[0])
            position += region[0]
        return crc

    def finish(self) -> dict[int, tuple[int, int]]:
        """Wait for every reported region to be summed (idempotent)."""
        self._start_writeback()
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join()
        if self._flusher is not None and self._flusher.is_alive():
            self._done = True
            self._flush_wanted.set()
            self._flusher.join()
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        return self.sums


_SYNC_FILE_RANGE_WRITE = 2


def writeback_starter() -> Callable[[int, int, int, int], int] | None:
    """libc's ``sync_file_range`` where there is one (Linux), else None."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        import ctypes

        function = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    function.argtypes = [ctypes.c_int, ctypes.c_longlong, ctypes.c_longlong, ctypes.c_uint]
    function.restype = ctypes.c_int
    return function


CHUNK = 8 * 1024 * 1024
MAP_FROM = 1 << 20  # regions (or windows of small ones) this large are summed from a mapping, not read
_BATCH = 4096  # reported regions summed in one go at most
FLUSH_EVERY = 128 * 1024 * 1024
KICK_EVERY = 8 * 1024 * 1024


def run_in_thread(fn: Callable[[], Any]) -> Callable[[], Any]:
    result: dict[str, Any] = {}

    def target() -> None:
        try:
            result["value"] = fn()
        except BaseException as e:  # re-raised in the caller's thread
            result["error"] = e

    thread = threading.Thread(target=target, daemon=True)
    thread.start()

    def join() -> Any:
        thread.join()
        if "error" in result:
            raise result["error"]
        return result["value"]

    return join


def verify_output(
    written: Path,
    expect: Expectations,
    read_back: ReadBack,
    sync: Callable[[], None],
    sums: Iterable[OutputSums] = (),
    *,
    views_raw: bool = False,
) -> int:
    """Re-read ``written`` (while ``sync`` runs) and compare every tensor with ``expect``; returns how many.

    The structure (names, dtypes, shapes, where the bytes lie) is re-read through the reader; the
    bytes' CRCs come from ``sums`` where the worker already read that exact region back, else from
    reading it now.

    Raises:
        FingerprintMismatchError: a tensor reads back different, or under a CRC its bytes do not have.
        StaleSourceCrc: what differs is a CRC the source recorded and its bytes do not have.
    """
    recheck = expect.recheck
    sync_join = run_in_thread(sync)
    try:
        summed = Summed(sums)
        for output_sums in summed.by_path.values():
            output_sums.finish()
        written_tensors = read_back(written)
        whole = whole_plain(list(written_tensors.values()))
        actual = tensor_checks(
            written_tensors, trust_stored=False, known=summed, views_raw=views_raw, whole=whole
        ).values
    finally:
        sync_join()
    expected = expect.checks()
    if actual.keys() != expected.values.keys():
        missing = sorted(expected.values.keys() - actual.keys())
        extra = sorted(actual.keys() - expected.values.keys())
        raise FingerprintMismatchError(
            f"the output reads back with other tensor names (missing {missing[:3]}, extra {extra[:3]}) — "
            "it was deleted; nothing changed"
        )
    stale = []
    if actual != expected.values:  # (one comparison in C: the usual write stops here)
        for name, check in expected.values.items():
            if actual[name] != check:
                if name in expected.recorded and recheck is not None and recheck(name) == actual[name]:
                    stale.append(name)  # the source's recorded CRC was stale; its bytes are what was written
                    continue
                raise FingerprintMismatchError(
                    f"tensor {name!r} reads back different from what was written ({describe(actual[name])}, not "
                    f"{describe(check)}) — the output was deleted; check the disk and try again"
                )
    # the CRC the output's zip records for a tensor must be that of its bytes (``actual`` is in the tensors' order)
    recorded = _recorded_crcs(written_tensors, whole)
    crcs = list(map(itemgetter(2), actual.values()))
    if recorded is not None and recorded != crcs:  # (one comparison in C: the usual write stops here)
        for name, crc, crc_summed in zip(written_tensors, recorded, crcs):
            if crc is not None and crc != crc_summed:
                if stale:
                    raise StaleSourceCrc(stale)
                raise FingerprintMismatchError(
                    f"tensor {name!r}: the CRC recorded in the output's zip ({crc:08x}) is not that of the bytes "
                    f"written ({crc_summed:08x}) — the output was deleted; nothing changed"
                )
    keep(written_tensors, actual, expected)  # read back and compared: dropped with the command
    return len(actual)


def _recorded_crcs(
    tensors: Mapping[str, TensorRef], whole: tuple[list[ByteRange], list[int]] | None
) -> list[int | None] | None:
    """The CRC a zip archive records for each tensor that is all of its storage (:func:`_stored_crc`; None for any
    other), in order; None when none records one (a safetensors file). ``whole``: :func:`whole_plain` of them."""
    crcs = list(map(_CRC32, whole[0])) if whole is not None else list(map(_stored_crc, tensors.values()))
    return None if crcs.count(None) == len(crcs) else crcs


@dataclass
class Expectations:
    """Work started before the copy: the content check, and the sha256 fingerprint if asked.

    ``checks`` and ``fingerprint`` wait for their threads and return (or raise) what they computed.
    """

    checks: Callable[[], Checks]
    fingerprint: Callable[[], str | None]
    wants_fingerprint: bool
    recheck: Callable[[str], TensorCheck] | None = None  # a tensor's check summed from the source's bytes
    threads: tuple[Callable[[], Any], ...] = ()  # what settle waits for (default: checks and fingerprint)

    @classmethod
    def start(cls, tensors: Mapping[str, TensorRef], *, fingerprint: bool, views_raw: bool) -> Expectations:
        """Start working out what ``tensors`` must read back as (and their fingerprint, if asked) in threads.

        Computed bytes (a cast) are not computed twice: the write's own pass sums them
        (``Derived.crc32``), and their checks are taken from it once the write is done.
        """
        # computed bytes (a cast) lie in storages with a ``derived``; sources in ByteRanges' paths (tested in C)
        computed = (
            {name: tensor for name, tensor in tensors.items() if tensor.whole_derived() is not None}
            if any(map(_DERIVED, map(_STORAGE, tensors.values())))
            else {}
        )
        stored = {name: tensor for name, tensor in tensors.items() if name not in computed} if computed else tensors
        RANGE_CRCS.clear()
        paths = list(map(_PATH, filter(None, map(_DATA, map(_STORAGE, stored.values())))))
        sources = dict(
            zip(map(id, paths), paths)
        ).values()  # by identity: one Path object read from, not 100,000 hashes
        lazy = not all(map(isinstance, sources, repeat(Path)))
        if lazy:
            # a remote source is summed after the write, from the CRCs its streaming recorded (not
            # downloaded twice); what the write did not stream whole is read then
            join = _later(lambda: tensor_checks(stored, trust_stored=True, views_raw=views_raw))
        else:
            # the usual source's checks are its recorded CRCs, made here at once (a thread would only take turns
            # with this one for the interpreter); the others read bytes, beside the write
            recorded = recorded_checks(stored)
            join = (
                (lambda: recorded)
                if recorded is not None
                else run_in_thread(lambda: tensor_checks(stored, trust_stored=True, views_raw=views_raw))
            )

        def checks() -> Checks:
            result = join()
            if computed:
                result = Checks({**result.values, **_computed_checks(computed)}, result.recorded)
            return result

        digest = run_in_thread(lambda: weights_fingerprint(tensors, allow_expansion=True) if fingerprint else None)
        return cls(
            checks=checks,
            fingerprint=digest,
            wants_fingerprint=fingerprint,
            recheck=lambda name: tensor_checks({name: tensors[name]}, trust_stored=False, views_raw=views_raw).values[
                name
            ],
            # not the computed tensors' checks: after a failed write they would cast again; nor a
            # remote source's, which would download it
            threads=(digest,) if lazy else (join, digest),
        )

    def settle(self) -> None:
        """Wait for the threads, dropping what they raise: the write already failed or succeeded, and
        its own error is the one to report."""
        for join in self.threads or (self.checks, self.fingerprint):
            try:
                join()
            except BaseException:
                pass


@dataclass
class CheckedFile:
    """The file a :func:`checked_output` body writes: tell ``on_data`` of each data region once it is in the file."""

    handle: BinaryIO
    on_data: Callable[[int, int], None]
    checked: int = 0  # tensors compared, once the check has passed


@contextlib.contextmanager
def checked_output(
    out: Path, expect: Expectations, read_back: ReadBack, *, views_raw: bool = False
) -> Iterator[CheckedFile]:
    """An atomic output (:func:`ckptool.files.atomic.atomic_output`) put in place only once its content checks out.

    The body writes through ``handle`` and reports its data regions to ``on_data`` (re-read and summed
    right behind it). When the body ends, the file is fsync'd in one thread while it is read back
    and every tensor compared with ``expect`` (:func:`verify_output`); only then does it replace
    ``out``. A failure of the body or the check deletes it.
    """
    with atomic_output(out) as (handle, tmp):
        sums = OutputSums(tmp)
        feed = feed_for(out.name)
        streamed = StreamedFile(handle, tmp, feed, sums) if feed is not None else None
        output = CheckedFile(cast(BinaryIO, streamed) if streamed is not None else handle, sums.written)
        try:
            try:
                yield output
                handle.flush()
                if streamed is not None:
                    streamed.finish()
            except BaseException:
                sums.finish()
                raise
            output.checked = verify_output(
                tmp, expect, read_back, lambda: os.fsync(handle.fileno()), [sums], views_raw=views_raw
            )
        finally:
            if streamed is not None:
                streamed.close()


class CheckedFolder:
    """The temp folder a :func:`checked_folder` body writes its files into, each summed as it is written
    and fsync'd in the background once it is complete."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.sums: list[OutputSums] = []
        self.checked = 0  # tensors compared, once the check has passed
        self._syncs: list[Callable[[], Any]] = []

    @contextlib.contextmanager
    def file(self, name: str) -> Iterator[tuple[BinaryIO, OutputSums]]:
        """A new file of the folder, and the sums that take its regions (``sums.written``)."""
        # at most two files' re-read threads and buffers at a time, however many files there are: the
        # previous one finishes its last regions while this one is written, instead of holding it up
        if len(self.sums) >= 2:
            self.sums[-2].finish()
        with open(self.directory / name, "w+b") as handle:
            sums = OutputSums(self.directory / name)  # its thread re-reads the file: created first
            self.sums.append(sums)
            feed = feed_for(name)
            streamed = StreamedFile(handle, self.directory / name, feed, sums) if feed is not None else None
            try:
                yield (cast(BinaryIO, streamed) if streamed is not None else handle), sums
                handle.flush()
                if streamed is not None:
                    streamed.finish()
            except BaseException:
                sums.finish()
                raise
            finally:
                if streamed is not None:
                    streamed.close()
            # its writeback started as it was written; waiting for it overlaps the next file's write
            duplicate = os.dup(handle.fileno())  # closed by the thread, after the fsync
            self._syncs.append(run_in_thread(functools.partial(_fsync_close, duplicate)))

    def sync(self) -> None:
        """Wait for every file's fsync (the folder's own is the caller's)."""
        for join in self._syncs:
            join()
        self._syncs.clear()


def _fsync_close(fd: int) -> None:
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def checked_folder(
    out: Path, expect: Expectations, read_back: ReadBack, *, last: str, remove: Iterable[str] = ()
) -> Iterator[CheckedFolder]:
    """A folder output (:func:`ckptool.files.atomic.folder_output`) put in place only once its content checks out.

    The body writes its files with :meth:`CheckedFolder.file`, ``last`` (the index) among them; the
    folder is then read back through ``last`` and every tensor compared with ``expect``
    (``folder_output`` fsyncs the files as it moves them in). ``remove`` names the earlier set's
    files to remove once the new set is in place.
    """
    with folder_output(out, last=last, remove=remove) as tmp_dir:
        folder = CheckedFolder(tmp_dir)
        try:
            yield folder
        except BaseException:
            for sums in folder.sums:
                sums.finish()
            with contextlib.suppress(BaseException):
                folder.sync()
            raise
        folder.checked = verify_output(tmp_dir / last, expect, read_back, folder.sync, folder.sums)
