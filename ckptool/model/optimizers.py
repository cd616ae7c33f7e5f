"""Optimizer state as ``torch.optim.Optimizer.state_dict()`` writes it: recognised, named, flattened.

An optimizer's state dict is ``{"state": {param_index: {name: tensor or value}}, "param_groups":
[{"lr": ..., "params": [indices]}, ...]}``. It holds no model weights, but its tensors (Adam's
``exp_avg``/``exp_avg_sq``, SGD's ``momentum_buffer``, the scalar ``step``) can be written to
safetensors like weights: :func:`flatten` names each by its key path (``state.0.exp_avg``); the
rest (parameter groups, non-tensor per-parameter values, the integer keys) rides in
``ckptool.entries`` so that a ``.pt`` written back holds the same dict torch's
``Optimizer.load_state_dict`` takes.
"""

from __future__ import annotations

from typing import Any, cast

from ckptool.base.errors import InputError
from ckptool.base.text import value_str
from ckptool.model.tree import iter_tensors
from ckptool.tensors.refs import TensorRef

STATE_KEY = "state"  # where per-parameter state lies; also how the weights option names an optimizer's tensors


def is_optimizer_state(value: Any) -> bool:
    """An ``optimizer.state_dict()``: ``{"state": {index: {...}}, "param_groups": [...]}``."""
    return (
        isinstance(value, dict)
        and isinstance(dict.get(value, "state"), dict)
        and isinstance(dict.get(value, "param_groups"), list)
    )


def per_parameter_state(value: dict) -> dict[Any, Any]:
    """The per-parameter state of an optimizer state dict (:func:`is_optimizer_state` checked it is a dict)."""
    return cast("dict[Any, Any]", dict.get(value, "state"))


def param_groups(value: dict) -> list[Any]:
    """The parameter groups of an optimizer state dict (:func:`is_optimizer_state` checked they are a list)."""
    return cast("list[Any]", dict.get(value, "param_groups"))


def _keys(value: dict) -> tuple[set[str], set[str]]:
    """The per-parameter state's names and the parameter groups' option names, over all of them."""
    state_names = {
        str(name)
        for per_parameter in dict.values(per_parameter_state(value))
        if isinstance(per_parameter, dict)
        for name in per_parameter
    }
    group_names = {str(name) for group in param_groups(value) if isinstance(group, dict) for name in group}
    return state_names, group_names


# Which torch.optim class wrote a state dict, told by the names only it uses (its per-parameter
# state or its group options), most specific first.
_KINDS: tuple[tuple[str, frozenset[str], frozenset[str]], ...] = (
    # name, any of these per-parameter names, any of these group options
    ("SGD", frozenset({"momentum_buffer"}), frozenset({"nesterov", "dampening"})),
    ("NAdam", frozenset({"mu_product"}), frozenset({"momentum_decay"})),
    ("Adamax", frozenset({"exp_inf"}), frozenset()),
    ("Adagrad", frozenset({"sum"}), frozenset({"lr_decay", "initial_accumulator_value"})),
    ("Adadelta", frozenset({"acc_delta"}), frozenset({"rho"})),
    ("RMSprop", frozenset(), frozenset({"centered"})),
    ("Rprop", frozenset({"prev"}), frozenset({"etas", "step_sizes"})),
    ("ASGD", frozenset({"ax"}), frozenset({"lambd", "t0"})),
    (
        "Adafactor",
        frozenset({"row_var", "col_var", "exp_avg_sq_row", "exp_avg_sq_col"}),
        frozenset({"beta2_decay", "scale_parameter", "relative_step"}),
    ),
    ("LBFGS", frozenset({"func_evals", "n_iter"}), frozenset({"history_size", "line_search_fn"})),
)


def optimizer_kind(value: dict) -> str | None:
    """The ``torch.optim`` class that wrote this state dict, as far as its names tell (``"AdamW"``,
    ``"SGD"``), or None. Adam and AdamW differ only in the ``decoupled_weight_decay`` option that
    torch ≥ 2.6 records; an older file says ``"Adam/AdamW"``."""
    state_names, group_names = _keys(value)
    for name, state_marks, group_marks in _KINDS:
        if state_names & state_marks or group_names & group_marks:
            return name
    if "amsgrad" in group_names:
        decoupled = [group.get("decoupled_weight_decay") for group in param_groups(value) if isinstance(group, dict)]
        if any(flag is True for flag in decoupled):
            return "AdamW"
        return "Adam" if decoupled and all(flag is False for flag in decoupled) else "Adam/AdamW"
    if {"exp_avg", "exp_avg_sq"} <= state_names:
        return "RAdam" if "decoupled_weight_decay" in group_names else "an Adam variant"
    return None


def state_names(value: dict) -> list[str]:
    """The per-parameter state's names in the order the state dict first gives them (``step, exp_avg, ...``)."""
    names: list[str] = []
    for per_parameter in dict.values(per_parameter_state(value)):
        if isinstance(per_parameter, dict):
            names += [value_str(key) for key in per_parameter if value_str(key) not in names]
    return names


def flatten(value: Any, *, path: Any = None) -> dict[str, TensorRef]:
    """Every tensor of an optimizer state dict, named by its key path joined with dots
    (``state.0.exp_avg``, ``state.0.step``; a tensor learning rate as ``param_groups.0.lr``), in
    the state dict's order. A tensor held at two places is named once, at the first.

    Raises:
        InputError: two places spell one name (``{0: ..., "0": ...}``), so the names would not
            say where each tensor goes back.
    """
    flat: dict[str, TensorRef] = {}
    for place, tensor in iter_tensors(value):
        name = ".".join(map(value_str, place))  # (an int key past 4300 digits: named by its size)
        if name in flat:
            raise InputError(
                f"optimizer state holds two tensors named {name!r} (keys of different types) — "
                "their names would not say where each goes back; keep the .pt",
                path=path,
            )
        flat[name] = tensor
    return flat


def tensor_names(value: Any) -> dict[int, str]:
    """``id(tensor) -> name`` for :func:`flatten`'s names (the encoding of the rest refers to them)."""
    return {id(tensor): name for name, tensor in flatten(value).items()}
