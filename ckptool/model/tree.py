"""Walking and rewriting the object tree a checkpoint unpickles to.

Hostile pickles can build cycles, shared sub-trees repeated a billion times over, and deep
nesting; every walk here is iterative and visits each container once.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator
from itertools import repeat
from typing import Any

from ckptool.pickles import OpaqueObject
from ckptool.tensors.refs import _IS_TENSOR_REF, StorageRef, TensorRef

Path_ = tuple[Any, ...]
# values no walk needs to enter: atoms, and empty containers (a pickle of 10 million empty lists
# would otherwise cost a path tuple and a record each)
_ATOMS = frozenset({str, bytes, int, float, bool, complex, type(None)})
_EMPTYABLE = frozenset({list, dict, tuple, set, frozenset})


def _leaf(value: Any) -> bool:
    kind = type(value)
    return kind in _ATOMS or (kind in _EMPTYABLE and not value)


def _children(obj: Any) -> list[tuple[Any, Any]]:
    # Mappings are read through dict's own methods, never through attributes of the object: an
    # unpickled OrderedDict can carry attributes set by the pickle (pickles.StateDict refuses ones
    # named like its methods; this keeps every walk honest regardless).
    if isinstance(obj, dict):
        return list(dict.items(obj))
    if isinstance(obj, list | tuple):
        return list(enumerate(obj))
    if isinstance(obj, OpaqueObject):
        kids: list[tuple[Any, Any]] = [("args", obj._args), ("items", obj._items), ("state", obj._state)]
        kids += [(("setitem", i), value) for i, (_, value) in enumerate(obj._setitems)]
        return kids
    return []


def _child_values(obj: Any) -> Any:
    """The values :func:`_children` pairs with keys, without building a pair per value."""
    if isinstance(obj, dict):
        return obj.values()
    if isinstance(obj, list | tuple):
        return obj
    if isinstance(obj, OpaqueObject):
        return [obj._args, obj._items, obj._state, *(value for _, value in obj._setitems)]
    return ()


def iter_tensors(obj: Any, *, storages: bool = False) -> Iterator[tuple[Path_, TensorRef]]:
    """Every TensorRef reachable from ``obj`` with the key path to its first occurrence.

    ``storages``: a storage saved as a value of its own (``torch.save(t.untyped_storage())``) is
    yielded too, as a 1-d tensor of its dtype over all of it.
    """
    seen: set[int] = set()
    stack: list[tuple[Path_, Any]] = [((), obj)]
    while stack:
        path, node = stack.pop()
        if isinstance(node, TensorRef):
            if id(node) not in seen:
                seen.add(id(node))
                yield path, node
            continue
        if storages and isinstance(node, StorageRef):
            if id(node) not in seen:
                seen.add(id(node))
                yield path, TensorRef(storage=node, dtype=node.dtype, shape=(node.numel,), stride=(1,))
            continue
        if id(node) in seen:
            continue
        if isinstance(node, list | tuple):  # no (index, value) pair per item: lists can be huge
            if node:
                seen.add(id(node))
                stack.extend(
                    (path + (index,), node[index]) for index in range(len(node) - 1, -1, -1) if not _leaf(node[index])
                )
            continue
        kids = _children(node)
        if kids:
            seen.add(id(node))
            stack.extend((path + (key,), value) for key, value in reversed(kids) if not _leaf(value))


def tensor_values(obj: Any) -> list[TensorRef]:
    """The tensors :func:`iter_tensors` yields, in its order, without the key path to each (no tuple
    per value: what counts storages or devices needs no names).

    Depth first through a stack of iterators, one per container entered; a state dict's 100,000
    tensors are taken at once (C-speed passes), not one by one. Each tensor once: they are gathered as
    the keys of a dict, where a TensorRef hashes by identity (``eq=False``) and keeps its first place."""
    seen: set[int] = set()  # containers entered
    found: dict[TensorRef, None] = {}
    stack: list[Iterator[Any]] = [iter((obj,))]
    atoms, emptyable = _ATOMS, _EMPTYABLE
    while stack:
        for node in stack[-1]:
            kind = type(node)
            if kind is TensorRef or isinstance(node, TensorRef):
                found[node] = None
                continue
            if kind in atoms or (kind in emptyable and not node) or id(node) in seen:
                continue
            if isinstance(node, dict):
                values = list(dict.values(node))
                if values and all(map(_IS_TENSOR_REF, values)):  # a state dict: its tensors at once (tested in C)
                    seen.add(id(node))
                    if found:
                        found.update(zip(values, repeat(None)))
                    else:
                        found = dict.fromkeys(values)
                    continue
            elif isinstance(node, list | tuple):
                values = list(node)
            else:
                values = [value for _, value in _children(node)]
            if values:
                seen.add(id(node))
                stack.append(iter(values))
                break  # into the container; this one's iterator goes on where it stopped
        else:
            stack.pop()
    return list(found)


def contains(obj: Any, kind: type) -> bool:
    """Whether an object of ``kind`` is reachable from ``obj`` (each container visited once)."""
    seen: set[int] = set()
    stack: list[Any] = [obj]
    while stack:
        node = stack.pop()
        if isinstance(node, kind):
            return True
        if _leaf(node) or id(node) in seen:
            continue
        seen.add(id(node))
        stack.extend(_child_values(node))
    return False


def placeholder_classes(obj: Any) -> dict[type, None]:
    """Every placeholder class reachable from ``obj`` (an allowed object's class, a class or function held
    as a value, a key included), each once, in the order met.

    There is one class per spelling of a global (``m`` + ``Outer.Inner``, ``m.Outer`` + ``Inner`` and
    ``getattr(m.Outer, 'Inner')`` are three), so a rewrite that reads back with a class its input did not
    hold spelled a name otherwise: it would not load as the same object. A tensor's own parts name only
    torch's globals, and a state dict's tensors are passed over at once (tested in C).
    """
    found: dict[type, None] = {}
    seen: set[int] = set()
    stack: list[Any] = [obj]
    atoms, emptyable = _ATOMS, _EMPTYABLE
    while stack:
        node = stack.pop()
        kind = type(node)
        if kind in atoms or kind is TensorRef or (kind in emptyable and not node) or id(node) in seen:
            continue
        seen.add(id(node))
        if isinstance(node, type):
            if issubclass(node, OpaqueObject):
                found[node] = None
                if node._parent is not None:  # read from getattr(<parent>, 'name')
                    stack.append(node._parent)
            continue
        if isinstance(node, OpaqueObject):
            found[kind] = None
            stack.extend(_child_values(node))
            stack.extend(key for key, _ in node._setitems)
        elif isinstance(node, dict):
            values = list(dict.values(node))
            if not all(map(_IS_TENSOR_REF, values)):
                stack.extend(values)
            if set(map(type, dict.keys(node))) != {str}:  # (a state dict's 100,000 str keys: one C pass)
                stack.extend(key for key in dict.keys(node) if type(key) is not str)
        elif isinstance(node, list | tuple | set | frozenset):
            stack.extend(node)
    return found


_CLOSE, _OPEN = (-1,), (2,)  # a tuple's ends: a shorter tuple sorts before a longer one it begins


def order_key(value: Any) -> tuple:
    """A sort key under which any two dict keys a pickle can hold compare, mixed kinds included.

    ``sorted({1: a, "x": b})`` raises TypeError (``'<' not supported between 'str' and 'int'``); keys
    compared through this never do: strings (by value), then numbers (ints, floats and bools by value),
    then tuples (item by item under this same order, a shorter one first), then None, then anything
    else by its type's name (equal keys keep their order in a stable sort). Built without recursion:
    a key may nest a thousand tuples deep.

    Example:
        >>> sorted([(1, 2), None, 3, "b", (1,)], key=order_key)
        ['b', 3, (1,), (1, 2), None]
    """
    tokens: list[tuple] = []
    stack: list[Any] = [value]
    while stack:
        item = stack.pop()
        kind = type(item)
        if item is _CLOSE:
            tokens.append(_CLOSE)
        elif kind is str or isinstance(item, str):
            tokens.append((0, str(item)))
        elif kind in (int, bool, float) or isinstance(item, int | float):
            tokens.append((1, item))
        elif kind is tuple:
            tokens.append(_OPEN)
            stack.append(_CLOSE)
            stack.extend(reversed(item))
        elif item is None:
            tokens.append((3,))
        else:
            tokens.append((4, kind.__qualname__))
    return tuple(tokens)


def get_at(container: Any, layout: Path_) -> Any:
    node = container
    for key in layout:
        node = node[key]
    return node


def replace_at(container: Any, layout: Path_, value: Any) -> Any:
    """A copy of ``container`` with the node at ``layout`` replaced; untouched branches are shared."""
    if not layout:
        return value
    head, rest = layout[0], layout[1:]
    child = replace_at(container[head], rest, value)
    if isinstance(container, dict):
        copy = copy_mapping(container)
        copy[head] = child
        return copy
    if isinstance(container, list):
        copy_list = list(container)
        copy_list[head] = child
        return copy_list
    if isinstance(container, tuple):
        return container[:head] + (child,) + container[head + 1 :]
    raise TypeError(f"cannot replace inside a {type(container).__name__}")


def copy_mapping(mapping: dict, items: list[tuple[Any, Any]] | None = None) -> dict:
    """A shallow copy keeping the mapping's type and attributes (a state_dict's ``_metadata``)."""
    copy = type(mapping)() if isinstance(mapping, OrderedDict) else {}
    copy.update(dict.items(mapping) if items is None else items)  # each pair set in order, as a loop sets them
    state = getattr(mapping, "__dict__", None)
    if state:
        copy.__dict__.update(state)
    return copy


def map_tensors(obj: Any, fn: Callable[[TensorRef], TensorRef]) -> Any:
    """Rebuild ``obj`` with every tensor replaced by ``fn(tensor)``; sharing and types are kept.

    Containers holding no tensors are returned as they are; each tensor is mapped once, so tensors
    that were one object stay one object.
    """
    memo: dict[int, Any] = {}
    has_tensor: dict[int, bool] = {}

    def contains(node: Any) -> bool:
        # iterative post-order: does the sub-tree hold a tensor?
        stack = [(node, False)]
        while stack:
            item, done = stack.pop()
            key = id(item)
            if isinstance(item, TensorRef):
                has_tensor[key] = True
                continue
            if key in has_tensor and not done:
                continue
            kids = _child_values(item)
            if not done:
                has_tensor[key] = False  # provisional: breaks cycles
                stack.append((item, True))
                stack.extend((child, False) for child in kids if not _leaf(child))
            else:
                has_tensor[key] = any(
                    not _leaf(child) and has_tensor.get(id(child), isinstance(child, TensorRef)) for child in kids
                )
        return has_tensor[id(node)]

    contains(obj)

    def rebuild(node: Any, depth: int = 0) -> Any:
        key = id(node)
        if key in memo:
            return memo[key]
        if isinstance(node, TensorRef):
            memo[key] = fn(node)
            return memo[key]
        if not has_tensor.get(key, False):
            return node
        if isinstance(node, dict):
            copy = copy_mapping(node, items=[])
            memo[key] = copy
            for k, v in dict.items(node):
                copy[k] = rebuild(v, depth + 1)
            return copy
        if isinstance(node, list):
            copy_list: list = []
            memo[key] = copy_list
            copy_list.extend(rebuild(v, depth + 1) for v in node)
            return copy_list
        if isinstance(node, tuple):
            result = (
                type(node)(rebuild(v, depth + 1) for v in node)
                if type(node) is tuple
                else type(node)([rebuild(v, depth + 1) for v in node])
            )
            memo[key] = result
            return result
        if isinstance(node, OpaqueObject):
            copy_obj = object.__new__(type(node))
            memo[key] = copy_obj
            copy_obj._mode = node._mode
            copy_obj._args = tuple(rebuild(v, depth + 1) for v in node._args)
            copy_obj._items = [rebuild(v, depth + 1) for v in node._items]
            copy_obj._setitems = [(k, rebuild(v, depth + 1)) for k, v in node._setitems]
            copy_obj._state = rebuild(node._state, depth + 1)
            return copy_obj
        return node

    return rebuild(obj)


def spelling(cls: type) -> str:
    """How a pickle names a placeholder class: ``getattr(m.Outer, 'Inner')``, ``m:Outer.Inner`` (module ``m``,
    a nested name) or its plain global ``m.Outer``."""
    attributes: list[str] = []
    while getattr(cls, "_parent", None) is not None:  # (a chain of getattr calls: no recursion over its length)
        attributes.append(cls._attribute)  # type: ignore[attr-defined]
        cls = cls._parent  # type: ignore[attr-defined]
    module = getattr(cls, "_module", None)
    name: str = getattr(cls, "_global", "") or cls.__qualname__
    text = f"{module}:{name[len(module) + 1 :]}" if module else name
    for attribute in reversed(attributes):
        text = f"getattr({text}, {attribute!r})"
    return text
