"""Cyclic garbage collection paused while a reader or writer builds many objects that form no cycles.

Python's collector runs every 700 allocations, and its older generations rescan what is alive: a
100,000-tensor checkpoint's records (members, placeholders, emitted memo entries) made it scan the
same live objects again and again, a fifth of the read. Nothing these passes build is garbage while
they run (the objects are the result), so pausing the collector frees no less memory; reference
counting still frees every temporary at once.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


@contextlib.contextmanager
def paused() -> Iterator[None]:
    """No cyclic collection inside; the collector's earlier state restored after (nesting and threads
    leave it as the outermost caller found it)."""
    collecting = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if collecting:
            gc.enable()
