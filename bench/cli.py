"""``python -m bench``'s options, and the run from parsing to the written results."""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import bench

from .inputs import parse_sizes
from .measure import stderr_logger, write_results
from .report import plot, render_markdown
from .runner import run_bench
from .tools import ALIASES, TOOL_NAMES

DEFAULT_RESULTS = Path(__file__).resolve().parent / "results"
DEFAULT_WORKDIR = Path(tempfile.gettempdir()) / "ckptool-bench"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench", description=bench.__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="0.25,1,2",
                   help="checkpoint sizes, comma-separated; GiB by default, or with a unit: 5M, 512MiB, 1G (default 0.25,1,2)")
    p.add_argument("--tiny", type=int, default=10000, help="also a checkpoint of this many tiny tensors (0: none; default 10000)")
    p.add_argument("--many-tensors", type=int, default=0, metavar="N",
                   help="also an MoE-like checkpoint of N small tensors of mixed shapes and dtypes (e.g. 100000; "
                        "default 0: none)")
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
    add_last_options(p)
    return p


def add_measure_options(p: argparse.ArgumentParser, *, python_for: str) -> None:
    """The sampling interval and the interpreter: options of ``python -m bench.dcp`` and ``bench.remote``."""
    p.add_argument("--interval", type=float, default=0.005, help="memory sampling interval in seconds (default 0.005)")
    p.add_argument("--python", default=sys.executable, help=f"interpreter for {python_for} (default: this one)")


def parse_tool_list(text: str, known: list[str], prog: str) -> list[str]:
    """``--tools``: ``all`` or a comma-separated subset of ``known``; an unknown name ends the run."""
    tools = known if text == "all" else [t.strip() for t in text.split(",") if t.strip()]
    unknown = [t for t in tools if t not in known]
    if unknown:
        raise SystemExit(f"{prog}: unknown tool(s) {unknown}; known: {', '.join(known)}")
    return tools


def add_last_options(p: argparse.ArgumentParser) -> None:
    """The options both ``python -m bench`` and ``python -m bench.dcp`` end with."""
    p.add_argument("--clean-inputs", action="store_true", help="delete the generated checkpoints at the end")
    p.add_argument("--quiet", action="store_true")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.sizes = parse_sizes(args.sizes)
    if args.repeat < 1:
        raise SystemExit("bench: --repeat must be >= 1")
    result = run_bench(args, stderr_logger("bench", args.quiet))
    args.results.mkdir(parents=True, exist_ok=True)
    result["meta"]["plot"] = plot(result, args.results / "bench.png")
    write_results(args.results, "bench", result, render_markdown(result))
    return 0
