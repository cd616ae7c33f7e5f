"""Bounded by construction: every command on every hostile input, in a real process with little address space.

SECURITY.md promises bounded time and memory: the limits refuse bombs before they allocate, so
no hostile input needs the machine's memory to be refused. Here each command (inspect, scan,
strip, add-prefix, remap, convert, verify, diff) runs on every case of the hostile corpus and of
the public picklescan corpus as its own process, under ``RLIMIT_AS`` = :data:`ADDRESS_SPACE`
(ckptool's commands need ~0.3 GiB of address space, numpy included: far under it, and far under
what any bomb asks for), with a hang limit. Each must exit 0, 1 or 3 on its own (no signal, no
hang), print exactly one line for an error and never a traceback, not run out of memory, and
leave nothing in its output folder.

The processes are forked from one server that imported ckptool once (a fresh interpreter per run
would cost ~0.3 s of start-up each, over 2,500 runs); a child sets its limit, runs the console
script's own entry point (``ckptool.cli.main.run``) with its stdout and stderr on files, and exits with
its code. The server reports each run's exit, time and peak resident memory (``wait4``).

And: SIGTERM and Ctrl-C end a command in the middle of long work (a large pickle, a checkpoint of
many tensors) promptly, with the usual one line, and leave no temp file.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import signal
import struct
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
import hostile  # noqa: E402 — the corpus generator beside this file
from test_hostile import COMMANDS, command_table, picklescan_files  # noqa: E402 — one table of every command

ADDRESS_SPACE = 3 << 30  # bytes; a command's own need is measured by test_the_limit_leaves_room_for_real_work
HANG_LIMIT_S = 300.0  # only a runaway reaches it, even on a loaded 2-core machine
TEMP_PREFIX = ".ckptool-tmp-"
# the server: imports ckptool, then forks one child per run (argv: plan.json results.jsonl);
# each result line: label, command, exit code or signal, seconds, peak RSS, stdout/stderr, leftovers
SERVER = r"""
import json, os, resource, shutil, sys, time
from pathlib import Path

import ckptool
import ckptool.cli.main
for name in ("io.reader", "io.writer", "ops.scan", "ops.inspect", "ops.diff", "verification.verify", "tensors.digest",
             "ops.load_into"):
    __import__(f"ckptool.{name}")  # what every command imports: paid once, here

plan = json.loads(Path(sys.argv[1]).read_text())
results = open(sys.argv[2], "w")
scratch = Path(plan["scratch"])


def child(run):
    limit = plan["address_space"]
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    for fd, name in ((1, "stdout"), (2, "stderr")):
        handle = os.open(scratch / name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(handle, fd)
        os.close(handle)
    os.chdir(run["cwd"])
    sys.argv = ["ckptool", *run["args"]]
    code = 0
    try:
        ckptool.cli.main.run()
    except SystemExit as e:  # what the interpreter does with it at exit
        if isinstance(e.code, int) or e.code is None:
            code = e.code or 0
        else:
            print(e.code, file=sys.stderr)
            code = 1
    except BaseException:
        import traceback
        traceback.print_exc()
        code = 1
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
    os._exit(code)


for run in plan["runs"]:
    out = Path(run["out"])
    started = time.monotonic()
    pid = os.fork()
    if pid == 0:
        child(run)
    status, usage, timed_out = 0, None, False
    while True:
        done, status, usage = os.wait4(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() - started > plan["hang_limit"]:
            os.kill(pid, 9)
            _, status, usage = os.wait4(pid, 0)
            timed_out = True
            break
        time.sleep(0.002)
    leftovers = sorted(p.name for p in out.iterdir()) if out.is_dir() else []
    for p in out.iterdir() if out.is_dir() else []:
        shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink()
    results.write(json.dumps({
        "label": run["label"], "command": run["command"], "seconds": round(time.monotonic() - started, 3),
        "exit": os.waitstatus_to_exitcode(status), "timed_out": timed_out, "maxrss_kb": usage.ru_maxrss,
        "stdout": (scratch / "stdout").read_text(errors="replace")[-2000:],
        "stderr": (scratch / "stderr").read_text(errors="replace")[-4000:], "leftovers": leftovers,
    }) + "\n")
    results.flush()
"""


def server_env(subprocess_env: dict[str, str]) -> dict[str, str]:
    environment = {k: v for k, v in subprocess_env.items() if k != "CKPTOOL_DEBUG"}
    # one BLAS thread: no thread pool reserving address space in a process that never multiplies matrices
    environment.update(OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    return environment


def run_all(runs: list[dict], tmp_path: Path, subprocess_env: dict[str, str], *,
            address_space: int = ADDRESS_SPACE) -> list[dict]:
    """Every run in ``runs`` (label, command, args, cwd, out) as a forked process under ``address_space``;
    their results in order."""
    scratch = tmp_path / "scratch"
    scratch.mkdir(exist_ok=True)
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"runs": runs, "scratch": str(scratch), "address_space": address_space,
                                "hang_limit": HANG_LIMIT_S}))
    results = tmp_path / "results.jsonl"
    completed = subprocess.run([sys.executable, "-c", SERVER, str(plan), str(results)], env=server_env(subprocess_env),
                               capture_output=True, text=True, timeout=HANG_LIMIT_S * 4 + 60 * len(runs))
    assert completed.returncode == 0, completed.stderr[-3000:]
    lines = [json.loads(line) for line in results.read_text().splitlines()]
    assert len(lines) == len(runs)
    return lines


def problems_of(result: dict, input_path: str) -> list[str]:
    """What is wrong with one run: [] when it ended cleanly on its own."""
    found = []
    stderr, code = result["stderr"], result["exit"]
    lines = stderr.strip().splitlines()
    if result["timed_out"]:
        found.append(f"still running after {HANG_LIMIT_S:.0f} s (killed)")
    elif code < 0:
        found.append(f"killed by signal {-code} ({signal.Signals(-code).name})")
    elif code not in (0, 1, 3):
        found.append(f"exit {code}: {stderr.strip()[-300:]!r}")
    if "Traceback" in stderr or "Traceback" in result["stdout"]:
        found.append(f"a traceback: {stderr[-300:]!r}")
    if code == 3 and (len(lines) != 1 or not lines[0].startswith(f"ckptool: error: {input_path}")):
        found.append(f"stderr is not one 'ckptool: error: <path>: ...' line: {stderr[:300]!r}")
    if "ran out of memory" in stderr:  # the limits should have refused it long before the machine's did
        found.append(f"ran out of memory under {ADDRESS_SPACE >> 30} GiB of address space (peak RSS "
                     f"{result['maxrss_kb'] >> 10} MiB)")
    # a command that succeeded (a benign file of the public corpus) wrote its output; a temp file is never left
    temps = [name for name in result["leftovers"] if name.startswith(TEMP_PREFIX)]
    if temps or result["leftovers"] and code != 0:
        found.append(f"left {result['leftovers']} in the output folder")
    return found


def matrix(items: list[tuple[str, Path]], out: Path, good: Path, cwd: Path) -> list[dict]:
    table = command_table(out, good)
    return [{"label": label, "command": command, "args": table[command](path), "cwd": str(cwd), "out": str(out),
             "input": str(path)} for label, path in items for command in COMMANDS]


def report(runs: list[dict], results: list[dict]) -> tuple[list[str], str]:
    """The failures (one line each) and a note of the largest peak memory seen, for the assertion message."""
    failures = []
    for run, result in zip(runs, results):
        for problem in problems_of(result, run["input"]):
            failures.append(f"{run['label']} / {run['command']}: {problem} [peak RSS {result['maxrss_kb'] >> 10} MiB, "
                            f"{result['seconds']:.1f} s]")
    heaviest = sorted(results, key=lambda r: -r["maxrss_kb"])[:5]
    note = "largest peaks: " + ", ".join(f"{r['label']}/{r['command']} {r['maxrss_kb'] >> 10} MiB" for r in heaviest)
    return failures, note


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[hostile.Case], Path]:
    root = tmp_path_factory.mktemp("bounded")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.jit's deprecation warnings
        cases = hostile.build_corpus(root / "corpus")
    return cases, hostile.write_good_checkpoint(root / "good.pt")


@pytest.fixture
def folders(tmp_path: Path) -> tuple[Path, Path]:
    out, cwd = tmp_path / "out", tmp_path / "cwd"
    out.mkdir()
    cwd.mkdir()
    return out, cwd


def test_the_limit_leaves_room_for_real_work(tmp_path: Path, folders: tuple[Path, Path],
                                              subprocess_env: dict[str, str]) -> None:
    """Every command on a real checkpoint succeeds under the limit, and at a tenth of it: the limit is not
    what refuses the hostile cases below (measured: a command's peak address space is 25-250 MiB, its peak
    resident memory 22-38 MiB). And the limit is real: under 16 MiB every command fails."""
    import torch

    out, cwd = folders
    path = tmp_path / "model.pt"
    torch.save({f"module.layer{i}.weight": torch.rand(256, 256) for i in range(8)}, path)
    runs = matrix([("real", path)], out, path, cwd)
    for space in (ADDRESS_SPACE, ADDRESS_SPACE // 10):
        results = run_all(runs, tmp_path, subprocess_env, address_space=space)
        assert [(r["command"], r["exit"], r["stderr"]) for r in results] == \
            [(r["command"], 0, "") for r in results]
    starved = run_all(runs, tmp_path, subprocess_env, address_space=16 << 20)
    assert all(r["exit"] != 0 for r in starved), [(r["command"], r["exit"]) for r in starved]


def test_every_command_on_every_hostile_case_within_the_bounds(corpus: tuple[list[hostile.Case], Path],
                                                               folders: tuple[Path, Path], tmp_path: Path,
                                                               subprocess_env: dict[str, str]) -> None:
    cases, good = corpus
    out, cwd = folders
    runs = matrix([(case.name, case.path) for case in cases], out, good, cwd)
    results = run_all(runs, tmp_path, subprocess_env)
    failures, note = report(runs, results)
    assert not failures, "\n".join(failures) + f"\n({len(failures)} of {len(runs)} runs; {note})"
    assert not list(cwd.iterdir())


@pytest.mark.skipif(not picklescan_files(), reason="the public picklescan corpus is not here")
def test_every_command_on_the_public_corpus_within_the_bounds(corpus: tuple[list[hostile.Case], Path],
                                                              folders: tuple[Path, Path], tmp_path: Path,
                                                              subprocess_env: dict[str, str]) -> None:
    _, good = corpus
    out, cwd = folders
    runs = matrix([(path.name, path) for path in picklescan_files()], out, good, cwd)
    results = run_all(runs, tmp_path, subprocess_env)
    failures, note = report(runs, results)
    assert not failures, "\n".join(failures) + f"\n({len(failures)} of {len(runs)} runs; {note})"
    assert not list(cwd.iterdir())


# ------------------------------------------------------------------------------------------------ interrupts

MANY_TENSORS = 100_000
SIGNAL_BOUND_S = 30.0  # from the signal to the exit; the goal is well under a second, this only catches a stuck one
# ckptool's CLI with one stage hooked (run as: python -c STAGED MARKER STAGE ckptool-args...): the stage's C
# function marks MARKER as it starts, runs, and then waits for a signal instead of returning, so the command
# can only end by the signal, and the signal most likely lands inside that C loop
STAGED = """
import signal, sys
from pathlib import Path

from ckptool.pickles import opcode_guard, unpickle

marker = Path(sys.argv.pop(1))
stage = sys.argv.pop(1)


class Hooked:
    def __init__(self, module, name):
        self._module, self._name = module, name

    def __getattr__(self, attribute):
        value = getattr(self._module, attribute)
        if attribute != self._name:
            return value

        def hooked(*args):
            marker.touch()
            value(*args)
            while True:  # only the signal ends this: KeyboardInterrupt, or the SIGTERM handler's SystemExit
                signal.pause()
        return hooked


owner, attribute, function = {"guard-walk": (opcode_guard, "_native", "walk"),
                              "unpickle-run": (unpickle, "_fastload", "load")}[stage]
setattr(owner, attribute, Hooked(getattr(owner, attribute), function))
sys.argv[0] = "ckptool"
from ckptool.cli.main import run
run()
"""


@pytest.fixture(scope="module")
def many_tensors(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A zip checkpoint of MANY_TENSORS one-float tensors, each its own storage (and zip member): every C loop of
    a read (the zip directory, the guard's walk, the unpickler's run) has 100,000 of something to go through."""
    import zipfile

    parts = [hostile.PROTO2, hostile.glob("collections", "OrderedDict"), b"q\x00(tRq\x01("]
    rebuild = hostile.glob("torch._utils", "_rebuild_tensor_v2") + b"q\x02"
    storage = hostile.glob("torch", "FloatStorage") + b"q\x03"
    for i in range(MANY_TENSORS):  # the globals memoized after their first use, as torch's pickler does
        parts.append(hostile.text(f"layer.{i}.weight") + (rebuild if i == 0 else b"h\x02") + b"((" +
                     hostile.text("storage") + (storage if i == 0 else b"h\x03") + hostile.text(str(i)) +
                     hostile.text("cpu") + b"K\x01tQK\x00K\x01\x85K\x01\x85\x89h\x00)RtR")
    parts.append(b"u.")
    path = tmp_path_factory.mktemp("many") / "many.pt"
    with zipfile.ZipFile(path, "w") as archive:  # zipfile: zip64 past 65,535 members
        archive.writestr("many/data.pkl", b"".join(parts))
        archive.writestr("many/byteorder", b"little")
        for i in range(MANY_TENSORS):
            archive.writestr(f"many/data/{i}", struct.pack("<f", i))
        archive.writestr("many/version", b"3\n")
    return path


def _sigint_as_at_a_terminal() -> None:
    # a test run started in the background passes SIGINT on ignored, and Python then never raises KeyboardInterrupt
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.parametrize(("command", "stage"), [("inspect", "unpickle-run"), ("scan", "guard-walk"),
                                                ("convert", "unpickle-run")])
@pytest.mark.parametrize(("signum", "exit_code", "line"), [
    (signal.SIGTERM, 143, "ckptool: terminated — nothing was written"),
    (signal.SIGINT, 130, "ckptool: interrupted — nothing was written"),
], ids=["SIGTERM", "SIGINT"])
def test_a_signal_ends_a_command_in_the_middle_of_long_work(many_tensors: Path, tmp_path: Path, command: str,
                                                            stage: str, signum: int, exit_code: int, line: str,
                                                            subprocess_env: dict[str, str]) -> None:
    out = tmp_path / "out"
    out.mkdir()
    marker = tmp_path / "working"
    args = {"inspect": ["inspect", many_tensors], "scan": ["scan", many_tensors],
            "convert": ["convert", many_tensors, "-o", out / "many.safetensors"]}[command]
    environment = {k: v for k, v in subprocess_env.items() if k != "CKPTOOL_DEBUG"}
    process = subprocess.Popen([sys.executable, "-c", STAGED, str(marker), stage, *map(str, args)], env=environment,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               preexec_fn=_sigint_as_at_a_terminal)
    try:
        hang_guard = time.monotonic() + 600  # only a child that neither reaches the stage nor exits gets here
        while not marker.exists():
            if process.poll() is not None:
                pytest.fail(f"exited ({process.returncode}) before its {stage}: {process.communicate()[1][-2000:]}")
            assert time.monotonic() < hang_guard, f"never reached its {stage}"
            time.sleep(0.005)
        process.send_signal(signum)
        signalled = time.monotonic()
        stdout, stderr = process.communicate(timeout=SIGNAL_BOUND_S)
        took = time.monotonic() - signalled
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
    assert process.returncode == exit_code, (process.returncode, stderr[-2000:])
    assert stderr.strip().splitlines() == [line], stderr[-2000:]
    assert "Traceback" not in stdout + stderr
    assert list(out.iterdir()) == [], f"left {sorted(p.name for p in out.iterdir())} (after {took:.2f} s)"
