"""Real training runs that save checkpoints the ways people do (single process, DataParallel, DDP, FSDP).

ckptool's tests and fixtures need checkpoints made by real training code, with every circumstance
that leaks into a checkpoint: ``module.`` prefixes from DataParallel/DDP, training containers with
optimizer state, checkpoints saved by rank 0 of a multi-process run, sharded DCP directories
written by every rank. Run it with ``python -m training --help``; the run commands are in
``training/__main__.py``.

Modules:
    models: ``lenet``, ``mlp``, ``resnet18`` for 1x28x28 inputs and 10 classes.
    data: a learnable synthetic 10-class dataset (offline, seeded) and MNIST from a local directory.
    loop: the Trainer (single / dp / ddp / fsdp), what each mode saves, and resuming.
    checkpoints: the two save formats (one torch.save file, a DCP directory) written atomically, and
        reading a DCP directory back safely.
"""

from __future__ import annotations

__all__ = ["DatasetNotFoundError", "TrainingError", "UsageError"]


class TrainingError(Exception):
    """An expected failure: the CLI prints its one-line message and exits with ``exit_code``."""

    exit_code = 1


class UsageError(TrainingError, ValueError):
    """The arguments or the launch environment are wrong (unknown model, ddp without torchrun, bad --out)."""

    exit_code = 2


class DatasetNotFoundError(TrainingError, FileNotFoundError):
    """The requested dataset is not on disk (training never downloads)."""

    exit_code = 2
