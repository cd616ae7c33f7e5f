"""Model folders: a folder of named components, each a sub-folder (or the folder itself) holding weights.

The libraries that publish models save them as folders, and the weights are one part of them:

=============================  =====================================================================
diffusers pipeline             ``model_index.json``; ``unet/``, ``vae/``, ``text_encoder/``... each
                               with ``config.json`` and ``diffusion_pytorch_model.safetensors`` (or
                               ``.bin``, or ``model.safetensors``); ``scheduler/``, ``tokenizer/``
transformers / PEFT            ``config.json`` (``adapter_config.json``) beside ``model.safetensors``,
                               ``pytorch_model.bin`` (``adapter_model.*``), sharded with an index
sentence-transformers          the transformer's weights at the top, ``2_Dense/`` etc. below
variants                       ``<name>.fp16.safetensors`` beside ``<name>.safetensors``; a sharded
                               variant's index is ``<name>.safetensors.index.fp16.json``
=============================  =====================================================================

:func:`find` lays such a folder out by names alone (nothing is opened): its components, each with
the weights file read by default and its variants, and every other file. :data:`FORMAT` claims a
folder that is more than one weights file (a component below it, a config beside the weights, a
``.bin`` without an index, a variant) and reads it: a folder of one component as that component
(``Contents.format`` names the format of its file, as for a training folder), a folder of several
as one state dict whose keys are ``<component>/<key>``. Every file is opened as a file of the
folder (``inputs.open_member``). ``scan`` judges every pickle in the tree.
"""

from __future__ import annotations

import json
import os
import re
import stat
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from ckptool.base.errors import InputError, UnsafeCheckpointError
from ckptool.base.text import value_str
from ckptool.files import inputs
from ckptool.files.byteio import is_remote
from ckptool.formats import Contents, Format, PickleBlob, Pickles, ReadOptions
from ckptool.formats import sniff as sniff_input
from ckptool.model.tree import get_at
from ckptool.model.weight_sets import find_layout
from ckptool.pickles.allowlist import RefusedGlobal
from ckptool.pickles.refusal import refusal

MAX_FOLDER_ENTRIES = 100_000  # names looked at in one folder: far more than any library writes
MAX_TREE_ENTRIES = 200_000  # names looked at in a whole tree
COMPONENT_DEPTH = 2  # sub-folders below the top that may hold a component (pipelines use one level)
PICKLE_SUFFIXES = (".pt", ".pth", ".bin", ".pkl", ".ckpt", ".pickle", ".tar")  # files a library torch.loads
SEPARATOR = "/"  # between a component's name and its own key, in a folder of several components

# the names the libraries give a model's weights (transformers, diffusers, PEFT, diffusers' LoRA), most
# preferred first when one folder holds several (transformers reads model.safetensors first)
KNOWN_STEMS = ("model", "diffusion_pytorch_model", "adapter_model", "pytorch_lora_weights", "pytorch_model")
_WEIGHTS = re.compile(r"(?P<base>.+)\.(?P<kind>safetensors|bin)")
_INDEX = re.compile(r"(?P<stem>.+)\.(?P<kind>safetensors|bin)\.index(?:\.(?P<variant>[\w-]+))?\.json")
_SHARD = re.compile(r".+-\d{5}-of-\d{5}\.(safetensors|bin)")
# a training run's own files, never a model's weights (transformers Trainer, accelerate save_state)
_TRAINING_FILES = re.compile(
    r"(optimizer|scheduler|scaler|sampler|dl_state_dict)(_\d+)?\.(pt|bin)|training_args\.bin"
    r"|rng_state(_\d+)?\.pth|random_states_\d+\.pkl|custom_checkpoint_\d+\.pkl"
)
# what a file beside the weights is, by name (inspect describes the content)
CONFIG = "config"
SKIPPED_FOLDERS = frozenset({"__pycache__", ".git", ".cache", ".huggingface", ".ipynb_checkpoints"})


@dataclass(frozen=True)
class Component:
    """One component of a model folder: a folder holding one model's weights.

    Attributes:
        name: how ``--weights`` names it: the sub-folder's path (``unet``, ``2_Dense``), or for
            weights at the top of the folder their file's stem (``model``).
        directory: the sub-folder's path from the top, ``""`` for the top itself.
        files: each variant's weights file (an index or a single file), by variant; ``""`` is the
            default weights (the file without a variant).
    """

    name: str
    directory: str
    files: dict[str, str]

    @property
    def variants(self) -> list[str]:
        return sorted(variant for variant in self.files if variant)

    def file_for(self, variant: str | None) -> tuple[str, str | None]:
        """The weights file read for ``variant`` (None: the default), and the variant it has.

        The default weights when no variant is asked, or when the component lacks the one asked;
        a component holding variants alone gives its first."""
        if variant is not None and variant in self.files:
            return self.files[variant], variant
        if "" in self.files:
            return self.files[""], None
        first = self.variants[0]
        return self.files[first], first

    def path(self, variant: str | None) -> str:
        """The weights file's path from the top of the folder."""
        name = self.file_for(variant)[0]
        if not name:  # a DCP sub-folder: the folder itself
            return self.directory
        return f"{self.directory}/{name}" if self.directory else name


@dataclass(frozen=True)
class FolderFile:
    """One file (or a weights sub-folder) of a folder and what it holds."""

    name: str
    role: str


@dataclass(frozen=True)
class FolderLayout:
    """What a model or training folder holds, by names alone.

    Attributes:
        directory: the folder.
        kind: what it is (``"diffusers pipeline"``, ``"model folder"``, ``"PEFT adapter folder"``,
            ``"transformers Trainer checkpoint"``...).
        weights: each set of weights, by the name ``--weights`` takes (a component's folder, a
            weights file), the one read by default first.
        files: the other files, in role order (optimizer, scheduler, rng state, configs...).
        read: the weights read (None: none yet, or all of them: a folder of several components).
        components: the weights that are components (a sub-folder, or a file at the top), with
            their files and variants.
        variant: the variant asked for (``--variant``), or None.
    """

    directory: Path
    kind: str
    weights: tuple[FolderFile, ...]
    files: tuple[FolderFile, ...]
    read: str | None = None
    components: tuple[Component, ...] = ()
    variant: str | None = None
    training: bool = False  # a training run's folder (its state beside the weights): rewritten file by file

    def of_role(self, role: str) -> list[FolderFile]:
        return [file for file in self.files if file.role == role]

    def named(self, name: str) -> FolderFile | None:
        """The weights or file ``name`` names: its name, or that name without its suffix (``model_1``,
        ``optimizer_1``), or a component's folder with a trailing ``/`` (``unet/``)."""
        name = name.rstrip("/") or name
        for file in (*self.weights, *self.files):
            if name in (file.name, stem(file.name)):
                return file
        return None

    def component(self, name: str) -> Component | None:
        return next((component for component in self.components if component.name == name), None)

    @property
    def variants(self) -> list[str]:
        return sorted({variant for component in self.components for variant in component.variants})

    @property
    def composite(self) -> bool:
        """A folder read as all of its components together."""
        return self.read is None and len(self.components) > 1


def stem(name: str) -> str:
    for suffix in (
        ".safetensors.index.json",
        ".bin.index.json",
        ".safetensors",
        ".bin",
        ".pt",
        ".pth",
        ".pkl",
        ".json",
    ):
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return name


# ------------------------------------------------------------------------------------------------ listing


Listing = dict[str, bool | None]  # a folder's names -> a folder, a file, or a link to a folder (None)


def entries(directory: Path, *, limit: int | None = MAX_FOLDER_ENTRIES) -> Listing:
    """The folder's names -> a folder (True), a file (False) or a link to a folder (None: falsy, so it is
    never entered; a link is judged when it is opened); at most ``limit`` names (None: all)."""
    if is_remote(directory):  # a folder of a store: one listing says the same
        listed = directory.listing().items()  # type: ignore[attr-defined]
        return dict(listed if limit is None else list(listed)[:limit])
    found: Listing = {}
    try:
        with os.scandir(directory) as listing:
            for entry in listing:
                try:
                    is_dir = entry.is_dir(follow_symlinks=False)
                    found[entry.name] = None if (not is_dir and entry.is_symlink() and entry.is_dir()) else is_dir
                except OSError:
                    found[entry.name] = False  # judged (and refused) when opened
                if limit is not None and len(found) >= limit:
                    break
    except OSError:
        return {}
    return found


def walk(directory: Path, *, depth: int = 8) -> Iterator[tuple[str, bool]]:
    """Every name of the tree below ``directory`` as a path from it, and whether it is a folder;
    folders are entered ``depth`` levels deep, links to folders never; at most
    :data:`MAX_TREE_ENTRIES` names."""
    seen = 0
    stack: list[tuple[str, int]] = [("", 0)]
    while stack:
        relative, level = stack.pop()
        listing = entries(directory / relative if relative else directory)
        for name in sorted(listing):
            seen += 1
            if seen > MAX_TREE_ENTRIES:
                return
            path = f"{relative}/{name}" if relative else name
            yield path, bool(listing[name])
            if listing[name] and level + 1 < depth and name not in SKIPPED_FOLDERS:
                stack.append((path, level + 1))


def _weights_files(names: Listing) -> dict[str, str]:
    """The weights files of one folder by variant (``""``: the default), the preferred one of each
    variant; empty when the folder holds no model's weights."""
    files = [name for name, is_dir in names.items() if not is_dir]
    found: list[tuple[int, str, str]] = []  # (rank, variant, file)
    singles: list[tuple[str, str, str]] = []  # (base, kind, file)
    for name in files:
        index = _INDEX.fullmatch(name)
        if index is not None:
            rank = _rank(index["stem"], index["kind"], sharded=True)
            found.append((rank, index["variant"] or "", name))
            continue
        match = _WEIGHTS.fullmatch(name)
        if match is None or _SHARD.fullmatch(name) or _TRAINING_FILES.fullmatch(name):
            continue
        singles.append((match["base"], match["kind"], name))
    bases = {base for base, _, _ in singles}
    unknown: list[str] = []
    for base, kind, name in singles:
        head, dot, variant = base.rpartition(".")
        if dot and (head in KNOWN_STEMS or head in bases) and variant.replace("-", "").replace("_", "").isalnum():
            found.append((_rank(head, kind, sharded=False), variant, name))
        elif base in KNOWN_STEMS:
            found.append((_rank(base, kind, sharded=False), "", name))
        else:
            unknown.append(name)
    if not found and len(unknown) == 1:  # a folder's one weights file, whatever its name
        found.append((len(KNOWN_STEMS) * 4, "", unknown[0]))
    chosen: dict[str, str] = {}
    for _, variant, name in sorted(found):
        chosen.setdefault(variant, name)
    return chosen


def _rank(name: str, kind: str, *, sharded: bool) -> int:
    """Lower is preferred: safetensors before .bin, an index before one file, known names first."""
    order = KNOWN_STEMS.index(name) if name in KNOWN_STEMS else len(KNOWN_STEMS)
    return (0 if kind == "safetensors" else 2) * 100 + (0 if sharded else 100) + order


def _is_component_folder(names: Listing) -> bool:
    return ".metadata" in names and not names[".metadata"]  # a DCP checkpoint (FSDP's weights)


def components(directory: Path, *, depth: int = COMPONENT_DEPTH) -> list[Component]:
    """Every component of the folder, the top's first, then the sub-folders' by path (an EMA copy,
    ``<name>_ema``, after the weights it copies)."""
    found: list[Component] = []
    top = entries(directory)
    files = _weights_files(top)
    if files:
        found.append(Component(stem(files.get("", next(iter(files.values())))).split(".")[0], "", files))
    below: list[Component] = []
    stack = [(name, 1) for name, is_dir in top.items() if is_dir and name not in SKIPPED_FOLDERS]
    while stack:
        relative, level = stack.pop()
        names = entries(directory / relative)
        sub = _weights_files(names)
        if sub:
            below.append(Component(relative, relative, sub))
            continue
        if _is_component_folder(names):
            below.append(Component(relative, relative, {"": ""}))
            continue
        if level < depth:
            stack += [
                (f"{relative}/{name}", level + 1)
                for name, is_dir in names.items()
                if is_dir and name not in SKIPPED_FOLDERS
            ]
    below.sort(key=lambda component: (component.name.removesuffix("_ema"), component.name.endswith("_ema")))
    if found and any(component.name == found[0].name for component in below):
        found[0] = replace(found[0], name=".")  # a sub-folder of the top's stem: the top is "."
    return found + below


# ------------------------------------------------------------------------------------------------ the format


def kind_of(top: Listing, parts: list[Component]) -> str:
    if "model_index.json" in top:
        return "diffusers pipeline"
    if "adapter_config.json" in top:
        return "PEFT adapter folder"
    if "modules.json" in top:
        return "sentence-transformers model"
    return "model folder" if len(parts) > 1 or "config.json" in top else "weights folder"


def find(directory: Path, variant: str | None = None) -> FolderLayout | None:
    """The layout of a model folder, or None when the folder is not one: no weights, or one weights
    file (or index) alone, which the format of that file reads. Nothing is opened."""
    top = entries(directory)
    parts = components(directory)
    if not parts:
        return None
    below = [part for part in parts if part.directory]
    others = [name for name, is_dir in top.items() if not is_dir and not _belongs_to_weights(name)]
    bare_bin = any(part.file_for(None)[0].endswith(".bin") and not part.directory for part in parts)
    if "model_index.json" not in top and any(
        name.lower().endswith((*PICKLE_SUFFIXES, ".safetensors")) for name in others
    ):
        return None  # checkpoints beside the weights (fixtures/, a download folder): a folder of models, not one
    named = stem(parts[0].file_for(None)[0]).split(".")[0] in KNOWN_STEMS[1:]  # a library's own name
    if not below and not others and not bare_bin and not parts[0].variants and not named:
        return None  # one model.safetensors or one index alone: read as that file
    weights = tuple(FolderFile(part.name if part.directory else part.path(variant), "weights") for part in parts)
    files = tuple(FolderFile(name, CONFIG) for name in _other_files(directory, parts))
    return FolderLayout(directory, kind_of(top, parts), weights, files, components=tuple(parts), variant=variant)


MAX_LISTED_FILES = 1_000  # the other files a layout names (a tokenizer folder holds a handful)


def _other_files(directory: Path, parts: list[Component]) -> list[str]:
    """The tree's files that are no component's weights (configs, tokenizer, scheduler, model card),
    from the top, hidden ones and those of skipped folders left out."""
    folders = {part.directory for part in parts}
    dcp = tuple(f"{part.directory}/" for part in parts if part.files == {"": ""})
    found: list[str] = []
    for name, is_dir in walk(directory, depth=COMPONENT_DEPTH + 1):
        folder, _, base = name.rpartition("/")
        if is_dir or base.startswith(".") or name.startswith(dcp) or any(p in SKIPPED_FOLDERS for p in name.split("/")):
            continue
        if folder in folders and _belongs_to_weights(base):
            continue
        found.append(name)
        if len(found) >= MAX_LISTED_FILES:
            break
    return sorted(found, key=lambda name: ("/" in name, name))


def _belongs_to_weights(name: str) -> bool:
    return bool(_WEIGHTS.fullmatch(name) or _INDEX.fullmatch(name) or _SHARD.fullmatch(name)) and not (
        _TRAINING_FILES.fullmatch(name)
    )


def sniff(head: bytes | None, path: Path) -> bool:
    """A folder of components, or weights with what a library writes beside them."""
    if head is not None:
        return False
    try:
        return find(path) is not None
    except (InputError, OSError):
        return False


def read_member(folder: Path, name: str, options: ReadOptions) -> Contents:
    """One file or sub-folder of the folder, read by the format it is; ``Contents.format`` names that
    format. A sub-folder is read as the folder it is (a component, a DCP checkpoint)."""
    path = folder / name
    if is_remote(path):
        is_folder = path.is_dir()
    else:
        try:
            is_folder = stat.S_ISDIR(os.lstat(path).st_mode)  # a link is no sub-folder: opened as a file of the folder
        except OSError:
            is_folder = False
    if is_folder:
        return _read_subfolder(folder, name, path, options)
    with inputs.open_member(folder, path, what=name, report=folder) as handle:
        try:
            head = handle.read(64)
        except OSError as e:
            raise InputError(f"{name} cannot be read ({e.strerror})", path=folder) from e
        if not head:
            raise InputError(f"{name} is empty (0 bytes) — the save or copy did not finish", path=folder)
        fmt = sniff_input(head, path)
        if fmt is None:
            raise InputError(f"{name} is not a checkpoint ckptool recognizes", path=folder)
        try:
            contents = fmt.read(path, ReadOptions(handle, head, options.resolver, options.variant))
        except RefusedGlobal as e:  # named by the file of the folder that holds the pickle
            raise UnsafeCheckpointError(refusal(e), path=path, globals_=e.names) from None
    contents.format = contents.format or fmt.name
    return contents


def _read_subfolder(folder: Path, name: str, path: Path, options: ReadOptions) -> Contents:
    sub = ReadOptions(None, b"", options.resolver, options.variant)
    fmt = sniff_input(None, path)
    if fmt is not None:
        contents = fmt.read(path, sub)
        contents.format = contents.format or fmt.name
        return contents
    from ckptool.formats import in_folder

    target = in_folder(path)
    if target is None:
        raise InputError(f"{name} is a folder without a checkpoint", path=folder)
    return read_member(path, target.name, options)


def read(path: Path, options: ReadOptions) -> Contents:
    """A folder of one component: that component, read by the format of its file; of several: every
    component's weights as one state dict of ``<component>/<key>``. The layout goes along."""
    layout = find(path, options.variant)
    assert layout is not None  # sniff claimed it
    if len(layout.components) == 1:
        name = layout.weights[0].name
        contents = read_member(path, name, options)
        contents.folder = replace(layout, read=name)
        return contents
    container: dict[str, Any] = {}
    files: list[Path] = []
    notes: list[str] = []
    for entry, part in zip(layout.weights, layout.components):
        contents = read_member(path, entry.name, options)
        where = contents.layout if contents.layout is not None else find_layout(contents.container)
        if where is None:
            notes.append(f"{part.name}: holds no weights (no mapping of names to tensors)")
            continue
        weights = get_at(contents.container, where)
        for key, value in dict.items(weights) if isinstance(weights, dict) else weights.items():
            container[f"{part.name}{SEPARATOR}{key if isinstance(key, str) else value_str(key)}"] = value
        files += contents.files
    return Contents(container=container, files=files, notes=notes, layout=(), folder=layout)


def loaded_paths(layout: FolderLayout, chosen: list[FolderFile] | None = None) -> set[str]:
    """The files (paths from the top) a load of the folder reads: each chosen component's weights file,
    or the shards its index names."""
    found: set[str] = set()
    for entry in layout.weights if chosen is None else chosen:
        part = layout.component(entry.name) or next(
            (part for part in layout.components if not part.directory and part.path(layout.variant) == entry.name),
            None,
        )
        name = part.path(layout.variant) if part is not None else entry.name
        found.add(name)
        if name.endswith(".json"):
            found |= index_shards(layout.directory, name)
    return found


def index_shards(directory: Path, name: str) -> set[str]:
    """The shards (paths from ``directory``) the index ``name`` names; none when it cannot be read."""
    folder, _, _ = name.rpartition("/")
    try:
        with inputs.open_member(directory, directory / name, what=name, report=directory) as handle:
            index = json.loads(handle.read(100_000_000))
        return {f"{folder}/{shard}" if folder else str(shard) for shard in index["weight_map"].values()}
    except (InputError, OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError):
        return set()  # the load says what is wrong with it


def tree_pickles(path: Path, options: ReadOptions, loaded: set[str]) -> list[PickleBlob]:
    """Every pickle of every file in the tree that may hold one, labelled by its path; those of the
    files in ``loaded`` are read by a load (scan runs the others dry). A DCP sub-folder's metadata
    pickle is judged as DCP's."""
    blobs: list[PickleBlob] = []
    for name, is_dir in walk(path):
        if is_dir:
            names = entries(path / name)
            if _is_component_folder(names):
                fmt = sniff_input(None, path / name)
                if fmt is not None:
                    found = fmt.scan_pickles(path / name, ReadOptions(None, b"", options.resolver))
                    blobs += [
                        PickleBlob(f"{name}/{blob.label}", blob.data, name in loaded, name) for blob in found.blobs
                    ]
            continue
        if not name.lower().endswith(PICKLE_SUFFIXES) or "/.metadata" in f"/{name}":
            continue
        with inputs.open_member(path, path / name, what=name, report=path) as handle:
            head = handle.read(64)
            fmt = sniff_input(head, path / name) if head else None
            if fmt is None:
                continue  # not a checkpoint: nothing torch would unpickle as one
            found = fmt.scan_pickles(path / name, ReadOptions(handle, head, options.resolver))
        blobs += [
            PickleBlob(f"{name}: {blob.label}", blob.data, blob.read_by_load and name in loaded, name)
            for blob in found.blobs
        ]
    return blobs


def pickle_blobs(path: Path, options: ReadOptions) -> Pickles:
    """Every pickle in the folder's tree; the default weights' are read by a load."""
    layout = find(path, options.variant)
    assert layout is not None
    return Pickles(FORMAT.name, tree_pickles(path, options, loaded_paths(layout)))


def owns(folder: Path) -> Callable[[str], bool]:
    """Which files below ``folder`` its components' readers read: each variant's weights file, an index's
    shards, a DCP component's files."""
    layout = find(folder)
    parts = layout.components if layout is not None else ()
    files = {f"{part.directory}/{name}".lstrip("/") for part in parts for name in part.files.values()}
    whole = tuple(f"{part.directory}/" for part in parts if part.directory and part.files == {"": ""})
    indexed = {part.directory for part in parts if any(_INDEX.fullmatch(name) for name in part.files.values())}

    def owned(path: str) -> bool:
        directory, _, base = path.rpartition("/")
        return path in files or path.startswith(whole) or (directory in indexed and bool(_SHARD.fullmatch(base)))

    return owned


FORMAT = Format(
    name="model-folder",
    owns=owns,
    sniff=sniff,
    read=read,
    pickle_blobs=pickle_blobs,
    default_suffix=".safetensors",
    rewrite_target="safetensors",
    weights_only=True,
    has_location_tags=True,
    in_place_refused="is a model folder: name the weights file to rewrite in place, or write beside it",
)
