"""One-line descriptions of what a checkpoint holds besides its weights: entries, optimizer state, sizes."""

from __future__ import annotations

import math
from typing import Any

from ckptool.base.errors import InputError
from ckptool.base.jsonout import key_text
from ckptool.base.text import value_repr
from ckptool.model import modules, optimizers
from ckptool.model.tree import iter_tensors
from ckptool.pickles import OpaqueObject
from ckptool.tensors.refs import DeviceRef, SizeRef, TensorRef


def human_bytes(size: int) -> str:
    value = float(size)
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if value < 1000 or unit == "TB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1000
    return f"{size} B"


def describe_entry(value: Any) -> str:
    """A one-line description of a container entry that is not the weights."""
    if isinstance(value, bool | int | float | str) or value is None:
        text = value_repr(value)  # (an int past 4300 digits: its size, not a ValueError)
        return text if len(text) <= 60 else text[:57] + "..."
    if isinstance(value, TensorRef):
        return f"tensor {value.dtype.name}{list(value.shape)}"
    if isinstance(value, DeviceRef):
        return f"device {value}"
    if isinstance(value, SizeRef):
        return f"torch.Size({list(value)})"
    if modules.is_module(value):  # a second pickled model (an EMA copy): its weights as state_dict() lists them
        try:
            return f"whole-model pickle {value.global_name}, {len(modules.state_dict(value))} tensors"
        except InputError:
            return f"whole-model pickle {value.global_name}, unreadable"
    tensors = list(iter_tensors(value))
    if is_optimizer_state(value):
        return describe_optimizer_state(value)
    if tensors:
        return f"{type(value).__name__} with {len(tensors)} tensors, {human_bytes(sum(t.nbytes for _, t in tensors))}"
    if isinstance(value, OpaqueObject):
        return f"{value.global_name} object"
    if isinstance(value, dict):
        text = (
            value_repr(value)
            if all(isinstance(v, bool | int | float | str | type(None)) for v in dict.values(value))
            else ""
        )
        return text if text and len(text) <= 80 else f"dict with {len(value)} entries"
    if isinstance(value, list | tuple):
        return f"{type(value).__name__} of {len(value)}"
    return type(value).__name__


# an entry's value is given in full (JSON) up to this many values and this depth; past that, its summary only
ENTRY_VALUES, ENTRY_DEPTH = 10_000, 32


class _NotPlain(Exception):
    """An entry (or a part of it) that is not plain data JSON carries exactly."""


def entry_type(value: Any) -> str:
    """What an entry is, as inspect's JSON names it (``int``, ``dict``, ``tensor``, ``optimizer_state``...)."""
    if value is None:
        return "null"
    for kind, name in (
        (bool, "bool"),
        (int, "int"),
        (float, "float"),
        (str, "str"),
        (bytes, "bytes"),
        (TensorRef, "tensor"),
        (DeviceRef, "device"),
        (SizeRef, "size"),
    ):
        if isinstance(value, kind):
            return name
    if modules.is_module(value):
        return "module"
    if is_optimizer_state(value):
        return "optimizer_state"
    if isinstance(value, OpaqueObject):
        return "object"
    for container, name in ((dict, "dict"), (list, "list"), (tuple, "tuple"), (set | frozenset, "set")):
        if isinstance(value, container):
            return name
    return type(value).__name__


def _plain_value(value: Any, budget: list[int], depth: int) -> Any:
    budget[0] -= 1
    if budget[0] < 0 or depth > ENTRY_DEPTH:
        raise _NotPlain
    if value is None or isinstance(value, bool | int | str):
        if isinstance(value, str):
            budget[0] -= len(value) // 64
        elif isinstance(value, int) and value.bit_length() > 14_000 and key_text(value)[0] == "<":  # past 4300 digits
            raise _NotPlain
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)  # strict JSON: "inf", "-inf", "nan"
    if isinstance(value, dict) and not isinstance(value, OpaqueObject):
        items = dict.items(value)
        if not all(
            k is None or isinstance(k, str | float | bool) or (isinstance(k, int) and key_text(k)[0] != "<")
            for k, _ in items
        ):
            raise _NotPlain
        return {key_text(k): _plain_value(v, budget, depth + 1) for k, v in items}
    if isinstance(value, list | tuple) and not isinstance(value, OpaqueObject):
        return [_plain_value(v, budget, depth + 1) for v in value]
    raise _NotPlain


def entry_record(value: Any) -> dict[str, Any]:
    """One entry as inspect reports it: ``type``, a one-line ``summary``, its ``value`` as JSON when it is
    plain data (numbers, strings, lists, dicts of them; a tensor, an object or a huge value has none),
    and ``global`` for a pickled object or module."""
    record: dict[str, Any] = {"type": entry_type(value), "summary": describe_entry(value)}
    global_name = (
        getattr(value, "global_name", None) if isinstance(value, OpaqueObject) or modules.is_module(value) else None
    )
    if isinstance(global_name, str):
        record["global"] = global_name
    try:
        record["value"] = _plain_value(value, [ENTRY_VALUES], 0)
    except _NotPlain:
        pass
    return record


is_optimizer_state = optimizers.is_optimizer_state


def describe_optimizer_state(value: dict) -> str:
    """``optimizer state: 2 params over 1 parameter group, 6 tensors (AdamW: step, exp_avg,
    exp_avg_sq), 104 B`` — what an optimizer's own state_dict holds: the optimizer it came from as
    far as its names tell (:func:`ckptool.model.optimizers.optimizer_kind`; else ``per parameter``) and
    torch's per-parameter keys."""
    state = optimizers.per_parameter_state(value)
    groups = len(optimizers.param_groups(value))
    tensors = [tensor for _, tensor in iter_tensors(value)]
    names = optimizers.state_names(value)
    kind = optimizers.optimizer_kind(value)
    shown = ", ".join(names[:6]) + (", ..." if len(names) > 6 else "")
    kinds = f" ({kind or 'per parameter'}: {shown})" if names else f" ({kind})" if kind else ""
    return (
        f"optimizer state: {len(state)} params over {groups} parameter group{'s' if groups != 1 else ''}, "
        f"{len(tensors)} tensors{kinds}, {human_bytes(sum(t.nbytes for t in tensors))}"
    )
