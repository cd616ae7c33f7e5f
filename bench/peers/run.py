"""ckptool's scan against four peer scanners on the scan corpus (bench/peers/corpus.py).

    bash bench/peers/venv.sh                                   # once: the peers' venv, /work/peers-venv
    .venv/bin/python -m bench.peers.run                        # everything: ~10 min on 2 cores
    .venv/bin/python -m bench.peers.run --only ckptool         # ckptool again, the peers' recorded grades kept
    .venv/bin/python -m bench.peers.run --only picklescan,fickling --jobs 4

Every scanner runs once per corpus entry, as its own process with a timeout (a hang or crash is that
file's grade, and no scanner's state carries over between files), and its answer is mapped to one grade:

    peers    malicious (its top grade) | lower (a warning or suspicion) | clean | error (failed, timed out,
             or the file was not scanned)
    ckptool  dangerous | unknown | safe | refused (exit 3) | error (anything else: exit 70, a timeout)

Top grades: picklescan a *dangerous* global; modelscan a CRITICAL issue; fickling LIKELY_OVERTLY_MALICIOUS
or OVERTLY_MALICIOUS (its two "malicious" severities); ModelAudit a *critical* issue. The lower grades:
picklescan's *suspicious* globals, modelscan's HIGH/MEDIUM/LOW, fickling's POSSIBLY_UNSAFE to
LIKELY_UNSAFE, ModelAudit's *warning* (its *info* findings are clean).

Writes bench/peers/results.json (per entry: label, source, each scanner's grade, detail, seconds) and
bench/peers/table.md. The corpus is built once into --corpus (default /tmp/ckptool-peers-corpus) and
reused; --rebuild writes it again.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from . import corpus as corpus_module

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
RESULTS = HERE / "results.json"
TABLE = HERE / "table.md"
VERSIONS = HERE / "versions.json"
DEFAULT_CORPUS = Path(tempfile.gettempdir()) / "ckptool-peers-corpus"
DEFAULT_VENV = Path("/work/peers-venv")
PEERS = ["picklescan", "modelscan", "fickling", "modelaudit"]
SCANNERS = ["ckptool", *PEERS]
TOP, LOWER, CLEAN, ERROR = "malicious", "lower", "clean", "error"
CKPT_GRADES = ["dangerous", "unknown", "safe", "refused", "error"]
PEER_GRADES = [TOP, LOWER, CLEAN, ERROR]
# the peers phone home unless told not to (ModelAudit sends telemetry; the machine has no network anyway)
QUIET_ENV = {"PROMPTFOO_DISABLE_TELEMETRY": "1", "NO_ANALYTICS": "1", "HF_HUB_OFFLINE": "1", "NO_COLOR": "1",
             "TERM": "dumb", "PYTHONDONTWRITEBYTECODE": "1"}


@dataclass
class Finished:
    """One finished process: exit status (None after a timeout), its output and wall time."""

    returncode: int | None
    stdout: str
    stderr: str
    seconds: float


def run_process(argv: list[str], *, cwd: Path, timeout: float, env: dict[str, str]) -> Finished:
    """``argv`` in a session of its own, killed with its children after ``timeout`` seconds."""
    start = time.perf_counter()
    process = subprocess.Popen(argv, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, errors="replace", start_new_session=True)
    try:
        stdout, stderr = process.communicate(timeout=timeout)
        returncode: int | None = process.returncode
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)  # the group this call started, nothing else
        stdout, stderr = process.communicate()
        returncode = None
    return Finished(returncode, stdout, stderr, time.perf_counter() - start)


def _brief(text: str, limit: int = 200) -> str:
    return " ".join(text.split())[:limit]


# ------------------------------------------------------------------------------------------------ scanners


@dataclass
class Scanner:
    """How to run one scanner on a path and read its answer."""

    name: str
    command: Callable[[Path, Path], list[str]]  # (path, a private scratch folder) -> argv
    grade: Callable[[Finished, Path], dict]  # (the process, the scratch folder) -> {"grade", "detail"}
    startup: list[str]  # a command costing what every run pays before it reads the file


def _api_grade(done: Finished, _: Path) -> dict:
    if done.returncode is None:
        return {"grade": ERROR, "detail": "timed out"}
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        return {"grade": ERROR, "detail": f"exit {done.returncode}: {_brief(done.stderr)}"}
    answer = json.loads(lines[-1])
    return {"grade": answer["grade"], "detail": _brief(f"{answer['raw']}; {answer['detail']}".strip("; "), 300)}


def _report(done: Finished, scratch: Path) -> tuple[dict, dict | None]:
    """The JSON report a scanner wrote to ``scratch/report.json`` and None, or ``{}`` and the error grade when
    it wrote none."""
    if done.returncode is None:
        return {}, {"grade": ERROR, "detail": "timed out"}
    report_path = scratch / "report.json"
    if not report_path.is_file():
        return {}, {"grade": ERROR, "detail": f"exit {done.returncode}, no report: {_brief(done.stdout + done.stderr)}"}
    return json.loads(report_path.read_text()), None


def _modelscan_grade(done: Finished, scratch: Path) -> dict:
    report, failed = _report(done, scratch)
    if failed is not None:
        return failed
    issues = report.get("issues", [])
    severities = sorted({issue.get("severity", "") for issue in issues})
    errors = [_brief(str(error.get("description", error)), 120) for error in report.get("errors", [])]
    scanned = report.get("summary", {}).get("scanned", {}).get("total_scanned", 0)
    critical = sorted({f"{i.get('module')}.{i.get('operator')}" for i in issues if i.get("severity") == "CRITICAL"})
    if critical:
        grade = TOP
    elif issues:
        grade = LOWER
    elif errors or not scanned or done.returncode not in (0, 1):
        grade = ERROR
    else:
        grade = CLEAN
    detail = f"exit {done.returncode}; severities {','.join(severities) or '-'}"
    if critical:
        detail += "; critical: " + ", ".join(critical[:5])
    if errors:
        detail += "; error: " + errors[0]
    if not scanned:
        detail += "; nothing scanned (type not supported)"
    return {"grade": grade, "detail": detail}


def _modelaudit_grade(done: Finished, scratch: Path) -> dict:
    report, failed = _report(done, scratch)
    if failed is not None:
        return failed
    issues = report.get("issues", [])
    by_severity = {level: [i for i in issues if i.get("severity") == level] for level in ("critical", "warning")}
    if by_severity["critical"]:
        grade = TOP
    elif by_severity["warning"]:
        grade = LOWER
    elif report.get("has_errors") or done.returncode == 2 or not report.get("files_scanned"):
        grade = ERROR
    else:
        grade = CLEAN
    messages = [i.get("message", "") for i in by_severity["critical"] or by_severity["warning"]]
    detail = f"exit {done.returncode}; critical {len(by_severity['critical'])}, warning {len(by_severity['warning'])}"
    if messages:
        detail += "; " + " | ".join(_brief(m, 100) for m in dict.fromkeys(messages).keys())
    if grade == ERROR:
        detail += "; has_errors" if report.get("has_errors") else "; nothing scanned"
    return {"grade": grade, "detail": _brief(detail, 400)}


def _ckptool_grade(done: Finished, _: Path) -> dict:
    if done.returncode is None:
        return {"grade": "error", "detail": "timed out"}
    if done.returncode == 3:
        return {"grade": "refused", "detail": _brief(done.stderr)}
    if done.returncode in (0, 1):
        report = json.loads(done.stdout)
        outside = [name for name in report.get("unsafe", [])]
        detail = ", ".join(report.get("dangerous") or outside)
        return {"grade": report["verdict"], "detail": _brief(detail, 300)}
    return {"grade": "error", "detail": f"exit {done.returncode}: {_brief(done.stderr)}"}


def scanners(venv: Path, ckptool: Path) -> dict[str, Scanner]:
    python = str(venv / "bin" / "python")
    api = str(HERE / "peer_api.py")
    return {
        "ckptool": Scanner("ckptool", lambda path, _: [str(ckptool), "scan", "--json", str(path)], _ckptool_grade,
                           [str(ckptool), "--help"]),
        "picklescan": Scanner("picklescan", lambda path, _: [python, api, "picklescan", str(path)], _api_grade,
                              [python, api, "picklescan", "--import-only"]),
        "modelscan": Scanner("modelscan", lambda path, scratch: [
            str(venv / "bin" / "modelscan"), "-p", str(path), "-r", "json", "-o", str(scratch / "report.json")],
            _modelscan_grade, [str(venv / "bin" / "modelscan"), "--help"]),
        "fickling": Scanner("fickling", lambda path, _: [python, api, "fickling", str(path)], _api_grade,
                            [python, api, "fickling", "--import-only"]),
        "modelaudit": Scanner("modelaudit", lambda path, scratch: [
            str(venv / "bin" / "modelaudit"), "scan", "--format", "json", "--no-cache", "-o",
            str(scratch / "report.json"), str(path)], _modelaudit_grade, [str(venv / "bin" / "modelaudit"), "--help"]),
    }


def scan_one(scanner: Scanner, path: Path, timeout: float, env: dict[str, str]) -> dict:
    with tempfile.TemporaryDirectory(prefix=f"peers-{scanner.name}-") as scratch:
        done = run_process(scanner.command(path, Path(scratch)), cwd=Path(scratch), timeout=timeout, env=env)
        try:
            graded = scanner.grade(done, Path(scratch))
        except (ValueError, KeyError, TypeError) as e:  # output the mapping does not understand
            graded = {"grade": ERROR if scanner.name != "ckptool" else "error",
                      "detail": f"unreadable output ({type(e).__name__}): {_brief(done.stdout + done.stderr)}"}
    graded["seconds"] = round(done.seconds, 3)
    return graded


def startup_seconds(scanner: Scanner, env: dict[str, str], repeat: int = 3) -> float:
    with tempfile.TemporaryDirectory() as scratch:
        times = [run_process(scanner.startup, cwd=Path(scratch), timeout=120, env=env).seconds for _ in range(repeat)]
    return round(statistics.median(times), 3)


# ------------------------------------------------------------------------------------------------ the run


def _versions(ckptool: Path) -> dict[str, str | None]:
    versions = json.loads(VERSIONS.read_text()) if VERSIONS.is_file() else {}
    commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    dirty = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain", "--", "ckptool"], capture_output=True,
                           text=True).stdout.strip()
    versions["ckptool"] = f"{commit}{' + uncommitted changes under ckptool/' if dirty else ''}"
    return versions


def _machine() -> str:
    model = ""
    try:
        model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                      if line.startswith("model name")), "")
    except OSError:
        pass
    return f"{platform.system()} {platform.machine()}, {os.cpu_count()} CPUs{', ' + model if model else ''}"


def run(*, corpus_dir: Path, only: list[str], jobs: int, timeout: float, venv: Path, ckptool: Path,
        rebuild: bool, progress: Callable[[str], None] = print) -> dict:
    corpus_dir = corpus_dir.resolve()
    if rebuild or not (corpus_dir / "manifest.json").is_file():
        progress(f"building the corpus in {corpus_dir}")
        corpus_module.build(corpus_dir)
    entries = corpus_module.load_manifest(corpus_dir)
    previous = json.loads(RESULTS.read_text()) if RESULTS.is_file() else {"meta": {}, "files": {}}
    env = {**os.environ, **QUIET_ENV}
    table = scanners(venv, ckptool)
    for name in only:
        if name != "ckptool" and not (venv / "bin" / "python").is_file():
            raise SystemExit(f"{venv} has no python: run bash bench/peers/venv.sh first (or pass --only ckptool)")
    files: dict[str, dict] = {}
    for entry in entries:
        record = previous["files"].get(entry.name, {})
        files[entry.name] = {"label": entry.label, "source": entry.source, "note": entry.note,
                             "grades": {k: v for k, v in record.get("grades", {}).items() if k not in only}}
    tasks = [(name, entry) for name in only for entry in entries]
    done_count = 0
    with concurrent.futures.ThreadPoolExecutor(max_workers=jobs) as pool:
        futures = {pool.submit(scan_one, table[name], corpus_dir / entry.path, timeout, env): (name, entry)
                   for name, entry in tasks}
        for future in concurrent.futures.as_completed(futures):
            name, entry = futures[future]
            graded = future.result()
            graded["detail"] = graded["detail"].replace(str(corpus_dir), "<corpus>")  # the same wherever it was built
            files[entry.name]["grades"][name] = graded
            done_count += 1
            if done_count % 50 == 0 or done_count == len(tasks):
                progress(f"  {done_count}/{len(tasks)} scans")
    meta = previous.get("meta", {})
    meta.update({"machine": _machine(), "timeout_s": timeout, "versions": {**meta.get("versions", {}),
                                                                             **_versions(ckptool)}})
    meta.setdefault("startup_s", {})
    meta.setdefault("jobs", {})
    meta.setdefault("ran", {})
    for name in only:
        meta["startup_s"][name] = startup_seconds(table[name], env)
        meta["jobs"][name] = jobs
        meta["ran"][name] = time.strftime("%Y-%m-%d %H:%M", time.gmtime()) + " UTC"
    meta["versions"] = {k: v for k, v in meta["versions"].items() if v is not None}
    results = {"meta": dict(sorted(meta.items())), "files": dict(sorted(files.items()))}
    for record in results["files"].values():
        record["grades"] = dict(sorted(record["grades"].items(), key=lambda item: SCANNERS.index(item[0])))
    RESULTS.write_text(json.dumps(results, indent=1, sort_keys=False) + "\n")
    TABLE.write_text(render_table(results))
    return results


# ------------------------------------------------------------------------------------------------ the table


def peer_flagged(results: dict, label: str | None = corpus_module.MALICIOUS) -> dict[str, dict[str, str]]:
    """Entries (of ``label``; None: any) some peer grades at its top grade: name -> {peer: grade}."""
    flagged = {}
    for name, record in results["files"].items():
        grades = {peer: record["grades"][peer]["grade"] for peer in PEERS if peer in record["grades"]}
        if TOP in grades.values() and label in (None, record["label"]):
            flagged[name] = grades
    return flagged


def _seconds(values: list[float]) -> str:
    if not values:
        return "-"
    values = sorted(values)
    p90 = values[min(len(values) - 1, int(round(0.9 * (len(values) - 1))))]
    return f"{statistics.median(values):.2f} / {p90:.2f} / {values[-1]:.1f}"


def _grade_rows(files: dict, chosen: dict[str, dict[str, str]]) -> list[str]:
    if not chosen:
        return []
    rows = ["| entry | label | ckptool | " + " | ".join(PEERS) + " | ckptool says | a top-grading peer says |",
            "|---|---|---|" + "---|" * len(PEERS) + "---|---|"]
    for name, grades in sorted(chosen.items()):
        ckpt = files[name]["grades"].get("ckptool", {})
        peer = next(p for p in PEERS if grades.get(p) == TOP)
        said = files[name]["grades"][peer]["detail"]
        rows.append(f"| `{name}` | {files[name]['label']} | {ckpt.get('grade', '-')} | "
                    + " | ".join(grades.get(p, "-") for p in PEERS)
                    + f" | {_cell(ckpt.get('detail', ''))} | {peer}: {_cell(said)} |")
    return rows


def _cell(text: str, limit: int = 110) -> str:
    text = text.replace("|", "/").replace("ckptool: error: ", "")
    return text if len(text) <= limit else text[: limit - 1] + "…"


def render_table(results: dict) -> str:
    files, meta = results["files"], results["meta"]
    labels = {label: [n for n, r in files.items() if r["label"] == label]
              for label in (corpus_module.MALICIOUS, corpus_module.BENIGN, corpus_module.MALFORMED)}
    versions = meta.get("versions", {})
    lines = ["# ckptool scan against peer scanners", "",
             f"Corpus: {len(files)} entries (bench/peers/corpus.py) — {len(labels['malicious'])} malicious, "
             f"{len(labels['benign'])} benign, {len(labels['malformed'])} malformed (hostile inputs without a code "
             "payload; counted in neither misses nor false alarms).",
             "Versions: " + ", ".join(f"{k} {v}" for k, v in sorted(versions.items())) + ".",
             f"Machine: {meta.get('machine', '?')}; per-file timeout {meta.get('timeout_s', '?')} s; each scan is "
             "one process (start-up included in its time).", "",
             "Grades: peers `malicious` (top grade) / `lower` (warning, suspicious) / `clean` / `error` (failed, "
             "timed out, or file type not scanned); ckptool `dangerous` / `unknown` / `safe` / `refused` (exit 3) "
             "/ `error`. A miss is a malicious entry graded clean or error (ckptool: safe, refused or error); a "
             "false alarm a benign entry graded at the top grade.", "",
             "| scanner | malicious: top / lower / clean / error | misses | benign: top / lower / clean / error "
             "| false alarms | malformed: top / lower / clean / error | s per file: median / p90 / max | start-up s |",
             "|---|---|---|---|---|---|---|---|"]
    for scanner in SCANNERS:
        grades_order = CKPT_GRADES if scanner == "ckptool" else PEER_GRADES
        have = [n for n in files if scanner in files[n]["grades"]]
        if not have:
            continue

        def counts(names: list[str]) -> list[int]:
            found = [files[n]["grades"][scanner]["grade"] for n in names if scanner in files[n]["grades"]]
            buckets = [found.count(g) for g in grades_order[:3]] + [sum(found.count(g) for g in grades_order[3:])]
            return buckets

        malicious, benign, malformed = (counts(labels[k]) for k in ("malicious", "benign", "malformed"))
        seconds = [files[n]["grades"][scanner]["seconds"] for n in have]
        lines.append(f"| {scanner} | {' / '.join(map(str, malicious))} | {malicious[2] + malicious[3]} | "
                     f"{' / '.join(map(str, benign))} | {benign[0]} | {' / '.join(map(str, malformed))} | "
                     f"{_seconds(seconds)} | {meta.get('startup_s', {}).get(scanner, '-')} |")
    lines += ["", "(ckptool's `refused` and `error` share the last column; its misses count `refused` malicious "
              "entries, which it will not load but does not name.)", ""]
    # per source, so a reader sees where each scanner's misses are
    lines += ["## Misses by source (malicious entries graded clean or error)", "",
              "| source | malicious | " + " | ".join(SCANNERS) + " |", "|---|---|" + "---|" * len(SCANNERS)]
    for source in ("hostile", "picklescan", "trust"):
        names = [n for n in labels["malicious"] if files[n]["source"] == source]
        if not names:
            continue
        cells = []
        for scanner in SCANNERS:
            missed = [n for n in names if scanner in files[n]["grades"] and files[n]["grades"][scanner]["grade"] in
                      (("safe", "refused", "error") if scanner == "ckptool" else (CLEAN, ERROR))]
            cells.append(str(len(missed)))
        lines.append(f"| {source} | {len(names)} | " + " | ".join(cells) + " |")
    flagged = peer_flagged(results)
    failing = {n: g for n, g in flagged.items() if files[n]["grades"].get("ckptool", {}).get("grade") != "dangerous"}
    lines += ["", "## Malicious, graded malicious by a peer, not `dangerous` by ckptool", "",
              f"{len(failing)} of the {len(flagged)} malicious entries some peer grades at its top grade "
              "(tests/test_peer_verdicts.py asserts ckptool grades every one of them `dangerous`).", ""]
    lines += _grade_rows(files, failing)
    others = {n: g for n, g in peer_flagged(results, None).items() if files[n]["label"] != corpus_module.MALICIOUS}
    lines += ["", "## Not labelled malicious, graded malicious by a peer", "",
              f"{len(others)} benign or malformed entries some peer grades at its top grade (the peers' false "
              "alarms, and their verdicts on malformed files; not asserted).", ""]
    lines += _grade_rows(files, others)
    alarms = [n for n in labels["benign"] if files[n]["grades"].get("ckptool", {}).get("grade") == "dangerous"]
    lines += ["", "## Benign entries ckptool grades `dangerous`", "", ", ".join(f"`{n}`" for n in alarms) or "none"]
    missed_by_all = [n for n in labels["malicious"]
                     if all(files[n]["grades"].get(s, {}).get("grade") in ("safe", "refused", "error", CLEAN, ERROR)
                            for s in SCANNERS)]
    lines += ["", "## Malicious entries every scanner misses (clean, safe, refused or error)", "",
              ", ".join(f"`{n}`" for n in missed_by_all) or "none", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--corpus", type=Path, default=DEFAULT_CORPUS, help="corpus folder (default: %(default)s)")
    parser.add_argument("--rebuild", action="store_true", help="write the corpus again first")
    parser.add_argument("--only", default=",".join(SCANNERS),
                        help="comma-separated scanners to run; the others' recorded grades are kept "
                             f"(default: all of {','.join(SCANNERS)})")
    parser.add_argument("--jobs", type=int, default=2, help="scans at once (default: %(default)s)")
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds per scan (default: %(default)s)")
    parser.add_argument("--venv", type=Path, default=DEFAULT_VENV, help="the peers' venv (default: %(default)s)")
    parser.add_argument("--ckptool", type=Path, default=REPO / ".venv" / "bin" / "ckptool",
                        help="the ckptool executable (default: %(default)s)")
    parser.add_argument("--table-only", action="store_true", help="rewrite table.md from results.json, run nothing")
    args = parser.parse_args(argv)
    if args.table_only:
        TABLE.write_text(render_table(json.loads(RESULTS.read_text())))
        return 0
    only = [name.strip() for name in args.only.split(",") if name.strip()]
    unknown = sorted(set(only) - set(SCANNERS))
    if unknown:
        parser.error(f"unknown scanner(s) {', '.join(unknown)}: choose from {', '.join(SCANNERS)}")
    run(corpus_dir=args.corpus, only=only, jobs=args.jobs, timeout=args.timeout, venv=args.venv,
        ckptool=args.ckptool, rebuild=args.rebuild)
    print(TABLE.read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
