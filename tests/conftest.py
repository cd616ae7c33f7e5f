"""Shared pytest fixtures: where the repository and its checkpoint fixtures are, how to run training."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import types
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from training_runs import TORCHRUN_VARIABLES, train_in_process

pytest_plugins = ["objectstore"]  # object-storage servers: seaweedfs, bucket, s3_faults, http_server

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))  # `pytest` as well as `python -m pytest` imports ckptool and training


@pytest.fixture(scope="session")
def repo_root() -> Path:
    """The repository root (the directory holding ckptool/, training/, fixtures/)."""
    return REPO_ROOT


@pytest.fixture
def load_script(repo_root: Path, monkeypatch: pytest.MonkeyPatch) -> Callable[[str], types.ModuleType]:
    """``load_script("fixtures/make_fixtures.py")``: a script of the repository imported by its path, under its
    file's stem, and in ``sys.modules`` for this test only (its dataclasses look their module up there)."""

    def load(relative: str) -> types.ModuleType:
        path = repo_root / relative
        spec = importlib.util.spec_from_file_location(path.stem, path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        monkeypatch.setitem(sys.modules, path.stem, module)
        spec.loader.exec_module(module)
        return module

    return load


@pytest.fixture(scope="session")
def fixtures_dir(repo_root: Path) -> Path:
    """The committed checkpoint fixtures (see fixtures/README.md)."""
    return repo_root / "fixtures"


@pytest.fixture
def memory() -> Iterator[str]:
    """A fresh folder of fsspec's ``memory://`` store (``memory://<root>/...``), removed after the test."""
    import uuid

    fsspec = pytest.importorskip("fsspec", reason="URLs need the remote extra (fsspec)")
    fs = fsspec.filesystem("memory")
    root = f"/t{uuid.uuid4().hex[:12]}"
    try:
        yield root
    finally:
        if fs.exists(root):
            fs.rm(root, recursive=True)


@pytest.fixture(scope="session")
def subprocess_env(repo_root: Path) -> dict[str, str]:
    """Environment for ``python -m training`` / torchrun subprocesses: repo importable, no torchrun leftovers."""
    environment = {key: value for key, value in os.environ.items() if key not in TORCHRUN_VARIABLES}
    environment["PYTHONPATH"] = os.pathsep.join(filter(None, [str(repo_root), environment.get("PYTHONPATH")]))
    # One intra-op thread per process: the tests run several torch processes at once (torchrun's
    # workers, parallel runs) on as few as two cores, where extra threads only spin. On a loaded
    # 2-core box this cuts a LeNet run's CPU time about threefold and changes no assertion.
    environment["OMP_NUM_THREADS"] = "1"
    return environment


@pytest.fixture(scope="session")
def python_executable() -> str:
    """The interpreter running the tests (the project's venv); torchrun is ``python -m torch.distributed.run``."""
    return sys.executable


# Files that take most of the suite's time, longest first (CPU-seconds: the torchrun chain, the fixture
# regeneration, the benchmark's ~35 processes, the hostile corpus through every command, ...). Under
# ``pytest -n 2 --dist loadfile`` (make test) the workers start on these and the many short files fill
# in around them, instead of one worker taking a long file last while the other idles.
LONGEST_FILES = (
    "test_fixtures.py", "test_hostile_bounded.py", "test_remote_write.py", "test_gadgets.py", "test_training_dcp.py",
    "test_bench.py", "test_nested_rewrite.py", "test_emit_wild.py", "test_globals.py", "test_gpu_recorded.py",
    "test_remote_bounds.py", "test_guard_native.py", "test_hostile.py", "test_training.py", "test_bounds.py",
    "test_dcp.py", "test_verify.py", "test_install.py",
)


def pytest_configure(config: pytest.Config) -> None:
    """Hand files to xdist workers in LONGEST_FILES order, not xdist's default of most tests first."""
    if hasattr(config.option, "loadscopereorder"):  # pytest-xdist's --dist loadfile/loadscope
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Longest files first (order within a file unchanged); ``gpu`` tests skipped, visibly, without CUDA."""
    def rank(item: pytest.Item) -> int:
        name = item.path.name
        return LONGEST_FILES.index(name) if name in LONGEST_FILES else len(LONGEST_FILES)

    items.sort(key=rank)  # stable
    _skip_gpu_tests_without_cuda(items)


def _skip_gpu_tests_without_cuda(items: list[pytest.Item]) -> None:
    """``gpu`` tests run on real CUDA where it is present and are skipped, visibly, everywhere else."""
    gpu_items = [item for item in items if item.get_closest_marker("gpu") is not None]
    if not gpu_items:
        return
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="gpu: needs CUDA (torch.cuda.is_available() is False here)")
    for item in gpu_items:
        item.add_marker(skip)


@pytest.fixture
def train():
    """Run ``python -m training ARGS`` in this process (tests/training_runs.py); fail the test with its stderr if it fails.

    Real processes are kept for what only a process shows: the torchrun launches (test_training_dcp.py)
    and the exit codes and one-line errors of a failing run (test_training.py).
    """

    def _train(*args: str) -> subprocess.CompletedProcess[str]:
        completed = train_in_process(list(args))
        assert completed.returncode == 0, completed.stderr[-4000:]
        return completed

    return _train
