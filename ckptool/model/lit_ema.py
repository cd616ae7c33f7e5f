"""The EMA copy a LitEma keeps inside a state dict (latent diffusion, Stable Diffusion v1), as a set of weights.

CompVis' latent-diffusion and stable-diffusion (``ldm/modules/ema.py``) keep the moving average of a
LightningModule's ``self.model`` in a submodule ``self.model_ema = LitEma(self.model)``: buffers
``decay`` and ``num_updates``, and for each parameter ``name`` of the model that requires grad a buffer
named ``name`` without its dots (``diffusion_model.input_blocks.0.0.weight`` ->
``diffusion_modelinput_blocks00weight``: a buffer's name may hold no dot). The state dict a checkpoint
holds therefore has ``model.<name>`` (the live weights) beside ``model_ema.<name without dots>``, and no
set of its own for the average. Its ``ema_scope``/``copy_to`` copies each such buffer into the parameter
whose name, dots removed, is the buffer's; the model's other parameters and buffers stay as they are.

:func:`ema_state_dict` gives what that leaves as the weights: the state dict with every ``model.<name>``
whose copy exists replaced by that copy, the ``model_ema.*`` entries dropped (as EMA-extraction scripts
write it), every other entry (``first_stage_model.*``, ``cond_stage_model.*``, a parameter without a copy)
as it was. It is the weights set :data:`NAME` (``--weights ema``), derived from the state dict rather than
lying in it: :func:`with_ema` puts it in the container's place, so writes see weights at a key path.
"""

from __future__ import annotations

from typing import Any

from ckptool.base.errors import InputError
from ckptool.model.tree import copy_mapping, get_at, replace_at
from ckptool.pickles.layouts import LayoutTensor
from ckptool.tensors.refs import TensorRef

NAME = "ema"  # the weights path naming the set
KIND = "EMA copy (LitEma)"  # what inspect calls it
MODEL = "model."  # the LightningModule's self.model
EMA = "model_ema."  # its self.model_ema = LitEma(self.model)
DECAY, NUM_UPDATES = EMA + "decay", EMA + "num_updates"  # LitEma's own two buffers


def shadow_key(key: str) -> str:
    """The EMA buffer LitEma keeps for weight ``model.<name>``: ``model_ema.<name without dots>``."""
    return EMA + key[len(MODEL) :].replace(".", "")


def ema_keys(state_dict: Any) -> dict[str, str]:
    """Each weight key of ``state_dict`` that has a LitEma copy, mapped to the copy's key; empty when the state dict
    holds no LitEma (its ``decay`` and ``num_updates`` buffers and at least one copy)."""
    if not isinstance(state_dict, dict) or DECAY not in state_dict or NUM_UPDATES not in state_dict:
        return {}
    found: dict[str, str] = {}
    for key in dict.keys(state_dict):
        if type(key) is str and key.startswith(MODEL):
            shadow = shadow_key(key)
            if dict.__contains__(state_dict, shadow):
                found[key] = shadow
    return found


def has_ema(state_dict: Any) -> bool:
    """Whether ``state_dict`` holds a LitEma copy of its ``model.`` weights."""
    return bool(ema_keys(state_dict))


def ema_state_dict(state_dict: dict[Any, Any], *, path: Any = None) -> dict:
    """The weights with their LitEma copy in place (what ``LitEma.copy_to`` leaves), ``model_ema.*`` dropped.

    Raises:
        InputError: there is no LitEma copy, or a copy is not a tensor of its weight's dtype and shape (copying
            it would convert or broadcast it: not the weights the average kept).
    """
    copies = ema_keys(state_dict)
    if not copies:
        raise InputError(f"holds no LitEma copy ({DECAY}, {NUM_UPDATES} and model_ema.* buffers)", path=path)
    items: list[tuple[Any, Any]] = []
    for key, value in dict.items(state_dict):
        if type(key) is str and key.startswith(EMA):
            continue
        shadow = copies.get(key) if type(key) is str else None
        if shadow is not None:
            copy = dict.__getitem__(state_dict, shadow)
            _check_fits(key, value, shadow, copy, path)
            value = copy
        items.append((key, value))
    return copy_mapping(state_dict, items)


def _check_fits(key: str, value: Any, shadow: str, copy: Any, path: Any) -> None:
    if isinstance(value, LayoutTensor) or isinstance(copy, LayoutTensor):
        raise InputError(
            f"{key!r} or its EMA copy {shadow!r} is a sparse, nested or quantized tensor — ckptool maps plain "
            "tensors only; choose the live weights",
            path=path,
        )
    if not isinstance(value, TensorRef) or not isinstance(copy, TensorRef):
        raise InputError(f"{key!r} or its EMA copy {shadow!r} is not a tensor — the file is corrupt", path=path)
    if value.dtype != copy.dtype or value.shape != copy.shape:
        raise InputError(
            f"the EMA copy {shadow!r} is {copy.dtype.name}{list(copy.shape)} but the weight {key!r} it stands for "
            f"is {value.dtype.name}{list(value.shape)} — LitEma's copy_to would convert it; choose the live weights",
            path=path,
        )


def with_ema(container: Any, layout: tuple[Any, ...], *, path: Any = None) -> Any:
    """``container`` with the state dict at ``layout`` replaced by its weights with the LitEma copy in place."""
    return replace_at(container, layout, ema_state_dict(get_at(container, layout), path=path))
