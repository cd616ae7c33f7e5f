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
import re
import reprlib
import struct
from collections import Counter, OrderedDict
from collections.abc import Callable
from typing import Any

from . import dtypes
from .dtypes import DType
from .errors import InputError
from .refs import DeviceRef, DTypeRef, SizeRef, StorageRef, TensorRef, bits_supported, human_size

# The ceiling on one pickle's size: real checkpoints' pickles are a few MB even with 100k tensors.
MAX_PICKLE_BYTES = 1 << 30
# What a pickle may make the unpickler allocate (estimated before it runs, the guard's own records
# included): a 10-byte pickle can otherwise ask for a 64 GiB memo, and 1 MB of EMPTY_SET opcodes
# builds 200 MB of sets. Real checkpoints' pickles estimate at ~2 KB per tensor (200 MB for 100k).
MAX_UNPICKLED_BYTES = 1 << 30
# Nesting of the object tree: every walk over it (ours, json, repr, the writer) must fit the stack.
MAX_NESTING = 100
# One dict key or set element: hashing a tuple visits every element of every nested tuple.
MAX_KEY_NODES = 1000
# Distinct keys of one dict/set sharing one hash (ints, floats and tuples of them hash predictably,
# so a pickle can make every insertion collide and the load quadratic).
MAX_HASH_COLLISIONS = 16
# Objects the tree would hold if every shared reference were copied (json.dumps, repr, str do
# copy them): a list doubled 60 times by memo references is 60 objects and 2**60 when walked.
MAX_EXPANDED_NODES = 10_000_000
# Bytes of strings the tree would hold if every shared reference were copied (and 16 times the
# pickle's length): what json.dumps, repr or a safetensors header would write.
MAX_EXPANDED_TEXT = 256 << 20

class _BriefRepr(reprlib.Repr):
    """reprlib bounds lists, tuples, dicts and strings; other objects get their type name only
    (a dataclass's own repr would walk every field, however large)."""

    def repr_instance(self, obj: Any, level: int) -> str:  # noqa: D102
        if type(obj) in (float, complex, bool, type(None)):
            return repr(obj)
        return f"<{type(obj).__name__}>"


_brief_repr = _BriefRepr()
_brief_repr.maxlevel, _brief_repr.maxstring, _brief_repr.maxother, _brief_repr.maxlong = 3, 60, 60, 40


def brief(value: Any) -> str:
    """A short repr for error messages: bounded in time and length whatever ``value`` holds."""
    try:
        return _brief_repr.repr(value)
    except Exception:  # a placeholder whose repr fails still gets a message
        return f"<{type(value).__name__}>"


class RefusedGlobal(Exception):
    """Raised inside the unpickler when a pickle names a global outside the allowlist."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.name = name


def _refuse_build(state: Any) -> None:
    raise InputError("pickle sets state (BUILD) on an allowlisted global — torch never writes that; refused")


class TypeRef:
    """A class global torch's weights_only set allows as a value (``torch.Tensor``): a name, never the class."""

    __slots__ = ("module", "name")

    def __init__(self, module: str, name: str) -> None:
        self.module, self.name = module, name

    def __setstate__(self, state: Any) -> None:  # one instance per class is shared by every load
        _refuse_build(state)

    def __repr__(self) -> str:
        return f"{self.module}.{self.name}"


class StorageTypeRef:
    """A storage class global (``torch.FloatStorage``, ``torch.storage.UntypedStorage``)."""

    __slots__ = ("module", "name", "dtype")

    def __init__(self, module: str, name: str, dtype: DType) -> None:
        self.module, self.name, self.dtype = module, name, dtype

    def __setstate__(self, state: Any) -> None:  # one instance per class is shared by every load
        _refuse_build(state)


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

    def reduce_args(self) -> tuple:
        """The arguments the pickle passes to the global (a placeholder may hold them in another form)."""
        return self._args

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


_INT64_MAX = (1 << 63) - 1


def _check_int(value: Any, what: str) -> int:
    if type(value) is not int or value < 0:
        raise InputError(f"tensor {what} is {brief(value)}, not a non-negative integer — the file is corrupt")
    if value > _INT64_MAX:
        raise InputError(f"tensor {what} {value} does not fit in 64 bits — the file is corrupt")
    return value


def _check_ints(value: Any, what: str) -> tuple[int, ...]:
    if type(value) is tuple and len(value) <= 64:  # the usual case, checked without a generator
        for v in value:
            if type(v) is not int or v < 0 or v > _INT64_MAX:
                break
        else:
            return value
    if not isinstance(value, tuple | list) or len(value) > 64:
        raise InputError(f"tensor {what} is {type(value).__name__}, not a tuple of integers — the file is corrupt")
    return tuple(_check_int(v, what) for v in value)


def _tensor_bits(extra: tuple, dtype: DType) -> tuple[bool, bool]:
    """The conjugate and negative bits in a rebuild's trailing ``metadata`` argument.

    torch applies ``metadata`` when it is truthy (``torch._utils.set_tensor_metadata``: a dict of str to
    bool whose ``conj``/``neg`` entries set the tensor's bits); torch.save writes ``{"conj": True}``,
    ``{"neg": True}`` or both. Anything else ckptool cannot be sure to read as torch does is refused.
    """
    if len(extra) > 1:
        raise InputError(f"a tensor is rebuilt with {len(extra)} arguments after its hooks; torch takes one "
                         "(metadata) — the file is corrupt")
    metadata = extra[0] if extra else None
    if not metadata:
        return False, False  # torch ignores a falsy metadata (None, {})
    if not isinstance(metadata, dict):
        raise InputError(f"a tensor's metadata is {brief(metadata)}, not a dict — the file is corrupt")
    bits = {"conj": False, "neg": False}
    for key, value in dict.items(metadata):
        if key not in bits:
            raise InputError(f"a tensor's metadata sets {brief(key)}, which ckptool does not know how to apply "
                             "(it knows conj and neg) — the file may come from a newer torch; refused")
        if value is not True:
            # torch.save writes only True entries; torch sets the bit for any entry, False included
            # (it reads the key, not the value), which other torch versions need not do
            raise InputError(f"a tensor's metadata {key!r} is {brief(value)}, not True — torch.save never "
                             "writes that, and torch versions read it differently; refused")
        bits[key] = True
    if "conj" in metadata and not dtype.name.startswith("C"):
        # torch asserts on any conj entry (even False) for a non-complex tensor
        raise InputError(f"a {dtype.torch_name} tensor's metadata sets its conjugate bit, which only complex "
                         "tensors have — the file is corrupt")
    problem = bits_supported(dtype, conj=bits["conj"], neg=bits["neg"])
    if problem is not None:
        raise InputError(f"a tensor carries {problem}; its values cannot be read exactly — refused")
    return bits["conj"], bits["neg"]


def _make_tensor(rebuild: str, storage: Any, offset: Any, size: Any, stride: Any, requires_grad: Any = False,
                 backward_hooks: Any = None, dtype: DType | None = None, extra: tuple = ()) -> TensorRef:
    if not isinstance(storage, StorageRef):
        raise InputError("a tensor's storage is not a saved storage record — the file is corrupt or not a checkpoint")
    if not isinstance(requires_grad, bool):
        raise InputError("a tensor's requires_grad is not a bool — the file is corrupt")
    dtype = dtype or storage.dtype
    if dtype.name not in dtypes.BY_NAME:  # a quantized storage: torch builds its tensors by _rebuild_qtensor only
        raise InputError(f"a plain tensor rebuild reads a {dtype.torch_name} storage — refused; torch.save writes "
                         "quantized tensors with _rebuild_qtensor")
    conj = neg = False
    if extra:  # the usual tensor has no metadata: nothing more to check
        conj, neg = _tensor_bits(extra, dtype)
    tensor = TensorRef(
        storage=storage,
        dtype=dtype,
        shape=_check_ints(size, "shape"),
        stride=_check_ints(stride, "stride"),
        offset=_check_int(offset, "storage offset"),
        requires_grad=requires_grad,
        rebuild=rebuild,
        extra=extra,
        backward_hooks=backward_hooks,
        conj=conj,
        neg=neg,
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
        raise InputError(f"tensor dtype {brief(dtype)} is not one ckptool knows — the file is corrupt or too new")
    return _make_tensor("torch._utils._rebuild_tensor_v3", storage, offset, size, stride, requires_grad,
                        backward_hooks, dtype=dtypes.BY_TORCH_NAME[dtype.name], extra=extra)


def _rebuild_parameter(data: Any, requires_grad: Any, backward_hooks: Any) -> TensorRef:
    if not isinstance(data, TensorRef):
        raise InputError("a parameter wraps something that is not a tensor — the file is corrupt")
    data.parameter = ("torch._utils._rebuild_parameter", requires_grad, backward_hooks)
    return data


# Attributes of torch.nn.Parameter that are descriptors (torch 2.x): torch's _set_obj_state does
# ``setattr(param, name, value)`` for each name in a parameter's saved state, and on these that runs
# torch code — ``data`` swaps the weights for another tensor, ``real``/``imag`` overwrite them — or
# fails. A parameter's real state is its ``__dict__`` (plain Python attributes), which never holds
# them; state naming one is refused. tests/test_differential.py checks this set against the
# installed torch's descriptors.
PARAMETER_DESCRIPTORS = frozenset({
    "H", "T", "_backward_hooks", "_base", "_cdata", "_grad", "_grad_fn", "_has_symbolic_sizes_strides",
    "_post_accumulate_grad_hooks", "_python_dispatch", "_version", "data", "device", "dtype", "grad",
    "grad_dtype", "grad_fn", "imag", "is_cpu", "is_cuda", "is_ipu", "is_leaf", "is_maia", "is_meta",
    "is_mkldnn", "is_mps", "is_mtia", "is_nested", "is_quantized", "is_sparse", "is_sparse_csr", "is_vulkan",
    "is_xla", "is_xpu", "itemsize", "layout", "mH", "mT", "name", "names", "nbytes", "ndim", "output_nr",
    "real", "requires_grad", "retains_grad", "shape", "volatile",
})


def _check_parameter_state(state: Any) -> None:
    """Honour a parameter's saved state only when it cannot change the tensor: plain attributes.

    torch (``_rebuild_parameter_with_state`` -> ``_set_obj_state``) takes ``state`` as a dict of
    attributes, or a pair ``(dict_state, slots_state)``, and sets each one on the parameter.
    """
    parts = state if isinstance(state, tuple) else (state,)
    if isinstance(state, tuple) and len(state) != 2:
        raise InputError(f"a parameter's state is a {len(state)}-tuple; torch reads a pair — the file is corrupt")
    for part in parts:
        if not part:
            continue  # torch skips a falsy part (Python 3.11 pickles an empty __dict__ as None)
        if not isinstance(part, dict):
            raise InputError(f"a parameter's state is {brief(part)}, not a dict of attributes — refused")
        for name in dict.keys(part):
            if type(name) is not str:
                raise InputError(f"a parameter's state sets attribute {brief(name)}, not a name — "
                                 "the file is corrupt")
            if name in PARAMETER_DESCRIPTORS or (name.startswith("__") and name.endswith("__")):
                raise InputError(f"a parameter's state sets {name!r}, which would change or replace the tensor "
                                 "when torch loads it (torch.save never writes that) — refused")


def _rebuild_parameter_with_state(data: Any, requires_grad: Any, backward_hooks: Any, state: Any) -> TensorRef:
    if not isinstance(data, TensorRef):
        raise InputError("a parameter wraps something that is not a tensor — the file is corrupt")
    _check_parameter_state(state)
    data.parameter = ("torch._utils._rebuild_parameter_with_state", requires_grad, backward_hooks, state)
    return data


_TENSOR_REBUILDS = ("torch._utils._rebuild_tensor", "torch._utils._rebuild_tensor_v2", "torch._utils._rebuild_tensor_v3")


def _rebuild_from_type_v2(func: Any, new_type: Any, args: Any, state: Any) -> TensorRef:
    """``torch._tensor._rebuild_from_type_v2``: what torch.save writes for a tensor carrying Python
    attributes (``t.note = ...``): ``func(*args)``, then each attribute of ``state`` set on it.

    Read when ``func`` is a tensor rebuild, the type ``torch.Tensor`` and the state plain attributes
    (the same rule as parameter state); the recipe rides on the tensor for ``.pt`` rewrites.
    """
    if not isinstance(new_type, TypeRef) or f"{new_type.module}.{new_type.name}" != "torch.Tensor":
        raise InputError(f"a tensor is rebuilt as type {brief(new_type)}; ckptool reads plain torch.Tensor "
                         "only — refused")
    if not isinstance(args, tuple) or not any(func is TORCH_GLOBALS.get(name) for name in _TENSOR_REBUILDS):
        raise InputError("a tensor with attributes is rebuilt by something other than a tensor rebuild — refused")
    tensor = func(*args)
    if not isinstance(tensor, TensorRef) or tensor.subclass is not None or tensor.parameter is not None:
        raise InputError("a tensor with attributes wraps something that is not a plain tensor — refused")
    _check_parameter_state(state)
    tensor.subclass = ("torch.Tensor", state)
    return tensor


def _rebuild_meta_tensor_no_storage(dtype: Any, size: Any, stride: Any, requires_grad: Any) -> OpaqueObject:
    """A tensor on the meta device (shape and dtype, no values): kept as the call that builds it."""
    if not isinstance(dtype, DTypeRef) or dtype.name not in dtypes.BY_TORCH_NAME:
        raise InputError(f"meta tensor dtype {brief(dtype)} is not one ckptool knows — the file is corrupt or too new")
    shape, strides = _check_ints(size, "shape"), _check_ints(stride, "stride")
    if len(shape) != len(strides) or not isinstance(requires_grad, bool):
        raise InputError("a meta tensor's shape, stride or requires_grad is malformed — the file is corrupt")
    return opaque_type("torch._utils._rebuild_meta_tensor_no_storage")(dtype, shape, strides, requires_grad)


def _rebuild_device_tensor_from_cpu_tensor(data: Any, dtype: Any, device: Any, requires_grad: Any) -> TensorRef:
    """torch: ``data.to(dtype=dtype, device=device)``. The values are ``data``'s when the dtype is its own
    and the device the CPU (any other device or a conversion is refused: ckptool would have to
    reproduce torch's conversion)."""
    if not isinstance(data, TensorRef) or data.parameter is not None or data.subclass is not None:
        raise InputError("a device tensor wraps something that is not a tensor — the file is corrupt")
    if not isinstance(dtype, DTypeRef) or dtypes.BY_TORCH_NAME.get(dtype.name) != data.dtype:
        shown = f"torch.{dtype.name}" if isinstance(dtype, DTypeRef) else brief(dtype)
        raise InputError(f"a tensor is converted to {shown} on load; ckptool reads tensors as saved — refused")
    if device != "cpu" and not (isinstance(device, DeviceRef) and device.args == ("cpu",)):
        raise InputError(f"a tensor is moved to device {brief(device)} on load; ckptool reads CPU tensors "
                         "from this rebuild only — refused")
    if not isinstance(requires_grad, bool):
        raise InputError("a tensor's requires_grad is not a bool — the file is corrupt")
    data.requires_grad = requires_grad
    return data


def _codecs_encode(text: Any, encoding: Any = "utf-8") -> bytes:
    # protocol 2 spells bytes as _codecs.encode(latin1_text, "latin1"); nothing else is allowed
    if not isinstance(text, str) or encoding not in ("latin1", "latin-1"):
        raise InputError("pickle uses _codecs.encode other than for bytes — refused")
    return text.encode("latin1")


def _torch_device(*args: Any) -> DeviceRef:
    if not args or not all(isinstance(a, str | int) for a in args) or len(args) > 2:
        raise InputError(f"torch.device{brief(args)} is malformed — the file is corrupt")
    return DeviceRef(tuple(args))


def _torch_size(values: Any = ()) -> SizeRef:
    return SizeRef(_check_ints(values, "size"))


def _builtin_set(items: Any = ()) -> set:
    if not isinstance(items, list | tuple | set | frozenset):
        raise InputError("set built from something that is not a list — refused")
    _check_keys(items)
    return set(items)


def _builtin_bytearray(data: Any = b"") -> bytearray:
    if not isinstance(data, bytes | bytearray):
        raise InputError("bytearray built from something that is not bytes — refused")
    return bytearray(data)


def _builtin_complex(real: Any = 0.0, imag: Any = 0.0) -> complex:
    if not all(isinstance(v, int | float) and not isinstance(v, bool) for v in (real, imag)):
        raise InputError("complex built from something that is not a number — refused")
    return complex(real, imag)


class StateDict(OrderedDict):
    """The ``collections.OrderedDict`` a pickle builds (a state_dict), whose attributes a pickle cannot
    turn against its readers.

    torch's loader applies BUILD state to an OrderedDict as ``__dict__.update(state)``; torch.save
    writes one attribute that way, ``_metadata`` (module versions). An attribute named like a method
    (``items``, ``keys``, ``get``...) would shadow it for every reader that calls ``obj.items()`` —
    ckptool, json, other tools — while torch's own value is the mapping's real contents. Such state
    is refused; other attributes are kept as torch keeps them.
    """

    __slots__ = ()  # instances still have a __dict__ (OrderedDict's), which BUILD fills

    def __setstate__(self, state: Any) -> None:
        if not isinstance(state, dict):
            raise InputError(f"pickle sets the state of an OrderedDict to {brief(state)}, not a dict of "
                             "attributes — refused")
        for name in dict.keys(state):
            if type(name) is not str or hasattr(OrderedDict, name) or name.startswith("__"):
                raise InputError(f"pickle sets attribute {brief(name)} on an OrderedDict, hiding its own "
                                 "contents from readers (torch.save never writes that) — refused")
        self.__dict__.update(state)

    def __reduce__(self) -> Any:  # copy/deepcopy/pickle treat it as the OrderedDict it stands for
        state = dict(self.__dict__) or None
        return (OrderedDict, (), state, None, iter(dict.items(self)))


# shown as what the file holds (repr, inspect's entries, error messages): an OrderedDict
StateDict.__name__ = StateDict.__qualname__ = "OrderedDict"


def _ordered_dict(items: Any = ()) -> OrderedDict:
    if isinstance(items, list | tuple) and items:
        if not all(isinstance(item, tuple | list) and len(item) == 2 for item in items):
            raise InputError("OrderedDict built from something that is not key-value pairs — refused")
        _check_keys([key for key, _ in items])
    if isinstance(items, dict):
        items = list(dict.items(items))  # never through an attribute the pickle may have set
    return StateDict(items) if isinstance(items, list | tuple) and items else StateDict()


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
        "torch._tensor._rebuild_from_type_v2": _rebuild_from_type_v2,
        "torch._utils._rebuild_meta_tensor_no_storage": _rebuild_meta_tensor_no_storage,
        "torch._utils._rebuild_device_tensor_from_cpu_tensor": _rebuild_device_tensor_from_cpu_tensor,
        "torch.Tensor": TypeRef("torch", "Tensor"),
        "torch.storage.UntypedStorage": StorageTypeRef("torch.storage", "UntypedStorage", dtypes.BY_NAME["U8"]),
        "torch.UntypedStorage": StorageTypeRef("torch", "UntypedStorage", dtypes.BY_NAME["U8"]),
    }
    for storage_class, dtype in dtypes.BY_STORAGE_CLASS.items():
        table[f"torch.{storage_class}"] = StorageTypeRef("torch", storage_class, dtype)
        # what files saved from a GPU named their storages before typed storages lost their device;
        # torch reads them by dtype alone (the location tag says where the bytes were)
        table[f"torch.cuda.{storage_class}"] = StorageTypeRef("torch.cuda", storage_class, dtype)
    for torch_name in (*dtypes.BY_TORCH_NAME, *dtypes.VALUE_ONLY_TORCH_NAMES):
        table[f"torch.{torch_name}"] = DTypeRef("torch", torch_name)
    for value in table.values():
        if callable(value) and not isinstance(value, type):
            # BUILD on a function would set its __defaults__ for every later load in this process
            value.__setstate__ = _refuse_build
    return table


# Globals torch's own weights_only unpickler allows, mapped to inert placeholders.
TORCH_GLOBALS: dict[str, Any] = _build_torch_globals()

# Sparse and nested tensors, and the layouts they name: placeholders of their rebuild calls, which
# ckptool.layouts (built on OpaqueObject above) adds to TORCH_GLOBALS as it is imported.
from . import layouts as _layouts  # noqa: E402, F401

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


def _py2_modules() -> frozenset[str]:
    import _compat_pickle

    return frozenset(_compat_pickle.IMPORT_MAPPING) | frozenset(module for module, _ in _compat_pickle.NAME_MAPPING)


_PY2_MODULES = _py2_modules()


def python3_name(full_name: str) -> str:
    """A global as Python 3 names it: protocol-2 pickles (torch.save's) name ``__builtin__.set``,
    ``copy_reg._reconstructor``...; pickle's own compatibility table (``_compat_pickle``, which
    torch's weights_only loader applies too) maps them before any allowlist is consulted."""
    module, _, name = full_name.rpartition(".")
    if module not in _PY2_MODULES:
        return full_name
    return ".".join(_python3(module, name))


def _python3(module: str, name: str) -> tuple[str, str]:
    import _compat_pickle

    mapped = _compat_pickle.NAME_MAPPING.get((module, name))
    if mapped is not None:
        return mapped
    return _compat_pickle.IMPORT_MAPPING.get(module, module), name


class GlobalResolver:
    """Maps a pickle's ``module.name`` to a placeholder, or refuses it.

    Args:
        allow_globals: extra names to accept as :class:`OpaqueObject` placeholders.
        permissive: scan mode — record every global and return a harmless placeholder for all.
    """

    def __init__(self, allow_globals: tuple[str, ...] | list[str] = (), *, permissive: bool = False) -> None:
        self.extra = set(DEFAULT_EXTRA_GLOBALS) | {python3_name(name) for name in allow_globals}
        self.permissive = permissive
        self.seen: dict[str, int] = {}
        self.refused: list[str] = []

    def is_allowed(self, full_name: str) -> bool:
        full_name = python3_name(full_name)
        return full_name in TORCH_GLOBALS or full_name in self.extra

    def resolve(self, module: str, name: str) -> Any:
        full_name = f"{module}.{name}"
        self.seen[full_name] = self.seen.get(full_name, 0) + 1  # as the file names it
        if module in _PY2_MODULES:
            module, name = _python3(module, name)
            full_name = f"{module}.{name}"
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
    """Unpickle ``data`` through ``resolver``; errors surface as RefusedGlobal or InputError.

    ``data`` is one whole pickle (bytes after its STOP are refused), or a stream positioned at a
    pickle, which is left just after that pickle's STOP. Before the C unpickler runs, :func:`guard`
    walks the opcodes once and refuses what would make it hang or exhaust memory; after, the
    object tree's nesting and sharing are checked (:func:`check_tree`).
    """
    if isinstance(data, bytes | bytearray | memoryview):
        blob = bytes(data)
        if len(blob) > MAX_PICKLE_BYTES:
            raise InputError(f"pickle is {len(blob)} bytes, over the {MAX_PICKLE_BYTES}-byte limit — refused")
        # a write's check re-reads the pickle it just emitted: those bytes need no guard
        size = len(blob) if blob in _EMITTED else guard(blob)
        if size != len(blob):
            raise InputError(f"pickle is followed by {len(blob) - size} bytes after its end (STOP) — "
                             "torch never writes that; refused")
    else:
        blob = read_pickle(data)
    try:
        obj = RestrictedUnpickler(io.BytesIO(blob), resolver, persistent_load).load()
    except (RefusedGlobal, InputError):
        raise
    except RecursionError as e:
        raise InputError("pickle is nested too deeply to read safely") from e
    except MemoryError as e:
        raise InputError("pickle would need more memory than is available to read") from e
    except Exception as e:  # any malformed-pickle error from the C unpickler
        raise InputError(f"pickle is corrupt or truncated ({type(e).__name__}: {_short(e)})") from e
    check_tree(obj, source_bytes=len(blob))
    return obj


def _short(error: BaseException) -> str:
    text = str(error).splitlines()[0] if str(error) else ""
    return text[:160]


# ---------------------------------------------------------------------------------------------
# the guard: what the C unpickler would do, in one linear pass, before it does it
#
# find_class keeps every callable inert, but the C unpickler itself can still be made to hang or
# to allocate without bound by a few bytes of opcodes: hashing a dict key that is a tuple of
# tuples shared through the memo (2**60 steps), keys whose hashes all collide (quadratic), a
# PUT at memo index 2**32 (a 64 GiB memo table), or BUILD setting attributes on a placeholder
# after it was validated. The guard mirrors the unpickler's stack and memo with small records of
# what each value is, and refuses those pickles; it never builds the values themselves.


class _Truncated(InputError):
    """The pickle runs past the end of the bytes given (the stream reader then reads more)."""

    def __init__(self, message: str = "pickle is truncated (it ends before its STOP opcode)", *,
                 path: object = None) -> None:
        super().__init__(message, path=path)  # type: ignore[arg-type]


_OPAQUE_VALUE = object()  # the guard does not know the value (salted hash, or not hashable)

# The guard's record of one stack or memo value (never the value itself), a tuple for speed:
#   (kind, name, nodes, hashable, value)
# kind: "str", "literal", "bytes", "tuple", "global", "object", "container", "other";
# name: a str's raw bytes (≤ 256) or the global a global/object came from; nodes: what hashing it
# visits (tuples: every element, recursively); value: ints, floats, None and tuples of them — hashes
# a pickle can predict. Records that can receive items (dicts, sets, lists, objects) are lists with
# a sixth slot: their predictable keys by hash (to catch collision floods); each is its own list.
_KIND, _NAME, _NODES, _HASHABLE, _VALUE, _BUCKETS = range(6)
_STR = ("str", None, 1, True, _OPAQUE_VALUE)
_BYTES = ("bytes", None, 1, True, _OPAQUE_VALUE)
_OTHER = ("other", None, 1, False, _OPAQUE_VALUE)
_LIST = ("list", None, 1, False, _OPAQUE_VALUE)  # lists take APPENDs, never keys: no buckets to keep
_EMPTY_TUPLE = ("tuple", None, 1, True, ())
_UNKNOWN_GLOBAL = ("global", None, 1, True, _OPAQUE_VALUE)
_NONE, _TRUE, _FALSE = (("literal", None, 1, True, value) for value in (None, True, False))
_BYTE_INTS = [("literal", None, 1, True, value) for value in range(256)]
_PLACEHOLDER_COST = 512  # a TensorRef, StorageRef or OpaqueObject record
_CANONICAL_INT = re.compile(rb"-?(0|[1-9][0-9]*)")
_DIGITS = re.compile(rb"[0-9]+")
_MAX_TEXT_NAME = 256  # longer strings are never a global's module or name


def _refuse(message: str) -> InputError:
    return InputError(f"pickle {message} — refused, nothing was executed")


class PickleStats:
    """What :func:`guard` saw in one pickle: its length, opcode counts and the globals it names.

    ``globals`` lists GLOBAL/INST names and STACK_GLOBAL names whose strings are known (resolved
    through the memo as the unpickler would); ``<unresolved STACK_GLOBAL>`` otherwise.
    """

    __slots__ = ("size", "counts", "globals")

    def __init__(self, size: int, counts: list[int], globals_: list[str]) -> None:
        self.size, self.counts, self.globals = size, counts, globals_

    def opcode_names(self) -> dict[str, int]:
        """Opcode counts by pickletools name."""
        import pickletools

        names = {op.code.encode("latin1")[0]: op.name for op in pickletools.opcodes}
        return {names.get(code, f"0x{code:02x}"): count for code, count in enumerate(self.counts) if count}


# Guarded pickles, by their exact bytes (a command often reads one pickle twice: scan lists it and
# then loads it; a write re-reads what it wrote). Only pickles the guard passed are kept.
_GUARDED: dict[bytes, PickleStats] = {}
_GUARDED_KEEP = 4
# Pickles :func:`dump` wrote in this process (it emits only what torch's weights_only loader reads,
# from an object tree that was itself checked): re-reading one of them exactly needs no guard.
_EMITTED: dict[bytes, None] = {}


def guard(data: bytes) -> int:
    """Walk one pickle's opcodes as the unpickler would, refusing what would hang it or blow it up.

    Returns the pickle's length (up to and including STOP); raises :class:`_Truncated` if ``data``
    ends first. Refused: BUILD on anything but an OrderedDict or an allowed object placeholder;
    dict keys and set elements that are not plain hashable values, nest over MAX_KEY_NODES values,
    cost more hashing in all than the pickle's length allows, or collide (over MAX_HASH_COLLISIONS
    distinct keys with one hash in one dict); memo indices no pickler writes; over
    MAX_UNPICKLED_BYTES of objects (estimated). Arguments must be in the form Python's pickler
    writes them (``INT 010`` is 8 to the C unpickler and 10 to Python's ``int``: refused).
    """
    return guard_stats(data).size


def guard_stats(data: bytes) -> PickleStats:
    """:func:`guard`, returning what it saw (:class:`PickleStats`); a pickle seen before is not walked again."""
    stats = _GUARDED.get(data)
    if stats is not None:
        return stats
    counts = [0] * 256
    names: list[str] = []
    stats = PickleStats(_guard(data, counts, names), counts, names)
    if len(_GUARDED) >= _GUARDED_KEEP:
        del _GUARDED[next(iter(_GUARDED))]
    _GUARDED[data if stats.size == len(data) else data[:stats.size]] = stats
    return stats


def _new_tuple(items: list) -> tuple:
    nodes = 1
    hashable = predictable = True
    for item in items:
        nodes += item[2]
        if not item[3]:
            hashable = False
        elif item[4] is _OPAQUE_VALUE:
            predictable = False
    value = tuple([item[4] for item in items]) if predictable and hashable else _OPAQUE_VALUE
    return ("tuple", None, nodes if nodes <= MAX_KEY_NODES else MAX_KEY_NODES + 1, hashable, value)


def _made_by(callable_: tuple | list) -> list:
    """The record of an object a callable builds (REDUCE, NEWOBJ, OBJ): it may receive items."""
    name = callable_[1] if callable_[0] == "global" else None
    # a placeholder object hashes by identity; _codecs.encode gives bytes (salted hash)
    return ["object", name, 1, name is not None and (name == "_codecs.encode" or name not in TORCH_GLOBALS),
            _OPAQUE_VALUE, None]


def _text_name(raw: bytes | None) -> str | None:
    if raw is None or len(raw) > _MAX_TEXT_NAME:
        return None
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return None


def _guard(data: bytes, counts: list[int], names: list[str]) -> int:
    end = len(data)
    stack: list = []
    push = stack.append
    marks: list[int] = []
    memo: dict[int, Any] = {}
    fence = 0
    ops = hashing = memory = 0
    i = 0

    def pop_mark() -> list:
        nonlocal fence
        if not marks:
            raise _refuse("has no MARK where one is needed (corrupt)")
        index = marks.pop()
        fence = marks[-1] if marks else 0
        items = stack[index:]
        del stack[index:]
        return items

    def line() -> bytes:
        nonlocal i
        newline = data.find(b"\n", i)
        if newline < 0:
            raise _Truncated()
        text, i = data[i:newline], newline + 1
        return text

    def add_keys(target: Any, keys: list) -> None:
        nonlocal hashing
        if target[0] != "container" and target[0] != "object":
            raise _refuse(f"adds items to a {target[0]}, which holds none (corrupt)")
        for key in keys:
            if not key[3]:
                raise _refuse(f"uses a {key[0]} {key[1] or ''} as a dict key or set element")
            if key[2] > MAX_KEY_NODES:
                raise _refuse(f"uses a dict key or set element of {key[2]}+ nested values (a hashing bomb)")
            hashing += key[2]
            value = key[4]
            if value is not _OPAQUE_VALUE:
                if target[5] is None:
                    target[5] = {}
                bucket = target[5].setdefault(hash(value), set())
                bucket.add(value)
                if len(bucket) > MAX_HASH_COLLISIONS:
                    raise _refuse(f"puts {len(bucket)} distinct keys with one hash into a dict or set "
                                  "(a hash-collision flood)")
        if hashing > 8 * ops + 100_000:
            raise _refuse("hashes more nested keys than its size allows (a hashing bomb)")

    def counted(width: int, signed: bool = False) -> int:
        nonlocal i
        size = int.from_bytes(data[i:i + width], "little", signed=signed)
        i += width
        if size < 0:
            raise _refuse(f"has a negative length {size} at offset {i - width} (corrupt)")
        if i + size > MAX_PICKLE_BYTES:
            raise _refuse(f"has a {size}-byte value, over the {MAX_PICKLE_BYTES}-byte pickle limit")
        if i + size > end:
            raise _Truncated()
        return size

    def literal(value: Any) -> tuple:
        return ("literal", None, 1, True, value)

    # The branches are ordered by how often torch's pickles use them (a state_dict entry is ~30
    # opcodes: BINPUT/LONG_BINPUT, BINGET, BININT1, MARK, BINUNICODE, TUPLE*, REDUCE, BINPERSID...).
    try:
        while True:
            code = data[i]  # IndexError past the end: truncated
            i += 1
            ops += 1
            counts[code] += 1
            if code == 0x71 or code == 0x72:  # BINPUT LONG_BINPUT
                if code == 0x71:
                    index = data[i]
                    i += 1
                else:
                    index = int.from_bytes(data[i:i + 4], "little")
                    i += 4
                    if i > end:
                        raise _Truncated()
                if index > ops:
                    raise _refuse(f"stores memo index {index}, which no pickler writes (a memory bomb)")
                if len(stack) <= fence:
                    raise _refuse("stores a value below its stack (corrupt)")
                memo[index] = stack[-1]
                memory += 16
            elif code == 0x68:  # BINGET
                value = memo.get(data[i])
                if value is None:
                    raise _refuse(f"reads memo index {data[i]}, which was never stored (corrupt)")
                i += 1
                push(value)
                memory += 8
            elif code == 0x4B:  # BININT1
                push(_BYTE_INTS[data[i]])
                i += 1
            elif code == 0x28:  # MARK
                fence = len(stack)
                marks.append(fence)
                memory += 8
            elif code == 0x58 or code == 0x8C:  # BINUNICODE SHORT_BINUNICODE
                if code == 0x58:
                    size = int.from_bytes(data[i:i + 4], "little")
                    i += 4
                else:
                    size = data[i]
                    i += 1
                if i + size > end:
                    if i + size > MAX_PICKLE_BYTES:
                        raise _refuse(f"has a {size}-byte value, over the {MAX_PICKLE_BYTES}-byte pickle limit")
                    raise _Truncated()
                push(("str", data[i:i + size], 1, True, _OPAQUE_VALUE) if size <= _MAX_TEXT_NAME else _STR)
                i += size
                memory += 56 + size
            elif code == 0x85 or code == 0x86 or code == 0x87:  # TUPLE1 TUPLE2 TUPLE3
                count = code - 0x84
                if len(stack) - count < fence:
                    raise _refuse("builds a tuple from below its stack (corrupt)")
                items = stack[-count:]
                del stack[-count:]
                push(_new_tuple(items))
                memory += 56 + 8 * count
            elif code == 0x74:  # TUPLE
                if not marks:
                    raise _refuse("has no MARK where one is needed (corrupt)")
                index = marks.pop()
                fence = marks[-1] if marks else 0
                items = stack[index:]
                del stack[index:]
                push(_new_tuple(items) if items else _EMPTY_TUPLE)
                memory += 56 + 8 * len(items)
            elif code == 0x52 or code == 0x81 or code == 0x92:  # REDUCE NEWOBJ NEWOBJ_EX
                count = 3 if code == 0x92 else 2
                if len(stack) - count < fence:
                    raise _refuse("calls with too few values on its stack (corrupt)")
                callable_ = stack[-count]
                del stack[-count:]
                push(_made_by(callable_))
                memory += _PLACEHOLDER_COST
            elif code == 0x51:  # BINPERSID
                if len(stack) <= fence:
                    raise _refuse("has BINPERSID without an id (corrupt)")
                stack[-1] = _OTHER
                memory += _PLACEHOLDER_COST
            elif code == 0x89 or code == 0x88 or code == 0x4E:  # NEWFALSE NEWTRUE NONE
                push(_FALSE if code == 0x89 else _TRUE if code == 0x88 else _NONE)
                memory += 8
            elif code == 0x29:  # EMPTY_TUPLE
                push(_EMPTY_TUPLE)
            elif code == 0x94:  # MEMOIZE
                if len(stack) <= fence:
                    raise _refuse("stores a value below its stack (corrupt)")
                memo[len(memo)] = stack[-1]
                memory += 16
            elif code == 0x6A or code == 0x67:  # LONG_BINGET GET
                if code == 0x6A:
                    index = int.from_bytes(data[i:i + 4], "little")
                    i += 4
                    if i > end:
                        raise _Truncated()
                else:
                    raw = line()
                    index = int(raw) if _DIGITS.fullmatch(raw) else -1
                value = memo.get(index)
                if value is None:
                    raise _refuse(f"reads memo index {index}, which was never stored (corrupt)")
                push(value)
                memory += 8
            elif code == 0x70:  # PUT
                raw = line()
                if not _DIGITS.fullmatch(raw):
                    raise _refuse(f"has a malformed PUT index {raw[:20]!r}")
                index = int(raw)
                if index > ops:
                    raise _refuse(f"stores memo index {index}, which no pickler writes (a memory bomb)")
                if len(stack) <= fence:
                    raise _refuse("stores a value below its stack (corrupt)")
                memo[index] = stack[-1]
                memory += 16
            elif code == 0x8D:  # BINUNICODE8
                size = counted(8)
                push(("str", data[i:i + size], 1, True, _OPAQUE_VALUE) if size <= _MAX_TEXT_NAME else _STR)
                i += size
                memory += 56 + size
            elif code == 0x4D or code == 0x4A:  # BININT2 BININT
                width = 2 if code == 0x4D else 4
                if i + width > end:
                    raise _Truncated()
                push(literal(int.from_bytes(data[i:i + width], "little", signed=code == 0x4A)))
                i += width
                memory += 40
            elif code == 0x62:  # BUILD
                if len(stack) - 2 < fence:
                    raise _refuse("sets state with too few values on its stack (corrupt)")
                stack.pop()
                target = stack[-1]
                if target[0] != "object" or target[1] is None or \
                        (target[1] in TORCH_GLOBALS and target[1] != "collections.OrderedDict"):
                    raise _refuse(f"sets state (BUILD) on {target[1] or 'a ' + target[0]}, "
                                  "which torch's loader never does")
                memory += 64
            elif code == 0x5D:  # EMPTY_LIST: takes no keys, so one shared record serves every list
                push(_LIST)
                memory += 88  # the list, its GC header and the slot that holds it
            elif code == 0x7D or code == 0x8F:  # EMPTY_DICT EMPTY_SET: a record of their own (key buckets)
                push(["container", None, 1, False, _OPAQUE_VALUE, None])
                memory += 360 if code == 0x8F else 240  # the object with its GC header, and the guard's record
            elif code == 0x75 or code == 0x73 or code == 0x90:  # SETITEMS SETITEM ADDITEMS
                if code == 0x73:
                    if len(stack) - 2 < fence:
                        raise _refuse("has SETITEM without a key and value (corrupt)")
                    keys = [stack[-2]]
                    del stack[-2:]
                else:
                    items = pop_mark()
                    if code == 0x75 and len(items) % 2:
                        raise _refuse("has an odd number of items for SETITEMS (corrupt)")
                    keys = items[::2] if code == 0x75 else items
                if len(stack) <= fence:
                    raise _refuse("adds items with no dict or set below them (corrupt)")
                add_keys(stack[-1], keys)
                memory += 100 * len(keys)
            elif code == 0x61 or code == 0x65:  # APPEND APPENDS
                if code == 0x61:
                    if len(stack) - 1 <= fence:
                        raise _refuse("has APPEND without a list (corrupt)")
                    stack.pop()
                    memory += 16
                else:
                    memory += 16 * len(pop_mark())
                    if len(stack) <= fence:
                        raise _refuse("has APPENDS without a list (corrupt)")
            elif code == 0x63 or code == 0x69:  # GLOBAL INST
                module, attribute = line(), line()
                try:
                    full_name = f"{module.decode('utf-8')}.{attribute.decode('utf-8')}"
                except UnicodeDecodeError:
                    raise _refuse("names a global that is not UTF-8") from None
                names.append(full_name)
                if code == 0x69:
                    pop_mark()
                    push(["object", full_name, 1, full_name not in TORCH_GLOBALS, _OPAQUE_VALUE, None])
                    memory += _PLACEHOLDER_COST
                else:
                    push(("global", full_name, 1, True, _OPAQUE_VALUE))
            elif code == 0x93:  # STACK_GLOBAL
                if len(stack) - 2 < fence:
                    raise _refuse("has STACK_GLOBAL without a module and name (corrupt)")
                module, attribute = stack[-2], stack[-1]
                del stack[-2:]
                module_name = _text_name(module[1]) if module[0] == "str" else None
                attribute_name = _text_name(attribute[1]) if attribute[0] == "str" else None
                known = module_name is not None and attribute_name is not None
                full_name = f"{module_name}.{attribute_name}" if known else None
                names.append(full_name or "<unresolved STACK_GLOBAL>")
                push(("global", full_name, 1, True, _OPAQUE_VALUE))
            elif code == 0x6F:  # OBJ
                items = pop_mark()
                if not items:
                    raise _refuse("has OBJ without a class (corrupt)")
                push(_made_by(items[0]))
                memory += _PLACEHOLDER_COST
            elif code == 0x64 or code == 0x91 or code == 0x6C:  # DICT FROZENSET LIST
                items = pop_mark()
                container = _LIST if code == 0x6C else ["container", None, 1, False, _OPAQUE_VALUE, None]
                if code == 0x64:
                    if len(items) % 2:
                        raise _refuse("has an odd number of items for DICT (corrupt)")
                    add_keys(container, items[::2])
                elif code == 0x91:
                    add_keys(container, items)
                push(container)
                memory += 216 + 100 * len(items)
            elif code == 0x30:  # POP
                if marks and marks[-1] == len(stack):
                    marks.pop()
                    fence = marks[-1] if marks else 0
                elif len(stack) <= fence:
                    raise _refuse("pops below its stack (corrupt)")
                else:
                    stack.pop()
            elif code == 0x31:  # POP_MARK
                pop_mark()
            elif code == 0x32:  # DUP
                if len(stack) <= fence:
                    raise _refuse("has DUP on an empty stack (corrupt)")
                push(stack[-1])
                memory += 8
            elif code == 0x2E:  # STOP
                if len(stack) <= fence:
                    raise _refuse("stops with nothing on its stack (corrupt)")
                break
            elif code == 0x80 or code == 0x95:  # PROTO FRAME: nothing to check
                i += 1 if code == 0x80 else 8
                if i > end:
                    raise _Truncated()
            elif code == 0x47:  # BINFLOAT
                if i + 8 > end:
                    raise _Truncated()
                push(literal(struct.unpack(">d", data[i:i + 8])[0]))
                i += 8
                memory += 32
            elif code == 0x8A or code == 0x8B:  # LONG1 LONG4
                size = counted(1 if code == 0x8A else 4, signed=code == 0x8B)
                push(literal(int.from_bytes(data[i:i + size], "little", signed=True)))
                i += size
                memory += 32 + size
            elif code == 0x49 or code == 0x4C:  # INT LONG (text)
                raw = line()
                if code == 0x4C and raw.endswith(b"L"):
                    raw = raw[:-1]
                if code == 0x49 and raw in (b"00", b"01"):
                    value = raw == b"01"
                elif _CANONICAL_INT.fullmatch(raw) and len(raw) <= 4300:
                    value = int(raw)
                else:
                    raise _refuse(f"has an integer {raw[:20]!r} not written the way Python's pickler writes it")
                push(literal(value))
                memory += 32 + len(raw)
            elif code == 0x46:  # FLOAT (text)
                raw = line()
                try:
                    value = float(raw)
                except ValueError:
                    raise _refuse(f"has a malformed float {raw[:20]!r}") from None
                push(literal(value))
                memory += 32
            elif code in (0x42, 0x43, 0x8E, 0x96, 0x54, 0x55):  # BINBYTES SHORT_BINBYTES BINBYTES8 BYTEARRAY8
                # BINSTRING SHORT_BINSTRING (py2 str, decoded as UTF-8 here)
                width = {0x42: 4, 0x43: 1, 0x8E: 8, 0x96: 8, 0x54: 4, 0x55: 1}[code]
                size = counted(width, signed=code == 0x54)
                if code in (0x54, 0x55):
                    push(("str", data[i:i + size], 1, True, _OPAQUE_VALUE) if size <= _MAX_TEXT_NAME else _STR)
                else:
                    push(_BYTES if code != 0x96 else ["container", None, 1, False, _OPAQUE_VALUE, None])
                i += size
                memory += 56 + size
            elif code == 0x53 or code == 0x56:  # STRING UNICODE (text)
                raw = line()
                if code == 0x53:
                    quoted = len(raw) >= 2 and raw[0] == raw[-1] and raw[:1] in (b"'", b'"')
                    push(("str", raw[1:-1], 1, True, _OPAQUE_VALUE) if quoted and b"\\" not in raw else _STR)
                else:
                    push(("str", raw, 1, True, _OPAQUE_VALUE) if b"\\" not in raw else _STR)
                memory += 56 + len(raw)
            elif code == 0x50:  # PERSID
                line()
                push(_OTHER)
                memory += _PLACEHOLDER_COST
            elif code in (0x82, 0x83, 0x84):  # EXT1 EXT2 EXT4
                i += {0x82: 1, 0x83: 2, 0x84: 4}[code]
                if i > end:
                    raise _Truncated()
                push(_UNKNOWN_GLOBAL)
            elif code == 0x98:  # READONLY_BUFFER
                if len(stack) <= fence:
                    raise _refuse("has READONLY_BUFFER on an empty stack (corrupt)")
            else:  # NEXT_BUFFER (out-of-band data a file cannot carry) and bytes that are no opcode
                raise _refuse(f"has byte 0x{code:02x} at offset {i - 1}, which is not an opcode ckptool reads")
            if memory > MAX_UNPICKLED_BYTES:
                raise _refuse(f"would build over {MAX_UNPICKLED_BYTES} bytes of objects (a memory bomb)")
    except IndexError:
        raise _Truncated() from None
    except struct.error:
        raise _Truncated() from None
    return i


def read_pickle(stream: Any) -> bytes:
    """Read the one pickle at ``stream``'s position (checked by :func:`guard`); leave the stream after it."""
    start = stream.tell()
    chunk = 1 << 20
    while True:
        stream.seek(start)
        blob = stream.read(chunk)
        try:
            size = guard(blob)
        except _Truncated:
            if len(blob) < chunk:
                raise
            if chunk > MAX_PICKLE_BYTES:
                raise InputError(f"pickle is over the {MAX_PICKLE_BYTES}-byte limit — refused") from None
            chunk = min(chunk * 4, MAX_PICKLE_BYTES + 1)
            continue
        stream.seek(start + size)
        return blob[:size]


def _key_nodes(key: Any) -> tuple[int, bool]:
    """What hashing ``key`` visits (tuples expanded, counted once per path) and whether its hash is predictable."""
    memo: dict[int, tuple[int, bool]] = {}
    stack: list[tuple[Any, bool]] = [(key, False)]
    while stack:
        node, done = stack.pop()
        if type(node) is not tuple and not isinstance(node, tuple):
            memo[id(node)] = (1, type(node) in (int, float, bool, type(None)))
            continue
        if not done:
            stack.append((node, True))
            stack.extend((item, False) for item in node if id(item) not in memo)
            continue
        nodes, predictable = 1, True
        for item in node:
            item_nodes, item_predictable = memo[id(item)]
            nodes += item_nodes
            predictable = predictable and item_predictable
        memo[id(node)] = (min(nodes, MAX_KEY_NODES + 1), predictable)
        if nodes > MAX_KEY_NODES:
            return nodes, predictable
    return memo[id(key)]


def _check_keys(keys: Any) -> None:
    """The guard's key rules for keys an allowlisted callable hashes (``set(items)``, ``OrderedDict(pairs)``)."""
    buckets: dict[int, set] = {}
    hashing = 0
    for key in keys:
        nodes, predictable = _key_nodes(key)
        if nodes > MAX_KEY_NODES:
            raise _refuse(f"uses a dict key or set element of {nodes}+ nested values (a hashing bomb)")
        hashing += nodes
        if predictable:
            bucket = buckets.setdefault(hash(key), set())
            bucket.add(key)
            if len(bucket) > MAX_HASH_COLLISIONS:
                raise _refuse(f"puts {len(bucket)} distinct keys with one hash into a set (a hash-collision flood)")
    if hashing > 8 * len(keys) + 100_000:
        raise _refuse("hashes more nested keys than its size allows (a hashing bomb)")


_ATOMS = frozenset({str, bytes, int, float, bool, type(None)})  # leaves of every tree
_TEXT = frozenset({str, bytes, bytearray})  # leaves a copy (json, repr, a header) costs their length
_EMPTYABLE = frozenset({list, dict, tuple, set, frozenset})  # empty ones are leaves too


def _tree_children(obj: Any) -> list[Any]:
    if type(obj) is TensorRef:
        if obj.extra == () and not obj.backward_hooks and obj.parameter is None and obj.subclass is None:
            return []  # the usual tensor: a leaf
        return [obj.extra, obj.backward_hooks, *(obj.parameter[1:] if obj.parameter else ()),
                *(obj.subclass[1:] if obj.subclass else ())]
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


def check_tree(root: Any, *, source_bytes: int = 0) -> None:
    """Refuse an unpickled tree nested over MAX_NESTING deep, or whose shared references would expand
    it when copied by a naive walk (json, repr, str, a safetensors header): past MAX_EXPANDED_NODES
    objects (and 16-fold), or past MAX_EXPANDED_TEXT bytes of strings (and 16 times ``source_bytes``,
    the pickle's length) — one 8 MiB string referenced 300 times is 2.4 GiB once json writes it.

    Atoms and empty containers are counted where they are referenced, never visited: a list of 10
    million empty lists costs one pass over it, not a record per list."""
    done: dict[int, tuple[int, int, int]] = {}  # id -> (height, expanded objects, expanded text bytes)
    on_path: set[int] = set()
    edges = 0
    text_limit = max(MAX_EXPANDED_TEXT, 16 * source_bytes)
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
            stack.extend((kid, None) for kid in kids
                         if type(kid) not in _ATOMS and (kid or type(kid) not in _EMPTYABLE)
                         and id(kid) not in done and id(kid) not in on_path)
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
            if entry is None:  # an empty container, or a cycle back to an ancestor: a leaf
                size += 1
                continue
            if entry[0] >= height:
                height = entry[0] + 1
            size += entry[1]
            text += entry[2]
        if height > MAX_NESTING:
            raise _refuse(f"nests its objects over {MAX_NESTING} levels deep")
        if size > MAX_EXPANDED_NODES and size > 16 * (edges + 1):
            raise _refuse(f"shares sub-objects so that walking it visits over {MAX_EXPANDED_NODES} objects "
                          "(a memo expansion bomb)")
        if text > text_limit:
            raise _refuse(f"shares strings so that copying it (JSON, repr, a header) writes over {human_size(text_limit)} "
                          "(a memo expansion bomb)")
        done[key] = (height, min(size, MAX_EXPANDED_NODES + 1), min(text, text_limit + 1))


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
            self.global_("collections.OrderedDict")
            self.write(_P.EMPTY_TUPLE + _P.REDUCE)
            self._put(obj)
            self._setitems(list(dict.items(obj)))
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

    @staticmethod
    def _tensor_args(tensor: TensorRef) -> tuple:
        args: list[Any] = [tensor.storage, tensor.offset, tuple(tensor.shape), tuple(tensor.stride)]
        if tensor.rebuild != "torch._utils._rebuild_tensor":
            hooks = tensor.backward_hooks if tensor.backward_hooks is not None else OrderedDict()
            args += [tensor.requires_grad, hooks]
        if tensor.rebuild == "torch._utils._rebuild_tensor_v3":
            args.append(DTypeRef("torch", tensor.dtype.torch_name))
        return tuple(args + list(tensor.extra))

    def _opaque(self, obj: OpaqueObject) -> None:
        self.global_(obj._global)
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
    blob = emitter.out.getvalue()
    if len(_EMITTED) >= _GUARDED_KEEP:
        del _EMITTED[next(iter(_EMITTED))]
    _EMITTED[blob] = None
    return blob, list(emitter.storages.values())
