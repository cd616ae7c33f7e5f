"""Ctrl-C and SIGTERM reach a command inside the C loops (``_fastload.c``).

Python runs a signal's handler between bytecodes; a C loop that holds the interpreter for as long as its
input lasts would hold the signal too. Each loop whose length an input sets calls ``PyErr_CheckSignals``
every 2^16 turns, and the handler's exception ends the loop as any error does.

Each test starts a loop over a long input with an interval timer armed, whose handler looks at how far
the loop got: a count strictly between none and all can only be seen from inside the loop (its loop
calls no Python code). Each timer is set to fire part way through the time the whole loop takes; one
that fires before the loop starts or after it ends proves nothing either way, and the next is tried. No
time is asserted.
"""

from __future__ import annotations

import gc
import math
import signal
import time
from collections.abc import Callable
from typing import Any

import pytest

from ckptool.pickles import unpickle

fastload = unpickle._fastload

pytestmark = pytest.mark.skipif(not hasattr(signal, "setitimer"), reason="no interval timer here")

FRACTIONS = (0.5, 0.3, 0.7, 0.5, 0.2, 0.6, 0.4, 0.8, 0.5, 0.1)  # of the loop's own time, for each timer


class Fired(Exception):
    """The timer's handler ran: ``seen`` is how far the loop had got."""

    def __init__(self, seen: int) -> None:
        super().__init__(seen)
        self.seen = seen


def _interrupted_part_way(run: Callable[[], Any], progress: Callable[[], int], total: int) -> bool:
    """Whether a timer's handler ran inside ``run``'s loop, seeing ``progress()`` strictly between 0 and ``total``."""

    def handler(signum: int, frame: Any) -> None:
        raise Fired(progress())

    # no collection during the loops: a finalizer it ran would run the handler in Python code, which
    # swallows its exception ("Exception ignored in ...")
    gc.collect()
    gc.disable()
    try:
        return _attempts(run, handler, total)
    finally:
        gc.enable()


def _attempts(run: Callable[[], Any], handler: Callable[[int, Any], None], total: int) -> bool:
    def attempt(delay: float) -> int | None:
        try:
            try:
                signal.setitimer(signal.ITIMER_REAL, delay)
                run()
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
        except Fired as e:
            return e.seen
        return None  # the loop ended before the timer

    duration = math.inf
    for _ in range(3):  # how long the whole loop takes here (its quickest)
        start = time.perf_counter()
        run()
        duration = min(duration, time.perf_counter() - start)
    previous = signal.signal(signal.SIGALRM, handler)
    try:
        for fraction in FRACTIONS:
            delay = max(duration * fraction, 1e-4)
            try:
                seen = attempt(delay)
            except Fired as e:  # the handler ran as the attempt was ending: after the loop
                seen = e.seen
            if seen is not None and 0 < seen < total:
                return True
    finally:
        signal.signal(signal.SIGALRM, previous)
    return False


@pytest.mark.skipif(fastload is None, reason="the C extension (ckptool/native/_fastload.c) was not built here")
def test_the_c_unpickler_ends_on_a_signal_part_way() -> None:
    # a persistent id gives the run a list of ours; three million APPENDs of None go into it
    count = 3_000_000
    target: list = []
    blob = b"\x80\x02(X\x02\x00\x00\x00pttQ" + b"Na" * count + b"."  # the list, then None appended to it
    constants = (None, None, None, frozenset(), None, None, None)

    def run() -> None:
        target.clear()
        fastload.load(blob, None, lambda pid: target, constants, None)

    assert _interrupted_part_way(run, lambda: len(target), count)

