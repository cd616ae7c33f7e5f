"""Library refusals name options as the caller passes them: keyword arguments through the API, flags on
the command line (``suggest.Wording``). Each case raises one refusal both ways; a scan of the library's
sources keeps a flag out of any message it raises."""

from __future__ import annotations

import ast
import json
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

import ckptool
from ckptool.ops import rewrite as operations
from ckptool.tensors import refs
from ckptool.io import writer
from ckptool.cli.main import main
from ckptool.base.suggest import flag

sys.path.insert(0, str(Path(__file__).parent))
import hostile  # noqa: E402 — the corpus generator beside this file

torch = pytest.importorskip("torch")

FLAG = re.compile(r"(^|[\s(/])(--[a-z]|-o\b)")  # a long flag, or -o (not -inf)


def cli(*args: object) -> tuple[int, str]:
    result = CliRunner().invoke(main, [str(a) for a in args])
    return result.exit_code, result.stderr


def refused(name: str, call: Callable[[], Any]) -> ckptool.CkptError:
    try:
        call()
    except ckptool.CkptError as e:
        return e
    raise AssertionError(f"{name}: nothing was refused")


@pytest.fixture
def lenet(fixtures_dir: Path) -> Path:
    return fixtures_dir / "single_lenet.pt"


def save_to(tmp_path: Path, lenet: Path, name: str, **options: Any) -> Callable[[], Any]:
    return lambda: ckptool.save(ckptool.load(lenet), tmp_path / name, **options)


def write(path: Path, obj: Any) -> Path:
    torch.save(obj, path)
    return path


def cases(tmp_path: Path, lenet: Path, monkeypatch: pytest.MonkeyPatch) -> list[tuple[Any, ...]]:
    """(id, the API call, the same refusal's command line or None, what the API says, what the CLI says)."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    twins = [write(tmp_path / "a" / "m.pt", {"w": torch.ones(1)}), write(tmp_path / "b" / "m.pt", {"w": torch.ones(1)})]
    meta = write(tmp_path / "meta.pt", {"w": torch.ones(2), "m": torch.empty(2, device="meta")})
    complex_ = write(tmp_path / "complex.pt", {"w": torch.ones(2, dtype=torch.complex128)})
    expanding = tmp_path / "expanding.pt"
    expanding.write_bytes(hostile.stride0_zip(2, 1000, value=2.5))
    monkeypatch.setattr(refs, "EXPANSION_SLACK", 0)  # a small file stands for a large one
    monkeypatch.setattr(writer, "MAX_SHARDS", 2)
    missing = tmp_path / "missing"
    return [
        ("to-unknown", lambda: ckptool.save(ckptool.load(lenet), tmp_path / "x.pt", to="onnx"), None,
         "to='onnx': choose pt or safetensors", None),
        ("to-contradicts", save_to(tmp_path, lenet, "x.safetensors", to="pt"),
         ("convert", lenet, "-o", tmp_path / "x.safetensors", "--to", "pt"),
         "to='pt' contradicts the name x.safetensors — drop to, or", "--to pt contradicts the name x.safetensors — drop --to, or"),
        ("shard-size-pt", save_to(tmp_path, lenet, "x.pt", max_shard_size=100),
         ("convert", lenet, "-o", tmp_path / "x.pt", "--max-shard-size", "100"),
         "max_shard_size applies to safetensors output", "--max-shard-size applies to safetensors output"),
        ("no-format", save_to(tmp_path, lenet, "x.onnx"), ("convert", lenet, "-o", tmp_path / "x.onnx"),
         "or a directory, or pass to", "or a directory, or pass --to"),
        ("out-dir-missing", lambda: operations.plan_convert([lenet], out_dir=missing),
         ("convert", lenet, "--out-dir", missing),
         f"out_dir={str(missing)!r} is not an existing directory", f"--out-dir {missing} is not an existing directory"),
        ("out-dir-collision", lambda: operations.plan_convert(twins, out_dir=tmp_path), ("convert", *twins, "--out-dir", tmp_path),
         "convert them into separate out_dir folders", "convert them into separate --out-dir folders"),
        ("nest", save_to(tmp_path, lenet, "x.pt", nest="model"), ("convert", lenet, "-o", tmp_path / "x.pt", "--nest", "model"),
         "nest applies to safetensors input", "--nest applies to safetensors input"),
        ("meta", lambda: ckptool.save(ckptool.load(meta), tmp_path / "x.safetensors"),
         ("convert", meta, "-o", tmp_path / "x.safetensors"),
         "write a .pt instead (to='pt'), or leave", "write a .pt instead (--to pt), or leave"),
        ("no-dtype", lambda: ckptool.save(ckptool.load(complex_), tmp_path / "x.safetensors"),
         ("convert", complex_, "-o", tmp_path / "x.safetensors"),
         "write a .pt instead (to='pt'), or leave", "write a .pt instead (--to pt), or leave"),
        ("shard-size-zero", save_to(tmp_path, lenet, "shards", max_shard_size=-1), None,
         "max_shard_size must be at least 1 byte, not -1", None),
        ("too-many-shards", save_to(tmp_path, lenet, "shards", max_shard_size=100),
         ("convert", lenet, "-o", tmp_path / "shards", "--max-shard-size", "100"),
         "max_shard_size=100 would make", "--max-shard-size 100 would make"),
        ("map-malformed", lambda: operations.remap(lenet, tmp_path / "x.pt", mapping=["cuda:1"]),
         ("remap", lenet, "-o", tmp_path / "x.pt", "--map", "cuda:1"),
         "mapping='cuda:1' is not OLD=NEW, e.g. mapping=['cuda:1=cuda:0']", "--map 'cuda:1' is not OLD=NEW, e.g. --map cuda:1=cuda:0"),
        ("to-and-map", lambda: operations.remap(lenet, tmp_path / "x.pt", to_device="cpu", mapping=["cuda:1=cpu"]),
         ("remap", lenet, "-o", tmp_path / "x.pt", "--to", "cpu", "--map", "cuda:1=cpu"),
         "give either to_device or mapping, not both", "give either --to or --map, not both"),
        ("nowhere", lambda: operations.remap(lenet, tmp_path / "x.pt"), ("remap", lenet, "-o", tmp_path / "x.pt"),
         "say where to: to_device='cpu', or mapping=['cuda:1=cuda:0']", "say where to: --to cpu, or --map cuda:1=cuda:0"),
        ("devices-empty", lambda: ckptool.verify(lenet, devices=""), ("verify", lenet, "--devices", ""),
         "devices is empty", "--devices is empty"),
        ("devices-absent", lambda: ckptool.verify(lenet, devices="cuda:7"), ("verify", lenet, "--devices", "cuda:7"),
         "devices: cuda:7 is not available", "--devices: cuda:7 is not available"),
        ("model-arg-alone", lambda: ckptool.verify(lenet, model_args=["num_classes=10"]),
         ("verify", lenet, "--model-arg", "num_classes=10"), "model_args needs model_spec", "--model-arg needs --model SPEC"),
        ("input-shape-alone", lambda: ckptool.verify(lenet, input_shape="1,1,28,28"),
         ("verify", lenet, "--input-shape", "1,1,28,28"), "input_shape needs model_spec", "--input-shape needs --model SPEC"),
        ("no-shape", lambda: ckptool.verify(lenet, model_spec="os:getcwd"), ("verify", lenet, "--model", "os:getcwd"),
         "model_spec='os:getcwd': say the input shape with input_shape, e.g.",
         "--model os:getcwd: say the input shape with --input-shape, e.g."),
        ("wrong-shape", lambda: ckptool.verify(lenet, model_spec="training:lenet", input_shape="1,2", devices="cpu"),
         ("verify", lenet, "--model", "training:lenet", "--input-shape", "1,2", "--devices", "cpu"),
         "— pass the right input_shape", "— pass the right --input-shape"),
        ("not-a-spec", lambda: ckptool.verify(lenet, model_spec="lenet"), ("verify", lenet, "--model", "lenet"),
         "model_spec='lenet' is not a model SPEC", "--model 'lenet' is not a model SPEC"),
        ("unknown-model", lambda: ckptool.verify(lenet, model_spec="training:alexnet"),
         ("verify", lenet, "--model", "training:alexnet"),
         "model_spec='training:alexnet': unknown training model", "--model training:alexnet: unknown training model"),
        ("spec-argument", lambda: ckptool.verify(lenet, model_spec="torchvision:resnet18?num_classes"), None,
         "model_spec='torchvision:resnet18?num_classes': argument 'num_classes' is not NAME=VALUE", None),
        ("model-arg", lambda: ckptool.verify(lenet, model_spec="training:lenet", model_args=["ten"]),
         ("verify", lenet, "--model", "training:lenet", "--model-arg", "ten"),
         "model_args 'ten' is not NAME=VALUE", "--model-arg 'ten' is not NAME=VALUE"),
        ("input-shape", lambda: ckptool.verify(lenet, model_spec="training:lenet", input_shape="a,b"),
         ("verify", lenet, "--model", "training:lenet", "--input-shape", "a,b"),
         "input_shape='a,b' is not a list of positive sizes", "--input-shape 'a,b' is not a list of positive sizes"),
        ("expansion", lambda: operations.convert_file(expanding, tmp_path / "x.safetensors", operations.ConvertOptions()),
         ("convert", expanding, "-o", tmp_path / "x.safetensors"),
         "them; pass allow_expansion=True if that size", "them; pass --allow-expansion if that size"),
    ]


def test_each_refusal_names_keywords_through_the_api_and_flags_on_the_command_line(
        lenet: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name, call, args, said, printed in cases(tmp_path, lenet, monkeypatch):
        error = refused(name, call)
        assert not FLAG.search(str(error)), (name, str(error))
        assert said in str(error), (name, str(error))
        if args is None:
            continue
        code, stderr = cli(*args)
        assert code == error.exit_code and printed in stderr, (name, stderr)
        assert stderr == f"ckptool: error: {error.render(flag)}\n", name  # the one refusal, spelled for each reader
        assert not list(tmp_path.glob("x.*")) and not (tmp_path / "shards").exists(), name


def test_verify_failures_name_keywords_in_the_report_and_flags_on_the_command_line(tmp_path: Path) -> None:
    from ckptool.verification.report import DeviceResult, VerifyReport, conclude

    path = write(tmp_path / "nan.pt", {"w": torch.tensor([float("nan"), 1.0])})
    report = ckptool.verify(path, devices="cpu")
    assert not report.ok and not FLAG.search(report.failure), report.failure
    assert "or pass allow_nonfinite=True (or allow_nonfinite=['PATTERN']) if they hold them" in report.failure
    assert report.to_json()["failure"] == report.failure
    code, stderr = cli("verify", path, "--devices", "cpu")
    assert code == 1 and "or pass --allow-nonfinite (or --allow-nonfinite-key PATTERN) if they hold them" in stderr
    assert stderr.strip().endswith(report.failure_text(flag))
    result = CliRunner().invoke(main, ["verify", str(path), "--devices", "cpu", "--json"])
    assert "--allow-nonfinite-key PATTERN" in json.loads(result.stdout)["failure"]

    drifted = VerifyReport(path=str(path), format="pt", ok=False, model="training:lenet", model_class="LeNet",
                           input_shape=(1, 1, 28, 28), dtype="F32", atol=1e-5, rtol=1e-4, load={"ok": True},
                           devices=[DeviceResult(device="cuda:0", ok=False, weights_identical=True, max_abs_err=0.5)])
    conclude(drifted)
    assert drifted.failure is not None and drifted.failure.endswith("— rerun with atol/rtol if that is expected")
    assert drifted.failure_text(flag).endswith("— rerun with --atol/--rtol if that is expected")


def _spelled_flags(root: Path) -> list[str]:
    """Every string constant naming a flag (``--name``) in the library's modules, docstrings aside: a
    refusal's words, a report's failure line, a diagnosis's fix."""
    found = []
    for path in sorted(root.rglob("*.py")):
        if path.relative_to(root).parts[0] == "cli" or path.relative_to(root).as_posix() == "base/suggest.py":
            continue  # the command line itself, and the one module that spells options as flags
        tree = ast.parse(path.read_text(encoding="utf-8"))
        docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                      if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
                      and node.body and isinstance(node.body[0], ast.Expr)}
        found += [f"{path.relative_to(root)}:{node.lineno}: {node.value!r}" for node in ast.walk(tree)
                  if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings
                  and re.search(r"--[A-Za-z]", node.value)]
    return found


def test_no_library_message_spells_a_flag() -> None:
    """A flag in a library message names an option an API caller cannot pass: it is an Option instead
    (the scan covers every ``raise``, and the lines a report carries)."""
    assert _spelled_flags(Path(ckptool.__file__).parent) == []


def test_the_scan_finds_a_flag_in_a_raise(tmp_path: Path) -> None:
    (tmp_path / "module.py").write_text('"""Uses --force in its docstring."""\n'
                                        'def f():\n    raise ValueError("pass " + "--force")\n')
    assert _spelled_flags(tmp_path) == ["module.py:3: '--force'"]
