"""Progress of long byte jobs: one seam, silent unless the command line shows a bar.

A job that moves many bytes (a write, a fingerprint, a diff) opens a :func:`task`; whatever moves
its bytes reports them, chunk by chunk: the copy engine through :func:`advance` (the running
task), a reader through the :class:`Task` it opened. By default no bar is made, so library calls
print nothing; ``ckptool`` installs :func:`terminal_bars` (tqdm on stderr) with :func:`showing`
when stderr is a terminal and neither ``--json`` nor ``--quiet`` was given. A bar appears only
once its job has run for :data:`DELAY` seconds, and a job that ends sooner leaves nothing behind.

One task runs at a time: a task opened while another runs (the fingerprint a write computes
alongside its copy, each file of a many-input convert) is silent, so no byte is counted twice.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable, Iterator
from typing import Any, Protocol, TextIO

DELAY = 1.0  # seconds a job runs before its bar shows (CKPTOOL_PROGRESS_DELAY overrides it)
DESCRIPTION_WIDTH = 40  # a longer name shows its end, so the bar keeps its room


class Bar(Protocol):
    """What a task drives: tqdm's ``update``/``close``, and its ``total``."""

    total: Any

    def update(self, n: int = 1) -> Any: ...

    def refresh(self) -> Any: ...

    def close(self) -> None: ...


BarFactory = Callable[[int | None, str], Bar]  # (total bytes or None, description) -> a bar


class Task:
    """A running job's progress: :meth:`advance` as bytes move. A silent task counts nothing."""

    def __init__(self, bar: Bar | None = None) -> None:
        self._bar = bar

    def advance(self, nbytes: int) -> None:
        """``nbytes`` more of the job are done."""
        if self._bar is not None:
            self._bar.update(nbytes)

    def expect(self, nbytes: int) -> None:
        """The job moves ``nbytes`` in all: the total of a task opened without one (a writer knows it
        once it has planned its output); a task that has its total keeps it."""
        if self._bar is not None and self._bar.total is None:
            self._bar.total = nbytes
            self._bar.refresh()

    def _finish(self) -> None:
        if self._bar is not None:
            self._bar.close()


SILENT = Task()
_lock = threading.Lock()
_factory: BarFactory | None = None
_running: Task | None = None


@contextlib.contextmanager
def task(total: int | None, description: str) -> Iterator[Task]:
    """A job of ``total`` bytes (None: the writer says with :meth:`Task.expect`), shown as
    ``description`` where bars are shown; silent where they are not, or inside another task."""
    global _running
    with _lock:
        if _factory is None or _running is not None:
            mine = None
        else:
            mine = _running = Task(_factory(total, description))
    if mine is None:
        yield SILENT
        return
    try:
        yield mine
    finally:
        with _lock:
            _running = None
        mine._finish()


def advance(nbytes: int) -> None:
    """``nbytes`` more of the running task are done (the copy engine's report); nothing when none runs."""
    running = _running
    if running is not None:
        running.advance(nbytes)


def expect(nbytes: int) -> None:
    """The running task's total, as :meth:`Task.expect` (a writer that has planned its output)."""
    running = _running
    if running is not None:
        running.expect(nbytes)


@contextlib.contextmanager
def showing(factory: BarFactory) -> Iterator[None]:
    """Show the tasks opened inside as bars made by ``factory`` (the command line's choice)."""
    global _factory
    previous, _factory = _factory, factory
    try:
        yield
    finally:
        _factory = previous


def delay() -> float:
    """Seconds before a bar shows: :data:`DELAY`, or ``CKPTOOL_PROGRESS_DELAY`` (tests set 0)."""
    try:
        return max(0.0, float(os.environ.get("CKPTOOL_PROGRESS_DELAY", DELAY)))
    except ValueError:
        return DELAY


def terminal_bars(stream: TextIO) -> BarFactory:
    """Byte bars on ``stream`` (a terminal), drawn by tqdm; each is removed when its job ends."""

    def make(total: int | None, description: str) -> Bar:
        from tqdm import tqdm  # type: ignore[import-untyped]  # tqdm ships no type hints

        from ckptool.base.text import printable

        shown = printable(description)  # a file's name may carry control characters
        if len(shown) > DESCRIPTION_WIDTH:
            shown = "..." + shown[-(DESCRIPTION_WIDTH - 3) :]
        bar: Bar = tqdm(
            total=total,
            desc=shown,
            unit="B",
            unit_scale=True,
            unit_divisor=1024,
            file=stream,
            delay=delay(),
            leave=False,
            dynamic_ncols=True,
        )
        return bar

    return make
