"""`make frameworks`: every ckptool command on checkpoints the training frameworks' own save paths wrote.

    .venv/bin/python scripts/frameworks/run.py                       # every framework (fw_*.py beside this file)
    .venv/bin/python scripts/frameworks/run.py --only lightning      # one (repeatable)
    .venv/bin/python scripts/frameworks/run.py --rewrite             # write the framework files again
    .venv/bin/python scripts/frameworks/run.py --refresh-fixtures    # and copy the small ones to fixtures/frameworks/
    .venv/bin/python scripts/frameworks/run.py --json-out results.json

Runs with ckptool's own venv. Builds the frameworks venv first (scripts/frameworks/venv.sh; needs PyPI once),
asks each framework module to write its files there (``driver.py write``; cached under
``$CKPTOOL_FRAMEWORKS_OUT`` or ``~/.cache/ckptool-frameworks/out``), runs every ckptool command on every file
(checks.py), then has the framework load ckptool's outputs back (``driver.py load``). Prints one PASS/FAIL
line per check, a table per framework, the versions installed, and exits 1 when anything failed. Not in CI.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from checks import REPO_ROOT, CaseRun, Outcome, check_case  # noqa: E402

FIXTURES = REPO_ROOT / "fixtures" / "frameworks"
FIXTURE_LIMIT_BYTES = 300 * 1024
WRITE_TIMEOUT_S = 1800


def venv_dir() -> Path:
    return Path(os.environ.get("CKPTOOL_FRAMEWORKS_VENV") or Path.home() / ".cache" / "ckptool-frameworks" / "venv")


def out_root() -> Path:
    return Path(os.environ.get("CKPTOOL_FRAMEWORKS_OUT") or Path.home() / ".cache" / "ckptool-frameworks" / "out")


def frameworks() -> list[str]:
    return sorted(path.stem.removeprefix("fw_") for path in HERE.glob("fw_*.py"))


def build_venv() -> Path:
    completed = subprocess.run(["bash", str(HERE / "venv.sh")], text=True)
    if completed.returncode != 0:
        raise SystemExit(f"frameworks: building the venv {venv_dir()} failed (exit {completed.returncode})")
    return venv_dir() / "bin" / "python"


def driver(python: Path, *args: str, log: Path) -> dict:
    """``driver.py ARGS`` in the frameworks venv; its JSON (the last line of stdout). Its output goes to ``log``."""
    completed = subprocess.run([str(python), str(HERE / "driver.py"), *args], capture_output=True, text=True,
                               timeout=WRITE_TIMEOUT_S, cwd=REPO_ROOT)
    log.write_text(f"$ driver.py {' '.join(args)}\n--- stdout\n{completed.stdout}\n--- stderr\n{completed.stderr}")
    lines = completed.stdout.strip().splitlines()
    if completed.returncode != 0 or not lines:
        tail = (completed.stderr.strip() or completed.stdout.strip()).splitlines()[-3:]
        raise RuntimeError(f"driver.py {args[0]} {args[1]} exit {completed.returncode}: {' | '.join(tail)} "
                           f"(full output: {log})")
    return json.loads(lines[-1])


def written(python: Path, name: str, rewrite: bool) -> tuple[Path, dict]:
    """The framework's files, written once: ``out/<name>/`` and its ``report.json`` (cases and versions)."""
    root = out_root()
    target = root / name
    report_path = target / "report.json"
    if report_path.is_file() and not rewrite:
        return target, json.loads(report_path.read_text())
    shutil.rmtree(target, ignore_errors=True)  # report.json, written last, marks a complete write
    target.mkdir(parents=True)
    report = driver(python, "write", name, str(target), log=root / f"{name}.write.log")
    report_path.write_text(json.dumps(report, indent=2) + "\n")
    return target, report


def refresh_fixtures(name: str, base: Path, report: dict, runs: dict[str, CaseRun]) -> list[str]:
    """Copy the cases marked ``fixture`` into fixtures/frameworks/<name>/ with their cases.json."""
    target = FIXTURES / name
    shutil.rmtree(target, ignore_errors=True)
    target.mkdir(parents=True)
    kept = []
    copied: dict[str, dict] = {}  # cases reading the same file or folder (another --variant) share one copy
    for case in report["cases"]:
        if not case.get("fixture"):
            continue
        source = base / case["path"]
        if case["path"] in copied:
            shared = copied[case["path"]]
            kept.append({**{key: value for key, value in case.items() if key != "fixture"},
                         "path": shared["path"], "written_as": case["path"], "sha256": shared["sha256"]})
            continue
        size = sum(p.stat().st_size for p in source.rglob("*") if p.is_file()) if source.is_dir() \
            else source.stat().st_size
        if size > FIXTURE_LIMIT_BYTES:
            raise RuntimeError(f"{name}/{case['id']}: {size} bytes, over the {FIXTURE_LIMIT_BYTES} fixture limit")
        destination = target / case["id"] / Path(case["path"]).name
        destination.parent.mkdir(parents=True)
        if source.is_dir():
            shutil.copytree(source, destination)
        else:
            shutil.copy2(source, destination)
        entry = {key: value for key, value in case.items() if key not in ("fixture",)}
        entry["path"] = str(destination.relative_to(target))
        entry["written_as"] = case["path"]
        files = sorted(p for p in destination.rglob("*") if p.is_file()) if destination.is_dir() else [destination]
        entry["sha256"] = {str(p.relative_to(target)): hashlib.sha256(p.read_bytes()).hexdigest() for p in files}
        kept.append(entry)
        copied[case["path"]] = entry
    (target / "cases.json").write_text(json.dumps({
        "framework": name,
        "regenerate": f"python scripts/frameworks/run.py --refresh-fixtures --only {name}",
        "versions": report["versions"],
        "cases": kept,
    }, indent=2) + "\n")
    return [entry["path"] for entry in kept]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Run every ckptool command on files the training frameworks wrote.")
    parser.add_argument("--only", action="append", default=[], help="a framework (fw_NAME.py); repeatable")
    parser.add_argument("--rewrite", action="store_true", help="write the framework files again (else cached)")
    parser.add_argument("--refresh-fixtures", action="store_true",
                        help="copy the cases marked 'fixture' into fixtures/frameworks/NAME/ "
                             "(with --rewrite: freshly written)")
    parser.add_argument("--json-out", type=Path, help="also write every outcome as JSON here")
    args = parser.parse_args(argv)
    names = [name for name in frameworks() if not args.only or name in args.only]
    unknown = set(args.only) - set(frameworks())
    if unknown:
        parser.error(f"no fw_NAME.py for {sorted(unknown)}; there are {frameworks()}")
    started = time.perf_counter()
    python = build_venv()
    outcomes: list[Outcome] = []
    all_versions: dict[str, str] = {}
    for name in names:
        try:
            base, report = written(python, name, args.rewrite)
        except Exception as error:  # noqa: BLE001 — one line per framework, then the next
            outcomes.append(Outcome(name, "-", "write", False, str(error)[:600]))
            print(f"FAIL  {name:12} {'-':28} write: {error}", flush=True)
            continue
        all_versions.update(report["versions"])
        runs: dict[str, CaseRun] = {}
        work_root = out_root() / "work" / name
        for case in report["cases"]:
            try:
                run = check_case(name, case, base / case["path"], work_root / case["id"], state_weights=True)
            except Exception as error:  # noqa: BLE001
                run = CaseRun([Outcome(name, case["id"], "harness", False, f"{type(error).__name__}: {error}")])
            runs[case["id"]] = run
            for outcome in run.outcomes:
                print(f"{'PASS' if outcome.passed else 'FAIL'}  {name:12} {case['id']:28} {outcome.check:22} "
                      f"{outcome.detail}", flush=True)
            outcomes.extend(run.outcomes)
        load_cases = [case for case in report["cases"] if case.get("load_back")]
        if load_cases:
            cases_json = work_root / "cases.json"
            outputs_json = work_root / "outputs.json"
            cases_json.write_text(json.dumps(load_cases))
            outputs_json.write_text(json.dumps({
                case["id"]: {"input": str(base / case["path"]), **runs[case["id"]].outputs} for case in load_cases}))
            try:
                results = driver(python, "load", name, str(cases_json), str(outputs_json),
                                 log=out_root() / f"{name}.load.log")["results"]
            except Exception as error:  # noqa: BLE001
                results = [{"id": case["id"], "ok": False, "detail": str(error)[:600]} for case in load_cases]
            for result in results:
                outcome = Outcome(name, result["id"], "load back", result["ok"], result["detail"])
                outcomes.append(outcome)
                print(f"{'PASS' if outcome.passed else 'FAIL'}  {name:12} {result['id']:28} {'load back':22} "
                      f"{outcome.detail}", flush=True)
        if args.refresh_fixtures:
            kept = refresh_fixtures(name, base, report, runs)
            print(f"fixtures/frameworks/{name}/: {len(kept)} case(s) {kept}")
    print_table(outcomes, names)
    print("versions: " + ", ".join(f"{k} {v}" for k, v in sorted(all_versions.items())))
    failed = [o for o in outcomes if not o.passed]
    print(f"frameworks: {len(outcomes) - len(failed)} passed, {len(failed)} failed "
          f"({len(names)} frameworks, {time.perf_counter() - started:.0f}s; files under {out_root()})")
    if args.json_out:
        args.json_out.write_text(json.dumps({"versions": all_versions, "outcomes": [o.__dict__ for o in outcomes]},
                                            indent=2) + "\n")
    return 1 if failed else 0


def print_table(outcomes: list[Outcome], names: list[str]) -> None:
    print()
    print(f"| {'framework':12} | {'case':28} | passed | failed | failing checks |")
    print(f"|{'-' * 14}|{'-' * 30}|-------:|-------:|---|")
    for name in names:
        cases = list(dict.fromkeys(o.case for o in outcomes if o.framework == name))
        for case in cases:
            mine = [o for o in outcomes if o.framework == name and o.case == case]
            bad = [o.check for o in mine if not o.passed]
            print(f"| {name:12} | {case:28} | {len(mine) - len(bad):6} | {len(bad):6} | {', '.join(bad)} |")
    print()


if __name__ == "__main__":
    sys.exit(main())
