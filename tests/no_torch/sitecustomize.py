"""Run first in a test's subprocess (this folder first on PYTHONPATH): torch made unimportable.

``CKPTOOL_TEST_BLOCK_TORCH=1``: ``import torch`` (and torchvision) fails as it does where torch is not
installed. ``CKPTOOL_TEST_MODULES_OUT=FILE``: at exit, FILE gets the top-level name of every module
loaded, and ``tried:NAME`` for each import of a blocked module that was attempted — so a test can
tell that a command never even tried torch (where torch is installed it would have imported it).
"""

from __future__ import annotations

import atexit
import os
import sys

BLOCKED = ("torch", "torchvision")
_tried: set[str] = set()


class _Blocker:
    """A meta-path finder that refuses torch, as a Python without it would, and notes the attempt."""

    @staticmethod
    def find_spec(name: str, path: object = None, target: object = None) -> None:
        top = name.split(".")[0]
        if top in BLOCKED:
            _tried.add(top)
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)


def _write_modules(out: str) -> None:
    names = {name.split(".")[0] for name in list(sys.modules)} | {f"tried:{name}" for name in _tried}
    with open(out, "w") as handle:
        handle.write("\n".join(sorted(names)) + "\n")


if os.environ.get("CKPTOOL_TEST_BLOCK_TORCH"):
    sys.meta_path.insert(0, _Blocker())
if os.environ.get("CKPTOOL_TEST_MODULES_OUT"):
    atexit.register(_write_modules, os.environ["CKPTOOL_TEST_MODULES_OUT"])
