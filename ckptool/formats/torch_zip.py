"""PyTorch's zip format (``torch.save`` since 1.6): ``<archive>/data.pkl`` + ``<archive>/data/<key>``.

Reading validates the archive and unpickles ``data.pkl`` through the restricted unpickler; tensor
bytes stay where they are. Writing re-emits the pickle and copies every storage's bytes raw — a
key or location rewrite never deserializes a tensor.
"""

from __future__ import annotations

import io
from collections import Counter
from collections.abc import Callable
from dataclasses import replace
from operator import itemgetter, mul
from pathlib import Path
from typing import Any, BinaryIO, cast

from ckptool import pickles
from ckptool.base import progress
from ckptool.base.errors import InputError, UnsupportedFormatError
from ckptool.formats import Contents, Format, PickleBlob, Pickles, ReadOptions, zipio
from ckptool.formats.zip_storages import storage_loader
from ckptool.tensors.refs import (
    _CRC32,
    _DATA,
    _DERIVED,
    _ITEMSIZE,
    _NUMEL,
    _OFFSET,
    _PATH,
    _PIECES,
    _PRODUCER,
    StorageRef,
)

ZIP_MAGIC = b"PK\x03\x04"


def sniff(head: bytes | None, path: Path) -> bool:
    """A zip archive (its first local header)."""
    return head is not None and head.startswith(ZIP_MAGIC)


def archive_folder(path: Path, members: dict[str, zipio.Member]) -> str:
    """The archive's single top-level folder (torch names it after the file; any name is valid)."""
    first = next(iter(members), "")
    if "/" in first:  # the usual archive: every name under the first one's folder (one C-speed pass)
        lead = first.split("/", 1)[0] + "/"
        if zipio.starting(members, lead, every=True):
            return lead[:-1]
    tops = {name.split("/", 1)[0] for name in members}
    if len(tops) != 1 or not all("/" in name for name in members):
        raise UnsupportedFormatError(
            "is a zip archive but not a PyTorch checkpoint (no single folder holding data.pkl)", path=path
        )
    return tops.pop()


def holds_code(members: zipio.Members, top: str) -> bool:
    """Whether a torch zip is a TorchScript archive: it holds code or the code's constants."""
    return members.get(f"{top}/constants.pkl") is not None or members.any_under(f"{top}/code/")


def read(path: Path, options: ReadOptions) -> Contents:
    """Read a torch zip checkpoint's object tree with lazy storages."""
    handle = options.handle
    assert handle is not None
    members = zipio.read_members(path, handle)
    if not members:
        raise UnsupportedFormatError("is an empty zip archive, not a PyTorch checkpoint", path=path)
    top = archive_folder(path, members)
    if holds_code(members, top):  # TorchScript: its weights are read as its state_dict, its code never run
        from ckptool.formats import torchscript  # here: its module, with its parsers, is for such an archive alone

        contents = torchscript.read_archive(
            path, options, members, top, big_endian=_big_endian(path, handle, members, top)
        )
        contents.format = torchscript.FORMAT.name
        return contents
    pickle_member = members.get(f"{top}/data.pkl")
    if pickle_member is None:
        raise UnsupportedFormatError("is a zip archive but not a PyTorch checkpoint (no data.pkl)", path=path)
    big_endian = _big_endian(path, handle, members, top)
    data = zipio.read_member(path, handle, pickle_member, limit=pickles.MAX_PICKLE_BYTES)
    storages: dict[str, StorageRef] = {}
    persistent_load = storage_loader(path, members, top, storages, big_endian=big_endian)
    container = pickles.loads(data, options.resolver, persistent_load)
    return Contents(container=container, files=[path])


def _big_endian(path: Path, handle: BinaryIO, members: zipio.Members, top: str) -> bool:
    """Whether the archive records big-endian storages (torch swaps them on load)."""
    big_endian = False
    byteorder = members.get(f"{top}/byteorder")
    if byteorder is not None:
        # torch reads exactly b"little" or b"big" (no record: little) and swaps a "big" file's storages
        record = zipio.read_member(path, handle, byteorder, limit=16)
        big_endian = record == b"big"
        if not big_endian and record.strip() != b"little":
            raise UnsupportedFormatError(
                f"records byte order {record[:16]!r}, neither little nor big — the file is corrupt", path=path
            )
    return big_endian


def write(
    handle: BinaryIO,
    container: Any,
    *,
    archive_name: str = "archive",
    on_data: Callable[[int, int], None] | None = None,
    trust_recorded_crcs: bool = True,
    guard_cache: pickles.GuardCache | None = None,
) -> None:
    """Write ``container`` as torch.save would: pickle first, storages raw, torch's bookkeeping records.

    Storages are renumbered 0..n-1 in order of first appearance; bytes of a storage read from a zip
    member are copied by the kernel with their CRC kept, others are streamed and summed. With
    ``trust_recorded_crcs`` off (a source whose recorded CRCs proved stale) every storage is summed.
    ``guard_cache`` (the write's) remembers the pickle, so reading the output back need not walk it.
    """
    pickle_bytes, storages = pickles.dump(container, renumber_storages=True, guard_cache=guard_cache)
    objects = list(map(itemgetter(1), storages))
    sizes = list(map(mul, map(_NUMEL, objects), map(_ITEMSIZE, objects)))  # StorageRef.nbytes
    progress.expect(sum(sizes))
    writer = zipio.ZipWriter(handle, on_data)
    try:
        writer.add_bytes(f"{archive_name}/data.pkl", pickle_bytes)
        writer.add_bytes(f"{archive_name}/.format_version", b"1")
        writer.add_bytes(f"{archive_name}/.storage_alignment", b"64")
        writer.add_bytes(f"{archive_name}/byteorder", b"little")
        datas = list(map(_DATA, objects))
        crcs = list(map(_CRC32, datas)) if all(datas) else [None]
        if (
            trust_recorded_crcs
            and None not in crcs
            and not any(map(_PIECES, objects))
            and not any(map(_DERIVED, objects))
            and not any(map(_PRODUCER, objects))
        ):
            # the usual write: every storage the bytes of a member, its CRC recorded (_add_each's first case, in
            # columns)
            names = list(map(f"{archive_name}/data/".__add__, map(itemgetter(0), storages)))
            recorded = cast("list[int]", crcs)  # None is not among them
            writer.add_copy_columns(names, list(map(_PATH, datas)), list(map(_OFFSET, datas)), sizes, recorded)
        else:
            _add_each(writer, storages, archive_name, trust_recorded_crcs)
        writer.add_bytes(f"{archive_name}/version", b"3\n")
        import secrets  # here: it imports hashlib and random, 5 ms of every read that writes nothing

        writer.add_bytes(f"{archive_name}/.data/serialization_id", str(secrets.randbelow(10**40)).zfill(40).encode())
        writer.close()
    finally:
        writer.release()


def _add_each(
    writer: zipio.ZipWriter, storages: list[tuple[str, StorageRef]], archive_name: str, trust_recorded_crcs: bool
) -> None:
    """Add each storage as a member: copied with its recorded CRC where it is the bytes of one (runs of them
    copied together), else its pieces, its computed bytes or its bytes streamed and summed."""
    copies: list[tuple[str, Any, int, int, int]] = []  # the usual storages: bytes of a member, its CRC recorded
    for key, storage in storages:
        data = storage.data
        if (
            data is not None
            and data.crc32 is not None
            and trust_recorded_crcs
            and storage.pieces is None
            and storage.derived is None
            and storage.producer is None
        ):
            copies.append((f"{archive_name}/data/{key}", data.path, data.offset, storage.nbytes, data.crc32))
            continue
        writer.add_copies(copies)
        copies.clear()
        if storage.pieces is not None:
            pieces = (
                storage.pieces if trust_recorded_crcs else tuple(replace(piece, crc32=None) for piece in storage.pieces)
            )
            writer.add_pieces(f"{archive_name}/data/{key}", pieces)
            continue
        if storage.derived is not None and storage.derived.nbytes == storage.nbytes:
            writer.add_derived(f"{archive_name}/data/{key}", storage.derived)  # a cast, streamed
            continue
        if storage.producer is not None:
            writer.add_bytes(f"{archive_name}/data/{key}", storage.producer())
            continue
        source = storage.byte_range()
        writer.add_copy(
            f"{archive_name}/data/{key}",
            source.path,
            source.offset,
            storage.nbytes,
            source.crc32 if trust_recorded_crcs else None,
        )
    writer.add_copies(copies)


# ---------------------------------------------------------------------------------------------
# scan: every pickle member, located as torch's reader locates members

LOADED_MARK = " (the data.pkl torch reads)"


def _is_pickle_member(member: zipio.Member, head: bytes) -> bool:
    """Whether scan reads a zip member as a pickle: any ``.pkl`` (in any case, anywhere), or any member
    outside a ``data/`` folder of storages that opens with a protocol 2–5 pickle header."""
    name = zipio.fold_name(member.name)
    if name.endswith(".pkl"):
        return True
    in_storages = "/data/" in f"/{name}"  # storage bytes are data, never unpickled by torch
    return not in_storages and len(head) == 2 and head[0] == 0x80 and 2 <= head[1] <= 5


def _may_be_pickle(member: zipio.Member) -> bool:
    """Whether :func:`_is_pickle_member` could say yes, before its first bytes are read."""
    name = zipio.fold_name(member.name)
    return name.endswith(".pkl") or "/data/" not in f"/{name}"


def pickle_blobs(path: Path, options: ReadOptions) -> Pickles:
    """Every pickle member of a zip, located as torch's reader locates members, whatever its name.

    Nothing about the archive's structure stops the scan: a member torch would run is read even
    where loading refuses the archive (overlapping members), and members of one name are each
    read, labelled by their place in the directory (and the one a load reads marked as such).
    An archive with a ``constants.pkl`` is scanned as ``torchscript``.
    """
    from ckptool.formats import pickle_stream  # here: pickletools, for a scan alone

    handle = options.handle
    assert handle is not None
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
        label = (
            member.name
            if counts[member.name] == 1
            else f"{member.name} (member {seen[member.name]} of {counts[member.name]} so named)"
        )
        if member is loaded:
            label += LOADED_MARK
        if member.encrypted:
            if member.compressed:
                continue  # ciphertext: its plaintext cannot be read; torch cannot read it either
            # flagged encrypted yet stored as it lies: torch refuses it, a reader ignoring the flag runs it
            label += " (flagged encrypted, stored in the clear)"
        if not _may_be_pickle(member):
            continue  # a storage's bytes: never read
        try:
            handle.seek(zipio.data_offset(handle, member))
        except InputError:
            continue  # unplaceable (a remote member read late): the load's one-line refusal speaks for it
        head = handle.read(2) if not member.compressed else b""
        if not _is_pickle_member(member, head):
            continue
        try:
            data = zipio.read_member(path, handle, member, limit=pickles.MAX_PICKLE_BYTES)
        except InputError:
            continue  # unreadable: the load (and its one-line refusal) speaks for it
        blobs += pickle_stream.split_pickles(io.BytesIO(data), label, 5, options.resolver.guard_cache)
    kind = "torchscript" if any(name.endswith("/constants.pkl") for name, _ in blobs) else FORMAT.name
    code = [
        member.name
        for member in listing.members
        if f"/{top}/code/" in f"/{member.name}" and zipio.fold_name(member.name).endswith(".py")
    ]
    notes = (
        [
            f"TorchScript code in {len(code)} file(s) under {top}/code/ (e.g. {code[0]!r}): torch.jit.load compiles "
            "it and the module runs it; ckptool reads the weights without it"
        ]
        if code
        else []
    )
    # a load reads the one data.pkl (not what follows its STOP): the rest are run dry
    return Pickles(
        kind, [PickleBlob(name, data, read_by_load=name.endswith(LOADED_MARK)) for name, data in blobs], notes
    )


FORMAT = Format(
    name="torch-zip",
    sniff=sniff,
    read=read,
    pickle_blobs=pickle_blobs,
    target="pt",
    suffixes=(".pt", ".pth", ".bin", ".ckpt", ".tar"),
)
