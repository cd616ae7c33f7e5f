"""Objects at ``s3://``, ``gs://`` and ``http(s)://`` URLs through obstore (Rust's ``object_store``): HEAD,
ranged GET, listing and streamed multipart puts. Signing, credentials, retries and connection pooling are
the library's; nothing here signs a request.

:func:`reader_for` gives the reader of one protocol for the storage options (``--storage-option``, s3fs's
and gcsfs's names: ``key``, ``secret``, ``token``, ``anon``, ``endpoint_url``, ``client_kwargs.region_name``,
``config_kwargs.retries``...; obstore's own config keys pass through) and the environment (``AWS_*``,
``AWS_ENDPOINT_URL[_S3]``, a shared-credentials profile; ``GOOGLE_*``, ``STORAGE_EMULATOR_HOST``). It
answers, on ``bucket/key`` paths (a URL's own for http), what :mod:`ckptool.files.remote` asks: ``info``, ``ls``,
``cat_file``, ``cat_ranges``. An option a protocol does not take is :class:`OptionError`.

A store is no more trusted than a file. A ranged GET is refused when the answer names another range, or
no range, or no length (the library checks those before the body), and its body is read no further than the
range: a body that goes on is :class:`~ckptool.files.bounded.RangeRefused`, the rest never read. Every request,
headers to last byte, ends within :func:`ckptool.files.bounded.request_timeout_s` (the client's own timeout;
:class:`~ckptool.files.bounded.RequestTimedOut`). Failures are :class:`StoreError` with a botocore-like
``response`` (status and code, never the store's text), FileNotFoundError, or the errors above.
"""

from __future__ import annotations

import json
import os
import re
import threading
import urllib.parse
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

from ckptool.files.bounded import RangeRefused, RequestTimedOut, request_timeout_s
from ckptool.files.store_options import (
    _ENV_NAMES,
    CONNECT_TIMEOUT_S,
    GS_PROTOCOLS,
    MAX_ATTEMPTS,
    MIN_CHUNK,
    S3_PROTOCOLS,
    OptionError,
    bucket_region,
    gcs_config,
    http_config,
    profile_provider,
    s3_config,
)

__all__ = ["MAX_ATTEMPTS", "OptionError", "Reader", "StoreError", "clear", "reader_for", "translate"]

# what happened, for tests and diagnostics: stores made, requests sent
COUNTS = {"stores": 0, "requests": 0}
_counts_lock = threading.Lock()
_readers: dict[str, Reader] = {}
_readers_lock = threading.Lock()
_STATUS = re.compile(r"non-2xx status code: (\d{3})")
_CODE = re.compile(r"<Code>([A-Za-z0-9.]+)</Code>")
_GOT_RANGE = re.compile(r"Requested (\d+)\.\.(\d+), got (\d+)\.\.(\d+)")


class StoreError(Exception):
    """A request the store refused: ``status`` and ``code`` (and ``response`` shaped as botocore's)."""

    def __init__(self, status: int, code: str = "") -> None:
        super().__init__(f"{status}{' ' + code if code else ''}")
        self.status = status
        self.code = code
        self.response = {"Error": {"Code": code or str(status)}, "ResponseMetadata": {"HTTPStatusCode": status}}


S3Error = StoreError  # the name it had


def _count(requests: int = 1) -> None:
    with _counts_lock:
        COUNTS["requests"] += requests


# -- the reader -------------------------------------------------------------------------------------------


def reader_for(protocol: str, options: Mapping[str, Any], env: Mapping[str, str] | None = None) -> Reader:
    """The reader of ``protocol`` (``s3``, ``gs``, ``http``, ``https``) for the storage options and environment
    (made once for each).

    Raises:
        OptionError: an option the protocol does not take.
        ImportError: obstore is not installed.
    """
    env = os.environ if env is None else env
    snapshot = json.dumps(
        [protocol, options, [env.get(name) for name in _ENV_NAMES], request_timeout_s()], sort_keys=True, default=str
    )
    with _readers_lock:
        found = _readers.get(snapshot)
    if found is not None:
        return found
    import obstore  # noqa: F401  (missing: the caller names the extra)

    if protocol in S3_PROTOCOLS:
        config, client, attempts = s3_config(options, env)
    elif protocol in GS_PROTOCOLS:
        config, client, attempts = gcs_config(options, env)
    else:
        config, client, attempts = http_config(options)
    reader = Reader(protocol, config, client, attempts)
    if reader.protocol == "s3":
        reader.provider = profile_provider(config, env)
    with _readers_lock:
        _readers[snapshot] = reader
    return reader


def clear() -> None:
    """Forget every reader (and its stores' connections)."""
    with _readers_lock:
        _readers.clear()


class Reader:
    """The objects of one protocol under one configuration: ``info``, ``ls``, ``cat_file``, ``cat_ranges``
    on ``bucket/key`` paths (the whole URL for http), as fsspec names them."""

    def __init__(self, protocol: str, config: dict[str, Any], client: dict[str, Any], attempts: int) -> None:
        self.protocol = "s3" if protocol in S3_PROTOCOLS else "gs" if protocol in GS_PROTOCOLS else protocol
        self.config = config
        self.seconds = request_timeout_s()
        self.client = {
            "timeout": f"{self.seconds:g}s",
            "connect_timeout": f"{CONNECT_TIMEOUT_S:g}s",
            "user_agent": "ckptool",
            **client,
        }
        self.retry = {"max_retries": max(0, attempts - 1)}
        self.provider: Any = None  # obstore's credential provider, where the profile's credentials need one
        self.regions: dict[str, str] = {}  # AWS buckets found in another region than the configured one
        self._stores: dict[str, Any] = {}
        self._lock = threading.Lock()

    def __repr__(self) -> str:  # never a credential
        return f"Reader({self.protocol}, endpoint={self.config.get('endpoint') or self.config.get('base_url') or '-'})"

    # where an object is
    def store(self, path: str) -> tuple[Any, str]:
        """(the obstore store that holds ``path``, the object's key there)."""
        if self.protocol in ("http", "https"):
            parsed = urllib.parse.urlsplit(path)
            if parsed.query:  # a presigned URL: the store is the URL itself, its object the empty key
                base, key = path, ""
            else:
                base = f"{parsed.scheme}://{parsed.netloc}"
                key = urllib.parse.unquote(parsed.path).lstrip("/")
        else:
            base, _, key = path.partition("/")
        with self._lock:
            store = self._stores.get(base)
        if store is None:
            store = self._make(base)
            with self._lock:
                self._stores[base] = store
                COUNTS["stores"] += 1
        return store, key

    def _make(self, base: str) -> Any:
        from obstore.exceptions import UnknownConfigurationKeyError
        from obstore.store import GCSStore, HTTPStore, S3Store

        config: Any = self.config
        client: Any = self.client
        retry: Any = self.retry
        try:
            if self.protocol == "s3":
                if base in self.regions:
                    config = {**config, "region": self.regions[base]}
                return S3Store(
                    base, config=config, client_options=client, retry_config=retry, credential_provider=self.provider
                )
            if self.protocol == "gs":
                return GCSStore(base, config=config, client_options=client, retry_config=retry)
            return HTTPStore.from_url(base, client_options=client, retry_config=retry)
        except UnknownConfigurationKeyError as e:
            raise OptionError(str(e).split(":", 1)[0]) from None
        except Exception as e:
            raise translate(e) from None

    def _call(self, path: str, op: Callable[[Any, str], Any], span: tuple[int, int] | None = None) -> Any:
        """``op(store, key)`` for ``path``, its failure translated; asked again, once, in the bucket's own region
        where AWS answers that the bucket lies in another (301) and no endpoint was named."""
        for attempt in (0, 1):
            store, key = self.store(path)
            _count()
            try:
                return op(store, key)
            except RangeRefused:
                raise
            except Exception as e:
                error = translate(e, path, span)
                if attempt or not self._moved(path, error):
                    raise error from None
        raise AssertionError("unreachable")

    def _moved(self, path: str, error: BaseException) -> bool:
        """Whether ``path``'s bucket was found in another AWS region (its store made anew there)."""
        if self.protocol != "s3" or self.config.get("endpoint") or not isinstance(error, StoreError):
            return False
        if error.status != 301 and error.code not in ("PermanentRedirect", "AuthorizationHeaderMalformed"):
            return False
        bucket = path.partition("/")[0]
        region = bucket_region(bucket, self.seconds)
        if not region or region == self.regions.get(bucket, self.config.get("region")):
            return False
        with self._lock:
            self.regions[bucket] = region
            self._stores.pop(bucket, None)
        return True

    # what remote.py asks for
    def head(self, path: str) -> dict[str, Any]:
        import obstore

        meta = self._call(path, obstore.head)
        return {"name": path, "type": "file", "size": int(meta["size"]), "ETag": meta.get("e_tag") or ""}

    def info(self, path: str) -> dict[str, Any]:
        """A file's size, or a prefix as a directory; FileNotFoundError when neither."""
        try:
            return self.head(path)
        except FileNotFoundError:
            if self.protocol in ("http", "https"):
                raise
        if self.is_prefix(path):
            return {"name": path, "type": "directory", "size": 0}
        raise FileNotFoundError(path)

    def is_prefix(self, path: str) -> bool:
        import obstore

        path = path.rstrip("/")
        if not self.store(path)[1]:
            return True

        def listed(store: Any, key: str) -> bool:
            for chunk in obstore.list(store, prefix=key.rstrip("/") + "/", chunk_size=1):
                return bool(chunk)
            return False

        return bool(self._call(path, listed))

    def ls(self, path: str, detail: bool = True) -> list[dict[str, Any]]:
        """The objects and prefixes right under ``path`` (one level)."""
        import obstore

        path = path.rstrip("/")
        store, key = self.store(path)
        bucket = path[: len(path) - len(key)].rstrip("/")
        listed = self._call(path, lambda store, key: obstore.list_with_delimiter(store, prefix=key or None))
        entries = [
            {"name": f"{bucket}/{prefix}", "type": "directory", "size": 0} for prefix in listed["common_prefixes"]
        ]
        entries += [
            {"name": f"{bucket}/{meta['path']}", "type": "file", "size": int(meta["size"])}
            for meta in listed["objects"]
        ]
        if not entries and key:
            raise FileNotFoundError(path)
        return entries

    def cat_file(self, path: str, start: int | None = None, end: int | None = None) -> bytes:
        """Bytes [start, end) of the object, never more: a longer or other answer is RangeRefused."""
        import obstore

        first = start or 0
        if end is None:
            end = int(self.head(path)["size"])
        if end <= first:
            return b""
        wanted = end - first

        def ranged(store: Any, key: str) -> bytes:
            answer = obstore.get(store, key, options={"range": (first, end)})
            body = bytearray()
            for piece in answer.stream(min_chunk_size=min(wanted, MIN_CHUNK)):
                body += piece
                if len(body) > wanted:
                    raise RangeRefused(f"sent more than the {wanted} bytes of the range it named")
            return bytes(body)

        return bytes(self._call(path, ranged, (first, end)))

    def cat_ranges(self, paths: list[str], starts: list[int], ends: list[int]) -> list[bytes]:
        if len(paths) == 1:
            return [self.cat_file(paths[0], starts[0], ends[0])]
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(max_workers=min(8, len(paths))) as pool:
            return list(pool.map(self.cat_file, paths, starts, ends))

    # writing
    def put(self, path: str, parts: Iterable[Any], *, part_size: int, in_flight: int) -> dict[str, Any]:
        """Stream ``parts`` (buffers, of ``part_size`` but the last) to ``path`` as one multipart upload, at most
        ``in_flight`` parts on their way at once. The object appears when the iterator ends; if it raises, or a
        request fails after the client's retries, the upload is aborted and the error raised."""
        import obstore

        store, key = self.store(path)
        try:
            return dict(
                obstore.put(
                    store, key, iter(parts), chunk_size=part_size, max_concurrency=in_flight, use_multipart=True
                )
            )
        except Exception as e:
            raise translate(e, path) from None

    def rm_file(self, path: str) -> None:
        self.delete(path)

    def delete(self, path: str) -> None:
        import obstore

        try:
            self._call(path, obstore.delete)
        except FileNotFoundError:
            pass


def translate(error: BaseException, path: str = "", span: tuple[int, int] | None = None) -> BaseException:
    """obstore's error as what :func:`ckptool.files.remote.remote_error` reads: FileNotFoundError, PermissionError,
    :class:`StoreError`, RangeRefused, RequestTimedOut or ConnectionError — never the store's text."""
    from obstore import exceptions

    if not isinstance(error, exceptions.BaseError):
        return error
    text = str(error).split("\n\nDebug source:", 1)[0]
    debug = str(error)
    asked = f"{span[0]}-{span[1] - 1}" if span else ""
    if isinstance(error, exceptions.NotFoundError):
        return FileNotFoundError(path)
    got = _GOT_RANGE.search(text)
    if got is not None:
        return RangeRefused(
            f"sent bytes {got.group(3)}-{int(got.group(4)) - 1} where {got.group(1)}-{int(got.group(2)) - 1} were asked"
        )
    if "non-partial response" in text or "RangeNotSupported" in debug:
        return RangeRefused(f"ignored the byte range (bytes {asked} asked) and sent the whole file")
    if "MissingContentLength" in debug and span is not None:
        return RangeRefused(f"sent bytes {asked} without saying how many (no Content-Length)")
    if "redirect without LOCATION" in text or "PermanentRedirect" in debug:  # a bucket in another AWS region
        return StoreError(301, "PermanentRedirect")
    status_match = _STATUS.search(text)
    status = int(status_match.group(1)) if status_match else None
    code_match = _CODE.search(debug)
    code = code_match.group(1) if code_match else ""
    if isinstance(error, (exceptions.PermissionDeniedError, exceptions.UnauthenticatedError)):
        return StoreError(status or 403, code)
    if status is not None:
        return StoreError(status, code)
    if "kind: Timeout" in debug or "operation timed out" in debug:
        return RequestTimedOut(request_timeout_s())
    if "kind: Connect" in debug or "error sending request" in text or "Connect" in debug:
        return ConnectionError("cannot connect to the store")
    return StoreError(0, type(error).__name__)


def chunks(handle: Any, size: int) -> Iterator[bytes]:
    """``handle``'s bytes in pieces of ``size`` (the last shorter)."""
    while data := handle.read(size):
        yield data
