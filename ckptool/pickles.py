"""Read and write checkpoint pickles without running them.

:class:`RestrictedUnpickler` resolves every global through an allowlist (:mod:`ckptool.safety`)
and builds inert placeholders: tensors become :class:`~ckptool.refs.TensorRef`, storages come from
the format reader, other allowed objects (``argparse.Namespace``, numpy scalars) become
:class:`OpaqueObject` records. Nothing a pickle names is ever imported or called.

:func:`dump` writes such an object tree back as a protocol-2 pickle using only the opcodes
torch's ``weights_only`` unpickler accepts, re-emitting every placeholder as the global it came
from — so a rewritten checkpoint loads wherever the original did.
"""

from __future__ import annotations

import io
import pickle
import struct
from collections import Counter, OrderedDict
from collections.abc import Callable
from typing import Any

from . import dtypes
from .dtypes import DType
from .errors import InputError
from .refs import DeviceRef, DTypeRef, SizeRef, StorageRef, TensorRef

# The ceiling on one pickle's size: real checkpoints' pickles are a few MB even with 100k tensors.
MAX_PICKLE_BYTES = 1 << 30


class RefusedGlobal(Exception):
    """Raised inside the unpickler when a pickle names a global outside the allowlist."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.name = name


class StorageTypeRef:
    """A storage class global (``torch.FloatStorage``, ``torch.storage.UntypedStorage``)."""

    __slots__ = ("module", "name", "dtype")

    def __init__(self, module: str, name: str, dtype: DType) -> None:
        self.module, self.name, self.dtype = module, name, dtype


class OpaqueObject:
    """An allowed object of a class ckptool does not model: its construction is recorded, never run.

    ``_mode`` is ``"newobj"`` (built by NEWOBJ: ``cls.__new__(cls, *args)``) or ``"reduce"``
    (built by calling the global). State from BUILD and items from APPEND/SETITEM are kept so
    :func:`dump` can re-emit the object exactly.
    """

    _global: str = ""

    def __new__(cls, *args: Any) -> OpaqueObject:
        obj = object.__new__(cls)
        obj._args = args
        obj._mode = "newobj"
        obj._state = None
        obj._items: list = []
        obj._setitems: list = []
        return obj

    def __init__(self, *args: Any) -> None:
        self._mode = "reduce"

    def __setstate__(self, state: Any) -> None:
        self._state = state

    def append(self, item: Any) -> None:
        self._items.append(item)

    def extend(self, items: Any) -> None:
        self._items.extend(items)

    def __setitem__(self, key: Any, value: Any) -> None:
        self._setitems.append((key, value))

    def __repr__(self) -> str:
        return f"<{self._global}>"

    @property
    def global_name(self) -> str:
        return self._global

    @property
    def state(self) -> Any:
        return self._state


_OPAQUE_TYPES: dict[str, type] = {}


def opaque_type(full_name: str) -> type:
    """The placeholder class standing for global ``full_name`` (one class per name)."""
    cls = _OPAQUE_TYPES.get(full_name)
    if cls is None:
        cls = type(full_name.rsplit(".", 1)[-1], (OpaqueObject,), {"_global": full_name, "__slots__": ()})
        _OPAQUE_TYPES[full_name] = cls
    return cls


# ---------------------------------------------------------------------------------------------
# tensor rebuild placeholders


def _check_int(value: Any, what: str) -> int:
    if type(value) is not int or value < 0:
        raise InputError(f"tensor {what} is {value!r}, not a non-negative integer — the file is corrupt")
    return value


def _check_ints(value: Any, what: str) -> tuple[int, ...]:
    if not isinstance(value, tuple | list) or len(value) > 64:
        raise InputError(f"tensor {what} is {type(value).__name__}, not a tuple of integers — the file is corrupt")
    return tuple(_check_int(v, what) for v in value)


def _make_tensor(rebuild: str, storage: Any, offset: Any, size: Any, stride: Any, requires_grad: Any = False,
                 backward_hooks: Any = None, dtype: DType | None = None, extra: tuple = ()) -> TensorRef:
    if not isinstance(storage, StorageRef):
        raise InputError("a tensor's storage is not a saved storage record — the file is corrupt or not a checkpoint")
    if not isinstance(requires_grad, bool):
        raise InputError("a tensor's requires_grad is not a bool — the file is corrupt")
    tensor = TensorRef(
        storage=storage,
        dtype=dtype or storage.dtype,
        shape=_check_ints(size, "shape"),
        stride=_check_ints(stride, "stride"),
        offset=_check_int(offset, "storage offset"),
        requires_grad=requires_grad,
        rebuild=rebuild,
        extra=extra,
        backward_hooks=backward_hooks,
    )
    tensor.validate()
    return tensor


def _rebuild_tensor_v2(storage: Any, offset: Any, size: Any, stride: Any, requires_grad: Any = False,
                       backward_hooks: Any = None, *extra: Any) -> TensorRef:
    return _make_tensor("torch._utils._rebuild_tensor_v2", storage, offset, size, stride, requires_grad,
                        backward_hooks, extra=extra)


def _rebuild_tensor(storage: Any, offset: Any, size: Any, stride: Any) -> TensorRef:
    return _make_tensor("torch._utils._rebuild_tensor", storage, offset, size, stride)


def _rebuild_tensor_v3(storage: Any, offset: Any, size: Any, stride: Any, requires_grad: Any, backward_hooks: Any,
                       dtype: Any, *extra: Any) -> TensorRef:
    if not isinstance(dtype, DTypeRef) or dtype.name not in dtypes.BY_TORCH_NAME:
        raise InputError(f"tensor dtype {dtype!r} is not one ckptool knows — the file is corrupt or too new")
    return _make_tensor("torch._utils._rebuild_tensor_v3", storage, offset, size, stride, requires_grad,
                        backward_hooks, dtype=dtypes.BY_TORCH_NAME[dtype.name], extra=extra)


def _rebuild_parameter(data: Any, requires_grad: Any, backward_hooks: Any) -> TensorRef:
    if not isinstance(data, TensorRef):
        raise InputError("a parameter wraps something that is not a tensor — the file is corrupt")
    data.parameter = ("torch._utils._rebuild_parameter", requires_grad, backward_hooks)
    return data


def _rebuild_parameter_with_state(data: Any, requires_grad: Any, backward_hooks: Any, state: Any) -> TensorRef:
    if not isinstance(data, TensorRef):
        raise InputError("a parameter wraps something that is not a tensor — the file is corrupt")
    data.parameter = ("torch._utils._rebuild_parameter_with_state", requires_grad, backward_hooks, state)
    return data


def _codecs_encode(text: Any, encoding: Any = "utf-8") -> bytes:
    # protocol 2 spells bytes as _codecs.encode(latin1_text, "latin1"); nothing else is allowed
    if not isinstance(text, str) or encoding not in ("latin1", "latin-1"):
        raise InputError("pickle uses _codecs.encode other than for bytes — refused")
    return text.encode("latin1")


def _torch_device(*args: Any) -> DeviceRef:
    if not args or not all(isinstance(a, str | int) for a in args) or len(args) > 2:
        raise InputError(f"torch.device{args!r} is malformed — the file is corrupt")
    return DeviceRef(tuple(args))


def _torch_size(values: Any = ()) -> SizeRef:
    return SizeRef(_check_ints(values, "size"))


def _builtin_set(items: Any = ()) -> set:
    return set(items)


def _builtin_bytearray(data: Any = b"") -> bytearray:
    if not isinstance(data, bytes | bytearray):
        raise InputError("bytearray built from something that is not bytes — refused")
    return bytearray(data)


def _builtin_complex(real: Any = 0.0, imag: Any = 0.0) -> complex:
    if not all(isinstance(v, int | float) and not isinstance(v, bool) for v in (real, imag)):
        raise InputError("complex built from something that is not a number — refused")
    return complex(real, imag)


def _ordered_dict(items: Any = ()) -> OrderedDict:
    return OrderedDict(items) if isinstance(items, list | tuple | dict) and items else OrderedDict()


def _counter(items: Any = None) -> Counter:
    return Counter(items) if isinstance(items, dict) else Counter()


def _build_torch_globals() -> dict[str, Any]:
    table: dict[str, Any] = {
        "collections.OrderedDict": _ordered_dict,
        "collections.Counter": _counter,
        "_codecs.encode": _codecs_encode,
        "builtins.set": _builtin_set,
        "builtins.bytearray": _builtin_bytearray,
        "builtins.complex": _builtin_complex,
        "torch.Size": _torch_size,
        "torch.device": _torch_device,
        "torch._utils._rebuild_tensor": _rebuild_tensor,
        "torch._utils._rebuild_tensor_v2": _rebuild_tensor_v2,
        "torch._utils._rebuild_tensor_v3": _rebuild_tensor_v3,
        "torch._utils._rebuild_parameter": _rebuild_parameter,
        "torch._utils._rebuild_parameter_with_state": _rebuild_parameter_with_state,
        "torch.storage.UntypedStorage": StorageTypeRef("torch.storage", "UntypedStorage", dtypes.BY_NAME["U8"]),
        "torch.UntypedStorage": StorageTypeRef("torch", "UntypedStorage", dtypes.BY_NAME["U8"]),
    }
    for storage_class, dtype in dtypes.BY_STORAGE_CLASS.items():
        table[f"torch.{storage_class}"] = StorageTypeRef("torch", storage_class, dtype)
    for torch_name in dtypes.BY_TORCH_NAME:
        table[f"torch.{torch_name}"] = DTypeRef("torch", torch_name)
    return table


# Globals torch's own weights_only unpickler allows, mapped to inert placeholders.
TORCH_GLOBALS: dict[str, Any] = _build_torch_globals()

# Benign types found in real checkpoints beyond torch's list: recorded, never constructed.
#   argparse.Namespace — training scripts save their parsed args (fairseq, many research repos)
#   numpy scalars, dtypes and arrays — metrics and RNG states saved as numpy values
DEFAULT_EXTRA_GLOBALS: tuple[str, ...] = (
    "argparse.Namespace",
    "numpy.core.multiarray._reconstruct",
    "numpy._core.multiarray._reconstruct",
    "numpy.core.multiarray.scalar",
    "numpy._core.multiarray.scalar",
    "numpy.ndarray",
    "numpy.dtype",
)


class GlobalResolver:
    """Maps a pickle's ``module.name`` to a placeholder, or refuses it.

    Args:
        allow_globals: extra names to accept as :class:`OpaqueObject` placeholders.
        permissive: scan mode — record every global and return a harmless placeholder for all.
    """

    def __init__(self, allow_globals: tuple[str, ...] | list[str] = (), *, permissive: bool = False) -> None:
        self.extra = set(DEFAULT_EXTRA_GLOBALS) | set(allow_globals)
        self.permissive = permissive
        self.seen: dict[str, int] = {}
        self.refused: list[str] = []

    def is_allowed(self, full_name: str) -> bool:
        return full_name in TORCH_GLOBALS or full_name in self.extra

    def resolve(self, module: str, name: str) -> Any:
        full_name = f"{module}.{name}"
        self.seen[full_name] = self.seen.get(full_name, 0) + 1
        if full_name in TORCH_GLOBALS:
            return TORCH_GLOBALS[full_name]
        if full_name in self.extra:
            return opaque_type(full_name)
        if full_name not in self.refused:
            self.refused.append(full_name)
        if self.permissive:
            return opaque_type(full_name)
        raise RefusedGlobal(full_name)


class RestrictedUnpickler(pickle.Unpickler):
    """A pickle.Unpickler whose globals come only from a :class:`GlobalResolver`."""

    def __init__(self, file: io.BufferedIOBase, resolver: GlobalResolver,
                 persistent_load: Callable[[Any], Any] | None) -> None:
        super().__init__(file, encoding="utf-8")
        self._resolver = resolver
        self._persistent = persistent_load

    def find_class(self, module: str, name: str) -> Any:  # noqa: D102 — the only door to globals
        return self._resolver.resolve(module, name)

    def persistent_load(self, pid: Any) -> Any:  # noqa: D102
        if self._persistent is None:
            raise InputError("pickle references external data (persistent id) outside a checkpoint")
        return self._persistent(pid)


def loads(data: bytes | io.BufferedIOBase, resolver: GlobalResolver,
          persistent_load: Callable[[Any], Any] | None = None) -> Any:
    """Unpickle ``data`` through ``resolver``; errors surface as RefusedGlobal or InputError."""
    stream = io.BytesIO(data) if isinstance(data, bytes | bytearray | memoryview) else data
    try:
        return RestrictedUnpickler(stream, resolver, persistent_load).load()
    except (RefusedGlobal, InputError):
        raise
    except RecursionError as e:
        raise InputError("pickle is nested too deeply to read safely") from e
    except MemoryError as e:
        raise InputError("pickle would need more memory than is available to read") from e
    except Exception as e:  # any malformed-pickle error from the C unpickler
        raise InputError(f"pickle is corrupt or truncated ({type(e).__name__}: {_short(e)})") from e


def _short(error: BaseException) -> str:
    text = str(error).splitlines()[0] if str(error) else ""
    return text[:160]


# ---------------------------------------------------------------------------------------------
# writing


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

    # memo -------------------------------------------------------------------------------------
    def _put(self, obj: Any) -> None:
        index = len(self.memo) + len(self.global_memo)
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

    def global_(self, full_name: str) -> None:
        index = self.global_memo.get(full_name)
        if index is not None:
            self._get(index)
            return
        module, name = full_name.rsplit(".", 1)
        self.write(_P.GLOBAL + module.encode() + b"\n" + name.encode() + b"\n")
        index = len(self.memo) + len(self.global_memo)
        self.global_memo[full_name] = index
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
        elif type(obj) is str:
            data = obj.encode("utf-8", "surrogatepass")
            self.write(_P.BINUNICODE + struct.pack("<I", len(data)) + data)
        elif id(obj) in self.memo:
            self._get(self.memo[id(obj)])
        elif type(obj) is bytes:
            self._reduce_call("_codecs.encode", (obj.decode("latin1"), "latin1"), obj)
        elif type(obj) is bytearray:
            self._reduce_call("builtins.bytearray", (bytes(obj),), obj)
        elif type(obj) is complex:
            self._reduce_call("builtins.complex", (obj.real, obj.imag), obj)
        elif isinstance(obj, TensorRef):
            self._tensor(obj)
        elif isinstance(obj, StorageRef):
            # the persistent id torch writes: ('storage', storage class, key, location, numel)
            self.write(_P.MARK)
            self.save("storage")
            self.global_(obj.type_global or f"torch.{obj.dtype.storage_class or 'UntypedStorage'}")
            self.save(self._storage_key(obj))
            self.save(obj.location)
            self.save(obj.numel)
            self.write(_P.TUPLE + _P.BINPERSID)
        elif isinstance(obj, SizeRef):
            self._reduce_call("torch.Size", (tuple(obj),), obj)
        elif isinstance(obj, tuple):
            self._tuple(obj)
        elif isinstance(obj, DeviceRef):
            self._reduce_call("torch.device", obj.args, obj)
        elif isinstance(obj, DTypeRef):
            self.global_(f"{obj.module}.{obj.name}")
        elif isinstance(obj, StorageTypeRef):
            self.global_(f"{obj.module}.{obj.name}")
        elif type(obj) is list:
            self.write(_P.EMPTY_LIST)
            self._put(obj)
            self._appends(obj)
        elif type(obj) is dict:
            self.write(_P.EMPTY_DICT)
            self._put(obj)
            self._setitems(list(obj.items()))
        elif isinstance(obj, Counter):
            self._reduce_call("collections.Counter", (dict(obj),), obj)
        elif isinstance(obj, OrderedDict):
            self.global_("collections.OrderedDict")
            self.write(_P.EMPTY_TUPLE + _P.REDUCE)
            self._put(obj)
            self._setitems(list(obj.items()))
            state = getattr(obj, "__dict__", None)
            if state:
                self.save(dict(state))
                self.write(_P.BUILD)
        elif type(obj) is set:
            self._reduce_call("builtins.set", (list(obj),), obj)
        elif isinstance(obj, OpaqueObject):
            self._opaque(obj)
        else:
            raise InputError(f"cannot write a {type(obj).__name__} into a checkpoint pickle")

    def _int(self, value: int) -> None:
        if 0 <= value < 256:
            self.write(_P.BININT1 + bytes([value]))
        elif 0 <= value < 65536:
            self.write(_P.BININT2 + struct.pack("<H", value))
        elif -(2**31) <= value < 2**31:
            self.write(_P.BININT + struct.pack("<i", value))
        else:
            encoded = pickle.encode_long(value)
            if len(encoded) > 255:
                raise InputError("an integer in the checkpoint is too large to write")
            self.write(_P.LONG1 + bytes([len(encoded)]) + encoded)

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

    def _appends(self, items: list) -> None:
        for start in range(0, len(items), 1000):
            batch = items[start : start + 1000]
            self.write(_P.MARK)
            for item in batch:
                self.save(item)
            self.write(_P.APPENDS)

    def _setitems(self, items: list) -> None:
        for start in range(0, len(items), 1000):
            batch = items[start : start + 1000]
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
        if tensor.parameter is not None:
            self.global_(tensor.parameter[0])
            self.write(_P.MARK)
        self.global_(tensor.rebuild)
        args: list[Any] = [tensor.storage, tensor.offset, tuple(tensor.shape), tuple(tensor.stride)]
        if tensor.rebuild != "torch._utils._rebuild_tensor":
            hooks = tensor.backward_hooks if tensor.backward_hooks is not None else OrderedDict()
            args += [tensor.requires_grad, hooks]
        if tensor.rebuild == "torch._utils._rebuild_tensor_v3":
            args.append(DTypeRef("torch", tensor.dtype.torch_name))
        args += list(tensor.extra)
        self.save(tuple(args))
        self.write(_P.REDUCE)
        if tensor.parameter is not None:
            for value in tensor.parameter[1:]:
                self.save(value)
            self.write(_P.TUPLE + _P.REDUCE)
        self._put(tensor)

    def _opaque(self, obj: OpaqueObject) -> None:
        self.global_(obj._global)
        self.save(tuple(obj._args))
        self.write(_P.NEWOBJ if obj._mode == "newobj" else _P.REDUCE)
        self._put(obj)
        if obj._items:
            self._appends(obj._items)
        if obj._setitems:
            self._setitems(obj._setitems)
        if obj._state is not None:
            self.save(obj._state)
            self.write(_P.BUILD)


def dump(obj: Any, *, renumber_storages: bool = False) -> tuple[bytes, list[tuple[str, StorageRef]]]:
    """Pickle a container of placeholders as torch would (protocol 2, weights_only-readable).

    Returns the pickle and the storages it references as ``(key, storage)`` in order of first
    appearance; with ``renumber_storages`` keys become "0", "1", ... (for storages from many sources).
    """
    emitter = _Emitter(renumber_storages)
    emitter.write(_P.PROTO + b"\x02")
    try:
        emitter.save(obj)
    except RecursionError as e:
        raise InputError("checkpoint object is nested too deeply to write") from e
    emitter.write(_P.STOP)
    return emitter.out.getvalue(), list(emitter.storages.values())
