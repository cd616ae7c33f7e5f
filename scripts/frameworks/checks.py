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
import re
import shlex
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # scripts/: the tensor comparison shared
from tensor_compare import compare, same_tensor  # noqa: E402,F401
from tensor_compare import torch_view as reference_view  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[2]
ADDED_PREFIX = "module."  # a known wrapper: strip of add-prefix's output is a round trip
COMMAND_TIMEOUT_S = 600
EXIT_OK, EXIT_PROBLEM, EXIT_REFUSED = 0, 1, 3
# a weights file as the libraries name it in a model folder: <stem>[.<variant>][-0000N-of-0000M].<kind>
WEIGHTS_NAME = re.compile(r"(?P<stem>model|pytorch_model|diffusion_pytorch_model|adapter_model|pytorch_lora_weights)"
                          r"(?:\.(?P<variant>\w+))?(?P<shard>-\d{5}-of-\d{5})?\.(?P<kind>safetensors|bin)")
INDEX_NAME = re.compile(r".+\.(safetensors|bin)\.index(\.\w+)?\.json")
# the name a library reads a weights file by once it is safetensors (transformers: model.safetensors)
SAFETENSORS_STEM = {"pytorch_model": "model"}


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
    parts: list[Part] = field(default_factory=list)  # the whole input, or each component a case names


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

def source_key(source: Path | tuple[Path, str | None]) -> str:
    """The key :func:`torch_view` files a source's reading under."""
    path, variant = source if isinstance(source, tuple) else (source, None)
    return f"{path}#{variant}" if variant else str(path)


def weight_files(folder: Path, variant: str | None) -> list[Path]:
    """The weights files the libraries name in ``folder`` (not below it), of one variant."""
    found: list[Path] = []
    if not folder.is_dir():
        return found
    for path in sorted(folder.iterdir()):
        match = WEIGHTS_NAME.fullmatch(path.name)
        if match and path.is_file() and match["variant"] == variant:
            found.append(path)
    return found


def torch_view(sources: list[Path | tuple[Path, str | None]], work: Path) -> dict[str, dict]:
    """scripts/realworld_reference.py's reading of each source (a throwaway subprocess), by :func:`source_key`;
    a folder: its weight files of the variant asked for, top-level dicts merged."""
    files: list[Path] = []
    members: dict[str, list[Path]] = {}
    for source in sources:
        path, variant = source if isinstance(source, tuple) else (source, None)
        if path.is_dir() or not path.exists():  # a folder (one convert did not write: no weight files)
            found = weight_files(path, variant)
            members[source_key(source)] = found
            files.extend(found)
        else:
            files.append(path)
    views = reference_view(sorted(set(files)), work, timeout=COMMAND_TIMEOUT_S)
    for key, found in members.items():
        merged: dict[str, object] = {}
        errors = [views[str(p)]["error"] for p in found if views[str(p)]["error"]]
        for p in found:
            for key_path, tensors in views[str(p)]["dicts"]:
                if not key_path:
                    merged.update(tensors)
        views[key] = {"loader": "folder", "error": errors[0] if errors else
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


# ---------------------------------------------------------------------------------------------- a folder's tree


def converted_name(name: str) -> str | None:
    """What convert of a folder writes a weights file of the input as (None: not a weights file, copied as it is):
    safetensors under the name its library reads first, a variant and a shard number kept."""
    match = WEIGHTS_NAME.fullmatch(name)
    if match is None:
        return None
    stem = SAFETENSORS_STEM.get(match["stem"], match["stem"])
    return f"{stem}{'.' + match['variant'] if match['variant'] else ''}{match['shard'] or ''}.safetensors"


def tree_problem(source: Path, out: Path, variant: str | None = None) -> str | None:
    """None when ``out`` is convert's folder of ``source``: the same tree, every weights file (of ``variant`` when
    one is asked for) written as safetensors under its library's name, every other file copied byte for byte, no
    pickled weights left and no file added but an index."""
    if not out.is_dir():
        return f"{out} is not a folder"
    made = {str(p.relative_to(out)) for p in out.rglob("*") if p.is_file()}
    expected: set[str] = set()
    for path in sorted(p for p in source.rglob("*") if p.is_file()):
        relative = path.relative_to(source)
        if INDEX_NAME.fullmatch(path.name):
            continue  # a sharded set's index is written anew with its shards
        target = converted_name(path.name)
        if target is None:
            if str(relative) not in made:
                return f"{relative} was not copied"
            if (out / relative).read_bytes() != path.read_bytes():
                return f"{relative} was copied with other bytes"
            expected.add(str(relative))
            continue
        wanted = variant is None or WEIGHTS_NAME.fullmatch(path.name)["variant"] == variant
        converted = str(relative.with_name(target))
        if wanted and converted not in made:
            return f"{relative}: no {converted} in the output (it holds {sorted(made)})"
        if converted in made:
            expected.add(converted)
    extra = sorted(name for name in made - expected if not INDEX_NAME.fullmatch(Path(name).name))
    pickled = sorted(name for name in made if converted_name(Path(name).name) and not name.endswith(".safetensors"))
    if extra or pickled:
        return f"the output holds files the input did not: {extra or pickled}"
    return None


# ---------------------------------------------------------------------------------------------- one case


@dataclass
class Part:
    """What one case's commands read: the whole input, or one component of a model folder (``--weights NAME``)."""

    component: str  # "" for the whole input
    selection: list[str]  # the flags every command reading the input gets (--weights NAME, --variant V)
    reference: tuple[Path, str | None]  # what torch reads for the values: the input, or the component's folder
    report: dict = field(default_factory=dict)  # inspect --json --fingerprint with the selection ({}: it failed)
    strip_prefix: str = ""  # the wrapper prefix strip removed ("": strip was a round trip of add-prefix's output)
    outputs: dict[str, str] = field(default_factory=dict)  # this part's outputs, by their name in CaseRun.outputs
    tree: tuple[Path, str | None] | None = None  # the component's folder in convert's output tree


def case_components(case: dict) -> list[str]:
    """The case's ``weights``: the components every weights command runs on, one by one (``[]``: the whole)."""
    weights = case.get("weights")
    if weights is None:
        return []
    return [weights] if isinstance(weights, str) else list(weights)


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


class CaseChecks:
    """The commands of one case, their outcomes and outputs (:attr:`run`)."""

    def __init__(self, framework: str, case: dict, path: Path, work: Path) -> None:
        self.framework, self.case, self.path, self.work = framework, case, path, work
        self.declared = list(case.get("allow_globals") or [])
        self.variant = case.get("variant")
        self.run = CaseRun()
        work.mkdir(parents=True, exist_ok=True)
        for old in work.iterdir():
            shutil.rmtree(old) if old.is_dir() else old.unlink()

    def record(self, check: str, problem: str | None, detail: str = "") -> None:
        self.run.outcomes.append(Outcome(self.framework, self.case["id"], check, problem is None, problem or detail))

    def note_flags(self, step: Step) -> None:
        if step.refused and self.run.flags_seen is None:
            self.run.flags_seen = step.flags

    def write(self, part: Part, name: str, args: list[str], out: Path, needs: list[str] | None = None) -> Step:
        step = run_step([*args, "-o", str(out)], self.declared if needs is None else needs,
                        rerun_args=[*args, "-o", str(out), "--force"])
        self.note_flags(step)
        if step.problem is None and step.completed.returncode == EXIT_OK:
            key = f"{name}:{part.component}" if part.component else name
            self.run.outputs[key] = part.outputs[key] = str(out)
        return step

    def output(self, part: Part, name: str) -> str | None:
        return part.outputs.get(f"{name}:{part.component}" if part.component else name)

    def inspect(self, part: Part, tag: str) -> list[str]:
        """inspect (human text, then --json with the fingerprint); the --allow-global flags a refusal printed."""
        source = [str(self.path), *part.selection]
        step = run_step(["inspect", *source], self.declared)
        self.note_flags(step)
        ok = step.problem or (None if step.completed.returncode == EXIT_OK else last_line(step.completed))
        self.record(f"inspect{tag}", ok, f"flags {step.flags}" if step.flags else "no flag")
        flags = flags_for(step.flags)
        completed = ckptool("inspect", "--json", "--fingerprint", *source, *flags)
        if completed.returncode == EXIT_OK:
            part.report = json.loads(completed.stdout)
        report = part.report
        self.record(f"inspect --json{tag}", None if completed.returncode == EXIT_OK else last_line(completed),
                    f"{report.get('tensors')} tensors at {report.get('layout')}, prefix {report.get('prefix')!r}")
        return flags

    def scan(self) -> None:
        """scan: never dangerous; safe with the flags a refusal printed (unknown without them)."""
        source, declared = str(self.path), self.declared
        completed = ckptool("scan", "--json", source)
        if completed.returncode not in (EXIT_OK, EXIT_PROBLEM):
            self.record("scan", last_line(completed))
            return
        document = json.loads(completed.stdout)
        verdict, problem = document.get("verdict"), None
        if verdict == "dangerous":
            problem = f"scan calls a framework's file dangerous: {document.get('dangerous')}"
        elif declared and verdict != "unknown":
            problem = f"verdict {verdict!r} for a file that needs {declared}"
        elif not declared and verdict != "safe" and not (self.path.is_dir() and verdict == "unknown"):
            # a training folder's weights read with no flag while a side file (training_args.bin) needs trust:
            # scan judges every pickle in the folder, so unknown is its right verdict there
            problem = f"verdict {verdict!r} for a file that reads with no flag: {document.get('unsafe')}"
        if problem is None and declared:
            allowed = ckptool("scan", "--json", source, *flags_for(declared))
            allowed_verdict = json.loads(allowed.stdout).get("verdict") if allowed.stdout.strip() else None
            if allowed.returncode != EXIT_OK or allowed_verdict != "safe":
                problem = f"with {declared}: verdict {allowed_verdict!r}, {last_line(allowed)}"
        self.record("scan", problem, f"verdict {verdict}")

    def rewrites(self, part: Part, work: Path, tag: str) -> bool:
        """add-prefix, then strip (of the input's own wrapper; of add-prefix's output when it has none), remap.
        Whether the part holds no model weights (those commands then refuse it in one line)."""
        report, source = part.report, [str(self.path), *part.selection]
        suffix = ".safetensors" if is_safetensors(self.path / part.component) else ".pt"
        weightless = bool(report) and report.get("layout") is None
        step = self.write(part, "add-prefix", ["add-prefix", *source, "--prefix", ADDED_PREFIX],
                          work / f"added{suffix}")
        self.record(f"add-prefix{tag}", refused_or(step, weightless))
        part.strip_prefix = prefix = report.get("prefix") or ""
        added = self.output(part, "add-prefix")
        if weightless or prefix:
            step = self.write(part, "strip", ["strip", *source], work / f"stripped{suffix}")
            self.record(f"strip{tag}", refused_or(step, weightless), f"stripped {prefix!r}" if prefix else "")
        elif added is None:
            self.record(f"strip{tag}", "no add-prefix output to strip")
        else:
            # add-prefix's output needs the input's flags only if it kept the classes (a whole pickled model is
            # written as a plain state dict, which needs none)
            scanned = ckptool("scan", "--json", added)
            safe = scanned.stdout.strip() and json.loads(scanned.stdout).get("verdict") == "safe"
            step = self.write(part, "strip", ["strip", added], work / f"stripped{suffix}", [] if safe else None)
            self.record(f"strip{tag}", refused_or(step, weightless), "round trip of add-prefix's output")
        if not str(report.get("format", "")).startswith("safetensors"):  # safetensors has no device tags
            step = self.write(part, "remap", ["remap", *source, "--to", "cpu"], work / "remapped.pt")
            self.record(f"remap --to cpu{tag}", refused_or(step, False))
        return weightless

    def converts(self, part: Part, work: Path, tag: str, flags: list[str], weightless: bool) -> None:
        """convert to safetensors (a folder input as a whole: a folder), that back to .pt, verify, diff."""
        source = [str(self.path), *part.selection]
        folder_out = self.path.is_dir() and not part.component  # a name without a suffix is a folder output
        out = work / ("converted" if folder_out else "converted.safetensors")
        step = self.write(part, "safetensors", ["convert", *source], out)
        self.record(f"convert .safetensors{tag}", refused_or(step, weightless))
        converted = self.output(part, "safetensors")
        if converted is None:
            if not weightless:
                for check in ("convert back to .pt", "verify --against", "diff"):
                    self.record(f"{check}{tag}", "no safetensors output")
            return
        if folder_out and self.case.get("tree"):
            self.record("convert tree", tree_problem(self.path, out, self.variant),
                        "every weights file as safetensors, every other file copied byte for byte")
        completed = ckptool("convert", converted, "-o", str(work / "back.pt"))
        if completed.returncode == EXIT_OK:
            key = f"pt:{part.component}" if part.component else "pt"
            self.run.outputs[key] = part.outputs[key] = str(work / "back.pt")
        self.record(f"convert back to .pt{tag}", None if completed.returncode == EXIT_OK else last_line(completed))
        # a component is compared with its folder in convert's tree (--variant, like --weights, then names the
        # same weights on both sides); its single-file output's values are compared with torch's reading
        against, against_weights = converted, []
        if part.tree is not None and part.tree[0].is_dir():
            against = str(part.tree[0].parent)
            against_weights = ["--against-weights", part.component]
        completed = ckptool("verify", *source, "--against", against, *against_weights, "--devices", "cpu", *flags)
        self.record(f"verify --against{tag}", None if completed.returncode == EXIT_OK else last_line(completed),
                    f"against {'the tree' if against_weights else 'the .safetensors'}")
        weights_b = ["--weights-b", part.component] if against_weights else []
        completed = ckptool("diff", *source, against, *weights_b, *flags)
        self.record(f"diff{tag}", None if completed.returncode == EXIT_OK else last_line(completed),
                    f"against {'the tree' if against_weights else 'the .safetensors'}")

    def folder_tree(self, whole: Part, flags: list[str]) -> None:
        """A model folder of components: convert writes the same tree (a folder output), checked file by file;
        diff and verify compare the folders as wholes (every component)."""
        out = self.work / "converted"
        step = self.write(whole, "safetensors", ["convert", str(self.path), *whole.selection], out)
        self.record("convert .safetensors", refused_or(step, False), "a folder output")
        if "safetensors" not in self.run.outputs:
            self.record("convert tree", "no output folder")
            return
        self.record("convert tree", tree_problem(self.path, out, self.variant),
                    "every weights file as safetensors, every other file copied byte for byte")
        if self.variant:  # the output holds that variant alone: compared component by component
            return
        completed = ckptool("diff", str(self.path), str(out), *flags)
        self.record("diff", None if completed.returncode == EXIT_OK else last_line(completed), "every component")
        completed = ckptool("verify", str(out), "--against", str(self.path), "--devices", "cpu", *flags)
        self.record("verify --against", None if completed.returncode == EXIT_OK else last_line(completed))


def check_case(framework: str, case: dict, path: Path, work: Path, *, values: bool = True,
               state_weights: bool = False) -> CaseRun:
    """Every command on ``path`` (the case's file or folder), outputs under ``work`` (emptied first).

    A case with ``weights`` (a model folder of components) is inspected, scanned and converted as a whole (the
    output a folder of the same tree), and every other command runs on each component it names with
    ``--weights NAME`` (and ``--variant`` when the case has one); its check names end in `` [NAME]``.
    ``state_weights``: also ask a file without model weights to convert what it holds (``--weights state``).
    """
    checks = CaseChecks(framework, case, path, work)
    run, variant = checks.run, case.get("variant")
    whole = Part("", ["--variant", variant] if variant else [], (path, variant))
    flags = checks.inspect(whole, "")
    checks.scan()
    components = case_components(case)
    if not components:
        run.parts.append(whole)
        weightless = checks.rewrites(whole, work, "")
        checks.converts(whole, work, "", flags, weightless)
        if weightless and state_weights:
            state_check(checks, whole, flags)
    else:
        checks.folder_tree(whole, flags)
        for component in components:
            tree = Path(run.outputs["safetensors"]) / component if "safetensors" in run.outputs else None
            part = Part(component, ["--weights", component, *whole.selection], (path / component, variant),
                        tree=(tree, variant) if tree else None)
            tag = f" [{component}]"
            part_flags = checks.inspect(part, tag)
            (work / component).mkdir()
            weightless = checks.rewrites(part, work / component, tag)
            checks.converts(part, work / component, tag, part_flags, weightless)
            run.parts.append(part)
    run.report, run.strip_prefix = whole.report, whole.strip_prefix
    if values:
        check_values(framework, case, path, run, torch_view(value_sources(path, run), work))
    return run


def state_check(checks: CaseChecks, whole: Part, flags: list[str]) -> None:
    """What a file without model weights holds, written when asked (``--weights state``)."""
    work, source, report = checks.work, str(checks.path), whole.report
    completed = ckptool("convert", source, "-o", str(work / "state.safetensors"), "--weights", "state", *flags)
    holds_state = any(candidate.get("kind") == "optimizer state" for candidate in report.get("candidates") or [])
    if holds_state:  # an optimizer's state: its tensors go to safetensors
        checks.record("convert --weights state", None if completed.returncode == EXIT_OK else last_line(completed))
    else:  # a scheduler's, the RNG's, the training arguments: refused in one line that says so
        refused = completed.returncode == EXIT_REFUSED and completed.stderr.count("\n") == 1 \
            and "optimizer state" in completed.stderr and not (work / "state.safetensors").exists()
        checks.record("convert --weights state", None if refused else f"expected one refusal line, got exit "
                      f"{completed.returncode}: {last_line(completed)}", "refused: no optimizer state in it")


def value_sources(path: Path, run: CaseRun) -> list[Path | tuple[Path, str | None]]:
    """What :func:`check_values` needs torch to read: each part's reference and outputs (``path`` is the input)."""
    sources: list[Path | tuple[Path, str | None]] = []
    for part in run.parts:
        if part.report:
            sources += [part.reference, *map(Path, part.outputs.values()), *([part.tree] if part.tree else [])]
    return sources


def check_values(framework: str, case: dict, path: Path, run: CaseRun, views: dict[str, dict]) -> None:
    """Every output's tensors against torch's own reading of the input (``views``: :func:`torch_view` of
    :func:`value_sources`); one ``values`` outcome per part."""
    for part in run.parts:
        problem, detail = part_values(part, views)
        check = f"values [{part.component}]" if part.component else "values"
        run.outcomes.append(Outcome(framework, case["id"], check, problem is None, problem or detail))


def part_values(part: Part, views: dict[str, dict]) -> tuple[str | None, str]:
    """The problem with one part's outputs' values (None: none), and what was compared."""
    report = part.report
    if not report:
        return "no inspect --json report to compare with", ""
    outputs = {name.split(":")[0]: Path(out) for name, out in part.outputs.items()}
    reference = views[source_key(part.reference)]
    if reference["error"]:
        return None, f"not compared: torch does not read the input ({reference['error'][:160]})"
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
        return ("; ".join(problems) or None,
                f"no model weights; remap's output holds every tensor torch reads in the input ({reference['loader']})")
    expected = weights_at(reference, [] if part.component else report["layout"])
    if not expected:
        return f"torch finds no tensors at ckptool's layout {report['layout']} ({reference['loader']})", ""
    if part.tree is not None:
        outputs["convert tree"] = part.tree[0]
        view = views[source_key(part.tree)]
        problem = view["error"] or compare(expected, weights_at(view, []))
        if problem:
            problems.append(f"the tree's {part.component}/: {problem}")
    for name, out in outputs.items():
        if name in ("remap", "convert tree"):
            continue
        view = views[str(out)]
        if view["error"]:
            problems.append(f"{name}: torch cannot read the output: {view['error'][:200]}")
            continue
        rename: Callable[[str], str] = lambda key: key  # noqa: E731
        if name == "add-prefix":
            rename = lambda key: ADDED_PREFIX + key  # noqa: E731
        elif name == "strip":
            rename = lambda key: key.removeprefix(part.strip_prefix)  # noqa: E731
        problem = compare(expected, weights_with_keys(view, {rename(key) for key in expected}), rename)
        if problem:
            problems.append(f"{name}: {problem}")
    return ("; ".join(problems) or None,
            f"{len(expected)} tensors of {len(outputs)} outputs equal torch's reading ({reference['loader']})")
