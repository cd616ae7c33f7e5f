"""One reader for every format: sniff by content, read through the restricted unpickler."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ckptool import formats, pickles
from ckptool.base.errors import (
    CkptError,
    InputError,
    NotACheckpointError,
    UnsafeCheckpointError,
    UnsupportedFormatError,
)
from ckptool.base.suggest import Metavar
from ckptool.base.suggest import option as suggest_option
from ckptool.files import inputs
from ckptool.files.byteio import forget_windows, use_storage_options
from ckptool.files.inputs import located
from ckptool.model import modules
from ckptool.model.checkpoint import Checkpoint, find_layout
from ckptool.model.tree import get_at
from ckptool.pickles.refusal import refusal


def load(
    path: Path | str,
    *,
    allow_globals: tuple[str, ...] | list[str] = (),
    guard_cache: pickles.GuardCache | None = None,
    weights: str | tuple | list | None = None,
    storage_options: Mapping[str, Any] | None = None,
    variant: str | None = None,
) -> Checkpoint:
    """Read any checkpoint without running its code; tensors stay on disk until used.

    Args:
        path: a ``.pt/.pth/.bin/.ckpt`` file (zip or legacy), a TorchScript archive (its parameters
            and buffers), a ``.safetensors`` file, a sharded safetensors or ``.bin`` directory or its
            ``*.index.json``.
        allow_globals: extra pickle globals to accept, by name (``"mylib.Config"``) or shell
            pattern on the dotted name (``"omegaconf.*"``, ``"*"`` for all); they are recorded as
            placeholders, never imported. torch's own globals keep their checks, and a pattern
            never accepts a global known to run code (:func:`ckptool.pickles.runs_code`).
        guard_cache: pickles the calling operation has already walked (a scan, a write's read-back).
        weights: which set of weights to take when the container holds several (``"state_dict_ema"``,
            ``"model.ema"``, ``"ema"`` of a whole-model pickle): keys joined by ``.`` or ``/``
            (:func:`ckptool.model.checkpoint.resolve_weights`), or a tuple of keys. None: the first
            found of :data:`ckptool.model.checkpoint.WEIGHTS_KEYS` (the live weights before an EMA copy).
            ``"state"`` (or the optimizer's key path) takes an optimizer's state, its tensors named
            ``state.<param>.<name>``. In a training folder, a file of the folder may be named first
            (``"model_1"``, ``"optimizer.bin"``, ``"model_1.safetensors/..."``); ``"state"`` there
            is its optimizer file's. In a model folder (a diffusers pipeline), a component
            (``"unet"``, ``"text_encoder/..."``); with none named, a folder of several components
            reads them all as one state dict of ``<component>/<key>``.
        storage_options: fsspec options for a URL ``path`` (``s3://``, ``gs://``, ``https://``...),
            as the CLI's ``--storage-option``: an endpoint, a profile, ``anon``. They stay in force for
            the reads that follow (the tensors of a remote checkpoint are read when used). The other
            reading functions (inspect, scan, diff, verify, load_into) take them too.
        variant: in a model folder, the weights variant to read (``"fp16"``:
            ``diffusion_pytorch_model.fp16.safetensors``); a component without it is read from its
            default weights. None: the default weights (a folder holding only a variant: that variant).
    Raises:
        InputError: missing, unreadable, truncated or corrupt input.
        UnsafeCheckpointError: the pickle names globals outside the allowlist (``.globals`` lists
            them all, the message the ``allow_globals`` that would accept them).
        UnsupportedFormatError: not a checkpoint (images, archives...).
        InputError: ``weights`` names no set of weights (the message lists those there are).

    Example:
        >>> ckpt = ckptool.load("ddp.pt")        # doctest: +SKIP
        >>> ckpt.format, ckpt.prefix, len(ckpt.tensors)   # doctest: +SKIP
        ('torch-zip', 'module.', 10)
    """
    use_storage_options(storage_options)
    path = located(path)
    if not isinstance(path, Path):
        forget_windows()  # a remote file's bytes are read as they are now, not as an earlier read saw them
    resolver = pickles.GlobalResolver(allow_globals, guard_cache=guard_cache)
    try:
        checkpoint = _load(path, resolver, variant=variant)
        if variant is not None:
            _check_variant(checkpoint, variant)
        if weights is None:
            return checkpoint
        if checkpoint.folder is not None:
            return _select_in_folder(checkpoint, weights, resolver)
        return checkpoint.select_weights(weights)
    except pickles.RefusedGlobal as e:
        raise UnsafeCheckpointError(refusal(e), path=path, globals_=e.names) from None
    except CkptError as e:
        if e.path is None:
            raise type(e)(e.wording or e.message, path=path) from e
        raise


def _check_variant(checkpoint: Checkpoint, variant: str) -> None:
    """A variant is asked of a folder that holds it."""
    folder = checkpoint.folder
    have = folder.variants if folder is not None else []
    if variant not in have:
        said = f"holds no {variant!r} variant of its weights (variants: {', '.join(have) or 'none'})"
        if folder is not None:
            raise InputError(said, path=checkpoint.path)
        raise InputError(
            said + " — " + suggest_option("variant", None) + " chooses among a model folder's weights files",
            path=checkpoint.path,
        )


def _load(
    path: Path, resolver: pickles.GlobalResolver, folder: Path | None = None, *, variant: str | None = None
) -> Checkpoint:
    """Read ``path``; ``folder`` is the input folder it was found in, whose bounds it must keep."""
    remote = inputs.describe_remote(path) if folder is None else None  # one request: is it there, a folder?
    if folder is None and not (path.exists() if remote is None else remote.exists):
        raise InputError(
            "does not exist — check the path" if remote is None else "does not exist (404) — check the URL", path=path
        )
    if folder is None and (path.is_dir() if remote is None else remote.is_dir):
        fmt = formats.sniff(None, path)
        if fmt is not None:
            return _checkpoint(path, fmt, fmt.read(path, formats.ReadOptions(None, b"", resolver, variant)), resolver)
        target = formats.in_folder(path)
        if target is None:
            raise UnsupportedFormatError(
                "is a directory without a checkpoint (no *.safetensors, *.safetensors.index.json, *.bin.index.json "
                "or .metadata)",
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
        handle = inputs.open_regular(path, size=remote.size if remote is not None else None)
    with handle:
        try:
            head = handle.read(64)
        except OSError as e:
            raise InputError(f"cannot be read ({e.strerror})", path=path) from e
        if not head:
            raise InputError("is empty (0 bytes) — the save or download did not finish", path=path)
        fmt = formats.sniff(head, path)
        if fmt is not None:
            return _checkpoint(path, fmt, fmt.read(path, formats.ReadOptions(handle, head, resolver)), resolver)
        what = formats.describe(head)
        if what is not None:
            raise NotACheckpointError(f"is {what}, not a PyTorch checkpoint", path=path)
        if formats.looks_like_text(head):
            raise NotACheckpointError("is a text file, not a PyTorch checkpoint", path=path)
        raise NotACheckpointError(
            "is not a checkpoint ckptool recognizes (not torch zip, legacy torch, or safetensors)", path=path
        )


def load_member(
    folder: Path,
    name: str,
    *,
    allow_globals: tuple[str, ...] | list[str] = (),
    resolver: pickles.GlobalResolver | None = None,
    variant: str | None = None,
) -> Checkpoint:
    """One file of the input ``folder`` (a training folder's optimizer, scheduler...), read as the
    checkpoint it is; it must be a regular file inside the folder (or a link that stays inside).

    Raises:
        InputError, UnsafeCheckpointError, UnsupportedFormatError: as :func:`load`, naming the file.
    """
    from ckptool.formats import model_folder

    resolver = resolver if resolver is not None else pickles.GlobalResolver(allow_globals)
    path = folder / name
    try:
        contents = model_folder.read_member(folder, name, formats.ReadOptions(None, b"", resolver, variant))
        return _checkpoint(path, formats.for_name(contents.format or ""), contents, resolver)
    except pickles.RefusedGlobal as e:
        raise UnsafeCheckpointError(refusal(e), path=path, globals_=e.names) from None
    except CkptError as e:
        if e.path is None or e.path == folder:
            raise type(e)(e.wording or e.message, path=path) from e
        raise


def _select_in_folder(
    checkpoint: Checkpoint, weights: str | tuple | list, resolver: pickles.GlobalResolver
) -> Checkpoint:
    """``weights`` in a training folder: a file of it (``model_1``, ``optimizer.bin``, then a path
    inside it after ``/``), else a path inside the weights read, else (``state``) its optimizer's."""
    from ckptool.formats import training_folder
    from ckptool.model import optimizers
    from ckptool.model.checkpoint import resolve_weights

    folder = checkpoint.folder
    text = weights if isinstance(weights, str) else None
    chosen, rest = None, None
    if text is not None:
        head, _, tail = text.partition("/")
        chosen = folder.named(text) or folder.named(head)
        rest = None if chosen is not None and folder.named(text) is chosen else (tail or None)
        optimizers_ = folder.of_role(training_folder.OPTIMIZER)
        if (
            chosen is None
            and optimizers_
            and text.split("/")[0].split(".")[0] == optimizers.STATE_KEY
            and (not checkpoint.has_weights or resolve_weights(checkpoint.container, text) is None)
        ):
            chosen, rest = optimizers_[0], text
    if chosen is None:
        try:
            return checkpoint.select_weights(weights)
        except InputError as e:
            names = [file.name for file in (*folder.weights, *folder.of_role(training_folder.OPTIMIZER))]
            raise InputError(
                f"{e.message.split(' — ')[0]} — the folder's weights: {', '.join(names) or 'none'}"
                + (" (or 'state': the optimizer's tensors)" if folder.of_role(training_folder.OPTIMIZER) else "")
                + "; pass one of them as "
                + suggest_option("weights", Metavar("PATH")),
                path=checkpoint.path,
            ) from None
    member = load_member(folder.directory, chosen.name, allow_globals=resolver.allow_globals, variant=folder.variant)
    member.path, member.folder = checkpoint.path, dataclasses.replace(folder, read=chosen.name)
    if rest is not None:
        return member.select_weights(rest)
    if member.layout is None and optimizers.is_optimizer_state(member.container):
        return member.select_weights(())  # an optimizer file named: its tensors
    return member


def _checkpoint(
    path: Path, fmt: formats.Format, contents: formats.Contents, resolver: pickles.GlobalResolver
) -> Checkpoint:
    """The one place a Checkpoint is made from what a format read."""
    if contents.format is not None:  # the claiming format handed the input to a narrower one
        fmt = formats.for_name(contents.format)
    if contents.layout is not None:
        layout: tuple | None = contents.layout
    else:
        layout = () if fmt.weights_only else find_layout(contents.container)
    node = get_at(contents.container, layout) if layout is not None else None
    found = layout is not None and modules.is_module(node)
    return Checkpoint(
        path=path,
        format=fmt.name,
        container=contents.container,
        layout=layout,
        globals=dict(resolver.seen),
        metadata=contents.metadata,
        files=contents.files,
        notes=contents.notes,
        allow_globals=resolver.allow_globals,
        module_class=modules.class_name(node) if found else None,
        flattened=contents.flattened,
        folder=contents.folder,
    )
