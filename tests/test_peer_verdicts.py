"""What the peer scanners call malicious, ckptool's scan calls dangerous.

bench/peers/run.py ran picklescan, modelscan, fickling and ModelAudit (a venv of their own, not
installed here) over the scan corpus of bench/peers/corpus.py and recorded each one's grade per entry
in bench/peers/results.json, keyed by the entries' stable names. This test rebuilds the corpus (the
public picklescan corpus only where ../shared/corpus/picklescan is present) and holds ckptool to the
recorded grades: every malicious entry some peer grades at its top grade is ``dangerous`` to
``ckptool.scan`` — refusing it is not enough, since ``scan`` is what a user asks whether a file is
safe to ``torch.load`` — and every benign checkpoint is read. Nothing in the corpus is ever loaded:
``scan`` runs no pickle, and the canaries and victims the payloads would touch are checked at the end.
"""

from __future__ import annotations

import io
import json
import pickle
import pickletools
from pathlib import Path

import pytest

import ckptool
from ckptool.base.errors import CkptError

pytest.importorskip("torch")  # the hostile suite's TorchScript and DCP cases are made with torch
hostile = pytest.importorskip("hostile")
from bench.peers import corpus as peer_corpus  # noqa: E402 — after the importorskip guards

REPO = Path(__file__).resolve().parent.parent
RECORDED = json.loads((REPO / "bench" / "peers" / "results.json").read_text())
PEERS = ("picklescan", "modelscan", "fickling", "modelaudit")


def peer_grades(name: str) -> dict[str, str]:
    grades = RECORDED["files"][name]["grades"]
    return {peer: grades[peer]["grade"] for peer in PEERS if peer in grades}


# malicious entries only: a peer's top grade on a benign or malformed file is its false alarm (bench/peers/table.md)
FLAGGED = sorted(name for name, record in RECORDED["files"].items()
                 if record["label"] == "malicious" and "malicious" in peer_grades(name).values())
# Peer-flagged files ckptool refuses rather than judges, each with the reason a refusal is the answer
REFUSED_NOT_READ = {
    "picklescan/tests/data/malicious1.7z": "a 7z archive, which no PyTorch or NumPy loader opens: ckptool says to "
                                           "extract it first, and judges the pickle inside once extracted",
}
# the picklescan corpus's bare-tensor checkpoints, which its README says every command reads
PICKLESCAN_CHECKPOINTS = ("picklescan/tests/data/pytorch_model.bin", "picklescan/tests/data/new_pytorch_model.bin")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, peer_corpus.Entry]]:
    out = tmp_path_factory.mktemp("peer-corpus")
    entries = peer_corpus.build(out)
    return out, {entry.name: entry for entry in entries}


def test_the_recorded_grades_cover_the_corpus(corpus: tuple[Path, dict[str, peer_corpus.Entry]]) -> None:
    """A corpus entry the recording never saw would go unchecked: re-run bench/peers/run.py after adding one."""
    _, entries = corpus
    unrecorded = sorted(set(entries) - set(RECORDED["files"]))
    assert not unrecorded, f"not in bench/peers/results.json (run: .venv/bin/python -m bench.peers.run): {unrecorded}"
    assert FLAGGED, "results.json records no peer verdict: run bench/peers/run.py with the peers' venv"


@pytest.mark.parametrize("name", FLAGGED)
def test_what_a_peer_calls_malicious_is_dangerous(corpus: tuple[Path, dict[str, peer_corpus.Entry]],
                                                  name: str) -> None:
    out, entries = corpus
    if name not in entries:
        pytest.skip(f"{name}: not in this build of the corpus (the public picklescan corpus is absent)")
    said = ", ".join(f"{peer} {grade}" for peer, grade in peer_grades(name).items())
    try:
        report = ckptool.scan(out / entries[name].path)
    except CkptError as e:
        if name in REFUSED_NOT_READ:
            assert "extract it first" in str(e)
            return
        pytest.fail(f"{name}: ckptool refuses it ({e}) where the peers say [{said}]: scan must name it dangerous")
    assert report.verdict == "dangerous", (
        f"{name}: ckptool says {report.verdict} (outside the allowlist: {report.unsafe}) where the peers say [{said}]")


def test_benign_checkpoints_are_read(corpus: tuple[Path, dict[str, peer_corpus.Entry]]) -> None:
    out, entries = corpus
    benign = [entry for entry in entries.values() if entry.label == peer_corpus.BENIGN
              and (entry.source == "fixtures" or entry.name in PICKLESCAN_CHECKPOINTS)]
    assert len(benign) > 20
    wrong = {}
    for entry in benign:
        try:
            report = ckptool.scan(out / entry.path)
        except CkptError as e:
            wrong[entry.name] = f"refused: {e}"
            continue
        if report.verdict == "dangerous":
            wrong[entry.name] = f"dangerous: {report.dangerous}"
    assert not wrong, wrong


def test_nothing_ran(corpus: tuple[Path, dict[str, peer_corpus.Entry]]) -> None:
    """Scanning every malicious entry created no canary and deleted no victim."""
    out, entries = corpus
    malicious = [entry for entry in entries.values() if entry.label == peer_corpus.MALICIOUS]
    for entry in malicious:
        try:
            ckptool.scan(out / entry.path)
        except CkptError:
            pass
    created = sorted(str(p.relative_to(out)) for p in out.glob("**/canary/*"))
    assert not created, created
    victims = [entry.victim for entry in malicious if entry.victim]
    assert victims and all((out / victim).is_file() for victim in victims)


def test_the_frame_case_hides_its_call_from_a_linear_walk(corpus: tuple[Path, dict[str, peer_corpus.Entry]]) -> None:
    """The FRAME desync is real: its twin, whose hidden call is ``len``, runs the call under a C unpickler
    reading a file and is a plain dict to ``pickle.loads``; the corpus case's linear walk names no global."""
    hidden = hostile.call(hostile.glob("builtins", "len"), hostile.text("x" * 300))
    twin = peer_corpus.frame_desync(hidden)
    as_bytes = pickle.loads(twin)
    assert list(as_bytes) == ["abcdecd"] and as_bytes["abcdecd"].endswith(hidden)
    assert list(pickle.Unpickler(io.BytesIO(twin)).load().values()) == [300]
    out, entries = corpus
    data = (out / entries["trust/frame_hidden_os_system.pkl"].path).read_bytes()
    opcodes = [opcode.name for opcode, _, _ in pickletools.genops(data)]
    assert "GLOBAL" not in opcodes and "STACK_GLOBAL" not in opcodes and b"cos\nsystem\n" in data
