"""Every ckptool command on one framework file, as a user would run it: shared by run.py and the test suite.

Runs in ckptool's own environment (never the frameworks venv) and imports no framework: ckptool is called as
``python -m ckptool`` (a subprocess, this checkout's package), torch's own reading of the files comes from
``scripts/realworld_reference.py`` (a throwaway subprocess).

The rule checked for every command: it succeeds with no flag, or it refuses the file once, in one line that
names every global the file needs (the ``--allow-global`` flags that line prints must equal the case's
``allow_globals``), and the same command with those flags then succeeds.
"""

from __future__ import annotations

import fnmatch
import json
import os
import shlex
import subprocess
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # scripts/: the tensor comparison shared
from tensor_compare import compare, same_tensor  # noqa: E402,F401
from tensor_compare import torch_view as reference_view  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[2]
ADDED_PREFIX = "module."  # a known wrapper: strip of add-prefix's output is a round trip
COMMAND_TIMEOUT_S = 600
EXIT_OK, EXIT_PROBLEM, EXIT_REFUSED = 0, 1, 3
WEIGHT_FILE_PATTERNS = ("model*.safetensors", "pytorch_model*.bin", "diffusion_pytorch_model*.safetensors")


@dataclass
class Outcome:
    """One check of one case: passed or not, and why."""

    framework: str
    case: str
    check: str
    passed: bool
    detail: str


@dataclass
class CaseRun:
    """What running every command on one case gave: the outcomes and the outputs written."""

    outcomes: list[Outcome] = field(default_factory=list)
    outputs: dict[str, str] = field(default_factory=dict)
    flags_seen: list[str] | None = None  # the --allow-global patterns a refusal printed (None: no refusal)
    report: dict = field(default_factory=dict)  # inspect --json of the input ({} when it failed)
    strip_prefix: str = ""  # the input's own wrapper prefix that strip removed ("" : strip was a round trip)


def in_subprocess(args: list[str]) -> subprocess.CompletedProcess[str]:
    """``python -m ckptool ARGS`` with this checkout's ckptool first on the path: what a user runs."""
    environment = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO_ROOT),
                                                                            os.environ.get("PYTHONPATH")])))
    return subprocess.run([sys.executable, "-m", "ckptool", *args], capture_output=True, text=True,
                          cwd=REPO_ROOT, env=environment, timeout=COMMAND_TIMEOUT_S)


# how a command is run: a subprocess by default; the test suite runs the CLI in its own process (the same
# exit codes and stderr lines, without an interpreter start per command)
RUNNER: Callable[[list[str]], subprocess.CompletedProcess[str]] = in_subprocess


def ckptool(*args: str) -> subprocess.CompletedProcess[str]:
    return RUNNER(list(args))


def last_line(completed: subprocess.CompletedProcess[str]) -> str:
    lines = (completed.stderr.strip() or completed.stdout.strip()).splitlines()
    return f"exit {completed.returncode}: {lines[-1][:400] if lines else '(no output)'}"


def refusal_flags(stderr: str) -> list[str] | None:
    """The ``--allow-global`` patterns a refusal prints as its fix (the first set offered), or None if the
    message is no refusal of globals."""
    if "pickle imports" not in stderr:
        return None
    line = next(line for line in stderr.splitlines() if "pickle imports" in line)
    for marker in ("allow them: ", "allow it by name: "):
        if marker in line:
            fix = line.rsplit(marker, 1)[1]
            break
    else:
        return []  # a refusal with no flag offered (a code-running global)
    fix = fix.split(", or read every global", 1)[0].rstrip(")")
    words = shlex.split(fix)
    return [words[i + 1] for i, word in enumerate(words[:-1]) if word == "--allow-global"]


def flags_for(patterns: list[str]) -> list[str]:
    return [part for pattern in patterns for part in ("--allow-global", pattern)]


def same_patterns(printed: list[str], declared: list[str]) -> str | None:
    """None when the refusal's printed patterns and the case's declared ones allow the same names."""
    uncovered = [name for name in printed if not any(fnmatch.fnmatchcase(name, pattern) or name == pattern
                                                     for pattern in declared)]
    unused = [pattern for pattern in declared if not any(fnmatch.fnmatchcase(name, pattern) or name == pattern
                                                         for name in printed)]
    if uncovered or unused:
        return (f"the refusal asks for {printed}, the case declares {declared}"
                + (f" (not declared: {uncovered})" if uncovered else "")
                + (f" (never asked for: {unused})" if unused else ""))
    return None


@dataclass
class Step:
    """One command as a user runs it: first with no flag, then, after a refusal, with the flags it printed."""

    completed: subprocess.CompletedProcess[str]
    flags: list[str]  # the --allow-global patterns the successful (or last) run used
    problem: str | None  # the refusal rule broken, if any
    refused: bool  # the no-flag run refused the file's globals


def run_step(args: list[str], declared: list[str], *, rerun_args: list[str] | None = None) -> Step:
    """``ckptool ARGS`` with no flag; after a refusal of globals, again with the flags the refusal printed.

    ``rerun_args`` replaces ``args`` for the second run (a write needs ``--force`` when a first run wrote).
    """
    completed = ckptool(*args)
    printed = refusal_flags(completed.stderr) if completed.returncode == EXIT_REFUSED else None
    if printed is None:
        problem = None
        if declared and completed.returncode in (EXIT_OK, EXIT_PROBLEM):
            problem = f"read with no flag, but the case declares {declared} (stale allow_globals)"
        return Step(completed, [], problem, False)
    if not printed:
        return Step(completed, [], f"refused with no flag to allow it: {last_line(completed)}", True)
    mismatch = same_patterns(printed, declared)
    second = ckptool(*(rerun_args or args), *flags_for(printed))
    problem = mismatch
    if second.returncode == EXIT_REFUSED and refusal_flags(second.stderr) is not None:
        problem = f"a second refusal after the first one's flags {printed}: {last_line(second)}"
    return Step(second, printed, problem, True)


# ---------------------------------------------------------------------------------------------- torch's view


def torch_view(paths: list[Path], work: Path) -> dict[str, dict]:
    """scripts/realworld_reference.py's reading of each path (a throwaway subprocess; a folder: its weight files,
    top-level dicts merged)."""
    files: list[Path] = []
    members: dict[Path, list[Path]] = {}
    for path in paths:
        if path.is_dir():
            found = sorted({p for pattern in WEIGHT_FILE_PATTERNS for p in path.glob(pattern)})
            members[path] = found
            files.extend(found)
        else:
            files.append(path)
    views = reference_view(files, work, timeout=COMMAND_TIMEOUT_S)
    for folder, found in members.items():
        merged: dict[str, object] = {}
        errors = [views[str(p)]["error"] for p in found if views[str(p)]["error"]]
        for p in found:
            for key_path, tensors in views[str(p)]["dicts"]:
                if not key_path:
                    merged.update(tensors)
        views[str(folder)] = {"loader": "folder", "error": errors[0] if errors else
                              (None if found else "no weight files in the folder"),
                              "locations": {}, "dicts": [([], merged)] if merged else []}
    return views


def weights_at(view: dict, path: list | None) -> dict | None:
    wanted = list(path or [])
    for found_path, tensors in view["dicts"]:
        if list(found_path) == wanted:
            return tensors
    return None


def weights_with_keys(view: dict, keys: set[str]) -> dict | None:
    for _path, tensors in view["dicts"]:
        if set(tensors) == keys:
            return tensors
    for _path, tensors in view["dicts"]:
        if tensors and set(tensors) <= keys:
            return tensors
    return None




# ---------------------------------------------------------------------------------------------- one case


def is_safetensors(path: Path) -> bool:
    if path.is_dir():
        return any(path.glob("*.safetensors")) and not any(path.glob("*.bin")) and not any(path.glob("*.pt"))
    return path.suffix == ".safetensors"


def refused_or(step: Step, weightless: bool) -> str | None:
    """The problem with a write step: None when it wrote, or, for a file without model weights, when it refused
    in one line (exit 3, no traceback) — a rewrite of weights has nothing to work on there."""
    if step.problem is not None:
        return step.problem
    completed = step.completed
    if completed.returncode == EXIT_OK:
        return None
    lines = completed.stderr.strip().splitlines()
    if weightless and completed.returncode == EXIT_REFUSED and len(lines) == 1 and "no weights" in lines[0]:
        return None
    return last_line(completed)


def check_case(framework: str, case: dict, path: Path, work: Path, *, values: bool = True,
               state_weights: bool = False) -> CaseRun:
    """Every command on ``path`` (the case's file or folder), outputs under ``work`` (emptied first).

    ``state_weights``: also ask a file without model weights to convert what it holds (``--weights state``).
    """
    run = CaseRun()
    declared = list(case.get("allow_globals") or [])
    work.mkdir(parents=True, exist_ok=True)
    for old in work.iterdir():
        if old.is_dir():
            import shutil

            shutil.rmtree(old)
        else:
            old.unlink()

    def record(check: str, problem: str | None, detail: str = "") -> None:
        run.outcomes.append(Outcome(framework, case["id"], check, problem is None, problem or detail))

    def note_flags(step: Step) -> None:
        if step.refused and run.flags_seen is None:
            run.flags_seen = step.flags

    suffix = ".safetensors" if is_safetensors(path) else ".pt"
    source = str(path)

    # inspect: human text, then --json with the fingerprint (where the weights are, prefix)
    step = run_step(["inspect", source], declared)
    note_flags(step)
    record("inspect", step.problem or (None if step.completed.returncode == EXIT_OK else last_line(step.completed)),
           f"flags {step.flags}" if step.flags else "no flag")
    flags = flags_for(step.flags)
    report: dict = {}
    completed = ckptool("inspect", "--json", "--fingerprint", source, *flags)
    if completed.returncode == EXIT_OK:
        report = json.loads(completed.stdout)
    record("inspect --json", None if completed.returncode == EXIT_OK else last_line(completed),
           f"{report.get('tensors')} tensors at {report.get('layout')}, prefix {report.get('prefix')!r}")

    # scan: never dangerous; safe with the flags a refusal printed (unknown without them)
    completed = ckptool("scan", "--json", source)
    if completed.returncode not in (EXIT_OK, EXIT_PROBLEM):
        record("scan", last_line(completed))
    else:
        verdict = json.loads(completed.stdout).get("verdict")
        problem = None
        if verdict == "dangerous":
            problem = f"scan calls a framework's file dangerous: {json.loads(completed.stdout).get('dangerous')}"
        elif declared and verdict != "unknown":
            problem = f"verdict {verdict!r} for a file that needs {declared}"
        elif not declared and verdict != "safe" and not (path.is_dir() and verdict == "unknown"):
            # a training folder's weights read with no flag while a side file (training_args.bin) needs trust:
            # scan judges every pickle in the folder, so unknown is its right verdict there
            problem = f"verdict {verdict!r} for a file that reads with no flag: {json.loads(completed.stdout).get('unsafe')}"
        if problem is None and declared:
            allowed = ckptool("scan", "--json", source, *flags_for(declared))
            allowed_verdict = json.loads(allowed.stdout).get("verdict") if allowed.stdout.strip() else None
            if allowed.returncode != EXIT_OK or allowed_verdict != "safe":
                problem = f"with {declared}: verdict {allowed_verdict!r}, {last_line(allowed)}"
        record("scan", problem, f"verdict {verdict}")

    def write(name: str, args: list[str], out: Path, needs: list[str] | None = None) -> Step:
        needs = declared if needs is None else needs
        step = run_step([*args, "-o", str(out)], needs, rerun_args=[*args, "-o", str(out), "--force"])
        note_flags(step)
        if step.problem is None and step.completed.returncode == EXIT_OK:
            run.outputs[name] = str(out)
        return step

    # a file without model weights (optimizer, scheduler, RNG state): the commands that rewrite weights refuse it
    # in one line that says what it holds
    weightless = bool(report) and report.get("layout") is None

    # add-prefix, then strip (of the input's own wrapper; of add-prefix's output when it has none)
    step = write("add-prefix", ["add-prefix", source, "--prefix", ADDED_PREFIX], work / f"added{suffix}")
    record("add-prefix", refused_or(step, weightless))
    prefix = report.get("prefix") or ""
    strip_source = source if prefix else run.outputs.get("add-prefix")
    if weightless:
        step = write("strip", ["strip", source], work / f"stripped{suffix}")
        record("strip", refused_or(step, weightless))
    elif strip_source is None:
        record("strip", "no add-prefix output to strip")
    else:
        # add-prefix's output needs the input's flags only if it kept the classes (a whole pickled model is
        # written as a plain state dict, which needs none)
        needs = declared
        if strip_source != source:
            scanned = ckptool("scan", "--json", strip_source)
            if scanned.stdout.strip() and json.loads(scanned.stdout).get("verdict") == "safe":
                needs = []
        step = write("strip", ["strip", strip_source], work / f"stripped{suffix}", needs)
        detail = f"stripped {prefix!r}" if prefix else "round trip of add-prefix's output"
        record("strip", refused_or(step, weightless), detail)

    # remap --to cpu: pickles only (safetensors has no device tags)
    if not str(report.get("format", "")).startswith("safetensors"):
        step = write("remap", ["remap", source, "--to", "cpu"], work / "remapped.pt")
        record("remap --to cpu", refused_or(step, False))

    # convert to safetensors (a folder input: a folder of shards + index), then that back to .pt
    if path.is_dir():  # a name without a suffix is a folder output
        step = write("safetensors", ["convert", source], work / "converted")
    else:
        step = write("safetensors", ["convert", source], work / "converted.safetensors")
    record("convert .safetensors", refused_or(step, weightless))
    if "safetensors" in run.outputs:
        converted = Path(run.outputs["safetensors"])
        back = work / "back.pt"
        completed = ckptool("convert", str(converted), "-o", str(back))
        if completed.returncode == EXIT_OK:
            run.outputs["pt"] = str(back)
        record("convert back to .pt", None if completed.returncode == EXIT_OK else last_line(completed))
        completed = ckptool("verify", str(converted), "--against", source, "--devices", "cpu", *flags)
        record("verify --against", None if completed.returncode == EXIT_OK else last_line(completed))
        completed = ckptool("diff", source, str(converted), *flags)
        record("diff", None if completed.returncode == EXIT_OK else last_line(completed))
    elif not weightless:
        for check in ("convert back to .pt", "verify --against", "diff"):
            record(check, "no safetensors output")
    if weightless and state_weights:  # what a file without model weights holds, written when asked
        completed = ckptool("convert", source, "-o", str(work / "state.safetensors"), "--weights", "state", *flags)
        holds_state = any(candidate.get("kind") == "optimizer state" for candidate in report.get("candidates") or [])
        if holds_state:  # an optimizer's state: its tensors go to safetensors
            record("convert --weights state", None if completed.returncode == EXIT_OK else last_line(completed))
        else:  # a scheduler's, the RNG's, the training arguments: refused in one line that says so
            refused = completed.returncode == EXIT_REFUSED and completed.stderr.count("\n") == 1 \
                and "optimizer state" in completed.stderr and not (work / "state.safetensors").exists()
            record("convert --weights state", None if refused else f"expected one refusal line, got exit "
                   f"{completed.returncode}: {last_line(completed)}", "refused: no optimizer state in it")

    run.report, run.strip_prefix = report, prefix
    if values:
        check_values(framework, case, path, run, torch_view(value_sources(path, run), work))
    return run


def value_sources(path: Path, run: CaseRun) -> list[Path]:
    """The files whose torch reading :func:`check_values` needs: the input and every output."""
    return [path, *map(Path, run.outputs.values())] if run.report else []


def check_values(framework: str, case: dict, path: Path, run: CaseRun, views: dict[str, dict]) -> None:
    """Every output's tensors against torch's own reading of the input (``views``: :func:`torch_view` of
    :func:`value_sources`); one ``values`` outcome."""

    def record(problem: str | None, detail: str = "") -> None:
        run.outcomes.append(Outcome(framework, case["id"], "values", problem is None, problem or detail))

    report = run.report
    if not report:
        return
    outputs = {name: Path(out) for name, out in run.outputs.items()}
    reference = views[str(path)]
    if reference["error"]:
        record(None, f"not compared: torch does not read the input ({reference['error'][:160]})")
        return
    problems = []
    if "remap" in outputs:  # remap keeps everything: every tensor dict of the file, not only the weights
        view = views[str(outputs["remap"])]
        if view["error"]:
            problems.append(f"remap: torch cannot read the output: {view['error'][:200]}")
        else:
            for key_path, tensors in reference["dicts"]:
                problem = compare(tensors, weights_at(view, key_path))
                if problem:
                    problems.append(f"remap: at {key_path}: {problem}")
            if set(view["locations"]) - {"cpu"}:
                problems.append(f"remap: output still tagged {sorted(set(view['locations']) - {'cpu'})}")
    if report.get("layout") is None:
        record("; ".join(problems) or None,
               f"no model weights; remap's output holds every tensor torch reads in the input ({reference['loader']})")
        return
    expected = weights_at(reference, report["layout"])
    if not expected:
        record(f"torch finds no tensors at ckptool's layout {report['layout']} ({reference['loader']})")
        return
    for name, out in outputs.items():
        if name == "remap":
            continue
        view = views[str(out)]
        if view["error"]:
            problems.append(f"{name}: torch cannot read the output: {view['error'][:200]}")
            continue
        rename: Callable[[str], str] = lambda key: key  # noqa: E731
        if name == "add-prefix":
            rename = lambda key: ADDED_PREFIX + key  # noqa: E731
        elif name == "strip":
            rename = lambda key: key.removeprefix(run.strip_prefix)  # noqa: E731
        problem = compare(expected, weights_with_keys(view, {rename(key) for key in expected}), rename)
        if problem:
            problems.append(f"{name}: {problem}")
    record("; ".join(problems) or None,
           f"{len(expected)} tensors of {len(outputs)} outputs equal torch's reading ({reference['loader']})")
