"""training/: real single and DataParallel runs through the CLI, and their checkpoints; its errors and pieces.

The runs go through ``python -m training``'s ``main`` in the test process (tests/training_runs.py):
a process per run would pay the interpreter and torch start-up each time. The failing runs whose
exit code and one-line stderr are the point run as real processes. The 2-process gloo DDP, multi-node
and FSDP runs (real torchrun launches) are in test_training_dcp.py.

Accuracy is checked once per mode on a split big enough to reach it; the other runs use small
splits because only what they save matters.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import torch
from training_runs import run_training, train_in_process

from training import UsageError
from training.data import class_prototypes, load_dataset, synthetic_digits
from training.loop import ProcessInfo, process_info, strip_wrapper_prefix
from training.models import INPUT_SHAPE, MODELS, build_model
from training.options import MODEL_NAMES

CONTAINER_KEYS = {"model", "optimizer", "epoch", "config", "metrics"}
SMALL = ["--train-size", "512", "--test-size", "128"]
# enough data to reach the accuracy asserted below with a margin (0.86-0.90 seen), at a third of the
# default 6000 samples' time on a 2-core machine
TO_ACCURACY = ["--train-size", "2048", "--test-size", "512"]
DDP_TO_ACCURACY = ["--train-size", "3072", "--test-size", "512"]  # a global batch twice as large: fewer steps
CONFIG_TYPES = (str, int, float, bool, type(None))


def load_checkpoint(path: Path) -> dict:
    return torch.load(path, weights_only=True, map_location="cpu")


def assert_training_container(checkpoint: dict, *, epoch: int) -> None:
    assert set(checkpoint) == CONTAINER_KEYS
    assert checkpoint["epoch"] == epoch
    assert all(isinstance(value, CONFIG_TYPES) for value in checkpoint["config"].values()), checkpoint["config"]
    assert set(checkpoint["metrics"]) == {"test_accuracy", "train_loss"}
    assert checkpoint["optimizer"]["state"], "optimizer state is empty: no step was taken"


def assert_loads_strictly(state_dict: dict[str, torch.Tensor], model_name: str) -> None:
    model = build_model(model_name)
    model.load_state_dict(state_dict, strict=True)
    for key, tensor in model.state_dict().items():
        assert torch.equal(tensor, state_dict[key]), key


# --------------------------------------------------------------------------------------------
# single and DataParallel, for real


def test_single_lenet_trains_to_accuracy_and_saves_plain_keys(train, tmp_path: Path) -> None:
    out = tmp_path / "single.pt"
    completed = train("--mode", "single", "--model", "lenet", "--epochs", "2", *TO_ACCURACY, "--out", str(out))

    checkpoint = load_checkpoint(out)
    assert_training_container(checkpoint, epoch=2)
    assert checkpoint["metrics"]["test_accuracy"] >= 0.8
    assert checkpoint["config"]["mode"] == "single"
    assert not any(key.startswith("module.") for key in checkpoint["model"])
    assert_loads_strictly(checkpoint["model"], "lenet")
    assert "epoch 2/2" in completed.stdout and "final test_accuracy" in completed.stdout
    assert [p.name for p in tmp_path.iterdir()] == ["single.pt"], "the atomic save left a temp file behind"


def test_dp_wrapped_keeps_module_prefix(train, tmp_path: Path) -> None:
    out = tmp_path / "dp.pt"
    train("--mode", "dp", "--model", "mlp", "--epochs", "2", *TO_ACCURACY, "--save-style", "wrapped", "--out", str(out))

    checkpoint = load_checkpoint(out)
    assert_training_container(checkpoint, epoch=2)
    assert checkpoint["metrics"]["test_accuracy"] >= 0.8
    assert checkpoint["model"] and all(key.startswith("module.") for key in checkpoint["model"])
    assert_loads_strictly(strip_wrapper_prefix(checkpoint["model"]), "mlp")


# --------------------------------------------------------------------------------------------
# resume and weights-only


def test_resume_continues_exactly_where_it_stopped(train, tmp_path: Path) -> None:
    first, resumed, straight = tmp_path / "first.pt", tmp_path / "resumed.pt", tmp_path / "straight.pt"
    args = ["--mode", "dp", "--model", "mlp", "--save-style", "wrapped", *SMALL]
    train(*args, "--epochs", "1", "--out", str(first))
    train(*args, "--epochs", "1", "--resume", str(first), "--out", str(resumed))
    train(*args, "--epochs", "2", "--out", str(straight))

    first_checkpoint, resumed_checkpoint = load_checkpoint(first), load_checkpoint(resumed)
    assert first_checkpoint["epoch"] == 1
    assert_training_container(resumed_checkpoint, epoch=2)
    assert resumed_checkpoint["config"]["resumed_from_epoch"] == 1
    assert not torch.equal(first_checkpoint["model"]["module.fc1.weight"], resumed_checkpoint["model"]["module.fc1.weight"])
    # model, Adam moments and the (seed, epoch) shuffle all restored: 1 + 1 epochs == 2 epochs, bit for bit
    straight_model = load_checkpoint(straight)["model"]
    for key, tensor in straight_model.items():
        assert torch.equal(tensor, resumed_checkpoint["model"][key]), key


@pytest.fixture(scope="module")
def weights_only_lenet(tmp_path_factory) -> Path:
    """One real ``--weights-only`` run, shared: one test checks what it saved, another that it cannot be resumed."""
    out = tmp_path_factory.mktemp("weights_only") / "weights.pt"
    args = ["--mode", "single", "--model", "lenet", "--epochs", "1", "--weights-only", *SMALL, "--out", str(out)]
    completed = train_in_process(args)
    assert completed.returncode == 0, completed.stderr[-4000:]
    return out


def test_weights_only_saves_the_bare_state_dict(weights_only_lenet: Path) -> None:
    state_dict = load_checkpoint(weights_only_lenet)
    assert set(state_dict) == set(build_model("lenet").state_dict())
    assert_loads_strictly(state_dict, "lenet")


def write_idx(path: Path, array: torch.Tensor) -> None:
    """An MNIST idx file: magic (0, 0, ubyte=0x08, ndim), big-endian dims, the bytes."""
    header = bytes([0, 0, 0x08, array.dim()]) + b"".join(size.to_bytes(4, "big") for size in array.shape)
    path.write_bytes(header + array.to(torch.uint8).numpy().tobytes())


def test_mnist_is_read_from_a_local_directory(train, tmp_path: Path) -> None:
    raw = tmp_path / "data" / "MNIST" / "raw"
    raw.mkdir(parents=True)
    for prefix, count in (("train", 300), ("t10k", 100)):
        images, labels = synthetic_digits(count, seed=0, train=prefix == "train").tensors
        pixels = (images.squeeze(1) * 0.3081 + 0.1307).clamp(0, 1).mul(255).round()
        write_idx(raw / f"{prefix}-images-idx3-ubyte", pixels)
        write_idx(raw / f"{prefix}-labels-idx1-ubyte", labels)
    out = tmp_path / "mnist.pt"
    train("--model", "mlp", "--epochs", "1", "--data", "mnist", "--data-dir", str(tmp_path / "data"), "--out", str(out))

    checkpoint = load_checkpoint(out)
    assert checkpoint["config"]["data"] == "mnist"
    assert (checkpoint["config"]["train_size"], checkpoint["config"]["test_size"]) == (300, 100)


# --------------------------------------------------------------------------------------------
# errors: one line, exit code, no traceback, nothing written


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--model", "vgg"], "invalid choice: 'vgg'"),
        (["--mode", "ddp"], "needs the torchrun environment"),
        (["--data", "mnist", "--data-dir", "{tmp}"], "no MNIST found under"),
        (["--data", "mnist"], "--data mnist needs --data-dir"),
    ],
    ids=["unknown-model", "ddp-without-torchrun", "missing-mnist", "mnist-without-dir"],
)
def test_bad_arguments_fail_in_one_line(args: list[str], expected: str, subprocess_env, repo_root, python_executable, tmp_path: Path) -> None:
    out = tmp_path / "never.pt"
    args = [arg.replace("{tmp}", str(tmp_path)) for arg in args]
    completed = run_training([*args, "--out", str(out)], env=subprocess_env, cwd=repo_root, python=python_executable)
    assert_one_line_error(completed, expected, exit_code=2)
    assert list(tmp_path.iterdir()) == []


def test_nonexistent_output_directory_fails_before_training(subprocess_env, repo_root, python_executable, tmp_path: Path) -> None:
    out = tmp_path / "missing" / "model.pt"
    completed = run_training(["--epochs", "50", "--out", str(out)], env=subprocess_env, cwd=repo_root, python=python_executable, timeout=600)
    assert_one_line_error(completed, "does not exist", exit_code=2)
    assert "epoch" not in completed.stdout, "it trained before checking --out"
    assert list(tmp_path.iterdir()) == []


def test_resume_from_weights_only_file_is_refused(weights_only_lenet: Path, subprocess_env, repo_root, python_executable, tmp_path: Path) -> None:
    out = tmp_path / "resumed.pt"
    completed = run_training(["--model", "lenet", "--resume", str(weights_only_lenet), "--out", str(out)], env=subprocess_env, cwd=repo_root, python=python_executable)
    assert_one_line_error(completed, "not a full training checkpoint", exit_code=1)
    assert not out.exists()


def assert_one_line_error(completed: subprocess.CompletedProcess[str], expected: str, *, exit_code: int) -> None:
    lines = completed.stderr.strip().splitlines()
    assert completed.returncode == exit_code, completed.stderr
    assert "Traceback" not in completed.stderr
    assert len(lines) == 1, completed.stderr
    assert lines[0].startswith("training: error: ") and expected in lines[0], lines[0]


# --------------------------------------------------------------------------------------------
# library pieces


@pytest.mark.parametrize("name", sorted(MODELS))
def test_every_model_maps_28x28_grayscale_to_10_logits(name: str) -> None:
    model = build_model(name).eval()
    with torch.no_grad():
        assert model(torch.zeros(2, *INPUT_SHAPE)).shape == (2, 10)


def test_resnet18_stem_is_adapted_to_small_grayscale_images() -> None:
    model = build_model("resnet18")
    assert model.conv1.in_channels == 1 and model.conv1.stride == (1, 1) and model.conv1.kernel_size == (3, 3)
    assert isinstance(model.maxpool, torch.nn.Identity)
    assert "layer4.1.bn2.running_var" in model.state_dict(), "torchvision's key names must be kept"


def test_unknown_model_is_a_value_error_listing_the_choices() -> None:
    with pytest.raises(ValueError, match="lenet, mlp, resnet18"):
        build_model("vgg")


def test_synthetic_data_is_deterministic_and_splits_differ() -> None:
    first = synthetic_digits(200, seed=3, train=True).tensors
    again = synthetic_digits(200, seed=3, train=True).tensors
    test_split = synthetic_digits(200, seed=3, train=False).tensors
    other_seed = synthetic_digits(200, seed=4, train=True).tensors
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    assert not torch.equal(first[0], test_split[0])
    assert not torch.equal(first[0], other_seed[0])
    assert set(first[1].tolist()) == set(range(10))
    # every split and seed is drawn around the same ten classes
    assert torch.equal(class_prototypes(), class_prototypes())
    assert len(load_dataset("synthetic", data_dir=None, train=True, seed=0)) == 6000


def test_a_torchrun_worker_ends_with_its_code_and_its_output_flushed(subprocess_env, repo_root, python_executable) -> None:
    """training/__main__.exit_worker skips the interpreter's teardown (os._exit): what the worker printed,
    buffered into a pipe, still arrives, and the exit code is the run's."""
    script = "import sys; from training.__main__ import exit_worker; print('saved'); print('note', file=sys.stderr); exit_worker(3)"
    done = subprocess.run([python_executable, "-c", script], cwd=repo_root, env=subprocess_env, capture_output=True,
                          text=True, timeout=120)
    assert (done.returncode, done.stdout, done.stderr) == (3, "saved\n", "note\n")


def test_process_info_reads_torchrun_and_refuses_mismatches() -> None:
    assert process_info("single", {}) == ProcessInfo(rank=0, local_rank=0, world_size=1)
    assert process_info("ddp", {"RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4"}) == ProcessInfo(3, 1, 4)
    with pytest.raises(UsageError, match="LOCAL_RANK"):
        process_info("ddp", {"RANK": "0", "WORLD_SIZE": "2"})
    with pytest.raises(UsageError, match="--mode single launched as 2 torchrun workers"):
        process_info("single", {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2"})


def test_the_device_follows_the_gpus_torch_sees_and_refuses_what_cannot_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """--device auto|cpu|cuda against 0, 1 and 2 visible GPUs (the discovery seam substituted; no CUDA is touched
    where the answer is the CPU or a refusal)."""
    import training.loop as loop

    ddp_rank1_of_2 = process_info("ddp", {"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"})
    assert ddp_rank1_of_2.local_world_size == 2
    chosen: list[int] = []
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    for gpus in (0, 1, 2):
        monkeypatch.setattr(loop, "visible_gpus", lambda gpus=gpus: gpus)
        assert loop.select_device("ddp", ddp_rank1_of_2, "cpu") == torch.device("cpu")
        assert loop.select_device("single", ProcessInfo(), "cpu") == torch.device("cpu")
    monkeypatch.setattr(loop, "visible_gpus", lambda: 0)
    assert loop.select_device("ddp", ddp_rank1_of_2, "auto") == torch.device("cpu")
    with pytest.raises(UsageError, match=r"^--device cuda: torch sees no GPU here .* use --device cpu"):
        loop.select_device("single", ProcessInfo(), "cuda")
    monkeypatch.setattr(loop, "visible_gpus", lambda: 1)
    for requested in ("auto", "cuda"):
        with pytest.raises(UsageError, match=r"^torchrun started 2 processes on this node but torch sees 1 GPU: nccl "
                                             r"needs one per process — use --nproc-per-node 1, or --device cpu"):
            loop.select_device("ddp", ddp_rank1_of_2, requested)
    assert loop.select_device("dp", ProcessInfo(), "auto") == torch.device("cuda", 0)
    monkeypatch.setattr(loop, "visible_gpus", lambda: 2)
    assert loop.select_device("ddp", ddp_rank1_of_2, "auto") == torch.device("cuda", 1)
    assert loop.select_device("fsdp", ddp_rank1_of_2, "cuda") == torch.device("cuda", 1)
    assert chosen == [0, 1, 1]


def test_device_cuda_without_a_gpu_is_one_line_before_any_training(tmp_path: Path) -> None:
    if torch.cuda.is_available():
        pytest.skip("needs a machine where torch sees no GPU")
    completed = train_in_process(["--device", "cuda", "--out", str(tmp_path / "m.pt")])
    assert completed.returncode == 2
    assert completed.stderr == ("training: error: --device cuda: torch sees no GPU here (torch.cuda.is_available() is "
                                "False) — use --device cpu (DDP and FSDP then run on gloo)\n")
    assert not (tmp_path / "m.pt").exists()


def test_model_names_checked_without_torch_are_the_models() -> None:
    assert MODEL_NAMES == tuple(MODELS)


@pytest.mark.parametrize(
    "args",
    [
        ["--model", "vgg"],
        ["--mode", "ddp"],
        ["--data", "mnist"],
        ["--epochs", "0"],
        ["--out", "/nonexistent-directory/x.pt"],
    ],
    ids=["unknown-model", "ddp-without-torchrun", "mnist-without-dir", "bad-epochs", "missing-out-directory"],
)
def test_bad_arguments_are_refused_before_torch_is_imported(args: list[str], subprocess_env, repo_root, python_executable, tmp_path: Path) -> None:
    # every process of a training run pays seconds for `import torch`: a wrong argument must not
    probe = (
        "import sys\n"
        "from training.__main__ import main\n"
        "try:\n"
        f"    code = main({[*args, '--out', str(tmp_path / 'x.pt')] if '--out' not in args else args!r})\n"
        "except SystemExit as e:  # argparse's own refusals exit\n"
        "    code = e.code\n"
        "print(code, 'torch' in sys.modules)\n"
    )
    completed = subprocess.run([python_executable, "-c", probe], env=subprocess_env, cwd=repo_root, capture_output=True, text=True, timeout=300)
    assert completed.stdout.split() == ["2", "False"], (completed.stdout, completed.stderr)
    assert len(completed.stderr.strip().splitlines()) == 1, completed.stderr
    assert not (tmp_path / "x.pt").exists()
