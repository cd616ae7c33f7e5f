"""The oracles of the fuzz: each C twin against its Python reference, and the public API's promise.

Every C extension of ckptool is the exact twin of a Python reference (README, "How it is fast"):

    twin        C                                   Python reference             switched by
    guard       ckptool/native/_guard.c  (the walk)        opcode_guard._python_walk    opcode_guard.NATIVE
    unpickle    ckptool/native/_fastload.c load            CPython's unpickler          unpickle.FAST
    header      ckptool/native/_fastload.c parse_header    json + _each_tensor          safetensors.PURE_PYTHON_HEADER

:func:`check` runs one input file through all of them: the guard's two walks over every pickle in it,
``ckptool.load`` with every twin in C and with each in Python
(their results compared node by node, sharing included), and where it loads, ``save`` to .pt and
.safetensors both ways (the outputs compared byte for byte); then ``load``, ``inspect`` and ``scan``
must raise nothing but a CkptError about the input (never InternalError). It returns the problems found,
each a line naming the oracle; an empty list is a pass. A memory error in C is not a problem it can
return: under the sanitized build (scripts/fuzz/run.py) it ends the process, which the driver records.

Used by scripts/fuzz/worker.py on every mutant and by tests/test_fuzz.py on every committed finding.
"""

from __future__ import annotations

import contextlib
import io
import secrets
import sys
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import ckptool
from ckptool.base.errors import CkptError, InputError, InternalError
from ckptool.formats import safetensors
from ckptool.pickles import limits, opcode_guard, unpickle
from ckptool.pickles.opcode_guard import Truncated

TWINS = ("guard", "unpickle", "header")
MAX_PICKLES = 6  # consecutive pickles walked in one file (a legacy file holds five)
MAX_MEMBER = 4 << 20  # a zip member read for its pickle: larger ones are left to the load
SAVE_LIMIT = 16 << 20  # outputs written only for loads whose tensors come to at most this much
_ATOMS = (int, float, str, bytes, bool, type(None), complex)


def native_modules() -> dict[str, Any]:
    """The C extension modules as imported (None where not built): the driver checks where they came from."""
    return {"guard": opcode_guard._native, "fastload": unpickle._fastload}


# ------------------------------------------------------------------------------------------------ switching


@contextlib.contextmanager
def python_for(twins: tuple[str, ...] | frozenset[str]) -> Iterator[None]:
    """Within the block, the named twins run their Python reference; the others stay as they were."""
    saved = (opcode_guard.NATIVE, unpickle.FAST, safetensors.PURE_PYTHON_HEADER)
    try:
        if "guard" in twins:
            opcode_guard.NATIVE = False
        if "unpickle" in twins:
            unpickle.FAST = False
        if "header" in twins:
            safetensors.PURE_PYTHON_HEADER = True
        yield
    finally:
        opcode_guard.NATIVE, unpickle.FAST, safetensors.PURE_PYTHON_HEADER = saved


# ------------------------------------------------------------------------------------------------ comparing


def canon(obj: Any, seen: dict[int, int] | None = None) -> Any:
    """A comparable form of ``obj``: its type, its contents, and a back-reference for every object met again
    (so the two runs' sharing is compared too). Atoms compare by value (a float by its repr: NaN equals NaN)."""
    seen = {} if seen is None else seen
    if type(obj) in _ATOMS:
        return (type(obj).__name__, repr(obj) if isinstance(obj, float | complex) else obj)
    if type(obj) is tuple and all(type(item) in _ATOMS for item in obj):
        # a tuple of atoms is a value: whether two equal ones are one object is nothing a reader can see
        # (the C header parse shares a shape tuple between tensors, json builds one per tensor)
        return ("tuple", [canon(item) for item in obj])
    if id(obj) in seen:
        return ("ref", seen[id(obj)])
    seen[id(obj)] = len(seen)
    kind = f"{type(obj).__module__}.{type(obj).__qualname__}"
    if isinstance(obj, dict):
        items = [(canon(k, seen), canon(v, seen)) for k, v in dict.items(obj)]
        state = getattr(obj, "__dict__", None)
        return (kind, items, canon(dict(state), seen) if state else None)
    if isinstance(obj, list | tuple):
        return (kind, [canon(item, seen) for item in obj])
    if isinstance(obj, set | frozenset):
        return (kind, sorted(repr(canon(item, {})) for item in obj))
    if isinstance(obj, Path):
        return (kind, str(obj))
    if isinstance(obj, type) or callable(obj) and not hasattr(obj, "__dict__") and not hasattr(type(obj), "__slots__"):
        return (kind, getattr(obj, "__qualname__", repr(obj)))
    fields = []
    for klass in type(obj).__mro__:
        for name in getattr(klass, "__slots__", ()):
            if hasattr(obj, name):
                fields.append((name, canon(getattr(obj, name), seen)))
    state = getattr(obj, "__dict__", None)
    if state is not None:
        fields.extend((name, canon(value, seen)) for name, value in sorted(state.items()))
    return (kind, fields)


def _error(e: BaseException) -> tuple[str, str]:
    return (type(e).__name__, str(e))


def _differs(a: Any, b: Any) -> str:
    """The first place two outcomes differ, shortly."""
    text_a, text_b = repr(a), repr(b)
    at = next((i for i, (x, y) in enumerate(zip(text_a, text_b)) if x != y), min(len(text_a), len(text_b)))
    return f"C {text_a[max(0, at - 80):at + 160]!r} vs Python {text_b[max(0, at - 80):at + 160]!r}"


# ------------------------------------------------------------------------------------------------ the guard


@contextlib.contextmanager
def _headroom() -> Iterator[None]:
    # room for the Python walk's bucket to compare keys ~1000 tuples deep, as the C walk does
    # (tests/test_guard_native.py: without it the two differ only by the Python walk's own stack)
    previous = sys.getrecursionlimit()
    sys.setrecursionlimit(max(previous, 5000))
    try:
        yield
    finally:
        sys.setrecursionlimit(previous)


def walk_outcome(walk: Callable[[bytes], Any], data: bytes) -> tuple:
    """One walk's result: ("passed", size, counts, globals) or its error's type and message."""
    try:
        with _headroom():
            stats = walk(data)
    except Truncated as e:
        return ("Truncated", str(e))
    except InputError as e:
        return _error(e)
    return ("passed", stats.size, tuple(stats.counts), tuple(stats.globals))


_LIMIT_VARIANTS = (("MAX_HASH_COLLISIONS", 0), ("MAX_KEY_NODES", 0), ("MAX_KEY_NODES", 2))


def check_guard(blob: bytes) -> tuple[list[str], int | None]:
    """Both walks over ``blob`` under the real limits, and (for a pickle they pass) under low ones; the problems,
    and the length of the pickle where both passed it."""
    if opcode_guard._native is None:
        return [], None
    expected = walk_outcome(opcode_guard._python_walk, blob)
    got = walk_outcome(opcode_guard._native_walk, blob)
    if got != expected:
        return [f"guard: the walks differ on {len(blob)} bytes: {_differs(got, expected)}"], None
    if expected[0] != "passed":
        return [], None
    problems = []
    for name, value in _LIMIT_VARIANTS:
        saved = getattr(limits, name)
        setattr(limits, name, value)
        try:
            expected_low = walk_outcome(opcode_guard._python_walk, blob)
            got_low = walk_outcome(opcode_guard._native_walk, blob)
        finally:
            setattr(limits, name, saved)
        if got_low != expected_low:
            problems.append(f"guard: the walks differ with {name}={value}: {_differs(got_low, expected_low)}")
    return problems, expected[1]


def pickles_in(data: bytes) -> list[bytes]:
    """The pickles to walk in a file's bytes: the file itself and the pickles after it (a legacy file is five
    in a row), and each pickle member of it as a zip (read with zipfile, stored or deflated, small)."""
    blobs = [data]
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as archive:
            for info in archive.infolist()[:64]:
                if info.filename.endswith(".pkl") and info.file_size <= MAX_MEMBER and info.compress_size <= MAX_MEMBER:
                    with contextlib.suppress(Exception):  # zipfile's own objections: the load judges those
                        with archive.open(info) as member:
                            blobs.append(member.read(MAX_MEMBER + 1)[:MAX_MEMBER])
    except Exception:  # noqa: BLE001 — not a zip zipfile reads: the file's bytes are the pickles
        pass
    return blobs


def check_guard_file(data: bytes) -> list[str]:
    problems: list[str] = []
    blobs = pickles_in(data)
    first, rest = blobs[0], blobs[1:]
    for _ in range(MAX_PICKLES):  # the pickles in a row at the start of the file
        found, size = check_guard(first)
        problems += found
        if not size or size >= len(first):
            break
        first = first[size:]
    for blob in rest:
        problems += check_guard(blob)[0]
    return problems


# ------------------------------------------------------------------------------------------------ whole loads


def load_outcome(path: Path) -> tuple[tuple, Any]:
    """``ckptool.load(path)``, comparable; and the checkpoint, where it loaded."""
    try:
        checkpoint = ckptool.load(path)
    except CkptError as e:
        return _error(e), None
    except Exception as e:  # noqa: BLE001 — compared too (and reported by check_api)
        return ("escaped",) + _error(e), None
    shown: tuple
    try:
        shown = ("read", checkpoint.format, canon(checkpoint.container), sorted(checkpoint.globals.items()),
                 sorted(checkpoint.metadata.items()), list(checkpoint.notes))
    except Exception as e:  # noqa: BLE001 — a property that raises is compared as what it raised
        shown = ("read, then raised",) + _error(e)
    return shown, checkpoint


def check_load(path: Path) -> tuple[list[str], Any, str]:
    """The load with every twin in C against the load with every twin in Python; where they differ, each twin
    alone in Python, to name the one that differs. Returns the problems, the (C) checkpoint and its outcome."""
    fast, checkpoint = load_outcome(path)
    with python_for(TWINS):
        slow, _ = load_outcome(path)
    if fast == slow:
        return [], checkpoint, fast[0]
    culprits = []
    for twin in TWINS:
        with python_for((twin,)):
            alone, _ = load_outcome(path)
        if alone != fast:
            culprits.append(twin)
    return [f"load: C and Python differ (twin {'+'.join(culprits) or 'unknown: only together'}): "
            f"{_differs(fast, slow)}"], checkpoint, fast[0]


def _small_enough(checkpoint: Any, size: int) -> bool:
    try:
        tensors = checkpoint.tensors if checkpoint.has_weights else {}
        return sum(tensor.nbytes for tensor in tensors.values()) <= min(SAVE_LIMIT, 16 * size + (1 << 20))
    except CkptError:
        return False


def _save_outcome(checkpoint: Any, out: Path) -> tuple:
    # a .pt archive's serialization id is random (as torch's): the same one for both writes compared
    saved = secrets.randbelow
    setattr(secrets, "randbelow", lambda limit: 1234567 % limit)
    try:
        ckptool.save(checkpoint, out, force=True)
    except CkptError as e:
        return _error(e)
    except Exception as e:  # noqa: BLE001 — compared too (and a problem of its own)
        return ("escaped",) + _error(e)
    finally:
        setattr(secrets, "randbelow", saved)
    return ("written", out.read_bytes())


def check_save(checkpoint: Any, path: Path, work: Path) -> list[str]:
    """A loaded checkpoint saved to .pt and .safetensors with every twin in C and in Python: the same bytes."""
    if checkpoint is None or not _small_enough(checkpoint, path.stat().st_size):
        return []
    problems = []
    for suffix in (".pt", ".safetensors"):
        # one file name in two folders: a .pt archive's top folder is its file's stem
        (work / "c").mkdir(exist_ok=True)
        (work / "py").mkdir(exist_ok=True)
        fast = _save_outcome(checkpoint, work / "c" / f"out{suffix}")
        with python_for(TWINS):
            slow = _save_outcome(checkpoint, work / "py" / f"out{suffix}")
        if fast[0] == "escaped":
            problems.append(f"api: save{suffix} raised {fast[1]}: {fast[2][:300]}")
        if fast != slow:
            shown_fast = fast if fast[0] != "written" else ("written", len(fast[1]))
            shown_slow = slow if slow[0] != "written" else ("written", len(slow[1]))
            problems.append(f"save{suffix}: C and Python write differently: {_differs(shown_fast, shown_slow)}")
        for name in ("c", "py"):
            (work / name / f"out{suffix}").unlink(missing_ok=True)
    return problems


# ------------------------------------------------------------------------------------------------ the API


def check_api(path: Path) -> list[str]:
    """load, inspect and scan (each twin in C) raise only a CkptError about the input."""
    problems = []
    for name in ("load", "inspect", "scan"):
        try:
            getattr(ckptool, name)(path)
        except InternalError as e:
            cause = e.__cause__
            where = ""
            if cause is not None and cause.__traceback__ is not None:
                frame = cause.__traceback__
                while frame.tb_next is not None:
                    frame = frame.tb_next
                where = f" at {Path(frame.tb_frame.f_code.co_filename).name}:{frame.tb_lineno}"
            problems.append(f"api: {name} raised InternalError{where}: {str(e)[:300]}")
        except CkptError:
            pass
        except Exception as e:  # noqa: BLE001 — the promise broken
            problems.append(f"api: {name} raised {type(e).__name__}: {str(e)[:300]}")
    return problems


def check(path: Path, work: Path) -> list[str]:
    """Every oracle on the file at ``path`` (``work``: an empty folder for outputs). The problems; [] passes."""
    return check_report(path, work)[0]


def check_report(path: Path, work: Path) -> tuple[list[str], str]:
    """:func:`check`, and how far the load went: "read", or the name of the error that refused the file."""
    data = path.read_bytes()
    problems = check_guard_file(data)
    found, checkpoint, outcome = check_load(path)
    problems += found
    problems += check_save(checkpoint, path, work)
    problems += check_api(path)
    return problems, outcome
