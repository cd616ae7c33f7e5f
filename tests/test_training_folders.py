"""Training folders as inputs, and an optimizer's state as safetensors (``--weights state``).

The folders are written the way the frameworks write them, with real torch objects: a
transformers ``Trainer`` ``checkpoint-N/`` (``save_file``'d or ``torch.save``'d weights, sharded
too; ``optimizer.pt`` of an ``AdamW`` after a real step, ``scheduler.pt`` of a ``LambdaLR``,
``rng_state.pth`` as transformers writes it, ``trainer_state.json``, a ``training_args.bin``
pickled from a stand-in ``TrainingArguments`` in a package named like transformers') and an
accelerate ``save_state`` folder (two models, two optimizers, ``random_states_0.pkl`` with the
step, ``custom_checkpoint_0.pkl``). Every command runs on each; the weights ckptool reads from a
folder must equal torch's reading of the weight file.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors import safe_open
from safetensors.torch import load_file
from standins import TRANSFORMERS

import ckptool
from ckptool.base import jsonout
from ckptool.cli.main import main
from ckptool.ops.load_into import to_state_dict

BUILD = """
    import json, os, random, sys
    import numpy as np, torch
    from safetensors.torch import save_file, save_model
    from transformers.training_args import TrainingArguments, OptimizerNames

    def model():
        return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))

    def trained(seed, optimizer_class=torch.optim.AdamW, **options):
        torch.manual_seed(seed)
        net = model()
        optimizer = optimizer_class(net.parameters(), **options)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1 - step / 10)
        net(torch.randn(2, 4)).sum().backward()
        optimizer.step()
        scheduler.step()
        return net, optimizer, scheduler

    def trainer_files(folder, optimizer, scheduler, step, ranks=1):
        torch.save(optimizer.state_dict(), f"{folder}/optimizer.pt")
        torch.save(scheduler.state_dict(), f"{folder}/scheduler.pt")
        for rank in range(ranks):  # transformers: rng_state.pth, or one rng_state_N.pth per process
            name = "rng_state.pth" if ranks == 1 else f"rng_state_{rank}.pth"
            torch.save({"python": random.getstate(), "numpy": np.random.get_state(),
                        "cpu": torch.random.get_rng_state()}, f"{folder}/{name}")
        json.dump({"best_metric": None, "best_model_checkpoint": None, "epoch": 1.5, "global_step": step,
                   "log_history": [{"epoch": 0.5, "loss": 1.25, "step": 10}, {"epoch": 1.0, "loss": 0.5, "step": 20}],
                   "max_steps": 2 * step, "num_train_epochs": 3, "total_flos": 1.0, "trial_name": None},
                  open(f"{folder}/trainer_state.json", "w"), indent=2)
        torch.save(TrainingArguments(output_dir="runs/x", optim=OptimizerNames.ADAMW_TORCH), f"{folder}/training_args.bin")
        json.dump({"model_type": "toy", "architectures": ["Toy"]}, open(f"{folder}/config.json", "w"))

    # transformers Trainer, safetensors weights (the default)
    net, optimizer, scheduler = trained(0, lr=5e-5)
    folder = f"{OUT}/trainer/checkpoint-500"
    os.makedirs(folder)
    save_file(net.state_dict(), f"{folder}/model.safetensors", metadata={"format": "pt"})
    trainer_files(folder, optimizer, scheduler, 500)
    torch.save({"scale": 65536.0, "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 2000,
                "_growth_tracker": 0}, f"{folder}/scaler.pt")  # GradScaler.state_dict()

    # transformers Trainer, save_safetensors=False, two processes, SGD with momentum
    net, optimizer, scheduler = trained(1, torch.optim.SGD, lr=0.1, momentum=0.9)
    folder = f"{OUT}/trainer_bin/checkpoint-2"
    os.makedirs(folder)
    torch.save(net.state_dict(), f"{folder}/pytorch_model.bin")
    trainer_files(folder, optimizer, scheduler, 2, ranks=2)

    # transformers Trainer, sharded safetensors weights
    net, optimizer, scheduler = trained(2, lr=1e-3)
    folder = f"{OUT}/trainer_sharded/checkpoint-4"
    os.makedirs(folder)
    state = net.state_dict()
    names = list(state)
    shards = {"model-00001-of-00002.safetensors": names[:2], "model-00002-of-00002.safetensors": names[2:]}
    for shard, keys in shards.items():
        save_file({key: state[key] for key in keys}, f"{folder}/{shard}", metadata={"format": "pt"})
    json.dump({"metadata": {"total_size": 92}, "weight_map": {key: shard for shard, keys in shards.items() for key in keys}},
              open(f"{folder}/model.safetensors.index.json", "w"))
    trainer_files(folder, optimizer, scheduler, 4)

    # accelerate save_state: two models (model.safetensors, model_1.safetensors), two optimizers
    net, optimizer, scheduler = trained(3, lr=1e-3)
    second, optimizer_1, _ = trained(4, torch.optim.SGD, lr=0.1, momentum=0.5)
    folder = f"{OUT}/accelerate"
    os.makedirs(folder)
    save_model(net, f"{folder}/model.safetensors")
    save_model(second, f"{folder}/model_1.safetensors")
    torch.save(optimizer.state_dict(), f"{folder}/optimizer.bin")
    torch.save(optimizer_1.state_dict(), f"{folder}/optimizer_1.bin")
    torch.save(scheduler.state_dict(), f"{folder}/scheduler.bin")
    torch.save({"step": 7, "random_state": random.getstate(), "numpy_random_seed": np.random.get_state(),
                "torch_manual_seed": torch.get_rng_state()}, f"{folder}/random_states_0.pkl")
    ema = {key: value * 0.5 for key, value in net.state_dict().items()}
    torch.save(ema, f"{folder}/custom_checkpoint_0.pkl")  # register_for_checkpointing(ema).state_dict()

    # accelerate save_state, safe_serialization=False, two processes
    net, optimizer, scheduler = trained(5, lr=1e-3)
    folder = f"{OUT}/accelerate_bin"
    os.makedirs(folder)
    torch.save(net.state_dict(), f"{folder}/pytorch_model.bin")
    torch.save(optimizer.state_dict(), f"{folder}/optimizer.bin")
    torch.save(scheduler.state_dict(), f"{folder}/scheduler.bin")
    for rank in range(2):
        torch.save({"step": 3, "random_state": random.getstate(), "numpy_random_seed": np.random.get_state(),
                    "torch_manual_seed": torch.get_rng_state()}, f"{folder}/random_states_{rank}.pkl")

    # training state without the model (the weights saved elsewhere)
    folder = f"{OUT}/state_only"
    os.makedirs(folder)
    torch.save(optimizer.state_dict(), f"{folder}/optimizer.bin")
    torch.save(scheduler.state_dict(), f"{folder}/scheduler.bin")
    """

# the weights file of each folder, as torch reads it
FOLDERS = {
    "trainer/checkpoint-500": "model.safetensors",
    "trainer_bin/checkpoint-2": "pytorch_model.bin",
    "trainer_sharded/checkpoint-4": "model.safetensors.index.json",
    "accelerate": "model.safetensors",
    "accelerate_bin": "pytorch_model.bin",
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Every folder, written once by a throwaway interpreter that can import the stand-in transformers."""
    root = tmp_path_factory.mktemp("runs")
    modules = root / "stand_ins"
    for relative, source in TRANSFORMERS.items():
        (modules / relative).parent.mkdir(parents=True, exist_ok=True)
        (modules / relative).write_text(textwrap.dedent(source))
    out = root / "out"
    code = f"import sys\nsys.path.insert(0, {str(modules)!r})\nOUT = {str(out)!r}\n" + textwrap.dedent(BUILD)
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300)
    return out


def run(*args: object) -> tuple[int, str, str]:
    result = CliRunner().invoke(main, [str(a) for a in args])
    return result.exit_code, result.stdout, result.stderr


def torch_weights(folder: Path, name: str) -> dict[str, torch.Tensor]:
    """The folder's weights as torch and safetensors read them."""
    if name.endswith(".index.json"):
        index = json.loads((folder / name).read_text())
        found: dict[str, torch.Tensor] = {}
        for shard in sorted(set(index["weight_map"].values())):
            found.update(load_file(folder / shard))
        return found
    if name.endswith(".safetensors"):
        return load_file(folder / name)
    return torch.load(folder / name, weights_only=True)


def assert_same(expected: dict[str, torch.Tensor], got: dict[str, torch.Tensor]) -> None:
    assert list(got) == list(expected) or set(got) == set(expected)
    for key, tensor in expected.items():
        assert got[key].dtype == tensor.dtype and torch.equal(got[key], tensor), key


def same_structure(a: object, b: object) -> bool:
    """Nested equality of what torch.load gives (tensors by value and dtype)."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return list(a) == list(b) and all(same_structure(a[key], b[key]) for key in a)
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(same_structure(x, y) for x, y in zip(a, b, strict=True))
    return a == b


# ------------------------------------------------------------------------------------------------ inspect


def test_inspect_lists_what_a_trainer_checkpoint_holds(runs: Path) -> None:
    folder = runs / "trainer/checkpoint-500"
    code, out, err = run("inspect", folder)
    assert code == 0, err
    assert "a directory without a checkpoint" not in out + err
    lines = out.splitlines()
    assert "  folder         transformers Trainer checkpoint: weights from model.safetensors" in lines
    assert "  tensors        4  (23 parameters, 92 B; F32: 4)" in lines
    assert "  step           500  (trainer_state.json)" in lines
    assert ("  optimizer      optimizer.pt: optimizer state: 4 params over 1 parameter group, 12 tensors "
            "(AdamW: step, exp_avg, exp_avg_sq), 200 B") in lines
    assert "  scheduler      scheduler.pt: learning-rate schedule: last_epoch 1, lr [4.5e-05], base [5e-05]" in lines
    assert "  rng state      rng_state.pth: random number generator states: python, numpy, cpu" in lines
    assert ("  trainer state  trainer_state.json: trainer state: global_step 500 of 1000, epoch 1.5, "
            "2 log entries") in lines
    assert "  grad scaler    scaler.pt: gradient scaler state: scale 65536" in lines
    assert "  model config   config.json: model config: model_type 'toy', architectures ['Toy']" in lines
    assert "  weights set    state  (optimizer state, 12 tensors)  --weights state" in lines
    # training_args.bin needs trust: said, with the flags that read it, and the folder is read anyway
    args_line = next(line for line in lines if line.startswith("  training args"))
    assert "transformers.training_args.TrainingArguments" in args_line and "need trust" in args_line
    assert f"fix: ckptool inspect {folder} --allow-global 'transformers.*'" in out \
        or f"fix: ckptool inspect {folder} --allow-global transformers." in out
    assert not any(name.startswith("transformers") for name in sys.modules)  # nothing imported


def test_inspect_json_and_trusted_training_args(runs: Path) -> None:
    jsonschema = pytest.importorskip("jsonschema", reason="jsonschema is in the test extra: pip install -e '.[test]'")
    folder = runs / "trainer/checkpoint-500"
    code, out, err = run("inspect", folder, "--json", "--allow-global", "transformers.*")
    assert code == 0, err
    data = json.loads(out)
    jsonschema.validate(data, jsonout.schema("inspect"), cls=jsonschema.Draft202012Validator)
    state = data["training_folder"]
    assert state["kind"] == "transformers Trainer checkpoint" and state["weights_files"] == ["model.safetensors"]
    assert (state["step"], state["step_from"]) == (500, "trainer_state.json")
    files = {file["file"]: file for file in state["files"]}
    assert [files[name]["role"] for name in ("optimizer.pt", "scheduler.pt", "rng_state.pth", "trainer_state.json",
                                              "training_args.bin", "scaler.pt", "config.json")] == [
        "optimizer", "scheduler", "rng state", "trainer state", "training args", "grad scaler", "model config"]
    optimizer = files["optimizer.pt"]["details"]
    assert (optimizer["optimizer"], optimizer["params"], optimizer["param_groups"], optimizer["tensors"]) == \
        ("AdamW", 4, 1, 12)
    assert files["scheduler.pt"]["details"]["last_epoch"] == 1
    assert files["rng_state.pth"]["details"]["generators"] == ["python", "numpy", "cpu"]
    args = files["training_args.bin"]
    assert args["needs"] == [] and args["details"]["class"] == "transformers.training_args.TrainingArguments"
    assert args["details"]["values"]["learning_rate"] == 5e-5 and args["details"]["values"]["optim"] == "adamw_torch"
    assert data["hints"] == []
    code, out, _ = run("inspect", folder, "--json")
    needs = {file["file"]: file["needs"] for file in json.loads(out)["training_folder"]["files"]}
    assert "transformers.training_args.TrainingArguments" in needs["training_args.bin"]
    assert not any(name.startswith("transformers") for name in sys.modules)


def test_accelerate_folder_with_two_models(runs: Path) -> None:
    folder = runs / "accelerate"
    code, out, err = run("inspect", folder, "--json")
    assert code == 0, err
    data = json.loads(out)
    assert data["training_folder"]["kind"] == "accelerate save_state folder"
    assert (data["training_folder"]["step"], data["training_folder"]["step_from"]) == (7, "random_states_0.pkl")
    assert [(c["weights"], c["kind"], c["tensors"], c["chosen"]) for c in data["candidates"]] == [
        ("model.safetensors", "state dict", 4, True), ("model_1.safetensors", "state dict", 4, False),
        ("state", "optimizer state", 12, False), ("optimizer_1.bin", "optimizer state", 4, False)]
    roles = {file["file"]: file["role"] for file in data["training_folder"]["files"]}
    assert roles == {"optimizer.bin": "optimizer", "optimizer_1.bin": "optimizer", "scheduler.bin": "scheduler",
                     "random_states_0.pkl": "rng state", "custom_checkpoint_0.pkl": "custom state"}
    # each model, by the name inspect gives it; the EMA a framework keeps in a custom checkpoint too
    for weights, file in (("model_1", "model_1.safetensors"), ("model_1.safetensors", "model_1.safetensors"),
                          (None, "model.safetensors")):
        loaded = ckptool.load(folder, weights=weights)
        assert_same(load_file(folder / file), to_state_dict(loaded.tensors))
    ema = ckptool.load(folder, weights="custom_checkpoint_0")
    assert_same(torch.load(folder / "custom_checkpoint_0.pkl", weights_only=True), to_state_dict(ema.tensors))
    out_path = folder.parent / "second.safetensors"
    code, _, err = run("convert", folder, "-o", out_path, "--weights", "model_1")
    assert code == 0, err
    assert_same(load_file(folder / "model_1.safetensors"), load_file(out_path))
    code, out, err = run("inspect", folder, "--weights", "nothing")
    assert code == 3 and out == "" and err.count("\n") == 1
    assert "model.safetensors, model_1.safetensors, optimizer.bin, optimizer_1.bin" in err and "--weights PATH" in err


@pytest.mark.parametrize("name", sorted(FOLDERS))
def test_weights_read_from_a_folder_equal_torchs(runs: Path, name: str) -> None:
    folder = runs / name
    checkpoint = ckptool.load(folder)
    assert checkpoint.folder is not None and checkpoint.path == folder
    assert_same(torch_weights(folder, FOLDERS[name]), to_state_dict(checkpoint.tensors))


# ------------------------------------------------------------------------------------------------ every command


@pytest.mark.parametrize("name", sorted(FOLDERS))
def test_every_command_on_each_folder(runs: Path, name: str, tmp_path: Path) -> None:
    folder = runs / name
    expected = torch_weights(folder, FOLDERS[name])
    before = {path: path.read_bytes() for path in folder.iterdir()}

    code, out, err = run("inspect", folder, "--fingerprint")
    assert code == 0, err
    fingerprint = next(line.split()[1] for line in out.splitlines() if line.startswith("  fingerprint"))

    code, out, err = run("scan", folder, "--json")
    report = json.loads(out)
    trainer = name.startswith("trainer")
    assert (code, report["verdict"]) == ((1, "unknown") if trainer else (0, "safe")), err
    if trainer:  # training_args.bin's classes: unknown, never dangerous
        assert report["verdicts"]["transformers.training_args.TrainingArguments"] == "unknown"
        assert report["dangerous"] == [] and report["readable"] is False  # the flags read it, as inert data
        assert any(problem.startswith("training_args.bin: unknown (transformers.training_args.TrainingArguments")
                   for problem in report["problems"]), report["problems"]
    assert any(label.startswith("optimizer") for label in report["pickles"])

    code, out, err = run("convert", folder, "-o", tmp_path / "model.safetensors", "--fingerprint")
    assert code == 0, err
    assert_same(expected, load_file(tmp_path / "model.safetensors"))
    assert fingerprint in out

    code, _, err = run("add-prefix", folder, "-o", tmp_path / "ddp.pt")
    assert code == 0, err
    written = torch.load(tmp_path / "ddp.pt", weights_only=True)
    assert_same({f"module.{key}": value for key, value in expected.items()}, written)
    code, _, err = run("strip", tmp_path / "ddp.pt", "-o", tmp_path / "plain.pt")
    assert code == 0, err
    code, out, err = run("strip", folder, "-o", tmp_path / "nothing.pt")
    assert code == 1 and "nothing to strip" in err and not (tmp_path / "nothing.pt").exists()

    code, out, err = run("remap", folder, "-o", tmp_path / "cpu.pt", "--to", "cpu")
    if FOLDERS[name].endswith(".bin"):
        assert code == 0, err
        assert_same(expected, torch.load(tmp_path / "cpu.pt", weights_only=True))
    else:  # safetensors weights keep no device tags
        assert code == 2 and "no device tags" in err

    code, out, err = run("verify", folder)
    assert code == 0, err
    code, out, err = run("diff", folder, tmp_path / "plain.pt")
    assert code == 0, err
    code, out, err = run("diff", folder, tmp_path / "ddp.pt")
    assert code == 1

    code, out, err = run("convert", folder, "-o", tmp_path / "state.safetensors", "--weights", "state")
    assert code == 0, err
    assert {file: file.read_bytes() for file in folder.iterdir()} == before  # the input never touched


def test_in_place_rewrites_the_folders_weights_file(runs: Path, tmp_path: Path) -> None:
    folder = tmp_path / "accelerate_bin"
    folder.mkdir()
    for file in (runs / "accelerate_bin").iterdir():
        (folder / file.name).write_bytes(file.read_bytes())
    expected = torch.load(folder / "pytorch_model.bin", weights_only=True)
    code, out, err = run("add-prefix", folder, "--in-place")
    assert code == 0, err
    assert f"-> {folder / 'pytorch_model.bin'}" in out
    assert list(torch.load(folder / "pytorch_model.bin", weights_only=True)) == [f"module.{k}" for k in expected]
    assert sorted(path.name for path in folder.iterdir()) == sorted(path.name for path in (runs / "accelerate_bin")
                                                                    .iterdir())


def test_folder_without_model_weights(runs: Path, tmp_path: Path) -> None:
    folder = runs / "state_only"
    code, out, err = run("inspect", folder)
    assert code == 0, err
    assert "  folder         accelerate save_state folder: no model weights" in out
    assert "no model weights in this folder" in out
    assert f"fix: ckptool convert {folder} -o {folder.parent / 'state_only.optimizer.safetensors'} --weights state" \
        in out
    code, out, err = run("convert", folder, "-o", tmp_path / "x.safetensors")
    assert code == 3 and out == "" and err.count("\n") == 1 and not (tmp_path / "x.safetensors").exists()
    code, out, err = run("convert", folder, "-o", tmp_path / "state.safetensors", "--weights", "state")
    assert code == 0, err
    with safe_open(tmp_path / "state.safetensors", "pt") as handle:
        assert sorted(handle.keys())[:3] == ["state.0.exp_avg", "state.0.exp_avg_sq", "state.0.step"]


def test_scan_judges_every_pickle_of_a_folder(runs: Path, tmp_path: Path) -> None:
    folder = tmp_path / "accelerate"
    folder.mkdir()
    for file in (runs / "accelerate").iterdir():
        (folder / file.name).write_bytes(file.read_bytes())
    # a hostile custom state: a pickle that would call os.system (never run)
    (folder / "custom_checkpoint_1.pkl").write_bytes(b"\x80\x02cos\nsystem\nX\x04\x00\x00\x00trueq\x00\x85R.")
    code, out, err = run("scan", folder, "--json")
    report = json.loads(out)
    assert code == 1 and report["verdict"] == "dangerous", out
    assert [name.split(".")[-1] for name in report["dangerous"]] == ["system"]
    assert any(label.startswith("custom_checkpoint_1.pkl") for label in report["pickles"])
    assert [problem.split(" (")[0] for problem in report["problems"]] == ["custom_checkpoint_1.pkl: dangerous"]
    code, out, err = run("inspect", folder)  # the weights are read; the file is named, loudly
    assert code == 0, err
    assert "custom_checkpoint_1.pkl names globals known to run code" in out
    assert ckptool.load(folder).tensors


def test_links_leaving_the_folder_are_refused(runs: Path, tmp_path: Path) -> None:
    folder = tmp_path / "run"
    folder.mkdir()
    for file in (runs / "accelerate_bin").iterdir():
        (folder / file.name).write_bytes(file.read_bytes())
    outside = tmp_path / "elsewhere.bin"
    outside.write_bytes((folder / "optimizer.bin").read_bytes())
    (folder / "optimizer.bin").unlink()
    os.symlink(outside, folder / "optimizer.bin")
    code, out, err = run("inspect", folder)  # the weights are fine; the linked file is not read
    assert code == 0, err
    assert "optimizer.bin: unreadable: optimizer.bin is a link to" in out
    code, out, err = run("scan", folder)
    assert code == 3 and out == "" and err.count("\n") == 1 and "outside the folder" in err
    code, out, err = run("convert", folder, "-o", tmp_path / "x.safetensors", "--weights", "state")
    assert code == 3 and "outside the folder" in err and not (tmp_path / "x.safetensors").exists()


def test_a_training_folder_in_a_hub_cache_snapshot(runs: Path, tmp_path: Path) -> None:
    repo = tmp_path / "models--org--run"
    snapshot = repo / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    (repo / "blobs").mkdir()
    for number, file in enumerate(sorted((runs / "trainer/checkpoint-500").iterdir())):
        blob = repo / "blobs" / f"sha{number}"
        blob.write_bytes(file.read_bytes())
        os.symlink(f"../../blobs/sha{number}", snapshot / file.name)
    code, out, err = run("inspect", snapshot)
    assert code == 0, err
    assert "step           500" in out and "unreadable" not in out
    assert_same(load_file(runs / "trainer/checkpoint-500/model.safetensors"),
                to_state_dict(ckptool.load(snapshot).tensors))


# ------------------------------------------------------------------------------------------------ --weights state


def stepped(optimizer_class: type, **options: object) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(7)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    groups = [{"params": model[0].parameters()}, {"params": model[1].parameters(), "lr": 0.01}]
    optimizer = optimizer_class(groups, **options)
    for _ in range(2):
        optimizer.zero_grad()
        model(torch.randn(5, 3)).pow(2).sum().backward()
        optimizer.step()
    return model, optimizer


@pytest.mark.parametrize(("optimizer_class", "options", "per_parameter"), [
    (torch.optim.AdamW, {"lr": 1e-3}, ["exp_avg", "exp_avg_sq", "step"]),
    (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}, ["momentum_buffer"]),
    (torch.optim.Adam, {"lr": 1e-3, "amsgrad": True}, ["exp_avg", "exp_avg_sq", "max_exp_avg_sq", "step"]),
])
def test_weights_state_round_trip(tmp_path: Path, optimizer_class: type, options: dict,
                                  per_parameter: list[str]) -> None:
    model, optimizer = stepped(optimizer_class, **options)
    source = tmp_path / "optimizer.pt"
    torch.save(optimizer.state_dict(), source)
    saved = torch.load(source, weights_only=True)

    code, out, err = run("inspect", source, "--weights", "state", "--fingerprint", "--json")
    assert code == 0, err
    fingerprint = json.loads(out)["fingerprint"]
    code, out, err = run("convert", source, "-o", tmp_path / "state.safetensors", "--weights", "state", "--fingerprint",
                         "--json")
    assert code == 0, err
    assert json.loads(out)["converted"][0]["fingerprint"] == fingerprint
    with safe_open(tmp_path / "state.safetensors", "pt") as handle:
        names = sorted(handle.keys())
        metadata = handle.metadata()
        assert names == sorted(f"state.{index}.{name}" for index in range(4) for name in per_parameter)
        for name in names:  # each tensor as torch saved it, the scalar step too
            _, index, key = name.split(".")
            assert torch.equal(handle.get_tensor(name), saved["state"][int(index)][key])
    assert metadata["ckptool.fingerprint"] == fingerprint
    assert '"param_groups"' in metadata["ckptool.entries"] and '"lr":0.01' in metadata["ckptool.entries"]

    code, out, err = run("convert", tmp_path / "state.safetensors", "-o", tmp_path / "back.pt")
    assert code == 0, err
    back = torch.load(tmp_path / "back.pt", weights_only=True)
    assert same_structure(saved, back)
    # the optimizer takes it and steps exactly as the original does
    model_b = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    model_b.load_state_dict(model.state_dict())
    optimizer_b = optimizer_class([{"params": model_b[0].parameters()}, {"params": model_b[1].parameters()}],
                                  **options)
    optimizer_b.load_state_dict(back)
    batch = torch.randn(5, 3)
    for net, opt in ((model, optimizer), (model_b, optimizer_b)):
        opt.zero_grad()
        net(batch).pow(2).sum().backward()
        opt.step()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), model_b.parameters(), strict=True))

    code, out, err = run("diff", source, tmp_path / "state.safetensors", "--weights", "state")
    assert code == 0, err


def test_weights_state_inside_a_training_container(tmp_path: Path) -> None:
    model, optimizer = stepped(torch.optim.AdamW, lr=1e-3)
    source = tmp_path / "run.pt"
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "epoch": 3}, source)
    code, out, err = run("inspect", source)
    assert code == 0, err
    assert "weights set    optimizer  (optimizer state, 12 tensors)  --weights optimizer" in out
    for weights in ("optimizer", "optimizer.state"):
        out_path = tmp_path / f"{weights}.safetensors"
        code, _, err = run("convert", source, "-o", out_path, "--weights", weights)
        assert code == 0, err
        with safe_open(out_path, "pt") as handle:
            assert "state.0.exp_avg" in handle.keys()
    code, _, err = run("convert", tmp_path / "optimizer.safetensors", "-o", tmp_path / "back.pt")
    assert code == 0, err
    back = torch.load(tmp_path / "back.pt", weights_only=True)
    assert list(back) == ["optimizer", "epoch"] and back["epoch"] == 3  # the model's tensors stay in the .pt
    assert same_structure(back["optimizer"], torch.load(source, weights_only=True)["optimizer"])


def test_renaming_an_optimizers_tensors_is_refused(tmp_path: Path) -> None:
    _, optimizer = stepped(torch.optim.AdamW, lr=1e-3)
    source = tmp_path / "optimizer.pt"
    torch.save(optimizer.state_dict(), source)
    for command in (["add-prefix", source, "-o", tmp_path / "x.pt"],
                    ["convert", source, "-o", tmp_path / "x.safetensors", "--dtype", "bf16"]):
        code, out, err = run(*command, "--weights", "state")
        assert code == 2 and out == "" and err.count("\n") == 1 and "optimizer's state" in err, command
    assert not (tmp_path / "x.pt").exists() and not (tmp_path / "x.safetensors").exists()


def test_a_training_runs_other_files_say_what_they_are(runs: Path) -> None:
    folder = runs / "trainer/checkpoint-500"
    for name, said in (("scheduler.pt", "learning-rate schedule: last_epoch 1"),
                       ("rng_state.pth", "random number generator states: python, numpy, cpu"),
                       ("scaler.pt", "gradient scaler state: scale 65536"),
                       ("optimizer.pt", "optimizer state: 4 params over 1 parameter group, 12 tensors (AdamW:")):
        code, out, err = run("inspect", folder / name)
        assert code == 0, err
        assert "no model weights: this file is" in out and said in out, name
        assert "no weights found" not in out
    code, out, err = run("inspect", runs / "accelerate/random_states_0.pkl")
    assert code == 0 and "random_state, numpy_random_seed, torch_manual_seed (step 7)" in out, err


def test_fsdp_weights_as_a_dcp_sub_folder(tmp_path: Path) -> None:
    """accelerate under FSDP saves the model as a DCP folder, pytorch_model_fsdp_0/, beside optimizer.bin."""
    import warnings

    import torch.distributed.checkpoint as dcp

    model, optimizer = stepped(torch.optim.AdamW, lr=1e-3)
    folder = tmp_path / "fsdp_state"
    folder.mkdir()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "torch.distributed is disabled ... save in a single process"
        dcp.save({"model": model.state_dict()}, checkpoint_id=folder / "pytorch_model_fsdp_0", no_dist=True)
    torch.save(optimizer.state_dict(), folder / "optimizer.bin")
    torch.save({"step": 2}, folder / "random_states_0.pkl")
    code, out, err = run("inspect", folder)
    assert code == 0, err
    assert "accelerate save_state folder: weights from pytorch_model_fsdp_0" in out and "step           2" in out
    code, out, err = run("scan", folder)
    assert code == 0, out + err
    assert_same(model.state_dict(), to_state_dict(ckptool.load(folder).tensors))
    code, _, err = run("convert", folder, "-o", tmp_path / "model.safetensors")
    assert code == 0, err
    assert_same(model.state_dict(), load_file(tmp_path / "model.safetensors"))


def test_damaged_training_files_are_described_not_fatal(runs: Path, tmp_path: Path) -> None:
    folder = tmp_path / "damaged"
    folder.mkdir()
    (folder / "pytorch_model.bin").write_bytes((runs / "accelerate_bin/pytorch_model.bin").read_bytes())
    (folder / "optimizer.pt").write_bytes(b"garbage")
    (folder / "config.json").write_text("[[[[")
    (folder / "trainer_state.json").write_text('{"global_step": 123456789012345678901234567890, "epoch": 1e999, '
                                               '"max_steps": true, "log_history": 5, "best_metric": [1, [2]]}')
    os.mkfifo(folder / "rng_state.pth")
    code, out, err = run("inspect", folder)
    assert code == 0, err
    assert "optimizer.pt: unreadable: optimizer.pt is not a checkpoint" in out
    assert "rng_state.pth: unreadable: rng_state.pth is a FIFO" in out
    assert "config.json: unreadable: config.json is not valid UTF-8 JSON" in out
    assert "global_step 123456789012345678901234567890, epoch inf" in out
    code, out, err = run("inspect", folder, "--json")
    assert code == 0 and json.loads(out)["training_folder"]["step"] == 123456789012345678901234567890, err
    code, out, err = run("scan", folder)  # scan reads every pickle: the FIFO is refused, never waited on
    assert code == 3 and out == "" and err.count("\n") == 1 and "FIFO" in err
    assert_same(torch.load(folder / "pytorch_model.bin", weights_only=True), to_state_dict(ckptool.load(folder).tensors))
