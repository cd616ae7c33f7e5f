"""Fuzzing: mutated real checkpoints in, only ckptool's own errors out — never another exception, never a hang.

Seeds are small real checkpoints made with torch (zip, legacy, safetensors) and ckptool's own
hostile corpus cases for the pickle layer; mutations are bit flips, truncations, splices (within a
file and across seeds), insertions and overwrites. Each example goes through the public API —
``ckptool.load``, ``inspect``, ``scan`` and, when it loads, every tensor's bytes, ``fingerprint``,
``diff``, ``save`` (.pt and safetensors) and ``load_into`` — and only a CkptError about the input
may come out: ``InternalError`` (the API's name for a bug) fails the example like any other exception.

A short run by default (CI); a long one with ``CKPTOOL_FUZZ_EXAMPLES=20000 pytest tests/test_fuzz.py``.
"""

from __future__ import annotations

import contextlib
import os
from collections import Counter
import sys
import tempfile
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ckptool
from ckptool import pickles
from ckptool.base.errors import CkptError, InputError, InternalError

sys.path.insert(0, str(Path(__file__).parent))
import hostile  # noqa: E402

EXAMPLES = int(os.environ.get("CKPTOOL_FUZZ_EXAMPLES", "300"))
FUZZ_SETTINGS = settings(
    max_examples=EXAMPLES,
    # no per-example deadline: on a loaded machine a clean refusal can take seconds; the time and
    # memory bounds are ckptool's own limits, each tested by construction in test_hostile.py
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    derandomize=EXAMPLES <= 300,  # CI runs the same examples every time; long runs explore
    database=None,
)


def _make_seeds() -> dict[str, bytes]:
    import io

    import torch
    from safetensors.torch import save as save_safetensors

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    container = {"model": {f"module.{k}": v for k, v in model.state_dict().items()},
                 "optimizer": optimizer.state_dict(), "epoch": 3, "tied": [model[0].weight, model[0].weight[1:]]}
    seeds = {}
    buffer = io.BytesIO()
    torch.save(container, buffer)
    seeds["zip"] = buffer.getvalue()
    buffer = io.BytesIO()
    torch.save(model.state_dict(), buffer, _use_new_zipfile_serialization=False)
    seeds["legacy"] = buffer.getvalue()
    seeds["safetensors"] = save_safetensors({k: v.contiguous() for k, v in model.state_dict().items()},
                                            metadata={"format": "pt"})
    seeds["hand_zip"] = hostile.good_zip()
    seeds["hand_legacy"] = hostile.good_legacy()
    return seeds


SEEDS = _make_seeds()
NAMES = sorted(SEEDS)
WORK = Path(tempfile.mkdtemp(prefix="ckptool-fuzz-"))
SEED_FILE = WORK / "seed.pt"  # what diff compares a mutated file with
SEED_FILE.write_bytes(SEEDS["zip"])


def seed_model():
    import torch

    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))


@st.composite
def mutated(draw: st.DrawFn) -> tuple[str, bytes]:
    name = draw(st.sampled_from(NAMES))
    data = bytearray(SEEDS[name])
    for _ in range(draw(st.integers(1, 4))):
        kind = draw(st.sampled_from(["flip", "flip", "byte", "truncate", "splice", "insert", "delete", "donor"]))
        at = draw(st.integers(0, max(len(data) - 1, 0)))
        if kind == "flip" and data:
            data[at] ^= 1 << draw(st.integers(0, 7))
        elif kind == "byte" and data:
            data[at] = draw(st.sampled_from([0x00, 0xFF, 0x7F, 0x80, ord("("), ord("."), ord("b"), ord("R")]))
        elif kind == "truncate":
            del data[at:]
        elif kind == "splice" and data:
            start = draw(st.integers(0, len(data) - 1))
            data[at:at] = data[start : start + draw(st.integers(1, 256))]
        elif kind == "insert":
            data[at:at] = draw(st.binary(min_size=1, max_size=16))
        elif kind == "delete":
            del data[at : at + draw(st.integers(1, 64))]
        elif kind == "donor":  # a chunk of another seed: structures that parse, in the wrong place
            donor = SEEDS[draw(st.sampled_from(NAMES))]
            start = draw(st.integers(0, len(donor) - 1))
            data[at : at + draw(st.integers(0, 64))] = donor[start : start + draw(st.integers(1, 512))]
    return name, bytes(data)


@contextlib.contextmanager
def only_input_errors() -> Iterator[None]:
    """A CkptError about the input is the expected outcome; InternalError (a bug) and anything else fail."""
    try:
        yield
    except InternalError:
        raise
    except CkptError:
        pass


def exercise(path: Path) -> str:
    """Everything the commands do with an input: only CkptError about the input may come out.

    Returns how far the input went: "refused" (not loaded), "loaded", or "written" (through diff and save).
    """
    for function in (ckptool.inspect, ckptool.scan):
        with only_input_errors():
            function(path)
    checkpoint = None
    with only_input_errors():
        checkpoint = ckptool.load(path)
    if checkpoint is None:
        return "refused"
    size = path.stat().st_size
    tensors = checkpoint.tensors if checkpoint.has_weights else {}
    for tensor in tensors.values():
        # a stride-0 view may legally describe more bytes than the file holds; reading those is not a reader question
        if tensor.nbytes <= 16 * size + (1 << 20):
            with only_input_errors():
                tensor.read_bytes()
    if not all(t.nbytes <= 16 * size + (1 << 20) for t in tensors.values()):
        return "loaded"
    with only_input_errors():
        ckptool.fingerprint(tensors)
    with only_input_errors():
        ckptool.diff(checkpoint, SEED_FILE)
    for suffix in (".pt", ".safetensors"):
        with only_input_errors():
            ckptool.save(checkpoint, WORK / f"out{suffix}", force=True)
    with only_input_errors():
        ckptool.load_into(seed_model(), checkpoint)
    return "written"


def test_mutated_checkpoints_raise_only_ckpt_errors() -> None:
    outcomes: Counter[str] = Counter()

    @FUZZ_SETTINGS
    @given(mutated())
    def check(example: tuple[str, bytes]) -> None:
        name, data = example
        path = WORK / f"mutated-{name}.bin"
        path.write_bytes(data)
        outcomes[exercise(path)] += 1

    check()
    # the deep paths (bytes, fingerprint, diff, save) are fuzzed too, not only the refusals: a change
    # that made nearly every mutation refused would otherwise pass unnoticed
    assert outcomes["written"] >= EXAMPLES // 60, outcomes  # 15 of the 300 CI examples get that far


PICKLE_PIECES = [
    hostile.PROTO2, b"(", b")", b"]", b"}", b"t", b"\x85", b"\x86", b"l", b"d", b"e", b"a", b"s", b"u", b"R", b"b", b"0",
    b"2", b"1", b"N", b"\x88", b"\x89", b"K\x01", b"J\xff\xff\xff\xff", b"q\x00", b"q\x01", b"h\x00", b"h\x01",
    b"r\x00\x00\x00\x00", b"\x94", b"\x8f", b"\x90", b"\x91", b"\x93", b"\x81", b"Q", hostile.text("storage"),
    hostile.text("os"), hostile.text("system"), hostile.glob("collections", "OrderedDict"),
    hostile.glob("torch._utils", "_rebuild_tensor_v2"), hostile.glob("torch", "FloatStorage"),
    hostile.glob("torch", "Size"), hostile.glob("torch", "device"), hostile.glob("builtins", "set"),
    hostile.glob("argparse", "Namespace"), hostile.glob("_codecs", "encode"), hostile.glob("os", "system"),
    hostile.storage_pid(4), hostile.rebuild(), b".",
]


@FUZZ_SETTINGS
@given(st.lists(st.sampled_from(PICKLE_PIECES), max_size=40), st.booleans())
def test_random_opcode_streams_raise_only_input_errors(pieces: list[bytes], permissive: bool) -> None:
    """The guard and the restricted unpickler on opcode soup (as scan's dry run and a load see it)."""
    from ckptool.tensors.refs import StorageRef

    storages: dict[str, StorageRef] = {}

    def persistent_load(pid: object) -> StorageRef:
        if not isinstance(pid, tuple) or len(pid) != 5 or not isinstance(pid[1], pickles.StorageTypeRef):
            raise InputError("not a storage record")
        return storages.setdefault(str(pid[2]), StorageRef(str(pid[2]), pid[1].dtype, 4, "cpu"))

    resolver = pickles.GlobalResolver(permissive=permissive)
    try:
        pickles.loads(b"".join(pieces) + b".", resolver, persistent_load)
    except (InputError, pickles.RefusedGlobal):
        pass


def test_fuzz_settings_are_documented() -> None:
    security = Path(__file__).resolve().parent.parent / "SECURITY.md"
    assert "CKPTOOL_FUZZ_EXAMPLES" in security.read_text()


@pytest.fixture(scope="module", autouse=True)
def _clean_work_dir():
    yield
    for path in WORK.iterdir():
        path.unlink()
    WORK.rmdir()


# ------------------------------------------------------------------------------------------------
# the sanitized fuzz's oracles (scripts/fuzz/twins.py) and what it found


FUZZ_SCRIPTS = Path(__file__).resolve().parent.parent / "scripts" / "fuzz"
FINDINGS = Path(__file__).resolve().parent / "data" / "fuzz"  # every input `make fuzz` ever flagged, once fixed


def _twins():
    sys.path.insert(0, str(FUZZ_SCRIPTS))
    import twins

    return twins


def finding_files() -> list[Path]:
    return sorted(p for p in FINDINGS.iterdir() if p.is_file() and p.suffix != ".txt") if FINDINGS.is_dir() else []


@pytest.mark.parametrize("path", finding_files(), ids=lambda path: path.name)
def test_every_fuzz_finding_stays_fixed(path: Path, tmp_path: Path) -> None:
    """Each input the fuzz flagged (tests/data/fuzz/, with a .txt of what it was): every C twin agrees with its
    Python reference on it and the API raises only CkptError (under ASan and UBSan too, in `make fuzz`)."""
    assert _twins().check(path, tmp_path) == []


def test_the_fuzz_oracles_pass_every_fixture(fixtures_dir: Path, tmp_path: Path) -> None:
    """The oracles hold on real checkpoints (so a finding is the input's doing, not the oracle's), and reach
    the deep ones: a load, a save both ways."""
    twins = _twins()
    outcomes = Counter()
    for path in sorted(fixtures_dir.rglob("*")):
        if path.is_file() and path.suffix in (".pt", ".pth", ".bin", ".ckpt", ".tar", ".safetensors", ".pkl"):
            problems, outcome = twins.check_report(path, tmp_path)
            assert problems == [], (path, problems)
            outcomes[outcome] += 1
    assert outcomes["read"] >= 30, outcomes


def test_the_fuzz_oracles_see_a_twin_that_differs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A C twin made to differ is caught, and named: the guard's walk, the unpickler's run."""
    from ckptool.pickles import opcode_guard, unpickle

    twins = _twins()
    path = tmp_path / "good.pt"
    path.write_bytes(hostile.good_zip())
    (tmp_path / "out").mkdir()
    assert twins.check(path, tmp_path / "out") == []
    if opcode_guard._native is not None:
        real_walk = opcode_guard._native_walk

        def walk_counting_one_more(data: bytes) -> pickles.PickleStats:
            stats = real_walk(data)
            return pickles.PickleStats(stats.size, [stats.counts[0] + 1, *stats.counts[1:]], stats.globals)

        with monkeypatch.context() as patch:
            patch.setattr(opcode_guard, "_native_walk", walk_counting_one_more)
            assert any(p.startswith("guard: the walks differ") for p in twins.check(path, tmp_path / "out"))
    if unpickle._fastload is not None:
        real_fast_load = unpickle._fast_load

        def fast_load_dropping_a_key(*args: object) -> object:
            result = real_fast_load(*args)
            if isinstance(result, dict) and result:
                del result[next(iter(result))]
            return result

        with monkeypatch.context() as patch:
            patch.setattr(unpickle, "_fast_load", fast_load_dropping_a_key)
            problems = twins.check(path, tmp_path / "out")
            assert any(p.startswith("load: C and Python differ (twin unpickle)") for p in problems), problems


def test_the_fuzz_mutators_run_on_every_kind_of_seed(fixtures_dir: Path, tmp_path: Path) -> None:
    """Every mutator runs without failing on every kind of seed, and the mutants differ from their seeds."""
    import random

    sys.path.insert(0, str(FUZZ_SCRIPTS))
    import mutate

    corpus = tmp_path / "hostile"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hostile.build_corpus(corpus)
    seeds = mutate.load_seeds([fixtures_dir, corpus])
    kinds = {seed.kind for seed in seeds}
    assert {"zip", "legacy", "safetensors", "pickle"} <= kinds, kinds
    donors = mutate.pickle_blobs(seeds)
    rng = random.Random(0)
    changed = 0
    for seed in seeds:
        for _ in range(3):
            data, notes = mutate.mutate(rng, seed, seeds, donors)
            assert notes and len(data) <= mutate.MAX_MUTANT
            changed += data != seed.data
    assert changed >= 2 * len(seeds), (changed, len(seeds))
