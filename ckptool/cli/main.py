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
import functools
import gc
import os
import signal
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from ckptool import __version__
from ckptool.base import exitcodes, gcpause, jsonout
from ckptool.base.errors import CkptError, InternalError
from ckptool.base.suggest import flag
from ckptool.cli import render

EXIT_INTERNAL, EXIT_CLOSED_PIPE = exitcodes.INTERNAL, exitcodes.CLOSED_PIPE  # the names tests import


def _error_text(error: CkptError) -> str:
    """The error's one line, each option it asks for spelled as this command line's flag."""
    return error.render(flag)


def _fail(error: CkptError, as_json: bool = False) -> None:
    if as_json:  # a pipeline reads the failure on stdout too, in the shape it parses
        click.echo(jsonout.dumps(jsonout.document("error", {"error": jsonout.error_object(error, _error_text)})))
    render.echo(f"ckptool: error: {_error_text(error)}", err=True)
    sys.exit(error.exit_code)


def _fail_json(as_json: bool, type_: str, message: str, exit_code: int) -> None:
    """With --json, the error document of a failure that is not a library error (Ctrl-C, a bug)."""
    if as_json:
        with contextlib.suppress(Exception):  # stdout may be the thing that failed
            click.echo(jsonout.dumps(jsonout.error_document(type_, message, exit_code=exit_code)))


def _closed_pipe() -> None:
    """stdout's reader went away (``ckptool inspect x | head -1``): stop quietly, as git does."""
    try:  # the interpreter flushes stdout once more at exit: let that go nowhere instead of failing
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):  # no real file descriptor (an in-process test runner)
        pass
    sys.exit(exitcodes.CLOSED_PIPE)


def handle_errors(command: Callable[..., Any]) -> Callable[..., Any]:
    """Turn library errors into one stderr line and their exit code; never a traceback."""

    @functools.wraps(command)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        as_json = bool(kwargs.get("as_json"))
        try:
            try:
                return command(*args, **kwargs)
            finally:
                if sys.stdout is not None:  # None when started with stdout closed (>&-)
                    sys.stdout.flush()  # a closed pipe shows here, not as a message at interpreter exit
        except BrokenPipeError:
            _closed_pipe()
        except CkptError as e:
            if isinstance(e, InternalError) and os.environ.get("CKPTOOL_DEBUG"):
                raise
            _fail(e, as_json)
        except KeyboardInterrupt:
            _fail_json(as_json, "interrupted", "interrupted — nothing was written", exitcodes.INTERRUPTED)
            render.echo("ckptool: interrupted — nothing was written", err=True)
            sys.exit(exitcodes.INTERRUPTED)
        except (click.exceptions.Exit, click.ClickException, SystemExit):
            raise
        except MemoryError:  # the machine's limit, not a bug in ckptool; temp outputs are already removed
            message = "ran out of memory — nothing was written; free memory or run it on a larger machine"
            _fail_json(as_json, "memory", message, exitcodes.INPUT)
            render.echo(f"ckptool: error: {message}", err=True)
            sys.exit(exitcodes.INPUT)
        except Exception as e:  # a bug: say so in one line; CKPTOOL_DEBUG=1 shows the traceback
            if os.environ.get("CKPTOOL_DEBUG"):
                raise
            message = (
                f"{type(e).__name__}: {e} — a bug in ckptool, not a problem with the input; rerun with "
                "CKPTOOL_DEBUG=1 and report it"
            )
            _fail_json(as_json, "internal", message, exitcodes.INTERNAL)
            render.echo(f"ckptool: internal error: {message}", err=True)
            sys.exit(exitcodes.INTERNAL)

    return wrapper


def _emit_json(command: str, data: dict[str, Any]) -> None:
    """Print ``command``'s --json document (see :mod:`ckptool.base.jsonout`): ASCII, strict, schema named first.
    A command that named a URL also reports what it cost: ``io: {bytes_read, requests}``."""
    if _names_url():
        from ckptool.files.remote import STATS

        counted = STATS.as_dict()
        data = {**data, "io": {"bytes_read": counted["bytes_read"], "requests": counted["requests"]}}
    # ensure_ascii: controls, bidi overrides and lone surrogates come out as \u escapes, exact and inert
    click.echo(jsonout.dumps(jsonout.document(jsonout.KINDS[command], data)))


_URL_NAMED = "ckptool.url_named"
_REMOTE = "ckptool.files.remote"  # looked up in sys.modules: imported only when a URL is in play


def _names_url() -> bool:
    context = click.get_current_context(silent=True)
    return context is not None and bool(context.find_root().meta.get(_URL_NAMED))


class Location(click.ParamType):
    """A path argument or option: a local :class:`Path` as before, or a URL (``s3://``, ``gs://``,
    ``https://``; others refused when used) as a :class:`~ckptool.files.remote.RemotePath` — never normalized
    into a path (``s3://b/k`` is not ``s3:/b/k``). ``file://`` names a local path."""

    name = "path"

    def __init__(self, *, keep_text: bool = False) -> None:
        self.keep_text = keep_text  # convert's -o: a str, whose trailing "/" says "a folder"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if isinstance(value, Path) or not isinstance(value, (str, bytes)):
            return value  # a Path, or a RemotePath given by a caller
        text = os.fsdecode(value) if isinstance(value, bytes) else value
        if "://" not in text:  # a local path, as before (ckptool.files.remote is not even imported)
            return text if self.keep_text else Path(text)
        from ckptool.files.remote import is_url, location

        if is_url(text):
            if ctx is not None:
                ctx.find_root().meta[_URL_NAMED] = True
            return text if self.keep_text else location(text)
        if self.keep_text:
            return text
        return location(text)  # file:// or local://: a local path, percent-decoded


LOCATION = Location()


def storage_options(command: Callable[..., Any]) -> Callable[..., Any]:
    """``--storage-option KEY=VALUE`` (repeatable): fsspec options for every URL of the command; and
    the request and byte counts (``--json``'s ``io``) start at zero for the command."""

    @click.option(
        "--storage-option",
        "storage_option",
        multiple=True,
        metavar="KEY=VALUE",
        help="An fsspec option for URLs (repeatable): endpoint_url=http://127.0.0.1:8333, anon=true, "
        "client_kwargs.region_name=eu-west-1. Credentials come from the environment, never printed.",
    )
    @functools.wraps(command)
    def wrapper(*args: Any, storage_option: tuple[str, ...], **kwargs: Any) -> Any:
        if storage_option or _REMOTE in sys.modules:  # ckptool.files.remote is imported only when URLs are in play
            from ckptool.files.remote import STATS, parse_storage_options, set_storage_options

            try:
                options = parse_storage_options(storage_option)
            except ValueError as e:
                raise click.BadParameter(str(e), param_hint="'--storage-option'") from None
            set_storage_options(options)
            STATS.reset()
        return command(*args, **kwargs)

    return wrapper


allow_global_option = click.option(
    "--allow-global",
    "allow_globals",
    multiple=True,
    metavar="NAME|PATTERN",
    help="Accept pickle globals by name (mylib.Config) or shell pattern on the dotted name ('omegaconf.*', "
    "'*' for all) (repeatable); each is read as an inert record, never imported. Torch's own globals keep "
    "their checks; a pattern never accepts a global known to run code (os.system): name it exactly.",
)
json_option = click.option("--json", "as_json", is_flag=True, help="Print a JSON object for pipelines.")
weights_option = click.option(
    "--weights",
    default=None,
    metavar="PATH",
    help="Which set of weights to take when the file holds several (inspect lists them): keys joined by . or / "
    "(state_dict_ema, model.ema, ema); a key holding dots is matched whole. Default: the live weights.",
)
force_option = click.option("--force", is_flag=True, help="Overwrite OUT if it exists.")
in_place_option = click.option(
    "--in-place", is_flag=True, help="Allow OUT to be the input (still written via a temp file)."
)
allow_expansion_option = click.option(
    "--allow-expansion",
    is_flag=True,
    help="Materialize tensor views that expand their stored bytes (stride 0, overlaps) more than 4x in full.",
)
dry_run_option = click.option(
    "--dry-run",
    is_flag=True,
    help="Make every check and refusal of the write, then stop: say what would be written; write nothing.",
)


def shows_progress(command: Callable[..., Any]) -> Callable[..., Any]:
    """``--quiet``, and a byte progress bar on stderr for the command's long work (past about a second)
    when stderr is a terminal, unless ``--json`` or ``--quiet``: nothing in a pipe or a log."""

    @click.option(
        "-q", "--quiet", is_flag=True, help="No progress bar (it shows only on a terminal, for work past a second)."
    )
    @functools.wraps(command)
    def wrapper(*args: Any, quiet: bool, **kwargs: Any) -> Any:
        from ckptool.base import progress

        stderr = sys.stderr
        show = not quiet and not kwargs.get("as_json") and stderr is not None and stderr.isatty()
        with progress.showing(progress.terminal_bars(stderr)) if show else contextlib.nullcontext():
            return command(*args, **kwargs)

    return wrapper


fingerprint_write_option = click.option(
    "--fingerprint",
    "with_fingerprint",
    is_flag=True,
    help="Also compute the sha256 fingerprint of the weights (reported; kept in safetensors metadata).",
)


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
@click.option("--tensors", "list_tensors", is_flag=True, help="List every weight tensor.")
@click.option(
    "--fingerprint",
    "with_fingerprint",
    is_flag=True,
    help="Also hash the weights (reads every byte; the same value in any format).",
)
@allow_global_option
@allow_expansion_option
@weights_option
@shows_progress
@storage_options
@handle_errors
def inspect(
    ckpt: Path,
    as_json: bool,
    list_tensors: bool,
    with_fingerprint: bool,
    allow_globals: tuple[str, ...],
    allow_expansion: bool,
    weights: str | None,
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
        tensors=list_tensors,
        allow_expansion=allow_expansion,
        weights=weights,
    )
    if as_json:
        _emit_json("inspect", summary.to_json())
    else:
        render.summary(summary)


# ------------------------------------------------------------------------------------------------ scan


@main.command()
@click.argument("ckpt", type=LOCATION)
@json_option
@allow_global_option
@storage_options
@handle_errors
def scan(ckpt: Path, as_json: bool, allow_globals: tuple[str, ...]) -> None:
    """List every pickle global and opcode without executing anything; judge safe, unknown or dangerous.

    Exit 0 safe, 1 unknown or dangerous globals found, 3 unreadable or not a checkpoint.

    Example: ckptool scan downloaded.pt --json
    """
    from ckptool.ops.scan import scan as scan_

    report = scan_(ckpt, allow_globals=allow_globals)
    if as_json:
        _emit_json("scan", report.to_json())
    else:
        render.scan(report)
    sys.exit(exitcodes.OK if report.safe else exitcodes.PROBLEM)


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
            dry_run_option,
        ]
    ):
        command = option(command)
    return command


@main.command()
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
        to_device=to_device,
        mapping=mapping,
        dry_run=dry_run,
    )
    if as_json:
        _emit_json("strip", report.to_json())
    else:
        details = report.details
        moved = (
            f"; devices {details['devices_before']} -> {details['devices_after']}" if "devices_after" in details else ""
        )
        render.write(
            report, f'stripped "{details["prefix"]}" from {details["renamed"]} keys: {ckpt} -> {report.target}{moved}'
        )


@main.command("add-prefix")
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
        dry_run=dry_run,
    )
    if as_json:
        _emit_json("add-prefix", report.to_json())
    else:
        render.write(report, f'added "{prefix}" to {report.details["renamed"]} keys: {ckpt} -> {report.target}')


@main.command()
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
        dry_run=dry_run,
    )
    if as_json:
        _emit_json("remap", report.to_json())
    else:
        render.write(
            report,
            f"remapped {ckpt} -> {report.target}: {report.details['devices_before']} -> "
            f"{report.details['devices_after']}",
        )


# ------------------------------------------------------------------------------------------------ convert


@main.command()
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
        dry_run=dry_run,
        drop=drop,
        rename=rename,
        weights_only=weights_only,
    )
    report = operations.convert(plan, options)  # each output's bar, on a terminal (shows_progress)
    if as_json:
        _emit_json("convert", report.to_json(_error_text))
    else:
        for result in report.converted:
            render.write(
                result,
                f"{result.input} -> {result.saved.path} ({result.saved.format}, "
                f"{result.saved.tensors} tensors, {render.human_bytes(result.saved.bytes)})",
            )
    for failure in report.failed:
        render.echo(f"ckptool: error: {_error_text(failure)}", err=True)
    if report.failed:
        sys.exit(report.exit_code)


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
        against_weights=against_weights,
    )
    if as_json:
        _emit_json("verify", report.to_json(flag))
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
        weights_b=weights_b,
    )
    if as_json:
        _emit_json("diff", report.to_json())
    else:
        render.diff(report)
    sys.exit(exitcodes.OK if report.identical else exitcodes.PROBLEM)
