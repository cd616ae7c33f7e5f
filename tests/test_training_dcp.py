"""training/: 2-process gloo DDP (one node and two), --save-format dcp and --mode fsdp, for real.

Every torchrun launch of the training tests is in this file, in one chain of runs that the tests
below share (a launch is three processes that each import torch: most of a small run's cost). Apart
from test_training.py so that a parallel test run (``make test``: xdist, a file per worker) spreads
the two files over both workers. DCP directories are read back with torch's own
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
from test_training import (  # the shared helpers and the `train` fixture, beside this file
    DDP_TO_ACCURACY,
    SMALL,
    assert_loads_strictly,
    assert_training_container,
    load_checkpoint,
)
from training_runs import TEARDOWN_ABORT

from training import TrainingError, UsageError
from training.checkpoints import optimizer_state_by_index, optimizer_state_by_name
from training.dcp_io import dcp_state_dict, load_dcp, save_dcp
from training.data import load_dataset
from training.loop import strip_wrapper_prefix
from training.models import INPUT_SHAPE, build_model

# --------------------------------------------------------------------------------------------
# torchrun, for real: one chain of runs shared by the tests below (the MLP, seed 0, the split
# DDP_TO_ACCURACY; OMP_NUM_THREADS=1)
#
#   ddp.pt      torchrun ddp, 1 epoch, --save-format torch          (the reference)
#   ddp.dcp     torchrun ddp, 1 epoch, --save-format dcp            (same seed: same weights)
#   straight.pt torchrun ddp, 2 epochs, torch                       (unwrapped; what both resumed runs must equal)
#   wrapped.pt  2 torchrun agents of 1 process each (--nnodes 2, c10d rendezvous, as on two machines),
#               ddp, 2 epochs, --save-style wrapped                 (straight.pt but for the 'module.' prefix)
#   fsdp.dcp    torchrun fsdp, --resume ddp.dcp, 1 more epoch, dcp  (2 DDP replicas -> 2 FSDP shards)
#   fsdp.pt     torchrun fsdp, --resume ddp.pt, 1 more epoch, torch (whole state -> shards -> gathered on rank 0)

LAUNCH = ["-m", "torch.distributed.run"]
PORT_TAKEN = ("EADDRINUSE", "address already in use", "Address already in use")


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("localhost", 0))
        return probe.getsockname()[1]


def start_two_agents(python: str, args: list[str], **popen) -> list[subprocess.Popen]:
    """Two torchrun agents ("nodes") of one process each that rendezvous over c10d on a free port."""
    endpoint = f"localhost:{free_port()}"
    return [
        subprocess.Popen([python, *LAUNCH, "--nnodes", "2", "--nproc-per-node", "1", "--node-rank", str(node_rank),
                          "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "-m", "training", *args], **popen)
        for node_rank in (0, 1)
    ]


def finish_two_agents(agents: list[subprocess.Popen], restart) -> list[str]:
    """Wait for both agents; their stdouts. Both must exit 0.

    Two failures of the launch, not of the run under test, start it again (``restart()``), up to
    four times: a free port taken by another process before either agent bound it (both must be
    told the port first), and gloo's teardown aborting a worker after its work is done
    (``TEARDOWN_ABORT``): its agent then exits early and takes the rendezvous store with it, so
    the other agent fails too, with a store error that names nothing of the run.
    """
    retry_on = (*PORT_TAKEN, TEARDOWN_ABORT)
    for _attempt in range(5):
        outputs = [agent.communicate(timeout=900) for agent in agents]
        if all(agent.returncode == 0 for agent in agents) or \
                not any(marker in stderr for _stdout, stderr in outputs for marker in retry_on):
            break
        agents = restart()
    if any(agent.returncode != 0 for agent in agents):
        tails = "\n".join(f"--- agent {rank} (exit {agent.returncode}):\n{stderr[-3000:]}"
                          for rank, (agent, (_stdout, stderr)) in enumerate(zip(agents, outputs)))
        pytest.fail(f"two agents:\n{tails}")
    return [stdout for stdout, _stderr in outputs]


@pytest.fixture(scope="module")
def dcp_runs(tmp_path_factory, subprocess_env, repo_root, python_executable) -> dict[str, Path]:
    """The chain of real gloo runs above, by name.

    Runs that do not depend on each other run side by side: most of a small run's time is start-up
    and rendezvous, not arithmetic. Every run must exit 0 with one "final" line (only rank 0 logs).
    """
    directory = tmp_path_factory.mktemp("dcp_runs")
    paths = {name: directory / name for name in ("ddp.pt", "ddp.dcp", "straight.pt", "wrapped.pt", "fsdp.dcp", "fsdp.pt")}
    base = ["--model", "mlp", "--device", "cpu", *DDP_TO_ACCURACY]  # gloo, also where torch sees GPUs
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
    two_agents = ["--mode", "ddp", "--epochs", "2", "--save-style", "wrapped", *base, "--out", str(paths["wrapped.pt"])]
    popen = dict(cwd=repo_root, env=dict(subprocess_env, OMP_NUM_THREADS="1"), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    standalone = [python_executable, *LAUNCH, "--standalone", "--nproc-per-node", "2", "-m", "training", *base]
    for number, wave in enumerate(waves):
        runs = [subprocess.Popen([*standalone, *args], **popen) for args in wave]
        agents = start_two_agents(python_executable, two_agents, **popen) if number == 0 else None
        for run, args in zip(runs, wave):
            stdout, stderr = run.communicate(timeout=900)
            returncode = run.returncode
            for _retry in range(2):  # gloo's teardown aborted a rank (seen in CI on the FSDP --resume run): again, alone
                if returncode == 0 or TEARDOWN_ABORT not in stderr:
                    break
                again = subprocess.run([*standalone, *args], timeout=900, **popen)
                stdout, stderr, returncode = again.stdout, again.stderr, again.returncode
            assert returncode == 0, f"{args}: {stderr[-4000:]}"
            assert stdout.count("final test_accuracy") == 1, "only rank 0 may log"
        if agents is not None:
            outputs = finish_two_agents(agents, lambda: start_two_agents(python_executable, two_agents, **popen))
            assert sum(stdout.count("final test_accuracy") for stdout in outputs) == 1, "only rank 0 may log"
    return paths


def test_real_two_process_ddp_wrapped_and_unwrapped(dcp_runs: dict[str, Path]) -> None:
    wrapped_checkpoint, unwrapped_checkpoint = load_checkpoint(dcp_runs["wrapped.pt"]), load_checkpoint(dcp_runs["straight.pt"])

    assert_training_container(wrapped_checkpoint, epoch=2)
    assert wrapped_checkpoint["config"]["world_size"] == 2
    assert wrapped_checkpoint["metrics"]["test_accuracy"] >= 0.8
    assert all(key.startswith("module.") for key in wrapped_checkpoint["model"])

    assert_training_container(unwrapped_checkpoint, epoch=2)
    assert unwrapped_checkpoint["config"]["world_size"] == 2
    assert unwrapped_checkpoint["metrics"]["test_accuracy"] >= 0.8
    assert not any(key.startswith("module.") for key in unwrapped_checkpoint["model"])
    assert_loads_strictly(unwrapped_checkpoint["model"], "mlp")
    # same seed, same run: the two saves differ only by the wrapper prefix (DDP over gloo is
    # deterministic, and a sum of the 2 ranks' gradients is the same whichever agent holds rank 0)
    assert_loads_strictly(strip_wrapper_prefix(wrapped_checkpoint["model"]), "mlp")
    for key, tensor in unwrapped_checkpoint["model"].items():
        assert torch.equal(tensor, wrapped_checkpoint["model"]["module." + key]), key
    assert wrapped_checkpoint["metrics"] == unwrapped_checkpoint["metrics"]


def test_multi_node_flags_two_agents(dcp_runs: dict[str, Path]) -> None:
    """Two torchrun agents ("nodes") of one process each rendezvous over c10d, as on two machines."""
    checkpoint = load_checkpoint(dcp_runs["wrapped.pt"])
    assert checkpoint["config"]["world_size"] == 2 and checkpoint["config"]["mode"] == "ddp"
    assert_loads_strictly(strip_wrapper_prefix(checkpoint["model"]), "mlp")


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
    images, labels = load_dataset("synthetic", data_dir=None, train=False, seed=0, size=128).tensors  # SMALL's test split
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
