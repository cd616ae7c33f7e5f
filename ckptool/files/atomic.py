"""Atomic, never-clobbering writes.

Every file ckptool writes goes through :func:`atomic_output`: a temp file in the target's own
directory (so ``os.replace`` is a rename on one filesystem), fsync'd, then moved into place.
On any error — including KeyboardInterrupt — the temp file is removed and the target is as it was.
"""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import tempfile
import threading
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, BinaryIO

from ckptool.base.errors import OutputError
from ckptool.base.suggest import option

TEMP_PREFIX = ".ckptool-tmp-"
# the option is named as the caller passes it: a flag on the command line, a keyword in the API
_NOT_THE_INPUT = option("in_place") + " given but the output is not the input — drop " + option("in_place")


def same_file(a: Path, b: Path) -> bool:
    """True if ``a`` and ``b`` name the same file (same path, symlink or hard link); a URL is only ever itself."""
    if not isinstance(a, (str, os.PathLike)) or not isinstance(b, (str, os.PathLike)):
        return a == b
    try:
        return os.path.samefile(a, b)
    except OSError:
        return os.path.abspath(a) == os.path.abspath(b)


def exists_refusal(out: Any) -> OutputError:
    """The refusal of an output that exists, without ``force`` (a local path or a URL)."""
    return OutputError(
        "already exists — pass " + option("force") + " to overwrite it, or choose another " + option("out", None),
        path=out,
    )


def is_input_refusal(out: Any, *, in_place: bool = True) -> OutputError:
    """The refusal of an output that is the input file, without ``in_place`` (offered only where it
    can be given: a local file; a URL is never rewritten in place)."""
    if not in_place:
        return OutputError(
            "is the input file; refusing to overwrite it — write elsewhere with " + option("out", None), path=out
        )
    return OutputError(
        "is the input file; refusing to overwrite it — write elsewhere with "
        + option("out", None)
        + ", or pass "
        + option("in_place"),
        path=out,
    )


def folder_holds_refusal(out: Any, writes: list[str], existing: list[str]) -> OutputError:
    """The refusal of a folder output holding ``existing`` files of the set it ``writes``, without ``force``."""
    # the last file written (an index) names the earlier set best
    shown = writes[-1] if writes and writes[-1] in existing else existing[0]
    return OutputError(
        f"already holds {shown}{' and more of its files' if len(existing) > 1 else ''} "
        "— pass " + option("force") + " to replace the earlier set (only its shards and index; "
        "nothing else in the folder is touched), or choose another " + option("out", None),
        path=out,
    )


def _local(inputs: tuple[Path, ...]) -> tuple[Path, ...]:
    return tuple(source for source in inputs if isinstance(source, (str, os.PathLike)))


def check_output(out: Path, *, inputs: tuple[Path, ...] = (), force: bool = False, in_place: bool = False) -> None:
    """Refuse an output that would clobber a file or overwrite an input unless asked.

    Raises:
        OutputError: ``out`` exists without ``force``, or is one of ``inputs`` without ``in_place``.
    """
    inputs = _local(inputs)  # a URL input is never a local output
    for source in inputs:
        if out.exists() and same_file(out, source):
            if not in_place:
                raise is_input_refusal(out)
            return
    if in_place:
        raise OutputError(_NOT_THE_INPUT, path=out)
    if out.is_dir():  # replacing a directory deletes what is in it
        root = out.resolve()
        for source in inputs:
            if root in Path(source).resolve().parents:
                raise OutputError(
                    f"is a directory holding the input {source} — replacing it would delete the input; "
                    "choose another " + option("out", None),
                    path=out,
                )
    if out.exists() and not force:
        raise exists_refusal(out)
    parent = out.parent if str(out.parent) else Path(".")
    if not parent.is_dir():
        raise OutputError(f"directory {parent} does not exist — create it first", path=out)


def check_folder_output(
    out: Path,
    *,
    writes: list[str],
    removes: list[str],
    inputs: tuple[Path, ...] = (),
    force: bool = False,
    in_place: bool = False,
) -> None:
    """Refuse a folder output that would replace an input or an earlier set without ``force``.

    A folder output replaces only the files it ``writes`` and ``removes`` (its shards and index,
    an earlier set's shards); everything else in the folder is left alone, so only those names
    are judged.

    Raises:
        OutputError: a file it replaces is an input (without ``in_place``), is a directory, or
            exists without ``force``; or ``out`` is not a folder and exists without ``force``.
    """
    inputs = _local(inputs)
    if not out.is_dir():
        check_output(out, inputs=inputs, force=force, in_place=in_place)
        return
    output_is_input = any(same_file(out, source) for source in inputs if os.path.lexists(source))
    if output_is_input and not in_place:
        raise OutputError(
            "is the input folder; refusing to rewrite it — write elsewhere with "
            + option("out", None)
            + ", or pass "
            + option("in_place"),
            path=out,
        )
    if in_place and not output_is_input:
        raise OutputError(_NOT_THE_INPUT, path=out)
    existing = []
    for name in [*writes, *removes]:
        path = out / name
        if not os.path.lexists(path):
            continue
        if path.is_dir() and not path.is_symlink():
            raise OutputError(
                f"{name} in it is a directory, where the output writes a file — move it away, or "
                "choose another " + option("out", None),
                path=out,
            )
        for source in inputs:
            if not in_place and os.path.lexists(source) and same_file(path, source):
                raise OutputError(
                    f"holds the input {source} as {name}, which this output would replace — "
                    "choose another " + option("out", None),
                    path=out,
                )
        existing.append(name)
    if existing and not force and not in_place:  # --in-place is the ask to replace the input's own set
        raise folder_holds_refusal(out, writes, existing)


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
    with _removed_on_failure(out, tmp, _unlink_quietly):
        with os.fdopen(fd, "w+b") as handle:
            yield handle, tmp
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(tmp, 0o644 & ~_umask())
        os.replace(tmp, out)
        fsync_dir(directory)


@contextlib.contextmanager
def _removed_on_failure(
    out: Path, tmp: Path, remove: Callable[[Path], None], *, keep: tuple[type[BaseException], ...] = ()
) -> Iterator[None]:
    """``remove(tmp)`` if the block fails — unless by one of ``keep`` (whose handler needs what ``tmp``
    holds). An OS error becomes an OutputError naming ``out``."""
    try:
        yield
    except keep:
        raise
    except OSError as e:
        remove(tmp)
        raise OutputError(_os_error_message(e), path=out) from e
    except BaseException:
        remove(tmp)
        raise


Rename = Callable[[Path, Path], None]


@contextlib.contextmanager
def signals_deferred() -> Iterator[None]:
    """Hold Ctrl-C and SIGTERM until the block ends, so a few renames that must happen together do.

    A signal that arrives meanwhile is delivered when the block is left (raising there as usual).
    Outside the main thread Python cannot change handlers, and the block runs unprotected.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    pending: list[tuple[int, Any]] = []
    wanted: list[int] = [signal.SIGINT, signal.SIGTERM]
    previous = {signum: signal.getsignal(signum) for signum in wanted}
    for signum in wanted:
        signal.signal(signum, lambda signum, frame: pending.append((signum, frame)))
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        for signum, frame in pending[:1]:
            handler = previous[signum]
            if callable(handler):
                handler(signum, frame)
            elif handler == signal.SIG_DFL and signum == signal.SIGINT:
                raise KeyboardInterrupt
            elif handler == signal.SIG_DFL:
                raise SystemExit(128 + signum)


def _fsync_files(directory: Path) -> None:
    """Every file below ``directory`` on disk, and every sub-folder's entries (a folder output may be a
    tree: a model folder's components); links are not followed."""
    for child in directory.iterdir():
        if child.is_symlink():
            continue
        if child.is_dir():
            _fsync_files(child)
            fsync_dir(child)
        elif child.is_file():
            with open(child, "rb+") as handle:
                os.fsync(handle.fileno())


@contextlib.contextmanager
def _temp_folder(out: Path, inside: Path, *, keep: tuple[type[BaseException], ...] = ()) -> Iterator[Path]:
    """A new temp folder in ``inside`` for the output ``out``, removed if the block fails — unless by one
    of ``keep`` (whose handler needs what it holds). An OS error becomes an OutputError naming ``out``."""
    try:
        tmp = Path(tempfile.mkdtemp(prefix=TEMP_PREFIX, dir=inside))
    except OSError as e:
        raise OutputError(_os_error_message(e), path=out) from e
    with _removed_on_failure(out, tmp, _rmtree_quietly, keep=keep):
        yield tmp


@contextlib.contextmanager
def atomic_directory(out: Path, *, rename: Rename = os.replace) -> Iterator[Path]:
    """Yield a temp directory beside ``out``; on success it takes ``out``'s place in one rename.

    Whatever was at ``out`` (a file, a link, an empty or earlier folder) is moved aside first — a
    directory cannot be renamed onto a non-empty one — and removed only once the new folder is in
    place; if that last rename fails, it is put back. ``rename`` is the rename to use (a seam for
    tests that make it fail).
    """
    out = Path(out)
    parent = out.parent if str(out.parent) else Path(".")
    with _temp_folder(out, parent) as tmp:
        yield tmp
        _fsync_files(tmp)
        os.chmod(tmp, 0o755 & ~_umask() | 0o700)
        if os.path.lexists(out):
            old = Path(tempfile.mkdtemp(prefix=TEMP_PREFIX, dir=parent))
            os.rmdir(old)
            with signals_deferred():
                rename(out, old)
                try:
                    rename(tmp, out)
                except BaseException:
                    rename(old, out)  # the previous output goes back where it was
                    raise
            if old.is_dir() and not old.is_symlink():
                _rmtree_quietly(old)
            else:  # the output was a file or a link: remove it, not what it points to
                _unlink_quietly(old)
        else:
            rename(tmp, out)
        fsync_dir(parent)


@contextlib.contextmanager
def update_directory(
    out: Path, *, last: str, remove: Iterable[str] = (), rename: Rename = os.replace
) -> Iterator[Path]:
    """Yield a temp folder inside the existing folder ``out``; on success move what was written
    there into ``out``, replacing only files of the same names, then remove the files ``remove``
    names. Nothing else in ``out`` is touched.

    Order (what a crash at any point leaves): the file ``last`` (an index that makes the set
    readable) is moved aside before anything else and put in place after everything else, so a
    reader never sees the old index beside new files; the files replaced wait in the temp folder
    (``.ckptool-tmp-*/previous/``) until the new set is in place. If a rename fails, every moved
    file is put back as it was. ``remove`` (an earlier set's files no longer written) goes last,
    after the new ``last`` is in place.
    """
    out = Path(out)
    try:
        with _temp_folder(out, out, keep=(_PartlyUndone,)) as staging:
            yield staging
            _fsync_files(staging)
            names = sorted(p.name for p in staging.iterdir() if p.name != last)
            if (staging / last).exists():
                names.append(last)
            previous = staging / "previous"
            previous.mkdir()
            with signals_deferred():
                _move_in(staging, out, names, last, previous, rename)
                fsync_dir(out)
                for name in remove:
                    if name not in names and os.path.lexists(out / name) and not (out / name).is_dir():
                        _unlink_quietly(out / name)  # a link is removed, never what it points to
                fsync_dir(out)
            _rmtree_quietly(staging)
    except _PartlyUndone as e:  # the temp folder is kept: it holds files that could not be put back
        raise OutputError(f"{e} — they are in {staging / 'previous'}; move them back by hand", path=out) from e.cause


class _PartlyUndone(Exception):
    def __init__(self, message: str, cause: BaseException) -> None:
        super().__init__(message)
        self.cause = cause


def _move_in(staging: Path, out: Path, names: list[str], last: str, previous: Path, rename: Rename) -> None:
    """Move ``names`` from ``staging`` into ``out`` (``last`` aside first, in last); undo on failure."""
    moved_aside: list[str] = []
    moved_in: list[str] = []
    try:
        if last in names and os.path.lexists(out / last):
            rename(out / last, previous / last)
            moved_aside.append(last)
        for name in names:
            if name not in moved_aside and os.path.lexists(out / name):
                rename(out / name, previous / name)
                moved_aside.append(name)
            rename(staging / name, out / name)
            moved_in.append(name)
    except BaseException as e:
        stuck = []
        for name in reversed(moved_in):  # undo: the folder is left exactly as it was
            try:
                rename(out / name, staging / name)
            except OSError:
                stuck.append(name)
        for name in moved_aside:
            try:
                rename(previous / name, out / name)
            except OSError:
                stuck.append(name)
        if stuck:
            raise _PartlyUndone(
                f"the write failed ({e}) and {len(stuck)} earlier file(s) could not be put back "
                f"({', '.join(stuck[:3])})",
                e,
            ) from e
        raise


def folder_output(
    out: Path, *, last: str, remove: Iterable[str] = (), rename: Rename = os.replace
) -> contextlib.AbstractContextManager[Path]:
    """Where a folder output is written: into an existing folder file by file
    (:func:`update_directory`), or as a new folder in one rename (:func:`atomic_directory`)."""
    if out.is_dir():
        return update_directory(out, last=last, remove=remove, rename=rename)
    return atomic_directory(out, rename=rename)


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
