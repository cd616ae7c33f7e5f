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

Modules: ``inputs`` (the generated checkpoints), ``tools`` (what is run), ``measure`` (one measured
process), ``cache`` (page-cache control), ``runner`` (the run), ``report`` (rows, table, plot),
``goals`` (the targets), ``cli`` (the options); ``dcp`` is ``python -m bench.dcp``.
"""

from __future__ import annotations

from .cli import build_parser, main
from .inputs import Input, make_input, parse_size, size_label
from .measure import GIB, MIB, REPO, Run  # not measure(): it would hide the module bench.measure
from .runner import run_bench
from .tools import ALIASES, TOOL_NAMES, TOOLS, Tool, select_tools

__all__ = ["ALIASES", "GIB", "MIB", "REPO", "TOOLS", "TOOL_NAMES", "Input", "Run", "Tool", "build_parser", "main",
           "make_input", "parse_size", "run_bench", "select_tools", "size_label"]
