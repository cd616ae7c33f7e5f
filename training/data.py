"""Datasets for 1x28x28, 10-class training: synthetic digits (default, offline) and local MNIST.

Training never downloads anything: the synthetic set is generated from a seed, and MNIST is read
from a directory the user filled beforehand.

Example:
    >>> train_set = load_dataset("synthetic", data_dir=None, train=True, seed=0, size=600)
    >>> images, labels = train_set.tensors
    >>> images.shape, labels.shape
    (torch.Size([600, 1, 28, 28]), torch.Size([600]))
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch.nn import functional
from torch.utils.data import TensorDataset

from training import DatasetNotFoundError, UsageError
from training.options import DATASETS

DEFAULT_TRAIN_SIZE = 6000
DEFAULT_TEST_SIZE = 1000

# A constant, not the run's seed: every split and every seed must share the same ten classes.
PROTOTYPE_SEED = 1998
# Standard MNIST normalisation; the synthetic images are built to roughly the same statistics.
MNIST_MEAN = 0.1307
MNIST_STD = 0.3081

_MAX_SHIFT = 3  # pixels, each direction
_NOISE_STD = 0.3
_SPLIT_OFFSET = {True: 0, False: 1}  # train and test draw different samples from the same seed


def class_prototypes() -> torch.Tensor:
    """The ten class images (10x28x28, values in [0, 1]) that synthetic samples are drawn around.

    Smooth blobs rather than pixel noise: a coarse 7x7 random pattern upsampled to 28x28 and
    windowed towards the centre, so a few pixels of shift keep an image recognisable (like a digit).
    """
    generator = torch.Generator().manual_seed(PROTOTYPE_SEED)
    coarse = torch.rand(10, 1, 7, 7, generator=generator)
    smooth = functional.interpolate(coarse, size=(28, 28), mode="bilinear", align_corners=False)
    axis = torch.linspace(-1.0, 1.0, 28)
    window = torch.exp(-(axis[:, None] ** 2 + axis[None, :] ** 2) / 0.5)
    strokes = ((smooth.squeeze(1) - 0.45) * 4.0).clamp(0.0, 1.0)
    return strokes * window


def synthetic_digits(n: int, *, seed: int, train: bool) -> TensorDataset:
    """A learnable synthetic 10-class dataset of 1x28x28 images, deterministic in ``(n, seed, train)``.

    Each sample is its class prototype (see :func:`class_prototypes`) with a random contrast, a
    random shift of up to 3 pixels and Gaussian pixel noise, normalised like MNIST. A LeNet or MLP
    learns it to well above 80% test accuracy within two epochs of 6000 samples.

    Args:
        n: number of samples.
        seed: the run's seed; the train and test splits of one seed hold different samples.
        train: which split.

    Returns:
        ``TensorDataset(images float32 [n, 1, 28, 28], labels int64 [n])``.

    Raises:
        UsageError: ``n`` is not positive.
    """
    if n <= 0:
        raise UsageError(f"dataset size must be positive, got {n}")
    generator = torch.Generator().manual_seed(seed * 2 + _SPLIT_OFFSET[train])
    prototypes = class_prototypes()
    labels = torch.randint(0, 10, (n,), generator=generator)
    contrast = torch.empty(n, 1, 1).uniform_(0.6, 1.4, generator=generator)
    shifts = torch.randint(-_MAX_SHIFT, _MAX_SHIFT + 1, (n, 2), generator=generator)
    noise = torch.randn(n, 28, 28, generator=generator) * _NOISE_STD
    images = prototypes[labels] * contrast
    for index, (dy, dx) in enumerate(shifts.tolist()):
        images[index] = torch.roll(images[index], shifts=(dy, dx), dims=(0, 1))
    images = (images + noise - MNIST_MEAN) / MNIST_STD
    return TensorDataset(images.unsqueeze(1).contiguous(), labels)


def mnist(data_dir: Path | None, *, train: bool, size: int | None = None) -> TensorDataset:
    """MNIST from ``data_dir`` (torchvision layout ``DIR/MNIST/raw/...``), normalised, as tensors.

    Args:
        data_dir: the directory given to torchvision's ``MNIST(root=...)``; nothing is downloaded.
        train: which split.
        size: keep only the first ``size`` samples (all when None).

    Raises:
        DatasetNotFoundError: ``data_dir`` is None or holds no MNIST.
    """
    from torchvision import datasets

    hint = "place MNIST there (torchvision layout DIR/MNIST/raw/) or use --data synthetic"
    if data_dir is None:
        raise DatasetNotFoundError(f"--data mnist needs --data-dir DIR; training never downloads — {hint}")
    try:
        dataset = datasets.MNIST(root=str(data_dir), train=train, download=False)
    except RuntimeError as e:  # torchvision's "Dataset not found. You can use download=True..."
        raise DatasetNotFoundError(f"no MNIST found under {data_dir} — {hint}") from e
    images = dataset.data[:size].float().div(255.0).sub(MNIST_MEAN).div(MNIST_STD)
    labels = dataset.targets[:size].long()
    return TensorDataset(images.unsqueeze(1).contiguous(), labels)


def load_dataset(
    name: str,
    *,
    data_dir: Path | None,
    train: bool,
    seed: int,
    size: int | None = None,
) -> TensorDataset:
    """Load a dataset split by name.

    Args:
        name: ``synthetic`` (generated from ``seed``) or ``mnist`` (read from ``data_dir``).
        data_dir: where MNIST lies; unused for ``synthetic``.
        train: which split.
        seed: seed of the synthetic samples; unused for ``mnist``.
        size: number of samples; default 6000 train / 1000 test for ``synthetic``, all for ``mnist``.

    Raises:
        UsageError: unknown name.
        DatasetNotFoundError: MNIST requested but not on disk.

    Example:
        >>> len(load_dataset("synthetic", data_dir=None, train=False, seed=0))
        1000
    """
    if name == "synthetic":
        default_size = DEFAULT_TRAIN_SIZE if train else DEFAULT_TEST_SIZE
        return synthetic_digits(default_size if size is None else size, seed=seed, train=train)
    if name == "mnist":
        return mnist(data_dir, train=train, size=size)
    raise UsageError(f"unknown dataset {name!r} — choose one of: {', '.join(DATASETS)}")
