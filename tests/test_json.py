"""--json is a contract: every document names its schema, validates against the JSON Schema shipped in the
package, is strict JSON, and a failure is an error document on stdout with the command's exit code."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner

from ckptool.base import jsonout
from ckptool.cli.main import main

jsonschema = pytest.importorskip("jsonschema", reason="jsonschema is in the test extra: pip install -e '.[test]'")

KINDS = ["inspect", "scan", "write", "convert", "verify", "diff", "error"]


def _strict(text: str) -> Any:
    def refuse(constant: str) -> None:
        raise AssertionError(f"not strict JSON: {constant}")

    assert text.isascii()
    return json.loads(text, parse_constant=refuse)


def run_json(*args: Any) -> tuple[int, dict[str, Any], str]:
    """Run a command with --json; its stdout must be one strict JSON document valid for the kind it names."""
    result = CliRunner().invoke(main, [str(a) for a in args] + ["--json"])
    data = _strict(result.stdout)
    kind = data["schema"].removeprefix("ckptool.").removesuffix("/1")
    assert kind in KINDS, data["schema"]
    jsonschema.validate(data, jsonout.schema(kind), cls=jsonschema.Draft202012Validator)
    return result.exit_code, data, result.stderr


@pytest.mark.parametrize("kind", KINDS)
def test_shipped_schemas_are_valid_json_schema(kind: str) -> None:
    schema = jsonout.schema(kind)
    jsonschema.Draft202012Validator.check_schema(schema)
    assert schema["properties"]["schema"] == {"const": f"ckptool.{kind}/{jsonout.VERSION}"}


def test_every_command_writes_its_schema(fixtures_dir: Path, tmp_path: Path) -> None:
    documents = {
        ("inspect", fixtures_dir / "lightning_mlp.ckpt", "--tensors", "--fingerprint"): "ckptool.inspect/1",
        ("inspect", fixtures_dir / "mlp.safetensors"): "ckptool.inspect/1",
        ("inspect", fixtures_dir / "sharded"): "ckptool.inspect/1",
        ("inspect", fixtures_dir / "tied_lm.pt"): "ckptool.inspect/1",
        ("scan", fixtures_dir / "single_lenet.pt"): "ckptool.scan/1",
        ("strip", fixtures_dir / "ddp_lenet_wrapped.pt", "-o", tmp_path / "s.pt"): "ckptool.write/1",
        ("add-prefix", fixtures_dir / "single_lenet.pt", "-o", tmp_path / "a.pt"): "ckptool.write/1",
        ("remap", fixtures_dir / "gpu_cuda1_ddp_lenet.pt", "-o", tmp_path / "r.pt", "--to", "cpu"): "ckptool.write/1",
        ("convert", fixtures_dir / "tied_lm.pt", "-o", tmp_path / "t.safetensors"): "ckptool.convert/1",
        ("convert", fixtures_dir / "single_lenet.pt", fixtures_dir / "mlp.safetensors", "--out-dir", tmp_path,
         "--to", "pt"): "ckptool.convert/1",
        ("verify", fixtures_dir / "single_lenet.pt"): "ckptool.verify/1",
        ("verify", fixtures_dir / "single_lenet.pt", "--model", "training:lenet", "--against",
         fixtures_dir / "ddp_lenet_wrapped.pt"): "ckptool.verify/1",
        ("diff", fixtures_dir / "single_lenet.pt", fixtures_dir / "ddp_lenet_wrapped.pt"): "ckptool.diff/1",
    }
    for args, schema in documents.items():
        code, data, stderr = run_json(*args)
        assert data["schema"] == schema, (args, stderr)
        assert code in (0, 1), (args, stderr)
    code, data, _ = run_json("convert", fixtures_dir / "single_lenet.pt", "-o", tmp_path / "one.safetensors")
    assert code == 0 and data["failed"] == [] and data["converted"][0]["output"] == str(tmp_path / "one.safetensors")


def test_a_failure_is_an_error_document_with_the_exit_code(fixtures_dir: Path, tmp_path: Path) -> None:
    evil = tmp_path / "evil.pkl"
    evil.write_bytes(b"cposix\nsystem\n(S'true'\ntR.")
    exists = tmp_path / "exists.pt"
    exists.write_bytes(b"x")
    stripped = tmp_path / "stripped.pt"
    shutil.copy(fixtures_dir / "single_lenet.pt", stripped)
    cases = {
        ("inspect", tmp_path / "missing.pt"): ("input", 3, tmp_path / "missing.pt"),
        ("inspect", evil): ("unsafe", 3, evil),
        ("strip", fixtures_dir / "ddp_lenet_wrapped.pt", "-o", exists): ("output", 3, exists),
        ("strip", stripped, "-o", tmp_path / "again.pt"): ("nothing_to_do", 1, None),
        ("remap", fixtures_dir / "gpu_cuda0_lenet.pt", "-o", tmp_path / "x.pt"): ("usage", 2, None),
        ("inspect", fixtures_dir / "single_lenet.pt", "--no-such-option"): ("usage", 2, None),
    }
    for args, (type_, code, path) in cases.items():
        exit_code, data, stderr = run_json(*args)
        error = data["error"]
        assert data["schema"] == "ckptool.error/1" and exit_code == code == error["exit_code"], (args, stderr)
        assert error["type"] == type_, (args, error)
        if path is not None:
            assert error["path"] == str(path)
        assert error["message"] and "\n" not in error["message"]
        if type_ != "usage" or args[-1] != "--no-such-option":  # a library error also keeps its stderr line
            assert stderr.startswith("ckptool: error: ") and stderr.count("\n") == 1, stderr
    _, data, _ = run_json("scan", evil)
    assert data["verdict"] == "dangerous"
    _, data, _ = run_json("inspect", evil)
    assert data["error"]["globals"] == ["posix.system"]
    assert not (tmp_path / "again.pt").exists() and not (tmp_path / "x.pt").exists()


def test_convert_failures_are_error_objects(fixtures_dir: Path, tmp_path: Path) -> None:
    code, data, _ = run_json("convert", fixtures_dir / "single_lenet.pt", tmp_path / "gone.pt", "--out-dir", tmp_path)
    assert code == 3 and len(data["converted"]) == 1
    [failure] = data["failed"]
    assert failure["type"] == "input" and failure["path"] == str(tmp_path / "gone.pt") and failure["exit_code"] == 3


def test_inspect_entries_are_json_values(tmp_path: Path) -> None:
    path = tmp_path / "run.pt"
    linear = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(linear.parameters(), lr=0.1, momentum=0.9)
    linear(torch.ones(1, 2)).sum().backward()
    optimizer.step()
    torch.save({"model": linear.state_dict(), "optimizer": optimizer.state_dict(), "epoch": 3, "loss": float("nan"),
                "best": -math.inf, "config": {"lr": 0.1, "layers": [2, 2], "name": "run\u00e9", "extra": None,
                                              7: True},
                "shape": torch.Size([2, 3]), "device": torch.device("cpu"), "blob": b"\x00\x01",
                "scale": torch.tensor(2.0)}, path)
    code, data, _ = run_json("inspect", path)
    entries = data["entries"]
    assert code == 0
    assert entries["epoch"] == {"type": "int", "summary": "3", "value": 3}
    assert entries["loss"]["type"] == "float" and entries["loss"]["value"] == "nan"
    assert entries["best"]["value"] == "-inf"
    assert entries["config"]["type"] == "dict"
    assert entries["config"]["value"] == {"lr": 0.1, "layers": [2, 2], "name": "run\u00e9", "extra": None, "7": True}
    assert entries["shape"] == {"type": "size", "summary": "torch.Size([2, 3])", "value": [2, 3]}
    assert entries["optimizer"]["type"] == "optimizer_state" and "value" not in entries["optimizer"]
    assert "2 params" in entries["optimizer"]["summary"]
    assert entries["device"]["type"] == "device" and "value" not in entries["device"]
    assert entries["blob"]["type"] == "bytes" and "value" not in entries["blob"]
    assert entries["scale"]["type"] == "tensor" and "value" not in entries["scale"]


def test_a_huge_entry_gives_its_summary_only(tmp_path: Path) -> None:
    path = tmp_path / "big.pt"
    torch.save({"model": {"w": torch.zeros(1)}, "history": list(range(50_000)), "small": list(range(10))}, path)
    _, data, _ = run_json("inspect", path)
    assert "value" not in data["entries"]["history"] and data["entries"]["history"]["summary"] == "list of 50000"
    assert data["entries"]["small"]["value"] == list(range(10))
