"""One Trainer for single-process, DataParallel and DistributedDataParallel runs, and how they save.

The shape follows pytorch/examples' ``distributed/ddp-tutorial-series``: the same Trainer runs every
mode; only the wrapper around the model, the process group and who saves differ. Every mode draws
batches through a ``DistributedSampler`` (one replica outside DDP) so shuffling depends only on
``(seed, epoch)`` and a resumed run sees the batches an uninterrupted one would.

Nothing here assumes a single node: devices come from ``LOCAL_RANK``, rank-0 duties (logging,
evaluating, saving) from ``RANK``.

Example:
    >>> result = run(RunConfig(mode="single", model="mlp", epochs=1, out=Path("mlp.pt")))
    >>> sorted(torch.load("mlp.pt", weights_only=True))
    ['config', 'epoch', 'metrics', 'model', 'optimizer']
"""

from __future__ import annotations

import os
import pickle
import random
import tempfile
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

from ckptool.atomic import atomic_output
from ckptool.errors import OutputError
from training import TrainingError, UsageError
from training.data import DATASETS, load_dataset
from training.models import MODELS, build_model

MODES = ("single", "dp", "ddp")
SAVE_STYLES = ("unwrapped", "wrapped")
# Prefix nn.DataParallel and DistributedDataParallel put on every key of their own state_dict().
WRAPPER_PREFIX = "module."
# Keys of the full training checkpoint (the default save); "model" holds the weights.
MODEL_KEY = "model"
OPTIMIZER_KEY = "optimizer"
EPOCH_KEY = "epoch"
CONFIG_KEY = "config"
METRICS_KEY = "metrics"
# torchrun sets these for every worker; their absence means the script was not launched by torchrun.
TORCHRUN_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE")

ConfigValue = str | int | float | bool | None


@dataclass(frozen=True)
class RunConfig:
    """The settings of one training run (the CLI's arguments)."""

    mode: str = "single"
    model: str = "lenet"
    epochs: int = 2
    batch_size: int = 64  # per process: a DDP run of N processes steps on N*batch_size samples
    lr: float = 1e-3
    seed: int = 0
    out: Path = Path("checkpoint.pt")
    save_style: str = "unwrapped"
    weights_only: bool = False
    resume: Path | None = None
    data: str = "synthetic"
    data_dir: Path | None = None
    train_size: int | None = None
    test_size: int | None = None


@dataclass(frozen=True)
class ProcessInfo:
    """Where this process sits in the run: its global rank, its rank on this node, and the run's size."""

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1

    @property
    def is_main(self) -> bool:
        """Rank 0 logs, evaluates and saves."""
        return self.rank == 0


@dataclass(frozen=True)
class RunResult:
    """What a run did: on rank 0 the saved path and metrics; other ranks save and measure nothing."""

    out: Path | None
    epoch: int
    test_accuracy: float | None
    train_loss: float
    seconds: float


def process_info(mode: str, environ: Mapping[str, str]) -> ProcessInfo:
    """Read the rank layout from torchrun's environment.

    Raises:
        UsageError: ``ddp`` without torchrun's variables, or ``single``/``dp`` launched as several
            torchrun workers (each would train alone and overwrite the others' output).
    """
    present = [name for name in TORCHRUN_ENV if name in environ]
    if mode == "ddp":
        missing = [name for name in TORCHRUN_ENV if name not in environ]
        if missing:
            raise UsageError(
                f"--mode ddp needs the torchrun environment ({', '.join(missing)} not set) — launch with: "
                "torchrun --standalone --nproc-per-node 2 -m training --mode ddp ..."
            )
    elif not present:
        return ProcessInfo()
    try:
        info = ProcessInfo(
            rank=int(environ.get("RANK", "0")),
            local_rank=int(environ.get("LOCAL_RANK", "0")),
            world_size=int(environ.get("WORLD_SIZE", "1")),
        )
    except ValueError as e:
        raise UsageError(f"torchrun environment is not numeric ({e}) — launch with torchrun") from e
    if mode != "ddp" and info.world_size > 1:
        raise UsageError(
            f"--mode {mode} launched as {info.world_size} torchrun workers — use --mode ddp, "
            "or run it with plain python"
        )
    return info


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
    # deterministic version; they should warn, not stop the run.
    torch.use_deterministic_algorithms(True, warn_only=True)


def select_device(mode: str, info: ProcessInfo) -> torch.device:
    """cuda:LOCAL_RANK for a DDP worker, cuda:0 otherwise when CUDA is available, else the CPU."""
    if not torch.cuda.is_available():
        return torch.device("cpu")
    index = info.local_rank if mode == "ddp" else 0
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def check_output_writable(out: Path) -> None:
    """Fail before training when ``out`` could not be written.

    Raises:
        UsageError: the directory is missing, not a directory, or not writable, or ``out`` is a directory.
    """
    directory = out.parent
    if out.is_dir():
        raise UsageError(f"--out {out} is a directory — give a file path such as {out / 'checkpoint.pt'}")
    if not directory.is_dir():
        raise UsageError(f"--out {out}: directory {directory} does not exist — create it first")
    try:
        # a real probe: os.access says yes to root on read-only mounts
        with tempfile.TemporaryFile(dir=directory):
            pass
    except OSError as e:
        raise UsageError(
            f"--out {out}: directory {directory} is not writable ({e.strerror}) — choose a writable directory"
        ) from e


def unwrap(model: nn.Module) -> nn.Module:
    """The user's model inside a DataParallel/DDP wrapper (the model itself when unwrapped)."""
    if isinstance(model, (nn.DataParallel, DistributedDataParallel)):
        return model.module
    return model


def wrap_model(model: nn.Module, mode: str, device: torch.device) -> nn.Module:
    """Wrap the model for the mode: nothing (single), DataParallel (dp), DistributedDataParallel (ddp)."""
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
    """Load a full training checkpoint to resume from (``weights_only=True``, onto the CPU).

    Raises:
        UsageError: the file does not exist.
        TrainingError: it cannot be loaded safely, or is not a full training checkpoint.
    """
    if not path.is_file():
        raise UsageError(f"--resume {path}: no such file — give a checkpoint saved by python -m training")
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, OSError) as e:
        first_line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise TrainingError(
            f"--resume {path}: cannot be loaded with weights_only=True ({first_line}) — "
            "resume from a checkpoint saved by python -m training"
        ) from e
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
    """Trains a (possibly wrapped) model; the same code path for single, dp and ddp.

    Args:
        model: the model as trained: plain, ``nn.DataParallel`` or ``DistributedDataParallel``.
        optimizer: over the parameters of the unwrapped model.
        train_loader: yields this process's shard; its sampler must be a ``DistributedSampler``.
        test_loader: the whole test set; only rank 0 evaluates.
        device: where batches go.
        info: this process's rank layout.
        log: called with one line per epoch on rank 0.
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
    ) -> None:
        self.model = model
        self.optimizer = optimizer
        self.train_loader = train_loader
        self.test_loader = test_loader
        self.device = device
        self.info = info
        self.log = log
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
            dist.all_reduce(totals, op=dist.ReduceOp.SUM)  # for logging only; DDP already synced grads
        return (totals[0] / totals[1]).item()

    @torch.no_grad()
    def evaluate(self) -> float:
        """Accuracy of the unwrapped model on the whole test set.

        The unwrapped model, because a DDP forward may broadcast buffers, a collective the
        other ranks (which do not evaluate) would never join.
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
            if self.info.is_main:
                self.test_accuracy = self.evaluate()
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

    Paths are left out: they describe the machine, not the run.
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


def save_atomically(obj: object, out: Path) -> None:
    """``torch.save`` to a temp file beside ``out``, fsync, rename into place.

    Raises:
        TrainingError: the file could not be written (nothing is left behind).
    """
    try:
        with atomic_output(out) as (handle, _temp_path):
            torch.save(obj, handle)
    except OutputError as e:
        raise TrainingError(f"--out {out}: {e.message}") from e


def validate(config: RunConfig) -> None:
    """Check the arguments that need no data, model or process group.

    Raises:
        UsageError: the first problem found.
    """
    if config.mode not in MODES:
        raise UsageError(f"unknown mode {config.mode!r} — choose one of: {', '.join(MODES)}")
    if config.model not in MODELS:
        raise UsageError(f"unknown model {config.model!r} — choose one of: {', '.join(MODELS)}")
    if config.data not in DATASETS:
        raise UsageError(f"unknown dataset {config.data!r} — choose one of: {', '.join(DATASETS)}")
    if config.save_style not in SAVE_STYLES:
        raise UsageError(f"unknown save style {config.save_style!r} — choose one of: {', '.join(SAVE_STYLES)}")
    for name in ("epochs", "batch_size", "train_size", "test_size"):
        value = getattr(config, name)
        if value is not None and value <= 0:
            raise UsageError(f"--{name.replace('_', '-')} must be positive, got {value}")
    if not config.lr > 0:
        raise UsageError(f"--lr must be positive, got {config.lr}")


def run(
    config: RunConfig,
    *,
    environ: Mapping[str, str] | None = None,
    log: Callable[[str], None] = print,
) -> RunResult:
    """Train as configured and save the checkpoint (rank 0 only).

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
        check_output_writable(config.out)
    resume_from = load_training_checkpoint(config.resume) if config.resume is not None else None
    train_set = load_dataset(config.data, data_dir=config.data_dir, train=True, seed=config.seed, size=config.train_size)
    test_set = load_dataset(config.data, data_dir=config.data_dir, train=False, seed=config.seed, size=config.test_size)

    seed_everything(config.seed)
    device = select_device(config.mode, info)
    if config.mode == "ddp":
        # env:// rendezvous from torchrun; gloo runs anywhere, nccl needs a GPU per process
        dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo")
    try:
        model = build_model(config.model).to(device)
        optimizer = torch.optim.Adam(model.parameters(), lr=config.lr)
        first_epoch = 0
        if resume_from is not None:
            try:
                model.load_state_dict(strip_wrapper_prefix(resume_from[MODEL_KEY]))
                optimizer.load_state_dict(resume_from[OPTIMIZER_KEY])
            except (RuntimeError, ValueError, KeyError) as e:
                # torch's first line is a header ("Error(s) in loading state_dict for X:"); the cause follows
                lines = [line.strip() for line in str(e).strip().splitlines() if line.strip()]
                cause = lines[1] if len(lines) > 1 else lines[0] if lines else type(e).__name__
                cause = cause if len(cause) <= 160 else cause[:157] + "..."
                raise TrainingError(
                    f"--resume {config.resume}: does not fit --model {config.model} ({cause}) — "
                    "pass the --model the checkpoint was trained with"
                ) from e
            first_epoch = int(resume_from[EPOCH_KEY])
        wrapped = wrap_model(model, config.mode, device)
        trainer = Trainer(
            wrapped,
            optimizer,
            make_loader(train_set, batch_size=config.batch_size, info=info, shuffle=True, seed=config.seed),
            DataLoader(test_set, batch_size=256),
            device=device,
            info=info,
            log=log,
        )
        last_epoch = trainer.train(first_epoch=first_epoch, epochs=config.epochs)

        if not info.is_main:
            return RunResult(None, last_epoch, None, trainer.train_loss, time.perf_counter() - started)
        state_dict = model_state_dict(wrapped, config.save_style)
        if config.weights_only:
            saved: object = state_dict
        else:
            saved = {
                MODEL_KEY: state_dict,
                OPTIMIZER_KEY: optimizer.state_dict(),
                EPOCH_KEY: last_epoch,
                CONFIG_KEY: run_settings(
                    config,
                    info,
                    train_size=len(train_set),
                    test_size=len(test_set),
                    resumed_from=first_epoch if resume_from is not None else None,
                ),
                METRICS_KEY: {"test_accuracy": float(trainer.test_accuracy), "train_loss": trainer.train_loss},
            }
        save_atomically(saved, config.out)
        seconds = time.perf_counter() - started
        what = "weights" if config.weights_only else "training checkpoint"
        log(
            f"final test_accuracy {trainer.test_accuracy:.4f} — saved {config.save_style} {what} "
            f"(epoch {last_epoch}) to {config.out} in {seconds:.1f}s"
        )
        return RunResult(config.out, last_epoch, trainer.test_accuracy, trainer.train_loss, seconds)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
