"""scan's findings as SARIF 2.1.0, the format code-scanning dashboards read (GitHub's among them).

One run; the tool ``ckptool`` with its version and three rules:

- ``CKPT001`` a dangerous global: the pickle calls something known to run code or reach the system
  (``os.system``, ``builtins.eval``); level ``error``.
- ``CKPT002`` an unknown global: outside the allowlist, none known to run code (a framework's own
  classes, whose code ``torch.load`` imports and runs); level ``warning``.
- ``CKPT003`` an unreadable file: a checkpoint or pickle that could not be judged (corrupt, refused,
  a link leaving its folder, a missing input); level ``warning``.

One result per finding: per file and global for CKPT001 and CKPT002, per file for CKPT003. A
local file under the directory the scan ran in is named relative to it (``uriBaseId`` ``SRCROOT``,
as GitHub code scanning requires); another by its ``file://`` URI, a URL as it is.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any
from urllib.parse import quote

from ckptool.files.atomic import atomic_output
from ckptool.ops.scan_tree import ItemResult

SCHEMA = "https://json.schemastore.org/sarif-2.1.0.json"
DANGEROUS, UNKNOWN, UNREADABLE = "CKPT001", "CKPT002", "CKPT003"

_RULES = [
    {
        "id": DANGEROUS,
        "name": "DangerousPickleGlobal",
        "shortDescription": {"text": "A pickle global known to run code or reach the system"},
        "fullDescription": {
            "text": "The file's pickle imports and calls a global known to run code or reach the system "
            "(os.system, builtins.eval, ...): torch.load or pickle.load of the file runs it."
        },
        "help": {"text": "Do not load the file; delete it or replace it with a copy from a trusted source."},
        "defaultConfiguration": {"level": "error"},
        "properties": {"tags": ["security"], "security-severity": "9.8"},
    },
    {
        "id": UNKNOWN,
        "name": "UnknownPickleGlobal",
        "shortDescription": {"text": "A pickle global outside the allowlist"},
        "fullDescription": {
            "text": "The file's pickle names a global outside the allowlist, none known to run code (often a "
            "framework's own class): loading it with torch imports that code and runs it."
        },
        "help": {
            "text": "Trust the file's source before loading it, or save the weights as safetensors "
            "(ckptool convert FILE -o FILE.safetensors)."
        },
        "defaultConfiguration": {"level": "warning"},
        "properties": {"tags": ["security"], "security-severity": "5.0"},
    },
    {
        "id": UNREADABLE,
        "name": "UnreadableCheckpoint",
        "shortDescription": {"text": "A checkpoint or pickle that could not be judged"},
        "fullDescription": {
            "text": "The file looks like a checkpoint or a pickle, but it could not be read to the end "
            "(corrupt, truncated, refused): its globals are not known."
        },
        "help": {"text": "Replace the file with a complete copy, or remove it."},
        "defaultConfiguration": {"level": "warning"},
        "properties": {"tags": ["security"]},
    },
]


def document(items: Iterable[ItemResult], version: str, root: Path | None = None) -> dict[str, Any]:
    """The SARIF log of ``items``' findings (paths relative to ``root``, default the working directory)."""
    base = Path(root if root is not None else os.getcwd()).resolve()
    results: list[dict[str, Any]] = []
    for item in items:
        location = [{"physicalLocation": {"artifactLocation": artifact(item.path, base)}}]
        for name in item.dangerous:
            message = (
                f"{item.path}: the pickle calls {name}, known to run code or reach the system — "
                "do not load this file; delete it or get it from a trusted source"
            )
            results.append(_result(DANGEROUS, "error", message, location, name))
        for name in item.unknown:
            message = (
                f"{item.path}: the pickle names {name}, outside the allowlist — loading it with torch runs that "
                "class's code: trust the file's source first, or save the weights as safetensors"
            )
            results.append(_result(UNKNOWN, "warning", message, location, name))
        if item.verdict == "unreadable":
            message = f"{item.path}: could not be judged — {item.reason}"
            results.append(_result(UNREADABLE, "warning", message, location, None))
    driver = {"name": "ckptool", "version": version, "rules": _RULES}
    run = {
        "tool": {"driver": driver},
        "originalUriBaseIds": {"SRCROOT": {"uri": base.as_uri() + "/"}},
        "results": results,
    }
    return {"$schema": SCHEMA, "version": "2.1.0", "runs": [run]}


def artifact(path: str, base: Path) -> dict[str, Any]:
    """A SARIF ``artifactLocation``: relative to ``base`` (``SRCROOT``) when under it, else an absolute URI."""
    if "://" in path and not path.startswith("file://"):
        return {"uri": path}
    local = Path(path.removeprefix("file://")).absolute()
    try:
        relative = Path(os.path.normpath(local)).relative_to(base)
    except ValueError:
        return {"uri": local.as_uri()}
    return {"uri": quote(relative.as_posix()), "uriBaseId": "SRCROOT"}


def _result(rule: str, level: str, message: str, location: list[dict[str, Any]], name: str | None) -> dict[str, Any]:
    found: dict[str, Any] = {
        "ruleId": rule,
        "ruleIndex": [DANGEROUS, UNKNOWN, UNREADABLE].index(rule),
        "level": level,
        "message": {"text": message},
        "locations": location,
    }
    if name is not None:  # the same global in the same file is one alert across runs
        uri = location[0]["physicalLocation"]["artifactLocation"]["uri"]
        found["partialFingerprints"] = {"ckptoolGlobal/v1": f"{uri}|{name}"}
    return found


def write(out: Path, items: Iterable[ItemResult], version: str) -> None:
    """Write the SARIF log atomically (a reader never sees half of it)."""
    text = json.dumps(document(items, version), indent=2, ensure_ascii=True)
    with atomic_output(out) as (handle, _):
        handle.write(text.encode("ascii") + b"\n")
