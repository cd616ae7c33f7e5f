"""The public API type-checks under ``mypy --strict`` from outside the package, as a user's code sees it.

The package is put, as an installed package would be, into the site-packages of a bare venv (no
torch: mypy reading torch's own sources would take a minute), and mypy checks a user's script that
calls each public function and reads each report class. Without ``py.typed`` mypy would refuse the
package ("missing library stubs or py.typed marker"); with a public name not exported, or an
annotation that does not fit how the API is documented, the script fails to check.
"""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

USER_SCRIPT = '''\
"""A user's script: every public name of ckptool, used with the types it promises."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import ckptool
from ckptool import (Checkpoint, CkptError, DiffReport, InputError, InternalError, LoadMismatchError, LoadReport,
                     OutputError, ResourceError, SaveReport, ScanReport, Summary, UnsafeCheckpointError,
                     UnsupportedFormatError, VerifyReport)
from ckptool.base.errors import Location
from ckptool.files.remote import RemotePath


def convert(path: Path, out: Path, model: Any) -> list[str]:
    checkpoint: Checkpoint = ckptool.load(path, allow_globals=["omegaconf.*"], weights="state_dict_ema")
    stripped: Checkpoint = checkpoint.strip_prefix()
    prefixed: Checkpoint = stripped.add_prefix("module.")
    saved: SaveReport = ckptool.save(stripped, out, force=True, fingerprint=True, max_shard_size=2 << 30)
    summary: Summary = ckptool.inspect(path, fingerprint=True, allow_globals=["mylib.Config"])
    scanned: ScanReport = ckptool.scan(str(path), allow_globals=("mylib.*",))
    compared: DiffReport = ckptool.diff(path, out, atol=1e-6)
    verified: VerifyReport = ckptool.verify(out, devices="cpu", against=path, allow_nonfinite=["*.mask"])
    value: str = ckptool.fingerprint(checkpoint.tensors)
    loaded: LoadReport = ckptool.load_into(model, out, device="cpu")
    files: list[Path] = saved.files
    counts: tuple[int, bool, str, bool, bool, int, str | None] = (
        summary.tensors, scanned.safe, scanned.verdict, compared.identical, verified.ok, loaded.matched,
        saved.fingerprint)
    fields: dict[str, Any] = summary.to_json() | scanned.to_json() | compared.to_json()
    return [value, ckptool.__version__, *sorted(prefixed.tensors), *map(str, files), str(counts), str(fields)]


def refused(path: Path) -> int:
    try:
        ckptool.load(path)
    except LoadMismatchError as error:
        return error.exit_code
    except UnsafeCheckpointError as error:
        names: list[str] = error.globals
        return len(names)
    except (InputError, UnsupportedFormatError, OutputError, ResourceError, InternalError) as error:
        where: Location | None = error.path  # a local Path, or a URL input's RemotePath
        url: RemotePath | None = where if isinstance(where, RemotePath) else None
        return 3 if where is None else 4 if url is None else 5
    except CkptError as error:
        return error.exit_code
    return 0
'''


def test_the_public_api_type_checks_strictly_from_outside(tmp_path: Path) -> None:
    pytest.importorskip("mypy", reason="mypy is in the test extra: pip install -e '.[test]'")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / ("Scripts/python.exe" if os.name == "nt" else "bin/python")
    site_packages = Path(subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True, text=True, check=True).stdout.strip())
    assert site_packages.is_dir() and site_packages != Path(sysconfig.get_paths()["purelib"])
    (site_packages / "ckptool").symlink_to(REPO / "ckptool", target_is_directory=True)
    script = tmp_path / "user_script.py"
    script.write_text(USER_SCRIPT)
    environment = {key: value for key, value in os.environ.items() if key != "MYPYPATH"}
    result = subprocess.run([sys.executable, "-m", "mypy", "--strict", "--python-executable", str(python),
                             "--cache-dir", str(tmp_path / "mypy-cache"), "--no-error-summary", str(script)],
                            capture_output=True, text=True, cwd=tmp_path, env=environment, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
