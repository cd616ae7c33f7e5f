"""Big models at a glance: ``inspect --tensors`` groups repeated blocks, and the weights are summed by
module (``ckptool.ops.tensor_groups``; the renderer in ``ckptool.cli.render``).

Every grouping test checks the rows against the one promise they make (:func:`assert_exact`): a row's
pattern, expanded, names exactly its members, all of one dtype and shape, and the rows together hold
every record once."""

from __future__ import annotations

import itertools
import json
import random
import re
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

import ckptool
from ckptool.base import jsonout
from ckptool.cli.main import main
from ckptool.ops.inspect import TensorInfo, WeightInfo, tensor_totals
from ckptool.ops.tensor_groups import (
    TensorGroup,
    component_totals,
    group_tensors,
    index_set,
    module_of,
    module_totals,
)


@dataclass
class Record:
    name: str
    dtype: str = "F32"
    shape: tuple[int, ...] = (4,)
    bytes: int = 16
    device: str = "cpu"


def records(names: list[str], **fields: object) -> list[Record]:
    return [Record(name, **fields) for name in names]  # type: ignore[arg-type]


def expand(group: TensorGroup) -> set[str]:
    """Every name a row's pattern claims, from its index sets."""
    if not group.indices:
        return {group.pattern}
    template = re.sub(r"\{[0-9.,]+\}", "{}", group.pattern)
    varying = [values for values in group.indices if len(values) > 1]
    assert template.count("{}") == len(varying), group.pattern
    return {template.format(*combination) for combination in itertools.product(*varying)}


def assert_exact(rows: list[TensorGroup], given: list[Record]) -> None:
    members = sorted(member for row in rows for member in row.members)
    assert members == list(range(len(given)))  # every record, once
    for row in rows:
        chosen = [given[m] for m in row.members]
        assert row.count == len(chosen)
        assert {record.name for record in chosen} == expand(row), row.pattern
        assert {(record.dtype, tuple(record.shape)) for record in chosen} == {(row.dtype, row.shape)}, row.pattern
        assert row.bytes == sum(record.bytes for record in chosen)
        assert row.first == chosen[0].name
    firsts = [row.members[0] for row in rows]
    assert firsts == sorted(firsts)  # first met first


def grouped(given: list[Record]) -> list[TensorGroup]:
    rows = group_tensors(given)
    assert_exact(rows, given)
    return rows


# ------------------------------------------------------------------------------------------------ grouping


def test_index_set_writes_runs_gaps_and_pairs() -> None:
    assert index_set(range(32)) == "0..31"
    assert index_set([9, 0, 1, 2, 3, 5, 7, 8]) == "0..3,5,7..9"
    assert index_set([5, 6]) == "5,6"
    assert index_set([4]) == "4"
    assert index_set([1, 3, 3, 1]) == "1,3"


def test_a_repeated_layer_is_one_row_per_tensor() -> None:
    names = [f"model.layers.{layer}.self_attn.{proj}.weight" for layer in range(32) for proj in ("q_proj", "k_proj")]
    given = [Record("model.embed_tokens.weight", "BF16", (100, 8), 1600)]
    given += records(names, dtype="BF16", shape=(8, 8), bytes=128)
    given += [Record("model.norm.weight"), Record("lm_head.weight", "BF16", (100, 8), 1600)]
    rows = grouped(given)
    assert [(row.pattern, row.count) for row in rows] == [
        ("model.embed_tokens.weight", 1),
        ("model.layers.{0..31}.self_attn.q_proj.weight", 32),
        ("model.layers.{0..31}.self_attn.k_proj.weight", 32),
        ("model.norm.weight", 1),
        ("lm_head.weight", 1),
    ]
    assert rows[1].bytes == 32 * 128 and rows[1].shape == (8, 8) and rows[1].indices == (tuple(range(32)),)
    assert rows[0].indices == ()


def test_gaps_in_the_indices_are_written_as_a_range_set() -> None:
    rows = grouped(records([f"blocks.{i}.w" for i in (0, 1, 2, 3, 5, 7, 8, 9)]))
    assert [row.pattern for row in rows] == ["blocks.{0..3,5,7..9}.w"]


def test_nested_indices_each_get_their_braces() -> None:
    names = [f"model.layers.{layer}.mlp.experts.{e}.w1.weight" for layer in range(32) for e in range(64)]
    rows = grouped(records(names))
    assert [(row.pattern, row.count) for row in rows] == [("model.layers.{0..31}.mlp.experts.{0..63}.w1.weight", 2048)]


def test_indices_that_do_not_fill_every_combination_are_split_until_exact() -> None:
    # layer 0 has 4 experts, layers 1-2 have 2, layer 3 has 4 again: no row may claim layer 1's expert 3
    names = [f"layers.{layer}.experts.{e}.w" for layer, count in enumerate((4, 2, 2, 4)) for e in range(count)]
    rows = grouped(records(names))
    assert sorted((row.pattern, row.count) for row in rows) == [
        ("layers.{0,3}.experts.{0..3}.w", 8),
        ("layers.{1,2}.experts.{0,1}.w", 4),
    ]


def test_a_last_layer_cut_short_is_a_row_of_its_own() -> None:
    names = [f"layers.{layer}.experts.{e}.w" for layer in range(8) for e in range(16)][:-5]
    rows = grouped(records(names))
    assert [row.pattern for row in rows] == ["layers.{0..6}.experts.{0..15}.w", "layers.7.experts.{0..10}.w"]
    assert rows[1].indices == ((7,), tuple(range(11)))


def test_random_subsets_of_an_index_grid_group_exactly() -> None:
    generator = random.Random(38)
    for _ in range(30):
        grid = [(a, b, c) for a in range(5) for b in range(4) for c in range(3) if generator.random() < 0.7]
        given = [
            Record(f"m.{a}.x.{b}.y.{c}.w", generator.choice(["F32", "BF16"]), (generator.choice([2, 3]),))
            for a, b, c in grid
        ]
        grouped(given)


def test_different_shapes_or_dtypes_under_one_name_split_into_exact_rows() -> None:
    given = [Record(f"stages.{i}.conv.weight", "F32", (64 if i < 2 else 128, 3)) for i in range(4)]
    given += [Record(f"stages.{i}.norm.weight", "F16" if i % 2 else "F32") for i in range(4)]
    rows = grouped(given)
    assert [(row.pattern, row.shape, row.dtype) for row in rows] == [
        ("stages.{0,1}.conv.weight", (64, 3), "F32"),
        ("stages.{2,3}.conv.weight", (128, 3), "F32"),
        ("stages.{0,2}.norm.weight", (4,), "F32"),
        ("stages.{1,3}.norm.weight", (4,), "F16"),
    ]


def test_only_whole_integer_components_are_indices() -> None:
    names = [
        "0.weight",
        "1.weight",
        "blocks.07.w",
        "blocks.7.w",
        "w1.a",
        "w2.a",
        "layer_1.b",
        "layer_2.b",
        "x.1e5",
        "x.2e5",
        "end.3",
        "end.4",
        "neg.-1.w",
        "neg.-2.w",
        "u.\u0661.w",
        "u.\u0662.w",
    ]
    rows = grouped(records(names))
    assert [row.pattern for row in rows] == [
        "{0,1}.weight",
        "blocks.07.w",
        "blocks.7.w",
        "w1.a",
        "w2.a",
        "layer_1.b",
        "layer_2.b",
        "x.1e5",
        "x.2e5",
        "end.{3,4}",
        "neg.-1.w",
        "neg.-2.w",
        "u.\u0661.w",
        "u.\u0662.w",
    ]


def test_names_holding_a_newline_or_nul_are_rows_of_their_own() -> None:
    names = ["a.0.w", "a.\x00.w", "a.1.w", "b.0.w\n", "b.1.w\n", "a.2.w"]
    rows = grouped(records(names))
    assert [(row.pattern, row.count) for row in rows] == [
        ("a.{0..2}.w", 3),
        ("a.\x00.w", 1),
        ("b.0.w\n", 1),
        ("b.1.w\n", 1),
    ]


def test_the_same_name_twice_is_one_row_counting_both() -> None:
    rows = group_tensors(records(["a.0", "a.0", "a.1", "b", "b"]))
    assert [(row.pattern, row.count) for row in rows] == [("a.{0,1}", 3), ("b", 2)]


def test_layouts_and_meta_tensors_are_never_grouped_with_plain_ones() -> None:
    given = [
        WeightInfo("e.0.w", "strided", "F32", [2, 3], 24, "cpu"),
        WeightInfo("e.1.w", "sparse_coo", "F32", [2, 3], 40, "cpu", parts=[]),
        WeightInfo("e.2.w", "strided", "F32", [2, 3], 0, "meta"),
        WeightInfo("e.3.w", "strided", "F32", [2, 3], 24, "cuda:1"),
        WeightInfo("q.0", "quantized", "QINT8", [4], 4, "cpu", qscheme="per_tensor_affine"),
        WeightInfo("q.1", "quantized", "QINT8", [4], 4, "cpu", qscheme="per_channel_affine"),
    ]
    rows = group_tensors(given)
    assert [(row.pattern, row.layout, row.device, row.qscheme) for row in rows] == [
        ("e.{0,3}.w", "strided", "", None),
        ("e.1.w", "sparse_coo", "cpu", None),
        ("e.2.w", "strided", "meta", None),
        ("q.0", "quantized", "cpu", "per_tensor_affine"),
        ("q.1", "quantized", "cpu", "per_channel_affine"),
    ]


def test_a_hundred_thousand_tensors_make_a_screenful_of_rows() -> None:
    # the bench's MoE-like state dict: per layer norms, a router, a counter and 64 experts of 3 projections
    given: list[TensorInfo] = []
    layer = 0
    while len(given) < 100_000:
        pre = f"module.model.layers.{layer}"
        given += [
            TensorInfo(f"{pre}.input_layernorm.weight", "F32", [16], 64, "cpu"),
            TensorInfo(f"{pre}.mlp.gate.weight", "BF16", [16, 8], 256, "cpu"),
            TensorInfo(f"{pre}.mlp.tokens_seen", "I64", [], 8, "cpu"),
        ]
        for expert in range(64):
            for proj, dtype in (("gate_proj", "F32"), ("up_proj", "BF16"), ("down_proj", "F16")):
                given.append(TensorInfo(f"{pre}.mlp.experts.{expert}.{proj}.weight", dtype, [8, 8], 128, "cpu"))
        layer += 1
    given = given[:100_000]
    rows = group_tensors(given)
    assert_exact(rows, given)  # type: ignore[arg-type]
    # 195 tensors a layer: 512 whole layers, then 160 tensors of the 513th (52 experts and a gate_proj)
    assert len(rows) == 9  # three per layer, three per expert, three for the last layer's experts
    assert rows[3].pattern == "module.model.layers.{0..511}.mlp.experts.{0..63}.gate_proj.weight"
    last = "module.model.layers.512.mlp.experts"
    assert [(row.pattern, row.count) for row in rows[-3:]] == [
        (f"{last}.{{0..52}}.gate_proj.weight", 53),
        (f"{last}.{{0..51}}.up_proj.weight", 52),
        (f"{last}.{{0..51}}.down_proj.weight", 52),
    ]


# ------------------------------------------------------------------------------------------------ modules


def test_module_of_takes_the_first_component_after_the_prefix_and_the_component() -> None:
    assert module_of("model.layers.0.w") == (None, "model")
    assert module_of("module.model.layers.0.w", "module.") == (None, "model")
    assert module_of("module._orig_mod.lm_head.weight", "module._orig_mod.") == (None, "lm_head")
    assert module_of("pos_embed") == (None, "pos_embed")
    assert module_of("unet/conv_in.weight") == ("unet", "conv_in")
    assert module_of("text_encoder/module.embed.weight", "module.") == ("text_encoder", "embed")


def test_module_totals_sum_in_first_met_order_under_the_wrapper_prefix() -> None:
    names = ["module.model.embed.weight", "module.model.layers.0.w", "module.lm_head.weight", "module.model.norm.w"]
    totals = module_totals(names, [10, 20, 30, 1], [40, 80, 120, 4], prefix="module.")
    assert [(m.name, m.tensors, m.parameters, m.bytes) for m in totals] == [
        ("model", 3, 31, 124),
        ("lm_head", 1, 30, 120),
    ]
    assert [m.to_json() for m in totals][1] == {"name": "lm_head", "tensors": 1, "parameters": 30, "bytes": 120}
    # a prefix not every key carries (a mixed file) is taken off where it is
    totals = module_totals(["module.a.w", "b.w"], [1, 2], [4, 8], prefix="module.")
    assert [m.name for m in totals] == ["a", "b"]
    assert component_totals(totals) == []


def test_component_keys_are_summed_by_component_then_module() -> None:
    names = ["unet/conv_in.weight", "unet/down_blocks.0.w", "vae/encoder.w", "unet/down_blocks.1.w", "vae/decoder.w"]
    totals = module_totals(names, [1, 2, 3, 4, 5], [2, 4, 6, 8, 10])
    assert [(m.component, m.name, m.tensors, m.parameters) for m in totals] == [
        ("unet", "conv_in", 1, 1),
        ("unet", "down_blocks", 2, 6),
        ("vae", "encoder", 1, 3),
        ("vae", "decoder", 1, 5),
    ]
    assert totals[0].to_json() == {"name": "conv_in", "tensors": 1, "parameters": 1, "bytes": 2, "component": "unet"}
    assert [(c.name, c.tensors, c.parameters, c.bytes) for c in component_totals(totals)] == [
        ("unet", 3, 7, 14),
        ("vae", 2, 8, 16),
    ]
    # a "/" in only some keys is part of those keys' names, not a component
    assert [m.component for m in module_totals(["a/b.w", "c.w"], [1, 1], [1, 1])] == [None, None]


def test_tensor_totals_name_keys_that_are_not_strings_and_sparse_parts_by_their_key(tmp_path: Path) -> None:
    path = tmp_path / "parts.pt"
    indices = torch.tensor([[0, 1], [1, 0]])
    torch.save(
        {
            "emb": torch.sparse_coo_tensor(indices, torch.tensor([1.0, 2.0]), (2, 2)),
            "fc.weight": torch.zeros(3, 2),
            "fc.bias": torch.zeros(3),
        },
        path,
    )
    checkpoint = ckptool.load(path)
    assert any("[" in name for name in checkpoint.tensors)  # the sparse tensor's parts, named "emb[...]"
    totals = tensor_totals(checkpoint.tensors, "")
    assert [(m.name, m.tensors) for m in totals] == [("fc", 2), ("emb", 2)]  # (the parts come last)
    assert sum(m.parameters for m in totals) == ckptool.inspect(path).parameters
    views = list(checkpoint.tensors.values())
    totals = tensor_totals({0: views[0], (2, "x"): views[1], "fc.weight": views[2]}, "")
    assert [m.name for m in totals] == ["0", "(2, 'x')", "fc"]
    assert group_tensors([TensorInfo(str(key), "F32", [1], 4, "cpu") for key in (0, 1, (2, "x"))])[0].pattern == "{0,1}"


# ------------------------------------------------------------------------------------------------ the CLI


def run(*args: object) -> tuple[int, str]:
    result = CliRunner().invoke(main, [str(arg) for arg in args])
    return result.exit_code, result.stdout


@pytest.fixture
def llama(tmp_path: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    """A tiny Llama-like state dict of 8 layers, saved with torch."""
    hidden, vocab, inner = 16, 64, 32
    state = {"model.embed_tokens.weight": torch.zeros(vocab, hidden, dtype=torch.bfloat16)}
    for layer in range(8):
        pre = f"model.layers.{layer}"
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            state[f"{pre}.self_attn.{proj}.weight"] = torch.zeros(hidden, hidden, dtype=torch.bfloat16)
        for proj, shape in (
            ("gate_proj", (inner, hidden)),
            ("up_proj", (inner, hidden)),
            ("down_proj", (hidden, inner)),
        ):
            state[f"{pre}.mlp.{proj}.weight"] = torch.zeros(*shape, dtype=torch.bfloat16)
        state[f"{pre}.input_layernorm.weight"] = torch.ones(hidden)
        state[f"{pre}.post_attention_layernorm.weight"] = torch.ones(hidden)
    state["model.norm.weight"] = torch.ones(hidden)
    state["lm_head.weight"] = torch.zeros(vocab, hidden, dtype=torch.bfloat16)
    path = tmp_path / "llama.pt"
    torch.save(state, path)
    return path, state


def test_inspect_tensors_prints_one_row_per_repeated_tensor(llama: tuple[Path, dict[str, torch.Tensor]]) -> None:
    path, state = llama
    code, out = run("inspect", path, "--tensors")
    assert code == 0
    rows = out[: out.index("  (75 keys")].split("\n\n")[-1]  # the listing: after the header's blank line
    listing = [line.split() for line in rows.splitlines()]
    assert len(listing) == 1 + 9 + 2  # the embedding, nine tensors per layer, the norm and the head
    assert listing[1] == ["model.layers.{0..7}.self_attn.q_proj.weight", "×8", "BF16", "[16,", "16]", "4.1", "KB"]
    assert listing[5] == ["model.layers.{0..7}.mlp.gate_proj.weight", "×8", "BF16", "[32,", "16]", "8.2", "KB"]
    assert [row[1] for row in listing[1:10]] == ["×8"] * 9
    assert listing[0][:3] == ["model.embed_tokens.weight", "BF16", "[64,"]
    assert len(state) == 75 and "(75 keys in 12 rows; --all lists every key)" in out
    table = out[out.index("  module ") :].splitlines()
    parameters = sum(tensor.numel() for tensor in state.values())
    head = 64 * 16
    assert table[0].split() == ["module", "tensors", "parameters", "size"]
    assert table[1].split()[:3] == ["model", str(len(state) - 1), f"{parameters - head:,}"]
    assert table[2].split()[:3] == ["lm_head", "1", f"{head:,}"]


def test_inspect_all_lists_every_key(llama: tuple[Path, dict[str, torch.Tensor]]) -> None:
    path, state = llama
    for args in (["--tensors", "--all"], ["--all"]):
        code, out = run("inspect", path, *args)
        assert code == 0
        listed = [line.split()[0] for line in out.splitlines()[1:] if line.split() and line.split()[0] in state]
        assert listed == list(state)
        assert "×" not in out and "--all lists" not in out


def test_plain_inspect_shows_parameters_per_module(llama: tuple[Path, dict[str, torch.Tensor]]) -> None:
    path, state = llama
    code, out = run("inspect", path)
    assert code == 0
    lines = out.splitlines()
    start = next(n for n, line in enumerate(lines) if line.startswith("  modules "))
    assert lines[start].split()[1:4] == ["model", f"{len(state) - 1}", "tensors"]
    assert lines[start + 1].split()[:5] == ["lm_head", "1", "tensor", "1,024", "parameters"]
    assert lines[start + 2].startswith("  saved devices")
    assert "{0..7}" not in out  # the listing is --tensors'


def test_plain_inspect_sums_modules_past_twelve(tmp_path: Path) -> None:
    path = tmp_path / "flat.pt"
    torch.save({f"head{n}.weight": torch.zeros(n + 1) for n in range(15)}, path)
    code, out = run("inspect", path)
    assert code == 0
    lines = [line for line in out.splitlines() if line.startswith("  modules") or line.startswith(" " * 17)]
    assert len(lines) == 12 and lines[0].split()[1] == "head0"
    assert lines[-1].split()[:6] == ["...", "4", "more", "4", "tensors", f"{12 + 13 + 14 + 15}"]


def test_one_module_prints_no_module_block(tmp_path: Path) -> None:
    path = tmp_path / "one.pt"
    torch.save({"model.a.weight": torch.zeros(2), "model.b.weight": torch.zeros(2)}, path)
    code, out = run("inspect", path)
    assert code == 0 and "modules" not in out


def test_inspect_json_keeps_every_key_and_adds_the_modules(llama: tuple[Path, dict[str, torch.Tensor]]) -> None:
    jsonschema = pytest.importorskip("jsonschema")
    path, state = llama
    code, out = run("inspect", path, "--json", "--tensors")
    assert code == 0
    document = json.loads(out)
    jsonschema.validate(document, jsonout.schema("inspect"), cls=jsonschema.Draft202012Validator)
    assert [entry["name"] for entry in document["state_dict"]] == list(state)
    assert [entry["name"] for entry in document["tensor_list"]] == list(state)
    parameters = sum(tensor.numel() for tensor in state.values())
    assert document["modules"] == [
        {
            "name": "model",
            "tensors": len(state) - 1,
            "parameters": parameters - 1024,
            "bytes": sum(t.numel() * t.element_size() for k, t in state.items() if k != "lm_head.weight"),
        },
        {"name": "lm_head", "tensors": 1, "parameters": 1024, "bytes": 2048},
    ]
    assert document["components"] == []
    code, out = run("inspect", path, "--json")
    plain = json.loads(out)
    jsonschema.validate(plain, jsonout.schema("inspect"), cls=jsonschema.Draft202012Validator)
    assert plain["modules"] == document["modules"] and "state_dict" not in plain


def test_a_ddp_file_is_summed_under_its_wrapper(tmp_path: Path) -> None:
    path = tmp_path / "ddp.pt"
    torch.save(
        {
            "module.backbone.conv.weight": torch.zeros(4, 3),
            "module.backbone.conv.bias": torch.zeros(4),
            "module.head.weight": torch.zeros(2, 4),
        },
        path,
    )
    summary = ckptool.inspect(path)
    assert summary.prefix == "module."
    assert [(m.name, m.tensors, m.parameters) for m in summary.modules] == [("backbone", 2, 16), ("head", 1, 8)]


def test_component_keys_are_shown_by_component(tmp_path: Path) -> None:
    jsonschema = pytest.importorskip("jsonschema")
    path = tmp_path / "pipeline.pt"
    state = {"unet/conv_in.weight": torch.zeros(4, 3)}
    state |= {f"unet/down_blocks.{n}.conv.weight": torch.zeros(4, 4) for n in range(3)}
    state |= {"vae/encoder.conv.weight": torch.zeros(2, 2), "vae/decoder.conv.weight": torch.zeros(2, 3)}
    state |= {"text_encoder/embed.weight": torch.zeros(10, 4)}
    torch.save(state, path)
    code, out = run("inspect", path)
    assert code == 0
    lines = [line for line in out.splitlines() if line.startswith("  components") or line.startswith(" " * 17)]
    block = [line[17:].split() for line in lines]
    assert [(row[0], row[1], row[3]) for row in block] == [
        ("unet", "4", "60"),
        ("vae", "2", "10"),
        ("text_encoder", "1", "40"),
    ]
    code, out = run("inspect", path, "--tensors")
    assert code == 0
    assert "  unet/down_blocks.{0..2}.conv.weight  ×3" in out
    table = [line.split()[:3] for line in out[out.index("  module ") :].splitlines()[1:]]
    assert table == [
        ["unet/", "4", "60"], ["conv_in", "1", "12"], ["down_blocks", "3", "48"],
        ["vae/", "2", "10"], ["encoder", "1", "4"], ["decoder", "1", "6"],
        ["text_encoder/", "1", "40"], ["embed", "1", "40"],
    ]  # fmt: skip
    code, out = run("inspect", path, "--json")
    document = json.loads(out)
    jsonschema.validate(document, jsonout.schema("inspect"), cls=jsonschema.Draft202012Validator)
    assert document["components"][0] == {"name": "unet", "tensors": 4, "parameters": 60, "bytes": 240}
    assert document["modules"][1] == {
        "name": "down_blocks", "tensors": 3, "parameters": 48, "bytes": 192, "component": "unet"
    }  # fmt: skip
