"""The commands that write a checkpoint: strip, add-prefix, remap and convert.

Each parses its options, calls its job in :mod:`ckptool.ops.rewrite` and renders the
:class:`~ckptool.ops.rewrite.WriteReport` (text, or --json); :mod:`ckptool.cli.main` adds them to
the command group.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from ckptool.cli import render
from ckptool.cli.options import (
    LOCATION,
    Location,
    allow_expansion_option,
    allow_global_option,
    dry_run_option,
    emit_json,
    error_text,
    fingerprint_write_option,
    force_option,
    handle_errors,
    in_place_option,
    json_option,
    shows_progress,
    storage_options,
    variant_option,
    weights_option,
)

# ------------------------------------------------------------------------------------------------ rewrites
# (operations.py does each job; these parse its options and render its WriteReport)


def _rewrite_options(command: Callable[..., Any]) -> Callable[..., Any]:
    for option in reversed(
        [
            click.argument("ckpt", type=LOCATION),
            click.option(
                "-o",
                "--out",
                type=LOCATION,
                help="Output path; its suffix decides the format (.pt/.pth/.bin/.ckpt or .safetensors; "
                "another suffix keeps the input's).",
            ),
            force_option,
            in_place_option,
            json_option,
            allow_global_option,
            fingerprint_write_option,
            weights_option,
            variant_option,
            dry_run_option,
        ]
    ):
        command = option(command)
    return command


@click.command()
@_rewrite_options
@click.option("--prefix", default=None, help="Strip this prefix instead of the detected wrapper stack.")
@click.option(
    "--to",
    "to_device",
    default=None,
    metavar="DEVICE",
    help="Also send every saved storage to DEVICE (cpu, cuda:0...), as remap does, in the same write.",
)
@click.option("--map", "mapping", multiple=True, metavar="OLD=NEW", help="Also rewrite one device tag (repeatable).")
@shows_progress
@storage_options
@handle_errors
def strip(
    ckpt: Path,
    out: Path | None,
    force: bool,
    in_place: bool,
    as_json: bool,
    allow_globals: tuple[str, ...],
    with_fingerprint: bool,
    weights: str | None,
    variant: str | None,
    dry_run: bool,
    prefix: str | None,
    to_device: str | None,
    mapping: tuple[str, ...],
) -> None:
    """Remove the wrapper prefix (module., _orig_mod., Lightning's model.) from the weight keys.

    By default strips the whole detected stack (e.g. module._orig_mod.); the rest of the
    container (optimizer, epoch, ...) is kept as it is. Exit 1 if no key carries the prefix.

    Example: ckptool strip ddp.pt -o model.pt
    """
    from ckptool.ops import rewrite as operations

    report = operations.strip(
        ckpt,
        out,
        prefix=prefix,
        force=force,
        in_place=in_place,
        allow_globals=allow_globals,
        fingerprint=with_fingerprint,
        weights=weights,
        variant=variant,
        to_device=to_device,
        mapping=mapping,
        dry_run=dry_run,
    )
    if as_json:
        emit_json("strip", report.to_json())
    else:
        details = report.details
        moved = (
            f"; devices {details['devices_before']} -> {details['devices_after']}" if "devices_after" in details else ""
        )
        render.write(
            report, f'stripped "{details["prefix"]}" from {details["renamed"]} keys: {ckpt} -> {report.target}{moved}'
        )


@click.command("add-prefix")
@_rewrite_options
@click.option("--prefix", default="module.", show_default=True, help="Prefix to put in front of every weight key.")
@shows_progress
@storage_options
@handle_errors
def add_prefix(
    ckpt: Path,
    out: Path | None,
    force: bool,
    in_place: bool,
    as_json: bool,
    allow_globals: tuple[str, ...],
    with_fingerprint: bool,
    weights: str | None,
    variant: str | None,
    dry_run: bool,
    prefix: str,
) -> None:
    """Put a prefix in front of every weight key (e.g. to resume a DDP run from plain weights).

    Example: ckptool add-prefix model.pt -o ddp.pt --prefix module.
    """
    from ckptool.ops import rewrite as operations

    report = operations.add_prefix(
        ckpt,
        out,
        prefix=prefix,
        force=force,
        in_place=in_place,
        allow_globals=allow_globals,
        fingerprint=with_fingerprint,
        weights=weights,
        variant=variant,
        dry_run=dry_run,
    )
    if as_json:
        emit_json("add-prefix", report.to_json())
    else:
        render.write(report, f'added "{prefix}" to {report.details["renamed"]} keys: {ckpt} -> {report.target}')


@click.command()
@_rewrite_options
@click.option(
    "--to", "to_device", default=None, metavar="DEVICE", help="Send every storage to DEVICE (cpu, cuda:0...)."
)
@click.option(
    "--map", "mapping", multiple=True, metavar="OLD=NEW", help="Rewrite one tag, e.g. cuda:1=cuda:0 (repeatable)."
)
@shows_progress
@storage_options
@handle_errors
def remap(
    ckpt: Path,
    out: Path | None,
    force: bool,
    in_place: bool,
    as_json: bool,
    allow_globals: tuple[str, ...],
    with_fingerprint: bool,
    weights: str | None,
    variant: str | None,
    dry_run: bool,
    to_device: str | None,
    mapping: tuple[str, ...],
) -> None:
    """Rewrite saved storage device tags so torch.load works where intended; needs no GPU.

    Tensors are not moved: only the tags torch.load restores them onto change.

    Example: ckptool remap gpu.pt -o cpu.pt --to cpu
    """
    from ckptool.ops import rewrite as operations

    report = operations.remap(
        ckpt,
        out,
        to_device=to_device,
        mapping=mapping,
        force=force,
        in_place=in_place,
        allow_globals=allow_globals,
        fingerprint=with_fingerprint,
        weights=weights,
        variant=variant,
        dry_run=dry_run,
    )
    if as_json:
        emit_json("remap", report.to_json())
    else:
        render.write(
            report,
            f"remapped {ckpt} -> {report.target}: {report.details['devices_before']} -> "
            f"{report.details['devices_after']}",
        )


# ------------------------------------------------------------------------------------------------ convert


@click.command()
@click.argument("ckpts", nargs=-1, required=True, type=LOCATION)
@click.option(
    "-o",
    "--out",
    type=Location(keep_text=True),  # a str: a trailing "/" says "a folder"
    help="Output: .safetensors, .pt/.pth/.bin, or a directory for sharded safetensors.",
)
@click.option("--out-dir", type=LOCATION, help="Convert many inputs into this directory (name kept, suffix from --to).")
@click.option(
    "--to",
    "to_format",
    type=click.Choice(["safetensors", "pt", "dcp"]),
    default=None,
    help="Target format (default: from OUT's suffix; safetensors with --out-dir); dcp: a "
    "torch.distributed.checkpoint folder of the whole checkpoint, for dcp.load (needs torch).",
)
@click.option("--strip", "strip_wrappers", is_flag=True, help="Also strip the detected wrapper prefix from the keys.")
@click.option("--max-shard-size", default=None, metavar="SIZE", help="Shard safetensors output, e.g. 5GB or 500MB.")
@click.option("--duplicate-tied", is_flag=True, help="Store tied tensors as full copies (for readers without aliases).")
@click.option(
    "--nest",
    type=click.Choice(["model", "state_dict"]),
    default=None,
    help="For .pt output from safetensors: wrap the weights as {NEST: weights}.",
)
@click.option(
    "--dtype", default=None, metavar="DTYPE", help="Cast floating weights: bf16, fp16 or fp32 (integers untouched)."
)
@click.option(
    "--allow-overflow",
    is_flag=True,
    help="With --dtype: accept a cast that turns finite values into Inf/NaN (refused by default).",
)
@click.option(
    "--drop",
    multiple=True,
    metavar="PATTERN",
    help="Leave out weight keys ('head.*', '*.num_batches_tracked') and top-level entries ('optimizer') a "
    "shell pattern matches whole (repeatable).",
)
@click.option(
    "--rename",
    multiple=True,
    metavar="REGEX=REPL",
    help=r"Rewrite weight keys with a regex, as re.sub does: '^backbone\.=' or 'blocks\.(\d+)=layers.\1' "
    "(repeatable, applied in order).",
)
@click.option(
    "--weights-only",
    is_flag=True,
    help="Write the weights alone (a bare state dict): no optimizer, epoch or config around them.",
)
@allow_expansion_option
@force_option
@json_option
@allow_global_option
@fingerprint_write_option
@weights_option
@variant_option
@dry_run_option
@shows_progress
@storage_options
@handle_errors
def convert(
    ckpts: tuple[Path, ...],
    out: str | None,
    out_dir: Path | None,
    to_format: str | None,
    strip_wrappers: bool,
    max_shard_size: str | None,
    duplicate_tied: bool,
    nest: str | None,
    dtype: str | None,
    allow_overflow: bool,
    drop: tuple[str, ...],
    rename: tuple[str, ...],
    weights_only: bool,
    allow_expansion: bool,
    force: bool,
    as_json: bool,
    allow_globals: tuple[str, ...],
    with_fingerprint: bool,
    weights: str | None,
    variant: str | None,
    dry_run: bool,
) -> None:
    """Convert between .pt and safetensors (single or sharded); the output is re-read and checked.

    Tied tensors are stored once and re-tied by ckptool (--duplicate-tied for plain copies); the
    container's plain entries (epoch, config, metrics) go into the safetensors metadata.

    Example: ckptool convert ddp.pt -o model.safetensors --strip
    """
    from ckptool.ops import rewrite as operations

    plan = operations.plan_convert(ckpts, out=out, out_dir=out_dir, to=to_format, max_shard_size=max_shard_size)
    options = operations.ConvertOptions(
        to=to_format,
        strip=strip_wrappers,
        duplicate_tied=duplicate_tied,
        nest=nest,
        dtype=dtype,
        allow_overflow=allow_overflow,
        allow_expansion=allow_expansion,
        force=force,
        allow_globals=allow_globals,
        fingerprint=with_fingerprint,
        weights=weights,
        variant=variant,
        dry_run=dry_run,
        drop=drop,
        rename=rename,
        weights_only=weights_only,
    )
    report = operations.convert(plan, options)  # each output's bar, on a terminal (shows_progress)
    if as_json:
        emit_json("convert", report.to_json(error_text))
    else:
        for result in report.converted:
            render.write(
                result,
                f"{result.input} -> {result.saved.path} ({result.saved.format}, "
                f"{result.saved.tensors} tensors, {render.human_bytes(result.saved.bytes)})",
            )
    for failure in report.failed:
        render.echo(f"ckptool: error: {error_text(failure)}", err=True)
    if report.failed:
        sys.exit(report.exit_code)
