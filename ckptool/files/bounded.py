"""Remote requests that read no further than they asked, and end in bounded time.

A server ckptool reads from is as untrusted as the file it serves. Asked for 256 KiB, it may send a
3 GiB body, other bytes than asked (another range, the whole object), or a byte a second. So every
ranged GET of a URL:

- judges the answer before its body (:func:`judge`): the status, ``Content-Range`` and
  ``Content-Length`` must describe the range asked, else :class:`RangeRefused`, and not a byte of
  the body is read;
- reads the body up to the length asked and no further; a body that goes on past a range it named
  is refused (:class:`RangeRefused`), a whole object sent for a range from byte 0 is cut where the
  range ends (the rest is never read: the connection is dropped);
- ends within one wall-clock limit per request, however slowly the bytes come
  (:func:`request_timeout_s`: ``$CKPTOOL_REMOTE_TIMEOUT`` seconds, default 120;
  :class:`RequestTimedOut`).

:mod:`ckptool.files.s3read` applies these rules on its own connections. Here they are applied to fsspec's
HTTP filesystem (``http(s)://``), s3fs and gcsfs through their own sessions (so their credentials,
endpoints and options still hold); their other requests (``info``, ``ls``, an upload's calls) run
under the same clock (:func:`call`). Other filesystems (``memory://``) are in-process: nothing to bound.
"""

from __future__ import annotations

import asyncio
import importlib
import os
import re
import sys
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

TIMEOUT_ENV = "CKPTOOL_REMOTE_TIMEOUT"
DEFAULT_TIMEOUT_S = 120.0  # one request, start to last byte: an 8 MiB part at 70 KB/s
ERROR_BODY_LIMIT = 64 * 1024  # the most of an error answer read (its code is in the first few hundred bytes)
PARALLEL = 8  # ranges of one batch in flight at once
_CONTENT_RANGE = re.compile(r"bytes\s+(\d+)-(\d+)/(\d+|\*)")
_CHUNK = 1 << 20


def request_timeout_s() -> float:
    """Seconds one request may take from its start to its last byte: ``$CKPTOOL_REMOTE_TIMEOUT``
    when it is a positive number, else :data:`DEFAULT_TIMEOUT_S`."""
    raw = os.environ.get(TIMEOUT_ENV, "")
    try:
        seconds = float(raw)
    except ValueError:
        return DEFAULT_TIMEOUT_S
    return seconds if seconds > 0 else DEFAULT_TIMEOUT_S


class RequestTimedOut(TimeoutError):
    """A request did not end within :func:`request_timeout_s` (a store that trickles, or hangs)."""

    def __init__(self, seconds: float) -> None:
        super().__init__(f"no complete answer within {seconds:g} s")
        self.seconds = seconds


class RangeRefused(Exception):
    """A ranged GET answered with other bytes than asked; the message says what came (numbers only,
    never the server's text)."""


def judge(status: int, content_range: str | None, content_length: int | None, start: int, end: int) -> tuple[int, bool]:
    """What to read of a 2xx answer to a GET of bytes ``[start, end)``: (the body bytes to read, whether
    a body going on past them is refused). Nothing of the body is read before this.

    Raises:
        RangeRefused: the answer is not the range asked (another range, a longer one, the whole object
            for a range that does not start at 0, a length that is not the range's).
    """
    asked = f"{start}-{end - 1}"
    if status == 206:
        match = _CONTENT_RANGE.fullmatch((content_range or "").strip())
        if match is None:
            raise RangeRefused(f"answered a range without naming it (bytes {asked} asked)")
        first, last = int(match.group(1)), int(match.group(2))
        if first != start or last < first or last > end - 1:
            raise RangeRefused(f"sent bytes {first}-{last} where {asked} were asked")
        length = last - first + 1
        if content_length is not None and content_length != length:
            raise RangeRefused(f"sent a body of {content_length} bytes for the {length} bytes of range {first}-{last}")
        return length, content_length is None
    if status == 200:  # the range ignored: the whole object comes
        if start != 0:
            raise RangeRefused(f"ignored the byte range (bytes {asked} asked) and sent the whole file")
        wanted = end - start
        return (wanted if content_length is None else min(wanted, content_length)), False
    raise RangeRefused(f"answered {status} to a request for bytes {asked}")


async def read_body(read: Callable[[int], Awaitable[bytes]], length: int, refuse_more: bool) -> bytes:
    """``length`` bytes (fewer where the body ends first) through ``read(n)``, which returns at most n
    bytes (b"" at the end); with ``refuse_more``, a byte past them is :class:`RangeRefused`."""
    body = bytearray()
    while len(body) < length:
        piece = await read(min(_CHUNK, length - len(body)))
        if not piece:
            break
        body += piece
    if refuse_more and len(body) == length and await read(1):
        raise RangeRefused(f"sent more than the {length} bytes of the range it named")
    return bytes(body)


# -- fsspec filesystems ---------------------------------------------------------------------------------------


def _kind(fs: Any) -> str | None:
    """'http', 's3fs' or 'gcsfs' for the filesystems whose requests are bounded here, else None."""
    for module, name, kind in (
        ("fsspec.implementations.http", "HTTPFileSystem", "http"),
        ("s3fs.core", "S3FileSystem", "s3fs"),
        ("gcsfs.core", "GCSFileSystem", "gcsfs"),
    ):
        found = sys.modules.get(module)
        if found is not None and isinstance(fs, getattr(found, name)):
            return kind
    return None


def _is_async(fs: Any) -> bool:
    asyn = sys.modules.get("fsspec.asyn")
    return asyn is not None and isinstance(fs, asyn.AsyncFileSystem) and not fs.asynchronous


async def _within(seconds: float, make: Callable[[], Awaitable[Any]]) -> Any:
    try:
        return await asyncio.wait_for(make(), seconds)
    except asyncio.TimeoutError:
        raise RequestTimedOut(seconds) from None


def _sync(fs: Any, function: Callable[..., Awaitable[Any]], *args: Any) -> Any:
    """``function(*args)`` run on ``fs``'s event loop, from this thread."""
    sync = importlib.import_module("fsspec.asyn").sync  # (untyped: looked up, not imported by name)

    try:
        return sync(fs.loop, function, *args)
    except TimeoutError as e:  # fsspec re-raises any TimeoutError as its own: the limit's own error is the one
        if isinstance(e.__cause__, RequestTimedOut):
            raise e.__cause__ from None
        raise


def _run(fs: Any, make: Callable[[], Awaitable[Any]]) -> Any:
    """``make()``'s coroutine on ``fs``'s event loop, cancelled after :func:`request_timeout_s`."""
    return _sync(fs, _within, request_timeout_s(), make)


def call(fs: Any, method: str, *args: Any, **kwargs: Any) -> Any:
    """``fs.<method>(*args, **kwargs)``, under the wall-clock limit where ``fs`` is an async fsspec
    filesystem (its ``_<method>`` coroutine is cancelled at the limit); a light reader
    (:class:`ckptool.files.s3read.S3Reader`) keeps its own clock."""
    coroutine = getattr(fs, "_" + method, None)
    if coroutine is not None and _is_async(fs):
        return _run(fs, lambda: coroutine(*args, **kwargs))
    return getattr(fs, method)(*args, **kwargs)


def get_ranges(fs: Any, key: str, spans: Sequence[tuple[int, int]]) -> list[bytes]:
    """The bytes ``[start, end)`` of ``key`` for each span (fewer at the object's end), read as
    :func:`judge` allows, each request under the wall-clock limit; up to :data:`PARALLEL` at once.

    Raises:
        RangeRefused, RequestTimedOut: as their names say; the filesystem's own errors otherwise.
    """
    kind = _kind(fs)
    if kind is None:  # the light S3 reader (bounded itself), or an in-process filesystem
        if len(spans) == 1:
            return [fs.cat_file(key, start=spans[0][0], end=spans[0][1])]
        pieces = fs.cat_ranges([key] * len(spans), [s for s, _ in spans], [e for _, e in spans])
        for piece in pieces:
            if isinstance(piece, BaseException):
                raise piece
        return list(pieces)
    one = {"http": _http_range, "s3fs": _s3fs_range, "gcsfs": _gcs_range}[kind]
    seconds = request_timeout_s()

    async def batch() -> list[bytes]:
        gate = asyncio.Semaphore(PARALLEL)

        async def fetch(start: int, end: int) -> bytes:
            async with gate:
                if end <= start:
                    return b""
                return await _within(seconds, lambda: one(fs, key, start, end))

        return list(await asyncio.gather(*(fetch(start, end) for start, end in spans)))

    return _sync(fs, batch)


def _range_header(start: int, end: int) -> dict[str, str]:
    # identity: a compressed answer's length is not the range's
    return {"Range": f"bytes={start}-{end - 1}", "Accept-Encoding": "identity"}


def _length(headers: Any) -> int | None:
    raw = headers.get("Content-Length")
    try:
        return int(raw) if raw is not None else None
    except ValueError:
        return None


async def _http_range(fs: Any, url: str, start: int, end: int) -> bytes:
    """fsspec's HTTP filesystem: its session, headers and options; the answer judged before the body."""
    session = await fs.set_session()
    options = dict(fs.kwargs)
    headers = {**(options.pop("headers", None) or {}), **_range_header(start, end)}
    async with session.get(fs.encode_url(url), headers=headers, **options) as answer:
        if answer.status >= 400:
            fs._raise_not_found_for_status(answer, url)  # FileNotFoundError, or aiohttp's error with the status
        if answer.status == 416:
            return b""
        length, refuse_more = judge(
            answer.status, answer.headers.get("Content-Range"), _length(answer.headers), start, end
        )
        return await read_body(answer.content.read, length, refuse_more)


async def _s3fs_range(fs: Any, path: str, start: int, end: int) -> bytes:
    """s3fs: its client (credentials, endpoint, retries), the answer judged before the body."""
    bucket, key, version = fs.split_path(path)
    extra = {"VersionId": version} if version else {}

    async def once() -> bytes:
        answer = await fs._call_s3(
            "get_object", Bucket=bucket, Key=key, Range=f"bytes={start}-{end - 1}", **extra, **fs.req_kw
        )
        body = answer["Body"]
        try:
            status = int(answer.get("ResponseMetadata", {}).get("HTTPStatusCode") or 200)
            length, refuse_more = judge(status, answer.get("ContentRange"), answer.get("ContentLength"), start, end)
            return await read_body(body.read, length, refuse_more)
        finally:
            body.close()

    try:  # s3fs's own retries of a read (a body cut short, a dropped connection), as its cat_file has them
        _error_wrapper = importlib.import_module("s3fs.core")._error_wrapper
    except ImportError:
        return await once()
    return await _error_wrapper(once, retries=fs.retries)


async def _gcs_range(fs: Any, path: str, start: int, end: int) -> bytes:
    """gcsfs: its session and credentials; an error's body read up to :data:`ERROR_BODY_LIMIT` for its code."""
    validate_response = importlib.import_module("gcsfs.retry").validate_response

    async def once() -> bytes:
        await fs._set_session()
        headers = fs._get_headers(_range_header(start, end))
        async with fs.session.request("GET", fs.url(path), params=fs._get_params({}), headers=headers) as answer:
            if answer.status >= 400:
                if answer.status == 416:
                    return b""
                text = await read_body(answer.content.read, ERROR_BODY_LIMIT, False)
                validate_response(answer.status, text, path)
            length, refuse_more = judge(
                answer.status, answer.headers.get("Content-Range"), _length(answer.headers), start, end
            )
            return await read_body(answer.content.read, length, refuse_more)

    try:
        retry_request = importlib.import_module("gcsfs.retry").retry_request
    except ImportError:
        return await once()
    return await retry_request(retries=getattr(fs, "retries", 6))(once)()
