"""Faults mid-write: a killed process, a full disk, a read-only or foreign directory, outputs that alias inputs.

The promise under test: the input is never changed, an existing output is either kept or replaced
whole, and a failed write leaves nothing behind — except that SIGKILL cannot be cleaned up after:
its temp file (``.ckptool-tmp-*``) stays where the output was going, inert, and the next run does
not care (SECURITY.md). A write is interrupted at a known point, not by winning a race: the child
is ckptool's own CLI with one hook that, after the first bytes of the output are written, marks a
file and waits for a signal; the test sends the signal once the mark is there.
"""

from __future__ import annotations

import hashlib
import os
import resource
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

import ckptool
from ckptool.cli.main import main

TEMP_PREFIX = ".ckptool-tmp-"
BIG_TENSORS, BIG_ELEMENTS = 8, 1_000_000  # 8 x 4 MB of float32: over the full-disk test's 8 MiB file limit
# ckptool's CLI, frozen mid-write: after the first bytes reach the temp file it marks MARKER and
# waits for a signal (run as: python -c PAUSED_WRITER MARKER ckptool-args...)
PAUSED_WRITER = """
import signal, sys
from pathlib import Path
from ckptool.io import write_check
from ckptool.cli.main import main

marker = Path(sys.argv.pop(1))
written = write_check.OutputSums.written

def written_then_wait(self, offset, length):
    written(self, offset, length)
    if not marker.exists():
        marker.touch()
        while True:  # a signal ends this: KeyboardInterrupt, the SIGTERM handler, or SIGKILL
            signal.pause()

write_check.OutputSums.written = written_then_wait
sys.argv[0] = "ckptool"
main()
"""


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()  # the inputs here are 32 MB at most


@pytest.fixture(scope="module")
def big_input(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import torch

    path = tmp_path_factory.mktemp("big") / "ddp.pt"
    generator = torch.Generator().manual_seed(0)
    torch.save({f"module.layer{i}.weight": torch.rand(BIG_ELEMENTS, generator=generator) for i in range(BIG_TENSORS)},
               path)
    return path


@pytest.fixture
def small_input(tmp_path: Path) -> Path:
    import torch

    path = tmp_path / "in" / "ddp.pt"
    path.parent.mkdir()
    torch.save({"module.fc.weight": torch.arange(6.0).reshape(2, 3), "module.fc.bias": torch.ones(2)}, path)
    return path


def _sigint_as_at_a_terminal() -> None:
    # a test run started in the background (``cmd &``, nohup) passes SIGINT on ignored, and Python
    # then never raises KeyboardInterrupt
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.fixture
def ckptool_process(subprocess_env: dict[str, str]):
    environment = {k: v for k, v in subprocess_env.items() if k != "CKPTOOL_DEBUG"}

    def start(*args: object, **kwargs: object) -> subprocess.Popen:
        kwargs.setdefault("preexec_fn", _sigint_as_at_a_terminal)
        return subprocess.Popen([sys.executable, "-m", "ckptool", *map(str, args)], env=environment,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kwargs)

    return start


@pytest.fixture
def paused_writer(subprocess_env: dict[str, str], tmp_path: Path):
    """Start ckptool so that it stops mid-write; return (process, marker file)."""
    environment = {k: v for k, v in subprocess_env.items() if k != "CKPTOOL_DEBUG"}

    def start(*args: object) -> tuple[subprocess.Popen, Path]:
        marker = tmp_path / "paused-mid-write"
        process = subprocess.Popen([sys.executable, "-c", PAUSED_WRITER, str(marker), *map(str, args)],
                                   env=environment, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                   preexec_fn=_sigint_as_at_a_terminal)
        return process, marker

    return start


def temp_files(directory: Path) -> list[Path]:
    return sorted(p for p in directory.iterdir() if p.name.startswith(TEMP_PREFIX))


def interrupt_mid_write(process: subprocess.Popen, marker: Path, directory: Path, sig: int) -> list[Path]:
    """Wait until the paused writer has written its first bytes, send ``sig``; return the temp files seen."""
    hang_guard = time.monotonic() + 600  # only a child that neither writes nor exits reaches this
    while not marker.exists():
        if process.poll() is not None:
            pytest.fail(f"ckptool exited ({process.returncode}) before it paused mid-write: {process.stderr.read()}")
        if time.monotonic() > hang_guard:
            process.kill()
            pytest.fail("ckptool neither wrote nor exited")
        time.sleep(0.01)
    temps = temp_files(directory)
    assert temps, "paused mid-write but no temp file beside the output"
    process.send_signal(sig)
    process.communicate(timeout=600)
    return temps


COMMANDS = {  # how each writing command is asked to rewrite the big input
    "strip": lambda src, out: ["strip", src, "-o", out],
    "convert": lambda src, out: ["convert", src, "-o", out],
}
SUFFIX = {"strip": ".pt", "convert": ".safetensors"}


@pytest.mark.parametrize("command", list(COMMANDS))
def test_kill_9_mid_write_keeps_input_and_previous_output(big_input: Path, tmp_path: Path, command: str,
                                                          ckptool_process, paused_writer) -> None:
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    out = out_dir / f"model{SUFFIX[command]}"
    before_input = sha256(big_input)
    first = ckptool_process(*COMMANDS[command](big_input, out))
    assert first.wait(timeout=300) == 0, first.stderr.read()
    before_output = sha256(out)

    process, marker = paused_writer(*COMMANDS[command](big_input, out), "--force")
    interrupt_mid_write(process, marker, out_dir, signal.SIGKILL)
    assert process.returncode == -signal.SIGKILL
    assert sha256(big_input) == before_input
    assert sha256(out) == before_output
    remnants = [p.name for p in out_dir.iterdir() if p != out]
    # SIGKILL cannot be caught: its temp file is the only remnant, never the output itself
    assert all(name.startswith(TEMP_PREFIX) for name in remnants) and len(remnants) <= 1, remnants

    again = ckptool_process(*COMMANDS[command](big_input, out), "--force")
    assert again.wait(timeout=300) == 0, again.stderr.read()
    assert ckptool.fingerprint(ckptool.load(out).tensors) == \
        ckptool.fingerprint(ckptool.load(big_input).strip_prefix().tensors if command == "strip" else
                            ckptool.load(big_input).tensors)
    assert sha256(big_input) == before_input


@pytest.mark.parametrize(("signum", "exit_code"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_interrupt_mid_write_cleans_up(big_input: Path, tmp_path: Path, paused_writer, signum: int,
                                       exit_code: int) -> None:
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    process, marker = paused_writer("strip", big_input, "-o", out_dir / "model.pt")
    interrupt_mid_write(process, marker, out_dir, signum)
    assert process.returncode == exit_code, process.returncode
    assert list(out_dir.iterdir()) == []


def _limit_file_size() -> None:  # runs in the child before exec
    resource.setrlimit(resource.RLIMIT_FSIZE, (8 << 20, 8 << 20))
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write then fails with EFBIG instead of killing


@pytest.mark.parametrize("command", list(COMMANDS))
def test_full_disk_fails_cleanly(big_input: Path, tmp_path: Path, command: str, ckptool_process) -> None:
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    before = sha256(big_input)
    process = ckptool_process(*COMMANDS[command](big_input, out_dir / f"model{SUFFIX[command]}"),
                              preexec_fn=_limit_file_size)
    _, stderr = process.communicate(timeout=300)
    assert process.returncode == 3, stderr
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ckptool: error: ") and "Traceback" not in stderr, stderr
    assert "too large" in stderr or "no space" in stderr, stderr
    assert list(out_dir.iterdir()) == []
    assert sha256(big_input) == before


def _read_only_directory_command(directory: Path) -> list[str] | None:
    """A command prefix under which ``directory`` is read-only (None if this machine cannot make one)."""
    if os.geteuid() != 0:
        return []  # chmod 555 is enough for an ordinary user
    unshare = shutil.which("unshare")
    if unshare is None:
        return None
    probe = subprocess.run([unshare, "-rm", "sh", "-c", f"mount -t tmpfs -o ro none '{directory}'"],
                           capture_output=True)
    return [unshare, "-rm", "sh", "-c", 'mount -t tmpfs -o ro none "$0" && exec "$@"', str(directory)] \
        if probe.returncode == 0 else None


def test_read_only_output_directory_is_refused(small_input: Path, tmp_path: Path,
                                               subprocess_env: dict[str, str]) -> None:
    out_dir = tmp_path / "read-only"
    out_dir.mkdir()
    prefix = _read_only_directory_command(out_dir)
    if prefix is None:
        pytest.skip("running as root without user namespaces: no way to make a directory read-only for root")
    if not prefix:
        out_dir.chmod(0o555)
    completed = subprocess.run([*prefix, sys.executable, "-m", "ckptool", "strip", str(small_input), "-o",
                                str(out_dir / "model.pt")], env=subprocess_env, capture_output=True, text=True,
                               timeout=120)
    out_dir.chmod(0o755)
    assert completed.returncode == 3, completed.stderr
    assert completed.stderr.startswith("ckptool: error: ") and "Traceback" not in completed.stderr
    assert "read-only" in completed.stderr or "permission denied" in completed.stderr, completed.stderr
    assert list(out_dir.iterdir()) == []


def invoke(*args: object):
    return CliRunner().invoke(main, [str(a) for a in args])


def test_output_on_another_filesystem_works(small_input: Path) -> None:
    shm = Path("/dev/shm")
    if not shm.is_dir() or os.stat(shm).st_dev == os.stat(small_input).st_dev:
        pytest.skip("no second filesystem at /dev/shm")
    out = shm / f"ckptool-test-{os.getpid()}-{time.monotonic_ns()}.pt"
    try:
        result = invoke("strip", small_input, "-o", out)
        assert result.exit_code == 0, result.stderr
        stripped = ckptool.load(small_input).strip_prefix().tensors
        assert ckptool.fingerprint(ckptool.load(out).tensors) == ckptool.fingerprint(stripped)
        assert not [p for p in shm.iterdir() if p.name.startswith(TEMP_PREFIX) and str(os.getpid()) in p.name]
    finally:
        out.unlink(missing_ok=True)


def test_existing_output_needs_force(small_input: Path, tmp_path: Path) -> None:
    out = tmp_path / "taken.pt"
    out.write_bytes(b"precious")
    result = invoke("strip", small_input, "-o", out)
    assert result.exit_code == 3 and "--force" in result.stderr
    assert out.read_bytes() == b"precious"


def test_output_is_the_input(small_input: Path) -> None:
    before = sha256(small_input)
    result = invoke("strip", small_input, "-o", small_input)
    assert result.exit_code == 3 and "input" in result.stderr
    assert sha256(small_input) == before


@pytest.mark.parametrize("link", ["symlink", "hardlink"])
def test_output_linked_to_the_input_is_refused(small_input: Path, tmp_path: Path, link: str) -> None:
    before = sha256(small_input)
    out = tmp_path / f"{link}.pt"
    if link == "symlink":
        out.symlink_to(small_input)
    else:
        os.link(small_input, out)
    for force in ([], ["--force"]):
        result = invoke("strip", small_input, "-o", out, *force)
        assert result.exit_code == 3 and "input" in result.stderr, result.stderr
    assert sha256(small_input) == before and out.exists()


def test_a_folder_output_that_holds_the_input_keeps_it(small_input: Path) -> None:
    before = sha256(small_input)
    result = invoke("convert", small_input, "-o", small_input.parent, "--to", "safetensors", "--force")
    assert result.exit_code == 0, result.stderr
    assert sha256(small_input) == before  # a folder output replaces only its own shards and index
    assert sorted(p.name for p in small_input.parent.iterdir()) == \
        ["ddp.pt", "model-00001-of-00001.safetensors", "model.safetensors.index.json"]
    assert not temp_files(small_input.parent.parent)
