"""On a real GPU: verify on every device, a real nccl DDP run, the GPU-tagged fixtures loading natively.

Marked ``gpu``: skipped, with the reason shown, where ``torch.cuda.is_available()`` is False (the
CPU-only tests reproduce GPU-saved files with exact location tags instead). On a CUDA machine:
``python -m pytest -m gpu``.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

import ckptool
from ckptool.cli.main import main
from training.models import build_model

pytestmark = pytest.mark.gpu
SMALL = ["--train-size", "512", "--test-size", "128"]


def gpu_count() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def test_verify_runs_on_every_gpu_with_bit_identical_weights(fixtures_dir: Path) -> None:
    result = CliRunner().invoke(main, ["verify", str(fixtures_dir / "single_lenet.pt"), "--model", "training:lenet",
                                       "--devices", "all", "--json"])
    assert result.exit_code == 0, result.stdout + result.stderr
    rows = {row["device"]: row for row in json.loads(result.stdout)["devices"]}
    assert set(rows) == {"cpu", *(f"cuda:{index}" for index in range(gpu_count()))}
    for device, row in rows.items():
        assert row["ok"] and row["weights_identical"] and row["within_tolerance"], (device, row)
        assert row["argmax_agreement"] == 1.0, (device, row)


def test_torch_devices_passed_to_verify_run_on_the_gpu(fixtures_dir: Path) -> None:
    """The Device seam's real implementation: the weights go to cuda:0 and back bit-identical."""
    from ckptool.model.devices import TorchDevice

    cuda = TorchDevice("cuda:0")
    assert cuda.move(torch.ones(2)).device == torch.device("cuda", 0)
    report = ckptool.verify(fixtures_dir / "single_lenet.pt", devices=[TorchDevice("cpu"), cuda])
    assert report.ok, report.failure
    assert [(row.device, row.weights_identical) for row in report.devices] == [("cpu", True), ("cuda:0", True)]


def test_a_real_nccl_ddp_run_saves_gpu_tags_that_ckptool_reads_and_fixes(tmp_path: Path, repo_root: Path,
                                                                         subprocess_env: dict[str, str]) -> None:
    processes = min(2, gpu_count())  # one GPU per process, as nccl needs
    out = tmp_path / "ddp.pt"
    completed = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(processes),
         "-m", "training", "--mode", "ddp", "--model", "lenet", "--epochs", "1", *SMALL, "--save-style", "wrapped",
         "--out", str(out)],
        cwd=repo_root, env=subprocess_env, capture_output=True, text=True, timeout=900,
    )
    assert completed.returncode == 0, completed.stderr[-4000:]
    summary = ckptool.inspect(out)
    assert summary.prefix == "module."
    assert any(tag.startswith("cuda:") for tag in summary.saved_devices), summary.saved_devices
    expected = torch.load(out, weights_only=True, map_location="cpu")["model"]  # torch's own reading
    checkpoint = ckptool.load(out)
    assert set(checkpoint.tensors) == set(expected)
    model = build_model("lenet")
    report = ckptool.load_into(model, out, device="cuda:0")
    assert report is not None and next(model.parameters()).device == torch.device("cuda", 0)
    for key, tensor in model.state_dict().items():
        assert torch.equal(tensor.cpu(), expected[f"module.{key}"]), key
    remapped = tmp_path / "cpu.pt"
    result = CliRunner().invoke(main, ["remap", str(out), "--to", "cpu", "-o", str(remapped)])
    assert result.exit_code == 0, result.stderr
    assert set(ckptool.inspect(remapped).saved_devices) == {"cpu"}


@pytest.mark.parametrize(("name", "gpus_needed"), [("gpu_cuda0_lenet.pt", 1), ("gpu_cuda1_ddp_lenet.pt", 2)])
def test_gpu_tagged_fixtures_load_natively_and_ckptool_agrees(fixtures_dir: Path, name: str, gpus_needed: int) -> None:
    if gpu_count() < gpus_needed:
        pytest.skip(f"{name} is tagged for cuda:{gpus_needed - 1}: needs {gpus_needed} GPUs, {gpu_count()} here")
    native = torch.load(fixtures_dir / name, weights_only=True)  # no map_location: onto the saved GPUs
    weights = native["model"]
    assert {tensor.device for tensor in weights.values()} == {torch.device("cuda", gpus_needed - 1)}
    checkpoint = ckptool.load(fixtures_dir / name)
    assert set(checkpoint.tensors) == set(weights)
    for key, ref in checkpoint.tensors.items():
        assert ref.location == f"cuda:{gpus_needed - 1}"
        data = bytearray(ref.read_bytes())
        expected = weights[key].cpu().contiguous()
        assert torch.equal(torch.frombuffer(data, dtype=expected.dtype).reshape(expected.shape), expected), key


def test_a_real_gpu_save_writes_the_bytes_of_the_tagged_cpu_save(fixtures_dir: Path, tmp_path: Path,
                                                                 load_script) -> None:
    """What the CPU-only suite stands on: a save with 'cuda:0' location tags is the file a GPU writes, byte for byte.

    The same full training checkpoint (weights, Adam moments and step counters, epoch, config) saved twice: once
    from cuda:0 for real, once from the CPU through make_fixtures' tagger.
    """
    make_fixtures = load_script("fixtures/make_fixtures.py")
    on_cpu = torch.load(fixtures_dir / "single_lenet.pt", weights_only=True, map_location="cpu")
    # every storage on cuda:0, the object otherwise as loaded (a state dict's _metadata kept, which a tree_map drops)
    on_gpu = torch.load(fixtures_dir / "single_lenet.pt", weights_only=True, map_location="cuda:0")
    (tmp_path / "gpu").mkdir()
    (tmp_path / "tagged").mkdir()
    torch.save(on_gpu, tmp_path / "gpu" / "lenet.pt")  # the same file name: torch names the archive's folder after it
    with make_fixtures.saved_locations(lambda storage: "cuda:0"):
        torch.save(on_cpu, tmp_path / "tagged" / "lenet.pt")
    assert (tmp_path / "gpu" / "lenet.pt").read_bytes() == (tmp_path / "tagged" / "lenet.pt").read_bytes()


def test_adam_keeps_its_step_counters_on_the_cpu_on_a_gpu_as_the_ddp_fixture_says(fixtures_dir: Path,
                                                                                   load_script) -> None:
    """gpu_cuda1_ddp_lenet.pt tags Adam's 'step' tensors 'cpu' and everything else 'cuda:1': what torch does."""
    model = build_model("lenet").to("cuda:0")
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.randn(4, 1, 28, 28, device="cuda:0")).sum().backward()
    optimizer.step()
    devices = {name: value.device.type for state in optimizer.state_dict()["state"].values()
               for name, value in state.items()}
    assert devices == {"step": "cpu", "exp_avg": "cuda", "exp_avg_sq": "cuda"}
    fixture_tags: dict[str, set[str]] = {}
    for entry in load_script("scripts/gpu_check.py").describe(fixtures_dir / "gpu_cuda1_ddp_lenet.pt"):
        if entry["path"][:2] == ["optimizer", "state"]:
            fixture_tags.setdefault(entry["path"][-1], set()).add(entry["location"])
    assert fixture_tags == {"step": {"cpu"}, "exp_avg": {"cuda:1"}, "exp_avg_sq": {"cuda:1"}}
