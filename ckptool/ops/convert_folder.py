"""convert of a model folder: the same tree, every weights file written as safetensors, every other file copied.

A diffusers pipeline, a transformers or PEFT folder is loaded by its library from the folder as a
whole (``DiffusionPipeline.from_pretrained``, ``AutoModel.from_pretrained``,
``PeftModel.from_pretrained``): configs, tokenizer and scheduler files beside the weights, each
component in its sub-folder, under the file names the library looks for. So a folder is converted
into a folder of the same shape:

- each component's weights (every variant, or the one ``--variant`` names) are read through the
  restricted reader and written as safetensors under the name its library reads first:
  ``pytorch_model.bin`` -> ``model.safetensors``, ``diffusion_pytorch_model.bin`` ->
  ``diffusion_pytorch_model.safetensors``, ``adapter_model.bin`` -> ``adapter_model.safetensors``,
  a variant keeping its tag (``model.fp16.safetensors``); sharded (with the index the libraries
  read) where the input was or ``--max-shard-size`` asks; each file checked as every write is;
- every other file (JSON configs, tokenizer, scheduler, model card) is copied byte for byte; a
  pickle among them is scanned first, and one that names code-running globals refuses the convert;
- the tree is written in a temp folder beside the output and put in place in one rename.
"""

from __future__ import annotations

import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ckptool.base.errors import OutputError, UnsafeCheckpointError, UsageError
from ckptool.base.suggest import option
from ckptool.files import inputs
from ckptool.files.atomic import atomic_directory, check_output
from ckptool.formats import model_folder
from ckptool.formats.model_folder import Component, FolderLayout
from ckptool.formats.safetensors import parse_size

if TYPE_CHECKING:  # pragma: no cover
    from ckptool.io.writer import SaveReport
    from ckptool.model.checkpoint import Checkpoint

# the name a library reads a component's safetensors weights by, for each name of its other weights
SAFETENSORS_STEM = {"pytorch_model": "model", "diffusion_pytorch_model": "diffusion_pytorch_model"}
COPY_CHUNK = 8 << 20


@dataclass(frozen=True)
class WeightsJob:
    """One weights file of the input folder, and what it is written as."""

    component: Component
    variant: str | None
    source: str  # its path from the top (an index, a file, a DCP sub-folder)
    target: str  # the safetensors file, or the folder a sharded set goes to, from the top
    stem: str
    sharded: bool


def output_stem(name: str) -> str:
    """``pytorch_model.bin`` -> ``model``; ``diffusion_pytorch_model.fp16.bin`` -> ``diffusion_pytorch_model``;
    accelerate's ``pytorch_model_1.bin`` -> ``model_1``."""
    base = name.split(".")[0] if name else "model"
    numbered = re.fullmatch(r"pytorch_model_(\d+)", base)
    if numbered is not None:
        return f"model_{numbered[1]}"
    return SAFETENSORS_STEM.get(base, base)


def tree_components(layout: FolderLayout) -> tuple[Component, ...]:
    """The components a tree convert writes: a model folder's, and a training folder's weights files at its
    top too (``model.safetensors``, ``pytorch_model_1.bin``); a DCP sub-folder (FSDP's) is copied as it is."""
    if not layout.training:
        return layout.components
    found = list(layout.components)
    for file in layout.weights:
        if layout.component(file.name) is None and not _is_folder(layout.directory / file.name):
            found.append(Component(model_folder.stem(file.name), "", {"": file.name}))
    return tuple(found)


def _is_folder(path: Path) -> bool:
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode)
    except OSError:
        return False


def plan_weights(layout: FolderLayout, variant: str | None, shard: bool) -> list[WeightsJob]:
    """Every weights file the convert writes: each component's variants, or ``variant``'s (a component
    without it: its default weights)."""
    jobs: list[WeightsJob] = []
    for part in tree_components(layout):
        if variant is None:
            wanted: list[str | None] = [key or None for key in part.files]
        else:
            wanted = [variant if variant in part.files else None]
        for chosen in wanted:
            name, has = part.file_for(chosen)
            sharded = shard or ".index." in name
            stem = output_stem(name)
            target = part.directory if sharded else f"{part.directory}/{stem}{f'.{has}' if has else ''}.safetensors"
            jobs.append(WeightsJob(part, has, part.path(chosen), target.lstrip("/"), stem, sharded))
    return jobs


def weights_paths(layout: FolderLayout) -> set[str]:
    """Every file that belongs to a component's weights (each variant's file, an index's shards)."""
    found: set[str] = set()
    for part in tree_components(layout):
        for key in part.files:
            path = part.path(key or None)
            found.add(path)
            if path.endswith(".json"):
                found |= model_folder.index_shards(layout.directory, path)
    dcp = [part.directory for part in tree_components(layout) if part.files == {"": ""}]
    return found | {f"{folder}/" for folder in dcp}


def other_files(layout: FolderLayout) -> list[str]:
    """Every file of the tree that is no component's weights, from the top."""
    weights = weights_paths(layout)
    dcp = tuple(path for path in weights if path.endswith("/"))
    return [
        name
        for name, is_dir in model_folder.walk(layout.directory)
        if not is_dir and name not in weights and not name.startswith(dcp) and not _skipped(name)
    ]


def _skipped(name: str) -> bool:
    parts = name.split("/")
    return any(part in model_folder.SKIPPED_FOLDERS for part in parts[:-1])


def refuse_target(source: Path, target: Path, force: bool) -> None:
    """The output folder is not the input, nor inside it, and is replaced only with ``force``."""
    if not isinstance(target, Path):
        raise UsageError(
            "a model folder is converted to a local folder — write it locally, then upload the folder", path=target
        )
    resolved, input_root = Path(os.path.abspath(target)), Path(os.path.abspath(source))
    if resolved == input_root or input_root in resolved.parents or resolved in input_root.parents:
        raise OutputError(
            "is the input folder, or inside or above it; a model folder is converted into a folder of its own — "
            "write elsewhere with " + option("out", None),
            path=target,
        )
    check_output(target, inputs=(source,), force=force)


def copy_member(root: Path, name: str, out: Path) -> int:
    """One file of the input tree copied into ``out`` (a file of the folder: inside its bounds)."""
    destination = out / name
    destination.parent.mkdir(parents=True, exist_ok=True)
    copied = 0
    with inputs.open_member(root, root / name, what=name, report=root) as source, open(destination, "wb") as sink:
        while chunk := source.read(COPY_CHUNK):
            sink.write(chunk)
            copied += len(chunk)
    return copied


def refuse_dangerous(source: Path, allow_globals: tuple[str, ...]) -> list[str]:
    """Scan every pickle in the tree first: one naming code-running globals refuses the convert (nothing
    is written); one naming other packages' classes in a copied file is copied with a note."""
    from ckptool.ops.scan import scan

    report = scan(source, allow_globals=allow_globals)
    if report.dangerous:
        raise UnsafeCheckpointError(
            f"names globals known to run code ({', '.join(report.dangerous[:4])}) — nothing converted; "
            f"ckptool scan {source} lists the files",
            path=source,
            globals_=list(report.dangerous),
        )
    unknown = [name for name in report.unsafe if name not in report.dangerous]
    if unknown:
        return [f"copied as they are: pickles naming {', '.join(unknown[:3])} (scan says unknown)"]
    return []


def convert_tree(
    source: Path, target: Path, options: Any, layout: FolderLayout, *, max_shard_bytes: int | None
) -> tuple[SaveReport, list[str]]:
    """Write the folder ``source`` (laid out as ``layout``) as the same tree at ``target``; ``options``
    are the convert's (:class:`ckptool.ops.rewrite.ConvertOptions`). Returns what was written and the notes."""
    from ckptool.io.reader import load
    from ckptool.io.writer import SaveReport, save

    refuse_target(source, target, options.force)
    notes = refuse_dangerous(source, options.allow_globals)
    jobs = plan_weights(layout, options.variant, shard=max_shard_bytes is not None)
    copies = other_files(layout)
    report = SaveReport(path=target, format=model_folder.FORMAT.name, files=[], dry_run=options.dry_run)
    if options.dry_run:
        report.files = [target / job.target for job in jobs] + [target / name for name in copies]
        return report, notes
    with atomic_directory(target) as tmp:
        for job in jobs:
            checkpoint = load(
                source, weights=_weights_name(layout, job), variant=job.variant, allow_globals=options.allow_globals
            )
            checkpoint = _transformed(checkpoint, options, notes)
            out = tmp / job.target if job.target else tmp
            out.parent.mkdir(parents=True, exist_ok=True)
            if job.sharded:
                out.mkdir(parents=True, exist_ok=True)
            saved = save(
                checkpoint,
                out,
                to="safetensors",
                max_shard_size=(max_shard_bytes or parse_size("5GB")) if job.sharded else None,
                duplicate_tied=options.duplicate_tied,
                fingerprint=options.fingerprint,
                allow_expansion=options.allow_expansion,
                shard_stem=job.stem,
                variant=job.variant,
                force=True,
            )
            report.tensors += saved.tensors
            report.bytes += saved.bytes
            report.checked += saved.checked
            report.files += [target / path.relative_to(tmp) for path in saved.files]
            if saved.aliases:
                notes.append(f"{job.component.name}: {len(saved.aliases)} tied tensor(s) stored once")
        for name in copies:
            copy_member(source, name, tmp)
            report.files.append(target / name)
    notes.append(
        f"wrote {len(jobs)} weights file(s) of {len(tree_components(layout))} component(s) as safetensors and "
        f"copied {len(copies)} other file(s)"
    )
    return report, notes


def _weights_name(layout: FolderLayout, job: WeightsJob) -> str:
    """What ``--weights`` calls the job's weights: a component's name, or a training folder's file."""
    if layout.component(job.component.name) is not None or not layout.training:
        return job.component.name
    return job.source


def _transformed(checkpoint: Checkpoint, options: Any, notes: list[str]) -> Checkpoint:
    """A component's weights as the convert's options ask: stripped, cast."""
    if options.strip and checkpoint.prefix:
        notes.append(f'{checkpoint.path.name}: stripped "{checkpoint.prefix}" from the keys')
        checkpoint = checkpoint.strip_prefix()
    if options.dtype is not None:
        from ckptool.model.cast import cast_weights

        checkpoint = cast_weights(
            checkpoint, options.dtype, allow_overflow=options.allow_overflow, allow_expansion=options.allow_expansion
        )
    return checkpoint
