"""Values torch reads that once ended ckptool as an internal error (exit 70): every command reads them or
refuses them in one line.

- An int of more than 4300 digits, anywhere in a container (an entry, a key, a nested config value):
  Python refuses to write it in digits (``ValueError: Exceeds the limit``). ckptool shows it by its size
  (``<int of N bits>``), leaves it out of ``inspect --json``'s values (no JSON reader takes it), leaves it
  out of safetensors metadata (named in a note) and writes it back into a ``.pt`` as pickle wrote it.
- A dict mixing keys of kinds that do not compare (``{1: ..., "x": ...}``): ``max``/``sorted`` raised
  ``TypeError: '>' not supported``; keys are now ordered by a total key (:func:`ckptool.model.tree.order_key`).

Files are real ``torch.save`` output; torch reads each with ``weights_only=False`` (its ``weights_only``
loader takes no LONG4, so not the long ints), and a ``.pt`` rewrite must load as the same values.
"""

from __future__ import annotations

import json
import math
from collections import OrderedDict
from pathlib import Path

from typing import Any

import pytest
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ckptool.base import jsonout
from ckptool.cli.main import main
from ckptool.base.text import int_text, printable, value_repr, value_str
from ckptool.model.tree import order_key

torch = pytest.importorskip("torch")

BIG = 10**5000  # 16,610 bits: past Python's 4300-digit limit on int <-> str
BITS = f"<int of {BIG.bit_length()} bits>"


def run(*args: object):
    return CliRunner().invoke(main, [str(a) for a in args])


def _files(directory: Path) -> dict[str, Path]:
    t = torch.arange(4.0)

    def c() -> torch.Tensor:
        return t.clone()

    made = {
        "entry": {"state_dict": {"w": c()}, "big": BIG, "small": -BIG},
        "key": {"state_dict": {"w": c()}, "cfg": {BIG: 1, "a": 2}},
        "nested": {"state_dict": {"w": c()}, "cfg": {"a": {"b": [1, BIG]}}, "t": (BIG, "x"), "s": {1, "a", BIG}},
        "weights_under_a_big_key": {BIG: {"w": c()}, "x": {"v": c(), "u": c()}},
        "mixed_candidates": {1: {"w": c()}, "x": {"w": c()}, (1, 2): {"w": c()}, None: {"w": c()}},
        "mixed_metadata": _with_metadata(OrderedDict(w=c()), {"": {"version": BIG}, 1: {"v": 2}}),
        "list_top": [c(), {BIG: c()}],
        "optimizer": {"state_dict": {"w": c()},
                      "optimizer": {"state": {0: {"exp_avg": c()}, "a": {"exp_avg": c()}},
                                    "param_groups": [{"params": [0, "a"], "lr": BIG}]}},
    }
    paths = {}
    for name, obj in made.items():
        paths[name] = directory / f"{name}.pt"
        torch.save(obj, paths[name])
    return paths


def _with_metadata(state_dict: OrderedDict, metadata: dict) -> OrderedDict:
    state_dict._metadata = metadata  # type: ignore[attr-defined]
    return state_dict


@pytest.fixture(scope="module")
def odd_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return _files(tmp_path_factory.mktemp("odd"))


COMMANDS = [["inspect"], ["inspect", "--json"], ["inspect", "--tensors"], ["scan"], ["scan", "--json"],
            ["diff", "{in}"], ["diff", "--json", "{in}"], ["convert", "-o", "{out}.pt"],
            ["convert", "-o", "{out}.safetensors"], ["strip", "--prefix", "x.", "-o", "{out}.strip.pt"],
            ["add-prefix", "--prefix", "m.", "-o", "{out}.prefixed.pt"], ["remap", "--to", "cpu", "-o", "{out}.cpu.pt"],
            ["verify"], ["verify", "--json"]]


@pytest.mark.parametrize("command", COMMANDS, ids=lambda args: "-".join(a.strip("-{}") for a in args))
def test_every_command_reads_or_refuses_in_one_line(odd_files: dict[str, Path], tmp_path: Path,
                                                    command: list[str]) -> None:
    for name, path in odd_files.items():
        args = [a.format(**{"in": path, "out": tmp_path / name}) for a in command]
        result = run(args[0], path, *args[1:])
        assert result.exit_code != 70, (name, args, result.stderr)
        if result.exit_code not in (0, 1):  # (strip's "nothing to strip" and verify's findings are 1)
            assert result.exit_code == 3 and len(result.stderr.strip().splitlines()) == 1, (name, args, result.stderr)
        if "--json" in args:
            json.loads(result.stdout)  # strict JSON that Python's own reader takes


def test_a_long_int_is_shown_by_its_size(odd_files: dict[str, Path]) -> None:
    text = run("inspect", odd_files["entry"])
    assert text.exit_code == 0 and BITS in text.stdout and f"<negative int of {BIG.bit_length()} bits>" in text.stdout
    data = json.loads(run("inspect", "--json", odd_files["entry"]).stdout)
    assert data["entries"]["big"]["type"] == "int" and data["entries"]["big"]["summary"] == BITS
    assert "value" not in data["entries"]["big"]  # no JSON reader takes it: a huge value has none
    nested = json.loads(run("inspect", "--json", odd_files["nested"]).stdout)["entries"]
    assert "value" not in nested["cfg"] and "value" not in nested["t"]


def test_weights_under_a_long_int_key_are_found_and_named(odd_files: dict[str, Path]) -> None:
    data = json.loads(run("inspect", "--json", odd_files["weights_under_a_big_key"]).stdout)
    assert data["layout"] == ["x"]  # the most tensors
    assert BITS in [candidate["weights"] for candidate in data["candidates"]]


def test_mixed_keys_choose_the_weights_by_a_total_order(odd_files: dict[str, Path]) -> None:
    # four state dicts of one tensor each: the greatest key under order_key (None ranks after str, int, tuple)
    data = json.loads(run("inspect", "--json", odd_files["mixed_candidates"]).stdout)
    assert data["layout"] == [None]


@pytest.mark.parametrize("name", ["entry", "key", "nested", "mixed_metadata", "optimizer"])
def test_a_pt_rewrite_keeps_long_ints_and_mixed_keys_as_torch_reads_them(odd_files: dict[str, Path], tmp_path: Path,
                                                                         name: str) -> None:
    out = tmp_path / "out.pt"
    result = run("convert", odd_files[name], "-o", out)
    assert result.exit_code == 0, result.stderr
    before, after = torch.load(odd_files[name], weights_only=False), torch.load(out, weights_only=False)
    assert _same(before, after)
    if name == "mixed_metadata":
        assert after._metadata == before._metadata


def test_safetensors_metadata_leaves_a_long_int_out_and_says_so(odd_files: dict[str, Path], tmp_path: Path) -> None:
    result = run("convert", odd_files["entry"], "-o", tmp_path / "out.safetensors", "--json")
    assert result.exit_code == 0, result.stderr
    notes = json.loads(result.stdout)["converted"][0]["notes"]
    assert any(note.startswith("big: an integer of 16610 bits") for note in notes), notes


def _same(a: object, b: object) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return type(a) is type(b) and list(a) == list(b) and all(_same(a[k], b[k]) for k in a)  # type: ignore[index]
    if isinstance(a, list | tuple):
        return type(a) is type(b) and len(a) == len(b) and all(map(_same, a, b))  # type: ignore[arg-type]
    return type(a) is type(b) and a == b


# ------------------------------------------------------------------------------------------- the helpers


def test_order_key_orders_every_kind_of_key() -> None:
    keys = [(1, 2), None, 3, "b", (1,), 2.5, True, (), ((),), (1, "a"), b"x", 1j, BIG, float("nan"), frozenset()]
    ordered = sorted(keys, key=order_key)  # no TypeError
    assert ordered[:1] == ["b"] and ordered.index(None) > ordered.index((1, 2)) > ordered.index((1,))
    assert ordered.index(()) < ordered.index((1,)) < ordered.index(((),))
    deep: tuple = ()
    for _ in range(3000):  # deeper than the recursion limit: keys may nest a thousand tuples
        deep = (deep,)
    assert len(order_key(deep)) == 6002


def test_long_ints_as_text_and_json() -> None:
    assert int_text(-12) == "-12" and int_text(BIG) == BITS and int_text(-BIG).startswith("<negative int of")
    assert value_repr({"lr": BIG, (BIG, "a"): [BIG]}) == f"{{'lr': {BITS}, ({BITS}, 'a'): [{BITS}]}}"
    assert value_str((BIG, 1)) == f"({BITS}, 1)" and value_str(7) == "7"
    assert printable(BIG) == BITS and printable(("\x1b", BIG)) == f"('\\x1b', {BITS})"
    document = json.loads(jsonout.dumps({"n": BIG, "m": 10**4299, "keys": {BIG: 1, 2: 3}, "f": math.inf}))
    assert document == {"n": BITS, "m": 10**4299, "keys": {BITS: 1, "2": 3}, "f": "inf"}


def test_an_optimizer_state_keyed_by_a_long_int_converts_without_its_tree(tmp_path: Path) -> None:
    # the weights are the optimizer's state: its tree cannot go along (a key past 4300 digits), its tensors do
    source, out = tmp_path / "optimizer.pt", tmp_path / "optimizer.safetensors"
    torch.save({"optimizer": {"state": {BIG: {"exp_avg": torch.ones(2)}, 1: {"exp_avg": torch.zeros(3)}},
                              "param_groups": [{"params": [BIG, 1]}]}}, source)
    result = run("convert", source, "--weights", "optimizer", "-o", out, "--json")
    assert result.exit_code == 0, result.stderr
    assert any("structure around the tensors not carried" in note
               for note in json.loads(result.stdout)["converted"][0]["notes"])
    listed = json.loads(run("inspect", out, "--json", "--tensors").stdout)["tensor_list"]
    assert sorted(tensor["name"] for tensor in listed) == ["state.1.exp_avg", f"state.{BITS}.exp_avg"]


class _Long:
    """Where a long int goes: hypothesis writes what it draws with repr, which an int past 4300 digits has not."""

    def __init__(self, sign: int) -> None:
        self.sign = sign

    def __repr__(self) -> str:
        return "-BIG" if self.sign < 0 else "BIG"

    def __hash__(self) -> int:
        return self.sign

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Long) and other.sign == self.sign


def _with_long_ints(value: Any) -> Any:
    """``value`` with each :class:`_Long` (in a key too) made the int it stands for."""
    if isinstance(value, _Long):
        return value.sign * BIG
    if isinstance(value, dict):
        return type(value)((_with_long_ints(k), _with_long_ints(v)) for k, v in value.items())
    if isinstance(value, list | tuple):
        return type(value)(map(_with_long_ints, value))
    return value


LONG = st.sampled_from([_Long(1), _Long(-1)])
KEYS = st.one_of(st.sampled_from(["state_dict", "model", "a", "x.y", "", "module.w"]), st.integers(-3, 3), LONG,
                 st.none(), st.floats(allow_nan=False, allow_infinity=False),
                 st.tuples(st.integers(0, 2), st.one_of(st.just("a"), LONG)))


@st.composite
def odd_containers(draw: Any) -> Any:
    """A container of weights beside values and keys of every kind, long ints and mixed keys anywhere."""
    t = torch.arange(4.0)
    leaves = st.one_of(st.integers(1, 4).map(lambda n: t[:n].clone()), LONG, st.integers(), st.text(max_size=4),
                       st.none(), st.floats(allow_nan=False))
    tree = st.recursive(leaves, lambda kids: st.one_of(
        st.lists(kids, max_size=3), st.tuples(kids, kids), st.dictionaries(KEYS, kids, max_size=4),
        st.builds(OrderedDict, st.dictionaries(st.text(max_size=3), kids, max_size=3))), max_leaves=10)
    container = draw(st.dictionaries(KEYS, tree, max_size=4))
    weights = {f"layer.{i}": torch.full((2,), float(i)) for i in range(draw(st.integers(0, 3)))}
    if weights:
        container[draw(KEYS)] = weights
    return container


@settings(max_examples=25, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(odd_containers())
def test_drawn_containers_are_read_or_refused_in_one_line(tmp_path: Path, container: Any) -> None:
    path = tmp_path / "drawn.pt"
    torch.save(_with_long_ints(container), path)
    for args in (["inspect"], ["inspect", "--json", "--tensors"], ["scan"], ["diff", path],
                 ["convert", "-o", tmp_path / "out.pt", "--force"], ["convert", "-o", tmp_path / "out.safetensors", "--force"],
                 ["verify", "--json"]):
        result = run(args[0], path, *args[1:])
        assert result.exit_code != 70, (args, result.stderr)
        if result.exit_code not in (0, 1):
            assert result.exit_code == 3 and len(result.stderr.strip().splitlines()) == 1, (args, result.stderr)
