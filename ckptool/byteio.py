"""Reading bytes by position: the file cache every multi-file read shares, and exact positional reads.

Every positional read that must get all its bytes goes through :func:`read_exact` or
:func:`read_into`; a file that ends first is one :meth:`InputError.truncated` naming it. A
:class:`FileCache` opens each file once per operation (a diff, a DCP read, a write's small
members) and closes them together, whatever fails in between.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, Generic, TypeVar

from .errors import InputError

Opened = TypeVar("Opened")


def _open_descriptor(path: Path) -> int:
    return os.open(path, os.O_RDONLY)


class FileCache(Generic[Opened]):
    """Files opened once each, by path, for one operation; :meth:`close` (or leaving a ``with``) closes them all.

    By default it holds read-only descriptors (``os.open``); ``opener``/``closer`` give it other
    handles (a DCP read opens its data files through :func:`ckptool.inputs.open_member`). With a
    ``limit``, at most that many stay open (a DCP directory can hold a file per rank): the least
    recently used is closed and reopened when asked for again, so ask for a file at each read and
    never keep what :meth:`get` returned across a yield — another reader may have closed it meanwhile.
    """

    def __init__(self, opener: Callable[[Path], Opened] = _open_descriptor,  # type: ignore[assignment]
                 closer: Callable[[Opened], Any] = os.close, *, limit: int | None = 32) -> None:
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


def pread_into(fd: int, view: memoryview, offset: int) -> int:
    """One positional read into ``view``: the bytes read, fewer at the end of the file, 0 past it."""
    if hasattr(os, "preadv"):
        return os.preadv(fd, [view], offset)
    data = os.pread(fd, len(view), offset)  # platforms without preadv
    view[:len(data)] = data
    return len(data)


def read_into(fd: int, view: memoryview, offset: int, path: Path) -> None:
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


def read_exact(fd: int, offset: int, size: int, path: Path) -> bytes:
    """``size`` bytes of ``fd`` at ``offset`` (a small piece: one read in the usual case).

    Raises:
        InputError: the file (``path``, for the message) ends first.
    """
    data = os.pread(fd, size, offset)
    while len(data) < size:
        more = os.pread(fd, size - len(data), offset + len(data))
        if not more:
            raise InputError.truncated(path)
        data += more
    return data
