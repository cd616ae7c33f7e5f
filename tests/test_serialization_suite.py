"""Every file of PyTorch's own serialization scenarios: ckptool reads torch's values or refuses.

The files come from ``serialization_cases.py`` (real ``torch.save`` under the scenarios of torch's
``test/test_serialization.py``). Each file torch's ``weights_only`` load accepts goes through five
checks, each ending "read" (torch's values, bit for bit: NaN payloads and -0.0 included), "refused"
(exit 3, one stderr line) or "wrong":

- ``inspect --json --tensors --fingerprint``: names, dtypes, shapes, and a fingerprint computed
  independently from torch's values;
- the API: every tensor's streamed bytes and materialized tensor (``test_differential.assert_agree``'s
  checks);
- ``convert -o x.safetensors``: the safetensors library loads torch's values;
- ``convert -o x.pt``: ``torch.load(weights_only=True)`` of the output equals torch's load of the input;
- ``diff``: identical against an independent ``torch.save`` of torch's loaded object, different after
  one low bit of one tensor is flipped.

A wrong answer fails the test; the per-family table (files read / refused / wrong) is printed, and
``python tests/test_serialization_suite.py`` prints it as the README's markdown table.
"""

from __future__ import annotations

import hashlib
import json
import sys
import tempfile
import warnings
from collections import Counter, OrderedDict
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
from click.testing import CliRunner  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's ckptool, also when run as a script
import serialization_cases  # noqa: E402 — the generator beside this file
from serialization_cases import Crafted, _legacy_file, _rebuild, _Stored  # noqa: E402
from test_differential import (assert_agree, assert_same_tensor, ckptool_tensors, raw, torch_part_name,  # noqa: E402
                               torch_parts, torch_tensors, values_of)

import ckptool  # noqa: E402
from ckptool.cli.main import main  # noqa: E402
from ckptool.tensors.dtypes import BY_TORCH_NAME  # noqa: E402
from ckptool.pickles.layouts import LayoutTensor  # noqa: E402
from ckptool.ops.load_into import to_state_dict  # noqa: E402
from ckptool.tensors.refs import TensorRef  # noqa: E402
from ckptool.model.tree import get_at  # noqa: E402

READ, REFUSED, WRONG = "read", "refused", "wrong"
# a safetensors output refused, naming them, for what the format cannot hold: a dtype it lacks, a meta
# tensor (no values), a sparse, nested or quantized tensor
NO_DTYPE = "read; safetensors cannot hold"


class Wrong(AssertionError):
    pass


def _run(*args: object) -> tuple[int, str, str]:
    result = CliRunner().invoke(main, [str(a) for a in args])
    return result.exit_code, result.stdout, result.stderr


def _refusal(code: int, err: str, what: str) -> str:
    """A command that did not succeed must be a refusal: exit 3, one line on stderr."""
    if code == 3 and err.count("\n") == 1 and err.startswith("ckptool: error: "):
        return REFUSED
    raise Wrong(f"{what}: exit {code}, stderr {err!r}")


def _plain(tensor: Any) -> bool:
    """A tensor whose values can be compared byte for byte (strided, on a real device, not quantized)."""
    return tensor.layout == torch.strided and not tensor.is_quantized and not tensor.is_nested and \
        tensor.device.type != "meta"


def _meta(tensor: Any) -> bool:
    return isinstance(tensor, torch.Tensor) and tensor.device.type == "meta"


def _valued(tensors: dict) -> dict:
    """Tensors that hold values: a meta tensor (shape and dtype only) is a recipe ckptool keeps as such."""
    return {key: tensor for key, tensor in tensors.items() if not _meta(tensor)}


def _same(expected: Any, got: Any, where: str) -> None:
    """Bit for bit: NaN payloads and the sign of zero included (sparse and nested: part by part)."""
    if not _plain(expected) and not _meta(expected) or not _plain(got) and not _meta(got):
        try:
            assert_same_tensor(expected, got, where)
        except AssertionError as e:
            raise Wrong(f"{where}: its {expected.layout} parts differ from torch's") from e
        return
    if got.dtype != expected.dtype or tuple(got.shape) != tuple(expected.shape):
        raise Wrong(f"{where}: {got.dtype}{tuple(got.shape)} where torch reads {expected.dtype}{tuple(expected.shape)}")
    if _meta(expected) and (not _meta(got) or got.stride() != expected.stride()):
        raise Wrong(f"{where}: a meta tensor comes back as {got.device} stride {got.stride()}")
    if _plain(expected) and raw(values_of(got)) != raw(values_of(expected)):
        raise Wrong(f"{where}: values differ from torch's")


def _fingerprint(state_dict: dict[str, Any]) -> str:
    """ckptool's fingerprint, computed from torch's tensors (fixtures/make_fixtures.py's recipe)."""
    digest = hashlib.sha256()
    for key in sorted(state_dict):
        tensor = values_of(state_dict[key])
        header = json.dumps([key, BY_TORCH_NAME[str(tensor.dtype).removeprefix("torch.")].name,
                             list(tensor.shape)], separators=(",", ":")).encode()
        data = raw(tensor)
        for part in (header, data):
            digest.update(len(part).to_bytes(8, "little"))
            digest.update(part)
    return "sha256:" + digest.hexdigest()


def _weights(reference: Any, checkpoint: Any) -> dict[str, Any]:
    """torch's tensors at the place ckptool found the weights, by ckptool's names."""
    if checkpoint.layout is None:
        return {}  # a file without a state dict (a bare tensor, a list): no weights to name
    node = get_at(reference, checkpoint.layout)
    return _valued({k: v for k, v in dict.items(node) if isinstance(v, torch.Tensor)})


def _listing(weights: dict[str, Any]) -> dict[str, Any]:
    """torch's weights as ckptool lists them: a sparse, nested or quantized tensor as its parts, named
    and read from torch's own accessors."""
    listed: dict[str, Any] = {}
    for key, tensor in weights.items():
        if _plain(tensor):
            listed[key] = tensor
        else:
            listed.update({torch_part_name(key, tensor, role): part for role, part in torch_parts(tensor).items()})
    return listed


def check_inspect(path: Path, reference: Any, work: Path) -> str:
    code, out, err = _run("inspect", path, "--json", "--tensors", "--fingerprint")
    if code != 0:
        return _refusal(code, err, "inspect")
    report = json.loads(out)
    checkpoint = ckptool.load(path)
    weights = _listing(_weights(reference, checkpoint))
    listed = {entry["name"]: entry for entry in report.get("tensor_list", [])}
    if listed.keys() != weights.keys():
        raise Wrong(f"inspect lists {sorted(listed)} where torch has {sorted(weights)}")
    for name, tensor in weights.items():
        entry = listed[name]
        if entry["dtype"] != BY_TORCH_NAME[str(tensor.dtype).removeprefix("torch.")].name or \
                entry["shape"] != list(tensor.shape):
            raise Wrong(f"inspect: {name} is {entry['dtype']}{entry['shape']} where torch reads {tensor.dtype}")
    if weights and report.get("fingerprint") != _fingerprint(weights):
        raise Wrong("inspect --fingerprint differs from the fingerprint of torch's values")
    return READ


def check_api(path: Path, reference: Any, work: Path) -> str:
    try:
        checkpoint = ckptool.load(path)
        found = ckptool_tensors(checkpoint.container)
        valued = {key: value for key, value in found.items() if isinstance(value, TensorRef | LayoutTensor)}
        materialized = to_state_dict({repr(p): t for p, t in valued.items()})
    except ckptool.CkptError as error:
        if "\n" in error.message:
            raise Wrong(f"API refusal spans lines: {error.message!r}") from None
        return REFUSED
    expected = torch_tensors(reference)
    if found.keys() != expected.keys():
        raise Wrong(f"API finds tensors at {sorted(map(repr, found))} where torch has {sorted(map(repr, expected))}")
    for key, want in expected.items():
        got = found[key]
        if _meta(want):  # no values: ckptool keeps the call that makes it
            if type(got).__name__ != "_rebuild_meta_tensor_no_storage":
                raise Wrong(f"API reads meta tensor {key} as {got!r}")
            continue
        if isinstance(got, LayoutTensor):
            parts = torch_parts(want)
            for role, part in got.components():  # the lazy parts diff, convert and the fingerprint read
                if part.read_bytes() != raw(values_of(parts[role])) or tuple(part.shape) != tuple(parts[role].shape):
                    raise Wrong(f"{key}: its {role} differs from torch's")
        elif not isinstance(got, TensorRef) or not _plain(want):
            raise Wrong(f"API reads {key} as {got!r} though torch's tensor is {want.layout}/{want.device}")
        else:
            data = torch.frombuffer(bytearray(got.read_bytes()) or bytearray(1), dtype=torch.uint8)[: got.nbytes]
            _same(want, data.view(want.dtype).reshape(want.shape), f"{key}: bytes")
        _same(want, materialized[repr(key)], f"{key}: materialized")
    return READ


def _convert(path: Path, target: Path) -> tuple[int, str]:
    """``convert path -o target``: its exit code and stderr; a refusal must leave no output."""
    code, _, err = _run("convert", path, "-o", target)
    if code != 0 and target.exists():
        raise Wrong("a refused convert left its output")
    return code, err


def check_safetensors(path: Path, reference: Any, work: Path) -> str:
    target = work / "out.safetensors"
    code, err = _convert(path, target)
    if code != 0:
        outcome = _refusal(code, err, "convert -o .safetensors")
        try:
            checkpoint = ckptool.load(path)
            weights = _weights(reference, checkpoint)
        except ckptool.CkptError:
            return outcome
        # what the format cannot hold, which the one line must name: sparse, nested and quantized
        # tensors, then dtypes it lacks, then meta tensors (no values)
        layouts = [name for name, tensor in weights.items() if not _plain(tensor)]
        lacking = [name for name, tensor in weights.items() if str(tensor.dtype).removeprefix("torch.")
                   not in SAFETENSORS_TORCH_DTYPES]
        node = get_at(reference, checkpoint.layout or ())
        metas = [name for name, value in dict.items(node) if _meta(value)] if isinstance(node, dict) else []
        for names, says in ((layouts, "sparse, nested or quantized"), (lacking, "safetensors has no dtype"),
                            (metas, "cannot hold meta tensors")):
            if names and says in err and all(repr(n) in err for n in names[:4]):
                return NO_DTYPE
        return outcome
    from safetensors.torch import load_file

    loaded = load_file(target)
    weights = _weights(reference, ckptool.load(path))
    if loaded.keys() != weights.keys():
        raise Wrong(f"safetensors holds {sorted(loaded)} where torch has {sorted(weights)}")
    for name, tensor in weights.items():
        _same(tensor, loaded[name], f"safetensors {name}")
    return READ


def check_pt(path: Path, reference: Any, work: Path) -> str:
    target = work / "out.pt"
    code, err = _convert(path, target)
    if code != 0:
        return _refusal(code, err, "convert -o .pt")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        reloaded = torch.load(target, weights_only=True)
    expected, got = torch_tensors(reference), torch_tensors(reloaded)
    if expected.keys() != got.keys():
        raise Wrong(f".pt output holds tensors at {sorted(map(repr, got))}, torch's input {sorted(map(repr, expected))}")
    for key, tensor in expected.items():
        _same(tensor, got[key], f".pt {key}")
        # Python attributes (parameter state, a tensor's own attributes) survive the rewrite
        if getattr(tensor, "__dict__", {}) != getattr(got[key], "__dict__", {}) or \
                type(tensor) is not type(got[key]) or tensor.requires_grad != got[key].requires_grad:
            raise Wrong(f".pt {key}: {type(got[key]).__name__} {getattr(got[key], '__dict__', {})} where torch "
                        f"loads {type(tensor).__name__} {getattr(tensor, '__dict__', {})}")
    return READ


def _flipped(tensor: Any) -> Any:
    """``tensor`` with the lowest bit of its first stored value flipped (a layout tensor: of its values)."""
    if _plain(tensor):
        flipped = values_of(tensor)
        flipped.reshape(-1).view(torch.uint8)[0] ^= 1
        return flipped
    if tensor.is_quantized:
        integers = tensor.int_repr().clone()
        integers.reshape(-1).view(torch.uint8)[0] ^= 1
        if tensor.qscheme() == torch.per_tensor_affine:
            return torch._make_per_tensor_quantized_tensor(integers, tensor.q_scale(), tensor.q_zero_point())
        return torch._make_per_channel_quantized_tensor(integers, tensor.q_per_channel_scales(),
                                                        tensor.q_per_channel_zero_points(), tensor.q_per_channel_axis())
    if tensor.is_nested:
        pieces = [piece.clone() for piece in tensor.unbind()]
        pieces[0].reshape(-1).view(torch.uint8)[0] ^= 1
        return torch.nested.nested_tensor(pieces)
    parts = torch_parts(tensor)
    values = values_of(parts["values"])
    values.reshape(-1).view(torch.uint8)[0] ^= 1
    if tensor.layout == torch.sparse_coo:
        return torch.sparse_coo_tensor(parts["indices"], values, tensor.shape, is_coalesced=tensor.is_coalesced())
    return torch.sparse_compressed_tensor(parts["compressed_indices"], parts["plain_indices"], values, tensor.shape,
                                          layout=tensor.layout)


def _flip_one_bit(reference: Any) -> Any | None:
    """torch's object with the lowest bit of one weight's first value flipped (None: nothing to flip)."""
    for key, tensor in torch_tensors(reference).items():
        if _meta(tensor) or not tensor.numel() or len(key) > 1:
            continue
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if not key:  # a bare tensor
                return _flipped(tensor)
            if isinstance(reference, dict):
                copy: Any = dict(reference)
                copy[key[0]] = _flipped(tensor)
                return copy
            if isinstance(reference, list | tuple):  # tensors by place
                items = list(reference)
                items[key[0]] = _flipped(tensor)
                return type(reference)(items) if isinstance(reference, tuple) else items
    return None


def check_diff(path: Path, reference: Any, work: Path) -> str:
    same = work / "same.pt"
    torch.save(reference, same)
    code, out, err = _run("diff", path, same)
    if code != 0:
        if code == 1:
            raise Wrong(f"diff finds an independent save of torch's values different: {out[-300:]}")
        return _refusal(code, err, "diff")
    flipped = _flip_one_bit(reference)
    if flipped is not None:
        torch.save(flipped, work / "flipped.pt")
        code, out, err = _run("diff", path, work / "flipped.pt")
        if code == 0:
            raise Wrong("diff finds a file with one flipped bit identical")
        if code != 1:
            return _refusal(code, err, "diff (flipped)")
    return READ


# what the safetensors library itself stores
SAFETENSORS_TORCH_DTYPES = {"float64", "float32", "float16", "bfloat16", "int64", "int32", "int16", "int8", "uint8",
                            "bool", "float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz", "complex64",
                            "uint64", "uint32", "uint16"}

CHECKS = {"inspect": check_inspect, "api": check_api, "safetensors": check_safetensors, "pt": check_pt,
          "diff": check_diff}

def run_suite(root: Path, files: dict[str, list[Path]] | None = None) -> tuple[dict[str, Counter], list[str]]:
    """Per family: files read / refused / wrong (and torch refuses), plus check counts; and every wrong answer."""
    table: dict[str, Counter] = {}
    wrong: list[str] = []
    for family, paths in (files if files is not None else serialization_cases.build(root / "files")).items():
        counts: Counter = Counter()
        for path in paths:
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    reference = torch.load(path, weights_only=True)
            except Exception:
                counts["torch refuses"] += 1
                continue
            outcomes = []
            for name, check in CHECKS.items():
                work = Path(tempfile.mkdtemp(dir=root))
                try:
                    with warnings.catch_warnings():
                        warnings.simplefilter("ignore")
                        outcome = check(path, reference, work)
                except Wrong as problem:
                    outcome = WRONG
                    wrong.append(f"{family}: {path.name}: {name}: {problem}")
                outcomes.append(outcome)
                counts[f"checks {READ if outcome == NO_DTYPE else outcome}"] += 1
            counts[WRONG if WRONG in outcomes else REFUSED if REFUSED in outcomes else READ] += 1
            counts[NO_DTYPE] += NO_DTYPE in outcomes
        table[family] = counts
    return table, wrong


def markdown(table: dict[str, Counter]) -> str:
    lines = ["| family | files | read | of which safetensors cannot hold | refused | wrong | checks read / refused / wrong |",
             "|---|---|---|---|---|---|---|"]
    total: Counter = Counter()
    for family, counts in table.items():
        total.update(counts)
        files = counts[READ] + counts[REFUSED] + counts[WRONG]
        lines.append(f"| {family} | {files} | {counts[READ]} | {counts[NO_DTYPE]} | {counts[REFUSED]} | {counts[WRONG]} | "
                     f"{counts['checks read']} / {counts['checks refused']} / {counts['checks wrong']} |")
    files = total[READ] + total[REFUSED] + total[WRONG]
    lines.append(f"| **all** | {files} | {total[READ]} | {total[NO_DTYPE]} | {total[REFUSED]} | {total[WRONG]} | "
                 f"{total['checks read']} / {total['checks refused']} / {total['checks wrong']} |")
    return "\n".join(lines)


@pytest.fixture(scope="session")
def suite(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Counter], list[str]]:
    """Every family's files, written once per session, and what each check made of them."""
    root = tmp_path_factory.mktemp("serialization")
    return run_suite(root, serialization_cases.build(root / "files"))


def test_every_serialization_scenario_reads_torchs_values_or_is_refused(suite: tuple) -> None:
    table, wrong = suite
    print("\n" + markdown(table))
    assert not wrong, "\n".join(wrong)


def test_the_families_ckptool_reads_in_full_stay_read(suite: tuple) -> None:
    """A regression to refusing a family ckptool reads fails here (refusals are allowed only where a
    file has no mapping of names to tensors, for the outputs that need one)."""
    table, _ = suite
    for family in ("dtypes", "views", "parameters", "conj/neg bits", "protocols", "legacy", "byte order",
                   "legacy records", "zip variants", "rebuilds", "quantized", "sparse", "nested"):
        assert table[family][REFUSED] == 0 and table[family][READ] > 0, (family, table[family])


def _storage() -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torch.arange(1.0, 3.0)._typed_storage()


_PLAIN = lambda: (_storage(), 0, (2,), (1,), False, OrderedDict())  # noqa: E731
CRAFTED_REBUILDS = {
    "from_type_v2 with too few arguments": lambda: Crafted(torch._tensor._rebuild_from_type_v2, (
        torch._utils._rebuild_tensor_v2, torch.Tensor, (1,), {})),
    "from_type_v2 as Parameter": lambda: Crafted(torch._tensor._rebuild_from_type_v2, (
        torch._utils._rebuild_tensor_v2, torch.nn.Parameter, _PLAIN(), {})),
    "from_type_v2 setting data": lambda: Crafted(torch._tensor._rebuild_from_type_v2, (
        torch._utils._rebuild_tensor_v2, torch.Tensor, _PLAIN(), {"data": torch.zeros(2)})),
    "from_type_v2 with attributes": lambda: Crafted(torch._tensor._rebuild_from_type_v2, (
        torch._utils._rebuild_tensor_v2, torch.Tensor, _PLAIN(), {"tag": 1, "names_": ["a"]})),
    "from_type_v2 calling OrderedDict": lambda: Crafted(torch._tensor._rebuild_from_type_v2, (
        OrderedDict, torch.Tensor, (), {})),
    "from_type_v2 of a parameter": lambda: Crafted(torch._tensor._rebuild_from_type_v2, (
        torch._utils._rebuild_parameter, torch.Tensor, (torch.ones(2), False, OrderedDict()), {"tag": 1})),
    "from_type_v2 nested": lambda: Crafted(torch._tensor._rebuild_from_type_v2, (
        torch._tensor._rebuild_from_type_v2, torch.Tensor,
        (torch._utils._rebuild_tensor_v2, torch.Tensor, _PLAIN(), {"a": 1}), {"b": 2})),
    "device tensor converted": lambda: Crafted(torch._utils._rebuild_device_tensor_from_cpu_tensor, (
        torch.ones(2), torch.float64, "cpu", False)),
    "device tensor to meta": lambda: Crafted(torch._utils._rebuild_device_tensor_from_cpu_tensor, (
        torch.ones(2), torch.float32, "meta", False)),
    "device tensor on cpu": lambda: Crafted(torch._utils._rebuild_device_tensor_from_cpu_tensor, (
        torch.arange(3.0), torch.float32, "cpu", True)),
    "meta tensor with mismatched stride": lambda: Crafted(torch._utils._rebuild_meta_tensor_no_storage, (
        torch.float32, (2,), (1, 2), False)),
}


@pytest.mark.parametrize("name", CRAFTED_REBUILDS)
def test_crafted_rebuild_calls_read_as_torch_or_are_refused(tmp_path: Path, name: str) -> None:
    """Hand-built arguments to the rebuilds ckptool now reads: torch refuses, ckptool refuses, or values equal."""
    path = tmp_path / "crafted.pt"
    torch.save({"w": CRAFTED_REBUILDS[name](), "b": torch.ones(1)}, path)
    outcome = assert_agree(path)
    if name in ("from_type_v2 setting data", "device tensor converted", "device tensor to meta"):
        assert outcome != "equal"  # ckptool never reads these as the plain tensor
    if name in ("from_type_v2 with attributes", "device tensor on cpu"):
        assert outcome == "equal"
        (tmp_path / "work").mkdir()
        assert check_pt(path, torch.load(path, weights_only=True), tmp_path / "work") == READ


@pytest.mark.parametrize("views,expect", [
    ([("v", 8, 4)], "refused"),             # ends past its storage
    ([("root", 0, 4)], "refused"),          # a view named like the storage it slices
    ([("v", 2, 4), ("v", 5, 2)], "equal"),  # one view key twice: torch keeps the first slice
    ([("v", 0, 10), ("w", 9, 1)], "equal"),
], ids=["past the end", "named like its root", "key reused", "whole and last"])
def test_crafted_legacy_storage_views(tmp_path: Path, views: list, expect: str) -> None:
    data = torch.arange(10, dtype=torch.float32).numpy().tobytes()
    root = _Stored(torch.FloatStorage, "root", data, 10)
    stored = [_Stored(torch.FloatStorage, "root", b"", 10, view=view) for view in views]
    obj = {"whole": _rebuild(root, 0, (10,), (1,))}
    obj.update({f"t{i}": _rebuild(view, 0, (1,), (1,)) for i, view in enumerate(stored)})
    path = _legacy_file(tmp_path / "views.pt", obj, [root, *stored])
    outcome = assert_agree(path)
    assert outcome == ("ckptool refuses" if expect == "refused" else expect), outcome


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as folder:
        result, problems = run_suite(Path(folder))
    print(markdown(result))
    print("\n".join(problems))
