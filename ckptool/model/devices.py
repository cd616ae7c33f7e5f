"""Devices: saved location tags, rewriting them, discovering where tensors can run, and running there.

A storage's location tag (``"cpu"``, ``"cuda:1"``) is what torch.load restores it onto; a tag
naming a GPU the loading machine lacks is the "Attempting to deserialize object on a CUDA device"
error. Rewriting tags is string work — it needs no GPU.

``verify`` reaches a device only through a :class:`Device` (move a model or tensor there, wait for
its work): :class:`TorchDevice` is the real one; a test passes its own (one that runs a "cuda:1"
row on CPU, flips bits, records) to ``verify(devices=[...])``.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, TypeVar, runtime_checkable

from ckptool.base.errors import UsageError
from ckptool.base.suggest import given, option
from ckptool.base.torch_import import import_torch, torch_installed

if TYPE_CHECKING:  # pragma: no cover - typing only; torch is imported where a device is used
    import torch

Movable = TypeVar("Movable")  # a torch.nn.Module or a torch.Tensor

_TAG = re.compile(r"^(cpu|cuda|mps|xpu|hpu|meta|privateuseone|mtia|xla)(?::(\d+))?$")


def normalize_location(tag: str) -> str:
    """Validate a location tag as torch writes it: ``cpu``, ``cuda``, ``cuda:1``, ``mps``..."""
    text = tag.strip()
    if not _TAG.match(text):
        raise UsageError(f"{tag!r} is not a device like cpu, cuda, cuda:1 or mps")
    return text


def location_mapper(to: str | None = None, mapping: Iterable[str] = ()) -> Callable[[str], str]:
    """A function from saved tag to new tag: ``to`` sends every tag there; ``mapping`` pairs ``old=new``.

    Example:
        >>> location_mapper(mapping=["cuda:1=cuda:0"])("cuda:1")
        'cuda:0'
    """
    pairs: dict[str, str] = {}
    for item in mapping:
        old, sep, new = item.partition("=")
        if not sep:
            raise UsageError(given("mapping", item) + " is not OLD=NEW, e.g. " + option("mapping", ["cuda:1=cuda:0"]))
        pairs[normalize_location(old)] = normalize_location(new)
    if to is not None and pairs:
        raise UsageError("give either " + option("to_device", None) + " or " + option("mapping", None) + ", not both")
    if to is None and not pairs:
        raise UsageError("say where to: " + option("to_device", "cpu") + ", or " + option("mapping", ["cuda:1=cuda:0"]))
    target = normalize_location(to) if to is not None else None

    def remap(tag: str) -> str:
        if target is not None:
            return target
        return pairs.get(tag, tag)

    return remap


def _accelerator_possible() -> bool:
    """Cheap check before importing torch (~1.5 s): is there any GPU driver on this machine at all?"""
    if sys.platform == "darwin":  # MPS
        return True
    markers = ("/dev/nvidia0", "/dev/nvidiactl", "/proc/driver/nvidia", "/dev/kfd", "/dev/dxg")
    return any(os.path.exists(marker) for marker in markers)


def available_devices() -> list[str]:
    """CPU plus every visible CUDA device (and MPS). Tests substitute this function."""
    if not _accelerator_possible():
        return ["cpu"]
    try:
        import torch
    except ImportError:  # the core install, without torch: the CPU alone, where verify streams the bytes
        return ["cpu"]

    devices = ["cpu"]
    if torch.cuda.is_available():
        devices += [f"cuda:{index}" for index in range(torch.cuda.device_count())]
    mps = getattr(torch.backends, "mps", None)
    if mps is not None and mps.is_available():
        devices.append("mps")
    return devices


@runtime_checkable
class Device(Protocol):
    """Where verify runs a model: it moves modules and tensors there and waits for the work queued there."""

    @property
    def name(self) -> str:
        """The device as reported (``"cpu"``, ``"cuda:1"``); ``"cpu"`` is the reference."""
        ...

    def move(self, value: Movable) -> Movable:
        """``value`` (an ``nn.Module``, moved in place, or a tensor, copied) on this device."""
        ...

    def synchronize(self, tensors: Iterable[torch.Tensor]) -> None:
        """Wait until the work producing ``tensors`` is done, so a kernel's failure surfaces here."""
        ...


@dataclass(frozen=True)
class TorchDevice:
    """A device torch names (``cpu``, ``cuda:N``, ``mps``, ``xpu:N``): ``.to(name)``, then the backend's sync."""

    name: str

    def move(self, value: Movable) -> Movable:
        return value.to(self.name)  # type: ignore[attr-defined]

    def synchronize(self, tensors: Iterable[torch.Tensor]) -> None:
        import torch

        waited: set[str] = set()
        for tensor in tensors:
            device = tensor.device
            if str(device) in waited:
                continue
            waited.add(str(device))
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            elif device.type == "mps":
                torch.mps.synchronize()


def resolve_devices(devices: str | Sequence[str]) -> list[str]:
    """``"all"`` -> every available device; ``"cpu,cuda:0"`` -> that list, each checked to exist here.

    Raises:
        UsageError: a device is malformed or not available on this machine.
    """
    if isinstance(devices, str):
        requested = [part.strip() for part in devices.split(",") if part.strip()]
    else:
        requested = [str(part).strip() for part in devices]
    if not requested:
        raise UsageError(option("devices", None) + " is empty — pass all, or a list like cpu,cuda:0")
    if requested == ["all"]:
        return list(available_devices())
    tags = []
    for device in requested:
        tag = normalize_location(device)
        tags.append(tag + ":0" if tag in ("cuda", "xpu") else tag)
    # the CPU alone is there without asking: no torch import (and no CUDA start) for a --devices cpu check
    available = ["cpu"] if set(tags) == {"cpu"} else list(available_devices())
    resolved: list[str] = []
    for tag in tags:
        if tag not in available:
            if tag != "cpu" and not torch_installed():
                import_torch(f"verifying on {tag}")  # says how to install it
            raise UsageError(
                option("devices", None) + f": {tag} is not available on this machine "
                f"(available: {', '.join(available)})"
            )
        if tag not in resolved:
            resolved.append(tag)
    return resolved


def open_devices(devices: str | Sequence[str | Device]) -> list[Device]:
    """The devices to run on: names as :func:`resolve_devices` checks them (each a :class:`TorchDevice`);
    :class:`Device` objects in a list are taken as given (the caller's own, e.g. a test's).

    Raises:
        UsageError: a name is malformed or not available on this machine.
    """
    if isinstance(devices, str) or all(isinstance(entry, str) for entry in devices):
        return [TorchDevice(name) for name in resolve_devices(devices)]  # type: ignore[arg-type]
    opened: list[Device] = []
    for entry in devices:
        if not isinstance(entry, str):
            opened.append(entry)
            continue
        for name in resolve_devices([entry]):
            if all(device.name != name for device in opened):
                opened.append(TorchDevice(name))
    return opened
