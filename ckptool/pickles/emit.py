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
from ckptool.pickles.placeholders import OpaqueObject, StateDict, StorageTypeRef, TypeRef
from ckptool.tensors.refs import DeviceRef, DTypeRef, SizeRef, StorageRef, TensorRef

if TYPE_CHECKING:
    from ckptool.pickles.guard_cache import GuardCache

_P = pickle
_SHARED_TEXT = 64  # bytes from which a string is memoised (shorter ones cost less than a memo entry)


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
        self._global_keys: dict[str, str] = {}  # a storage class's global -> its key in global_memo
        self._dims_bytes: dict[tuple[int, ...], bytes] = {}  # a plain tensor's shape or stride -> its ints and TUPLEn

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
            if len(data) >= _SHARED_TEXT:  # one string the input shares stays one string, not n copies
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
            self.write(_long_bytes(value))

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
            for key, value in batch:
                self.save(key)
                self.save(value)
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
            and tensor.rebuild == _REBUILD_V2
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
        """A plain ``_rebuild_tensor_v2`` tensor (the state dict's usual entry) written in one piece:
        exactly the bytes :meth:`save` writes for it value by value (its arguments' tuple, a fresh
        hooks ``OrderedDict``, each numbered alike; its shape and stride by value, as :meth:`_tensor_args`
        gives them). False, with nothing written, for any argument that path would write otherwise (shared
        through the memo, not plain ints)."""
        memo = self.memo
        storage, hooks, shape, stride, offset = (
            tensor.storage,
            tensor.backward_hooks,
            tensor.shape,
            tensor.stride,
            tensor.offset,
        )
        if hooks is None:
            hooks = OrderedDict()
        elif not _empty_hooks(hooks, memo):
            return False
        if not _plain_fields(tensor, memo):
            return False
        found = self._plain_globals(storage)
        if found is None:
            return False  # a global's first use: written (and memoised) by the general path
        rebuild_at, type_at, dict_at = found
        parts = self._plain_storage(storage, rebuild_at, type_at)
        if parts is None:
            return False
        parts.append(_int_bytes(offset))
        index = self.next_index
        for dims in (shape, stride):
            if not dims:
                parts.append(_P.EMPTY_TUPLE)
                continue
            parts.append(self._plain_dims(dims))
            parts.append(_put_bytes(index))  # (numbered as pickle numbers it; never looked up: written by value)
            index += 1
        parts.append(_P.NEWTRUE if tensor.requires_grad else _P.NEWFALSE)
        parts.append(_get_bytes(dict_at))
        args = (storage, offset, shape, stride, tensor.requires_grad, hooks)  # kept: its id stays its own
        self._plain_puts(parts, index, hooks, args, tensor)
        self.write(b"".join(parts))
        return True

    def _plain_globals(self, storage: StorageRef) -> tuple[int, int, int] | None:
        """The memo indexes of the globals a plain tensor names (its rebuild, its storage's class, the hooks'
        ``OrderedDict``), or None when one is not memoised yet."""
        global_memo = self.global_memo
        rebuild_at = global_memo.get(_REBUILD_V2_KEY)
        dict_at = global_memo.get(_ORDERED_DICT_KEY)
        type_global = storage.type_global or f"torch.{storage.dtype.storage_class or 'UntypedStorage'}"
        type_key = self._global_keys.get(type_global)
        if type_key is None:
            module, name = type_global.rsplit(".", 1)
            type_key = self._global_keys[type_global] = f"{module}\n{name}"
        type_at = global_memo.get(type_key)
        if rebuild_at is None or dict_at is None or type_at is None:
            return None
        return rebuild_at, type_at, dict_at

    def _plain_storage(self, storage: StorageRef, rebuild_at: int, type_at: int) -> list[bytes] | None:
        """A plain tensor's first bytes: its rebuild global, the arguments' MARK, and its storage's persistent id
        (:meth:`_storage`). None when its key or location is not a string :meth:`save` writes unmemoised."""
        parts = [_get_bytes(rebuild_at), b"((X\x07\x00\x00\x00storage", _get_bytes(type_at)]
        for text in (self._storage_key(storage), storage.location):
            if type(text) is not str:
                return None
            data = text.encode("utf-8", "surrogatepass")
            parts.append(_P.BINUNICODE + struct.pack("<I", len(data)) + data)
            if len(data) >= _SHARED_TEXT:  # the general path memoises such a string: not this one's form
                return None
        parts.append(_int_bytes(storage.numel))
        parts.append(b"tQ")
        return parts

    def _plain_dims(self, dims: tuple[int, ...]) -> bytes:
        """A plain tensor's shape or stride (1 to 3 ints) and its TUPLEn, cached by value."""
        # every value is an int (checked by _plain_fields), so a tuple equal to a cached one writes the same bytes
        written = self._dims_bytes.get(dims)
        if written is None:
            small = _SMALL_INTS
            written = self._dims_bytes[dims] = (
                b"".join([small[value] if 0 <= value < 256 else _int_bytes(value) for value in dims])
                + _TUPLES[len(dims)]
            )
        return written

    def _plain_puts(self, parts: list[bytes], index: int, hooks: Any, args: tuple, tensor: TensorRef) -> None:
        """The end of a plain tensor: the hooks' call, the arguments' TUPLE, the rebuild's REDUCE, each PUT at the
        memo index :meth:`save` gives it, and memoised."""
        memo, keep = self.memo, self.keep
        parts.append(b")R")
        parts.append(_put_bytes(index))
        memo[id(hooks)] = index
        keep.append(hooks)
        parts.append(b"t")
        parts.append(_put_bytes(index + 1))
        memo[id(args)] = index + 1
        keep.append(args)
        parts.append(b"R")
        parts.append(_put_bytes(index + 2))
        memo[id(tensor)] = index + 2
        keep.append(tensor)
        self.next_index = index + 3

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


_REBUILD_V2 = "torch._utils._rebuild_tensor_v2"
_REBUILD_V2_KEY = "torch._utils\n_rebuild_tensor_v2"
_ORDERED_DICT_KEY = "collections\nOrderedDict"
_TUPLES = (b"", _P.TUPLE1, _P.TUPLE2, _P.TUPLE3)


def _empty_hooks(hooks: Any, memo: dict[int, int]) -> bool:
    """Whether saved backward hooks write as a fresh empty ``OrderedDict`` would: empty, no attributes, not
    shared through the memo."""
    return not (
        (type(hooks) is not OrderedDict and type(hooks) is not StateDict)
        or hooks
        or getattr(hooks, "__dict__", None)
        or id(hooks) in memo
    )


def _plain_fields(tensor: TensorRef, memo: dict[int, int]) -> bool:
    """Whether a tensor's storage, offset, shape, stride and flag are what :meth:`_Emitter._plain_tensor` writes
    in one piece: of their exact types, at most 3 dimensions, ints only, the storage not met before."""
    storage, shape, stride = tensor.storage, tensor.shape, tensor.stride
    if (
        type(storage) is not StorageRef
        or id(storage) in memo
        or type(tensor.offset) is not int
        or type(shape) is not tuple
        or type(stride) is not tuple
        or len(shape) > 3
        or len(stride) > 3
        or type(tensor.requires_grad) is not bool
        or type(storage.numel) is not int
        or type(storage.location) is not str
    ):
        return False
    for value in shape + stride:
        if type(value) is not int:
            return False
    return True


_OP_INDEX = struct.Struct("<BI").pack
_SMALL_INTS = [_P.BININT1 + bytes([value]) for value in range(256)]
_SHORT_GETS = [_P.BINGET + bytes([index]) for index in range(256)]
_SHORT_PUTS = [_P.BINPUT + bytes([index]) for index in range(256)]


def _get_bytes(index: int) -> bytes:
    return _SHORT_GETS[index] if index < 256 else _OP_INDEX(0x6A, index)  # BINGET, LONG_BINGET


def _put_bytes(index: int) -> bytes:
    return _SHORT_PUTS[index] if index < 256 else _OP_INDEX(0x72, index)  # BINPUT, LONG_BINPUT


def _int_bytes(value: int) -> bytes:
    """What :meth:`_Emitter._int` writes for ``value``."""
    if 0 <= value < 256:
        return _SMALL_INTS[value]
    if 0 <= value < 65536:
        return _P.BININT2 + struct.pack("<H", value)
    if -(2**31) <= value < 2**31:
        return _P.BININT + struct.pack("<i", value)
    return _long_bytes(value)


def _long_bytes(value: int) -> bytes:
    """LONG1, or past 255 bytes (614 digits) LONG4, as pickle (and so torch.save) writes an int. torch's
    weights_only loader reads no LONG4: an int that long came from a pickle it did not load either (or from a
    container ckptool carried out of one), and is written back as that pickle held it."""
    encoded = pickle.encode_long(value)
    if len(encoded) < 256:
        return _P.LONG1 + bytes([len(encoded)]) + encoded
    return _P.LONG4 + struct.pack("<i", len(encoded)) + encoded


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
