"""Checkpoint: a container, where the weights live in it, and how it was saved."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from operator import attrgetter
from pathlib import Path
from typing import Any

from ckptool.base.errors import FingerprintMismatchError, InputError, NothingToDoError, UsageError
from ckptool.base.suggest import Metavar
from ckptool.base.suggest import option as suggest_option
from ckptool.base.text import value_str
from ckptool.model import keys as keys_
from ckptool.model import lit_ema, modules, optimizers
from ckptool.model.tree import (
    contains,
    copy_mapping,
    get_at,
    iter_tensors,
    map_tensors,
    placeholder_classes,
    replace_at,
    spelling,
    tensor_values,
)
from ckptool.model.weight_sets import (
    OPTIMIZER_STATE,
    WeightSet,
    lit_ema_set,
    resolve_weights,
    spell_weights,
    weight_set_at,
    weight_sets,
)
from ckptool.model.weight_sets import WEIGHTS_KEYS as WEIGHTS_KEYS
from ckptool.model.weight_sets import find_layout as find_layout
from ckptool.model.weight_sets import is_state_dict as is_state_dict
from ckptool.pickles import TORCH_GLOBALS, OpaqueObject, layouts
from ckptool.pickles.layouts import LayoutTensor
from ckptool.tensors.refs import _IS_TENSOR_REF, _STORAGE, StorageRef, TensorRef

_LOCATION = attrgetter("location")
LIGHTNING_MARKERS = ("pytorch-lightning_version", "hyper_parameters", "lightning_version")


def _may_be_placeholder(name: str) -> bool:
    """Whether a global a read resolved may stand as a placeholder class in its tree: any but torch's own
    functions and records (a state dict's usual three globals name none: its read-back is not walked)."""
    value = TORCH_GLOBALS.get(name)
    return value is None or (isinstance(value, type) and issubclass(value, OpaqueObject))


@dataclass
class Checkpoint:
    """A checkpoint as read: the unpickled container with lazy tensors, and where the weights are.

    Attributes:
        path: the file or directory read.
        format: the name of its :class:`~ckptool.formats.Format`: ``torch-zip``, ``torch-legacy``,
            ``safetensors``, ``safetensors-sharded`` or ``dcp``.
        container: the top-level object (dicts, lists and :class:`~ckptool.tensors.refs.TensorRef` leaves).
        layout: key path to the weights inside ``container`` (``()`` for a bare state_dict).
        globals: every pickle global used, with counts (empty for safetensors).
        metadata: safetensors metadata (string to string).
        files: every file the checkpoint spans.
        allow_globals: the ``allow_globals`` entries it was read with (a command suggested for it
            carries them).
        module_class: for a whole-model pickle (the weights are a pickled ``nn.Module``), the
            module's class; its weights are read as ``model.state_dict()`` gives them, and a ``.pt``
            output holds them as a plain state dict.
        selected: the weights were chosen by the caller (``load(..., weights=...)``), not found
            by the default rule; a ``.pt`` rewrite is read back at the same place.
        flattened: the "weights" are an optimizer's state dict at ``layout``, its tensors named by
            key path (``state.0.exp_avg``; :func:`ckptool.model.optimizers.flatten`); a safetensors
            output carries the rest of it in ``ckptool.entries``.
        folder: for a training folder input (a transformers ``checkpoint-N/``, an accelerate
            ``save_state`` folder), what the folder holds besides the weights read
            (:class:`ckptool.formats.training_folder.TrainingFolder`); None otherwise.

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
    module_class: str | None = None
    selected: bool = False
    # a .pt rewrite re-emits a whole-model pickle's modules themselves, not the weights alone: set by
    # remap, which changes device tags only, so the model still loads where its classes are
    keep_modules: bool = False
    flattened: bool = False
    folder: Any = None
    # weights derived from the container, not lying in it (``"ema"``, a LitEma copy: model/lit_ema.py): their name,
    # and the container as read (``container`` holds them in place, at ``layout``, so that writes find them)
    derived: str | None = None
    read_container: Any = field(default=None, repr=False, compare=False)
    # the state dict read from a module record, once (a transform's copy reads its own)
    _module_weights: Any = field(default=None, init=False, repr=False, compare=False)

    # views ----------------------------------------------------------------------------------
    @property
    def has_weights(self) -> bool:
        return self.layout is not None

    @property
    def state_dict(self) -> dict:
        """The weights mapping inside the container."""
        if self.layout is None:
            raise InputError(
                "holds no weights (no mapping of names to tensors) — is this a checkpoint?", path=self.path
            )
        node = get_at(self.container, self.layout)
        if self.flattened:
            if self._module_weights is None:
                self._module_weights = optimizers.flatten(node, path=self.path)
            return self._module_weights
        if isinstance(node, OpaqueObject) and modules.is_module(node):
            if self._module_weights is None:
                notes: list[str] = []
                where = repr(spell_weights(self.container, self.layout)) if self.layout else ""
                try:
                    self._module_weights = modules.state_dict(node, where=where, notes=notes)
                except InputError as e:
                    if e.path is None:
                        raise InputError(e.wording or e.message, path=self.path) from e
                    raise
                self.notes.extend(note for note in notes if note not in self.notes)
            return self._module_weights
        return node

    @property
    def whole_model(self) -> bool:
        """The weights come from a pickled ``nn.Module`` (``torch.save(model)``)."""
        return self.module_class is not None

    def weight_sets(self) -> list[WeightSet]:
        """Every set of weights the container holds (see :func:`weight_sets`); the chosen one included."""
        found = weight_sets(self.container if self.derived is None else self.read_container)
        if self.layout is not None and all(found_set.layout != self.layout for found_set in found):
            node = get_at(self.container, self.layout)
            found.insert(0, weight_set_at(node, self.layout) or WeightSet(self.layout, "state dict"))
        return found

    def select_weights(self, weights: str | tuple[Any, ...] | list[Any]) -> Checkpoint:
        """The same checkpoint with its weights taken from ``weights`` (a key path, see
        :func:`resolve_weights`), e.g. ``"state_dict_ema"`` for a training run's EMA copy.

        Raises:
            InputError: nothing at that path, or what is there holds no tensors; the message lists
                the sets of weights the container holds.
        """
        if self.derived is not None:  # chosen among the sets the container as read holds
            return replace(self, container=self.read_container, derived=None, read_container=None).select_weights(
                weights
            )
        layout = resolve_weights(self.container, weights)
        ema = lit_ema_set(self.container) if layout is None and weights == lit_ema.NAME else None
        if ema is not None:  # no key: the LitEma copy mapped onto the weights it averages
            return replace(
                self,
                container=lit_ema.with_ema(self.container, ema.layout, path=self.path),
                layout=ema.layout,
                module_class=None,
                selected=True,
                notes=list(self.notes),
                flattened=False,
                derived=lit_ema.NAME,
                read_container=self.container,
            )
        shown = weights if isinstance(weights, str) else "/".join(map(value_str, weights))
        if (
            layout
            and layout[-1] == optimizers.STATE_KEY
            and optimizers.is_optimizer_state(get_at(self.container, layout[:-1]))
        ):
            layout = layout[:-1]  # an optimizer's "state": its tensors, with the groups that give them meaning
        node = get_at(self.container, layout) if layout is not None else None
        found = weight_set_at(node, layout) if layout is not None else None
        if (
            layout is not None
            and found is None
            and isinstance(node, dict)
            and any(isinstance(value, TensorRef | LayoutTensor) for value in dict.values(node))
        ):
            found = WeightSet(layout, "state dict")  # fewer tensors than other entries: still the caller's choice
        if found is None:
            candidates = ", ".join(
                repr(w.derived or spell_weights(self.container, w.layout)) for w in self.weight_sets()[:8]
            )
            what = "nothing is there" if layout is None else "what is there holds no tensors"
            if not candidates:  # a scheduler's, a scaler's or the RNG's state: nothing to pick
                raise InputError(
                    f"no weights at {shown!r} ({what}) — it holds no set of weights or optimizer "
                    "state at all; inspect says what it holds",
                    path=self.path,
                )
            raise InputError(
                f"no weights at {shown!r} ({what}) — the weights it holds: {candidates}; "
                "pass one of them as " + suggest_option("weights", Metavar("PATH")),
                path=self.path,
            )
        return replace(
            self,
            layout=layout,
            module_class=found.module_class,
            selected=True,
            notes=list(self.notes),
            flattened=found.kind == OPTIMIZER_STATE,
        )

    def weights_as_written(self, written: Checkpoint) -> Checkpoint:
        """``written`` (this checkpoint written to a file and read back) with its weights at the
        place this one's are: where the caller chose them in a container written whole.

        Raises:
            FingerprintMismatchError: ``written`` names a class or function of the container otherwise than
                this checkpoint does (a nested ``Outer.Inner`` split at another dot): it would not load as
                the same object.
        """
        unknown = (
            placeholder_classes(written.container).keys() - placeholder_classes(self.container).keys()
            if any(map(_may_be_placeholder, written.globals))
            else ()
        )
        if unknown:
            name = min(spelling(cls) for cls in unknown)
            raise FingerprintMismatchError(
                f"the output reads back naming {name}, which the input names otherwise: it would not load as the "
                "input does — it was deleted; nothing changed (a bug in ckptool: please report it)"
            )
        if (
            (self.selected or self.flattened)
            and not self.whole_model
            and self.layout is not None
            and (written.layout != self.layout or written.flattened != self.flattened)
            and resolve_weights(written.container, self.layout) is not None
        ):
            return written.select_weights(self.layout)
        return written

    @property
    def tensors(self) -> dict[str, TensorRef]:
        """The weights: name -> tensor (non-tensor entries left out).

        A sparse or nested tensor stands here as its component tensors, named
        ``key[layout size/role]`` (:func:`ckptool.pickles.layouts.component_name`), so what reads or checks
        every tensor (diff, fingerprint, verify, a write's check) covers its values.
        """
        state_dict = self.state_dict
        items = dict.items(state_dict) if isinstance(state_dict, dict) else state_dict.items()  # a caller's Mapping
        values = dict.values(state_dict) if isinstance(state_dict, dict) else state_dict.values()
        if all(map(_IS_TENSOR_REF, values)):  # the usual state dict holds tensors only (tested in C: 100,000 in 5 ms)
            found = dict.copy(state_dict) if type(state_dict) is dict else dict(items)  # a dict's table copied whole
        else:
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
            raise InputError(
                "holds a sparse, nested or quantized tensor outside any mapping of names to "
                "tensors — compare it with torch (ckptool compares named tensors)",
                path=self.path,
            )
        bare = "storage" if isinstance(self.container, StorageRef) else "tensor"
        found: dict[str, TensorRef] = {}
        for place, tensor in iter_tensors(self.container, storages=True):
            name = ".".join(map(value_str, place)) or bare
            if name in found:
                raise InputError(
                    f"holds two tensors both placed at {name!r} (keys of different types) — compare them with torch",
                    path=self.path,
                )
            found[name] = tensor
        if not found:
            raise InputError(
                "holds no tensors (no weights, no tensor or storage anywhere in it) — is this a checkpoint?",
                path=self.path,
            )
        return found

    @property
    def is_lightning(self) -> bool:
        return isinstance(self.container, dict) and any(marker in self.container for marker in LIGHTNING_MARKERS)

    @property
    def prefix(self) -> str:
        """The wrapper stack every weight key carries ("" if none)."""
        if self.layout is None or self.flattened:
            return ""
        return self.prefix_among(self.tensors)

    def prefix_among(self, tensors: Mapping[str, Any]) -> str:
        """:attr:`prefix`, given :attr:`tensors` already listed (a state dict of 100,000 lists in 20 ms)."""
        if self.layout is None or self.flattened:  # an optimizer's names are key paths: no wrapper
            return ""
        return keys_.detect_prefix(tensors, lightning=self.is_lightning)

    def storages(self) -> list[StorageRef]:
        """Every distinct storage in the whole container (weights, optimizer state...)."""
        # first seen first; a StorageRef hashes by identity (no id() per tensor)
        return list(dict.fromkeys(map(_STORAGE, tensor_values(self.container))))

    def saved_devices(self) -> dict[str, int]:
        """Location tags as saved: ``{"cuda:1": n_storages}``."""
        return dict(Counter(map(_LOCATION, self.storages())))

    # transforms (pure: a new Checkpoint shares what did not change) ---------------------------
    def with_state_dict(self, state_dict: dict) -> Checkpoint:
        if self.flattened:  # the names are key paths into the optimizer's dict, not keys of a mapping
            raise UsageError(
                "the weights chosen are an optimizer's state: its tensors are named by where they lie "
                "in it, and renaming or casting them would not give an optimizer state back — convert "
                "it as it is",
                path=self.path,
            )
        return replace(
            self,
            container=replace_at(self.container, self.layout or (), state_dict),
            layout=self.layout if self.layout is not None else (),
        )

    def strip_prefix(self, prefix: str | None = None) -> Checkpoint:
        """Remove ``prefix`` (default: the detected wrapper stack) from the weight keys."""
        prefix = self.prefix if prefix is None else prefix
        state_dict = self.state_dict  # a file without weights (optimizer state) says so, as add-prefix does
        if not prefix:
            raise NothingToDoError(
                "no wrapper prefix (module., _orig_mod., model.) on the weight keys — nothing to strip", path=self.path
            )
        return self.with_state_dict(keys_.strip_prefix(state_dict, prefix))

    def add_prefix(self, prefix: str = keys_.DDP_PREFIX) -> Checkpoint:
        """Put ``prefix`` in front of every weight key."""
        return self.with_state_dict(keys_.add_prefix(self.state_dict, prefix))

    def rename_keys(self, rules: list[tuple[Any, str]]) -> tuple[Checkpoint, int]:
        """The weight keys rewritten by regex ``rules`` (see :func:`ckptool.model.keys.rename_keys`), and how
        many changed."""
        renamed, changed = keys_.rename_keys(self.state_dict, rules)
        return self.with_state_dict(renamed), changed

    def drop(self, patterns: list[str] | tuple[str, ...]) -> tuple[Checkpoint, list[str], list[str]]:
        """Without the weight keys and the container's top-level entries a shell pattern matches whole
        (``head.*``, ``optimizer``); the dropped keys and entries.

        Raises:
            UsageError: a pattern matches the entry that holds the weights.
        """
        from ckptool.base.errors import UsageError

        keys = keys_.matching(self.state_dict, patterns) if self.has_weights else []
        entries = keys_.matching(self.entries(), patterns)
        if self.layout and isinstance(self.layout[0], str) and keys_.matching([self.layout[0]], patterns):
            raise UsageError(
                f"{self.layout[0]!r} holds the weights: a pattern that drops it would leave none — "
                "name the keys inside it instead (e.g. 'head.*')"
            )
        dropped = self.with_state_dict(keys_.drop_keys(self.state_dict, keys)) if keys else self
        if entries:
            gone = set(entries)
            dropped = replace(
                dropped,
                container=copy_mapping(
                    dropped.container, items=[(k, v) for k, v in dict.items(dropped.container) if k not in gone]
                ),
            )
        return dropped, [value_str(key) for key in keys], [value_str(entry) for entry in entries]

    def weights_only(self) -> Checkpoint:
        """The weights alone, as a bare state dict at the top level (the container's other entries,
        optimizer, epoch, config, left out), as timm's ``clean_checkpoint`` and OpenMMLab's
        ``publish_model`` keep them."""
        return replace(
            self, container=self.state_dict, layout=(), module_class=None, keep_modules=False, selected=False
        )

    def remap(self, mapper: Callable[[str], str]) -> Checkpoint:
        """Rewrite every storage's location tag with ``mapper`` (no tensor moves; no GPU needed)."""
        new_storages: dict[int, StorageRef] = {}

        def retag(tensor: TensorRef) -> TensorRef:
            storage = tensor.storage
            if id(storage) not in new_storages:
                new_storages[id(storage)] = replace(storage, location=mapper(storage.location))
            return replace(tensor, storage=new_storages[id(storage)])

        return replace(self, container=map_tensors(self.container, retag), keep_modules=True)

    def entries(self) -> dict[str, Any]:
        """The top-level entries other than the weights (epoch, optimizer, config...)."""
        if not isinstance(self.container, dict) or not self.layout:
            return {}
        return {k: v for k, v in dict.items(self.container) if k != self.layout[0]}
