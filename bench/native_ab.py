"""A/B of each C entry point against its Python twin, on the workloads users run.

```
python -m bench.native_ab                                  # small: 10,000 tensors, 64 MiB, ResNet-18; 3 runs
python -m bench.native_ab --many 100000 --big 1G --repeat 3
python -m bench.native_ab --many 100000 --big 0 --no-resnet --cases inspect,convert --split-all
python -m bench.native_ab --many 100000 --big 0 --no-resnet --only-sets --set 'no load=load'
```

Each measured run is a whole process (``python -m bench.native_ab _child SPEC``) that turns the chosen C entry points
off in-process, then runs the ``ckptool`` command (or ``ckptool.load``, the phase every read command waits on). An
entry point is turned off by replacing it with what sends its caller to the Python twin (the C function replaced by
one returning ``NotImplemented`` or its reference, or the module flag its caller tests), never by an environment
switch, so the same toggles work whatever the switches are called.

Stages, per case (a command on a workload): first one run with every entry point counted, to learn which ones the
case calls; then, interleaved over ``--repeat`` rounds, all in C, all in Python, and each group (the entry points
behind one ``CKPTOOL_PURE_PYTHON_*`` switch) that the case calls in Python; then each entry point of a group alone, interleaved with all-C again (its ratio is against those runs), where
the group in Python was at least ``--split`` times slower or broke a goal that all-C met (a single entry point costs
no more than its group, so the others cannot reach the bar). Times are medians of wall-clock process times;
``phase`` is the time inside the process from just before the command to its exit, imports of ckptool excluded.
Outputs are removed and ``sync`` called between runs, untimed; inputs are read once first (a warm cache).

The inputs are generated with torch in ``--workdir`` (default ``/tmp/ckptool-native-ab``, not the repository):
each with DDP's ``module.`` key prefix (what ``strip`` removes): a torchvision ResNet-18 ``state_dict`` (where torchvision imports), ``--many`` small tensors (an MoE-like state
dict, saved by ``torch.save`` and as ``.safetensors``), and a ``--big`` checkpoint of four large tensors.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .inputs import parse_size, size_label
from .measure import REPO, child_env, compile_package

# the entry points, by the group (the switch) their twins sit behind; where each lives and what replaces it is
# in _install below
GROUPS: dict[str, tuple[str, ...]] = {
    "guard": ("walk",),
    "unpickle": ("load",),
    "header": ("parse_header",),
}
ENTRIES = tuple(entry for group in GROUPS.values() for entry in group)
GROUP_OF = {entry: group for group, entries in GROUPS.items() for entry in entries}
C_FILE = {"guard": "native/_guard.c", "unpickle": "native/_fastload.c", "header": "native/_fastload.c"}


# ------------------------------------------------------------------------------------------------ the child


def _decline(*args: Any, **kwargs: Any) -> Any:
    return NotImplemented


def _install(python: list[str], counts: dict[str, int] | None) -> list[str]:
    """Turn the ``python`` entry points off (their callers then run the Python twins); with ``counts``, count the
    calls of every entry point left on. Returns the entry points not found in this checkout."""
    from ckptool.pickles import opcode_guard, unpickle

    fastload = getattr(unpickle, "_fastload", None)
    missing = []

    def counted(entry: str, function: Any) -> Any:
        if counts is None or function is None:
            return function

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            counts[entry] = counts.get(entry, 0) + 1
            return function(*args, **kwargs)
        return wrapper

    for entry in ENTRIES:
        off = entry in python
        if entry == "walk":
            if off:
                opcode_guard.NATIVE = False
            elif opcode_guard.NATIVE:
                opcode_guard._native_walk = counted(entry, opcode_guard._native_walk)
            else:
                missing.append(entry)
            continue
        native = getattr(fastload, entry, None)
        if native is None:
            missing.append(entry)
            continue
        if not off:
            setattr(fastload, entry, counted(entry, native))
        elif entry == "load":
            setattr(fastload, entry, _decline)
        elif entry == "parse_header":
            setattr(fastload, entry, lambda *args: None)
    return missing


def child(spec: dict[str, Any]) -> None:
    """One measured process: the toggles, then the command; its phase time (and counts) written to spec["report"]."""
    counts: dict[str, int] | None = {} if spec.get("probe") else None
    missing = _install(spec["python"], counts)
    report = Path(spec["report"])
    argv = spec["argv"]
    started = time.perf_counter()

    def write() -> None:
        report.write_text(json.dumps({"phase": time.perf_counter() - started, "counts": counts, "missing": missing}))

    if argv[0] == "load":  # the read every command starts with, in-process
        import ckptool

        checkpoint = ckptool.load(argv[1])
        len(checkpoint.tensors)
        write()
        return
    from ckptool.cli import main as cli

    atexit.register(write)  # cli.run runs the exit handlers before its os._exit
    sys.argv = ["ckptool", *argv]
    cli.run()


# ------------------------------------------------------------------------------------------------ the inputs


GEN_SCRIPT = r'''
import json, os, sys, torch
kind, path, size = sys.argv[1], sys.argv[2], int(sys.argv[3])
g = torch.Generator().manual_seed(0)
sd = {}
if kind == "resnet18":
    import torchvision
    torch.manual_seed(0)
    sd = torchvision.models.resnet18().state_dict()
elif kind == "many":  # an MoE-like state dict of small tensors of mixed shapes and dtypes
    dtypes = (torch.float32, torch.bfloat16, torch.float16)
    i = layer = 0
    while len(sd) < size:
        pre = f"model.layers.{layer}"
        sd[f"{pre}.input_layernorm.weight"] = torch.randn(16, generator=g)
        sd[f"{pre}.mlp.gate.weight"] = torch.randn(16, 8, generator=g).to(torch.bfloat16)
        sd[f"{pre}.mlp.tokens_seen"] = torch.tensor(layer, dtype=torch.int64)
        for j in range(64):
            for name in ("gate_proj", "up_proj", "down_proj"):
                sd[f"{pre}.mlp.experts.{j}.{name}.weight"] = torch.randn(8, 8, generator=g).to(dtypes[i % 3])
                i += 1
        layer += 1
    sd = dict(list(sd.items())[:size])
else:  # a few large tensors filling `size` bytes
    cols = 4096
    rows = max(1, size // 4 // 4 // cols)
    sd = {f"model.large.{j}.weight": torch.randn(rows, cols, generator=g) for j in range(4)}
sd = {"module." + key: value for key, value in sd.items()}  # DDP-wrapped, as strip expects
torch.save(sd, path + ".tmp")
os.replace(path + ".tmp", path)
if kind == "many":
    import safetensors.torch
    safetensors.torch.save_file(sd, path[:-3] + ".safetensors.tmp")
    os.replace(path[:-3] + ".safetensors.tmp", path[:-3] + ".safetensors")
print(json.dumps({"tensors": len(sd)}))
'''


@dataclass
class Workload:
    name: str  # what the table calls it
    path: Path
    kind: str  # resnet18 | many | big
    safetensors: Path | None = None


def make_inputs(args: argparse.Namespace, log: Any) -> list[Workload]:
    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    wanted = []
    if args.resnet:
        wanted.append(("resnet18", "resnet18", 0, "ResNet-18"))
    if args.many:
        wanted.append(("many", f"many-{args.many}", args.many, f"{args.many:,} tensors"))
    if args.big:
        wanted.append(("big", f"big-{args.big}", args.big, size_label(args.big)))
    found = []
    for kind, stem, size, label in wanted:
        path = work / f"{stem}.pt"
        st = path.with_suffix(".safetensors") if kind == "many" else None
        if not path.exists() or (st is not None and not st.exists()):
            log(f"generating {label} in {work} ...")
            done = subprocess.run([args.python, "-c", GEN_SCRIPT, kind, str(path), str(size)], capture_output=True,
                                  text=True, check=False)
            if done.returncode != 0:
                if kind == "resnet18" and "torchvision" in done.stderr:
                    log("torchvision not importable: no ResNet-18 workload")
                    continue
                raise SystemExit(f"native_ab: generating {label} failed:\n{done.stderr[-3000:]}")
        found.append(Workload(label, path, kind, st))
    return found


# ------------------------------------------------------------------------------------------------ the cases


@dataclass
class Case:
    workload: Workload
    command: str  # what the table calls it
    argv: list[str]  # ckptool's arguments ("load PATH": the in-process read); OUT stands for the output
    output: str | None  # the output's file name in the scratch folder
    goal: float | None = None  # seconds (or None)
    goal_text: str = ""
    runs: dict[str, list[tuple[float, float]]] = field(default_factory=dict)  # variant -> [(wall, phase)]
    called: list[str] = field(default_factory=list)


def cases_for(workloads: list[Workload], wanted: set[str]) -> list[Case]:
    cases = []
    for w in workloads:
        pt = str(w.path)
        many = w.kind == "many"
        table = [("load", ["load", pt], None, None, ""),
                 ("inspect", ["inspect", pt], None, 1.0 if many else None, "<= 1 s" if many else ""),
                 ("scan", ["scan", pt], None, None, ""),
                 ("convert", ["convert", pt, "-o", "OUT"], "out.safetensors", 2.5 if many else None,
                  "<= 2.5 s" if many else ""),
                 ("strip", ["strip", pt, "-o", "OUT"], "out.pt", 2.5 if many else None, "<= 2.5 s" if many else "")]
        if w.safetensors is not None:
            st = str(w.safetensors)
            table += [("load", ["load", st], None, None, ""),
                      ("inspect", ["inspect", st], None, 1.0, "<= 1 s"),
                      ("convert", ["convert", st, "-o", "OUT"], "out.pt", 2.5, "<= 2.5 s")]
        for command, argv, output, goal, goal_text in table:
            if command not in wanted:
                continue
            suffix = "" if argv[1] == pt else " (.safetensors)"
            label = f"{command} {'-> ' + output if output else ''}".strip() + suffix
            cases.append(Case(w, label, argv, output, goal, goal_text))
        if w.kind == "big" and "convert" in wanted:
            cases.append(Case(w, "cp+sync", ["cp+sync", pt, "OUT"], "out.bin"))
    return cases


class Runner:
    def __init__(self, args: argparse.Namespace, log: Any) -> None:
        self.args, self.log = args, log
        self.scratch = Path(args.workdir) / "out"
        self.env = child_env()
        for name in list(self.env):
            if name.startswith("CKPTOOL_PURE_PYTHON"):
                del self.env[name]  # the toggles decide, not a switch left set

    def run(self, case: Case, python: list[str], probe: bool = False) -> tuple[float, float, dict]:
        shutil.rmtree(self.scratch, ignore_errors=True)
        self.scratch.mkdir(parents=True)
        os.sync()
        out = str(self.scratch / case.output) if case.output else ""
        argv = [out if a == "OUT" else a for a in case.argv]
        report = self.scratch / "report.json"
        if argv[0] == "cp+sync":
            command = ["sh", "-c", f"cp '{argv[1]}' '{argv[2]}' && sync '{argv[2]}'"]
        else:
            spec = {"python": python, "argv": argv, "report": str(report), "probe": probe}
            command = [self.args.python, "-m", "bench.native_ab", "_child", json.dumps(spec)]
        t0 = time.perf_counter()
        done = subprocess.run(command, cwd=REPO, env=self.env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                              text=True, timeout=self.args.timeout, check=False)
        wall = time.perf_counter() - t0
        if done.returncode != 0:
            raise SystemExit(f"native_ab: {case.workload.name} {case.command} (Python: {python}) exited "
                             f"{done.returncode}:\n{done.stderr[-2000:]}")
        found = json.loads(report.read_text()) if report.exists() else {"phase": wall}
        return wall, found["phase"], found

    def measure(self, case: Case, variants: dict[str, list[str]]) -> None:
        names = list(variants)
        for round_ in range(self.args.repeat):
            order = names[round_ % len(names):] + names[:round_ % len(names)]  # interleaved, rotated each round
            for name in order:
                wall, phase, _ = self.run(case, variants[name])
                case.runs.setdefault(name, []).append((wall, phase))
                self.log(f"  {case.workload.name} | {case.command} | {name}: {wall:.3f} s")


SPLIT_BASE = "all C (beside the entry points)"


def median(case: Case, variant: str, index: int = 0) -> float:
    return statistics.median(run[index] for run in case.runs[variant])


def measure_case(runner: Runner, case: Case, args: argparse.Namespace) -> None:
    if case.argv[0] == "cp+sync":
        runner.measure(case, {"cp+sync": []})
        return
    _, _, probe = runner.run(case, [], probe=True)
    missing = probe.get("missing") or []
    case.called = [entry for entry in ENTRIES if (probe.get("counts") or {}).get(entry)]
    groups = [group for group, entries in GROUPS.items() if any(entry in case.called for entry in entries)]
    every = [entry for entry in ENTRIES if entry not in missing]
    variants: dict[str, list[str]] = {"all C": []}
    if not args.only_sets:
        variants["all Python"] = every
        if len(groups) > 1:
            variants.update({f"{group} (group)": list(GROUPS[group]) for group in groups})
    variants.update(args.sets)
    runner.measure(case, variants)
    if args.only_sets:
        return
    base = median(case, "all C")
    split = []
    for group in groups:
        called = [entry for entry in GROUPS[group] if entry in case.called]
        if len(called) < 2:
            continue
        got = median(case, f"{group} (group)" if len(groups) > 1 else "all Python")
        breaks = case.goal is not None and base <= case.goal < got
        if args.split_all or got / base >= args.split or breaks:
            split += called
    if split:  # interleaved with all-C again: each entry point's ratio is against the runs beside it
        runner.measure(case, {SPLIT_BASE: [], **{entry: [entry] for entry in split}})


# ------------------------------------------------------------------------------------------------ the table


def table(cases: list[Case]) -> str:
    lines = [("| workload | command | C entry points called | in Python | all-C s | Python s | ratio | phase C s | "
              "phase Py s | goal | goal met without it |"),
             "|---|---|---|---|---:|---:|---:|---:|---:|---|---|"]
    for case in cases:
        if "cp+sync" in case.runs:
            lines.append(f"| {case.workload.name} | cp+sync | | | {median(case, 'cp+sync'):.3f} | | | | | | |")
            continue
        called = ", ".join(case.called) or "none"
        for variant in case.runs:
            if variant in ("all C", SPLIT_BASE):
                continue
            reference = SPLIT_BASE if variant in ENTRIES and SPLIT_BASE in case.runs else "all C"
            base, base_phase = median(case, reference), median(case, reference, 1)
            got, phase = median(case, variant), median(case, variant, 1)
            goal = case.goal_text or ""
            met = "" if case.goal is None else ("yes" if got <= case.goal else
                                                "**no**" if base <= case.goal else "no (nor all-C)")
            lines.append(f"| {case.workload.name} | {case.command} | {called} | {variant} | {base:.3f} | {got:.3f} | "
                         f"{got / base:.2f}x | {base_phase:.3f} | {phase:.3f} | {goal} | {met} |")
            called = ""
    return "\n".join(lines)


def big_goal(cases: list[Case]) -> list[str]:
    """The 1 GiB convert against cp+sync, for each variant measured."""
    notes = []
    for cp in (c for c in cases if "cp+sync" in c.runs):
        limit = 1.2 * median(cp, "cp+sync")
        for case in cases:
            if case.workload is cp.workload and case.argv[0] == "convert":
                for variant in case.runs:
                    if variant == SPLIT_BASE:
                        continue
                    got = median(case, variant)
                    notes.append(f"- {cp.workload.name} {case.command}, {variant}: {got:.3f} s against "
                                 f"1.2 x cp+sync = {limit:.3f} s: {'met' if got <= limit else 'NOT met'}")
    return notes


# ------------------------------------------------------------------------------------------------ main


def main(argv: list[str] | None = None) -> None:
    if argv is None and len(sys.argv) > 2 and sys.argv[1] == "_child":
        child(json.loads(sys.argv[2]))
        return
    parser = argparse.ArgumentParser(prog="python -m bench.native_ab", description=__doc__.split("\n\n")[0])
    parser.add_argument("--many", type=int, default=10_000, help="small tensors in the many-tensor workload (0: none)")
    parser.add_argument("--big", type=lambda text: 0 if text == "0" else parse_size(text), default=parse_size("64M"),
                        help="bytes of the few-large-tensor workload, e.g. 1G (0: none)")
    parser.add_argument("--no-resnet", dest="resnet", action="store_false", help="leave out ResNet-18")
    parser.add_argument("--cases", default="load,inspect,scan,convert,strip",
                        help="commands to measure (load: ckptool.load in-process)")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--split", type=float, default=1.5,
                        help="measure a group's entry points alone where the group in Python is this much slower")
    parser.add_argument("--split-all", action="store_true", help="measure every called entry point alone")
    parser.add_argument("--set", dest="sets", action="append", default=[], metavar="NAME=ENTRY,ENTRY",
                        help="also measure these entry points in Python together (e.g. what a deletion leaves)")
    parser.add_argument("--only-sets", action="store_true", help="measure only all-C and the --set variants")
    parser.add_argument("--workdir", default="/tmp/ckptool-native-ab")
    parser.add_argument("--python", default=sys.executable, help="the interpreter (with torch, for the inputs)")
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument("--out", help="also write the markdown here")
    args = parser.parse_args(argv)
    sets = {}
    for text in args.sets:
        name, _, entries = text.partition("=")
        chosen = [entry for group in entries.split(",") for entry in GROUPS.get(group, (group,))]
        unknown = [entry for entry in chosen if entry not in ENTRIES]
        if not name or unknown:
            parser.error(f"--set {text!r}: NAME=ENTRY,... of {', '.join(ENTRIES)} or a group ({', '.join(GROUPS)})")
        sets[name] = chosen
    args.sets = sets

    def log(text: str) -> None:
        print(text, file=sys.stderr, flush=True)

    log(f"ckptool: {compile_package(args.python)}")
    workloads = make_inputs(args, log)
    for w in workloads:  # a warm cache: each input read once
        for path in (w.path, w.safetensors):
            if path is not None:
                with open(path, "rb") as f:
                    while f.read(16 << 20):
                        pass
    cases = cases_for(workloads, set(args.cases.split(",")))
    runner = Runner(args, log)
    for case in cases:
        measure_case(runner, case, args)
    shutil.rmtree(runner.scratch, ignore_errors=True)
    command = "python -m bench.native_ab " + " ".join(sys.argv[1:] if argv is None else argv)
    header = (f"`{command}` — medians of {args.repeat} interleaved runs, wall-clock seconds per process; "
              "ratio = Python / all-C; phase = inside the process, imports excluded")
    md = "\n".join([header, "", table(cases)]
                   + ([""] + big_goal(cases) if any("cp+sync" in c.runs for c in cases) else []))
    print(md)
    if args.out:
        Path(args.out).write_text(md + "\n")


if __name__ == "__main__":
    main()
