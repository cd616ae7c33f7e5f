"""Real torch tensors from lazy references, and loading them into a model ("load anywhere in one line").

Everything else in ckptool works on :class:`~ckptool.tensors.refs.TensorRef` without torch; this module is
where bytes become tensors. One torch storage is built per saved :class:`~ckptool.tensors.refs.StorageRef`
(memory-mapped copy-on-write where the bytes are aligned), and every tensor is a view of it, so
tied tensors stay tied and views stay views. torch is imported inside the functions: importing
this module costs nothing.

:func:`load_into` fits a checkpoint's keys to a model: it tries the key rewrites a training run
makes necessary (strip ``module.``/``_orig_mod.``/``model.``, add the prefix the model's own keys
carry), keeps the one that matches most keys with equal shapes, and loads strictly. When nothing
fits it raises :class:`LoadMismatchError` with a :class:`LoadDiagnosis` — what is missing,
unexpected or of another shape, grouped by module, the likely cause, and the command that fixes it —
instead of torch's wall of keys (both in :mod:`ckptool.ops.key_fitting`).
"""

from __future__ import annotations

import itertools
import os
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ckptool.base.errors import CkptError, InputError
from ckptool.base.torch_import import import_torch
from ckptool.files.byteio import use_storage_options
from ckptool.io.reader import load
from ckptool.model.checkpoint import Checkpoint
from ckptool.model.keys import detect_prefix
from ckptool.ops.key_fitting import (
    KeyMatch,
    KeyRewrite,
    LoadDiagnosis,
    LoadMismatchError,
    best_rewrite,
    diagnose,
    match_keys,
    model_name,
)
from ckptool.ops.key_fitting import group_by_module as group_by_module  # imported from here too
from ckptool.ops.key_fitting import module_of as module_of  # imported from here too
from ckptool.tensors.dtypes import DType
from ckptool.tensors.refs import StorageRef, TensorRef, check_wholes

if TYPE_CHECKING:  # pragma: no cover - typing only; torch is imported lazily at run time
    import torch
    from torch import nn

# ---------------------------------------------------------------------------------------------- tensors


def torch_dtype(dtype: DType) -> torch.dtype:
    """The torch dtype for a ckptool :class:`~ckptool.tensors.dtypes.DType` (``F32`` -> ``torch.float32``)."""
    import torch

    try:
        return getattr(torch, dtype.torch_name)
    except AttributeError:
        raise InputError(
            f"dtype {dtype.name} ({dtype.torch_name}) is not supported by this torch "
            f"{torch.__version__} — upgrade torch to load it"
        ) from None


def _storage_alignment(storage: StorageRef, tensors: Iterable[TensorRef]) -> int:
    return max([storage.dtype.itemsize, *(tensor.dtype.itemsize for tensor in tensors)])


def materialize_storage(storage: StorageRef, *, mmap: bool = True, alignment: int = 1) -> torch.UntypedStorage:
    """One saved storage as a torch ``UntypedStorage`` on CPU, reading only its bytes.

    With ``mmap`` (and bytes that lie at an ``alignment``-aligned file offset) the storage maps the
    file copy-on-write: no read happens until a page is touched, and writes stay private. Otherwise
    the bytes are read into a fresh buffer.

    Raises:
        InputError: the file is shorter than the storage's bytes.
    """
    import numpy as np
    import torch

    if storage.producer is not None:  # computed bytes: a cast, or DCP chunks assembled
        produced = storage.producer()
        raw = produced if isinstance(produced, bytearray) else bytearray(produced)
        return torch.frombuffer(raw, dtype=torch.uint8).untyped_storage() if raw else torch.UntypedStorage(0)
    span = storage.byte_range()
    if span.length == 0:
        return torch.UntypedStorage(0)
    if not isinstance(span.path, Path):  # a URL: its bytes fetched by ranges (parallel for a big one)
        buffer = torch.empty(span.length, dtype=torch.uint8)
        view, filled = memoryview(buffer.numpy()), 0
        for chunk in span.iter_chunks():
            view[filled : filled + len(chunk)] = chunk
            filled += len(chunk)
        return buffer.untyped_storage()
    try:
        file_size = os.path.getsize(span.path)
    except OSError as e:
        raise InputError(f"cannot be read ({e.strerror}) — check the path", path=span.path) from e
    if span.offset + span.length > file_size:
        raise InputError.truncated(span.path, f"storage {storage.key!r} ends after the end of the file")
    if mmap and span.offset % max(alignment, 1) == 0:
        mapped = np.memmap(span.path, dtype=np.uint8, mode="c", offset=span.offset, shape=(span.length,))
        return torch.from_numpy(mapped).untyped_storage()
    buffer = torch.empty(span.length, dtype=torch.uint8)
    view = buffer.numpy().data  # a memoryview of the tensor's bytes
    with open(span.path, "rb") as handle:
        handle.seek(span.offset)
        filled = handle.readinto(view)
    if filled != span.length:
        raise InputError.truncated(span.path)
    return buffer.untyped_storage()


def to_state_dict(tensors: Mapping[str, TensorRef], *, mmap: bool = True) -> dict[str, torch.Tensor]:
    """Materialize lazy tensors as real CPU tensors, keeping ties and views.

    Each saved storage becomes one torch storage; each tensor is a view of it with its saved
    offset, shape and stride, and its conjugate/negative bits (as ``torch.load`` sets them). Tensors that shared a
    storage on disk share it here
    (``a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()``). Only the storages the
    given tensors use are read. Sparse and nested tensors (:mod:`ckptool.pickles.layouts`) are built with
    torch from their components and checked as ``torch.load`` checks them. Other non-tensor values
    are left out.

    Args:
        tensors: name -> :class:`~ckptool.tensors.refs.TensorRef`, e.g. ``Checkpoint.tensors``.
        mmap: map aligned bytes copy-on-write instead of reading them (memory stays in the page cache).

    Example:
        >>> state_dict = to_state_dict(ckptool.load("tied.pt").tensors)        # doctest: +SKIP
        >>> state_dict["embed.weight"].data_ptr() == state_dict["head.weight"].data_ptr()   # doctest: +SKIP
        True
    """
    import_torch("materializing tensors")  # where it is missing: the install step, not a bare ImportError
    import torch

    from ckptool.pickles import layouts

    refs = {name: tensor for name, tensor in tensors.items() if isinstance(tensor, TensorRef)}
    # what torch.load refuses is refused before a byte of values is read: the sparse and nested tensors
    # given whole, and those whose parts are given (as Checkpoint.tensors lists them)
    check_wholes(refs)
    layout_values = layouts.layout_tensors(tensors)
    for name, value in layout_values.items():
        value.check(name=str(name))
    # sparse and nested tensors: their components are materialized with the rest (sharing storages)
    refs.update({f"{name}\0{role}": part for name, value in layout_values.items() for role, part in value.components()})
    users: dict[int, list[TensorRef]] = {}
    for tensor in refs.values():
        users.setdefault(id(tensor.storage), []).append(tensor)
    storages: dict[int, torch.UntypedStorage] = {}
    state_dict: dict[str, torch.Tensor] = {}
    for name, tensor in refs.items():
        key = id(tensor.storage)
        if key not in storages:
            storages[key] = materialize_storage(
                tensor.storage, mmap=mmap, alignment=_storage_alignment(tensor.storage, users[key])
            )
        dtype = torch_dtype(tensor.dtype)
        try:
            state_dict[name] = torch.empty(0, dtype=dtype).set_(
                storages[key], tensor.offset, tensor.shape, tensor.stride
            )
        except RuntimeError as e:
            raise InputError(
                f"tensor {name!r} does not fit its storage ({e}) — the file is corrupt",
                path=tensor.storage.byte_range().path,
            ) from e
        if tensor.conj or tensor.neg:
            # the bits torch's _rebuild_tensor_v2 sets from the same metadata: a lazy conjugate or
            # negative view, exactly as torch.load returns it (copies and load_state_dict resolve it)
            bits = {key: True for key, value in (("conj", tensor.conj), ("neg", tensor.neg)) if value}
            torch._C._set_tensor_metadata(state_dict[name], bits)  # type: ignore[attr-defined]  # not in torch's stubs
    if not layout_values:
        return state_dict
    for name, value in layout_values.items():
        parts = {role: state_dict.pop(f"{name}\0{role}") for role, _ in value.components()}
        state_dict[name] = value.build(parts)
    return {name: state_dict[name] for name in tensors if name in state_dict}


# ---------------------------------------------------------------------------------------------- load_into


@dataclass
class LoadReport:
    """What :func:`load_into` did.

    Attributes:
        rewrite: the key rewrite applied (``KeyRewrite()`` when the keys fit as stored).
        matched: keys loaded; missing / unexpected / mismatched stay 0 after a strict load.
        casts: ``{"F16->F32": n}`` — tensors whose dtype the model's parameters converted.
        device: where the model's weights are (where it was, unless a device was asked for).
        skipped: checkpoint keys the ``filter_fn`` left out (after the key rewrite).
        missing_keys / unexpected_keys / mismatched_keys: with ``strict=False``, the model's keys
            not loaded, the checkpoint's keys the model lacks, and those whose shapes differ
            (left out of the load).
    """

    path: Path
    format: str
    layout: tuple[Any, ...]
    model: str
    device: str
    rewrite: KeyRewrite
    matched: int
    missing: int = 0
    unexpected: int = 0
    mismatched: int = 0
    casts: dict[str, int] = field(default_factory=dict)
    tied: int = 0
    skipped: list[str] = field(default_factory=list)
    missing_keys: list[str] = field(default_factory=list)
    unexpected_keys: list[str] = field(default_factory=list)
    mismatched_keys: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {
            "ok": True,
            "path": str(self.path),
            "format": self.format,
            "layout": list(self.layout),
            "model": self.model,
            "device": self.device,
            "rewrite": None if self.rewrite.is_identity else self.rewrite.describe(),
            "matched": self.matched,
            "missing": self.missing,
            "unexpected": self.unexpected,
            "mismatched": self.mismatched,
            "casts": dict(self.casts),
        }


def _open(
    path: Path | str | Checkpoint,
    allow_globals: tuple[str, ...] | list[str],
    weights: str | None = None,
    variant: str | None = None,
) -> Checkpoint:
    if isinstance(path, Checkpoint):
        return path if weights is None else path.select_weights(weights)
    return load(path, allow_globals=allow_globals, weights=weights, variant=variant)


def _model_device(model: nn.Module) -> str:
    """Where the model's weights are: its first parameter's (or buffer's) device; ``cpu`` for none."""
    for tensor in itertools.chain(model.parameters(), model.buffers()):
        return str(tensor.device)
    return "cpu"


def load_into(
    model: nn.Module,
    path: Path | str | Checkpoint,
    *,
    fix: bool = True,
    device: str | None = None,
    strict: bool = True,
    filter_fn: Callable[[dict[str, torch.Tensor], nn.Module], dict[str, torch.Tensor]] | None = None,
    allow_globals: tuple[str, ...] | list[str] = (),
    weights: str | None = None,
    storage_options: Mapping[str, Any] | None = None,
    variant: str | None = None,
) -> LoadReport:
    """Load any checkpoint's weights into ``model``, fixing wrapper prefixes on the way.

    Reads the file without running its code, finds the weights inside any training container,
    picks the key rewrite that fits ``model`` (strip ``module.``/``_orig_mod.``/``model.``, or add the
    prefix a wrapped model expects), then calls ``model.load_state_dict``: the values are copied
    into the model's own tensors, on the device they are on.

    Args:
        model: the network to fill (bare, or wrapped in DataParallel/DDP/torch.compile).
        path: any checkpoint ckptool reads, or an already loaded :class:`~ckptool.Checkpoint`.
        fix: apply the best rewrite; with ``fix=False`` the keys must fit as stored, otherwise the
            error names the fix.
        device: move the model there first (``"cpu"``, ``"cuda:0"``...); by default it stays where it is.
        strict: every key must fit (the default); with ``False`` the keys that fit by name and shape
            are loaded and the report lists the rest (``missing_keys``, ``unexpected_keys``,
            ``mismatched_keys``).
        filter_fn: ``filter_fn(state_dict, model) -> state_dict``, as timm's ``load_checkpoint`` takes
            it: called on the rewritten state dict before the load; the keys it drops are reported
            as ``skipped`` (with ``strict=True`` the model's keys it drops must be none).
        allow_globals: extra pickle globals to accept by name.
        weights: which set of weights to load (``"state_dict_ema"``, ``"ema"``, a model folder's
            ``"unet"``; see :func:`ckptool.load`).
        variant: a model folder's weights variant (``"fp16"``; see :func:`ckptool.load`).

    Raises:
        LoadMismatchError: the keys or shapes do not fit (exit code 1); ``.diagnosis`` has the detail.
        InputError: the checkpoint is unreadable or holds no weights.
        MissingExtraError: torch is not installed (an ``ImportError``: ``pip install 'ckptool[torch]'``).

    Example:
        >>> report = ckptool.load_into(LeNet(), "ddp.pt")    # doctest: +SKIP
        >>> report.rewrite.describe(), report.matched       # doctest: +SKIP
        ('strip "module."', 8)
        >>> ckptool.load_into(net, "ema.pt", strict=False,  # doctest: +SKIP
        ...                   filter_fn=lambda sd, m: {k: v for k, v in sd.items() if not k.startswith("head.")})
    """
    import_torch("loading into a model")
    use_storage_options(storage_options)
    checkpoint = _open(path, allow_globals, weights, variant)
    tensors = checkpoint.tensors
    if not tensors:
        raise InputError("holds no weight tensors to load", path=checkpoint.path)
    model_state = model.state_dict()
    model_shapes = {key: tuple(value.shape) for key, value in model_state.items() if hasattr(value, "shape")}
    as_stored, best = _matches(checkpoint, tensors, model_shapes)
    chosen = best if fix else as_stored
    name = model_name(model)
    if strict and filter_fn is None and not chosen.fits:
        raise LoadMismatchError(_diagnosis(checkpoint, name, model_shapes, as_stored, best))
    state_dict = to_state_dict({chosen.rewrite.apply(key): tensor for key, tensor in tensors.items()})
    skipped: list[str] = []
    if filter_fn is not None:
        filtered = filter_fn(state_dict, model)
        skipped = [key for key in state_dict if key not in filtered]
        state_dict = dict(filtered)
    keys = _sort_keys(state_dict, model_shapes)
    fits, missing, unexpected, mismatched = keys
    if strict and (missing or unexpected or mismatched):  # what filter_fn left does not fit the model
        raise LoadMismatchError(
            _diagnosis(checkpoint, name, model_shapes, as_stored, best)
            if not chosen.fits
            else _filtered_diagnosis(checkpoint, name, chosen, missing, unexpected, skipped)
        )
    _load_state_dict(model, fits, device=device, strict=strict, path=checkpoint.path)
    return _report(checkpoint, tensors, model, name, device, chosen.rewrite, model_state, keys, skipped)


def _report(
    checkpoint: Checkpoint,
    tensors: Mapping[str, TensorRef],
    model: nn.Module,
    name: str,
    device: str | None,
    rewrite: KeyRewrite,
    model_state: dict[str, Any],
    keys: tuple[dict[str, torch.Tensor], list[str], list[str], list[str]],
    skipped: list[str],
) -> LoadReport:
    """What :func:`load_into` did: ``keys`` is :func:`_sort_keys`' answer."""
    fits, missing, unexpected, mismatched = keys
    casts = Counter(
        f"{dtype_name(value)}->{dtype_name(model_state[key])}"
        for key, value in fits.items()
        if value.dtype != model_state[key].dtype
    )
    storages = Counter(id(tensor.storage) for tensor in tensors.values())
    return LoadReport(
        path=checkpoint.path,
        format=checkpoint.format,
        layout=tuple(checkpoint.layout or ()),
        model=name,
        device=str(device) if device is not None else _model_device(model),
        rewrite=rewrite,
        matched=len(fits),
        missing=len(missing),
        unexpected=len(unexpected),
        mismatched=len(mismatched),
        casts=dict(casts),
        tied=sum(count - 1 for count in storages.values() if count > 1),
        skipped=skipped,
        missing_keys=missing,
        unexpected_keys=unexpected,
        mismatched_keys=mismatched,
    )


def _matches(
    checkpoint: Checkpoint, tensors: Mapping[str, TensorRef], model_shapes: dict[str, tuple[int, ...]]
) -> tuple[KeyMatch, KeyMatch]:
    """How the checkpoint's keys match the model's as stored, and after the rewrite that fits best."""
    checkpoint_shapes = {key: tuple(tensor.shape) for key, tensor in tensors.items()}
    best = best_rewrite(checkpoint_shapes, model_shapes, checkpoint_prefix=checkpoint.prefix)
    as_stored = match_keys(checkpoint_shapes, model_shapes)
    assert as_stored is not None  # the identity rewrite cannot collide
    return as_stored, best


def _diagnosis(
    checkpoint: Checkpoint, name: str, model_shapes: dict[str, tuple[int, ...]], as_stored: KeyMatch, best: KeyMatch
) -> LoadDiagnosis:
    """Why the checkpoint's keys do not fit the model, and the fix."""
    return diagnose(
        checkpoint.path,
        checkpoint.format,
        name,
        list(model_shapes),
        as_stored,
        best,
        checkpoint_prefix=checkpoint.prefix,
        model_prefix=detect_prefix(model_shapes, lightning=True),
        allow_globals=checkpoint.allow_globals,
    )


def _sort_keys(
    state_dict: dict[str, torch.Tensor], model_shapes: dict[str, tuple[int, ...]]
) -> tuple[dict[str, torch.Tensor], list[str], list[str], list[str]]:
    """``(fits, missing, unexpected, mismatched)``: the tensors that fit the model by name and shape, and
    the model's keys missing, the keys it does not have, and those of another shape."""
    fits = {
        key: value
        for key, value in state_dict.items()
        if key in model_shapes and tuple(value.shape) == model_shapes[key]
    }
    missing = [key for key in model_shapes if key not in fits]
    unexpected = [key for key in state_dict if key not in model_shapes]
    mismatched = [key for key in state_dict if key in model_shapes and key not in fits]
    return fits, missing, unexpected, mismatched


def _load_state_dict(
    model: nn.Module, fits: dict[str, torch.Tensor], *, device: str | None, strict: bool, path: Path
) -> None:
    """Move the model to ``device`` (when given) and copy the tensors that fit into it."""
    if device is not None:
        model.to(device)
    try:
        model.load_state_dict(fits, strict=strict)
    except RuntimeError as e:
        first_line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CkptError(
            f"load_state_dict failed after the keys matched ({first_line}) — "
            "the model's load hooks reject these weights",
            path=path,
        ) from e


def _filtered_diagnosis(
    checkpoint: Checkpoint, model: str, chosen: Any, missing: list[str], unexpected: list[str], skipped: list[str]
) -> LoadDiagnosis:
    """The keys fit before ``filter_fn`` and not after it: say what it took away."""
    shown = ", ".join(missing[:3]) + (", ..." if len(missing) > 3 else "")
    problem = (
        f"filter_fn left {len(missing)} of {model}'s keys without weights ({shown})"
        if missing
        else f"filter_fn returned {len(unexpected)} keys {model} does not have ({', '.join(unexpected[:3])})"
    )
    return LoadDiagnosis(
        path=checkpoint.path,
        model=model,
        cause="partial",
        problem=problem,
        fix="load with strict=False to keep the model's own values for them",
        rewrite=chosen.rewrite,
        model_keys=chosen.matched + len(chosen.missing),
        matched=chosen.matched - len(missing),
        missing=missing,
        unexpected=unexpected,
        mismatched=[],
        fitted_matched=chosen.matched - len(missing),
        fitted_missing=missing,
        fitted_unexpected=unexpected,
        fitted_mismatched=[],
    )


def dtype_name(tensor: torch.Tensor) -> str:
    from ckptool.tensors.dtypes import BY_TORCH_NAME

    name = str(tensor.dtype).removeprefix("torch.")
    known = BY_TORCH_NAME.get(name)
    return known.name if known is not None else name
