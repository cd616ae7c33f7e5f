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
from collections import deque
from collections.abc import Iterator
from typing import Any

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


# what a command's last passes leave behind, held to its exit (see keep): the last few, so a batch of files holds
# two files' trees at most, not every file's
_kept: deque[tuple[Any, ...]] = deque(maxlen=4)


def keep(*objects: Any) -> None:
    """In a process whose results live to its end (:func:`freeze_results`: a command), hold ``objects`` (a
    checkpoint's tree, a write's read-back) until it exits instead of freeing them object by object as their
    last reference goes: a 100,000-tensor tree costs ~0.08 s to free, and the command exits without tearing
    its heap down (``cli.run``). Only what dies as a command ends is handed here, so no peak grows. A
    library caller frees them as usual."""
    if _freezing:
        _kept.append(objects)


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
