"""verification.py and `ckptool verify`: strict load with diagnosis, per-device evaluation, --against, model SPECs."""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from typing import Any

import pytest
import safetensors.torch
import torch
from click.testing import CliRunner
from torch import nn

from ckptool.verification import determinism
from ckptool.cli.main import main
from ckptool.model.devices import TorchDevice
from ckptool.base.errors import UsageError
from ckptool.verification.model_checks import EVAL_BATCH
from ckptool.verification.models import parse_input_shape, parse_model_spec
from training.models import LeNet, build_model

# the module behind `ckptool.verify` (the function)
verify_module = importlib.import_module("ckptool.verification.verify")
devices_module = importlib.import_module("ckptool.model.devices")

FAKE_DEVICES = ["cpu", "cuda:0", "cuda:1"]


class StandIn:
    """A device for tests (the ``Device`` seam): named "cuda:N", it runs on CPU; ``fault(value)``, if
    given, changes what it moved (a module or a tensor) the way a broken transfer would."""

    def __init__(self, name: str, fault: Any = None) -> None:
        self.name = name
        self.fault = fault
        self.moved: list[Any] = []

    def move(self, value: Any) -> Any:
        self.moved.append(value)
        value = value.to("cpu")
        return self.fault(value) if self.fault is not None else value

    def synchronize(self, tensors: Any) -> None:
        pass


def stand_ins(**faults: Any) -> list[Any]:
    """The CPU plus two "GPUs" that run on CPU: ``cuda0=`` / ``cuda1=`` give one of them a fault."""
    return [TorchDevice("cpu"), StandIn("cuda:0", faults.get("cuda0")), StandIn("cuda:1", faults.get("cuda1"))]


def lenet_state(seed: int = 0) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    return LeNet().state_dict()


@pytest.fixture
def lenet_pt(tmp_path: Path) -> Path:
    """A plain LeNet training container: {"model": state_dict, "epoch": 1}."""
    path = tmp_path / "lenet.pt"
    torch.save({"model": lenet_state(), "epoch": 1}, path)
    return path


@pytest.fixture
def ddp_pt(tmp_path: Path) -> Path:
    """What saving a DDP-wrapped model gives: every key under "model" starts with module."""
    path = tmp_path / "ddp.pt"
    torch.save({"model": {"module." + k: v for k, v in lenet_state().items()}, "epoch": 1}, path)
    return path


def invoke(*args: Any) -> Any:
    return CliRunner().invoke(main, [str(a) for a in args])


@pytest.fixture(autouse=True)
def small_test_set(monkeypatch: pytest.MonkeyPatch) -> None:
    """200 synthetic test images instead of 1000: the same code path, a fifth of the CPU time."""
    monkeypatch.setattr(verify_module, "TEST_SET_SIZE", 200)


# ---------------------------------------------------------------------------------------------- load


def test_ddp_checkpoint_fails_with_the_strip_fix_and_the_fix_works(ddp_pt: Path, tmp_path: Path) -> None:
    result = invoke("verify", ddp_pt, "--model", "training:lenet", "--devices", "cpu")
    stripped = tmp_path / "ddp.stripped.pt"
    assert result.exit_code == 1, result.output
    assert result.stderr == (f'ckptool: verify failed: {ddp_pt}: every weight key carries "module." (DataParallel/DDP) '
                             f"but LeNet's keys have no prefix — run: ckptool strip {ddp_pt} -o {stripped}\n")
    assert "unexpected (8 keys, by module): module.conv1 (2), module.conv2 (2), module.fc1 (2), module.fc2 (2)" \
        in result.stdout
    # run the named fix, then verify the result
    assert invoke("strip", ddp_pt, "-o", stripped).exit_code == 0
    result = invoke("verify", stripped, "--model", "training:lenet", "--devices", "cpu", "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["ok"] is True
    assert report["load"]["ok"] is True and report["load"]["rewrite"] is None
    [cpu] = report["devices"]
    assert cpu["device"] == "cpu" and cpu["ok"] is True
    assert cpu["max_abs_err"] == 0.0 and cpu["max_rel_err"] == 0.0
    assert cpu["weights_identical"] is True
    assert cpu["argmax_agreement"] == 1.0
    assert 0.0 <= cpu["accuracy"] <= 1.0
    assert report["against"] is None


def test_ddp_failure_json_carries_the_diagnosis(ddp_pt: Path) -> None:
    result = invoke("verify", ddp_pt, "--model", "training:lenet", "--devices", "cpu", "--json")
    assert result.exit_code == 1
    report = json.loads(result.stdout)
    assert report["ok"] is False and report["devices"] == []
    diagnosis = report["load"]["diagnosis"]
    assert diagnosis["cause"] == "prefix" and diagnosis["rewrite"] == 'strip "module."'
    assert diagnosis["after_rewrite"]["matched"] == 8


def test_wrong_architecture_fails_with_a_readable_diagnosis(tmp_path: Path) -> None:
    torch.manual_seed(0)
    path = tmp_path / "mlp.pt"
    torch.save(build_model("mlp").state_dict(), path)
    result = invoke("verify", path, "--model", "training:lenet", "--devices", "cpu")
    assert result.exit_code == 1
    assert result.stderr == (f"ckptool: verify failed: {path}: holds a different architecture than LeNet: 3 of its 8 "
                             "tensors found with the right shape (missing: conv1, conv2; unexpected: none; other "
                             "shapes: fc1) — pass the model this checkpoint was trained with\n")
    assert "missing (4 keys, by module): conv1 (2), conv2 (2)" in result.stdout
    assert "shape differs: fc1.weight [128, 784] in the checkpoint, [128, 800] in the model" in result.stdout


def test_real_ddp_fixture_fails_and_unwrapped_passes(fixtures_dir: Path) -> None:
    wrapped, unwrapped = fixtures_dir / "ddp_lenet_wrapped.pt", fixtures_dir / "ddp_lenet_unwrapped.pt"
    # committed fixtures: a missing one is a broken checkout, not a reason to test less
    assert wrapped.is_file() and unwrapped.is_file(), "fixtures/ddp_lenet_*.pt missing — run `make fixtures`"
    assert verify_module.verify(wrapped, model_spec="training:lenet", devices="cpu").ok is False
    report = verify_module.verify(unwrapped, model_spec="training:lenet", devices="cpu")
    assert report.ok, report.failure
    assert report.devices[0].accuracy > 0.3  # trained for an epoch: well above chance (0.1)


# ---------------------------------------------------------------------------------------------- devices


def test_every_device_row_passes_when_transfers_are_exact(lenet_pt: Path) -> None:
    devices = stand_ins()
    report = verify_module.verify(lenet_pt, model_spec="training:lenet", devices=devices).to_json()  # what --json prints
    assert report["ok"], report["failure"]
    assert [row["device"] for row in report["devices"]] == FAKE_DEVICES
    for row in report["devices"]:
        assert row["ok"] and row["weights_identical"] and row["max_abs_err"] == 0.0 and row["argmax_agreement"] == 1.0
    assert len({row["accuracy"] for row in report["devices"]}) == 1
    for stand_in in devices[1:]:  # the model, the seeded input and the test set's batches went to each device
        assert isinstance(stand_in.moved[0], nn.Module) and len(stand_in.moved) == 2 + -(-200 // EVAL_BATCH)


def corrupt_fc2(value: Any) -> Any:
    """A transfer that changes one weight of a LeNet (and nothing else)."""
    if isinstance(value, nn.Module):
        with torch.no_grad():
            value.fc2.weight[3, 7] += 0.5
    return value


def test_a_device_that_corrupts_a_weight_fails(lenet_pt: Path) -> None:
    report = verify_module.verify(lenet_pt, model_spec="training:lenet", devices=stand_ins(cuda1=corrupt_fc2))
    rows = {row["device"]: row for row in report.to_json()["devices"]}
    assert rows["cpu"]["ok"] and rows["cuda:0"]["ok"]
    assert rows["cuda:1"]["ok"] is False
    assert rows["cuda:1"]["weights_identical"] is False
    assert rows["cuda:1"]["differing_weights"] == ["fc2.weight"]
    assert rows["cuda:1"]["max_abs_err"] > 0
    assert not report.ok
    assert report.failure == "cuda:1: weights changed in the transfer to the device (fc2.weight)"


def test_outputs_beyond_tolerance_fail_even_with_identical_weights(lenet_pt: Path) -> None:
    def noisy(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return value + 1e-3  # the device "computes" on a slightly different input
        return value

    report = verify_module.verify(lenet_pt, model_spec="training:lenet", devices=stand_ins(cuda0=noisy))
    rows = {row.device: row for row in report.devices}
    assert rows["cuda:0"].weights_identical and rows["cuda:0"].within_tolerance is False and not rows["cuda:0"].ok
    assert report.failure.startswith("cuda:0: outputs differ from the CPU reference beyond atol 1e-05 / rtol 0.0001")
    loose = verify_module.verify(lenet_pt, model_spec="training:lenet", atol=1.0, rtol=1.0,
                                 devices=stand_ins(cuda0=noisy))
    assert loose.ok, loose.failure


def test_devices_option_checks_availability(lenet_pt: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(devices_module, "available_devices", lambda: ["cpu"])
    result = invoke("verify", lenet_pt, "--devices", "cpu,cuda:1")
    assert result.exit_code == 2
    assert result.stderr == "ckptool: error: --devices: cuda:1 is not available on this machine (available: cpu)\n"
    assert verify_module.resolve_devices("cpu, cpu") == ["cpu"]


def test_determinism_flags_are_set_while_verifying_and_restored(lenet_pt: Path) -> None:
    seen: list[tuple[bool, bool, str]] = []

    def recording(value: Any) -> Any:
        seen.append((torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark,
                     torch.get_float32_matmul_precision()))
        return value

    original = verify_module.determinism_state()
    precision = [(owner, name, getattr(owner, name)) for owner, name in determinism._precision_attributes()]
    torch.backends.cudnn.benchmark = True
    torch.backends.cudnn.deterministic = False
    torch.set_float32_matmul_precision("high")
    try:
        changed = verify_module.determinism_state()
        assert changed != original
        verify_module.verify(lenet_pt, model_spec="training:lenet", devices=stand_ins(cuda0=recording))
        assert seen and all(flags == (True, False, "highest") for flags in seen)
        assert verify_module.determinism_state() == changed
    finally:
        torch.backends.cudnn.benchmark = original["cudnn.benchmark"]
        torch.backends.cudnn.deterministic = original["cudnn.deterministic"]
        torch.set_float32_matmul_precision(original["float32_matmul_precision"])
        for owner, name, value in precision:
            setattr(owner, name, value)
    assert verify_module.determinism_state() == original


def test_restored_after_a_failure_too(lenet_pt: Path) -> None:
    before = verify_module.determinism_state()

    def broken(value: Any) -> Any:
        raise KeyboardInterrupt  # escapes every handler: the context manager must still restore

    with pytest.raises(KeyboardInterrupt):
        verify_module.verify(lenet_pt, model_spec="training:lenet", devices=[StandIn("cpu", broken)])
    assert verify_module.determinism_state() == before


# ---------------------------------------------------------------------------------------------- without a model


def test_weights_only_verify_counts_nan_and_inf(tmp_path: Path) -> None:
    weight = torch.randn(4, 4)
    weight[0, 0], weight[1, 1], weight[2, 2] = float("nan"), float("inf"), float("nan")
    path = tmp_path / "nan.pt"
    torch.save({"w": weight, "steps": torch.arange(3)}, path)
    result = invoke("verify", path, "--json", "--devices", "cpu")
    assert result.exit_code == 1, result.output  # weights holding NaN/Inf fail unless allowed
    assert "hold NaN or Inf: w (2 NaN, 1 Inf)" in json.loads(result.stdout)["failure"]
    result = invoke("verify", path, "--json", "--devices", "cpu", "--allow-nonfinite-key", "w")
    assert result.exit_code == 0, result.output
    failed = verify_module.verify(path, devices=stand_ins())
    assert not failed.ok and "hold NaN or Inf: w (2 NaN, 1 Inf)" in failed.failure
    report = verify_module.verify(path, devices=stand_ins(), allow_nonfinite=["w"]).to_json()
    assert report["ok"], report["failure"]
    assert [row["device"] for row in report["devices"]] == FAKE_DEVICES
    for row in report["devices"]:
        assert row["weights_identical"] and row["nonfinite"] == {"w": {"nan": 2, "inf": 1}}
    assert report["notes"] == ["1 weight tensor(s) hold NaN or Inf: w"]


def test_weights_only_verify_fails_when_a_transfer_changes_bits(tmp_path: Path) -> None:
    path = tmp_path / "w.pt"
    torch.save({"a": torch.ones(3), "b": torch.zeros(2)}, path)

    def flips(value: Any) -> Any:
        return value * -1  # -0.0 != 0.0 bit for bit

    report = verify_module.verify(path, devices=stand_ins(cuda0=flips))
    rows = {row.device: row for row in report.devices}
    assert rows["cuda:0"].differing_weights == ["a", "b"] and not report.ok
    assert rows["cuda:1"].ok


# ---------------------------------------------------------------------------------------------- --against


def test_safetensors_copy_verifies_against_its_pt_source(lenet_pt: Path, tmp_path: Path) -> None:
    copy_path = tmp_path / "lenet.safetensors"
    safetensors.torch.save_file(lenet_state(), copy_path)
    result = invoke("verify", copy_path, "--model", "training:lenet", "--devices", "cpu", "--against", lenet_pt,
                    "--json")
    assert result.exit_code == 0, result.output
    against = json.loads(result.stdout)["against"]
    assert against["ok"] and against["identical"]
    assert against["weights"]["byte_identical"] == 8
    assert against["outputs"] == {"max_abs_err": 0.0, "max_rel_err": 0.0, "within_tolerance": True}
    # without a model: the weights alone
    assert invoke("verify", copy_path, "--devices", "cpu", "--against", lenet_pt).exit_code == 0


def test_against_a_stripped_copy_aligns_the_prefix(ddp_pt: Path, lenet_pt: Path) -> None:
    report = verify_module.verify(lenet_pt, devices="cpu", against=ddp_pt)
    assert report.ok, report.failure
    assert report.against.diff.aligned == ("", "module.")


def test_a_changed_element_fails_diff_and_verify_against(lenet_pt: Path, tmp_path: Path) -> None:
    state = lenet_state()
    state["conv2.weight"] = state["conv2.weight"].clone()
    state["conv2.weight"][4, 3, 2, 1] += 1e-3
    changed = tmp_path / "changed.safetensors"
    safetensors.torch.save_file(state, changed)
    result = invoke("verify", changed, "--model", "training:lenet", "--devices", "cpu", "--against", lenet_pt)
    assert result.exit_code == 1
    assert result.stderr.startswith(f"ckptool: verify failed: against {lenet_pt}: conv2.weight differs in values, "
                                    "max abs diff 0.001")
    assert "conv2.weight: values, max abs diff 0.001" in result.stdout
    assert invoke("diff", changed, lenet_pt).exit_code == 1


# ---------------------------------------------------------------------------------------------- model SPECs


def test_model_specs_parse() -> None:
    spec = parse_model_spec("torchvision:resnet18?num_classes=10&zero_init_residual=true")
    assert (spec.family, spec.name, spec.kwargs) == ("torchvision", "resnet18",
                                                     {"num_classes": 10, "zero_init_residual": True})
    assert spec.default_input_shape == (1, 3, 224, 224)
    assert parse_model_spec("training:lenet").default_input_shape == (1, 1, 28, 28)
    assert parse_model_spec("mypkg.models:make", ["width=0.5"]).kwargs == {"width": 0.5}
    assert parse_input_shape("1,3,32,32") == (1, 3, 32, 32)


@pytest.mark.parametrize(("spec", "message"), [
    ("lenet", "--model 'lenet' is not a model SPEC — use torchvision:NAME[?k=v&...], training:lenet|mlp|resnet18, "
              "or package.module:factory (your own code, imported and called on purpose)"),
    ("training:alexnet", "--model training:alexnet: unknown training model 'alexnet' — choose one of: lenet, mlp, "
                         "resnet18"),
    ("torchvision:resnet19", "--model torchvision:resnet19: torchvision has no model 'resnet19' — did you mean "),
    # a family that is not installed reads as module:function; json imports, and says what is missing
    ("json:lenet", "--model json:lenet: json has no lenet — and no model family 'json' is installed (families come "
                   "from installed packages' 'ckptool.models' entry points); name a function as "
                   "package.module:function\n"),
    ("torchvision:resnet18?weights=DEFAULT", "--model torchvision:resnet18?weights=DEFAULT: weights= would download "
                                             "weights — the checkpoint provides them; drop weights"),
    ("torchvision:resnet18?num_classes", "--model 'torchvision:resnet18?num_classes': argument 'num_classes' is not "
                                         "NAME=VALUE, e.g. num_classes=10"),
])
def test_bad_model_spec_is_a_usage_error(lenet_pt: Path, spec: str, message: str) -> None:
    result = invoke("verify", lenet_pt, "--model", spec, "--devices", "cpu", "--input-shape", "1,1,28,28")
    assert result.exit_code == 2
    assert result.stderr.startswith("ckptool: error: " + message)
    assert result.stderr.count("\n") == 1


def test_unreadable_checkpoint_exits_3(tmp_path: Path) -> None:
    result = invoke("verify", tmp_path / "missing.pt", "--model", "training:lenet")
    assert result.exit_code == 3
    assert result.stderr == f"ckptool: error: {tmp_path / 'missing.pt'}: does not exist — check the path\n"


def test_torchvision_model_with_input_shape(tmp_path: Path) -> None:
    spec = parse_model_spec("torchvision:resnet18?num_classes=10")
    torch.manual_seed(0)
    path = tmp_path / "resnet.pt"
    torch.save(spec.build().state_dict(), path)
    report = verify_module.verify(path, model_spec=spec, devices="cpu", input_shape="2,3,32,32")
    assert report.ok, report.failure
    assert report.model_class == "ResNet" and report.devices[0].argmax_agreement == 1.0
    assert report.devices[0].accuracy is None  # no test set outside the training: family


def test_user_factory_spec_imports_the_users_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "my_nets.py").write_text(
        "from torch import nn\n"
        "def tiny(width=4):\n"
        "    return nn.Sequential(nn.Linear(3, width), nn.ReLU(), nn.Linear(width, 2))\n"
    )
    monkeypatch.chdir(tmp_path)
    torch.manual_seed(0)
    path = tmp_path / "tiny.pt"
    torch.save(nn.Sequential(nn.Linear(3, 6), nn.ReLU(), nn.Linear(6, 2)).state_dict(), path)
    result = invoke("verify", path, "--model", "my_nets:tiny", "--model-arg", "width=6", "--input-shape", "5,3",
                    "--devices", "cpu", "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["model_class"] == "Sequential"
    missing_shape = invoke("verify", path, "--model", "my_nets:tiny", "--devices", "cpu")
    assert missing_shape.exit_code == 2
    assert missing_shape.stderr == ("ckptool: error: --model my_nets:tiny: say the input shape with --input-shape, "
                                    "e.g. 1,3,224,224\n")


def test_a_model_that_rejects_the_input_shape_is_a_usage_error(lenet_pt: Path) -> None:
    with pytest.raises(UsageError, match="the model fails on an input of shape 1,3,28,28"):
        verify_module.verify(lenet_pt, model_spec="training:lenet", devices="cpu", input_shape=(1, 3, 28, 28))


def test_verify_help_names_the_user_code_import() -> None:
    result = invoke("verify", "--help")
    assert result.exit_code == 0
    text = " ".join(result.output.split())
    assert "imports and runs YOUR code on purpose (never the checkpoint's)" in text
    assert "Example: ckptool verify" in text


def test_model_options_need_a_model(lenet_pt: Path) -> None:
    result = invoke("verify", lenet_pt, "--input-shape", "1,1,28,28", "--devices", "cpu")
    assert result.exit_code == 2
    assert result.stderr == "ckptool: error: --input-shape needs --model SPEC\n"


def test_weights_only_cpu_verify_streams_without_torch(tmp_path: Path) -> None:
    """The pipeline check (verify --against, CPU) reads bytes and never imports torch, also on a GPU machine."""
    import subprocess
    import sys

    import torch

    state = {"w": torch.tensor([1.0, float("nan"), float("inf")]), "b": torch.tensor([float("-inf")]).bfloat16(),
             "h": torch.tensor([float("nan"), 2.0]).half(), "i": torch.arange(3)}
    torch.save(state, tmp_path / "a.pt")
    torch.save(state, tmp_path / "b.pt")
    code = (
        "import sys\n"
        "if 'torch' in sys.modules: sys.exit('torch was imported before ckptool (by site-packages)')\n"
        "import ckptool, ckptool.model.devices\n"
        "ckptool.model.devices._accelerator_possible = lambda: True  # as where a GPU driver is installed\n"
        "r = ckptool.verify(sys.argv[1], devices='cpu', against=sys.argv[2], allow_nonfinite=True)\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
        "print(r.ok, sorted((k, v['nan'], v['inf']) for k, v in r.devices[0].nonfinite.items()))\n"
    )
    completed = subprocess.run([sys.executable, "-c", code, str(tmp_path / "a.pt"), str(tmp_path / "b.pt")],
                               capture_output=True, text=True)
    assert completed.returncode == 0, completed.stderr[-3000:]
    assert completed.stdout.strip() == "True [('b', 0, 1), ('h', 1, 0), ('w', 1, 1)]"


def test_against_counts_nan_and_inf_of_a_reading_it_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Weights-only CPU verify --against counts A's NaN/Inf in the same pass as the diff (A read once),
    with the same counts as verify without --against: in every chunk, in tensors the diff does not read
    (only in A, another shape), under the key A stores when a prefix is aligned."""
    import os

    comparison = importlib.import_module("ckptool.ops.diff")
    per_chunk = comparison.CHUNK_SIZE // 4
    big = torch.randn(per_chunk * 2 + 77)  # two full chunks and a partial one
    big[5], big[per_chunk + 3], big[-1] = float("nan"), float("-inf"), float("inf")
    state = {"big": big, "half": torch.tensor([float("nan"), 1.0]).half(),
             "bf": torch.tensor([float("inf"), -1.0, float("nan"), float("-inf")]).bfloat16(),
             "steps": torch.arange(3), "only_a": torch.tensor([float("nan"), float("nan")]),
             "reshaped": torch.tensor([1.0, float("inf"), 3.0, 4.0]), "clean": torch.ones(per_chunk + 1)}
    a, b = tmp_path / "a.pt", tmp_path / "b.safetensors"
    torch.save(state, a)
    other = {key: value.clone() for key, value in state.items() if key != "only_a"}
    other["big"] = torch.nan_to_num(big)  # B holds no NaN/Inf: the counts must come from A
    other["reshaped"] = other["reshaped"].reshape(2, 2)
    safetensors.torch.save_file(other, b)

    alone = verify_module.verify(a, devices="cpu")
    expected = {"big": {"nan": 1, "inf": 2}, "half": {"nan": 1, "inf": 0}, "bf": {"nan": 1, "inf": 2},
                "only_a": {"nan": 2, "inf": 0}, "reshaped": {"nan": 0, "inf": 1}}
    assert list(alone.devices[0].nonfinite.items()) == list(expected.items())

    read: dict[str, int] = {}
    names: dict[int, str] = {}
    real_open, real_preadv, real_pread = os.open, os.preadv, os.pread

    def opened(path: Any, *args: Any, **kwargs: Any) -> int:
        fd = real_open(path, *args, **kwargs)
        names[fd] = Path(path).name
        return fd

    def preadv(fd: int, buffers: Any, offset: int) -> int:
        got = real_preadv(fd, buffers, offset)
        read[names.get(fd, "?")] = read.get(names.get(fd, "?"), 0) + got
        return got

    def pread(fd: int, size: int, offset: int) -> bytes:
        data = real_pread(fd, size, offset)
        read[names.get(fd, "?")] = read.get(names.get(fd, "?"), 0) + len(data)
        return data

    monkeypatch.setattr(os, "open", opened)
    monkeypatch.setattr(os, "preadv", preadv)
    monkeypatch.setattr(os, "pread", pread)
    report = verify_module.verify(a, devices="cpu", against=b)
    monkeypatch.undo()

    assert list(report.devices[0].nonfinite.items()) == list(expected.items())
    assert report.notes == alone.notes == ["5 weight tensor(s) hold NaN or Inf: bf, big, half, only_a, reshaped"]
    weights = report.against.diff
    assert weights.to_json() == comparison.diff(a, b, align_prefixes=True).to_json()
    assert weights.only_in_a == ["only_a"]
    assert [(change.name, change.kinds) for change in weights.changed] == [("big", ["values"]),
                                                                          ("reshaped", ["shape"])]
    assert not report.ok and report.failure.startswith(f"against {b}: the weight keys differ")
    # every byte of A once (the diff's pass counted NaN/Inf), and of B's compared tensors once
    a_bytes = sum(value.numel() * value.element_size() for value in state.values())
    b_bytes = sum(value.numel() * value.element_size() for key, value in other.items() if key != "reshaped")
    assert read == {"a.pt": a_bytes, "b.safetensors": b_bytes}

    # a wrapper prefix on A: compared without it, counted under A's key
    ddp = tmp_path / "ddp.pt"
    torch.save({"module." + key: value for key, value in state.items() if key != "only_a"}, ddp)
    report = verify_module.verify(ddp, devices="cpu", against=b)
    assert report.against.diff.aligned == ("module.", "")
    assert [change.name for change in report.against.diff.changed] == ["big", "reshaped"]
    assert list(report.devices[0].nonfinite.items()) == \
        [("module." + key, counts) for key, counts in expected.items() if key != "only_a"]
    assert list(verify_module.verify(ddp, devices="cpu").devices[0].nonfinite.items()) == \
        list(report.devices[0].nonfinite.items())


def test_against_names_a_truncated_checkpoint_before_its_truncated_reference(tmp_path: Path) -> None:
    """In the fused pass B may fail first; the error still names A when A is unreadable too (as when A
    was read whole before the diff)."""
    from ckptool.base.errors import InputError
    from ckptool.io.reader import load

    x, y = torch.randn(70_000), torch.randn(70_000)
    a, b = tmp_path / "a.pt", tmp_path / "b.pt"
    torch.save({"x": x, "y": y}, a)  # y's bytes last in the file
    torch.save({"y": y, "x": x}, b)  # x's bytes last in the file
    left, right = load(a), load(b)
    os_truncate = __import__("os").truncate
    os_truncate(a, left.tensors["y"].contiguous_byte_range().offset + 10)
    os_truncate(b, right.tensors["x"].contiguous_byte_range().offset + 10)
    with pytest.raises(InputError, match="file is truncated") as caught:
        verify_module.check_cpu_weights_against(left, right, None)
    assert caught.value.path == a
