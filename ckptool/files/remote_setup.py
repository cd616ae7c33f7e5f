"""URLs' shared state: the storage options every URL of the process is opened with (``--storage-option``), the
request and byte counts (``--json``'s ``io``), and the third-party libraries kept off the terminal."""

from __future__ import annotations

import contextlib
import importlib
import json
import logging
import os
import threading
from collections.abc import Iterator, Mapping
from typing import Any

from ckptool.base.errors import MissingExtraError

INSTALL = "pip install 'ckptool[remote]'"

# -- filesystems and options ------------------------------------------------------------------

_options: dict[str, Any] = {}
_filesystems: dict[tuple[str, str], Any] = {}
_lock = threading.Lock()


def parse_storage_options(pairs: tuple[str, ...] | list[str]) -> dict[str, Any]:
    """``KEY=VALUE`` pairs (``--storage-option``) as fsspec keyword arguments; a value that reads as
    JSON (``true``, ``3``, ``{"a": 1}``) is that value, anything else the string. A dotted key sets
    a nested one (``client_kwargs.region_name=eu-west-1``).

    Raises:
        ValueError: a pair without ``=``.
    """
    options: dict[str, Any] = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        if not sep or not key:
            raise ValueError(f"{key or pair!r} is not KEY=VALUE")
        try:
            value: Any = json.loads(raw)
        except ValueError:
            value = raw
        target = options
        *outer, last = key.split(".")
        for part in outer:
            target = target.setdefault(part, {})
        target[last] = value
    return options


def set_storage_options(options: Mapping[str, Any] | None) -> None:
    """The fsspec keyword arguments every URL of this process is opened with (``--storage-option``)."""
    with _lock:
        _options.clear()
        _options.update(options or {})
        _filesystems.clear()
    _forget_remote_files()


def _forget_remote_files() -> None:
    """The byte-I/O layer's shared windows and range CRCs go when a command starts or the options change."""
    import sys

    byteio = sys.modules.get("ckptool.files.byteio")
    if byteio is not None:
        byteio.forget_remote()


# the libraries' own loggers: their tracebacks and the stores' raw answers stay off the terminal (a
# NullHandler keeps Python's last-resort handler quiet; an application's own logging still sees them)
QUIET_LOGGERS = (
    "fsspec",
    "s3fs",
    "gcsfs",
    "aiobotocore",
    "botocore",
    "aiohttp",
    "google",
    "google.auth",
    "urllib3",
    "asyncio",
)
_QUIET_WARNINGS = r"(fsspec|s3fs|gcsfs|aiobotocore|botocore|aiohttp|google|urllib3)(\.|$)"
_quieted = False


def _quiet_libraries() -> None:
    global _quieted
    if _quieted:
        return
    import warnings

    for name in QUIET_LOGGERS:
        logger = logging.getLogger(name)
        if not any(isinstance(handler, logging.NullHandler) for handler in logger.handlers):
            logger.addHandler(logging.NullHandler())
    warnings.filterwarnings("ignore", module=_QUIET_WARNINGS)
    # gcsfs asks Google's control plane about a bucket over gRPC, whose C core logs to the terminal itself
    os.environ.setdefault("GRPC_VERBOSITY", "NONE")
    _quieted = True


def _fsspec() -> Any:
    _quiet_libraries()
    try:
        fsspec = importlib.import_module("fsspec")  # (untyped: looked up, not imported by name)
    except ImportError as e:
        raise MissingExtraError(f"URLs need fsspec, which is not installed — {INSTALL}") from e
    return fsspec


# -- counting -----------------------------------------------------------------------------------


class IOStats:
    """Requests made and bytes read from URLs since :meth:`reset` (``--json``'s ``io``)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.requests = 0
        self.bytes_read = 0
        self.bytes_written = 0

    def reset(self) -> None:
        with self._lock:
            self.requests = self.bytes_read = self.bytes_written = 0
        LEARNT_SIZES.clear()
        _forget_remote_files()

    @contextlib.contextmanager
    def request(self, read: int = 0) -> Iterator[None]:
        with self._lock:
            self.requests += 1
            self.bytes_read += read
        yield

    def add(self, *, requests: int = 0, read: int = 0, written: int = 0) -> None:
        with self._lock:
            self.requests += requests
            self.bytes_read += read
            self.bytes_written += written

    def as_dict(self) -> dict[str, int]:
        with self._lock:
            return {"bytes_read": self.bytes_read, "requests": self.requests, "bytes_written": self.bytes_written}


STATS = IOStats()
# the sizes the store told of the files this command opened (``inspect``'s file_bytes costs no request)
LEARNT_SIZES: dict[Any, int] = {}  # by RemotePath
