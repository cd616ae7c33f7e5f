"""Devices: saved location tags, rewriting them, and discovering where tensors can run.

A storage's location tag (``"cpu"``, ``"cuda:1"``) is what torch.load restores it onto; a tag
naming a GPU the loading machine lacks is the "Attempting to deserialize object on a CUDA device"
error. Rewriting tags is string work — it needs no GPU.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Callable, Iterable

from .errors import UsageError

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
            raise UsageError(f"--map {item!r} is not OLD=NEW, e.g. --map cuda:1=cuda:0")
        pairs[normalize_location(old)] = normalize_location(new)
    if to is not None and pairs:
        raise UsageError("give either --to or --map, not both")
    if to is None and not pairs:
        raise UsageError("say where to: --to cpu, or --map cuda:1=cuda:0")
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
    import torch

    devices = ["cpu"]
    if torch.cuda.is_available():
        devices += [f"cuda:{index}" for index in range(torch.cuda.device_count())]
    mps = getattr(torch.backends, "mps", None)
    if mps is not None and mps.is_available():
        devices.append("mps")
    return devices
