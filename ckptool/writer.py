"""The one place ckptool writes checkpoints: atomically, and checked by fingerprint.

Every write goes to a temp file beside the output. While the bytes are copied, another thread
hashes the source; after, the temp file is fsync'd while the main thread re-reads it through the
reader and hashes it again. Only equal fingerprints let ``os.replace`` put it in place.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from . import dtypes
from .atomic import atomic_directory, atomic_output, check_output
from .checkpoint import Checkpoint
from .errors import CkptError, FingerprintMismatchError, UsageError
from .fingerprint import PREFIX, fingerprint
from .formats import safetensors, torch_zip
from .refs import StorageRef, TensorRef
from .tree import map_tensors

PT_SUFFIXES = (".pt", ".pth", ".bin", ".ckpt", ".tar")
TARGETS = ("pt", "safetensors", "safetensors-sharded")
_FINGERPRINT_PLACEHOLDER = PREFIX + "0" * 64


@dataclass
class SaveReport:
    """What a save wrote: the output, its format, files, tensors and the checked fingerprint."""

    path: Path
    format: str
    files: list[Path]
    tensors: int
    bytes: int
    fingerprint: str
    aliases: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


def target_format(out: Path, to: str | None, max_shard_size: int | None) -> str:
    """Choose the output format from ``--to``, the suffix, or a directory."""
    if to is not None:
        if to not in ("pt", "safetensors"):
            raise UsageError(f"--to {to!r}: choose pt or safetensors")
        if to == "safetensors" and (max_shard_size is not None or out.is_dir() or not out.suffix):
            return "safetensors-sharded" if max_shard_size is not None or out.is_dir() else "safetensors"
        return to
    if out.suffix == ".safetensors":
        return "safetensors-sharded" if max_shard_size is not None else "safetensors"
    if out.suffix in PT_SUFFIXES:
        if max_shard_size is not None:
            raise UsageError("--max-shard-size applies to safetensors output — write to a directory or .safetensors")
        return "pt"
    if out.is_dir() or not out.suffix:
        return "safetensors-sharded"
    raise UsageError(f"cannot tell the format from {out.name!r} — use .pt, .safetensors or a directory, or pass --to")


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


def _verify(written: Path, expected: str, read_back: Callable[[Path], Mapping[str, TensorRef]], sync: Callable[[], None]) -> str:
    sync_join = _run_in_thread(sync)
    actual = fingerprint(read_back(written))
    sync_join()
    if actual != expected:
        raise FingerprintMismatchError(
            f"the written weights read back with fingerprint {actual[:23]}…, not {expected[:23]}… — "
            "the output was deleted; check the disk and try again"
        )
    return actual


def pt_container(checkpoint: Checkpoint, nest: str | None = None) -> Any:
    """The object to pickle for a .pt output: the container itself, or the weights for safetensors input."""
    if checkpoint.format.startswith("safetensors"):
        container: Any = dict(map_tensors(checkpoint.tensors, _typed_for_pickle))
        # ties survive as shared storages: map_tensors maps the shared StorageRef once per tensor,
        # so re-point tied tensors at one storage
        container = _retie_storages(checkpoint.tensors, container)
        return {nest: container} if nest else container
    if nest:
        raise UsageError("--nest applies to safetensors input; this checkpoint already has a container")
    return checkpoint.container


def _typed_for_pickle(tensor: TensorRef) -> TensorRef:
    """safetensors tensors as torch would pickle them (legacy typed storage, or untyped + dtype)."""
    storage = tensor.storage
    if tensor.dtype.storage_class:
        typed = replace(storage, type_global=f"torch.{tensor.dtype.storage_class}")
        return replace(tensor, storage=typed, rebuild="torch._utils._rebuild_tensor_v2")
    untyped = replace(storage, dtype=dtypes.BY_NAME["U8"], numel=storage.nbytes, type_global="torch.storage.UntypedStorage")
    return replace(tensor, storage=untyped, rebuild="torch._utils._rebuild_tensor_v3")


def _retie_storages(original: Mapping[str, TensorRef], converted: dict) -> dict:
    by_storage: dict[int, StorageRef] = {}
    for name, tensor in original.items():
        first = by_storage.setdefault(id(tensor.storage), converted[name].storage)
        converted[name] = replace(converted[name], storage=first)
    return converted


def _json_entries(checkpoint: Checkpoint) -> str | None:
    """The container's plain entries (epoch, config, metrics) as JSON, where they are JSON."""
    plain: dict[str, Any] = {}
    for key, value in checkpoint.entries().items():
        try:
            json.dumps(value, allow_nan=False)
        except (TypeError, ValueError):
            continue
        plain[str(key)] = value
    return json.dumps(plain, sort_keys=True, separators=(",", ":")) if plain else None


def safetensors_metadata(checkpoint: Checkpoint) -> dict[str, str]:
    metadata = {k: v for k, v in checkpoint.metadata.items() if not k.startswith("ckptool.")}
    metadata.setdefault("format", "pt")
    metadata["ckptool.source"] = checkpoint.path.name
    entries = _json_entries(checkpoint)
    if entries is not None:
        metadata["ckptool.entries"] = entries
    metadata["ckptool.fingerprint"] = _FINGERPRINT_PLACEHOLDER
    return metadata


def save(checkpoint: Checkpoint, out: Path | str, *, to: str | None = None, force: bool = False,
         in_place: bool = False, max_shard_size: int | None = None, duplicate_tied: bool = False,
         nest: str | None = None) -> SaveReport:
    """Write ``checkpoint`` to ``out`` atomically and prove the weights read back unchanged.

    Args:
        checkpoint: what :func:`ckptool.load` returned, possibly transformed.
        out: a ``.pt``-like file, a ``.safetensors`` file, or a directory for sharded safetensors.
        to: ``"pt"`` or ``"safetensors"`` to override the suffix.
        force: overwrite an existing output.
        in_place: allow ``out`` to be the input (still via a temp file).
        max_shard_size: bytes per shard for sharded safetensors.
        duplicate_tied: store tied tensors as full copies instead of aliases.
        nest: wrap safetensors weights as ``{nest: weights}`` in a .pt output.

    Raises:
        OutputError: exists without ``force``, is the input, or the disk refused the write.
        FingerprintMismatchError: the output did not read back identical (it is deleted).

    Example:
        >>> ckptool.save(ckptool.load("ddp.pt").strip_prefix(), "model.safetensors")  # doctest: +SKIP
    """
    out = Path(out)
    target = target_format(out, to, max_shard_size)
    check_output(out, inputs=tuple(checkpoint.files) + (checkpoint.path,), force=force, in_place=in_place)
    tensors = checkpoint.tensors if checkpoint.has_weights else {}
    expected_join = _run_in_thread(lambda: fingerprint(tensors))
    try:
        if target == "pt":
            report = _save_pt(checkpoint, out, nest, expected_join)
        elif target == "safetensors":
            report = _save_safetensors(checkpoint, out, duplicate_tied, expected_join)
        else:
            report = _save_sharded(checkpoint, out, max_shard_size or safetensors.parse_size("5GB"), duplicate_tied,
                                   expected_join)
    except CkptError as e:
        if e.path is None:
            raise type(e)(e.message, path=out) from e
        raise
    finally:
        try:
            expected_join()
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


def _save_pt(checkpoint: Checkpoint, out: Path, nest: str | None, expected_join: Callable[[], str]) -> SaveReport:
    container = pt_container(checkpoint, nest)
    with atomic_output(out) as (handle, tmp):
        torch_zip.write(handle, container, archive_name=_archive_name(out))
        handle.flush()
        expected = expected_join()
        _verify(tmp, expected, _read_back(checkpoint), lambda: os.fsync(handle.fileno()))
    return SaveReport(path=out, format="torch-zip", files=[out], tensors=0, bytes=0, fingerprint=expected)


def _archive_name(out: Path) -> str:
    # torch names the folder after the file; any name loads, so keep it simple and safe
    stem = out.name.split(".")[0]
    return stem if stem.isidentifier() else "archive"


def _patch_fingerprint(handle, value: str) -> None:
    handle.flush()
    handle.seek(0)
    head = handle.read(8)
    length = int.from_bytes(head, "little")
    header = handle.read(length)
    position = header.find(_FINGERPRINT_PLACEHOLDER.encode())
    if position < 0:
        raise FingerprintMismatchError("internal: fingerprint placeholder missing from the header")
    handle.seek(8 + position)
    handle.write(value.encode())
    handle.flush()


def _save_safetensors(checkpoint: Checkpoint, out: Path, duplicate_tied: bool,
                      expected_join: Callable[[], str]) -> SaveReport:
    tensors = checkpoint.tensors
    metadata = safetensors_metadata(checkpoint)
    with atomic_output(out) as (handle, tmp):
        aliases = safetensors.write_file(handle, tensors, metadata, duplicate_tied=duplicate_tied)
        expected = expected_join()
        _patch_fingerprint(handle, expected)
        _verify(tmp, expected, _read_back(checkpoint), lambda: os.fsync(handle.fileno()))
    return SaveReport(path=out, format="safetensors", files=[out], tensors=0, bytes=0, fingerprint=expected,
                      aliases=aliases)


def _save_sharded(checkpoint: Checkpoint, out: Path, max_shard_size: int, duplicate_tied: bool,
                  expected_join: Callable[[], str]) -> SaveReport:
    tensors = checkpoint.tensors
    aliases = {} if duplicate_tied else safetensors.plan_aliases(tensors)
    stored = {k: v for k, v in tensors.items() if k not in aliases}
    shards = safetensors.plan_shards(stored, max_shard_size)
    metadata = safetensors_metadata(checkpoint)
    weight_map: dict[str, str] = {}
    files: list[Path] = []
    with atomic_directory(out) as tmp_dir:
        handles = []
        for index, names in enumerate(shards):
            name = safetensors.shard_file_name(index, len(shards))
            shard_tensors = {k: stored[k] for k in names}
            # an alias lives in the shard that stores its target
            shard_aliases = {a: t for a, t in aliases.items() if t in shard_tensors}
            shard_metadata = dict(metadata)
            if shard_aliases:
                shard_metadata[safetensors.ALIASES_KEY] = json.dumps(shard_aliases, sort_keys=True)
            handle = open(tmp_dir / name, "w+b")
            handles.append(handle)
            safetensors._write_one(handle, shard_tensors, shard_metadata)
            weight_map.update({k: name for k in names})
            files.append(out / name)
        expected = expected_join()
        for handle in handles:
            _patch_fingerprint(handle, expected)
            handle.close()
        index = {"metadata": {"total_size": sum(t.nbytes for t in stored.values()), "ckptool.fingerprint": expected},
                 "weight_map": dict(sorted(weight_map.items()))}
        (tmp_dir / safetensors.INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
        _verify(tmp_dir / safetensors.INDEX_NAME, expected, _read_back(checkpoint), lambda: None)
    return SaveReport(path=out, format="safetensors-sharded", files=[out / safetensors.INDEX_NAME, *files], tensors=0,
                      bytes=0, fingerprint=expected, aliases=aliases)
