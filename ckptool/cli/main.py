"""The ckptool command line: parse, call one library function, render text or --json.

The write jobs live in :mod:`ckptool.ops.rewrite`, the suggested fix commands and the spelling of
options in :mod:`ckptool.base.suggest`, the exit codes in :mod:`ckptool.base.exitcodes`: 0 ok; 1 a check
found a problem (verify, diff, scan) or there was nothing to do; 2 usage; 3 input unreadable,
unsafe or refused, or output refused; 70 an internal error (a bug in ckptool, never a verdict on
the input); 130/143 interrupted; 141 stdout was closed early (``| head``), which ends the command
quietly, as it ends git.

Text output escapes every control character that came from a file (see :mod:`ckptool.base.text`);
--json output is exact, and ASCII (``json.dumps`` escapes controls and non-ASCII itself).
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import click

from ckptool import __version__
from ckptool.base import exitcodes, gcpause, jsonout
from ckptool.base.suggest import flag
from ckptool.cli import render, writes
from ckptool.cli.options import (
    LOCATION,
    allow_expansion_option,
    allow_global_option,
    emit_json,
    handle_errors,
    json_option,
    shows_progress,
    storage_options,
    variant_option,
    weights_option,
)

EXIT_INTERNAL, EXIT_CLOSED_PIPE = exitcodes.INTERNAL, exitcodes.CLOSED_PIPE  # the names tests import


GC_YOUNG_ALLOCATIONS = 50_000  # allocations between young collections in a CLI process (Python: 700)


class _Group(click.Group):
    """The command group; a usage error of a command given --json is also an error document on stdout."""

    def invoke(self, ctx: click.Context) -> Any:
        args = [*getattr(ctx, "_protected_args", []), *ctx.args]
        try:
            return super().invoke(ctx)
        except click.UsageError as e:
            if "--json" in args:
                click.echo(jsonout.dumps(jsonout.error_document("usage", e.format_message(), exit_code=e.exit_code)))
            raise


@click.group(
    cls=_Group,
    context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100},
    help="Make any PyTorch checkpoint portable, and prove it.\n\nReads .pt/.pth/.bin/.ckpt (zip or "
    "legacy), safetensors (single or sharded) without running pickle code. Exit codes: "
    f"{exitcodes.help_text()}.",
)
@click.version_option(__version__, prog_name="ckptool")
def main() -> None:
    """The ckptool command group (its help text lists the exit codes from :mod:`ckptool.base.exitcodes`)."""
    # a polite kill (SIGTERM) unwinds like Ctrl-C, so half-written temp files are removed
    signal.signal(signal.SIGTERM, _terminate)
    # The cyclic collector's defaults (a young collection every 700 allocations, whole-heap ones after 100 of them)
    # suit long-running programs. A command builds a checkpoint's records once and keeps them to the end, and those
    # records form no cycles: with 100,000 tensors the defaults spent 0.6 s of an inspect, 1.5 s of a strip and 2.7 s
    # of a convert rescanning them. Reference counting still frees everything else at once; only garbage in cycles
    # waits for the (now rarer) collections. What a read or a write builds under a paused collector is handed to
    # the permanent generation as the collector resumes (gcpause.freeze_results): never scanned again.
    gc.set_threshold(GC_YOUNG_ALLOCATIONS, 20, 20)
    gcpause.freeze_results()
    if not os.environ.get("CKPTOOL_DEBUG"):
        # stderr carries ckptool's own one-line messages only: a library's warning (numpy on a
        # signalling NaN, torch deprecations) is noise there, and could quote a file's bytes raw
        import warnings

        warnings.simplefilter("ignore")


def run() -> None:
    """The ``ckptool`` command (the console script, ``python -m ckptool``): :func:`main`, then an exit that leaves the
    heap to the kernel where nothing else needs the interpreter's shutdown.

    A command keeps its checkpoint to the end, and the interpreter's shutdown frees its records one by one (a
    100,000-tensor read: ~0.1 s of an inspect). Here the exit handlers run and the streams are flushed as at any
    exit, then the process ends; one with other threads alive, torch loaded or an exit status other than a number
    exits the usual way.
    """
    try:
        main()
        code: Any = 0
    except SystemExit as e:
        code = 0 if e.code is None else e.code
    if type(code) is not int or threading.active_count() > 1 or "torch" in sys.modules:
        raise SystemExit(code)
    atexit._run_exitfuncs()
    try:
        for stream in (sys.stdout, sys.stderr):
            if stream is not None:
                stream.flush()
    except (OSError, ValueError):  # (a closed pipe, a closed stream: the usual exit reports it as it would)
        raise SystemExit(code) from None
    os._exit(code)


def _terminate(signum: int, frame: Any) -> None:
    render.echo("ckptool: terminated — nothing was written", err=True)
    raise SystemExit(exitcodes.killed_by(signum))


# ------------------------------------------------------------------------------------------------ inspect


@main.command()
@click.argument("ckpt", type=LOCATION)
@json_option
@click.option("--tensors", "list_tensors", is_flag=True, help="List the weight tensors, repeated blocks grouped.")
@click.option("--all", "every_tensor", is_flag=True, help="List every key, none grouped (implies --tensors).")
@click.option(
    "--fingerprint",
    "with_fingerprint",
    is_flag=True,
    help="Also hash the weights (reads every byte; the same value in any format).",
)
@allow_global_option
@allow_expansion_option
@weights_option
@variant_option
@shows_progress
@storage_options
@handle_errors
def inspect(
    ckpt: Path,
    as_json: bool,
    list_tensors: bool,
    every_tensor: bool,
    with_fingerprint: bool,
    allow_globals: tuple[str, ...],
    allow_expansion: bool,
    weights: str | None,
    variant: str | None,
) -> None:
    """Describe a checkpoint: format, where the weights are, wrapper prefix, devices, entries.

    Reads no tensor bytes (unless --fingerprint) and runs no pickle code.

    Example: ckptool inspect ddp.pt --json
    """
    from ckptool.ops.inspect import inspect as inspect_

    summary = inspect_(
        ckpt,
        allow_globals=allow_globals,
        fingerprint=with_fingerprint,
        tensors=list_tensors or every_tensor,
        allow_expansion=allow_expansion,
        weights=weights,
        variant=variant,
    )
    if as_json:
        emit_json("inspect", summary.to_json())
    else:
        render.summary(summary, every_tensor=every_tensor)


# ------------------------------------------------------------------------------------------------ scan


@main.command()
@click.argument("paths", nargs=-1, required=True, type=LOCATION)
@json_option
@click.option(
    "--sarif",
    "sarif_out",
    type=click.Path(dir_okay=False, path_type=Path),
    help="Also write the findings as SARIF 2.1.0 to this file (for code-scanning dashboards).",
)
@click.option(
    "--fail-on",
    type=click.Choice(["unknown", "dangerous"]),
    default="unknown",
    show_default=True,
    help="The verdict that makes the exit code 1: unknown (or dangerous) globals, or dangerous ones only.",
)
@allow_global_option
@click.option(
    "-q", "--quiet", is_flag=True, help="No progress bar (it shows only on a terminal, for work past a second)."
)
@click.option(
    "-j",
    "--jobs",
    type=click.IntRange(min=1),
    default=None,
    metavar="N",
    help="Processes judging a tree's files once it takes over half a second [default: one a CPU; 1: this one].",
)
@storage_options
@handle_errors
def scan(
    paths: tuple[Path, ...],
    as_json: bool,
    sarif_out: Path | None,
    fail_on: str,
    allow_globals: tuple[str, ...],
    quiet: bool,
    jobs: int | None,
) -> None:
    """List every pickle global and opcode without executing anything; judge safe, unknown or dangerous.

    PATHS are files, folders (walked recursively: each checkpoint or pickle in them is judged by its
    content, a model folder as one model, other files skipped), URLs and prefixes (s3://bucket/models/).
    One file or one model folder gives its full report; more give one summary.

    Exit 0 all safe, 1 unknown or dangerous globals found (dangerous only with --fail-on dangerous),
    3 unreadable, not a checkpoint, nothing readable, or a path that does not exist.

    Example: ckptool scan downloaded.pt --json; ckptool scan models/ --sarif ckptool.sarif
    """
    from ckptool.ops import scan_tree

    if len(paths) == 1 and scan_tree.single_model(paths[0]):
        _scan_one(paths[0], as_json, sarif_out, fail_on, allow_globals)
    with _files_bar(not quiet and not as_json) as counted:
        report = scan_tree.scan_many(paths, allow_globals=allow_globals, keep_safe=as_json, on_item=counted, jobs=jobs)
    counts = report.counts
    if len(paths) == 1 and counts["skipped"] == sum(counts.values()):
        _scan_one(paths[0], as_json, sarif_out, fail_on, allow_globals)  # a folder of no checkpoint: refused as ever
    if sarif_out is not None:
        from ckptool.ops import sarif

        sarif.write(sarif_out, report.items, __version__)
    if as_json:
        document = {"schema": "ckptool.scan/2", **report.to_json(fail_on)}
        remote = sys.modules.get("ckptool.files.remote")  # imported only when a URL is in play
        if remote is not None:
            counted = remote.STATS.as_dict()
            document["io"] = {"bytes_read": counted["bytes_read"], "requests": counted["requests"]}
        click.echo(jsonout.dumps(document))
    else:
        render.scan_tree(report, fail_on)
    sys.exit(report.exit_code(fail_on))


@contextlib.contextmanager
def _files_bar(wanted: bool) -> Iterator[Callable[[Any], None] | None]:
    """A count of the files scanned on stderr when it is a terminal (past about a second, removed at the end);
    None (no count) elsewhere."""
    stderr = sys.stderr
    if not wanted or stderr is None or not stderr.isatty():
        yield None
        return
    from tqdm import tqdm  # type: ignore[import-untyped]  # tqdm ships no type hints

    from ckptool.base import progress

    shown_after = progress.delay()
    bar = tqdm(desc="scanned", unit=" files", file=stderr, delay=shown_after, leave=False, dynamic_ncols=True)
    try:
        yield lambda _item: bar.update(1)
    finally:
        if bar.format_dict["elapsed"] >= shown_after:
            bar.refresh()  # the final count, drawn once before the line is removed
        bar.close()


def _scan_one(path: Path, as_json: bool, sarif_out: Path | None, fail_on: str, allow_globals: tuple[str, ...]) -> None:
    """scan of one file or one model folder: its full report, as scan always printed it."""
    from ckptool.base.errors import CkptError
    from ckptool.ops import sarif, scan_tree
    from ckptool.ops.scan import scan as scan_

    try:
        report = scan_(path, allow_globals=allow_globals)
    except CkptError as e:
        if sarif_out is not None:
            unread = scan_tree.ItemResult(str(path), "unreadable", reason=e.message)
            sarif.write(sarif_out, [unread], __version__)
        raise
    if sarif_out is not None:
        sarif.write(sarif_out, [scan_tree.summarized(str(path), report)], __version__)
    if as_json:
        emit_json("scan", report.to_json())
    else:
        render.scan(report)
    failed = bool(report.dangerous) if fail_on == "dangerous" else not report.safe
    sys.exit(exitcodes.PROBLEM if failed else exitcodes.OK)


# ------------------------------------------------------------------------------------------------ verify, diff
# (verification.py, comparison.py)


@main.command()
@click.argument("ckpt", type=LOCATION)
@click.option(
    "--model",
    "model_spec",
    default=None,
    metavar="SPEC",
    help="torchvision:NAME[?k=v&...], training:lenet|mlp|resnet18, or package.module:factory — the "
    "last imports and runs YOUR code on purpose (never the checkpoint's).",
)
@click.option(
    "--model-arg",
    "model_args",
    multiple=True,
    metavar="K=V",
    help="Keyword argument for the model builder, e.g. num_classes=10 (repeatable).",
)
@click.option(
    "--devices",
    default="all",
    show_default=True,
    metavar="all|cpu,cuda:0,...",
    help="Devices to evaluate on; the CPU run is always the reference.",
)
@click.option(
    "--against",
    type=LOCATION,
    default=None,
    metavar="OTHER",
    help="A second checkpoint (any format) that must hold the same weights (and outputs, with --model).",
)
@click.option(
    "--input-shape",
    default=None,
    metavar="1,3,224,224",
    help="Shape of the seeded input (default: 1,1,28,28 for training:, 1,3,224,224 for torchvision:).",
)
@click.option("--atol", type=float, default=None, help="Absolute output tolerance (default by dtype: fp32 1e-5).")
@click.option("--rtol", type=float, default=None, help="Relative output tolerance (default by dtype: fp32 1e-4).")
@click.option("--allow-nonfinite", is_flag=True, help="Weights holding NaN or Inf do not fail the check.")
@click.option(
    "--allow-nonfinite-key",
    "nonfinite_keys",
    multiple=True,
    metavar="PATTERN",
    help="Weights whose key matches this shell pattern may hold NaN/Inf, e.g. '*.mask' (repeatable).",
)
@json_option
@allow_global_option
@allow_expansion_option
@weights_option
@variant_option
@click.option("--against-weights", default=None, metavar="PATH", help="--weights for OTHER.")
@shows_progress
@storage_options
@handle_errors
def verify(
    ckpt: Path,
    model_spec: str | None,
    model_args: tuple[str, ...],
    devices: str,
    against: Path | None,
    input_shape: str | None,
    atol: float | None,
    rtol: float | None,
    allow_nonfinite: bool,
    nonfinite_keys: tuple[str, ...],
    as_json: bool,
    allow_globals: tuple[str, ...],
    allow_expansion: bool,
    weights: str | None,
    variant: str | None,
    against_weights: str | None,
) -> None:
    """Prove the weights load strictly and evaluate identically on CPU and every device.

    With --model: strict load (a wrong prefix or architecture is diagnosed with its fix), then
    eval on a seeded input under deterministic settings; per device the weights must be
    bit-identical after the transfer and the outputs within tolerance of the CPU run. Without
    --model: every weight is materialized on each device and NaN/Inf are counted (weights holding
    them fail unless --allow-nonfinite). Exit 0 ok,
    1 a check failed, 2 bad arguments, 3 unreadable input.

    Example: ckptool verify model.pt --model training:lenet
    """
    from ckptool.verification.verify import verify as verify_

    report = verify_(
        ckpt,
        model_spec=model_spec,
        model_args=model_args,
        devices=devices,
        against=against,
        input_shape=input_shape,
        atol=atol,
        rtol=rtol,
        allow_globals=allow_globals,
        allow_expansion=allow_expansion,
        allow_nonfinite=allow_nonfinite or nonfinite_keys,
        weights=weights,
        variant=variant,
        against_weights=against_weights,
    )
    if as_json:
        emit_json("verify", report.to_json(flag))
    else:
        render.verify(report)
    if not report.ok:
        render.echo(f"ckptool: verify failed: {report.failure_text(flag)}", err=True)
    sys.exit(exitcodes.OK if report.ok else exitcodes.PROBLEM)


@main.command()
@click.argument("a", type=LOCATION)
@click.argument("b", type=LOCATION)
@click.option(
    "--atol",
    type=float,
    default=0.0,
    show_default=True,
    help="Value differences up to this are not changes (0: exact; floats count -0.0 as 0.0, NaN as NaN).",
)
@json_option
@allow_global_option
@allow_expansion_option
@weights_option
@variant_option
@click.option("--weights-b", default=None, metavar="PATH", help="--weights for B (--weights applies to A).")
@shows_progress
@storage_options
@handle_errors
def diff(
    a: Path,
    b: Path,
    atol: float,
    as_json: bool,
    allow_globals: tuple[str, ...],
    allow_expansion: bool,
    weights: str | None,
    variant: str | None,
    weights_b: str | None,
) -> None:
    """Compare the weights of two checkpoints in any formats: keys, dtypes, shapes, values.

    Keys are compared as stored (a module. prefix on one side is named, with the strip command).
    Values are streamed chunk by chunk; a tensor whose bytes differ gets its max abs difference.
    Exit 0 identical, 1 different, 3 unreadable input.

    Example: ckptool diff model.pt model.safetensors
    """
    from ckptool.ops.diff import diff as diff_

    report = diff_(
        a,
        b,
        atol=atol,
        allow_globals=allow_globals,
        allow_expansion=allow_expansion,
        weights_a=weights,
        variant=variant,
        weights_b=weights_b,
    )
    if as_json:
        emit_json("diff", report.to_json())
    else:
        render.diff(report)
    sys.exit(exitcodes.OK if report.identical else exitcodes.PROBLEM)


# the commands that write a checkpoint (ckptool/cli/writes.py); click lists every command by name
for _command in (writes.strip, writes.add_prefix, writes.remap, writes.convert):
    main.add_command(_command)
