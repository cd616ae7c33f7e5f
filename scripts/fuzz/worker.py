"""The fuzz loop, run by scripts/fuzz/run.py under the sanitized build (one process, restarted after a crash).

    worker.py --seconds S --seed N --findings DIR --current DIR SEED_FOLDER...   the loop
    worker.py --check                                                          the build is the sanitized one
    worker.py --replay FILE...                                                 every oracle on each file

Before each mutant runs, its bytes and notes are written to ``--current`` (``input.<suffix>``,
``input.json``): if a sanitizer ends the process, the driver files that input as the crash, and the
notes' time tells it how long the input has been running (a hang). A difference between twins or
an exception the API must not raise is filed here, in ``--findings``, and the loop goes on.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import shutil
import sys
import tempfile
import time
import traceback
from collections import Counter
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import mutate  # noqa: E402
import twins  # noqa: E402

MAX_PER_SIGNATURE = 3  # inputs kept for one kind of finding in one run (the rest are counted)
KIND_WEIGHTS = {"zip": 4, "pickle": 3, "safetensors": 3, "legacy": 1, "other": 1}
# the fixtures load, the hostile cases are refused by design: mutants of the first reach deeper
FOLDER_WEIGHTS = {"fixtures": 3}


def check_build() -> None:
    """Exit 1 unless the extensions are the sanitized copies under build/fuzz and the runtimes are mapped in."""
    maps = Path("/proc/self/maps").read_text()
    problems = [f"{name} runtime not loaded" for name in ("libasan", "libubsan") if name not in maps]
    build = HERE.parent.parent / "build" / "fuzz"
    for name, module in twins.native_modules().items():
        if module is None:
            problems.append(f"{name}: not built")
        elif not Path(module.__file__).resolve().is_relative_to(build.resolve()):
            problems.append(f"{name}: loaded from {module.__file__}, not from {build}")
    if problems:
        print("; ".join(problems))
        raise SystemExit(1)
    print(f"extensions {', '.join(sorted(twins.native_modules()))} loaded from build/fuzz with libasan and libubsan "
          "mapped")


def replay(files: list[str]) -> int:
    failed = 0
    with tempfile.TemporaryDirectory(prefix="ckptool-replay-") as folder:
        for name in files:
            problems = twins.check(Path(name), Path(folder))
            print(f"{name}: {'ok' if not problems else ''}")
            for problem in problems:
                print(f"  {problem}")
            failed += bool(problems)
    return 1 if failed else 0


def planted(fault: str) -> list[str]:
    """A fault of each kind the driver must file (``run.py selftest``): the third mutant's run crashes in C under
    ASan, hangs, or differs."""
    if fault == "crash":
        import ctypes

        ctypes.string_at(0)  # a read of address 0 in C: ASan's SEGV report, then the abort
    if fault == "hang":
        while True:
            time.sleep(1)
    return ["plant: a planted difference"] if fault == "mismatch" else []


def signature(problem: str) -> str:
    """What makes two findings the same kind: the oracle and the start of its message, numbers left out."""
    head = problem.split(":", 2)
    return "".join(c for c in ":".join(head[:2])[:100] if not c.isdigit())


def file_finding(findings: Path, data: bytes, suffix: str, problems: list[str], meta: dict) -> Path:
    name = f"{problems[0].split(':', 1)[0]}-{hashlib.sha256(data).hexdigest()[:16]}"
    path = findings / f"{name}{suffix}"
    path.write_bytes(data)
    (findings / f"{name}.txt").write_text("\n".join(problems) + f"\n\nmutant: {json.dumps(meta)}\n"
                                          f"replay: python scripts/fuzz/run.py replay {path}\n")
    return path


def loop(args: argparse.Namespace) -> None:
    rng = random.Random(args.seed)
    seeds = mutate.load_seeds([Path(folder) for folder in args.folders])
    if not seeds:
        raise SystemExit("fuzz: no seeds")
    by_kind: dict[str, list[mutate.Seed]] = {}
    for seed in seeds:
        by_kind.setdefault(seed.kind, []).append(seed)
    kinds = sorted(by_kind)
    weights = [KIND_WEIGHTS.get(kind, 1) for kind in kinds]
    donors = mutate.pickle_blobs(seeds)
    findings, current = Path(args.findings), Path(args.current)
    work = Path(tempfile.mkdtemp(prefix="ckptool-fuzz-out-"))
    deadline = time.monotonic() + args.seconds
    plant = os.environ.get("FUZZ_PLANT", "")
    counts: Counter[str] = Counter()
    outcomes: Counter[str] = Counter()
    kept: Counter[str] = Counter()
    shown = ", ".join(f"{kind} {len(group)}" for kind, group in by_kind.items())
    print(f"fuzz worker: seed {args.seed}, {len(seeds)} seeds ({shown}), {args.seconds:.0f} s", file=sys.stderr,
          flush=True)
    try:
        while time.monotonic() < deadline:
            kind = rng.choices(kinds, weights)[0]
            seed = rng.choices(by_kind[kind], [FOLDER_WEIGHTS.get(s.name.split("/", 1)[0], 1)
                                               for s in by_kind[kind]])[0]
            try:
                data, notes = mutate.mutate(rng, seed, seeds, donors)
            except Exception:  # noqa: BLE001 — a mutator's own bug: said at the end, the fuzz goes on
                counts["mutator errors"] += 1
                if counts["mutator errors"] == 1:
                    print(f"fuzz worker: the mutator failed on {seed.name}:\n{traceback.format_exc()}",
                          file=sys.stderr, flush=True)
                continue
            suffix = seed.suffix if not data.startswith(b"PK") else ".pt"
            meta = {"seed": seed.name, "worker_seed": args.seed, "iteration": counts["mutants"], "notes": notes}
            for stale in current.glob("input.*"):
                stale.unlink()
            path = current / f"input{suffix}"
            path.write_bytes(data)
            (current / "input.json").write_text(json.dumps(meta))  # written last: its time is the input's start
            problems, outcome = twins.check_report(path, work)
            if plant and counts["mutants"] == 2:
                problems += planted(plant)
            counts["mutants"] += 1
            counts[f"kind {kind}"] += 1
            outcomes[outcome] += 1
            for leftover in work.iterdir():
                shutil.rmtree(leftover) if leftover.is_dir() else leftover.unlink()
            if problems:
                key = signature(problems[0])
                counts["findings"] += 1
                if kept[key] < MAX_PER_SIGNATURE:
                    kept[key] += 1
                    filed = file_finding(findings, data, suffix, problems, meta)
                    print(f"fuzz: finding {filed.name}: {problems[0][:300]}", file=sys.stderr, flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    loaded = sum(n for outcome, n in outcomes.items() if outcome == "read")
    shown = ", ".join(f"{k[5:]} {n}" for k, n in sorted(counts.items()) if k.startswith("kind "))
    print(f"fuzz worker: {counts['mutants']} mutants ({shown}); "
          f"{loaded} loaded, refusals by error: {dict(outcomes.most_common(6))}; {counts['findings']} finding(s) "
          f"of {len(kept)} kind(s); {counts['mutator errors']} mutator error(s)", file=sys.stderr, flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true")
    parser.add_argument("--replay", nargs="+")
    parser.add_argument("--seconds", type=float, default=60)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--findings", default="build/fuzz-findings")
    parser.add_argument("--current", default=None)
    parser.add_argument("folders", nargs="*")
    args = parser.parse_args()
    if args.check:
        check_build()
    elif args.replay:
        raise SystemExit(replay(args.replay))
    else:
        if args.current is None:
            args.current = tempfile.mkdtemp(prefix="ckptool-fuzz-current-")
        os.makedirs(args.findings, exist_ok=True)
        loop(args)


if __name__ == "__main__":
    main()
