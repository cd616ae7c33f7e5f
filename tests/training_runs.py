"""How the tests launch ``python -m training``: 2 workers under torchrun, or one run in this process.

A torchrun launch is whole processes, as a user runs it. A one-process run goes through the same
``training.__main__.main(argv)`` in the test process instead: the interpreter start, ``import torch``
and torch's lazy imports (several CPU-seconds a process) are paid once per test worker rather than
once per run, and only the arithmetic of the run itself is left. Whatever the run changes in the
process (threads, seeds, deterministic-algorithm flags, torchrun variables) is put back afterwards.
"""

from __future__ import annotations

import contextlib
import io
import os
import random
import subprocess
from collections.abc import Iterator
from pathlib import Path

# gloo sometimes aborts a rank as its process group is torn down under load (SIGABRT, after the run's work and its
# save are done): torch's teardown, not the run under test; a launch that failed so is run again
TEARDOWN_ABORT = "terminate called without an active exception"

# torchrun's variables: a test process must not look like a torchrun worker to python -m training
TORCHRUN_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT")


def run_training(args: list[str], *, env: dict[str, str], cwd: Path, python: str, torchrun: bool = False, timeout: int = 900) -> subprocess.CompletedProcess[str]:
    """``python -m training ARGS`` as a real process (under ``torchrun --nproc-per-node 2`` with ``torchrun``)."""
    launcher = [python, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"] if torchrun else [python]
    return subprocess.run([*launcher, "-m", "training", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def train_in_process(args: list[str]) -> subprocess.CompletedProcess[str]:
    """``python -m training ARGS`` run by its ``main`` in this process: exit code, stdout and stderr.

    Single-threaded, as the subprocess runs are (OMP_NUM_THREADS=1): the same kernels, the same
    tensors bit for bit.
    """
    from training.__main__ import main

    stdout, stderr = io.StringIO(), io.StringIO()
    with _process_state_restored(), contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        returncode = main(list(args))
    return subprocess.CompletedProcess(["python", "-m", "training", *args], returncode, stdout.getvalue(), stderr.getvalue())


@contextlib.contextmanager
def _process_state_restored() -> Iterator[None]:
    """One intra-op thread and no torchrun variables inside; every global a run sets restored after."""
    import numpy as np
    import torch

    environment = {key: os.environ.get(key) for key in (*TORCHRUN_VARIABLES, "CUBLAS_WORKSPACE_CONFIG")}
    threads = torch.get_num_threads()
    deterministic = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled())
    cudnn = (torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark)
    rng = (torch.get_rng_state(), random.getstate(), np.random.get_state())
    for key in TORCHRUN_VARIABLES:
        os.environ.pop(key, None)
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
        if (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()) != deterministic:
            # only when changed: the call imports torch._inductor (seconds) to set its flag too
            torch.use_deterministic_algorithms(deterministic[0], warn_only=deterministic[1])
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = cudnn
        torch.set_rng_state(rng[0])
        random.setstate(rng[1])
        np.random.set_state(rng[2])
        for key, value in environment.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
