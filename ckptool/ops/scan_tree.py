"""scan of many inputs: files, folders walked recursively, URL prefixes, a hub cache; one summary.

The scan is two pieces, so a pool of processes can run the second: :func:`walk` yields the
items of the inputs lazily (a file, or a folder that is one model), holding one folder's listing
at a time; :func:`scan_item` judges one item into a small :class:`ItemResult` (its verdict, the
globals outside the allowlist, a one-line reason) — no report's opcode or global maps are kept.
:func:`scan_many` runs them in order into a :class:`TreeReport`.

What is an item:

- a file is judged by its content (its first bytes: a format's signature, a pickle's first opcode,
  the ``.npy`` magic, an ``.npz`` archive of arrays); a file of none of these is skipped and counted.
  A text file is judged under a checkpoint's suffix (:data:`SUFFIXES`), or when its opcodes read as a
  pickle (a protocol-0 pickle is text): other text that opens with a letter that is also an opcode is skipped.
- a folder that a folder format claims (DCP, a training folder, sharded weights, a model folder
  such as a pipeline) is one item, judged as that model, when every file of it that holds a
  checkpoint or a pickle is one of the model's own (its weights, shards and training files);
  otherwise the folder is walked and its files and sub-folders are items.
- links to folders are never followed; a file linked from inside an input folder must stay in it
  (or, in a hub cache snapshot, in the repo's ``blobs/``). A hub repo's ``blobs/`` is not walked:
  its files are judged through the snapshots' links, under their names.
"""

from __future__ import annotations

import gc
import os
import re
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

from ckptool import formats
from ckptool.base.errors import CkptError, UnsupportedFormatError
from ckptool.files import inputs
from ckptool.files.inputs import located
from ckptool.formats import model_folder
from ckptool.ops import scan as scan_
from ckptool.pickles.frames import TEXT_PICKLE_PREFIX, opens_as_pickle

# the suffixes of files a library unpickles or reads as a checkpoint: judged even when their bytes look like text
SUFFIXES = (".pt", ".pth", ".bin", ".ckpt", ".pkl", ".pickle", ".joblib", ".npy", ".npz", ".safetensors", ".tar")
VERDICTS = ("safe", "unknown", "dangerous", "unreadable", "skipped")
SKIPPED_FOLDERS = frozenset({".git", "__pycache__"})
COLLECT_EVERY = 200  # judged items between two collections of their cyclic garbage (see scan_many)
POOL_AFTER = 0.5  # seconds of judging in this process after which the rest of a tree goes to worker processes
BATCH_SECONDS = 0.02  # the work a batch sent to a worker process is sized to (see _pooled)
MAX_BATCH = 256  # items a batch holds at most
IN_FLIGHT = 64  # batches and items in flight at most: the window that keeps workers busy past a slow file
SKIPPED_KEPT = 1000  # skipped items a tree report lists; the rest are only counted
MAX_MODEL_CHECK_FILES = 10_000  # a claimed folder holding more files is walked as files, not checked as one model
_SHARD = re.compile(r".+-\d{5}-of-\d{5}\.(safetensors|bin)")
_INDEX = re.compile(r".+\.(safetensors|bin)\.index(\.[\w-]+)?\.json")


@dataclass(frozen=True)
class Item:
    """One thing to judge: ``path`` (a file, or a folder that is one model), shown as ``shown``;
    ``folder`` is the input folder it was found in (links inside it are bounded by it), None for an
    input named itself; ``problem`` is why it cannot be judged (a missing input, a link refused)."""

    path: Path
    shown: str
    folder: Path | None = None
    model: bool = False
    problem: str | None = None
    missing: bool = False


@dataclass
class ItemResult:
    """One item's verdict (``safe``, ``unknown``, ``dangerous``, ``unreadable`` or ``skipped``), its format,
    the globals outside the allowlist (``dangerous`` ones also in ``dangerous``) and why it was skipped
    or unreadable; ``notes`` are the scan's notes on a file judged unsafe."""

    path: str
    verdict: str
    kind: str = "file"
    format: str = ""
    pickles: int = 0
    dangerous: list[str] = field(default_factory=list)
    unknown: list[str] = field(default_factory=list)
    reason: str = ""
    notes: list[str] = field(default_factory=list)
    missing: bool = False

    def to_json(self) -> dict[str, Any]:
        found: dict[str, Any] = {"path": self.path, "verdict": self.verdict, "kind": self.kind}
        if self.verdict == "skipped":
            return {**found, "reason": self.reason}
        found.update(format=self.format, pickles=self.pickles, dangerous=self.dangerous, unknown=self.unknown)
        if self.reason:
            found["reason"] = self.reason
        if self.notes:
            found["notes"] = self.notes
        return found


@dataclass
class TreeReport:
    """The counts by verdict of every item, and the items a summary names, in the order walked: each
    judged or unreadable one (the safe ones only when ``keep_safe``), and the first
    :data:`SKIPPED_KEPT` skipped ones. Its size grows with the findings, not with the files walked."""

    roots: list[str]
    keep_safe: bool = True
    items: list[ItemResult] = field(default_factory=list)
    skipped: list[ItemResult] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    tally: Counter[str] = field(default_factory=Counter)

    def add(self, item: ItemResult) -> None:
        """Count ``item``; keep it if a summary names it."""
        self.tally[item.verdict] += 1
        if item.missing:
            self.missing.append(item.path)
        if item.verdict == "skipped":
            if len(self.skipped) < SKIPPED_KEPT:
                self.skipped.append(item)
        elif item.verdict != "safe" or self.keep_safe:
            self.items.append(item)

    @property
    def counts(self) -> dict[str, int]:
        return {verdict: self.tally.get(verdict, 0) for verdict in VERDICTS}

    def exit_code(self, fail_on: str = "unknown") -> int:
        """0 every judged item safe; 1 one dangerous (or, failing on ``unknown``, one unknown);
        3 an input missing, or nothing judged at all."""
        counts = self.counts
        if self.missing or not (counts["safe"] or counts["unknown"] or counts["dangerous"]):
            return 3
        if counts["dangerous"] or (fail_on == "unknown" and counts["unknown"]):
            return 1
        return 0

    def to_json(self, fail_on: str = "unknown") -> dict[str, Any]:
        return {
            "roots": self.roots,
            "counts": self.counts,
            "fail_on": fail_on,
            "exit_code": self.exit_code(fail_on),
            "items": [item.to_json() for item in self.items],
            "skipped": [{"path": item.path, "reason": item.reason} for item in self.skipped],
            "skipped_unlisted": self.counts["skipped"] - len(self.skipped),
        }


# ------------------------------------------------------------------------------------------ the walk


def single_model(path: Path | str) -> bool:
    """Whether ``path`` alone is scanned as one input (a file, a missing path, or a folder that is one
    model), as ``scan`` always did; otherwise it is a tree of items."""
    path = located(path)
    remote = inputs.describe_remote(path)
    if not (path.exists() if remote is None else remote.exists):
        return True
    if not (path.is_dir() if remote is None else remote.is_dir):
        return True
    return is_one_model(path)


def walk(roots: Iterable[Path | str]) -> Iterator[Item]:
    """The items of the inputs, lazily: each input file itself; each folder that is one model; the
    files and model folders below each other folder (depth first, names in order). Inputs that overlap
    (``scan . models/``) give each item once, under the name it was first found by; the same file
    under two link names stays two items."""
    roots = list(roots)
    if len(roots) < 2:
        yield from _walk_roots(roots)
        return
    seen: set[str] = set()  # one string an item: the flat-memory walk of one input keeps none
    for item in _walk_roots(roots):
        key = str(item.path) if inputs.is_remote(item.path) else os.path.abspath(item.path)
        if key not in seen:
            seen.add(key)
            yield item


def _walk_roots(roots: list[Path | str]) -> Iterator[Item]:
    for root in roots:
        path = located(root)
        shown = str(root)
        remote = inputs.describe_remote(path)
        if not (path.exists() if remote is None else remote.exists):
            yield Item(path, shown, problem="does not exist — check the path", missing=True)
        elif not (path.is_dir() if remote is None else remote.is_dir):
            yield Item(path, shown)
        elif is_one_model(path):
            yield Item(path, shown, model=True)
        else:
            yield from _walk_folder(path, shown)


def _walk_folder(top: Path, shown: str) -> Iterator[Item]:
    pending = [(top, shown)]
    while pending:
        folder, folder_shown = pending.pop()
        names = _listing(folder)
        if "snapshots" in names and "blobs" in names:  # a hub repo: its blobs are the snapshots' files
            names.pop("blobs")
        below = []
        for name, is_dir in sorted(names.items()):
            path, item_shown = folder / name, f"{folder_shown.rstrip('/')}/{name}"
            if is_dir is None:
                yield Item(path, item_shown, top, problem="is a link to a folder — not followed")
            elif is_dir:
                if name not in SKIPPED_FOLDERS:
                    below.append((path, item_shown))
            else:
                yield Item(path, item_shown, top)
        for path, item_shown in reversed(below):
            if is_one_model(path):
                yield Item(path, item_shown, top, model=True)
            else:
                pending.append((path, item_shown))
        # a claimed folder is yielded before its siblings' files would be: order stays by name within a folder


def _listing(folder: Path) -> dict[str, bool | None]:
    """A folder's names -> a folder (True), a file (False) or a link to a folder (None); every name."""
    return model_folder.entries(folder, limit=None)


def is_one_model(folder: Path) -> bool:
    """Whether a folder format claims ``folder`` and every file in it that holds a checkpoint or a
    pickle is one the model's reader reads (so judging the model judges them all)."""
    fmt = formats.sniff(None, folder)
    single = None if fmt is not None else formats.in_folder(folder)
    if fmt is None and single is None:
        return False
    owned = _owned(folder, fmt, single)
    for count, rel in enumerate(_files_below(folder)):
        if count >= MAX_MODEL_CHECK_FILES:
            return False
        if not owned(rel) and _holds_checkpoint(folder / rel, rel):
            return False
    return True


def _owned(folder: Path, fmt: formats.Format | None, single: Path | None) -> Any:
    """``owned(rel)``: whether the model reads the file ``rel`` (a path from ``folder``) as its own."""
    if fmt is not None and fmt.owns is not None:
        return fmt.owns(folder)
    name = single.name if single is not None else None
    return lambda rel: "/" not in rel and (rel == name or bool(_INDEX.fullmatch(rel) or _SHARD.fullmatch(rel)))


def _files_below(folder: Path) -> Iterator[str]:
    """Every file below ``folder`` as a path from it (links to folders not followed)."""
    pending = [""]
    while pending:
        prefix = pending.pop()
        for name, is_dir in sorted(_listing(folder / prefix if prefix else folder).items()):
            rel = f"{prefix}/{name}" if prefix else name
            if is_dir:
                if name not in SKIPPED_FOLDERS:
                    pending.append(rel)
            elif is_dir is False:
                yield rel


def _holds_checkpoint(path: Path, rel: str) -> bool:
    if rel.lower().endswith(SUFFIXES):
        return True
    if inputs.is_remote(path):
        return False  # a store's file is judged by its name here: one request a file is for the scan itself
    try:
        with open(path, "rb") as handle:
            return _claimed(handle, handle.read(64), rel) is not None
    except OSError:
        return False


def _claimed(handle: BinaryIO, head: bytes, name: str) -> str | None:
    """What the first bytes make of a file: ``"checkpoint"``, ``"npy"``, or None for no checkpoint or pickle.

    A text file under no checkpoint's suffix is a checkpoint when its opcodes read as a pickle (a
    protocol-0 pickle is text, and ``torch.load`` or ``pickle.load`` takes any name); text that
    merely opens with a letter that is also an opcode is not."""
    if not head:
        return None
    if head.startswith(b"\x93NUMPY"):
        return "npy"
    if formats.sniff(head, Path(name)) is None:
        return None
    if formats.looks_like_text(head) and not name.lower().endswith(SUFFIXES):
        handle.seek(0)
        prefix = handle.read(TEXT_PICKLE_PREFIX + 1)
        whole = len(prefix) <= TEXT_PICKLE_PREFIX
        if not opens_as_pickle(prefix[:TEXT_PICKLE_PREFIX], whole=whole):
            return None
    return "checkpoint"


# ------------------------------------------------------------------------------------------ one item


def scan_item(item: Item, allow_globals: tuple[str, ...] = ()) -> ItemResult:
    """Judge one item: its verdict and what it rests on; a file that is no checkpoint is skipped,
    one that cannot be read is unreadable (with the reason), never an exception."""
    if item.problem is not None:
        verdict = "skipped" if item.problem.startswith("is a link to a folder") else "unreadable"
        return ItemResult(item.shown, verdict, reason=item.problem, missing=item.missing)
    if item.model:
        return _judged(item, allow_globals, "model")
    try:
        if item.folder is not None:
            inputs.check_member(item.folder, item.path, what=item.shown, report=item.path)
        with inputs.open_regular(item.path) as handle:
            head = handle.read(64)
            claimed = _claimed(handle, head, item.path.name)
    except CkptError as e:
        return ItemResult(item.shown, "unreadable", reason=e.message)
    except OSError as e:
        return ItemResult(item.shown, "unreadable", reason=f"cannot be read ({e.strerror or e})")
    if not head:
        return ItemResult(item.shown, "skipped", reason="is empty (0 bytes)")
    if claimed is None:
        what = formats.describe(head) or ("a text file" if formats.looks_like_text(head) else "no checkpoint or pickle")
        return ItemResult(item.shown, "skipped", reason=f"is {what}")
    return _judged(item, allow_globals, "file")


def _judged(item: Item, allow_globals: tuple[str, ...], kind: str) -> ItemResult:
    try:
        judged = scan_.judge(item.path, allow_globals=allow_globals)
    except UnsupportedFormatError as e:
        verdict = "unreadable" if kind == "model" or item.path.name.lower().endswith(SUFFIXES) else "skipped"
        return ItemResult(item.shown, verdict, kind, reason=e.message)
    except CkptError as e:
        return ItemResult(item.shown, "unreadable", kind, reason=e.message)
    except OSError as e:  # a file that vanished or a store that failed mid-walk: this item only
        return ItemResult(item.shown, "unreadable", kind, reason=f"cannot be read ({e.strerror or e})")
    return _result(item, judged, kind)


def _result(item: Item, judged: scan_.Judged, kind: str) -> ItemResult:
    report = judged.report
    error = scan_.accepted(judged).error
    if error is not None:
        return ItemResult(item.shown, "unreadable", kind, report.format, reason=error.message)
    found = summarized(item.shown, report, kind)
    if not report.unsafe and report.problems and report.problems[0].startswith((scan_.PLAIN_NOTE, scan_.NPZ_NOTE)):
        found.notes = report.problems[:1]  # what a safe file is, where it is no checkpoint ckptool loads
    return found


def summarized(shown: str, report: scan_.ScanReport, kind: str = "file") -> ItemResult:
    """A scan report's verdict and the globals it rests on, without its opcode and global maps."""
    dangerous = set(report.dangerous)
    unknown = [name for name in report.unsafe if name not in dangerous]
    notes = report.problems[:20] if report.unsafe else []
    return ItemResult(
        shown, report.verdict, kind, report.format, len(report.pickles), report.dangerous, unknown, "", notes
    )


def default_jobs() -> int:
    """The processes a tree scan may use: the CPUs this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def scan_many(
    roots: Iterable[Path | str],
    *,
    allow_globals: tuple[str, ...] = (),
    keep_safe: bool = True,
    on_item: Callable[[ItemResult], None] | None = None,
    jobs: int | None = None,
) -> TreeReport:
    """Judge every item of the inputs (see the module's notes); an unreadable file never stops the scan.

    The walk and the report hold what the summary names, never every file: the memory is flat in the
    number of files walked (``keep_safe=False`` drops the safe items too). ``on_item`` is called with
    each item's result as it is judged (a progress bar's count), in the walk's order.

    Items are judged in this process; a tree that takes longer than :data:`POOL_AFTER` seconds has the
    rest judged by ``jobs`` worker processes (default: one a CPU; 1: none), a bounded window of items
    at a time, their results taken in the walk's order: the report is the same either way."""
    roots = list(roots)
    report = TreeReport([str(root) for root in roots], keep_safe=keep_safe)
    jobs = default_jobs() if jobs is None else max(1, jobs)
    judged = 0

    def take(found: ItemResult) -> None:
        nonlocal judged
        report.add(found)
        judged += found.verdict != "skipped"
        if found.verdict != "skipped" and judged % COLLECT_EVERY == 0:
            # A command hands what each read builds to the collector's permanent generation (gcpause.freeze_results),
            # its cyclic garbage too (~25 KB a pickle): over thousands of files that held every file's garbage to
            # the end (10,000 pickles: 370 MB). Handing it back and collecting keeps the memory flat.
            gc.unfreeze()
            gc.collect()
        if on_item is not None:
            on_item(found)

    items = walk(roots)
    started = time.perf_counter()
    for item in items:
        take(scan_item(item, allow_globals))
        if jobs > 1 and time.perf_counter() - started >= POOL_AFTER:
            _pooled(items, allow_globals, jobs, take)
            break
    return report


def _pooled(
    items: Iterator[Item], allow_globals: tuple[str, ...], jobs: int, take: Callable[[ItemResult], None]
) -> None:
    """The rest of the walk judged by ``jobs`` worker processes, in batches sized to take about
    :data:`BATCH_SECONDS` each by what the batches so far took (most files are skipped in tens of
    microseconds, where one message an item would cost more than the item; a pickle can take tens of
    milliseconds, where a large batch would leave a worker idle), at most :data:`IN_FLIGHT` batches in
    flight (a slow file holds back the results behind it, not the workers), each result taken in the
    walk's order. An item of a store, or one that cannot be judged, is judged here when its turn comes
    (a store's session lives in this process). Workers are forked from a server process that imports
    this module once (not from this process: a command's threads and open stores are not copied into
    them); where no pool can be made, the rest is judged here."""
    import collections
    import multiprocessing
    from concurrent.futures import Future, ProcessPoolExecutor

    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload([__name__])
    window: collections.deque[Future[tuple[list[ItemResult], float]] | Item] = collections.deque()
    batch: list[Item] = []
    size, item_seconds = 4, 0.0

    def turn() -> None:
        nonlocal size, item_seconds
        entry = window.popleft()
        if isinstance(entry, Item):
            take(scan_item(entry, allow_globals))
            return
        found, seconds = entry.result()
        item_seconds = seconds / len(found) if not item_seconds else 0.8 * item_seconds + 0.2 * seconds / len(found)
        size = max(1, min(MAX_BATCH, int(BATCH_SECONDS / max(item_seconds, 1e-6))))
        for one in found:
            take(one)

    try:
        pool = ProcessPoolExecutor(jobs, mp_context=context)
    except (OSError, NotImplementedError):  # no semaphores here (a container without /dev/shm): judged here
        for item in items:
            take(scan_item(item, allow_globals))
        return
    try:
        for item in items:
            here = item.problem is not None or inputs.is_remote(item.path)
            if batch and (here or len(batch) >= size):
                window.append(pool.submit(_judge_all, batch, allow_globals))
                batch = []
            if here:
                window.append(item)
            else:
                batch.append(item)
            while len(window) >= IN_FLIGHT:
                turn()
        if batch:
            window.append(pool.submit(_judge_all, batch, allow_globals))
        while window:
            turn()
    finally:
        pool.shutdown(wait=True, cancel_futures=True)  # an interrupt or an error: no worker left running


def _judge_all(items: list[Item], allow_globals: tuple[str, ...]) -> tuple[list[ItemResult], float]:
    """A worker's batch: each item judged, in order, and the seconds it took."""
    started = time.perf_counter()
    found = [scan_item(item, allow_globals) for item in items]
    return found, time.perf_counter() - started
