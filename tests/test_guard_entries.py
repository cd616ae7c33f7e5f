"""The opcode guard vets a tensor entry of torch's form in one step: it must see exactly what the
opcode-by-opcode walk sees (records, memo, counts, memory estimate, refusals), on real torch pickles
and on those pickles with bytes changed."""

from __future__ import annotations

import random
import re
import zipfile
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from ckptool.base.errors import InputError  # noqa: E402
from ckptool.pickles import opcode_guard  # noqa: E402


def _walk(data: bytes, one_step: bool, monkeypatch: pytest.MonkeyPatch) -> tuple:
    with monkeypatch.context() as m:
        if not one_step:
            m.setattr(opcode_guard, "_ENTRY", re.compile(rb"(?!)"))  # matches nothing: every opcode walked alone
        counts: list[int] = [0] * 256
        names: list[str] = []
        walk = opcode_guard._Walk(data, counts, names)
        try:
            size, error = walk.run(), None
        except InputError as e:
            size, error = None, f"{type(e).__name__}: {e}"
    memo = {index: (v.kind, v.name, v.nodes, v.hashable, "?" if v.value is opcode_guard.OPAQUE else v.value)
            for index, v in walk.memo.items()}
    stack = [(v.kind, v.name, v.nodes, v.hashable) for v in walk.stack]
    # a refusal stops the walk: its counts and estimate are never read
    return size, error, counts if error is None else None, names, memo, stack, walk.memory if error is None else None


def _pickle(tmp_path: Path, protocol: int = 2) -> bytes:
    g = torch.Generator().manual_seed(0)
    shared = torch.randn(100, generator=g)
    sd = {
        "module.scalar": torch.tensor(3),
        "module.vec": torch.randn(16, generator=g),
        "module.big": torch.zeros(70000, dtype=torch.int8),  # a BININT numel and size
        "module.mid": torch.zeros(300, dtype=torch.bfloat16),  # BININT2
        "module.mat": torch.randn(8, 8, generator=g).to(torch.float16),
        "module.t": torch.randn(3, 5, generator=g).t(),  # strides that are not C order
        "module.view": shared[10:30],  # an offset into a shared storage
        "module.view2": shared[40:41],
        "module.five": torch.zeros(1, 2, 3, 2, 1),  # MARK ... TUPLE
        "module.p": torch.nn.Parameter(torch.randn(2, 2, generator=g)),
        "module.grad": torch.randn(4, generator=g).requires_grad_(True),
        "module.bool": torch.ones(3, dtype=torch.bool),
    }
    for i in range(300):  # past 256 memo entries: LONG_BINPUT / LONG_BINGET
        sd[f"module.layers.{i}.w"] = torch.randn(4, 4, generator=g) if i % 2 else torch.randn(4, generator=g)
    out = tmp_path / f"sd{protocol}.pt"
    torch.save({"state_dict": sd, "epoch": 3}, out, pickle_protocol=protocol)
    with zipfile.ZipFile(out) as archive:
        return archive.read(next(n for n in archive.namelist() if n.endswith("data.pkl")))


@pytest.mark.parametrize("protocol", [2, 4])
def test_entries_in_one_step_match_the_opcode_walk(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                   protocol: int) -> None:
    data = _pickle(tmp_path, protocol)
    taken = []
    entry = opcode_guard._Walk.entry

    def spy(self, match, ops, key):  # type: ignore[no-untyped-def]
        result = entry(self, match, ops, key)
        taken.append(result is not None)
        return result

    monkeypatch.setattr(opcode_guard._Walk, "entry", spy)
    fast = _walk(data, True, monkeypatch)
    assert fast[1] is None and fast[0] == len(data)
    if protocol == 2:
        assert sum(taken) > 250  # the entries of torch's form were taken in one step
    assert fast == _walk(data, False, monkeypatch)


def test_changed_bytes_are_judged_alike(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    data = _pickle(tmp_path)
    rng = random.Random(7)
    opcodes = [0x71, 0x72, 0x68, 0x6A, 0x4B, 0x4D, 0x4A, 0x85, 0x86, 0x87, 0x74, 0x28, 0x29, 0x58, 0x52]
    for _ in range(80):
        mutant = bytearray(data)
        for _ in range(rng.choice([1, 1, 2, 3])):
            at = rng.randrange(len(mutant))
            mutant[at] = rng.choice([rng.randrange(256), mutant[at] ^ 1, rng.choice(opcodes)])
        assert _walk(bytes(mutant), True, monkeypatch) == _walk(bytes(mutant), False, monkeypatch)


@pytest.mark.parametrize("store", [1, 20])  # the entry's first store (its key) and its last (the tensor)
def test_a_memo_bomb_inside_an_entry_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, store: int) -> None:
    data = _pickle(tmp_path)
    key = b"module.layers.150.w"
    match = opcode_guard._ENTRY.match(data, data.index(key) + len(key))
    assert match is not None and data[match.start(store)] == 0x72  # LONG_BINPUT
    at = match.start(store) + 1
    mutant = data[:at] + (0xFFFFFFF0).to_bytes(4, "little") + data[at + 4:]  # a 64 GiB memo table
    fast, slow = _walk(mutant, True, monkeypatch), _walk(mutant, False, monkeypatch)
    assert fast == slow
    assert fast[1] is not None and "memo index 4294967280" in fast[1]
