"""Hostile and corrupt inputs: every command refuses them in one line, runs nothing, writes nothing.

The corpus is generated fresh (tests/hostile.py); the public picklescan corpus is read where it is
(/work/shared/corpus/picklescan/tests, skipped when absent). Each command runs in-process through
click's CliRunner (fast); a handful of cases run through a real ``python -m ckptool`` to prove no
traceback reaches a terminal.
"""

from __future__ import annotations

import os
import pickle
import shutil
import struct
import subprocess
import sys
import time
import tracemalloc
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
from click.testing import CliRunner

import ckptool
from ckptool import pickles
from ckptool.cli.main import main
from ckptool.base.errors import CkptError, InputError

sys.path.insert(0, str(Path(__file__).parent))
import hostile  # noqa: E402 — the corpus generator beside this file

PICKLESCAN = Path(os.environ.get("CKPTOOL_PICKLESCAN_CORPUS", "/work/shared/corpus/picklescan/tests"))
# not a speed test: a bound only a runaway (quadratic hashing, a bomb left unguarded) reaches, even
# on a loaded 2-core machine where one refusal can take seconds; the bounds themselves are tested
# by construction (tests of each limit), not by the clock
HANG_LIMIT_S = 120.0
TEMP_PREFIX = ".ckptool-tmp-"
# what a payload prints or leaves if it ran (picklescan's corpus); ckptool's own canaries are files
PAYLOAD_OUTPUT = ("pwned", "successful attack", "Injection running", "456")


@dataclass
class Corpus:
    root: Path
    cases: list[hostile.Case]
    canary_dir: Path
    good: Path  # a real torch.save'd checkpoint: the second argument of diff


@pytest.fixture(scope="session")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Corpus:
    root = tmp_path_factory.mktemp("hostile")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.jit's deprecation warnings
        cases = hostile.build_corpus(root / "corpus")
    good = hostile.write_good_checkpoint(root / "good.pt")
    return Corpus(root, cases, root / "corpus" / "canary", good)


def command_table(out: Path, good: Path) -> dict[str, Callable[[Path], list[str]]]:
    """Arguments for every command ckptool has."""
    table: dict[str, Callable[[Path], list]] = {
        "inspect": lambda p: ["inspect", p],
        "scan": lambda p: ["scan", p],
        "strip": lambda p: ["strip", p, "-o", out / "stripped.pt"],
        "add-prefix": lambda p: ["add-prefix", p, "-o", out / "prefixed.pt"],
        "remap": lambda p: ["remap", p, "--to", "cpu", "-o", out / "remapped.pt"],
        "convert": lambda p: ["convert", p, "-o", out / "converted.safetensors"],
        "verify": lambda p: ["verify", p],
        "diff": lambda p: ["diff", p, good],
    }
    return {name: (lambda p, make=make: [str(a) for a in make(p)]) for name, make in table.items()}


COMMANDS = ["inspect", "scan", "strip", "add-prefix", "remap", "convert", "verify", "diff"]


def test_the_hostile_suites_run_every_command() -> None:
    """A command added to the CLI gets a line in command_table, or the hostile suites would leave it out."""
    assert sorted(COMMANDS) == sorted(main.commands)


# data of another kind than a checkpoint, every pickle in it plain: every command refuses it, but scan
# judges it as it judges a plain pickle in a tree (safe, exit 0, a note saying what it is)
SCAN_JUDGES_SAFE = {"raw_plain_pickle", "legacy_pickle_only", "numpy_file"}


def expected_exit(command: str, expect: str, name: str = "") -> int:
    if command == "scan" and name in SCAN_JUDGES_SAFE:
        return 0
    return 1 if command == "scan" and expect == hostile.UNSAFE else 3


def problems_with(result, command: str, path: Path, want: int, elapsed: float, out: Path, watched: list[Path]) -> list[str]:
    """Everything wrong with one run (empty when it refused cleanly)."""
    found = []
    stderr = result.stderr
    lines = stderr.strip().splitlines()
    if result.exit_code != want:
        found.append(f"exit {result.exit_code}, want {want}: {lines[-1][:200] if lines else result.stdout[-200:]!r}")
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        found.append(f"raised {type(result.exception).__name__}: {result.exception}")
    if "Traceback" in stderr or "Traceback" in result.stdout:
        found.append("a traceback was printed")
    if want == 3 and (len(lines) != 1 or not lines[0].startswith(f"ckptool: error: {path}")):
        found.append(f"stderr is not one 'ckptool: error: <path>: ...' line: {stderr[:300]!r}")
    if want == 1 and not any(f": {verdict} (" in result.stdout.split("\n", 1)[0] for verdict in ("DANGEROUS", "UNKNOWN")):
        found.append(f"scan did not report DANGEROUS or UNKNOWN: {result.stdout[:200]!r}")
    if any(not char.isprintable() for line in (result.stdout + stderr).split("\n") for char in line):
        found.append(f"a control character reached the terminal: {(result.stdout + stderr)[:200]!r}")
    if elapsed > HANG_LIMIT_S:
        found.append(f"took {elapsed:.1f} s: a runaway")
    left = sorted(p.name for p in out.iterdir())
    if left:
        found.append(f"left {left} in the output directory")
    for directory in watched:
        if any(directory.iterdir()):
            found.append(f"a payload ran: {sorted(p.name for p in directory.iterdir())} appeared in {directory}")
    output = result.stdout + stderr
    for marker in PAYLOAD_OUTPUT:
        if marker in output and marker not in str(path):
            found.append(f"payload output {marker!r} seen")
    return found


def run_matrix(paths_and_wants: list[tuple[str, Path, dict[str, int]]], out: Path, good: Path,
               watched: list[Path]) -> tuple[int, list[str]]:
    """Run every command on every path; return the number of runs and every problem found."""
    runner = CliRunner()
    table = command_table(out, good)
    runs, failures = 0, []
    for label, path, wants in paths_and_wants:
        for command, make_args in table.items():
            if command not in wants:
                continue
            started = time.monotonic()
            result = runner.invoke(main, make_args(path))
            elapsed = time.monotonic() - started
            runs += 1
            for problem in problems_with(result, command, path, wants[command], elapsed, out, watched):
                failures.append(f"{label} / {command}: {problem}")
            for leftover in out.iterdir():  # keep going after a failure: later runs need an empty directory
                leftover.unlink() if not leftover.is_dir() else shutil.rmtree(leftover)
    return runs, failures


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    monkeypatch.delenv("CKPTOOL_DEBUG", raising=False)  # it would turn internal errors into tracebacks
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)  # a payload writing relative files (my_file.txt) would show up here
    return cwd


# ------------------------------------------------------------------------------------------------
# the generated corpus


def test_corpus_is_large_and_covers_both_verdicts(corpus: Corpus) -> None:
    expects = {case.expect for case in corpus.cases}
    # floors just under the corpus's size (196 cases, 89 with a canary): a builder that silently drops
    # cases fails here; one that adds cases raises the floor when it is worth keeping
    assert len(corpus.cases) >= 190 and expects == {hostile.UNSAFE, hostile.REFUSE}
    assert sum(case.canary is not None for case in corpus.cases) >= 85


def test_the_mutated_checkpoints_start_out_real(tmp_path: Path) -> None:
    """The structural cases mutate these; torch itself reads them, so each mutation is the only fault."""
    import torch

    for name, data in (("zip", hostile.good_zip()), ("legacy", hostile.good_legacy())):
        path = tmp_path / f"{name}.pt"
        path.write_bytes(data)
        expected = torch.tensor([1.0, 2.0, 3.0, 4.0])
        assert torch.equal(torch.load(path, weights_only=True)["weight"], expected)
        data = bytearray(ckptool.load(path).tensors["weight"].read_bytes())
        assert torch.equal(torch.frombuffer(data, dtype=torch.float32), expected)


@pytest.mark.parametrize("command", COMMANDS)
def test_every_hostile_case_is_refused(corpus: Corpus, command: str, clean_env: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    plan = [(case.name, case.path, {command: expected_exit(command, case.expect, case.name)}) for case in corpus.cases]
    runs, failures = run_matrix(plan, out, corpus.good, [corpus.canary_dir, clean_env])
    assert runs == len(corpus.cases)
    assert not failures, "\n".join(failures)


def test_library_raises_only_ckpt_errors(corpus: Corpus, clean_env: Path) -> None:
    from ckptool.ops.scan import scan
    from ckptool.ops.inspect import inspect

    for case in corpus.cases:
        for function in (ckptool.load, ckptool.inspect, inspect):
            with pytest.raises(CkptError) as raised:
                function(case.path)
            assert not isinstance(raised.value, ckptool.InternalError), (case.name, raised.value)
        if case.expect == hostile.UNSAFE:
            report = scan(case.path)
            # a payload is dangerous; a structural case (a TorchScript archive ckptool refuses) may be unknown
            assert not report.safe and report.verdict in ("dangerous", "unknown"), case.name
            assert report.verdict == "dangerous" or case.canary is None, (case.name, report.unsafe)
        elif case.name in SCAN_JUDGES_SAFE:
            report = ckptool.scan(case.path)
            assert report.safe and "not a checkpoint ckptool loads, but safe to unpickle" in report.problems[0]
        else:
            with pytest.raises(CkptError) as raised:
                ckptool.scan(case.path)
            assert not isinstance(raised.value, ckptool.InternalError), (case.name, raised.value)
    assert not any(corpus.canary_dir.iterdir())


SUBPROCESS_CASES = ("zip_os_system", "legacy_builtins_exec", "raw_protocol4", "tuple_hash_bomb", "memo_index_bomb",
                    "zip_deflate_bomb_datapkl")


def test_real_processes_print_one_line_and_no_traceback(corpus: Corpus, clean_env: Path, tmp_path: Path,
                                                         subprocess_env: dict[str, str]) -> None:
    out = tmp_path / "out"
    out.mkdir()
    table = command_table(out, corpus.good)
    by_name = {case.name: case for case in corpus.cases}
    environment = {k: v for k, v in subprocess_env.items() if k != "CKPTOOL_DEBUG"}
    failures = []
    for name in SUBPROCESS_CASES:
        case = by_name[name]
        for command in ("inspect", "scan", "convert" if "convert" in table else "strip"):
            completed = subprocess.run([sys.executable, "-m", "ckptool", *table[command](case.path)], cwd=clean_env,
                                       env=environment, capture_output=True, text=True, timeout=600)
            want = expected_exit(command, case.expect)
            lines = completed.stderr.strip().splitlines()
            if completed.returncode != want or "Traceback" in completed.stderr + completed.stdout:
                failures.append(f"{name} / {command}: exit {completed.returncode}: {completed.stderr[-300:]!r}")
            elif want == 3 and (len(lines) != 1 or not lines[0].startswith(f"ckptool: error: {case.path}: ")):
                failures.append(f"{name} / {command}: stderr {completed.stderr!r}")
    assert not failures, "\n".join(failures)
    assert not any(out.iterdir()) and not any(corpus.canary_dir.iterdir()) and not any(clean_env.iterdir())


# ------------------------------------------------------------------------------------------------
# mechanisms, one at a time


def test_a_memory_flood_is_refused_before_it_is_built(monkeypatch: pytest.MonkeyPatch) -> None:
    # 4 GiB of estimated objects is the real limit; a smaller one keeps the test small
    monkeypatch.setattr(pickles.limits, "MAX_UNPICKLED_BYTES", 16 << 20)
    flood = hostile.PROTO2 + b"\x8f\x940" * 200_000 + b"N."  # EMPTY_SET, MEMOIZE, POP: 200k live sets
    with pytest.raises(InputError, match="memory bomb"):
        pickles.loads(flood, pickles.GlobalResolver())


@pytest.mark.parametrize("native", [False, True], ids=["python-walk", "c-walk"])
def test_a_sparse_memo_index_counts_the_table_the_unpickler_grows(monkeypatch: pytest.MonkeyPatch,
                                                                   native: bool) -> None:
    # CPython's unpickler keeps its memo in a table of pointers as long as twice the highest index stored:
    # one PUT at an index near the opcodes' count grows 16 bytes for each index, stored or not
    from ckptool.pickles import opcode_guard
    if native and opcode_guard._native is None:
        pytest.skip("the C walk is not built")
    monkeypatch.setattr(opcode_guard, "NATIVE", native)
    filler = b"N0" * 600_000  # NONE POP: 1.2 million opcodes, 8 bytes of objects each
    bomb = hostile.PROTO2 + filler + b"Nr" + struct.pack("<I", 1_200_000) + b"0N."
    tracemalloc.start()
    try:
        pickle.loads(bomb)  # plain data: what the unpickler really holds for it
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak >= 18 << 20
    monkeypatch.setattr(pickles.limits, "MAX_UNPICKLED_BYTES", 16 << 20)
    with pytest.raises(InputError, match="memory bomb"):
        pickles.loads(bomb, pickles.GlobalResolver())
    dense = hostile.PROTO2 + filler + b"Nr" + struct.pack("<I", 0) + b"0N."  # the same opcodes, index 0
    assert pickles.loads(dense, pickles.GlobalResolver()) is None


def test_a_text_memo_index_of_more_digits_than_int_reads_is_refused() -> None:
    # int() raises ValueError past 4300 digits: that error once escaped the guard, where a refusal belongs
    for data, wording in ((b"Np" + b"1" * 5000 + b"\n0N.", "malformed PUT index"),
                          (b"Np0\n0g" + b"0" * 5000 + b"\n.", "reads memo index -1")):
        with pytest.raises(InputError, match=wording):
            pickles.loads(data, pickles.GlobalResolver())


def test_equal_keys_nested_too_deeply_to_compare_are_refused() -> None:
    # two equal tuples ~990 deep as keys of one dict: the guard's own bucket compares them (so does a dict),
    # which recursed past Python's limit from a deep enough stack and escaped as RecursionError (exit 70)
    deep = b"K\x01" + b"\x85" * 990
    data = hostile.whole(b"}(" + deep + b"N" + deep + b"Nu")

    def nested(depth: int) -> str:
        if depth:
            return nested(depth - 1)
        with pytest.raises(InputError) as refused:
            pickles.loads(data, pickles.GlobalResolver())
        return str(refused.value)

    # one refusal, by the guard, before anything compares them: the same however deep the caller's stack is
    messages = {nested(depth) for depth in (0, 100, 600)}
    assert len(messages) == 1 and "nested over 100 levels deep (a hashing bomb)" in messages.pop()


def test_a_refused_build_leaves_the_shared_placeholders_as_they_were(tmp_path: Path) -> None:
    storage = pickles.TORCH_GLOBALS["torch.FloatStorage"]
    rebuild = pickles.TORCH_GLOBALS["torch._utils._rebuild_tensor_v2"]
    before = (storage.module, storage.name, storage.dtype, rebuild.__defaults__)
    for body in (hostile.glob("torch", "FloatStorage") + hostile.tup(b"N", hostile.dct((hostile.text("name"),
                                                                                        hostile.text("system")))),
                 hostile.glob("torch._utils", "_rebuild_tensor_v2") + hostile.dct((hostile.text("__defaults__"),
                                                                                   hostile.tup())),):
        with pytest.raises(InputError, match="BUILD"):
            pickles.loads(hostile.whole(body + b"b"), pickles.GlobalResolver())
    with pytest.raises(InputError):  # the runtime guard, for a pickle the opcode guard never saw
        storage.__setstate__((None, {"name": "system"}))
    assert (storage.module, storage.name, storage.dtype, rebuild.__defaults__) == before


def test_argparse_namespace_and_ordered_dict_metadata_still_take_build_state() -> None:
    namespace = hostile.glob("argparse", "Namespace") + b")\x81" + hostile.dct((hostile.text("lr"), hostile.integer(3))) + b"b"
    metadata = hostile.ordered_dict() + hostile.dct((hostile.text("_metadata"), hostile.dct())) + b"b"
    value = pickles.loads(hostile.whole(hostile.tup(namespace, metadata)), pickles.GlobalResolver())
    assert value[0].state == {"lr": 3} and value[1]._metadata == {}


def test_error_messages_stay_short_whatever_the_pickle_holds() -> None:
    bomb = pickles.loads(hostile.whole(hostile.doubled(hostile.lst(), 20, b"l")), pickles.GlobalResolver())
    assert len(pickles.brief(bomb)) < 200
    assert len(pickles.brief("x" * 10**7)) < 200


# ------------------------------------------------------------------------------------------------
# the public picklescan corpus


# readable, benign PyTorch checkpoints in that corpus (picklescan's "clean model" controls)
PICKLESCAN_BENIGN_CHECKPOINTS = {"pytorch_model.bin", "new_pytorch_model.bin"}
# refused before any pickle is judged (scan exits 3): not a torch file, or a zip trick ckptool rejects outright.
# (malicious1_central_directory.zip, whose names differ, and malicious1_wrong_ext.zip, a pickle in data.txt, are
# judged: scan reads every pickle member of a zip however it is named, and exits 1)
PICKLESCAN_STRUCTURAL = {
    "bad_pytorch.pt",  # a PNG
    "not_a_pickle.bin",
    "benign_password_protected.zip",  # an encrypted member (malicious1_0x1.zip's is only flagged so: scanned, dangerous)
    "malicious1.7z",  # a 7z archive
}
# plain data, no checkpoint: every other command refuses it, scan judges it safe (exit 0) with a note saying what it is
# (dns_exfiltration.npy's object array is scanned too: dangerous)
PICKLESCAN_PLAIN_DATA = {
    "benign0_v0.pkl", "benign0_v3.pkl", "benign0_v4.pkl",
    "int_array.npy", "object_array.npy",
    "int_arrays.npz", "int_arrays_compressed.npz", "object_arrays.npz", "object_arrays_compressed.npz",
}


def picklescan_files() -> list[Path]:
    if not PICKLESCAN.is_dir():
        return []
    return sorted(p for folder in ("data", "data2") for p in (PICKLESCAN / folder).glob("*") if p.is_file())


@pytest.mark.skipif(not picklescan_files(), reason=f"public corpus not found at {PICKLESCAN}")
def test_public_picklescan_corpus_is_refused_and_nothing_runs(corpus: Corpus, clean_env: Path, tmp_path: Path) -> None:
    files = picklescan_files()
    assert len(files) >= 100
    out = tmp_path / "out"
    out.mkdir()
    plan = []
    for path in files:
        if path.name in PICKLESCAN_BENIGN_CHECKPOINTS:
            continue
        scan_exit = 3 if path.name in PICKLESCAN_STRUCTURAL else 0 if path.name in PICKLESCAN_PLAIN_DATA else 1
        plan.append((path.name, path, {c: (scan_exit if c == "scan" else 3) for c in COMMANDS}))
    runs, failures = run_matrix(plan, out, corpus.good, [corpus.canary_dir, clean_env])
    assert runs == len(plan) * len(COMMANDS)
    assert not failures, "\n".join(failures)


@pytest.mark.skipif(not picklescan_files(), reason=f"public corpus not found at {PICKLESCAN}")
def test_public_corpus_benign_checkpoints_read_like_torch_reads_them(clean_env: Path, tmp_path: Path) -> None:
    import torch

    from ckptool.ops.scan import scan

    for name in sorted(PICKLESCAN_BENIGN_CHECKPOINTS):
        path = PICKLESCAN / "data" / name
        expected = torch.load(path, weights_only=True)  # weights_only: torch's own safe loader
        checkpoint = ckptool.load(path)
        assert scan(path).safe
        if isinstance(expected, dict):
            assert sorted(checkpoint.tensors) == sorted(expected)
        for command in COMMANDS:  # whatever each does with them, it does it cleanly
            args = command_table(tmp_path / "out", path)[command](path)
            (tmp_path / "out").mkdir(exist_ok=True)
            result = CliRunner().invoke(main, args)
            assert result.exit_code in (0, 1, 3) and "Traceback" not in result.stderr, (name, command, result.stderr)
            assert "internal error" not in result.stderr, (name, command, result.stderr)
            for leftover in (tmp_path / "out").iterdir():
                leftover.unlink() if leftover.is_file() else shutil.rmtree(leftover)
    assert not any(clean_env.iterdir())
