"""Globals a pickle only refers to: a class outside the allowlist that is never called is data.

A pickle names a class without calling it when the class itself is the value: Lightning 1.x keys its
``callbacks`` entry by the ``ModelCheckpoint`` class (``{<class ModelCheckpoint>: {...}}``). Nothing of the
class runs when such a pickle is read; the file holds its name, as it holds a string. Such a global is read
as the placeholder class an ``--allow-global`` read gives it, with no flag, when all of these hold:

- it is not known to run code or reach the system (:func:`~ckptool.pickles.allowlist.runs_code`: those are
  refused however a pickle uses them);
- the pickle never calls it: no object of it is built, by REDUCE, NEWOBJ, NEWOBJ_EX, OBJ or INST, from a
  GLOBAL or the memo (:data:`~ckptool.pickles.placeholders.WATCHED` sees each call, whichever way it comes),
  nor of a nested name spelled through it (extension codes, EXT1/2/4, the guard refuses outright);
- the tree the read built holds it only inside plain containers (dicts, lists, tuples, sets, an
  OrderedDict), as a key, a value or an item, reached from the top through such containers alone: never an
  argument an object keeps, a tensor's hooks or state, an object's state;
- the read ran to its end, and every other global it refused is such a one too — else the refusal names them
  all, word for word as when none is data.

What else a pickle could do with a class it holds is refused before this is asked: the guard refuses BUILD on
a global and items set on one, and appending to one fails in the unpickler (the read stops early: every refused
name is refused). ``scan`` still calls such a global unknown (torch.load imports its module to read it).
"""

from __future__ import annotations

from typing import Any

from ckptool.pickles.placeholders import OpaqueObject, StateDict, watched_names

# the containers a referenced class may lie in: what a pickle builds from its own opcodes (a set or an
# OrderedDict through torch's allowed calls), holding values and nothing else
_PLAIN = frozenset({dict, list, tuple, set, frozenset, StateDict})
_ATOMS = frozenset({str, bytes, bytearray, int, float, bool, complex, type(None)})


def accept_data_references(resolver: Any, root: Any, children: Any) -> list[str]:
    """Accept the globals ``resolver`` refused when every one of them is only referred to in ``root`` (the
    read's tree; ``children(obj)`` lists what any other object holds); the names accepted, else none."""
    ask = getattr(resolver, "data_references", None)
    names = ask() if ask is not None else []
    if not names or not only_as_values(root, frozenset(names), children):
        return []
    resolver.accept(names)
    return names


def only_as_values(root: Any, names: frozenset[str], children: Any) -> bool:
    """Whether the placeholder classes of ``names`` lie in ``root`` only inside plain containers reached from
    the top through plain containers, and no object of one (or of a nested name spelled through one) is in it.

    One pass; an object reached both through plain containers and through anything else is walked as the
    latter (at most twice in all), so a tree the memo shares or makes cyclic costs its size."""
    seen: dict[int, bool] = {}  # id -> whether it was walked as plain (False: walked as held by an object)
    stack: list[tuple[Any, bool]] = [(root, True)]
    while stack:
        obj, plain = stack.pop()
        kind = type(obj)
        if kind in _ATOMS:
            continue
        if isinstance(obj, type):
            if not plain and issubclass(obj, OpaqueObject) and not names.isdisjoint(watched_names(obj)):
                return False
            continue
        walked = seen.get(id(obj))
        if walked is not None and (plain or not walked):  # nothing new: only plain after held is walked again
            continue
        seen[id(obj)] = plain
        if isinstance(obj, OpaqueObject):
            if not names.isdisjoint(watched_names(kind)):  # an object of it: the pickle called it
                return False
            stack.extend((child, False) for child in children(obj))
        elif kind in _PLAIN:
            items = [*dict.keys(obj), *dict.values(obj)] if isinstance(obj, dict) else list(obj)
            stack.extend((item, plain) for item in items)
            attributes = getattr(obj, "__dict__", None)  # an OrderedDict's attributes (BUILD): an object's state
            if attributes:
                stack.extend((value, False) for value in attributes.values())
        else:
            stack.extend((child, False) for child in children(obj))
    return True
