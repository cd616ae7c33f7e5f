"""Outputs at URLs: written and checked locally, then uploaded so that the object appears only complete.

A remote output is written as a local one is — by the same checked write (every tensor re-read and
compared) — into a private staging folder (``tempfile.mkdtemp`` under ``$CKPTOOL_STAGING_DIR``, or
the system's temp folder), always removed afterwards. Only a staged output that passed its check is
uploaded:

- ``s3://``: a multipart upload. Parts of :data:`PART_SIZE` are read from the staged file one at a
  time (at most :data:`PARTS_IN_FLIGHT` sent at once, so memory stays a few parts however big the
  output), each sent with its ``Content-MD5`` (the store refuses a part whose bytes differ) and its
  returned ETag compared with the part's MD5. Once every part is in, the upload is completed, and
  the object's size (and its composite ETag, where the store gives one) is compared with the staged
  file's. Before completion nothing is visible; any failure, or Ctrl-C, aborts the upload, which
  leaves neither object nor parts. A part is retried with backoff by the client (botocore's
  standard retries; s3fs retries SlowDown too). Where an abort cannot reach the store (it died),
  the next write to the same URL aborts the incomplete uploads of that key before it begins.
- ``gs://`` (and fsspec's in-process ``memory://``): the protocol's own file, opened without
  autocommit where the protocol holds the commit back (gcsfs) and committed at the end, elsewhere
  written to a temporary object beside the output and moved onto its name; the atomicity is the
  protocol's.

A folder of shards is uploaded as a set: every file's parts first, then each upload completed, the
index last, then the earlier set's shards the new index no longer names are removed. A remote store
has no rename, so the set is not replaced in one step as a local folder is: the completions are a few
short requests, run with Ctrl-C held (:func:`ckptool.files.atomic.signals_deferred`), and an earlier index
is removed before the first of them, so a reader never finds the old index beside new shards.
"""

from __future__ import annotations

import contextlib
import hashlib
import queue
import re
import threading
import uuid
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from ckptool.base import progress
from ckptool.base.errors import CkptError, OutputError
from ckptool.files import bounded
from ckptool.files.atomic import TEMP_PREFIX, signals_deferred
from ckptool.files.remote import STATS, RemotePath, remote_error
from ckptool.io.upload_checks import (
    S3_PROTOCOLS,
    STAGING_PREFIX,
    check_output,
    earlier_shards,
    named_for_user,
    refuse_input,
    staged,
    staging_root,
)

__all__ = [
    "S3_PROTOCOLS",
    "STAGING_PREFIX",
    "FedUpload",
    "check_output",
    "earlier_shards",
    "named_for_user",
    "publish",
    "refuse_input",
    "staged",
    "staging_root",
]

PART_SIZE = 8 * 1024 * 1024  # bytes per part (S3: at least 5 MiB but the last; at most 10,000 parts)
MAX_PARTS = 10_000
PARTS_IN_FLIGHT = 2  # parts being sent at once (each one is in memory until sent)
_COMPOSITE = re.compile(r"^([0-9a-f]{32})-(\d+)$")


def _md5(data: bytes) -> Any:
    return hashlib.md5(data, usedforsecurity=False)


# -- staging ------------------------------------------------------------------------------------------------


# -- refusals before anything is written ---------------------------------------------------------------------


# -- uploading ------------------------------------------------------------------------------------------------


class _Upload:
    """One file on its way to one object: ``send`` puts its bytes with the store (nothing visible yet),
    ``complete`` makes the object appear, ``abort`` drops what was sent (None, or why it could not)."""

    completed = False

    def send(self) -> None:
        raise NotImplementedError

    def complete(self) -> None:
        raise NotImplementedError

    def abort(self) -> str | None:
        raise NotImplementedError


class _StoreUpload(_Upload):
    """s3:// and gs://: one multipart upload through obstore (:meth:`ckptool.files.stores.Reader.put`), fed the
    staged file's parts on a thread of its own. ``send`` returns once every part is handed over (the upload
    held open: nothing visible); ``complete`` lets the parts end, which completes the upload, then compares
    the object's size (and S3's composite ETag) with the bytes sent; ``abort`` makes the parts raise, on
    which obstore aborts the upload (no object, no parts)."""

    def __init__(self, local: Path | None, remote: RemotePath) -> None:
        self.local = local
        self.remote = remote
        self.reader, self.path = remote.filesystem()
        self.size = local.stat().st_size if local is not None else 0
        self.part_size = max(PART_SIZE, -(-self.size // MAX_PARTS))
        self.digests: list[bytes] = []
        self.result: dict[str, Any] = {}
        self._sent = threading.Event()
        self._go = threading.Event()
        self._stop = threading.Event()
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None

    def _parts(self) -> Iterator[bytes]:
        assert self.local is not None
        with open(self.local, "rb") as handle:
            while True:
                if self._stop.is_set():
                    raise _Aborted()
                data = handle.read(self.part_size)
                if not data:
                    break
                yield self.part(len(self.digests) + 1, data)
                del data
        self._held_open()

    def _held_open(self) -> None:
        """Every part is handed over: the upload stays open (nothing visible) until the set completes."""
        self._sent.set()
        while not self._go.wait(0.05):
            if self._stop.is_set():
                raise _Aborted()

    def part(self, number: int, data: bytes) -> bytes:
        """Part ``number`` on its way: its MD5 kept (for the object's check at completion), counted; the
        bytes to send."""
        self.digests.append(_md5(data).digest())
        STATS.add(requests=1, written=len(data))
        if self.local is not None:  # a fed upload's bytes are counted by the write's own progress
            progress.advance(len(data))
        return data

    def _run(self) -> None:
        try:
            self.result = self.reader.put(self.path, self._parts(), part_size=self.part_size, in_flight=PARTS_IN_FLIGHT)
        except BaseException as e:  # noqa: BLE001 (handed to the thread that waits)
            self._error = e
        finally:
            self._sent.set()

    def send(self) -> None:
        self._thread = threading.Thread(target=self._run, name="ckptool-upload", daemon=True)
        self._thread.start()
        while not self._sent.wait(0.1):
            pass
        if self._error is not None:
            raise self._error

    def complete(self) -> None:
        assert self._thread is not None
        self._go.set()
        self._thread.join()
        if self._error is not None:
            raise self._error
        self.completed = True
        STATS.add(requests=1)
        head = self.reader.head(self.path)
        stored = int(head.get("size", -1))
        etag = str(self.result.get("e_tag") or head.get("ETag") or "").strip('"')
        composite = _COMPOSITE.match(etag)
        expected = _md5(b"".join(self.digests)).hexdigest()
        problem = None
        if stored != self.size:
            problem = f"the store holds {stored} bytes where {self.size} were uploaded"
        elif composite is not None and int(composite.group(2)) == len(self.digests) and composite.group(1) != expected:
            problem = f"the store's checksum of the parts ({etag}) is not that of the bytes uploaded"
        if problem is not None:
            with contextlib.suppress(Exception):
                self.reader.delete(self.path)
            raise OutputError(f"{problem} — the object was deleted; try again", path=self.remote)

    def abort(self) -> str | None:
        """Stop the upload (obstore aborts it); None, or why the store may still hold its parts: the request
        that failed could not reach the store, and the store does not answer now either, so obstore's abort
        most likely did not reach it."""
        if self._thread is None or self.completed:
            return None
        self._stop.set()
        self._thread.join()
        if self._error is None or isinstance(self._error, (_Aborted, KeyboardInterrupt, CkptError)):
            return None
        if not isinstance(self._error, (ConnectionError, TimeoutError, OSError)) or isinstance(
            self._error, FileNotFoundError
        ):
            return None
        try:
            STATS.add(requests=1)
            self.reader.head(self.path)
        except FileNotFoundError:
            return None  # the store answers: it took the abort too
        except Exception as e:
            return remote_error(e, self.remote, writing=True).message.split(" — ")[0]
        return None


class FedUpload(_StoreUpload):
    """An upload whose parts are fed while the file is written (:class:`ckptool.io.streamed.StreamedFile`): it
    starts at once; :meth:`feed` blocks while the store is behind (one part waits, :data:`PARTS_IN_FLIGHT` are
    on their way), and raises, the upload aborted, when the store failed. ``send`` waits for the parts fed."""

    def __init__(self, remote: RemotePath, expected: int) -> None:
        super().__init__(None, remote)
        # ``expected``: the tensors' bytes; the header and a margin on top, within the store's count of parts
        self.part_size = max(PART_SIZE, -(-(expected + expected // 100 + (64 << 20)) // MAX_PARTS))
        self._fed: queue.Queue[bytes | None] = queue.Queue(maxsize=1)
        self._thread = threading.Thread(target=self._run, name="ckptool-upload", daemon=True)
        self._thread.start()

    def feed(self, data: bytes) -> None:
        while True:
            if self._error is not None or self._stop.is_set():
                failed = self._error or _Aborted()
                if not isinstance(failed, Exception):
                    raise type(failed)()  # Ctrl-C on the upload's thread: the write stops as at any Ctrl-C
                reason = self.abort()
                raise OutputError(write_error(failed, self.remote).message + _abort_note(reason), path=self.remote)
            try:
                self._fed.put(data, timeout=0.1)
                return
            except queue.Full:
                continue

    def fed(self) -> None:
        self.feed(None)  # type: ignore[arg-type]

    def _parts(self) -> Iterator[bytes]:
        while True:
            try:
                data = self._fed.get(timeout=0.05)
            except queue.Empty:
                if self._stop.is_set():
                    raise _Aborted() from None
                continue
            if data is None:
                break
            self.size += len(data)
            yield self.part(len(self.digests) + 1, data)
            del data
        self._held_open()

    def send(self) -> None:
        while not self._sent.wait(0.1):
            pass
        if self._error is not None:
            raise self._error


class _Aborted(Exception):
    """Raised into obstore's upload so that it aborts it."""


class _StreamUpload(_Upload):
    """gs:// (and memory://). Where the protocol's file can hold back its commit (gcsfs's resumable
    upload), it is written without autocommit and committed at the end; elsewhere the bytes go to a
    temporary object beside the output (``.ckptool-tmp-*``), moved onto the output's name at the end
    (a server-side copy on most stores). Either way its atomicity is the protocol's."""

    DEFERRING = ("gs", "gcs")

    def __init__(self, local: Path, remote: RemotePath) -> None:
        self.local = local
        self.remote = remote
        self.fs, self.path = remote.filesystem()
        self.size = local.stat().st_size
        self.handle: Any = None
        self.deferred = remote.protocol in self.DEFERRING
        self.temp: str | None = None

    def send(self) -> None:
        if self.deferred:
            self.handle = self.fs.open(self.path, "wb", autocommit=False)
        else:
            parent, _, name = self.path.rpartition("/")
            self.temp = (
                f"{parent}/{TEMP_PREFIX}{uuid.uuid4().hex[:12]}-{name}"
                if parent
                else f"{TEMP_PREFIX}{uuid.uuid4().hex[:12]}-{name}"
            )
            self.handle = self.fs.open(self.temp, "wb")
        STATS.add(requests=1)
        with open(self.local, "rb") as source:
            while data := source.read(PART_SIZE):
                self.handle.write(data)
                STATS.add(written=len(data))
                progress.advance(len(data))
        if not self.deferred:
            self.handle.close()

    def complete(self) -> None:
        STATS.add(requests=1)
        if self.deferred:
            self.handle.close()
            self.handle.commit()
        else:
            assert self.temp is not None
            self.fs.mv(self.temp, self.path)
            self.temp = None
        self.completed = True
        self.fs.invalidate_cache(self.path)
        info = bounded.call(self.fs, "info", self.path)
        if int(info.get("size") or 0) != self.size:
            with contextlib.suppress(Exception):
                bounded.call(self.fs, "rm_file", self.path)
            raise OutputError(
                f"the store holds {info.get('size')} bytes where {self.size} were uploaded — the "
                "object was deleted; try again",
                path=self.remote,
            )

    def abort(self) -> str | None:
        if self.handle is None or self.completed:
            return None
        try:
            if self.deferred:
                self.handle.discard()
            elif self.temp is not None:
                bounded.call(self.fs, "rm_file", self.temp)
        except FileNotFoundError:
            return None
        except Exception as e:
            return type(e).__name__
        return None


_DIGEST_CODES = ("BadDigest", "InvalidDigest", "XAmzContentSHA256Mismatch", "XAmzContentChecksumMismatch")


def write_error(error: BaseException, path: RemotePath) -> CkptError:
    """One line for a failed upload request: bytes the store received altered (its checksum of them
    is not the one sent), else as :func:`ckptool.files.remote.remote_error` says."""
    current: BaseException | None = error
    code = ""
    for _ in range(8):  # s3fs raises an OSError whose cause is botocore's error
        if current is None:
            break
        response = getattr(current, "response", None)
        code = str(response.get("Error", {}).get("Code", "")) if isinstance(response, dict) else ""
        if code:
            break
        current = current.__cause__ or current.__context__
    if code in _DIGEST_CODES:
        return OutputError(
            f"the store received other bytes than were sent ({code}): something on the way altered "
            "them — try again, and check the network or proxy if it persists",
            path=path,
        )
    return remote_error(error, path, writing=True)


def _abort_note(failed: str | None) -> str:
    """What a failed upload's message ends with: its abort, and ``failed``, why it may not have reached the store."""
    if failed is None:
        return "; the upload was aborted: nothing was written"
    return (
        f"; aborting the upload may have failed too ({failed}): no object was written, but its parts may stay "
        "in the store until the bucket's lifecycle rule for incomplete uploads removes them"
    )


def _upload_for(local: Path, remote: RemotePath) -> _Upload:
    return _StreamUpload(local, remote) if remote.protocol == "memory" else _StoreUpload(local, remote)


def publish(
    files: Sequence[tuple[Path, RemotePath]],
    *,
    replaces_last: bool = False,
    remove: Iterable[RemotePath] = (),
    label: str | None = None,
    fed: Mapping[RemotePath, FedUpload] | None = None,
) -> list[str]:
    """Upload the staged ``files`` (local, remote) as one set: every file sent, then every upload
    completed in order (the last file last); then ``remove`` the objects the set no longer names.
    ``replaces_last``: the last file's object exists already and goes first, so a reader never finds
    it beside a part of the new set. ``fed``: the uploads of the files sent while they were written, by
    their URL (held open, waiting to complete). Returns notes (an earlier file that could not be removed).

    Raises:
        OutputError: a request failed (after the client's retries), or the store's checksum or size
            of an object is not that of the bytes uploaded. Every upload not yet completed is aborted.
        KeyboardInterrupt: the same, after the aborts.
    """
    uploads: list[_Upload] = []
    current: RemotePath | None = None
    fed = fed or {}
    total = sum(local.stat().st_size for local, remote in files if remote not in fed)
    try:
        with progress.task(total, f"upload {label or files[-1][1].name}"):
            for local, remote in files:
                current = remote
                upload = fed.get(remote) or _upload_for(local, remote)
                uploads.append(upload)
                upload.send()
        with signals_deferred():  # a few short requests: a Ctrl-C now would leave half a set
            if replaces_last:
                last = files[-1][1]
                current = last
                fs, path = last.filesystem()
                STATS.add(requests=1)
                bounded.call(fs, "rm_file", path)
            for upload in uploads:
                current = upload.remote  # type: ignore[attr-defined]
                upload.complete()
    except BaseException as e:
        failed = [reason for upload in uploads if (reason := upload.abort()) is not None]
        done = sum(1 for upload in uploads if upload.completed)
        if not isinstance(e, Exception):
            raise
        error = e if isinstance(e, CkptError) else write_error(e, current or files[-1][1])
        message, named = error.message, error.path
        if done and len(files) > 1:
            message += (
                f"; {done} of {len(files)} files of the set were already in place — the set is incomplete "
                "(no index was written): write it again"
            )
        else:
            message += _abort_note(failed[0] if failed else None)
        raise OutputError(message, path=named) from e
    notes: list[str] = []
    for stale in remove:
        fs, path = stale.filesystem()
        try:
            STATS.add(requests=1)
            bounded.call(fs, "rm_file", path)
        except FileNotFoundError:
            pass
        except Exception as e:
            notes.append(f"could not remove {stale}, a shard of the earlier set ({remote_error(e, stale).message})")
    return notes
