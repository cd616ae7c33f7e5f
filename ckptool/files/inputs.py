"""Which files an input may open: regular files, and inside a folder only what the folder holds.

A checkpoint folder (sharded safetensors or ``.bin``, a folder with one ``.safetensors``, a DCP
directory) names its other files itself — an index lists shards, ``.metadata`` lists ``.distcp`` files — and
an attacker controls those names and what they are on disk. So a file of a folder input is read
only when, after following links, it is a regular file inside the folder, or — for a Hugging Face
hub cache snapshot (``<repo>/snapshots/<rev>/``, whose files are links to ``../../blobs/<sha>``) —
inside that repo's ``blobs/``. A file named on the command line is the user's choice and may be a
link anywhere, but must still be a regular file.

Files are opened with ``O_NONBLOCK`` and checked with ``fstat`` on the open descriptor, so a FIFO
or device swapped in never blocks the open and is refused by what was actually opened.

A URL (:class:`~ckptool.files.remote.RemotePath`) opens as a :class:`~ckptool.files.remote.RemoteFile` read by
ranges. Object stores have no links or special files: a file of a remote folder must be an object
under the folder's prefix, and it must be there.
"""

from __future__ import annotations

import contextlib
import os
import stat
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO

from ckptool.base.errors import InputError
from ckptool.files.byteio import is_remote, is_url

if TYPE_CHECKING:
    from ckptool.files.remote import RemoteFile, RemotePath


def location(path: str | os.PathLike[str] | RemotePath) -> Path | RemotePath:
    """What the user named, decided once at the edge: a local :class:`Path`, or a URL as a
    :class:`~ckptool.files.remote.RemotePath` (``ckptool.files.remote`` is imported only for a URL)."""
    if isinstance(path, Path) or (isinstance(path, str) and "://" not in path):
        return Path(path)
    from ckptool.files.remote import location as remote_location

    return remote_location(path)


def located(path: str | os.PathLike[str] | RemotePath) -> Path:
    """:func:`location`, typed as the readers and writers take a location: a :class:`Path`. A
    :class:`~ckptool.files.remote.RemotePath` has the ``Path`` methods they call (``name``, ``/``,
    ``exists``, ``is_dir``...), and every open goes through this module, which tells the two apart."""
    return location(path)  # type: ignore[return-value]  # a RemotePath stands in for a Path


def _kind(mode: int) -> str:
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISSOCK(mode):
        return "a socket"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    return "a special file"


def allowed_roots(folder: Path) -> list[Path]:
    """Where links inside ``folder`` may point: the folder itself and, when it lies in a hub cache
    snapshot (``<repo>/snapshots/<rev>/...``), ``<repo>/blobs``."""
    real = Path(os.path.realpath(folder))
    roots = [real]
    for ancestor in (real, *real.parents):
        if ancestor.parent.name == "snapshots" and ancestor.parent.parent != ancestor.parent:
            roots.append(ancestor.parent.parent / "blobs")
            break
    return roots


def _remote_member(
    folder: Path | RemotePath, path: Path | RemotePath, *, what: str, report: Path | RemotePath | None
) -> dict:
    """The store's description of ``path``, a file of the remote ``folder``: it must lie under the
    folder, be there, and be an object (not a prefix)."""
    if not (is_url(folder) and is_url(path) and _lies_under(folder, path)):
        raise InputError(
            f"{what} lies outside the folder — refused (ckptool reads only files inside an input folder)", path=report
        )
    info = path.info()
    if info is None:
        raise InputError(f"{what} is missing — copy every file of the checkpoint", path=report)
    if info.get("type") == "directory":
        raise InputError(
            f"{what} is a directory, not a regular file — refused; replace it with the real file", path=report
        )
    return info


def _lies_under(folder: RemotePath, path: RemotePath) -> bool:
    """Whether the URL ``path`` names an object below ``folder``'s prefix."""
    if not path.is_relative_to(folder) or path == folder:
        return False
    # a store or an HTTP server may resolve "a/../b" to b: no such step is taken
    base, below = folder.url.split("?", 1)[0].rstrip("/"), path.url.split("?", 1)[0]
    return below.startswith(base + "/") and all(
        part not in ("", ".", "..") for part in below[len(base) + 1 :].split("/")
    )


class _RemoteStat:
    """What :func:`check_member` returns for a remote file: its size, as ``st_size``."""

    def __init__(self, size: int) -> None:
        self.st_size = size


def check_member(
    folder: Path | RemotePath, path: Path | RemotePath, *, what: str, report: Path | RemotePath | None = None
) -> os.stat_result:
    """Refuse ``path`` (a file of the input ``folder``) unless it is a regular file whose link
    target, if it is a link, stays inside the folder or, for a hub snapshot, its repo's ``blobs/``.

    Returns the ``stat`` of the file it resolves to. ``what`` names the file in messages (e.g.
    ``"shard model-00001-of-00002.safetensors"``); ``report`` is the path errors are reported
    against (default: ``path``).

    Raises:
        InputError: a link leaving the folder, a FIFO/device/directory, or a missing file.
    """
    where = report if report is not None else path
    if is_url(folder) or is_url(path):
        found = _remote_member(folder, path, what=what, report=where)
        return _RemoteStat(int(found.get("size") or 0))  # type: ignore[return-value]  # its st_size is all that is read
    try:
        link = stat.S_ISLNK(os.lstat(path).st_mode)
    except FileNotFoundError as e:
        raise InputError(f"{what} is missing — copy every file of the checkpoint", path=where) from e
    except OSError as e:
        raise InputError(f"{what} cannot be read ({e.strerror})", path=where) from e
    if link:
        target = Path(os.path.realpath(path))
        roots = allowed_roots(folder)
        if not any(target == root or target.is_relative_to(root) for root in roots):
            where_to = "outside the folder" + (" and outside the hub cache's blobs/" if len(roots) > 1 else "")
            shown = str(target) if len(str(target)) <= 120 else "..." + str(target)[-117:]
            raise InputError(
                f"{what} is a link to {shown}, {where_to} — refused (ckptool reads only files inside "
                "an input folder); copy the file into the folder",
                path=where,
            )
    try:
        info = os.stat(path)
    except FileNotFoundError as e:
        raise InputError(f"{what} is a link to a missing file — copy every file of the checkpoint", path=where) from e
    except OSError as e:
        raise InputError(f"{what} cannot be read ({e.strerror})", path=where) from e
    if not stat.S_ISREG(info.st_mode):
        raise InputError(
            f"{what} is {_kind(info.st_mode)}, not a regular file — refused; replace it with the real file", path=where
        )
    return info


class Remote:
    """What the store says of a URL: whether something is there, a folder (a prefix) or a file, its size."""

    def __init__(self, info: dict | None) -> None:
        self.exists = info is not None
        self.is_dir = info is not None and info.get("type") == "directory"
        self.size = int(info.get("size") or 0) if info is not None and not self.is_dir else None


def describe_remote(path: Path | RemotePath) -> Remote | None:
    """:class:`Remote` for a URL (one request), None for a local path."""
    if not is_remote(path):
        return None
    from ckptool.files.remote import LEARNT_SIZES

    found = Remote(path.info())  # type: ignore[union-attr]
    if found.size is not None:
        LEARNT_SIZES[path] = found.size  # type: ignore[index]
    return found


def open_regular(
    path: Path | RemotePath,
    *,
    what: str | None = None,
    report: Path | RemotePath | None = None,
    size: int | None = None,
) -> BinaryIO:
    """Open ``path`` for reading without ever blocking, and refuse it unless it is a regular file.

    ``O_NONBLOCK`` makes opening a FIFO return at once (no writer needed); ``fstat`` on the open
    descriptor then judges what was opened, with no gap between a check and the open.

    Raises:
        InputError: not a regular file, missing, or unreadable.
    """
    where = report if report is not None else path
    label = f"{what} " if what else ""
    if is_url(path):  # ``size``: what the store said of it already (no second request)
        opened = _open_remote(path, label=label, report=where, size=size)
        return opened  # type: ignore[return-value]  # a RemoteFile reads as a binary file does
    with contextlib.suppress(OSError):  # a device is not even opened (opening some has effects)...
        mode = os.stat(path).st_mode
        if not stat.S_ISREG(mode):
            raise InputError(f"{label}is {_kind(mode)}, not a regular file — not a checkpoint", path=where)
    try:  # ...and what is opened is judged again, by its descriptor: nothing can be swapped in between
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError as e:
        raise InputError(f"{label}does not exist — check the path", path=where) from e
    except PermissionError as e:
        raise InputError(f"{label}cannot be read: permission denied — check the file's permissions", path=where) from e
    except OSError as e:
        raise InputError(f"{label}cannot be read ({e.strerror}) — check the path", path=where) from e
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise InputError(f"{label}is {_kind(mode)}, not a regular file — not a checkpoint", path=where)
        if hasattr(os, "set_blocking"):
            os.set_blocking(fd, True)  # no effect on a regular file's reads; restores ordinary semantics
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def _open_remote(
    path: RemotePath, *, label: str, report: Path | RemotePath | None, size: int | None = None
) -> RemoteFile:
    """A remote file read by ranges; a missing object or a prefix (a folder) refused as a local one is."""
    from ckptool.files.remote import LEARNT_SIZES, RemoteFile

    if size is None:
        info = path.info()
        if info is None:
            raise InputError(f"{label}does not exist (404) — check the URL", path=report)
        if info.get("type") == "directory":
            raise InputError(f"{label}is a directory, not a regular file — not a checkpoint", path=report)
        size = int(info.get("size") or 0)
    LEARNT_SIZES[path] = size
    return RemoteFile(path, size=size)


def open_member(
    folder: Path | RemotePath, path: Path | RemotePath, *, what: str, report: Path | RemotePath | None = None
) -> BinaryIO:
    """:func:`check_member`, then :func:`open_regular`: how every file of a folder input is opened."""
    info = check_member(folder, path, what=what, report=report)
    if is_url(path):  # one request: the size check_member learnt opens it
        where = report if report is not None else path
        opened = _open_remote(path, label=f"{what} ", report=where, size=info.st_size)
        return opened  # type: ignore[return-value]  # a RemoteFile reads as a binary file does
    return open_regular(path, what=what, report=report)
