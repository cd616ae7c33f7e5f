"""scan: every global and opcode a checkpoint's pickles use, found without executing anything.

Two passes per pickle. A static pass lists the opcodes and the globals they name: the guard's
record of the pickle (:func:`ckptool.pickles.guard_stats`, ``STACK_GLOBAL`` operands resolved
through its stack and memo), or ``pickletools.genops`` over a pickle the guard refused. Then a
restricted load; only if it fails, a dry run feeds the pickle to the restricted unpickler in
permissive mode, where every global becomes an inert placeholder — so the globals a real load
would import are listed exactly, even when hidden behind memo tricks.
Three verdicts, per global and for the file: *safe* when every global is on the allowlist ckptool
loads with (``--allow-global`` names and patterns included); *dangerous* when one is known to run
code or reach the system (:func:`ckptool.pickles.runs_code`: ``os.system``, ``builtins.eval``) —
even when named exactly to ``--allow-global``, which reads it as inert data but cannot make
``torch.load`` of the file harmless; *unknown* otherwise (a framework's own classes: building them
runs that package's code, so they need trust, not alarm). :func:`ckptool.pickles.refusal.refusal` words a
load's refusal.
"""

from __future__ import annotations

import io
import pickletools
from collections import Counter
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

from ckptool import formats, pickles
from ckptool.base.errors import CkptError, InputError, NotACheckpointError, UnsupportedFormatError
from ckptool.files import inputs
from ckptool.files.byteio import learnt_size, use_storage_options
from ckptool.files.inputs import located
from ckptool.formats import npy
from ckptool.tensors import dtypes
from ckptool.tensors.refs import StorageRef

# what a converted object of a package runs, for scan's note
_CONVERTED_CODE = {
    "omegaconf": "omegaconf resolves its interpolations, running the resolvers the loading program "
    "registered: ${oc.env:...} reads the environment, an eval resolver runs any code"
}
_STRING_OPS = {"SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8", "UNICODE", "STRING", "BINSTRING", "SHORT_BINSTRING"}


PLAIN_NOTE = "not a checkpoint ckptool loads, but safe to unpickle"
NPZ_NOTE = "an archive of numpy arrays (no checkpoint ckptool loads): its object arrays judged"


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
    dangerous: list[str] = field(default_factory=list)  # of ``unsafe``, those known to run code
    verdict: str = ""  # the file's: "safe", "unknown" or "dangerous"
    verdicts: dict[str, str] = field(default_factory=dict)  # each global's: "allowed", "unknown" or "dangerous"
    readable: bool = False  # whether ckptool reads the file with these flags (a TorchScript archive: no flag needed)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


SAFE, UNKNOWN, DANGEROUS, ALLOWED = "safe", "unknown", "dangerous", "allowed"


def global_verdict(full_name: str, resolver: pickles.GlobalResolver) -> str:
    """One global's verdict: ``dangerous`` when it is known to run code or reach the system (whatever
    the flags: an exact ``--allow-global`` reads it inert, but ``torch.load`` would still call it),
    else ``allowed`` when the read's allowlist accepts it, else ``unknown``."""
    if pickles.runs_code(full_name) or full_name in resolver.called_on:
        return DANGEROUS
    return ALLOWED if resolver.is_allowed(full_name) else UNKNOWN


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
            if len(found) >= pickles.limits.MAX_GLOBALS:  # the guard refused it for that: the rest would only flood
                error = f"names over {pickles.limits.MAX_GLOBALS} globals: the first ones are listed"
                break
            if name in ("GLOBAL", "INST"):
                found.append(str(arg).replace(" ", ".", 1))
            elif name == "STACK_GLOBAL":
                if len(strings) >= 2:
                    found.append(f"{strings[-2]}.{strings[-1]}")
                else:
                    found.append("<unresolved STACK_GLOBAL>")
            elif name in _STRING_OPS:
                strings.append(arg.decode("latin1") if isinstance(arg, bytes) else str(arg))
            elif name in ("BINPUT", "LONG_BINPUT", "PUT") and strings and isinstance(arg, int):  # genops: an int
                memo[arg] = strings[-1]
            elif name == "MEMOIZE" and strings:
                memo[len(memo)] = strings[-1]
            elif name in ("BINGET", "LONG_BINGET", "GET") and isinstance(arg, int) and arg in memo:
                strings.append(memo[arg])
    except Exception as e:  # genops raises ValueError and friends on malformed input
        error = f"{type(e).__name__}: {str(e)[:120]}"
    return found, opcodes, error


def dry_run_globals(
    data: bytes,
    allow_globals: tuple[str, ...],
    guard_cache: pickles.GuardCache | None = None,
    called_on: dict[str, str] | None = None,
) -> tuple[dict[str, int], str | None]:
    """Globals a load would import, found by unpickling with inert placeholders for everything; the data
    classes a call converts while unpickling go into ``called_on`` (class -> call)."""
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
        error = ", ".join(e.names)
    if called_on is not None:
        called_on.update(resolver.called_on)
    return dict(resolver.seen), error


def _pickles(path: Path, resolver: pickles.GlobalResolver) -> tuple[formats.Format | None, formats.Pickles]:
    """The format that claims a file and the pickles in it, read as its format lists them."""
    with inputs.open_regular(path, size=learnt_size(path)) as handle:
        head = handle.read(64)
        if not head:
            raise InputError("is empty (0 bytes) — the save or download did not finish", path=path)
        fmt = formats.sniff(head, path)
        if fmt is None:  # no checkpoint: the load names what it is; an array of objects is a pickle numpy.load runs
            return None, formats.Pickles("npy", _npy_pickles(handle, head, resolver)) if head.startswith(
                npy.MAGIC
            ) else formats.Pickles("", [])
        return fmt, fmt.scan_pickles(path, formats.ReadOptions(handle, head, resolver))


def _npy_pickles(handle: Any, head: bytes, resolver: pickles.GlobalResolver) -> list[formats.PickleBlob]:
    """The pickle of an ``.npy`` object array (``numpy.load(allow_pickle=True)`` runs it); none for another array."""
    from ckptool.formats import pickle_stream

    handle.seek(0)
    offset = npy.pickle_offset(handle.read(npy.HEAD_BYTES))
    if offset is None:
        return []
    handle.seek(offset)
    return [
        formats.PickleBlob(label, data, read_by_load=False)
        for label, data in pickle_stream.split_pickles(
            handle, "the array's objects (numpy.load with allow_pickle runs them)", 1, resolver.guard_cache
        )
    ]


def scan(
    path: Path | str,
    *,
    allow_globals: tuple[str, ...] | list[str] = (),
    storage_options: Mapping[str, Any] | None = None,
) -> ScanReport:
    """List a checkpoint's pickle globals and opcodes and judge them, running nothing.

    A file of another kind than a checkpoint whose pickles are plain (a pickle of data, a NumPy array or
    archive of arrays) is judged too: safe, its first note saying what it is, as a tree scan judges it.

    Raises:
        InputError: the file is missing, unreadable, a broken checkpoint, or holds no pickle to judge.

    Example:
        >>> report = ckptool.scan("model.pt")      # doctest: +SKIP
        >>> report.safe, report.unsafe              # doctest: +SKIP
        (True, [])
    """
    use_storage_options(storage_options)
    judged = accepted(judge(path, allow_globals=allow_globals))
    if judged.error is not None:
        raise judged.error
    return judged.report


class Judged(NamedTuple):
    """:func:`judge`'s answer: the report; the error of a load that failed although no global is
    outside the allowlist (:func:`scan` raises it); and whether a dry run stopped before a pickle's end."""

    report: ScanReport
    error: CkptError | None = None
    stopped: bool = False


def judge(path: Path | str, *, allow_globals: tuple[str, ...] | list[str] = ()) -> Judged:
    """:func:`scan`'s report, and the error of a load that failed although no global is outside the
    allowlist (which :func:`scan` raises: the input is no checkpoint ckptool reads). A tree scan
    tells a plain pickle judged safe (no dry run stopped early) from an unreadable file with it."""
    path, allow_globals = located(path), tuple(allow_globals)
    is_dir = _is_folder(path)
    if not is_dir and _is_npz(path):
        from ckptool.ops import scan_npz

        judged = judge_blobs(path, "npz", scan_npz.pickles(path), allow_globals)
        judged.report.problems.insert(0, NPZ_NOTE)
        return judged
    fmt = formats.sniff(None, path) if is_dir else None
    if is_dir and fmt is None:  # a folder of safetensors: nothing pickled
        return Judged(_unpickled_folder(path, allow_globals))
    cache = pickles.GuardCache()  # the pickles this scan walked: its load and dry runs walk none again
    fmt, found = _found_pickles(path, fmt, allow_globals, cache)
    blobs = found.blobs
    resolver = pickles.GlobalResolver(allow_globals)
    if fmt is not None and fmt.scan_resolver is not None:  # DCP's metadata classes are read as inert placeholders too
        resolver = fmt.scan_resolver(resolver)
    opcodes, static_names = _static_pass(blobs, cache)
    format_name, globals_, problems, load_error = _load_pass(path, blobs, allow_globals, cache, resolver.called_on)
    conversions = [
        f"the pickle calls {call} on an object of {class_name}: torch.load would run that class's code "
        f"while unpickling ({_CONVERTED_CODE.get(class_name.split('.')[0], 'its methods')})"
        for class_name, call in resolver.called_on.items()
    ]
    report = _report(
        path,
        found.kind,
        blobs,
        _Passes(opcodes, static_names, globals_, bool(problems)),
        resolver,
        problems=[*found.notes, *conversions, *problems],
        readable=load_error is None,
    )
    unsafe, verdicts = report.unsafe, report.verdicts
    by_file, unread = _by_file(blobs, verdicts, cache)
    report.problems += by_file
    report.readable = report.readable and not unread  # a folder's other file that a load never reads
    if unsafe:
        return Judged(report)
    if load_error is not None:
        # no dangerous global, but not a checkpoint ckptool can read: that is the answer
        return Judged(report, load_error, bool(problems))
    report.format = format_name
    return Judged(report)


def accepted(judged: Judged) -> Judged:
    """``judged`` as scan answers it: a file of another kind than a checkpoint (a plain pickle, an array),
    whose pickles (or plain array) were read to their end with no global outside the allowlist, is safe
    to unpickle, and its error becomes the report's first note; any other error is kept (a broken
    checkpoint, an unreadable file, or no pickle at all)."""
    error, report = judged.error, judged.report
    if error is None:
        return judged
    plain_array = report.format == "npy" and not report.pickles
    if judged.stopped or not isinstance(error, NotACheckpointError) or not (report.pickles or plain_array):
        return judged
    report.problems.insert(0, f"{PLAIN_NOTE}: {error.message}")
    return Judged(report)


def _is_npz(path: Path) -> bool:
    """Whether ``path`` is an ``.npz`` archive of arrays (its name, and a zip's first bytes)."""
    if not path.name.lower().endswith(".npz"):
        return False
    try:
        with inputs.open_regular(path) as handle:
            return handle.read(2) == b"PK"
    except (OSError, CkptError):
        return False  # the ordinary read names what is wrong


def _is_folder(path: Path) -> bool:
    """Whether the input ``path`` is a folder; refused when it is missing or, local, not a regular file."""
    remote = inputs.describe_remote(path)  # a URL: one request says whether it is there, and what
    if not (path.exists() if remote is None else remote.exists):
        raise InputError(
            "does not exist — check the path" if remote is None else "does not exist (404) — check the URL", path=path
        )
    is_dir = path.is_dir() if remote is None else remote.is_dir
    if not is_dir and remote is None and not path.is_file():  # opening a FIFO would wait forever for a writer
        raise UnsupportedFormatError("is not a regular file (a FIFO, socket or device) — not a checkpoint", path=path)
    return is_dir


def _unpickled_folder(path: Path, allow_globals: tuple[str, ...]) -> ScanReport:
    """The report on a folder of safetensors: read as a load reads it, with nothing pickled to judge."""
    from ckptool.io.reader import load

    checkpoint = load(path, allow_globals=allow_globals)
    return ScanReport(
        path=str(path),
        format=checkpoint.format,
        safe=True,
        unsafe=[],
        globals={},
        opcodes={},
        pickles=[],
        verdict=SAFE,
        readable=True,
    )


def _found_pickles(
    path: Path, fmt: formats.Format | None, allow_globals: tuple[str, ...], cache: pickles.GuardCache
) -> tuple[formats.Format | None, formats.Pickles]:
    """The pickles of ``path`` (a folder ``fmt`` claims, or a file sniffed here); an unreadable file is an
    InputError."""
    resolver = pickles.GlobalResolver(allow_globals, guard_cache=cache)
    try:
        if fmt is not None:
            return fmt, fmt.scan_pickles(path, formats.ReadOptions(None, b"", resolver))
        return _pickles(path, resolver)
    except PermissionError as e:
        raise InputError("cannot be read: permission denied — check the file's permissions", path=path) from e
    except OSError as e:
        raise InputError(f"cannot be read ({e.strerror})", path=path) from e


def _by_file(
    blobs: list[formats.PickleBlob], verdicts: dict[str, str], cache: pickles.GuardCache
) -> tuple[list[str], bool]:
    """For an input of several files (a training folder), which file names the globals outside the
    allowlist: one line per such file, with its verdict; and whether one of them is a file a load
    of the input does not read (its globals then need the flags even to be read as inert data)."""
    names: dict[str, list[str]] = {}
    unread = False
    for blob in blobs:
        if blob.file is None:
            continue
        _, found = _static_pass([blob], cache)
        names.setdefault(blob.file, [])
        outside = [name for name in found if verdicts.get(name, ALLOWED) != ALLOWED]
        names[blob.file] += [name for name in outside if name not in names[blob.file]]
        unread = unread or (bool(outside) and not blob.read_by_load)
    lines = []
    for file, unsafe in names.items():
        if unsafe:
            verdict = DANGEROUS if any(verdicts[name] == DANGEROUS for name in unsafe) else UNKNOWN
            lines.append(f"{file}: {verdict} ({', '.join(unsafe[:6])}{', ...' if len(unsafe) > 6 else ''})")
    return lines, unread


def _static_pass(blobs: list[formats.PickleBlob], cache: pickles.GuardCache) -> tuple[Counter, list[str]]:
    """The opcodes and the globals they name, of every pickle, without unpickling."""
    opcodes: Counter = Counter()
    static_names: list[str] = []
    for blob in blobs:
        data = blob.data
        try:  # the guard walked every pickle it passed already (read_pickle); its record is kept
            stats = pickles.guard_stats(data, cache)
            opcodes.update(stats.opcode_names())
            static_names += stats.globals
        except InputError:  # refused: list what its opcodes name anyway
            static, ops, _ = static_globals(data)
            opcodes.update(ops)
            static_names += static
            # and what CPython's unpickler reading it from a file would run (a frame's end that cuts an
            # argument makes it read other opcodes than those the bytes show: a disguise)
            view = pickles.file_reader_view(data)
            if view is not None:
                try:
                    static_names += pickles.guard_stats(view).globals
                except InputError:
                    static_names += static_globals(view)[0]
    return opcodes, static_names


def _load_pass(
    path: Path,
    blobs: list[formats.PickleBlob],
    allow_globals: tuple[str, ...],
    cache: pickles.GuardCache,
    called_on: dict[str, str],
) -> tuple[str, Counter, list[str], CkptError | None]:
    """The globals a restricted load resolves, and a dry run's of each pickle it did not read (with the
    data classes a call converts while unpickling, into ``called_on``).

    Returns the checkpoint's format (when the load succeeded), the globals, the dry runs'
    problems (kept only when the load failed) and the load's error.
    """
    from ckptool.io.reader import load

    globals_: Counter = Counter()
    problems: list[str] = []
    format_name = ""
    try:
        # a restricted load names exactly the globals it resolves; if it succeeds, no dry run of what it read
        checkpoint = load(path, allow_globals=allow_globals, guard_cache=cache)
        globals_.update(checkpoint.globals)
        format_name = checkpoint.format
        load_error: CkptError | None = None
        # the pickles the load did not read (a zip's other .pkl members) are still run dry; all of them where
        # a call may convert an object whose class's code it runs (an exactly allowed one is read all the same)
        unread = blobs if pickles.may_convert(checkpoint.globals) else [blob for blob in blobs if not blob.read_by_load]
    except CkptError as e:
        load_error = e
        unread = blobs
    for blob in unread:
        dynamic, dynamic_error = dry_run_globals(blob.data, allow_globals, cache, called_on)
        if load_error is not None or not blob.read_by_load:  # what the load read, it listed already
            globals_.update(dynamic)
        if dynamic_error and load_error is not None:
            problems.append(f"{blob.label}: {dynamic_error}")
    return format_name, globals_, problems, load_error


def judge_blobs(path: Path, kind: str, blobs: list[formats.PickleBlob], allow_globals: tuple[str, ...]) -> Judged:
    """The report on pickles no format reads (an ``.npz`` archive's object arrays, which ``numpy.load``
    with ``allow_pickle`` unpickles): their static globals and a dry run's, judged as :func:`scan` judges."""
    cache = pickles.GuardCache()
    resolver = pickles.GlobalResolver(allow_globals)
    opcodes, static_names = _static_pass(blobs, cache)
    globals_: Counter = Counter()
    problems: list[str] = []
    for blob in blobs:
        dynamic, error = dry_run_globals(blob.data, allow_globals, cache, resolver.called_on)
        globals_.update(dynamic)
        if error:
            problems.append(f"{blob.label}: {error}")
    passes = _Passes(opcodes, static_names, globals_, bool(problems))
    report = _report(path, kind, blobs, passes, resolver, problems=problems, readable=False)
    return Judged(report, None, bool(problems))


class _Passes(NamedTuple):
    """What a scan's passes found: the opcodes and globals named statically, the globals the reads
    resolved, and whether a read stopped before a pickle's end."""

    opcodes: Counter
    static_names: list[str]
    globals: Counter
    stopped: bool


def _report(
    path: Path,
    kind: str,
    blobs: list[formats.PickleBlob],
    passes: _Passes,
    resolver: pickles.GlobalResolver,
    *,
    problems: list[str],
    readable: bool,
) -> ScanReport:
    """The report on ``blobs``: every global the reads resolved, and those only the static pass saw,
    each judged (:func:`global_verdict`)."""
    globals_ = passes.globals
    for full_name in passes.static_names:
        # a getattr the reads judged by its calls (pickle's spelling of a nested name) is listed by
        # what it named; only a read that stopped early leaves it to the static pass
        if full_name not in globals_ and (
            passes.stopped or pickles.python3_name(full_name) != pickles.ATTRIBUTE_LOOKUP
        ):
            globals_[full_name] += 1
    verdicts = {name: global_verdict(name, resolver) for name in sorted(globals_)}
    unsafe = [name for name, verdict in verdicts.items() if verdict != ALLOWED]
    dangerous = [name for name in unsafe if verdicts[name] == DANGEROUS]
    return ScanReport(
        path=str(path),
        format=kind,
        safe=not unsafe,
        unsafe=unsafe,
        globals=dict(sorted(globals_.items())),
        opcodes=dict(sorted(passes.opcodes.items())),
        pickles=[blob.label for blob in blobs],
        problems=problems,
        dangerous=dangerous,
        verdict=DANGEROUS if dangerous else UNKNOWN if unsafe else SAFE,
        verdicts=verdicts,
        readable=readable,
    )
