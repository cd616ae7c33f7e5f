"""From runs to results: the rows (medians, ratios to the disk limit and the naive path, memory over the
interpreter baseline), ``bench.md``'s table and goals, and ``bench.png``."""

from __future__ import annotations

import argparse
import statistics
from dataclasses import dataclass, field
from pathlib import Path

from .goals import evaluate_goals
from .inputs import Input
from .measure import GIB, MIB, Run, git_rev, machine_meta
from .tools import LIMIT_FOR, NAIVE_FOR, NAIVE_MMAP_FOR

# a warm run whose input was less cached than this just before it is named in the report
WARM_ENOUGH = 0.95


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

    out_rows = [_summarize_row(r, by_key, base_anon) for r in rows]
    goals = evaluate_goals(out_rows, inputs)
    meta = {
        **machine_meta(started, python),
        "repeat": args.repeat,
        "statistic": "median",
        "cache_warm": "one warm-up read of the input(s) before the warm repetitions",
        "cold_method": cold_method,
        "sampling_interval_s": args.interval,
        "workdir": str(args.workdir),
        "git": git_rev(),
        "bytecode": bytecode,
    }
    return {"meta": meta,
            "inputs": [{"label": i.label, "path": str(i.path), "file_bytes": i.file_bytes, "tensors": i.tensors,
                        "twin_bytes": i.twin.stat().st_size if i.twin.exists() else None,
                        "generated_s": round(i.gen_s, 2), "reused": i.reused} for i in inputs],
            "rows": out_rows, "goals": goals}


def _summarize_row(r: Row, by_key: dict[tuple[str, str, str], Row], base_anon: dict[str, float]) -> dict:
    d: dict = {"tool": r.tool, "group": r.group, "job": r.job, "description": r.description, "size": r.size,
               "size_bytes": r.size_bytes, "cache": r.cache, "status": r.status, "note": r.note}
    if not r.runs:
        return d
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
    return d


def render_markdown(result: dict) -> str:
    meta, rows = result["meta"], result["rows"]
    lines = ["# ckptool benchmark", "",
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
        if cached and r["cache"] == "warm" and min(cached) < WARM_ENOUGH:
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
    sized = {i["label"]: i["file_bytes"] for i in result["inputs"] if not i["label"].endswith(("tiny", "tensors"))}
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
