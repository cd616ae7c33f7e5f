"""How the tests launch ``python -m training``: one process, or 2 workers under torchrun."""

from __future__ import annotations

import subprocess
from pathlib import Path


def run_training(args: list[str], *, env: dict[str, str], cwd: Path, python: str, torchrun: bool = False, timeout: int = 900) -> subprocess.CompletedProcess[str]:
    launcher = [python, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"] if torchrun else [python]
    return subprocess.run([*launcher, "-m", "training", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
