"""Reading bytes by position: the file cache every multi-file read shares, and exact positional reads.

Every positional read that must get all its bytes goes through :func:`read_exact` or
:func:`read_into`; a file that ends first is one :meth:`InputError.truncated` naming it. A
:class:`FileCache` opens each file once per operation (a diff, a DCP read, a write's small
members) and closes them together, whatever fails in between.

A source is a local file's descriptor or, for a URL (:class:`~ckptool.files.remote.RemotePath`), a
:class:`~ckptool.files.remote.RemoteFile` read by ranges: the functions here take either, so every
reader, copier and comparer reads a remote file through the same calls as a local one.
"""

from __future__ import annotations

import os
import sys
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO, Generic, TypeVar, Union, overload

from ckptool.base.errors import InputError
from ckptool.files.crc import crc32

if TYPE_CHECKING:
    from typing_extensions import TypeIs

    from ckptool.files.remote import RemoteFile, RemotePath

Opened = TypeVar("Opened")
Source = Union[int, "RemoteFile"]  # a local descriptor, or a remote file read by ranges
_REMOTE = "ckptool.files.remote"  # looked up in sys.modules: imported only when a URL is in play


def is_remote(value: object) -> bool:
    """Whether ``value`` is a URL (:class:`~ckptool.files.remote.RemotePath`) or a file read from one.

    :mod:`ckptool.files.remote` is imported only when a URL is used, so a local path never pays for it:
    until then nothing can be remote."""
    remote = sys.modules.get(_REMOTE)
    return remote is not None and isinstance(value, (remote.RemotePath, remote.RemoteFile))


def is_url(value: object) -> TypeIs[RemotePath]:
    """Whether ``value`` is a URL (:class:`~ckptool.files.remote.RemotePath`): :func:`is_remote` for a
    location, which a type checker narrows by."""
    remote = sys.modules.get(_REMOTE)
    return remote is not None and isinstance(value, remote.RemotePath)


def learnt_size(path: object) -> int | None:
    """A URL's size as this command's reading of it learnt it (no request), or None."""
    remote = sys.modules.get(_REMOTE)
    return remote.LEARNT_SIZES.get(path) if remote is not None and isinstance(path, remote.RemotePath) else None


def use_storage_options(options: Mapping[str, Any] | None) -> None:
    """An API call's ``storage_options=``: None keeps the options in force; a mapping replaces them
    for this call and the reads after it (a checkpoint loaded from a URL reads its tensors when used)."""
    if options is not None:
        from ckptool.files.remote import set_storage_options

        set_storage_options(options)


def open_source(path: Path | RemotePath, *, size: int | None = None) -> Source:
    """A read-only descriptor of a local file, or a :class:`RemoteFile` for a URL (``size`` when
    known spares a request)."""
    if is_remote(path):
        from ckptool.files.remote import RemoteFile

        return RemoteFile(path, size=size)  # type: ignore[arg-type]
    return os.open(path, os.O_RDONLY)  # type: ignore[arg-type]


def close_source(source: Source) -> None:
    if not isinstance(source, int):
        source.close()
    else:
        os.close(source)


def file_size(handle: BinaryIO | RemoteFile | int) -> int:
    """The size of an open file: a descriptor, a file object, or a :class:`RemoteFile`."""
    if is_remote(handle):
        return handle.size  # type: ignore[union-attr]
    size = getattr(handle, "size", None)
    if isinstance(size, int) and not hasattr(handle, "fileno"):  # a window onto part of a file
        return size
    return os.fstat(handle if isinstance(handle, int) else handle.fileno()).st_size


def read_capped(handle: BinaryIO, limit: int) -> bytes | None:
    """The rest of ``handle``, or None when that is more than ``limit`` bytes. A remote file's size
    is known before any byte is fetched: one claiming more than the limit costs no download."""
    if is_remote(handle) and handle.size - handle.tell() > limit:  # type: ignore[attr-defined]
        return None
    raw = handle.read(limit + 1)
    return None if len(raw) > limit else raw


def path_size(path: Path | RemotePath, *, learnt: bool = False) -> int:
    """The size of the file at ``path``, local or remote; with ``learnt``, a URL's size as this
    command's reading of it learnt it (no request), where it did.

    Raises:
        OSError: a local file that cannot be stat'ed. InputError: a URL with nothing there.
    """
    if is_remote(path):
        size = learnt_size(path) if learnt else None
        return size if size is not None else path.size()  # type: ignore[union-attr]
    return os.path.getsize(path)  # type: ignore[arg-type]


# the CRC-32 of each whole remote range this process streamed, by (URL, offset, length): a write's
# check of its source takes them instead of downloading the bytes a second time
RANGE_CRCS: dict[tuple[RemotePath, int, int], int] = {}
_SHARED: OrderedDict[RemotePath, tuple[RemoteFile, threading.Lock]] = OrderedDict()
_SHARED_LOCK = threading.Lock()
_SHARED_FILES = 2  # remote files whose windows serve small ranges (a bias, a norm) across tensors
SMALL_RANGE = 1 << 20
_FETCH = 4 << 20  # a big remote range is fetched in parts of this size, one part ahead (memory: ~4 parts)


def _shared(path: RemotePath) -> tuple[RemoteFile, threading.Lock]:
    with _SHARED_LOCK:
        found = _SHARED.pop(path, None)
        if found is None:
            from ckptool.files.remote import RemoteFile

            found = (RemoteFile(path, size=learnt_size(path)), threading.Lock())
            while len(_SHARED) >= _SHARED_FILES:
                _SHARED.popitem(last=False)
        _SHARED[path] = found
        return found


def forget_windows() -> None:
    """Drop the shared windows of remote files: a read that starts (a load) sees the objects as they are now."""
    with _SHARED_LOCK:
        _SHARED.clear()


def forget_remote() -> None:
    """Drop what this process remembers of remote files (their windows and range CRCs)."""
    forget_windows()
    RANGE_CRCS.clear()


def iter_range(path: Path | RemotePath, offset: int, size: int, chunk_size: int) -> Iterator[bytes]:
    """``size`` bytes of ``path`` at ``offset`` in chunks. A URL's small range comes from a window
    shared by the ranges around it (one request for many small tensors), a big one in chunks fetched
    one ahead; either is summed as it streams (:data:`RANGE_CRCS`).

    Raises:
        InputError: the file ends first.
    """
    if is_remote(path):
        remote, lock = _shared(path)  # type: ignore[arg-type]
        crc = 0
        if size <= SMALL_RANGE:
            with lock:
                data = remote.pread(size, offset)
            if len(data) < size:
                raise InputError.truncated(path)
            RANGE_CRCS[(path, offset, size)] = crc32(data)  # type: ignore[index]
            yield data
            return
        part = _FETCH  # fetched by the part (a request per few MiB; memory: two parts), handed on by the chunk
        for fetched in remote.iter_chunks(offset, size, part):
            crc = crc32(fetched, crc)
            if len(fetched) <= chunk_size:
                yield fetched
                continue
            for start in range(0, len(fetched), chunk_size):
                yield fetched[start : start + chunk_size]
        RANGE_CRCS[(path, offset, size)] = crc  # type: ignore[index]
        return
    with open(path, "rb", buffering=0) as handle:  # type: ignore[arg-type]
        handle.seek(offset)
        remaining = size
        while remaining:
            data = handle.read(min(chunk_size, remaining))
            if not data:
                raise InputError.truncated(path)
            remaining -= len(data)
            yield data


class FileCache(Generic[Opened]):
    """Files opened once each, by path, for one operation; :meth:`close` (or leaving a ``with``) closes them all.

    By default it holds read-only descriptors (``os.open``), or :class:`RemoteFile` for URLs
    (:func:`open_source`); ``opener``/``closer`` give it other
    handles (a DCP read opens its data files through :func:`ckptool.files.inputs.open_member`). With a
    ``limit``, at most that many stay open (a DCP directory can hold a file per rank): the least
    recently used is closed and reopened when asked for again, so ask for a file at each read and
    never keep what :meth:`get` returned across a yield — another reader may have closed it meanwhile.
    """

    @overload
    def __init__(self: FileCache[Source], *, limit: int | None = 32) -> None: ...

    @overload
    def __init__(
        self, opener: Callable[[Path], Opened], closer: Callable[[Opened], Any], *, limit: int | None = 32
    ) -> None: ...

    def __init__(
        self,
        opener: Callable[[Path], Any] = open_source,
        closer: Callable[[Any], Any] = close_source,
        *,
        limit: int | None = 32,
    ) -> None:
        self._opened: dict[Path, Opened] = {}
        self._opener = opener
        self._closer = closer
        self._limit = limit

    def get(self, path: Path) -> Opened:
        """The open file at ``path``, opened now if it is not open yet."""
        opened = self._opened.pop(path, None)
        if opened is None:
            if self._limit is not None and len(self._opened) >= self._limit:
                self._closer(self._opened.pop(next(iter(self._opened))))
            opened = self._opener(path)
        self._opened[path] = opened  # the most recently used last
        return opened

    def close(self) -> None:
        """Close every file (idempotent)."""
        opened, self._opened = self._opened, {}
        for item in opened.values():
            self._closer(item)

    def __enter__(self) -> FileCache[Opened]:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def pread_into(fd: Source, view: memoryview, offset: int) -> int:
    """One positional read into ``view``: the bytes read, fewer at the end of the file, 0 past it."""
    if not isinstance(fd, int):  # a RemoteFile
        return fd.preadinto(view, offset)
    if hasattr(os, "preadv"):
        return os.preadv(fd, [view], offset)
    data = os.pread(fd, len(view), offset)  # platforms without preadv
    view[: len(data)] = data
    return len(data)


def read_into(fd: Source, view: memoryview, offset: int, path: Path) -> None:
    """Fill ``view`` with the bytes of ``fd`` at ``offset``.

    Raises:
        InputError: the file (``path``, for the message) ends first.
    """
    filled = 0
    while filled < len(view):
        got = pread_into(fd, view[filled:], offset + filled)
        if not got:
            raise InputError.truncated(path)
        filled += got


def read_exact(fd: Source, offset: int, size: int, path: Path) -> bytes:
    """``size`` bytes of ``fd`` at ``offset`` (a small piece: one read in the usual case).

    Raises:
        InputError: the file (``path``, for the message) ends first.
    """
    if not isinstance(fd, int):  # a RemoteFile
        data = fd.pread(size, offset)
        if len(data) < size:
            raise InputError.truncated(path)
        RANGE_CRCS[(fd.path, offset, size)] = crc32(data)
        return data
    data = os.pread(fd, size, offset)
    while len(data) < size:
        more = os.pread(fd, size - len(data), offset + len(data))
        if not more:
            raise InputError.truncated(path)
        data += more
    return data
