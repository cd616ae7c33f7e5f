"""ckptool on torch.distributed.checkpoint (DCP) directories: does memory stay flat as checkpoints grow?

Run as ``python -m bench.dcp`` (see bench/README.md, "DCP"). It generates DCP checkpoints of
``--sizes`` GiB once in ``--workdir`` (a real 2-process gloo save: every parameter a DTensor split
``Shard(0)`` over 2 ranks, as FSDP2 holds it, so the large tensors lie in 2 chunks in 2 ``.distcp``
files), then measures whole processes, like ``python -m bench``:

  * ``cp+sync``      ``cp -r DIR OUT`` + ``sync`` of every copied file (the durable-write limit),
  * ``convert-st``   ``ckptool convert DIR -o OUT.safetensors``,
  * ``convert-pt``   ``ckptool convert DIR -o OUT.pt``,
  * ``inspect``      ``ckptool inspect DIR``,
  * ``torch-dcp``    ``torch.distributed.checkpoint.format_utils.dcp_to_torch_save(DIR, OUT.pt)``:
                     torch's own consolidation, which loads the whole state dict into memory (no fsync),

recording wall time (median of ``--repeat``), peak RssAnon over the interpreter baseline and peak RSS
(the samplers of bench/measure.py). Results: ``bench/results/dcp.json`` and ``dcp.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from .cache import evict, rewarm, warm
from .cli import add_last_options, add_measure_options, parse_tool_list
from .inputs import parse_size, parse_sizes
from .measure import (
    GIB,
    MIB,
    REPO,
    Run,
    child_env,
    compile_package,
    git_rev,
    load_meta,
    machine_meta,
    measure_in,
    stderr_logger,
    write_results,
)

DEFAULT_RESULTS = Path(__file__).resolve().parent / "results"
DEFAULT_WORKDIR = Path(tempfile.gettempdir()) / "ckptool-bench-dcp"
GEN_VERSION = 1  # bump when the generated checkpoints change shape
DEFAULT_LARGEST_MIB = 256
LAYER_MIB = 128

# One rank of the generator: joins a gloo group through a FileStore (no ports), builds its local shards
# and saves them with DCP. Every tensor is filled from a per-tensor seed, so both ranks agree on what
# the whole tensor is without ever building it.
GEN_SCRIPT = r'''
import json, math, os, sys, time
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

out, nbytes, largest, layer_bytes, store = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
mode = sys.argv[6]  # shard0 (FSDP2), shard1 (columns: tensor parallel's row-wise layers) or no_dist
torch.set_num_threads(1)
rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
H = 4096
sharded = mode != "no_dist"
if sharded:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,))

def fill(t, seed):
    g = torch.Generator().manual_seed(seed)
    if t.dtype.is_floating_point:
        t.normal_(generator=g)
    else:
        t.random_(0, 1 << 20, generator=g)
    return t

def param(shape, dtype, seed):
    """A parameter as FSDP2 holds it: a DTensor split Shard(0) (torch.chunk rows), or Shard(1) (columns;
    1-D tensors stay Shard(0)), or a plain tensor."""
    if not sharded:
        return fill(torch.empty(shape, dtype=dtype), seed)
    dim = 1 if mode == "shard1" and len(shape) > 1 else 0
    n = shape[dim]
    per = -(-n // world)
    start, stop = min(rank * per, n), min(rank * per + per, n)
    local_shape = list(shape)
    local_shape[dim] = stop - start
    # the local shard only; its content depends on (seed, rank)
    local = fill(torch.empty(local_shape, dtype=dtype), seed * 64 + rank)
    stride = tuple(math.prod(shape[i + 1:]) for i in range(len(shape)))
    return DTensor.from_local(local, mesh, [Shard(dim)], run_check=False, shape=torch.Size(shape), stride=stride)

sd, seed = {}, 1
# a few hundred small tensors: norms and biases (sharded too, as FSDP2 shards every parameter),
# plus int64 counters kept as plain (replicated) tensors
n_blocks = 60 if nbytes >= (256 << 20) else 12
for b in range(n_blocks):
    for name in ("attn_norm.weight", "ffn_norm.weight", "attn.o_proj.bias", "mlp.down_proj.bias"):
        sd[f"layers.{b}.{name}"] = param((H,), torch.float32, seed); seed += 1
    sd[f"layers.{b}.attn.rope_cache_version"] = torch.tensor(b, dtype=torch.int64)
small = sum(t.numel() * t.element_size() for t in sd.values())
# the largest tensor: an embedding, bf16 [rows, H]
emb_rows = max(2, largest // (2 * H))
sd["embed_tokens.weight"] = param((emb_rows, H), torch.bfloat16, seed); seed += 1
rest = max(nbytes - small - emb_rows * 2 * H, 2 * 4 * H)
n_layers = max(2, round(rest / layer_bytes))
for j in range(n_layers):
    dtype = torch.float32 if j % 2 == 0 else torch.bfloat16
    esize = 4 if dtype == torch.float32 else 2
    rows = max(2, rest // n_layers // (esize * H))
    rows += (j % 3 == 2) and rows > 2  # some odd row counts: uneven shards, as torch.chunk gives them
    sd[f"layers.{j % n_blocks}.mlp.w{j // n_blocks}.weight"] = param((rows, H), dtype, seed); seed += 1
state = {"model": sd, "step": 1000}
t0 = time.perf_counter()
dcp.save(state, checkpoint_id=out, no_dist=not sharded)
if sharded:
    dist.barrier()
    dist.destroy_process_group()
if rank == 0:
    sizes = [(tuple(t.shape), t.numel() * t.element_size()) for t in sd.values()]
    print(json.dumps({"tensors": len(sd), "bytes": sum(s for _, s in sizes), "largest_bytes": max(s for _, s in sizes),
                      "large_tensors": sum(s >= (16 << 20) for _, s in sizes), "torch": torch.__version__,
                      "save_s": round(time.perf_counter() - t0, 2)}))
'''

CHECK_SCRIPT = r'''
import json, sys
from collections import Counter
sys.path.insert(0, sys.argv[2])
from ckptool.formats import dcp
from ckptool import pickles
from pathlib import Path
meta = dcp.parse_metadata(Path(sys.argv[1]), pickles.GlobalResolver(()))
chunks = Counter(len(e.chunks) for e in meta.entries if hasattr(e, "chunks"))
print(json.dumps({"chunks_per_tensor": {str(k): v for k, v in sorted(chunks.items())}, "data_files": [p.name for p in meta.files]}))
'''

TORCH_SCRIPT = r'''
import sys
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
dcp_to_torch_save(sys.argv[1], sys.argv[2])
'''


@dataclass
class DcpInput:
    label: str
    nbytes: int
    path: Path
    meta: dict = field(default_factory=dict)
    files: list[Path] = field(default_factory=list)
    dir_bytes: int = 0
    gen_s: float = 0.0
    reused: bool = False
    skipped: str = ""


@dataclass
class Tool:
    name: str
    argv: Callable[[str, DcpInput, Path], list[str]]
    output: str = ""            # what it writes under the output dir
    description: str = ""
    torch: bool = False          # baseline: import torch rather than python


def _ck(py: str, *args: str) -> list[str]:
    return [py, "-m", "ckptool", *args]


TOOLS = [
    Tool("cp+sync", lambda py, i, o: ["sh", "-c", 'cp -r "$1" "$2" && sync "$2"/.metadata "$2"/* "$2"', "sh",
                                      str(i.path), str(o / "copy")],
         "copy", "cp -r DIR OUT && sync every file (the durable-write limit)"),
    Tool("convert-st", lambda py, i, o: _ck(py, "convert", str(i.path), "-o", str(o / "out.safetensors")),
         "out.safetensors", "ckptool convert DIR -o OUT.safetensors"),
    Tool("convert-pt", lambda py, i, o: _ck(py, "convert", str(i.path), "-o", str(o / "out.pt")),
         "out.pt", "ckptool convert DIR -o OUT.pt"),
    Tool("inspect", lambda py, i, o: _ck(py, "inspect", str(i.path)), "", "ckptool inspect DIR"),
    Tool("torch-dcp", lambda py, i, o: [py, "-c", TORCH_SCRIPT, str(i.path), str(o / "torch.pt")],
         "torch.pt", "torch dcp_to_torch_save(DIR, OUT.pt) (all in RAM; no fsync)", torch=True),
]
TOOL_NAMES = [t.name for t in TOOLS]


SAVED_BY = {"sharded": "a 2-process gloo DCP save of Shard(0) DTensors",  # GEN_VERSION 1 inputs call it so
            "shard0": "a 2-process gloo DCP save of Shard(0) DTensors",
            "shard1": "a 2-process gloo DCP save of Shard(1) DTensors (2-D ones; 1-D Shard(0))"}


def _label(nbytes: int) -> str:
    return f"{nbytes / GIB:g} GiB"


def _dir_files(path: Path) -> list[Path]:
    return sorted(p for p in path.iterdir() if p.is_file())


def generate(inp: DcpInput, python: str, largest: int, log: Callable[[str], None], ranks: int = 2,
             modes: tuple[str, ...] = ("shard0", "no_dist")) -> None:
    meta_path = inp.path.with_suffix(".json")
    if inp.path.is_dir() and meta_path.exists():
        inp.meta, inp.reused = json.loads(meta_path.read_text()), True
    else:
        if inp.path.exists():
            shutil.rmtree(inp.path)
        env = child_env()
        env["OMP_NUM_THREADS"] = "1"
        layer = min(LAYER_MIB * MIB, max(inp.nbytes // 8, 4 * MIB))
        t0 = time.perf_counter()
        meta = None
        for mode in modes:
            log(f"generating {inp.label} DCP checkpoint ({mode}, {1 if mode == 'no_dist' else ranks} process(es)) "
                f"in {inp.path} ...")
            with tempfile.TemporaryDirectory(prefix="dcp-store-") as tmp:
                store = str(Path(tmp) / "store")
                procs = []
                n = 1 if mode == "no_dist" else ranks
                for rank in range(n):
                    penv = dict(env, RANK=str(rank), WORLD_SIZE=str(n), LOCAL_RANK=str(rank))
                    procs.append(subprocess.Popen(
                        [python, "-c", GEN_SCRIPT, str(inp.path), str(inp.nbytes), str(largest), str(layer), store, mode],
                        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=penv, cwd=REPO))
                outs = [p.communicate() for p in procs]
            if all(p.returncode == 0 for p in procs):
                meta = json.loads(outs[0][0].strip().splitlines()[-1])
                meta["mode"] = mode
                break
            log(f"{mode} save failed: {outs[0][1][-1500:] or outs[-1][1][-1500:]}")
            shutil.rmtree(inp.path, ignore_errors=True)
        if meta is None:
            raise SystemExit(f"bench.dcp: generating {inp.label} failed")
        if meta["mode"] != modes[0]:
            meta["note"] = (f"the {modes[0]} (2-process) save failed; fell back to a single-process no_dist save "
                            "(1 chunk/tensor)")
        meta["gen_s"] = round(time.perf_counter() - t0, 1)
        check = subprocess.run([python, "-c", CHECK_SCRIPT, str(inp.path), str(REPO)], capture_output=True,
                               text=True, env=env, check=False)
        if check.returncode == 0:
            meta.update(json.loads(check.stdout.strip().splitlines()[-1]))
        for p in _dir_files(inp.path):
            with open(p, "rb+") as f:
                os.fsync(f.fileno())
        meta_path.write_text(json.dumps(meta))
        inp.meta, inp.gen_s = meta, meta["gen_s"]
    inp.files = _dir_files(inp.path)
    inp.dir_bytes = sum(p.stat().st_size for p in inp.files)


def _fit(points: list[tuple[float, float]]) -> tuple[float, float] | None:
    """Least-squares (slope, intercept) of y over x."""
    if len(points) < 2:
        return None
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    var = sum((x - mx) ** 2 for x in xs)
    if not var:
        return None
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var
    return slope, my - slope * mx


def run(args: argparse.Namespace, log: Callable[[str], None]) -> dict:
    started = time.time()
    python, env = args.python, child_env()
    workdir: Path = args.workdir
    workdir.mkdir(parents=True, exist_ok=True)
    out_dir, log_dir = workdir / "out", workdir / "log"
    log_dir.mkdir(exist_ok=True)
    tools = [t for t in TOOLS if t.name in args.tools]
    load_before = os.getloadavg()[0]
    log(f"1-min load average {load_before:.2f} on {os.cpu_count()} CPUs; ckptool bytecode: {compile_package(python)}")

    def one(argv: list[str], output: str = "") -> Run:
        return measure_in(out_dir, argv, output, cwd=REPO, env=env, log_dir=log_dir, interval=args.interval)

    # interpreter baselines (min of a few runs: the floor)
    base: dict[str, float] = {}
    base_rss: dict[str, float] = {}
    for name, argv in (("python", [python, "-c", "pass"]), ("import-torch", [python, "-c", "import torch"])):
        runs = [one(argv) for _ in range(max(3, args.repeat))]
        base[name] = min(r.anon_mib for r in runs)
        base_rss[name] = min(r.rss_mib for r in runs)
    log(f"baselines: python {base['python']:.1f} MiB anon, import torch {base['import-torch']:.1f} MiB anon")

    inputs = [_input(args, nbytes, log) for nbytes in args.sizes]
    os.sync()

    rows: list[dict] = []
    for inp in inputs:
        if inp.skipped:
            continue
        log(f"{inp.label}: {len(inp.files)} files, {inp.dir_bytes / MIB:.0f} MiB, {inp.meta.get('tensors')} tensors, "
            f"largest {inp.meta.get('largest_bytes', 0) / MIB:.0f} MiB; {args.repeat} x {len(tools)} tools ...")
        warm(inp.files)
        runs: dict[str, list[Run]] = {t.name: [] for t in tools}
        for _ in range(args.repeat):
            for tool in tools:
                if args.cache == "cold":
                    evict(inp.files, "fadvise", python, env)
                    cached = None
                else:
                    cached = rewarm(inp.files)
                r = one(tool.argv(python, inp, out_dir), tool.output)
                r.cached = cached
                runs[tool.name].append(r)
                if r.rc != 0 or (tool.output and not r.out_bytes):
                    last = (r.stderr_tail.strip().splitlines() or [""])[-1]
                    log(f"  {tool.name} [{inp.label}] failed (exit {r.rc}): {last[:300]}")
        rows.extend(_row(inp, tool, runs[tool.name], base) for tool in tools)
    for r in rows:
        ref = next((x for x in rows if x["tool"] == "cp+sync" and x["size"] == r["size"]), None)
        if ref and r["tool"] not in ("cp+sync", "inspect"):
            r["x_cp_sync"] = r["median_s"] / ref["median_s"]

    meta = {
        **machine_meta(started, python),
        "repeat": args.repeat, "statistic": "median", "cache": args.cache, "save": args.save,
        "sampling_interval_s": args.interval,
        "workdir": str(workdir), "git": git_rev(), "baseline_anon_mib": base, "baseline_rss_mib": base_rss,
        **load_meta(load_before, [x for r in rows for x in r["load1"]]),
    }
    result = {"meta": meta, "inputs": [{"label": i.label, "path": str(i.path), "dir_bytes": i.dir_bytes,
                                        "files": len(i.files), "generated_s": i.gen_s, "reused": i.reused,
                                        "skipped": i.skipped, **i.meta} for i in inputs], "rows": rows}
    result["fits"] = fits(rows)
    result["projection"] = project(result["fits"], rows)
    return result


def _input(args: argparse.Namespace, nbytes: int, log: Callable[[str], None]) -> DcpInput:
    """The input of ``nbytes``, generated unless reused; skipped (saying why) when the disk cannot hold it."""
    workdir: Path = args.workdir
    largest = min(args.largest, nbytes // 2)  # the smoke run's 0.05 GiB: half the checkpoint
    suffix = {"shard0": "", "shard1": "-shard1", "no_dist": "-nodist"}[args.save]
    inp = DcpInput(_label(nbytes), nbytes, workdir / f"dcp-{nbytes}-L{largest}-v{GEN_VERSION}{suffix}")
    free = shutil.disk_usage(workdir).free
    have = inp.path.is_dir() and inp.path.with_suffix(".json").exists()
    need = (0 if have else int(nbytes * 1.05)) + int(nbytes * 1.05) + 512 * MIB  # input + one output + margin
    if free < need:
        inp.skipped = f"skipped: needs {need / GIB:.1f} GiB of disk in {workdir}, {free / GIB:.1f} GiB free"
        log(f"{inp.label}: {inp.skipped}")
    else:
        generate(inp, args.python, largest, log,
                 modes=(args.save, "no_dist") if args.save != "no_dist" else ("no_dist",))
    return inp


def _row(inp: DcpInput, tool: Tool, rs: list[Run], base: dict[str, float]) -> dict:
    """One tool's runs on one input, summarized."""
    torch_loaded = any(r.torch_loaded for r in rs)
    # cp+sync is no python process: its memory is shown as is
    which = None if tool.name == "cp+sync" else "import-torch" if torch_loaded or tool.torch else "python"
    anon = statistics.median(r.anon_mib for r in rs)
    return {
        "size": inp.label, "size_bytes": inp.nbytes, "dir_bytes": inp.dir_bytes, "tool": tool.name,
        "description": tool.description, "ok": all(r.rc == 0 for r in rs),
        "exit_codes": sorted({r.rc for r in rs}),
        "times_s": [round(r.wall_s, 4) for r in rs], "median_s": statistics.median(r.wall_s for r in rs),
        "min_s": min(r.wall_s for r in rs), "cpu_s": statistics.median(r.cpu_s for r in rs),
        "anon_peak_mib": anon, "anon_peak_max_mib": max(r.anon_mib for r in rs),
        "anon_baseline": which, "anon_over_baseline_mib": anon - base[which] if which else anon,
        "rss_peak_mib": statistics.median(r.rss_mib for r in rs),
        "torch_loaded": torch_loaded, "out_bytes": max(r.out_bytes for r in rs),
        "largest_tensor_mib": inp.meta.get("largest_bytes", 0) / MIB,
        "load1": [round(r.load1, 2) for r in rs], "input_cached": [r.cached for r in rs],
        "stderr_tail": "" if all(r.rc == 0 for r in rs) else rs[-1].stderr_tail,
    }


def fits(rows: list[dict]) -> dict:
    """Per tool: time and memory against checkpoint size (least squares over the sizes measured)."""
    out: dict[str, dict] = {}
    for name in TOOL_NAMES:
        rs = [r for r in rows if r["tool"] == name and r["ok"]]
        t = _fit([(r["dir_bytes"] / GIB, r["median_s"]) for r in rs])
        m = _fit([(r["dir_bytes"] / GIB, r["anon_over_baseline_mib"]) for r in rs])
        if t or m:
            out[name] = {"s_per_gib": t[0] if t else None, "s_fixed": t[1] if t else None,
                         "anon_mib_per_gib": m[0] if m else None, "anon_mib_fixed": m[1] if m else None,
                         "anon_min_mib": min(r["anon_over_baseline_mib"] for r in rs),
                         "anon_max_mib": max(r["anon_over_baseline_mib"] for r in rs)}
    return out


def project(fit: dict, rows: list[dict]) -> dict:
    """On paper: a 70B-parameter bf16 checkpoint (140 GB) whose largest tensor is a 128k x 8192 bf16 embedding."""
    total = 70e9 * 2
    largest = 128256 * 8192 * 2
    out: dict = {"checkpoint_bytes": total, "largest_tensor_bytes": largest}
    for name in ("cp+sync", "convert-st", "convert-pt", "torch-dcp"):
        f = fit.get(name)
        if f and f["s_per_gib"] is not None:
            out[f"{name}_s"] = f["s_fixed"] + f["s_per_gib"] * total / GIB
    # memory: ckptool's peak over the baseline. Where it reaches half the largest tensor or more, some tensor
    # is held whole (split chunks assembled) and it is scaled with the largest tensor; below that nothing
    # is held whole (every tensor copied or streamed piece by piece) and it is taken as constant
    for name in ("convert-st", "convert-pt"):
        rs = [r for r in rows if r["tool"] == name and r["ok"] and r["largest_tensor_mib"]]
        if rs:
            r = max(rs, key=lambda r: r["dir_bytes"])
            ratio = r["anon_over_baseline_mib"] / r["largest_tensor_mib"]
            out[f"{name}_anon_mib_measured"] = r["anon_over_baseline_mib"]
            out[f"{name}_x_largest"] = ratio
            out[f"{name}_scales_with_tensor"] = ratio >= 0.5
            out[f"{name}_anon_gib"] = (ratio * largest if ratio >= 0.5 else r["anon_over_baseline_mib"] * MIB) / GIB
    rs = [r for r in rows if r["tool"] == "torch-dcp" and r["ok"]]
    if rs:
        r = max(rs, key=lambda r: r["dir_bytes"])
        out["torch-dcp_x_checkpoint"] = r["anon_over_baseline_mib"] * MIB / r["dir_bytes"]
        out["torch-dcp_anon_gib"] = out["torch-dcp_x_checkpoint"] * total / GIB
    return out


def render(result: dict) -> str:
    meta, rows = result["meta"], result["rows"]
    lines = ["# ckptool on DCP checkpoints", "",
             (f"{meta['started']}, git {meta['git']}, {meta['platform']}, {meta['cpus']} CPUs, {meta['mem_gib']} GiB RAM, "
             f"Python {meta['python_version']}. Median of {meta['repeat']} whole-process runs (wall clock), "
             f"input {'warm in the page cache' if meta['cache'] == 'warm' else 'evicted before each run (fadvise)'}. "
             f"1-min load average: {meta['load1_before']} before, median {meta['load1_during_median']}, "
             f"max {meta['load1_during_max']} during. Run took {meta['duration_s']:.0f} s."), ""]
    if meta.get("load1_during_max") is not None and meta["load1_during_max"] > 1.5:
        lines += [(f"**Note:** the machine was busy (load up to {meta['load1_during_max']} on {meta['cpus']} CPUs); "
                  "times are noisier than on an idle machine, memory is not affected."), ""]
    for i in result["inputs"]:
        if i["skipped"]:
            lines.append(f"- {i['label']}: {i['skipped']}")
            continue
        chunks = ", ".join(f"{v} in {k} chunk(s)" for k, v in i.get("chunks_per_tensor", {}).items())
        lines.append(f"- {i['label']}: {i['dir_bytes'] / MIB:.0f} MiB in {i['files']} files, {i['tensors']} tensors "
                     f"({chunks}; {i.get('large_tensors')} of ≥ 16 MiB), largest {i['largest_bytes'] / MIB:.0f} MiB; "
                     f"saved by {SAVED_BY.get(i.get('mode'), 'a no_dist DCP save')}"
                     + (f" — {i['note']}" if i.get("note") else "") + f" (generated in {i.get('gen_s')} s)")
    lines += ["", "| size | tool | median s | × cp+sync | peak anon MiB over baseline | peak RSS MiB | largest tensor MiB |",
              "|---|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        x = f"{r['x_cp_sync']:.2f}" if "x_cp_sync" in r else ""
        anon = (f"{r['anon_over_baseline_mib']:+.1f} ({'torch' if r['anon_baseline'] == 'import-torch' else 'py'})"
                if r["anon_baseline"] else f"{r['anon_peak_mib']:.1f} (absolute)")
        status = "" if r["ok"] else f"**exit {r['exit_codes']}** "
        lines.append(f"| {r['size']} | {r['tool']} | {status}{r['median_s']:.2f} | {x} | {anon} | {r['rss_peak_mib']:.0f} | "
                     f"{r['largest_tensor_mib']:.0f} |")
    lines += ["", "Tools: " + "; ".join(f"`{t.name}` = {t.description}" for t in TOOLS) + ". "
              "peak anon: peak RssAnon (sampled every "
              f"{meta['sampling_interval_s'] * 1000:g} ms, summed over the process tree) minus the interpreter baseline "
              f"(py = `python -c pass`, {meta['baseline_anon_mib']['python']:.1f} MiB; torch = `python -c \"import torch\"`, "
              f"{meta['baseline_anon_mib']['import-torch']:.1f} MiB). peak RSS: ru_maxrss (includes the baseline and "
              "file pages mapped).", ""]
    f = result["fits"]
    if f:
        lines += ["## Per GiB (least squares over the sizes)", "",
                  "| tool | s per GiB | s fixed | anon MiB per GiB | anon MiB fixed | anon over baseline, min … max |",
                  "|---|---:|---:|---:|---:|---|"]
        for name, v in f.items():
            def g(x, spec=".2f"):
                return "" if x is None else format(x, spec)
            lines.append(f"| {name} | {g(v['s_per_gib'])} | {g(v['s_fixed'])} | {g(v['anon_mib_per_gib'], '.1f')} | "
                         f"{g(v['anon_mib_fixed'], '.1f')} | {v['anon_min_mib']:.0f} … {v['anon_max_mib']:.0f} MiB |")
        p = result["projection"]
        lines += ["", ("## On paper: a 70B-parameter bf16 checkpoint (140 GB, largest tensor a 128256 × 8192 bf16 "
                  f"embedding = {p['largest_tensor_bytes'] / GIB:.2f} GiB)"), ""]
        for name in ("cp+sync", "convert-st", "convert-pt", "torch-dcp"):
            if f"{name}_s" in p:
                lines.append(f"- {name}: ~{p[f'{name}_s'] / 60:.1f} min (the fit above, at this machine's disk speed, "
                             f"input {'warm' if meta['cache'] == 'warm' else 'cold'})")
        for name in ("convert-st", "convert-pt"):
            if p.get(f"{name}_scales_with_tensor"):
                lines.append(f"- {name} memory: peak anon here = {p[f'{name}_x_largest']:.2f} × the largest tensor "
                             f"(tensors held whole) → ~{p[f'{name}_anon_gib']:.1f} GiB for the 2 GiB embedding")
            elif f"{name}_anon_gib" in p:
                lines.append(f"- {name} memory: {p[f'{name}_anon_mib_measured']:.0f} MiB over the baseline here, "
                             f"{p[f'{name}_x_largest']:.2f} × the largest tensor: no tensor is held whole, so it stays "
                             "about that for any size")
        if "torch-dcp_anon_gib" in p:
            lines.append(f"- torch-dcp memory: peak anon here = {p['torch-dcp_x_checkpoint']:.2f} × the checkpoint → "
                         f"~{p['torch-dcp_anon_gib']:.0f} GiB for 140 GB")
    return "\n".join(lines) + "\n"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.dcp", description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="0.5,1,2,4", help="checkpoint sizes, GiB or with a unit (default 0.5,1,2,4)")
    p.add_argument("--repeat", type=int, default=3, help="runs per measurement; the median is reported (default 3)")
    p.add_argument("--tools", default="all", help=f"comma-separated subset of {', '.join(TOOL_NAMES)} (default all)")
    p.add_argument("--largest", type=parse_size, default=DEFAULT_LARGEST_MIB * MIB,
                   help="size of the largest tensor (an embedding), at most half the checkpoint (default 256M)")
    p.add_argument("--save", choices=("shard0", "shard1", "no_dist"), default="shard0",
                   help="how the inputs are saved: a 2-process DCP save of DTensors split Shard(0) (default; FSDP2: "
                        "every tensor in 2 chunks of whole rows) or Shard(1) (2 chunks of columns: what tensor "
                        "parallelism's row-wise layers give; these must be assembled), or a single-process no_dist "
                        "save (every tensor one chunk)")
    p.add_argument("--cache", choices=("warm", "cold"), default="warm",
                   help="input warm in the page cache (default) or evicted with fadvise before each run")
    p.add_argument("--workdir", type=Path, default=DEFAULT_WORKDIR,
                   help=f"where the checkpoints are generated once and reused (default {DEFAULT_WORKDIR})")
    p.add_argument("--results", type=Path, default=DEFAULT_RESULTS, help="where dcp.json/md go (default bench/results)")
    add_measure_options(p, python_for="ckptool and torch")
    add_last_options(p)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.sizes = parse_sizes(args.sizes)
    args.tools = parse_tool_list(args.tools, TOOL_NAMES, "bench.dcp")
    if args.repeat < 1:
        raise SystemExit("bench.dcp: --repeat must be >= 1")

    result = run(args, stderr_logger("bench.dcp", args.quiet))
    if args.clean_inputs:
        for i in result["inputs"]:
            shutil.rmtree(i["path"], ignore_errors=True)
            Path(i["path"]).with_suffix(".json").unlink(missing_ok=True)
    args.results.mkdir(parents=True, exist_ok=True)
    write_results(args.results, "dcp", result, render(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
