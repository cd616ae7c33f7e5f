"""The C extensions, loaded in one place behind one switch.

Each is the twin of a Python reference that stays in its own module and that tests hold it to, byte
for byte (``tests/test_twins.py``, ``test_guard_native.py``, ``test_fastload.py``; ``make fuzz`` under
ASan and UBSan):

- ``_guard``: the opcode guard's walk (``ckptool.pickles.opcode_guard``);
- ``_fastload``: the restricted unpickler's run, and a safetensors header's parse
  (``ckptool.pickles.unpickle``, ``ckptool.formats.safetensors``).

They are optional: where they were not built (no C compiler at install) :func:`load` returns None and
the Python runs. ``CKPTOOL_PURE_PYTHON=1`` runs the Python everywhere.
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType

PURE_PYTHON = os.environ.get("CKPTOOL_PURE_PYTHON", "") not in ("", "0")


def load(name: str) -> ModuleType | None:
    """The extension ``name`` (``_guard``, ``_fastload``), or None: not built, or turned off."""
    if PURE_PYTHON:
        return None
    try:
        return importlib.import_module(f"{__name__}.{name}")
    except ImportError:  # not built (installed where no C compiler was): the Python twin runs
        return None
