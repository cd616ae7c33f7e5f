"""What every command shares: its error handling, the --json document, the location argument and the common options.

A command is wrapped by :func:`handle_errors` (one line on stderr, or an error document with --json,
and the exit code of :mod:`ckptool.base.exitcodes`); :data:`LOCATION` decides once what the user named,
a local path or a URL; :func:`storage_options` and :func:`shows_progress` add what a command reading
a URL or showing a bar needs.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from ckptool.base import exitcodes, jsonout
from ckptool.base.errors import CkptError, InternalError
from ckptool.base.suggest import flag
from ckptool.cli import render


def error_text(error: CkptError) -> str:
    """The error's one line, each option it asks for spelled as this command line's flag."""
    return error.render(flag)


def _fail(error: CkptError, as_json: bool = False) -> None:
    if as_json:  # a pipeline reads the failure on stdout too, in the shape it parses
        click.echo(jsonout.dumps(jsonout.document("error", {"error": jsonout.error_object(error, error_text)})))
    render.echo(f"ckptool: error: {error_text(error)}", err=True)
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


def emit_json(command: str, data: dict[str, Any]) -> None:
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
    "(state_dict_ema, model.ema, ema), or a model folder's component (unet); a key holding dots is matched "
    "whole. Default: the live weights (a folder of components: all of them).",
)
variant_option = click.option(
    "--variant",
    default=None,
    metavar="NAME",
    help="In a model folder, read the weights variant NAME (fp16: diffusion_pytorch_model.fp16.safetensors); "
    "a component without it is read from its default weights. Default: the default weights.",
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
