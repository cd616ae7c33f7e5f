"""training/: real single, DataParallel and 2-process gloo DDP and FSDP runs through the CLI, and their checkpoints.

Accuracy is checked once per mode on the default 6000/1000 synthetic split; the other runs use small
splits because only what they save matters. DCP directories are read back with torch's own
``dcp_to_torch_save``, never with ckptool.
"""

from __future__ import annotations

import os
import pickle
import shutil
import socket
import subprocess
import warnings
from pathlib import Path

import pytest
import torch

from training import TrainingError, UsageError
from training.checkpoints import optimizer_state_by_index, optimizer_state_by_name
from training.dcp_io import dcp_state_dict, load_dcp, save_dcp
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


def run_training(args: list[str], *, env: dict[str, str], cwd: Path, python: str, torchrun: bool = False, timeout: int = 900) -> subprocess.CompletedProcess[str]:
    launcher = [python, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"] if torchrun else [python]
    return subprocess.run([*launcher, "-m", "training", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.fixture
def train(subprocess_env: dict[str, str], repo_root: Path, python_executable: str):
    """Run ``python -m training ARGS`` (or under torchrun); fail the test with its stderr if it fails."""

    def _train(*args: str, torchrun: bool = False) -> subprocess.CompletedProcess[str]:
        completed = run_training(list(args), env=subprocess_env, cwd=repo_root, python=python_executable, torchrun=torchrun)
        assert completed.returncode == 0, completed.stderr[-4000:]
        return completed

    return _train


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
# the three modes, for real


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


def test_real_two_process_ddp_wrapped_and_unwrapped(train, tmp_path: Path) -> None:
    wrapped, unwrapped = tmp_path / "wrapped.pt", tmp_path / "unwrapped.pt"
    args = ["--mode", "ddp", "--model", "lenet", "--epochs", "2", *DDP_TO_ACCURACY]
    completed = train(*args, "--save-style", "wrapped", "--out", str(wrapped), torchrun=True)
    train(*args, "--save-style", "unwrapped", "--out", str(unwrapped), torchrun=True)

    wrapped_checkpoint = load_checkpoint(wrapped)
    assert_training_container(wrapped_checkpoint, epoch=2)
    assert wrapped_checkpoint["config"]["world_size"] == 2
    assert wrapped_checkpoint["metrics"]["test_accuracy"] >= 0.8
    assert all(key.startswith("module.") for key in wrapped_checkpoint["model"])
    assert completed.stdout.count("final test_accuracy") == 1, "only rank 0 may log and save"

    unwrapped_checkpoint = load_checkpoint(unwrapped)
    assert_training_container(unwrapped_checkpoint, epoch=2)
    assert not any(key.startswith("module.") for key in unwrapped_checkpoint["model"])
    assert_loads_strictly(unwrapped_checkpoint["model"], "lenet")
    # same seed, same run: the two saves differ only by the wrapper prefix (DDP over gloo is deterministic)
    assert_loads_strictly(strip_wrapper_prefix(wrapped_checkpoint["model"]), "lenet")
    for key, tensor in unwrapped_checkpoint["model"].items():
        assert torch.equal(tensor, wrapped_checkpoint["model"]["module." + key]), key


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("localhost", 0))
        return probe.getsockname()[1]


PORT_TAKEN = ("EADDRINUSE", "address already in use", "Address already in use")


def test_multi_node_flags_two_agents(subprocess_env: dict[str, str], repo_root: Path, python_executable: str, tmp_path: Path) -> None:
    """Two torchrun agents ("nodes") of one process each rendezvous over c10d, as on two machines."""
    out = tmp_path / "multinode.pt"
    environment = dict(subprocess_env, OMP_NUM_THREADS="1")
    # both agents must be told the port before either binds it: a free port can be taken by
    # another process in between, so a run that lost its port is retried on a fresh one
    for _attempt in range(5):
        endpoint = f"localhost:{free_port()}"
        agents = [
            subprocess.Popen(
                [python_executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
                 "--node-rank", str(node_rank), "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint,
                 "-m", "training", "--mode", "ddp", "--model", "mlp", "--epochs", "1", *SMALL, "--out", str(out)],
                cwd=repo_root, env=environment, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            )
            for node_rank in (0, 1)
        ]
        outputs = [agent.communicate(timeout=600) for agent in agents]
        if all(agent.returncode == 0 for agent in agents) or \
                not any(marker in stderr for _stdout, stderr in outputs for marker in PORT_TAKEN):
            break
    for agent, (_stdout, stderr) in zip(agents, outputs):
        assert agent.returncode == 0, stderr[-4000:]
    checkpoint = load_checkpoint(out)
    assert checkpoint["config"]["world_size"] == 2
    assert_loads_strictly(checkpoint["model"], "mlp")


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
def weights_only_lenet(tmp_path_factory, subprocess_env: dict[str, str], repo_root: Path, python_executable: str) -> Path:
    """One real ``--weights-only`` run, shared: one test checks what it saved, another that it cannot be resumed."""
    out = tmp_path_factory.mktemp("weights_only") / "weights.pt"
    args = ["--mode", "single", "--model", "lenet", "--epochs", "1", "--weights-only", *SMALL, "--out", str(out)]
    completed = run_training(args, env=subprocess_env, cwd=repo_root, python=python_executable)
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
# --save-format dcp and --mode fsdp, for real: one chain of runs shared by the tests below
#
#   ddp.pt      torchrun ddp, 1 epoch, --save-format torch          (the reference)
#   ddp.dcp     torchrun ddp, 1 epoch, --save-format dcp            (same seed: same weights)
#   fsdp.dcp    torchrun fsdp, --resume ddp.dcp, 1 more epoch, dcp  (2 DDP replicas -> 2 FSDP shards)
#   fsdp.pt     torchrun fsdp, --resume ddp.pt, 1 more epoch, torch (whole state -> shards -> gathered on rank 0)
#   straight.pt torchrun ddp, 2 epochs, torch                       (what both resumed runs must equal)


@pytest.fixture(scope="module")
def dcp_runs(tmp_path_factory, subprocess_env, repo_root, python_executable) -> dict[str, Path]:
    """The chain of real 2-process gloo runs above (the MLP on the small split), by name.

    Runs that do not depend on each other run side by side: most of a small run's time is start-up
    and rendezvous, not arithmetic.
    """
    directory = tmp_path_factory.mktemp("dcp_runs")
    paths = {name: directory / name for name in ("ddp.pt", "ddp.dcp", "fsdp.dcp", "fsdp.pt", "straight.pt")}
    base = ["--model", "mlp", *SMALL]
    waves = [
        [
            ["--mode", "ddp", "--epochs", "1", "--out", str(paths["ddp.pt"])],
            ["--mode", "ddp", "--epochs", "1", "--save-format", "dcp", "--out", str(paths["ddp.dcp"])],
            ["--mode", "ddp", "--epochs", "2", "--out", str(paths["straight.pt"])],
        ],
        [
            ["--mode", "fsdp", "--epochs", "1", "--resume", str(paths["ddp.dcp"]), "--save-format", "dcp", "--out", str(paths["fsdp.dcp"])],
            ["--mode", "fsdp", "--epochs", "1", "--resume", str(paths["ddp.pt"]), "--out", str(paths["fsdp.pt"])],
        ],
    ]
    launcher = [python_executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "training"]
    environment = dict(subprocess_env, OMP_NUM_THREADS="1")  # the workers share two cores
    for wave in waves:
        runs = [
            subprocess.Popen([*launcher, *base, *args], cwd=repo_root, env=environment, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for args in wave
        ]
        for run, args in zip(runs, wave):
            stdout, stderr = run.communicate(timeout=900)
            assert run.returncode == 0, f"{args}: {stderr[-4000:]}"
            assert stdout.count("final test_accuracy") == 1, "only rank 0 may log"
    return paths


def dcp_as_torch(directory: Path, tmp_path: Path) -> dict:
    """A DCP directory converted by torch's own ``dcp_to_torch_save`` (one process, no process group)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    converted = tmp_path / f"{directory.name}.pt"
    dcp_to_torch_save(directory, converted)
    return torch.load(converted, weights_only=True)


def assert_same_tensors(expected: dict[str, torch.Tensor], actual: dict[str, torch.Tensor]) -> None:
    assert set(expected) == set(actual)
    for key, tensor in expected.items():
        assert torch.equal(tensor, actual[key]), key


def test_ddp_dcp_directory_holds_what_the_torch_save_holds(dcp_runs: dict[str, Path], tmp_path: Path) -> None:
    directory = dcp_runs["ddp.dcp"]
    assert sorted(p.name for p in directory.iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    assert [p.name for p in directory.parent.iterdir() if p.name.startswith(".")] == [], "a temp directory was left behind"

    reference = load_checkpoint(dcp_runs["ddp.pt"])
    converted = dcp_as_torch(directory, tmp_path)
    assert set(converted) == {"model", "optim", "extra"}
    assert_same_tensors(reference["model"], converted["model"])
    assert_loads_strictly(converted["model"], "mlp")
    # get_state_dict keys the optimizer state by parameter name, optimizer.state_dict() by number
    names = converted["optim"]["param_groups"][0]["params"]
    assert names == list(reference["model"])
    for number, name in enumerate(names):
        assert_same_tensors(reference["optimizer"]["state"][number], converted["optim"]["state"][name])
    extra = converted["extra"]
    assert extra["epoch"] == reference["epoch"] == 1
    # rank 0's accuracy, although rank 1 (which does not evaluate under DDP) may be the one DCP kept
    assert extra["metrics"] == reference["metrics"] and extra["metrics"]["test_accuracy"] is not None
    assert extra["config"] == reference["config"]


def test_fsdp_resumes_both_formats_and_both_saves_equal_an_uninterrupted_run(dcp_runs: dict[str, Path], tmp_path: Path) -> None:
    directory = dcp_runs["fsdp.dcp"]
    assert sorted(p.name for p in directory.iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    straight = load_checkpoint(dcp_runs["straight.pt"])
    gathered = load_checkpoint(dcp_runs["fsdp.pt"])
    converted = dcp_as_torch(directory, tmp_path)

    assert_training_container(gathered, epoch=2)
    assert gathered["config"]["mode"] == "fsdp" and gathered["config"]["resumed_from_epoch"] == 1
    assert converted["extra"]["epoch"] == 2 and converted["extra"]["config"]["resumed_from_epoch"] == 1
    # DDP epoch 1 -> (DCP, or the torch file) -> FSDP epoch 2 equals 2 DDP epochs bit for bit: weights,
    # Adam moments and the (seed, epoch) shuffle all came back into the shards (2 ranks summing is exact)
    assert_same_tensors(straight["model"], gathered["model"])
    assert_same_tensors(straight["model"], converted["model"])
    assert gathered["optimizer"]["param_groups"][0]["params"] == [0, 1, 2, 3]
    for number, state in straight["optimizer"]["state"].items():
        assert_same_tensors(state, gathered["optimizer"]["state"][number])
    # the gathered save is an ordinary unsharded checkpoint: it loads into a plain model and Adam
    model = build_model("mlp")
    model.load_state_dict(gathered["model"], strict=True)
    torch.optim.Adam(model.parameters()).load_state_dict(gathered["optimizer"])
    assert gathered["metrics"] == converted["extra"]["metrics"] == straight["metrics"]


def test_one_process_resumes_fsdp_shards_into_an_existing_dcp_directory(dcp_runs: dict[str, Path], train, tmp_path: Path) -> None:
    out = tmp_path / "single.dcp"
    shutil.copytree(dcp_runs["ddp.dcp"], out)  # an existing DCP checkpoint is replaced, as a file is
    completed = train("--mode", "single", "--model", "mlp", "--epochs", "1", *SMALL,
                      "--resume", str(dcp_runs["fsdp.dcp"]), "--save-format", "dcp", "--out", str(out))

    assert "epoch 3/3" in completed.stdout
    assert sorted(p.name for p in out.iterdir()) == [".metadata", "__0_0.distcp"], "the old __1_0.distcp survived"
    assert [p.name for p in tmp_path.iterdir()] == ["single.dcp"], "a temp directory was left behind"
    converted = dcp_as_torch(out, tmp_path)
    assert converted["extra"]["epoch"] == 3 and converted["extra"]["config"]["resumed_from_epoch"] == 2
    assert_loads_strictly(converted["model"], "mlp")
    # the saved accuracy is the saved weights' accuracy
    model = build_model("mlp").eval()
    model.load_state_dict(converted["model"])
    images, labels = load_dataset("synthetic", data_dir=None, train=False, seed=0, size=128).tensors
    with torch.no_grad():
        accuracy = (model(images).argmax(dim=1) == labels).float().mean().item()
    assert accuracy == pytest.approx(converted["extra"]["metrics"]["test_accuracy"])


def write_dcp(directory: Path, state_dict: dict) -> None:
    """A DCP directory written by torch in this process (no process group)."""
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to save in a single process"
        dcp.save(state_dict, checkpoint_id=directory, no_dist=True)


DCP_ARGUMENT_CASES = [
    ("wrapped-dcp", "--save-style wrapped needs --save-format torch", UsageError),
    ("fsdp-without-torchrun", "--mode fsdp needs the torchrun environment", UsageError),
    ("out-is-a-file", "is a file — a DCP checkpoint is a directory", UsageError),
    ("out-is-another-directory", "is a directory that is not a DCP checkpoint", UsageError),
    ("torch-out-is-a-directory", "or --save-format dcp to write a DCP directory", UsageError),
    ("resume-directory-without-metadata", "not a DCP checkpoint directory (no .metadata)", UsageError),
    ("resume-weights-only-dcp", "not a full DCP training checkpoint", TrainingError),
    ("resume-dcp-of-another-model", "does not fit --model lenet (Missing key(s) in state_dict: 'conv1.weight')", TrainingError),
    ("resume-dcp-with-hostile-metadata", "cannot be read safely (names posix.system", TrainingError),
]


@pytest.mark.parametrize(("case", "expected", "error"), DCP_ARGUMENT_CASES, ids=[case for case, _, _ in DCP_ARGUMENT_CASES])
def test_dcp_arguments_are_checked_before_training(case: str, expected: str, error: type[Exception], tmp_path: Path) -> None:
    """Refused by ``run`` itself, before any data, seed or process group (so they run in this process)."""
    from training.loop import RunConfig, run

    out = tmp_path / "out.dcp"
    mlp_state = build_model("mlp").state_dict()
    settings: dict = {"mode": "single", "model": "mlp", "save_format": "dcp", "out": out}
    if case == "wrapped-dcp":
        settings.update(mode="dp", save_style="wrapped")
    elif case == "fsdp-without-torchrun":
        settings.update(mode="fsdp")
    elif case == "out-is-a-file":
        out.write_bytes(b"keep me")
    elif case == "out-is-another-directory":
        out.mkdir()
        (out / "notes.txt").write_text("keep me")
    elif case == "torch-out-is-a-directory":
        out.mkdir()
        settings.update(save_format="torch")
    else:
        resume = tmp_path / "resume.dcp"
        resume.mkdir()
        settings.update(resume=resume, save_format="torch", out=tmp_path / "never.pt")
        if case == "resume-weights-only-dcp":
            write_dcp(resume, {"model": mlp_state})
        elif case == "resume-dcp-of-another-model":
            settings.update(model="lenet")
            # an optimizer entry is only a key to this check; any value makes one
            write_dcp(resume, {"model": mlp_state, "optim": {"param_groups": [{"lr": 0.001}]}, "extra": {"epoch": 1}})
        elif case == "resume-dcp-with-hostile-metadata":
            (resume / ".metadata").write_bytes(pickle.dumps(os.system))
    before = sorted(p.name for p in tmp_path.rglob("*"))
    with pytest.raises(error) as raised:
        run(RunConfig(**settings), environ={}, log=lambda line: None)
    assert type(raised.value) is error, "a usage error exits 2, a checkpoint problem 1"
    assert expected in str(raised.value)
    assert "\n" not in str(raised.value)
    assert sorted(p.name for p in tmp_path.rglob("*")) == before, "something was written or removed"


def test_failed_dcp_save_leaves_nothing_behind(tmp_path: Path) -> None:
    out = tmp_path / "out.dcp"
    unpicklable = {"model": {"weight": torch.ones(2)}, "extra": {"hook": lambda: None}}
    with pytest.raises(TrainingError, match=r"--out .*out\.dcp: DCP save failed \(rank 0: .*pickle.*nothing was written"):
        save_dcp(unpicklable, out, is_main=True, distributed=False)
    assert list(tmp_path.iterdir()) == []


def trained_mlp_and_adam(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = build_model("mlp")
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.randn(4, *INPUT_SHAPE)).sum().backward()
    optimizer.step()
    return model, optimizer


def test_dcp_round_trip_in_one_process(tmp_path: Path) -> None:
    """save_dcp then load_dcp without a process group: weights, Adam state and epoch come back."""
    saved_model, saved_optimizer = trained_mlp_and_adam(seed=1)
    extra = {"epoch": 4, "config": {"mode": "single"}, "metrics": {"test_accuracy": 0.5, "train_loss": 1.0}}
    save_dcp(dcp_state_dict(saved_model, saved_optimizer, extra, weights_only=False), tmp_path / "run.dcp", is_main=True, distributed=False)

    model, optimizer = trained_mlp_and_adam(seed=2)
    assert load_dcp(tmp_path / "run.dcp", model, optimizer, model_name="mlp", distributed=False) == 4
    assert_same_tensors(saved_model.state_dict(), model.state_dict())
    for number, state in saved_optimizer.state_dict()["state"].items():
        assert_same_tensors(state, optimizer.state_dict()["state"][number])


class TouchOnLoad:
    """Unpickles as a call to ``Path.touch``: proof that a pickle ran code."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self):
        return (Path.touch, (self.path,))


def test_dcp_values_are_loaded_weights_only(tmp_path: Path) -> None:
    model, optimizer = trained_mlp_and_adam(seed=1)
    proof = tmp_path / "code-ran"
    extra = {"epoch": TouchOnLoad(proof)}
    save_dcp(dcp_state_dict(model, optimizer, extra, weights_only=False), tmp_path / "run.dcp", is_main=True, distributed=False)

    with pytest.raises(TrainingError, match=r"run\.dcp: cannot be loaded \(rank 0: .*[Ww]eights.only"):
        load_dcp(tmp_path / "run.dcp", model, optimizer, model_name="mlp", distributed=False)
    assert not proof.exists(), "torch's planner unpickled a value without weights_only"


def test_optimizer_renumbering_round_trips() -> None:
    model, optimizer = trained_mlp_and_adam(seed=0)
    by_number = optimizer.state_dict()
    names = [name for name, _ in model.named_parameters()]
    by_name = optimizer_state_by_name(by_number, names)
    assert list(by_name["state"]) == names and by_name["param_groups"][0]["params"] == names
    again = optimizer_state_by_index(by_name)
    assert again["param_groups"] == by_number["param_groups"]
    for number, state in by_number["state"].items():
        assert_same_tensors(state, again["state"][number])


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


def test_process_info_reads_torchrun_and_refuses_mismatches() -> None:
    assert process_info("single", {}) == ProcessInfo(rank=0, local_rank=0, world_size=1)
    assert process_info("ddp", {"RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4"}) == ProcessInfo(3, 1, 4)
    with pytest.raises(UsageError, match="LOCAL_RANK"):
        process_info("ddp", {"RANK": "0", "WORLD_SIZE": "2"})
    with pytest.raises(UsageError, match="--mode single launched as 2 torchrun workers"):
        process_info("single", {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2"})


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
