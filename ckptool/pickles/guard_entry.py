"""The guard's step over a whole state-dict tensor entry: the pattern torch's pickler writes, and its parts.

:meth:`~ckptool.pickles.opcode_guard._Walk.entry` takes an entry matching :data:`_ENTRY` in one step,
with the records, memo entries, opcode counts and memory estimate the opcode-by-opcode walk makes.
"""

from __future__ import annotations

import re

from ckptool.pickles import limits
from ckptool.pickles.guard_records import (
    _BYTE_INTS,
    _EMPTY_TUPLE,
    OPAQUE,
    Value,
    _literal,
    _made_by,
    _new_tuple,
    _opaque_tuple,
)

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


# an entry's memo stores: its key, the storage key, the storage tuple, the size and stride tuples (None
# where the entry does not store them), the hooks, the arguments and the result
Puts = tuple[bytes, bytes, bytes, bytes | None, bytes | None, bytes, bytes, bytes]


def memo_reads(
    memo: dict[int, Value], fn_get: bytes, storage_get: bytes, class_get: bytes, location_get: bytes, hooks_get: bytes
) -> tuple[Value, Value, Value, Value, Value] | None:
    """The memo's records of what an entry reads (its function, ``'storage'``, storage class, location and
    hooks' class), or None when one was never stored."""
    # a memo index: BINGET/BINPUT's byte or LONG_BINGET/LONG_BINPUT's 4 bytes after the opcode
    get = memo.get
    fn = get(int.from_bytes(fn_get, "little") >> 8)
    storage = get(int.from_bytes(storage_get, "little") >> 8)
    class_ = get(int.from_bytes(class_get, "little") >> 8)
    location = get(int.from_bytes(location_get, "little") >> 8)
    hooks = get(int.from_bytes(hooks_get, "little") >> 8)
    if fn is None or storage is None or class_ is None or location is None or hooks is None:
        return None
    return fn, storage, class_, location, hooks


def store_indices(top: int, ops: int, puts: Puts) -> tuple[int, int, int, int, int, int, int, int] | None:
    """The memo indices an entry stores at (-1 for a size or stride it does not store), or None unless they
    increase past every index stored before (``top``) and none passes the opcodes so far (``ops``)."""
    key_put, skey_put, storage_put, size_put, stride_put, hooks_put, args_put, result_put = puts
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
    # (so each is fresh, and none is a value the entry reads)
    if not top <= key_at < skey_at < storage_at or not last < hooks_at < args_at < result_at <= ops:
        return None
    return key_at, skey_at, storage_at, size_at, stride_at, hooks_at, args_at, result_at


def store_entry(
    memo: dict[int, Value],
    key: Value,
    skey: bytes,
    reads: tuple[Value, Value, Value, Value, Value],
    at: tuple[int, int, int, int, int, int, int, int],
    size: Value,
    stride: Value,
) -> tuple[Value, int]:
    """Store an entry's records in the memo as the opcode walk would; return the call's result and the stores."""
    fn, storage, class_, location, hooks = reads
    key_at, skey_at, storage_at, size_at, stride_at, hooks_at, args_at, result_at = at
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
        memo[size_at] = size
        stores += 1
    if stride_at >= 0:
        memo[stride_at] = stride
        stores += 1
    memo[hooks_at] = _made_by(hooks)
    nodes = 5 + size.nodes + stride.nodes
    memo[args_at] = _opaque_tuple(
        nodes if nodes <= max_nodes else max_nodes + 1, False, 1 + max(size.depth, stride.depth)
    )
    memo[result_at] = result = _made_by(fn)
    return result, stores


def count_opcodes(counts: list[int], puts: Puts, gets: tuple[bytes, bytes, bytes, bytes, bytes], stores: int) -> None:
    """Count an entry's memo opcodes: ``stores`` PUTs, short or long by their bytes, and its five GETs."""
    key_put, skey_put, storage_put, size_put, stride_put, hooks_put, args_put, result_put = puts
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
    fn_get, storage_get, class_get, location_get, hooks_get = gets
    long_gets = (len(fn_get) + len(storage_get) + len(class_get) + len(location_get) + len(hooks_get) - 10) // 3
    counts[0x72] += long_puts
    counts[0x71] += stores - long_puts
    counts[0x6A] += long_gets
    counts[0x68] += 5 - long_gets
