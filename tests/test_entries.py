"""safetensors outputs carry the container around the weights (ckptool.entries) and name what they cannot.

Every file is made with torch.save in tmp_path; round trips are compared with torch's own
``torch.load(weights_only=True)`` of the original, and every safetensors output is opened with the
safetensors library.
"""

from __future__ import annotations

import argparse
import collections
import fractions
import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from safetensors import safe_open
from safetensors.torch import save_file

import ckptool
from ckptool.formats import entries
from ckptool.cli.main import main
from ckptool.pickles import OpaqueObject


def invoke(*args: object):
    return CliRunner().invoke(main, [str(a) for a in args])


def convert(source: Path, out: Path, *extra: object) -> dict[str, Any]:
    result = invoke("convert", source, "-o", out, "--json", *extra)
    assert result.exit_code == 0, result.output
    [report] = json.loads(result.stdout)["converted"]
    return report


def same(a: Any, b: Any) -> bool:
    """Deep equality that tells apart what ``==`` confuses: 1 and 1.0 and True, tuple and list,
    dict and OrderedDict (and their attributes), nan (equal to itself here) and -0.0 and 0.0."""
    if type(a) is not type(b):
        return False
    if isinstance(a, float):
        return (math.isnan(a) and math.isnan(b)) or (a == b and math.copysign(1, a) == math.copysign(1, b))
    if isinstance(a, complex):
        return same(a.real, b.real) and same(a.imag, b.imag)
    if isinstance(a, dict):
        attributes = (not isinstance(a, collections.OrderedDict)
                      or same(dict(getattr(a, "__dict__", {})), dict(getattr(b, "__dict__", {}))))
        return list(a) == list(b) and all(same(a[k], b[k]) for k in a) and attributes
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, OpaqueObject):  # ckptool's record of a pickled call: the same call
        return (a.global_name == b.global_name and a._mode == b._mode and same(a.reduce_args(), b.reduce_args())
                and same(a.state, b.state))
    if isinstance(a, type) and issubclass(a, OpaqueObject):
        return a._global == b._global
    if isinstance(a, np.ndarray):
        return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
    return a == b


def without(container: dict, *path: Any) -> dict:
    """``container`` with the weights at ``path`` removed (the entries torch loads besides them)."""
    node = container
    for key in path[:-1]:
        node = node[key]
    del node[path[-1]]
    return container


def linear_weights() -> collections.OrderedDict:
    return torch.nn.Linear(3, 2).state_dict()


def config_checkpoint(path: Path) -> None:
    """A constructor config nested beside the weights, and the values JSON has no word for."""
    torch.save({
        "model": {"state_dict": linear_weights(),
                  "model_args": {"dim": 3, "betas": (0.9, 0.999), "device": torch.device("cuda", 1),
                                 "shape": torch.Size([2, 3]), "dtype": torch.bfloat16, "dropout": 0.0}},
        "epoch": 3,
        "scheduler": {"mode_worse": math.inf, "best": -math.inf, "last_loss": math.nan, "zero": -0.0,
                      "_last_lr": [0.1, 0.01], "last_epoch": 3},
        "by_index": {0: "a", 1: {"x": 1}, (1, 2): "pair", None: 1, 1.5: 2.0, True: [1, 1.0]},
        "ordered": collections.OrderedDict([("b", 1), ("a", (2,))]),
        "counts": collections.Counter(a=2, b=1),
        "raw": b"\x00\xffbytes", "buffer": bytearray(b"xy"), "tags": {3, 1, 2}, "z": 1 + 2j,
        "huge": 10**40, "text": "caf\u00e9 \u202e", "empty": {}, "marker": {"$ckptool": "weights"},
        "nested": [[1, (2, [3.0, None])]],
    }, path)


@pytest.mark.parametrize("sharded", [False, True], ids=["single", "sharded"])
def test_nested_config_and_special_values_round_trip_through_safetensors(tmp_path: Path, sharded: bool) -> None:
    source = tmp_path / "train.pt"
    config_checkpoint(source)
    middle = tmp_path / ("out" if sharded else "out.safetensors")
    report = convert(source, middle, *(["--max-shard-size", "8B"] if sharded else []))
    assert report["notes"] == []  # everything was carried
    shards = sorted(middle.glob("*.safetensors")) if sharded else [middle]
    assert len(shards) == (2 if sharded else 1)
    for index, shard in enumerate(shards):  # a file the safetensors library reads, metadata str -> str
        with safe_open(shard, "pt") as handle:
            metadata = handle.metadata()
            assert sorted(handle.keys())
        assert all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items())
        assert ("ckptool.entries" in metadata) == (index == 0)  # the first shard only
    back = tmp_path / "back.pt"
    report = convert(middle, back)
    assert any("restored the container" in note and "model.state_dict" in note for note in report["notes"])
    original = torch.load(source, weights_only=True)
    restored = torch.load(back, weights_only=True)
    for key, weight in original["model"]["state_dict"].items():
        assert torch.equal(restored["model"]["state_dict"][key], weight)
    assert same(without(original, "model", "state_dict"), without(restored, "model", "state_dict"))


def test_optimizer_state_left_behind_is_named_once(tmp_path: Path) -> None:
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    source = tmp_path / "resume.pt"
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "epoch": 3}, source)
    report = convert(source, tmp_path / "w.safetensors")
    assert report["notes"] == ["optimizer: optimizer state (6 tensors) not carried — safetensors holds weights "
                               "only; keep the .pt for resuming"]
    text = invoke("convert", source, "-o", tmp_path / "w2.safetensors")
    assert text.exit_code == 0 and "optimizer: optimizer state (6 tensors) not carried" in text.output
    convert(tmp_path / "w.safetensors", tmp_path / "back.pt")
    restored = torch.load(tmp_path / "back.pt", weights_only=True)
    assert sorted(restored) == ["epoch", "model"] and restored["epoch"] == 3


def test_optimizer_state_without_tensors_is_carried_with_its_int_keys(tmp_path: Path) -> None:
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)  # no momentum: no state tensors
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    state = optimizer.state_dict()
    state["state"] = {0: {"momentum_buffer": None}, 1: {"momentum_buffer": None}}
    source = tmp_path / "sgd.pt"
    torch.save({"model": model.state_dict(), "optimizer": state}, source)
    assert convert(source, tmp_path / "w.safetensors")["notes"] == []
    convert(tmp_path / "w.safetensors", tmp_path / "back.pt")
    assert same(torch.load(tmp_path / "back.pt", weights_only=True)["optimizer"],
                torch.load(source, weights_only=True)["optimizer"])


def test_what_cannot_be_carried_is_named_by_key_path(tmp_path: Path) -> None:
    weights = linear_weights()
    source = tmp_path / "mixed.pt"
    torch.save({
        "model": weights,
        "ema": {f"layer{i}.weight": torch.ones(2) for i in range(5)},   # a second state_dict: one note
        "running": {"mean": torch.zeros(3), "count": 4},               # one tensor beside a plain value
        "history": [1.0, torch.ones(1)],                               # a list: left out whole
        "cfg": {"when": fractions.Fraction(1, 3), "lr": 0.1},          # an allowed global's object
        "epoch": 7,
    }, source)
    report = convert(source, tmp_path / "w.safetensors", "--allow-global", "fractions.Fraction")
    notes = report["notes"]
    assert len(notes) == 4, notes
    assert any(n.startswith("ema: 5 tensor(s) outside the weights (layer0.weight, layer1.weight, layer2.weight, "
                            "...) not carried") for n in notes), notes
    assert any(n.startswith("running.mean: a tensor (float32 [3]) outside the weights not carried") for n in notes)
    assert any(n.startswith("history: a list whose item 1 is a tensor") for n in notes), notes
    assert any(n.startswith("cfg.when: an object of fractions.Fraction") for n in notes), notes
    convert(tmp_path / "w.safetensors", tmp_path / "back.pt")
    restored = torch.load(tmp_path / "back.pt", weights_only=True)
    assert same(without(restored, "model"), {"running": {"count": 4}, "cfg": {"lr": 0.1}, "epoch": 7})


def test_non_tensor_values_among_the_weights_are_named(tmp_path: Path) -> None:
    weights = dict(linear_weights())
    weights["version"] = 2
    source = tmp_path / "versioned.pt"
    torch.save({"state_dict": weights, "epoch": 1}, source)
    notes = convert(source, tmp_path / "w.safetensors")["notes"]
    assert notes == ["state_dict.version: a non-tensor value (int) among the weights not carried — safetensors stores tensors only"]


def test_numpy_values_and_namespaces_are_carried_as_the_calls_torch_loads(tmp_path: Path) -> None:
    source = tmp_path / "numpy.pt"
    values = {
        "array": np.arange(6, dtype=np.float64).reshape(2, 3),
        "fortran": np.asfortranarray(np.arange(6, dtype=np.int16).reshape(2, 3)),
        "big_endian": np.arange(3, dtype=">u4"),
        "zero_d": np.array(5, dtype=np.int8),
        "bools": np.array([True, False]),
        "scalar": np.float32(1.5),
        "count": np.int64(7),
        "kind": np.dtype("f4"),
        "args": argparse.Namespace(lr=0.1, layers=(3, 4), name="run"),
    }
    torch.save({"model": linear_weights(), **values}, source)
    assert convert(source, tmp_path / "w.safetensors")["notes"] == []
    original = ckptool.load(source).container
    carried = ckptool.load(tmp_path / "w.safetensors")
    assert carried.layout == ("model",)
    for key in values:
        assert same(carried.container[key], original[key]), key
    # what the records hold is numpy's own data: the array's raw bytes, shape and Fortran order
    assert carried.container["array"].state[4] == values["array"].tobytes()
    assert carried.container["fortran"].state[1:4:2] == ((2, 3), True)


def test_large_numpy_arrays_are_left_behind_and_named(tmp_path: Path) -> None:
    source = tmp_path / "big.pt"
    torch.save({"model": linear_weights(), "rng": np.zeros(entries.MAX_ARRAY_BYTES // 8 + 1), "epoch": 1}, source)
    notes = convert(source, tmp_path / "w.safetensors")["notes"]
    assert len(notes) == 1 and notes[0].startswith("rng: a numpy array of") and "keep the .pt" in notes[0]


def test_fingerprint_stays_first_beside_the_entries(tmp_path: Path) -> None:
    source = tmp_path / "train.pt"
    config_checkpoint(source)
    report = convert(source, tmp_path / "w.safetensors", "--fingerprint")
    with safe_open(tmp_path / "w.safetensors", "pt") as handle:
        metadata = handle.metadata()
    assert metadata["ckptool.fingerprint"] == report["fingerprint"]
    assert (tmp_path / "w.safetensors").read_bytes()[8:].startswith(b'{"__metadata__":{"ckptool.fingerprint":')
    assert ckptool.load(tmp_path / "w.safetensors").container["epoch"] == 3


def test_rewriting_safetensors_keeps_the_entries(tmp_path: Path) -> None:
    source = tmp_path / "train.pt"
    config_checkpoint(source)
    convert(source, tmp_path / "a.safetensors")
    convert(tmp_path / "a.safetensors", tmp_path / "b.safetensors")
    first, second = ckptool.load(tmp_path / "a.safetensors"), ckptool.load(tmp_path / "b.safetensors")
    assert second.layout == first.layout == ("model", "state_dict")
    assert same(without(second.container, "model", "state_dict"), without(first.container, "model", "state_dict"))


def test_older_entries_still_read_and_are_named_when_left_behind(tmp_path: Path) -> None:
    # what ckptool wrote before the encoding had a version: top-level JSON entries, no weights place
    old = tmp_path / "old.safetensors"
    save_file(dict(linear_weights()), old, metadata={"format": "pt", "ckptool.entries": '{"epoch":3,"lr":0.1}'})
    assert invoke("inspect", old).exit_code == 0
    checkpoint = ckptool.load(old)
    assert checkpoint.layout == () and set(checkpoint.tensors) == {"weight", "bias"}
    notes = convert(old, tmp_path / "back.pt")["notes"]
    assert any("entries epoch, lr from metadata ckptool.entries not carried" in note for note in notes), notes
    convert(old, tmp_path / "again.safetensors")
    with safe_open(tmp_path / "again.safetensors", "pt") as handle:
        assert handle.metadata()["ckptool.entries"] == '{"epoch":3,"lr":0.1}'


def test_nest_is_refused_for_a_file_carrying_its_container(tmp_path: Path) -> None:
    source = tmp_path / "train.pt"
    config_checkpoint(source)
    convert(source, tmp_path / "w.safetensors")
    result = invoke("convert", tmp_path / "w.safetensors", "-o", tmp_path / "x.pt", "--nest", "model")
    assert result.exit_code == 2 and "--nest" in result.output and "model.state_dict" in result.output
    assert not (tmp_path / "x.pt").exists()


def _deep(levels: int) -> str:
    return '{"$ckptool":"entries","version":1,"container":{"model":{"$ckptool":"weights"},"x":' \
        + "[" * levels + "]" * levels + "}}"


MALFORMED = {
    "not JSON": ("{", "is not JSON"),
    "an array": ("[1]", "is not a JSON object"),
    "a NaN literal": ('{"a": NaN}', "non-JSON number NaN"),
    "no weights": ('{"$ckptool":"entries","version":1,"container":{"epoch":1}}', "marks no place for the weights"),
    "two weights": ('{"$ckptool":"entries","version":1,"container":{"a":{"$ckptool":"weights"},'
                    '"b":{"$ckptool":"weights"}}}', "places the weights twice"),
    "a newer version": ('{"$ckptool":"entries","version":2,"container":{}}', "upgrade ckptool"),
    "an unknown record": ('{"$ckptool":"entries","version":1,"container":{"model":{"$ckptool":"weights"},'
                          '"x":{"$ckptool":"pickle","data":"x"}}}', "unknown type 'pickle'"),
    "a global never carried": ('{"$ckptool":"entries","version":1,"container":{"model":{"$ckptool":"weights"},'
                               '"x":{"$ckptool":"object","global":"os.system","build":"reduce","args":["id"]}}}',
                               "names the global 'os.system'"),
    "deep nesting": (_deep(150), "nests over 100 levels"),
    "colliding keys": ('{"$ckptool":"entries","version":1,"container":{"model":{"$ckptool":"weights"},'
                       '"x":{"$ckptool":"dict","items":[' + ",".join(f"[{i * (2**61 - 1)},0]" for i in range(40))
                       + "]}}}", "keys with one hash"),
    "a list as a key": ('{"$ckptool":"entries","version":1,"container":{"model":{"$ckptool":"weights"},'
                        '"x":{"$ckptool":"set","items":[[1]]}}}', "cannot be one"),
    "bad base64": ('{"$ckptool":"entries","version":1,"container":{"model":{"$ckptool":"weights"},'
                   '"x":{"$ckptool":"bytes","base64":"***"}}}', "not base64"),
    "an OrderedDict hiding its items": ('{"$ckptool":"entries","version":1,"container":{"model":{"$ckptool":'
                                        '"weights"},"x":{"$ckptool":"OrderedDict","items":[],"attrs":{"items":1}}}}',
                                        "hide its contents"),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_entries_are_refused_in_one_line(tmp_path: Path, case: str) -> None:
    text, expected = MALFORMED[case]
    path = tmp_path / "hostile.safetensors"
    save_file(dict(linear_weights()), path, metadata={"ckptool.entries": text})
    for command in (["inspect", path], ["convert", path, "-o", tmp_path / "out.pt"]):
        result = invoke(*command)
        assert result.exit_code == 3, (case, result.output)
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and str(path) in lines[0] and "ckptool.entries" in lines[0], lines
        assert expected in lines[0], lines
    assert not (tmp_path / "out.pt").exists()


def test_entries_over_the_size_limit_are_refused_on_read_and_never_written(tmp_path: Path,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    source = tmp_path / "train.pt"
    torch.save({"model": linear_weights(), "log": ["x" * 100] * 50}, source)
    monkeypatch.setattr(entries, "MAX_ENTRIES_CHARS", 1000)
    notes = convert(source, tmp_path / "w.safetensors")["notes"]
    assert len(notes) == 1 and "over the 1000 limit) not carried" in notes[0]
    with safe_open(tmp_path / "w.safetensors", "pt") as handle:
        assert "ckptool.entries" not in handle.metadata()
    save_file(dict(linear_weights()), tmp_path / "long.safetensors",
              metadata={"ckptool.entries": json.dumps({"log": ["x" * 100] * 50})})
    result = invoke("inspect", tmp_path / "long.safetensors")
    assert result.exit_code == 3 and "over the 1000 limit" in result.stderr


def test_decode_of_encode_is_the_container(tmp_path: Path) -> None:
    source = tmp_path / "train.pt"
    config_checkpoint(source)
    checkpoint = ckptool.load(source)
    text, dropped = entries.encode(checkpoint.container, checkpoint.layout)
    assert text is not None and dropped == []
    decoded = entries.decode(text)
    assert decoded.layout == ("model", "state_dict")
    assert same(without(decoded.container, "model", "state_dict"), without(checkpoint.container, "model", "state_dict"))
