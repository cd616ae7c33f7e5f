"""The one place ckptool writes checkpoints: atomically, and checked by content.

Every write goes to a temp file beside the output. While the bytes are copied, a thread computes
the expected content of every tensor — name, dtype, shape and a CRC32 of its bytes — taking the
CRC a zip archive already stores for a storage copied whole, and summing the source for the rest.
After the copy, the temp file is fsync'd in one thread while the main thread re-reads it through
the reader (structure and bytes) and sums it again. Only an exact match lets ``os.replace`` put it
in place; any difference deletes it and names the tensor. The check is :mod:`ckptool.io.write_check`
(one ``checked_output``/``checked_folder`` context around each write), the copying
:mod:`ckptool.files.copying`; this module chooses the format and plans the output.

Why CRC32 and not the sha256 fingerprint: the check guards against accidental change (a bug, a
bad disk), not an adversary, and two sha256 passes cost more than the whole durable copy
(sha256 runs at ~1 GB/s per core here; ``cp`` + ``sync`` of 1 GiB takes ~0.8 s). The sha256
fingerprint — the identity of the weights across formats — is computed on request
(``fingerprint=True``, ``--fingerprint``) alongside, and recorded in safetensors metadata.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from ckptool import formats, pickles
from ckptool.base import progress, suggest
from ckptool.base.errors import CkptError, FingerprintMismatchError, OutputError, UsageError
from ckptool.base.gcpause import paused
from ckptool.files.atomic import TEMP_PREFIX, check_folder_output, check_output
from ckptool.files.inputs import location
from ckptool.formats import safetensors, torch_zip
from ckptool.io.write_formats import plan_outputs, pt_container, rewrite_format, suffix_format, target_format
from ckptool.model.checkpoint import Checkpoint
from ckptool.pickles import layouts
from ckptool.tensors.digest import PREFIX
from ckptool.tensors.refs import TensorRef, check_expansion, total_nbytes

__all__ = ["SaveReport", "plan_outputs", "read_back", "rewrite_format", "save", "suffix_format", "target_format"]

# the content check moved to write_check; these names are imported from here too
if TYPE_CHECKING:
    from ckptool.files.remote import RemotePath
from ckptool.io.write_check import (
    Expectations,
    StaleSourceCrc,
    checked_folder,
    checked_output,
    run_in_thread,
    tensor_checks,
)

# a path into a write's temp file or temp directory (atomic.TEMP_PREFIX), and what follows it inside
_TEMP_PATH = re.compile(r"[^\s'\"]*" + re.escape(TEMP_PREFIX) + r"[A-Za-z0-9_]+(?:\.part)?(/[^\s'\"]*)?")
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
    dry_run: bool = False  # nothing was written: ``files`` are what would be, ``bytes`` the weights' bytes


def _json_entries(checkpoint: Checkpoint, notes: list[str] | None = None) -> str | None:
    """The container around the weights, encoded for safetensors metadata (:mod:`ckptool.formats.entries`);
    what the encoding cannot carry is named, by key path, in ``notes``."""
    from ckptool.formats import entries

    if not checkpoint.has_weights or not isinstance(checkpoint.layout, tuple):
        return None
    names = None
    if checkpoint.flattened:  # an optimizer's state: its tree goes along, each tensor by its name in the file
        names = {id(tensor): name for name, tensor in checkpoint.tensors.items()}
    text, dropped = entries.encode(checkpoint.container, checkpoint.layout, tensor_names=names)
    if notes is not None:
        notes.extend(dropped)
    return text


def safetensors_metadata(
    checkpoint: Checkpoint, *, with_fingerprint: bool, notes: list[str] | None = None
) -> dict[str, str]:
    """The metadata of a safetensors output: the input's own (ckptool's keys rewritten), the
    container's other entries (``ckptool.entries``; what they cannot carry is added to ``notes``)
    and the fingerprint's slot, first."""
    metadata = {k: v for k, v in checkpoint.metadata.items() if not k.startswith("ckptool.")}
    metadata.setdefault("format", "pt")
    metadata["ckptool.source"] = checkpoint.path.name
    entries = _json_entries(checkpoint, notes)
    if entries is None and checkpoint.layout == ():
        # an older ckptool's entries, which record no place for the weights: kept as they came
        entries = checkpoint.metadata.get("ckptool.entries")
    if entries is not None:
        metadata["ckptool.entries"] = entries
    if with_fingerprint:
        # patched in once the hash is known (the header keeps its length); first in the header, so
        # its place is known exactly and no value of the user's is ever mistaken for it
        metadata = {FINGERPRINT_KEY: _FINGERPRINT_PLACEHOLDER, **metadata}
    return metadata


def save(
    checkpoint: Checkpoint,
    out: Path | str,
    *,
    to: str | None = None,
    force: bool = False,
    in_place: bool = False,
    max_shard_size: int | None = None,
    duplicate_tied: bool = False,
    nest: str | None = None,
    fingerprint: bool = False,
    allow_expansion: bool = False,
    dry_run: bool = False,
    shard_stem: str = "model",
    variant: str | None = None,
) -> SaveReport:
    """Write ``checkpoint`` to ``out`` atomically and prove every tensor reads back unchanged.

    Args:
        checkpoint: what :func:`ckptool.load` returned, possibly transformed.
        out: a ``.pt``-like file, a ``.safetensors`` file, or a directory for sharded safetensors;
            local, or a URL (``s3://``, ``gs://``): written and checked
            in a local staging folder, then uploaded (:mod:`ckptool.io.upload`).
        to: ``"pt"`` or ``"safetensors"`` to override the suffix.
        force: overwrite an existing output.
        in_place: allow ``out`` to be the input (still via a temp file).
        max_shard_size: bytes per shard for sharded safetensors.
        duplicate_tied: store tied tensors as full copies instead of aliases.
        nest: wrap safetensors weights as ``{nest: weights}`` in a .pt output.
        fingerprint: also compute the sha256 fingerprint (reported; stored in safetensors metadata).
        allow_expansion: write out views that expand their storage (stride 0, overlaps) past
            :data:`ckptool.tensors.refs.EXPANSION_FACTOR` in full. A ``.pt`` output copies storages as
            they are and needs this only with ``fingerprint``.
        dry_run: make every check and refusal a write would make, then stop: nothing is written and
            no tensor byte is read; the report lists the files that would be written.
        shard_stem, variant: how a folder of shards names its files (``model`` ->
            ``model-00001-of-00002.safetensors`` and ``model.safetensors.index.json``; a variant
            ``fp16`` -> ``model.fp16-00001-of-00002.safetensors``, ``model.safetensors.index.fp16.json``).

    Raises:
        OutputError: exists without ``force``, is the input, or the disk refused the write.
        InputError: views would expand their storage too far (see ``allow_expansion``), or
            ``max_shard_size`` would make more than :data:`MAX_SHARDS` shards.
        FingerprintMismatchError: a tensor did not read back identical (the output is deleted).

    Example:
        >>> ckptool.save(ckptool.load("ddp.pt").strip_prefix(), "model.safetensors")  # doctest: +SKIP
    """
    # the one place that decides between disk and a URL: a URL is written here and uploaded (ckptool.io.upload)
    destination = location(out)
    url = destination if not isinstance(destination, Path) else None
    out = cast(Path, destination)  # a RemotePath stands where a Path stands (name, suffix, /, is_dir)
    target, tensors, plan = _refuse(
        checkpoint, out, url, to=to, max_shard_size=max_shard_size, duplicate_tied=duplicate_tied,
        allow_expansion=allow_expansion, fingerprint=fingerprint, force=force, in_place=in_place,
        naming=(shard_stem, variant),
    )  # fmt: skip
    if dry_run:  # every refusal of the write has been made; stop before a byte is read or written
        return SaveReport(
            path=out,
            format=target.name,
            files=[out / name for name in plan.writes] if plan is not None else [out],
            tensors=len(tensors),
            bytes=total_nbytes(tensors.values()),
            dry_run=True,
            notes=list(plan.notes) if plan is not None else [],
        )
    options: dict[str, Any] = {
        "nest": nest,
        "duplicate_tied": duplicate_tied,
        "fingerprint": fingerprint,
        "views_raw": not target.weights_only,  # a .pt output copies storages raw
    }
    if url is not None:
        report = _save_remote(checkpoint, tensors, url, target, plan, **options)
    else:
        # the write's records (100,000 headers, checks, sums) are no garbage while it runs: no collection rescans them
        with paused():
            report = _save_local(checkpoint, tensors, out, target, plan, **options)
    report.tensors = len(tensors)
    report.bytes = total_nbytes(tensors.values())
    rewrite_note = formats.for_name(checkpoint.format).rewrite_note
    if rewrite_note and not target.weights_only:
        report.notes.append(rewrite_note)
    return report


def _refuse(
    checkpoint: Checkpoint,
    out: Path,
    url: RemotePath | None,
    *,
    to: str | None,
    max_shard_size: int | None,
    duplicate_tied: bool,
    allow_expansion: bool,
    fingerprint: bool,
    force: bool,
    in_place: bool,
    naming: tuple[str, str | None] = ("model", None),
) -> tuple[formats.Format, Mapping[str, TensorRef], _ShardPlan | None]:
    """Every refusal of :func:`save`, before a thread reads the input or a byte is written: (the output's format,
    the tensors it writes, the shard plan of a folder output)."""
    if url is not None:
        from ckptool.files.remote import check_supported
        from ckptool.io import upload

        check_supported(url, writing=True)  # a protocol ckptool does not write: refused before any request
        # before the format is chosen: that may ask the store about the output
        upload.refuse_input(url, files=checkpoint.files, folder=checkpoint.path)
    inputs = tuple(checkpoint.files) + (checkpoint.path,)
    target = target_format(out, to, max_shard_size)
    tensors: Mapping[str, TensorRef]
    if not target.weights_only:
        tensors = checkpoint.tensors if checkpoint.has_weights else {}
    else:  # weights only: one without them is refused (state_dict says so); every refusal comes
        # before a thread reads the input or a byte is written, the layouts' before any of their
        # components is taken for a tensor
        layouts.refuse_for_safetensors(checkpoint.state_dict, out)
        _refuse_meta_tensors(checkpoint, out)
        tensors = checkpoint.tensors
        safetensors.check_dtypes(tensors, out=out)
    # a .pt output copies storages raw: only its fingerprint would stream the views in full
    views_raw = not target.weights_only
    if not views_raw or fingerprint:
        check_expansion(
            tensors, allow=allow_expansion, path=checkpoint.path, doing="write" if not views_raw else "fingerprint"
        )
    plan: _ShardPlan | None = None
    if target.sharded:
        plan = _plan_shards(
            tensors, max_shard_size or safetensors.parse_size("5GB"), duplicate_tied, out, checkpoint.path, naming
        )
    if url is not None:
        writes = {"writes": plan.writes, "removes": plan.removes} if plan is not None else {}
        upload.check_output(url, inputs=inputs, force=force, in_place=in_place, **writes)
    elif plan is not None:
        check_folder_output(
            out, writes=plan.writes, removes=plan.removes, inputs=inputs, force=force, in_place=in_place
        )
    else:
        check_output(out, inputs=inputs, force=force, in_place=in_place)
    return target, tensors, plan


def _save_remote(
    checkpoint: Checkpoint,
    tensors: Mapping[str, TensorRef],
    out: RemotePath,
    target: formats.Format,
    plan: _ShardPlan | None,
    **options: Any,
) -> SaveReport:
    """The local checked write into a staging folder, then its upload to ``out`` (:mod:`ckptool.io.upload`)."""
    from ckptool.io import upload
    from ckptool.io.streamed import STREAMS

    # a safetensors file or set without a fingerprint (nothing written goes back over its bytes) to S3 or GCS
    # is sent while it is written and checked (ckptool.io.streamed); anything else is staged, then uploaded
    streamed = target.weights_only and not options["fingerprint"] and out.protocol != "memory"
    fed: dict[RemotePath, upload.FedUpload] = {}
    shards = dict(zip(plan.names, plan.shards)) if plan is not None else {}

    def feed(name: str) -> upload.FedUpload | None:
        remote = out if plan is None else out / name
        if not streamed or (plan is None and name != out.name) or (plan is not None and name not in shards):
            return None
        held = tensors.values() if plan is None else [plan.stored[key] for key in shards[name]]
        fed[remote] = upload.FedUpload(remote, total_nbytes(held))  # its parts sized for its bytes
        return fed[remote]

    with upload.staged(out) as local:
        streams = STREAMS.set(feed)
        try:
            try:
                local_plan = replace(plan, removes=[], notes=[]) if plan is not None else None
                report = _save_local(checkpoint, tensors, local, target, local_plan, **options)
            except CkptError as e:
                raise upload.named_for_user(e, local, out) from e
            finally:
                STREAMS.reset(streams)
            if plan is None:
                files = [(local, out)]
            else:
                files = [(local / name, out / name) for name in plan.writes]
            notes = upload.publish(
                files,
                replaces_last=plan is not None and plan.replaces_index,
                remove=[out / name for name in plan.removes] if plan is not None else [],
                label=out.name,
                fed=fed,
            )
        except BaseException:
            for started in fed.values():  # a write or check that failed: nothing of it becomes visible
                started.abort()
            raise
    report.path = cast(Path, out)  # the report names the URL (a RemotePath stands where a Path stands)
    report.files = [cast(Path, out)] if plan is None else [cast(Path, out / file.name) for file in report.files]
    report.notes = [note.replace(str(local), str(out)) for note in report.notes]
    if plan is not None:
        report.notes += plan.notes
    report.notes += notes
    return report


def _save_local(
    checkpoint: Checkpoint,
    tensors: Mapping[str, TensorRef],
    out: Path,
    target: formats.Format,
    plan: _ShardPlan | None,
    *,
    nest: str | None,
    duplicate_tied: bool,
    fingerprint: bool,
    views_raw: bool,
) -> SaveReport:
    expect = Expectations.start(tensors, fingerprint=fingerprint, views_raw=views_raw)
    try:
        if not target.weights_only:
            report = _save_pt(checkpoint, out, nest, expect)
        elif not target.sharded:
            report = _save_safetensors(checkpoint, tensors, out, duplicate_tied, expect)
        else:
            assert plan is not None
            report = _save_sharded(checkpoint, out, plan, expect)
    except CkptError as e:
        if e.path is None or _TEMP_PATH.search(str(e.path)):
            # the temp file is an implementation detail: the user asked for `out`, name that
            def named(text: str) -> str:
                return _TEMP_PATH.sub(lambda m: str(out) + (m.group(1) or ""), text)

            raise type(e)(e.wording.map_text(named) if e.wording is not None else named(e.message), path=out) from e
        raise
    finally:
        expect.settle()
    return report


def read_back(
    source: Checkpoint, guard_cache: pickles.GuardCache | None = None
) -> Callable[[Path], Mapping[str, TensorRef]]:
    """A reader for the output that accepts the globals the input was read with (and needs no walk of
    the pickles ``guard_cache`` says the write emitted)."""

    def read(path: Path) -> Mapping[str, TensorRef]:
        from ckptool.io.reader import load

        written = source.weights_as_written(load(path, allow_globals=tuple(source.globals), guard_cache=guard_cache))
        return written.tensors if written.has_weights else {}

    return read


def _save_pt(checkpoint: Checkpoint, out: Path, nest: str | None, expect: Expectations) -> SaveReport:
    container = pt_container(checkpoint, nest)
    cache = pickles.GuardCache()  # the pickle this write emits, which its read-back need not walk
    try:
        checked = _write_pt(container, out, expect, read_back(checkpoint, cache), trust_recorded=True, cache=cache)
    except StaleSourceCrc:
        # the source recorded CRCs that are not its bytes' (saved with CRCs off, or patched after
        # saving; torch ignores them): write again, summing every storage instead of copying its CRC
        tensors = checkpoint.tensors if checkpoint.has_weights else {}
        summed = run_in_thread(lambda: tensor_checks(tensors, trust_stored=False, views_raw=True))
        expect = replace(expect, checks=summed, threads=(summed, expect.fingerprint))
        checked = _write_pt(container, out, expect, read_back(checkpoint, cache), trust_recorded=False, cache=cache)
    return SaveReport(path=out, format="torch-zip", files=[out], fingerprint=expect.fingerprint(), checked=checked)


def _write_pt(
    container: Any,
    out: Path,
    expect: Expectations,
    reader: Callable[[Path], Mapping[str, TensorRef]],
    *,
    trust_recorded: bool,
    cache: pickles.GuardCache | None = None,
) -> int:
    with progress.task(None, out.name), checked_output(out, expect, reader, views_raw=True) as output:
        torch_zip.write(
            output.handle,
            container,
            archive_name=_archive_name(out),
            on_data=output.on_data,
            trust_recorded_crcs=trust_recorded,
            guard_cache=cache,
        )
    return output.checked


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
    names = [
        name
        for name, value in dict.items(checkpoint.state_dict)
        if getattr(value, "_global", "") == "torch._utils._rebuild_meta_tensor_no_storage"
    ]
    if names:
        shown = ", ".join(repr(name) for name in names[:3]) + (", ..." if len(names) > 3 else "")
        raise OutputError(
            f"safetensors cannot hold meta tensors (a shape and dtype without values): {shown} — "
            "write a .pt instead (" + suggest.option("to", "pt") + "), or leave these tensors out",
            path=out,
        )


def _save_safetensors(
    checkpoint: Checkpoint, tensors: Mapping[str, TensorRef], out: Path, duplicate_tied: bool, expect: Expectations
) -> SaveReport:
    notes: list[str] = []
    metadata = safetensors_metadata(checkpoint, with_fingerprint=expect.wants_fingerprint, notes=notes)
    with progress.task(None, out.name), checked_output(out, expect, read_back(checkpoint)) as output:
        aliases = safetensors.write_file(
            output.handle, tensors, metadata, duplicate_tied=duplicate_tied, on_data=output.on_data
        )
        value = expect.fingerprint()
        if value:
            _patch_fingerprint(output.handle, value)
    return SaveReport(
        path=out,
        format="safetensors",
        files=[out],
        fingerprint=value,
        checked=output.checked,
        aliases=aliases,
        notes=notes,
    )


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
    replaces_index: bool = False  # a URL's folder holds an index already (removed first when the set goes up)
    index_name: str = safetensors.INDEX_NAME

    @property
    def writes(self) -> list[str]:
        return [*self.names, self.index_name]


# Shards one write may make: each is a file, a header and a re-read; a few thousand is already a
# 10 TB checkpoint in 2 GB shards. ``--max-shard-size 1B`` over many tensors would make one per tensor.
MAX_SHARDS = 10_000


def _plan_shards(
    tensors: Mapping[str, TensorRef],
    max_shard_size: int,
    duplicate_tied: bool,
    out: Path,
    source: Path,
    naming: tuple[str, str | None] = ("model", None),
) -> _ShardPlan:
    if max_shard_size < 1:
        raise UsageError(suggest.option("max_shard_size", None) + f" must be at least 1 byte, not {max_shard_size}")
    aliases = {} if duplicate_tied else safetensors.plan_aliases(tensors)
    stored = {k: v for k, v in tensors.items() if k not in aliases}
    shards = safetensors.plan_shards(stored, max_shard_size)
    if len(shards) > MAX_SHARDS:
        floor = -(-sum(t.nbytes for t in stored.values()) // MAX_SHARDS)
        raise UsageError(
            suggest.typed("max_shard_size", max_shard_size)
            + f" would make {len(shards)} shards, over the {MAX_SHARDS}-shard limit — pass a larger "
            + suggest.option("max_shard_size", None)
            + f" (at least {floor} bytes)",
            path=source,
        )
    from ckptool.formats.safetensors_write import index_file_name, shard_file_name

    names = [shard_file_name(index, len(shards), *naming) for index in range(len(shards))]
    index_name = index_file_name(*naming)
    removes: list[str] = []
    notes: list[str] = []
    replaces_index = False
    if not isinstance(out, Path):  # a URL: the earlier set as its index names it, read from the store
        from ckptool.io import upload

        replaces_index, named = upload.earlier_shards(out, index_name)
        if named is None:
            notes.append(
                f"the earlier {index_name} could not be read: shards of the earlier set, if any, were left in place"
            )
        removes = [name for name in (named or []) if name not in names]
    elif out.is_dir():
        old_index = out / index_name
        if os.path.lexists(old_index):
            # the earlier set's shards, as its own index names them: nothing else is ever removed
            named = safetensors.shards_named_by(old_index)
            if named is None:
                notes.append(
                    f"the earlier {index_name} could not be read: shards of the earlier set, if any, were left in place"
                )
            removes = [name for name in (named or []) if name not in names]
        single = out / f"{naming[0]}{'.' + naming[1] if naming[1] else ''}.safetensors"
        if os.path.lexists(single):
            notes.append(
                f"{out} also holds {single.name}, which loaders such as transformers read before the "
                "index — remove it if it is an older copy"
            )
    return _ShardPlan(aliases, stored, shards, names, removes, notes, replaces_index, index_name)


def _save_sharded(checkpoint: Checkpoint, out: Path, plan: _ShardPlan, expect: Expectations) -> SaveReport:
    dropped: list[str] = []
    metadata = safetensors_metadata(checkpoint, with_fingerprint=expect.wants_fingerprint, notes=dropped)
    # the container's entries go into the first shard only (the reader merges every shard's metadata):
    # a large config copied into thousands of headers would multiply it
    entries = metadata.pop("ckptool.entries", None)
    weight_map: dict[str, str] = {}
    files: list[Path] = []
    # shards and index are written into a temp folder, checked, then moved in: the index last
    total = sum(tensor.nbytes for tensor in plan.stored.values())
    with (
        progress.task(total, out.name),
        checked_folder(out, expect, read_back(checkpoint), last=plan.index_name, remove=plan.removes) as folder,
    ):
        for index, (name, names) in enumerate(zip(plan.names, plan.shards)):
            shard_tensors = {k: plan.stored[k] for k in names}
            # an alias lives in the shard that stores its target
            shard_aliases = {a: t for a, t in plan.aliases.items() if t in shard_tensors}
            shard_metadata = dict(metadata)
            if index == 0 and entries is not None:
                shard_metadata["ckptool.entries"] = entries
            if shard_aliases:
                shard_metadata[safetensors.ALIASES_KEY] = json.dumps(shard_aliases, sort_keys=True)
            with folder.file(name) as (handle, shard_sums):
                safetensors.write_tensors(handle, shard_tensors, shard_metadata, on_data=shard_sums.written)
            weight_map.update({k: name for k in names})
            files.append(out / name)
        value = expect.fingerprint()
        if value:
            for shard in files:
                with open(folder.directory / shard.name, "r+b") as handle:
                    _patch_fingerprint(handle, value)
        index_metadata: dict[str, Any] = {"total_size": sum(t.nbytes for t in plan.stored.values())}
        if value:
            index_metadata[FINGERPRINT_KEY] = value
        index_doc = {"metadata": index_metadata, "weight_map": dict(sorted(weight_map.items()))}
        (folder.directory / plan.index_name).write_text(json.dumps(index_doc, indent=2) + "\n")
    report = SaveReport(
        path=out,
        format="safetensors-sharded",
        files=[out / plan.index_name, *files],
        fingerprint=value,
        checked=folder.checked,
        aliases=plan.aliases,
        notes=[*dropped, *plan.notes],
    )
    if plan.removes:
        report.notes.append(
            f"removed {len(plan.removes)} shard(s) of the earlier set ({', '.join(plan.removes[:3])}"
            f"{', ...' if len(plan.removes) > 3 else ''})"
        )
    return report
