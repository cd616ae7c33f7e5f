"""Atomic, never-clobbering writes.

Every file ckptool writes goes through :func:`atomic_output`: a temp file in the target's own
directory (so ``os.replace`` is a rename on one filesystem), fsync'd, then moved into place.
On any error — including KeyboardInterrupt — the temp file is removed and the target is as it was.
"""

from __future__ import annotations

import contextlib
import errno
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

from .errors import OutputError

TEMP_PREFIX = ".ckptool-tmp-"


def same_file(a: Path, b: Path) -> bool:
    """True if ``a`` and ``b`` name the same file (same path, symlink or hard link)."""
    try:
        return os.path.samefile(a, b)
    except OSError:
        return os.path.abspath(a) == os.path.abspath(b)


def check_output(out: Path, *, inputs: tuple[Path, ...] = (), force: bool = False, in_place: bool = False) -> None:
    """Refuse an output that would clobber a file or overwrite an input unless asked.

    Raises:
        OutputError: ``out`` exists without ``force``, or is one of ``inputs`` without ``in_place``.
    """
    for source in inputs:
        if out.exists() and same_file(out, source):
            if not in_place:
                raise OutputError(
                    "is the input file; refusing to overwrite it — write elsewhere with -o, or pass --in-place",
                    path=out,
                )
            return
    if in_place:
        raise OutputError("--in-place given but the output is not the input — drop --in-place", path=out)
    if out.is_dir():  # replacing a directory deletes what is in it
        root = out.resolve()
        for source in inputs:
            if root in Path(source).resolve().parents:
                raise OutputError(f"is a directory holding the input {source} — replacing it would delete the input; "
                                  "choose another -o", path=out)
    if out.exists() and not force:
        raise OutputError("already exists — pass --force to overwrite it, or choose another -o", path=out)
    parent = out.parent if str(out.parent) else Path(".")
    if not parent.is_dir():
        raise OutputError(f"directory {parent} does not exist — create it first", path=out)


def _os_error_message(error: OSError) -> str:
    if error.errno == errno.ENOSPC:
        return "no space left on device — free space or write elsewhere; nothing was written"
    if error.errno == errno.EFBIG:
        return "file too large for this filesystem or limit — write elsewhere; nothing was written"
    if error.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return "permission denied (read-only or not writable) — choose a writable directory; nothing was written"
    return f"{error.strerror or error} — nothing was written"


def fsync_dir(directory: Path) -> None:
    """Make a rename in ``directory`` durable (best effort on filesystems that refuse it)."""
    with contextlib.suppress(OSError):
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


@contextlib.contextmanager
def atomic_output(out: Path) -> Iterator[tuple[BinaryIO, Path]]:
    """Yield ``(file, temp_path)`` for writing ``out``; on success fsync and rename into place.

    The caller may re-read ``temp_path`` (e.g. to check its fingerprint) before the block ends;
    raising inside the block discards the temp file.
    """
    out = Path(out)
    directory = out.parent if str(out.parent) else Path(".")
    try:
        fd, tmp_name = tempfile.mkstemp(prefix=TEMP_PREFIX, suffix=".part", dir=directory)
    except OSError as e:
        raise OutputError(_os_error_message(e), path=out) from e
    tmp = Path(tmp_name)
    try:
        with os.fdopen(fd, "w+b") as handle:
            yield handle, tmp
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(tmp, 0o644 & ~_umask())
        os.replace(tmp, out)
        fsync_dir(directory)
    except OSError as e:
        _unlink_quietly(tmp)
        raise OutputError(_os_error_message(e), path=out) from e
    except BaseException:
        _unlink_quietly(tmp)
        raise


@contextlib.contextmanager
def atomic_directory(out: Path) -> Iterator[Path]:
    """Yield a temp directory beside ``out``; on success it replaces ``out`` (a directory) atomically."""
    out = Path(out)
    parent = out.parent if str(out.parent) else Path(".")
    try:
        tmp = Path(tempfile.mkdtemp(prefix=TEMP_PREFIX, dir=parent))
    except OSError as e:
        raise OutputError(_os_error_message(e), path=out) from e
    try:
        yield tmp
        for child in tmp.iterdir():
            with open(child, "rb+") as handle:
                os.fsync(handle.fileno())
        os.chmod(tmp, 0o755 & ~_umask() | 0o700)
        if out.exists():
            # a directory cannot be os.replace'd onto a non-empty one: move the old one aside first
            old = Path(tempfile.mkdtemp(prefix=TEMP_PREFIX, dir=parent))
            os.rmdir(old)
            os.replace(out, old)
            os.replace(tmp, out)
            if old.is_dir() and not old.is_symlink():
                _rmtree_quietly(old)
            else:  # the output was a file or a link: remove it, not what it points to
                _unlink_quietly(old)
        else:
            os.replace(tmp, out)
        fsync_dir(parent)
    except OSError as e:
        _rmtree_quietly(tmp)
        raise OutputError(_os_error_message(e), path=out) from e
    except BaseException:
        _rmtree_quietly(tmp)
        raise


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _unlink_quietly(path: Path) -> None:
    with contextlib.suppress(OSError):
        os.unlink(path)


def _rmtree_quietly(path: Path) -> None:
    import shutil

    shutil.rmtree(path, ignore_errors=True)
