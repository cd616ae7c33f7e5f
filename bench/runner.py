"""The run of ``python -m bench``: inputs generated, then every selected tool measured on every input,
warm and cold, ``--repeat`` times; the rows summarized into the result."""

from __future__ import annotations

import argparse
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path

from .cache import cached, drop_caches_allowed, evict, rewarm, warm
from .inputs import Input, make_input, size_label
from .measure import REPO, child_env, compile_package, load_meta, measure, measure_in
from .report import Row, summarize
from .tools import Ctx, Tool, ckptool_availability, select_tools


class _Runner:
    """Measures one tool on one input in one cache state and files the run under its row."""

    def __init__(self, args: argparse.Namespace, log: Callable[[str], None], avail: dict[str, str],
                 cold_method: str) -> None:
        self.args, self.log, self.avail, self.cold_method = args, log, avail, cold_method
        self.python, self.env = args.python, child_env()
        self.out_dir: Path = args.workdir / "out"
        self.log_dir: Path = args.workdir / "log"
        self.log_dir.mkdir(exist_ok=True)
        self.rows: dict[tuple[str, str, str], Row] = {}

    def row_for(self, tool: Tool, inp: Input | None, cache: str) -> Row:
        key = (tool.name, inp.label if inp else "-", cache)
        if key not in self.rows:
            self.rows[key] = Row(tool.name, tool.group, tool.job, tool.description, inp.label if inp else "-",
                                 inp.file_bytes if inp else 0, cache)
            why = self.avail.get(tool.name, "")
            if why:
                self.rows[key].status, self.rows[key].note = "n/a", why.removeprefix("n/a: ")
        return self.rows[key]

    def warm_up(self, tool: Tool) -> None:
        """One untimed run (a start-up baseline's first, which loads the interpreter's files)."""
        measure(tool.argv(Ctx(self.python, None, self.out_dir)), cwd=REPO, env=self.env, log_dir=self.log_dir,
                interval=self.args.interval)

    def one(self, tool: Tool, inp: Input | None, cache: str) -> None:
        row = self.row_for(tool, inp, cache)
        if row.status == "n/a":
            return
        files = [] if inp is None else [inp.path] + ([inp.twin] if tool.twin else [])
        if cache == "cold" and inp is not None:
            evict(files, self.cold_method, self.python, self.env)
        fraction = None
        if inp is not None and tool.reads_input:
            fraction = rewarm(files) if cache == "warm" else cached(files)
        r = measure_in(self.out_dir, tool.argv(Ctx(self.python, inp, self.out_dir)), tool.writes, cwd=REPO,
                       env=self.env, log_dir=self.log_dir, interval=self.args.interval)
        r.cached = fraction
        row.runs.append(r)
        if r.rc not in tool.ok_codes or (tool.writes and not r.out_bytes):
            row.status = "error"
            why = f"exit {r.rc}" if r.rc not in tool.ok_codes else "wrote no output"
            last = (r.stderr_tail.strip().splitlines() or [""])[-1]
            row.note = f"{why}: {last}"[:300]
            self.log(f"  {tool.name} [{row.size}, {cache}] failed: {row.note}")

    def runs_on(self, tool: Tool, inp: Input, cache: str) -> bool:
        if self.args.full:
            return True
        if tool.max_bytes and inp.nbytes > tool.max_bytes:
            return False
        return cache == "warm" or tool.cold


def run_bench(args: argparse.Namespace, log: Callable[[str], None]) -> dict:
    started = time.time()
    load_before = os.getloadavg()
    python = args.python
    args.workdir.mkdir(parents=True, exist_ok=True)

    selected = select_tools(args.tools)
    avail = ckptool_availability(python) if any(t.group == "ckptool" for t in selected) else {}
    for name, why in avail.items():
        if why and name in {t.name for t in selected}:
            log(f"{name}: {why}")
    cold_method = _cold_method(args.cold_method, log)
    runner = _Runner(args, log, avail, cold_method)

    bytecode = compile_package(python)
    inputs: list[Input] = []
    for nbytes in args.sizes:
        inputs.append(make_input(args.workdir, python, nbytes=nbytes, log=log))
    if args.tiny:
        inputs.append(make_input(args.workdir, python, n_tiny=args.tiny, log=log))
    if getattr(args, "many_tensors", 0):
        inputs.append(make_input(args.workdir, python, n_many=args.many_tensors, log=log))
    os.sync()

    global_tools = [t for t in selected if not t.per_size]
    size_tools = [t for t in selected if t.per_size]
    skipped = [] if args.full else _left_out(size_tools, inputs, cold_method)
    if skipped:
        log("without --full: " + "; ".join(skipped))

    # start-up baselines: one warm-up each, then the repetitions
    if global_tools:
        log("baselines and start-up ...")
        for tool in global_tools:
            if not avail.get(tool.name):
                runner.warm_up(tool)
        for _ in range(max(args.repeat, 5) if args.repeat >= 3 else args.repeat):  # the baselines want a few runs
            for tool in global_tools:
                runner.one(tool, None, "-")
    for inp in inputs:
        _measure_input(runner, inp, size_tools)

    shutil.rmtree(runner.out_dir, ignore_errors=True)
    if args.clean_inputs:
        for inp in inputs:
            for p in (inp.path, inp.twin, inp.path.with_suffix(".json")):
                p.unlink(missing_ok=True)

    result = summarize(list(runner.rows.values()), inputs, args, cold_method, python, started, bytecode)
    result["meta"]["not_run_without_full"] = skipped
    result["meta"].update(load_meta(load_before[0], [x.load1 for r in runner.rows.values() for x in r.runs]))
    return result


def _cold_method(method: str, log: Callable[[str], None]) -> str:
    if method == "auto":
        method = "fadvise" if hasattr(os, "posix_fadvise") else "none"
    if method == "drop_caches" and not drop_caches_allowed():
        log("cannot write /proc/sys/vm/drop_caches here: falling back to posix_fadvise(DONTNEED)")
        method = "fadvise"
    return method


def _left_out(size_tools: list[Tool], inputs: list[Input], cold_method: str) -> list[str]:
    """The runs left out without ``--full``, in words."""
    skipped: list[str] = []
    for t in size_tools:
        if t.max_bytes and any(i.nbytes > t.max_bytes for i in inputs):
            skipped.append(f"{t.name} runs on inputs up to {size_label(t.max_bytes)} only")
        if not t.cold and cold_method != "none":
            skipped.append(f"{t.name} runs warm only")
    return skipped


def _measure_input(runner: _Runner, inp: Input, size_tools: list[Tool]) -> None:
    repeat, cold_method, log = runner.args.repeat, runner.cold_method, runner.log
    needs_twin = any(t.twin for t in size_tools)
    warm([inp.path] + ([inp.twin] if needs_twin else []))  # the warm-up read
    log(f"{inp.label}: warm cache, {repeat} x {len(size_tools)} tools ...")
    for _ in range(repeat):
        for tool in size_tools:
            if runner.runs_on(tool, inp, "warm"):
                runner.one(tool, inp, "warm")
        # a tool's output may have pushed the input out of the cache on a small machine: re-warm
        warm([inp.path] + ([inp.twin] if needs_twin else []))
    if cold_method != "none" and inp.nbytes:  # the tiny input is a few MiB: a cold read of it is noise
        log(f"{inp.label}: cold input ({cold_method}), {repeat} x ...")
        for _ in range(repeat):
            for tool in size_tools:
                if tool.reads_input and runner.runs_on(tool, inp, "cold"):
                    runner.one(tool, inp, "cold")
        warm([inp.path])
