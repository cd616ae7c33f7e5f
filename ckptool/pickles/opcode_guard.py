"""The guard: what the C unpickler would do, in one linear pass, before it does it.

find_class keeps every callable inert, but the C unpickler itself can still be made to hang or
to allocate without bound by a few bytes of opcodes: hashing a dict key that is a tuple of
tuples shared through the memo (2**60 steps), keys whose hashes all collide (quadratic), a
PUT at memo index 2**32 (a 64 GiB memo table), or BUILD setting attributes on a placeholder
after it was validated. The guard mirrors the unpickler's stack and memo with small records of
what each value is (:class:`Value`), and refuses those pickles; it never builds the values themselves.

Two walks do that, alike to the byte: :class:`_Walk` here, the reference, and its C twin
(``_guard.c``, an optional extension built with the package), ~40 times faster, used when it was
built (:data:`NATIVE`) unless ``CKPTOOL_PURE_PYTHON=1`` asks for this module's walk.
"""

from __future__ import annotations

import gc
import re
import struct
from collections.abc import Callable
from typing import Any

from ckptool import native
from ckptool.base.errors import InputError
from ckptool.pickles import limits
from ckptool.pickles.allowlist import TORCH_GLOBALS
from ckptool.pickles.guard_cache import GuardCache, PickleStats
from ckptool.pickles.limits import refuse


class Truncated(InputError):
    """The pickle runs past the end of the bytes given (the stream reader then reads more)."""

    def __init__(
        self, message: str = "pickle is truncated (it ends before its STOP opcode)", *, path: object = None
    ) -> None:
        super().__init__(message, path=path)  # type: ignore[arg-type]


_native: Any = native.load("_guard")
# whether guard_stats walks in C (tests/test_guard_native.py holds the two walks to the same results)
NATIVE = _native is not None
_NATIVE_LIMIT = 1 << 62  # the C walk's range for each limit (a test may set any): past it, the Python walk
_NATIVE_MAX_NESTING = 255  # a C tuple record holds its depth in a byte

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
_UNKNOWN_GLOBAL = Value("global", None, 1, True, OPAQUE)
_NONE, _TRUE, _FALSE = (Value("literal", None, 1, True, value) for value in (None, True, False))
_BYTE_INTS = [Value("literal", None, 1, True, value) for value in range(256)]
_PLACEHOLDER_COST = 512  # a TensorRef, StorageRef or OpaqueObject record
_CANONICAL_INT = re.compile(rb"-?(0|[1-9][0-9]*)")
_DIGITS = re.compile(rb"[0-9]+")
_MAX_TEXT_NAME = 256  # longer strings are never a global's module or name
_MAX_DIGITS = 4300  # int() refuses longer digit strings (Python's default int_max_str_digits): no pickler writes them


def _crossing(frame_end: int) -> str:
    """The refusal of an opcode whose argument runs past its frame's end. CPython's unpickler reading from
    a file serves a frame's opcodes from one buffer and reads an argument the buffer cannot hold from
    the bytes after the frame, dropping what was left; read from bytes, it reads on across the end; the
    Python unpickler refuses. Which opcodes run depends on the reader: the pickle is refused."""
    return (
        f"has an opcode that runs past the end of its frame at offset {frame_end}, so unpicklers would read "
        "different opcodes from it (a disguise)"
    )


def _text(raw: bytes) -> Value:
    return Value("str", raw, 1, True, OPAQUE) if len(raw) <= _MAX_TEXT_NAME else _STR


def _literal(value: Any) -> Value:
    return Value("literal", None, 1, True, value)


def guard(data: bytes, cache: GuardCache | None = None) -> int:
    """Walk one pickle's opcodes as the unpickler would, refusing what would hang it or blow it up.

    Returns the pickle's length (up to and including STOP); raises :class:`Truncated` if ``data``
    ends first. Refused: BUILD on anything but an OrderedDict or an allowed object placeholder;
    dict keys and set elements that are not plain hashable values, nest over MAX_KEY_NODES values,
    cost more hashing in all than the pickle's length allows, or collide (over MAX_HASH_COLLISIONS
    distinct keys with one hash in one dict); memo indices no pickler writes; over
    MAX_UNPICKLED_BYTES of objects (estimated). Arguments must be in the form Python's pickler
    writes them (``INT 010`` is 8 to the C unpickler and 10 to Python's ``int``: refused).
    """
    return guard_stats(data, cache).size


def guard_stats(data: bytes, cache: GuardCache | None = None) -> PickleStats:
    """:func:`guard`, returning what it saw (:class:`PickleStats`); a pickle ``cache`` holds is not walked again."""
    if cache is not None:
        stats = cache.walked(data)
        if stats is not None:
            return stats
    collecting = gc.isenabled()
    gc.disable()  # the walk's records hold no references to each other: no cycle for a collection to find
    try:
        stats = _native_walk(data) if NATIVE and type(data) is bytes and _native_limits() else _python_walk(data)
    except RecursionError:  # two equal keys ~1000 tuples deep: comparing them, as a dict would, recursed too far
        raise refuse("has dict keys or set elements nested too deeply to compare (a hashing bomb)") from None
    finally:
        if collecting:
            gc.enable()
    if cache is not None:
        cache.add_walked(data if stats.size == len(data) else data[: stats.size], stats)
    return stats


def _python_walk(data: bytes) -> PickleStats:
    counts = [0] * 256
    names: list[str] = []
    return PickleStats(_Walk(data, counts, names).run(), counts, names)


def _native_limits() -> bool:
    return (
        all(
            type(limit) is int and 0 <= limit <= _NATIVE_LIMIT
            for limit in (
                limits.MAX_UNPICKLED_BYTES,
                limits.MAX_PICKLE_BYTES,
                limits.MAX_KEY_NODES,
                limits.MAX_HASH_COLLISIONS,
                limits.MAX_GLOBALS,
            )
        )
        and type(limits.MAX_NESTING) is int
        and 0 <= limits.MAX_NESTING < _NATIVE_MAX_NESTING
    )


def _native_walk(data: bytes) -> PickleStats:
    """The C walk: the Python walk's results, its Truncated and its refusals' messages."""
    assert _native is not None
    result = _native.walk(
        data,
        limits.MAX_UNPICKLED_BYTES,
        limits.MAX_PICKLE_BYTES,
        limits.MAX_KEY_NODES,
        limits.MAX_HASH_COLLISIONS,
        limits.MAX_NESTING,
        limits.MAX_GLOBALS,
        _torch_names(),
    )
    if result is None:
        raise Truncated()
    if type(result) is str:
        raise refuse(result)
    return PickleStats(*result)


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


_MAX_SHAPE_BYTES = 64  # longer size or stride tuples are walked opcode by opcode (and not kept by their bytes)
_INT_OPS = re.compile(rb"K.|M..|J....", re.DOTALL)
_PUT, _GET, _INT = rb"(q.|r....)", rb"(h.|j....)", rb"(K.|M..|J....)"
_INTS = rb"(\)|(?:K.|M..|J....){1,3}[\x85-\x87]|\((?:K.|M..|J....)*t)"
# A state-dict entry after its key, as torch's pickler (protocol 2) writes it once the globals and the
# strings 'storage' and 'cpu' are in the memo: PUT the key; _rebuild_tensor_v2 (GET) MARK MARK
# 'storage' (GET) storage class (GET) storage key (BINUNICODE of digits, PUT) location (GET) numel
# TUPLE PUT BINPERSID; offset; size tuple [PUT]; stride tuple [PUT]; requires_grad; OrderedDict (GET)
# EMPTY_TUPLE REDUCE PUT (the hooks); TUPLE PUT REDUCE PUT.
_ENTRY = re.compile(
    _PUT
    + _GET
    + rb"\(\("
    + _GET
    + _GET
    + rb"X(.)\x00\x00\x00([0-9]{1,12})"
    + _PUT
    + _GET
    + _INT
    + rb"t"
    + _PUT
    + rb"Q"
    + _INT
    + _INTS
    + rb"(q.|r....)?"
    + _INTS
    + rb"(q.|r....)?"
    + rb"([\x88\x89])"
    + _GET
    + rb"\)R"
    + _PUT
    + rb"t"
    + _PUT
    + rb"R"
    + _PUT,
    re.DOTALL,
)


def _int_tuple(cache: dict, raw: bytes) -> tuple[Value, int, list[int], int] | None:
    """A tuple of ints as the walk reads ``raw`` (EMPTY_TUPLE, ints and TUPLE1-3, or MARK ints TUPLE):
    its record, its opcodes' count, their codes, and the memory the walk counts; None if the count
    of ints is not the TUPLEn opcode's (the walk then reads it opcode by opcode). Kept in ``cache``."""
    if raw == b")":
        shape = (_EMPTY_TUPLE, 1, [0x29], 0)
    else:
        items: list[Value] = []
        codes: list[int] = []
        memory = 0
        for op in _INT_OPS.findall(raw, 1 if raw[0] == 0x28 else 0, len(raw) - 1):
            codes.append(op[0])
            if op[0] == 0x4B:
                items.append(_BYTE_INTS[op[1]])
            else:
                items.append(_literal(int.from_bytes(op[1:], "little", signed=op[0] == 0x4A)))
                memory += 40
        last = raw[-1]
        if last == 0x74:  # MARK ... TUPLE
            codes[:0] = [0x28]
            memory += 8
        elif last - 0x84 != len(items):
            cache[raw] = None
            return None
        codes.append(last)
        shape = (_new_tuple(items) if items else _EMPTY_TUPLE, len(codes), codes, memory + 56 + 8 * len(items))
    cache[raw] = shape
    return shape


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


class _Walk:
    """One pass over one pickle: the unpickler's stack, marks and memo, as records.

    :meth:`run` handles the opcodes of a state-dict entry inline; every other opcode has its own
    method in :data:`_RARE`, which reads and updates the walk's position (``at``), ``fence`` (the
    stack's depth at the last MARK: nothing may be taken from below it) and ``memory`` estimate.
    """

    __slots__ = (
        "data",
        "end",
        "counts",
        "names",
        "stack",
        "marks",
        "memo",
        "at",
        "fence",
        "ops",
        "hashing",
        "memory",
        "tuples",
        "shapes",
        "entries",
        "memo_top",
    )

    def __init__(self, data: bytes, counts: list[int], names: list[str]) -> None:
        self.data, self.end, self.counts, self.names = data, len(data), counts, names
        self.stack: list[Value] = []
        self.marks: list[int] = []
        self.memo: dict[int, Value] = {}
        self.at = self.fence = self.ops = self.hashing = self.memory = 0
        # one past the highest memo index stored: CPython's unpickler holds its memo in a table of
        # pointers that long (grown to twice the index asked for), whichever indices are stored
        self.memo_top = 0
        self.tuples: dict[bytes, tuple[Value, int, list[int], int] | None] = {}  # an entry's int tuples by their bytes
        self.shapes: dict[bytes, int] = {}  # how many times each was walked in an entry
        self.entries = 0  # the entries walked in one step (their opcodes counted at the end)

    def count_entries(self) -> None:
        """Add the opcodes of the entries walked in one step that :meth:`entry` only tallied."""
        counts, entries = self.counts, self.entries
        for code, times in ((0x58, 1), (0x28, 2), (0x74, 2), (0x51, 1), (0x52, 2), (0x29, 1)):
            counts[code] += times * entries
        for raw, times in self.shapes.items():
            for code in self.tuples[raw][2]:  # type: ignore[index]
                counts[code] += times
        self.entries = 0
        self.shapes.clear()

    def run(self) -> int:
        """Walk to STOP; return the pickle's length.

        One loop, longer than a function should be, because it is the hot path: a 100k-tensor
        pickle is 3 million opcodes, and a call per opcode would cost a quarter of the walk. The
        ~15 opcodes torch's pickles are made of (a state-dict entry is ~30 of them) are handled
        here, in order of frequency, with the walk's state in local variables; each other opcode
        has its own method, reached through :data:`_RARE`.
        """
        data, end, counts = self.data, self.end, self.counts
        stack, marks, memo = self.stack, self.marks, self.memo
        push = stack.append
        rare = _RARE
        byte_ints = _BYTE_INTS
        entry_match = _ENTRY.match
        max_memory, max_pickle = limits.MAX_UNPICKLED_BYTES, limits.MAX_PICKLE_BYTES
        i = fence = ops = memory = top = 0
        frame_end = 0  # where the frame being read ends; 0 outside frames (torch writes none)
        try:
            while True:
                if frame_end and i >= frame_end:
                    if i > frame_end:
                        raise refuse(_crossing(frame_end))
                    frame_end = 0
                code = data[i]  # IndexError past the end: truncated
                i += 1
                ops += 1
                counts[code] += 1
                if code == 0x72 or code == 0x71 or code == 0x94 or code == 0x70:  # LONG_BINPUT BINPUT MEMOIZE PUT
                    if code == 0x72:
                        index = int.from_bytes(data[i : i + 4], "little")
                        i += 4
                        if i > end:
                            raise Truncated()
                    elif code == 0x71:
                        index = data[i]
                        i += 1
                    elif code == 0x94:
                        index = len(memo)
                    else:
                        raw, i = _line(data, i)
                        if not _DIGITS.fullmatch(raw) or len(raw) > _MAX_DIGITS:
                            raise refuse(f"has a malformed PUT index {raw[:20]!r}")
                        index = int(raw)
                    if index > ops:
                        raise refuse(f"stores memo index {index}, which no pickler writes (a memory bomb)")
                    if len(stack) <= fence:
                        raise refuse("stores a value below its stack (corrupt)")
                    memo[index] = stack[-1]
                    memory += 16
                    if index >= top:  # the unpickler's memo table reaches this index: 16 bytes for each skipped
                        memory += 16 * (index - top)
                        top = index + 1
                elif code == 0x68 or code == 0x6A or code == 0x67:  # BINGET LONG_BINGET GET
                    if code == 0x68:
                        index = data[i]
                        i += 1
                    elif code == 0x6A:
                        index = int.from_bytes(data[i : i + 4], "little")
                        i += 4
                        if i > end:
                            raise Truncated()
                    else:
                        raw, i = _line(data, i)
                        index = int(raw) if len(raw) <= _MAX_DIGITS and _DIGITS.fullmatch(raw) else -1
                    value = memo.get(index)
                    if value is None:
                        raise refuse(f"reads memo index {index}, which was never stored (corrupt)")
                    push(value)
                    memory += 8
                elif code == 0x4B:  # BININT1
                    push(byte_ints[data[i]])
                    i += 1
                elif code == 0x28:  # MARK
                    fence = len(stack)
                    marks.append(fence)
                    memory += 8
                elif code == 0x58 or code == 0x8C:  # BINUNICODE SHORT_BINUNICODE
                    if code == 0x58:
                        size = int.from_bytes(data[i : i + 4], "little")
                        i += 4
                    else:
                        size = data[i]
                        i += 1
                    if i + size > end:
                        if i + size > max_pickle:
                            raise refuse(f"has a {size}-byte value, over the {max_pickle}-byte pickle limit")
                        raise Truncated()
                    key = Value("str", data[i : i + size], 1, True, OPAQUE) if size <= _MAX_TEXT_NAME else _STR
                    i += size
                    memory += 56 + size
                    if code == 0x58 and not frame_end:  # a state-dict key: the tensor entry after it, in one step
                        match = entry_match(data, i)
                        if match is not None:
                            self.memo_top = top
                            done = self.entry(match, ops, key)
                            if done is not None:
                                top = self.memo_top
                                push(key)
                                push(done[0])
                                ops += done[1]
                                memory += done[2]
                                i = match.end()
                                if memory > max_memory:
                                    raise refuse(f"would build over {max_memory} bytes of objects (a memory bomb)")
                                continue
                    push(key)
                elif code == 0x74 or 0x85 <= code <= 0x87:  # TUPLE TUPLE1 TUPLE2 TUPLE3
                    if code == 0x74:
                        items, fence = _pop_mark(stack, marks)
                    else:
                        count = code - 0x84
                        if len(stack) - count < fence:
                            raise refuse("builds a tuple from below its stack (corrupt)")
                        items = stack[-count:]
                        del stack[-count:]
                    push(_new_tuple(items) if items else _EMPTY_TUPLE)
                    memory += 56 + 8 * len(items)
                elif code == 0x52 or code == 0x81 or code == 0x92:  # REDUCE NEWOBJ NEWOBJ_EX
                    count = 3 if code == 0x92 else 2
                    if len(stack) - count < fence:
                        raise refuse("calls with too few values on its stack (corrupt)")
                    callable_ = stack[-count]
                    nested = stack[-1].name if code == 0x52 and stack[-1].kind == "tuple" else None
                    del stack[-count:]
                    if nested is not None and callable_.kind == "global" and callable_.name in _ATTRIBUTE_LOOKUPS:
                        push(Value("global", nested, 1, True, OPAQUE))  # getattr(<global>, 'name'): <global>.name
                    else:
                        push(_made_by(callable_))
                    memory += _PLACEHOLDER_COST
                elif code == 0x51:  # BINPERSID
                    if len(stack) <= fence:
                        raise refuse("has BINPERSID without an id (corrupt)")
                    stack[-1] = _OTHER
                    memory += _PLACEHOLDER_COST
                elif code == 0x89 or code == 0x88 or code == 0x4E:  # NEWFALSE NEWTRUE NONE
                    push(_FALSE if code == 0x89 else _TRUE if code == 0x88 else _NONE)
                    memory += 8
                elif code == 0x29:  # EMPTY_TUPLE
                    push(_EMPTY_TUPLE)
                elif code == 0x2E:  # STOP
                    if len(stack) <= fence:
                        raise refuse("stops with nothing on its stack (corrupt)")
                    if frame_end and i != frame_end:  # a stream reader would go on after the frame, not after STOP
                        raise refuse(
                            f"stops at offset {i - 1}, inside a frame that ends at offset {frame_end} (corrupt)"
                        )
                    break
                elif (
                    code == 0x95
                ):  # FRAME: the reader takes the frame's bytes in one read and serves the opcodes from them
                    if frame_end:
                        raise refuse(
                            f"starts a frame at offset {i - 1} inside the frame that ends at offset {frame_end}"
                        )
                    if i + 8 > end:
                        raise Truncated()
                    size = int.from_bytes(data[i : i + 8], "little")
                    i += 8
                    if i + size > end:
                        if i + size > max_pickle:
                            raise refuse(f"has a {size}-byte frame, over the {max_pickle}-byte pickle limit")
                        raise Truncated()
                    frame_end = i + size
                else:
                    handler = rare.get(code)
                    if handler is None:  # NEXT_BUFFER (out-of-band data a file cannot carry), or no opcode
                        raise refuse(f"has byte 0x{code:02x} at offset {i - 1}, which is not an opcode ckptool reads")
                    self.at, self.fence, self.ops, self.memory = i, fence, ops, memory
                    handler(self, code)
                    i, fence, memory = self.at, self.fence, self.memory
                if memory > max_memory:
                    raise refuse(f"would build over {max_memory} bytes of objects (a memory bomb)")
        except (IndexError, struct.error):
            raise Truncated() from None
        self.at, self.ops, self.memory, self.memo_top = i, ops, memory, top
        self.count_entries()
        return i

    def entry(self, match: re.Match[bytes], ops: int, key: Value) -> tuple[Value, int, int] | None:
        """One tensor entry of a state dict after its key, as torch's pickler writes it, in one step.

        ``match`` is :data:`_ENTRY` matched after the key: ``_rebuild_tensor_v2(persistent storage
        tuple, offset, size, stride, requires_grad, OrderedDict())`` with its globals and the strings
        it shares read from the memo. The records, memo entries, opcode counts and memory estimate
        are exactly those the opcode-by-opcode walk makes; returns the record of the call's result,
        the opcodes walked and the memory they add, or None (nothing changed) when the entry is not
        plainly in that form — a memo read of a value the entry itself stores, a memo index stored
        twice or past the opcodes so far, a tuple whose length is not its opcode's: the walk then
        takes it opcode by opcode.
        """
        (
            key_put,
            fn_get,
            storage_get,
            class_get,
            skey_size,
            skey,
            skey_put,
            location_get,
            numel,
            storage_put,
            offset,
            size,
            size_put,
            stride,
            stride_put,
            flag,
            hooks_get,
            hooks_put,
            args_put,
            result_put,
        ) = match.groups()
        if skey_size[0] != len(skey) or len(size) > _MAX_SHAPE_BYTES or len(stride) > _MAX_SHAPE_BYTES:
            return None
        tuples = self.tuples
        size_tuple = tuples.get(size) or _int_tuple(tuples, size)
        stride_tuple = tuples.get(stride) or _int_tuple(tuples, stride)
        if size_tuple is None or stride_tuple is None:
            return None
        # a memo index: BINGET/BINPUT's byte or LONG_BINGET/LONG_BINPUT's 4 bytes after the opcode
        memo = self.memo
        get = memo.get
        fn = get(int.from_bytes(fn_get, "little") >> 8)
        storage = get(int.from_bytes(storage_get, "little") >> 8)
        class_ = get(int.from_bytes(class_get, "little") >> 8)
        location = get(int.from_bytes(location_get, "little") >> 8)
        hooks = get(int.from_bytes(hooks_get, "little") >> 8)
        if fn is None or storage is None or class_ is None or location is None or hooks is None:
            return None
        # the stores: increasing indices past every one stored before, none past the opcodes so far
        key_at = int.from_bytes(key_put, "little") >> 8
        skey_at = int.from_bytes(skey_put, "little") >> 8
        storage_at = int.from_bytes(storage_put, "little") >> 8
        size_at = -1 if size_put is None else int.from_bytes(size_put, "little") >> 8
        stride_at = -1 if stride_put is None else int.from_bytes(stride_put, "little") >> 8
        hooks_at = int.from_bytes(hooks_put, "little") >> 8
        args_at = int.from_bytes(args_put, "little") >> 8
        result_at = int.from_bytes(result_put, "little") >> 8
        last = storage_at
        if size_at >= 0:
            if size_at <= last:
                return None
            last = size_at
        if stride_at >= 0:
            if stride_at <= last:
                return None
            last = stride_at
        top = self.memo_top
        # (so each is fresh, and none is a value the entry reads)
        if not top <= key_at < skey_at < storage_at or not last < hooks_at < args_at < result_at <= ops:
            return None
        max_nodes = limits.MAX_KEY_NODES
        nodes = 3 + storage.nodes + class_.nodes + location.nodes
        memo[key_at] = key
        memo[skey_at] = Value("str", skey, 1, True, OPAQUE)
        memo[storage_at] = _opaque_tuple(
            nodes if nodes <= max_nodes else max_nodes + 1,
            storage.hashable and class_.hashable and location.hashable,
            1 + max(storage.depth, class_.depth, location.depth),
        )
        stores = 6
        if size_at >= 0:
            memo[size_at] = size_tuple[0]
            stores += 1
        if stride_at >= 0:
            memo[stride_at] = stride_tuple[0]
            stores += 1
        memo[hooks_at] = _made_by(hooks)
        nodes = 5 + size_tuple[0].nodes + stride_tuple[0].nodes
        memo[args_at] = _opaque_tuple(
            nodes if nodes <= max_nodes else max_nodes + 1, False, 1 + max(size_tuple[0].depth, stride_tuple[0].depth)
        )
        memo[result_at] = result = _made_by(fn)
        # the opcodes' counts: what every entry has is tallied, and added up when the walk ends
        counts = self.counts
        long_puts = (
            len(key_put)
            + len(skey_put)
            + len(storage_put)
            + len(hooks_put)
            + len(args_put)
            + len(result_put)
            + (0 if size_put is None else len(size_put))
            + (0 if stride_put is None else len(stride_put))
            - 2 * stores
        ) // 3
        long_gets = (len(fn_get) + len(storage_get) + len(class_get) + len(location_get) + len(hooks_get) - 10) // 3
        counts[0x72] += long_puts
        counts[0x71] += stores - long_puts
        counts[0x6A] += long_gets
        counts[0x68] += 5 - long_gets
        counts[numel[0]] += 1
        counts[offset[0]] += 1
        counts[flag[0]] += 1
        self.entries += 1
        shapes = self.shapes
        shapes[size] = shapes.get(size, 0) + 1
        shapes[stride] = shapes.get(stride, 0) + 1
        # opcodes: the 23 every entry has after its key, its stores of tuples, and its tuples' own
        walked = 17 + stores + size_tuple[1] + stride_tuple[1]
        self.memo_top = result_at + 1
        memory = (
            16 * (result_at + 1 - top)
            + 1856
            + len(skey)
            + (40 if len(numel) > 2 else 0)
            + (40 if len(offset) > 2 else 0)
            + size_tuple[3]
            + stride_tuple[3]
        )
        return result, walked, memory

    # helpers of the methods below --------------------------------------------------------------
    def line(self) -> bytes:
        raw, self.at = _line(self.data, self.at)
        return raw

    def pop_mark(self) -> list[Value]:
        items, self.fence = _pop_mark(self.stack, self.marks)
        return items

    def has(self, count: int) -> bool:
        """Whether ``count`` values lie on the stack above its fence."""
        return len(self.stack) - count >= self.fence

    def counted(self, width: int, signed: bool = False) -> int:
        """A length of ``width`` bytes at the position, checked against the bytes that follow it."""
        i = self.at
        size = int.from_bytes(self.data[i : i + width], "little", signed=signed)
        i = self.at = i + width
        if size < 0:
            raise refuse(f"has a negative length {size} at offset {i - width} (corrupt)")
        if i + size > limits.MAX_PICKLE_BYTES:
            raise refuse(f"has a {size}-byte value, over the {limits.MAX_PICKLE_BYTES}-byte pickle limit")
        if i + size > self.end:
            raise Truncated()
        return size

    def add_keys(self, target: Value, keys: list[Value]) -> None:
        """Keys (or set elements) going into ``target``: each hashed by the unpickler, so each must be
        hashable, small, and not one of a flood of keys sharing one hash."""
        if target.kind != "container" and target.kind != "object":
            raise refuse(f"adds items to a {target.kind}, which holds none (corrupt)")
        assert isinstance(target, Receiver)
        max_nodes, max_collisions, max_depth = limits.MAX_KEY_NODES, limits.MAX_HASH_COLLISIONS, limits.MAX_NESTING
        for key in keys:
            if not key.hashable:
                raise refuse(
                    f"uses a {key.kind} {(key.name if key.kind != 'tuple' else None) or ''} as a dict key "
                    "or set element"
                )
            if key.nodes > max_nodes:
                raise refuse(f"uses a dict key or set element of {key.nodes}+ nested values (a hashing bomb)")
            if key.depth > max_depth:  # comparing two equal ones would recurse that deep
                raise refuse(f"uses a dict key or set element nested over {max_depth} levels deep (a hashing bomb)")
            self.hashing += key.nodes
            value = key.value
            if value is not OPAQUE:
                if target.buckets is None:
                    target.buckets = {}
                bucket = target.buckets.setdefault(hash(value), set())
                bucket.add(value)
                if len(bucket) > max_collisions:
                    raise refuse(
                        f"puts {len(bucket)} distinct keys with one hash into a dict or set (a hash-collision flood)"
                    )
        if self.hashing > 8 * self.ops + 100_000:
            raise refuse("hashes more nested keys than its size allows (a hashing bomb)")

    def add_name(self, full_name: str) -> None:
        """A global named (GLOBAL, INST, STACK_GLOBAL): each becomes a placeholder class when unpickled."""
        if len(self.names) >= limits.MAX_GLOBALS:
            raise refuse(f"names over {limits.MAX_GLOBALS} globals (a memory bomb)")
        self.names.append(full_name)

    # one method per opcode (or family of opcodes alike but for their argument's width) ---------
    def sized(self, code: int) -> None:  # BINUNICODE8, and the BINBYTES and BINSTRING families
        width, signed, kind = _SIZED[code]
        size = self.counted(width, signed)
        raw = self.data[self.at : self.at + size]
        self.stack.append(_text(raw) if kind == "str" else _BYTES if kind == "bytes" else Receiver("container"))
        self.at += size
        self.memory += 56 + size

    def binint(self, code: int) -> None:  # BININT2 BININT
        width = 2 if code == 0x4D else 4
        if self.at + width > self.end:
            raise Truncated()
        self.stack.append(_literal(int.from_bytes(self.data[self.at : self.at + width], "little", signed=code == 0x4A)))
        self.at += width
        self.memory += 40

    def long(self, code: int) -> None:  # LONG1 LONG4
        size = self.counted(1 if code == 0x8A else 4, signed=code == 0x8B)
        self.stack.append(_literal(int.from_bytes(self.data[self.at : self.at + size], "little", signed=True)))
        self.at += size
        self.memory += 32 + size

    def binfloat(self, code: int) -> None:  # BINFLOAT
        if self.at + 8 > self.end:
            raise Truncated()
        self.stack.append(_literal(struct.unpack(">d", self.data[self.at : self.at + 8])[0]))
        self.at += 8
        self.memory += 32

    def text_int(self, code: int) -> None:  # INT LONG (text)
        raw = self.line()
        if code == 0x4C and raw.endswith(b"L"):
            raw = raw[:-1]
        if code == 0x49 and raw in (b"00", b"01"):
            value: Any = raw == b"01"
        elif _CANONICAL_INT.fullmatch(raw) and len(raw) <= _MAX_DIGITS:
            value = int(raw)
        else:
            raise refuse(f"has an integer {raw[:20]!r} not written the way Python's pickler writes it")
        self.stack.append(_literal(value))
        self.memory += 32 + len(raw)

    def text_float(self, code: int) -> None:  # FLOAT (text)
        raw = self.line()
        try:
            value = float(raw)
        except ValueError:
            raise refuse(f"has a malformed float {raw[:20]!r}") from None
        self.stack.append(_literal(value))
        self.memory += 32

    def text_str(self, code: int) -> None:  # STRING UNICODE (text)
        raw = self.line()
        # the text the unpickler makes is these bytes only when they are ASCII with no escape (UNICODE
        # decodes raw-unicode-escape, byte by byte: UTF-8 bytes are not the name they spell)
        plain = raw.isascii() and b"\\" not in raw
        if code == 0x53:
            quoted = len(raw) >= 2 and raw[0] == raw[-1] and raw[:1] in (b"'", b'"')
            self.stack.append(_text(raw[1:-1]) if quoted and plain else _STR)
        else:
            self.stack.append(_text(raw) if plain else _STR)
        self.memory += 56 + len(raw)

    def global_(self, code: int) -> None:  # GLOBAL INST
        module, attribute = self.line(), self.line()
        try:
            full_name = f"{module.decode('utf-8')}.{attribute.decode('utf-8')}"
        except UnicodeDecodeError:
            raise refuse("names a global that is not UTF-8") from None
        self.add_name(full_name)
        if code == 0x69:
            self.pop_mark()
            self.stack.append(Receiver("object", full_name, full_name not in _torch_names()))
            self.memory += _PLACEHOLDER_COST
        else:
            self.stack.append(Value("global", full_name, 1, True, OPAQUE))

    def stack_global(self, code: int) -> None:  # STACK_GLOBAL
        if not self.has(2):
            raise refuse("has STACK_GLOBAL without a module and name (corrupt)")
        module, attribute = self.stack[-2:]
        del self.stack[-2:]
        module_name = _text_name(module.name) if module.kind == "str" else None
        attribute_name = _text_name(attribute.name) if attribute.kind == "str" else None
        known = module_name is not None and attribute_name is not None
        full_name = f"{module_name}.{attribute_name}" if known else None
        self.add_name(full_name or "<unresolved STACK_GLOBAL>")
        self.stack.append(Value("global", full_name, 1, True, OPAQUE))

    def ext(self, code: int) -> None:  # EXT1 EXT2 EXT4: a global from the copyreg registry
        self.at += {0x82: 1, 0x83: 2, 0x84: 4}[code]
        if self.at > self.end:
            raise Truncated()
        self.stack.append(_UNKNOWN_GLOBAL)

    def obj(self, code: int) -> None:  # OBJ
        items = self.pop_mark()
        if not items:
            raise refuse("has OBJ without a class (corrupt)")
        self.stack.append(_made_by(items[0]))
        self.memory += _PLACEHOLDER_COST

    def persid(self, code: int) -> None:  # PERSID (text)
        self.line()
        self.stack.append(_OTHER)
        self.memory += _PLACEHOLDER_COST

    def build(self, code: int) -> None:  # BUILD
        if not self.has(2):
            raise refuse("sets state with too few values on its stack (corrupt)")
        self.stack.pop()
        target = self.stack[-1]
        if (
            target.kind != "object"
            or target.name is None
            or (target.name in _torch_names() and target.name != "collections.OrderedDict")
        ):
            shown = target.name if target.kind != "tuple" else None  # a tuple's name is getattr's, not its own
            raise refuse(f"sets state (BUILD) on {shown or 'a ' + target.kind}, which torch's loader never does")
        self.memory += 64

    def empty_list(self, code: int) -> None:  # EMPTY_LIST: takes no keys, so one shared record serves every list
        self.stack.append(_LIST)
        self.memory += 88  # the list, its GC header and the slot that holds it

    def empty_keyed(self, code: int) -> None:  # EMPTY_DICT EMPTY_SET: a record of their own (key buckets)
        self.stack.append(Receiver("container"))
        self.memory += 360 if code == 0x8F else 240  # the object with its GC header, and the guard's record

    def collection(self, code: int) -> None:  # DICT FROZENSET LIST
        items = self.pop_mark()
        container = _LIST if code == 0x6C else Receiver("container")
        if code == 0x64:
            if len(items) % 2:
                raise refuse("has an odd number of items for DICT (corrupt)")
            self.add_keys(container, items[::2])
        elif code == 0x91:
            self.add_keys(container, items)
        self.stack.append(container)
        self.memory += 216 + 100 * len(items)

    def set_items(self, code: int) -> None:  # SETITEMS SETITEM ADDITEMS
        if code == 0x73:
            if not self.has(2):
                raise refuse("has SETITEM without a key and value (corrupt)")
            keys = [self.stack[-2]]
            del self.stack[-2:]
        else:
            items = self.pop_mark()
            if code == 0x75 and len(items) % 2:
                raise refuse("has an odd number of items for SETITEMS (corrupt)")
            keys = items[::2] if code == 0x75 else items
        if not self.has(1):
            raise refuse("adds items with no dict or set below them (corrupt)")
        self.add_keys(self.stack[-1], keys)
        self.memory += 100 * len(keys)

    def append(self, code: int) -> None:  # APPEND APPENDS
        if code == 0x61:
            if not self.has(2):
                raise refuse("has APPEND without a list (corrupt)")
            self.stack.pop()
            self.memory += 16
        else:
            self.memory += 16 * len(self.pop_mark())
            if not self.has(1):
                raise refuse("has APPENDS without a list (corrupt)")

    def pop(self, code: int) -> None:  # POP: the top value, or a MARK with nothing above it
        if self.marks and self.marks[-1] == len(self.stack):
            self.marks.pop()
            self.fence = self.marks[-1] if self.marks else 0
        elif not self.has(1):
            raise refuse("pops below its stack (corrupt)")
        else:
            self.stack.pop()

    def pop_mark_op(self, code: int) -> None:  # POP_MARK
        self.pop_mark()

    def dup(self, code: int) -> None:  # DUP
        if not self.has(1):
            raise refuse("has DUP on an empty stack (corrupt)")
        self.stack.append(self.stack[-1])
        self.memory += 8

    def proto(self, code: int) -> None:  # PROTO: nothing to check
        self.at += 1
        if self.at > self.end:
            raise Truncated()

    def readonly_buffer(self, code: int) -> None:  # READONLY_BUFFER
        if not self.has(1):
            raise refuse("has READONLY_BUFFER on an empty stack (corrupt)")


# opcode: (width of its length, whether the length is signed, what it pushes)
_SIZED: dict[int, tuple[int, bool, str]] = {
    0x8D: (8, False, "str"),  # BINUNICODE8
    0x54: (4, True, "str"),  # BINSTRING (a Python 2 str, decoded as UTF-8 here)
    0x55: (1, False, "str"),  # SHORT_BINSTRING
    0x42: (4, False, "bytes"),  # BINBYTES
    0x43: (1, False, "bytes"),  # SHORT_BINBYTES
    0x8E: (8, False, "bytes"),  # BINBYTES8
    0x96: (8, False, "bytearray"),  # BYTEARRAY8: mutable, so no key (a container record)
}

# The opcodes :meth:`_Walk.run` does not handle inline, each with its method.
_RARE: dict[int, Callable[[_Walk, int], None]] = {
    **dict.fromkeys(_SIZED, _Walk.sized),
    0x4D: _Walk.binint,
    0x4A: _Walk.binint,  # BININT2 BININT
    0x8A: _Walk.long,
    0x8B: _Walk.long,  # LONG1 LONG4
    0x47: _Walk.binfloat,  # BINFLOAT
    0x49: _Walk.text_int,
    0x4C: _Walk.text_int,  # INT LONG
    0x46: _Walk.text_float,  # FLOAT
    0x53: _Walk.text_str,
    0x56: _Walk.text_str,  # STRING UNICODE
    0x63: _Walk.global_,
    0x69: _Walk.global_,  # GLOBAL INST
    0x93: _Walk.stack_global,  # STACK_GLOBAL
    0x82: _Walk.ext,
    0x83: _Walk.ext,
    0x84: _Walk.ext,  # EXT1 EXT2 EXT4
    0x6F: _Walk.obj,  # OBJ
    0x50: _Walk.persid,  # PERSID
    0x62: _Walk.build,  # BUILD
    0x5D: _Walk.empty_list,  # EMPTY_LIST
    0x7D: _Walk.empty_keyed,
    0x8F: _Walk.empty_keyed,  # EMPTY_DICT EMPTY_SET
    0x64: _Walk.collection,
    0x91: _Walk.collection,
    0x6C: _Walk.collection,  # DICT FROZENSET LIST
    0x75: _Walk.set_items,
    0x73: _Walk.set_items,
    0x90: _Walk.set_items,  # SETITEMS SETITEM ADDITEMS
    0x61: _Walk.append,
    0x65: _Walk.append,  # APPEND APPENDS
    0x30: _Walk.pop,  # POP
    0x31: _Walk.pop_mark_op,  # POP_MARK
    0x32: _Walk.dup,  # DUP
    0x80: _Walk.proto,  # PROTO (FRAME is read in run: it changes how the walk reads what follows)
    0x98: _Walk.readonly_buffer,  # READONLY_BUFFER
}
