"""``pip install ckptool`` without torch: a fresh venv, the core commands on a fixture, and the extra named.

One venv per test session (built from a copy of the package sources, so no build output lands in
the repository); pip takes click, numpy and tqdm from the configured index or its cache. Skipped,
saying why, only when pip cannot reach any index.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
INSTALL = "pip install 'ckptool[torch]'"
# what pip prints when no index can be reached (offline, no proxy): then the test cannot run here
_NO_INDEX = re.compile(r"NewConnectionError|Temporary failure in name resolution|Network is unreachable|"
                       r"No matching distribution found|Could not find a version that satisfies|ProxyError|"
                       r"Max retries exceeded")

pytestmark = pytest.mark.install


def _venv_python(venv: Path) -> Path:
    return venv / ("Scripts/python.exe" if os.name == "nt" else "bin/python")


@pytest.fixture(scope="session")
def torchless_venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A venv holding ``pip install <this tree>`` and nothing else (no torch)."""
    root = tmp_path_factory.mktemp("torchless")
    source = root / "src"
    source.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy2(REPO / name, source / name)
    # the sources only: the install compiles the native guard itself (or goes on without it)
    shutil.copytree(REPO / "ckptool", source / "ckptool", ignore=shutil.ignore_patterns("__pycache__", "*.so", "*.pyd"))
    venv = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    # the tests' own pip installs into the new venv (--python): no ensurepip, a few seconds saved
    environment = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    result = subprocess.run([sys.executable, "-m", "pip", "--python", str(_venv_python(venv)), "install",
                             "--quiet", "--disable-pip-version-check", str(source)],
                            capture_output=True, text=True, timeout=600, env=environment)
    if result.returncode != 0:
        output = result.stdout + result.stderr
        if _NO_INDEX.search(output):
            pytest.skip(f"pip cannot reach a package index to install click, numpy and tqdm: {output.strip()[-300:]}")
        pytest.fail(f"pip install of the package failed:\n{output}")
    return venv


def _run(venv: Path, *args: object, cwd: Path) -> subprocess.CompletedProcess[str]:
    environment = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    return subprocess.run([str(_venv_python(venv)), "-m", "ckptool", *map(str, args)], capture_output=True, text=True,
                          cwd=cwd, env=environment, timeout=300)


def test_the_core_installs_and_runs_without_torch(torchless_venv: Path, fixtures_dir: Path, tmp_path: Path) -> None:
    python = str(_venv_python(torchless_venv))
    probe = subprocess.run([python, "-c", "import importlib.util as u, ckptool, pathlib; "
                                          "print(u.find_spec('torch') is None, u.find_spec('fsspec') is None, "
                                          "u.find_spec('tqdm') is not None, "
                                          "(pathlib.Path(ckptool.__file__).parent / 'py.typed').is_file())"],
                           capture_output=True, text=True, cwd=tmp_path, timeout=120)
    # no torch, no fsspec; tqdm; py.typed in the wheel
    assert probe.stdout.split() == ["True", "True", "True", "True"], probe.stderr

    checkpoint = fixtures_dir / "ddp_lenet_wrapped.pt"
    inspected = _run(torchless_venv, "inspect", checkpoint, "--json", "--fingerprint", cwd=tmp_path)
    assert inspected.returncode == 0, inspected.stderr
    assert json.loads(inspected.stdout)["prefix"] == "module."
    scanned = _run(torchless_venv, "scan", checkpoint, cwd=tmp_path)
    assert scanned.returncode == 0, scanned.stderr
    converted = _run(torchless_venv, "convert", checkpoint, "-o", tmp_path / "model.safetensors", "--strip",
                     "--json", cwd=tmp_path)
    assert converted.returncode == 0, converted.stderr
    assert json.loads(converted.stdout)["converted"][0]["checked"] == 8
    verified = _run(torchless_venv, "verify", tmp_path / "model.safetensors", cwd=tmp_path)
    assert verified.returncode == 0, verified.stderr

    needs_torch = _run(torchless_venv, "verify", tmp_path / "model.safetensors", "--model", "training:lenet",
                       cwd=tmp_path)
    assert needs_torch.returncode == 3
    assert needs_torch.stderr.count("\n") == 1 and INSTALL in needs_torch.stderr, needs_torch.stderr

    for args in (["inspect", "s3://bucket/model.pt"], ["convert", checkpoint, "-o", "s3://bucket/model.safetensors"]):
        needs_remote = _run(torchless_venv, *args, cwd=tmp_path)  # a URL without the remote extra: one line
        assert needs_remote.returncode == 3, needs_remote.stderr
        assert needs_remote.stderr.count("\n") == 1 and "pip install 'ckptool[remote]'" in needs_remote.stderr, \
            needs_remote.stderr
