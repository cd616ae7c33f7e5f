"""One reader for every format: sniff by content, read through the restricted unpickler."""

from __future__ import annotations

from pathlib import Path

from . import inputs, pickles
from .checkpoint import Checkpoint, find_layout
from .errors import CkptError, InputError, UnsafeCheckpointError, UnsupportedFormatError
from .formats import safetensors, torch_legacy, torch_zip
from .suggest import option

_PICKLE_FIRST_BYTES = frozenset(b"\x80(cSVIJKLFGN]}l)dtq.")


def _describe(head: bytes) -> str | None:
    signatures = [
        (b"\x89PNG", "a PNG image"), (b"\xff\xd8\xff", "a JPEG image"), (b"GIF8", "a GIF image"),
        (b"\x1f\x8b", "a gzip archive — decompress it first"), (b"7z\xbc\xaf", "a 7z archive — extract it first"),
        (b"BZh", "a bzip2 archive — decompress it first"), (b"\xfd7zXZ", "an xz archive — decompress it first"),
        (b"\x93NUMPY", "a NumPy .npy array, not a checkpoint"), (b"\x89HDF", "an HDF5 file (Keras?), not a PyTorch checkpoint"),
        (b"GGUF", "a GGUF file (llama.cpp), not a PyTorch checkpoint"), (b"%PDF", "a PDF document"),
        (b"\x7fELF", "an executable"), (b"PK\x05\x06", "an empty zip archive"),
    ]
    for magic, what in signatures:
        if head.startswith(magic):
            return what
    return None


def _looks_like_text(head: bytes) -> bool:
    try:
        text = head.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return all(ch.isprintable() or ch in "\r\n\t" for ch in text)


def load(path: Path | str, *, allow_globals: tuple[str, ...] | list[str] = ()) -> Checkpoint:
    """Read any checkpoint without running its code; tensors stay on disk until used.

    Args:
        path: a ``.pt/.pth/.bin/.ckpt`` file (zip or legacy), a ``.safetensors`` file, a sharded
            safetensors directory or its ``*.index.json``.
        allow_globals: extra pickle globals to accept by name (e.g. ``"mylib.Config"``); they are
            recorded as placeholders, never imported.

    Raises:
        InputError: missing, unreadable, truncated or corrupt input.
        UnsafeCheckpointError: the pickle names a global outside the allowlist.
        UnsupportedFormatError: not a checkpoint (TorchScript, images, archives...).

    Example:
        >>> ckpt = ckptool.load("ddp.pt")        # doctest: +SKIP
        >>> ckpt.format, ckpt.prefix, len(ckpt.tensors)   # doctest: +SKIP
        ('torch-zip', 'module.', 10)
    """
    path = Path(path)
    resolver = pickles.GlobalResolver(allow_globals)
    try:
        return _load(path, resolver)
    except pickles.RefusedGlobal as e:
        raise UnsafeCheckpointError(
            f"pickle imports {e.name}, which could run code — refused, nothing was executed "
            "(if you trust this file, allow it by name: " + option("allow_globals", [e.name]) + ")",
            path=path, globals_=resolver.refused,
        ) from None
    except CkptError as e:
        if e.path is None:
            raise type(e)(e.wording or e.message, path=path) from e
        raise


def _load(path: Path, resolver: pickles.GlobalResolver, folder: Path | None = None) -> Checkpoint:
    """Read ``path``; ``folder`` is the input folder it was found in, whose bounds it must keep."""
    if folder is None and not path.exists():
        raise InputError("does not exist — check the path", path=path)
    if folder is None and path.is_dir():
        if (path / ".metadata").is_file():
            from .formats import dcp

            return dcp.read(path, resolver)
        target = safetensors.find_index(path)
        if target is None:
            raise UnsupportedFormatError(
                "is a directory without a checkpoint (no *.safetensors, *.safetensors.index.json or .metadata)",
                path=path,
            )
        checkpoint = _load(target, resolver, folder=path)
        checkpoint.path = path
        return checkpoint
    # a FIFO would block a plain open() forever and a device never ends: opened without blocking,
    # judged by what was opened; a file found in a folder must also stay inside it
    if folder is not None:
        handle = inputs.open_member(folder, path, what=path.name, report=folder)
    else:
        handle = inputs.open_regular(path)
    with handle:
        try:
            head = handle.read(64)
        except OSError as e:
            raise InputError(f"cannot be read ({e.strerror})", path=path) from e
        if not head:
            raise InputError("is empty (0 bytes) — the save or download did not finish", path=path)
        if head.startswith(b"PK\x03\x04"):
            contents = torch_zip.read(path, handle, resolver)
            return Checkpoint(path=path, format=torch_zip.FORMAT, container=contents.container,
                              layout=find_layout(contents.container), globals=dict(resolver.seen),
                              archive_name=contents.archive_name, files=[path])
        if safetensors.looks_like_safetensors(head):
            contents = safetensors.read_file(path, handle)
            return _from_safetensors(path, safetensors.FORMAT, contents)
        if head.lstrip().startswith(b"{"):
            if not path.name.endswith(".json"):
                raise UnsupportedFormatError("is a JSON file, not a checkpoint", path=path)
            contents = safetensors.read_index(path)
            return _from_safetensors(path, safetensors.SHARDED_FORMAT, contents)
        what = _describe(head)
        if what is not None:
            raise UnsupportedFormatError(f"is {what}, not a PyTorch checkpoint", path=path)
        if head[0] in _PICKLE_FIRST_BYTES:
            try:
                contents = torch_legacy.read(path, handle, resolver)
            except InputError as e:
                if _looks_like_text(head) and not isinstance(e, UnsafeCheckpointError):
                    raise UnsupportedFormatError("is a text file, not a PyTorch checkpoint", path=path) from e
                raise
            return Checkpoint(path=path, format=torch_legacy.FORMAT, container=contents.container,
                              layout=find_layout(contents.container), globals=dict(resolver.seen), files=[path],
                              notes=["legacy (pre-1.6) serialization: rewrites are written in the zip format"])
        if _looks_like_text(head):
            raise UnsupportedFormatError("is a text file, not a PyTorch checkpoint", path=path)
        raise UnsupportedFormatError(
            "is not a checkpoint ckptool recognizes (not torch zip, legacy torch, or safetensors)", path=path
        )


def _from_safetensors(path: Path, format_: str, contents: safetensors.SafetensorsContents) -> Checkpoint:
    return Checkpoint(path=path, format=format_, container=contents.tensors, layout=(), metadata=contents.metadata,
                      files=contents.files)

