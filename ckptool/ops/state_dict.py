"""load_state_dict: any checkpoint's weights as a dict of torch tensors, the call people type.

``ckptool.load_state_dict(path)`` is ``safetensors.torch.load_file`` for every format ckptool reads:
a ``.pt``/``.bin``/``.ckpt`` (zip or legacy), safetensors (one file or sharded), sharded ``.bin``, DCP,
TorchScript, a whole pickled model, a training folder, a model folder or one component of it. Nothing
a pickle names runs (:func:`ckptool.load`). Every tensor of the weights is then made a torch tensor
by :func:`ckptool.ops.load_into.to_state_dict`: one torch storage per saved storage, memory-mapped
copy-on-write where its bytes are aligned, each tensor a view of it with its saved offset and
strides, so tied tensors stay tied and views stay views, as ``torch.load`` gives them; sparse,
nested and quantized tensors are built by torch from their parts and checked as ``torch.load``
checks them. Keys are as stored: no wrapper prefix is stripped (:func:`ckptool.load_into` fits keys to
a model). On another device the storages are moved one at a time, so ties survive the move and the
host holds one storage's bytes at a time beyond what is mapped.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ckptool.base.errors import ResourceError, UsageError
from ckptool.base.suggest import given, option
from ckptool.base.torch_import import import_torch
from ckptool.io.reader import load
from ckptool.model.checkpoint import Checkpoint
from ckptool.model.devices import available_devices
from ckptool.ops.load_into import to_state_dict
from ckptool.pickles.layouts import LayoutTensor
from ckptool.tensors.refs import TensorRef

if TYPE_CHECKING:  # pragma: no cover - typing only; torch is imported lazily at run time
    import torch


def load_state_dict(
    path: Path | str | Checkpoint,
    *,
    weights: str | tuple[Any, ...] | list[Any] | None = None,
    device: str | torch.device = "cpu",
    variant: str | None = None,
    allow_globals: tuple[str, ...] | list[str] = (),
    storage_options: Mapping[str, Any] | None = None,
) -> dict[str, torch.Tensor]:
    """Any checkpoint's weights as ``{name: torch.Tensor}``, read without running its code.

    Args:
        path: any checkpoint ckptool reads (a file, a sharded or model folder, its index, a URL), or
            an already loaded :class:`~ckptool.Checkpoint`.
        weights: which set of weights, as :func:`ckptool.load` takes it: ``"state_dict_ema"`` in a
            training container, ``"unet"`` in a diffusers pipeline (whose weights are otherwise all
            its components', keyed ``<component>/<key>``).
        device: where the tensors go (``"cpu"``, ``"cuda"``, ``"cuda:1"``, ``"mps"``, ``"meta"``, or a
            ``torch.device``); checked before anything is read.
        variant: in a model folder, the weights variant to read (``"fp16"``:
            ``diffusion_pytorch_model.fp16.safetensors``).
        allow_globals: extra pickle globals to accept (names or shell patterns), read as inert data.
        storage_options: options for a URL ``path`` (an endpoint, a profile, ``anon``).

    Returns:
        The weights in state-dict order, keys as stored (a ``module.`` prefix stays); values as
        ``torch.load(path, weights_only=True)`` gives them, ties and views kept. Entries that are not
        tensors (a state dict's ``_metadata``, an int) are left out, as ``safetensors`` has none.

    Raises:
        UsageError: ``device`` is malformed or not available here (``"cuda"`` on a machine without a
            GPU), or ``variant`` is given with a loaded checkpoint.
        UnsafeCheckpointError: the pickle names globals outside the allowlist; nothing ran.
        InputError: the input is unreadable, holds no weights, or holds a tensor ``torch.load`` refuses.
        ResourceError: the device ran out of memory.
        MissingExtraError: torch is not installed.

    Example:
        >>> state_dict = ckptool.load_state_dict("model.safetensors")               # doctest: +SKIP
        >>> state_dict = ckptool.load_state_dict("ema.pt", weights="state_dict_ema")  # doctest: +SKIP
        >>> model.load_state_dict(ckptool.load_state_dict("ddp.pt", device="cuda"))   # doctest: +SKIP
    """
    import_torch("loading a state dict")
    target = _target_device(device)
    checkpoint = _open(path, weights, variant, allow_globals, storage_options)
    found = checkpoint.state_dict
    items = dict.items(found) if isinstance(found, dict) else found.items()  # dict.items: a StateDict's own
    # a sparse, nested or quantized tensor whole (Checkpoint.tensors lists its parts), which to_state_dict builds
    tensors: dict[str, Any] = {name: value for name, value in items if isinstance(value, TensorRef | LayoutTensor)}
    if target.type == "cpu":
        return to_state_dict(tensors)
    return _on_device(tensors, target)


def _open(
    path: Path | str | Checkpoint,
    weights: str | tuple[Any, ...] | list[Any] | None,
    variant: str | None,
    allow_globals: tuple[str, ...] | list[str],
    storage_options: Mapping[str, Any] | None,
) -> Checkpoint:
    if not isinstance(path, Checkpoint):
        return load(
            path, weights=weights, variant=variant, allow_globals=allow_globals, storage_options=storage_options
        )
    if variant is not None:
        raise UsageError(
            given("variant", variant) + " chooses the files of a folder as it is read: pass the folder's path, "
            "not a loaded Checkpoint"
        )
    return path if weights is None else path.select_weights(weights)


def _target_device(device: str | torch.device) -> torch.device:
    """``device`` as torch names it, once it is known to be here (``cuda`` is ``cuda:0``'s question).

    Raises:
        UsageError: malformed, or not available on this machine.
    """
    import torch

    try:
        target = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        raise UsageError(
            given("device", str(device)) + " is not a device — pass one like 'cpu', 'cuda', 'cuda:1' or 'mps'"
        ) from None
    if target.type in ("cpu", "meta"):
        return target
    if target.type in ("cuda", "mps"):  # discovery the tests substitute (model.devices)
        here = available_devices()
        available = f"{target.type}:{target.index or 0}" if target.type == "cuda" else target.type
    else:  # xpu, hpu...: asked of torch's own backend module
        backend = getattr(torch, target.type, None)
        count = backend.device_count() if backend is not None and backend.is_available() else 0
        here = ["cpu", *(f"{target.type}:{index}" for index in range(count))]
        available = f"{target.type}:{target.index or 0}"
    if available not in here:
        raise UsageError(
            given("device", str(device)) + f" is not available on this machine (available: {', '.join(here)}) — "
            "load onto the CPU with " + option("device", "cpu") + ", or run where that device is"
        )
    return target


def _on_device(tensors: dict[str, Any], target: torch.device) -> dict[str, torch.Tensor]:
    """The tensors on ``target``: each saved storage materialized, moved once, and viewed again there,
    one storage at a time; sparse, nested and quantized tensors moved as torch moves them."""
    import torch

    groups: dict[int, dict[str, TensorRef]] = {}
    layouts: dict[str, Any] = {}  # LayoutTensors, which to_state_dict builds with torch
    for name, value in tensors.items():
        if isinstance(value, TensorRef):
            groups.setdefault(id(value.storage), {})[name] = value
        else:
            layouts[name] = value
    moved: dict[str, torch.Tensor] = {}
    for group in groups.values():
        on_cpu = to_state_dict(group)
        with _placing(target, f"the storage of {next(iter(on_cpu))!r}"):
            whole = torch.empty(0, dtype=torch.uint8).set_(next(iter(on_cpu.values())).untyped_storage())
            storage = whole.to(target).untyped_storage()
        for name, tensor in on_cpu.items():
            with _placing(target, f"tensor {name!r}"):
                view = torch.empty(0, dtype=tensor.dtype, device=target)
                view.set_(storage, tensor.storage_offset(), tensor.shape, tensor.stride())
            if tensor.is_conj() or tensor.is_neg():  # the lazy bits torch.load sets, as on the CPU
                bits = {key: True for key, value in (("conj", tensor.is_conj()), ("neg", tensor.is_neg())) if value}
                torch._C._set_tensor_metadata(view, bits)  # type: ignore[attr-defined]  # not in torch's stubs
            moved[name] = view
    for name, tensor in to_state_dict(layouts).items():
        with _placing(target, f"tensor {name!r}"):
            moved[name] = tensor.to(target)
    return {name: moved[name] for name in tensors if name in moved}


@contextlib.contextmanager
def _placing(target: torch.device, what: str) -> Iterator[None]:
    """Failures to put ``what`` on ``target`` said as refusals: out of the device's memory, or a
    tensor torch cannot put there."""
    import torch

    try:
        yield
    except torch.OutOfMemoryError as e:
        raise ResourceError(
            f"{target} ran out of memory for {what} — free memory there, or load onto the CPU with "
            + option("device", "cpu")
        ) from e
    except (RuntimeError, NotImplementedError) as e:
        first_line = (str(e).strip().splitlines() or [type(e).__name__])[0].split(". ")[0]  # torch's first sentence
        first_line = first_line if len(first_line) <= 160 else first_line[:157] + "..."
        raise UsageError(
            f"torch cannot place {what} on {target} ({first_line}) — load onto the CPU with " + option("device", "cpu")
        ) from e
