"""A URL output before its bytes: the refusals a local output gets (an existing object without ``--force``, the
input itself, a folder's files), made against the store, and the private local staging folder the write goes
through (:func:`staged`)."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

from ckptool.base.errors import CkptError, InputError, OutputError, UsageError
from ckptool.base.suggest import option
from ckptool.files.atomic import exists_refusal, folder_holds_refusal, is_input_refusal
from ckptool.files.remote import STATS, RemotePath, check_supported, remote_error

STAGING_PREFIX = "ckptool-staging-"
S3_PROTOCOLS = ("s3", "s3a", "s3n")


def staging_root() -> str | None:
    """Where staging folders are made: ``$CKPTOOL_STAGING_DIR``, else the system's temp folder (None)."""
    return os.environ.get("CKPTOOL_STAGING_DIR") or None


@contextlib.contextmanager
def staged(out: RemotePath) -> Iterator[Path]:
    """A local path named like ``out`` in a new private folder, for the checked write; the folder is
    removed when the block ends, whatever happens."""
    root = staging_root()
    try:
        folder = Path(tempfile.mkdtemp(prefix=STAGING_PREFIX, dir=root))
    except OSError as e:
        raise OutputError(
            f"cannot make a staging folder in {root or tempfile.gettempdir()} ({e.strerror or e}) "
            "— set CKPTOOL_STAGING_DIR to a writable local folder with room for the output; "
            "nothing was written",
            path=out,
        ) from e
    try:
        yield folder / (out.name or "output")
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def named_for_user(error: CkptError, staged_path: Path, out: RemotePath) -> CkptError:
    """``error`` from the staged write, naming ``out`` where it named the staging path (a private detail)."""
    shown = str(staged_path)
    text = error.message.replace(shown, str(out))
    if shown not in error.message and error.path is not None and str(error.path).startswith(shown):
        text = error.message
    if "no space left" in text:
        text += (
            f" (the local staging folder, in {staging_root() or tempfile.gettempdir()}: set "
            "CKPTOOL_STAGING_DIR to a disk with room for the output)"
        )
    path: Any = out
    if error.path is not None and str(error.path).startswith(shown + "/"):
        path = out / str(error.path)[len(shown) + 1 :]
    made = type(error)(text, path=path)
    made.__cause__ = error
    return made


def check_output(
    out: RemotePath,
    *,
    inputs: Sequence[Any] = (),
    force: bool = False,
    in_place: bool = False,
    writes: list[str] | None = None,
    removes: Iterable[str] = (),
) -> None:
    """Refuse a remote output as :func:`ckptool.files.atomic.check_output` refuses a local one (same wording):
    an existing object without ``force``, the input itself; for a folder output (``writes``: the
    files it writes) any file it would replace, without ``force``. Also: a read-only protocol, an
    in-place rewrite (local files only), and an S3 bucket that is missing or refused.

    Raises:
        UsageError: a read-only protocol (``https://``), or ``in_place``.
        OutputError: what exists without ``force``; the input; a bucket missing or refused.
    """
    if out.read_only:
        raise UsageError(f"{out.protocol}:// is read-only — write the output to a local path, s3:// or gs://", path=out)
    if in_place:
        raise UsageError(
            option("in_place")
            + " rewrites a local file; a URL is written as a new object — drop "
            + option("in_place")
            + " and name the output with "
            + option("out", None),
            path=out,
        )
    check_supported(out, writing=True)
    # compared by what they name (s3a://B/k/ is s3://b/k), before any request: no spelling of an input is written
    remote_inputs = {source.identity for source in inputs if isinstance(source, RemotePath)}
    if writes is None and out.identity in remote_inputs:
        raise is_input_refusal(out, in_place=False)
    if writes is not None:
        if out.identity in remote_inputs:  # a sharded input's folder, by any spelling
            raise OutputError(
                "is the input folder; refusing to rewrite it — write elsewhere with " + option("out", None), path=out
            )
        for name in [*writes, *removes]:
            if (out / name).identity in remote_inputs:
                raise OutputError(
                    f"holds the input {out / name} as {name}, which this output would replace — "
                    "choose another " + option("out", None),
                    path=out,
                )
    _check_bucket(out)
    info = _info(out)
    if writes is None:
        if info is not None and info.get("type") == "directory":
            raise OutputError(
                "is a folder (objects lie under it), where the output writes one object — choose "
                "another " + option("out", None),
                path=out,
            )
        if info is not None and not force:
            raise exists_refusal(out)
        return
    if info is not None and info.get("type") != "directory":
        raise OutputError(
            "is an object, where the output writes a folder of files — remove it, or choose another "
            + option("out", None),
            path=out,
        )
    if info is None:
        return
    try:
        present = {child.name for child in out.iterdir()}
    except InputError as e:
        raise OutputError(e.message, path=out) from e
    existing = [name for name in [*writes, *removes] if name in present]
    if existing and not force:
        raise folder_holds_refusal(out, writes, existing)


def refuse_input(out: RemotePath, *, files: Sequence[Any] = (), folder: Any = None) -> None:
    """Refuse an output that is an input by any spelling (:func:`ckptool.files.remote.identity`), before any
    request is made for it: one of the input's ``files``, or its ``folder``.

    Raises:
        OutputError: ``out`` names an input.
    """
    named = out.identity
    if any(isinstance(file, RemotePath) and file.identity == named for file in files):
        raise is_input_refusal(out, in_place=False)
    if isinstance(folder, RemotePath) and folder.identity == named:
        raise (
            is_input_refusal(out, in_place=False)
            if folder in files
            else OutputError(
                "is the input folder; refusing to rewrite it — write elsewhere with " + option("out", None), path=out
            )
        )


def _info(out: RemotePath) -> dict[str, Any] | None:
    """What the store holds at ``out`` (None: nothing); a failure named as the output's."""
    try:
        return out.info()
    except InputError as e:
        raise OutputError(e.message, path=out) from e


def _check_bucket(out: RemotePath) -> None:
    """An S3 output's bucket must exist and answer before a byte is staged (one listing request)."""
    if out.protocol not in S3_PROTOCOLS:
        return
    reader, key = out.filesystem()
    bucket = key.split("/", 1)[0]
    try:
        STATS.add(requests=1)
        reader.is_prefix(key)
    except Exception as e:
        error = remote_error(e, out, writing=True)
        if "(404)" in error.message:
            raise OutputError(
                f"its bucket {bucket} does not exist (404) — create it first, or check the URL", path=out
            ) from None
        if error.message.startswith("access denied"):
            return  # credentials that may write but not list the bucket: the write itself will say
        raise error from None


def earlier_shards(out: RemotePath, index_name: str) -> tuple[bool, list[str] | None]:
    """(whether the folder ``out`` holds ``index_name``, the shard files that index names — None when it
    cannot be read as an index)."""
    from ckptool.formats.safetensors import MAX_HEADER_BYTES, shards_named_in

    index = out / index_name
    info = _info(index)
    if info is None:
        return False, []
    if int(info.get("size") or 0) > MAX_HEADER_BYTES:
        return True, None
    try:
        return True, shards_named_in(index.read_bytes())
    except InputError as e:
        raise OutputError(e.message, path=index) from e
