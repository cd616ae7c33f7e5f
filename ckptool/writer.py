"""The one place ckptool writes checkpoints: atomically, and checked by content.

Every write goes to a temp file beside the output. While the bytes are copied, a thread computes
the expected content of every tensor — name, dtype, shape and a CRC32 of its bytes — taking the
CRC a zip archive already stores for a storage copied whole, and summing the source for the rest.
After the copy, the temp file is fsync'd in one thread while the main thread re-reads it through
the reader (structure and bytes) and sums it again. Only an exact match lets ``os.replace`` put it
in place; any difference deletes it and names the tensor.

Why CRC32 and not the sha256 fingerprint: the check guards against accidental change (a bug, a
bad disk), not an adversary, and two sha256 passes cost more than the whole durable copy
(sha256 runs at ~1 GB/s per core here; ``cp`` + ``sync`` of 1 GiB takes ~0.7 s). The sha256
fingerprint — the identity of the weights across formats — is computed on request
(``fingerprint=True``, ``--fingerprint``) alongside, and recorded in safetensors metadata.
"""

from __future__ import annotations

import json
import os
import queue
import re
import sys
import threading
import zlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from . import dtypes, layouts, suggest
from .atomic import TEMP_PREFIX, atomic_output, check_folder_output, check_output, folder_output, same_file
from .checkpoint import Checkpoint
from .errors import CkptError, FingerprintMismatchError, OutputError, UsageError
from .digest import PREFIX
from .digest import fingerprint as weights_fingerprint  # `save` has a parameter named fingerprint
from .formats import safetensors, torch_zip, zipio
from .refs import StorageRef, TensorRef, check_expansion
from .tree import map_tensors

# a path into a write's temp file or temp directory (atomic.TEMP_PREFIX), and what follows it inside
_TEMP_PATH = re.compile(r"[^\s'\"]*" + re.escape(TEMP_PREFIX) + r"[A-Za-z0-9_]+(?:\.part)?(/[^\s'\"]*)?")
PT_SUFFIXES = (".pt", ".pth", ".bin", ".ckpt", ".tar")
TARGETS = ("pt", "safetensors", "safetensors-sharded")
FINGERPRINT_KEY = "ckptool.fingerprint"
_FINGERPRINT_PLACEHOLDER = PREFIX + "0" * 64
# how a safetensors header written with a fingerprint begins (safetensors.write_file puts the metadata first)
_FINGERPRINT_SLOT = ('{"__metadata__":{' + json.dumps(FINGERPRINT_KEY) + ':"').encode()


@dataclass
class SaveReport:
    """What a save wrote: the output, its format, files, tensors, and the content check passed.

    ``fingerprint`` is the sha256 fingerprint of the written weights when it was asked for, else None.
    """

    path: Path
    format: str
    files: list[Path]
    tensors: int = 0
    bytes: int = 0
    fingerprint: str | None = None
    checked: int = 0
    aliases: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class TensorCheck:
    """What must read back for one tensor: dtype, shape and the CRC32 of its C-order bytes.

    ``recorded``: the CRC is the one the source archive recorded, not one summed from its bytes.
    torch never checks those (a file saved with CRCs off records 0; one written through ``skip_data``
    or patched later records stale ones), so a mismatch on a recorded CRC is settled by summing the
    source's bytes.

    For a view that expands its storage (stride 0, overlaps) written to a ``.pt`` — where the
    storage is copied raw, not expanded — the CRC is that of the storage bytes it spans, and
    ``view`` holds its offset and strides, which must read back the same.
    """

    dtype: str
    shape: tuple[int, ...]
    crc32: int
    view: tuple | None = None
    recorded: bool = field(default=False, compare=False)


class _StaleSourceCrc(Exception):
    """The source archive recorded CRCs that are not its bytes', and a .pt output copied them."""


def _stored_crc(tensor: TensorRef) -> int | None:
    """The CRC a zip archive recorded for the tensor's bytes, when the tensor is its whole storage
    (or, for a storage lying in pieces — DCP row shards — combined from the pieces' recorded CRCs)."""
    if tensor.conj or tensor.neg:
        return None  # the archive's CRC is of the stored bytes, not of the values
    pieces = tensor.whole_pieces()
    if pieces is not None:
        return zipio.pieces_crc(pieces)
    storage = tensor.storage
    data = storage.data
    if storage.producer is not None or data is None or data.crc32 is None or not tensor.is_contiguous():
        return None
    if tensor.offset != 0 or tensor.nbytes != data.length:
        return None
    return data.crc32


class OutputSums:
    """CRC32s of the output's data regions, summed by a worker thread right behind the writer.

    The writer reports each region once it is in the file; the worker reads it back (from the page
    cache) while the next one is copied, so the re-read costs no extra pass after the copy.
    Writeback starts as the data comes: every ``KICK_EVERY`` bytes are handed to the disk with
    ``sync_file_range(SYNC_FILE_RANGE_WRITE)`` (Linux; it does not wait), so the final fsync has
    little left to wait for — a durable write then costs about the copy, not the copy plus the
    flush. Elsewhere a thread calls ``fdatasync`` every ``FLUSH_EVERY`` bytes instead.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self.sums: dict[int, tuple[int, int]] = {}  # region offset -> (length, CRC32)
        self._queue: queue.SimpleQueue[tuple[int, int] | None] = queue.SimpleQueue()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        self._unflushed = 0
        self._done = False
        self._kick = _writeback_starter()
        self._kicked = self._end = 0
        self._fd = -1
        self._flusher: threading.Thread | None = None
        self._flush_wanted = threading.Event()
        if self._kick is not None:
            try:
                self._fd = os.open(self.path, os.O_RDONLY)
            except OSError:
                self._kick = None
        if self._kick is None:
            self._flusher = threading.Thread(target=self._flush_loop, daemon=True)
            self._flusher.start()

    def written(self, offset: int, length: int) -> None:
        self._queue.put((offset, length))
        if self._kick is not None:
            self._end = max(self._end, offset + length)
            if self._end - self._kicked >= KICK_EVERY:
                self._start_writeback()
            return
        self._unflushed += length
        if self._unflushed >= FLUSH_EVERY:
            self._unflushed = 0
            self._flush_wanted.set()

    def _start_writeback(self) -> None:
        if self._kick is not None and self._end > self._kicked:
            # a failure here only loses the head start: the final fsync reports real errors
            self._kick(self._fd, self._kicked, self._end - self._kicked, _SYNC_FILE_RANGE_WRITE)
            self._kicked = self._end

    def _flush_loop(self) -> None:
        try:
            fd = os.open(self.path, os.O_RDONLY)
        except OSError:
            return
        try:
            while True:
                self._flush_wanted.wait()
                self._flush_wanted.clear()
                if self._done:
                    return
                try:
                    os.fdatasync(fd)
                except OSError:  # the final fsync reports real errors
                    return
        finally:
            os.close(fd)

    def _run(self) -> None:
        buffer = bytearray(CHUNK)  # one buffer, reused: no allocation per read
        view = memoryview(buffer)
        with open(self.path, "rb", buffering=0) as handle:
            fd = handle.fileno()
            while (item := self._queue.get()) is not None:
                if self._error is not None:
                    continue
                offset, length = item
                try:
                    crc, done = 0, 0
                    while done < length:
                        n = _pread_into(fd, view[:min(CHUNK, length - done)], offset + done)
                        if not n:
                            break
                        crc = zlib.crc32(view[:n], crc)
                        done += n
                    self.sums[offset] = (length, crc)
                except OSError as e:  # re-read errors surface as a missing sum: the check re-reads itself
                    self._error = e

    def crc_of(self, offset: int, length: int) -> int | None:
        """The CRC32 of ``length`` bytes at ``offset``, from the regions summed end to end; None unless
        they cover exactly that span (a large copy is reported in steps: their CRCs are combined)."""
        if length == 0:
            return 0
        crc, position, end = 0, offset, offset + length
        while position < end:
            region = self.sums.get(position)
            if region is None or position + region[0] > end:
                return None
            crc = region[1] if position == offset else zipio.crc32_combine(crc, region[1], region[0])
            position += region[0]
        return crc

    def finish(self) -> dict[int, tuple[int, int]]:
        """Wait for every reported region to be summed (idempotent)."""
        self._start_writeback()
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join()
        if self._flusher is not None and self._flusher.is_alive():
            self._done = True
            self._flush_wanted.set()
            self._flusher.join()
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        return self.sums


_SYNC_FILE_RANGE_WRITE = 2


def _pread_into(fd: int, view: memoryview, offset: int) -> int:
    if hasattr(os, "preadv"):
        return os.preadv(fd, [view], offset)
    data = os.pread(fd, len(view), offset)  # platforms without preadv
    view[:len(data)] = data
    return len(data)


def _writeback_starter() -> Callable[[int, int, int, int], int] | None:
    """libc's ``sync_file_range`` where there is one (Linux), else None."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        import ctypes

        function = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    function.argtypes = [ctypes.c_int, ctypes.c_longlong, ctypes.c_longlong, ctypes.c_uint]
    function.restype = ctypes.c_int
    return function


CHUNK = 8 * 1024 * 1024
FLUSH_EVERY = 128 * 1024 * 1024
KICK_EVERY = 8 * 1024 * 1024


def _span_crc(tensor: TensorRef) -> int:
    """CRC32 of the storage bytes an expanding view spans (read once, never expanded)."""
    crc = 0
    data = tensor.storage.byte_range()
    for chunk in data.iter_reused(tensor.offset * tensor.dtype.itemsize, tensor.span_bytes()):
        crc = zlib.crc32(chunk, crc)
    return crc


def tensor_checks(tensors: Mapping[str, TensorRef], *, trust_stored: bool,
                  known: Callable[[str, int, int], int | None] | None = None,
                  views_raw: bool = False) -> dict[str, TensorCheck]:
    """The content of every tensor.

    ``trust_stored`` takes a source archive's own CRCs where they apply; ``known(path, offset, length)``
    gives CRCs of byte ranges already summed (by :class:`OutputSums`), or None. ``views_raw`` (a
    ``.pt`` output, whose storages are copied as they are) checks an expanding view by the bytes
    it spans and its strides, so a stride-0 view is never expanded to be summed.
    """
    checks: dict[str, TensorCheck] = {}
    by_storage: dict[tuple, int] = {}  # tied tensors are summed once
    for name, tensor in tensors.items():
        # a conjugate or negative view of a storage holds other values than the plain view
        identity = (id(tensor.storage), tensor.offset, tensor.shape, tensor.stride, tensor.dtype.name,
                    tensor.conj, tensor.neg)
        if views_raw and tensor.storage.producer is None and tensor.storage.pieces is None and tensor.expands():
            crc = by_storage.get(identity)
            if crc is None:
                crc = by_storage[identity] = _span_crc(tensor)
            checks[name] = TensorCheck(tensor.dtype.name, tuple(tensor.shape), crc, (tensor.offset, tensor.stride))
            continue
        crc = by_storage.get(identity)
        recorded = False
        if crc is None:
            crc = _stored_crc(tensor) if trust_stored else None
            recorded = crc is not None
        if crc is None and known:
            span = tensor.contiguous_byte_range()
            if span is not None:
                crc = known(str(span.path), span.offset, span.length)
        if crc is None:
            crc = 0
            for chunk in tensor.iter_reused():
                crc = zlib.crc32(chunk, crc)
        by_storage[identity] = crc
        checks[name] = TensorCheck(tensor.dtype.name, tuple(tensor.shape), crc, recorded=recorded)
    return checks


def suffix_format(out: Path) -> str | None:
    """The format a file name's suffix says: ``"safetensors"``, ``"pt"``, or None for another suffix."""
    suffix = out.suffix.lower()
    if suffix == ".safetensors":
        return "safetensors"
    return "pt" if suffix in PT_SUFFIXES else None


def rewrite_format(checkpoint: Checkpoint, out: Path | None, *, command: str) -> str:
    """The format a rewrite (strip, add-prefix, remap) writes: what the suffix of ``out`` says, so
    a file's name never lies about its content; the input's own format for a suffix ckptool does
    not know, or with no ``out`` (``--in-place``).

    Raises:
        UsageError: a ``.safetensors`` name for a rewrite that would have to drop what the input
            holds besides its weights (a rewrite keeps the whole container), or for ``remap``
            (safetensors has no device tags to rewrite).
    """
    own = "safetensors" if checkpoint.format.startswith("safetensors") else "pt"
    wanted = suffix_format(out) if out is not None else None
    if wanted is None or wanted == own:
        return own
    if wanted == "pt":
        return wanted  # the weights, as convert writes them: nothing a .pt cannot hold
    source = checkpoint.path
    if command == "remap":
        raise UsageError("is a safetensors name, and safetensors keeps no device tags to remap — write .pt, or "
                         f"drop the tags with: {suggest.command('convert', source, out=out)}", path=out)
    extra = [repr(key) for key in checkpoint.entries()]
    if checkpoint.has_weights:
        extra += [repr(key) for key, value in checkpoint.state_dict.items() if not isinstance(value, TensorRef)]
    if checkpoint.layout is None or extra:
        shown = ", ".join(extra[:4]) + (", ..." if len(extra) > 4 else "")
        hint = (suggest.command("convert", source, out=out, strip=True) if command == "strip" else
                f"{suggest.command(command, source, out='OUT.pt')}, then {suggest.command('convert', 'OUT.pt', out=out)}")
        raise UsageError(f"is a safetensors name, which holds weights only, but {source} also holds "
                         f"{shown or 'no weights'}, which {command} keeps — write .pt, or keep just the weights: {hint}",
                         path=out)
    return wanted


def target_format(out: Path, to: str | None, max_shard_size: int | None) -> str:
    """Choose the output format from ``--to``, the suffix, or a directory."""
    if to is not None:
        if to not in ("pt", "safetensors"):
            raise UsageError(f"--to {to!r}: choose pt or safetensors")
        named = suffix_format(out)
        if named is not None and named != to:
            raise UsageError(f"--to {to} contradicts the name {out.name} — drop --to, or name the output "
                             f"{out.stem}{'.pt' if to == 'pt' else '.safetensors'}")
        if to == "safetensors" and (max_shard_size is not None or out.is_dir() or not out.suffix):
            return "safetensors-sharded" if max_shard_size is not None or out.is_dir() else "safetensors"
        return to
    if suffix_format(out) == "safetensors":
        return "safetensors-sharded" if max_shard_size is not None else "safetensors"
    if suffix_format(out) == "pt":
        if max_shard_size is not None:
            raise UsageError("--max-shard-size applies to safetensors output — write to a directory or .safetensors")
        return "pt"
    if out.is_dir() or not out.suffix:
        return "safetensors-sharded"
    raise UsageError(f"cannot tell the format from {out.name!r} — use .pt, .safetensors or a directory, or pass --to")


def plan_outputs(sources: list[Path] | tuple[Path, ...], out_dir: Path, to: str | None) -> list[tuple[Path, Path]]:
    """Every ``(input, output)`` of a many-input conversion into ``out_dir``, planned before any is written.

    An output keeps its input's name up to the first dot, with the suffix of ``to`` (safetensors
    by default).

    Raises:
        UsageError: ``out_dir`` is not an existing directory.
        OutputError: two inputs would be written to one output (refused even with ``--force``:
            the second write would destroy the first, or the first an input the second reads).
    """
    if not out_dir.is_dir():
        raise UsageError(f"--out-dir {out_dir} is not an existing directory — create it first")
    suffix = ".pt" if to == "pt" else ".safetensors"
    jobs = [(Path(source), out_dir / (Path(source).name.split(".")[0] + suffix)) for source in sources]
    by_output: dict[str, Path] = {}
    for source, target in jobs:
        key = os.path.normcase(os.path.abspath(target))
        if key in by_output:
            other = by_output[key]
            if _same_path(other, source):
                raise OutputError(f"input {source} is given twice — nothing was written; give each input once",
                                  path=target)
            raise OutputError(f"{other} and {source} would both be written here — nothing was written; convert "
                              "them into separate --out-dir folders", path=target)
        by_output[key] = source
    return jobs


def _same_path(a: Path, b: Path) -> bool:
    if os.path.lexists(a) and os.path.lexists(b):
        return same_file(a, b)
    return os.path.normcase(os.path.abspath(a)) == os.path.normcase(os.path.abspath(b))


def _run_in_thread(fn: Callable[[], Any]) -> Callable[[], Any]:
    result: dict[str, Any] = {}

    def target() -> None:
        try:
            result["value"] = fn()
        except BaseException as e:  # re-raised in the caller's thread
            result["error"] = e

    thread = threading.Thread(target=target, daemon=True)
    thread.start()

    def join() -> Any:
        thread.join()
        if "error" in result:
            raise result["error"]
        return result["value"]

    return join


def _verify(written: Path, expected_join: Callable[[], dict[str, TensorCheck]],
            read_back: Callable[[Path], Mapping[str, TensorRef]], sync: Callable[[], None],
            sums: list[OutputSums] | None = None, recheck: Callable[[str], TensorCheck] | None = None, *,
            views_raw: bool = False) -> int:
    """Re-read ``written`` (while ``sync`` runs) and compare every tensor with the expectation.

    The structure (names, dtypes, shapes, where the bytes lie) is re-read through the reader; the
    bytes' CRCs come from ``sums`` where the worker already read that exact region back, else from
    reading it now.
    """
    sync_join = _run_in_thread(sync)
    try:
        by_path: dict[str, OutputSums] = {}
        for output_sums in sums or []:
            output_sums.finish()
            by_path[str(output_sums.path)] = output_sums

        def known(path: str, offset: int, length: int) -> int | None:
            output_sums = by_path.get(path)
            return output_sums.crc_of(offset, length) if output_sums is not None else None

        written_tensors = read_back(written)
        actual = tensor_checks(written_tensors, trust_stored=False, known=known, views_raw=views_raw)
    finally:
        sync_join()
    expected = expected_join()
    if actual.keys() != expected.keys():
        missing = sorted(expected.keys() - actual.keys())
        extra = sorted(actual.keys() - expected.keys())
        raise FingerprintMismatchError(
            f"the output reads back with other tensor names (missing {missing[:3]}, extra {extra[:3]}) — "
            "it was deleted; nothing changed"
        )
    stale = []
    for name, check in expected.items():
        if actual[name] != check:
            if check.recorded and recheck is not None and recheck(name) == actual[name]:
                stale.append(name)  # the source's recorded CRC was stale; its bytes are what was written
                continue
            raise FingerprintMismatchError(
                f"tensor {name!r} reads back different from what was written ({actual[name]} != {check}) — "
                "the output was deleted; check the disk and try again"
            )
    for name, tensor in written_tensors.items():  # the CRC the output's zip records must be that of its bytes
        recorded = _stored_crc(tensor)
        if recorded is not None and recorded != actual[name].crc32:
            if stale:
                raise _StaleSourceCrc(stale)
            raise FingerprintMismatchError(
                f"tensor {name!r}: the CRC recorded in the output's zip ({recorded:08x}) is not that of the bytes "
                f"written ({actual[name].crc32:08x}) — the output was deleted; nothing changed")
    return len(actual)


def pt_container(checkpoint: Checkpoint, nest: str | None = None) -> Any:
    """The object to pickle for a .pt output: the container itself, or the weights for safetensors input."""
    if checkpoint.format.startswith("safetensors"):
        container: Any = dict(map_tensors(checkpoint.tensors, _typed_for_pickle()))
        return {nest: container} if nest else container
    if nest:
        raise UsageError("--nest applies to safetensors input; this checkpoint already has a container")
    return checkpoint.container


def _typed_for_pickle() -> Callable[[TensorRef], TensorRef]:
    """safetensors tensors as torch would pickle them (legacy typed storage, or untyped + dtype).

    Each storage is converted once, so tied tensors still share one storage in the output.
    """
    converted: dict[int, StorageRef] = {}

    def convert(tensor: TensorRef) -> TensorRef:
        storage = tensor.storage
        typed = bool(tensor.dtype.storage_class)
        if id(storage) not in converted:
            converted[id(storage)] = replace(storage, type_global=f"torch.{tensor.dtype.storage_class}") if typed \
                else replace(storage, dtype=dtypes.BY_NAME["U8"], numel=storage.nbytes,
                             type_global="torch.storage.UntypedStorage")
        rebuild = "torch._utils._rebuild_tensor_v2" if typed else "torch._utils._rebuild_tensor_v3"
        return replace(tensor, storage=converted[id(storage)], rebuild=rebuild)

    return convert


def _json_entries(checkpoint: Checkpoint) -> str | None:
    """The container's plain entries (epoch, config, metrics) as JSON, where they are JSON."""
    plain: dict[str, Any] = {}
    for key, value in checkpoint.entries().items():
        try:  # as it will be written: sorted keys fail on a dict mixing int and str keys
            json.dumps(value, allow_nan=False, sort_keys=True)
        except (TypeError, ValueError):
            continue
        plain[str(key)] = value
    return json.dumps(plain, allow_nan=False, sort_keys=True, separators=(",", ":")) if plain else None


def safetensors_metadata(checkpoint: Checkpoint, *, with_fingerprint: bool) -> dict[str, str]:
    metadata = {k: v for k, v in checkpoint.metadata.items() if not k.startswith("ckptool.")}
    metadata.setdefault("format", "pt")
    metadata["ckptool.source"] = checkpoint.path.name
    entries = _json_entries(checkpoint)
    if entries is not None:
        metadata["ckptool.entries"] = entries
    if with_fingerprint:
        # patched in once the hash is known (the header keeps its length); first in the header, so
        # its place is known exactly and no value of the user's is ever mistaken for it
        metadata = {FINGERPRINT_KEY: _FINGERPRINT_PLACEHOLDER, **metadata}
    return metadata


@dataclass
class _Expectations:
    """Work started before the copy: the content check, and the sha256 fingerprint if asked."""

    checks: Callable[[], dict[str, TensorCheck]]
    fingerprint: Callable[[], str | None]
    wants_fingerprint: bool
    recheck: Callable[[str], TensorCheck] | None = None  # a tensor's check summed from the source's bytes


def save(checkpoint: Checkpoint, out: Path | str, *, to: str | None = None, force: bool = False,
         in_place: bool = False, max_shard_size: int | None = None, duplicate_tied: bool = False,
         nest: str | None = None, fingerprint: bool = False, allow_expansion: bool = False) -> SaveReport:
    """Write ``checkpoint`` to ``out`` atomically and prove every tensor reads back unchanged.

    Args:
        checkpoint: what :func:`ckptool.load` returned, possibly transformed.
        out: a ``.pt``-like file, a ``.safetensors`` file, or a directory for sharded safetensors.
        to: ``"pt"`` or ``"safetensors"`` to override the suffix.
        force: overwrite an existing output.
        in_place: allow ``out`` to be the input (still via a temp file).
        max_shard_size: bytes per shard for sharded safetensors.
        duplicate_tied: store tied tensors as full copies instead of aliases.
        nest: wrap safetensors weights as ``{nest: weights}`` in a .pt output.
        fingerprint: also compute the sha256 fingerprint (reported; stored in safetensors metadata).
        allow_expansion: write out views that expand their storage (stride 0, overlaps) past
            :data:`ckptool.refs.EXPANSION_FACTOR` in full. A ``.pt`` output copies storages as
            they are and needs this only with ``fingerprint``.

    Raises:
        OutputError: exists without ``force``, is the input, or the disk refused the write.
        InputError: views would expand their storage too far (see ``allow_expansion``), or
            ``max_shard_size`` would make more than :data:`MAX_SHARDS` shards.
        FingerprintMismatchError: a tensor did not read back identical (the output is deleted).

    Example:
        >>> ckptool.save(ckptool.load("ddp.pt").strip_prefix(), "model.safetensors")  # doctest: +SKIP
    """
    out = Path(out)
    target = target_format(out, to, max_shard_size)
    inputs = tuple(checkpoint.files) + (checkpoint.path,)
    if target == "pt":
        tensors = checkpoint.tensors if checkpoint.has_weights else {}
    else:  # weights only: one without them is refused (state_dict says so); every refusal comes
        # before a thread reads the input or a byte is written, the layouts' before any of their
        # components is taken for a tensor
        layouts.refuse_for_safetensors(checkpoint.state_dict, out)
        _refuse_meta_tensors(checkpoint, out)
        tensors = checkpoint.tensors
        safetensors.check_dtypes(tensors, out=out)
    # a .pt output copies storages raw: only its fingerprint would stream the views in full
    views_raw = target == "pt"
    if not views_raw or fingerprint:
        check_expansion(tensors, allow=allow_expansion, path=checkpoint.path,
                        doing="write" if not views_raw else "fingerprint")
    plan: _ShardPlan | None = None
    if target == "safetensors-sharded":
        plan = _plan_shards(tensors, max_shard_size or safetensors.parse_size("5GB"), duplicate_tied, out,
                            checkpoint.path)
        check_folder_output(out, writes=plan.writes, removes=plan.removes, inputs=inputs, force=force,
                            in_place=in_place)
    else:
        check_output(out, inputs=inputs, force=force, in_place=in_place)
    expect = _Expectations(
        checks=_run_in_thread(lambda: tensor_checks(tensors, trust_stored=True, views_raw=views_raw)),
        fingerprint=_run_in_thread(lambda: weights_fingerprint(tensors, allow_expansion=True) if fingerprint else None),
        wants_fingerprint=fingerprint,
        recheck=lambda name: tensor_checks({name: tensors[name]}, trust_stored=False, views_raw=views_raw)[name],
    )
    try:
        if target == "pt":
            report = _save_pt(checkpoint, out, nest, expect)
        elif target == "safetensors":
            report = _save_safetensors(checkpoint, tensors, out, duplicate_tied, expect)
        else:
            assert plan is not None
            report = _save_sharded(checkpoint, out, plan, expect)
    except CkptError as e:
        if e.path is None or _TEMP_PATH.search(str(e.path)):
            # the temp file is an implementation detail: the user asked for `out`, name that
            raise type(e)(_TEMP_PATH.sub(lambda m: str(out) + (m.group(1) or ""), e.message), path=out) from e
        raise
    finally:
        for join in (expect.checks, expect.fingerprint):
            try:
                join()
            except BaseException:  # the write already failed or succeeded; its error is the one to report
                pass
    report.tensors = len(tensors)
    report.bytes = sum(t.nbytes for t in tensors.values())
    if checkpoint.format == "torch-legacy" and target == "pt":
        report.notes.append("the input used the legacy (pre-1.6) format; the output is in the zip format")
    return report


def _read_back(source: Checkpoint) -> Callable[[Path], Mapping[str, TensorRef]]:
    """A reader for the output that accepts the globals the input was read with."""

    def read(path: Path) -> Mapping[str, TensorRef]:
        from .reader import load

        written = load(path, allow_globals=tuple(source.globals))
        return written.tensors if written.has_weights else {}

    return read


def _save_pt(checkpoint: Checkpoint, out: Path, nest: str | None, expect: _Expectations) -> SaveReport:
    container = pt_container(checkpoint, nest)
    try:
        checked = _write_pt(container, out, expect, _read_back(checkpoint), trust_recorded=True)
    except _StaleSourceCrc:
        # the source recorded CRCs that are not its bytes' (saved with CRCs off, or patched after
        # saving; torch ignores them): write again, summing every storage instead of copying its CRC
        tensors = checkpoint.tensors if checkpoint.has_weights else {}
        expect = replace(expect, checks=_run_in_thread(lambda: tensor_checks(tensors, trust_stored=False,
                                                                             views_raw=True)))
        checked = _write_pt(container, out, expect, _read_back(checkpoint), trust_recorded=False)
    return SaveReport(path=out, format="torch-zip", files=[out], fingerprint=expect.fingerprint(), checked=checked)


def _write_pt(container: Any, out: Path, expect: _Expectations,
              read_back: Callable[[Path], Mapping[str, TensorRef]], *, trust_recorded: bool) -> int:
    with atomic_output(out) as (handle, tmp):
        sums = OutputSums(tmp)
        try:
            torch_zip.write(handle, container, archive_name=_archive_name(out), on_data=sums.written,
                            trust_recorded_crcs=trust_recorded)
            handle.flush()
        except BaseException:
            sums.finish()
            raise
        return _verify(tmp, expect.checks, read_back, lambda: os.fsync(handle.fileno()), [sums],
                       recheck=expect.recheck, views_raw=True)


def _archive_name(out: Path) -> str:
    # torch names the folder after the file; any name loads, so keep it simple and safe
    stem = out.name.split(".")[0]
    return stem if stem.isidentifier() else "archive"


def _patch_fingerprint(handle: Any, value: str) -> None:
    """Write ``value`` over the placeholder that opens the header's metadata (and nowhere else)."""
    handle.flush()
    handle.seek(8)
    slot = _FINGERPRINT_SLOT + _FINGERPRINT_PLACEHOLDER.encode()
    if handle.read(len(slot)) != slot or len(value) != len(_FINGERPRINT_PLACEHOLDER):
        raise FingerprintMismatchError("internal: the header does not open with the fingerprint's field")
    handle.seek(8 + len(_FINGERPRINT_SLOT))
    handle.write(value.encode())
    handle.flush()


def _refuse_meta_tensors(checkpoint: Checkpoint, out: Path) -> None:
    """A meta tensor among the weights (a shape and dtype, no values) has no place in safetensors;
    leaving it out would drop a weight silently."""
    names = [name for name, value in dict.items(checkpoint.state_dict)
             if getattr(value, "_global", "") == "torch._utils._rebuild_meta_tensor_no_storage"]
    if names:
        shown = ", ".join(repr(name) for name in names[:3]) + (", ..." if len(names) > 3 else "")
        raise OutputError(f"safetensors cannot hold meta tensors (a shape and dtype without values): {shown} — "
                          "write a .pt instead (--to pt), or leave these tensors out", path=out)


def _save_safetensors(checkpoint: Checkpoint, tensors: Mapping[str, TensorRef], out: Path, duplicate_tied: bool,
                      expect: _Expectations) -> SaveReport:
    metadata = safetensors_metadata(checkpoint, with_fingerprint=expect.wants_fingerprint)
    with atomic_output(out) as (handle, tmp):
        sums = OutputSums(tmp)
        try:
            aliases = safetensors.write_file(handle, tensors, metadata, duplicate_tied=duplicate_tied,
                                             on_data=sums.written)
        except BaseException:
            sums.finish()
            raise
        value = expect.fingerprint()
        if value:
            _patch_fingerprint(handle, value)
        checked = _verify(tmp, expect.checks, _read_back(checkpoint), lambda: os.fsync(handle.fileno()), [sums],
                          recheck=expect.recheck)
    return SaveReport(path=out, format="safetensors", files=[out], fingerprint=value, checked=checked, aliases=aliases)


@dataclass
class _ShardPlan:
    """A folder output, planned before anything is written: which tensors go to which shard file,
    the files it writes (shards, then the index) and the earlier set's shards it removes."""

    aliases: dict[str, str]
    stored: dict[str, TensorRef]
    shards: list[list[str]]
    names: list[str]
    removes: list[str]
    notes: list[str]

    @property
    def writes(self) -> list[str]:
        return [*self.names, safetensors.INDEX_NAME]


# Shards one write may make: each is a file, a header and a re-read; a few thousand is already a
# 10 TB checkpoint in 2 GB shards. ``--max-shard-size 1B`` over many tensors would make one per tensor.
MAX_SHARDS = 10_000


def _plan_shards(tensors: Mapping[str, TensorRef], max_shard_size: int, duplicate_tied: bool, out: Path,
                 source: Path) -> _ShardPlan:
    if max_shard_size < 1:
        raise UsageError(f"--max-shard-size must be at least 1 byte, not {max_shard_size}")
    aliases = {} if duplicate_tied else safetensors.plan_aliases(tensors)
    stored = {k: v for k, v in tensors.items() if k not in aliases}
    shards = safetensors.plan_shards(stored, max_shard_size)
    if len(shards) > MAX_SHARDS:
        floor = -(-sum(t.nbytes for t in stored.values()) // MAX_SHARDS)
        raise UsageError(f"--max-shard-size {max_shard_size} would make {len(shards)} shards, over the "
                         f"{MAX_SHARDS}-shard limit — pass a larger --max-shard-size (at least {floor} bytes)",
                         path=source)
    names = [safetensors.shard_file_name(index, len(shards)) for index in range(len(shards))]
    removes: list[str] = []
    notes: list[str] = []
    if out.is_dir():
        old_index = out / safetensors.INDEX_NAME
        if os.path.lexists(old_index):
            # the earlier set's shards, as its own index names them: nothing else is ever removed
            named = safetensors.shards_named_by(old_index)
            if named is None:
                notes.append(f"the earlier {safetensors.INDEX_NAME} could not be read: shards of the earlier set, "
                             "if any, were left in place")
            removes = [name for name in (named or []) if name not in names]
        single = out / "model.safetensors"
        if os.path.lexists(single):
            notes.append(f"{out} also holds model.safetensors, which loaders such as transformers read before the "
                         "index — remove it if it is an older copy")
    return _ShardPlan(aliases, stored, shards, names, removes, notes)


def _save_sharded(checkpoint: Checkpoint, out: Path, plan: _ShardPlan, expect: _Expectations) -> SaveReport:
    metadata = safetensors_metadata(checkpoint, with_fingerprint=expect.wants_fingerprint)
    # the container's entries go into the first shard only (the reader merges every shard's metadata):
    # a large config copied into thousands of headers would multiply it
    entries = metadata.pop("ckptool.entries", None)
    weight_map: dict[str, str] = {}
    files: list[Path] = []
    # shards and index are written into a temp folder, checked, then moved in: the index last
    with folder_output(out, last=safetensors.INDEX_NAME, remove=plan.removes) as tmp_dir:
        all_sums: list[OutputSums] = []
        for index, (name, names) in enumerate(zip(plan.names, plan.shards)):
            shard_tensors = {k: plan.stored[k] for k in names}
            # an alias lives in the shard that stores its target
            shard_aliases = {a: t for a, t in plan.aliases.items() if t in shard_tensors}
            shard_metadata = dict(metadata)
            if index == 0 and entries is not None:
                shard_metadata["ckptool.entries"] = entries
            if shard_aliases:
                shard_metadata[safetensors.ALIASES_KEY] = json.dumps(shard_aliases, sort_keys=True)
            with open(tmp_dir / name, "w+b") as handle:
                shard_sums = OutputSums(tmp_dir / name)  # its thread re-reads the file: created first
                all_sums.append(shard_sums)
                try:
                    safetensors._write_one(handle, shard_tensors, shard_metadata, on_data=shard_sums.written)
                finally:
                    # one shard's re-read thread and buffer at a time, however many shards there are
                    shard_sums.finish()
            weight_map.update({k: name for k in names})
            files.append(out / name)
        value = expect.fingerprint()
        if value:
            for name in files:
                with open(tmp_dir / name.name, "r+b") as handle:
                    _patch_fingerprint(handle, value)
        index_metadata: dict[str, Any] = {"total_size": sum(t.nbytes for t in plan.stored.values())}
        if value:
            index_metadata[FINGERPRINT_KEY] = value
        index = {"metadata": index_metadata, "weight_map": dict(sorted(weight_map.items()))}
        (tmp_dir / safetensors.INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
        checked = _verify(tmp_dir / safetensors.INDEX_NAME, expect.checks, _read_back(checkpoint), lambda: None,
                          all_sums, recheck=expect.recheck)
    report = SaveReport(path=out, format="safetensors-sharded", files=[out / safetensors.INDEX_NAME, *files],
                        fingerprint=value, checked=checked, aliases=plan.aliases, notes=list(plan.notes))
    if plan.removes:
        report.notes.append(f"removed {len(plan.removes)} shard(s) of the earlier set ({', '.join(plan.removes[:3])}"
                            f"{', ...' if len(plan.removes) > 3 else ''})")
    return report
