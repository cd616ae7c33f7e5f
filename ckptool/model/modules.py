"""The weights of a whole-model pickle (``torch.save(model)``), read from its inert module records.

``torch.save(model)`` pickles every ``nn.Module`` as its class (a global) plus its ``__dict__``
(BUILD state): ``_parameters``, ``_buffers``, ``_non_persistent_buffers_set`` and ``_modules``,
the submodules in the same form. The restricted unpickler records such an object as an
:class:`~ckptool.pickles.OpaqueObject` (its class allowed by the user, never imported); this module
reads the records the way ``Module.state_dict()`` walks the live objects, without importing or
calling anything the pickle names — no ``__setstate__``, no ``_save_to_state_dict``, no hook.

What ``Module.state_dict()`` does (torch/nn/modules/module.py) and how it is followed here:

* a module's own parameters, then its persistent buffers (``_save_to_state_dict``), under
  ``prefix + name``; a None entry is skipped; a buffer named in ``_non_persistent_buffers_set``
  is left out (a pickle saved before that set existed has none: every buffer is kept, as
  ``Module.__setstate__`` fills in an empty set);
* then each submodule in ``_modules`` order under ``prefix + name + "."``, a None one skipped;
* no de-duplication: a submodule reachable by two paths appears under both, with the same
  tensors (tied);
* a parameter is given ``detach()``\\ ed: a plain tensor, not an ``nn.Parameter``;
* a later key equal to an earlier one replaces its value and keeps its place (a dict's assignment).

What the records cannot show, and torch's own call would do: a class that overrides
``_save_to_state_dict`` or ``get_extra_state`` (its code is not run), and state-dict hooks (listed
as a note when a module holds any). A module that contains itself would make torch recurse
forever: it is refused, as is a tree that would list more than :data:`MAX_MODULE_VISITS` modules.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from ckptool.base.errors import InputError
from ckptool.pickles import OpaqueObject, StateDict, brief
from ckptool.pickles.layouts import LayoutTensor
from ckptool.tensors.refs import TensorRef

# The three attributes every nn.Module's pickled state holds since torch 0.4; a record holding all
# three as mappings is read as a module.
MODULE_STATE_KEYS = ("_parameters", "_buffers", "_modules")
_HOOK_KEYS = ("_state_dict_hooks", "_state_dict_pre_hooks")
# Module visits one state dict may take. Real models have thousands of modules; a pickle that shares
# one submodule twice at each of 40 levels lists 2**40 paths, which torch would walk too.
MAX_MODULE_VISITS = 1_000_000


def module_state(obj: Any) -> dict | None:
    """The pickled ``__dict__`` of a module record, or None if ``obj`` is not one."""
    if not isinstance(obj, OpaqueObject):
        return None
    state = obj.state
    if isinstance(state, tuple) and len(state) == 2 and isinstance(state[0], dict):
        state = state[0]  # (__dict__, slots): a class with __slots__ as well
    if not isinstance(state, dict):
        return None
    if all(isinstance(dict.get(state, key), dict) for key in MODULE_STATE_KEYS):
        return state
    return None


def is_module(obj: Any) -> bool:
    """Whether ``obj`` is the inert record of a pickled ``nn.Module``."""
    return module_state(obj) is not None


def class_name(obj: Any) -> str:
    """The global a module record was pickled as (``models.yolo.DetectionModel``)."""
    return obj.global_name if isinstance(obj, OpaqueObject) else type(obj).__name__


def state_dict(module: Any, *, where: str = "", notes: list[str] | None = None) -> StateDict:
    """``module.state_dict()`` of a module record: the same keys, in the same order, the same tensors.

    Args:
        module: a module record (:func:`is_module`).
        where: how the caller names the record in messages (``'model'``).
        notes: if given, receives a line for what the records show torch would have done
            differently (state-dict hooks, which are never run).

    Raises:
        InputError: the record is not a module, a module contains itself, a name is not a
            string, an entry is not a tensor, or the tree lists more than :data:`MAX_MODULE_VISITS` modules.

    Example:
        >>> list(state_dict(ckpt.container))          # doctest: +SKIP
        ['0.weight', '0.bias', '1.weight', '1.bias', '1.running_mean', '1.running_var', '1.num_batches_tracked']
    """
    label = f"the module at {where}" if where else "the module"
    if module_state(module) is None:
        raise InputError(
            f"{label} ({brief(module)}) holds no module state (_parameters, _buffers, _modules) — "
            "ckptool cannot read its weights"
        )
    destination = StateDict()
    detached: dict[int, Any] = {}  # one plain tensor per parameter, so shared parameters stay one tensor
    hooked: list[str] = []
    visits = 0
    # pre-order, as torch recurses: (module, key prefix, ids of the modules on the path to it)
    stack: list[tuple[Any, str, frozenset[int]]] = [(module, "", frozenset())]
    while stack:
        node, prefix, ancestors = stack.pop()
        visits += 1
        if visits > MAX_MODULE_VISITS:
            raise InputError(
                f"{label} lists over {MAX_MODULE_VISITS:,} submodules (shared ones counted once per "
                "path) — refused, as too large to be a model"
            )
        state = module_state(node)
        if state is None:
            raise InputError(
                f"submodule {prefix[:-1]!r} of {label} is a {class_name(node)} pickled without module "
                "state (_parameters, _buffers, _modules) — ckptool cannot read its weights"
            )
        if id(node) in ancestors:
            raise InputError(
                f"submodule {prefix[:-1]!r} of {label} contains itself — torch's state_dict() would never end; refused"
            )
        if any(dict.get(state, key) for key in _HOOK_KEYS):
            hooked.append(prefix[:-1] or "(top)")
        skipped = _non_persistent(state, prefix, label)
        for kind in ("_parameters", "_buffers"):
            for name, value in dict.items(state[kind]):
                if value is None or (kind == "_buffers" and name in skipped):
                    continue
                if not isinstance(name, str):
                    raise InputError(
                        f"{label} names a {kind[1:-1]} {brief(name)} under {prefix[:-1]!r}, not a string — refused"
                    )
                if not isinstance(value, TensorRef | LayoutTensor):
                    raise InputError(
                        f"{label} holds {brief(value)} as {kind[1:-1]} {prefix + name!r}, not a tensor — refused"
                    )
                destination[prefix + name] = _detach(value, detached)
        children = [(name, child) for name, child in dict.items(state["_modules"]) if child is not None]
        for name, _ in children:
            if not isinstance(name, str):
                raise InputError(
                    f"{label} names a submodule {brief(name)} under {prefix[:-1]!r}, not a string — refused"
                )
        inner = ancestors | {id(node)}
        stack.extend((child, f"{prefix}{name}.", inner) for name, child in reversed(children))
    if hooked and notes is not None:
        shown = ", ".join(repr(name) for name in hooked[:3]) + (", ..." if len(hooked) > 3 else "")
        notes.append(
            f"{len(hooked)} module(s) of {label} carry state_dict hooks ({shown}), which ckptool never "
            "runs: torch's state_dict() may differ where they change it"
        )
    return destination


def _non_persistent(state: dict, prefix: str, label: str) -> frozenset:
    names = dict.get(state, "_non_persistent_buffers_set")
    if names is None:  # saved before torch 1.6 had non-persistent buffers: every buffer is kept
        return frozenset()
    if not isinstance(names, set | frozenset | list | tuple):
        raise InputError(
            f"{label} holds {brief(names)} as the non-persistent buffers of {prefix[:-1] or 'its top'!r},"
            " not a set — refused"
        )
    return frozenset(name for name in names if isinstance(name, str))


def _detach(value: Any, detached: dict[int, Any]) -> Any:
    """``param.detach()``: the tensor without the ``nn.Parameter`` wrapper (buffers are plain already)."""
    if not isinstance(value, TensorRef) or (value.parameter is None and not value.requires_grad):
        return value
    if id(value) not in detached:
        detached[id(value)] = replace(value, parameter=None, requires_grad=False)
    return detached[id(value)]
