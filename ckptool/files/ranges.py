"""Byte ranges of files: where a tensor's bytes lie, streamed in bounded chunks."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from ckptool.base.errors import InputError
from ckptool.files.byteio import iter_range, read_into

CHUNK_SIZE = 8 * 1024 * 1024


@dataclass(slots=True)
class ByteRange:
    """``length`` bytes of ``path`` starting at ``offset``; ``crc32`` when the container recorded one."""

    path: Path
    offset: int
    length: int
    crc32: int | None = None

    def iter_chunks(self, start: int = 0, size: int | None = None, chunk_size: int = CHUNK_SIZE) -> Iterator[bytes]:
        """Stream ``size`` bytes at ``start`` in chunks (bounded memory; a URL's fetched a chunk ahead)."""
        size = self.length - start if size is None else size
        if start < 0 or size < 0 or start + size > self.length:
            raise InputError(f"read of {size} bytes at {start} is outside a {self.length}-byte range", path=self.path)
        if size == 0:
            return
        yield from iter_range(self.path, self.offset + start, size, chunk_size)

    def iter_reused(self, start: int = 0, size: int | None = None, chunk_size: int = CHUNK_SIZE) -> Iterator[bytearray]:
        """Like :meth:`iter_chunks`, reading into one reused buffer: each chunk is valid only until
        the next is requested. For consumers that hash or compare a chunk and drop it — fresh 8 MB
        allocations per chunk cost more page faults than the read itself."""
        size = self.length - start if size is None else size
        if start < 0 or size < 0 or start + size > self.length:
            raise InputError(f"read of {size} bytes at {start} is outside a {self.length}-byte range", path=self.path)
        if size == 0:
            return
        if not isinstance(self.path, Path):  # a URL: its chunks, fetched one ahead (each a fresh buffer)
            for chunk in self.iter_chunks(start, size, chunk_size):
                yield bytearray(chunk)
            return
        buffer = bytearray(min(chunk_size, size))
        fd = os.open(self.path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))  # no file object: small ranges are many
        try:
            position, remaining = self.offset + start, size
            while remaining:
                if remaining < len(buffer):
                    buffer = bytearray(remaining)
                read_into(fd, memoryview(buffer), position, self.path)
                position += len(buffer)
                remaining -= len(buffer)
                yield buffer
        finally:
            os.close(fd)


class LazyByteRange(ByteRange):
    """A :class:`ByteRange` whose offset is worked out when first asked for (a remote zip member's
    data offset, which needs its local header): ``resolve()`` returns it, or raises why it cannot."""

    def __init__(
        self,
        path: Path,
        offset: int | None,
        length: int,
        crc32: int | None = None,
        *,
        resolve: Callable[[], int] | None = None,
    ) -> None:
        self._resolve = resolve
        self._offset = offset
        self.path, self.length, self.crc32 = path, length, crc32

    @property
    def offset(self) -> int:
        if self._offset is None:
            assert self._resolve is not None
            self._offset = self._resolve()
        return self._offset

    @offset.setter
    def offset(self, value: int) -> None:
        self._offset = value
