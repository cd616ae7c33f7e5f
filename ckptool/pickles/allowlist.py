"""The allowlist: which globals a pickle may name, and the inert placeholder each one becomes.

:data:`TORCH_GLOBALS` is torch's own ``weights_only`` set, each name mapped to the placeholder or
checking rebuild that stands for it (:mod:`ckptool.pickles.rebuilds`); :data:`DEFAULT_EXTRA_GLOBALS`
the data-only classes training scripts store, recorded as :class:`OpaqueObject`\\ s. SECURITY.md
gives the reason for each. :class:`GlobalResolver` applies them (and a user's ``--allow-global``
names) to one read; anything else raises :class:`RefusedGlobal`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .. import dtypes
from ..refs import DTypeRef
from .placeholders import StorageTypeRef, TypeRef, opaque_type, refuse_build
from .rebuilds import (_builtin_bytearray, _builtin_complex, _builtin_set, _codecs_encode, _counter, _ordered_dict,
                       _rebuild_device_tensor_from_cpu_tensor, _rebuild_from_type_v2, _rebuild_meta_tensor_no_storage,
                       _rebuild_parameter, _rebuild_parameter_with_state, _rebuild_tensor, _rebuild_tensor_v2,
                       _rebuild_tensor_v3, _torch_device, _torch_size)

if TYPE_CHECKING:
    from .guard_cache import GuardCache


class RefusedGlobal(Exception):
    """Raised inside the unpickler when a pickle names a global outside the allowlist."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.name = name


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
            value.__setstate__ = refuse_build
    return table


# Globals torch's own weights_only unpickler allows, mapped to inert placeholders.
TORCH_GLOBALS: dict[str, Any] = _build_torch_globals()
# Sparse and nested tensors, quantized storages and the layouts they name are added to
# TORCH_GLOBALS by ckptool.layouts (built on OpaqueObject), imported at the end of ckptool.pickles.

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
        guard_cache: the pickles this read's operation already walked (a scan that then loads,
            a write that re-reads its output); none: every pickle is walked.
    """

    def __init__(self, allow_globals: tuple[str, ...] | list[str] = (), *, permissive: bool = False,
                 guard_cache: GuardCache | None = None) -> None:
        self.extra = set(DEFAULT_EXTRA_GLOBALS) | {python3_name(name) for name in allow_globals}
        self.permissive = permissive
        self.guard_cache = guard_cache
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
            return opaque_type(full_name, module)
        if full_name not in self.refused:
            self.refused.append(full_name)
        if self.permissive:
            return opaque_type(full_name, module)
        raise RefusedGlobal(full_name)
