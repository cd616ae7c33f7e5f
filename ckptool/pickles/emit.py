"""The writer: a placeholder tree back into a pickle torch's ``weights_only`` loader reads.

:func:`dump` emits protocol 2 using only the opcodes torch's ``weights_only`` unpickler accepts,
re-emitting every placeholder as the global it came from, so a rewritten checkpoint loads wherever
the original did. (What only a protocol-4 input can hold — a frozenset read from FROZENSET, keywords
from NEWOBJ_EX, a nested class's dotted name — is written as that input wrote it, and so is an int too
long for LONG1: LONG4, which a weights_only load of the input did not read either.) It needs nothing of the
reading side but the placeholder types, and the table of
torch's globals to name an allowed function handed over as a value (``defaultdict(OrderedDict)``).

Every global it writes is one the tree names: a placeholder's own, a class or function the tree
holds as a value, or one of torch's own spellings of the values the reader builds from them
(``builtins.set``, ``_codecs.encode``, ``collections.OrderedDict``...). It never names a global the
read did not resolve.
"""

from __future__ import annotations

import io
import pickle
import struct
from collections import Counter, OrderedDict
from typing import TYPE_CHECKING, Any

from ckptool.base.errors import InputError
from ckptool.base.gcpause import paused
from ckptool.pickles.emit_plain import REBUILD_V2, SHARED_TEXT, PlainTensors, long_bytes, write_pairs
from ckptool.pickles.placeholders import OpaqueObject, StorageTypeRef, TypeRef
from ckptool.tensors.refs import DeviceRef, DTypeRef, SizeRef, StorageRef, TensorRef

if TYPE_CHECKING:
    from ckptool.pickles.guard_cache import GuardCache

_P = pickle


class _Emitter:
    """A protocol-2 pickler restricted to the opcodes torch's weights_only unpickler reads."""

    def __init__(self, renumber: bool) -> None:
        self.renumber = renumber
        self.storages: dict[int, tuple[str, StorageRef]] = {}
        self.out = io.BytesIO()
        self.write = self.out.write
        self.memo: dict[int, int] = {}
        self.keep: list[Any] = []  # keep memoized objects alive so ids stay unique
        self.global_memo: dict[str, int] = {}
        # the memo index the next PUT takes: one more for each PUT written. Not the memo's size: a plain
        # tensor's emission (:meth:`_plain_tensor`) writes a PUT and memoises nothing for an object nothing
        # else refers to (it cannot be met again)
        self.next_index = 0
        self.dotted = False  # a global named as a nested class (module + "Outer.Inner") was written
        self._callables: dict[int, str] | None = None  # id of an allowed function -> its global
        self.plain = PlainTensors(self)  # the writer of plain tensors in one piece

    # memo -------------------------------------------------------------------------------------
    def _put(self, obj: Any) -> None:
        index = self.next_index
        self.next_index = index + 1
        self.memo[id(obj)] = index
        self.keep.append(obj)
        self._write_put(index)

    def _write_put(self, index: int) -> None:
        if index < 256:
            self.write(_P.BINPUT + bytes([index]))
        else:
            self.write(_P.LONG_BINPUT + struct.pack("<I", index))

    def _get(self, index: int) -> None:
        if index < 256:
            self.write(_P.BINGET + bytes([index]))
        else:
            self.write(_P.LONG_BINGET + struct.pack("<I", index))

    def global_(self, full_name: str, module: str | None = None) -> None:
        """GLOBAL ``module``/``name``: split at the last dot unless the reader kept where the pickle split it."""
        module, name = (module, full_name[len(module) + 1 :]) if module else full_name.rsplit(".", 1)
        key = f"{module}\n{name}"
        index = self.global_memo.get(key)
        if index is not None:
            self._get(index)
            return
        self.dotted = self.dotted or "." in name
        self.write(_P.GLOBAL + module.encode() + b"\n" + name.encode() + b"\n")
        index = self.next_index
        self.next_index = index + 1
        self.global_memo[key] = index
        self._write_put(index)

    def _storage_key(self, storage: StorageRef) -> str:
        entry = self.storages.get(id(storage))
        if entry is None:
            key = str(len(self.storages)) if self.renumber else storage.key
            entry = self.storages[id(storage)] = (key, storage)
        return entry[0]

    # values -----------------------------------------------------------------------------------
    def save(self, obj: Any) -> None:
        if obj is None:
            self.write(_P.NONE)
        elif obj is True:
            self.write(_P.NEWTRUE)
        elif obj is False:
            self.write(_P.NEWFALSE)
        elif type(obj) is int:
            self._int(obj)
        elif type(obj) is float:
            self.write(_P.BINFLOAT + struct.pack(">d", obj))
        elif id(obj) in self.memo:
            self._get(self.memo[id(obj)])
        elif type(obj) is TensorRef:  # the usual value of a state dict: tested before the rarer kinds
            self._tensor(obj)
        elif type(obj) is str:
            data = obj.encode("utf-8", "surrogatepass")
            self.write(_P.BINUNICODE + struct.pack("<I", len(data)) + data)
            if len(data) >= SHARED_TEXT:  # one string the input shares stays one string, not n copies
                self._put(obj)
        else:
            self._save_other(obj)

    def _save_other(self, obj: Any) -> None:
        """:meth:`save` for the kinds a state dict holds fewer of, tested in this order (a subclass before its base)."""
        if type(obj) is bytes:
            self._reduce_call("_codecs.encode", (obj.decode("latin1"), "latin1"), obj)
        elif type(obj) is bytearray:
            self._reduce_call("builtins.bytearray", (bytes(obj),), obj)
        elif type(obj) is complex:
            self._reduce_call("builtins.complex", (obj.real, obj.imag), obj)
        elif isinstance(obj, TensorRef):
            self._tensor(obj)
        elif isinstance(obj, StorageRef):
            self._storage(obj)
        elif isinstance(obj, SizeRef):
            self._reduce_call("torch.Size", (tuple(obj),), obj)
        elif isinstance(obj, tuple):
            self._tuple(obj)
        elif isinstance(obj, DeviceRef):
            self._reduce_call("torch.device", obj.args, obj)
        elif isinstance(obj, DTypeRef):
            self.global_(f"{obj.module}.{obj.name}")
        elif isinstance(obj, StorageTypeRef | TypeRef):
            self.global_(f"{obj.module}.{obj.name}")
        elif type(obj) is list:
            self.write(_P.EMPTY_LIST)
            self._put(obj)
            self._appends(obj)
        elif type(obj) is dict:
            self.write(_P.EMPTY_DICT)
            self._put(obj)
            self._setitems(list(dict.items(obj)))
        elif isinstance(obj, Counter):
            self._reduce_call("collections.Counter", (dict(obj),), obj)
        elif isinstance(obj, OrderedDict):
            self._ordered_dict(obj)
        elif type(obj) is set:
            self._reduce_call("builtins.set", (list(obj),), obj)
        elif isinstance(obj, OpaqueObject):
            self._opaque(obj)
        elif type(obj) is frozenset:
            self._frozenset(obj)
        elif isinstance(obj, type) and issubclass(obj, OpaqueObject) and (obj._global or obj._parent is not None):
            # an allowed class passed as a value (numpy's ndarray to _reconstruct, defaultdict's
            # list factory, a config's object_type): the global it was read from, spelled as it was
            self._class(obj)
        elif callable(obj) and self._callable_name(obj) is not None:
            self.global_(self._callable_name(obj))  # type: ignore[arg-type]
        else:
            raise InputError(f"cannot write a {type(obj).__name__} into a checkpoint pickle")

    def _storage(self, storage: StorageRef) -> None:
        """The persistent id torch writes: ('storage', storage class, key, location, numel)."""
        self.write(_P.MARK)
        self.save("storage")
        self.global_(storage.type_global or f"torch.{storage.dtype.storage_class or 'UntypedStorage'}")
        self.save(self._storage_key(storage))
        self.save(storage.location)
        self.save(storage.numel)
        self.write(_P.TUPLE + _P.BINPERSID)

    def _ordered_dict(self, obj: OrderedDict) -> None:
        self.global_("collections.OrderedDict")
        self.write(_P.EMPTY_TUPLE + _P.REDUCE)
        self._put(obj)
        self._setitems(list(dict.items(obj)))
        state = getattr(obj, "__dict__", None)
        if state:
            self.save(dict(state))
            self.write(_P.BUILD)

    def _frozenset(self, obj: frozenset) -> None:
        # the reader builds one only from FROZENSET (no frozenset global is allowed by default):
        # written back the same way, so no global the file did not name appears
        self.write(_P.MARK)
        for item in obj:
            self.save(item)
        self.write(_P.FROZENSET)
        self._put(obj)

    def _class(self, cls: type) -> None:
        """A placeholder class named as the pickle named it, so that it loads as the same object: read from
        ``getattr(<global>, 'name')`` (pickle's spelling of a nested name below protocol 4), that call again;
        else its global, split where the pickle split it (STACK_GLOBAL's ``m`` + ``Outer.Inner``)."""
        if cls._parent is None:  # type: ignore[attr-defined]
            self.global_(cls._global, cls._module)  # type: ignore[attr-defined]
            return
        if id(cls) in self.memo:
            self._get(self.memo[id(cls)])
            return
        self.global_("builtins.getattr")
        self.save((cls._parent, cls._attribute))  # type: ignore[attr-defined]
        self.write(_P.REDUCE)
        self._put(cls)

    def _callable_name(self, obj: Any) -> str | None:
        """The global a function of torch's allowed set stands for (``collections.OrderedDict`` is read
        as a checking function), when the tree holds it as a value."""
        if self._callables is None:
            from ckptool.pickles.allowlist import TORCH_GLOBALS  # complete once ckptool.pickles is imported

            self._callables = {
                id(value): name
                for name, value in TORCH_GLOBALS.items()
                if callable(value) and not isinstance(value, type)
            }
        return self._callables.get(id(obj))

    def _int(self, value: int) -> None:
        if 0 <= value < 256:
            self.write(_P.BININT1 + bytes([value]))
        elif 0 <= value < 65536:
            self.write(_P.BININT2 + struct.pack("<H", value))
        elif -(2**31) <= value < 2**31:
            self.write(_P.BININT + struct.pack("<i", value))
        else:
            self.write(long_bytes(value))

    def _tuple(self, obj: tuple) -> None:
        if not obj:
            self.write(_P.EMPTY_TUPLE)
            return
        if len(obj) <= 3:
            for item in obj:
                self.save(item)
            if id(obj) in self.memo:  # a recursive tuple was completed while saving its items
                self.write(_P.POP * len(obj))
                self._get(self.memo[id(obj)])
                return
            self.write((_P.TUPLE1, _P.TUPLE2, _P.TUPLE3)[len(obj) - 1])
        else:
            self.write(_P.MARK)
            for item in obj:
                self.save(item)
            self.write(_P.TUPLE)
        self._put(obj)

    # pickle's batches: up to 1000 items under a MARK, one alone by APPEND/SETITEM. An object of an
    # allowed class receives them as its pickle gave them (APPENDS calls its extend, APPEND its append)
    def _appends(self, items: list) -> None:
        for start in range(0, len(items), 1000):
            batch = items[start : start + 1000]
            if len(batch) == 1:
                self.save(batch[0])
                self.write(_P.APPEND)
                continue
            self.write(_P.MARK)
            for item in batch:
                self.save(item)
            self.write(_P.APPENDS)

    def _setitems(self, items: list) -> None:
        """SETITEM(S) in batches of 1000, as pickle writes them: ``items`` is a list of (key, value) tuples."""
        for start in range(0, len(items), 1000):
            batch = items[start : start + 1000]
            if len(batch) == 1:
                self.save(batch[0][0])
                self.save(batch[0][1])
                self.write(_P.SETITEM)
                continue
            self.write(_P.MARK)
            write_pairs(self, batch)  # plain tensors under str keys in one piece, the rest by save
            self.write(_P.SETITEMS)

    def _reduce_call(self, full_name: str, args: tuple, obj: Any) -> None:
        self.global_(full_name)
        self.save(tuple(args))
        self.write(_P.REDUCE)
        self._put(obj)

    def _tensor(self, tensor: TensorRef) -> None:
        if (
            tensor.subclass is None
            and tensor.parameter is None
            and tensor.rebuild == REBUILD_V2
            and not tensor.extra
            and self._plain_tensor(tensor)
        ):
            return
        if tensor.subclass is not None:
            # _rebuild_from_type_v2(func, type, args, state): the rebuild's global, then its arguments
            self.global_("torch._tensor._rebuild_from_type_v2")
            self.write(_P.MARK)
            self.global_(tensor.rebuild)
            self.global_(tensor.subclass[0])
            self.write(_P.MARK)
            for value in self._tensor_args(tensor):
                self.save(value)
            self.write(_P.TUPLE)
            self.save(tensor.subclass[1])
            self.write(_P.TUPLE + _P.REDUCE)
            self._put(tensor)
            return
        if tensor.parameter is not None:
            self.global_(tensor.parameter[0])
            self.write(_P.MARK)
        self.global_(tensor.rebuild)
        self.save(self._tensor_args(tensor))
        self.write(_P.REDUCE)
        if tensor.parameter is not None:
            for value in tensor.parameter[1:]:
                self.save(value)
            self.write(_P.TUPLE + _P.REDUCE)
        self._put(tensor)

    def _plain_tensor(self, tensor: TensorRef) -> bool:
        """A plain tensor (the state dict's usual entry) written in one piece by :class:`PlainTensors`: False, with
        nothing written, for one it declines."""
        written = self.plain.tensor(tensor)
        if written is None:
            return False
        self.write(written)
        return True

    @staticmethod
    def _tensor_args(tensor: TensorRef) -> tuple:
        # a tensor's shape and stride are written by value (tuples of their own, as torch.save's are): which
        # tensors share one tuple object is the reader's business (a safetensors header's parse shares them),
        # and must not change the bytes written
        args: list[Any] = [tensor.storage, tensor.offset, tuple(list(tensor.shape)), tuple(list(tensor.stride))]
        if tensor.rebuild != "torch._utils._rebuild_tensor":
            hooks = tensor.backward_hooks if tensor.backward_hooks is not None else OrderedDict()
            args += [tensor.requires_grad, hooks]
        if tensor.rebuild == "torch._utils._rebuild_tensor_v3":
            args.append(DTypeRef("torch", tensor.dtype.torch_name))
        return tuple(args + list(tensor.extra))

    def _opaque(self, obj: OpaqueObject) -> None:
        # pickle's save_reduce order: the call, memo, items appended, items set, then BUILD's state
        self._class(type(obj))
        if obj._mode == "newobj_ex":  # cls.__new__(cls, *args, **kwargs): the pair the reader kept
            args, kwargs = obj._args
            self.save(tuple(args))
            self.save(kwargs)
            self.write(_P.NEWOBJ_EX)
        else:
            self.save(tuple(obj.reduce_args()))
            self.write(_P.NEWOBJ if obj._mode == "newobj" else _P.REDUCE)
        self._put(obj)
        if obj._items:
            self._appends(obj._items)
        if obj._setitems:
            self._setitems(obj._setitems)
        if obj._state is not None:
            self.save(obj._state)
            self.write(_P.BUILD)


def dump(
    obj: Any, *, renumber_storages: bool = False, guard_cache: GuardCache | None = None
) -> tuple[bytes, list[tuple[str, StorageRef]]]:
    """Pickle a container of placeholders as torch would (protocol 2, weights_only-readable).

    Returns the pickle and the storages it references as ``(key, storage)`` in order of first
    appearance; with ``renumber_storages`` keys become "0", "1", ... (for storages from many sources).
    ``guard_cache`` (the write's own) remembers the pickle, so the write's read-back need not walk it:
    it holds only what torch's weights_only loader reads, emitted from a tree that was itself checked.
    """
    emitter = _Emitter(renumber_storages)
    emitter.write(_P.PROTO + b"\x02")
    try:
        with paused():  # the memo keeps every object it numbers alive: nothing here is garbage
            emitter.save(obj)
    except RecursionError as e:
        raise InputError("checkpoint object is nested too deeply to write") from e
    emitter.write(_P.STOP)
    blob = emitter.out.getvalue()
    if emitter.dotted:
        # Python's unpickler looks a dotted name up attribute by attribute only under protocol 4
        # (the input's, which named it by STACK_GLOBAL); no opcode written is newer than that
        blob = blob[:1] + b"\x04" + blob[2:]
    if guard_cache is not None:
        guard_cache.add_emitted(blob)
    return blob, list(emitter.storages.values())
