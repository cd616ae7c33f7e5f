"""ckptool benchmark: ckptool against the disk limit (cp, cp + sync) and the naive torch path.

Run as ``python -m bench`` (see bench/README.md). Every measurement is a whole process started with
subprocess and timed by wall clock; the harness itself never imports torch (checkpoints are generated
in a child process), so its own memory and start-up do not leak into the numbers.

For every process it records:
  * wall time (median over ``--repeat`` runs),
  * peak anonymous memory: ``RssAnon`` from ``/proc/PID/status`` sampled every ~5 ms in a thread,
    summed over the child and its descendants (``cp && sync`` runs under ``sh``),
  * peak RSS: ``ru_maxrss`` from ``os.wait4`` (the child's own high-water mark, exact),
  * whether the process loaded torch (``libtorch`` in ``/proc/PID/maps``): its memory baseline is then
    ``python -c "import torch"``, otherwise ``python -c pass``.

Results: ``bench/results/bench.json``, ``bench.md`` (the table and the goals), ``bench.png`` when
matplotlib is importable (it is not a dependency).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

REPO = Path(__file__).resolve().parent.parent
DEFAULT_RESULTS = Path(__file__).resolve().parent / "results"
DEFAULT_WORKDIR = Path(tempfile.gettempdir()) / "ckptool-bench"
GIB = 1 << 30
MIB = 1 << 20
GEN_VERSION = 1  # bump when the generated checkpoints change shape

# Goals the numbers are judged against (from the issue "Speed: a benchmark against the disk limit
# and the naive torch path").
GOAL_REWRITE_VS_DISK = 1.2      # convert/strip/remap <= 1.2 x cp+sync
GOAL_REWRITE_VS_NAIVE = 4.0     # ... and >= 4 x faster than the naive torch path
GOAL_ANON_OVER_BASE_MIB = 64.0  # peak anonymous memory over the interpreter baseline
GOAL_ANON_FLAT_MIB = 16.0       # "flat in size": growth from the smallest to the largest size
GOAL_READONLY_S = 0.15          # inspect / scan whole process, any size
GOAL_COMPARE_VS_READ = 2.0      # diff / verify --against <= 2 x reading both files once
GOAL_HELP_S = 0.15              # ckptool --help


# ---------------------------------------------------------------------------------------------
# checkpoints


GEN_SCRIPT = r'''
import json, os, sys, torch
path, twin, nbytes, n_small, n_tiny = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
g = torch.Generator().manual_seed(0)
sd = {}
if n_tiny:
    # many tiny tensors: what inspect/scan cost per tensor, not per byte
    for i in range(n_tiny):
        sd[f"module.blocks.{i // 4}.p{i % 4}"] = torch.randn(16, generator=g)
else:
    widths = (64, 128, 256, 512, 768, 1024, 2048)
    used = 0
    for i in range(n_small):
        layer, kind = divmod(i, 4)
        if kind == 3:
            t = torch.tensor(i, dtype=torch.int64)  # like BatchNorm's num_batches_tracked
        else:
            t = torch.randn(widths[i % len(widths)], generator=g)
        sd[f"module.layers.{layer}.{('bias', 'norm.weight', 'norm.bias', 'num_batches_tracked')[kind]}"] = t
        used += t.numel() * t.element_size()
    n_large = 4
    rest = max(nbytes - used, n_large * 4096)
    cols = 4096
    for j in range(n_large):
        dtype = torch.float32 if j % 2 == 0 else torch.bfloat16
        esize = 4 if dtype == torch.float32 else 2
        rows = max(1, rest // n_large // esize // cols)
        sd[f"module.large.{j}.weight"] = torch.randn(rows, cols, generator=g, dtype=torch.float32).to(dtype)

# tag every storage 'cuda:0', exactly what torch.save writes on a GPU (see fixtures/make_fixtures.py)
registry = torch.serialization._package_registry
entry = (min(e[0] for e in registry) - 1, lambda storage: "cuda:0", lambda storage, location: None)
torch.serialization.register_package(*entry)
try:
    torch.save(sd, path + ".tmp")
    # the twin: the same weights saved in the reverse order -> different bytes, equal content
    torch.save(dict(reversed(list(sd.items()))), twin + ".tmp")
finally:
    registry.remove(entry)
for p in (path, twin):
    with open(p + ".tmp", "rb+") as f:
        os.fsync(f.fileno())
    os.replace(p + ".tmp", p)
print(json.dumps({"tensors": len(sd), "bytes": sum(t.numel() * t.element_size() for t in sd.values()),
                  "torch": torch.__version__}))
'''


@dataclass
class Input:
    label: str          # "0.25 GiB", "10k tiny"
    nbytes: int         # requested tensor bytes (0 for the tiny one)
    path: Path
    twin: Path
    tensors: int = 0
    file_bytes: int = 0
    gen_s: float = 0.0
    reused: bool = False


def parse_size(text: str) -> int:
    """'0.25' (GiB), '1G', '5M', '512MiB' -> bytes."""
    t = text.strip().lower().removesuffix("ib").removesuffix("b")
    scale = GIB
    if t.endswith("g"):
        t = t[:-1]
    elif t.endswith("m"):
        t, scale = t[:-1], MIB
    elif t.endswith("k"):
        t, scale = t[:-1], 1024
    value = int(float(t) * scale)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"size must be > 0: {text!r}")
    return value


def size_label(nbytes: int) -> str:
    if nbytes >= GIB // 4:
        return f"{nbytes / GIB:g} GiB"
    return f"{nbytes / MIB:g} MiB"


def make_input(workdir: Path, python: str, *, nbytes: int = 0, n_tiny: int = 0, log: Callable[[str], None]) -> Input:
    if n_tiny:
        label, stem, n_small = f"{n_tiny // 1000}k tiny" if n_tiny >= 1000 else f"{n_tiny} tiny", f"tiny-{n_tiny}", 0
    else:
        # ~1000 small tensors, fewer when the size is too small to hold them (the smoke test's 5 MiB)
        label, stem, n_small = size_label(nbytes), f"ckpt-{nbytes}", min(1000, max(8, nbytes // (64 * 1024)))
    path = workdir / f"{stem}-v{GEN_VERSION}.pt"
    twin = workdir / f"{stem}-v{GEN_VERSION}-twin.pt"
    meta_path = workdir / f"{stem}-v{GEN_VERSION}.json"
    inp = Input(label, nbytes, path, twin)
    if path.exists() and twin.exists() and meta_path.exists():
        meta = json.loads(meta_path.read_text())
        inp.tensors, inp.reused = meta["tensors"], True
    else:
        log(f"generating {label} checkpoint + twin in {workdir} ...")
        t0 = time.perf_counter()
        out = subprocess.run([python, "-c", GEN_SCRIPT, str(path), str(twin), str(nbytes), str(n_small), str(n_tiny)],
                             capture_output=True, text=True)
        if out.returncode != 0:
            raise SystemExit(f"bench: generating {label} failed:\n{out.stderr[-3000:]}")
        meta = json.loads(out.stdout.strip().splitlines()[-1])
        meta_path.write_text(json.dumps(meta))
        inp.tensors, inp.gen_s = meta["tensors"], time.perf_counter() - t0
    inp.file_bytes = path.stat().st_size
    return inp


# ---------------------------------------------------------------------------------------------
# tools


NAIVE_SCRIPT = r'''
import sys, torch
src, dst, mmap, how = sys.argv[1], sys.argv[2], sys.argv[3] == "1", sys.argv[4]
sd = torch.load(src, map_location="cpu", weights_only=True, mmap=mmap)
sd = {(k[len("module."):] if k.startswith("module.") else k): v for k, v in sd.items()}
if how == "safetensors":
    from safetensors.torch import save_file
    save_file(sd, dst)
else:
    torch.save(sd, dst)
'''


@dataclass
class Ctx:
    python: str
    inp: Input | None
    out_dir: Path


@dataclass
class Tool:
    name: str
    group: str                         # baseline | disk | naive | ckptool
    argv: Callable[[Ctx], list[str]]
    job: str = ""                      # convert | rewrite | read | compare | startup
    per_size: bool = True              # False: run once per repetition, not per checkpoint
    writes: str = ""                   # output file name when the tool writes one
    reads_input: bool = True           # eligible for the cold-cache run
    cold: bool = True                  # run cold by default (else only with --full)
    max_bytes: int = 0                 # run only on inputs up to this size by default (0: any; --full: any)
    twin: bool = False                 # reads the twin too
    subcommand: str = ""               # ckptool subcommand that must exist
    needs_option: str = ""             # ... with this option in its --help
    ok_codes: tuple[int, ...] = (0,)
    description: str = ""


def _ckptool(ctx: Ctx, *args: str) -> list[str]:
    return [ctx.python, "-m", "ckptool", *args]


def _out(ctx: Ctx, name: str) -> str:
    return str(ctx.out_dir / name)


def _naive(mmap: bool, how: str) -> Callable[[Ctx], list[str]]:
    ext = "safetensors" if how == "safetensors" else "pt"
    return lambda c: [c.python, "-c", NAIVE_SCRIPT, str(c.inp.path), _out(c, f"naive.{ext}"), "1" if mmap else "0", how]


TOOLS: list[Tool] = [
    # interpreter baselines (memory baselines and the start-up floor)
    Tool("python", "baseline", lambda c: [c.python, "-c", "pass"], job="startup", per_size=False, reads_input=False,
         description='python -c "pass"'),
    Tool("import-torch", "baseline", lambda c: [c.python, "-c", "import torch"], job="startup", per_size=False,
         reads_input=False, description='python -c "import torch"'),
    Tool("help", "ckptool", lambda c: _ckptool(c, "--help"), job="startup", per_size=False, reads_input=False,
         description="ckptool --help"),
    # the disk
    Tool("read", "disk", lambda c: ["cat", str(c.inp.path)], job="read", description="cat CKPT > /dev/null"),
    Tool("read-both", "disk", lambda c: ["cat", str(c.inp.path), str(c.inp.twin)], job="read", twin=True,
         description="cat A B > /dev/null (reference for diff / verify)"),
    Tool("cp", "disk", lambda c: ["cp", str(c.inp.path), _out(c, "cp.pt")], job="copy", writes="cp.pt",
         description="cp CKPT OUT"),
    Tool("cp+sync", "disk",
         lambda c: ["sh", "-c", 'cp "$1" "$2" && sync "$2" "$3"', "sh", str(c.inp.path), _out(c, "cpsync.pt"),
                    str(c.out_dir)],
         job="copy", writes="cpsync.pt", description="cp CKPT OUT && sync OUT OUTDIR (the durable-write limit)"),
    # the naive torch paths
    Tool("naive-st", "naive", _naive(False, "safetensors"), job="convert", writes="naive.safetensors", cold=False,
         description="torch.load + strip keys + safetensors save_file"),
    Tool("naive-st-mmap", "naive", _naive(True, "safetensors"), job="convert", writes="naive.safetensors",
         description="torch.load(mmap=True) + strip keys + save_file"),
    Tool("naive-pt", "naive", _naive(False, "torch"), job="rewrite", writes="naive.pt", cold=False,
         description="torch.load + strip keys + torch.save"),
    Tool("naive-pt-mmap", "naive", _naive(True, "torch"), job="rewrite", writes="naive.pt",
         description="torch.load(mmap=True) + strip keys + torch.save"),
    # ckptool
    Tool("convert", "ckptool", lambda c: _ckptool(c, "convert", str(c.inp.path), "-o", _out(c, "out.safetensors")),
         job="convert", writes="out.safetensors", subcommand="convert", description="ckptool convert CKPT -o OUT.safetensors"),
    Tool("strip", "ckptool", lambda c: _ckptool(c, "strip", str(c.inp.path), "-o", _out(c, "strip.pt")),
         job="rewrite", writes="strip.pt", subcommand="strip", description="ckptool strip CKPT -o OUT"),
    Tool("remap", "ckptool", lambda c: _ckptool(c, "remap", str(c.inp.path), "-o", _out(c, "remap.pt"), "--to", "cpu"),
         job="rewrite", writes="remap.pt", subcommand="remap", description="ckptool remap CKPT -o OUT --to cpu"),
    Tool("inspect", "ckptool", lambda c: _ckptool(c, "inspect", str(c.inp.path)), job="readonly",
         subcommand="inspect", description="ckptool inspect CKPT"),
    Tool("inspect-json", "ckptool", lambda c: _ckptool(c, "inspect", str(c.inp.path), "--json"), job="readonly",
         subcommand="inspect", description="ckptool inspect CKPT --json"),
    Tool("scan", "ckptool", lambda c: _ckptool(c, "scan", str(c.inp.path)), job="readonly", subcommand="scan",
         description="ckptool scan CKPT"),
    Tool("diff", "ckptool", lambda c: _ckptool(c, "diff", str(c.inp.path), str(c.inp.twin)), job="compare",
         twin=True, subcommand="diff", description="ckptool diff A TWIN (same weights, other order)"),
    Tool("verify", "ckptool", lambda c: _ckptool(c, "verify", str(c.inp.path), "--against", str(c.inp.twin)),
         job="compare", twin=True, subcommand="verify", needs_option="--against", max_bytes=GIB,
         description="ckptool verify A --against TWIN"),
]
TOOL_NAMES = [t.name for t in TOOLS]
ALIASES = {"naive": ["naive-st", "naive-st-mmap", "naive-pt", "naive-pt-mmap"],
           "baselines": ["python", "import-torch"], "disk": ["read", "read-both", "cp", "cp+sync"],
           "ckptool": ["help", "convert", "strip", "remap", "inspect", "inspect-json", "scan", "diff", "verify"]}
# what a row is compared with: the disk limit and the naive path of the same job
LIMIT_FOR = {"convert": "cp+sync", "rewrite": "cp+sync", "compare": "read-both", "copy": "cp+sync"}
NAIVE_FOR = {"convert": "naive-st", "rewrite": "naive-pt"}
NAIVE_MMAP_FOR = {"convert": "naive-st-mmap", "rewrite": "naive-pt-mmap"}


def ckptool_availability(python: str) -> dict[str, str]:
    """subcommand -> '' when usable, else why not ('n/a: ...')."""
    env = child_env()
    probe = subprocess.run([python, "-m", "ckptool", "--help"], capture_output=True, text=True, env=env, cwd=REPO)
    result: dict[str, str] = {}
    for tool in TOOLS:
        if tool.group != "ckptool":
            continue
        if probe.returncode != 0:
            result[tool.name] = "n/a: ckptool does not start: " + (probe.stderr.strip().splitlines() or ["?"])[-1]
            continue
        if not tool.subcommand:
            result[tool.name] = ""
            continue
        sub = subprocess.run([python, "-m", "ckptool", tool.subcommand, "--help"], capture_output=True, text=True,
                             env=env, cwd=REPO)
        if sub.returncode != 0:
            result[tool.name] = f"n/a: no `ckptool {tool.subcommand}` yet"
        elif tool.needs_option and tool.needs_option not in sub.stdout:
            result[tool.name] = f"n/a: `ckptool {tool.subcommand}` has no {tool.needs_option} yet"
        else:
            result[tool.name] = ""
    return result


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


# ---------------------------------------------------------------------------------------------
# one measured process


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


# ---------------------------------------------------------------------------------------------
# cache control


def drop_caches_allowed() -> bool:
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("1")
        return True
    except OSError:
        return False


def evict(paths: list[Path], method: str, python: str, env: dict[str, str]) -> None:
    """Make ``paths`` cold in the page cache (untimed)."""
    if method == "drop_caches":
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("1")
        # drop_caches also evicts the interpreter, torch's shared libraries and ckptool's own files;
        # read those back so that only the checkpoint is cold
        subprocess.run([python, "-c", "import torch, safetensors.torch, ckptool.cli"], env=env, cwd=REPO,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        subprocess.run(["sh", "-c", "cp --version; sync --version; cat --version"], stdout=subprocess.DEVNULL)
        return
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def cached_fraction(path: Path) -> float | None:
    """Fraction of ``path``'s pages in the page cache (mincore), None where that cannot be asked."""
    try:
        import ctypes
        import mmap

        size = path.stat().st_size
        if size == 0:
            return 1.0
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
        page = mmap.PAGESIZE
        pages = (size + page - 1) // page
        with open(path, "rb") as f:
            addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, f.fileno(), 0)
            if addr in (None, ctypes.c_void_p(-1).value):
                return None
            try:
                vec = ctypes.create_string_buffer(pages)
                if libc.mincore(addr, size, vec) != 0:
                    return None
                return sum(b & 1 for b in vec.raw) / pages
            finally:
                libc.munmap(addr, size)
    except (OSError, AttributeError, ValueError):
        return None


def warm(paths: list[Path]) -> None:
    for p in paths:
        with open(p, "rb", buffering=0) as f:
            buf = bytearray(8 * MIB)
            while f.readinto(buf):
                pass


# ---------------------------------------------------------------------------------------------
# the run


@dataclass
class Row:
    tool: str
    group: str
    job: str
    description: str
    size: str
    size_bytes: int
    cache: str                        # warm | cold | -
    status: str = "ok"                # ok | n/a | error
    note: str = ""
    runs: list[Run] = field(default_factory=list)

    def median(self, attr: str) -> float | None:
        values = [getattr(r, attr) for r in self.runs]
        return statistics.median(values) if values else None


def clean_dir(path: Path) -> None:
    if path.exists():
        shutil.rmtree(path)
    path.mkdir(parents=True)


def run_bench(args: argparse.Namespace, log: Callable[[str], None]) -> dict:
    started = time.time()
    load_before = os.getloadavg()
    python = args.python
    env = child_env()
    workdir: Path = args.workdir
    workdir.mkdir(parents=True, exist_ok=True)
    out_dir = workdir / "out"
    log_dir = workdir / "log"
    log_dir.mkdir(exist_ok=True)

    selected = select_tools(args.tools)
    avail = ckptool_availability(python) if any(t.group == "ckptool" for t in selected) else {}
    for name, why in avail.items():
        if why and name in {t.name for t in selected}:
            log(f"{name}: {why}")

    cold_method = args.cold_method
    if cold_method == "auto":
        cold_method = "fadvise" if hasattr(os, "posix_fadvise") else "none"
    if cold_method == "drop_caches" and not drop_caches_allowed():
        log("cannot write /proc/sys/vm/drop_caches here: falling back to posix_fadvise(DONTNEED)")
        cold_method = "fadvise"

    bytecode = compile_package(python)
    inputs: list[Input] = []
    for nbytes in args.sizes:
        inputs.append(make_input(workdir, python, nbytes=nbytes, log=log))
    if args.tiny:
        inputs.append(make_input(workdir, python, n_tiny=args.tiny, log=log))
    os.sync()

    rows: dict[tuple[str, str, str], Row] = {}

    def row_for(tool: Tool, inp: Input | None, cache: str) -> Row:
        key = (tool.name, inp.label if inp else "-", cache)
        if key not in rows:
            rows[key] = Row(tool.name, tool.group, tool.job, tool.description, inp.label if inp else "-",
                            inp.file_bytes if inp else 0, cache)
            why = avail.get(tool.name, "")
            if why:
                rows[key].status, rows[key].note = "n/a", why.removeprefix("n/a: ")
        return rows[key]

    def one(tool: Tool, inp: Input | None, cache: str) -> None:
        row = row_for(tool, inp, cache)
        if row.status == "n/a":
            return
        clean_dir(out_dir)
        if cache == "cold" and inp is not None:
            evict([inp.path] + ([inp.twin] if tool.twin else []), cold_method, python, env)
        cached = None
        if inp is not None and tool.reads_input:
            files = [inp.path] + ([inp.twin] if tool.twin else [])
            fractions = [cached_fraction(p) for p in files]
            if cache == "warm" and None not in fractions and min(fractions) < 0.99:
                # memory reclaim (this VM runs DAMON pageout) evicts page cache between runs: warm it again
                warm(files)
                fractions = [cached_fraction(p) for p in files]
            cached = None if None in fractions else min(fractions)
        r = measure(tool.argv(Ctx(python, inp, out_dir)), cwd=REPO, env=env, log_dir=log_dir, interval=args.interval)
        r.cached = cached
        if tool.writes:
            out_file = out_dir / tool.writes
            r.out_bytes = out_file.stat().st_size if out_file.exists() else 0
        row.runs.append(r)
        if r.rc not in tool.ok_codes or (tool.writes and not r.out_bytes):
            row.status = "error"
            why = f"exit {r.rc}" if r.rc not in tool.ok_codes else "wrote no output"
            last = (r.stderr_tail.strip().splitlines() or [""])[-1]
            row.note = f"{why}: {last}"[:300]
            log(f"  {tool.name} [{row.size}, {cache}] failed: {row.note}")
        # clean up outside the timing; sync so that one run's write-back does not land in the next
        shutil.rmtree(out_dir, ignore_errors=True)
        os.sync()

    global_tools = [t for t in selected if not t.per_size]
    size_tools = [t for t in selected if t.per_size]
    skipped: list[str] = []
    if not args.full:
        for t in size_tools:
            if t.max_bytes and any(i.nbytes > t.max_bytes for i in inputs):
                skipped.append(f"{t.name} runs on inputs up to {size_label(t.max_bytes)} only")
            if not t.cold and cold_method != "none":
                skipped.append(f"{t.name} runs warm only")
        if skipped:
            log("without --full: " + "; ".join(skipped))

    def runs_on(tool: Tool, inp: Input, cache: str) -> bool:
        if args.full:
            return True
        if tool.max_bytes and inp.nbytes > tool.max_bytes:
            return False
        return cache == "warm" or tool.cold

    # start-up baselines: one warm-up each, then the repetitions
    if global_tools:
        log("baselines and start-up ...")
        for tool in global_tools:
            if not avail.get(tool.name):
                measure(tool.argv(Ctx(python, None, out_dir)), cwd=REPO, env=env, log_dir=log_dir, interval=args.interval)
        for _ in range(max(args.repeat, 5) if args.repeat >= 3 else args.repeat):  # the baselines want a few runs
            for tool in global_tools:
                one(tool, None, "-")

    for inp in inputs:
        needs_twin = any(t.twin for t in size_tools)
        warm([inp.path] + ([inp.twin] if needs_twin else []))  # the warm-up read
        log(f"{inp.label}: warm cache, {args.repeat} x {len(size_tools)} tools ...")
        for rep in range(args.repeat):
            for tool in size_tools:
                if runs_on(tool, inp, "warm"):
                    one(tool, inp, "warm")
            # a tool's output may have pushed the input out of the cache on a small machine: re-warm
            warm([inp.path] + ([inp.twin] if needs_twin else []))
        if cold_method != "none" and inp.nbytes:  # the tiny input is a few MiB: a cold read of it is noise
            log(f"{inp.label}: cold input ({cold_method}), {args.repeat} x ...")
            for rep in range(args.repeat):
                for tool in size_tools:
                    if tool.reads_input and runs_on(tool, inp, "cold"):
                        one(tool, inp, "cold")
            warm([inp.path])

    shutil.rmtree(out_dir, ignore_errors=True)
    if args.clean_inputs:
        for inp in inputs:
            for p in (inp.path, inp.twin, inp.path.with_suffix(".json")):
                p.unlink(missing_ok=True)

    result = summarize(list(rows.values()), inputs, args, cold_method, python, started, bytecode)
    result["meta"]["not_run_without_full"] = skipped
    loads = [x.load1 for r in rows.values() for x in r.runs]
    result["meta"]["load1_before"] = round(load_before[0], 2)
    result["meta"]["load1_during_median"] = round(statistics.median(loads), 2) if loads else None
    result["meta"]["load1_during_max"] = round(max(loads), 2) if loads else None
    return result


def select_tools(spec: str) -> list[Tool]:
    if not spec or spec == "all":
        return list(TOOLS)
    wanted: list[str] = []
    for name in (s.strip() for s in spec.split(",")):
        if not name:
            continue
        names = ALIASES.get(name, [name])
        for n in names:
            if n not in TOOL_NAMES:
                raise SystemExit(f"bench: unknown tool {n!r}; known: {', '.join(TOOL_NAMES)} "
                                 f"(groups: {', '.join(ALIASES)})")
            wanted.append(n)
    # the references the ratios need come along
    for n in list(wanted):
        tool = next(t for t in TOOLS if t.name == n)
        for ref in (LIMIT_FOR.get(tool.job), NAIVE_FOR.get(tool.job)):
            if ref and ref not in wanted and tool.group == "ckptool":
                wanted.append(ref)
        if tool.group in ("ckptool", "naive") and "python" not in wanted:
            wanted.append("python")
        if tool.group in ("ckptool", "naive") and "import-torch" not in wanted:
            wanted.append("import-torch")
    return [t for t in TOOLS if t.name in wanted]


# ---------------------------------------------------------------------------------------------
# summary, table, goals


def summarize(rows: list[Row], inputs: list[Input], args: argparse.Namespace, cold_method: str, python: str,
              started: float, bytecode: str = "") -> dict:
    by_key = {(r.tool, r.size, r.cache): r for r in rows}
    base_anon = {}
    for name in ("python", "import-torch"):
        r = by_key.get((name, "-", "-"))
        if r and r.runs and r.status == "ok":
            # the floor: a ~140 MiB transient of anonymous memory shows up in some `import torch` runs on
            # this VM and not in others; the baseline is what the interpreter needs at least
            base_anon[name] = min(x.anon_mib for x in r.runs)

    out_rows = []
    for r in rows:
        d: dict = {"tool": r.tool, "group": r.group, "job": r.job, "description": r.description, "size": r.size,
                   "size_bytes": r.size_bytes, "cache": r.cache, "status": r.status, "note": r.note}
        if r.runs:
            torch_loaded = any(x.torch_loaded for x in r.runs)
            base = None
            if r.group in ("ckptool", "naive") or r.tool == "import-torch":
                base = "import-torch" if torch_loaded else "python"
            if r.tool in ("python", "import-torch"):
                base = None
            anon = r.median("anon_mib")
            d.update({
                "times_s": [round(x.wall_s, 4) for x in r.runs],
                "median_s": r.median("wall_s"),
                "min_s": min(x.wall_s for x in r.runs),
                "cpu_s": r.median("cpu_s"),
                "anon_peak_mib": anon,
                "anon_peak_max_mib": max(x.anon_mib for x in r.runs),
                "rss_peak_mib": r.median("rss_mib"),
                "rss_peak_max_mib": max(x.rss_mib for x in r.runs),
                "torch_loaded": torch_loaded,
                "anon_baseline": base,
                "anon_over_baseline_mib": (anon - base_anon[base]) if base and base in base_anon else None,
                "out_bytes": max(x.out_bytes for x in r.runs),
                "exit_codes": sorted({x.rc for x in r.runs}),
                "samples": min(x.samples for x in r.runs),
                "load1": max(x.load1 for x in r.runs),
                "input_cached": ([x.cached for x in r.runs] if any(x.cached is not None for x in r.runs) else None),
            })
            if r.status == "error":
                d["stderr_tail"] = r.runs[-1].stderr_tail
            limit = LIMIT_FOR.get(r.job)
            ref = by_key.get((limit, r.size, r.cache)) if limit else None
            if ref and ref.runs and ref.status == "ok" and r.tool != limit:
                d["limit_tool"], d["x_limit"] = limit, d["median_s"] / ref.median("wall_s")
            for key, table in (("x_naive", NAIVE_FOR), ("x_naive_mmap", NAIVE_MMAP_FOR)):
                naive = table.get(r.job)
                ref = by_key.get((naive, r.size, r.cache)) if naive else None
                if r.group == "ckptool" and ref and ref.runs and ref.status == "ok":
                    d[key + "_tool"], d[key] = naive, d["median_s"] / ref.median("wall_s")
        out_rows.append(d)

    goals = evaluate_goals(out_rows, inputs)
    meta = {
        "started": _dt.datetime.fromtimestamp(started).isoformat(timespec="seconds"),
        "duration_s": round(time.time() - started, 1),
        "python": python,
        "python_version": platform.python_version(),
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "mem_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GIB, 1),
        "repeat": args.repeat,
        "statistic": "median",
        "cache_warm": "one warm-up read of the input(s) before the warm repetitions",
        "cold_method": cold_method,
        "sampling_interval_s": args.interval,
        "workdir": str(args.workdir),
        "git": _git_rev(),
        "bytecode": bytecode,
    }
    return {"meta": meta,
            "inputs": [{"label": i.label, "path": str(i.path), "file_bytes": i.file_bytes, "tensors": i.tensors,
                        "twin_bytes": i.twin.stat().st_size if i.twin.exists() else None,
                        "generated_s": round(i.gen_s, 2), "reused": i.reused} for i in inputs],
            "rows": out_rows, "goals": goals}


def _git_rev() -> str:
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "ckptool"], cwd=REPO, capture_output=True,
                               text=True).stdout.strip()
        return rev + ("+dirty" if dirty else "")
    except OSError:
        return "?"


def evaluate_goals(rows: list[dict], inputs: list[Input]) -> list[dict]:
    goals: list[dict] = []
    ok = [r for r in rows if r["status"] == "ok" and "median_s" in r]

    def get(tool: str, size: str, cache: str) -> dict | None:
        return next((r for r in ok if r["tool"] == tool and r["size"] == size and r["cache"] == cache), None)

    def status_of(tool: str) -> str:
        r = next((r for r in rows if r["tool"] == tool), None)
        return "n/a" if r is None else r["status"]

    def add(goal: str, tool: str, size: str, value: float | None, target: str, passed: bool | None, detail: str = ""):
        goals.append({"goal": goal, "tool": tool, "size": size, "value": value, "target": target,
                      "status": "n/a" if passed is None else ("PASS" if passed else "MISS"), "detail": detail})

    labels = [i.label for i in inputs]
    big = [i.label for i in inputs if i.nbytes]
    for tool in ("convert", "strip", "remap"):
        if status_of(tool) != "ok":
            add("<= 1.2x cp+sync, >= 4x faster than naive, anon <= 64 MiB over base, flat", tool, "all", None, "",
                None, next((r["note"] for r in rows if r["tool"] == tool), "not run"))
            continue
        for size in labels:
            for cache in ("warm", "cold"):
                r = get(tool, size, cache)
                if not r:
                    continue
                if "x_limit" in r and size in big:  # not for the 10k-tiny file: `cp` of 2 MB is start-up alone
                    add("time vs cp+sync", tool, f"{size} {cache}", r["x_limit"], f"<= {GOAL_REWRITE_VS_DISK}x",
                        r["x_limit"] <= GOAL_REWRITE_VS_DISK)
                if "x_naive" in r:
                    speedup = 1 / r["x_naive"]
                    extra = f"vs mmap naive {1 / r['x_naive_mmap']:.1f}x" if "x_naive_mmap" in r else ""
                    add(f"speed-up over naive ({r['x_naive_tool']})", tool, f"{size} {cache}", speedup,
                        f">= {GOAL_REWRITE_VS_NAIVE}x", speedup >= GOAL_REWRITE_VS_NAIVE, extra)
                elif "x_naive_mmap" in r:  # cold rows: only the mmap variant runs cold by default
                    speedup = 1 / r["x_naive_mmap"]
                    add(f"speed-up over naive ({r['x_naive_mmap_tool']})", tool, f"{size} {cache}", speedup,
                        f">= {GOAL_REWRITE_VS_NAIVE}x", speedup >= GOAL_REWRITE_VS_NAIVE)
            r = get(tool, size, "warm")
            if r and r.get("anon_over_baseline_mib") is not None:
                add(f"peak anon over {r['anon_baseline']}", tool, size, r["anon_over_baseline_mib"],
                    f"<= {GOAL_ANON_OVER_BASE_MIB:g} MiB", r["anon_over_baseline_mib"] <= GOAL_ANON_OVER_BASE_MIB)
        sized = [get(tool, s, "warm") for s in big]
        sized = [r for r in sized if r]
        if len(sized) >= 2:
            growth = sized[-1]["anon_peak_mib"] - sized[0]["anon_peak_mib"]
            add("anon flat in size", tool, f"{sized[0]['size']} -> {sized[-1]['size']}", growth,
                f"<= {GOAL_ANON_FLAT_MIB:g} MiB growth", growth <= GOAL_ANON_FLAT_MIB)
    for tool in ("inspect", "inspect-json", "scan"):
        if status_of(tool) != "ok":
            add("whole process <= 0.15 s", tool, "all", None, "", None, "not run / n/a")
            continue
        for size in labels:
            for cache in ("warm", "cold"):
                r = get(tool, size, cache)
                if r:
                    add("whole process time (s)", tool, f"{size} {cache}", r["median_s"], f"<= {GOAL_READONLY_S} s",
                        r["median_s"] <= GOAL_READONLY_S)
    for tool in ("diff", "verify"):
        if status_of(tool) != "ok":
            add("<= 2x reading both files once", tool, "all", None, "", None,
                next((r["note"] for r in rows if r["tool"] == tool), "not run"))
            continue
        # the goal is for two 1 GiB checkpoints: at a few MB, `cat` takes milliseconds and the
        # ratio only measures interpreter start-up
        for size in [i.label for i in inputs if i.nbytes >= GIB]:
            for cache in ("warm", "cold"):
                r = get(tool, size, cache)
                if r and "x_limit" in r:
                    add("time vs reading both files (cat A B)", tool, f"{size} {cache}", r["x_limit"],
                        f"<= {GOAL_COMPARE_VS_READ}x", r["x_limit"] <= GOAL_COMPARE_VS_READ)
    r = get("help", "-", "-")
    if r:
        add("ckptool --help whole process (s)", "help", "-", r["median_s"], f"<= {GOAL_HELP_S} s",
            r["median_s"] <= GOAL_HELP_S)
    elif status_of("help") != "ok":
        add("ckptool --help whole process (s)", "help", "-", None, "", None, "not run")
    return goals


def _fmt(value: float | None, spec: str, unit: str = "") -> str:
    return "" if value is None else f"{value:{spec}}{unit}"


def render_markdown(result: dict) -> str:
    meta, rows = result["meta"], result["rows"]
    lines = [f"# ckptool benchmark", "",
             f"{meta['started']}, git {meta['git']}, {meta['platform']}, {meta['cpus']} CPUs, {meta['mem_gib']} GiB RAM, "
             f"Python {meta['python_version']}. Median of {meta['repeat']} whole-process runs (wall clock). "
             f"warm = page cache warm (one warm-up read, re-read when reclaim evicted it); "
             + (f"cold = input evicted with {meta['cold_method']} before each run. " if meta["cold_method"] != "none"
                else "no cold runs. ") +
             f"Run took {meta['duration_s']:.0f} s.", ""]
    if meta.get("load1_during_max") is not None and meta["load1_during_max"] > 1.5:
        lines += [f"**Note:** the machine was busy during the run (1-min load average {meta['load1_before']} before, "
                  f"median {meta['load1_during_median']}, max {meta['load1_during_max']} during, on {meta['cpus']} CPUs): "
                  "other processes competed for the CPUs and the disk; times are noisier than on an idle machine "
                  "(bench.json keeps every run and the load at its start).", ""]
    lines += ["Inputs: " + "; ".join(f"{i['label']} = {i['file_bytes'] / MIB:.1f} MiB file, {i['tensors']} tensors"
                                     for i in result["inputs"]), ""]
    header = ("| size | cache | tool | median s | × limit | × naive | anon MiB (over base) | peak RSS MiB | note |\n"
              "|---|---|---|---:|---:|---:|---:|---:|---|")
    lines.append(header)
    for r in rows:
        if r["status"] != "ok" and "median_s" not in r:
            lines.append(f"| {r['size']} | {r['cache']} | {r['tool']} | n/a | | | | | {r['note']} |")
            continue
        xl = f"{r['x_limit']:.2f} ({'cp+sync' if r['limit_tool'] == 'cp+sync' else 'read A+B'})" if "x_limit" in r else ""
        parts = []
        if "x_naive" in r:
            parts.append(f"{r['x_naive']:.2f}")
        if "x_naive_mmap" in r:
            parts.append(f"{r['x_naive_mmap']:.2f} mmap")
        xn = " / ".join(parts)
        anon = f"{r['anon_peak_mib']:.1f}"
        if r.get("anon_over_baseline_mib") is not None:
            anon += f" (+{r['anon_over_baseline_mib']:.1f} {'torch' if r['anon_baseline'] == 'import-torch' else 'py'})"
        notes = [r["note"]] if r["status"] != "ok" else []
        if r.get("torch_loaded") and r["group"] == "ckptool":
            notes.append("loads torch")
        cached = [c for c in (r.get("input_cached") or []) if c is not None]
        if cached and r["cache"] == "warm" and min(cached) < 0.95:
            notes.append(f"input only {100 * min(cached):.0f}% cached")
        if cached and r["cache"] == "cold" and max(cached) > 0.05:
            notes.append(f"input {100 * max(cached):.0f}% cached despite eviction")
        note = "; ".join(notes)
        status = "" if r["status"] == "ok" else f"**{r['status']}** "
        lines.append(f"| {r['size']} | {r['cache']} | {r['tool']} | {status}{r['median_s']:.3f} | {xl} | {xn} | {anon} | "
                     f"{r['rss_peak_mib']:.0f} | {note} |")
    lines += ["", "× limit: time over `cp+sync` (writers) or over `cat A B` (diff/verify), same size and cache state. "
              "× naive: time over the naive torch path of the same job (convert: torch.load + save_file; strip/remap: "
              "torch.load + torch.save), then over its mmap=True variant. anon: peak RssAnon (summed over the process "
              "tree), in brackets over the matching interpreter baseline (py = `python -c pass`, torch = "
              "`python -c \"import torch\"`, chosen by whether the process mapped libtorch; the baseline is the lowest of its "
              "runs). peak RSS: ru_maxrss.", ""]
    if meta.get("not_run_without_full"):
        lines += ["Left out to keep the run short (`--full` runs them): " + "; ".join(meta["not_run_without_full"]) + ".", ""]
    lines += ["## Goals", "", "| goal | tool | size | value | target | status | detail |", "|---|---|---|---:|---|---|---|"]
    for g in result["goals"]:
        value = "" if g["value"] is None else f"{g['value']:.3g}"
        lines.append(f"| {g['goal']} | {g['tool']} | {g['size']} | {value} | {g['target']} | {g['status']} | {g['detail']} |")
    passed = sum(g["status"] == "PASS" for g in result["goals"])
    missed = sum(g["status"] == "MISS" for g in result["goals"])
    na = sum(g["status"] == "n/a" for g in result["goals"])
    lines += ["", f"{passed} met, {missed} missed, {na} not measurable (tool missing).", ""]
    lines.append(f"Plot: {meta.get('plot', '')}")
    return "\n".join(lines) + "\n"


def plot(result: dict, path: Path) -> str:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "skipped: matplotlib is not importable (it is not a dependency; pip install matplotlib to get bench.png)"
    sized = {i["label"]: i["file_bytes"] for i in result["inputs"] if "tiny" not in i["label"]}
    if len(sized) < 1:
        return "skipped: no sized inputs"
    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(13, 5))
    tools = []
    for r in result["rows"]:
        if r["size"] in sized and r["cache"] == "warm" and "median_s" in r and r["tool"] not in tools:
            tools.append(r["tool"])
    for tool in tools:
        pts = sorted((sized[r["size"]] / GIB, r["median_s"], r["anon_peak_mib"]) for r in result["rows"]
                     if r["tool"] == tool and r["size"] in sized and r["cache"] == "warm" and "median_s" in r)
        style = "-o" if tool in ("convert", "strip", "remap", "diff", "verify", "inspect", "scan") else "--."
        ax_t.plot([p[0] for p in pts], [p[1] for p in pts], style, label=tool)
        ax_m.plot([p[0] for p in pts], [p[2] for p in pts], style, label=tool)
    ax_t.set(xlabel="checkpoint size (GiB)", ylabel="median wall time (s)", title="time, warm cache")
    ax_m.set(xlabel="checkpoint size (GiB)", ylabel="peak RssAnon (MiB)", title="peak anonymous memory")
    for ax in (ax_t, ax_m):
        ax.grid(True, alpha=0.3)
    ax_m.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return f"written: {path.name}"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="0.25,1,2",
                   help="checkpoint sizes, comma-separated; GiB by default, or with a unit: 5M, 512MiB, 1G (default 0.25,1,2)")
    p.add_argument("--tiny", type=int, default=10000, help="also a checkpoint of this many tiny tensors (0: none; default 10000)")
    p.add_argument("--repeat", type=int, default=3, help="runs per measurement; the median is reported (default 3)")
    p.add_argument("--tools", default="all", help=f"comma-separated: {', '.join(TOOL_NAMES)}, or a group: "
                                                  f"{', '.join(ALIASES)} (default all)")
    p.add_argument("--workdir", type=Path, default=DEFAULT_WORKDIR,
                   help=f"where checkpoints are generated once and reused (default {DEFAULT_WORKDIR})")
    p.add_argument("--results", type=Path, default=DEFAULT_RESULTS, help="where bench.json/md/png go (default bench/results)")
    p.add_argument("--cold-method", choices=("auto", "fadvise", "drop_caches", "none"), default="auto",
                   help="how the cold-input runs evict the input: posix_fadvise(DONTNEED) on the input (auto: the default) "
                        "or drop_caches (root; then re-reads the interpreter and torch so only the input is cold); "
                        "none: skip the cold runs")
    p.add_argument("--interval", type=float, default=0.005, help="memory sampling interval in seconds (default 0.005)")
    p.add_argument("--python", default=sys.executable, help="interpreter for ckptool and the naive scripts (default: this one)")
    p.add_argument("--full", action="store_true",
                   help="also the runs left out by default to keep the time down: the plain (non-mmap) naive paths "
                        "with a cold input, and verify on inputs over 1 GiB")
    p.add_argument("--clean-inputs", action="store_true", help="delete the generated checkpoints at the end")
    p.add_argument("--quiet", action="store_true")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.sizes = [parse_size(s) for s in args.sizes.split(",") if s.strip()]
    if args.repeat < 1:
        raise SystemExit("bench: --repeat must be >= 1")

    def log(msg: str) -> None:
        if not args.quiet:
            print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)

    result = run_bench(args, log)
    args.results.mkdir(parents=True, exist_ok=True)
    result["meta"]["plot"] = plot(result, args.results / "bench.png")
    md = render_markdown(result)
    (args.results / "bench.json").write_text(json.dumps(result, indent=2))
    (args.results / "bench.md").write_text(md)
    print(md)
    print(f"written: {args.results / 'bench.json'}, {args.results / 'bench.md'}", file=sys.stderr)
    return 0
