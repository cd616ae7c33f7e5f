"""The ``--json`` documents: one versioned shape per command, errors included.

Every object the CLI prints with ``--json`` names its schema first: ``{"schema": "ckptool.inspect/1",
...}``. The name is the document kind (``inspect``, ``scan``, ``write`` for strip / add-prefix /
remap, ``convert``, ``verify``, ``diff``, ``error``), the number its version: it goes up when a field
is removed or changes meaning; a new field may appear without it. The JSON Schema of each kind ships
in ``ckptool/schemas/<kind>.schema.json`` (:func:`schema`).

A failed command with ``--json`` still prints one object on stdout, ``{"schema": "ckptool.error/1",
"error": {"type", "message", "path", "exit_code"}}``, and exits with that code; its one-line
message goes to stderr as without ``--json``.

The output is strict JSON: ASCII (controls and non-ASCII escaped), no ``NaN``/``Infinity`` (a
non-finite float is the string ``"nan"``, ``"inf"`` or ``"-inf"``), only string keys, and no number
of more than 4300 digits (what Python's own JSON reader takes: an int past that is the string
``"<int of N bits>"``, as :func:`ckptool.base.text.int_text` writes it; a pickle may hold one of billions
of digits, which no reader could use and writing would take hours).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import PurePath
from typing import Any

from ckptool.base import errors, exitcodes
from ckptool.base.text import int_text

VERSION = 1

# the document kind of each command's --json object
KINDS = {
    "inspect": "inspect",
    "scan": "scan",
    "strip": "write",
    "add-prefix": "write",
    "remap": "write",
    "convert": "convert",
    "verify": "verify",
    "diff": "diff",
}

# an error's "type", most specific class first (the CLI's own failures add "interrupted", "memory", "internal")
ERROR_TYPES: list[tuple[type[errors.CkptError], str]] = [
    (errors.UnsafeCheckpointError, "unsafe"),
    (errors.UnsupportedFormatError, "unsupported_format"),
    (errors.InputError, "input"),
    (errors.OutputError, "output"),
    (errors.KeyCollisionError, "key_collision"),
    (errors.NothingToDoError, "nothing_to_do"),
    (errors.FingerprintMismatchError, "fingerprint_mismatch"),
    (errors.UsageError, "usage"),
    (errors.ResourceError, "memory"),
    (errors.InternalError, "internal"),
]


def schema_name(kind: str) -> str:
    """``ckptool.<kind>/<version>``, the value of every document's ``schema`` key."""
    return f"ckptool.{kind}/{VERSION}"


def document(kind: str, data: dict[str, Any]) -> dict[str, Any]:
    """``data`` as the ``kind`` document: its schema name first, then its fields."""
    return {"schema": schema_name(kind), **data}


def error_type(error: BaseException) -> str:
    """The stable ``type`` name of a ckptool error (``input``, ``unsafe``, ``output``, ...)."""
    for cls, name in ERROR_TYPES:
        if isinstance(error, cls):
            return name
    return "error"


def error_object(error: errors.CkptError, describe: Callable[[errors.CkptError], str] = str) -> dict[str, Any]:
    """``{"type", "message", "path", "exit_code"}`` (and ``globals`` for a refused pickle) of one error;
    ``describe`` gives the message (the CLI spells the options it asks for as flags)."""
    found: dict[str, Any] = {
        "type": error_type(error),
        "message": describe(error),
        "path": str(error.path) if error.path is not None else None,
        "exit_code": error.exit_code,
    }
    if isinstance(error, errors.UnsafeCheckpointError) and error.globals:
        found["globals"] = list(error.globals)
    return found


def error_document(
    type_: str, message: str, *, path: str | None = None, exit_code: int = exitcodes.INPUT, **extra: Any
) -> dict[str, Any]:
    """The ``error`` document for a failure that is not a :class:`~ckptool.base.errors.CkptError`."""
    return document(
        "error", {"error": {"type": type_, "message": message, "path": path, "exit_code": exit_code, **extra}}
    )


def plain(value: Any) -> Any:
    """``value`` as strict JSON values: tuples as lists, paths as strings, keys as strings,
    non-finite floats as ``"nan"``/``"inf"``/``"-inf"``, an int too long for digits as ``"<int of N
    bits>"``; anything else as its ``str``."""
    if value is None or isinstance(value, bool | str):
        return value
    if isinstance(value, int):
        return value if value.bit_length() <= _DIGITS_SURELY_WRITTEN else _long_int(value)
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    if isinstance(value, dict):
        return {key_text(k): plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [plain(v) for v in value]
    if isinstance(value, PurePath):
        return str(value)
    return str(value)


def key_text(key: Any) -> str:
    """A dict key as a JSON object key: strings as they are, numbers, booleans and None as JSON spells them."""
    if isinstance(key, str):
        return key
    if isinstance(key, float) and not math.isfinite(key):
        return str(key)
    if isinstance(key, int) and not isinstance(key, bool):
        return int_text(key)  # json.dumps' digits, or for an int too long for them its size
    return json.dumps(key) if isinstance(key, bool | int | float) or key is None else str(key)


# ints of up to this many bits have at most 4300 digits, which Python writes (and its JSON reader takes)
_DIGITS_SURELY_WRITTEN = 14_000


def _long_int(value: int) -> int | str:
    """A long int as strict JSON carries it: itself where Python writes its digits, else its size as text."""
    text = int_text(value)
    return value if text[0] != "<" else text


def dumps(data: dict[str, Any]) -> str:
    """The printed text of a document: indented, ASCII, strict (no NaN)."""
    return json.dumps(plain(data), indent=2, ensure_ascii=True, allow_nan=False)


def schema(kind: str) -> dict[str, Any]:
    """The JSON Schema (draft 2020-12) of the ``kind`` document, as shipped in the package."""
    from importlib import resources  # here, not at import: it pulls in tempfile, shutil, bz2, lzma (~10 ms a command)

    text = resources.files("ckptool").joinpath("schemas").joinpath(f"{kind}.schema.json").read_text(encoding="utf-8")
    loaded: dict[str, Any] = json.loads(text)
    return loaded
