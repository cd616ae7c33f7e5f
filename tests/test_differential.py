"""ckptool reads the values torch.load(weights_only=True) reads, or refuses the file.

Every file here is made by torch.save, from random tensors (dtypes, views with offsets and strides,
conjugate and negative bits, parameters with and without state, nested containers, zip and legacy
formats) or from hand-built rebuild arguments (metadata, parameter state, OrderedDict state). For
each, either torch refuses it, or ckptool refuses it (a CkptError), or every tensor ckptool finds
holds torch's values: its bytes (``TensorRef.read_bytes``, what convert, diff, fingerprint and
verify stream) and its materialized tensor. Floating values compare bit for bit, except that the
sign of a zero and the payload of a NaN may differ where torch's own vectorized kernels differ
from its scalar ones (negating a complex zero gives +0.0 in one and -0.0 in the other).

Hypothesis runs derandomized with a modest example count, so CI sees the same examples each run.
"""

from __future__ import annotations

import json
import warnings
import zipfile
from collections import Counter, OrderedDict
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner
from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st

import ckptool
from ckptool.cli.main import main
from ckptool.pickles.layouts import LayoutTensor
from ckptool.ops.load_into import to_state_dict
from ckptool.pickles import PARAMETER_DESCRIPTORS
from ckptool.tensors.refs import TensorRef

# of a suite's 60 examples, at least this many must be files both torch and ckptool read and compare (not
# files one of them refuses), so that a change making most inputs refused cannot pass unnoticed
MIN_EQUAL = 20
SETTINGS = settings(max_examples=60, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.int16, torch.int32,
          torch.int64, torch.uint8, torch.bool, torch.complex64, torch.complex128]
# where torch has a negation kernel (bool, float8 and uint16/32/64 have none)
NEGATABLE = {torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.int16, torch.int32,
             torch.int64, torch.uint8, torch.complex64, torch.complex128}
FLOATING = {torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.complex64, torch.complex128}


class Crafted:
    """Pickles as ``fn(*args)``: hand-built rebuild calls, written through torch's own pickler."""

    def __init__(self, fn: Any, args: tuple) -> None:
        self.fn, self.args = fn, args

    def __reduce_ex__(self, protocol: int) -> tuple:
        return self.fn, self.args


class ShadowedDict(OrderedDict):
    """An OrderedDict pickled with BUILD state ``state`` (what torch.load applies to its __dict__)."""

    def __init__(self, items: list, state: dict) -> None:
        super().__init__(items)
        self._build_state = state

    def __reduce__(self) -> tuple:
        return OrderedDict, (), self._build_state, None, iter(dict.items(self))


# ---------------------------------------------------------------------------------------------- helpers


def run(*args: object) -> tuple[int, str, str]:
    result = CliRunner().invoke(main, [str(a) for a in args])
    return result.exit_code, result.stdout, result.stderr


# the four .pt rewrites, each from a source to a .pt output
PT_REWRITES = ("remap", "add-prefix", "convert", "strip")


def rewrite(command: str, source: Path, out: Path) -> tuple[int, str, str]:
    """Run one of :data:`PT_REWRITES` from ``source`` to ``out`` (remap: every storage to the CPU)."""
    extra = ["--to", "cpu"] if command == "remap" else []
    return run(command, source, *extra, "-o", out)


def torch_tensors(obj: Any, path: tuple = ()) -> dict[tuple, Any]:
    """Every tensor in torch's loaded object, by the key path ckptool's tree uses."""
    if isinstance(obj, torch.Tensor):
        return {path: obj}
    found: dict[tuple, Any] = {}
    if isinstance(obj, dict):
        for key, value in dict.items(obj):
            found.update(torch_tensors(value, path + (key,)))
    elif isinstance(obj, list | tuple):
        for index, value in enumerate(obj):
            found.update(torch_tensors(value, path + (index,)))
    return found


def is_plain(tensor: Any) -> bool:
    """A strided tensor with values (not sparse, nested, quantized or on the meta device)."""
    return tensor.layout == torch.strided and not tensor.is_quantized and not tensor.is_nested and \
        tensor.device.type != "meta"


def values_of(tensor: Any) -> Any:
    """torch's values for a loaded tensor: bits resolved, contiguous, detached (others as they are)."""
    if not is_plain(tensor):
        return tensor
    # a fresh C-order copy: .contiguous() keeps a size-1 dimension's odd stride, which view(uint8) refuses
    return tensor.detach().resolve_conj().resolve_neg().clone(memory_format=torch.contiguous_format)


def ckptool_tensors(obj: Any, path: tuple = (), on_path: frozenset = frozenset()) -> dict[tuple, Any]:
    """Every tensor in ckptool's tree by the key path :func:`torch_tensors` gives torch's: plain
    tensors, and sparse, nested, quantized and meta tensors whole (not their parts)."""
    if isinstance(obj, TensorRef | LayoutTensor) or type(obj).__name__ == "_rebuild_meta_tensor_no_storage":
        return {path: obj}
    found: dict[tuple, Any] = {}
    if id(obj) in on_path:
        return found
    items = dict.items(obj) if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, list | tuple) else ()
    for key, value in items:
        found.update(ckptool_tensors(value, path + (key,), on_path | {id(obj)}))
    return found


def torch_parts(tensor: Any) -> dict[str, Any]:
    """The parts ckptool lists a sparse, nested or quantized tensor by, as torch's own accessors give them."""
    if tensor.is_quantized:
        if tensor.qscheme() == torch.per_tensor_affine:
            return {"int_repr": tensor.int_repr(), "scale": torch.tensor(tensor.q_scale(), dtype=torch.float64),
                    "zero_point": torch.tensor(tensor.q_zero_point(), dtype=torch.int64)}
        return {"int_repr": tensor.int_repr(), "scales": tensor.q_per_channel_scales(),
                "zero_points": tensor.q_per_channel_zero_points(),
                "axis": torch.tensor(tensor.q_per_channel_axis(), dtype=torch.int64)}
    if tensor.is_nested:
        return {"values": tensor.values(), "sizes": tensor._nested_tensor_size(),
                "strides": tensor._nested_tensor_strides(), "offsets": tensor._nested_tensor_storage_offsets()}
    if tensor.layout == torch.sparse_coo:
        return {"indices": tensor._indices(), "values": tensor._values()}
    compressed = {torch.sparse_csr: ("crow_indices", "col_indices"), torch.sparse_bsr: ("crow_indices", "col_indices"),
                  torch.sparse_csc: ("ccol_indices", "row_indices"), torch.sparse_bsc: ("ccol_indices", "row_indices")}
    first, second = compressed[tensor.layout]
    return {"compressed_indices": getattr(tensor, first)(), "plain_indices": getattr(tensor, second)(),
            "values": tensor.values()}


def torch_part_name(key: str, tensor: Any, role: str) -> str:
    """The name ckptool's ``Checkpoint.tensors`` gives a part, worked out from torch's tensor."""
    if tensor.is_quantized:
        tag = f"{str(tensor.dtype).removeprefix('torch.')} {'x'.join(map(str, tensor.shape))}"
    elif tensor.is_nested:
        tag = f"nested {'x'.join(map(str, tensor._nested_tensor_size().shape))}"
    else:
        tag = f"{str(tensor.layout).removeprefix('torch.')} {'x'.join(map(str, tensor.shape))}"
    return f"{key}[{tag}/{role}]"


def assert_same_tensor(expected: Any, got: Any, where: str) -> None:
    """torch's tensor and another, bit for bit where it matters: values (with :func:`assert_same_values`'s
    float rule), a quantized tensor's integers and parameters exactly, sparse and nested tensors by part."""
    assert got.dtype == expected.dtype and got.layout == expected.layout, where
    assert got.is_quantized == expected.is_quantized and got.is_nested == expected.is_nested, where
    if is_plain(expected):
        assert_same_values(values_of(expected), values_of(got), where)
        return
    if expected.is_quantized:
        assert got.qscheme() == expected.qscheme() and got.shape == expected.shape, where
        assert got.stride() == expected.stride() and got.storage_offset() == expected.storage_offset(), where
    elif expected.is_nested:
        pieces = list(zip(expected.unbind(), got.unbind(), strict=True))
        assert all(raw(values_of(a)) == raw(values_of(b)) for a, b in pieces), where
    else:
        assert got.shape == expected.shape, where
        if expected.layout == torch.sparse_coo:
            assert got.is_coalesced() == expected.is_coalesced(), where
    want, have = torch_parts(expected), torch_parts(got)
    for role, part in want.items():  # exactly: a scale's NaN payload or -0.0 counts
        assert have[role].dtype == part.dtype and have[role].shape == part.shape, f"{where}: {role}"
        assert raw(values_of(have[role])) == raw(values_of(part)), f"{where}: {role}"


def raw(tensor: Any) -> bytes:
    return tensor.reshape(-1).view(torch.uint8).numpy().tobytes() if tensor.numel() else b""


def assert_same_values(expected: Any, got: Any, where: str) -> None:
    """Bit for bit, or (floating types only) equal with NaN == NaN and -0.0 == 0.0."""
    assert got.dtype == expected.dtype and got.shape == expected.shape, where
    if raw(got) == raw(expected):
        return
    assert expected.dtype in FLOATING, f"{where}: integer or bool values differ"
    torch.testing.assert_close(got, expected, rtol=0, atol=0, equal_nan=True, msg=where)


def load_both(path: Path) -> tuple[Any, Any]:
    """(torch's object or None if torch refuses, ckptool's Checkpoint or None if ckptool refuses)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            reference = torch.load(path, weights_only=True)
            torch_tensors_ = torch_tensors(reference)
            for tensor in torch_tensors_.values():  # a bit torch cannot resolve is a refusal too
                values_of(tensor)
    except Exception:
        reference = None
    try:
        checkpoint = ckptool.load(path)
    except ckptool.CkptError as e:
        assert "\n" not in e.message
        checkpoint = None
    return reference, checkpoint


def assert_agree(path: Path) -> str:
    """Either side refuses, or ckptool's every tensor holds torch's values. Returns which happened."""
    reference, checkpoint = load_both(path)
    if reference is None:
        return "torch refuses"
    if checkpoint is None:
        return "ckptool refuses"
    expected = torch_tensors(reference)
    found = ckptool_tensors(checkpoint.container)
    assert found.keys() == expected.keys()
    metas = {key for key, value in expected.items() if value.device.type == "meta"}
    for key in metas:  # a tensor with no values: ckptool keeps the call that makes it
        assert type(found.pop(key)).__name__ == "_rebuild_meta_tensor_no_storage", key
    materialized = to_state_dict({repr(p): t for p, t in found.items()})
    for key, tensor_ref in found.items():
        if isinstance(tensor_ref, LayoutTensor):
            assert_same_tensor(expected[key], materialized[repr(key)], f"{key}: materialized")
            parts = torch_parts(expected[key])
            for role, part in tensor_ref.components():  # the lazy parts: what diff, convert and fingerprint read
                assert part.dtype.torch_name == str(parts[role].dtype).removeprefix("torch."), (key, role)
                assert tuple(part.shape) == tuple(parts[role].shape), (key, role)
                assert part.read_bytes() == raw(values_of(parts[role])), (key, role)
            continue
        want = values_of(expected[key])
        assert tensor_ref.dtype.torch_name == str(want.dtype).removeprefix("torch."), key
        assert tuple(tensor_ref.shape) == tuple(want.shape), key
        streamed = torch.frombuffer(bytearray(tensor_ref.read_bytes()) or bytearray(1), dtype=torch.uint8)
        streamed = streamed[: tensor_ref.nbytes].view(want.dtype).reshape(want.shape)
        assert_same_values(want, streamed, f"{key}: bytes")
        made = materialized[repr(key)]
        assert made.is_conj() == expected[key].is_conj() and made.is_neg() == expected[key].is_neg(), key
        assert_same_values(want, values_of(made), f"{key}: materialized")
    return "equal"


# ---------------------------------------------------------------------------------------------- strategies


@st.composite
def tensors(draw: Any) -> Any:
    dtype = draw(st.sampled_from(DTYPES))
    shape = draw(st.lists(st.integers(1, 5), min_size=0, max_size=3))
    numel = 1
    for size in shape:
        numel *= size
    item = torch.empty(0, dtype=dtype).element_size()
    data = bytearray(draw(st.binary(min_size=numel * item, max_size=numel * item)))
    if dtype is torch.bool:
        data = bytearray(b % 2 for b in data)
    tensor = torch.frombuffer(data, dtype=torch.uint8).view(dtype).reshape(shape).clone() if data else \
        torch.empty(shape, dtype=dtype)
    for _ in range(draw(st.integers(0, 2))):  # views: offsets, steps, transposes, selections
        if tensor.dim() == 0:
            break
        op = draw(st.sampled_from(["slice", "transpose", "select"]))
        dim = draw(st.integers(0, tensor.dim() - 1))
        size = tensor.shape[dim]
        if op == "slice" and size:
            start = draw(st.integers(0, size - 1))
            tensor = tensor.narrow(dim, start, size - start)[(slice(None),) * dim + (slice(None, None, draw(st.integers(1, 2))),)]
        elif op == "transpose":
            tensor = tensor.transpose(0, dim)
        elif op == "select" and size:
            tensor = tensor.select(dim, draw(st.integers(0, size - 1)))
    if dtype.is_complex and draw(st.booleans()):
        tensor = tensor.conj()
    if dtype in NEGATABLE and draw(st.booleans()):
        tensor = torch._neg_view(tensor)
    kind = draw(st.sampled_from(["tensor", "tensor", "parameter", "parameter with state"]))
    if kind != "tensor":
        tensor = torch.nn.Parameter(tensor, requires_grad=dtype in FLOATING and draw(st.booleans()))
        if kind == "parameter with state":
            tensor.tensor_model_parallel = True  # a plain attribute (Megatron sets such), saved as state
            tensor.partition_dim = draw(st.integers(0, 3))
    return tensor


containers = st.recursive(
    tensors(),
    lambda children: st.one_of(
        st.lists(children, min_size=1, max_size=3),
        st.dictionaries(st.sampled_from(["w", "b", "model", "state_dict", "ema"]), children, min_size=1, max_size=3),
        st.dictionaries(st.sampled_from(["a.weight", "a.bias"]), children, min_size=1, max_size=2).map(OrderedDict),
    ),
    max_leaves=4,
)


# ---------------------------------------------------------------------------------------------- torch.save'd files


def test_random_checkpoints_read_the_values_torch_reads(tmp_path_factory: pytest.TempPathFactory) -> None:
    outcomes: Counter[str] = Counter()

    @SETTINGS
    @given(obj=containers, legacy=st.booleans())
    def check(obj: Any, legacy: bool) -> None:
        path = tmp_path_factory.mktemp("diff") / "random.pt"
        try:
            torch.save({"root": obj}, path, _use_new_zipfile_serialization=not legacy)
        except Exception:  # a combination torch.save itself cannot write is no test of reading
            assume(False)
        outcome = assert_agree(path)
        assert outcome in ("equal", "torch refuses")
        outcomes[outcome] += 1

    check()
    # values compared, not only refusals agreed on: the suite must not shrink to files torch refuses
    assert outcomes["equal"] >= MIN_EQUAL, outcomes


@pytest.mark.parametrize("make", [
    lambda x: x.conj(),
    lambda x: torch._neg_view(x),
    lambda x: torch._neg_view(x.conj()),
    lambda x: torch._neg_view(x[1:, ::2].conj()),
], ids=["conj", "neg", "conj+neg", "view conj+neg"])
def test_a_file_with_bits_differs_from_the_clean_file_in_diff_fingerprint_and_verify(tmp_path: Path,
                                                                                     make: Any) -> None:
    # no zeros: torch's vectorized complex negation gives +0.0 for 0.0 where a sign flip gives -0.0
    clean = torch.arange(1, 25, dtype=torch.float32).reshape(4, 6) + 1j * (torch.arange(24.).reshape(4, 6) + 1)
    clean = clean.to(torch.complex64)
    bits = make(clean)
    torch.save({"w": clean[: bits.shape[0], : bits.shape[1]].contiguous() if bits.shape != clean.shape else clean},
               tmp_path / "clean.pt")
    torch.save({"w": bits}, tmp_path / "bits.pt")
    torch.save({"w": bits.resolve_conj().resolve_neg().clone()}, tmp_path / "resolved.pt")
    a, b, resolved = (ckptool.load(tmp_path / name) for name in ("bits.pt", "clean.pt", "resolved.pt"))
    assert ckptool.fingerprint(a.tensors) != ckptool.fingerprint(b.tensors)
    assert ckptool.fingerprint(a.tensors) == ckptool.fingerprint(resolved.tensors)
    assert not ckptool.diff(a, b).identical
    assert ckptool.diff(a, resolved).identical
    code, out, err = run("verify", tmp_path / "bits.pt", "--against", tmp_path / "clean.pt")
    assert code == 1, out + err
    # written out, the values survive: .pt keeps the bits for torch to apply, safetensors stores values
    for out in ("out.pt", "out.safetensors"):
        ckptool.save(a, tmp_path / out)
        assert ckptool.fingerprint(ckptool.load(tmp_path / out).tensors) == ckptool.fingerprint(resolved.tensors)
    assert torch.equal(torch.load(tmp_path / "out.pt", weights_only=True)["w"].resolve_conj().resolve_neg(),
                       bits.resolve_conj().resolve_neg())
    from safetensors.torch import load_file

    assert torch.equal(load_file(tmp_path / "out.safetensors")["w"], bits.resolve_conj().resolve_neg())


def test_read_bytes_gives_values_not_storage_bytes(tmp_path: Path) -> None:
    torch.save({"w": torch._neg_view(torch.tensor([1.0, -2.0]))}, tmp_path / "neg.pt")
    assert ckptool.load(tmp_path / "neg.pt").tensors["w"].read_bytes() == torch.tensor([-1.0, 2.0]).numpy().tobytes()


# ---------------------------------------------------------------------------------------------- crafted rebuilds

METADATA_VALUES = st.sampled_from([True, False, 1, 0, "x", None])


def test_crafted_tensor_metadata(tmp_path_factory: pytest.TempPathFactory) -> None:
    outcomes: Counter[str] = Counter()

    @SETTINGS
    @given(dtype=st.sampled_from([torch.float32, torch.complex64, torch.int64, torch.uint8, torch.bool,
                                  torch.bfloat16, torch.uint16, torch.complex128]),
           metadata=st.one_of(st.none(), st.just({}), st.just(7),
                              st.dictionaries(st.sampled_from(["conj", "neg", "zero"]), METADATA_VALUES, max_size=3)),
           v3=st.booleans())
    @example(dtype=torch.complex64, metadata={"conj": False}, v3=False)  # torch sets the bit for False too
    @example(dtype=torch.float32, metadata={"neg": False}, v3=True)
    @example(dtype=torch.float32, metadata={"neg": True, "conj": True}, v3=False)
    def check(dtype: Any, metadata: Any, v3: bool) -> None:
        base = torch.arange(1, 7).to(dtype)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            storage = base._typed_storage()
        if v3:
            args = (storage, 1, (2, 2), (2, 1), False, OrderedDict(), dtype, metadata)
            call = Crafted(torch._utils._rebuild_tensor_v3, args)
        else:
            args = (storage, 1, (2, 2), (2, 1), False, OrderedDict(), metadata)
            call = Crafted(torch._utils._rebuild_tensor_v2, args)
        path = tmp_path_factory.mktemp("meta") / "crafted.pt"
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                torch.save({"w": call}, path)
        except Exception:  # torch.save cannot pickle every dtype through every rebuild
            assume(False)
        outcomes[assert_agree(path)] += 1

    check()
    assert outcomes["equal"] >= MIN_EQUAL, outcomes  # values compared, not only refusals agreed on


STATE_NAMES = st.sampled_from(["data", "real", "imag", "grad", "requires_grad", "__class__", "_is_sharded",
                               "tensor_model_parallel", "foo"])
STATE_VALUES = st.sampled_from(["zeros", "int", "none", "true"])


def _state_value(kind: str) -> Any:
    return {"zeros": torch.zeros(3), "int": 3, "none": None, "true": True}[kind]


@SETTINGS
@given(entries=st.dictionaries(STATE_NAMES, STATE_VALUES, max_size=3), as_pair=st.booleans(),
       slots=st.dictionaries(STATE_NAMES, STATE_VALUES, max_size=2))
def test_crafted_parameter_state(tmp_path_factory: pytest.TempPathFactory, entries: dict, as_pair: bool,
                                 slots: dict) -> None:
    state: Any = {name: _state_value(kind) for name, kind in entries.items()}
    if as_pair:
        state = (state or None, {name: _state_value(kind) for name, kind in slots.items()} or None)
    call = Crafted(torch._utils._rebuild_parameter_with_state, (torch.ones(3), False, OrderedDict(), state))
    path = tmp_path_factory.mktemp("state") / "crafted.pt"
    torch.save({"w": call}, path)
    outcome = assert_agree(path)
    changes_values = any(name in ("data", "real", "imag") for name in entries) or \
        (as_pair and any(name in ("data", "real", "imag") for name in slots))
    assert not (changes_values and outcome == "equal")  # ckptool never reads those as the plain tensor


@SETTINGS
@given(names=st.lists(st.sampled_from(["items", "keys", "values", "get", "_metadata", "foo", "__setstate__",
                                       "__class__", "copy"]), min_size=1, max_size=3, unique=True))
def test_crafted_ordered_dict_state(tmp_path_factory: pytest.TempPathFactory, names: list) -> None:
    state = {name: ([] if name != "_metadata" else {"": {"version": 1}}) for name in names}
    path = tmp_path_factory.mktemp("od") / "crafted.pt"
    torch.save({"model": ShadowedDict([("w", torch.ones(2)), ("b", torch.zeros(2))], state)}, path)
    outcome = assert_agree(path)
    if names == ["_metadata"]:
        assert outcome == "equal"
        assert ckptool.load(path).layout == ("model",)
    if any(hasattr(OrderedDict, name) for name in names):
        assert outcome != "equal"  # shadowed methods: refused, never read as an empty mapping


def test_parameter_descriptors_cover_the_installed_torch() -> None:
    """Every name whose setattr on a Parameter runs torch code is refused in parameter state."""
    import inspect

    descriptors = {name for name in dir(torch.nn.Parameter)
                   if hasattr(type(inspect.getattr_static(torch.nn.Parameter, name)), "__set__")
                   and not (name.startswith("__") and name.endswith("__"))}
    assert descriptors <= PARAMETER_DESCRIPTORS, sorted(descriptors - PARAMETER_DESCRIPTORS)


# ---------------------------------------------------------------------------------------------- storages, globals


@pytest.mark.parametrize("legacy", [False, True], ids=["zip", "legacy"])
@pytest.mark.parametrize("first", [torch.float32, torch.int64, torch.bool, torch.complex64])
def test_an_empty_storage_under_one_key_keeps_each_references_dtype(tmp_path: Path, first: Any,
                                                                   legacy: bool) -> None:
    """torch keeps only allocated storages by key (test_save_different_dtype_unallocated)."""
    a = torch.tensor([], dtype=first)
    b = torch.empty(0, dtype=torch.int64 if first is not torch.int64 else torch.float32).set_(a.untyped_storage())
    path = tmp_path / "empty.pt"
    torch.save({"a": a, "b": b}, path, _use_new_zipfile_serialization=not legacy)
    assert assert_agree(path) == "equal"
    ckptool.save(ckptool.load(path), tmp_path / "out.pt")
    reloaded = torch.load(tmp_path / "out.pt", weights_only=True)
    assert reloaded["a"].dtype == a.dtype and reloaded["b"].dtype == b.dtype


def test_protocol_2_builtins_reach_the_allowlist(tmp_path: Path) -> None:
    """torch.save (protocol 2) names __builtin__.set/bytearray/complex; they map to builtins.*."""
    path = tmp_path / "builtins.pt"
    torch.save({"w": torch.ones(2), "ids": {1, 2}, "blob": bytearray(b"ab"), "z": complex(1, 2)}, path)
    with zipfile.ZipFile(path) as archive:
        assert b"__builtin__\nset" in archive.read("builtins/data.pkl")
    checkpoint = ckptool.load(path)
    assert checkpoint.container["ids"] == {1, 2} and checkpoint.container["blob"] == bytearray(b"ab")
    assert checkpoint.container["z"] == complex(1, 2)
    assert ckptool.scan(path).safe
    assert assert_agree(path) == "equal"


# ---------------------------------------------------------------------------------------------- the CLI


@pytest.mark.parametrize("dtype,values", [(torch.int64, (2**62, 2**62 + 1)), (torch.uint64, (2**63 + 2, 2**63 + 3)),
                                          (torch.int64, (-(2**63), -(2**63) + 1))], ids=["int64", "uint64", "int64 min"])
def test_diff_tells_integers_apart_that_float64_cannot(tmp_path: Path, dtype: Any, values: tuple) -> None:
    torch.save({"a": torch.tensor([values[0]], dtype=dtype)}, tmp_path / "a.pt")
    torch.save({"a": torch.tensor([values[1]], dtype=dtype)}, tmp_path / "b.pt")
    code, out, _ = run("diff", tmp_path / "a.pt", tmp_path / "b.pt")
    assert code == 1 and "identical" not in out.splitlines()[-1] and "every value is equal" not in out
    report = ckptool.diff(tmp_path / "a.pt", tmp_path / "b.pt")
    assert not report.identical and report.max_abs_diff == 1.0


def test_complex128_is_refused_for_safetensors_naming_the_tensors(tmp_path: Path) -> None:
    torch.save({"z": torch.tensor([1 + 2j], dtype=torch.complex128), "w": torch.ones(2),
                "y": torch.zeros(1, dtype=torch.complex128)}, tmp_path / "c.pt")
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    for target in (out_dir / "c.safetensors", out_dir / "shards"):
        code, _, err = run("convert", tmp_path / "c.pt", "-o", target, *(["--max-shard-size", "1KB"]
                                                                         if target.name == "shards" else []))
        assert code == 3 and err.count("\n") == 1, err
        assert "complex128" in err and "'z'" in err and "'y'" in err and "'w'" not in err
    assert list(out_dir.iterdir()) == []
    code, _, err = run("convert", tmp_path / "c.pt", "-o", out_dir / "c.pt")  # .pt holds it
    assert code == 0, err


def test_a_file_saved_with_crcs_off_reads_and_converts(tmp_path: Path) -> None:
    torch.serialization.set_crc32_options(False)
    try:
        torch.save({"w": torch.arange(70000.0), "b": torch.ones(3)}, tmp_path / "nocrc.pt")
    finally:
        torch.serialization.set_crc32_options(True)
    with zipfile.ZipFile(tmp_path / "nocrc.pt") as archive:
        assert {info.CRC for info in archive.infolist()} == {0}
    assert run("inspect", tmp_path / "nocrc.pt")[0] == 0
    for out in ("out.pt", "out.safetensors"):
        code, _, err = run("convert", tmp_path / "nocrc.pt", "-o", tmp_path / out)
        assert code == 0, err
    with zipfile.ZipFile(tmp_path / "out.pt") as archive:
        assert archive.testzip() is None  # the output records the CRCs of its bytes
    assert torch.equal(torch.load(tmp_path / "out.pt", weights_only=True)["w"], torch.arange(70000.0))
    assert run("diff", tmp_path / "nocrc.pt", tmp_path / "out.safetensors")[0] == 0


def _make_crcs_stale(path: Path) -> None:
    """Record wrong CRCs for the storages and the pickle, as a file patched after saving has."""
    import struct

    data = bytearray(path.read_bytes())
    with zipfile.ZipFile(path) as archive:
        infos, central = archive.infolist(), archive.start_dir
    for info in infos:
        if "/data/" in info.filename or info.filename.endswith("data.pkl"):
            wrong = struct.pack("<I", info.CRC ^ 0x5A5A5A5A)
            data[info.header_offset + 14:info.header_offset + 18] = wrong
            name = info.filename.encode()
            position = data.find(b"PK\x01\x02", central)
            while position >= 0:
                length = struct.unpack("<H", data[position + 28:position + 30])[0]
                if data[position + 46:position + 46 + length] == name:
                    data[position + 16:position + 20] = wrong
                position = data.find(b"PK\x01\x02", position + 4)
    path.write_bytes(bytes(data))


def test_a_file_with_stale_crcs_reads_and_converts(tmp_path: Path) -> None:
    torch.save({"w": torch.arange(70000.0), "b": torch.ones(3)}, tmp_path / "stale.pt")
    _make_crcs_stale(tmp_path / "stale.pt")
    assert torch.equal(torch.load(tmp_path / "stale.pt", weights_only=True)["b"], torch.ones(3))  # torch reads it
    for out in ("out.pt", "out.safetensors"):
        code, _, err = run("convert", tmp_path / "stale.pt", "-o", tmp_path / out)
        assert code == 0, err
    with zipfile.ZipFile(tmp_path / "out.pt") as archive:
        assert archive.testzip() is None
    assert run("diff", tmp_path / "stale.pt", tmp_path / "out.pt")[0] == 0


def test_protocol_2_set_in_a_checkpoint_is_read_and_scanned_safe(tmp_path: Path) -> None:
    torch.save({"w": torch.ones(2), "seen_ids": {1, 2, 3}}, tmp_path / "set.pt")
    assert run("inspect", tmp_path / "set.pt")[0] == 0
    code, out, _ = run("scan", tmp_path / "set.pt", "--json")
    assert code == 0 and json.loads(out)["safe"]
    code, _, err = run("strip", tmp_path / "set.pt", "-o", tmp_path / "out.pt", "--prefix", "w")
    assert code in (0, 1), err
    assert run("convert", tmp_path / "set.pt", "-o", tmp_path / "copy.pt")[0] == 0
    assert torch.load(tmp_path / "copy.pt", weights_only=True)["seen_ids"] == {1, 2, 3}


@pytest.mark.parametrize("command", ["inspect", "diff", "verify", "convert"])
def test_a_shadowed_ordered_dict_and_a_replaced_parameter_are_refused_in_one_line(tmp_path: Path,
                                                                                   command: str) -> None:
    torch.save({"model": ShadowedDict([("w", torch.ones(2))], {"items": []})}, tmp_path / "od.pt")
    torch.save({"w": Crafted(torch._utils._rebuild_parameter_with_state,
                             (torch.ones(3), False, OrderedDict(), {"data": torch.zeros(3)}))}, tmp_path / "param.pt")
    torch.save({"w": torch.ones(2)}, tmp_path / "clean.pt")
    for name in ("od.pt", "param.pt"):
        args = {"inspect": [tmp_path / name], "diff": [tmp_path / name, tmp_path / "clean.pt"],
                "verify": [tmp_path / name], "convert": [tmp_path / name, "-o", tmp_path / "out.safetensors"]}[command]
        code, _, err = run(command, *args)
        assert code == 3 and err.count("\n") == 1 and name in err, err
    assert not (tmp_path / "out.safetensors").exists()


def test_inspect_says_which_tensors_carry_bits(tmp_path: Path) -> None:
    torch.save({"w": torch._neg_view(torch.ones(2)), "b": torch.ones(2)}, tmp_path / "neg.pt")
    notes = ckptool.inspect(tmp_path / "neg.pt").notes
    assert any("negative bit" in note and "'w'" in note for note in notes)


def test_a_model_loaded_through_ckptool_gets_the_weights_torch_loads(tmp_path: Path, fixtures_dir: Path) -> None:
    """Every weight saved as a negative view: load_into (verify --model's path) must negate them as torch does."""
    from training.models import lenet

    weights = torch.load(fixtures_dir / "single_lenet.pt", weights_only=True)["model"]
    torch.save({"model": {k: torch._neg_view(v) if v.is_floating_point() else v for k, v in weights.items()}},
               tmp_path / "neg.pt")
    reference = torch.load(tmp_path / "neg.pt", weights_only=True)["model"]
    model = lenet()
    ckptool.load_into(model, tmp_path / "neg.pt")
    for key, value in model.state_dict().items():
        assert torch.equal(value, reference[key].resolve_neg()), key
    report = ckptool.verify(tmp_path / "neg.pt", against=fixtures_dir / "single_lenet.pt")
    assert not report.ok
