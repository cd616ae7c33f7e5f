"""ckptool: make any PyTorch checkpoint portable, and prove it.

Read any checkpoint without running its code, fix what its training run left in it (wrapper
prefixes, GPU location tags, pickle), convert it, and verify the weights are the same.

Example:
    >>> import ckptool
    >>> ckpt = ckptool.load("ddp.pt")                           # doctest: +SKIP
    >>> ckptool.save(ckpt.strip_prefix(), "model.safetensors")  # doctest: +SKIP
"""

from __future__ import annotations

__version__ = "0.1.0"

from .checkpoint import Checkpoint
from .errors import CkptError, InputError, OutputError, UnsafeCheckpointError, UnsupportedFormatError
from .fingerprint import fingerprint
from .reader import load
from .safety import ScanReport, scan
from .summary import Summary, inspect
from .writer import SaveReport, save

__all__ = [
    "Checkpoint",
    "CkptError",
    "InputError",
    "OutputError",
    "UnsafeCheckpointError",
    "UnsupportedFormatError",
    "__version__",
    "fingerprint",
    "inspect",
    "load",
    "scan",
    "ScanReport",
    "Summary",
    "save",
    "SaveReport",
]
