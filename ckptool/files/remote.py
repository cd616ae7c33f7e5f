"""Checkpoints where they live: URLs (``s3://``, ``gs://``, ``https://``) read by ranges.

A :class:`RemotePath` stands where a :class:`pathlib.Path` stands in the readers: it joins, names
and suffixes like a path, so a sharded index's ``directory / shard`` or a DCP folder's files work
unchanged. It has no ``__fspath__``: a local ``open()`` handed a URL fails loudly instead of
opening a file named ``s3:/...``. Its ``str()`` never carries credentials (user:password, a
presigned query), so messages can print it.

:class:`RemoteFile` is the seekable file the readers read through: a few cached windows that grow
on sequential reads (so ``inspect`` of a ``.pt`` is a size request, the head with ``data.pkl`` and
the tail with the zip directory), big reads fetched exactly (in parallel ranges when large), and
every request and byte counted in :data:`STATS` for ``--json``'s ``io``.

Every request reads no further than it asked and ends within a wall-clock limit
(:mod:`ckptool.files.bounded`). The protocols read are :data:`SUPPORTED` (``s3://`` and its Hadoop spellings
``s3a://``/``s3n://``, ``gs://``/``gcs://``, ``http(s)://``, and fsspec's in-process ``memory://``); any
other is refused in one line naming them, before a request is made. :func:`identity` gives an object
one spelling whatever the user typed, so an output is compared with its inputs by what it names.

``s3://``, ``gs://`` and ``http(s)://`` are read and written through obstore (:mod:`.stores`), fsspec serves
only ``memory://``; either is imported only when a URL is used (without them, one line names the extra).
Options, counts and quiet loggers: :mod:`.remote_setup`; the one-line errors: :mod:`.remote_errors`.
"""

from __future__ import annotations

import io
import json
import os
import re
import urllib.parse
from collections import OrderedDict
from collections.abc import Iterator
from pathlib import Path, PurePosixPath
from typing import Any

from ckptool.base.errors import InputError, MissingExtraError
from ckptool.base.text import shown_url
from ckptool.files import bounded, remote_setup
from ckptool.files.remote_errors import S3_NAMES, remote_error, says_missing
from ckptool.files.remote_setup import (
    INSTALL,
    STATS,
    IOStats,
    _filesystems,
    _fsspec,
    _lock,
    _options,
    _quiet_libraries,
    parse_storage_options,
    set_storage_options,
)

__all__ = [
    "INSTALL",
    "LEARNT_SIZES",
    "S3_NAMES",
    "STATS",
    "IOStats",
    "RemoteFile",
    "RemotePath",
    "parse_storage_options",
    "remote_error",
    "set_storage_options",
]

_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.\-]*)://")
READ_ONLY_PROTOCOLS = frozenset({"http", "https"})
LOCAL_PROTOCOLS = frozenset({"file", "local"})  # fsspec's two names for this machine's files: read as paths
# the protocols ckptool reads (each by ranges, bounded) -> the fsspec protocol that serves it
_S3 = dict.fromkeys(("s3", "s3a", "s3n"), "s3")
SUPPORTED = {**_S3, "gs": "gs", "gcs": "gs", "http": "http", "https": "https", "memory": "memory"}
SUPPORTED_SHOWN = "s3:// (s3a://, s3n://), gs:// (gcs://), https://, http:// and local paths (file://)"
SUPPORTED_WRITTEN = "s3:// (s3a://, s3n://), gs:// (gcs://) and local paths (file://)"
_BUCKETED = frozenset({"s3", "gs", "memory"})  # a URL's "host" is the first folder (bucket) of one path
_DEFAULT_PORTS = {"http": 80, "https": 443}


def is_url(value: object) -> bool:
    """True for a :class:`RemotePath` or a string naming a URL other than a local file (``file://``, ``local://``)."""
    if isinstance(value, RemotePath):
        return True
    if not isinstance(value, str):
        return False
    match = _SCHEME.match(value)
    return match is not None and match.group(1).lower() not in LOCAL_PROTOCOLS


def location(value: str | os.PathLike[str] | RemotePath) -> Path | RemotePath:
    """What a user named: a :class:`RemotePath` for a URL, a local :class:`Path` otherwise (``file://``
    and ``local://`` too, percent-decoded)."""
    if isinstance(value, RemotePath):
        return value
    text = os.fspath(value)
    match = _SCHEME.match(text)
    if match is None:
        return Path(text)
    if match.group(1).lower() in LOCAL_PROTOCOLS:
        parsed = urllib.parse.urlparse(text)
        return Path(
            urllib.parse.unquote(parsed.netloc + parsed.path)
            if parsed.netloc not in ("", "localhost")
            else urllib.parse.unquote(parsed.path)
        )
    return RemotePath(text)


def identity(target: str | os.PathLike[str] | RemotePath) -> str:
    """One spelling of what ``target`` names, for telling whether an output is an input: a local path
    (plain, ``file://``, ``local://``) as ``file://`` + its real path (links and ``..`` resolved); a URL
    with its protocol's one name (``s3a``/``s3n`` -> ``s3``, ``gcs`` -> ``gs``), no user or password,
    the host lower-cased without its default port, the path percent-decoded with ``.`` and ``..``
    steps taken and no trailing ``/``, no query or fragment.

    Two spellings of one object always give one identity; two objects may share one only where a
    store would resolve one name to the other (``a/../b``), which is what the comparison must catch.

    Example:
        >>> identity("s3a://Bucket/run/./ckpt.pt/") == identity("s3://bucket/run/ckpt.pt")
        True
    """
    found = location(target) if not isinstance(target, RemotePath) else target
    if not isinstance(found, RemotePath):
        return "file://" + os.path.normcase(os.path.realpath(found))
    parsed = urllib.parse.urlsplit(found.url)
    protocol = SUPPORTED.get(found.protocol, found.protocol)
    host = parsed.netloc.rsplit("@", 1)[-1].lower()
    name, colon, port = host.rpartition(":")
    if colon and port.isdigit() and "]" not in port and int(port) == _DEFAULT_PORTS.get(protocol):
        host = name
    path = urllib.parse.unquote(parsed.path)
    if protocol in _BUCKETED:  # no host: s3:///b/k is s3://b/k, as the filesystem strips it
        path, host = "/" + (host + path).lstrip("/"), ""
    segments: list[str] = []
    for segment in path.split("/")[1:]:  # RFC 3986's dot-segment removal; "a//b" stays (a store's own key)
        if segment == "..":
            if segments:
                segments.pop()
        elif segment != ".":
            segments.append(segment)
    path = ("/" + "/".join(segments)).rstrip("/") if path else ""
    return f"{protocol}://{host}{path[1:] if protocol in _BUCKETED else path}"


class RemotePath:
    """A URL standing where a local path stands: ``/``, ``name``, ``suffix``, ``parent``, ``exists()``..."""

    __slots__ = ("protocol", "_url", "_shown")

    def __init__(self, url: str) -> None:
        match = _SCHEME.match(url)
        if match is None:
            raise ValueError(f"not a URL: {url!r}")
        self.protocol = match.group(1).lower()
        self._url = url.rstrip("/") if url.count("/") > 3 or not url.endswith("://") else url
        self._shown = shown_url(self._url)

    # -- what it is called ------------------------------------------------------------------
    @property
    def url(self) -> str:
        """The full URL, credentials included: for the filesystem, never for messages."""
        return self._url

    def __str__(self) -> str:
        return self._shown

    def __repr__(self) -> str:
        return f"RemotePath({self._shown!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, RemotePath) and other._url == self._url

    def __hash__(self) -> int:
        return hash(("remote", self._url))

    def __lt__(self, other: RemotePath) -> bool:
        return self._url < other._url

    def _split(self) -> tuple[str, str, str]:
        """(scheme://netloc, path without a trailing slash, ?query)."""
        parsed = urllib.parse.urlsplit(self._url)
        query = f"?{parsed.query}" if parsed.query else ""
        return f"{parsed.scheme}://{parsed.netloc}", parsed.path.rstrip("/"), query

    @property
    def name(self) -> str:
        base, path, _ = self._split()
        return PurePosixPath(path).name if path else base.split("://", 1)[1].rsplit("@", 1)[-1]

    @property
    def suffix(self) -> str:
        return PurePosixPath(self.name).suffix

    @property
    def suffixes(self) -> list[str]:
        return PurePosixPath(self.name).suffixes

    @property
    def stem(self) -> str:
        return PurePosixPath(self.name).stem

    @property
    def parent(self) -> RemotePath:
        base, path, _ = self._split()
        if not path or path == "/":
            return self
        return RemotePath(base + str(PurePosixPath(path).parent).rstrip("/"))

    @property
    def parents(self) -> list[RemotePath]:
        found: list[RemotePath] = []
        current = self.parent
        while current != (found[-1] if found else self):
            found.append(current)
            current = current.parent
        return found

    def __truediv__(self, other: str | os.PathLike[str]) -> RemotePath:
        base, path, query = self._split()
        tail = os.fspath(other).strip("/")
        return RemotePath(f"{base}{path}/{tail}{query}" if tail else self._url)

    def with_name(self, name: str) -> RemotePath:
        return self.parent / name

    def with_suffix(self, suffix: str) -> RemotePath:
        return self.parent / (self.stem + suffix)

    def is_relative_to(self, other: object) -> bool:
        return isinstance(other, RemotePath) and (other == self or other in self.parents)

    def resolve(self, strict: bool = False) -> RemotePath:
        return self

    @property
    def identity(self) -> str:
        """What this URL names, whatever its spelling (:func:`identity`)."""
        return identity(self)

    # -- what is there ------------------------------------------------------------------------
    @property
    def read_only(self) -> bool:
        return self.protocol in READ_ONLY_PROTOCOLS

    def filesystem(self) -> tuple[Any, str]:
        """(the fsspec filesystem, the path it knows this object by)."""
        return filesystem_for(self)

    def reading_filesystem(self) -> tuple[Any, str]:
        """(what reads this object: :mod:`.stores`'s light reader where it can stand in for s3fs, else the
        fsspec filesystem; the path it knows this object by)."""
        return reading_filesystem_for(self)

    def info(self) -> dict[str, Any] | None:
        """The store's description (``type``, ``size``), or None when nothing is there."""
        fs, path = self.reading_filesystem()
        try:
            with STATS.request():
                return dict(bounded.call(fs, "info", path))
        except FileNotFoundError as e:
            if says_missing(e):
                return None
            raise remote_error(e, self) from None
        except Exception as e:
            raise remote_error(e, self) from None

    def exists(self) -> bool:
        return self.info() is not None

    def is_dir(self) -> bool:
        info = self.info()
        return info is not None and info.get("type") == "directory"

    def is_file(self) -> bool:
        info = self.info()
        return info is not None and info.get("type") != "directory"

    def size(self) -> int:
        info = self.info()
        if info is None:
            raise InputError("does not exist (404) — check the URL", path=self)
        return int(info.get("size") or 0)

    def listing(self) -> dict[str, bool]:
        """The folder's names -> whether each is a folder (a prefix); empty when nothing is there."""
        fs, path = self.filesystem()
        try:
            with STATS.request():
                entries = bounded.call(fs, "ls", path, detail=True)
        except FileNotFoundError:
            return {}
        except Exception as e:
            raise remote_error(e, self) from None
        prefix = path.rstrip("/") + "/"
        children: dict[str, bool] = {}
        for entry in entries:
            name = str(entry.get("name", "")).rstrip("/") if isinstance(entry, dict) else str(entry).rstrip("/")
            if self.protocol in READ_ONLY_PROTOCOLS:
                name = name.rsplit("/", 1)[-1]
            elif name.startswith(prefix):
                name = name[len(prefix) :]
            else:
                name = name.rsplit("/", 1)[-1]
            if name and name != path.rstrip("/") and "/" not in name:
                children[name] = isinstance(entry, dict) and entry.get("type") == "directory"
        return children

    def iterdir(self) -> Iterator[RemotePath]:
        return iter([self / name for name in self.listing()])

    def glob(self, pattern: str) -> Iterator[RemotePath]:
        """The folder's children whose names match ``pattern`` (one level, case-sensitive, as a local glob)."""
        import fnmatch

        return iter([self / name for name in self.listing() if fnmatch.fnmatchcase(name, pattern)])

    def read_bytes(self) -> bytes:
        with RemoteFile(self) as handle:
            return handle.read()

    def read_text(self, encoding: str = "utf-8") -> str:
        return self.read_bytes().decode(encoding)


# -- filesystems ------------------------------------------------------------------------------


def check_supported(path: RemotePath, *, writing: bool = False) -> str:
    """The fsspec protocol that serves ``path`` (:data:`SUPPORTED`).

    Raises:
        InputError: a chained URL (``zip://a::s3://...``) or a protocol ckptool does not read, naming those it
            does (OutputError, naming those it writes, for an output).
    """
    from ckptool.base.errors import OutputError
    from ckptool.base.suggest import Metavar, option

    kind: type[InputError] | type[OutputError]
    if writing:
        kind, does, step = OutputError, f"writes to {SUPPORTED_WRITTEN}", "write the output to one of them"
    else:
        kind, does, step = InputError, f"reads {SUPPORTED_SHOWN}", "copy the file to one of them"
    if "::" in path.url:
        raise kind(f"chained URLs (a::b) are not supported — ckptool {does}; {step}", path=path)
    protocol = SUPPORTED.get(path.protocol)
    if protocol is None:
        raise kind(f"{path.protocol}:// URLs are not supported — ckptool {does}; {step}", path=path)
    if protocol in _BUCKETED and "@" in path.url.split("://", 1)[1].split("/", 1)[0]:
        raise kind(
            f"{path.protocol}:// URLs carry no user or password — give the store's credentials in the "
            "environment or with " + option("storage_options", Metavar("KEY=VALUE")),
            path=path,
        )
    return protocol


def filesystem_for(path: RemotePath) -> tuple[Any, str]:
    """What serves ``path`` and the path it knows the object by: :mod:`.stores`'s obstore reader for
    ``s3://``, ``gs://`` and ``http(s)://`` (made once per protocol and options), fsspec's filesystem for
    its in-process ``memory://``."""
    protocol = check_supported(path)
    if protocol != "memory":
        return _reader(path, protocol)
    fsspec = _fsspec()
    key = (protocol, json.dumps(_options, sort_keys=True, default=str))
    with _lock:
        fs = _filesystems.get(key)
    if fs is None:
        try:
            fs = fsspec.filesystem(protocol, **_options)
        except (TypeError, ValueError) as e:  # an option this protocol does not take
            raise _option_refusal(path, type(e).__name__) from None
        with _lock:
            _filesystems[key] = fs
    return fs, fs._strip_protocol(path.url)


def _option_refusal(path: RemotePath, what: str) -> InputError:
    from ckptool.base.suggest import Metavar, option

    return InputError(
        f"the storage options are not ones {path.protocol}:// takes ({what}) — "
        "check each " + option("storage_options", Metavar("KEY=VALUE")),
        path=path,
    )


def _reader(path: RemotePath, protocol: str) -> tuple[Any, str]:
    _quiet_libraries()
    try:
        from ckptool.files import stores

        with _lock:
            options = dict(_options)
        reader = stores.reader_for(protocol, options)
    except ImportError as e:
        raise MissingExtraError(
            f"{path.protocol}:// URLs need obstore, which is not installed — {INSTALL}", path=path
        ) from e
    except stores.OptionError as e:
        raise _option_refusal(path, str(e)) from None
    if protocol in ("http", "https"):
        return reader, path.url
    return reader, path.url.split("://", 1)[1].lstrip("/").rstrip("/")


def reading_filesystem_for(path: RemotePath) -> tuple[Any, str]:
    """For reads: the same as :func:`filesystem_for` (kept for its callers)."""
    return filesystem_for(path)


# the sizes the store told of the files this command opened (``inspect``'s file_bytes costs no request)
LEARNT_SIZES: dict[RemotePath, int] = remote_setup.LEARNT_SIZES

# -- reading ------------------------------------------------------------------------------------

READAHEAD = 256 * 1024  # a small read fetches at least this much (the head, the zip directory)
MAX_READAHEAD = 8 * 1024 * 1024  # sequential small reads double the window up to this
PARALLEL_FROM = 32 * 1024 * 1024  # a read this big is fetched as parallel ranges
PART = 8 * 1024 * 1024
KEEP_UP_TO = 2 * 1024 * 1024  # a big read up to this size is kept as a window too
_WINDOWS = 4


class RemoteFile(io.RawIOBase):
    """A remote object read by ranges, as a seekable binary file (``read``, ``seek``, ``readinto``)
    plus positional reads (:meth:`pread`) that leave the position alone."""

    def __init__(self, path: RemotePath, *, size: int | None = None) -> None:
        super().__init__()
        self.path = path
        self.name = str(path)
        self._fs, self._key = path.reading_filesystem()
        if size is None:
            info = path.info()
            if info is None:
                raise InputError("does not exist (404) — check the URL", path=path)
            if info.get("type") == "directory":
                raise InputError("is a folder, not a file", path=path)
            size = int(info.get("size") or 0)
            LEARNT_SIZES[path] = size
        self.size = size
        self._position = 0
        self._windows: OrderedDict[int, bytes] = OrderedDict()  # start -> bytes, most recently used last
        self._readahead = READAHEAD
        self._last_end = -1

    # io.RawIOBase
    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def fileno(self) -> int:
        raise io.UnsupportedOperation(f"{self.name} is remote: it has no file descriptor")

    def tell(self) -> int:
        return self._position

    def seek(self, offset: int, whence: int = 0) -> int:
        if whence == 0:
            position = offset
        elif whence == 1:
            position = self._position + offset
        elif whence == 2:
            position = self.size + offset
        else:
            raise ValueError(f"invalid whence {whence}")
        if position < 0:
            raise OSError(22, "negative seek position")
        self._position = position
        return position

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        data = self.pread(len(view), self._position)
        view[: len(data)] = data
        self._position += len(data)
        return len(data)

    def read(self, size: int | None = -1) -> bytes:
        if size is None or size < 0:
            size = max(0, self.size - self._position)
        data = self.pread(size, self._position)
        self._position += len(data)
        return data

    def readall(self) -> bytes:
        return self.read(-1)

    # positional reads
    def pread(self, size: int, offset: int) -> bytes:
        """Up to ``size`` bytes at ``offset`` (fewer at the end of the object), from a cached window
        when it holds them, else fetched."""
        if offset >= self.size or size <= 0:
            return b""
        end = min(self.size, offset + size)
        for start, data in reversed(self._windows.items()):
            if start <= offset and end <= start + len(data):
                self._windows.move_to_end(start)
                return data[offset - start : end - start]
        for start, data in reversed(self._windows.items()):
            if start <= offset < start + len(data):  # a read that starts in a window: only the rest is fetched
                self._windows.move_to_end(start)
                head = data[offset - start :]
                return head + self.pread(end - offset - len(head), offset + len(head))
        if end - offset >= self._readahead:
            self._last_end = end
            data = self._fetch(offset, end)
            if len(data) <= KEEP_UP_TO:  # a reader's look-ahead (a pickle read by the MiB): kept for what follows
                self._keep(offset, data)
            return data
        # a small read: fetch a window around it, bigger when reads go on where the last ended
        if offset == self._last_end:
            self._readahead = min(MAX_READAHEAD, self._readahead * 2)
        start = offset
        if offset >= self.size - self._readahead:  # near the end: the zip directory, a footer
            start = max(0, self.size - self._readahead)
        stop = min(self.size, max(end, start + self._readahead))
        data = self._fetch(start, stop)
        self._keep(start, data)
        self._last_end = end
        return data[offset - start : end - start]

    def _keep(self, start: int, data: bytes) -> None:
        self._windows[start] = data
        self._windows.move_to_end(start)
        while len(self._windows) > _WINDOWS:
            self._windows.popitem(last=False)

    def cached(self, offset: int, size: int) -> bytes | None:
        """The bytes at ``offset`` when a window already holds them all (no request), else None."""
        end = min(self.size, offset + size)
        for start, data in self._windows.items():
            if start <= offset and end <= start + len(data):
                return data[offset - start : end - start]
        return None

    def pread_ranges(self, ranges: list[tuple[int, int]]) -> list[bytes]:
        """Many small ``(offset, size)`` reads at once: those a window holds from it, the others
        fetched exactly, as parallel ranges in one batch (zip local headers spread over a file)."""
        found: list[bytes | None] = [self.cached(offset, size) for offset, size in ranges]
        wanted = [i for i, data in enumerate(found) if data is None]
        if wanted:
            spans = [(ranges[i][0], min(self.size, ranges[i][0] + ranges[i][1])) for i in wanted]
            pieces = self._get(spans)
            for i, piece in zip(wanted, pieces):
                found[i] = piece
        return [data or b"" for data in found]

    def _get(self, spans: list[tuple[int, int]]) -> list[bytes]:
        """The bytes of each ``[start, end)`` from the store, read no further than asked (:mod:`.bounded`)."""
        try:
            pieces = bounded.get_ranges(self._fs, self._key, spans)
        except InputError:
            raise
        except Exception as e:
            raise remote_error(e, self.path) from None
        STATS.add(requests=len(spans), read=sum(len(piece) for piece in pieces))
        for (start, end), piece in zip(spans, pieces):
            if len(piece) > end - start:  # an in-process store's answer, or a reader that did not stop
                raise InputError(
                    f"the store sent {len(piece)} bytes where {end - start} at {start} were asked — "
                    "refused; check the URL and the store",
                    path=self.path,
                )
        return pieces

    def preadinto(self, view: memoryview, offset: int) -> int:
        data = self.pread(len(view), offset)
        view[: len(data)] = data
        return len(data)

    def _fetch(self, start: int, end: int) -> bytes:
        """Bytes [start, end) from the store: one request, or parallel ranges for a big read."""
        if end - start >= PARALLEL_FROM:
            spans = [(s, min(end, s + PART)) for s in range(start, end, PART)]
        else:
            spans = [(start, end)]
        pieces = self._get(spans)
        data = pieces[0] if len(pieces) == 1 else b"".join(pieces)
        if len(data) != end - start:
            raise InputError.truncated(self.path, f"asked for {end - start} bytes at {start}, got {len(data)}")
        return data

    def iter_chunks(self, offset: int, size: int, chunk_size: int = PART) -> Iterator[bytes]:
        """``size`` bytes at ``offset`` in chunks, fetched one chunk ahead on a thread."""
        from concurrent.futures import ThreadPoolExecutor

        if size <= 0:
            return
        bounds = [(s, min(offset + size, s + chunk_size)) for s in range(offset, offset + size, chunk_size)]
        with ThreadPoolExecutor(max_workers=2) as pool:
            pending = pool.submit(self._fetch, *bounds[0])
            for following in bounds[1:]:
                current, pending = pending, pool.submit(self._fetch, *following)
                yield current.result()
            yield pending.result()
