"""Checkpoint: a container, where the weights live in it, and how it was saved."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from . import keys as keys_
from .errors import InputError, NothingToDoError
from .refs import StorageRef, TensorRef
from . import layouts
from .layouts import LayoutTensor
from .tree import contains, get_at, iter_tensors, map_tensors, replace_at

# Where training code puts the weights, tried in order (first match wins).
#   state_dict        Lightning, timm, many scripts          model_state_dict  the PyTorch tutorial's resumable dict
#   model             this project's training/, fairseq, DETR module   DeepSpeed
#   net / network     older research code                     ema/model_ema     EMA copies (after the live weights)
WEIGHTS_KEYS = ("state_dict", "model_state_dict", "model", "module", "model_state", "net", "network",
                "weights", "params", "model_ema", "ema", "state_dict_ema")
LIGHTNING_MARKERS = ("pytorch-lightning_version", "hyper_parameters", "lightning_version")


def is_state_dict(obj: Any) -> bool:
    """A str-keyed mapping whose values are mostly tensors."""
    if not isinstance(obj, dict) or not obj or not all(isinstance(k, str) for k in obj):
        return False
    tensors = sum(isinstance(v, TensorRef | LayoutTensor) for v in dict.values(obj))  # never an attribute the pickle set
    return tensors > 0 and tensors * 2 >= len(obj)


def find_layout(container: Any) -> tuple[Any, ...] | None:
    """The key path from the top-level object to the weights, or None if there are none.

    Example:
        >>> find_layout({"model": {"fc.weight": tensor}, "epoch": 3})   # doctest: +SKIP
        ('model',)
    """
    if is_state_dict(container):
        return ()
    node: Any = container
    path: tuple[Any, ...] = ()
    for _ in range(4):
        if not isinstance(node, dict):
            break
        for key in WEIGHTS_KEYS:
            if is_state_dict(dict.get(node, key)):
                return path + (key,)
        nested = [key for key in WEIGHTS_KEYS if isinstance(dict.get(node, key), dict)]
        if not nested:
            break
        node, path = node[nested[0]], path + (nested[0],)
    if isinstance(container, dict):
        candidates = [(sum(1 for _ in iter_tensors(v)), k) for k, v in dict.items(container) if is_state_dict(v)]
        if candidates:
            return (max(candidates)[1],)
    return None


@dataclass
class Checkpoint:
    """A checkpoint as read: the unpickled container with lazy tensors, and where the weights are.

    Attributes:
        path: the file or directory read.
        format: the name of its :class:`~ckptool.formats.Format`: ``torch-zip``, ``torch-legacy``,
            ``safetensors``, ``safetensors-sharded`` or ``dcp``.
        container: the top-level object (dicts, lists and :class:`~ckptool.refs.TensorRef` leaves).
        layout: key path to the weights inside ``container`` (``()`` for a bare state_dict).
        globals: every pickle global used, with counts (empty for safetensors).
        metadata: safetensors metadata (string to string).
        files: every file the checkpoint spans.
        allow_globals: the ``allow_globals`` entries it was read with (a command suggested for it
            carries them).

    Example:
        >>> ckpt = ckptool.load("ddp.pt")                      # doctest: +SKIP
        >>> ckpt.prefix, ckpt.layout                           # doctest: +SKIP
        ('module.', ('model',))
        >>> ckptool.save(ckpt.strip_prefix(), "model.pt")     # doctest: +SKIP
    """

    path: Path
    format: str
    container: Any
    layout: tuple[Any, ...] | None
    globals: dict[str, int] = field(default_factory=dict)
    metadata: dict[str, str] = field(default_factory=dict)
    files: list[Path] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    allow_globals: tuple[str, ...] = ()

    # views ----------------------------------------------------------------------------------
    @property
    def has_weights(self) -> bool:
        return self.layout is not None

    @property
    def state_dict(self) -> dict:
        """The weights mapping inside the container."""
        if self.layout is None:
            raise InputError("holds no weights (no mapping of names to tensors) — is this a checkpoint?", path=self.path)
        return get_at(self.container, self.layout)

    @property
    def tensors(self) -> dict[str, TensorRef]:
        """The weights: name -> tensor (non-tensor entries left out).

        A sparse or nested tensor stands here as its component tensors, named
        ``key[layout size/role]`` (:func:`ckptool.layouts.component_name`), so what reads or checks
        every tensor (diff, fingerprint, verify, a write's check) covers its values.
        """
        state_dict = self.state_dict
        items = dict.items(state_dict) if isinstance(state_dict, dict) else state_dict.items()  # a caller's Mapping
        found = {k: v for k, v in items if isinstance(v, TensorRef)}
        if len(found) < len(state_dict):
            layouts.add_components(found, state_dict, self.path)
        return found

    def tensors_by_place(self) -> dict[str, TensorRef]:
        """Every tensor of a container that holds no mapping of names to weights (a bare tensor, a
        list or tuple of tensors, a dict with integer keys), named by where it lies: ``0``, ``a.1``,
        ``tensor`` for a bare one (``storage``); a storage saved on its own counts as a 1-d tensor of its dtype.
        ``diff`` compares two such files by these names.

        Raises:
            InputError: it holds no tensor; two places spell one name (``{1: t, "1": u}``); or a
                sparse, nested or quantized tensor, whose values are more than its parts' bytes
                (their names and parameters come from a mapping of names, which is missing).
        """
        if contains(self.container, LayoutTensor):
            raise InputError("holds a sparse, nested or quantized tensor outside any mapping of names to "
                             "tensors — compare it with torch (ckptool compares named tensors)", path=self.path)
        bare = "storage" if isinstance(self.container, StorageRef) else "tensor"
        found: dict[str, TensorRef] = {}
        for place, tensor in iter_tensors(self.container, storages=True):
            name = ".".join(str(key) for key in place) or bare
            if name in found:
                raise InputError(f"holds two tensors both placed at {name!r} (keys of different types) — compare "
                                 "them with torch", path=self.path)
            found[name] = tensor
        if not found:
            raise InputError("holds no tensors (no weights, no tensor or storage anywhere in it) — is this a "
                             "checkpoint?", path=self.path)
        return found

    @property
    def is_lightning(self) -> bool:
        return isinstance(self.container, dict) and any(marker in self.container for marker in LIGHTNING_MARKERS)

    @property
    def prefix(self) -> str:
        """The wrapper stack every weight key carries ("" if none)."""
        if self.layout is None:
            return ""
        return keys_.detect_prefix(self.tensors, lightning=self.is_lightning)

    def storages(self) -> list[StorageRef]:
        """Every distinct storage in the whole container (weights, optimizer state...)."""
        seen: dict[int, StorageRef] = {}
        for _, tensor in iter_tensors(self.container):
            seen.setdefault(id(tensor.storage), tensor.storage)
        return list(seen.values())

    def saved_devices(self) -> dict[str, int]:
        """Location tags as saved: ``{"cuda:1": n_storages}``."""
        return dict(Counter(storage.location for storage in self.storages()))

    # transforms (pure: a new Checkpoint shares what did not change) ---------------------------
    def with_state_dict(self, state_dict: dict) -> Checkpoint:
        return replace(self, container=replace_at(self.container, self.layout or (), state_dict),
                       layout=self.layout if self.layout is not None else ())

    def strip_prefix(self, prefix: str | None = None) -> Checkpoint:
        """Remove ``prefix`` (default: the detected wrapper stack) from the weight keys."""
        prefix = self.prefix if prefix is None else prefix
        if not prefix:
            raise NothingToDoError("no wrapper prefix (module., _orig_mod., model.) on the weight keys — nothing to strip",
                                   path=self.path)
        return self.with_state_dict(keys_.strip_prefix(self.state_dict, prefix))

    def add_prefix(self, prefix: str = keys_.DDP_PREFIX) -> Checkpoint:
        """Put ``prefix`` in front of every weight key."""
        return self.with_state_dict(keys_.add_prefix(self.state_dict, prefix))

    def remap(self, mapper: Callable[[str], str]) -> Checkpoint:
        """Rewrite every storage's location tag with ``mapper`` (no tensor moves; no GPU needed)."""
        new_storages: dict[int, StorageRef] = {}

        def retag(tensor: TensorRef) -> TensorRef:
            storage = tensor.storage
            if id(storage) not in new_storages:
                new_storages[id(storage)] = replace(storage, location=mapper(storage.location))
            return replace(tensor, storage=new_storages[id(storage)])

        return replace(self, container=map_tensors(self.container, retag))

    def entries(self) -> dict[str, Any]:
        """The top-level entries other than the weights (epoch, optimizer, config...)."""
        if not isinstance(self.container, dict) or not self.layout:
            return {}
        return {k: v for k, v in dict.items(self.container) if k != self.layout[0]}
