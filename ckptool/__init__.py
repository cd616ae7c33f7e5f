"""ckptool: make any PyTorch checkpoint portable, and prove it.

Read any checkpoint without running its code, fix what its training run left in it (wrapper
prefixes, GPU location tags, pickle), convert it, and verify the weights are the same.

Example:
    >>> import ckptool
    >>> state_dict = ckptool.load_state_dict("model.pt")       # doctest: +SKIP
    >>> ckpt = ckptool.load("ddp.pt")                           # doctest: +SKIP
    >>> ckptool.save(ckpt.strip_prefix(), "model.safetensors")  # doctest: +SKIP
"""

from __future__ import annotations

__version__ = "0.1.0"

import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

# public name -> the module that defines it; imported on first use, so `ckptool inspect` pays
# only for what it runs (start-up is part of every command's time)
_EXPORTS = {
    "Checkpoint": "model.checkpoint",
    "CkptError": "base.errors",
    "InputError": "base.errors",
    "InternalError": "base.errors",
    "OutputError": "base.errors",
    "ResourceError": "base.errors",
    "UnsafeCheckpointError": "base.errors",
    "UnsupportedFormatError": "base.errors",
    "DiffReport": "ops.diff",
    "diff": "ops.diff",
    "fingerprint": "tensors.digest",
    "LoadMismatchError": "ops.key_fitting",
    "LoadReport": "ops.load_into",
    "load_into": "ops.load_into",
    "load": "io.reader",
    "load_state_dict": "ops.state_dict",
    "ScanReport": "ops.scan",
    "scan": "ops.scan",
    "Summary": "ops.inspect",
    "inspect": "ops.inspect",
    "VerifyReport": "verification.verify",
    "verify": "verification.verify",
    "SaveReport": "io.writer",
    "save": "io.writer",
}

__all__ = ["__version__", *sorted(_EXPORTS)]
# the functions that read, write or compare files: whatever goes wrong inside them reaches the
# caller as a CkptError — InputError and friends for the input's faults, InternalError for a bug
_BOUNDARY = {"diff", "fingerprint", "inspect", "load", "load_into", "load_state_dict", "save", "scan", "verify"}


def __getattr__(name: str) -> Any:
    module_name = _EXPORTS.get(name)
    if module_name is None:
        raise AttributeError(f"module 'ckptool' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(f".{module_name}", __name__), name)
    if name in _BOUNDARY:
        value = _only_ckpt_errors(value)
    globals()[name] = value
    return value


def _only_ckpt_errors(function: Callable[..., Any]) -> Callable[..., Any]:
    """``function``, raising only CkptError subclasses: an unexpected exception becomes InternalError."""
    import functools
    import inspect

    from ckptool.base.errors import CkptError, InternalError, ResourceError

    signature = inspect.signature(function)

    @functools.wraps(function)
    def call(*args: Any, **kwargs: Any) -> Any:
        try:
            signature.bind(*args, **kwargs)
        except TypeError as e:  # a wrong argument is the caller's mistake, said as Python says it, not a bug
            raise TypeError(f"ckptool.{function.__name__}() {e}") from None
        try:
            return function(*args, **kwargs)
        except CkptError:
            raise
        except MemoryError as e:  # the machine's limit, not a bug: said as such
            raise ResourceError(
                f"ran out of memory in ckptool.{function.__name__} — nothing was written; "
                "free memory or run it on a larger machine"
            ) from e
        except Exception as e:  # not the input's fault as far as ckptool can tell: a bug, said as one
            from pathlib import Path

            first = args[0] if args else None
            path = first if isinstance(first, str | Path) else Path(first) if isinstance(first, os.PathLike) else None
            raise InternalError(
                f"internal error in ckptool.{function.__name__}: {type(e).__name__}: {e} — a bug "
                "in ckptool, not a verdict on the input; please report it",
                path=path,
            ) from e

    return call


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))


if TYPE_CHECKING:  # pragma: no cover - for type checkers and IDEs ("X as X": exported, as __all__ says)
    from ckptool.base.errors import (
        CkptError as CkptError,
    )
    from ckptool.base.errors import (
        InputError as InputError,
    )
    from ckptool.base.errors import (
        InternalError as InternalError,
    )
    from ckptool.base.errors import (
        OutputError as OutputError,
    )
    from ckptool.base.errors import (
        ResourceError as ResourceError,
    )
    from ckptool.base.errors import (
        UnsafeCheckpointError as UnsafeCheckpointError,
    )
    from ckptool.base.errors import (
        UnsupportedFormatError as UnsupportedFormatError,
    )
    from ckptool.io.reader import load as load
    from ckptool.io.writer import SaveReport as SaveReport
    from ckptool.io.writer import save as save
    from ckptool.model.checkpoint import Checkpoint as Checkpoint
    from ckptool.ops.diff import DiffReport as DiffReport
    from ckptool.ops.diff import diff as diff
    from ckptool.ops.inspect import Summary as Summary
    from ckptool.ops.inspect import inspect as inspect
    from ckptool.ops.key_fitting import (
        LoadMismatchError as LoadMismatchError,
    )
    from ckptool.ops.load_into import (
        LoadReport as LoadReport,
    )
    from ckptool.ops.load_into import (
        load_into as load_into,
    )
    from ckptool.ops.scan import ScanReport as ScanReport
    from ckptool.ops.scan import scan as scan
    from ckptool.ops.state_dict import load_state_dict as load_state_dict
    from ckptool.tensors.digest import fingerprint as fingerprint
    from ckptool.verification.verify import VerifyReport as VerifyReport
    from ckptool.verification.verify import verify as verify
