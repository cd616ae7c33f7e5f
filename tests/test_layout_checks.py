"""Sparse and nested tensors torch.load refuses are refused, by every command and the API, and no others.

Each file holds one sparse (COO, CSR, CSC, BSR, BSC) or nested tensor: made by torch, then (for most
drawn cases) one part changed — an index moved past the size, a compressed index out of order, a
size that overflows, a dtype torch does not take. The reference is ``torch.load(weights_only=True)``
followed by torch's own validator (``_validate_sparse_coo_tensor_args``,
``_validate_sparse_compressed_tensor_args``), as a torch that validates what it loads does, run in a
child process (torch's validator can crash on indices out of order: a crash is a refusal): ckptool
refuses exactly the files torch refuses, and reads torch's tensor from the others. ckptool is stricter
in two documented places, for records torch.save never writes: a nested tensor's negative sizes,
strides or offsets, and COO indices of a type other than int64 and int32.
"""

from __future__ import annotations

import multiprocessing
import sys
import warnings
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

import ckptool  # noqa: E402
from ckptool.pickles.layout_checks import coo_problem  # noqa: E402
from ckptool.ops.load_into import to_state_dict  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from test_differential import SETTINGS, Crafted, assert_same_tensor, run, torch_parts  # noqa: E402

COMPRESSED = {torch.sparse_csr: ("crow_indices", "col_indices"), torch.sparse_bsr: ("crow_indices", "col_indices"),
              torch.sparse_csc: ("ccol_indices", "row_indices"), torch.sparse_bsc: ("ccol_indices", "row_indices")}


def _torch_reads(path: Path) -> Any | None:
    """torch's tensor ``w``, or None where torch.load (and torch's validator on what it loaded) refuses it."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            tensor = torch.load(path, weights_only=True)["w"]
            if tensor.layout == torch.sparse_coo:
                torch._validate_sparse_coo_tensor_args(tensor._indices(), tensor._values(), tensor.size(),
                                                       tensor.is_coalesced())
            elif tensor.layout in COMPRESSED:
                first, second = COMPRESSED[tensor.layout]
                torch._validate_sparse_compressed_tensor_args(getattr(tensor, first)(), getattr(tensor, second)(),
                                                              tensor.values(), tensor.size(), tensor.layout)
        return tensor
    except Exception:  # noqa: BLE001 — any refusal of torch's is one
        return None


# torch's own validator reads memory past a compressed index it was given out of order (and crashes):
# torch's side of a drawn file is judged in a child process first, a crash counting as a refusal
_CHILD: list[ProcessPoolExecutor] = []


def _torch_accepts_in_child(path: str) -> bool:
    return _torch_reads(Path(path)) is not None


def _torch_accepts(path: Path) -> bool:
    for _ in range(2):  # in a fresh child the second time: a crash is torch's, not a child's that was failing
        if not _CHILD:
            _CHILD.append(ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")))
        try:
            return _CHILD[0].submit(_torch_accepts_in_child, str(path)).result(timeout=300)
        except BrokenProcessPool:
            _CHILD.pop().shutdown(wait=False)
    return False  # torch crashed reading it


@pytest.fixture(scope="module", autouse=True)
def _child(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The child that judges torch's side; it must read a good file (else every file would seem refused)."""
    good = _save(tmp_path_factory.mktemp("good") / "good.pt", torch.eye(2).to_sparse())
    assert _torch_accepts(good)
    yield
    while _CHILD:
        _CHILD.pop().shutdown()


def _ckptool_reads(path: Path) -> Any | None:
    """ckptool's tensor ``w`` (the API's), or None where ckptool refuses in one line."""
    try:
        return to_state_dict(ckptool.load(path).state_dict)["w"]
    except ckptool.CkptError as e:
        assert "\n" not in e.message and "Traceback" not in e.message
        return None


def _save(path: Path, record: Any) -> Path:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.save({"w": record, "b": torch.ones(2)}, path)
    return path


def _sparse(layout: Any, data: tuple) -> Crafted:
    return Crafted(torch._utils._rebuild_sparse_tensor, (layout, data))


def _nested(buffer: Any, sizes: Any, strides: Any, offsets: Any) -> Crafted:
    return Crafted(torch._utils._rebuild_nested_tensor, (buffer, sizes, strides, offsets))


def _changed(tensor: Any, draw: Any) -> Any:
    """``tensor`` (an index tensor) with at most one entry changed to a drawn value (past the bounds, negative,
    huge), or its dtype changed."""
    tensor = tensor.clone()
    how = draw(st.sampled_from(["same", "same", "entry", "entry", "dtype"]))
    if how == "entry" and tensor.numel():
        flat = tensor.view(-1)
        position = draw(st.integers(0, tensor.numel() - 1))
        flat[position] = draw(st.sampled_from([-1, 0, 1, 2, 3, 5, 7, 2**31, 2**62, 2**63 - 1])) \
            if tensor.dtype == torch.int64 else draw(st.sampled_from([-1, 0, 1, 2, 3, 5, 7, 2**31 - 1]))
    elif how == "dtype":
        tensor = tensor.to(draw(st.sampled_from([torch.int32, torch.int16, torch.int64])))
    return tensor


@st.composite
def sparse_records(draw: Any) -> Any:
    """A sparse tensor's record: made by torch from a random dense tensor, then perhaps one part changed."""
    layout = draw(st.sampled_from([torch.sparse_coo, *COMPRESSED]))
    batch = draw(st.lists(st.integers(1, 2), max_size=1)) if layout in COMPRESSED else []
    shape = [*batch, draw(st.integers(1, 4)) * 2, draw(st.integers(1, 3)) * 2, *draw(st.lists(st.integers(1, 2),
                                                                                           max_size=1))]
    generator = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    dense = torch.randint(-1, 2, shape, generator=generator).float() * torch.rand(shape, generator=generator).gt(0.4)
    if layout == torch.sparse_coo:
        sparse = dense.to_sparse(draw(st.integers(1, len(shape))))
        if draw(st.booleans()):
            sparse = torch.sparse_coo_tensor(sparse._indices().flip(1), sparse._values().flip(0), sparse.shape)
        indices, values = _changed(sparse._indices(), draw), sparse._values()
        size = list(sparse.shape)
        if draw(st.booleans()):  # a size that no longer fits the indices, or overflows
            size[draw(st.integers(0, len(size) - 1))] = draw(st.sampled_from([1, 3, 2**31, 2**62]))
        coalesced = draw(st.sampled_from([None, True, False]))
        return _sparse(layout, (indices, values, torch.Size(size), coalesced))
    dense_dims = len(shape) - len(batch) - 2
    blocks = (2, 2) if layout in (torch.sparse_bsr, torch.sparse_bsc) else None
    method = {torch.sparse_csr: "to_sparse_csr", torch.sparse_csc: "to_sparse_csc", torch.sparse_bsr: "to_sparse_bsr",
              torch.sparse_bsc: "to_sparse_bsc"}[layout]
    args = (blocks, dense_dims) if blocks else (dense_dims,)
    try:
        sparse = getattr(dense, method)(*args)
    except RuntimeError:  # (torch makes no batched tensor with differing nnz per batch)
        sparse = getattr(torch.zeros(shape), method)(*args)
    first, second = COMPRESSED[layout]
    compressed, plain = _changed(getattr(sparse, first)(), draw), _changed(getattr(sparse, second)(), draw)
    size = list(sparse.shape)
    if draw(st.booleans()):
        size[draw(st.integers(0, len(size) - 1))] = draw(st.sampled_from([1, 4, 6, 2**31, 2**62]))
    return _sparse(layout, (compressed, plain, sparse.values(), torch.Size(size)))


@st.composite
def nested_records(draw: Any) -> Any:
    pieces = [torch.arange(float(draw(st.integers(0, 6)) * 2)).reshape(-1, 2) for _ in range(draw(st.integers(1, 3)))]
    nested = torch.nested.nested_tensor(pieces)
    sizes, strides = nested._nested_tensor_size(), nested._nested_tensor_strides()
    offsets = nested._nested_tensor_storage_offsets()
    which = draw(st.sampled_from(["sizes", "strides", "offsets", "none"]))
    parts = {"sizes": sizes, "strides": strides, "offsets": offsets}
    if which != "none":
        parts[which] = _changed(parts[which], draw)
    return _nested(nested.values(), parts["sizes"], parts["strides"], parts["offsets"])


def _stricter(record: Crafted) -> bool:
    """Whether ckptool refuses the record by one of its stricter rules: a nested tensor's negative size, stride or
    offset; COO indices of a type other than int64 and int32 (torch converts even float indices)."""
    if record.fn is torch._utils._rebuild_nested_tensor:
        return any(bool((part < 0).any()) for part in record.args[1:])
    layout, data = record.args
    return layout == torch.sparse_coo and data[0].dtype not in (torch.int64, torch.int32)


def _agree(path: Path, record: Crafted) -> str:
    expected = _torch_reads(path) if _torch_accepts(path) else None
    got = _ckptool_reads(path)
    if expected is None or got is None:
        if got is None and expected is not None and _stricter(record):
            return "ckptool refuses"
        assert expected is None and got is None, f"torch {'reads' if expected is not None else 'refuses'}, ckptool " \
                                                 f"{'reads' if got is not None else 'refuses'}"
        return "refused"
    if expected.is_nested:  # by its parts: a nested tensor torch reads may hold more elements than unbind() takes
        assert got.is_nested and got.dtype == expected.dtype
        for role, part in torch_parts(expected).items():
            assert torch.equal(torch_parts(got)[role], part), role
    else:
        assert_same_tensor(expected, got, "w")
    return "equal"


@settings(SETTINGS, max_examples=150)
@given(record=sparse_records())
def test_sparse_tensors_are_refused_exactly_where_torch_refuses_them(tmp_path_factory: pytest.TempPathFactory,
                                                                     record: Any) -> None:
    _agree(_save(tmp_path_factory.mktemp("sparse") / "s.pt", record), record)


@settings(SETTINGS, max_examples=80)
@given(record=nested_records())
def test_nested_tensors_are_refused_exactly_where_torch_refuses_them(tmp_path_factory: pytest.TempPathFactory,
                                                                     record: Any) -> None:
    _agree(_save(tmp_path_factory.mktemp("nested") / "n.pt", record), record)


def _index(values: Any, dtype: Any = torch.int64) -> Any:
    return torch.tensor(values, dtype=dtype)


# hand-built records torch refuses (each names the invariant), and near ones it reads
CASES: dict[str, tuple[Any, bool]] = {
    "coo index past the size": (_sparse(torch.sparse_coo, (_index([[0, 5]]), torch.ones(2), torch.Size([3]), None)),
                                False),
    "coo negative index": (_sparse(torch.sparse_coo, (_index([[0, -1]]), torch.ones(2), torch.Size([3]), None)), False),
    "coo marked coalesced, duplicated": (_sparse(torch.sparse_coo, (_index([[1, 1]]), torch.ones(2), torch.Size([3]),
                                                                    True)), False),
    "coo duplicated, not marked": (_sparse(torch.sparse_coo, (_index([[1, 1]]), torch.ones(2), torch.Size([3]), False)),
                                   True),
    "coo int32 indices": (_sparse(torch.sparse_coo, (_index([[0, 2]], torch.int32), torch.ones(2), torch.Size([3]),
                                                     None)), True),
    "coo 0-dim values": (_sparse(torch.sparse_coo, (_index([[2]]), torch.tensor(4.0), torch.Size([3]), None)), True),
    "coo numel overflows": (_sparse(torch.sparse_coo, (_index([[0], [0]]), torch.ones(1), torch.Size([2**40, 2**40]),
                                                       None)), False),
    "coo values of another dense size": (_sparse(torch.sparse_coo, (_index([[0, 1]]), torch.ones(2, 3),
                                                                    torch.Size([2, 2]), None)), False),
    "csr column past the size": (_sparse(torch.sparse_csr, (_index([0, 1, 2]), _index([0, 7]), torch.ones(2),
                                                            torch.Size([2, 3]))), False),
    "csr row pointers decrease": (_sparse(torch.sparse_csr, (_index([0, 2, 1, 2]), _index([0, 2]), torch.ones(2),
                                                             torch.Size([3, 3]))), False),
    "csr unsorted row": (_sparse(torch.sparse_csr, (_index([0, 2, 2]), _index([2, 0]), torch.ones(2),
                                                    torch.Size([2, 3]))), False),
    "csr mixed index dtypes": (_sparse(torch.sparse_csr, (_index([0, 1, 2], torch.int32), _index([0, 2]), torch.ones(2),
                                                          torch.Size([2, 3]))), False),
    "csr int32 column overflow": (_sparse(torch.sparse_csr, (_index([0, 0, 0], torch.int32), _index([], torch.int32),
                                                             torch.ones(0), torch.Size([2, 2**31]))), False),
    "csr empty, last pointer past nnz": (_sparse(torch.sparse_csr, (_index([0, 1, 5]), _index([]), torch.ones(0),
                                                                    torch.Size([2, 3]))), False),
    "csr dense dims torch does not check": (_sparse(torch.sparse_csr, (_index([0, 1, 2]), _index([0, 2]),
                                                                       torch.ones(2, 4), torch.Size([2, 3, 5]))), True),
    "csc row past the size": (_sparse(torch.sparse_csc, (_index([0, 1, 1, 2]), _index([0, 2]), torch.ones(2),
                                                         torch.Size([2, 3]))), False),
    "bsr size not a multiple of the block": (_sparse(torch.sparse_bsr, (_index([0, 1]), _index([1]),
                                                                        torch.ones(1, 2, 2), torch.Size([2, 5]))),
                                             False),
    "nested size overflows": (_nested(torch.arange(4.0), _index([[3, 2**62]]), _index([[2**62, 1]]), _index([0])),
                              False),
    "nested size times stride overflows": (_nested(torch.arange(4.0), _index([[2**32, 2**32]]),
                                                   _index([[2**31, 1]]), _index([0])), False),
    "nested piece past its buffer": (_nested(torch.arange(4.0), _index([[2], [3]]), _index([[1], [1]]),
                                             _index([0, 2])), False),
    "nested int32 sizes": (_nested(torch.arange(4.0), _index([[2]], torch.int32), _index([[1]], torch.int32),
                                   _index([0], torch.int32)), False),
    "nested huge stride-0 pieces": (_nested(torch.arange(4.0), _index([[2**62, 4]]), _index([[0, 0]]), _index([0])),
                                    True),
    "nested empty piece far away": (_nested(torch.arange(4.0), _index([[0]]), _index([[1]]), _index([100])), True),
}


@pytest.mark.parametrize("name", CASES)
def test_hand_built_records_agree_with_torch(tmp_path: Path, name: str) -> None:
    record, reads = CASES[name]
    path = _save(tmp_path / "case.pt", record)
    assert _agree(path, record) == ("equal" if reads else "refused")


@pytest.mark.parametrize("name", ["coo index past the size", "csr unsorted row", "nested size overflows"])
def test_every_command_that_reads_values_refuses_them_in_one_line(tmp_path: Path, name: str) -> None:
    path = _save(tmp_path / "bad.pt", CASES[name][0])
    commands = [("convert", path, "-o", tmp_path / "out.pt"), ("add-prefix", path, "-o", tmp_path / "s.pt", "--prefix", "module."),
                ("convert", path, "-o", tmp_path / "cast.pt", "--dtype", "bf16"), ("diff", path, path),
                ("verify", path, "--devices", "cpu"), ("inspect", path, "--fingerprint")]
    for command in commands:
        code, _, stderr = run(*command)
        assert code == 3, (command, stderr)
        lines = stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"ckptool: error: {path}: "), (command, stderr)
        assert "torch.load refuses it too" in lines[0], (command, stderr)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.pt"], "nothing was written"
    code, stdout, _ = run("inspect", path)  # a description reads no values
    assert code == 0 and "'w'" in stdout
    checkpoint = ckptool.load(path)
    for given_ in (checkpoint.state_dict, checkpoint.tensors):  # the API: whole, or as its parts
        with pytest.raises(ckptool.CkptError, match="torch.load refuses it too"):
            to_state_dict(given_)


def test_a_pt_rewrite_of_a_good_tensor_reads_its_indices_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The check is made once per tensor, whichever commands ask."""
    import ckptool.pickles.layout_checks as checks

    calls: list[int] = []
    real = checks.coo_problem

    def counting(*args: Any) -> Any:
        calls.append(1)
        return real(*args)

    monkeypatch.setattr(checks, "coo_problem", counting)
    path = _save(tmp_path / "good.pt", torch.eye(3).to_sparse())
    checkpoint = ckptool.load(path)
    ckptool.save(checkpoint, tmp_path / "out.pt")
    to_state_dict(checkpoint.state_dict)
    assert len(calls) == 1


def test_coo_problem_reads_big_indices_chunk_by_chunk(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Bounds and order are checked a chunk of columns at a time, with the order carried across chunks."""
    import ckptool.pickles.layout_checks as checks

    monkeypatch.setattr(checks, "CHUNK", 3)
    indices = torch.arange(10).reshape(1, 10)
    for changed, expected in ((None, None), ((0, 3), "not sorted"), ((0, 9), "found index")):
        bad = indices.clone()
        if changed is not None:
            bad[changed] = 2 if expected == "not sorted" else 10
        path = _save(tmp_path / "c.pt", torch.sparse_coo_tensor(bad, torch.ones(10), (10,), is_coalesced=False,
                                                                 check_invariants=False))
        record = ckptool.load(path).state_dict["w"]
        parts = dict(record.components())
        problem = coo_problem(parts["indices"], parts["values"], (10,), True)
        assert (problem is None) if expected is None else (expected in problem), problem
