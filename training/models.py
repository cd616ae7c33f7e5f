"""Models for 1x28x28 grayscale inputs and 10 classes: ``lenet``, ``mlp``, ``resnet18``.

Layers are named attributes (``conv1``, ``fc1``...) rather than ``nn.Sequential`` indices so that
checkpoint keys read like the ones people meet in the wild (``module.conv1.weight``).

Example:
    >>> model = build_model("lenet")
    >>> model(torch.zeros(2, *INPUT_SHAPE)).shape
    torch.Size([2, 10])
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from training import UsageError

INPUT_SHAPE = (1, 28, 28)
NUM_CLASSES = 10


class LeNet(nn.Module):
    """d2l's LeNet variant: conv 1->20 3x3, avgpool 2, conv 20->50 5x5, avgpool 2, fc 800->128->10.

    Shapes for 28x28: 28 -conv3-> 26 -pool-> 13 -conv5-> 9 -pool-> 4, so the flattened size is
    50*4*4 = 800. ReLU instead of d2l's sigmoid: it reaches high accuracy within two epochs.
    """

    def __init__(self, num_classes: int = NUM_CLASSES) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 20, kernel_size=3)
        self.pool1 = nn.AvgPool2d(2)
        self.conv2 = nn.Conv2d(20, 50, kernel_size=5)
        self.pool2 = nn.AvgPool2d(2)
        self.flatten = nn.Flatten()
        self.fc1 = nn.Linear(50 * 4 * 4, 128)
        self.fc2 = nn.Linear(128, num_classes)
        self.relu = nn.ReLU()

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        hidden = self.pool1(self.relu(self.conv1(images)))
        hidden = self.pool2(self.relu(self.conv2(hidden)))
        hidden = self.relu(self.fc1(self.flatten(hidden)))
        return self.fc2(hidden)


class MLP(nn.Module):
    """Flatten, 784 -> 128, ReLU, 128 -> 10."""

    def __init__(self, num_classes: int = NUM_CLASSES) -> None:
        super().__init__()
        self.flatten = nn.Flatten()
        self.fc1 = nn.Linear(28 * 28, 128)
        self.relu = nn.ReLU()
        self.fc2 = nn.Linear(128, num_classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.relu(self.fc1(self.flatten(images))))


def lenet() -> nn.Module:
    """LeNet for 1x28x28 inputs (see :class:`LeNet`)."""
    return LeNet()


def mlp() -> nn.Module:
    """A one-hidden-layer MLP for 1x28x28 inputs (see :class:`MLP`)."""
    return MLP()


def resnet18() -> nn.Module:
    """torchvision's ResNet-18 (10 classes) adapted to 1x28x28 grayscale inputs.

    The stock stem (7x7 stride-2 conv on 3 channels, then a stride-2 max pool) would shrink a 28x28
    image to 7x7 before the first block; as in the usual CIFAR/MNIST adaptation, ``conv1`` becomes a
    1-channel 3x3 stride-1 conv and ``maxpool`` an ``Identity``, so the blocks see 28x28 -> 4x4.
    Every other key is torchvision's, so checkpoints keep torchvision's key names.
    """
    import torchvision  # here, not at the top: it adds about a second to every lenet/mlp process's start

    model = torchvision.models.resnet18(num_classes=NUM_CLASSES)
    model.conv1 = nn.Conv2d(INPUT_SHAPE[0], 64, kernel_size=3, stride=1, padding=1, bias=False)
    model.maxpool = nn.Identity()
    return model


MODELS: dict[str, Callable[[], nn.Module]] = {
    "lenet": lenet,
    "mlp": mlp,
    "resnet18": resnet18,
}


def register_with_ckptool() -> None:
    """Offer these models to ckptool as ``training:lenet|mlp|resnet18`` SPECs, with the synthetic test set.

    The ``ckptool.models`` entry point (training/pyproject.toml) names this function, so an
    installed ``ckptool verify --model training:lenet`` finds the models without ckptool importing
    this package; importing :mod:`training.models` calls it too. The test set is the synthetic one
    the runs evaluate on by default (``--seed 0``), so ``verify`` reports the accuracy a run logged.
    """
    from ckptool.verification.models import register

    register("training", MODELS, input_shape=(1, *INPUT_SHAPE), test_set=_default_test_set)


def _default_test_set(size: int) -> tuple[torch.Tensor, torch.Tensor]:
    from training.data import synthetic_digits
    from training.options import RunConfig

    images, labels = synthetic_digits(size, seed=RunConfig.seed, train=False).tensors
    return images, labels


def build_model(name: str) -> nn.Module:
    """Build a freshly initialised model by name (initialisation follows torch's global RNG).

    Args:
        name: one of :data:`MODELS` (``lenet``, ``mlp``, ``resnet18``).

    Returns:
        The model, on CPU, in training mode.

    Raises:
        UsageError: (a ``ValueError``) the name is not one of :data:`MODELS`.

    Example:
        >>> build_model("mlp").fc1.weight.shape
        torch.Size([128, 784])
    """
    try:
        factory = MODELS[name]
    except KeyError:
        choices = ", ".join(MODELS)
        raise UsageError(f"unknown model {name!r} — choose one of: {choices}") from None
    return factory()


register_with_ckptool()
