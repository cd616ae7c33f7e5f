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
from .diff import DiffReport, diff
from .errors import CkptError, InputError, OutputError, UnsafeCheckpointError, UnsupportedFormatError
from .fingerprint import fingerprint
from .materialize import LoadMismatchError, LoadReport, load_into
from .reader import load
from .safety import ScanReport, scan
from .summary import Summary, inspect
from .verify import VerifyReport, verify
from .writer import SaveReport, save

__all__ = [
    "Checkpoint",
    "DiffReport",
    "CkptError",
    "InputError",
    "LoadMismatchError",
    "LoadReport",
    "OutputError",
    "UnsafeCheckpointError",
    "UnsupportedFormatError",
    "__version__",
    "diff",
    "fingerprint",
    "inspect",
    "load",
    "load_into",
    "scan",
    "ScanReport",
    "Summary",
    "save",
    "SaveReport",
    "verify",
    "VerifyReport",
]
