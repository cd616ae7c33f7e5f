"""``make fuzz``: the C extensions under AddressSanitizer and UBSan, held to their Python twins.

Steps, in order (``python scripts/fuzz/run.py [STEP ...]`` runs some; none: all four):

    build    build/fuzz/: a copy of ckptool/ and tests/ (the rest linked) whose two extensions are compiled
             with -fsanitize=address,undefined. The in-place .so files of the checkout are never touched.
    canary   proves the sanitizers are live: canary.c, compiled with the same flags and loaded under the same
             environment, must die with ASan's heap-buffer-overflow report and UBSan's signed-overflow report
             (and its clean calls pass); the real extensions must carry the instrumentation (their symbols).
    tests    the C-vs-Python differential tests (test_guard_native, test_fastload, test_fuzz)
             run under the sanitized build.
    fuzz     mutants of the fixtures, the hostile corpus and ../shared/corpus/ through every twin and the public
             API (worker.py, twins.py) for FUZZ_SECONDS (default 120). A memory error, a hang, a difference
             between C and Python, or an exception other than a CkptError is written to the findings folder
             (FUZZ_FINDINGS, default build/fuzz-findings/) with what went wrong, and the step fails.

Other steps: ``replay FILE...`` runs every oracle on the given files under the sanitized build; ``atheris``
(when the atheris package is installed) runs the coverage-guided fuzz for FUZZ_SECONDS instead of ``fuzz``;
``selftest`` plants a difference, a crash in C and a hang in the worker and checks each is filed and fails.

Environment: FUZZ_SECONDS, FUZZ_SEED (the worker's first random seed; default: from the clock),
FUZZ_FINDINGS, FUZZ_HANG_SECONDS (one input this long is a hang; default 120), CC (default gcc).
A finding becomes a regression test by copying its input into tests/data/fuzz/ (tests/test_fuzz.py
replays every file there through the same oracles).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
BUILD = REPO / "build" / "fuzz"
EXTENSIONS = ("ckptool/native/_guard.c", "ckptool/native/_fastload.c")
COPIED = ("ckptool", "tests")  # the tests are copied too: conftest.py puts its own parent first on sys.path
NOT_LINKED = {"build", ".git", ".venv", "ckptool", "tests", "demo-out", ".pytest_cache", ".hypothesis"}
SANITIZE = ("-fsanitize=address,undefined", "-fsanitize=float-cast-overflow", "-fno-sanitize-recover=all")
CFLAGS = ("-shared", "-fPIC", "-O1", "-g", "-fno-omit-frame-pointer", "-Wall", "-Wno-unused-function", *SANITIZE)
DIFFERENTIAL_TESTS = ("tests/test_guard_native.py", "tests/test_fastload.py", "tests/test_fuzz.py")
SHARED_CORPUS = REPO.parent / "shared" / "corpus"
# symbols only an instrumented object calls: their absence means a flag was lost
ASAN_SYMBOL, UBSAN_SYMBOL = "__asan_report_load", "__ubsan_handle_"


def compiler() -> str:
    return os.environ.get("CC", "gcc")


def runtime(name: str) -> str:
    """The sanitizer runtime the compiler links against (``libasan.so``), as a path that exists."""
    found = subprocess.run([compiler(), f"-print-file-name={name}"], capture_output=True, text=True,
                           check=True).stdout.strip()
    if not Path(found).is_absolute() or not Path(found).exists():
        raise SystemExit(f"fuzz: {compiler()} has no {name} (install its sanitizer runtimes, e.g. libasan8 and "
                         "libubsan1 on Debian)")
    return str(Path(found).resolve())


def sanitized_env(python_path: Path = BUILD) -> dict[str, str]:
    """A process that loads the sanitized extensions: the runtimes preloaded (CPython is not instrumented),
    every Python allocation through malloc (so ASan sees overflows of Python objects, not only of C buffers)."""
    environment = dict(os.environ)
    environment.update({
        "PYTHONPATH": os.pathsep.join(filter(None, [str(python_path), os.environ.get("PYTHONPATH")])),
        "LD_PRELOAD": f"{runtime('libasan.so')}:{runtime('libubsan.so')}",
        # leaks: CPython keeps its interned objects to the end by design; abort: a core-style death the driver
        # sees; may_return_null: a bomb's huge request is a MemoryError, as it is without ASan, not an ASan abort
        "ASAN_OPTIONS": "detect_leaks=0:abort_on_error=1:allocator_may_return_null=1:handle_abort=1",
        "UBSAN_OPTIONS": "halt_on_error=1:print_stacktrace=1",
        "PYTHONMALLOC": "malloc",
        "PYTHONDONTWRITEBYTECODE": "1",
        "OMP_NUM_THREADS": "1",
    })
    environment.pop("CKPTOOL_DEBUG", None)
    for name in [key for key in environment if key.startswith("CKPTOOL_PURE_PYTHON")]:
        del environment[name]  # the fuzz switches each twin itself
    return environment


def plain_env() -> dict[str, str]:
    """The checkout's own build, every twin switched by the fuzz itself."""
    environment = {key: value for key, value in os.environ.items() if not key.startswith("CKPTOOL_PURE_PYTHON")}
    environment["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    environment.pop("CKPTOOL_DEBUG", None)
    return environment


# ------------------------------------------------------------------------------------------------ build


def compile_extension(source: Path, target: Path) -> None:
    include = sysconfig.get_paths()["include"]
    command = [compiler(), *CFLAGS, f"-I{include}", str(source), "-o", str(target)]
    completed = subprocess.run(command, capture_output=True, text=True)
    if completed.returncode != 0:
        raise SystemExit(f"fuzz: compiling {source} failed:\n{completed.stderr}")


def build() -> None:
    started = time.monotonic()
    if BUILD.exists():
        shutil.rmtree(BUILD)
    BUILD.mkdir(parents=True)
    ignore = shutil.ignore_patterns("*.so", "*.pyd", "__pycache__", "*.pyc")
    for name in COPIED:
        shutil.copytree(REPO / name, BUILD / name, ignore=ignore, symlinks=True)
    for entry in REPO.iterdir():  # fixtures, README, pyproject.toml...: what the tests read beside the package
        if entry.name not in NOT_LINKED:
            (BUILD / entry.name).symlink_to(entry)
    suffix = sysconfig.get_config_var("EXT_SUFFIX")
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        for future in [pool.submit(compile_extension, BUILD / source, BUILD / (source[:-2] + suffix))
                       for source in EXTENSIONS]:
            future.result()
    for source in EXTENSIONS:
        built = BUILD / (source[:-2] + suffix)
        symbols = subprocess.run(["nm", "-D", "--undefined-only", str(built)], capture_output=True, text=True,
                                 check=True).stdout
        if ASAN_SYMBOL not in symbols or UBSAN_SYMBOL not in symbols:
            raise SystemExit(f"fuzz: {built} is not instrumented (no {ASAN_SYMBOL}* or {UBSAN_SYMBOL}* symbols)")
    print(f"fuzz: built {len(EXTENSIONS)} sanitized extensions into {BUILD.relative_to(REPO)} "
          f"in {time.monotonic() - started:.0f} s", flush=True)


# ------------------------------------------------------------------------------------------------ canary


def canary() -> None:
    """The sanitizers, proven live on a fault of each kind they must catch."""
    with tempfile.TemporaryDirectory(prefix="ckptool-canary-") as folder:
        target = Path(folder) / ("_canary" + sysconfig.get_config_var("EXT_SUFFIX"))
        compile_extension(HERE / "canary.c", target)
        environment = sanitized_env(Path(folder))
        cases = (("_canary.copy(8) + _canary.add(0)", True, ""),  # in bounds, no overflow: runs clean
                 ("_canary.copy(9)", False, "heap-buffer-overflow"),
                 ("_canary.add(1)", False, "signed integer overflow"))
        for call, clean, report in cases:
            completed = subprocess.run([sys.executable, "-c", f"import _canary; print({call})"], env=environment,
                                       capture_output=True, text=True, timeout=120)
            if clean and completed.returncode != 0:
                raise SystemExit(f"fuzz: the canary's clean call failed under the sanitizers:\n{completed.stderr}")
            if not clean and (completed.returncode == 0 or report not in completed.stderr):
                raise SystemExit(f"fuzz: the sanitizers are not live: {call} exited {completed.returncode} without "
                                 f"{report!r} on stderr:\n{completed.stderr[-2000:]}")
    # and the real extensions, loaded from build/fuzz with ASan mapped in, by the worker's own check
    check = subprocess.run([sys.executable, str(HERE / "worker.py"), "--check"], env=sanitized_env(),
                           capture_output=True, text=True, timeout=300)
    if check.returncode != 0:
        raise SystemExit(f"fuzz: the sanitized build does not load as it should:\n{check.stdout}{check.stderr}")
    print("fuzz: sanitizers live (ASan heap-buffer-overflow and UBSan signed overflow caught in canary.c; "
          f"{check.stdout.strip()})", flush=True)


# ------------------------------------------------------------------------------------------------ tests


def tests(extra: list[str] | None = None) -> None:
    started = time.monotonic()
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "0", "-x",
               *DIFFERENTIAL_TESTS, *(extra or [])]
    completed = subprocess.run(command, cwd=BUILD, env=sanitized_env())
    if completed.returncode != 0:
        raise SystemExit(f"fuzz: the differential tests failed under the sanitizers (exit {completed.returncode}); "
                         f"rerun: cd {BUILD} && <sanitized env> {' '.join(command)}")
    print(f"fuzz: differential tests passed under the sanitizers in {time.monotonic() - started:.0f} s", flush=True)


# ------------------------------------------------------------------------------------------------ fuzz


def findings_dir() -> Path:
    return Path(os.environ.get("FUZZ_FINDINGS", REPO / "build" / "fuzz-findings"))


def seed_folders(work: Path) -> list[Path]:
    """The fixtures, a fresh hostile corpus, the committed findings, ../shared/corpus/ where it is, and the
    coverage-guided fuzz's corpus where an atheris run left one (its inputs reach code the others do not)."""
    hostile = work / "hostile"
    subprocess.run([sys.executable, "-c", "import sys, warnings; sys.path.insert(0, 'tests'); import hostile; "
                    "warnings.simplefilter('ignore'); hostile.build_corpus(__import__('pathlib').Path(sys.argv[1]))",
                    str(hostile)], cwd=REPO, check=True, capture_output=True)
    folders = [REPO / "fixtures", hostile, REPO / "tests" / "data" / "fuzz"]
    if SHARED_CORPUS.is_dir():
        folders.append(SHARED_CORPUS)
    folders.append(REPO / "build" / "fuzz-corpus")
    return [folder for folder in folders if folder.is_dir()]


def fuzz(seconds: float | None = None, *, findings: Path | None = None, hang: float | None = None,
         folders: list[Path] | None = None, plant: str = "") -> None:
    """The worker, restarted after every crash or hang until the time is spent; then the verdict."""
    seconds = float(os.environ.get("FUZZ_SECONDS", "120")) if seconds is None else seconds
    hang = float(os.environ.get("FUZZ_HANG_SECONDS", "120")) if hang is None else hang
    seed = int(os.environ.get("FUZZ_SEED", str(int(time.time()))))
    findings = findings_dir() if findings is None else findings
    findings.mkdir(parents=True, exist_ok=True)
    before = set(findings.iterdir())
    with tempfile.TemporaryDirectory(prefix="ckptool-fuzz-") as folder:
        work = Path(folder)
        folders = seed_folders(work) if folders is None else folders
        deadline = time.monotonic() + seconds
        runs = 0
        while (left := deadline - time.monotonic()) > 5:
            current = work / "current"
            current.mkdir(exist_ok=True)
            for stale in current.iterdir():
                stale.unlink()
            command = [sys.executable, str(HERE / "worker.py"), "--seconds", f"{left:.0f}", "--seed", str(seed + runs),
                       "--findings", str(findings), "--current", str(current), *map(str, folders)]
            log = work / f"worker-{runs}.log"
            with open(log, "wb") as stderr:
                process = subprocess.Popen(command, env={**sanitized_env(), "FUZZ_PLANT": plant}, stderr=stderr,
                                           cwd=work)
                rc = _watch(process, current, hang, left + hang)
            runs += 1
            if rc != 0:
                _record_death(rc, current, log, findings, hang)
            else:
                sys.stderr.write(log.read_text(errors="replace"))
    new = sorted(set(findings.iterdir()) - before)
    if new:
        listing = "\n  ".join(str(p) for p in new if p.suffix == ".txt")
        raise SystemExit(f"fuzz: {len([p for p in new if p.suffix == '.txt'])} finding(s), each input beside its "
                         f".txt:\n  {listing}\nmake each a test: copy the input into tests/data/fuzz/ "
                         "(tests/test_fuzz.py replays every file there)")
    print(f"fuzz: no findings in {seconds:.0f} s ({runs} worker run(s))", flush=True)


def _watch(process: subprocess.Popen, current: Path, hang: float, limit: float) -> int:
    """Wait for the worker; kill it when one input has been running for ``hang`` seconds (-1: a hang)."""
    started = time.monotonic()
    while True:
        try:
            return process.wait(timeout=1.0)
        except subprocess.TimeoutExpired:
            pass
        try:  # the worker replaces its marker between inputs: absent for a moment, not an error
            since: float | None = (current / "input.json").stat().st_mtime
        except FileNotFoundError:
            since = None
        if since is not None and time.time() - since > hang or time.monotonic() - started > limit:
            process.kill()
            process.wait()
            return -1


def _record_death(rc: int, current: Path, log: Path, findings: Path, hang: float) -> None:
    """A worker that died (a sanitizer's abort, a segfault) or hung: its input and its stderr into findings."""
    import hashlib

    inputs = [p for p in current.iterdir() if p.name.startswith("input.") and p.suffix != ".json"]
    data = inputs[0].read_bytes() if inputs else b""
    kind = "hang" if rc == -1 else "crash"
    name = f"{kind}-{hashlib.sha256(data).hexdigest()[:16]}"
    suffix = inputs[0].suffix if inputs else ".bin"
    (findings / f"{name}{suffix}").write_bytes(data)
    meta = (current / "input.json").read_text() if (current / "input.json").exists() else "{}"
    stderr = log.read_text(errors="replace")
    cause = f"no input finished within {hang:.0f} s" if rc == -1 else f"the worker died (exit {rc})"
    (findings / f"{name}.txt").write_text(f"{cause} on {name}{suffix}\nmutant: {meta}\n\nstderr (last 200 lines):\n"
                                          + "\n".join(stderr.splitlines()[-200:]) + "\n")
    print(f"fuzz: {kind}: {findings / (name + suffix)} (see {name}.txt)", flush=True)


def selftest() -> None:
    """The driver files each kind of fault and fails: a planted difference, a crash in C under ASan, a hang."""
    with tempfile.TemporaryDirectory(prefix="ckptool-fuzz-selftest-") as folder:
        seeds = Path(folder) / "seeds"
        shutil.copytree(REPO / "fixtures" / "wild", seeds)  # a few small seeds: the faults are planted anyway
        for plant, kind in (("mismatch", "plant-"), ("crash", "crash-"), ("hang", "hang-")):
            findings = Path(folder) / plant
            try:
                fuzz(25, findings=findings, hang=8, folders=[seeds], plant=plant)
            except SystemExit as e:
                filed = sorted(p.name for p in findings.iterdir())
                if not any(name.startswith(kind) and name.endswith(".txt") for name in filed) or \
                        not any(name.startswith(kind) and not name.endswith(".txt") for name in filed):
                    raise SystemExit(f"fuzz: a planted {plant} was not filed as {kind}*: {filed}") from e
                report = next(p for p in findings.iterdir() if p.name.startswith(kind) and p.suffix == ".txt")
                if plant == "crash" and "AddressSanitizer" not in report.read_text():
                    raise SystemExit(f"fuzz: the planted crash's report lacks ASan's: {report.read_text()[-2000:]}")
                continue
            raise SystemExit(f"fuzz: a planted {plant} did not fail the fuzz step")
    print("fuzz: self-test passed (a planted difference, crash and hang were each filed and failed the step)")


def replay(files: list[str]) -> None:
    completed = subprocess.run([sys.executable, str(HERE / "worker.py"), "--replay", *files], env=sanitized_env())
    if completed.returncode != 0:
        raise SystemExit(completed.returncode)


def atheris_fuzz() -> None:
    """The coverage-guided fuzz (atheris_target.py) for FUZZ_SECONDS; its corpus grows in build/fuzz-corpus/.

    It runs the checkout's own extensions, not the sanitized copies: gcc's ASan runtime, preloaded, takes over
    the coverage hooks atheris's libFuzzer reads, and its guidance goes blind. A crash is still a crash
    (libFuzzer keeps the input); ``run.py replay`` shows it under the sanitizers."""
    seconds = float(os.environ.get("FUZZ_SECONDS", "120"))
    findings = findings_dir()
    findings.mkdir(parents=True, exist_ok=True)
    corpus = REPO / "build" / "fuzz-corpus"  # kept between runs: libFuzzer starts from what it found before
    corpus.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="ckptool-atheris-") as folder:
        folders = seed_folders(Path(folder))
        completed = subprocess.run([sys.executable, str(HERE / "atheris_target.py"), f"-max_total_time={seconds:.0f}",
                                    f"-artifact_prefix={findings}/", "-rss_limit_mb=4096", "-timeout=300",
                                    str(corpus), *map(str, folders)], env=plain_env())
    if completed.returncode != 0:
        raise SystemExit(f"fuzz: atheris stopped on a finding (exit {completed.returncode}); its input is in "
                         f"{findings} (crash-*, timeout-*, oom-*)")


def main(argv: list[str]) -> None:
    steps = argv or ["build", "canary", "tests", "fuzz"]
    if steps[0] == "replay":
        replay(steps[1:])
        return
    timings = []
    for step in steps:
        started = time.monotonic()
        {"build": build, "canary": canary, "tests": tests, "fuzz": fuzz, "atheris": atheris_fuzz,
         "selftest": selftest}[step]()
        timings.append(f"{step} {time.monotonic() - started:.0f} s")
    print(f"fuzz: done ({', '.join(timings)})")


if __name__ == "__main__":
    main(sys.argv[1:])
