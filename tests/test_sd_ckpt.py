"""A Stable Diffusion v1 ``.ckpt`` (fixtures/wild/sd_v1_tiny.ckpt, made by fixtures/make_sd_ckpt.py).

Two things such a file needs. Its pickle names Lightning's ``ModelCheckpoint`` class as a dict key and never
calls it: every command reads it with no flag, ``scan`` still calls the class unknown, and a file that calls
it is refused. Its state dict holds LitEma's moving average beside the live weights (``model_ema.*``, named
without dots): ``--weights ema`` (``weights="ema"``) gives the weights as ldm's ``LitEma.copy_to`` leaves them,
``inspect`` lists that set beside ``state_dict``, and writes of it check out. What the weights should be is
computed here with torch alone — the mapping by hand, and the fixture's own modules running ``copy_to`` —
from ``torch.load(weights_only=False)`` with the ``ModelCheckpoint`` stand-in importable for the test.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import ckptool
from ckptool.ops.load_into import to_state_dict

torch = pytest.importorskip("torch")
safetensors_torch = pytest.importorskip("safetensors.torch")

REPO = Path(__file__).resolve().parent.parent
FIXTURE = REPO / "fixtures" / "wild" / "sd_v1_tiny.ckpt"
STANDINS = REPO / "fixtures" / "standins"
CALLBACK = "pytorch_lightning.callbacks.model_checkpoint.ModelCheckpoint"


@pytest.fixture
def sd_module(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """fixtures/make_sd_ckpt.py imported (its tiny LatentDiffusion and LitEma), with the ModelCheckpoint stand-in
    importable, for one test: sys.path and the modules it imported are put back after."""
    monkeypatch.syspath_prepend(str(STANDINS))
    monkeypatch.syspath_prepend(str(REPO / "fixtures"))
    before = set(sys.modules)
    import make_sd_ckpt

    try:
        yield make_sd_ckpt
    finally:
        for name in set(sys.modules) - before:
            del sys.modules[name]


def torch_checkpoint(path: Path) -> dict:
    """torch's own reading of the file (it imports the stand-in class the pickle names)."""
    return torch.load(path, weights_only=False, map_location="cpu")


def ema_by_hand(state_dict: dict) -> dict:
    """LitEma's mapping written out: ``model.<name>`` takes ``model_ema.<name without dots>`` where that exists,
    every ``model_ema.*`` entry dropped, everything else kept."""
    out = {}
    for key, value in state_dict.items():
        if key.startswith("model_ema."):
            continue
        shadow = "model_ema." + key[len("model."):].replace(".", "")
        out[key] = state_dict[shadow] if key.startswith("model.") and shadow in state_dict else value
    return out


def ema_by_copy_to(module: Any, state_dict: dict) -> dict:
    """What ldm's ``ema_scope`` leaves as the model's state dict: the module loaded, ``copy_to`` run, the EMA's own
    buffers left out."""
    model = module.LatentDiffusion()
    model.load_state_dict(state_dict)
    model.model_ema.copy_to(model.model)
    return {key: value for key, value in model.state_dict().items() if not key.startswith("model_ema.")}


def run(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "ckptool", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=300)


def assert_same(got: dict, expected: dict) -> None:
    assert list(got) == list(expected)
    for key, tensor in expected.items():
        assert got[key].dtype == tensor.dtype and torch.equal(got[key], tensor), key


def test_the_fixture_is_what_a_stable_diffusion_v1_ckpt_holds(sd_module: Any) -> None:
    checkpoint = torch_checkpoint(FIXTURE)
    assert set(checkpoint) == {"epoch", "global_step", "pytorch-lightning_version", "state_dict", "callbacks"}
    (callback,) = checkpoint["callbacks"]
    assert f"{callback.__module__}.{callback.__qualname__}" == CALLBACK
    state = checkpoint["state_dict"]
    assert state["model_ema.decay"].dtype == torch.float32 and float(state["model_ema.decay"]) == pytest.approx(0.9999)
    assert state["model_ema.num_updates"].dtype == torch.int32 and int(state["model_ema.num_updates"]) == 3
    assert "model_ema.diffusion_modelinput_blocks00weight" in state
    assert "model.diffusion_model.input_blocks.0.0.weight" in state
    assert any(key.startswith("first_stage_model.") for key in state)
    assert any(key.startswith("cond_stage_model.transformer.") for key in state)
    # the frozen parameter has no copy: its live value is the EMA set's too
    assert "model.diffusion_model.out.0.weight" in state and "model_ema.diffusion_modelout0weight" not in state
    with pytest.raises(Exception, match=f"Unsupported global: GLOBAL {CALLBACK}"):
        torch.load(FIXTURE, weights_only=True)


def test_the_mapping_by_hand_is_what_copy_to_leaves(sd_module: Any) -> None:
    state = torch_checkpoint(FIXTURE)["state_dict"]
    expected = ema_by_copy_to(sd_module, state)
    assert_same(ema_by_hand(state), expected)
    changed = [key for key in expected if not torch.equal(expected[key], state[key])]
    assert changed and all(key.startswith("model.diffusion_model.") for key in changed)


def test_inspect_reads_it_with_no_flag_and_lists_the_ema_beside_the_state_dict(tmp_path: Path) -> None:
    inspected = run("inspect", "--json", str(FIXTURE), cwd=tmp_path)
    assert inspected.returncode == 0, inspected.stderr
    report = json.loads(inspected.stdout)
    assert report["layout"] == ["state_dict"] and report["tensors"] == 79
    assert [(c["weights"], c["kind"], c["tensors"], c["chosen"]) for c in report["candidates"]] == [
        ("state_dict", "state dict", 79, True),
        ("ema", "EMA copy (LitEma)", 48, False),
    ]
    assert report["entries"]["callbacks"]["type"] == "dict" and CALLBACK in report["globals"]
    text = run("inspect", str(FIXTURE), cwd=tmp_path)
    assert text.returncode == 0, text.stderr
    assert "  weights set    ema  (EMA copy (LitEma), 48 tensors)  --weights ema\n" in text.stdout
    assert "  entry          callbacks: dict with 1 entries\n" in text.stdout
    chosen = json.loads(run("inspect", "--json", "--weights", "ema", str(FIXTURE), cwd=tmp_path).stdout)
    assert [(c["weights"], c["chosen"]) for c in chosen["candidates"]] == [("state_dict", False), ("ema", True)]
    assert chosen["tensors"] == 48 and chosen["layout"] == ["state_dict"] and chosen["prefix"] == ""


def test_scan_calls_the_class_unknown_and_says_ckptool_reads_it(tmp_path: Path) -> None:
    scanned = run("scan", "--json", str(FIXTURE), cwd=tmp_path)
    assert scanned.returncode == 1, scanned.stderr
    report = json.loads(scanned.stdout)
    assert report["verdict"] == "unknown" and report["unsafe"] == [CALLBACK] and report["readable"]
    text = run("scan", str(FIXTURE), cwd=tmp_path)
    assert f"  ! {CALLBACK}\n" in text.stdout and "ckptool reads the file with them as inert placeholders" in text.stdout


def test_the_default_weights_are_torchs_state_dict(sd_module: Any) -> None:
    expected = torch_checkpoint(FIXTURE)["state_dict"]
    checkpoint = ckptool.load(FIXTURE)
    assert checkpoint.derived is None
    assert_same(to_state_dict(checkpoint.tensors), dict(expected))


def test_the_ema_weights_are_what_copy_to_leaves(sd_module: Any) -> None:
    expected = ema_by_copy_to(sd_module, torch_checkpoint(FIXTURE)["state_dict"])
    checkpoint = ckptool.load(FIXTURE, weights="ema")
    assert checkpoint.derived == "ema" and checkpoint.selected
    assert_same(to_state_dict(checkpoint.tensors), expected)
    # chosen again from it: the sets of the file as read
    assert_same(to_state_dict(checkpoint.select_weights("state_dict").tensors),
                dict(torch_checkpoint(FIXTURE)["state_dict"]))


@pytest.mark.parametrize("suffix", [".safetensors", ".pt"])
def test_convert_writes_the_ema_weights(tmp_path: Path, sd_module: Any, suffix: str) -> None:
    original = torch_checkpoint(FIXTURE)
    expected = ema_by_hand(original["state_dict"])
    out = tmp_path / f"ema{suffix}"
    converted = run("convert", "--weights", "ema", str(FIXTURE), "-o", str(out), cwd=tmp_path)
    assert converted.returncode == 0, converted.stderr
    assert "checked: all 48 tensors re-read from the output, identical" in converted.stdout
    if suffix == ".safetensors":
        written = safetensors_torch.load_file(str(out))
        assert set(written) == set(expected)
        assert_same({key: written[key] for key in expected}, expected)
    else:  # the container kept, its state dict the EMA set: what EMA-extraction scripts write
        written_checkpoint = torch_checkpoint(out)
        assert {key: value for key, value in written_checkpoint.items() if key != "state_dict"} == {
            key: value for key, value in original.items() if key != "state_dict"}
        assert_same(dict(written_checkpoint["state_dict"]), expected)
        again = run("inspect", "--json", str(out), cwd=tmp_path)  # the output reads with no flag, no EMA left
        assert again.returncode == 0 and [c["weights"] for c in json.loads(again.stdout)["candidates"]] == ["state_dict"]
    fingerprints = {
        json.loads(run("inspect", "--json", "--fingerprint", *args, cwd=tmp_path).stdout)["fingerprint"]
        for args in (["--weights", "ema", str(FIXTURE)], [str(out)])
    }
    assert len(fingerprints) == 1


def test_strip_and_the_other_writes_take_the_ema_weights(tmp_path: Path, sd_module: Any) -> None:
    expected = ema_by_hand(torch_checkpoint(FIXTURE)["state_dict"])
    stripped = tmp_path / "stripped.pt"
    done = run("strip", "--weights", "ema", "--prefix", "model.", str(FIXTURE), "-o", str(stripped), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    renamed = {key[len("model."):] if key.startswith("model.") else key: value for key, value in expected.items()}
    assert_same(dict(torch_checkpoint(stripped)["state_dict"]), renamed)
    remapped = tmp_path / "remapped.pt"
    done = run("remap", "--weights", "ema", "--to", "cpu", str(FIXTURE), "-o", str(remapped), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert_same(dict(torch_checkpoint(remapped)["state_dict"]), expected)


def test_a_file_that_calls_the_class_is_refused(tmp_path: Path, sd_module: Any) -> None:
    from pytorch_lightning.callbacks.model_checkpoint import ModelCheckpoint

    class Called:
        def __reduce__(self) -> tuple:
            return (ModelCheckpoint, ())  # pickled as REDUCE of the class: loading it calls ModelCheckpoint()

    checkpoint = torch_checkpoint(FIXTURE)
    checkpoint["callbacks"] = {ModelCheckpoint: {"monitor": None}, "made": Called()}
    path = tmp_path / "called.ckpt"
    torch.save(checkpoint, path)
    for command in (["inspect"], ["convert", "-o", str(tmp_path / "x.safetensors")], ["inspect", "--weights", "ema"]):
        refused = run(command[0], str(path), *command[1:], cwd=tmp_path)
        assert refused.returncode == 3
        assert refused.stderr == (
            f"ckptool: error: {path}: pickle imports {CALLBACK}, which could run code — refused, nothing was "
            f"executed (if you trust this file, allow it by name: --allow-global {CALLBACK})\n"
        )
    scanned = run("scan", "--json", str(path), cwd=tmp_path)
    assert scanned.returncode == 1 and json.loads(scanned.stdout)["readable"] is False


def test_an_ema_copy_that_does_not_fit_its_weight_is_refused(tmp_path: Path, sd_module: Any) -> None:
    checkpoint = torch_checkpoint(FIXTURE)
    state = checkpoint["state_dict"]
    state["model_ema.diffusion_modelinput_blocks00weight"] = state["model_ema.diffusion_modelinput_blocks00weight"][:1]
    path = tmp_path / "misfit.ckpt"
    torch.save(checkpoint, path)
    assert run("inspect", str(path), cwd=tmp_path).returncode == 0  # the live weights read as ever
    refused = run("convert", "--weights", "ema", str(path), "-o", str(tmp_path / "x.safetensors"), cwd=tmp_path)
    assert refused.returncode == 3
    assert ("the EMA copy 'model_ema.diffusion_modelinput_blocks00weight' is F32[1, 4, 3, 3] but the weight "
            "'model.diffusion_model.input_blocks.0.0.weight' it stands for is F32[4, 4, 3, 3]") in refused.stderr


def test_a_key_named_ema_is_what_the_name_chooses(tmp_path: Path, sd_module: Any) -> None:
    checkpoint = torch_checkpoint(FIXTURE)
    checkpoint["ema"] = {"w": torch.ones(3)}
    path = tmp_path / "with_ema_key.ckpt"
    torch.save(checkpoint, path)
    chosen = ckptool.load(path, weights="ema")
    assert chosen.layout == ("ema",) and chosen.derived is None and list(chosen.tensors) == ["w"]
    listed = json.loads(run("inspect", "--json", str(path), cwd=tmp_path).stdout)["candidates"]
    assert [(c["weights"], c["kind"]) for c in listed] == [("state_dict", "state dict"), ("ema", "state dict")]


def test_a_state_dict_without_litema_has_no_ema_set(tmp_path: Path) -> None:
    path = tmp_path / "plain.pt"
    torch.save({"state_dict": {"model.w": torch.ones(2), "model_ema.w": torch.zeros(2)}}, path)  # no decay
    with pytest.raises(ckptool.CkptError, match="no weights at 'ema'"):
        ckptool.load(path, weights="ema")
