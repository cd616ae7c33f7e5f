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
from typing import Any

from ckptool import native
from ckptool.pickles import limits
from ckptool.pickles.guard_cache import GuardCache, PickleStats
from ckptool.pickles.guard_entry import (
    _ENTRY,
    _MAX_SHAPE_BYTES,
    _int_tuple,
    count_opcodes,
    memo_reads,
    store_entry,
    store_indices,
)
from ckptool.pickles.guard_records import (
    _ATTRIBUTE_LOOKUPS,
    _BYTE_INTS,
    _DIGITS,
    _EMPTY_TUPLE,
    _FALSE,
    _MAX_DIGITS,
    _MAX_TEXT_NAME,
    _NONE,
    _OTHER,
    _PLACEHOLDER_COST,
    _STR,
    _TRUE,
    OPAQUE,
    Truncated,
    Value,
    _line,
    _made_by,
    _new_tuple,
    _pop_mark,
    _torch_names,
)
from ckptool.pickles.guard_steps import _RARE, WalkState
from ckptool.pickles.limits import refuse

_native: Any = native.load("_guard")
# whether guard_stats walks in C (tests/test_guard_native.py holds the two walks to the same results)
NATIVE = _native is not None
_NATIVE_LIMIT = 1 << 62  # the C walk's range for each limit (a test may set any): past it, the Python walk
_NATIVE_MAX_NESTING = 255  # a C tuple record holds its depth in a byte


def _crossing(frame_end: int) -> str:
    """The refusal of an opcode whose argument runs past its frame's end. CPython's unpickler reading from
    a file serves a frame's opcodes from one buffer and reads an argument the buffer cannot hold from
    the bytes after the frame, dropping what was left; read from bytes, it reads on across the end; the
    Python unpickler refuses. Which opcodes run depends on the reader: the pickle is refused."""
    return (
        f"has an opcode that runs past the end of its frame at offset {frame_end}, so unpicklers would read "
        "different opcodes from it (a disguise)"
    )


def guard(data: bytes, cache: GuardCache | None = None) -> int:
    """Walk one pickle's opcodes as the unpickler would, refusing what would hang it or blow it up.

    Returns the pickle's length (up to and including STOP); raises :class:`Truncated` if ``data``
    ends first. Refused: BUILD on anything but an OrderedDict or an allowed object placeholder; extension
    codes (EXT1/2/4: copyreg's registry names their global, and the unpickler caches it across reads);
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


class _Walk(WalkState):
    """One pass over one pickle: the unpickler's stack, marks and memo, as records.

    :meth:`run` handles the opcodes of a state-dict entry inline; every other opcode has its own
    method in :data:`_RARE`, which reads and updates the walk's position (``at``), ``fence`` (the
    stack's depth at the last MARK: nothing may be taken from below it) and ``memory`` estimate.
    """

    __slots__ = ()

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
        memo = self.memo
        reads = memo_reads(memo, fn_get, storage_get, class_get, location_get, hooks_get)
        if reads is None:
            return None
        top = self.memo_top
        puts = (key_put, skey_put, storage_put, size_put, stride_put, hooks_put, args_put, result_put)
        at = store_indices(top, ops, puts)
        if at is None:
            return None
        result, stores = store_entry(memo, key, skey, reads, at, size_tuple[0], stride_tuple[0])
        # the opcodes' counts: what every entry has is tallied, and added up when the walk ends
        count_opcodes(self.counts, puts, (fn_get, storage_get, class_get, location_get, hooks_get), stores)
        counts = self.counts
        counts[numel[0]] += 1
        counts[offset[0]] += 1
        counts[flag[0]] += 1
        self.entries += 1
        shapes = self.shapes
        shapes[size] = shapes.get(size, 0) + 1
        shapes[stride] = shapes.get(stride, 0) + 1
        # opcodes: the 23 every entry has after its key, its stores of tuples, and its tuples' own
        walked = 17 + stores + size_tuple[1] + stride_tuple[1]
        result_at = at[-1]
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
