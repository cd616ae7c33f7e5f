"""Training folders: a transformers Trainer ``checkpoint-N/`` or an accelerate ``save_state`` folder.

A training framework saves a resumable run as a folder: the model's weights in the files its
``save_pretrained``/``save_model`` writes (``model.safetensors``, ``pytorch_model.bin``, sharded
with an index; accelerate numbers further models ``model_1.safetensors``, ``pytorch_model_1.bin``),
and beside them the training state, each part in a file of its own:

============================  ==========================================================
transformers ``Trainer``       ``optimizer.pt``, ``scheduler.pt``, ``rng_state.pth`` (one
                               ``rng_state_N.pth`` per rank), ``trainer_state.json``,
                               ``training_args.bin`` (a pickled ``TrainingArguments``),
                               ``scaler.pt``; often ``config.json``
accelerate ``save_state``      ``optimizer.bin`` (``optimizer_N.bin``), ``scheduler.bin``,
                               ``random_states_N.pkl`` (per rank, with the step),
                               ``scaler.pt``, ``sampler.bin``, ``custom_checkpoint_N.pkl``
============================  ==========================================================

:func:`find` tells such a folder by those names alone (nothing is opened) and lays it out: its
sets of weights, the one read by default first, and its other files by role. :data:`FORMAT`
claims the folder, reads the weights through the format of their file (``Contents.format`` then
names that format, so every command treats the weights as it treats that file) and hands the
layout on (``Contents.folder``; ``inspect`` describes the other files). ``scan`` judges every
pickle in the folder. Each file is opened as a file of the folder (``inputs.open_member``: a
regular file inside it, or in a hub cache snapshot's ``blobs/``).
"""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from ckptool.formats import Contents, Format, Pickles, ReadOptions
from ckptool.formats.model_folder import FolderFile, FolderLayout, components, entries, tree_pickles
from ckptool.formats.model_folder import loaded_paths as loaded_paths
from ckptool.formats.model_folder import read_member as read_member

TrainingFolder = FolderLayout  # a training folder's layout is a folder layout with training files

if TYPE_CHECKING:  # pragma: no cover
    from ckptool import pickles

# The roles of the files beside the weights, and the names the frameworks give them.
OPTIMIZER = "optimizer"
SCHEDULER = "scheduler"
RNG_STATE = "rng state"
TRAINER_STATE = "trainer state"
TRAINING_ARGS = "training args"
SCALER = "grad scaler"
SAMPLER = "sampler"
CUSTOM_STATE = "custom state"
CONFIG = "model config"
_ROLES: tuple[tuple[str, re.Pattern[str]], ...] = (
    (OPTIMIZER, re.compile(r"optimizer(_\d+)?\.(pt|bin)")),  # transformers .pt, accelerate .bin (one per optimizer)
    (SCHEDULER, re.compile(r"scheduler(_\d+)?\.(pt|bin)")),
    (RNG_STATE, re.compile(r"rng_state(_\d+)?\.pth|random_states_\d+\.pkl")),  # per rank
    (TRAINER_STATE, re.compile(r"trainer_state\.json")),
    (TRAINING_ARGS, re.compile(r"training_args\.bin")),
    (SCALER, re.compile(r"scaler(_\d+)?\.pt")),
    (SAMPLER, re.compile(r"(sampler|dl_state_dict)(_\d+)?\.bin")),
    (CUSTOM_STATE, re.compile(r"custom_checkpoint_\d+\.pkl")),
    (CONFIG, re.compile(r"config\.json|generation_config\.json")),  # listed, but no sign of a training folder
)
_TRANSFORMERS_SIGNS = re.compile(
    r"trainer_state\.json|training_args\.bin|rng_state(_\d+)?\.pth|optimizer\.pt"
    r"|scheduler\.pt"
)
_ACCELERATE_SIGNS = re.compile(
    r"random_states_\d+\.pkl|optimizer(_\d+)?\.bin|scheduler(_\d+)?\.bin"
    r"|custom_checkpoint_\d+\.pkl"
)

# The files one model's weights may lie in, most preferred first (transformers reads safetensors
# before .bin, an index before a single file); accelerate numbers every model after the first.
_FIRST_MODEL = (
    "model.safetensors.index.json",
    "model.safetensors",
    "pytorch_model.bin.index.json",
    "pytorch_model.bin",
    "pytorch_model_fsdp_0",
)
_NUMBERED_MODEL = re.compile(r"(?:model_(\d+)\.safetensors|pytorch_model_(\d+)\.bin|pytorch_model_fsdp_(\d+))")
_ADAPTER = ("adapter_model.safetensors", "adapter_model.bin")  # a PEFT adapter saved by the Trainer


def find(directory: Path) -> TrainingFolder | None:
    """The layout of a training folder (a Trainer checkpoint, an accelerate ``save_state`` folder),
    or None when ``directory`` holds no training state by its names. Nothing is opened."""
    names = entries(directory)
    files: list[FolderFile] = []
    for role, pattern in _ROLES:
        files += [
            FolderFile(name, role)
            for name in sorted(names, key=_numbered)
            if pattern.fullmatch(name) and not names[name]
        ]
    if not any(file.role != CONFIG for file in files):
        return None
    weights: list[FolderFile] = []
    first = next((name for name in _FIRST_MODEL if name in names), None)
    if first is not None:
        weights.append(FolderFile(first, "weights"))
    numbered: dict[int, str] = {}
    for name in sorted(names):
        match = _NUMBERED_MODEL.fullmatch(name)
        if match is not None:
            number = int(next(group for group in match.groups() if group is not None))
            if number > 0:
                numbered.setdefault(number, name)  # model_N.safetensors before pytorch_model_N.bin (sorted)
    weights += [FolderFile(numbered[number], "weights") for number in sorted(numbered)]
    adapter = next((name for name in _ADAPTER if name in names), None)
    if adapter is not None:
        weights.append(FolderFile(adapter, "weights"))
    # components a training script's save hooks wrote (diffusers: unet/, unet_ema/ through save_pretrained)
    named = {file.name for file in weights}
    below = [part for part in components(directory, depth=1) if part.directory and part.name not in named]
    weights += [FolderFile(part.name, "weights") for part in below]
    kinds = [file.name for file in files]
    kind = (
        "transformers Trainer checkpoint"
        if any(_TRANSFORMERS_SIGNS.fullmatch(name) for name in kinds)
        else "accelerate save_state folder"
        if any(_ACCELERATE_SIGNS.fullmatch(name) for name in kinds)
        else "training folder"
    )
    return TrainingFolder(directory, kind, tuple(weights), tuple(files), components=tuple(below), training=True)


def _numbered(name: str) -> tuple[int, str]:
    """rng_state_2.pth before rng_state_10.pth."""
    digits = re.findall(r"\d+", name)
    return (int(digits[-1]) if digits else -1, name)


def sniff(head: bytes | None, path: Path) -> bool:
    """A folder holding a training run's state (optimizer, scheduler, rng state...) by its names."""
    return head is None and find(path) is not None


def read(path: Path, options: ReadOptions) -> Contents:
    """The folder's first model weights, read by the format of their file; the layout goes along."""
    layout = find(path)
    assert layout is not None  # sniff claimed it
    if not layout.weights:
        roles = ", ".join(dict.fromkeys(file.role for file in layout.files if file.role != CONFIG))
        return Contents(
            container={},
            files=[],
            folder=layout,
            notes=[
                f"{layout.kind} without model weights (no model.safetensors, pytorch_model.bin or "
                f"their index): it holds {roles}"
            ],
        )
    contents = read_member(path, layout.weights[0].name, options)
    contents.folder = replace(layout, read=layout.weights[0].name)
    return contents


def pickle_blobs(path: Path, options: ReadOptions) -> Pickles:
    """Every pickle of every file in the folder's tree that may hold one, labelled by file; only the
    default weights' are read by a load (scan runs the others dry)."""
    layout = find(path)
    assert layout is not None
    loaded = loaded_paths(layout, list(layout.weights[:1]))
    return Pickles(FORMAT.name, tree_pickles(path, options, loaded))


def scan_resolver(resolver: pickles.GlobalResolver) -> pickles.GlobalResolver:
    """DCP's metadata classes count as read, as for a DCP folder: FSDP's weights are a DCP sub-folder."""
    from ckptool.formats.dcp import FORMAT as DCP

    assert DCP.scan_resolver is not None
    return DCP.scan_resolver(resolver)


FORMAT = Format(
    name="training-folder",
    sniff=sniff,
    read=read,
    pickle_blobs=pickle_blobs,
    scan_resolver=scan_resolver,
    has_location_tags=False,
    in_place_refused="is a training folder: name the model file to rewrite in place, or write beside it",
    owns=lambda folder: lambda path: True,  # every file of the folder is its own
)
