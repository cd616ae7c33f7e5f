"""What a run is asked to do, checked without torch: the CLI validates its arguments, the launch
environment and --out before the first ``import torch`` (about two seconds of every process start).

Nothing here may import torch, torchvision or ckptool's torch-using modules; :mod:`training.loop`,
:mod:`training.models`, :mod:`training.data` and :mod:`training.checkpoints` re-export these names.
"""

from __future__ import annotations

import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from training import DatasetNotFoundError, UsageError

MODES = ("single", "dp", "ddp", "fsdp")
# auto: a GPU where torch sees one (one per DDP/FSDP process on the node), else the CPU
DEVICES = ("auto", "cpu", "cuda")
# Modes that run as torchrun workers in one process group.
DISTRIBUTED_MODES = ("ddp", "fsdp")
SAVE_STYLES = ("unwrapped", "wrapped")
# torchrun sets these for every worker; their absence means the script was not launched by torchrun.
TORCHRUN_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE")
# The keys of training.models.MODELS (a test checks they agree).
MODEL_NAMES = ("lenet", "mlp", "resnet18")
DATASETS = ("synthetic", "mnist")
SAVE_FORMATS = ("torch", "dcp")
DCP_METADATA = ".metadata"


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
    save_format: str = "torch"
    weights_only: bool = False
    resume: Path | None = None  # a --save-format torch file or a DCP directory
    data: str = "synthetic"
    data_dir: Path | None = None
    train_size: int | None = None
    test_size: int | None = None
    device: str = "auto"


@dataclass(frozen=True)
class ProcessInfo:
    """Where this process sits in the run: its global rank, its rank on this node, and the run's size."""

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int = 1  # processes torchrun started on this node

    @property
    def is_main(self) -> bool:
        """Rank 0 logs, evaluates and saves."""
        return self.rank == 0


def process_info(mode: str, environ: Mapping[str, str]) -> ProcessInfo:
    """Read the rank layout from torchrun's environment.

    Raises:
        UsageError: ``ddp``/``fsdp`` without torchrun's variables, or ``single``/``dp`` launched as several
            torchrun workers (each would train alone and overwrite the others' output).
    """
    present = [name for name in TORCHRUN_ENV if name in environ]
    if mode in DISTRIBUTED_MODES:
        missing = [name for name in TORCHRUN_ENV if name not in environ]
        if missing:
            raise UsageError(
                f"--mode {mode} needs the torchrun environment ({', '.join(missing)} not set) — launch with: "
                f"torchrun --standalone --nproc-per-node 2 -m training --mode {mode} ..."
            )
    elif not present:
        return ProcessInfo()
    try:
        info = ProcessInfo(
            rank=int(environ.get("RANK", "0")),
            local_rank=int(environ.get("LOCAL_RANK", "0")),
            world_size=int(environ.get("WORLD_SIZE", "1")),
            local_world_size=int(environ.get("LOCAL_WORLD_SIZE", "1")),
        )
    except ValueError as e:
        raise UsageError(f"torchrun environment is not numeric ({e}) — launch with torchrun") from e
    if mode not in DISTRIBUTED_MODES and info.world_size > 1:
        raise UsageError(
            f"--mode {mode} launched as {info.world_size} torchrun workers — use --mode ddp or fsdp, "
            "or run it with plain python"
        )
    return info


def check_output_writable(out: Path, save_format: str = "torch") -> None:
    """Fail before training when ``out`` could not be written.

    Raises:
        UsageError: the directory is missing, not a directory, or not writable; or ``out`` is a directory
            (``torch``), or a file or a directory other than a DCP checkpoint (``dcp``).
    """
    directory = out.parent
    if save_format == "dcp":
        check_dcp_output(out)
    elif out.is_dir():
        raise UsageError(
            f"--out {out} is a directory — give a file path such as {out / 'checkpoint.pt'}, "
            "or --save-format dcp to write a DCP directory"
        )
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


def validate(config: RunConfig) -> None:
    """Check the arguments that need no data, model or process group.

    Raises:
        UsageError: the first problem found.
    """
    if config.mode not in MODES:
        raise UsageError(f"unknown mode {config.mode!r} — choose one of: {', '.join(MODES)}")
    if config.model not in MODEL_NAMES:
        raise UsageError(f"unknown model {config.model!r} — choose one of: {', '.join(MODEL_NAMES)}")
    if config.data not in DATASETS:
        raise UsageError(f"unknown dataset {config.data!r} — choose one of: {', '.join(DATASETS)}")
    if config.save_style not in SAVE_STYLES:
        raise UsageError(f"unknown save style {config.save_style!r} — choose one of: {', '.join(SAVE_STYLES)}")
    if config.save_format not in SAVE_FORMATS:
        raise UsageError(f"unknown save format {config.save_format!r} — choose one of: {', '.join(SAVE_FORMATS)}")
    if config.device not in DEVICES:
        raise UsageError(f"unknown device {config.device!r} — choose one of: {', '.join(DEVICES)}")
    if config.save_format == "dcp" and config.save_style == "wrapped":
        # get_state_dict names parameters as the model does, whatever wraps it: no "module." to keep
        raise UsageError(
            "--save-style wrapped needs --save-format torch — a DCP checkpoint always holds the model's own keys"
        )
    for name in ("epochs", "batch_size", "train_size", "test_size"):
        value = getattr(config, name)
        if value is not None and value <= 0:
            raise UsageError(f"--{name.replace('_', '-')} must be positive, got {value}")
    if not config.lr > 0:
        raise UsageError(f"--lr must be positive, got {config.lr}")


def check_dataset_present(data: str, data_dir: Path | None) -> None:
    """Fail before training (and before importing torchvision) when MNIST cannot be there.

    Only what torchvision's ``MNIST(root=data_dir)`` needs at the least: ``data_dir/MNIST/raw``.
    :func:`training.data.mnist` still reports anything torchvision itself refuses.

    Raises:
        DatasetNotFoundError: ``--data mnist`` without --data-dir, or no ``MNIST/raw`` under it.
    """
    if data != "mnist":
        return
    hint = "place MNIST there (torchvision layout DIR/MNIST/raw/) or use --data synthetic"
    if data_dir is None:
        raise DatasetNotFoundError(f"--data mnist needs --data-dir DIR; training never downloads — {hint}")
    if not (data_dir / "MNIST" / "raw").is_dir():
        raise DatasetNotFoundError(f"no MNIST found under {data_dir} — {hint}")


# ---------------------------------------------------------------------------------------------
# --save-format dcp: where it goes (the writing is training.dcp_io's)


def is_dcp_directory(path: Path) -> bool:
    """True if ``path`` is a directory holding a DCP ``.metadata`` file."""
    return path.is_dir() and (path / DCP_METADATA).is_file()


def check_dcp_output(out: Path) -> None:
    """Fail before training when ``out`` cannot become a DCP checkpoint directory.

    An existing DCP checkpoint (or an empty directory) is replaced, as an existing file is for
    ``--save-format torch``; any other existing path is refused rather than deleted.

    Raises:
        UsageError: the parent directory is missing, or ``out`` is a file or a directory holding anything else.
    """
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out {out} is a file — a DCP checkpoint is a directory; give a new path such as {out}.dcp")
    if out.is_dir() and not is_dcp_directory(out) and any(out.iterdir()):
        raise UsageError(
            f"--out {out} is a directory that is not a DCP checkpoint — refusing to replace it; give a new path"
        )
    if not out.parent.is_dir():
        raise UsageError(f"--out {out}: directory {out.parent} does not exist — create it first")
