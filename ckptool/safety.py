"""scan: every global and opcode a checkpoint's pickles use, found without executing anything.

Two passes per pickle. A static pass lists the opcodes and the globals they name: the guard's
record of the pickle (:func:`ckptool.pickles.guard_stats`, ``STACK_GLOBAL`` operands resolved
through its stack and memo), or ``pickletools.genops`` over a pickle the guard refused. Then a
restricted load; only if it fails, a dry run feeds the pickle to the restricted unpickler in
permissive mode, where every global becomes an inert placeholder — so the globals a real load
would import are listed exactly, even when hidden behind memo tricks.
A checkpoint is safe when every global is on the allowlist ckptool loads with.
"""

from __future__ import annotations

import io
import pickletools
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from . import dtypes, pickles
from .errors import CkptError, InputError, UnsupportedFormatError
from .formats import safetensors, zipio
from .refs import StorageRef

_STRING_OPS = {"SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8", "UNICODE", "STRING", "BINSTRING", "SHORT_BINSTRING"}


@dataclass
class ScanReport:
    """The verdict and what it rests on; ``asdict`` gives the --json object."""

    path: str
    format: str
    safe: bool
    unsafe: list[str]
    globals: dict[str, int]
    opcodes: dict[str, int]
    pickles: list[str]
    problems: list[str] = field(default_factory=list)
    readable: bool = True

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def static_globals(data: bytes) -> tuple[list[str], Counter, str | None]:
    """Globals named by GLOBAL/INST/STACK_GLOBAL and opcode counts; stops at STOP or a bad opcode."""
    found: list[str] = []
    opcodes: Counter = Counter()
    strings: list[str] = []
    memo: dict[int, str] = {}
    error = None
    try:
        for opcode, arg, _ in pickletools.genops(io.BytesIO(data)):
            opcodes[opcode.name] += 1
            name = opcode.name
            if name in ("GLOBAL", "INST"):
                found.append(str(arg).replace(" ", ".", 1))
            elif name == "STACK_GLOBAL":
                if len(strings) >= 2:
                    found.append(f"{strings[-2]}.{strings[-1]}")
                else:
                    found.append("<unresolved STACK_GLOBAL>")
            elif name in _STRING_OPS:
                strings.append(arg.decode("latin1") if isinstance(arg, bytes) else str(arg))
            elif name in ("BINPUT", "LONG_BINPUT", "PUT") and strings:
                memo[int(arg)] = strings[-1]
            elif name == "MEMOIZE" and strings:
                memo[len(memo)] = strings[-1]
            elif name in ("BINGET", "LONG_BINGET", "GET") and int(arg) in memo:
                strings.append(memo[int(arg)])
    except Exception as e:  # genops raises ValueError and friends on malformed input
        error = f"{type(e).__name__}: {str(e)[:120]}"
    return found, opcodes, error


def dry_run_globals(data: bytes, allow_globals: tuple[str, ...],
                    guard_cache: pickles.GuardCache | None = None) -> tuple[dict[str, int], str | None]:
    """Globals a load would import, found by unpickling with inert placeholders for everything."""
    resolver = pickles.GlobalResolver(allow_globals, permissive=True, guard_cache=guard_cache)
    stand_ins: dict[Any, StorageRef] = {}

    def persistent_load(pid: Any) -> Any:
        # a stand-in storage large enough for any view, so tensors build and the run goes on to the end
        storage_type = pid[1] if isinstance(pid, tuple) and len(pid) > 1 else None
        dtype = storage_type.dtype if isinstance(storage_type, pickles.StorageTypeRef) else dtypes.BY_NAME["U8"]
        key = pickles.brief(pid)
        if key not in stand_ins:
            stand_ins[key] = StorageRef(key=key, dtype=dtype, numel=1 << 62, location="cpu")
        return stand_ins[key]

    error = None
    try:
        pickles.loads(data, resolver, persistent_load)
    except CkptError as e:
        error = e.message
    except pickles.RefusedGlobal as e:  # not raised in permissive mode, kept for safety
        error = e.name
    return dict(resolver.seen), error


_PICKLE_FIRST_BYTES = b"\x80(cSVIJKLFGN]}l)dtq."
_UNCHECKED_PICKLE_BYTES = 64 << 20  # how much of a pickle the guard refused is still listed statically


def _split_pickles(stream: Any, label: str, limit: int, cache: pickles.GuardCache) -> list[tuple[str, bytes]]:
    """Up to ``limit`` consecutive pickles from ``stream``'s position (a pickle may hide another after STOP)."""
    blobs: list[tuple[str, bytes]] = []
    for index in range(limit):
        start = stream.tell()
        first = stream.read(1)
        if not first or first[0] not in _PICKLE_FIRST_BYTES:
            break
        stream.seek(start)
        try:
            data = pickles.read_pickle(stream, cache)
        except InputError:  # refused or malformed: list what its opcodes name anyway, from a bounded prefix
            stream.seek(start)
            data = stream.read(_UNCHECKED_PICKLE_BYTES)
            data = data[: _pickle_end(data, 0)]
            stream.seek(start + len(data))
        blobs.append((label if index == 0 else f"{label} (after STOP, pickle {index + 1})", data))
        if not data:
            break
    return blobs


def _pickle_blobs(path: Path, cache: pickles.GuardCache) -> tuple[str, list[tuple[str, bytes]]]:
    """The pickles inside a file: zip members ending .pkl, or a stream of consecutive pickles."""
    with open(path, "rb") as handle:
        head = handle.read(16)
        if not head:
            raise InputError("is empty (0 bytes) — the save or download did not finish", path=path)
        if head.startswith(b"PK\x03\x04"):
            blobs = _zip_pickles(path, handle, cache)
            if any(name.endswith("/constants.pkl") for name, _ in blobs):
                return "torchscript", blobs
            return "torch-zip", blobs
        if safetensors.looks_like_safetensors(head):
            return "safetensors", []
        handle.seek(0)
        # a legacy checkpoint is five pickles then raw bytes; a plain pickle file is one
        blobs = _split_pickles(handle, "pickle", 5, cache)
    return "pickle", [(f"pickle {index}", data) for index, (_, data) in enumerate(blobs)]


LOADED_MARK = " (the data.pkl torch reads)"


def _is_pickle_member(member: zipio.Member, head: bytes) -> bool:
    """Whether scan reads a zip member as a pickle: any ``.pkl`` (in any case, anywhere), or any member
    outside a ``data/`` folder of storages that opens with a protocol 2–5 pickle header."""
    name = zipio.fold_name(member.name)
    if name.endswith(".pkl"):
        return True
    in_storages = "/data/" in f"/{name}"  # storage bytes are data, never unpickled by torch
    return not in_storages and len(head) == 2 and head[0] == 0x80 and 2 <= head[1] <= 5


def _zip_pickles(path: Path, handle: Any, cache: pickles.GuardCache) -> list[tuple[str, bytes]]:
    """Every pickle member of a zip, located as torch's reader locates members, whatever its name.

    Nothing about the archive's structure stops the scan: a member torch would run is read even
    where loading refuses the archive (overlapping members), and members of one name are each
    read, labelled by their place in the directory (and the one a load reads marked as such).
    """
    listing = zipio.list_members(path, handle)
    counts = Counter(member.name for member in listing.members)
    seen: Counter = Counter()
    blobs: list[tuple[str, bytes]] = []
    top = listing.members[0].name.split("/", 1)[0] if listing.members else ""
    try:
        loaded = zipio.Members(path, listing.members).get(f"{top}/data.pkl")  # the one a load reads
    except InputError:  # too many members to tell which duplicate: every one is run dry
        loaded = None
    for member in listing.members:
        seen[member.name] += 1
        label = member.name if counts[member.name] == 1 else \
            f"{member.name} (member {seen[member.name]} of {counts[member.name]} so named)"
        if member is loaded:
            label += LOADED_MARK
        if member.encrypted:
            continue  # its plaintext cannot be read; torch cannot read it either
        handle.seek(member.data_offset)
        head = handle.read(2) if not member.compressed else b""
        if not _is_pickle_member(member, head):
            continue
        try:
            data = zipio.read_member(path, handle, member, limit=pickles.MAX_PICKLE_BYTES)
        except InputError:
            continue  # unreadable: the load (and its one-line refusal) speaks for it
        blobs += _split_pickles(io.BytesIO(data), label, 5, cache)
    return blobs


def _pickle_end(data: bytes, offset: int) -> int:
    try:
        for opcode, _, position in pickletools.genops(io.BytesIO(data[offset:])):
            if opcode.name == "STOP":
                return offset + position + 1
    except Exception:
        pass
    return len(data)


def scan(path: Path | str, *, allow_globals: tuple[str, ...] = ()) -> ScanReport:
    """List a checkpoint's pickle globals and opcodes and judge them, running nothing.

    Raises:
        InputError: the file is missing, unreadable, or holds no pickle to judge.

    Example:
        >>> report = ckptool.scan("model.pt")      # doctest: +SKIP
        >>> report.safe, report.unsafe              # doctest: +SKIP
        (True, [])
    """
    path = Path(path)
    if not path.exists():
        raise InputError("does not exist — check the path", path=path)
    is_dir = path.is_dir()
    if not is_dir and not path.is_file():  # opening a FIFO would wait forever for a writer
        raise UnsupportedFormatError("is not a regular file (a FIFO, socket or device) — not a checkpoint", path=path)
    if is_dir:
        from .formats import dcp
    if is_dir and not dcp.is_dcp(path):
        from .reader import load

        checkpoint = load(path, allow_globals=allow_globals)
        return ScanReport(path=str(path), format=checkpoint.format, safe=True, unsafe=[], globals={}, opcodes={},
                          pickles=[])
    cache = pickles.GuardCache()  # the pickles this scan walked: its load and dry runs walk none again
    try:
        kind, blobs = ("dcp", dcp.pickle_blobs(path, allow_globals, cache)) if is_dir else _pickle_blobs(path, cache)
    except PermissionError as e:
        raise InputError("cannot be read: permission denied — check the file's permissions", path=path) from e
    except OSError as e:
        raise InputError(f"cannot be read ({e.strerror})", path=path) from e
    resolver = pickles.GlobalResolver(allow_globals)
    if kind == "dcp":  # DCP's metadata classes are read as inert placeholders too
        resolver = dcp.MetadataResolver(resolver)
    from .reader import load

    globals_: Counter = Counter()
    opcodes: Counter = Counter()
    problems: list[str] = []
    static_names: list[str] = []
    for _, data in blobs:
        try:  # the guard walked every pickle it passed already (read_pickle); its record is kept
            stats = pickles.guard_stats(data, cache)
            opcodes.update(stats.opcode_names())
            static_names += stats.globals
        except InputError:  # refused: list what its opcodes name anyway
            static, ops, _ = static_globals(data)
            opcodes.update(ops)
            static_names += static
    try:
        # a restricted load names exactly the globals it resolves; if it succeeds, no dry run of what it read
        checkpoint = load(path, allow_globals=allow_globals, guard_cache=cache)
        globals_.update(checkpoint.globals)
        load_error: CkptError | None = None
        # the pickles the load did not read (a zip's other .pkl members) are still run dry
        is_zip = kind in ("torch-zip", "torchscript")
        unread = [(name, data) for name, data in blobs if is_zip and not name.endswith(LOADED_MARK)]
    except CkptError as e:
        load_error = e
        unread = blobs
    for name, data in unread:
        dynamic, dynamic_error = dry_run_globals(data, allow_globals, cache)
        globals_.update(dynamic)
        if dynamic_error and load_error is not None:
            problems.append(f"{name}: {dynamic_error}")
    for full_name in static_names:
        if full_name not in globals_:
            globals_[full_name] += 1
    unsafe = sorted(g for g in globals_ if not resolver.is_allowed(g))
    report = ScanReport(path=str(path), format=kind, safe=not unsafe, unsafe=unsafe,
                        globals=dict(sorted(globals_.items())), opcodes=dict(sorted(opcodes.items())),
                        pickles=[name for name, _ in blobs], problems=problems)
    if unsafe:
        return report
    if load_error is not None:
        # no dangerous global, but not a checkpoint ckptool can read: that is the answer
        raise load_error
    report.format = checkpoint.format
    return report
