"""Sparse and nested tensors: placeholders for torch's ``_rebuild_sparse_tensor`` and ``_rebuild_nested_tensor``.

``torch.save`` writes such a tensor as a call on its component tensors (each an ordinary
``_rebuild_tensor_v2``): a sparse COO tensor as its indices, values, size and coalesced flag; a
CSR/CSC/BSR/BSC tensor as its compressed indices, plain indices, values and size; a nested
tensor as its buffer, sizes, strides and offsets. The placeholders here keep that call as it was
(an :class:`~ckptool.pickles.OpaqueObject`, so the writer re-emits it and ``remap`` retags its
components' storages) and say what it stands for (layout, dtype, shape). Nothing is built until
:func:`materialize` is asked for values, which builds the tensor with torch from the component
tensors. What ``torch.load`` refuses (the sparse invariants, a nested piece's storage size) is
refused first, from the index parts (:mod:`ckptool.pickles.layout_checks`), by whatever reads values:
``Checkpoint.tensors`` lists the parts as :class:`~ckptool.tensors.refs.PartRef`, which
:func:`ckptool.tensors.refs.check_wholes` checks, and a ``.pt`` write checks a record before re-emitting it.

Quantized tensors (``_rebuild_qtensor``) are layout tensors too: :mod:`ckptool.pickles.quantized`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from itertools import repeat
from typing import TYPE_CHECKING, Any

from ckptool.base.errors import InputError
from ckptool.pickles import layout_checks
from ckptool.pickles.limits import brief
from ckptool.pickles.placeholders import OpaqueObject, TypeRef
from ckptool.pickles.rebuilds import _check_parameter_state
from ckptool.pickles.rebuilds import _rebuild_from_type_v2 as _plain_from_type_v2
from ckptool.pickles.rebuilds import _rebuild_parameter as _plain_parameter
from ckptool.pickles.rebuilds import _rebuild_parameter_with_state as _plain_parameter_with_state
from ckptool.tensors.refs import PartRef, TensorRef

if TYPE_CHECKING:
    import torch

SPARSE_LAYOUTS = ("sparse_coo", "sparse_csr", "sparse_csc", "sparse_bsr", "sparse_bsc")
_LAYOUT_NAMES = frozenset(f"torch.{name}" for name in (*SPARSE_LAYOUTS, "strided", "_mkldnn", "jagged"))


def _refuse_build(state: Any) -> None:
    raise InputError(
        f"pickle sets attributes ({brief(state)}) on a sparse, nested or quantized tensor — refused; "
        "torch.save never writes that"
    )


class Layout(OpaqueObject):
    """``torch.serialization._get_layout(name)``: how torch pickles a ``torch.layout``."""

    _global = "torch.serialization._get_layout"

    def __setstate__(self, state: Any) -> None:
        _refuse_build(state)

    def __init__(self, *args: Any) -> None:
        self._mode = "reduce"
        if len(args) != 1 or args[0] not in _LAYOUT_NAMES:
            raise InputError(f"unknown tensor layout {brief(args)} — the file is corrupt or from a newer PyTorch")

    @property
    def name(self) -> str:
        return self._args[0].removeprefix("torch.")


def _tensor(value: Any, what: str, *, integer: bool = False, dims: int | None = None) -> TensorRef:
    if not isinstance(value, TensorRef):
        raise InputError(f"a sparse or nested tensor's {what} is not a tensor ({brief(value)}) — the file is corrupt")
    if integer and value.dtype.torch_name not in ("int64", "int32"):
        raise InputError(
            f"a sparse or nested tensor's {what} is {value.dtype.torch_name}, not an integer index "
            "tensor — the file is corrupt"
        )
    if dims is not None and len(value.shape) != dims:
        raise InputError(
            f"a sparse or nested tensor's {what} has {len(value.shape)} dimensions, not {dims} — the file is corrupt"
        )
    return value


def _size(value: Any) -> tuple[int, ...]:
    if not isinstance(value, tuple) or not all(type(d) is int and 0 <= d < 1 << 63 for d in value):
        raise InputError(f"a sparse tensor's size {brief(value)} is not a list of sizes — the file is corrupt")
    return tuple(value)


class LayoutTensor(OpaqueObject):
    """A tensor torch rebuilds from component tensors; its rebuild call is kept as it was."""

    def __setstate__(self, state: Any) -> None:
        _refuse_build(state)

    @property
    def layout(self) -> str:
        raise NotImplementedError

    def components(self) -> list[tuple[str, TensorRef]]:
        """The component tensors by role (``indices``, ``values``, ...)."""
        raise NotImplementedError

    @property
    def dtype(self) -> Any:
        """The element type of the values (a :class:`~ckptool.tensors.dtypes.DType`)."""
        return dict(self.components())["values"].dtype

    @property
    def shape(self) -> tuple[int, ...]:
        raise NotImplementedError

    def build(self, parts: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """The tensor torch.load returns, from the materialized components."""
        raise NotImplementedError

    def problem(self) -> str | None:
        """What torch.load refuses in it (read from its index parts), or None."""
        return None

    def _parts(self, saved: list[tuple[str, TensorRef]]) -> list[tuple[str, TensorRef]]:
        """The saved component tensors as the parts of this tensor (:class:`~ckptool.tensors.refs.PartRef`: what
        reads their values checks this tensor first), made once for its arguments."""
        cached = self.__dict__.get("_components")
        if cached is not None and cached[0] is self._args:
            return cached[1]
        parts: list[tuple[str, TensorRef]] = [(role, PartRef.of(tensor, self)) for role, tensor in saved]
        self.__dict__["_components"] = (self._args, parts)
        return parts

    def check(self, *, name: str = "", path: Any = None) -> None:
        """Refuse it as torch.load does (:mod:`ckptool.pickles.layout_checks`); its index parts are read once."""
        if self.__dict__.get("_checked") is self._args:
            return
        problem = self.problem()
        if problem is not None:
            if path is None:  # the file its parts lie in
                path = next((part.storage.data.path for _, part in self.components() if part.storage.data), None)
            raise layout_checks.refuse(self.layout, problem, name=name, path=path)
        self.__dict__["_checked"] = self._args

    def describe(self) -> str:
        shape = "[" + ", ".join(str(d) for d in self.shape) + "]"
        return f"{self.layout} {self.dtype.torch_name} {shape}"

    def label(self) -> str:
        """What kind of tensor it is, for a message: ``sparse_coo``, ``nested``, ``quantized qint8``."""
        return self.layout

    def name_tag(self) -> str:
        """What its parts' names carry besides the key: what the parts alone do not fix (layout, size)."""
        return f"{self.layout} {'x'.join(str(d) for d in self.shape)}"


class SparseTensor(LayoutTensor):
    """``torch._utils._rebuild_sparse_tensor(layout, data)``."""

    _global = "torch._utils._rebuild_sparse_tensor"

    def __init__(self, *args: Any) -> None:
        self._mode = "reduce"
        if (
            len(args) != 2
            or not isinstance(args[0], Layout)
            or args[0].name not in SPARSE_LAYOUTS
            or not isinstance(args[1], tuple)
        ):
            raise InputError(
                f"sparse tensor record {brief(args)} is not (sparse layout, components) — the file is corrupt"
            )
        data = args[1]
        if args[0].name == "sparse_coo":
            if len(data) not in (3, 4) or (len(data) == 4 and data[3] not in (True, False, None)):
                raise InputError(
                    "a sparse COO record is not (indices, values, size[, coalesced]) — the file is corrupt"
                )
            _tensor(data[0], "indices", integer=True, dims=2)
            _tensor(data[1], "values")
            _size(data[2])
        else:
            if len(data) != 4:
                raise InputError(
                    f"a {args[0].name} record is not (compressed indices, plain indices, values, size) "
                    "— the file is corrupt"
                )
            _tensor(data[0], "compressed indices", integer=True)
            _tensor(data[1], "plain indices", integer=True)
            _tensor(data[2], "values")
            _size(data[3])

    @property
    def layout(self) -> str:
        return self._args[0].name

    def components(self) -> list[tuple[str, TensorRef]]:
        data = self._args[1]
        if self.layout == "sparse_coo":
            return self._parts([("indices", data[0]), ("values", data[1])])
        return self._parts([("compressed_indices", data[0]), ("plain_indices", data[1]), ("values", data[2])])

    @property
    def shape(self) -> tuple[int, ...]:
        data = self._args[1]
        return _size(data[2] if self.layout == "sparse_coo" else data[3])

    @property
    def coalesced(self) -> bool | None:
        data = self._args[1]
        return data[3] if self.layout == "sparse_coo" and len(data) == 4 else None

    def problem(self) -> str | None:
        data = self._args[1]
        if self.layout == "sparse_coo":
            return layout_checks.coo_problem(data[0], data[1], self.shape, self.coalesced)
        return layout_checks.compressed_problem(self.layout, data[0], data[1], data[2], self.shape)

    def reduce_args(self) -> tuple:
        """The arguments as saved, once checked: a write never re-emits a tensor torch.load refuses."""
        self.check()
        return self._args

    def build(self, parts: Mapping[str, torch.Tensor]) -> torch.Tensor:
        import torch

        self.check()
        try:
            if self.layout == "sparse_coo":
                # torch.load builds it unchecked, then checks every loaded sparse tensor's invariants
                return torch.sparse_coo_tensor(
                    parts["indices"], parts["values"], self.shape, is_coalesced=self.coalesced, check_invariants=True
                )
            return torch.sparse_compressed_tensor(
                parts["compressed_indices"],
                parts["plain_indices"],
                parts["values"],
                self.shape,
                layout=getattr(torch, self.layout),
                check_invariants=True,
            )
        except (RuntimeError, ValueError, TypeError) as e:
            raise InputError(
                f"{self.layout} tensor is inconsistent ({str(e).splitlines()[0][:160]}) — torch.load "
                "refuses it too; the file is corrupt"
            ) from e


class NestedTensor(LayoutTensor):
    """``torch._utils._rebuild_nested_tensor(buffer, sizes, strides, storage_offsets)``."""

    _global = "torch._utils._rebuild_nested_tensor"

    def __init__(self, *args: Any) -> None:
        self._mode = "reduce"
        if len(args) != 4:
            raise InputError("a nested tensor record is not (buffer, sizes, strides, offsets) — the file is corrupt")
        buffer = _tensor(args[0], "buffer", dims=1)
        sizes = _tensor(args[1], "sizes", integer=True, dims=2)
        strides = _tensor(args[2], "strides", integer=True, dims=2)
        offsets = _tensor(args[3], "offsets", integer=True, dims=1)
        if tuple(sizes.shape) != tuple(strides.shape) or offsets.shape[0] != sizes.shape[0]:
            raise InputError("a nested tensor's sizes, strides and offsets disagree in shape — the file is corrupt")
        del buffer

    @property
    def layout(self) -> str:
        return "nested"

    def components(self) -> list[tuple[str, TensorRef]]:
        return self._parts(
            [
                ("values", self._args[0]),
                ("sizes", self._args[1]),
                ("strides", self._args[2]),
                ("offsets", self._args[3]),
            ]
        )

    @property
    def shape(self) -> tuple[int, ...]:
        """The number of nested tensors and the dimensions of each (their sizes are ragged)."""
        return tuple(self._args[1].shape)

    def describe(self) -> str:
        count, dims = self.shape
        return f"nested {self.dtype.torch_name} ({count} tensors of {dims} dimensions)"

    def problem(self) -> str | None:
        return layout_checks.nested_problem(*self._args)

    def reduce_args(self) -> tuple:
        """The arguments as saved, once checked: a write never re-emits a tensor torch.load refuses."""
        self.check()
        return self._args

    def build(self, parts: Mapping[str, torch.Tensor]) -> torch.Tensor:
        import torch

        # checked first: a piece reaching past its buffer would read memory the file does not hold
        self.check()
        buffer, sizes, strides, offsets = parts["values"], parts["sizes"], parts["strides"], parts["offsets"]
        try:
            return torch._nested_view_from_buffer(
                buffer.contiguous(), sizes.contiguous(), strides.contiguous(), offsets.contiguous()
            )
        except (RuntimeError, ValueError, TypeError) as e:
            raise layout_checks.refuse("nested", str(e).splitlines()[0][:160]) from e


# torch's weights_only unpickler allows all three (ckptool.pickles.allowlist builds TORCH_GLOBALS from this table)
GLOBALS: dict[str, Any] = {
    "torch.serialization._get_layout": Layout,
    "torch._utils._rebuild_sparse_tensor": SparseTensor,
    "torch._utils._rebuild_nested_tensor": NestedTensor,
}


def layout_tensors(state_dict: Mapping[str, Any]) -> dict[str, LayoutTensor]:
    """The sparse and nested tensors among a mapping's values."""
    items = dict.items(state_dict) if isinstance(state_dict, dict) else state_dict.items()
    values = dict.values(state_dict) if isinstance(state_dict, dict) else state_dict.values()
    if not any(map(isinstance, values, repeat(LayoutTensor))):  # the usual state dict: tested in C
        return {}
    return {key: value for key, value in items if isinstance(value, LayoutTensor)}


def describe_all(state_dict: Mapping[str, Any]) -> list[str]:
    """One line per sparse, nested or quantized tensor: what it is and how its parts are listed."""
    return [
        f"{key!r} is a {value.describe()} tensor, listed as its parts {key}[...]: "
        + ", ".join(role for role, _ in value.components())
        for key, value in layout_tensors(state_dict).items()
    ]


def component_name(key: str, value: LayoutTensor, role: str) -> str:
    """The name a component tensor has in ``Checkpoint.tensors``: the tensor's key, its layout and
    size (which the components alone do not fix; a quantized tensor's dtype), and the component's role."""
    return f"{key}[{value.name_tag()}/{role}]"


def add_components(tensors: dict[str, TensorRef], state_dict: Mapping[str, Any], path: Any) -> None:
    """Add the component tensors of the sparse and nested tensors in ``state_dict`` to ``tensors``."""
    for key, value in layout_tensors(state_dict).items():
        if not isinstance(key, str):
            continue
        for role, part in value.components():
            name = component_name(key, value, role)
            if name in state_dict or name in tensors:
                raise InputError(
                    f"tensor key {name!r} names both a tensor and a part of the {value.layout} tensor "
                    f"{key!r} — rename one (ckptool cannot tell them apart)",
                    path=path,
                )
            tensors[name] = part


def materialize(
    tensors: Mapping[str, LayoutTensor], to_state_dict: Callable[[Mapping[str, TensorRef]], dict[str, torch.Tensor]]
) -> dict[str, torch.Tensor]:
    """Build each tensor with torch from its components (materialized by ``to_state_dict``)."""
    parts = to_state_dict(
        {f"{name}\0{role}": tensor for name, value in tensors.items() for role, tensor in value.components()}
    )
    return {
        name: value.build({role: parts[f"{name}\0{role}"] for role, _ in value.components()})
        for name, value in tensors.items()
    }


def refuse_for_safetensors(state_dict: Mapping[str, Any], out: Any) -> None:
    """A safetensors file holds dense tensors only: name the sparse, nested and quantized ones, write nothing."""
    found = layout_tensors(state_dict)
    if found:
        from ckptool.base import suggest
        from ckptool.base.errors import OutputError

        shown = ", ".join(f"{key!r} ({value.label()})" for key, value in list(found.items())[:4])
        more = f" and {len(found) - 4} more" if len(found) > 4 else ""
        raise OutputError(
            f"safetensors holds dense tensors only, but {shown}{more} "
            f"{'is' if len(found) == 1 else 'are'} sparse, nested or quantized — nothing was written; "
            f"write .pt ({suggest.command('convert', '...', out='OUT.pt')}), or make them dense with "
            "torch first (tensor.to_dense(), tensor.dequantize())",
            path=out,
        )


class WrappedLayoutTensor(LayoutTensor):
    """A sparse, nested or quantized tensor wrapped as torch.save wraps a tensor: in ``nn.Parameter``
    (``_rebuild_parameter``, ``_rebuild_parameter_with_state``) or carrying Python attributes
    (``_rebuild_from_type_v2`` with ``torch.Tensor``). It stands for the tensor it wraps (its parts,
    its values; the API gives the tensor, as for a plain parameter); a ``.pt`` rewrite re-emits the
    wrapping call, so torch loads the same parameter or attributes."""

    @property
    def inner(self) -> LayoutTensor:
        return self._args[2] if self._global == "torch._tensor._rebuild_from_type_v2" else self._args[0]

    def reduce_args(self) -> tuple:
        if self._global == "torch._tensor._rebuild_from_type_v2":
            inner = self._args[2]
            return (self._args[0], self._args[1], tuple(inner.reduce_args()), self._args[3])
        return self._args

    @property
    def layout(self) -> str:
        return self.inner.layout

    @property
    def dtype(self) -> Any:
        return self.inner.dtype

    @property
    def shape(self) -> tuple[int, ...]:
        return self.inner.shape

    def components(self) -> list[tuple[str, TensorRef]]:
        return self.inner.components()

    def label(self) -> str:
        return self.inner.label()

    def name_tag(self) -> str:
        return self.inner.name_tag()

    def describe(self) -> str:
        return self.inner.describe() + (" parameter" if "parameter" in self._global else " with attributes")

    def build(self, parts: Mapping[str, torch.Tensor]) -> torch.Tensor:
        return self.inner.build(parts)

    def check(self, *, name: str = "", path: Any = None) -> None:
        self.inner.check(name=name, path=path)


def _wrapper(name: str) -> type:
    return type(name.rsplit(".", 1)[-1], (WrappedLayoutTensor,), {"_global": name})


_ParameterOfLayout = _wrapper("torch._utils._rebuild_parameter")
_ParameterWithStateOfLayout = _wrapper("torch._utils._rebuild_parameter_with_state")
_LayoutWithAttributes = _wrapper("torch._tensor._rebuild_from_type_v2")


def _rebuild_parameter(data: Any, *args: Any) -> Any:
    if not isinstance(data, LayoutTensor):
        return _plain_parameter(data, *args)
    if len(args) != 2 or not isinstance(args[0], bool):
        raise InputError(f"a parameter record {brief(args)} is not (requires_grad, hooks) — the file is corrupt")
    return _ParameterOfLayout(data, *args)


def _rebuild_parameter_with_state(data: Any, *args: Any) -> Any:
    if not isinstance(data, LayoutTensor):
        return _plain_parameter_with_state(data, *args)
    if len(args) != 3 or not isinstance(args[0], bool):
        raise InputError(f"a parameter record {brief(args)} is not (requires_grad, hooks, state) — the file is corrupt")
    _check_parameter_state(args[2])
    return _ParameterWithStateOfLayout(data, *args)


_LAYOUT_REBUILDS = {
    "torch._utils._rebuild_sparse_tensor",
    "torch._utils._rebuild_nested_tensor",
    "torch._utils._rebuild_qtensor",
}


def _rebuild_from_type_v2(func: Any, new_type: Any, args: Any, state: Any) -> Any:
    # a layout tensor's placeholder class: what the allowlist gave for one of its rebuild functions
    name = (
        func._global
        if isinstance(func, type) and issubclass(func, LayoutTensor) and func._global in _LAYOUT_REBUILDS
        else None
    )
    if name is None:
        return _plain_from_type_v2(func, new_type, args, state)
    if not isinstance(new_type, TypeRef) or f"{new_type.module}.{new_type.name}" != "torch.Tensor":
        raise InputError(
            f"a tensor is rebuilt as type {brief(new_type)}; ckptool reads plain torch.Tensor only — refused"
        )
    if not isinstance(args, tuple):
        raise InputError("a tensor with attributes has no argument tuple — the file is corrupt")
    _check_parameter_state(state)
    module, _, function = name.rpartition(".")
    return _LayoutWithAttributes(TypeRef(module, function), new_type, func(*args), state)


# the plain rebuilds of parameters and tensors with attributes, taking a layout tensor too: these replace
# ckptool.pickles.rebuilds' entries in TORCH_GLOBALS
WRAPPED_REBUILDS: dict[str, Any] = {
    "torch._utils._rebuild_parameter": _rebuild_parameter,
    "torch._utils._rebuild_parameter_with_state": _rebuild_parameter_with_state,
    "torch._tensor._rebuild_from_type_v2": _rebuild_from_type_v2,
}
for _function in WRAPPED_REBUILDS.values():
    _function.__setstate__ = _refuse_build
