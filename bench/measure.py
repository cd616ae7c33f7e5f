"""One measured process: wall time, peak anonymous memory (summed over its process tree) and peak RSS.

Shared by ``python -m bench`` and ``python -m bench.dcp``, with what both put around a measurement:
the child's environment, byte-compiling ckptool first, a fresh output folder, and the machine's
description in the results.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
GIB = 1 << 30
MIB = 1 << 20


def child_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.pop("CKPTOOL_DEBUG", None)
    return env


def compile_package(python: str) -> str:
    """Byte-compile ckptool as ``pip install`` does, so start-up is measured as users see it.

    An editable checkout run with ``PYTHONDONTWRITEBYTECODE`` set (as on CI machines) would
    otherwise recompile every module in every process: ~40 ms a command here.
    """
    done = subprocess.run([python, "-m", "compileall", "-q", str(REPO / "ckptool")], capture_output=True)
    return "compiled (.pyc, as installed)" if done.returncode == 0 else "not compiled: compileall failed"


def _status_fields(pid: int) -> tuple[int, int]:
    """(RssAnon, VmHWM) in KiB; (0, 0) when the process is gone or a zombie."""
    anon = hwm = 0
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            for line in f:
                if line.startswith(b"RssAnon:"):
                    anon = int(line.split()[1])
                elif line.startswith(b"VmHWM:"):
                    hwm = int(line.split()[1])
    except (OSError, ValueError):
        pass
    return anon, hwm


def _descendants(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        try:  # children started by the main thread (sh -c 'cp ... && sync ...'); cheap enough for every 5 ms
            with open(f"/proc/{p}/task/{p}/children") as f:
                todo.extend(int(x) for x in f.read().split())
        except (OSError, ValueError):
            pass
    return out


def _loads_torch(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/maps", "rb") as f:
            return b"libtorch" in f.read()
    except OSError:
        return False


class Sampler(threading.Thread):
    """Samples RssAnon (summed over the process tree) and VmHWM of the child every ``interval`` seconds."""

    def __init__(self, pid: int, interval: float = 0.005) -> None:
        super().__init__(daemon=True)
        self.pid, self.interval = pid, interval
        self.stop = threading.Event()
        self.peak_anon_kib = 0
        self.peak_hwm_kib = 0
        self.samples = 0
        self.torch_loaded = False

    def run(self) -> None:
        n = 0
        while True:
            total_anon = 0
            for p in _descendants(self.pid):
                anon, hwm = _status_fields(p)
                total_anon += anon
                if p == self.pid:
                    self.peak_hwm_kib = max(self.peak_hwm_kib, hwm)
            self.peak_anon_kib = max(self.peak_anon_kib, total_anon)
            if not self.torch_loaded and n % 4 == 0:
                self.torch_loaded = _loads_torch(self.pid)
            n += 1
            self.samples = n
            if self.stop.wait(self.interval):
                return


@dataclass
class Run:
    wall_s: float
    rc: int
    anon_mib: float
    rss_mib: float
    cpu_s: float
    torch_loaded: bool
    samples: int
    load1: float = 0.0
    cached: float | None = None       # fraction of the input(s) in the page cache just before the run
    out_bytes: int = 0
    stderr_tail: str = ""


def measure(argv: list[str], *, cwd: Path, env: dict[str, str], log_dir: Path, interval: float) -> Run:
    err_path = log_dir / "stderr.txt"
    load1 = os.getloadavg()[0]
    with open(err_path, "wb") as err:
        t0 = time.perf_counter()
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err, cwd=cwd, env=env)
        sampler = Sampler(proc.pid, interval)
        sampler.start()
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - t0
        proc.returncode = os.waitstatus_to_exitcode(status)  # reaped here: Popen must not wait again
        sampler.stop.set()
        sampler.join()
    tail = err_path.read_text(errors="replace")[-2000:]
    rss_kib = max(usage.ru_maxrss, sampler.peak_hwm_kib)
    return Run(wall, proc.returncode, sampler.peak_anon_kib / 1024, rss_kib / 1024, usage.ru_utime + usage.ru_stime,
               sampler.torch_loaded, sampler.samples, load1=load1, stderr_tail=tail)



def clean_dir(path: Path) -> None:
    if path.exists():
        shutil.rmtree(path)
    path.mkdir(parents=True)


def output_bytes(target: Path) -> int:
    """Bytes a tool wrote: the file's size, or the sum over a folder's files; 0 when nothing is there."""
    if target.is_dir():
        return sum(p.stat().st_size for p in target.rglob("*") if p.is_file())
    return target.stat().st_size if target.exists() else 0


def measure_in(out_dir: Path, argv: list[str], output: str, *, cwd: Path, env: dict[str, str], log_dir: Path,
               interval: float) -> Run:
    """``measure`` with ``out_dir`` fresh; records what the tool wrote to ``out_dir / output`` (when it names
    one), then deletes ``out_dir`` and syncs, untimed, so that one run's write-back does not land in the next."""
    clean_dir(out_dir)
    r = measure(argv, cwd=cwd, env=env, log_dir=log_dir, interval=interval)
    if output:
        r.out_bytes = output_bytes(out_dir / output)
    shutil.rmtree(out_dir, ignore_errors=True)
    os.sync()
    return r


def git_rev() -> str:
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "ckptool"], cwd=REPO, capture_output=True,
                               text=True).stdout.strip()
        return rev + ("+dirty" if dirty else "")
    except OSError:
        return "?"


def machine_meta(started: float, python: str) -> dict:
    """The first fields of a result's ``meta``: when, how long, and on what."""
    return {
        "started": _dt.datetime.fromtimestamp(started).isoformat(timespec="seconds"),
        "duration_s": round(time.time() - started, 1),
        "python": python,
        "python_version": platform.python_version(),
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "mem_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GIB, 1),
    }


def load_meta(before: float, during: list[float]) -> dict:
    """The 1-minute load average before the run and at the start of every measured process."""
    return {
        "load1_before": round(before, 2),
        "load1_during_median": round(statistics.median(during), 2) if during else None,
        "load1_during_max": round(max(during), 2) if during else None,
    }


def stderr_logger(name: str, quiet: bool) -> Callable[[str], None]:
    def log(msg: str) -> None:
        if not quiet:
            print(f"[{name} {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)

    return log


def write_results(results: Path, stem: str, result: dict, md: str) -> None:
    """``STEM.json`` (every run) and ``STEM.md`` (the table, also printed) under ``results``."""
    (results / f"{stem}.json").write_text(json.dumps(result, indent=2))
    (results / f"{stem}.md").write_text(md)
    print(md)
    print(f"written: {results / f'{stem}.json'}, {results / f'{stem}.md'}", file=sys.stderr)
