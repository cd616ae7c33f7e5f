"""Sharded torch checkpoints: ``pytorch_model.bin.index.json`` and the ``.bin`` shards it names.

transformers (``save_pretrained(safe_serialization=False)``) and diffusers write a model too large
for one file as ``pytorch_model-0000N-of-0000M.bin`` shards, each a ``torch.save``'d state dict
(zip, or the legacy stream in old releases), plus an index whose ``weight_map`` maps every weight
name to the shard holding it. Each shard is read as the file it is (through the restricted
unpickler; nothing it names runs), as a file of the folder input (``inputs.open_member``: a
regular file inside the folder, or its hub cache's ``blobs/``), and the ``weight_map`` decides
which tensor comes from which shard: a name it maps to a shard that lacks it is refused, and
what a shard holds beyond what the index maps to it is left out (and said).

The weights come in the order transformers' loader reads them: shards in sorted name order,
each shard's tensors in its own order. Read-only: ckptool writes them as safetensors (single or
sharded) or as one ``.pt``.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from ckptool.base.errors import InputError, UnsupportedFormatError
from ckptool.files import inputs
from ckptool.files.byteio import read_capped
from ckptool.formats import Contents, Format, PickleBlob, Pickles, ReadOptions, torch_legacy, torch_zip
from ckptool.formats import sniff as sniff_file
from ckptool.formats.hf_index import find_index as safetensors_index
from ckptool.tensors.refs import TensorRef

INDEX_SUFFIXES = (".bin.index.json", ".pt.index.json", ".pth.index.json")
_SHARD_SUFFIXES = (".bin", ".pt", ".pth")
INDEX_NAME = "pytorch_model.bin.index.json"  # transformers' WEIGHTS_INDEX_NAME
MAX_INDEX_BYTES = 100_000_000  # as a safetensors header's limit; an index of any real model is far smaller
_SHARD_NAME = re.compile(r"^[^/\\\x00]+$")


def sniff(head: bytes | None, path: Path) -> bool:
    """A JSON file named as a torch shard index (``*.bin.index.json``), or a folder holding one and no
    safetensors weights (a folder with both is read through its safetensors, as transformers reads it)."""
    if head is None:
        try:
            return find_index(path) is not None
        except (InputError, OSError):
            return False  # the folder's own reader says what is wrong with it
    return head.lstrip().startswith(b"{") and path.name.lower().endswith(INDEX_SUFFIXES)


def find_index(directory: Path) -> Path | None:
    """The ``*.bin.index.json`` of a folder that holds no safetensors weights, or None."""
    if safetensors_index(directory) is not None:
        return None
    indexes = sorted(path for path in directory.iterdir() if path.name.lower().endswith(INDEX_SUFFIXES))
    if len(indexes) > 1:
        preferred = directory / INDEX_NAME
        if preferred in indexes:
            return preferred
        raise InputError(
            f"holds {len(indexes)} torch shard indexes ({', '.join(p.name for p in indexes[:3])}"
            f"{', ...' if len(indexes) > 3 else ''}) — name the one to read",
            path=directory,
        )
    return indexes[0] if indexes else None


def _folder_index(directory: Path) -> Path:
    index = find_index(directory)
    if index is None:
        raise InputError("holds no *.bin.index.json — not a sharded torch checkpoint", path=directory)
    return index


def _index(path: Path, options: ReadOptions) -> tuple[dict[str, str], dict[str, str]]:
    """The index's ``weight_map`` (name -> shard file, each a file name beside the index) and metadata."""
    handle = options.handle
    assert handle is not None
    handle.seek(0)
    raw = read_capped(handle, MAX_INDEX_BYTES)
    if raw is None:
        raise InputError(f"index is over {MAX_INDEX_BYTES} bytes, larger than any real index — refused", path=path)
    try:
        index = json.loads(raw.decode("utf-8"))
    except (ValueError, RecursionError) as e:
        raise InputError("index is not valid UTF-8 JSON — the file is corrupt", path=path) from e
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise InputError(
            "index has no weight_map of weight name -> shard file — not a sharded checkpoint index", path=path
        )
    for shard in sorted(set(weight_map.values())):
        if not _SHARD_NAME.match(shard) or shard in (".", ".."):
            shown = shard if len(shard) <= 80 else shard[:77] + "..."
            raise InputError(
                f"index names shard {shown!r}, which is not a file name in the index's folder — refused "
                "(an index names its shards beside it); fix the index or re-download the checkpoint",
                path=path,
            )
    metadata = index.get("metadata")
    metadata = {str(k): str(v) for k, v in metadata.items() if k != "total_size"} if isinstance(metadata, dict) else {}
    return weight_map, metadata


def _opened_index(directory: Path, options: ReadOptions) -> tuple[Path, ReadOptions]:
    """A folder input's index, opened as a file of the folder (inside it, regular)."""
    index = _folder_index(directory)
    handle = inputs.open_member(directory, index, what=index.name, report=directory)
    return index, ReadOptions(handle, b"", options.resolver)


def read(path: Path, options: ReadOptions) -> Contents:
    """Every weight the index maps, each from the shard it names (``path``: the index, or its folder)."""
    if options.handle is None:
        index, opened = _opened_index(path, options)
        with opened.handle:  # type: ignore[union-attr]
            return read(index, opened)
    weight_map, metadata = _index(path, options)
    directory = path.parent
    wanted: dict[str, set[str]] = {}
    for name, shard in weight_map.items():
        wanted.setdefault(shard, set()).add(name)
    tensors: dict[str, TensorRef] = {}
    files: list[Path] = []
    notes: list[str] = []
    shard_notes: dict[str, list[str]] = {}  # what a shard's format says (legacy serialization), by shard
    for shard in sorted(wanted):
        shard_path = directory / shard
        container, said = _read_shard(directory, shard_path, path, options)
        for note in said:
            shard_notes.setdefault(note, []).append(shard)
        names = wanted[shard]
        unlisted = []
        for name, value in container.items():
            if name not in names:
                unlisted.append(name)
                continue
            if not isinstance(value, TensorRef):
                raise UnsupportedFormatError(
                    f"shard {shard} holds {str(name)[:80]!r} as {type(value).__name__}, not "
                    "a tensor — ckptool reads shards that are state dicts",
                    path=path,
                )
            tensors[name] = value
        absent = sorted(name for name in names if name not in tensors)
        if absent:
            raise InputError(
                f"index maps {len(absent)} tensor(s) to shard {shard}, which does not hold them (e.g. "
                f"{absent[0][:80]!r}) — the checkpoint is inconsistent; re-download or re-save it",
                path=path,
            )
        if unlisted:
            shown = ", ".join(repr(str(name)[:60]) for name in unlisted[:3]) + (", ..." if len(unlisted) > 3 else "")
            notes.append(
                f"shard {shard} holds {len(unlisted)} entr(ies) the index does not map to it ({shown}): "
                "left out, as the index decides"
            )
        files.append(shard_path)
    for note, shards in shard_notes.items():
        which = shards[0] if len(shards) == 1 else f"{len(shards)} shards ({shards[0]}, ...)"
        notes.append(f"{which}: {note}")
    return Contents(container=tensors, files=files, metadata=metadata, notes=notes)


def _read_shard(directory: Path, shard_path: Path, index_path: Path, options: ReadOptions) -> tuple[dict, list[str]]:
    """One shard's state dict, read as the torch file it is; it must be a regular file inside the folder."""
    shard = shard_path.name
    what = f"shard {shard} named by the index"
    try:
        with inputs.open_member(directory, shard_path, what=what, report=index_path) as handle:
            head = handle.read(64)
            if not head:
                raise InputError(f"{what} is empty (0 bytes) — the download did not finish", path=index_path)
            fmt = sniff_file(head, shard_path)
            if fmt is not torch_zip.FORMAT and fmt is not torch_legacy.FORMAT:
                raise UnsupportedFormatError(
                    f"{what} is not a torch.save file (zip or legacy) — a .bin shard index names torch files",
                    path=index_path,
                )
            contents = fmt.read(shard_path, ReadOptions(handle, head, options.resolver))
    except OSError as e:
        raise InputError(f"{what} cannot be read ({e.strerror})", path=index_path) from e
    if contents.format is not None or not isinstance(contents.container, dict):
        raise UnsupportedFormatError(
            f"{what} is not a state dict (a mapping of names to tensors) — ckptool reads "
            "shards as transformers writes them",
            path=index_path,
        )
    return contents.container, contents.notes


def names_torch_shards(path: Path, options: ReadOptions) -> bool:
    """Whether a JSON index (of any name) maps its weights to torch files (``.bin``, ``.pt``, ``.pth``)."""
    try:
        weight_map, _ = _index(path, options)
    except InputError:
        return False  # the safetensors reader says what is wrong with it
    return bool(weight_map) and all(shard.lower().endswith(_SHARD_SUFFIXES) for shard in weight_map.values())


def pickle_blobs(path: Path, options: ReadOptions) -> Pickles:
    """Every pickle of every shard the index names, labelled by shard (a folder: through its index)."""
    if options.handle is None:
        index, opened = _opened_index(path, options)
        with opened.handle:  # type: ignore[union-attr]
            return pickle_blobs(index, opened)
    directory = path.parent
    blobs: list[PickleBlob] = []
    for shard in sorted(set(_index(path, options)[0].values())):
        shard_path = directory / shard
        with inputs.open_member(directory, shard_path, what=f"shard {shard} named by the index", report=path) as handle:
            head = handle.read(64)
            fmt = sniff_file(head, shard_path) if head else None
            if fmt is None:
                continue  # the load names what it is
            found = fmt.scan_pickles(shard_path, ReadOptions(handle, head, options.resolver))
        blobs += [PickleBlob(f"{shard}: {blob.label}", blob.data, blob.read_by_load) for blob in found.blobs]
    return Pickles(FORMAT.name, blobs)


FORMAT = Format(
    name="torch-sharded",
    sniff=sniff,
    read=read,
    pickle_blobs=pickle_blobs,
    rewrite_note="a sharded .bin checkpoint is rewritten as one .pt file of its weights",
    weights_only=True,
    in_place_refused="is a sharded .bin checkpoint: a rewrite writes one .pt, which would replace its index and "
    "leave its shards behind",
)
