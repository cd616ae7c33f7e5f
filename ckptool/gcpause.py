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


_freezing = False  # set by a process whose results live to its end (the CLI): see freeze_results


def freeze_results() -> None:
    """In this process, hand what each pass built over to the collector's permanent generation as it resumes.

    A paused collector still counts allocations: the first collection after a pass scans everything
    the pass built (a 100,000-tensor read: half a million objects), and later whole-heap collections
    scan it again. A command keeps its checkpoint to the end and exits, so frozen results are never
    missed; a library caller never freezes (frozen cycles would wait for ``gc.unfreeze``).
    """
    global _freezing
    _freezing = True


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
            if _freezing:
                gc.freeze()
            gc.enable()
