"""The C run of the unpickler (``ckptool/native/_fastload.c``) gives exactly what CPython's unpickler gives.

CPython's unpickler with the Python callbacks is the reference (``CKPTOOL_PURE_PYTHON=1``, or
``unpickle.FAST`` off). On every input here both read the same file or pickle and must agree on the
whole result: the object tree, compared node by node with its sharing (which objects are one object),
every field of every tensor, storage and byte range, the globals the resolver saw and refused; or on
the error, its type and message. The inputs: every fixture, every file of torch's own serialization
scenarios, the hostile and picklescan corpora, single-byte mutations of a torch state dict's pickle, and
pickles built to make the run give up half way (what its callbacks recorded must be undone).
"""

from __future__ import annotations

import math
import os
import pickle
import random
import sys
import warnings
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import ckptool
from ckptool import pickles
from ckptool.base.errors import CkptError
from ckptool.formats import torch_zip, zip_storages, zipio
from ckptool.pickles import unpickle

sys.path.insert(0, str(Path(__file__).parent))
import hostile  # noqa: E402 — the corpus generator beside this file
import serialization_cases  # noqa: E402

pytestmark = pytest.mark.skipif(unpickle._fastload is None, reason="the C run is not built: `make venv` compiles "
                                                                  "ckptool/native/_fastload.c")

ROOT = Path(__file__).resolve().parent.parent
PICKLESCAN = Path(os.environ.get("CKPTOOL_PICKLESCAN_CORPUS", "/work/shared/corpus/picklescan/tests"))
_ATOMS = (int, float, str, bytes, bool, type(None), complex)


def canon(obj: Any, seen: dict[int, int] | None = None) -> Any:
    """A comparable form of ``obj``: its type, its contents, and a back-reference for every object
    met again (so the two runs' sharing is compared too). Atoms compare by value (a NaN by its repr)."""
    seen = {} if seen is None else seen
    if type(obj) in _ATOMS:
        return (type(obj).__name__, repr(obj) if isinstance(obj, float | complex) else obj)
    if id(obj) in seen:
        return ("ref", seen[id(obj)])
    seen[id(obj)] = len(seen)
    kind = f"{type(obj).__module__}.{type(obj).__qualname__}"
    if isinstance(obj, dict):
        items = [(canon(k, seen), canon(v, seen)) for k, v in dict.items(obj)]
        state = getattr(obj, "__dict__", None)
        return (kind, items, canon(dict(state), seen) if state else None)
    if isinstance(obj, list | tuple):
        return (kind, [canon(item, seen) for item in obj])
    if isinstance(obj, set | frozenset):
        return (kind, sorted(repr(canon(item, {})) for item in obj))
    if isinstance(obj, Path):
        return (kind, str(obj))
    if isinstance(obj, type) or callable(obj) and not hasattr(obj, "__dict__") and not hasattr(type(obj), "__slots__"):
        return (kind, getattr(obj, "__qualname__", repr(obj)))
    fields = []
    for klass in type(obj).__mro__:
        for name in getattr(klass, "__slots__", ()):
            if hasattr(obj, name):
                fields.append((name, canon(getattr(obj, name), seen)))
    state = getattr(obj, "__dict__", None)
    if state is not None:
        fields.extend((name, canon(value, seen)) for name, value in sorted(state.items()))
    return (kind, fields)


def read(path: Path, fast: bool, monkeypatch: pytest.MonkeyPatch) -> tuple:
    """What ckptool's reader gives for ``path`` with one run or the other."""
    monkeypatch.setattr(unpickle, "FAST", fast)
    try:
        checkpoint = ckptool.load(path)
    except CkptError as e:
        return (type(e).__name__, str(e))
    return ("read", checkpoint.format, canon(checkpoint.container), sorted(checkpoint.globals.items()))


def both(path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple:
    slow = read(path, False, monkeypatch)
    fast = read(path, True, monkeypatch)
    assert fast == slow, path
    return fast


def files_under(root: Path) -> Iterator[Path]:
    for path in sorted(root.rglob("*")):
        if path.is_file() and path.suffix in (".pt", ".pth", ".ckpt", ".bin", ".tar", ".pkl", ".zip", ".distcp"):
            yield path


def test_every_fixture_reads_alike(monkeypatch: pytest.MonkeyPatch) -> None:
    seen = [both(path, monkeypatch)[0] for path in files_under(ROOT / "fixtures")]
    assert seen.count("read") >= 15, seen  # the fixtures are checkpoints ckptool reads


def test_torch_serialization_scenarios_read_alike(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    families = [serialization_cases.dtypes, serialization_cases.views, serialization_cases.parameters,
                serialization_cases.conjneg, serialization_cases.containers, serialization_cases.storages,
                serialization_cases.serialization_data, serialization_cases.protocols, serialization_cases.legacy,
                serialization_cases.byteorder]
    results = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for family in families:
            directory = tmp_path / family.__name__
            directory.mkdir()
            for path in family(directory):
                if path is not None:
                    results.append(both(path, monkeypatch)[0])
    assert results.count("read") >= 20, results


def test_the_hostile_corpus_is_refused_alike(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cases = hostile.build_corpus(tmp_path / "corpus")
    outcomes = [both(case.path, monkeypatch)[0] for case in cases if case.path.is_file()]
    assert len(outcomes) > 100 and outcomes.count("read") < len(outcomes)


@pytest.mark.skipif(not PICKLESCAN.is_dir(), reason="the picklescan corpus is not on this machine")
def test_the_picklescan_corpus_reads_alike(monkeypatch: pytest.MonkeyPatch) -> None:
    outcomes = [both(path, monkeypatch)[0] for path in sorted(PICKLESCAN.rglob("*")) if path.is_file()
                and path.stat().st_size < 64 << 20]
    assert "read" in outcomes and len(outcomes) > 20


# ------------------------------------------------------------------------------ pickle by pickle


def _state_dict_archive(tmp_path: Path) -> Path:
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3), torch.nn.Linear(3, 2))
    state = model.state_dict()
    state["tied"] = state["0.weight"]  # one storage twice
    state["view"] = state["0.weight"][1:, ::2]  # an offset, a stride
    state["half"] = torch.arange(6, dtype=torch.float16).reshape(2, 3)
    state["big"] = torch.zeros(3)
    path = tmp_path / "sd.pt"
    torch.save(state, path)
    return path


def loads(path: Path, blob: bytes, fast: bool, counts: bool = True) -> tuple:
    """One pickle through ``unpickle``'s path with the archive's storage loader; the resolver's records too."""
    previous = unpickle.FAST
    unpickle.FAST = fast
    try:
        with open(path, "rb") as handle:
            members = zipio.read_members(path, handle)
        top = torch_zip.archive_folder(path, members)
        storages: dict = {}
        loader = zip_storages.storage_loader(path, members, top, storages)
        resolver = pickles.GlobalResolver()
        try:
            if counts:
                result = pickles.loads(blob, resolver, loader)
            else:  # as for a pickle ckptool emitted: no counts, the run may give up half way
                with unpickle.paused():
                    result = unpickle._unpickle(blob, resolver, loader, None)
            outcome: tuple = ("read", canon(result))
        except Exception as e:  # noqa: BLE001 — the two runs must fail alike, whatever the error
            outcome = (type(e).__name__, str(e))
        return outcome, dict(resolver.seen), list(resolver.refused), sorted(storages)
    finally:
        unpickle.FAST = previous


def test_mutated_state_dict_pickles_read_alike(tmp_path: Path) -> None:
    path = _state_dict_archive(tmp_path)
    with zipfile.ZipFile(path) as archive:
        name = next(n for n in archive.namelist() if n.endswith("/data.pkl"))
        data = archive.read(name)
    assert loads(path, data, True) == loads(path, data, False)
    assert loads(path, data, True)[0][0] == "read"
    rng = random.Random(11)
    kinds = set()
    for _ in range(400):
        mutant = bytearray(data)
        for _ in range(rng.choice([1, 1, 2])):
            at = rng.randrange(2, len(mutant))
            mutant[at] = rng.choice([rng.randrange(256), mutant[at] ^ 1, mutant[at] + 1 & 255, ord("N"), ord("q"),
                                     ord("h"), ord("K"), ord("t"), ord("R"), ord("u"), ord("0"), ord("\x85")])
        fast, slow = loads(path, bytes(mutant), True), loads(path, bytes(mutant), False)
        assert fast == slow, bytes(mutant)
        kinds.add(fast[0][0])
    assert "read" in kinds and len(kinds) >= 3, kinds  # some still read, and errors of several kinds


@pytest.mark.parametrize("tail", [b"0", b"\x8f", b"B\x01\x00\x00\x00x", b"(N\x94\x8f\x90", b"\x95\x00"])
def test_a_run_given_up_half_way_leaves_no_records(tmp_path: Path, tail: bytes) -> None:
    # an opcode the run does not take, after the storages and globals of a state dict were read: without
    # the guard's counts it gives up there, and CPython's unpickler reads it again from the start
    path = _state_dict_archive(tmp_path)
    with zipfile.ZipFile(path) as archive:
        data = archive.read(next(n for n in archive.namelist() if n.endswith("/data.pkl")))
    assert data.endswith(b".")
    blob = data[:-1] + b"N" + tail + b"0." if tail != b"0" else data[:-1] + b"N0."
    fast, slow = loads(path, blob, True, counts=False), loads(path, blob, False, counts=False)
    assert fast == slow
    assert fast[1].get("torch._utils._rebuild_tensor_v2") == 1  # counted once, not once per run


def test_containers_of_every_taken_opcode_read_alike(tmp_path: Path) -> None:
    path = _state_dict_archive(tmp_path)
    values = [
        {"epoch": 3, "lr": 0.1, "nan": math.nan, "neg": -1.5e-300, "big": 2**62, "small": -(2**40), "b": True,
         "none": None, "list": [1, [2, 3], (4,), (5, 6), (7, 8, 9), ()], "text": "ünï\ud800", "nested": {1: {2: {}}}},
        [{"step": 1}, {"step": 2}] * 3,
        {"ints": list(range(-300, 300, 7)) + [2**31 - 1, -(2**31), 2**31, 2**63 - 1, -(2**63)]},
    ]
    for value in values:
        shared = [value, value]  # one object twice: a memo read
        for protocol in (2, 3, 4):
            blob = pickle.dumps(shared, protocol=protocol)
            fast, slow = loads(path, blob, True), loads(path, blob, False)
            assert fast == slow and fast[0][0] == "read", (protocol, fast, slow)


def test_the_run_is_what_reads_by_default() -> None:
    assert unpickle.FAST == (os.environ.get("CKPTOOL_PURE_PYTHON", "") in ("", "0"))
    # the opcodes it takes, by the guard's counts: those of torch's state dicts and training containers
    for code in b"\x80}](X\x8cqrhjKMJ\x8aG\x88\x89Nt\x85\x86\x87cRQsuaeb.":
        assert code not in unpickle._FAST_NOT_TAKEN


def test_the_run_reads_a_state_dict_with_no_python_rebuild_calls(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    # its per-tensor work is in C: the Python rebuild and persistent_load are not called for plain tensors
    path = _state_dict_archive(tmp_path)
    calls = {"rebuild": 0}
    original = pickles.allowlist.TORCH_GLOBALS["torch._utils._rebuild_tensor_v2"]

    def counting(*args: Any) -> Any:
        calls["rebuild"] += 1
        return original(*args)
    monkeypatch.setattr(pickles.rebuilds, "_rebuild_tensor_v2", counting)
    monkeypatch.setitem(pickles.allowlist.TORCH_GLOBALS, "torch._utils._rebuild_tensor_v2", counting)
    fast = read(path, True, monkeypatch)
    assert calls["rebuild"] == 0
    slow = read(path, False, monkeypatch)
    assert calls["rebuild"] == 9 and fast == slow  # ten entries, one of them the same tensor as another


class _Storage:
    """A storage record to pickle as torch.save does: ("storage", its class, key, location, numel)."""

    def __init__(self, key: str, kind: Any, numel: int) -> None:
        self.key, self.kind, self.numel = key, kind, numel


class _Tensor:
    def __init__(self, storage: _Storage, size: int) -> None:
        self.storage, self.size = storage, size

    def __reduce__(self) -> tuple:
        return (torch._utils._rebuild_tensor_v2,
                (self.storage, 0, (self.size,), (1,), False, __import__("collections").OrderedDict()))


class _Pickler(pickle.Pickler):
    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, _Storage):
            return ("storage", obj.kind, obj.key, "cpu", obj.numel)
        return None


def _archive_of(path: Path, refs: list[tuple[str, _Storage, int]], storages: list[_Storage],
                member_order: list[str]) -> Path:
    """A torch archive holding ``refs`` (entry name, storage, elements viewed) with its members written in
    ``member_order`` (data.pkl, byteorder, version and each of ``storages``' keys, in any order)."""
    import io

    buffer = io.BytesIO()
    _Pickler(buffer, protocol=2).dump({name: _Tensor(storage, size) for name, storage, size in refs})
    sizes = {storage.key: storage.numel * {torch.FloatStorage: 4, torch.HalfStorage: 2, torch.LongStorage: 8}[
        storage.kind] for storage in storages}
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as archive:
        for name in member_order:
            if name in ("data.pkl", "byteorder", "version"):
                archive.writestr(f"archive/{name}", {"data.pkl": buffer.getvalue(), "byteorder": b"little",
                                                     "version": b"3\n"}[name])
            else:
                archive.writestr(f"archive/data/{name}", bytes(range(256)) * (sizes[name] // 256) +
                                 bytes(sizes[name] % 256))
    return path


def test_storages_met_in_any_order_read_alike(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # the run looks for a storage's member among the next ones of the archive before any look-up (torch meets
    # storages in the order it writes them): storages met again, out of order, far ahead, with keys of any
    # text, members in any order, and empty storages of several dtypes must read as the Python loader reads them
    rng = random.Random(5)
    kinds = [torch.FloatStorage, torch.HalfStorage, torch.LongStorage]
    outcomes = []
    for case in range(40):
        count = rng.choice([3, 8, 24, 40])
        keys = [str(k) for k in range(count)] if case % 4 else [rng.choice(["w", "é", "λ", "k"]) + str(k)
                                                                for k in range(count)]
        storages = [_Storage(key, rng.choice(kinds), rng.choice([0, 1, 3, 40, 300])) for key in keys]
        order = list(range(count))
        if case % 3 == 1:
            rng.shuffle(order)  # met out of order
        elif case % 3 == 2:  # in order, with some met again and some met first far ahead
            for _ in range(count // 4):
                at = rng.randrange(count)
                order.insert(rng.randrange(len(order) + 1), min(at + 17, count - 1) if rng.random() < 0.5 else at)
        refs = [(f"t{i}", storages[k], rng.randrange(storages[k].numel + 1)) for i, k in enumerate(order)]
        members = [storage.key for storage in storages]
        if case % 5 == 3:
            rng.shuffle(members)
        elif case % 5 == 4:
            members.reverse()
        heads = ["data.pkl", "byteorder"] if case % 2 else ["byteorder", "data.pkl", "version"]
        member_order = heads + members + (["version"] if case % 2 else [])
        path = _archive_of(tmp_path / f"case{case}.pt", refs, storages, member_order)
        outcomes.append(both(path, monkeypatch)[0])
    # the planted case: a storage met first beyond the members looked at, then one in order, then the first again
    storages = [_Storage(str(k), torch.FloatStorage, 4) for k in range(24)]
    refs = [("far", storages[17], 4), ("near", storages[2], 4), ("far again", storages[17], 2)]
    path = _archive_of(tmp_path / "planted.pt", refs, storages, ["data.pkl", "byteorder"] + [s.key for s in storages])
    result = both(path, monkeypatch)
    outcomes.append(result[0])
    tensors = ckptool.load(path).tensors
    assert tensors["far"].storage is tensors["far again"].storage
    assert outcomes.count("read") == len(outcomes), outcomes


def test_a_big_endian_archive_keeps_the_python_loader(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        paths = [p for p in serialization_cases.byteorder(tmp_path) if p is not None]
    assert paths
    for path in paths:
        assert both(path, monkeypatch)[0] == "read"


# ------------------------------------------------------------------------------- streams of a grammar

GRAMMAR_OUTCOMES: dict[str, int] = {}


def _grammar_outcome(data: bytes, fast: bool, allow: tuple[str, ...]) -> tuple:
    previous = unpickle.FAST
    unpickle.FAST = fast
    resolver = pickles.GlobalResolver(allow)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            result: tuple = ("read", canon(pickles.loads(data, resolver)))
    except Exception as e:  # noqa: BLE001 — the two runs must fail alike, whatever the error
        result = (type(e).__name__, str(e))
    finally:
        unpickle.FAST = previous
    return result, dict(resolver.seen), list(resolver.refused)


def test_opcode_streams_from_the_guards_grammar_read_alike() -> None:
    # every opcode the guard reads, valid and malformed (tests/test_guard_native.py's grammar): what the guard
    # passes, both runs read or refuse alike, with or without every global allowed
    hypothesis = pytest.importorskip("hypothesis")
    import test_guard_native as grammar

    @hypothesis.settings(max_examples=3 * grammar.EXAMPLES, deadline=None, derandomize=grammar.EXAMPLES <= 300,
                         database=None, suppress_health_check=list(hypothesis.HealthCheck))
    @hypothesis.given(grammar.opcode_stream(), hypothesis.strategies.booleans())
    def streams(data: bytes, allow_all: bool) -> None:
        allow = ("*",) if allow_all else ()
        with grammar.headroom():
            fast = _grammar_outcome(data, True, allow)
            slow = _grammar_outcome(data, False, allow)
        assert fast == slow, data
        GRAMMAR_OUTCOMES[fast[0][0]] = GRAMMAR_OUTCOMES.get(fast[0][0], 0) + 1

    GRAMMAR_OUTCOMES.clear()
    streams()
    assert GRAMMAR_OUTCOMES.get("read", 0) >= 20 and len(GRAMMAR_OUTCOMES) >= 2, GRAMMAR_OUTCOMES


def test_nothing_leaks_over_many_reads_and_writes(tmp_path: Path) -> None:
    # a reference the C code keeps by mistake is an object that outlives each read: the memory traced after
    # many reads (and writes, and given-up runs) must not grow with their number
    import gc
    import tracemalloc

    path = _state_dict_archive(tmp_path)
    with zipfile.ZipFile(path) as archive:
        data = archive.read(next(n for n in archive.namelist() if n.endswith("/data.pkl")))
    given_up = data[:-1] + b"N0."  # POP: without the guard's counts the run gives up at it
    containers = [pickle.dumps({"a": [1, 2.5, (3, "x")], "b": {4: None}}, protocol=p) for p in (2, 4)]

    def rounds(count: int) -> None:
        for _ in range(count):
            assert loads(path, data, True)[0][0] == "read"
            assert loads(path, given_up, True, counts=False)[0][0] == "read"
            for blob in containers:
                pickles.loads(blob, pickles.GlobalResolver())
            tree = ckptool.load(path).container
            pickles.dump(tree)
            pickles.dump(tree, renumber_storages=True)

    rounds(20)  # caches and interned names settle
    gc.collect()
    tracemalloc.start()
    try:
        rounds(50)
        gc.collect()
        first = tracemalloc.get_traced_memory()[0]
        rounds(400)
        gc.collect()
        grown = tracemalloc.get_traced_memory()[0] - first
    finally:
        tracemalloc.stop()
    assert grown < 120_000, f"{grown} bytes more after 400 more rounds"  # ~25 kB here: caches settling


def test_dumps_under_a_frozen_collector_leave_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    # a command freezes what each pass built as the collector resumes (base.gcpause): a reference cycle made by a
    # dump would then never be collected, and a many-file convert would keep every emitter's memo of every tree
    import gc
    import tracemalloc

    from ckptool.base import gcpause

    monkeypatch.setattr(gcpause, "_freezing", True)
    tree = ckptool.load(Path(__file__).parent.parent / "fixtures" / "single_lenet.pt").container

    def rounds(count: int) -> None:
        for _ in range(count):
            with gcpause.paused():
                pickles.dump(tree)

    rounds(20)
    gc.collect()
    tracemalloc.start()
    try:
        rounds(50)
        gc.collect()
        first = tracemalloc.get_traced_memory()[0]
        rounds(200)
        gc.collect()
        grown = tracemalloc.get_traced_memory()[0] - first
    finally:
        tracemalloc.stop()
        gc.unfreeze()
    assert grown < 120_000, f"{grown} bytes more after 200 more dumps"  # 4 MB when the emitter's writer held it
