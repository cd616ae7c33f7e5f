"""One Trainer for single-process, DataParallel, DDP and FSDP runs, and how they save and resume.

The shape follows pytorch/examples' ``distributed/ddp-tutorial-series``: the same Trainer runs every
mode; only the wrapper around the model, the process group and who saves differ. Every mode draws
batches through a ``DistributedSampler`` (one replica outside DDP/FSDP) so shuffling depends only on
``(seed, epoch)`` and a resumed run sees the batches an uninterrupted one would.

Nothing here assumes a single node: devices come from ``LOCAL_RANK``, rank-0 duties (logging,
evaluating, saving) from ``RANK``. FSDP (``torch.distributed.fsdp.fully_shard``, FSDP2) runs on gloo
as well as nccl: each rank holds a shard of every parameter and of the Adam moments, so every rank
takes part in each forward (evaluation included), and a save either goes through DCP (each rank
writes its shards) or gathers the full state dict onto rank 0 for ``--save-format torch``.

Example:
    >>> result = run(RunConfig(mode="single", model="mlp", epochs=1, out=Path("mlp.pt")))
    >>> sorted(torch.load("mlp.pt", weights_only=True))
    ['config', 'epoch', 'metrics', 'model', 'optimizer']
"""

from __future__ import annotations

import os
import pickle
import random
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from training import TrainingError, UsageError
from training.checkpoints import (
    CONFIG_KEY,
    EPOCH_KEY,
    METRICS_KEY,
    MODEL_KEY,
    OPTIMIZER_KEY,
    save_torch,
)
from training.data import load_dataset
from training.models import build_model
from training.options import (  # noqa: F401  (re-exported: the loop's settings and checks live there)
    DATASETS,
    DISTRIBUTED_MODES,
    MODES,
    SAVE_FORMATS,
    SAVE_STYLES,
    TORCHRUN_ENV,
    ProcessInfo,
    RunConfig,
    check_output_writable,
    process_info,
    validate,
)

# Prefix nn.DataParallel and DistributedDataParallel put on every key of their own state_dict().
WRAPPER_PREFIX = "module."
# training.dcp_io (torch.distributed.checkpoint) and torchvision are imported where first needed:
# each adds about a second to the start of every process, and most runs need neither.

ConfigValue = str | int | float | bool | None


@dataclass(frozen=True)
class RunResult:
    """What a run did: on rank 0 the saved path and metrics; other ranks save and measure nothing."""

    out: Path | None
    epoch: int
    test_accuracy: float | None
    train_loss: float
    seconds: float


def seed_everything(seed: int) -> None:
    """Seed every RNG a run touches and ask for deterministic kernels."""
    # cuBLAS reads this when it initialises; it must be set before the first CUDA matmul.
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.backends.cudnn.benchmark = False
    torch.backends.cudnn.deterministic = True
    # warn_only: some CUDA backward kernels (adaptive average pooling in resnet18) have no
    # deterministic version; they should warn, not stop the run. The C switch is the one
    # torch.use_deterministic_algorithms sets; the public call also sets torch.compile's own flag,
    # importing inductor, dynamo and sympy (~2 s of CPU per process) for runs that never compile.
    set_switch = getattr(torch._C, "_set_deterministic_algorithms", None)
    if set_switch is None:  # a torch without the C switch: the public call does the same and more
        torch.use_deterministic_algorithms(True, warn_only=True)
    else:
        set_switch(True, warn_only=True)


def visible_gpus() -> int:
    """How many CUDA devices torch sees here (0 without CUDA); the seam tests substitute."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def select_device(mode: str, info: ProcessInfo, requested: str = "auto") -> torch.device:
    """Where this process trains: ``--device`` cpu, cuda, or auto (cuda where torch sees a GPU, else the CPU).

    On CUDA a DDP/FSDP worker takes cuda:LOCAL_RANK (nccl wants one GPU per process), any other run cuda:0.

    Raises:
        UsageError: cuda asked for where there is none, or more processes on this node than GPUs.
    """
    if requested == "cpu":
        return torch.device("cpu")
    gpus = visible_gpus()
    if gpus == 0 and requested == "auto":
        return torch.device("cpu")
    if gpus == 0:
        raise UsageError("--device cuda: torch sees no GPU here (torch.cuda.is_available() is False) — "
                         "use --device cpu (DDP and FSDP then run on gloo)")
    distributed = mode in DISTRIBUTED_MODES
    processes = max(info.local_world_size, info.local_rank + 1)
    if distributed and processes > gpus:
        raise UsageError(
            f"torchrun started {processes} processes on this node but torch sees {gpus} GPU"
            f"{'s' if gpus != 1 else ''}: nccl needs one per process — use --nproc-per-node {gpus}, "
            "or --device cpu to train on gloo")
    index = info.local_rank if distributed else 0
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def unwrap(model: nn.Module) -> nn.Module:
    """The user's model inside a DataParallel/DDP wrapper (the model itself when unwrapped).

    ``fully_shard`` wraps nothing: it turns the model itself into an ``FSDPModule`` with the same keys.
    """
    if isinstance(model, (nn.DataParallel, DistributedDataParallel)):
        return model.module
    return model


def shard_model(model: nn.Module, device: torch.device, world_size: int) -> nn.Module:
    """Shard ``model`` in place with FSDP2's ``fully_shard`` over all ranks; return it.

    Each direct child that holds parameters (a layer of lenet/mlp, a stage of resnet18) becomes its
    own FSDP unit, so only one unit's full parameters exist at a time in forward and backward; the
    root unit takes what is left. Parameters become DTensors sharded on dim 0 across the ranks.
    Every rank must hold the same initial weights (the run's seed sees to that): unlike DDP,
    ``fully_shard`` does not broadcast them.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    # the mesh's device type picks the collectives: "cpu" runs them on gloo, "cuda" on nccl
    mesh = init_device_mesh(device.type, (world_size,))
    for child in model.children():
        if any(True for _ in child.parameters()):
            fully_shard(child, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def wrap_model(model: nn.Module, mode: str, device: torch.device, world_size: int = 1) -> nn.Module:
    """Wrap the model for the mode: nothing (single), DataParallel (dp), DDP (ddp), or shard it (fsdp)."""
    if mode == "fsdp":
        return shard_model(model, device, world_size)
    if mode == "dp":
        # on a CPU-only machine DataParallel has no devices and just calls the module; its
        # state_dict() still carries the "module." prefix, which is the point of this mode here
        return nn.DataParallel(model)
    if mode == "ddp":
        device_ids = [device.index] if device.type == "cuda" else None
        return DistributedDataParallel(model, device_ids=device_ids)
    return model


def strip_wrapper_prefix(state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Drop ``module.`` from every key when every key has it (a checkpoint saved from the wrapper)."""
    if state_dict and all(key.startswith(WRAPPER_PREFIX) for key in state_dict):
        return {key.removeprefix(WRAPPER_PREFIX): value for key, value in state_dict.items()}
    return dict(state_dict)


def load_training_checkpoint(path: Path) -> dict:
    """Load a full ``--save-format torch`` training checkpoint to resume from (``weights_only=True``, onto the CPU).

    Raises:
        UsageError: the file does not exist.
        TrainingError: it cannot be loaded safely, or is not a full training checkpoint.
    """
    if not path.is_file():
        raise UsageError(f"--resume {path}: no such file or DCP directory — give a checkpoint saved by python -m training")
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, OSError) as e:
        first_line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise TrainingError(
            f"--resume {path}: cannot be loaded with weights_only=True ({first_line}) — "
            "resume from a checkpoint saved by python -m training"
        ) from e
    return checked_training_checkpoint(checkpoint, path)


def checked_training_checkpoint(checkpoint: object, path: Path) -> dict:
    """``checkpoint`` if it is a full training checkpoint (model, optimizer, epoch).

    Raises:
        TrainingError: it is not.
    """
    required = (MODEL_KEY, OPTIMIZER_KEY, EPOCH_KEY)
    if not isinstance(checkpoint, dict) or not all(key in checkpoint for key in required):
        raise TrainingError(
            f"--resume {path}: not a full training checkpoint (needs {', '.join(required)}; "
            "a --weights-only save has no optimizer state) — resume from a save without --weights-only"
        )
    return checkpoint


def make_loader(dataset: TensorDataset, *, batch_size: int, info: ProcessInfo, shuffle: bool, seed: int) -> DataLoader:
    """A DataLoader over this process's shard (the whole set outside DDP)."""
    sampler = DistributedSampler(
        dataset, num_replicas=info.world_size, rank=info.rank, shuffle=shuffle, seed=seed
    )
    return DataLoader(dataset, batch_size=batch_size, sampler=sampler)


class Trainer:
    """Trains a (possibly wrapped) model; the same code path for single, dp, ddp and fsdp.

    Args:
        model: the model as trained: plain, ``nn.DataParallel``, ``DistributedDataParallel`` or sharded
            by ``fully_shard``.
        optimizer: over the parameters of the unwrapped model.
        train_loader: yields this process's shard; its sampler must be a ``DistributedSampler``.
        test_loader: the whole test set; only rank 0 evaluates, unless ``evaluate_on_every_rank``.
        device: where batches go.
        info: this process's rank layout.
        log: called with one line per epoch on rank 0.
        evaluate_on_every_rank: every rank runs the evaluation (rank 0 still logs): needed under
            FSDP, whose every forward all-gathers parameters from all ranks.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        train_loader: DataLoader,
        test_loader: DataLoader,
        *,
        device: torch.device,
        info: ProcessInfo,
        log: Callable[[str], None] = print,
        evaluate_on_every_rank: bool = False,
    ) -> None:
        self.model = model
        self.optimizer = optimizer
        self.train_loader = train_loader
        self.test_loader = test_loader
        self.device = device
        self.info = info
        self.log = log
        self.evaluate_on_every_rank = evaluate_on_every_rank
        self.train_loss = float("nan")
        self.test_accuracy: float | None = None

    def _run_batch(self, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        self.optimizer.zero_grad(set_to_none=True)
        loss = functional.cross_entropy(self.model(images), labels)
        loss.backward()
        self.optimizer.step()
        return loss.detach()

    def _run_epoch(self, epoch: int) -> float:
        """Train one epoch; return the mean training loss over every process's samples."""
        sampler = self.train_loader.sampler
        if isinstance(sampler, DistributedSampler):
            sampler.set_epoch(epoch)  # a different shuffle each epoch, the same on every rank
        self.model.train()
        # summed on the device, read once per epoch: no host sync per batch
        totals = torch.zeros(2, dtype=torch.float64, device=self.device)
        for images, labels in self.train_loader:
            images, labels = images.to(self.device), labels.to(self.device)
            loss = self._run_batch(images, labels)
            totals[0] += loss.double() * labels.numel()
            totals[1] += labels.numel()
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(totals, op=dist.ReduceOp.SUM)  # for logging only; DDP/FSDP already synced grads
        return (totals[0] / totals[1]).item()

    @torch.no_grad()
    def evaluate(self) -> float:
        """Accuracy of the unwrapped model on the whole test set.

        The unwrapped model, because a DDP forward may broadcast buffers, a collective the
        other ranks (which do not evaluate) would never join. An FSDP model cannot be unwrapped:
        there every rank evaluates the same batches, so their all-gathers pair up.
        """
        model = unwrap(self.model)
        model.eval()
        correct = 0
        total = 0
        for images, labels in self.test_loader:
            images, labels = images.to(self.device), labels.to(self.device)
            correct += (model(images).argmax(dim=1) == labels).sum().item()
            total += labels.numel()
        model.train()
        return correct / total

    def train(self, *, first_epoch: int, epochs: int) -> int:
        """Train epochs ``first_epoch+1 .. first_epoch+epochs``; return the number of completed epochs."""
        last_epoch = first_epoch + epochs
        for epoch in range(first_epoch + 1, last_epoch + 1):
            started = time.perf_counter()
            self.train_loss = self._run_epoch(epoch)
            if self.info.is_main or self.evaluate_on_every_rank:
                self.test_accuracy = self.evaluate()
            if self.info.is_main:
                seconds = time.perf_counter() - started
                self.log(
                    f"epoch {epoch}/{last_epoch}  train_loss {self.train_loss:.4f}  "
                    f"test_accuracy {self.test_accuracy:.4f}  {seconds:.1f}s"
                )
        return last_epoch


def model_state_dict(model: nn.Module, save_style: str) -> dict[str, torch.Tensor]:
    """The weights as saved: the wrapper's own state_dict (``module.`` keys) when ``wrapped``.

    ``wrapped`` reproduces the common mistake of saving ``ddp_model.state_dict()``; ``unwrapped``
    is ``ddp_model.module.state_dict()``. A model without a wrapper saves plain keys either way.
    """
    source = model if save_style == "wrapped" else unwrap(model)
    return source.state_dict()


def run_settings(config: RunConfig, info: ProcessInfo, *, train_size: int, test_size: int, resumed_from: int | None) -> dict[str, ConfigValue]:
    """The run's settings as a plain dict (str/int/float/bool/None only, so weights_only loads it).

    Paths are left out: they describe the machine, not the run. So is the save format: a file or a
    DCP directory says it by itself.
    """
    return {
        "mode": config.mode,
        "model": config.model,
        "epochs": config.epochs,
        "batch_size": config.batch_size,
        "lr": config.lr,
        "seed": config.seed,
        "save_style": config.save_style,
        "data": config.data,
        "train_size": train_size,
        "test_size": test_size,
        "world_size": info.world_size,
        "resumed_from_epoch": resumed_from,
    }


@dataclass(frozen=True)
class ResumeSource:
    """A checked ``--resume``: a torch file loaded onto the CPU, or a DCP directory read when the model exists."""

    path: Path
    checkpoint: dict | None  # the loaded --save-format torch checkpoint; None for a DCP directory

    @property
    def is_dcp(self) -> bool:
        """The checkpoint is a DCP directory, loaded in place once the model is built (and sharded)."""
        return self.checkpoint is None


def open_resume(path: Path, model_name: str) -> ResumeSource:
    """Check ``--resume`` before any training: load a torch file, or read a DCP directory's metadata.

    A DCP directory is checked against a fresh ``model_name`` now, so a wrong ``--model`` fails before
    the data is loaded rather than after the process group is up.

    Raises:
        UsageError: nothing at ``path``, or a directory that is not a DCP checkpoint.
        TrainingError: not a full training checkpoint, not loadable safely, or (DCP) not for ``model_name``.
    """
    if path.is_dir():
        from training.dcp_io import check_dcp_training_checkpoint, load_dcp_container

        container = load_dcp_container(path)  # a torch checkpoint's container as DCP (ckptool convert --to dcp)
        if container is not None:
            return ResumeSource(path, checked_training_checkpoint(container, path))
        check_dcp_training_checkpoint(path, build_model(model_name).state_dict(), model_name=model_name)
        return ResumeSource(path, None)
    return ResumeSource(path, load_training_checkpoint(path))


def load_torch_weights(model: nn.Module, checkpoint: dict, *, path: Path, model_name: str) -> None:
    """Load a torch checkpoint's weights into the unwrapped, unsharded model.

    Raises:
        TrainingError: they do not fit the model (another --model).
    """
    try:
        model.load_state_dict(strip_wrapper_prefix(checkpoint[MODEL_KEY]))
    except (RuntimeError, ValueError, KeyError) as e:
        raise _does_not_fit(path, model_name, e) from e


def load_torch_optimizer(model: nn.Module, optimizer: torch.optim.Optimizer, checkpoint: dict, *, path: Path, model_name: str, sharded: bool) -> None:
    """Load a torch checkpoint's ``optimizer.state_dict()`` into ``optimizer``.

    Under FSDP the saved state is whole while the optimizer holds shards: it is keyed by parameter
    name and handed to ``set_optimizer_state_dict``, which keeps each rank's shard of it.

    Raises:
        TrainingError: the state does not fit the optimizer (another --model).
    """
    try:
        if sharded:
            from training.dcp_io import load_full_optimizer_state

            load_full_optimizer_state(model, optimizer, checkpoint[OPTIMIZER_KEY])
        else:
            optimizer.load_state_dict(checkpoint[OPTIMIZER_KEY])
    except (RuntimeError, ValueError, KeyError, IndexError) as e:
        raise _does_not_fit(path, model_name, e) from e


def _does_not_fit(path: Path, model_name: str, error: Exception) -> TrainingError:
    # torch's first line is a header ("Error(s) in loading state_dict for X:"); the cause follows
    lines = [line.strip() for line in str(error).strip().splitlines() if line.strip()]
    cause = lines[1] if len(lines) > 1 else lines[0] if lines else type(error).__name__
    cause = cause if len(cause) <= 160 else cause[:157] + "..."
    return TrainingError(
        f"--resume {path}: does not fit --model {model_name} ({cause}) — pass the --model the checkpoint was trained with"
    )


def save_checkpoint(
    wrapped: nn.Module,
    optimizer: torch.optim.Optimizer,
    config: RunConfig,
    info: ProcessInfo,
    *,
    extra: dict[str, object],
) -> None:
    """Save as ``--save-format`` says; every rank of a DDP/FSDP run must call this.

    ``torch``: rank 0 writes one file (under FSDP after all ranks gather the shards onto it); DP/DDP
    keep the wrapped/unwrapped choice. ``dcp``: every rank writes its part of one directory.

    Args:
        wrapped: the model as trained.
        optimizer: its optimizer.
        config: the run's settings (format, style, weights-only, out).
        info: this process's rank layout.
        extra: ``{"epoch", "config", "metrics"}``, rank 0's values.

    Raises:
        TrainingError: the save failed.
    """
    distributed = dist.is_available() and dist.is_initialized()
    model = unwrap(wrapped)
    if config.mode == "fsdp":
        # FSDP shards parameters only: each rank's BatchNorm running stats followed its own batches.
        # Rank 0's (the ones it evaluated with, and what DDP would keep) go into either format.
        for buffer in model.buffers():
            dist.broadcast(buffer, src=0)
    if config.save_format == "dcp":
        from training.dcp_io import dcp_state_dict, save_dcp

        if distributed:
            # DCP keeps one copy of a value every rank holds; rank 0 alone measured the accuracy under DDP
            holder = [extra]
            dist.broadcast_object_list(holder, src=0)
            extra = holder[0]
        state_dict = dcp_state_dict(model, optimizer, extra, weights_only=config.weights_only)
        save_dcp(state_dict, config.out, is_main=info.is_main, distributed=distributed)
        return

    if config.mode == "fsdp":
        from training.dcp_io import gather_full_state

        # a collective: every rank sends its shards, rank 0 receives whole CPU tensors
        model_state, optimizer_state = gather_full_state(model, optimizer, weights_only=config.weights_only)
        if not info.is_main:
            return
    else:
        if not info.is_main:
            return
        model_state = model_state_dict(wrapped, config.save_style)
        optimizer_state = optimizer.state_dict()
    saved: object = model_state if config.weights_only else {MODEL_KEY: model_state, OPTIMIZER_KEY: optimizer_state, **extra}
    save_torch(saved, config.out)


def run(
    config: RunConfig,
    *,
    environ: Mapping[str, str] | None = None,
    log: Callable[[str], None] = print,
) -> RunResult:
    """Train as configured and save the checkpoint (rank 0, or every rank for DCP).

    Args:
        config: the run's settings.
        environ: where torchrun's variables are read (default ``os.environ``).
        log: receives the per-epoch lines and the final line, on rank 0 only.

    Returns:
        What the run did.

    Raises:
        UsageError: bad arguments or launch environment, found before any training.
        DatasetNotFoundError: the dataset is not on disk.
        TrainingError: the resume checkpoint does not fit, or the save failed.
    """
    started = time.perf_counter()
    validate(config)
    info = process_info(config.mode, os.environ if environ is None else environ)
    if info.is_main:
        check_output_writable(config.out, config.save_format)
    resume = open_resume(config.resume, config.model) if config.resume is not None else None
    train_set = load_dataset(config.data, data_dir=config.data_dir, train=True, seed=config.seed, size=config.train_size)
    test_set = load_dataset(config.data, data_dir=config.data_dir, train=False, seed=config.seed, size=config.test_size)

    seed_everything(config.seed)
    device = select_device(config.mode, info, config.device)
    distributed = config.mode in DISTRIBUTED_MODES
    if distributed:
        # env:// rendezvous from torchrun; gloo runs anywhere, nccl needs a GPU per process
        dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo")
    try:
        model = build_model(config.model).to(device)
        if resume is not None and not resume.is_dcp:
            # before wrapping: DDP broadcasts these weights, fully_shard shards them
            load_torch_weights(model, resume.checkpoint, path=resume.path, model_name=config.model)
        wrapped = wrap_model(model, config.mode, device, info.world_size)
        # after wrapping: under FSDP the optimizer must hold the sharded parameters
        optimizer = torch.optim.Adam(unwrap(wrapped).parameters(), lr=config.lr)
        first_epoch = 0
        if resume is not None and resume.is_dcp:
            from training.dcp_io import load_dcp

            first_epoch = load_dcp(resume.path, unwrap(wrapped), optimizer, model_name=config.model, distributed=distributed)
        elif resume is not None:
            load_torch_optimizer(
                unwrap(wrapped), optimizer, resume.checkpoint, path=resume.path, model_name=config.model, sharded=config.mode == "fsdp"
            )
            first_epoch = int(resume.checkpoint[EPOCH_KEY])
        trainer = Trainer(
            wrapped,
            optimizer,
            make_loader(train_set, batch_size=config.batch_size, info=info, shuffle=True, seed=config.seed),
            DataLoader(test_set, batch_size=256),
            device=device,
            info=info,
            log=log,
            evaluate_on_every_rank=config.mode == "fsdp",
        )
        last_epoch = trainer.train(first_epoch=first_epoch, epochs=config.epochs)

        extra = {
            EPOCH_KEY: last_epoch,
            CONFIG_KEY: run_settings(
                config,
                info,
                train_size=len(train_set),
                test_size=len(test_set),
                resumed_from=first_epoch if resume is not None else None,
            ),
            METRICS_KEY: {
                "test_accuracy": None if trainer.test_accuracy is None else float(trainer.test_accuracy),
                "train_loss": trainer.train_loss,
            },
        }
        save_checkpoint(wrapped, optimizer, config, info, extra=extra)
        if distributed:
            # gloo's barrier waits for this rank's outstanding collectives too (the FSDP gather sends
            # shards that rank 1 never reads back): tearing the group down under one aborts the process
            dist.barrier()
        if not info.is_main:
            return RunResult(None, last_epoch, None, trainer.train_loss, time.perf_counter() - started)
        seconds = time.perf_counter() - started
        what = "weights" if config.weights_only else "training checkpoint"
        style = "DCP" if config.save_format == "dcp" else config.save_style
        log(
            f"final test_accuracy {trainer.test_accuracy:.4f} — saved {style} {what} "
            f"(epoch {last_epoch}) to {config.out} in {seconds:.1f}s"
        )
        return RunResult(config.out, last_epoch, trainer.test_accuracy, trainer.train_loss, seconds)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
