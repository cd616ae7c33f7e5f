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
import os
import re
import shutil
import tempfile
import threading
import uuid
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

from ckptool.base import progress
from ckptool.base.errors import CkptError, InputError, OutputError, UsageError
from ckptool.base.suggest import option
from ckptool.files import bounded
from ckptool.files.atomic import TEMP_PREFIX, exists_refusal, folder_holds_refusal, is_input_refusal, signals_deferred
from ckptool.files.remote import STATS, RemotePath, check_supported, remote_error

PART_SIZE = 8 * 1024 * 1024  # bytes per part (S3: at least 5 MiB but the last; at most 10,000 parts)
MAX_PARTS = 10_000
PARTS_IN_FLIGHT = 2  # parts being sent at once (each one is in memory until sent)
STAGING_PREFIX = "ckptool-staging-"
_COMPOSITE = re.compile(r"^([0-9a-f]{32})-(\d+)$")
S3_PROTOCOLS = ("s3", "s3a", "s3n")


def _md5(data: bytes) -> Any:
    return hashlib.md5(data, usedforsecurity=False)


# -- staging ------------------------------------------------------------------------------------------------


def staging_root() -> str | None:
    """Where staging folders are made: ``$CKPTOOL_STAGING_DIR``, else the system's temp folder (None)."""
    return os.environ.get("CKPTOOL_STAGING_DIR") or None


@contextlib.contextmanager
def staged(out: RemotePath) -> Iterator[Path]:
    """A local path named like ``out`` in a new private folder, for the checked write; the folder is
    removed when the block ends, whatever happens."""
    root = staging_root()
    try:
        folder = Path(tempfile.mkdtemp(prefix=STAGING_PREFIX, dir=root))
    except OSError as e:
        raise OutputError(
            f"cannot make a staging folder in {root or tempfile.gettempdir()} ({e.strerror or e}) "
            "— set CKPTOOL_STAGING_DIR to a writable local folder with room for the output; "
            "nothing was written",
            path=out,
        ) from e
    try:
        yield folder / (out.name or "output")
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def named_for_user(error: CkptError, staged_path: Path, out: RemotePath) -> CkptError:
    """``error`` from the staged write, naming ``out`` where it named the staging path (a private detail)."""
    shown = str(staged_path)
    text = error.message.replace(shown, str(out))
    if shown not in error.message and error.path is not None and str(error.path).startswith(shown):
        text = error.message
    if "no space left" in text:
        text += (
            f" (the local staging folder, in {staging_root() or tempfile.gettempdir()}: set "
            "CKPTOOL_STAGING_DIR to a disk with room for the output)"
        )
    path: Any = out
    if error.path is not None and str(error.path).startswith(shown + "/"):
        path = out / str(error.path)[len(shown) + 1 :]
    made = type(error)(text, path=path)
    made.__cause__ = error
    return made


# -- refusals before anything is written ---------------------------------------------------------------------


def check_output(
    out: RemotePath,
    *,
    inputs: Sequence[Any] = (),
    force: bool = False,
    in_place: bool = False,
    writes: list[str] | None = None,
    removes: Iterable[str] = (),
) -> None:
    """Refuse a remote output as :func:`ckptool.files.atomic.check_output` refuses a local one (same wording):
    an existing object without ``force``, the input itself; for a folder output (``writes``: the
    files it writes) any file it would replace, without ``force``. Also: a read-only protocol, an
    in-place rewrite (local files only), and an S3 bucket that is missing or refused.

    Raises:
        UsageError: a read-only protocol (``https://``), or ``in_place``.
        OutputError: what exists without ``force``; the input; a bucket missing or refused.
    """
    if out.read_only:
        raise UsageError(f"{out.protocol}:// is read-only — write the output to a local path, s3:// or gs://", path=out)
    if in_place:
        raise UsageError(
            option("in_place")
            + " rewrites a local file; a URL is written as a new object — drop "
            + option("in_place")
            + " and name the output with "
            + option("out", None),
            path=out,
        )
    check_supported(out, writing=True)
    # compared by what they name (s3a://B/k/ is s3://b/k), before any request: no spelling of an input is written
    remote_inputs = {source.identity for source in inputs if isinstance(source, RemotePath)}
    if writes is None and out.identity in remote_inputs:
        raise is_input_refusal(out, in_place=False)
    if writes is not None:
        if out.identity in remote_inputs:  # a sharded input's folder, by any spelling
            raise OutputError(
                "is the input folder; refusing to rewrite it — write elsewhere with " + option("out", None), path=out
            )
        for name in [*writes, *removes]:
            if (out / name).identity in remote_inputs:
                raise OutputError(
                    f"holds the input {out / name} as {name}, which this output would replace — "
                    "choose another " + option("out", None),
                    path=out,
                )
    _check_bucket(out)
    info = _info(out)
    if writes is None:
        if info is not None and info.get("type") == "directory":
            raise OutputError(
                "is a folder (objects lie under it), where the output writes one object — choose "
                "another " + option("out", None),
                path=out,
            )
        if info is not None and not force:
            raise exists_refusal(out)
        return
    if info is not None and info.get("type") != "directory":
        raise OutputError(
            "is an object, where the output writes a folder of files — remove it, or choose another "
            + option("out", None),
            path=out,
        )
    if info is None:
        return
    try:
        present = {child.name for child in out.iterdir()}
    except InputError as e:
        raise OutputError(e.message, path=out) from e
    existing = [name for name in [*writes, *removes] if name in present]
    if existing and not force:
        raise folder_holds_refusal(out, writes, existing)


def refuse_input(out: RemotePath, *, files: Sequence[Any] = (), folder: Any = None) -> None:
    """Refuse an output that is an input by any spelling (:func:`ckptool.files.remote.identity`), before any
    request is made for it: one of the input's ``files``, or its ``folder``.

    Raises:
        OutputError: ``out`` names an input.
    """
    named = out.identity
    if any(isinstance(file, RemotePath) and file.identity == named for file in files):
        raise is_input_refusal(out, in_place=False)
    if isinstance(folder, RemotePath) and folder.identity == named:
        raise (
            is_input_refusal(out, in_place=False)
            if folder in files
            else OutputError(
                "is the input folder; refusing to rewrite it — write elsewhere with " + option("out", None), path=out
            )
        )


def _info(out: RemotePath) -> dict[str, Any] | None:
    """What the store holds at ``out`` (None: nothing); a failure named as the output's."""
    try:
        return out.info()
    except InputError as e:
        raise OutputError(e.message, path=out) from e


def _check_bucket(out: RemotePath) -> None:
    """An S3 output's bucket must exist and answer before a byte is staged (one listing request)."""
    if out.protocol not in S3_PROTOCOLS:
        return
    reader, key = out.filesystem()
    bucket = key.split("/", 1)[0]
    try:
        STATS.add(requests=1)
        reader.is_prefix(key)
    except Exception as e:
        error = remote_error(e, out, writing=True)
        if "(404)" in error.message:
            raise OutputError(
                f"its bucket {bucket} does not exist (404) — create it first, or check the URL", path=out
            ) from None
        if error.message.startswith("access denied"):
            return  # credentials that may write but not list the bucket: the write itself will say
        raise error from None


def earlier_shards(out: RemotePath, index_name: str) -> tuple[bool, list[str] | None]:
    """(whether the folder ``out`` holds ``index_name``, the shard files that index names — None when it
    cannot be read as an index)."""
    from ckptool.formats.safetensors import MAX_HEADER_BYTES, shards_named_in

    index = out / index_name
    info = _info(index)
    if info is None:
        return False, []
    if int(info.get("size") or 0) > MAX_HEADER_BYTES:
        return True, None
    try:
        return True, shards_named_in(index.read_bytes())
    except InputError as e:
        raise OutputError(e.message, path=index) from e


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

    def __init__(self, local: Path, remote: RemotePath) -> None:
        self.local = local
        self.remote = remote
        self.reader, self.path = remote.filesystem()
        self.size = local.stat().st_size
        self.part_size = max(PART_SIZE, -(-self.size // MAX_PARTS))
        self.digests: list[bytes] = []
        self.result: dict[str, Any] = {}
        self._sent = threading.Event()
        self._go = threading.Event()
        self._stop = threading.Event()
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None

    def _parts(self) -> Iterator[bytes]:
        with open(self.local, "rb") as handle:
            while True:
                if self._stop.is_set():
                    raise _Aborted()
                data = handle.read(self.part_size)
                if not data:
                    break
                yield self.part(len(self.digests) + 1, data)
                del data
        self._sent.set()
        while not self._go.wait(0.05):  # held open: the object appears only when the set is complete
            if self._stop.is_set():
                raise _Aborted()

    def part(self, number: int, data: bytes) -> bytes:
        """Part ``number`` on its way: its MD5 kept (for the object's check at completion), counted; the
        bytes to send."""
        self.digests.append(_md5(data).digest())
        STATS.add(requests=1, written=len(data))
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


def _upload_for(local: Path, remote: RemotePath) -> _Upload:
    return _StreamUpload(local, remote) if remote.protocol == "memory" else _StoreUpload(local, remote)


def publish(
    files: Sequence[tuple[Path, RemotePath]],
    *,
    replaces_last: bool = False,
    remove: Iterable[RemotePath] = (),
    label: str | None = None,
) -> list[str]:
    """Upload the staged ``files`` (local, remote) as one set: every file sent, then every upload
    completed in order (the last file last); then ``remove`` the objects the set no longer names.
    ``replaces_last``: the last file's object exists already and goes first, so a reader never finds
    it beside a part of the new set. Returns notes (an earlier file that could not be removed).

    Raises:
        OutputError: a request failed (after the client's retries), or the store's checksum or size
            of an object is not that of the bytes uploaded. Every upload not yet completed is aborted.
        KeyboardInterrupt: the same, after the aborts.
    """
    uploads: list[_Upload] = []
    current: RemotePath | None = None
    total = sum(local.stat().st_size for local, _ in files)
    try:
        with progress.task(total, f"upload {label or files[-1][1].name}"):
            for local, remote in files:
                current = remote
                upload = _upload_for(local, remote)
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
        elif failed:
            message += (
                f"; aborting the upload may have failed too ({failed[0]}): no object was written, but its "
                "parts may stay in the store until the bucket's lifecycle rule for incomplete uploads removes them"
            )
        else:
            message += "; the upload was aborted: nothing was written"
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
