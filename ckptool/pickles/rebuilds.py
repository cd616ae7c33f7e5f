"""What the allowlisted callables do instead of running: check their arguments and build records.

``torch._utils._rebuild_tensor_v2(storage, offset, size, stride, ...)`` becomes a
:class:`~ckptool.tensors.refs.TensorRef` after every argument is checked to be what ``torch.save`` writes;
``collections.OrderedDict`` a :class:`~ckptool.pickles.placeholders.StateDict`; ``builtins.set``,
``torch.Size``, ``torch.device``... records or plain values. Anything else a rebuild is handed is
refused. :mod:`ckptool.pickles.allowlist` maps the globals to these functions.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from typing import Any

from ckptool.base.errors import InputError
from ckptool.pickles import limits
from ckptool.pickles.limits import brief, refuse
from ckptool.pickles.placeholders import OpaqueObject, StateDict, TypeRef, opaque_type
from ckptool.tensors import dtypes
from ckptool.tensors.dtypes import DType
from ckptool.tensors.refs import DeviceRef, DTypeRef, SizeRef, StorageRef, TensorRef, bits_supported

_INT64_MAX = (1 << 63) - 1
_PLAIN_DTYPES = frozenset(dtypes.BY_NAME)  # the dtypes a plain rebuild reads (not quantized ones)


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
        raise InputError(
            f"a tensor is rebuilt with {len(extra)} arguments after its hooks; torch takes one "
            "(metadata) — the file is corrupt"
        )
    metadata = extra[0] if extra else None
    if not metadata:
        return False, False  # torch ignores a falsy metadata (None, {})
    if not isinstance(metadata, dict):
        raise InputError(f"a tensor's metadata is {brief(metadata)}, not a dict — the file is corrupt")
    bits = {"conj": False, "neg": False}
    for key, value in dict.items(metadata):
        if key not in bits:
            raise InputError(
                f"a tensor's metadata sets {brief(key)}, which ckptool does not know how to apply "
                "(it knows conj and neg) — the file may come from a newer torch; refused"
            )
        if value is not True:
            # torch.save writes only True entries; torch sets the bit for any entry, False included
            # (it reads the key, not the value), which other torch versions need not do
            raise InputError(
                f"a tensor's metadata {key!r} is {brief(value)}, not True — torch.save never "
                "writes that, and torch versions read it differently; refused"
            )
        bits[key] = True
    if "conj" in metadata and not dtype.name.startswith("C"):
        # torch asserts on any conj entry (even False) for a non-complex tensor
        raise InputError(
            f"a {dtype.torch_name} tensor's metadata sets its conjugate bit, which only complex "
            "tensors have — the file is corrupt"
        )
    problem = bits_supported(dtype, conj=bits["conj"], neg=bits["neg"])
    if problem is not None:
        raise InputError(f"a tensor carries {problem}; its values cannot be read exactly — refused")
    return bits["conj"], bits["neg"]


def _make_tensor(
    rebuild: str,
    storage: Any,
    offset: Any,
    size: Any,
    stride: Any,
    requires_grad: Any = False,
    backward_hooks: Any = None,
    dtype: DType | None = None,
    extra: tuple = (),
) -> TensorRef:
    if not isinstance(storage, StorageRef):
        raise InputError("a tensor's storage is not a saved storage record — the file is corrupt or not a checkpoint")
    if not isinstance(requires_grad, bool):
        raise InputError("a tensor's requires_grad is not a bool — the file is corrupt")
    dtype = dtype or storage.dtype
    if dtype.name not in dtypes.BY_NAME:  # a quantized storage: torch builds its tensors by _rebuild_qtensor only
        raise InputError(
            f"a plain tensor rebuild reads a {dtype.torch_name} storage — refused; torch.save writes "
            "quantized tensors with _rebuild_qtensor"
        )
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


_V2 = "torch._utils._rebuild_tensor_v2"


def _rebuild_tensor_v2(
    storage: Any,
    offset: Any,
    size: Any,
    stride: Any,
    requires_grad: Any = False,
    backward_hooks: Any = None,
    *extra: Any,
) -> TensorRef:
    if (
        not extra
        and type(storage) is StorageRef
        and type(size) is tuple
        and type(stride) is tuple
        and type(offset) is int
        and (requires_grad is False or requires_grad is True)
    ):
        # the usual tensor, checked in one pass: every check of _make_tensor and TensorRef.validate,
        # the same record; anything they would refuse (or not take plainly) goes their way, for their message
        dtype = storage.dtype
        if len(size) == len(stride) <= 64 and 0 <= offset <= _INT64_MAX and dtype.name in _PLAIN_DTYPES:
            last = offset
            count = 1
            for dim, step in zip(size, stride):
                if (
                    type(dim) is not int
                    or type(step) is not int
                    or dim < 0
                    or step < 0
                    or dim > _INT64_MAX
                    or step > _INT64_MAX
                ):
                    break
                count *= dim
                last += (dim - 1) * step
            else:
                itemsize = dtype.itemsize
                if count <= _INT64_MAX and (count == 0 or (last + 1) * itemsize <= itemsize * storage.numel):
                    return TensorRef(storage, dtype, size, stride, offset, requires_grad, _V2, (), backward_hooks)
    return _make_tensor(
        "torch._utils._rebuild_tensor_v2", storage, offset, size, stride, requires_grad, backward_hooks, extra=extra
    )


def _rebuild_tensor(storage: Any, offset: Any, size: Any, stride: Any) -> TensorRef:
    return _make_tensor("torch._utils._rebuild_tensor", storage, offset, size, stride)


def _rebuild_tensor_v3(
    storage: Any, offset: Any, size: Any, stride: Any, requires_grad: Any, backward_hooks: Any, dtype: Any, *extra: Any
) -> TensorRef:
    if not isinstance(dtype, DTypeRef) or dtype.name not in dtypes.BY_TORCH_NAME:
        raise InputError(f"tensor dtype {brief(dtype)} is not one ckptool knows — the file is corrupt or too new")
    return _make_tensor(
        "torch._utils._rebuild_tensor_v3",
        storage,
        offset,
        size,
        stride,
        requires_grad,
        backward_hooks,
        dtype=dtypes.BY_TORCH_NAME[dtype.name],
        extra=extra,
    )


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
PARAMETER_DESCRIPTORS = frozenset(
    {
        "H",
        "T",
        "_backward_hooks",
        "_base",
        "_cdata",
        "_grad",
        "_grad_fn",
        "_has_symbolic_sizes_strides",
        "_post_accumulate_grad_hooks",
        "_python_dispatch",
        "_version",
        "data",
        "device",
        "dtype",
        "grad",
        "grad_dtype",
        "grad_fn",
        "imag",
        "is_cpu",
        "is_cuda",
        "is_ipu",
        "is_leaf",
        "is_maia",
        "is_meta",
        "is_mkldnn",
        "is_mps",
        "is_mtia",
        "is_nested",
        "is_quantized",
        "is_sparse",
        "is_sparse_csr",
        "is_vulkan",
        "is_xla",
        "is_xpu",
        "itemsize",
        "layout",
        "mH",
        "mT",
        "name",
        "names",
        "nbytes",
        "ndim",
        "output_nr",
        "real",
        "requires_grad",
        "retains_grad",
        "shape",
        "volatile",
    }
)


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
                raise InputError(f"a parameter's state sets attribute {brief(name)}, not a name — the file is corrupt")
            if name in PARAMETER_DESCRIPTORS or (name.startswith("__") and name.endswith("__")):
                raise InputError(
                    f"a parameter's state sets {name!r}, which would change or replace the tensor "
                    "when torch loads it (torch.save never writes that) — refused"
                )


def _rebuild_parameter_with_state(data: Any, requires_grad: Any, backward_hooks: Any, state: Any) -> TensorRef:
    if not isinstance(data, TensorRef):
        raise InputError("a parameter wraps something that is not a tensor — the file is corrupt")
    _check_parameter_state(state)
    data.parameter = ("torch._utils._rebuild_parameter_with_state", requires_grad, backward_hooks, state)
    return data


# the rebuilds _rebuild_from_type_v2 may call: torch checks the same three by name
_TENSOR_REBUILDS = (_rebuild_tensor, _rebuild_tensor_v2, _rebuild_tensor_v3)


def _rebuild_from_type_v2(func: Any, new_type: Any, args: Any, state: Any) -> TensorRef:
    """``torch._tensor._rebuild_from_type_v2``: what torch.save writes for a tensor carrying Python
    attributes (``t.note = ...``): ``func(*args)``, then each attribute of ``state`` set on it.

    Read when ``func`` is a tensor rebuild, the type ``torch.Tensor`` and the state plain attributes
    (the same rule as parameter state); the recipe rides on the tensor for ``.pt`` rewrites.
    """
    if not isinstance(new_type, TypeRef) or f"{new_type.module}.{new_type.name}" != "torch.Tensor":
        raise InputError(
            f"a tensor is rebuilt as type {brief(new_type)}; ckptool reads plain torch.Tensor only — refused"
        )
    if not isinstance(args, tuple) or not any(func is rebuild for rebuild in _TENSOR_REBUILDS):
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
        raise InputError(
            f"a tensor is moved to device {brief(device)} on load; ckptool reads CPU tensors "
            "from this rebuild only — refused"
        )
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


def _ordered_dict(items: Any = ()) -> OrderedDict:
    if not isinstance(items, list | tuple | dict):
        # an object: torch.load would iterate it, running its class's code (omegaconf resolves interpolations)
        raise InputError(
            f"OrderedDict built from {brief(items)}, not key-value pairs — torch never writes that; refused"
        )
    if isinstance(items, list | tuple) and items:
        if not all(isinstance(item, tuple | list) and len(item) == 2 for item in items):
            raise InputError("OrderedDict built from something that is not key-value pairs — refused")
        _check_keys([key for key, _ in items])
    if isinstance(items, dict):
        items = list(dict.items(items))  # never through an attribute the pickle may have set
    return StateDict(items) if isinstance(items, list | tuple) and items else StateDict()


def _counter(items: Any = None) -> Counter:
    if items is not None and not isinstance(items, dict):
        raise InputError(f"Counter built from {brief(items)}, not a dict of counts — torch never writes that; refused")
    return Counter(items) if isinstance(items, dict) else Counter()


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
        memo[id(node)] = (min(nodes, limits.MAX_KEY_NODES + 1), predictable)
        if nodes > limits.MAX_KEY_NODES:
            return nodes, predictable
    return memo[id(key)]


def _check_keys(keys: Any) -> None:
    """The guard's key rules for keys an allowlisted callable hashes (``set(items)``, ``OrderedDict(pairs)``)."""
    buckets: dict[int, set] = {}
    hashing = 0
    for key in keys:
        nodes, predictable = _key_nodes(key)
        if nodes > limits.MAX_KEY_NODES:
            raise refuse(f"uses a dict key or set element of {nodes}+ nested values (a hashing bomb)")
        hashing += nodes
        if predictable:
            bucket = buckets.setdefault(hash(key), set())
            bucket.add(key)
            if len(bucket) > limits.MAX_HASH_COLLISIONS:
                raise refuse(f"puts {len(bucket)} distinct keys with one hash into a set (a hash-collision flood)")
    if hashing > 8 * len(keys) + 100_000:
        raise refuse("hashes more nested keys than its size allows (a hashing bomb)")
