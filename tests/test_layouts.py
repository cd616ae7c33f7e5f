"""Sparse and nested tensors: read with the values torch reads, rewritten as torch wrote them.

Every file here is made by ``torch.save``. ckptool's values (``to_state_dict`` over the state dict,
the API's materialization) are compared with ``torch.load(weights_only=True)`` exactly: layout,
dtype, size, components, dense values. ``.pt`` rewrites (strip, remap, add-prefix, convert) must
load in torch with the same tensors; a safetensors output is refused in one line naming them.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

import ckptool  # noqa: E402
from ckptool.ops.load_into import to_state_dict  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from test_differential import PT_REWRITES, rewrite, run  # noqa: E402


def _dense() -> Any:
    return torch.tensor([[0.0, 1.5, 0.0, -2.0], [3.0, 0.0, 0.0, 4.25], [0.0, 0.0, 0.0, 0.0], [5.0, 6.0, 0.0, -0.0]])


def _uncoalesced() -> Any:
    indices = torch.tensor([[1, 0, 1], [2, 0, 2]])
    return torch.sparse_coo_tensor(indices, torch.tensor([1.0, 2.0, 3.0]), (2, 3))


LAYOUTS = {
    "coo": lambda: _dense().to_sparse(),
    "coo_uncoalesced": _uncoalesced,
    "coo_int64_hybrid": lambda: torch.arange(24).reshape(4, 3, 2).to_sparse(1),
    "csr": lambda: _dense().to_sparse_csr(),
    "csc": lambda: _dense().double().to_sparse_csc(),
    "bsr": lambda: _dense().to_sparse_bsr((2, 2)),
    "bsc": lambda: _dense().to_sparse_bsc((2, 1)),
    "nested": lambda: torch.nested.nested_tensor([torch.ones(2, 3), torch.arange(8.0).reshape(4, 2)]),
    "nested_int": lambda: torch.nested.nested_tensor([torch.arange(3), torch.arange(5)]),
}


def _torch_load(path: Path) -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torch.load(path, weights_only=True)


def assert_same(expected: Any, got: Any, name: str) -> None:
    assert got.layout == expected.layout and got.dtype == expected.dtype, name
    assert got.is_nested == expected.is_nested, name
    if expected.is_nested:
        pieces = list(zip(expected.unbind(), got.unbind(), strict=True))
        assert all(torch.equal(a, b) for a, b in pieces), name
        return
    assert got.shape == expected.shape, name
    if expected.layout == torch.sparse_coo:
        assert got.is_coalesced() == expected.is_coalesced(), name
        assert torch.equal(got._indices(), expected._indices()) and torch.equal(got._values(), expected._values()), name
    elif expected.layout != torch.strided:
        compressed = (torch.sparse_csr, torch.sparse_bsr)
        ci, pi = (got.crow_indices(), got.col_indices()) if got.layout in compressed else \
            (got.ccol_indices(), got.row_indices())
        eci, epi = (expected.crow_indices(), expected.col_indices()) if got.layout in compressed else \
            (expected.ccol_indices(), expected.row_indices())
        assert torch.equal(ci, eci) and torch.equal(pi, epi) and torch.equal(got.values(), expected.values()), name
    assert torch.equal(got.to_dense(), expected.to_dense()), name


def assert_loads_like(path: Path, reference: dict[str, Any], *, prefix: str = "") -> None:
    loaded = _torch_load(path)
    assert sorted(loaded) == sorted(prefix + key for key in reference)
    for key, value in reference.items():
        assert_same(value, loaded[prefix + key], key)


@pytest.fixture
def saved(tmp_path: Path) -> tuple[Path, dict[str, Any]]:
    state = {"dense": torch.arange(4.0), **{name: make() for name, make in LAYOUTS.items()}}
    path = tmp_path / "layouts.pt"
    torch.save(state, path)
    return path, _torch_load(path)


def test_the_api_reads_the_values_torch_reads(saved: tuple[Path, dict[str, Any]]) -> None:
    path, reference = saved
    checkpoint = ckptool.load(path)
    values = to_state_dict(checkpoint.state_dict)
    assert list(values) == list(reference)
    for key, expected in reference.items():
        assert_same(expected, values[key], key)


@pytest.mark.parametrize("command", PT_REWRITES)
def test_pt_rewrites_load_in_torch_with_the_same_tensors(tmp_path: Path, command: str) -> None:
    state = {f"module.{name}": make() for name, make in LAYOUTS.items()}
    source = tmp_path / "ddp.pt"
    torch.save(state, source)
    reference = _torch_load(source)
    out = tmp_path / "out.pt"
    code, stdout, stderr = rewrite(command, source, out)
    assert code == 0, stderr
    if command == "strip":
        assert_loads_like(out, {key.removeprefix("module."): value for key, value in reference.items()})
    else:
        assert_loads_like(out, reference, prefix="module." if command == "add-prefix" else "")


def test_a_safetensors_output_is_refused_in_one_line_naming_them(saved: tuple[Path, dict[str, Any]],
                                                                   tmp_path: Path) -> None:
    path, _ = saved
    out = tmp_path / "out.safetensors"
    code, stdout, stderr = run("convert", path, "-o", out)
    assert code == 3 and len(stderr.strip().splitlines()) == 1, stderr
    assert "'coo' (sparse_coo)" in stderr and "nothing was written" in stderr
    assert not out.exists() and not list(tmp_path.glob("*.safetensors"))
    code, _, stderr = run("convert", path, "-o", tmp_path / "shards", "--max-shard-size", "1MB")
    assert code == 3 and "sparse, nested or quantized" in stderr and not (tmp_path / "shards").exists()


def test_inspect_describes_them(saved: tuple[Path, dict[str, Any]]) -> None:
    path, _ = saved
    code, stdout, _ = run("inspect", path)
    assert code == 0
    assert "'csr' is a sparse_csr float32 [4, 4] tensor" in stdout
    assert "'nested' is a nested float32 (2 tensors of 2 dimensions)" in stdout


def test_diff_and_fingerprint_see_their_values(tmp_path: Path) -> None:
    a, b, c = tmp_path / "a.pt", tmp_path / "b.pt", tmp_path / "c.pt"
    torch.save({"w": _dense().to_sparse()}, a)
    changed = _dense()
    changed[0, 1] = 7.0
    torch.save({"w": changed.to_sparse()}, b)
    torch.save({"w": torch.sparse_coo_tensor(_dense().to_sparse()._indices(), _dense().to_sparse()._values(),
                                             (4, 9))}, c)  # same parts, another size
    assert run("diff", a, a)[0] == 0
    assert run("diff", a, b)[0] == 1
    assert run("diff", a, c)[0] == 1
    fingerprints = {ckptool.fingerprint(ckptool.load(p).tensors) for p in (a, b, c)}
    assert len(fingerprints) == 3


def test_inconsistent_sparse_parts_are_refused_as_torch_refuses_them(tmp_path: Path) -> None:
    """An index past the size. torch.load(weights_only=True) refuses it where torch validates the sparse tensors it
    loads there (2.14 does); where it does not (2.11, seen on a GPU machine), torch's own validator refuses what it
    returned."""
    bad = torch.sparse_coo_tensor(torch.tensor([[0, 5]]), torch.tensor([1.0, 2.0]), (3,), check_invariants=False)
    path = tmp_path / "bad.pt"
    torch.save({"w": bad, "b": torch.ones(1)}, path)
    with pytest.raises(Exception):
        loaded = _torch_load(path)["w"]
        torch._validate_sparse_coo_tensor_args(loaded._indices(), loaded._values(), loaded.size())
    with pytest.raises(ckptool.CkptError) as caught:
        to_state_dict(ckptool.load(path).state_dict)
    assert "\n" not in caught.value.message and "sparse_coo" in caught.value.message


def test_a_nested_tensor_reaching_past_its_buffer_is_refused(tmp_path: Path) -> None:
    """torch.load does not check a nested tensor's offsets; ckptool does before building a view."""
    from test_differential import Crafted

    buffer = torch.arange(4.0)
    sizes, strides = torch.tensor([[2], [3]]), torch.tensor([[1], [1]])
    for offsets, fits in ((torch.tensor([0, 1]), True), (torch.tensor([0, 2]), False), (torch.tensor([0, 100]), False)):
        path = tmp_path / "nested.pt"
        torch.save({"w": Crafted(torch._utils._rebuild_nested_tensor, (buffer, sizes, strides, offsets)),
                    "b": torch.ones(1)}, path)
        checkpoint = ckptool.load(path)  # the parts are read lazily: inspect and rewrites need no values
        if fits:
            assert_same(_torch_load(path)["w"], to_state_dict(checkpoint.state_dict)["w"], "w")
            continue
        with pytest.raises(ckptool.CkptError, match="past its buffer"):
            to_state_dict(checkpoint.state_dict)


@pytest.mark.parametrize("wrap", ["parameter", "parameter with state", "attributes", "state setting data"])
def test_wrapped_layout_tensors_read_as_torch_or_are_refused(tmp_path: Path, wrap: str) -> None:
    """A sparse or quantized tensor in nn.Parameter or with Python attributes: torch reads it; so does ckptool,
    and a .pt rewrite gives torch the same wrapping back. State that would replace the tensor is refused."""
    from test_differential import Crafted, assert_agree

    sparse = _dense().to_sparse()
    hooks: Any = __import__("collections").OrderedDict()
    make = {
        "parameter": lambda: torch.nn.Parameter(sparse, requires_grad=False),
        "parameter with state": lambda: Crafted(torch._utils._rebuild_parameter_with_state,
                                                (sparse, False, hooks, {"tag": 1})),
        "attributes": lambda: Crafted(torch._tensor._rebuild_from_type_v2,
                                      (torch._utils._rebuild_sparse_tensor, torch.Tensor,
                                       (torch.sparse_coo, (sparse._indices(), sparse._values(), sparse.shape, True)),
                                       {"note": "x"})),
        "state setting data": lambda: Crafted(torch._utils._rebuild_parameter_with_state,
                                              (sparse, False, hooks, {"data": torch.zeros(2)})),
    }[wrap]
    path = tmp_path / "wrapped.pt"
    torch.save({"w": make(), "b": torch.ones(1)}, path)
    outcome = assert_agree(path)
    assert outcome != "equal" if wrap == "state setting data" else outcome == "equal", outcome
    if wrap == "state setting data":
        with pytest.raises(ckptool.CkptError, match="'data'"):
            ckptool.load(path)
    if outcome == "equal":
        code, _, err = run("convert", path, "-o", tmp_path / "out.pt")
        assert code == 0, err
        reference, loaded = _torch_load(path)["w"], _torch_load(tmp_path / "out.pt")["w"]
        assert type(loaded) is type(reference) and loaded.__dict__ == reference.__dict__
        assert_same(reference, loaded, "w")


def test_a_views_span_and_contiguity_agree_with_torch_on_random_layouts() -> None:
    """span_bytes (storage bytes from a view's first element to its last), expands() and is_contiguous(), cached
    per TensorRef with a fast path for contiguous views, against torch's own view of the same shape and strides."""
    import math
    import random

    from ckptool.tensors.dtypes import BY_TORCH_NAME
    from ckptool.tensors.refs import StorageRef, TensorRef, contiguous_stride

    float32 = BY_TORCH_NAME["float32"]
    positions = torch.arange(10_000)  # element i of the storage holds i: a view's largest value is its last element
    rng = random.Random(0)
    for _ in range(3000):
        shape = tuple(rng.choice([0, 1, 1, 2, 3, 5]) for _ in range(rng.randint(0, 4)))
        if rng.random() < 0.5:  # contiguous, some size-1 dimensions with any stride
            stride = tuple(rng.randint(0, 50) if size == 1 and rng.random() < 0.5 else step
                           for size, step in zip(shape, contiguous_stride(shape)))
        else:
            stride = tuple(rng.randint(0, 20) for _ in shape)
        ref = TensorRef(StorageRef(key="0", dtype=float32, numel=10_000, location="cpu"), float32, shape, stride)
        view = positions.as_strided(shape, stride)
        if math.prod(shape) == 0:
            assert ref.span_bytes() == 0 and not ref.expands(), (shape, stride)
            continue
        span = (int(view.max()) + 1) * 4
        assert ref.span_bytes() == span, (shape, stride)
        assert ref.expands() == (math.prod(shape) * 4 > span), (shape, stride)
        assert ref.is_contiguous() == view.is_contiguous(), (shape, stride)


def _layout_name(tensor: Any) -> str:
    if tensor.is_quantized:
        return "quantized"
    if tensor.is_nested:
        return "nested"
    return str(tensor.layout).removeprefix("torch.")


def test_inspect_lists_each_key_as_torch_s_state_dict_holds_it(tmp_path: Path) -> None:
    """--tensors: one entry per key (a sparse, nested or quantized tensor whole, with its layout; a meta tensor
    with device meta and no bytes), its parts named as diff names them; the --json document validates."""
    import json

    import jsonschema

    from ckptool.base import jsonout
    from ckptool.tensors.dtypes import BY_TORCH_NAME

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        state = {**{name: make() for name, make in LAYOUTS.items()},
                 "dense": torch.arange(6.0).reshape(2, 3),
                 "q": torch.quantize_per_channel(torch.randn(4, 3), torch.rand(4) + 0.1, torch.arange(4), 0,
                                                 torch.qint8),
                 "q4": torch.quantize_per_tensor(torch.randn(2, 4), 0.5, 1, torch.quint4x2),
                 "meta": torch.empty(3, 4, dtype=torch.float16, device="meta"),
                 "param": torch.nn.Parameter(_dense().to_sparse(), requires_grad=False)}
        path = tmp_path / "mixed.pt"
        torch.save(state, path)
    reference = _torch_load(path)
    code, stdout, _ = run("inspect", path, "--json", "--tensors")
    assert code == 0
    document = json.loads(stdout)
    jsonschema.validate(document, jsonout.schema("inspect"), cls=jsonschema.Draft202012Validator)
    listed = {entry["name"]: entry for entry in document["state_dict"]}
    assert list(listed) == list(reference)  # every key, in order, meta included
    parts = {entry["name"] for entry in document["tensor_list"]}  # (as diff and the fingerprint name them)
    for key, tensor in reference.items():
        entry = listed[key]
        assert entry["layout"] == _layout_name(tensor), key
        dtype = str(tensor.dtype).removeprefix("torch.")
        assert entry["dtype"] == (dtype.upper() if tensor.is_quantized else BY_TORCH_NAME[dtype].name), key
        if tensor.is_nested:
            assert entry["shape"] == [tensor.size(0), *[None] * (tensor.dim() - 1)], key
        else:
            assert entry["shape"] == list(tensor.shape), key
        assert entry["device"] == ("meta" if tensor.device.type == "meta" else "cpu"), key
        assert (entry["bytes"] == 0) == (tensor.device.type == "meta"), key
        if entry["layout"] == "strided":  # (a meta tensor has no values to list)
            assert "parts" not in entry and (key in parts) == (tensor.device.type != "meta"), key
        else:
            assert entry["parts"] and set(entry["parts"]) <= parts and key not in parts, key
        if tensor.is_quantized:
            assert entry["qscheme"] == str(tensor.qscheme()).removeprefix("torch."), key
    code, stdout, _ = run("inspect", path, "--tensors")
    lines = {line.split()[0]: line for line in stdout.splitlines()[1:] if line.startswith("  ") and
             line.split() and line.split()[0] in reference}
    assert "sparse_bsc" in lines["bsc"] and "nested" in lines["nested"] and "[2, *, *]" in lines["nested"]
    assert "quantized per_channel_affine" in lines["q"] and lines["meta"].split()[-1] == "meta"
    code, stdout, _ = run("inspect", path)
    assert "1 meta tensor(s), a shape and dtype without values: 'meta'" in stdout
