"""The guard's records of the values a pickle builds, and the small readers its walks share.

A :class:`Value` stands for one value on the unpickler's stack or in its memo: what kind it is, the
global that made it, how many values it nests and how deep, whether it hashes predictably, and
the value itself where the guard can know it (:data:`OPAQUE` where it cannot).
"""

from __future__ import annotations

import re
from typing import Any

from ckptool.base.errors import InputError
from ckptool.pickles import limits
from ckptool.pickles.allowlist import TORCH_GLOBALS
from ckptool.pickles.limits import refuse


class Truncated(InputError):
    """The pickle runs past the end of the bytes given (the stream reader then reads more)."""

    def __init__(
        self, message: str = "pickle is truncated (it ends before its STOP opcode)", *, path: object = None
    ) -> None:
        super().__init__(message, path=path)  # type: ignore[arg-type]


OPAQUE = object()  # the guard does not know the value (salted hash, or not hashable)


class Value:
    """The guard's record of one stack or memo value (never the value itself).

    ``kind``: "str", "literal", "bytes", "tuple", "global", "object", "container", "list" or
    "other"; ``name``: a str's raw bytes (≤ 256) or the global a global/object came from;
    ``nodes``: what hashing it visits (tuples: every element, recursively); ``hashable``;
    ``value``: ints, floats, None and tuples of them — hashes a pickle can predict — else OPAQUE;
    ``depth``: how deep tuples nest in it (0 for anything but a tuple), which comparing two equal ones
    recurses. A class with slots: its fields read as fast as a tuple's items in the per-opcode loop.
    """

    __slots__ = ("kind", "name", "nodes", "hashable", "value", "depth")

    def __init__(self, kind: str, name: Any, nodes: int, hashable: bool, value: Any, depth: int = 0) -> None:
        self.kind, self.name, self.nodes, self.hashable, self.value = kind, name, nodes, hashable, value
        self.depth = depth


class Receiver(Value):
    """The record of a value that takes keys (a dict, a set, an object), each its own: ``buckets``
    holds its predictable keys by hash, to catch collision floods."""

    __slots__ = ("buckets",)

    def __init__(self, kind: str, name: str | None = None, hashable: bool = False) -> None:
        self.kind, self.name, self.nodes, self.hashable, self.value = kind, name, 1, hashable, OPAQUE
        self.depth = 0
        self.buckets: dict[int, set] | None = None


_STR = Value("str", None, 1, True, OPAQUE)
_BYTES = Value("bytes", None, 1, True, OPAQUE)
_OTHER = Value("other", None, 1, False, OPAQUE)
_LIST = Value("list", None, 1, False, OPAQUE)  # lists take APPENDs, never keys: one record serves all
_EMPTY_TUPLE = Value("tuple", None, 1, True, (), 1)
_NONE, _TRUE, _FALSE = (Value("literal", None, 1, True, value) for value in (None, True, False))
_BYTE_INTS = [Value("literal", None, 1, True, value) for value in range(256)]
_PLACEHOLDER_COST = 512  # a TensorRef, StorageRef or OpaqueObject record
_CANONICAL_INT = re.compile(rb"-?(0|[1-9][0-9]*)")
_DIGITS = re.compile(rb"[0-9]+")
_MAX_TEXT_NAME = 256  # longer strings are never a global's module or name
_MAX_DIGITS = 4300  # int() refuses longer digit strings (Python's default int_max_str_digits): no pickler writes them


def _text(raw: bytes) -> Value:
    return Value("str", raw, 1, True, OPAQUE) if len(raw) <= _MAX_TEXT_NAME else _STR


def _literal(value: Any) -> Value:
    return Value("literal", None, 1, True, value)


# Pickle's protocol-2 spelling of a nested name (``Outer.Inner``, ``HistoryBuffer.min``): REDUCE of
# ``getattr`` with a global and a plain identifier. The reader takes it for the global it spells
# (:meth:`~ckptool.pickles.GlobalResolver.resolve`), so the walk does: an object of it may get its state.
_ATTRIBUTE_LOOKUPS = frozenset({"builtins.getattr", "__builtin__.getattr"})


def _attribute_pair(items: list[Value]) -> str | None:
    """``<global>.<name>`` when ``items`` are a global and a plain identifier, no dunder: getattr's arguments
    spelling a nested name; else None."""
    parent, attribute = items
    if parent.kind != "global" or parent.name is None or attribute.kind != "str" or attribute.name is None:
        return None
    text = _text_name(attribute.name)
    if text is None or not text.isidentifier() or (text.startswith("__") and text.endswith("__")):
        return None
    return f"{parent.name}.{text}"


def _new_tuple(items: list[Value]) -> Value:
    nodes = 1
    depth = 0
    hashable = predictable = True
    for item in items:
        nodes += item.nodes
        if item.depth > depth:
            depth = item.depth
        if not item.hashable:
            hashable = False
        elif item.value is OPAQUE:
            predictable = False
    max_nodes = limits.MAX_KEY_NODES
    if nodes > max_nodes:
        nodes = max_nodes + 1
    if not (predictable and hashable):
        nested = _attribute_pair(items) if len(items) == 2 else None
        if nested is not None:  # a tuple like any other, knowing the name getattr would make of it
            return Value("tuple", nested, nodes, hashable, OPAQUE, depth + 1)
        return _opaque_tuple(nodes, hashable, depth + 1)
    return Value("tuple", None, nodes, hashable, tuple([item.value for item in items]), depth + 1)


# records never change: tuples alike but for values the guard cannot know share one; at most
# MAX_KEY_NODES + 1 depths of 2 * (MAX_KEY_NODES + 1) records, none holding anything a pickle wrote
_OPAQUE_TUPLES: dict[tuple[int, bool, int], Value] = {}


def _opaque_tuple(nodes: int, hashable: bool, depth: int) -> Value:
    """The shared record of tuples of ``nodes`` values nesting ``depth`` deep that the guard cannot all know."""
    record = _OPAQUE_TUPLES.get((nodes, hashable, depth))
    if record is None:
        record = _OPAQUE_TUPLES[nodes, hashable, depth] = Value("tuple", None, nodes, hashable, OPAQUE, depth)
    return record


# torch's globals that build a hashable value (bytes, a complex number): usable as a dict key like any value
_VALUES = frozenset({"_codecs.encode", "builtins.complex", "__builtin__.complex"})
_TORCH_NAMES: list[frozenset[str]] = []  # TORCH_GLOBALS as a pickle may spell them, once it is complete


def _torch_names() -> frozenset[str]:
    """``TORCH_GLOBALS``' names as a pickle may spell them: Python 3's, and protocol 2's (``__builtin__.set``),
    which the resolver maps through pickle's compatibility table before looking them up."""
    if not _TORCH_NAMES or len(_TORCH_NAMES[0]) < len(TORCH_GLOBALS):
        import _compat_pickle

        names = set(TORCH_GLOBALS)
        for name in TORCH_GLOBALS:
            module, _, attribute = name.rpartition(".")
            old = _compat_pickle.REVERSE_NAME_MAPPING.get((module, attribute))
            if old is not None:
                names.add(".".join(old))
            if module in _compat_pickle.REVERSE_IMPORT_MAPPING:
                names.add(f"{_compat_pickle.REVERSE_IMPORT_MAPPING[module]}.{attribute}")
        _TORCH_NAMES[:] = [frozenset(names)]
    return _TORCH_NAMES[0]


def _made_by(callable_: Value) -> Receiver:
    """The record of an object a callable builds (REDUCE, NEWOBJ, OBJ): it may receive items."""
    name = callable_.name if callable_.kind == "global" else None
    # a placeholder object hashes by identity; _codecs.encode gives bytes (salted hash)
    return Receiver("object", name, name is not None and (name in _VALUES or name not in _torch_names()))


def _text_name(raw: bytes | None) -> str | None:
    if raw is None or len(raw) > _MAX_TEXT_NAME:
        return None
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return None


def _line(data: bytes, i: int) -> tuple[bytes, int]:
    """The text argument starting at ``i`` (up to its newline), and where the next opcode starts."""
    newline = data.find(b"\n", i)
    if newline < 0:
        raise Truncated()
    return data[i:newline], newline + 1


def _pop_mark(stack: list[Value], marks: list[int]) -> tuple[list[Value], int]:
    """The values above the last MARK, taken off the stack, and the stack's new fence."""
    if not marks:
        raise refuse("has no MARK where one is needed (corrupt)")
    index = marks.pop()
    items = stack[index:]
    del stack[index:]
    return items, marks[-1] if marks else 0
