"""PyTorch, imported only by the work that needs it, and the install step named when it is missing.

The core (inspect, scan, convert, strip, remap, add-prefix, diff, verify without a model) reads
and writes bytes with numpy and never imports torch; ``pip install ckptool`` does not pull it.
Materializing tensors (``load_into``, ``verify`` with a model or on an accelerator) needs it:
``pip install 'ckptool[torch]'``.
"""

from __future__ import annotations

from types import ModuleType

from ckptool.base.errors import MissingExtraError

INSTALL = "pip install 'ckptool[torch]'"


def import_torch(purpose: str) -> ModuleType:
    """The ``torch`` module, or :class:`~ckptool.base.errors.MissingExtraError` naming ``purpose`` and the install step.

    Example:
        >>> torch = import_torch("verifying on a model")   # doctest: +SKIP
    """
    try:
        import torch
    except ImportError as e:
        raise MissingExtraError(f"{purpose} needs PyTorch, which is not installed — {INSTALL}") from e
    return torch


def torch_installed() -> bool:
    """Whether torch can be imported (without importing it)."""
    import importlib.util

    try:
        return importlib.util.find_spec("torch") is not None
    except (ImportError, ValueError):
        return False
