"""The README's Python API snippet runs as printed, and each print gives what its comment says."""

from __future__ import annotations

import importlib.metadata
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from ckptool.cli.main import main

REPO = Path(__file__).resolve().parent.parent


def readme_snippet() -> str:
    readme = (REPO / "README.md").read_text()
    section = readme[readme.index("## Python API"):]
    return section[section.index("```python\n") + len("```python\n"):section.index("\n```\n")]


def test_python_snippet_runs_as_printed(fixtures_dir: Path, tmp_path: Path, python_executable: str,
                                        subprocess_env: dict[str, str]) -> None:
    demo = tmp_path / "demo-out"  # what make demo leaves: the DDP run's checkpoint, stripped, converted
    demo.mkdir()
    shutil.copy(fixtures_dir / "ddp_lenet_wrapped.pt", demo / "ddp.pt")
    for args in (["strip", demo / "ddp.pt", "-o", demo / "model.pt"],
                 ["convert", demo / "model.pt", "-o", demo / "model.safetensors"]):
        result = CliRunner().invoke(main, [str(a) for a in args])
        assert result.exit_code == 0, result.output
    snippet = readme_snippet()
    assert snippet.startswith("import ckptool\n")
    completed = subprocess.run([python_executable, "-c", snippet], cwd=tmp_path, env=subprocess_env,
                               capture_output=True, text=True, timeout=300)
    assert completed.returncode == 0, completed.stderr
    expected = [re.sub(r" \(.*\)$", "", line.split("  # ", 1)[1]) for line in snippet.splitlines()
                if line.startswith("print(")]
    assert completed.stdout.splitlines() == expected
    assert (demo / "api.safetensors").exists()


def test_shell_completion_as_the_readme_says(subprocess_env: dict[str, str]) -> None:
    readme = (REPO / "README.md").read_text()
    assert 'eval "$(_CKPTOOL_COMPLETE=bash_source ckptool)"' in readme
    try:  # an installed ckptool has its console script beside python; a bare checkout on PYTHONPATH has none
        importlib.metadata.distribution("ckptool")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("ckptool is not installed here (pip install -e .): no console script to complete")
    ckptool = str(Path(sys.executable).parent / "ckptool")  # the console script pip installed beside python
    source = subprocess.run([ckptool], env={**subprocess_env, "_CKPTOOL_COMPLETE": "bash_source"},
                            capture_output=True, text=True, timeout=60)
    assert source.returncode == 0 and "complete -o nosort -F _ckptool_completion ckptool" in source.stdout
    words = subprocess.run([ckptool], env={**subprocess_env, "_CKPTOOL_COMPLETE": "bash_complete",
                                           "COMP_WORDS": "ckptool con", "COMP_CWORD": "1"},
                           capture_output=True, text=True, timeout=60)
    assert words.stdout.split() == ["plain,convert"]
