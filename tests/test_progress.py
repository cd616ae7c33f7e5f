"""Progress bars: on a terminal's stderr for long byte jobs, and nowhere else (a pipe, --json, --quiet, the API).

The command-line tests run ckptool with stderr on a pseudo-terminal (``os.openpty``) and the bar's
delay set to 0 (``CKPTOOL_PROGRESS_DELAY``), so a small fixture is enough to make a bar appear.
"""

from __future__ import annotations

import errno
import json
import os
import select
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from ckptool.base import progress

REPO = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.skipif(not hasattr(os, "openpty"), reason="needs a pseudo-terminal")


def _env(delay: str = "0") -> dict[str, str]:
    return dict(os.environ, CKPTOOL_PROGRESS_DELAY=delay,
                PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))


def run_on_terminal(tmp_path: Path, *args: object) -> tuple[int, str, bytes]:
    """``ckptool ARGS``, stderr on a 100-column pseudo-terminal: (exit code, stdout, what the terminal got)."""
    import fcntl
    import struct
    import termios

    primary, secondary = os.openpty()
    fcntl.ioctl(secondary, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))  # tqdm draws nothing in 0 columns
    stdout_path = tmp_path / "stdout.txt"
    with open(stdout_path, "wb") as stdout:
        process = subprocess.Popen([sys.executable, "-m", "ckptool", *map(str, args)], stdin=subprocess.DEVNULL,
                                   stdout=stdout, stderr=secondary, env=_env(), cwd=tmp_path)
    os.close(secondary)
    terminal = b""
    try:
        while True:
            ready, _, _ = select.select([primary], [], [], 60)
            if not ready:
                break
            try:
                data = os.read(primary, 65536)
            except OSError as e:  # EIO: the process closed its end
                if e.errno != errno.EIO:
                    raise
                break
            if not data:
                break
            terminal += data
    finally:
        os.close(primary)
        code = process.wait(timeout=120)
    return code, stdout_path.read_text(), terminal


def run_in_pipe(tmp_path: Path, *args: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "ckptool", *map(str, args)], capture_output=True, text=True,
                          env=_env(), cwd=tmp_path, timeout=300)


@pytest.mark.parametrize("command", ["convert", "strip", "inspect", "diff"])
def test_a_bar_shows_on_a_terminal(fixtures_dir: Path, tmp_path: Path, command: str) -> None:
    ddp = fixtures_dir / "ddp_lenet_wrapped.pt"
    args: dict[str, list[object]] = {
        "convert": ["convert", ddp, "-o", tmp_path / "model.safetensors"],
        "strip": ["strip", ddp, "-o", tmp_path / "model.pt"],
        "inspect": ["inspect", ddp, "--fingerprint"],
        "diff": ["diff", ddp, ddp],
    }
    code, stdout, terminal = run_on_terminal(tmp_path, *args[command])
    assert code == 0, terminal
    assert stdout  # the report still goes to stdout, untouched
    assert b"%|" in terminal, terminal  # tqdm's bar: "model.safetensors:  40%|####      | 201k/504k ..."
    assert b"error" not in terminal
    assert b"\n" not in terminal  # the bar is removed when its job ends: no stray line


def test_no_bar_with_json_or_quiet_even_on_a_terminal(fixtures_dir: Path, tmp_path: Path) -> None:
    ddp = fixtures_dir / "ddp_lenet_wrapped.pt"
    code, stdout, terminal = run_on_terminal(tmp_path, "convert", ddp, "-o", tmp_path / "a.safetensors", "--json")
    assert code == 0 and terminal == b""
    assert json.loads(stdout)["converted"][0]["checked"] == 8
    code, stdout, terminal = run_on_terminal(tmp_path, "convert", ddp, "-o", tmp_path / "b.safetensors", "--quiet")
    assert code == 0 and terminal == b""
    code, stdout, terminal = run_on_terminal(tmp_path, "verify", ddp, "-q")
    assert code == 0 and terminal == b""


def test_nothing_on_stderr_in_a_pipe(fixtures_dir: Path, tmp_path: Path) -> None:
    ddp, lenet = fixtures_dir / "ddp_lenet_wrapped.pt", fixtures_dir / "single_lenet.pt"
    (tmp_path / "many").mkdir()
    for args in (["convert", ddp, "-o", tmp_path / "model.safetensors", "--fingerprint"],
                 ["convert", ddp, lenet, "--out-dir", tmp_path / "many"],  # many inputs: no stray line either
                 ["convert", lenet, "-o", tmp_path / "shards", "--max-shard-size", "100KB"],
                 ["remap", fixtures_dir / "gpu_cuda1_ddp_lenet.pt", "-o", tmp_path / "cpu.pt", "--to", "cpu"],
                 ["inspect", ddp, "--fingerprint"], ["verify", lenet, "--devices", "cpu"], ["diff", ddp, ddp]):
        result = run_in_pipe(tmp_path, *args)
        assert result.returncode == 0, result.stderr
        assert result.stderr == "", (args, result.stderr)


def test_the_many_input_convert_shows_a_bar_per_output(fixtures_dir: Path, tmp_path: Path) -> None:
    (tmp_path / "many").mkdir()
    code, _, terminal = run_on_terminal(tmp_path, "convert", fixtures_dir / "ddp_lenet_wrapped.pt",
                                        fixtures_dir / "single_lenet.pt", "--out-dir", tmp_path / "many")
    assert code == 0, terminal
    assert b"ddp_lenet_wrapped.safetensors" in terminal and b"single_lenet.safetensors" in terminal


# ------------------------------------------------------------------------------------------ the seam


class _Recorder:
    """A bar factory that records what each bar was told."""

    def __init__(self) -> None:
        self.bars: list[dict[str, Any]] = []

    def __call__(self, total: int | None, description: str) -> Any:
        record: dict[str, Any] = {"total": total, "description": description, "done": 0, "closed": False}
        self.bars.append(record)

        class Bar:
            @property
            def total(self) -> int | None:
                return record["total"]

            @total.setter
            def total(self, value: int | None) -> None:
                record["total"] = value

            def update(self, n: int = 1) -> None:
                record["done"] += n

            def refresh(self) -> None:
                pass

            def close(self) -> None:
                record["closed"] = True

        return Bar()


def test_library_calls_stay_silent(fixtures_dir: Path, tmp_path: Path, capfd: pytest.CaptureFixture[str],
                                   monkeypatch: pytest.MonkeyPatch) -> None:
    import ckptool

    monkeypatch.setenv("CKPTOOL_PROGRESS_DELAY", "0")
    checkpoint = ckptool.load(fixtures_dir / "ddp_lenet_wrapped.pt")
    ckptool.save(checkpoint.strip_prefix(), tmp_path / "model.safetensors", fingerprint=True)
    ckptool.inspect(tmp_path / "model.safetensors", fingerprint=True)
    out, err = capfd.readouterr()
    assert (out, err) == ("", "")


def test_one_task_counts_a_write_s_bytes_once(fixtures_dir: Path, tmp_path: Path) -> None:
    """The fingerprint computed beside a write's copy, in its own thread, adds nothing to the write's bar."""
    import ckptool

    recorder = _Recorder()
    checkpoint = ckptool.load(fixtures_dir / "ddp_lenet_wrapped.pt")
    weight_bytes = sum(tensor.nbytes for tensor in checkpoint.tensors.values())
    with progress.showing(recorder):
        ckptool.save(checkpoint, tmp_path / "model.safetensors", fingerprint=True)
        ckptool.save(checkpoint, tmp_path / "shards", max_shard_size=100_000)
    assert [bar["description"] for bar in recorder.bars] == ["model.safetensors", "shards"]
    for bar in recorder.bars:
        assert bar["total"] == weight_bytes and bar["done"] == weight_bytes and bar["closed"]


def test_a_task_inside_a_task_is_silent() -> None:
    recorder = _Recorder()
    with progress.showing(recorder):
        with progress.task(None, "outer") as outer:
            progress.expect(100)
            with progress.task(50, "inner") as inner:
                inner.advance(50)  # silent
                progress.advance(30)  # the running (outer) task
            outer.advance(70)
            progress.expect(999)  # a total once set is kept
    with progress.task(10, "no bars shown") as silent:
        silent.advance(10)
    assert recorder.bars == [{"total": 100, "description": "outer", "done": 100, "closed": True}]
