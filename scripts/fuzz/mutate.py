"""Seeds and mutations for the fuzz: structure-aware, so a mutant gets past the first check it meets.

A :class:`Seed` is a real input (a fixture, a hostile case, a public corpus file) with what it is
(zip, legacy, safetensors, pickle) and where its structure lives: a zip's directory and local headers
and its pickle member, a legacy file's five pickles, a safetensors header. :func:`mutate` picks one of:

    bytes       bit flips, interesting bytes and integers, inserts, deletes, in-file splices, truncation,
                a chunk of another seed; aimed at the structural ranges (a 1.5 MB checkpoint is mostly
                tensor bytes no reader looks at)
    pickle      opcode-aware edits of a pickle (a zip's data.pkl, then re-zipped with a right CRC, so the
                mutant reaches the guard and the unpickler, not the CRC check): delete, duplicate, swap
                opcodes; insert or replace one from a list of every opcode the guard reads; set an opcode's
                integer argument (a memo index, a length, a FRAME size) to an interesting value; rename a global
    zip         member edits (rename, case-fold collisions, drop, duplicate, reorder, another seed's member)
                and header fields (central, local, end record) set to interesting values
    header      safetensors headers edited as JSON (dtypes, shapes, offsets, names, metadata, duplicate keys)
                and as text (tokens JSON parsers disagree on), with a right or wrong length prefix

Pure functions of a ``random.Random``: a worker's seed replays its run.
"""

from __future__ import annotations

import io
import json
import pickletools
import random
import struct
import sys
import zipfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
import hostile  # noqa: E402 — the hostile corpus's opcode helpers

MAX_SEED = 8 << 20  # bigger files are left out (mutating them is slow, and what matters is their structure)
MAX_MUTANT = 16 << 20
LEGACY_MAGIC = hostile.pickle.dumps(hostile.MAGIC_NUMBER, protocol=2)
INTERESTING = (0, 1, 2, 3, 4, 7, 8, 15, 16, 31, 32, 63, 64, 127, 128, 255, 256, 4095, 4096, 0x7FFF, 0x8000,
               0xFFFF, 0x10000, 0x7FFFFFFF, 0x80000000, 0xFFFFFFFF, 1 << 32, (1 << 63) - 1, 1 << 63, (1 << 64) - 1)
INTERESTING_BYTES = (0x00, 0x01, 0x7F, 0x80, 0xFF, ord("("), ord("."), ord("b"), ord("R"), ord("0"), ord("N"))


@dataclass
class Seed:
    """One real input, what it is, and where its structure lives."""

    name: str
    kind: str  # "zip", "legacy", "safetensors", "pickle" or "other"
    data: bytes
    hot: list[tuple[int, int]] = field(default_factory=list)  # ranges worth mutating
    pickles: list[tuple[int, int]] = field(default_factory=list)  # (start, end) of each pickle in data
    members: list[tuple[str, bytes]] = field(default_factory=list)  # a zip's members as zipfile reads them

    @property
    def suffix(self) -> str:
        return {"zip": ".pt", "legacy": ".pt", "safetensors": ".safetensors", "pickle": ".pkl"}.get(self.kind, ".bin")


# ------------------------------------------------------------------------------------------------ seeds


def load_seeds(folders: list[Path]) -> list[Seed]:
    seeds = []
    for folder in folders:
        for path in sorted(folder.rglob("*")):
            if path.is_symlink() or not path.is_file() or path.suffix in (".py", ".md", ".txt"):
                continue
            size = path.stat().st_size
            if 0 < size <= MAX_SEED:
                seeds.append(describe(f"{folder.name}/{path.relative_to(folder)}", path.read_bytes()))
    return seeds


def _pickle_end(data: bytes, start: int) -> int | None:
    """Where the pickle starting at ``start`` ends (after its STOP), by pickletools' reading; None if it does not."""
    try:
        for opcode, _, position in pickletools.genops(io.BytesIO(data[start:])):
            if opcode.name == "STOP" and position is not None:
                return start + position + 1
    except Exception:  # noqa: BLE001 — not a pickle pickletools reads to its end
        return None
    return None


def describe(name: str, data: bytes) -> Seed:
    if data[:4] == b"PK\x03\x04" or b"PK\x05\x06" in data[-65557:]:
        seed = Seed(name, "zip", data)
        _describe_zip(seed)
        return seed
    if data.startswith(LEGACY_MAGIC):
        seed = Seed(name, "legacy", data)
        start = 0
        for _ in range(5):
            end = _pickle_end(data, start)
            if end is None:
                break
            seed.pickles.append((start, end))
            start = end
        seed.hot = [(0, max(start, min(len(data), 4096)))]
        return seed
    if len(data) >= 10:
        (length,) = struct.unpack_from("<Q", data)
        if 2 <= length <= len(data) - 8 and data[8:9] == b"{":
            return Seed(name, "safetensors", data, hot=[(0, 8 + length)])
    end = _pickle_end(data, 0)
    if end is not None:
        return Seed(name, "pickle", data, hot=[(0, len(data))], pickles=[(0, end)])
    return Seed(name, "other", data, hot=[(0, len(data))])


def _describe_zip(seed: Seed) -> None:
    data = seed.data
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as archive:
            start = archive.start_dir  # type: ignore[attr-defined]
            seed.hot.append((start, len(data)))
            for info in archive.infolist()[:4096]:
                seed.hot.append((info.header_offset, info.header_offset + 30 + len(info.filename) + 64))
                if info.file_size <= 1 << 20 and info.compress_size <= 1 << 20:
                    try:
                        member = archive.read(info)
                    except Exception:  # noqa: BLE001 — a member zipfile cannot read: kept out of the edits
                        continue
                    seed.members.append((info.filename, member))
                    if info.filename.endswith(".pkl"):
                        offset = info.header_offset + 30 + len(info.filename.encode()) + len(info.extra)
                        seed.hot.append((offset, offset + info.compress_size))
    except Exception:  # noqa: BLE001 — zipfile's objections: the tail, where the directory would be
        seed.hot.append((max(0, len(data) - 4096), len(data)))


# ------------------------------------------------------------------------------------------------ bytes


def _position(rng: random.Random, seed_hot: list[tuple[int, int]], size: int) -> int:
    if seed_hot and rng.random() < 0.85:
        start, end = rng.choice(seed_hot)
        start, end = max(0, start), min(end, size)  # (a broken zip's offsets can point anywhere)
        if start < end:
            return rng.randrange(start, end)
    return rng.randrange(size) if size else 0


def _interesting(rng: random.Random, near: int | None = None) -> int:
    if near is not None and rng.random() < 0.3:
        return max(0, near + rng.choice((-1, 1, -8, 8, 4096)))
    return rng.choice(INTERESTING)


def mutate_bytes(rng: random.Random, data: bytearray, hot: list[tuple[int, int]], donors: list[Seed],
                 notes: list[str]) -> None:
    for _ in range(rng.choice((1, 1, 1, 2, 3, 4))):
        size = len(data)
        at = _position(rng, hot, size)
        kind = rng.choice(("flip", "flip", "byte", "int", "insert", "delete", "splice", "truncate", "donor"))
        if kind == "flip" and size:
            data[at] ^= 1 << rng.randrange(8)
        elif kind == "byte" and size:
            data[at] = rng.choice(INTERESTING_BYTES) if rng.random() < 0.7 else rng.randrange(256)
        elif kind == "int" and size:
            width = rng.choice((1, 2, 4, 8))
            value = _interesting(rng) & ((1 << 8 * width) - 1)
            data[at:at + width] = value.to_bytes(width, "little")
        elif kind == "insert":
            data[at:at] = rng.randbytes(rng.choice((1, 1, 2, 4, 16)))
        elif kind == "delete":
            del data[at:at + rng.choice((1, 1, 2, 4, 16, 64))]
        elif kind == "splice" and size:
            start = rng.randrange(size)
            data[at:at] = data[start:start + rng.choice((1, 8, 64, 256))]
        elif kind == "truncate" and size > 1:
            del data[max(1, at):]
        elif kind == "donor" and donors:
            donor = rng.choice(donors).data
            start = rng.randrange(len(donor))
            data[at:at + rng.choice((0, 0, 8, 64))] = donor[start:start + rng.choice((4, 32, 256, 512))]
        else:
            continue
        notes.append(f"{kind}@{at}")


# ------------------------------------------------------------------------------------------------ pickles


def _glob(module: str, name: str) -> bytes:
    return hostile.glob(module, name)


PICKLE_PIECES = (
    hostile.PROTO2, b"\x80\x04", b"\x80\x05", b"(", b")", b"]", b"}", b"t", b"\x85", b"\x86", b"\x87", b"l", b"d",
    b"e", b"a", b"s", b"u", b"R", b"b", b"0", b"1", b"2", b"N", b"\x88", b"\x89", b"K\x01", b"K\xff", b"M\xff\xff",
    b"J\xff\xff\xff\xff", b"J\x00\x00\x00\x80", b"q\x00", b"q\x01", b"h\x00", b"h\x01", b"r\x00\x00\x00\x00",
    b"r\xff\xff\xff\x7f", b"j\x00\x00\x00\x00", b"j\x01\x00\x00\x00", b"\x94", b"\x8f", b"\x90", b"\x91", b"\x93",
    b"\x81", b"\x92", b"Q", b"P0\n", b"\x8a\x01\xff", b"\x8a\x09" + b"\xff" * 9, b"\x8b\x00\x00\x00\x00",
    b"G\x7f\xf8\x00\x00\x00\x00\x00\x00", b"I01\n", b"I010\n", b"L5L\n", b"F1e400\n", b"S'x'\n", b"Vx\n",
    b"p0\n", b"p4294967296\n", b"g0\n", b"\x82\x01", b"i__builtin__\nset\n", b"o",
    b"\x95\x00\x00\x00\x00\x00\x00\x00\x00", b"\x95\x10\x00\x00\x00\x00\x00\x00\x00",
    b"\x95\xff\xff\xff\xff\xff\xff\xff\x7f", b"\x96\x00\x00\x00\x00\x00\x00\x00\x00", b"\x97", b"\x98",
    b"B\x04\x00\x00\x00abcd", b"C\x02ab", b"\x8e\x00\x00\x00\x00\x00\x00\x00\x00", b"\x8c\x03abc",
    b"\x8d\x00\x00\x00\x00\x00\x00\x00\x00", b"X\xff\xff\xff\x7f", b"T\x00\x00\x00\x00", b"U\x00",
    hostile.text("storage"), hostile.text("cpu"), hostile.text("0"), hostile.text("os"), hostile.text("system"),
    hostile.text("torch._utils"), hostile.text("_rebuild_tensor_v2"), hostile.text("collections"),
    hostile.text("OrderedDict"), b"\x8c\x0ccollections\x94\x8c\x0bOrderedDict\x94\x93",
    _glob("collections", "OrderedDict"), _glob("torch._utils", "_rebuild_tensor_v2"), _glob("torch", "FloatStorage"),
    _glob("torch", "HalfStorage"), _glob("torch", "Size"), _glob("torch", "device"), _glob("builtins", "set"),
    _glob("builtins", "getattr"), _glob("argparse", "Namespace"), _glob("_codecs", "encode"), _glob("os", "system"),
    _glob("torch._utils", "_rebuild_parameter"), _glob("torch._tensor", "_rebuild_from_type_v2"),
    _glob("torch._utils", "_rebuild_sparse_tensor"), _glob("torch._utils", "_rebuild_qtensor"),
    _glob("torch.serialization", "_get_layout"), _glob("numpy.core.multiarray", "_reconstruct"),
    _glob("pathlib", "PosixPath"), _glob("__builtin__", "set"),
    hostile.storage_pid(4), hostile.storage_pid(1 << 40), hostile.storage_pid(4, key="1", storage="LongStorage"),
    hostile.rebuild(), hostile.rebuild(offset=3), hostile.rebuild(shape=(2, 2), stride=(0, 1)),
    hostile.rebuild(numel=1 << 30, shape=(1 << 30,)), hostile.ordered_dict(), b".",
)
# the opcodes whose argument is a little-endian integer of this width (a memo index, a length, a value)
INT_ARGS = {ord("K"): 1, ord("M"): 2, ord("J"): 4, ord("q"): 1, ord("h"): 1, ord("r"): 4, ord("j"): 4, ord("X"): 4,
            0x8C: 1, ord("B"): 4, ord("C"): 1, 0x8E: 8, 0x8D: 8, 0x95: 8, 0x96: 8, ord("T"): 4, ord("U"): 1,
            0x8A: 1, 0x8B: 4, 0x80: 1, 0x82: 1, 0x83: 2, 0x84: 4}


def opcode_starts(blob: bytes) -> list[int]:
    """Where each opcode of a pickle starts (as far as pickletools reads it), and where it ends."""
    starts: list[int] = []
    try:
        for _, _, position in pickletools.genops(io.BytesIO(blob)):
            starts.append(position or 0)
    except Exception:  # noqa: BLE001 — a broken pickle: its opcodes up to the break
        pass
    return starts + [len(blob)] if starts else [0, len(blob)]


def mutate_pickle(rng: random.Random, blob: bytes, donors: list[bytes], notes: list[str]) -> bytes:
    data = bytearray(blob)
    for _ in range(rng.choice((1, 1, 1, 2, 3))):
        starts = opcode_starts(bytes(data))
        i = rng.randrange(len(starts) - 1)
        begin, end = starts[i], starts[i + 1]
        kind = rng.choice(("delete", "duplicate", "swap", "insert", "insert", "replace", "int", "int", "int",
                           "global", "donor", "truncate"))
        if kind == "delete":
            del data[begin:end]
        elif kind == "duplicate":
            data[end:end] = data[begin:end]
        elif kind == "swap" and i + 2 < len(starts):
            after = starts[i + 2]
            data[begin:after] = data[end:after] + data[begin:end]
        elif kind == "insert":
            data[begin:begin] = rng.choice(PICKLE_PIECES)
        elif kind == "replace":
            data[begin:end] = rng.choice(PICKLE_PIECES)
        elif kind == "int":
            width = INT_ARGS.get(data[begin]) if begin < len(data) else None
            if width is None:
                candidates = [s for s in starts[:-1] if s < len(data) and data[s] in INT_ARGS]
                if not candidates:
                    continue
                begin = rng.choice(candidates)
                width = INT_ARGS[data[begin]]
            old = int.from_bytes(data[begin + 1:begin + 1 + width], "little")
            value = _interesting(rng, old) & ((1 << 8 * width) - 1)
            data[begin + 1:begin + 1 + width] = value.to_bytes(width, "little")
        elif kind == "global":
            data[begin:end] = rng.choice([p for p in PICKLE_PIECES if p[:1] == b"c"])
        elif kind == "donor" and donors:
            donor = rng.choice(donors)
            donor_starts = opcode_starts(donor)
            j = rng.randrange(len(donor_starts) - 1)
            k = min(len(donor_starts) - 1, j + rng.choice((1, 2, 4, 16)))
            data[begin:begin] = donor[donor_starts[j]:donor_starts[k]]
        elif kind == "truncate":
            del data[begin:]
        else:
            continue
        notes.append(f"pickle-{kind}@{begin}")
    return bytes(data)


# ------------------------------------------------------------------------------------------------ zips

CENTRAL_FIELDS = {"version": (4, 2), "needed": (6, 2), "flags": (8, 2), "method": (10, 2), "crc": (16, 4),
                  "compressed": (20, 4), "size": (24, 4), "name_length": (28, 2), "extra_length": (30, 2),
                  "comment_length": (32, 2), "disk": (34, 2), "offset": (42, 4)}
LOCAL_FIELDS = {"needed": (4, 2), "flags": (6, 2), "method": (8, 2), "crc": (14, 4), "compressed": (18, 4),
                "size": (22, 4), "name_length": (26, 2), "extra_length": (28, 2)}
END_FIELDS = {"disk": (4, 2), "cd_disk": (6, 2), "entries_here": (8, 2), "entries": (10, 2), "cd_size": (12, 4),
              "cd_offset": (16, 4), "comment_length": (20, 2)}
NAME_TRICKS: tuple[Callable[[str], str], ...] = (
    str.upper, lambda n: n.replace("/", "\\"), lambda n: "../" + n, lambda n: "/" + n, lambda n: n + "\x00x",
    lambda n: n.split("/", 1)[-1], lambda n: "other/" + n.split("/", 1)[-1], lambda n: n + "/",
    lambda n: n.replace("data.pkl", "DATA.PKL"), lambda n: n.replace("data", "da\u0130ta"), lambda n: n * 2,
    lambda n: n.replace("/", "/./"), lambda n: n[:-1],
)


def _records(data: bytes) -> tuple[int | None, list[int], list[int]]:
    """The end record's offset, each central record's offset, and each local header's offset."""
    end = data.rfind(b"PK\x05\x06")
    if end < 0:
        return None, [], []
    central: list[int] = []
    local: list[int] = []
    position = data.rfind(b"PK\x01\x02", 0, end)
    try:
        cd_offset = struct.unpack_from("<I", data, end + 16)[0]
        position = cd_offset if data[cd_offset:cd_offset + 4] == b"PK\x01\x02" else position
        while 0 <= position < end and data[position:position + 4] == b"PK\x01\x02" and len(central) < 4096:
            central.append(position)
            lengths = struct.unpack_from("<HHH", data, position + 28)
            local.append(struct.unpack_from("<I", data, position + 42)[0])
            position += 46 + sum(lengths)
    except struct.error:
        pass
    return end, central, local


def mutate_zip_fields(rng: random.Random, data: bytearray, notes: list[str]) -> None:
    end, central, local = _records(bytes(data))
    choices = [("end", end, END_FIELDS)] if end is not None else []
    choices += [("central", at, CENTRAL_FIELDS) for at in central]
    choices += [("local", at, LOCAL_FIELDS) for at in local if 0 <= at < len(data) - 30]
    if not choices:
        return
    for _ in range(rng.choice((1, 1, 2))):
        where, at, fields = rng.choice(choices)
        name = rng.choice(list(fields))
        offset, width = fields[name]
        if at + offset + width > len(data):
            continue
        old = int.from_bytes(data[at + offset:at + offset + width], "little")
        if name == "method":
            value = rng.choice((0, 8, 12, 14, 93, 99, 1))
        elif name == "flags":
            value = old ^ rng.choice((1, 8, 0x40, 0x800, 0x2000))
        else:
            value = _interesting(rng, old) & ((1 << 8 * width) - 1)
        data[at + offset:at + offset + width] = value.to_bytes(width, "little")
        notes.append(f"zip-{where}-{name}={value}")


def mutate_members(rng: random.Random, seed: Seed, donors: list[Seed], pickle_donors: list[bytes],
                   notes: list[str]) -> bytes:
    """The seed's members, edited, written again as a stored zip by hand (CRCs right unless a field edit says)."""
    members = [hostile.Member(name, data) for name, data in seed.members]
    for _ in range(rng.choice((1, 1, 2))):
        if not members:
            break
        i = rng.randrange(len(members))
        kind = rng.choice(("pickle", "pickle", "pickle", "pickle", "rename", "drop", "duplicate", "reorder", "donor",
                           "deflate", "local_name"))
        pickled = [j for j, m in enumerate(members) if m.name.endswith(".pkl")]
        if kind == "pickle" and pickled:
            j = rng.choice(pickled)
            members[j].data = mutate_pickle(rng, members[j].data, pickle_donors, notes)
            continue
        if kind == "rename":
            members[i].name = rng.choice(NAME_TRICKS)(members[i].name)
        elif kind == "drop":
            del members[i]
        elif kind == "duplicate":
            members.insert(rng.randrange(len(members) + 1), hostile.Member(members[i].name, members[i].data))
        elif kind == "reorder":
            rng.shuffle(members)
        elif kind == "donor":
            donor = rng.choice([d for d in donors if d.members] or [seed])
            if donor.members:
                name, data = rng.choice(donor.members)
                members.insert(rng.randrange(len(members) + 1), hostile.Member(name, data))
        elif kind == "deflate":
            members[i].method = 8
        elif kind == "local_name":
            members[i].local_name = rng.choice(NAME_TRICKS)(members[i].name)
        else:
            continue
        notes.append(f"member-{kind}#{i}")
    return hostile.make_zip(members)


# ------------------------------------------------------------------------------------------------ safetensors

DTYPES = ("F64", "F32", "F16", "BF16", "I64", "I32", "I16", "I8", "U8", "U16", "U32", "U64", "BOOL", "F8_E4M3",
          "F8_E5M2", "F8_E8M0", "F4", "F6_E2M3", "C64", "X", "", "f32", 4, None)
ODD_SHAPES: tuple[object, ...] = ([], [0], [-1], [1.0], ["1"], [[1]], [True], [1 << 63], [1 << 64],
                                  [1 << 32, 1 << 32], [1] * 65, [3, 0, 1 << 62], None, "4", {})
JSON_TOKENS = (" ", "\t", "\n", '"', "{", "}", "[", "]", ",", ":", "1e400", "-0", "18446744073709551616",
               "9223372036854775808", "-9223372036854775809", "1.0", "1E1", "01", "null", "true", "NaN", "Infinity",
               '"\\u0000"', '"\\ud800"', '"\\udfff\\ud800"', '"\\/"', "\\", "\x00", "\xff", "\u00e9", '""',
               '"__metadata__"', '{"dtype":"F32","shape":[1],"data_offsets":[0,4]}', '"dtype"', '"shape"',
               '"data_offsets"', "[0,4]", '"F32"', "\ufeff")


def _header_text(pairs: list[tuple[str, object]], rng: random.Random) -> str:
    """A JSON object of ``pairs`` (duplicates kept, as a hostile writer can)."""
    separator = rng.choice((",", ", ", ",\n"))
    ascii_only = rng.random() < 0.7
    return "{" + separator.join(f"{json.dumps(k, ensure_ascii=ascii_only)}:{json.dumps(v, ensure_ascii=ascii_only)}"
                                for k, v in pairs) + "}"


def mutate_safetensors(rng: random.Random, seed: Seed, notes: list[str]) -> bytes:
    data = seed.data
    (length,) = struct.unpack_from("<Q", data)
    raw, body = data[8:8 + length], bytearray(data[8 + length:])
    try:
        header = json.loads(raw)
        pairs = list(header.items()) if isinstance(header, dict) else []
    except (ValueError, RecursionError):  # a hostile header: edited as text
        pairs = []
    if pairs and rng.random() < 0.6:
        for _ in range(rng.choice((1, 1, 2))):
            i = rng.randrange(len(pairs))
            name, entry = pairs[i]
            entry = dict(entry) if isinstance(entry, dict) else entry
            kind = rng.choice(("dtype", "shape", "offsets", "offsets", "keys", "name", "duplicate", "metadata",
                               "drop", "swap"))
            if kind == "dtype" and isinstance(entry, dict):
                entry["dtype"] = rng.choice(DTYPES)
            elif kind == "shape" and isinstance(entry, dict):
                shape = entry.get("shape")
                entry["shape"] = rng.choice(ODD_SHAPES) if rng.random() < 0.5 or not isinstance(shape, list) else \
                    [_interesting(rng, s) if isinstance(s, int) else s for s in shape]
            elif kind == "offsets" and isinstance(entry, dict):
                offsets = entry.get("data_offsets")
                offsets = list(offsets) if isinstance(offsets, list) else [0, 0]
                choice = rng.randrange(5)
                if choice == 0 and len(offsets) == 2:
                    offsets.reverse()
                elif choice == 1 and offsets and isinstance(offsets[-1], int):
                    offsets[rng.randrange(len(offsets))] = _interesting(rng, offsets[-1])
                elif choice == 2:
                    offsets = rng.choice(([0], [0, 4, 8], [-1, 3], [1.5, 2], None, [0, 1 << 64], ["0", "4"]))
                elif choice == 3 and len(offsets) == 2 and all(isinstance(o, int) for o in offsets):
                    shift = rng.choice((-4, -1, 1, 4))
                    offsets = [offsets[0] + shift, offsets[1] + shift]
                else:
                    offsets = [0, 0]
                entry["data_offsets"] = offsets
            elif kind == "keys" and isinstance(entry, dict):
                if entry and rng.random() < 0.5:
                    del entry[rng.choice(list(entry))]
                else:
                    entry[rng.choice(("extra", "dtype ", "Shape"))] = 1
            elif kind == "name":
                name = rng.choice(("", "\x00", "\ud800", "a" * 5000, "__metadata__", "x.\u202eevil", name.upper(),
                                   name + "\n"))
            elif kind == "duplicate":
                pairs.insert(rng.randrange(len(pairs) + 1), (name if rng.random() < 0.5 else name + "_2", entry))
            elif kind == "metadata":
                pairs.insert(0, ("__metadata__", rng.choice(({"a": 1}, [], "x", {"a": {"b": "c"}}, None,
                                                             {"format": "pt", "ckptool.aliases": "{"},
                                                             {"ckptool.aliases": '{"x": 1}'}, {"\ud800": "\x00"}))))
            elif kind == "drop":
                del pairs[i]
                notes.append(f"st-{kind}#{i}")
                break
            elif kind == "swap" and len(pairs) > 1:
                j = rng.randrange(len(pairs))
                pairs[i], pairs[j] = pairs[j], pairs[i]
            if kind not in ("duplicate", "metadata", "swap"):
                pairs[i] = (name, entry)
            notes.append(f"st-{kind}#{i}")
        text = _header_text(pairs, rng)
        try:
            raw = text.encode("utf-8", "surrogatepass")
        except UnicodeEncodeError:
            raw = text.encode("utf-8", "replace")
    else:
        text_bytes = bytearray(raw)
        for _ in range(rng.choice((1, 1, 2, 3))):
            at = rng.randrange(len(text_bytes) + 1)
            kind = rng.choice(("token", "token", "delete", "duplicate"))
            if kind == "token":
                text_bytes[at:at] = rng.choice(JSON_TOKENS).encode("utf-8", "surrogatepass")
            elif kind == "delete":
                del text_bytes[at:at + rng.choice((1, 2, 8))]
            else:
                start = rng.randrange(len(text_bytes) + 1)
                text_bytes[at:at] = text_bytes[start:start + rng.choice((8, 32, 128))]
            notes.append(f"st-text-{kind}@{at}")
        raw = bytes(text_bytes)
    if rng.random() < 0.3:  # the data section, cut or grown
        if rng.random() < 0.5 and body:
            del body[rng.randrange(len(body)):]
        else:
            body += rng.randbytes(rng.choice((1, 4, 64)))
        notes.append("st-body")
    declared = len(raw)
    if rng.random() < 0.15:
        declared = _interesting(rng, declared)
        notes.append(f"st-length={declared}")
    elif rng.random() < 0.1:
        raw += b" " * rng.choice((1, 7))
        declared = len(raw)
        notes.append("st-padded")
    return struct.pack("<Q", declared & ((1 << 64) - 1)) + raw + bytes(body)


# ------------------------------------------------------------------------------------------------ the choice


def mutate(rng: random.Random, seed: Seed, seeds: list[Seed], pickle_donors: list[bytes]) -> tuple[bytes, list[str]]:
    """One mutant of ``seed`` and the notes of what was done (for the finding's record)."""
    notes: list[str] = []
    if seed.kind == "zip" and seed.members and rng.random() < 0.55:
        data = bytearray(mutate_members(rng, seed, seeds, pickle_donors, notes))
        if rng.random() < 0.3:
            mutate_zip_fields(rng, data, notes)
    elif seed.kind == "zip" and rng.random() < 0.5:
        data = bytearray(seed.data)
        mutate_zip_fields(rng, data, notes)
    elif seed.kind == "safetensors" and rng.random() < 0.8:
        data = bytearray(mutate_safetensors(rng, seed, notes))
    elif seed.kind in ("legacy", "pickle") and seed.pickles and rng.random() < 0.7:
        start, end = rng.choice(seed.pickles)
        blob = mutate_pickle(rng, seed.data[start:end], pickle_donors, notes)
        data = bytearray(seed.data[:start] + blob + seed.data[end:])
        if seed.kind == "pickle" and rng.random() < 0.4:  # as a zip's data.pkl: through the whole load
            data = bytearray(hostile.make_zip(hostile.torch_members(bytes(data), {"0": hostile.FOUR_FLOATS})))
            notes.append("as-data.pkl")
    else:
        data = bytearray(seed.data)
    if not notes or rng.random() < 0.2:
        mutate_bytes(rng, data, seed.hot, seeds, notes)
    return bytes(data[:MAX_MUTANT]), notes


def pickle_blobs(seeds: list[Seed]) -> list[bytes]:
    """Every whole pickle among the seeds (raw, a legacy file's, a zip's .pkl members): donors of opcodes."""
    blobs = []
    for seed in seeds:
        blobs += [seed.data[start:end] for start, end in seed.pickles]
        blobs += [data for name, data in seed.members if name.endswith(".pkl")]
    return [blob for blob in blobs if len(blob) <= 1 << 20]

