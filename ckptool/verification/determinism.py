"""Deterministic settings while verifying: TF32 off (matmul and cuDNN), cuDNN deterministic, no
benchmark autotuning — restored afterwards, whatever happens inside."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any


def _precision_attributes() -> list[tuple[Any, str]]:
    import torch

    backends = torch.backends
    if hasattr(backends.cuda.matmul, "fp32_precision"):  # torch >= 2.9: reading the legacy flags may raise
        owners = [backends.cuda.matmul, getattr(backends.cudnn, "conv", None), getattr(backends.cudnn, "rnn", None)]
        return [(owner, "fp32_precision") for owner in owners if hasattr(owner, "fp32_precision")]
    return [(backends.cuda.matmul, "allow_tf32"), (backends.cudnn, "allow_tf32")]


def determinism_state() -> dict[str, Any]:
    """The settings :func:`deterministic_settings` changes, as they are now."""
    import torch

    state = {f"{type(owner).__name__}.{name}": getattr(owner, name) for owner, name in _precision_attributes()}
    state["float32_matmul_precision"] = torch.get_float32_matmul_precision()
    state["cudnn.deterministic"] = torch.backends.cudnn.deterministic
    state["cudnn.benchmark"] = torch.backends.cudnn.benchmark
    return state


@contextlib.contextmanager
def deterministic_settings() -> Iterator[None]:
    """TF32 off (matmul and cuDNN), cuDNN deterministic, no benchmark autotuning; restored on exit."""
    import torch

    attributes = _precision_attributes()
    saved = [getattr(owner, name) for owner, name in attributes]
    saved_precision = torch.get_float32_matmul_precision()
    saved_deterministic = torch.backends.cudnn.deterministic
    saved_benchmark = torch.backends.cudnn.benchmark
    try:
        torch.set_float32_matmul_precision("highest")
        for owner, name in attributes:
            setattr(owner, name, "ieee" if name == "fp32_precision" else False)
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False
        yield
    finally:
        torch.set_float32_matmul_precision(saved_precision)
        for (owner, name), value in zip(attributes, saved):
            setattr(owner, name, value)
        torch.backends.cudnn.deterministic = saved_deterministic
        torch.backends.cudnn.benchmark = saved_benchmark
