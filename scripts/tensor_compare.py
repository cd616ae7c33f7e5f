"""torch's reading of files and the comparison of tensors, for the harnesses that check ckptool against torch
and the frameworks (``scripts/realworld.py``, ``scripts/frameworks/checks.py``): same dtype, shape and bytes,
tied weights allowed to be stored once."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

REFERENCE_SCRIPT = Path(__file__).resolve().parent / "realworld_reference.py"


def torch_view(paths: list[Path], work: Path, *, timeout: float) -> dict[str, dict]:
    """scripts/realworld_reference.py's reading of each path (a throwaway subprocess), by ``str(path)``."""
    import torch

    out = work / "reference.pt"
    completed = subprocess.run([sys.executable, str(REFERENCE_SCRIPT), str(out), *map(str, paths)],
                               capture_output=True, text=True, timeout=timeout, cwd=work)
    if completed.returncode != 0:
        raise RuntimeError(f"reference reader failed: {completed.stderr.strip()[-1500:]}")
    results: dict[str, dict] = torch.load(out, weights_only=True)
    out.unlink()
    return results


def same_tensor(a: Any, b: Any) -> bool:
    """Same dtype, shape and bytes (NaN payloads and -0.0 included)."""
    import torch

    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.detach().cpu().reshape(-1).contiguous().view(torch.uint8),
                       b.detach().cpu().reshape(-1).contiguous().view(torch.uint8))


def compare(expected: Mapping[str, Any], got: Mapping[str, Any] | None,
            rename: Callable[[str], str] = lambda key: key) -> str | None:
    """None when ``got`` holds every expected tensor (under ``rename(key)``) with equal values.

    A key may be missing only when its tensor shares storage with a key that is present (tied
    weights stored once and re-tied by ckptool).
    """
    if got is None:
        return "no tensor dict with the expected keys in the output"
    storages: dict[int, list[str]] = {}
    for key, tensor in expected.items():
        storages.setdefault(tensor.untyped_storage().data_ptr(), []).append(key)
    extra = set(got) - {rename(key) for key in expected}
    if extra:
        return f"{len(extra)} unexpected keys, e.g. {sorted(extra)[:3]}"
    for key, tensor in expected.items():
        target = rename(key)
        if target not in got:
            partners = [rename(k) for k in storages[tensor.untyped_storage().data_ptr()] if k != key]
            if any(p in got and same_tensor(tensor, got[p]) for p in partners):
                continue
            return f"missing key {target!r}"
        if not same_tensor(tensor, got[target]):
            return f"{target!r}: values, dtype or shape differ from torch's reading of the input"
    return None
