"""Which format an output is written in, and what a ``.pt`` output holds: the format a suffix names or a rewrite
keeps (:func:`rewrite_format`, :func:`target_format`), the outputs of a many-input convert (:func:`plan_outputs`),
and the container a ``.pt`` output pickles (:func:`pt_container`)."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from ckptool import formats
from ckptool.base import suggest
from ckptool.base.errors import OutputError, UsageError
from ckptool.files.atomic import same_file
from ckptool.model.checkpoint import Checkpoint
from ckptool.model.tree import map_tensors
from ckptool.tensors import dtypes
from ckptool.tensors.refs import StorageRef, TensorRef


def suffix_format(out: Path) -> str | None:
    """The format a file name's suffix says: ``"safetensors"``, ``"pt"``, or None for another suffix."""
    named = formats.for_suffix(out)
    return named.target if named is not None else None


def rewrite_format(checkpoint: Checkpoint, out: Path | None, *, command: str) -> str:
    """The format a rewrite (strip, add-prefix, remap) writes: what the suffix of ``out`` says, so
    a file's name never lies about its content; the input's own format for a suffix ckptool does
    not know, or with no ``out`` (``--in-place``).

    Raises:
        UsageError: a ``.safetensors`` name for a rewrite that would have to drop what the input
            holds besides its weights (a rewrite keeps the whole container), or for ``remap``
            (safetensors has no device tags to rewrite).
    """
    own = formats.for_name(checkpoint.format).rewrite_target
    refused = formats.for_name(checkpoint.format).in_place_refused
    if out is None and refused:  # --in-place: the input would be replaced by less than it holds
        raise UsageError(
            f"{refused} — write it beside the input instead: {suggest.command(command, checkpoint.path, out='OUT.pt')}",
            path=checkpoint.path,
        )
    wanted = suffix_format(out) if out is not None else None
    if wanted is None or wanted == own:
        return own
    wanted_format = formats.for_target(wanted)
    assert wanted_format is not None  # a suffix names a format ckptool writes
    if not wanted_format.weights_only:
        return wanted  # the weights, as convert writes them: nothing a .pt cannot hold
    source = checkpoint.path
    if command == "remap":
        raise UsageError(
            "is a safetensors name, and safetensors keeps no device tags to remap — write .pt, or "
            "drop the tags with: "
            f"{suggest.command('convert', source, out=out, allow_globals=list(checkpoint.allow_globals))}",
            path=out,
        )
    # a whole-model pickle's rewrite keeps its weights alone (pt_container): nothing else to lose
    extra = [repr(key) for key in checkpoint.entries()] if not checkpoint.whole_model else []
    if checkpoint.has_weights:
        extra += [repr(key) for key, value in checkpoint.state_dict.items() if not isinstance(value, TensorRef)]
    if checkpoint.layout is None or extra:
        shown = ", ".join(extra[:4]) + (", ..." if len(extra) > 4 else "")
        allowed = list(checkpoint.allow_globals)
        hint = (
            suggest.command("convert", source, out=out, strip=True, allow_globals=allowed)
            if command == "strip"
            else f"{suggest.command(command, source, out='OUT.pt', allow_globals=allowed)}, then "
            f"{suggest.command('convert', 'OUT.pt', out=out, allow_globals=allowed)}"
        )
        raise UsageError(
            f"is a safetensors name, which holds weights only, but {source} also holds "
            f"{shown or 'no weights'}, which {command} keeps — write .pt, or keep just the weights: {hint}",
            path=out,
        )
    return wanted


def target_format(out: Path, to: str | None, max_shard_size: int | None) -> formats.Format:
    """Choose the output format from ``--to``, the suffix, or a directory (a registered format)."""
    if to is not None:
        chosen = formats.for_target(to)
        if chosen is None:
            raise UsageError(suggest.given("to", to) + ": choose pt or safetensors")
        named = suffix_format(out)
        if named is not None and named != to:
            raise UsageError(
                suggest.typed("to", to)
                + f" contradicts the name {out.name} — drop "
                + suggest.option("to", None)
                + f", or name the output {suggest.stem(out)}{chosen.default_suffix}"
            )
        if max_shard_size is not None or out.is_dir():  # a format without shards ignores both
            return formats.for_target(to, sharded=True) or chosen
        return chosen
    named_format = formats.for_suffix(out)
    if named_format is not None:
        if max_shard_size is None:
            return named_format
        sharded = formats.for_target(named_format.target or "", sharded=True)
        if sharded is None:
            raise UsageError(
                suggest.option("max_shard_size", None) + " applies to safetensors output — write to a "
                "directory or .safetensors"
            )
        return sharded
    if out.is_dir() or not out.suffix:
        return formats.folder_output()
    raise UsageError(
        f"cannot tell the format from {out.name!r} — use .pt, .safetensors or a directory, or pass "
        + suggest.option("to", None)
    )


def plan_outputs(sources: list[Path] | tuple[Path, ...], out_dir: Path, to: str | None) -> list[tuple[Path, Path]]:
    """Every ``(input, output)`` of a many-input conversion into ``out_dir``, planned before any is written.

    An output keeps its input's name without its checkpoint suffixes (``chgnet_0.3.0.pth.tar`` ->
    ``chgnet_0.3.0.safetensors``: :func:`ckptool.base.suggest.stem`), with the suffix of ``to``
    (safetensors by default).

    Raises:
        UsageError: ``out_dir`` is not an existing directory.
        OutputError: two inputs would be written to one output (refused even with ``--force``:
            the second write would destroy the first, or the first an input the second reads).
    """
    remote = not isinstance(out_dir, Path)
    if remote:  # a store has no folders to create: a prefix is one once an object lies under it
        if out_dir.is_file():
            raise UsageError(suggest.typed("out_dir", str(out_dir)) + " is an object, not a folder — choose another")
    elif not out_dir.is_dir():
        raise UsageError(suggest.typed("out_dir", str(out_dir)) + " is not an existing directory — create it first")
    suffix = {"pt": ".pt", "dcp": ".dcp"}.get(to or "", ".safetensors")  # a DCP output is a folder: name.dcp
    jobs = [
        (source if not isinstance(source, str) else Path(source), out_dir / (suggest.stem(source) + suffix))
        for source in sources
    ]
    by_output: dict[str, Path] = {}
    for source, target in jobs:
        key = target.identity if remote else os.path.normcase(os.path.abspath(target))  # type: ignore[attr-defined]
        if key in by_output:
            other = by_output[key]
            if _same_path(other, source):
                raise OutputError(
                    f"input {source} is given twice — nothing was written; give each input once", path=target
                )
            raise OutputError(
                f"{other} and {source} would both be written here — nothing was written; convert "
                "them into separate " + suggest.option("out_dir", None) + " folders",
                path=target,
            )
        by_output[key] = source
    return jobs


def _same_path(a: Path, b: Path) -> bool:
    if not (isinstance(a, Path) and isinstance(b, Path)):  # a URL: by what it names, whatever its spelling
        return getattr(a, "identity", a) == getattr(b, "identity", b)
    if os.path.lexists(a) and os.path.lexists(b):
        return same_file(a, b)
    return os.path.normcase(os.path.abspath(a)) == os.path.normcase(os.path.abspath(b))


def pt_container(checkpoint: Checkpoint, nest: str | None = None) -> Any:
    """The object to pickle for a .pt output: the container itself, or the weights for safetensors input
    (inside the container its ``ckptool.entries`` carried, when it carried one)."""
    if checkpoint.whole_model and not checkpoint.keep_modules:
        # a pickled nn.Module: its weights as a plain state dict, none of its classes
        return checkpoint.state_dict
    if formats.for_name(checkpoint.format).weights_only:
        if checkpoint.layout or checkpoint.flattened:  # the container ckptool.entries carried, around the weights
            if nest:
                raise UsageError(
                    suggest.option("nest", None) + " applies to safetensors input holding weights "
                    "alone; this file carries its container (the weights at "
                    + ".".join(str(key) for key in checkpoint.layout or ())
                    + ") — drop "
                    + suggest.option("nest", None),
                    path=checkpoint.path,
                )
            return map_tensors(checkpoint.container, _typed_for_pickle())
        container: Any = dict(map_tensors(checkpoint.tensors, _typed_for_pickle()))
        return {nest: container} if nest else container
    if nest:
        raise UsageError(
            suggest.option("nest", None) + " applies to safetensors input; this checkpoint already has a container"
        )
    return checkpoint.container


def _typed_for_pickle() -> Callable[[TensorRef], TensorRef]:
    """safetensors tensors as torch would pickle them (legacy typed storage, or untyped + dtype).

    Each storage is converted once, so tied tensors still share one storage in the output.
    """
    converted: dict[int, StorageRef] = {}

    def convert(tensor: TensorRef) -> TensorRef:
        storage = tensor.storage
        typed = bool(tensor.dtype.storage_class)
        if id(storage) not in converted:
            converted[id(storage)] = (
                replace(storage, type_global=f"torch.{tensor.dtype.storage_class}")
                if typed
                else replace(
                    storage,
                    dtype=dtypes.BY_NAME["U8"],
                    numel=storage.nbytes,
                    type_global="torch.storage.UntypedStorage",
                )
            )
        rebuild = "torch._utils._rebuild_tensor_v2" if typed else "torch._utils._rebuild_tensor_v3"
        return replace(tensor, storage=converted[id(storage)], rebuild=rebuild)

    return convert
