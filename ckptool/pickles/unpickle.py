"""Unpickling: one pickle read, walked by the guard, run through the restricted unpickler, checked.

:func:`loads` is the only way ckptool turns pickle bytes into objects:
:func:`~ckptool.pickles.opcode_guard.guard` first (what would hang the C unpickler or exhaust
memory is refused before it runs), then :class:`RestrictedUnpickler` (every global through a
:class:`GlobalResolver`), then :func:`check_tree` (nesting, and sharing that would expand the
tree when copied).
"""

from __future__ import annotations

import io
import pickle
from collections.abc import Callable
from typing import Any, BinaryIO

from ckptool import native
from ckptool.base.errors import InputError
from ckptool.base.gcpause import paused
from ckptool.pickles import limits, rebuilds
from ckptool.pickles.allowlist import TORCH_GLOBALS, GlobalResolver, RefusedGlobal
from ckptool.pickles.guard_cache import GuardCache
from ckptool.pickles.limits import refuse
from ckptool.pickles.opcode_guard import Truncated, guard, guard_stats
from ckptool.pickles.placeholders import WATCHED, OpaqueObject, StateDict
from ckptool.pickles.references import accept_data_references
from ckptool.tensors.refs import DeviceRef, StorageRef, TensorRef, human_size

# the C run of the unpickler over torch's usual opcodes (ckptool/native/_fastload.c), where it was built;
# else CPython's unpickler with the Python callbacks
_fastload: Any = native.load("_fastload")
FAST = _fastload is not None


def _register_constructors() -> None:
    """Let the C run build TensorRef, StorageRef and ByteRange by setting their slots, as their dataclass
    ``__init__`` does (100,000 tensors: 0.2 s less than calling it); a class that is not plainly that
    (a ``__post_init__``, a default factory) is called instead."""
    import dataclasses

    from ckptool.files.ranges import ByteRange

    for cls in (TensorRef, StorageRef, ByteRange):
        fields = dataclasses.fields(cls)
        if (
            hasattr(cls, "__post_init__")
            or "__slots__" not in vars(cls)
            or any(f.default_factory is not dataclasses.MISSING or not f.init for f in fields)
        ):
            continue
        _fastload.register(
            cls,
            tuple(f.name for f in fields),
            tuple(cls if f.default is dataclasses.MISSING else f.default for f in fields),
        )


if FAST:
    _register_constructors()


# the opcodes the C run does not take (by the guard's counts): CPython's unpickler runs at once
_FAST_TAKEN = frozenset(b"\x80}])(X\x8cqr\x94hjKMJ\x8aG\x88\x89Nt\x85\x86\x87c\x93RQsuaeb.")
_FAST_NOT_TAKEN = tuple(code for code in range(256) if code not in _FAST_TAKEN)


class RestrictedUnpickler(pickle.Unpickler):
    """A pickle.Unpickler whose globals come only from a :class:`GlobalResolver`."""

    def __init__(
        self, file: io.BufferedIOBase, resolver: GlobalResolver, persistent_load: Callable[[Any], Any] | None
    ) -> None:
        super().__init__(file, encoding="utf-8")
        self._resolver = resolver
        # handed to the C unpickler itself (its persistent_load setter): no Python frame between
        # it and the format's loader for each of 100,000 storages
        self.persistent_load = (  # type: ignore[method-assign]
            persistent_load if persistent_load is not None else _no_persistent_ids
        )

    def find_class(self, module: str, name: str) -> Any:  # noqa: D102 — the only door to globals
        return self._resolver.resolve(module, name)


def _no_persistent_ids(pid: Any) -> Any:
    raise InputError("pickle references external data (persistent id) outside a checkpoint")


def loads(
    data: bytes | io.BufferedIOBase | BinaryIO,
    resolver: GlobalResolver,
    persistent_load: Callable[[Any], Any] | None = None,
) -> Any:
    """Unpickle ``data`` through ``resolver``; errors surface as RefusedGlobal or InputError.

    ``data`` is one whole pickle (bytes after its STOP are refused), or a stream positioned at a
    pickle, which is left just after that pickle's STOP. Before the C unpickler runs, :func:`guard`
    walks the opcodes once (unless ``resolver.guard_cache`` holds them already) and refuses what
    would make it hang or exhaust memory; after, the object tree's nesting and sharing are checked
    (:func:`check_tree`). A pickle this operation emitted (the write check's re-read) needs neither.
    """
    cache = resolver.guard_cache
    if isinstance(data, bytes | bytearray | memoryview):
        blob = bytes(data)
        if len(blob) > limits.MAX_PICKLE_BYTES:
            raise InputError(f"pickle is {len(blob)} bytes, over the {limits.MAX_PICKLE_BYTES}-byte limit — refused")
        # a write's check re-reads the pickle it just emitted: those bytes need no guard, nor their tree a check (it is
        # the tree the write was given, whose every node the emitter wrote once, memo references as references)
        counts = None
        emitted = cache is not None and cache.is_emitted(blob)
        if emitted:
            size = len(blob)
        else:
            stats = guard_stats(blob, cache)
            size, counts = stats.size, stats.counts
        if size != len(blob):
            raise InputError(
                f"pickle is followed by {len(blob) - size} bytes after its end (STOP) — "
                "torch never writes that; refused"
            )
    else:
        blob, counts, emitted = read_pickle(data, cache), None, False
    # a refused global becomes an inert placeholder and the walk goes on, so that one refusal names
    # every refused global; what the walk then meets (a rebuild given a placeholder, a corrupt
    # tail) ends it with the refusal of the names found so far
    with paused():  # the tree is the result: nothing it builds is garbage
        watching = WATCHED.set(getattr(resolver, "references", None))  # the refused classes the pickle calls
        try:
            obj = _unpickle(blob, resolver, persistent_load, counts)
        except (RefusedGlobal, InputError) as e:
            refusal = resolver.refusal(complete=False)
            if refusal is not None and not isinstance(e, RefusedGlobal):
                raise refusal from None
            raise
        finally:
            WATCHED.reset(watching)
        if not emitted:
            check_tree(obj, source_bytes=len(blob))
        if hasattr(resolver, "may_convert") and resolver.may_convert():
            for call in _calls(obj):
                resolver.called(call)
        accept_data_references(resolver, obj, _tree_children)  # classes it only refers to, never calls: data
        refusal = resolver.refusal()
        if refusal is not None:
            raise refusal
    return obj


def _unpickle(
    blob: bytes, resolver: GlobalResolver, persistent_load: Callable[[Any], Any] | None, counts: list[int] | None = None
) -> Any:
    """Run the restricted unpickler over one guarded pickle; any failure is an InputError.

    Where the C run (:data:`FAST`) takes the pickle, it gives what CPython's unpickler would; where it
    declines (an opcode it does not take, an error CPython's unpickler would raise itself), what its
    callbacks recorded is undone and CPython's unpickler runs. ``counts``: the guard's opcode counts,
    where it walked the pickle (one the run does not take all of goes to CPython's unpickler at once).
    """
    try:
        if FAST and type(blob) is bytes and (counts is None or not any(counts[code] for code in _FAST_NOT_TAKEN)):
            result = _fast_load(blob, resolver, persistent_load)
            if result is not NotImplemented:
                return result
        return RestrictedUnpickler(Interruptible(blob), resolver, persistent_load).load()
    except (RefusedGlobal, InputError):
        raise
    except RecursionError as e:
        raise InputError("pickle is nested too deeply to read safely") from e
    except MemoryError as e:
        raise InputError("pickle would need more memory than is available to read") from e
    except Exception as e:  # any malformed-pickle error from the C unpickler
        raise InputError(f"pickle is corrupt or truncated ({type(e).__name__}: {_short(e)})") from e


class Interruptible(io.BytesIO):
    """The pickle's bytes, with a ``peek`` in Python: CPython's unpickler then fills its buffer through it,
    128 KiB at a time, and the interpreter runs a pending Ctrl-C's or SIGTERM's handler at each call (the
    unpickler's own loop, in C, never checks). A pickle the guard passed reads alike with or without
    ``peek`` (every opcode lies inside one frame or outside all: ``tests/test_frames.py``)."""

    def __init__(self, blob: bytes) -> None:
        super().__init__(blob)
        self._blob = blob

    def peek(self, size: int = 0) -> bytes:
        at = self.tell()
        return self._blob[at : at + max(size, 1)]


def _fast_load(blob: bytes, resolver: GlobalResolver, persistent_load: Callable[[Any], Any] | None) -> Any:
    """The C run: its result, or NotImplemented with the resolver's and the archive's records as before."""
    if not hasattr(resolver, "records"):  # a resolver that cannot undo what it records: CPython's unpickler
        return NotImplemented
    storages = getattr(persistent_load, "fast_storages", None)
    # looked up at each read, as the resolver looks them up: the very functions a GLOBAL resolves to
    rebuild = (
        TORCH_GLOBALS["torch._utils._rebuild_tensor_v2"],
        TensorRef,
        rebuilds._V2,
        rebuilds._PLAIN_DTYPES,
        StorageRef,
        TORCH_GLOBALS["collections.OrderedDict"],
        StateDict,
    )
    before = resolver.records()
    kept = dict(storages[0]) if storages is not None else None  # the archive's storages read so far
    result = _fastload.load(
        blob,
        resolver.resolve,
        persistent_load if persistent_load is not None else _no_persistent_ids,
        rebuild,
        storages,
    )
    if result is NotImplemented:
        resolver.restore(before)
        if storages is not None:
            storages[0].clear()
            storages[0].update(kept)
    return result


def _short(error: BaseException) -> str:
    text = str(error).splitlines()[0] if str(error) else ""
    return text[:160]


def read_pickle(stream: Any, guard_cache: GuardCache | None = None) -> bytes:
    """Read the one pickle at ``stream``'s position (checked by :func:`guard`); leave the stream after it."""
    start = stream.tell()
    chunk = 1 << 20
    while True:
        stream.seek(start)
        blob = stream.read(chunk)
        try:
            size = guard(blob, guard_cache)
        except Truncated:
            if len(blob) < chunk:
                raise
            if chunk > limits.MAX_PICKLE_BYTES:
                raise InputError(f"pickle is over the {limits.MAX_PICKLE_BYTES}-byte limit — refused") from None
            chunk = min(chunk * 4, limits.MAX_PICKLE_BYTES + 1)
            continue
        stream.seek(start + size)
        return blob[:size]


_ATOMS = frozenset({str, bytes, int, float, bool, type(None)})  # leaves of every tree
_TEXT = frozenset({str, bytes, bytearray})  # leaves a copy (json, repr, a header) costs their length
_EMPTYABLE = frozenset({list, dict, tuple, set, frozenset})  # empty ones are leaves too


def _tree_children(obj: Any) -> list[Any]:
    if type(obj) is TensorRef:
        if obj.extra == () and not obj.backward_hooks and obj.parameter is None and obj.subclass is None:
            return []  # the usual tensor: a leaf
        return [
            obj.extra,
            obj.backward_hooks,
            *(obj.parameter[1:] if obj.parameter else ()),
            *(obj.subclass[1:] if obj.subclass else ()),
        ]
    if isinstance(obj, dict):
        kids = [*dict.keys(obj), *dict.values(obj)]
        state = getattr(obj, "__dict__", None)
        return kids + list(state.values()) if state else kids
    if isinstance(obj, list | tuple | set | frozenset):
        return list(obj)
    if isinstance(obj, OpaqueObject):
        return [obj._args, obj._items, obj._state, *(value for pair in obj._setitems for value in pair)]
    if isinstance(obj, TensorRef):
        return [obj.extra, obj.backward_hooks, *(obj.parameter[1:] if obj.parameter else ())]
    if isinstance(obj, DeviceRef):
        return [obj.args]
    return []


def _calls(root: Any) -> list[OpaqueObject]:
    """Every object the tree holds that was built by calling its global (REDUCE, OBJ, INST), each once."""
    found: list[OpaqueObject] = []
    seen: set[int] = set()
    stack = [root]
    while stack:
        obj = stack.pop()
        if type(obj) in _ATOMS or id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, OpaqueObject) and obj._mode == "reduce":
            found.append(obj)
        stack.extend(_tree_children(obj))
    return found


def check_tree(root: Any, *, source_bytes: int = 0) -> None:
    """Refuse an unpickled tree nested over MAX_NESTING deep, or whose shared references would expand
    it when copied by a naive walk (json, repr, str, a safetensors header): past MAX_EXPANDED_NODES
    objects (and 16-fold), or past MAX_EXPANDED_TEXT bytes of strings (and 16 times ``source_bytes``,
    the pickle's length) — one 8 MiB string referenced 300 times is 2.4 GiB once json writes it.

    Atoms and empty containers are counted where they are referenced, never visited: a list of 10
    million empty lists costs one pass over it, not a record per list (:func:`_check_tree`)."""
    text_limit = max(limits.MAX_EXPANDED_TEXT, 16 * source_bytes)
    verdict = _check_tree(root, text_limit)
    if verdict == 1:
        raise refuse(f"nests its objects over {limits.MAX_NESTING} levels deep")
    if verdict == 2:
        raise refuse(
            f"shares sub-objects so that walking it visits over {limits.MAX_EXPANDED_NODES} objects "
            "(a memo expansion bomb)"
        )
    if verdict == 3:
        raise refuse(
            f"shares strings so that copying it (JSON, repr, a header) writes over {human_size(text_limit)} "
            "(a memo expansion bomb)"
        )


def _check_tree(root: Any, text_limit: int) -> int:
    """:func:`check_tree`'s walk: 0 (the tree passes), 1 (it nests too deep), 2 (its sharing expands past the node
    limit) or 3 (past ``text_limit`` bytes of strings), for the first object found over a limit."""
    done: dict[int, tuple[int, int, int]] = {}  # id -> (height, expanded objects, expanded text bytes)
    on_path: set[int] = set()
    edges = 0
    stack: list[tuple[Any, list[Any] | None]] = [(root, None)]
    while stack:
        obj, kids = stack[-1]
        key = id(obj)
        if kids is None:
            if key in done:
                stack.pop()
                continue
            kids = _tree_children(obj)
            if not kids:
                done[key] = (1, 1, len(obj) if type(obj) in _TEXT else 0)
                stack.pop()
                continue
            edges += len(kids)
            on_path.add(key)
            stack[-1] = (obj, kids)
            for kid in kids:  # a loop, not a generator of calls: a state dict has 100,000 kids
                kind = type(kid)
                if kind in _ATOMS:
                    continue
                if kind is TensorRef:  # the usual tensor is a leaf: no metadata, hooks, parameter or subclass to enter
                    if kid.extra == () and not kid.backward_hooks and kid.parameter is None and kid.subclass is None:
                        continue
                elif not kid and kind in _EMPTYABLE:
                    continue
                kid_key = id(kid)
                if kid_key not in done and kid_key not in on_path:
                    stack.append((kid, None))
            continue
        stack.pop()
        on_path.discard(key)
        height, size, text = 1, 1, 0
        for kid in kids:
            kind = type(kid)
            if kind in _ATOMS:
                size += 1
                if kind is str or kind is bytes:
                    text += len(kid)
                continue
            entry = done.get(id(kid))
            if entry is None:
                # a TensorRef not visited is a plain one (what its own visit would record: (1, 1, 0)), unless it is
                # an ancestor on the path (every other kid was visited before its parent is done)
                if kind is TensorRef and id(kid) not in on_path:
                    size += 1
                    if height < 2:
                        height = 2
                    continue
                # an empty container, or a cycle back to an ancestor: a leaf
                size += 1
                continue
            if entry[0] >= height:
                height = entry[0] + 1
            size += entry[1]
            text += entry[2]
        if height > limits.MAX_NESTING:
            return 1
        if size > limits.MAX_EXPANDED_NODES and size > 16 * (edges + 1):
            return 2
        if text > text_limit:
            return 3
        done[key] = (height, min(size, limits.MAX_EXPANDED_NODES + 1), min(text, text_limit + 1))
    return 0
