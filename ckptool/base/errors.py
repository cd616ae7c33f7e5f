"""ckptool's exceptions: each message names the file or key, the cause, and the next step.

The CLI turns a :class:`CkptError` into one line on stderr and its ``exit_code``; anything
else escaping a command is a bug. ``str(error)`` is always one printable line: what a message
quotes from the file (a key, a global, a file name) has its control characters escaped.

A message that asks for an option (``--force``, ``--allow-global NAME``) is a
:class:`~ckptool.base.suggest.Wording`: ``str(error)`` spells the option as the API's keyword argument
(``force=True``), :meth:`CkptError.render` with :func:`ckptool.base.suggest.flag` as the CLI's flag.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from ckptool.base import exitcodes
from ckptool.base.suggest import Option, Wording, keyword
from ckptool.base.text import printable, shown_url, url_name


class Location(Protocol):
    """Where an error happened: a local :class:`~pathlib.Path`, or a URL as the
    ``ckptool.files.remote.RemotePath`` the input was decided to be where the user named it. Either has a
    ``name``, and its ``str()`` carries no credentials."""

    @property
    def name(self) -> str: ...


class _UrlText(str):
    """A URL an error was given as text, kept as a message may print it (without credentials)."""

    @property
    def name(self) -> str:
        return url_name(self)


def _located(path: str | Location) -> Location:
    """``path`` as the error keeps it: text becomes a local :class:`Path`, or a URL's text without credentials."""
    if isinstance(path, str):
        return _UrlText(shown_url(path)) if "://" in path else Path(path)
    return path


class CkptError(Exception):
    """Base class: an expected failure with an actionable one-line message."""

    exit_code = exitcodes.INPUT

    def __init__(self, message: str | Wording, *, path: str | Location | None = None) -> None:
        self.path = _located(path) if path is not None else None  # a URL stays a URL (printed without credentials)
        self.wording = message if isinstance(message, Wording) else None
        self.message = str(message)  # an option it names spelled as the API's keyword argument
        super().__init__(self.render(keyword))

    def render(self, spell: Callable[[Option], str]) -> str:
        """The one-line message with each option it asks for spelled by ``spell``."""
        message = self.wording.render(spell) if self.wording is not None else self.message
        return printable(f"{self.path}: {message}" if self.path is not None else message)


class InputError(CkptError):
    """The input cannot be read: missing, unreadable, truncated, corrupt or not a checkpoint."""

    @classmethod
    def truncated(
        cls, path: str | Location | None, cause: str = "tensor bytes end before the data they promise"
    ) -> InputError:
        """The file ends before bytes it promises: ``<path>: file is truncated: <cause> — <next step>``."""
        return cls(f"file is truncated: {cause} — re-save or re-download the checkpoint", path=path)


class UnsafeCheckpointError(InputError):
    """The pickle references a global outside the allowlist; nothing was executed."""

    def __init__(
        self, message: str | Wording, *, path: Path | str | None = None, globals_: list[str] | None = None
    ) -> None:
        super().__init__(message, path=path)
        self.globals = list(globals_ or [])


class UnsupportedFormatError(InputError):
    """The file is readable but is not a checkpoint ckptool handles (TorchScript, archives, images...)."""


class NotACheckpointError(UnsupportedFormatError):
    """The file is data of another kind (a plain pickle, an array, text, an image), not a checkpoint of
    any format: no broken one. scan still judges the pickles of such a file."""


class OutputError(CkptError):
    """The output cannot be written: exists without --force, is the input, disk full, read-only."""


class KeyCollisionError(CkptError):
    """A key rewrite would map two keys onto one name."""


class NothingToDoError(CkptError):
    """The requested change would leave the checkpoint as it is (e.g. no key carries the prefix)."""

    exit_code = exitcodes.PROBLEM


class FingerprintMismatchError(CkptError):
    """A written file did not read back with the weights' fingerprint; it was deleted."""

    exit_code = exitcodes.PROBLEM


class UsageError(CkptError):
    """The arguments contradict each other or name something that does not exist."""

    exit_code = exitcodes.USAGE


class ResourceError(CkptError):
    """The machine ran out of memory while doing the work; nothing was written."""


class InternalError(CkptError):
    """A bug in ckptool met while doing the work — not a verdict on the input; please report it.

    The public API functions raise it in place of any other exception (chained, so the cause and
    its traceback stay on ``__cause__``); the CLI gives it its own exit code, 70 (EX_SOFTWARE).
    """

    exit_code = exitcodes.INTERNAL


class MissingExtraError(CkptError, ImportError):  # type: ignore[misc]  # path: a CkptError Location, not a module path
    """The work needs an optional dependency that is not installed (PyTorch: ``pip install 'ckptool[torch]'``).

    An ``ImportError`` too, so ``except ImportError`` around an optional feature catches it.
    """
