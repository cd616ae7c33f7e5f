"""The guard's walk state, and its steps for the opcodes :meth:`~.opcode_guard._Walk.run` does not take inline.

Each such opcode has its own method here, reached through :data:`_RARE`; it reads and updates the
walk's position (``at``), ``fence`` (the stack's depth at the last MARK: nothing may be taken from
below it) and ``memory`` estimate.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from typing import Any

from ckptool.pickles import limits
from ckptool.pickles.guard_records import (
    _BYTES,
    _CANONICAL_INT,
    _LIST,
    _MAX_DIGITS,
    _OTHER,
    _PLACEHOLDER_COST,
    _STR,
    OPAQUE,
    Receiver,
    Truncated,
    Value,
    _line,
    _literal,
    _made_by,
    _pop_mark,
    _text,
    _text_name,
    _torch_names,
)
from ckptool.pickles.limits import refuse


class WalkState:
    """One pass's state over one pickle (the unpickler's stack, marks and memo, as records), and the
    steps of the opcodes the walk's main loop hands on (:data:`_RARE`)."""

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
        # the registry is the process's, and CPython's unpickler keeps what find_class gave for a code in
        # copyreg's cache for every later read: a read would take a global another read resolved, unjudged
        raise refuse(
            "uses an extension code (EXT1, EXT2, EXT4): the global it names is the loading process's copyreg "
            "registry's, not the file's, and the unpickler caches it across reads (torch's loader refuses it too)"
        )

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

# The opcodes :meth:`~.opcode_guard._Walk.run` does not handle inline, each with its method.
_RARE: dict[int, Callable[[WalkState, int], None]] = {
    **dict.fromkeys(_SIZED, WalkState.sized),
    0x4D: WalkState.binint,
    0x4A: WalkState.binint,  # BININT2 BININT
    0x8A: WalkState.long,
    0x8B: WalkState.long,  # LONG1 LONG4
    0x47: WalkState.binfloat,  # BINFLOAT
    0x49: WalkState.text_int,
    0x4C: WalkState.text_int,  # INT LONG
    0x46: WalkState.text_float,  # FLOAT
    0x53: WalkState.text_str,
    0x56: WalkState.text_str,  # STRING UNICODE
    0x63: WalkState.global_,
    0x69: WalkState.global_,  # GLOBAL INST
    0x93: WalkState.stack_global,  # STACK_GLOBAL
    0x82: WalkState.ext,
    0x83: WalkState.ext,
    0x84: WalkState.ext,  # EXT1 EXT2 EXT4
    0x6F: WalkState.obj,  # OBJ
    0x50: WalkState.persid,  # PERSID
    0x62: WalkState.build,  # BUILD
    0x5D: WalkState.empty_list,  # EMPTY_LIST
    0x7D: WalkState.empty_keyed,
    0x8F: WalkState.empty_keyed,  # EMPTY_DICT EMPTY_SET
    0x64: WalkState.collection,
    0x91: WalkState.collection,
    0x6C: WalkState.collection,  # DICT FROZENSET LIST
    0x75: WalkState.set_items,
    0x73: WalkState.set_items,
    0x90: WalkState.set_items,  # SETITEMS SETITEM ADDITEMS
    0x61: WalkState.append,
    0x65: WalkState.append,  # APPEND APPENDS
    0x30: WalkState.pop,  # POP
    0x31: WalkState.pop_mark_op,  # POP_MARK
    0x32: WalkState.dup,  # DUP
    0x80: WalkState.proto,  # PROTO (FRAME is read in run: it changes how the walk reads what follows)
    0x98: WalkState.readonly_buffer,  # READONLY_BUFFER
}
