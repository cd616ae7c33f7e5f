"""Where the weights lie in a container: the keys training code uses, the weight sets, their spelling."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

from ckptool.base.text import value_str
from ckptool.model import lit_ema, modules, optimizers
from ckptool.model.tree import get_at, iter_tensors, order_key
from ckptool.pickles import OpaqueObject
from ckptool.pickles.layouts import LayoutTensor
from ckptool.tensors.refs import TensorRef

# Where training code puts the weights, tried in order (first match wins).
#   state_dict        Lightning, timm, many scripts          model_state_dict  the PyTorch tutorial's resumable dict
#   model             this project's training/, fairseq, DETR module   DeepSpeed
#   net / network     older research code                     ema/model_ema     EMA copies (after the live weights)
WEIGHTS_KEYS = (
    "state_dict",
    "model_state_dict",
    "model",
    "module",
    "model_state",
    "net",
    "network",
    "weights",
    "params",
    "model_ema",
    "ema",
    "state_dict_ema",
)


def is_state_dict(obj: Any) -> bool:
    """A str-keyed mapping whose values are mostly tensors."""
    if not isinstance(obj, dict) or not obj:
        return False
    # by the types present (a state dict of 100,000 tensors has a handful): no call per key or value
    if not all(issubclass(kind, str) for kind in set(map(type, obj))):
        return False
    kinds = Counter(map(type, dict.values(obj)))  # never an attribute the pickle set
    tensors = sum(count for kind, count in kinds.items() if issubclass(kind, TensorRef | LayoutTensor))
    return tensors > 0 and tensors * 2 >= len(obj)


def find_layout(container: Any) -> tuple[Any, ...] | None:
    """The key path from the top-level object to the weights, or None if there are none.

    Example:
        >>> find_layout({"model": {"fc.weight": tensor}, "epoch": 3})   # doctest: +SKIP
        ('model',)
    """
    if is_state_dict(container):
        return ()
    node: Any = container
    path: tuple[Any, ...] = ()
    for _ in range(4):
        if not isinstance(node, dict):
            break
        for key in WEIGHTS_KEYS:
            if is_state_dict(dict.get(node, key)):
                return path + (key,)
        nested = [key for key in WEIGHTS_KEYS if isinstance(dict.get(node, key), dict)]
        if not nested:
            break
        node, path = node[nested[0]], path + (nested[0],)
    if isinstance(container, dict):
        candidates = [(sum(1 for _ in iter_tensors(v)), k) for k, v in dict.items(container) if is_state_dict(v)]
        if candidates:  # the most tensors; of equal counts the greatest key, of any kinds (1 and "x" compare)
            return (max(candidates, key=lambda candidate: (candidate[0], order_key(candidate[1])))[1],)
    return _find_module(container)


def _find_module(container: Any) -> tuple[Any, ...] | None:
    """Where a whole-model pickle keeps its model (``torch.save(model)``, ``{"model": model, ...}``), when
    no state dict was found: the top level, a known key, then the first top-level module."""
    if modules.is_module(container):
        return ()
    if not isinstance(container, dict):
        return None
    for key in WEIGHTS_KEYS:
        if modules.is_module(dict.get(container, key)):
            return (key,)
    for key, value in dict.items(container):
        if modules.is_module(value):
            return (key,)
    return None


# The candidate walk's bounds: keys are looked for this deep (find_layout's own reach), and no more
# than this many containers are entered, however wide a hostile pickle makes them.
CANDIDATE_DEPTH = 4
MAX_CANDIDATE_NODES = 10_000
MAX_CANDIDATES = 1_000


@dataclass(frozen=True)
class WeightSet:
    """One set of weights a container holds: where it lies and what it is.

    Attributes:
        layout: the key path to it (``()`` for the top level).
        kind: ``"state dict"``, ``"whole-model pickle"`` (a pickled ``nn.Module``) or
            ``"optimizer state"`` (an optimizer's state dict, its tensors named by key path:
            :func:`ckptool.model.optimizers.flatten`).
        module_class: the module's class, for a whole-model pickle.
        derived: for a set derived from the state dict at ``layout`` rather than lying in the container, the
            weights path naming it (``"ema"``: the EMA copy a LitEma keeps in it, :mod:`ckptool.model.lit_ema`).
    """

    layout: tuple[Any, ...]
    kind: str
    module_class: str | None = None
    derived: str | None = None


OPTIMIZER_STATE = "optimizer state"


def weight_set_at(node: Any, layout: tuple[Any, ...]) -> WeightSet | None:
    if is_state_dict(node) and not (layout and _scalars_only(node)):
        return WeightSet(layout, "state dict")
    if modules.is_module(node):
        return WeightSet(layout, "whole-model pickle", modules.class_name(node))
    if optimizers.is_optimizer_state(node):
        return WeightSet(layout, OPTIMIZER_STATE)
    return None


def _scalars_only(mapping: dict[Any, Any]) -> bool:
    """Every tensor in ``mapping`` is 0-dim: scores, not weights (Lightning's ``ModelCheckpoint`` keeps
    ``best_k_models``, checkpoint paths mapped to their monitored metric, beside the real state dict)."""
    return all(not value.shape for value in dict.values(mapping) if isinstance(value, TensorRef | LayoutTensor))


def weight_sets(container: Any) -> list[WeightSet]:
    """Every set of weights in ``container`` (state dicts and pickled modules), in container order.

    Mappings are entered :data:`CANDIDATE_DEPTH` levels deep; a set of weights is not entered
    (a module's submodules are its own), nor an optimizer's state (listed as one set: its
    per-parameter dicts of tensors are not weights of their own).

    Example:
        >>> [w.layout for w in weight_sets({"state_dict": sd, "state_dict_ema": sd2, "epoch": 3})]  # doctest: +SKIP
        [('state_dict',), ('state_dict_ema',)]
    """
    found: list[WeightSet] = []
    seen: set[int] = set()
    stack: list[tuple[tuple[Any, ...], Any]] = [((), container)]
    entered = 0
    while stack and entered < MAX_CANDIDATE_NODES:
        layout, node = stack.pop()
        weight_set = weight_set_at(node, layout)
        if weight_set is not None:  # listed at every place it lies (one EMA object saved as two entries)
            found.append(weight_set)
            if len(found) >= MAX_CANDIDATES:
                break
            continue
        if id(node) in seen:
            continue
        seen.add(id(node))
        if (
            not isinstance(node, dict)
            or len(layout) >= CANDIDATE_DEPTH
            or (dict.__contains__(node, "state") and dict.__contains__(node, "param_groups"))
        ):
            continue
        entered += 1
        stack.extend(
            (layout + (key,), value)
            for key, value in reversed(dict.items(node))
            if isinstance(value, dict | OpaqueObject)
        )
    ema = lit_ema_set(container, found)
    if ema is not None:  # listed after the state dict it comes from
        found.insert(next(i for i, w in enumerate(found) if w.layout == ema.layout) + 1, ema)
    return found


def lit_ema_set(container: Any, found: list[WeightSet] | None = None) -> WeightSet | None:
    """The set ``"ema"`` names: the LitEma copy in the first state dict of ``container`` (of the sets ``found``
    there) that holds one, when no key path spells ``ema``."""
    sets = weight_sets(container) if found is None else found
    for weight_set in sets:
        if weight_set.kind == "state dict" and lit_ema.has_ema(get_at(container, weight_set.layout)):
            if resolve_weights(container, lit_ema.NAME) is not None:
                return None  # a key spells it: that is what the name chooses
            return WeightSet(weight_set.layout, lit_ema.KIND, derived=lit_ema.NAME)
    return None


def resolve_weights(container: Any, path: str | tuple[Any, ...] | list[Any]) -> tuple[Any, ...] | None:
    """The key path a ``weights`` argument names in ``container``, or None if it names nothing there.

    A tuple or list is a key path as it is. A string is keys joined by ``.`` or ``/``; a key that
    itself holds dots or slashes is matched whole (the longest key that fits is tried first), so
    ``model.ema`` is the key ``"model.ema"`` where there is one, else ``"model"`` then ``"ema"``.
    Digits also match an integer key or a list index. ``""`` and ``"/"`` name the top level.

    Example:
        >>> resolve_weights({"model": {"ema": sd}}, "model.ema")     # doctest: +SKIP
        ('model', 'ema')
    """
    if not isinstance(path, str):
        node = container
        for key in path:
            node = _child(node, key)
            if node is _MISSING:
                return None
        return tuple(path)
    if path in ("", "/"):
        return ()
    return _match(container, path, 0)


_MISSING = object()


def _child(node: Any, key: Any) -> Any:
    if isinstance(node, dict):
        try:
            return dict.get(node, key, _MISSING)
        except TypeError:  # an unhashable key in a caller's path names nothing
            return _MISSING
    if isinstance(node, list | tuple) and isinstance(key, int) and not isinstance(key, bool) and 0 <= key < len(node):
        return node[key]
    return _MISSING


def _match(node: Any, text: str, depth: int) -> tuple[Any, ...] | None:
    if depth > CANDIDATE_DEPTH * 4:
        return None
    ends = [index for index, char in enumerate(text) if char in "./"] + [len(text)]
    for end in reversed(ends):  # the longest key first: keys may hold dots
        part = text[:end]
        # (int() takes decimal digits of any script, not superscripts; at most 4300 of them)
        for key in (part, int(part)) if part.isdecimal() and len(part) <= 4300 else (part,):
            child = _child(node, key)
            if child is _MISSING:
                continue
            if end == len(text):
                return (key,)
            rest = _match(child, text[end + 1 :], depth + 1)
            if rest is not None:
                return (key, *rest)
    return None


def spell_weights(container: Any, layout: tuple[Any, ...]) -> str:
    """The ``weights`` string that names ``layout`` in ``container`` (``.`` between keys where that is
    unambiguous, else ``/``); the inverse of :func:`resolve_weights`."""
    if not layout:
        return "/"
    parts = [value_str(key) for key in layout]  # (a key no string can name is shown by what it is)
    for separator in (".", "/"):
        text = separator.join(parts)
        if resolve_weights(container, text) == tuple(layout):
            return text
    return "/".join(parts)
