"""The jobs behind the write commands (strip, add-prefix, remap, convert), one function each.

Each reads its input, applies one rule, writes through :func:`ckptool.io.writer.save` and returns a
:class:`WriteReport`; the command line only parses its options, calls one of these and renders the
report. Nothing here prints, and no message names a command-line flag (options a refusal asks for
are :class:`~ckptool.base.suggest.Option` s).

Example:
    >>> report = strip("ddp.pt", "model.pt")                    # doctest: +SKIP
    >>> report.details                                          # doctest: +SKIP
    {'prefix': 'module.', 'renamed': 8}
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from itertools import repeat
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ckptool.base import suggest
from ckptool.base.errors import CkptError, UsageError
from ckptool.base.gcpause import keep
from ckptool.base.suggest import Metavar, option
from ckptool.files.inputs import located

if TYPE_CHECKING:  # the writer is imported by the job that writes, so --help stays fast
    from ckptool.io.writer import SaveReport
    from ckptool.model.checkpoint import Checkpoint


@dataclass
class WriteReport:
    """What one write command did: its input, what was written and checked, what it changed.

    Attributes:
        command: the job (``strip``, ``add-prefix``, ``remap``, ``convert``).
        input: the input as given.
        target: the output as asked for (the input itself for an in-place rewrite).
        saved: the writer's report (format, files, tensors checked, fingerprint, aliases).
        notes: what the job did besides the write (a stripped prefix, a cast), then the writer's notes.
        details: what the job changed, by name: ``prefix`` and ``renamed`` keys for strip and
            add-prefix, ``devices_before`` and ``devices_after`` for remap.
    """

    command: str
    input: Path
    target: Path
    saved: SaveReport
    notes: list[str] = field(default_factory=list)
    details: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        """The --json object: the same fields for every write command."""
        written = {
            "output": str(self.saved.path),
            "format": self.saved.format,
            "tensors": self.saved.tensors,
            "bytes": self.saved.bytes,
            "checked": self.saved.checked,
            "fingerprint": self.saved.fingerprint,
            "files": [str(f) for f in self.saved.files],
        }
        if self.saved.dry_run:  # what would be written; nothing was
            written["dry_run"] = True
        if self.command == "convert":  # convert's object leads with its input and lists the aliases it recorded
            return {"input": str(self.input), **written, "aliases": self.saved.aliases, "notes": self.notes}
        return {**written, "notes": self.notes, "input": str(self.input), **self.details}


def _target(ckpt: Path, out: Path | None, in_place: bool, checkpoint: Checkpoint | None = None) -> Path:
    if out is None:
        if in_place:
            folder = checkpoint.folder if checkpoint is not None else None
            if (
                checkpoint is not None
                and folder is not None
                and folder.read is not None
                and [file.name for file in checkpoint.files] == [folder.read]
            ):
                return ckpt / folder.read  # a training folder's one weights file, rewritten where it is
            return ckpt
        raise UsageError(
            "missing " + option("out", Metavar("OUT")) + " (or " + option("in_place") + " to rewrite the input)"
        )
    return out


def strip(
    ckpt: Path | str,
    out: Path | str | None = None,
    *,
    prefix: str | None = None,
    force: bool = False,
    in_place: bool = False,
    allow_globals: tuple[str, ...] = (),
    fingerprint: bool = False,
    weights: str | None = None,
    variant: str | None = None,
    to_device: str | None = None,
    mapping: Iterable[str] = (),
    dry_run: bool = False,
) -> WriteReport:
    """Remove a key prefix (by default the detected wrapper stack) and write the result to ``out``;
    with ``to_device`` or ``mapping``, rewrite the saved device tags in the same write (as :func:`remap`).

    Raises:
        NothingToDoError: no key carries the prefix.
        UsageError: no ``out`` and not ``in_place``; device tags asked of a format without them.
    """
    from ckptool.io.reader import load

    ckpt, out = located(ckpt), _optional_path(out)
    mapping = tuple(mapping)
    mapper = _mapper(to_device, mapping) if to_device is not None or mapping else None
    checkpoint = _one_set(load(ckpt, allow_globals=allow_globals, weights=weights, variant=variant))
    target = _target(ckpt, out, in_place, checkpoint)
    used = prefix if prefix is not None else checkpoint.prefix
    stripped = checkpoint.strip_prefix(used)  # (the prefix detected once)
    renamed = count_keys(checkpoint.state_dict, prefix=used)
    details: dict[str, Any] = {"prefix": used, "renamed": renamed}
    if mapper is not None:
        _has_location_tags(checkpoint, ckpt)
        details["devices_before"] = checkpoint.saved_devices()
        stripped = stripped.remap(mapper)
        details["devices_after"] = stripped.saved_devices()
    written = _Written(ckpt, out, target, force, in_place, fingerprint, dry_run)
    return written.report("strip", checkpoint, stripped, details)


@dataclass(frozen=True)
class _Written:
    """Where a rewrite of ``ckpt`` goes (``out`` as given, ``target`` as planned) and how it is written."""

    ckpt: Path
    out: Path | None
    target: Path
    force: bool
    in_place: bool
    fingerprint: bool
    dry_run: bool

    def report(
        self, command: str, checkpoint: Checkpoint, rewritten: Checkpoint, details: dict[str, Any]
    ) -> WriteReport:
        """Write ``rewritten`` (``checkpoint`` after ``command``) in the input's format, checked, and report it."""
        from ckptool.io.writer import rewrite_format, save

        saved = save(
            rewritten,
            self.target,
            to=rewrite_format(checkpoint, self.out, command=command),
            force=self.force,
            in_place=self.in_place,
            fingerprint=self.fingerprint,
            dry_run=self.dry_run,
        )
        keep(checkpoint, rewritten)
        notes = whole_model_notes(checkpoint, saved, "remap" if command == "remap" else "") + saved.notes
        return WriteReport(command, self.ckpt, self.target, saved, notes, details)


def _one_set(checkpoint: Checkpoint) -> Checkpoint:
    """A rewrite writes one set of weights as one file: a model folder read as all of its components is
    refused (``--weights`` names one; ``convert`` writes the whole folder)."""
    folder = checkpoint.folder
    if folder is None or not folder.composite:
        return checkpoint
    names = ", ".join(component.name for component in folder.components[:4])
    raise UsageError(
        f"is a model folder of {len(folder.components)} components ({names}"
        f"{', ...' if len(folder.components) > 4 else ''}): rewrite one with "
        + option("weights", Metavar("COMPONENT"))
        + ", or write the whole folder with convert (-o OUT/)",
        path=checkpoint.path,
    )


def _mapper(to_device: str | None, mapping: Iterable[str]) -> Any:
    from ckptool.model.devices import location_mapper

    return location_mapper(to_device, mapping)


def _has_location_tags(checkpoint: Checkpoint, ckpt: Path) -> None:
    from ckptool import formats

    if not formats.for_name(checkpoint.format).has_location_tags:
        raise UsageError(f"{ckpt}: safetensors files carry no device tags — nothing to remap")


def add_prefix(
    ckpt: Path | str,
    out: Path | str | None = None,
    *,
    prefix: str = "module.",
    force: bool = False,
    in_place: bool = False,
    allow_globals: tuple[str, ...] = (),
    fingerprint: bool = False,
    weights: str | None = None,
    variant: str | None = None,
    dry_run: bool = False,
) -> WriteReport:
    """Put ``prefix`` in front of every weight key and write the result to ``out``."""
    from ckptool.io.reader import load

    ckpt, out = located(ckpt), _optional_path(out)
    checkpoint = _one_set(load(ckpt, allow_globals=allow_globals, weights=weights, variant=variant))
    target = _target(ckpt, out, in_place, checkpoint)
    prefixed = checkpoint.add_prefix(prefix)
    details = {"prefix": prefix, "renamed": count_keys(checkpoint.state_dict)}
    written = _Written(ckpt, out, target, force, in_place, fingerprint, dry_run)
    return written.report("add-prefix", checkpoint, prefixed, details)


def remap(
    ckpt: Path | str,
    out: Path | str | None = None,
    *,
    to_device: str | None = None,
    mapping: Iterable[str] = (),
    force: bool = False,
    in_place: bool = False,
    allow_globals: tuple[str, ...] = (),
    fingerprint: bool = False,
    weights: str | None = None,
    variant: str | None = None,
    dry_run: bool = False,
) -> WriteReport:
    """Rewrite the saved storage device tags (every one to ``to_device``, or ``mapping``'s ``old=new``).

    Raises:
        UsageError: neither or both of ``to_device`` and ``mapping``, or a safetensors input (no tags).
    """
    from ckptool.io.reader import load

    ckpt, out = located(ckpt), _optional_path(out)
    mapper = _mapper(to_device, mapping)
    checkpoint = _one_set(load(ckpt, allow_globals=allow_globals, weights=weights, variant=variant))
    _has_location_tags(checkpoint, ckpt)
    target = _target(ckpt, out, in_place, checkpoint)
    before = checkpoint.saved_devices()
    remapped = checkpoint.remap(mapper)
    after = remapped.saved_devices()
    written = _Written(ckpt, out, target, force, in_place, fingerprint, dry_run)
    return written.report("remap", checkpoint, remapped, {"devices_before": before, "devices_after": after})


def whole_model_notes(checkpoint: Checkpoint, saved: SaveReport, command: str = "") -> list[str]:
    """What a write of a whole-model pickle's weights left behind: the classes, and the other entries."""
    from ckptool import formats

    if not checkpoint.whole_model or formats.for_name(saved.format).weights_only:  # weights alone anyway
        return []
    if command == "remap":  # device tags changed, the modules themselves written back
        return [
            f"whole-model pickle ({checkpoint.module_class}): rewrote the pickled model itself with only its "
            "device tags changed; torch.load of the output needs the model's classes, as the input's did"
        ]
    left = [repr(str(key)) for key in checkpoint.entries()]
    shown = ", ".join(left[:4]) + (", ..." if len(left) > 4 else "")
    return [
        f"whole-model pickle ({checkpoint.module_class}): wrote its weights as a plain state dict, as "
        "model.state_dict() gives them, which torch.load(weights_only=True) reads; no class of the model "
        "goes along" + (f", nor the container's other entries ({shown})" if left else "")
    ]


def count_keys(state_dict: Any, *, prefix: str | None = None) -> int:
    """How many keys of ``state_dict`` a rewrite renames: those starting with ``prefix`` (every key
    when None). Keys that are not strings carry no prefix."""
    if prefix is None:
        return len(state_dict)
    from ckptool.model.keys import _IS_STR

    return sum(map(str.startswith, filter(_IS_STR, state_dict), repeat(prefix)))  # in C: 100,000 keys


def _optional_path(path: Path | str | None) -> Path | None:
    return located(path) if path is not None else None


# ------------------------------------------------------------------------------------------------ convert


@dataclass
class ConvertPlan:
    """Every ``(input, output)`` of a convert, planned (and collisions refused) before anything is written.

    Attributes:
        jobs: the pairs, in the order given.
        one_output: the output was named (``out``): the one job's failure is raised, not collected.
        max_shard_bytes: bytes per shard of a sharded safetensors output (None: the format's default).
    """

    jobs: list[tuple[Path, Path]]
    one_output: bool
    max_shard_bytes: int | None = None
    shards_asked: bool = False  # --max-shard-size was given (not implied by an output named "out/")


@dataclass
class ConvertOptions:
    """How each input of a convert is written (see :func:`convert_file`)."""

    to: str | None = None
    strip: bool = False
    duplicate_tied: bool = False
    nest: str | None = None
    dtype: str | None = None
    allow_overflow: bool = False
    allow_expansion: bool = False
    force: bool = False
    allow_globals: tuple[str, ...] = ()
    fingerprint: bool = False
    weights: str | None = None
    dry_run: bool = False
    drop: tuple[str, ...] = ()  # shell patterns: weight keys and top-level entries to leave out
    rename: tuple[str, ...] = ()  # PATTERN=REPLACEMENT regex rules for the weight keys, in order
    weights_only: bool = False  # write the weights alone (a bare state dict), no container around them
    variant: str | None = None  # a model folder's weights variant to read (fp16: *.fp16.safetensors)


@dataclass
class ConvertReport:
    """Every input converted, and every refusal of a many-input convert (the others still ran)."""

    plan: ConvertPlan
    converted: list[WriteReport] = field(default_factory=list)
    failed: list[CkptError] = field(default_factory=list)

    @property
    def exit_code(self) -> int:
        """The worst failure's exit code; 0 when every input was converted."""
        return max((error.exit_code for error in self.failed), default=0)

    def to_json(self, describe: Callable[[CkptError], str] = str) -> dict[str, Any]:
        """The --json object, one shape for ``out`` and ``out_dir``: every write report, then every
        failure as an error object (``describe`` gives its message)."""
        from ckptool.base.jsonout import error_object

        return {
            "converted": [report.to_json() for report in self.converted],
            "failed": [error_object(error, describe) for error in self.failed],
        }


def plan_convert(
    sources: Iterable[Path | str],
    *,
    out: Path | str | None = None,
    out_dir: Path | str | None = None,
    to: str | None = None,
    max_shard_size: str | int | None = None,
) -> ConvertPlan:
    """Plan a convert: one input to ``out``, or any number into the folder ``out_dir``.

    Raises:
        UsageError: both or neither of ``out`` and ``out_dir``; several inputs with ``out``; a
            shard size that is not a size.
        OutputError: two inputs would be written to one output in ``out_dir``.
    """
    from ckptool.formats.safetensors import parse_size

    paths = [located(source) for source in sources]
    shard_bytes = parse_size(max_shard_size) if isinstance(max_shard_size, str) else max_shard_size
    if (out is None) == (out_dir is None):
        raise UsageError(
            "give exactly one of "
            + option("out", Metavar("OUT"))
            + " (one input) or "
            + option("out_dir", Metavar("DIR"))
            + " (any number of inputs)"
        )
    if out is not None:
        if len(paths) != 1:
            raise UsageError(
                option("out", None)
                + " takes one input; use "
                + option("out_dir", Metavar("DIR"))
                + " to convert several"
            )
        if isinstance(out, str) and out.endswith(("/", os.sep)) and shard_bytes is None and to != "pt":
            shard_bytes = parse_size("5GB")  # "out/": a folder of shards (the writer's default size), as no suffix says
        return ConvertPlan([(paths[0], located(out))], True, shard_bytes, max_shard_size is not None)
    from ckptool.io.writer import plan_outputs

    assert out_dir is not None
    return ConvertPlan(plan_outputs(paths, located(out_dir), to), False, shard_bytes, max_shard_size is not None)


def convert_file(
    source: Path,
    target: Path,
    options: ConvertOptions,
    *,
    max_shard_bytes: int | None = None,
    shards_asked: bool | None = None,
) -> WriteReport:
    """Convert ``source`` to ``target``: strip the wrapper prefix and cast if asked, write, check.
    A model folder (a pipeline, a model with its configs) converted to a folder is written as the
    same tree (:mod:`ckptool.ops.convert_folder`)."""
    from ckptool import formats
    from ckptool.io.reader import load
    from ckptool.io.writer import save, target_format

    own_writer = formats.for_target(options.to) if options.to is not None else None
    if (own_writer is None or not own_writer.own_saver) and isinstance(target, Path):
        target_format(target, options.to, max_shard_bytes)  # a name no format claims: refused before the input is read
    checkpoint = loaded = load(
        source, allow_globals=options.allow_globals, weights=options.weights, variant=options.variant
    )
    tree = _folder_tree(checkpoint, target, options)
    if tree is not None:
        from ckptool.ops.convert_folder import convert_tree

        asked = shards_asked if shards_asked is not None else max_shard_bytes is not None
        saved, said = convert_tree(source, target, options, tree, max_shard_bytes=max_shard_bytes if asked else None)
        return WriteReport("convert", source, target, saved, said)
    notes: list[str] = []
    if options.strip and checkpoint.prefix:
        notes.append(f'stripped "{checkpoint.prefix}" from the keys')
        checkpoint = checkpoint.strip_prefix()
    checkpoint = _reshape(checkpoint, options, notes)
    if options.dtype is not None:
        from ckptool.model.cast import cast_weights

        checkpoint = cast_weights(
            checkpoint, options.dtype, allow_overflow=options.allow_overflow, allow_expansion=options.allow_expansion
        )
        notes.append(f"cast floating weights to {options.dtype}")
    if own_writer is not None and own_writer.own_saver:  # DCP: written by torch's own saver
        from ckptool.ops.dcp_write import save_dcp

        if not isinstance(target, Path):
            raise UsageError(
                f"a {own_writer.name} folder is written to a local path only — write it locally, then "
                "upload the folder",
                path=target,
            )
        if max_shard_bytes is not None:
            raise UsageError(option("max_shard_size", None) + f" applies to safetensors output, not {own_writer.name}")
        saved = save_dcp(
            checkpoint,
            target,
            force=options.force,
            fingerprint=options.fingerprint,
            allow_expansion=options.allow_expansion,
            dry_run=options.dry_run,
        )
    else:
        saved = save(
            checkpoint,
            target,
            to=options.to,
            force=options.force,
            max_shard_size=max_shard_bytes,
            duplicate_tied=options.duplicate_tied,
            nest=options.nest,
            fingerprint=options.fingerprint,
            allow_expansion=options.allow_expansion,
            dry_run=options.dry_run,
        )
    if saved.aliases:
        notes.append(f"{len(saved.aliases)} tied tensor(s) stored once, recorded as aliases (re-tied on load)")
    if checkpoint.prefix and formats.for_name(saved.format).weights_only:
        # a published safetensors file is loaded into bare models (from_pretrained, load_model): say so now
        notes.append(
            f'the keys still carry "{checkpoint.prefix}" (a training wrapper\'s); a bare model reports them '
            "as unexpected keys — to drop it: "
            + suggest.command(
                "convert", source, out=target, strip=True, force=True, allow_globals=list(options.allow_globals)
            )
        )

    if formats.for_name(checkpoint.format).weights_only and not formats.for_name(saved.format).weights_only:
        from ckptool.formats.entries import restored_notes

        notes += restored_notes(checkpoint.layout, checkpoint.metadata, flattened=checkpoint.flattened)
    keep(loaded, checkpoint)  # (the input's tree, and the stripped, renamed or cast one)
    return WriteReport("convert", source, target, saved, notes + whole_model_notes(checkpoint, saved) + saved.notes)


def _folder_tree(checkpoint: Checkpoint, target: Path, options: ConvertOptions) -> Any:
    """The layout of a model folder input written as a tree (a folder output, no component chosen), or
    None. A folder of several components written to one file is refused: no library loads that."""
    from ckptool import formats

    folder = checkpoint.folder
    if folder is None or options.weights is not None or (folder.training and not isinstance(target, Path)):
        return None
    suffixes = tuple(suffix for fmt in formats.registered() for suffix in fmt.suffixes)
    to_folder = target.suffix.lower() not in suffixes or (isinstance(target, Path) and target.is_dir())
    if to_folder and options.to in (None, formats.folder_output().target):
        return folder
    if folder.composite:
        names = ", ".join(component.name for component in folder.components[:4])
        raise UsageError(
            f"is a model folder of {len(folder.components)} components ({names}"
            f"{', ...' if len(folder.components) > 4 else ''}): convert it to a folder (-o OUT/), or choose one "
            + option("weights", Metavar("COMPONENT")),
            path=checkpoint.path,
        )
    return None


def _reshape(checkpoint: Checkpoint, options: ConvertOptions, notes: list[str]) -> Checkpoint:
    """Rename the weight keys, drop keys and entries, keep the weights alone: as ``options`` asks."""
    from ckptool.model.keys import parse_rename

    if options.rename:
        rules = [parse_rename(rule) for rule in options.rename]
        checkpoint, changed = checkpoint.rename_keys(rules)
        if not changed:
            raise UsageError(
                "the rename rules change no weight key — inspect lists the keys (" + option("tensors") + ")",
                path=checkpoint.path,
            )
        notes.append(f"renamed {changed} keys")
    if options.drop:
        checkpoint, keys, entries = checkpoint.drop(options.drop)
        if not keys and not entries:
            raise UsageError(
                "no weight key or entry matches "
                + ", ".join(repr(p) for p in options.drop)
                + " — inspect lists them ("
                + option("tensors")
                + " for the keys)",
                path=checkpoint.path,
            )
        if keys:
            notes.append(f"dropped {len(keys)} weight keys ({', '.join(keys[:3])}{', ...' if len(keys) > 3 else ''})")
        if entries:
            notes.append(f"dropped entries: {', '.join(entries)}")
    if options.weights_only:
        left = [str(key) for key in checkpoint.entries()]
        checkpoint = checkpoint.weights_only()
        notes.append(
            "wrote the weights alone"
            + (f" (left out: {', '.join(left[:6])}{', ...' if len(left) > 6 else ''})" if left else "")
        )
    return checkpoint


def convert(
    plan: ConvertPlan, options: ConvertOptions, *, jobs: Iterable[tuple[Path, Path]] | None = None
) -> ConvertReport:
    """Run every job of ``plan`` (or ``jobs``, the same pairs — e.g. wrapped in a progress bar).

    A many-input convert goes on past a refused input (the report lists it); a single one raises.
    """
    report = ConvertReport(plan)
    for source, target in plan.jobs if jobs is None else jobs:
        try:
            report.converted.append(
                convert_file(
                    source, target, options, max_shard_bytes=plan.max_shard_bytes, shards_asked=plan.shards_asked
                )
            )
        except CkptError as e:
            if len(plan.jobs) == 1:
                raise
            report.failed.append(e)
    return report
