"""The C run of the unpickler (``ckptool/native/_fastload.c``) gives exactly what CPython's unpickler gives.

CPython's unpickler with the Python callbacks is the reference (``CKPTOOL_PURE_PYTHON=1``, or
``unpickle.FAST`` off). On every input here both read the same file or pickle and must agree on the
whole result: the object tree, compared node by node with its sharing (which objects are one object),
every field of every tensor, storage and byte range, the globals the resolver saw and refused; or on
the error, its type and message. The inputs: every fixture, every file of torch's own serialization
scenarios, the hostile and picklescan corpora, single-byte mutations of a torch state dict's pickle, and
pickles built to make the run give up half way (what its callbacks recorded must be undone).

Its emitter of a dict's entries (``emit_items``) is held to the Python emitter the same way: the same
pickle bytes and the same storages, in the same order, for every checkpoint those inputs read and for
a dict of every kind of entry it writes itself or hands back to ``save``.
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


def test_the_constructors_the_run_uses_build_what_the_classes_build(tmp_path: Path) -> None:
    from ckptool.tensors import dtypes
    from ckptool.tensors.refs import StorageRef, TensorRef
    from ckptool.files.ranges import ByteRange

    f32 = dtypes.BY_NAME["F32"]
    byte_range = ByteRange(tmp_path, 64, 16, 7)
    storage = StorageRef("0", f32, 4, "cuda:1", byte_range, "torch.FloatStorage")
    cases = [(ByteRange, (tmp_path, 64, 16)), (ByteRange, (tmp_path, 64, 16, None)), (ByteRange, (tmp_path, 0, 0, 5)),
             (StorageRef, ("0", f32, 4, "cpu")), (StorageRef, ("k", f32, 4, "cpu", byte_range, "torch.FloatStorage")),
             (TensorRef, (storage, f32, (2, 2), (2, 1))),
             (TensorRef, (storage, f32, (4,), (1,), 0, True, "torch._utils._rebuild_tensor_v2", (), None))]
    for cls, args in cases:
        made = unpickle._fastload.make(cls, *args)
        assert type(made) is cls and canon(made) == canon(cls(*args)), (cls, args)
    for cls, args in ((ByteRange, (tmp_path,)), (TensorRef, (storage,) * 14)):  # too few, too many: the class says
        with pytest.raises(TypeError):
            unpickle._fastload.make(cls, *args)


# ------------------------------------------------------------------------------------ the emitter


def emitted(container: Any, emit_in_c: bool, monkeypatch: pytest.MonkeyPatch, renumber: bool) -> tuple:
    """What ``dump`` writes for ``container``: the pickle, and the storages' keys and identities."""
    with monkeypatch.context() as patch:
        if not emit_in_c:
            patch.setattr(pickles.emit, "_emit_items", None)
        try:
            blob, storages = pickles.dump(container, renumber_storages=renumber)
        except CkptError as e:
            return (type(e).__name__, str(e))
    return blob, [(key, id(storage)) for key, storage in storages]


@pytest.mark.skipif(pickles.emit._emit_items is None, reason="the C emitter is not built")
def test_the_c_emitter_writes_what_the_python_emitter_writes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    paths = list(files_under(ROOT / "fixtures"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for family in (serialization_cases.dtypes, serialization_cases.views, serialization_cases.parameters,
                       serialization_cases.conjneg, serialization_cases.containers, serialization_cases.storages):
            directory = tmp_path / family.__name__
            directory.mkdir()
            paths += [path for path in family(directory) if path is not None]
    paths.append(_state_dict_archive(tmp_path))
    written = 0
    for path in paths:
        try:
            checkpoint = ckptool.load(path)
        except CkptError:
            continue
        for renumber in (False, True):
            fast = emitted(checkpoint.container, True, monkeypatch, renumber)
            assert fast == emitted(checkpoint.container, False, monkeypatch, renumber), path
        written += 1
    assert written >= 20


@pytest.mark.skipif(pickles.emit._emit_items is None, reason="the C emitter is not built")
def test_the_c_emitter_takes_every_kind_of_entry_alike(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # entries the C path writes and entries it hands to save(): the same bytes either way, in one dict
    from collections import OrderedDict

    from ckptool.tensors import dtypes
    from ckptool.tensors.refs import StorageRef, TensorRef
    from ckptool.files.ranges import ByteRange

    f32 = dtypes.BY_NAME["F32"]
    storage = StorageRef("s", f32, 1 << 40, "cuda:1", ByteRange(tmp_path, 0, 4 << 40), "torch.FloatStorage")
    untyped = StorageRef("u", dtypes.BY_NAME["U8"], 8, "cpu", ByteRange(tmp_path, 0, 8), "")
    long_key = StorageRef("k" * 80, f32, 4, "cpu", ByteRange(tmp_path, 0, 16), "torch.FloatStorage")
    def t(*dims: int) -> tuple[int, ...]:  # a tuple of its own (a shared one is memoised: save() writes it)
        return tuple(list(dims))

    def tensor(source: StorageRef, shape: tuple, stride: tuple, *rest: Any) -> TensorRef:
        return TensorRef(source, source.dtype, shape, stride, *rest)

    shape = t(2, 2)
    plain = tensor(storage, shape, t(2, 1))
    shared_hooks: OrderedDict = OrderedDict()
    v2 = "torch._utils._rebuild_tensor_v2"
    entries = {
        "first": tensor(storage, t(4), t(1)),  # the globals' first use: save() memoises them
        "plain": plain, "same": plain, "shares shape": tensor(storage, shape, t(2, 1), 4),
        "grad": tensor(storage, t(3), t(1), 0, True),
        "hooks none": tensor(storage, t(3), t(1), 0, True, v2, (), None),
        "hooks odict": tensor(storage, t(3), t(1), 0, False, v2, (), OrderedDict()),
        "hooks set": tensor(storage, t(3), t(1), 0, False, v2, (), OrderedDict(a=1)),
        # one hooks dict of two tensors: memoised by the first (nothing else refers to a tensor's own: not memoised)
        "hooks shared": tensor(storage, t(3), t(1), 0, False, v2, (), shared_hooks),
        "hooks shared again": tensor(storage, t(3), t(1), 0, False, v2, (), shared_hooks),
        "shared stride": tensor(storage, t(5), (1,)), "shared stride again": tensor(storage, t(6), (1,)),
        "offsets": tensor(storage, t(1), t(1), 300), "offset 2": tensor(storage, t(1), t(1), 70000),
        "big offset": tensor(storage, t(1), t(1), (1 << 40) - 1),
        "negative": tensor(storage, t(1), t(1), -(1 << 35)), "negative small": tensor(storage, t(1), t(1), -1),
        "negative edge": tensor(storage, t(1), t(1), -(1 << 31) - 1), "edge": tensor(storage, t(1), t(1), 1 << 31),
        "i64": tensor(storage, t(1), t(1), (1 << 63) - 1), "i64 low": tensor(storage, t(1), t(1), -(1 << 63)),
        "huge": tensor(storage, t(1), t(1), 1 << 70), "big dims": tensor(storage, t(70000, 300), t(300, 1)),
        "four dims": tensor(storage, t(1, 1, 1, 1), t(1, 1, 1, 1)),
        "no dims": tensor(storage, (), ()),
        "same tuple": tensor(storage, t(1), t(9)),
        "untyped": tensor(untyped, t(8), t(1)),
        "long storage key": tensor(long_key, t(4), t(1)),
        "v3": tensor(storage, t(4), t(1), 0, False, "torch._utils._rebuild_tensor_v3"),
        "extra": tensor(storage, t(4), t(1), 0, False, v2, ({"m": 1},)),
        "k" * 70: 3, 5: "int key", "none": None, "list": [1.5, plain], "key again": "first",
        "ü\ud800": tensor(storage, t(2), t(1)),
    }
    # a key long enough to be memoised (64 bytes), met again as a key: ASCII, and fewer characters than bytes
    long_ascii, long_wide = "n" * 70, "ü" * 40
    entries[long_ascii] = tensor(storage, t(2), t(1))
    entries[long_wide] = 4
    entries["same tuple"].stride = entries["same tuple"].shape  # one tuple as shape and stride
    for container in (entries, OrderedDict(entries), {"model": entries, "epoch": 2},
                      {long_ascii: 1, long_wide: 2, "model": entries}):
        for renumber in (False, True):
            fast = emitted(container, True, monkeypatch, renumber)
            assert fast == emitted(container, False, monkeypatch, renumber)
            assert isinstance(fast[0], bytes)
    # and it was the C path that wrote them: the Python one is asked for only what it hands over
    asked: list[str] = []
    original = pickles.emit._Emitter._plain_tensor

    def counting(self: Any, value: TensorRef) -> bool:
        asked.append(next(k for k, v in entries.items() if v is value))
        return original(self, value)
    monkeypatch.setattr(pickles.emit._Emitter, "_plain_tensor", counting)
    pickles.dump(entries)
    assert "grad" not in asked and "plain" not in asked and "offsets" not in asked and "first" in asked, asked


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


def _fixture_tensors() -> list[list[Any]]:
    """The tensors of every fixture that holds weights, a list per file."""
    found = []
    for path in sorted(Path("fixtures").rglob("*")):
        if path.suffix in (".pt", ".pth", ".bin", ".safetensors", ".ckpt") and path.is_file():
            try:
                checkpoint = ckptool.load(path)
            except CkptError:
                continue
            if checkpoint.has_weights:
                found.append(list(checkpoint.tensors.values()))
    assert len(found) > 10
    return found


def test_whole_plain_in_c_decides_as_the_python_passes_do(tmp_path: Path) -> None:
    """refs.whole_plain's one pass in C against its passes in Python, on the tensors of every fixture and of
    drawn views bent in each field it tests (offset, bits, producer, pieces, no data, shape and stride of
    other kinds and values, a length that is not the byte count): the same datas and byte counts, or the
    C pass declines (None) where the Python passes do — and never accepts what they decline."""
    import dataclasses

    from ckptool.tensors import dtypes, refs

    views: list[list[refs.TensorRef]] = _fixture_tensors()
    rng = random.Random(20261127)
    f32 = dtypes.BY_NAME["F32"]
    for _ in range(3000):
        shape = tuple(rng.choice([0, 1, 2, 3]) for _ in range(rng.randint(0, 3)))
        stride = refs.contiguous_stride(shape)
        nbytes = math.prod(shape) * 4
        data = refs.ByteRange(tmp_path, rng.randint(0, 99), nbytes, rng.choice([None, 7]))
        storage = refs.StorageRef("0", f32, math.prod(shape), "cpu", data)
        view = refs.TensorRef(storage, f32, shape, stride)
        bend = rng.randrange(13)
        if bend == 0:
            view.offset = rng.choice([1, True, 0, False])
        elif bend == 1:
            view.conj = rng.choice([True, 1, 0])
        elif bend == 2:
            view.neg = True
        elif bend == 3:
            storage.producer = rng.choice([lambda: b"", None])
        elif bend == 4:
            storage.pieces = rng.choice([(data,), ()])
        elif bend == 5:
            storage.data = None
        elif bend == 6:
            view.shape = rng.choice([list(shape), (*shape[:-1], True) if shape else (), (2**63,), (-1,), (2.0,)])
        elif bend == 7:
            view.stride = rng.choice([list(stride), tuple(s + 1 for s in stride), (*stride, 1), (0,) * len(stride)])
        elif bend == 8:
            storage.data = dataclasses.replace(data, length=nbytes + rng.choice([-1, 1, 4]))
        elif bend == 9:
            view.dtype = dtypes.BY_NAME[rng.choice(["F64", "BF16", "BOOL"])]
        elif bend == 10:
            storage.data = dataclasses.replace(data, length=rng.choice([float(nbytes), True if nbytes == 1 else nbytes]))
        views.append([view] + [refs.TensorRef(refs.StorageRef("1", f32, 1, "cpu", refs.ByteRange(tmp_path, 0, 4)), f32,
                                              (1,), (1,))] * rng.randint(0, 2))
    accepted = declined = 0
    for group in views:
        python = refs._whole_plain(group)
        c = unpickle._fastload.whole_plain(group)
        if python is None:
            assert c is None, group
            declined += 1
        elif c is not None:
            assert c[1] == python[1] and all(a is b for a, b in zip(c[0], python[0])) and len(c[0]) == len(python[0])
            assert all(type(n) is int for n in c[1])
            accepted += 1
        else:  # declined in C only where Python's == took what C does not: an int subclass, a list stride
            assert any(type(v.shape) is not tuple or any(type(d) is not int for d in (*v.shape, *v.stride))
                       or type(v.stride) is not tuple or type(v.storage.data.length) is not int for v in group)
    assert accepted > 300 and declined > 300


def test_the_census_in_c_counts_as_the_python_passes_do(tmp_path: Path) -> None:
    """refs.census's pass in C (what inspect counts: elements, bytes, tensors by dtype name, conjugate and
    negative bits, a storage viewed twice) against refs._census, on every fixture's tensors and on drawn ones:
    shapes of zero, one or many dimensions, dims near 2**63, dtypes apart and two dtype objects of one name,
    shared storages, bits; the same counts, or NotImplemented where the Python passes take what C does not
    (a list or bool or huge dim, a sum past 64 bits, another class)."""
    from ckptool.tensors import dtypes, refs

    groups: list[list[Any]] = list(_fixture_tensors())
    rng = random.Random(5)
    kinds = [dtypes.BY_NAME[name] for name in ("F32", "BF16", "I64", "BOOL", "C64")]
    twin = __import__("dataclasses").replace(kinds[0])  # another F32 object: counted with F32, by name
    for _ in range(3000):
        storages = [refs.StorageRef(str(k), kinds[0], 4, "cpu") for k in range(rng.randint(1, 4))]
        group: list[Any] = []
        for _ in range(rng.randint(0, 6)):
            shape = tuple(rng.choice([0, 1, 3, 1000, 2**31]) for _ in range(rng.randint(0, 4)))
            view = refs.TensorRef(rng.choice(storages), rng.choice(kinds + [twin]), shape, (1,) * len(shape))
            bend = rng.randrange(12)
            if bend == 0:
                view.conj = rng.choice([True, 1, 0])
            elif bend == 1:
                view.neg = rng.choice([True, False])
            elif bend == 2:
                view.shape = rng.choice([list(shape), (True, 2), (2**62, 4), (2**63,), (3, 2**61)])
            group.append(view)
        groups.append(group)
    taken = declined = 0
    for group in groups:
        python = refs._census(group)
        c = unpickle._fastload.census(group, refs.TensorRef)
        if c is NotImplemented:
            declined += 1
            assert any(type(v.shape) is not tuple or any(type(d) is not int or d >= 2**63 for d in v.shape)
                       for v in group) or python.parameters >= 2**63 or python.nbytes >= 2**63, group
        else:
            assert refs.Census(*c) == python and list(c[2]) == list(python.dtypes), group
            taken += 1
        assert refs.census(group) == python
    assert taken > 2000 and declined > 50
    assert unpickle._fastload.census([object()], refs.TensorRef) is NotImplemented


def _hashable(obj: Any) -> bool:
    try:
        hash(obj)
    except TypeError:
        return False
    return True


def _drawn_tree(rng: random.Random, plain: Any) -> Any:
    """A tree of every kind check_tree meets, with shared sub-objects and cycles: lists, tuples, dicts, sets,
    a state dict with attributes, strings and bytes of many lengths, tensors plain and with metadata, hooks (back
    into the tree), a parameter or a subclass, opaque objects, devices, bytearrays, a tuple subclass."""
    import copy
    from collections import OrderedDict

    from ckptool.pickles.placeholders import OpaqueObject
    from ckptool.tensors.refs import DeviceRef, SizeRef

    def atom() -> Any:
        return rng.choice([None, True, 7, 2.5, "", "x" * rng.choice([1, 40, 900]), b"\0" * rng.choice([0, 3, 700]),
                           -(2**70)])

    pool: list[Any] = [atom() for _ in range(4)] + [plain]
    lists: list[list] = []
    for _ in range(rng.randint(1, 40)):
        kids = [rng.choice(pool) for _ in range(rng.choice([0, 1, 2, 3, 6]))]
        kind = rng.randrange(15)
        if kind == 0:
            node: Any = list(kids)
            lists.append(node)
        elif kind == 1:
            node = tuple(kids)
        elif kind == 2:
            node = {rng.choice(["a", "b", "c", 3, "k" * 50]): kid for kid in kids}
        elif kind == 3:
            node = rng.choice([set, frozenset])(kid for kid in kids if _hashable(kid))
        elif kind == 4:
            node = OrderedDict((f"w{index}", kid) for index, kid in enumerate(kids))
            if rng.random() < 0.7:
                node._metadata = {"": {"version": 1}, "x": rng.choice(pool)}
        elif kind == 5:
            node = copy.copy(plain)
        elif kind in (6, 7):
            node = copy.copy(plain)
            bent = rng.randrange(5)
            if bent == 0:
                node.backward_hooks = OrderedDict(hook=rng.choice(pool))
            elif bent == 1:
                node.extra = tuple(kids)
            elif bent == 2:
                node.parameter = (True, *kids)
            elif bent == 3:
                node.subclass = ("torch.nn.Buffer", *kids)
            else:
                node.backward_hooks = rng.choice([OrderedDict(), {}, 0, ""])  # empty: still the usual tensor
        elif kind == 8:
            node = OpaqueObject(*kids)
            node._state = rng.choice([None, {"k": rng.choice(pool)}])
            node._items = [rng.choice(pool)] if rng.random() < 0.5 else []
        elif kind == 9:
            node = DeviceRef(("cuda", rng.randint(0, 3)))
        elif kind == 10:
            node = bytearray(rng.choice([0, 5, 300]))
        elif kind == 11:
            node = SizeRef(rng.randint(0, 9) for _ in range(rng.randint(0, 3)))
        elif kind == 12:
            node = [[[[rng.choice(pool)]]]]  # depth
        elif kind == 13:  # sharing that doubles what a naive walk visits at each level (a memo expansion bomb)
            node = rng.choice(pool)
            for _ in range(rng.randint(2, 14)):
                node = [node, node] if rng.random() < 0.8 else (node, "s", node)
        else:
            node = atom()
        pool.append(node)
    for target in lists:  # cycles: a list holding what was built after it (itself, or an ancestor of it)
        if rng.random() < 0.3:
            target.append(rng.choice(pool))
    hooked = [node for node in pool if type(node).__name__ == "TensorRef" and node.backward_hooks]
    for tensor in hooked:  # a cycle through a tensor's hooks
        if rng.random() < 0.3 and isinstance(tensor.backward_hooks, OrderedDict):
            tensor.backward_hooks["back"] = rng.choice(pool)
    for node in pool:  # a tensor held by its own parameter's or subclass's arguments
        if type(node).__name__ == "TensorRef" and rng.random() < 0.3:
            if node.parameter is not None:
                node.parameter = (*node.parameter, node)
            elif node.subclass is not None:
                node.subclass = (*node.subclass, node)
    return rng.choice([pool[-1], list(pool[-rng.randint(1, len(pool)):]), {"model": pool[-1], "all": pool}])


def test_check_tree_in_c_judges_as_the_python_walk_does(fixtures_dir: Path) -> None:
    """The tree check's C walk against the Python walk on drawn trees of every kind it meets (shared sub-objects,
    cycles through lists and a tensor's hooks, every kind of leaf) under drawn limits: the same verdict (passes,
    too deep, too many expanded objects, too much expanded text) for every tree, each verdict drawn often."""
    import copy
    from collections import Counter, OrderedDict

    from ckptool.native import _fastload
    from ckptool.pickles import limits
    from ckptool.tensors.refs import TensorRef

    plain = next(iter(ckptool.load(fixtures_dir / "single_lenet.pt").tensors.values()))
    held = copy.copy(plain)  # a tensor that is one of its own parameter's arguments: a leaf below itself
    held.parameter, held.backward_hooks = (True, held), None
    hooked = copy.copy(plain)  # a cycle back through a tensor's hooks
    hooked.backward_hooks = OrderedDict(back=[hooked])
    made = [held, [held], {"w": held, "b": [held, plain]}, hooked, [[hooked]], [plain, [plain]], "text", plain]
    rng = random.Random(20261127)
    verdicts: Counter = Counter()
    for index in range(len(made) + 2000):
        tree = made[index] if index < len(made) else _drawn_tree(rng, plain)
        # every nesting limit up to 12 (each tree's height is then found exactly), drawn limits of each kind
        for nesting, nodes, text in [*((nesting, limits.MAX_EXPANDED_NODES, limits.MAX_EXPANDED_TEXT)
                                       for nesting in range(1, 13)),
                                     (rng.randint(2, 8), rng.randint(1, 60), rng.randint(0, 5000)),
                                     (limits.MAX_NESTING, rng.randint(1, 500), limits.MAX_EXPANDED_TEXT)]:
            saved = limits.MAX_NESTING, limits.MAX_EXPANDED_NODES
            limits.MAX_NESTING, limits.MAX_EXPANDED_NODES = nesting, nodes
            try:
                expected = unpickle._check_tree(tree, text)
            finally:
                limits.MAX_NESTING, limits.MAX_EXPANDED_NODES = saved
            found = _fastload.check_tree(tree, (TensorRef, unpickle._tree_children, nesting, nodes, text))
            assert found == expected, (tree, nesting, nodes, text)
            verdicts[found] += 1
    assert min(verdicts[verdict] for verdict in range(4)) > 50, verdicts
