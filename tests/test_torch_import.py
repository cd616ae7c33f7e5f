"""The core needs no torch: every command but ``verify --model`` runs where torch cannot be imported.

Each command runs in a subprocess whose ``sitecustomize`` (tests/no_torch/) makes ``import torch``
fail as on a machine without it, and records every import of torch that was even attempted: a
command passes only if it did its work and never tried. What does need torch says how to install
it, in one line (CLI) or a :class:`~ckptool.base.errors.MissingExtraError`, an ``ImportError`` (API).
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
BLOCKER = Path(__file__).resolve().parent / "no_torch"
INSTALL = "pip install 'ckptool[torch]'"


def run_without_torch(tmp_path: Path, *args: object, code: str | None = None) -> tuple[int, str, str, set[str]]:
    """``python -m ckptool ARGS`` (or ``python -c CODE``) with torch unimportable: (exit, stdout, stderr, modules)."""
    modules = tmp_path / f"modules-{os.getpid()}-{len(list(tmp_path.glob('modules-*')))}.txt"
    env = dict(os.environ, CKPTOOL_TEST_BLOCK_TORCH="1", CKPTOOL_TEST_MODULES_OUT=str(modules),
               PYTHONPATH=os.pathsep.join([str(BLOCKER), str(REPO)]))
    command = [sys.executable, "-c", code] if code is not None else [sys.executable, "-m", "ckptool", *map(str, args)]
    result = subprocess.run(command, env=env, capture_output=True, text=True, cwd=tmp_path, timeout=300)
    loaded = set(modules.read_text().split()) if modules.exists() else set()
    return result.returncode, result.stdout, result.stderr, loaded


def assert_torch_free(loaded: set[str], what: str) -> None:
    assert loaded, f"{what}: the subprocess wrote no module list"
    assert not {"torch", "torchvision", "tried:torch", "tried:torchvision"} & loaded, \
        f"{what} imported (or tried to import) torch"


def _commands(fixtures: Path, out: Path) -> list[tuple[str, list[object], int]]:
    ddp, gpu = fixtures / "ddp_lenet_wrapped.pt", fixtures / "gpu_cuda1_ddp_lenet.pt"
    lenet = fixtures / "single_lenet.pt"
    (out / "many").mkdir()
    return [
        ("inspect", ["inspect", ddp, "--tensors", "--fingerprint"], 0),
        ("inspect --json", ["inspect", fixtures / "mlp.safetensors", "--json"], 0),
        ("inspect sharded", ["inspect", fixtures / "sharded", "--fingerprint"], 0),
        ("inspect torchscript", ["inspect", fixtures / "torchscript_mlp.pt"], 0),
        ("scan", ["scan", ddp, "--json"], 0),
        ("convert to safetensors", ["convert", ddp, "-o", out / "a.safetensors", "--fingerprint"], 0),
        ("convert to pt", ["convert", out / "a.safetensors", "-o", out / "a.pt"], 0),
        ("convert sharded", ["convert", lenet, "-o", out / "shards", "--max-shard-size", "100KB"], 0),
        ("convert --out-dir", ["convert", ddp, lenet, "--out-dir", out / "many"], 0),
        ("convert tied", ["convert", fixtures / "tied_lm.pt", "-o", out / "tied.safetensors"], 0),
        ("strip", ["strip", ddp, "-o", out / "stripped.pt"], 0),
        ("add-prefix", ["add-prefix", lenet, "-o", out / "prefixed.pt"], 0),
        ("remap", ["remap", gpu, "-o", out / "cpu.pt", "--to", "cpu"], 0),
        ("diff identical", ["diff", ddp, out / "a.pt", "--json"], 0),
        ("diff values", ["diff", lenet, fixtures / "ddp_lenet_unwrapped.pt"], 1),
        ("verify", ["verify", lenet, "--devices", "cpu"], 0),
        ("verify --against", ["verify", lenet, "--devices", "cpu", "--against", out / "shards"], 0),
    ]


def test_every_core_command_runs_without_torch(fixtures_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    for what, args, expected in _commands(fixtures_dir, out):
        code, stdout, stderr, loaded = run_without_torch(tmp_path, *args)
        assert code == expected, f"{what}: exit {code}: {stderr}"
        assert "internal error" not in stderr and "Traceback" not in stderr, f"{what}: {stderr}"
        assert_torch_free(loaded, what)
    assert json.loads((out / "shards" / "model.safetensors.index.json").read_text())["weight_map"]


def test_verify_with_the_default_devices_runs_without_torch(fixtures_dir: Path, tmp_path: Path) -> None:
    """``--devices all`` on a machine without torch: the CPU row alone, read from the file (a GPU driver or not)."""
    code, stdout, stderr, loaded = run_without_torch(tmp_path, "verify", fixtures_dir / "single_lenet.pt", "--json")
    assert code == 0, stderr
    assert [row["device"] for row in json.loads(stdout)["devices"]] == ["cpu"]
    assert "torch" not in loaded


def test_a_cast_runs_without_torch(fixtures_dir: Path, tmp_path: Path) -> None:
    code, _, stderr, loaded = run_without_torch(tmp_path, "convert", fixtures_dir / "single_lenet.pt", "-o",
                                                tmp_path / "half.safetensors", "--dtype", "bf16")
    assert code == 0, stderr
    assert_torch_free(loaded, "convert --dtype")


@pytest.mark.parametrize("args", [
    ["--model", "training:lenet"],
    ["--model", "torchvision:resnet18"],
    ["--model", "mypackage.models:build"],
    ["--devices", "cuda:0"],
])
def test_what_needs_torch_says_how_to_install_it(fixtures_dir: Path, tmp_path: Path, args: list[str]) -> None:
    code, stdout, stderr, loaded = run_without_torch(tmp_path, "verify", fixtures_dir / "single_lenet.pt", *args)
    assert code == 3
    assert stdout == ""
    assert len(stderr.splitlines()) == 1, stderr
    assert stderr.startswith("ckptool: error: ") and INSTALL in stderr
    assert "torch" not in loaded


def test_the_api_raises_an_import_error_naming_the_extra(fixtures_dir: Path, tmp_path: Path) -> None:
    code = f"""
import ckptool
from ckptool.base.errors import MissingExtraError
from ckptool.ops.load_into import to_state_dict
checkpoint = ckptool.load({str(fixtures_dir / 'single_lenet.pt')!r})
for call in (lambda: to_state_dict(checkpoint.tensors),
             lambda: ckptool.load_into(object(), checkpoint),
             lambda: ckptool.verify(checkpoint.path, model_spec="training:lenet")):
    try:
        call()
    except ImportError as error:
        assert isinstance(error, MissingExtraError) and isinstance(error, ckptool.CkptError), type(error)
        assert {INSTALL!r} in str(error), str(error)
        print("ok")
    else:
        raise AssertionError("no error")
"""
    exit_code, stdout, stderr, _ = run_without_torch(tmp_path, code=code)
    assert exit_code == 0, stderr
    assert stdout.split() == ["ok"] * 3


def _safetensors(path: Path, dtype: str, data: bytes) -> Path:
    """A one-tensor safetensors file written by hand (no torch, no safetensors package)."""
    header = json.dumps({"w": {"dtype": dtype, "shape": [len(data)], "data_offsets": [0, len(data)]}}).encode()
    header += b" " * (-len(header) % 8)
    path.write_bytes(struct.pack("<Q", len(header)) + header + data)
    return path


@pytest.mark.parametrize("dtype,torch_name", [("F8_E4M3", "float8_e4m3fn"), ("F8_E5M2", "float8_e5m2"),
                                              ("F8_E4M3FNUZ", "float8_e4m3fnuz"), ("F8_E5M2FNUZ", "float8_e5m2fnuz")])
def test_float8_values_compare_without_torch_as_torch_decodes_them(tmp_path: Path, dtype: str, torch_name: str) -> None:
    torch = pytest.importorskip("torch")
    if not hasattr(torch, torch_name):
        pytest.skip(f"this torch has no {torch_name}")
    a_bytes, b_bytes = bytes(range(0, 256, 3)), bytes((value * 7 + 1) % 256 for value in range(0, 256, 3))
    a = _safetensors(tmp_path / "a.safetensors", dtype, a_bytes)
    b = _safetensors(tmp_path / "b.safetensors", dtype, b_bytes)
    code, stdout, stderr, loaded = run_without_torch(tmp_path, "diff", a, b, "--json")
    assert code == 1, stderr
    assert_torch_free(loaded, "diff of float8 tensors")

    def decoded(raw: bytes) -> object:
        return torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(getattr(torch, torch_name)).to(torch.float64)

    left, right = decoded(a_bytes), decoded(b_bytes)  # equal values (and NaN against NaN) differ by 0
    difference = (left - right).abs().masked_fill((left == right) | (left.isnan() & right.isnan()), 0)
    expected = difference.nan_to_num(nan=float("inf"), posinf=float("inf")).max().item()
    assert json.loads(stdout)["changed"][0]["max_abs_diff"] in (expected, str(expected))


def test_every_float8_bit_pattern_decodes_as_torch_decodes_it() -> None:
    torch = pytest.importorskip("torch")
    import numpy as np

    from ckptool.ops.diff import float8_table
    from ckptool.tensors.dtypes import BY_NAME

    for name in ("F8_E4M3", "F8_E5M2", "F8_E4M3FNUZ", "F8_E5M2FNUZ", "F8_E8M0"):
        torch_dtype = getattr(torch, BY_NAME[name].torch_name, None)
        if torch_dtype is None:
            continue
        expected = torch.arange(256, dtype=torch.uint8).view(torch_dtype).to(torch.float64).numpy()
        table = float8_table(name)
        assert np.array_equal(table, expected, equal_nan=True), name
        assert np.array_equal(np.signbit(table), np.signbit(expected)), name
