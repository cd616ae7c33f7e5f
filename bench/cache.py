"""Page-cache control around a measurement: evict an input (a cold run), warm it, ask how much is cached."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from .measure import MIB, REPO


def drop_caches_allowed() -> bool:
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("1")
        return True
    except OSError:
        return False


def evict(paths: list[Path], method: str, python: str, env: dict[str, str]) -> None:
    """Make ``paths`` cold in the page cache (untimed)."""
    if method == "drop_caches":
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("1")
        # drop_caches also evicts the interpreter, torch's shared libraries and ckptool's own files;
        # read those back so that only the checkpoint is cold
        subprocess.run([python, "-c", "import torch, safetensors.torch, ckptool.cli.main"], env=env, cwd=REPO,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        subprocess.run(["sh", "-c", "cp --version; sync --version; cat --version"], stdout=subprocess.DEVNULL)
        return
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def cached_fraction(path: Path) -> float | None:
    """Fraction of ``path``'s pages in the page cache (mincore), None where that cannot be asked."""
    try:
        import ctypes
        import mmap

        size = path.stat().st_size
        if size == 0:
            return 1.0
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
        page = mmap.PAGESIZE
        pages = (size + page - 1) // page
        with open(path, "rb") as f:
            addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, f.fileno(), 0)
            if addr in (None, ctypes.c_void_p(-1).value):
                return None
            try:
                vec = ctypes.create_string_buffer(pages)
                if libc.mincore(addr, size, vec) != 0:
                    return None
                return sum(b & 1 for b in vec.raw) / pages
            finally:
                libc.munmap(addr, size)
    except (OSError, AttributeError, ValueError):
        return None


def warm(paths: list[Path]) -> None:
    for p in paths:
        with open(p, "rb", buffering=0) as f:
            buf = bytearray(8 * MIB)
            while f.readinto(buf):
                pass



def rewarm(paths: list[Path]) -> float | None:
    """Warm ``paths`` again where reclaim evicted them (untimed); the fraction cached, None where unknown.

    Memory reclaim (this VM runs DAMON pageout) evicts page cache between runs, so a warm run
    checks its input first.
    """
    fraction = cached(paths)
    for _ in range(3):
        if fraction is None or fraction >= 0.99:
            break
        warm(paths)
        fraction = cached(paths)
    return fraction


def cached(paths: list[Path]) -> float | None:
    """The smallest cached fraction over ``paths``; None where any cannot be asked."""
    fractions = [cached_fraction(p) for p in paths]
    return None if None in fractions else min(fractions)
