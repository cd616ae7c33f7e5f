"""The hostile corpus: files built to attack ckptool, generated fresh into a directory for each test run.

``build_corpus(directory)`` writes every case and returns a list of :class:`Case`. Nothing here runs a
payload: pickles are assembled opcode by opcode (or by ``pickle.dumps`` of an object whose
``__reduce__`` *names* the payload), zips are written byte by byte, so every trick is exactly the one
intended. Each executable payload, if anything ever ran it, creates ``Case.canary`` (a file under
``directory/canary/``); the tests assert that directory stays empty.

Expectations:
    ``unsafe``  a recognised malicious pickle: ``scan`` exits 1, every other command exits 3.
    ``refuse``  corrupt, hostile or not a checkpoint: every command exits 3, ``scan`` included.

Also here: :func:`good_zip` / :func:`good_legacy` (the valid checkpoints the structural cases are
mutated from; torch.load(weights_only=True) reads them, see test_hostile.py) and
:func:`write_good_checkpoint` (a real torch.save'd file, e.g. the second argument of ``diff``).
"""

from __future__ import annotations

import json
import os
import pickle
import random
import stat
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path

UNSAFE, REFUSE = "unsafe", "refuse"
MAGIC_NUMBER = 0x1950A86A20F9469CFC6C  # torch's legacy-format magic number
LEGACY_PROTOCOL = 1001


@dataclass(frozen=True)
class Case:
    """One hostile input: its name, where it is, what every command must do, and its canary."""

    name: str
    path: Path
    expect: str
    canary: Path | None = None  # created by the payload if it ever runs

    def __str__(self) -> str:  # pytest ids
        return self.name


# ------------------------------------------------------------------------------------------------
# pickle opcodes (protocol 2 unless stated): each helper returns bytes that push one value


PROTO2 = b"\x80\x02"
STOP = b"."


def text(value: str) -> bytes:
    data = value.encode("utf-8")
    return b"X" + struct.pack("<I", len(data)) + data  # BINUNICODE


def raw_bytes(value: bytes) -> bytes:
    return b"B" + struct.pack("<I", len(value)) + value  # BINBYTES (protocol 3)


def integer(value: int) -> bytes:
    if 0 <= value < 256:
        return b"K" + bytes([value])
    if -(2**31) <= value < 2**31:
        return b"J" + struct.pack("<i", value)
    data = pickle.encode_long(value)
    return b"\x8a" + bytes([len(data)]) + data  # LONG1


def glob(module: str, name: str) -> bytes:
    return b"c" + module.encode() + b"\n" + name.encode() + b"\n"  # GLOBAL


def tup(*items: bytes) -> bytes:
    return b"(" + b"".join(items) + b"t"


def lst(*items: bytes) -> bytes:
    return b"](" + b"".join(items) + b"e"


def dct(*pairs: tuple[bytes, bytes]) -> bytes:
    return b"}(" + b"".join(k + v for k, v in pairs) + b"u"


def call(function: bytes, *args: bytes) -> bytes:
    return function + tup(*args) + b"R"  # REDUCE


def whole(body: bytes) -> bytes:
    return PROTO2 + body + STOP


def ordered_dict() -> bytes:
    return call(glob("collections", "OrderedDict"))


def storage_pid(numel: int, key: str = "0", storage: str = "FloatStorage", legacy: bool = False) -> bytes:
    fields = [text("storage"), glob("torch", storage), text(key), text("cpu"), integer(numel)]
    if legacy:
        fields.append(b"N")  # view metadata
    return tup(*fields) + b"Q"  # BINPERSID


def rebuild(numel: int = 4, offset: int = 0, shape: tuple[int, ...] = (4,), stride: tuple[int, ...] = (1,),
            legacy: bool = False, offset_op: bytes | None = None) -> bytes:
    """``torch._utils._rebuild_tensor_v2(storage, offset, shape, stride, False, OrderedDict())``."""
    return call(glob("torch._utils", "_rebuild_tensor_v2"), storage_pid(numel, legacy=legacy),
                offset_op if offset_op is not None else integer(offset),
                tup(*map(integer, shape)), tup(*map(integer, stride)), b"\x89", ordered_dict())


def doubled(seed: bytes, times: int, make: bytes) -> bytes:
    """``seed`` wrapped ``times`` times as ``make`` of two memo references to the previous level:
    ``times`` levels of pickle, 2**times values for anything that walks it without a memo."""
    out = seed + b"r" + struct.pack("<I", 0) + b"0"  # LONG_BINPUT 0, POP
    for level in range(times):
        get = b"j" + struct.pack("<I", level)  # LONG_BINGET
        pair = {b"t": b"(" + get + get + b"t", b"l": b"(" + get + get + b"l"}[make]
        out += pair + b"r" + struct.pack("<I", level + 1) + b"0"
    return out + b"j" + struct.pack("<I", times)


# ------------------------------------------------------------------------------------------------
# containers: a torch zip, a legacy stream, a raw pickle, safetensors


@dataclass
class Member:
    """A zip member as written; every field can lie."""

    name: str
    data: bytes
    local_name: str | None = None  # the name in the local header (default: name)
    crc: int | None = None  # default: the real CRC
    method: int = 0  # 0 stored, 8 deflated
    flags: int = 0x800
    stored: bytes | None = None  # the bytes in the archive (default: data, deflated if method 8)
    central_size: int | None = None  # file size claimed by the central directory
    header_offset: int | None = None  # offset claimed by the central directory


def make_zip(members: list[Member], *, raw_prefix: bytes = b"") -> bytes:
    """A zip written by hand: local headers, data, central directory, end record."""
    out = bytearray(raw_prefix)
    central = bytearray()
    for member in members:
        stored = member.stored
        if stored is None:
            stored = member.data
            if member.method == 8:
                compressor = zlib.compressobj(9, zlib.DEFLATED, -15)
                stored = compressor.compress(member.data) + compressor.flush()
        crc = zlib.crc32(member.data) if member.crc is None else member.crc
        local_name = (member.local_name if member.local_name is not None else member.name).encode()
        name = member.name.encode()
        offset = len(out)
        out += struct.pack("<IHHHHHIIIHH", 0x04034B50, 20, member.flags, member.method, 0, 0x21, crc, len(stored),
                           len(member.data), len(local_name), 0) + local_name + stored
        size = len(member.data) if member.central_size is None else member.central_size
        central += struct.pack("<IHHHHHHIIIHHHHHII", 0x02014B50, 20, 20, member.flags, member.method, 0, 0x21, crc,
                               len(stored), size, len(name), 0, 0, 0, 0, 0,
                               offset if member.header_offset is None else member.header_offset) + name
    start = len(out)
    out += central
    out += struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, len(members), len(members), len(central), start, 0)
    return bytes(out)


def torch_members(data_pkl: bytes, storages: dict[str, bytes] | None = None, top: str = "archive") -> list[Member]:
    members = [Member(f"{top}/data.pkl", data_pkl), Member(f"{top}/byteorder", b"little")]
    members += [Member(f"{top}/data/{key}", data) for key, data in (storages or {}).items()]
    members += [Member(f"{top}/version", b"3\n"), Member(f"{top}/.data/serialization_id", b"0" * 40)]
    return members


FOUR_FLOATS = struct.pack("<4f", 1.0, 2.0, 3.0, 4.0)


def good_zip_pickle(**rebuild_args: object) -> bytes:
    return whole(dct((text("weight"), rebuild(**rebuild_args))))


def good_zip() -> bytes:
    """A valid torch zip checkpoint ``{"weight": tensor([1., 2., 3., 4.])}`` written by hand."""
    return make_zip(torch_members(good_zip_pickle(), {"0": FOUR_FLOATS}))


def legacy_stream(main: bytes, keys: list[str], storages: bytes = b"", *, magic: bytes | None = None,
                  version: int = LEGACY_PROTOCOL, little_endian: bool = True) -> bytes:
    """torch's pre-1.6 stream: magic, protocol, system info, the object pickle, storage keys, storages."""
    sys_info = {"protocol_version": LEGACY_PROTOCOL, "little_endian": little_endian,
                "type_sizes": {"short": 2, "int": 4, "long": 4}}
    head = magic if magic is not None else pickle.dumps(MAGIC_NUMBER, protocol=2)
    return head + pickle.dumps(version, protocol=2) + pickle.dumps(sys_info, protocol=2) + main + \
        pickle.dumps(keys, protocol=2) + storages


def good_legacy() -> bytes:
    """A valid legacy checkpoint ``{"weight": tensor([1., 2., 3., 4.])}`` written by hand."""
    main = whole(dct((text("weight"), rebuild(legacy=True))))
    return legacy_stream(main, ["0"], struct.pack("<q", 4) + FOUR_FLOATS)


def safetensors_file(header: object, data: bytes = b"", *, length: int | None = None) -> bytes:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    return struct.pack("<Q", len(raw) if length is None else length) + raw + data


def f32(shape: list[int], begin: int, end: int) -> dict:
    return {"dtype": "F32", "shape": shape, "data_offsets": [begin, end]}


def write_good_checkpoint(path: Path) -> Path:
    """A real ``torch.save``'d state dict (torch imported here only)."""
    import torch

    torch.save({"fc.weight": torch.arange(6.0).reshape(2, 3), "fc.bias": torch.zeros(2)}, path)
    return path


# ------------------------------------------------------------------------------------------------
# payloads: bytes pushing a value whose construction would run code and create the canary


def payloads(canary_dir: Path) -> dict[str, tuple[bytes, Path]]:
    """name -> (opcodes pushing the malicious value, the canary it would create)."""
    out: dict[str, tuple[bytes, Path]] = {}

    def add(name: str, make) -> None:  # noqa: ANN001 — make(canary path) -> opcodes
        canary = canary_dir / name
        out[name] = (make(str(canary)), canary)

    def touch(c: str) -> bytes:
        return text(f"touch '{c}'")

    def py_open(c: str) -> bytes:
        return text(f"open({c!r}, 'w').close()")

    def import_os() -> bytes:
        return call(glob("builtins", "__import__"), text("os"))

    add("os_system", lambda c: call(glob("os", "system"), touch(c)))
    add("posix_system", lambda c: call(glob("posix", "system"), touch(c)))
    add("nt_system", lambda c: call(glob("nt", "system"), touch(c)))
    add("subprocess_popen", lambda c: call(glob("subprocess", "Popen"), lst(text("touch"), text(c))))
    add("subprocess_check_output", lambda c: call(glob("subprocess", "check_output"), lst(text("touch"), text(c))))
    add("subprocess_run", lambda c: call(glob("subprocess", "run"), lst(text("touch"), text(c))))
    add("builtins_eval", lambda c: call(glob("builtins", "eval"), py_open(c)))
    add("builtins_exec", lambda c: call(glob("builtins", "exec"), py_open(c)))
    add("builtins_compile", lambda c: call(glob("builtins", "exec"),
                                           call(glob("builtins", "compile"), py_open(c), text("<x>"), text("exec"))))
    add("builtins_open", lambda c: call(glob("builtins", "open"), text(c), text("w")))
    add("builtins_getattr", lambda c: call(call(glob("builtins", "getattr"), import_os(), text("system")), touch(c)))
    add("builtin_py2_import", lambda c: call(call(glob("__builtin__", "getattr"),
                                                  call(glob("__builtin__", "__import__"), text("os")),
                                                  text("system")), touch(c)))
    add("functools_partial", lambda c: call(glob("functools", "partial"), glob("os", "system"), touch(c)) + b")R")
    add("operator_attrgetter", lambda c: call(call(call(glob("operator", "attrgetter"), text("system")), import_os()),
                                              touch(c)))
    add("operator_methodcaller", lambda c: call(call(glob("operator", "methodcaller"), text("system"), touch(c)),
                                                import_os()))
    add("runpy_run_code", lambda c: call(glob("runpy", "_run_code"), py_open(c), dct()))
    add("pkgutil_resolve_name", lambda c: call(call(glob("pkgutil", "resolve_name"), text("os:system")), touch(c)))
    add("pickle_loads", lambda c: call(glob("pickle", "loads"), raw_bytes(whole(call(glob("os", "system"), touch(c))))))
    add("_pickle_loads", lambda c: call(glob("_pickle", "loads"), raw_bytes(whole(call(glob("os", "system"), touch(c))))))
    # BUILD on a module: replace torch._utils' rebuild function with os.system, then call it
    add("build_on_module", lambda c: glob("torch", "_utils") + dct((text("_rebuild_tensor_v2"), glob("os", "system")))
        + b"b0" + call(glob("torch._utils", "_rebuild_tensor_v2"), touch(c)))
    return out


class _Reduce:
    """An object that pickles as ``callable(*args)`` — pickle.dumps writes it, nothing calls it."""

    def __init__(self, callable_: object, args: tuple) -> None:
        self.callable, self.args = callable_, args

    def __reduce__(self) -> tuple:
        return self.callable, self.args


# ------------------------------------------------------------------------------------------------
# the corpus


def build_corpus(directory: Path) -> list[Case]:
    """Write every hostile case under ``directory`` and return them (~175 cases)."""
    directory.mkdir(parents=True, exist_ok=True)
    canary_dir = directory / "canary"
    canary_dir.mkdir(exist_ok=True)
    files = directory / "files"
    files.mkdir(exist_ok=True)
    cases: list[Case] = []

    def add(name: str, content: bytes, expect: str, canary: Path | None = None, suffix: str = ".pt") -> Path:
        path = files / f"{name}{suffix}"
        path.write_bytes(content)
        cases.append(Case(name, path, expect, canary))
        return path

    # -- the same payloads in a torch zip, a legacy file and a raw pickle ------------------------
    for name, (body, canary) in payloads(canary_dir).items():
        add(f"zip_{name}", make_zip(torch_members(whole(dct((text("weight"), body))))), UNSAFE, canary)
        add(f"legacy_{name}", legacy_stream(whole(body), []), UNSAFE, canary)
        add(f"raw_{name}", whole(body), UNSAFE, canary, suffix=".pkl")

    # -- every protocol, as Python's own pickler writes it (os.system is posix.system on Linux) ----
    for protocol in range(6):
        canary = canary_dir / f"protocol{protocol}"
        data = pickle.dumps(_Reduce(os.system, (f"touch '{canary}'",)), protocol=protocol)
        add(f"raw_protocol{protocol}", data, UNSAFE, canary, suffix=".pkl")
        add(f"legacy_protocol{protocol}", legacy_stream(data, []), UNSAFE, canary)
    canary = canary_dir / "inst"
    add("raw_inst", b"(S'touch " + str(canary).encode() + b"'\nios\nsystem\n.", UNSAFE, canary, suffix=".pkl")
    canary = canary_dir / "obj"
    add("raw_obj", b"(cos\nsystem\nS'touch " + str(canary).encode() + b"'\no.", UNSAFE, canary, suffix=".pkl")
    canary = canary_dir / "stack_global_memo"
    memo_global = (b"\x80\x04\x8c\x02os\x94\x8c\x06system\x94000h\x00h\x01\x93"  # names via MEMOIZE, then GET
                   + tup(text(f"touch '{canary}'")) + b"R")
    add("zip_stack_global_memo", make_zip(torch_members(b"\x80\x04" + dct((text("weight"), memo_global[2:])) + STOP)),
        UNSAFE, canary)
    add("raw_stack_global_memo", memo_global + STOP, UNSAFE, canary, suffix=".pkl")
    # the payload in the magic-number pickle, before anything torch-like
    body, canary = payloads(canary_dir)["os_system"]
    add("legacy_magic_bypass", legacy_stream(whole(dct()), [], magic=whole(body)), UNSAFE, canary)
    # a benign data.pkl with a second, malicious pickle after its STOP (torch never reads it; scan shows it)
    add("zip_pickle_after_stop", make_zip(torch_members(good_zip_pickle() + whole(body), {"0": FOUR_FLOATS})),
        UNSAFE, canary)
    add("raw_pickle_after_stop", whole(integer(1)) + whole(body), UNSAFE, canary, suffix=".pkl")
    add("raw_plain_pickle", whole(dct((text("weight"), integer(1)))), REFUSE, suffix=".pkl")

    # -- pickles that only name allowed globals but attack the reader ------------------------------
    def zip_with(data_pkl: bytes, storages: dict[str, bytes] | None = None) -> bytes:
        return make_zip(torch_members(data_pkl, {"0": FOUR_FLOATS} if storages is None else storages))

    moved = dct((text("offset"), integer(10**6)), (text("shape"), tup(integer(10**6))))
    add("build_on_tensor", zip_with(whole(dct((text("weight"), rebuild() + moved + b"b")))), REFUSE)
    defaults = tup(b"N", dct((text("__defaults__"), tup(integer(1)))))
    add("build_on_allowed_function", zip_with(whole(glob("torch._utils", "_rebuild_tensor_v2") + defaults + b"b0"
                                                    + dct((text("weight"), rebuild())))), REFUSE)
    renamed = tup(b"N", dct((text("module"), text("os")), (text("name"), text("system"))))
    add("build_on_storage_class", zip_with(whole(glob("torch", "FloatStorage") + renamed + b"b0"
                                                 + dct((text("weight"), rebuild())))), REFUSE)
    add("storage_larger_than_stored", zip_with(good_zip_pickle(numel=1000)), REFUSE)
    add("offset_outside_storage", zip_with(good_zip_pickle(offset=100)), REFUSE)
    add("stride_outside_storage", zip_with(good_zip_pickle(shape=(4,), stride=(100,))), REFUSE)
    add("negative_stride", zip_with(good_zip_pickle(stride=(-1,))), REFUSE)
    add("negative_size", zip_with(good_zip_pickle(shape=(-4,))), REFUSE)
    add("negative_offset", zip_with(good_zip_pickle(offset=-1)), REFUSE)
    add("shape_stride_mismatch", zip_with(good_zip_pickle(shape=(2, 2), stride=(1,))), REFUSE)
    add("dimension_over_int64", zip_with(good_zip_pickle(shape=(0, 2**64), stride=(1, 1))), REFUSE)
    add("storage_missing", zip_with(good_zip_pickle(), {}), REFUSE)
    weight = (text("weight"), rebuild())

    def zip_dict(*pairs: tuple[bytes, bytes]) -> bytes:
        return zip_with(whole(dct(*pairs)))

    list_bomb = doubled(lst(), 60, b"l")  # 60 levels of pickle, 2**60 lists when walked without a memo
    add("persistent_id_bomb", zip_dict((text("weight"), list_bomb + b"Q")), REFUSE)
    add("offset_repr_bomb", zip_with(good_zip_pickle(offset_op=list_bomb)), REFUSE)
    add("device_repr_bomb", zip_dict(weight, (text("device"), call(glob("torch", "device"), list_bomb))), REFUSE)
    add("list_expansion_bomb", zip_dict(weight, (text("history"), list_bomb)), REFUSE)
    add("tuple_hash_bomb", zip_dict(weight, (doubled(tup(integer(1)), 60, b"t"), integer(0))), REFUSE)
    add("deep_tuple_key", zip_dict(weight, (b")" + b"\x85" * 100_000, integer(0))), REFUSE)
    deep_key = b"K\x01" + b"\x85" * 990  # two equal keys: comparing them recursed past Python's limit
    add("deep_equal_tuple_keys", zip_with(whole(dct(weight) + b"(" + deep_key + b"N" + deep_key + b"Nu")), REFUSE)
    add("deep_nesting", zip_dict(weight, (text("deep"), b"]" * 100_000 + b"a" * 99_999)), REFUSE)
    modulus = (1 << 61) - 1  # hash(n) == hash(n + k * modulus): every key lands in one slot
    flood = b"".join(integer(5 + k * modulus) + b"N" for k in range(20_000))
    add("int_hash_flood", zip_with(whole(dct(weight) + b"(" + flood + b"u")), REFUSE)
    colliding = b"](" + b"".join(integer(5 + k * modulus) for k in range(5_000)) + b"e"
    add("set_hash_flood", zip_dict(weight, (text("ids"), call(glob("builtins", "set"), colliding))), REFUSE)
    add("memo_index_bomb", zip_with(PROTO2 + b"Nr" + struct.pack("<I", 0xFFFFFFF0) + b"0" + dct(weight) + STOP), REFUSE)
    add("memo_text_put_bomb", zip_with(b"Np99999999999\n0" + dct(weight) + STOP), REFUSE)
    add("octal_int_key", zip_with(whole(dct(weight) + b"I010\nNs")), REFUSE)
    add("frame_length_lie", zip_with(b"\x80\x04\x95" + struct.pack("<Q", 1 << 40)
                                     + good_zip_pickle()[2:]), REFUSE)
    add("unknown_opcode", zip_with(PROTO2 + b"\xff" + STOP), REFUSE)
    add("truncated_pickle", zip_with(good_zip_pickle()[:-20]), REFUSE)
    add("empty_pickle", zip_with(b""), REFUSE)
    add("stack_underflow", zip_with(PROTO2 + b"t" + STOP), REFUSE)
    add("persistent_module_record", zip_dict((text("weight"), tup(text("module"), text("x")) + b"Q")), REFUSE)

    # -- zip tricks -----------------------------------------------------------------------------
    base = torch_members(good_zip_pickle(), {"0": FOUR_FLOATS})

    def variant(change) -> bytes:  # noqa: ANN001 — change(list of Member) mutates it
        members = [Member(**vars(m)) for m in base]
        change(members)
        return make_zip(members)

    add("zip_encrypted_flag", variant(lambda m: setattr(m[0], "flags", 0x801)), REFUSE)
    add("zip_compressed_storage", variant(lambda m: setattr(m[2], "method", 8)), REFUSE)
    add("zip_stored_size_lie", variant(lambda m: setattr(m[2], "central_size", 1 << 30)), REFUSE)
    add("zip_offset_outside", variant(lambda m: setattr(m[2], "header_offset", 0xFFFF0000)), REFUSE)
    add("zip_no_datapkl", variant(lambda m: m.pop(0)), REFUSE)
    add("zip_two_folders", variant(lambda m: m.append(Member("other/data.pkl", whole(integer(1))))), REFUSE)
    add("zip_torchscript_markers", variant(lambda m: m.append(Member("archive/constants.pkl", whole(tup())))), REFUSE)
    good = good_zip()
    central = good.rfind(b"PK\x01\x02")
    add("zip_truncated_central_directory", good[: central + 20], REFUSE)
    add("zip_truncated_storage", good[: good.find(FOUR_FLOATS) + 8], REFUSE)
    add("zip_empty_archive", make_zip([]), REFUSE)
    # 200 MB of zeros deflated to 200 kB, sizes declared honestly in the central directory
    add("zip_deflate_bomb_datapkl", make_zip([Member("archive/data.pkl", b"", method=8, stored=_deflate_zeros(200 << 20),
                                                     central_size=200 << 20, crc=0)] + base[1:]), REFUSE)
    add("zip_deflate_lies_small", variant(lambda m: (setattr(m[0], "method", 8),
                                                     setattr(m[0], "stored", _deflate_zeros(64 << 20)))), REFUSE)
    # member B's local header sits inside member A's data: one byte range counted twice
    inner_name = b"archive/data/1"
    inner = struct.pack("<IHHHHHIIIHH", 0x04034B50, 20, 0x800, 0, 0, 0x21, zlib.crc32(FOUR_FLOATS), 16, 16,
                        len(inner_name), 0) + inner_name + FOUR_FLOATS
    data = make_zip([Member(**vars(m)) for m in base] + [Member("archive/data/2", inner)])
    add("zip_overlapping_members", _with_extra_central(data, Member("archive/data/1", FOUR_FLOATS), data.find(inner)),
        REFUSE)

    # -- legacy tricks ----------------------------------------------------------------------------
    legacy_main = whole(dct((text("weight"), rebuild(legacy=True))))
    add("legacy_numel_mismatch", legacy_stream(legacy_main, ["0"], struct.pack("<q", 99) + FOUR_FLOATS), REFUSE)
    add("legacy_truncated_storage", legacy_stream(legacy_main, ["0"], struct.pack("<q", 4) + FOUR_FLOATS[:6]), REFUSE)
    add("legacy_keys_not_strings", legacy_stream(legacy_main, [1]), REFUSE)  # type: ignore[list-item]
    add("legacy_unknown_key", legacy_stream(legacy_main, ["0", "7"], struct.pack("<q", 4) + FOUR_FLOATS), REFUSE)
    add("legacy_bad_protocol", legacy_stream(legacy_main, ["0"], version=7), REFUSE)
    add("legacy_big_endian", legacy_stream(legacy_main, ["0"], little_endian=False), REFUSE)
    add("legacy_pickle_only", whole(dct((text("weight"), integer(1)))), REFUSE, suffix=".pkl")
    add("legacy_string_bomb", legacy_stream(PROTO2 + b"\x8e" + struct.pack("<Q", 1 << 62) + STOP, []), REFUSE)

    # -- safetensors ----------------------------------------------------------------------------
    sixteen = bytes(16)
    add("st_header_length_zero", safetensors_file(b"{}", length=0), REFUSE, suffix=".safetensors")
    add("st_header_past_file", safetensors_file({"w": f32([4], 0, 16)}, sixteen, length=10_000),
        REFUSE, suffix=".safetensors")
    add("st_header_length_max", safetensors_file(b"{}", length=2**64 - 1), REFUSE, suffix=".safetensors")
    add("st_header_over_100mb", safetensors_file(b"{}", length=100_000_001), REFUSE, suffix=".safetensors")
    add("st_invalid_utf8", safetensors_file(b'{"\xff\xfe": 1}'), REFUSE, suffix=".safetensors")
    add("st_invalid_json", safetensors_file(b'{"w": '), REFUSE, suffix=".safetensors")
    add("st_entry_not_an_object", safetensors_file({"w": [1, 2]}), REFUSE, suffix=".safetensors")
    add("st_overlapping", safetensors_file({"a": f32([4], 0, 16), "b": f32([4], 8, 24)}, bytes(24)),
        REFUSE, suffix=".safetensors")
    add("st_reversed_offsets", safetensors_file({"a": f32([4], 16, 0)}, sixteen), REFUSE, suffix=".safetensors")
    add("st_gap", safetensors_file({"a": f32([2], 0, 8), "b": f32([2], 12, 20)}, bytes(20)),
        REFUSE, suffix=".safetensors")
    add("st_trailing_bytes", safetensors_file({"a": f32([4], 0, 16)}, sixteen + b"extra"), REFUSE,
        suffix=".safetensors")
    add("st_data_short", safetensors_file({"a": f32([4], 0, 16)}, sixteen[:10]), REFUSE, suffix=".safetensors")
    add("st_unknown_dtype", safetensors_file({"a": {"dtype": "F128", "shape": [1], "data_offsets": [0, 16]}},
                                             sixteen), REFUSE, suffix=".safetensors")
    for kind, dtype in (("list", ["F32"]), ("object", {"F32": 1}), ("number", 5)):  # unhashable or no name
        add(f"st_dtype_{kind}", safetensors_file({"a": {"dtype": dtype, "shape": [4], "data_offsets": [0, 16]}},
                                                 sixteen), REFUSE, suffix=".safetensors")
    add("st_offsets_not_ints", safetensors_file({"a": {"dtype": "F32", "shape": [4], "data_offsets": [0.0, 16]}},
                                                sixteen), REFUSE, suffix=".safetensors")
    add("st_shape_overflow", safetensors_file({"a": f32([2**40, 2**40], 0, 16)}, sixteen), REFUSE,
        suffix=".safetensors")
    add("st_zero_dim_overflow", safetensors_file({"a": f32([0, 2**64], 0, 0)}), REFUSE, suffix=".safetensors")
    add("st_shape_offset_mismatch", safetensors_file({"a": f32([3], 0, 16)}, sixteen), REFUSE,
        suffix=".safetensors")
    add("st_negative_dim", safetensors_file({"a": f32([-4], 0, 16)}, sixteen), REFUSE, suffix=".safetensors")
    add("st_metadata_not_strings", safetensors_file({"__metadata__": {"a": 1}, "w": f32([4], 0, 16)}, sixteen),
        REFUSE, suffix=".safetensors")
    add("st_huge_integer", safetensors_file(b'{"w": {"dtype": "F32", "shape": [' + b"9" * 5000 + b'], '
                                            b'"data_offsets": [0, 16]}}', sixteen), REFUSE, suffix=".safetensors")
    add("st_deep_json", safetensors_file(b'{"w": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"), REFUSE,
        suffix=".safetensors")
    add("st_alias_not_a_name", safetensors_file({"__metadata__": {"ckptool.aliases": '{"b": ["a"]}'},
                                                 "a": f32([4], 0, 16)}, sixteen), REFUSE, suffix=".safetensors")
    add("st_alias_missing_target", safetensors_file({"__metadata__": {"ckptool.aliases": '{"b": "zz"}'},
                                                     "a": f32([4], 0, 16)}, sixteen), REFUSE, suffix=".safetensors")
    add("st_alias_deep_json", safetensors_file({"__metadata__": {"ckptool.aliases": "[" * 100_000},
                                                "a": f32([4], 0, 16)}, sixteen), REFUSE, suffix=".safetensors")
    index_dir = directory / "sharded_escape"
    index_dir.mkdir(exist_ok=True)
    (index_dir / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": "../outside.safetensors"}}))
    cases.append(Case("st_index_escapes_directory", index_dir, REFUSE))
    missing_dir = directory / "sharded_missing"
    missing_dir.mkdir(exist_ok=True)
    (missing_dir / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": "gone.safetensors"}}))
    cases.append(Case("st_index_missing_shard", missing_dir, REFUSE))

    # -- torch.distributed.checkpoint directories: the .metadata pickle ----------------------------
    for name, metadata, expect in (("dcp_metadata_os_system", whole(body), UNSAFE),
                                   ("dcp_metadata_list_bomb", whole(list_bomb), REFUSE),
                                   ("dcp_metadata_garbage", b"\x80\x02garbage", REFUSE),
                                   ("dcp_metadata_empty", b"", REFUSE)):
        dcp_dir = directory / name
        dcp_dir.mkdir(exist_ok=True)
        (dcp_dir / ".metadata").write_bytes(metadata)
        (dcp_dir / "__0_0.distcp").write_bytes(good_zip())
        cases.append(Case(name, dcp_dir, expect, canary if expect == UNSAFE else None))

    # -- not checkpoints at all ------------------------------------------------------------------
    rng = random.Random(0)
    add("empty_file", b"", REFUSE)
    add("random_bytes", bytes(rng.randrange(256) for _ in range(4096)), REFUSE)
    add("png_image", b"\x89PNG\r\n\x1a\n" + bytes(64), REFUSE, suffix=".png")
    add("text_file", b"Hello, this is a README and not a checkpoint.\n", REFUSE, suffix=".txt")
    add("json_file", b'{"not": "an index"}', REFUSE, suffix=".json")
    add("gzip_file", b"\x1f\x8b\x08\x00" + bytes(32), REFUSE, suffix=".gz")
    add("numpy_file", b"\x93NUMPY\x01\x00" + bytes(64), REFUSE, suffix=".npy")
    empty_dir = directory / "empty_directory"
    empty_dir.mkdir(exist_ok=True)
    cases.append(Case("directory", empty_dir, REFUSE))
    cases.append(Case("missing_path", directory / "does-not-exist.pt", REFUSE))
    fifo = directory / "fifo.pt"
    if hasattr(os, "mkfifo") and not fifo.exists():
        os.mkfifo(fifo)
    if fifo.exists():
        cases.append(Case("fifo", fifo, REFUSE))
    device_link = directory / "dev_zero.pt"
    if Path("/dev/zero").exists() and not device_link.is_symlink():
        device_link.symlink_to("/dev/zero")
    if device_link.is_symlink():
        cases.append(Case("device_file", device_link, REFUSE))
    unreadable = add("unreadable_file", good_zip(), REFUSE)
    unreadable.chmod(0)
    if os.geteuid() == 0:  # root reads it anyway: not a hostile case there
        unreadable.chmod(stat.S_IRUSR | stat.S_IWUSR)
        cases.pop()
    cases += _files_cases(directory, canary_dir)
    cases += _values_cases(directory)
    cases += _contract_cases(files, canary_dir)
    cases += _bounds_cases(directory, canary_dir)
    cases += _zip_members_cases(directory, canary_dir)
    cases += _formats_cases(directory, canary_dir)
    cases += _carry_cases(directory)
    cases += _emit_cases(directory)
    return cases


def _files_cases(directory: Path, canary_dir: Path) -> list[Case]:
    """Folder inputs whose files are not what a folder holds: a FIFO shard, a shard and a folder's
    one safetensors linked outside the folder, a DCP ``.metadata`` linked to a file outside (whose
    text holds a payload marker: if it were ever read, its bytes would show in the error)."""
    cases: list[Case] = []
    outside = directory / "outside_the_folders"
    outside.mkdir(exist_ok=True)
    first = safetensors_file({"w": f32([4], 0, 16)}, bytes(16))
    (outside / "model-00001-of-00002.safetensors").write_bytes(first)
    secret = outside / "passwd"
    secret.write_text("root:x:0:0:pwned:/root:/bin/sh\n")
    index = json.dumps({"weight_map": {"w": "model-00001-of-00002.safetensors", "v": "model-00002-of-00002.safetensors"}})

    def sharded(name: str) -> Path:
        folder = directory / name
        folder.mkdir(exist_ok=True)
        (folder / "model.safetensors.index.json").write_text(index)
        (folder / "model-00002-of-00002.safetensors").write_bytes(safetensors_file({"v": f32([4], 0, 16)}, bytes(16)))
        return folder

    linked = sharded("files_shard_linked_outside")
    if not (linked / "model-00001-of-00002.safetensors").is_symlink():
        (linked / "model-00001-of-00002.safetensors").symlink_to(outside / "model-00001-of-00002.safetensors")
    cases.append(Case("files_shard_linked_outside", linked, REFUSE))
    if hasattr(os, "mkfifo"):
        fifo = sharded("files_fifo_shard")
        if not (fifo / "model-00001-of-00002.safetensors").exists():
            os.mkfifo(fifo / "model-00001-of-00002.safetensors")
        cases.append(Case("files_fifo_shard", fifo, REFUSE))
    single = directory / "files_only_safetensors_linked_outside"
    single.mkdir(exist_ok=True)
    if not (single / "model.safetensors").is_symlink():
        (single / "model.safetensors").symlink_to(outside / "model-00001-of-00002.safetensors")
    cases.append(Case("files_only_safetensors_linked_outside", single, REFUSE))
    dcp_dir = directory / "files_dcp_metadata_linked_outside"
    dcp_dir.mkdir(exist_ok=True)
    if not (dcp_dir / ".metadata").is_symlink():
        (dcp_dir / ".metadata").symlink_to(secret)
    (dcp_dir / "__0_0.distcp").write_bytes(good_zip())
    cases.append(Case("files_dcp_metadata_linked_outside", dcp_dir, REFUSE))
    return cases


def _values_cases(directory: Path) -> list[Case]:
    """Files torch.load(weights_only=True) reads whose values ckptool cannot give exactly: refused.

    (Files whose bits ckptool applies, and the differential against torch, are in test_differential.py.)
    """
    storages = {"0": FOUR_FLOATS}
    weight = (text("weight"),)

    def tensor_with_metadata(metadata: bytes, storage: str = "FloatStorage") -> bytes:
        return call(glob("torch._utils", "_rebuild_tensor_v2"), storage_pid(4, storage=storage), integer(0),
                    tup(integer(4)), tup(integer(1)), b"\x89", ordered_dict(), metadata)

    def parameter_with_state(state: bytes) -> bytes:
        return call(glob("torch._utils", "_rebuild_parameter_with_state"), rebuild(), b"\x89", ordered_dict(), state)

    made = {
        # an OrderedDict whose BUILD state shadows its items(): readers calling .items() would see none
        "values_ordered_dict_shadows_items": whole(dct((text("model"), ordered_dict()
            + b"(" + text("weight") + rebuild() + b"u" + dct((text("items"), b"]")) + b"b"))),
        # parameter state that replaces the weights (param.data = zeros) or overwrites them (param.real)
        "values_parameter_state_data": whole(dct((text("weight"), parameter_with_state(
            dct((text("data"), rebuild())))))),
        "values_parameter_state_real_in_slots": whole(dct((text("weight"), parameter_with_state(
            tup(b"N", dct((text("real"), rebuild()))))))),
        # metadata ckptool cannot apply exactly: an unknown key, a negative bit torch cannot resolve
        "values_metadata_unknown_key": whole(dct((*weight, tensor_with_metadata(dct((text("zero"), b"\x88")))))),
        "values_metadata_neg_on_bool": whole(dct((*weight, tensor_with_metadata(dct((text("neg"), b"\x88")),
                                                                                 "BoolStorage")))),
        "values_metadata_not_a_dict": whole(dct((*weight, tensor_with_metadata(lst(text("neg")))))),
    }
    cases = []
    for name, data_pkl in made.items():
        path = directory / "files" / f"{name}.pt"
        bools = {"0": b"\x01\x00\x01\x00"}  # the bool tensor's own storage (4 bytes, as torch checks)
        path.write_bytes(make_zip(torch_members(data_pkl, bools if "bool" in name else storages)))
        cases.append(Case(name, path, REFUSE))
    return cases


def _contract_cases(directory: Path, canary_dir: Path) -> list[Case]:
    """Inputs aimed at the output contract: element counts past int64, names made to drive a terminal."""
    cases = []

    def add(name: str, content: bytes, expect: str, canary: Path | None = None) -> None:
        path = directory / f"{name}.pt"
        path.write_bytes(content)
        cases.append(Case(name, path, expect, canary))

    # stride 0: no bytes needed, so only the element count (2^64) can refuse it
    add("numel_2_64_stride_0", make_zip(torch_members(good_zip_pickle(shape=(1 << 32, 1 << 32), stride=(0, 0)),
                                                      {"0": FOUR_FLOATS})), REFUSE)
    # a global whose name holds a lone surrogate (pickle's own writer emits it with surrogatepass)
    name = b"sys\xed\xa0\x80tem"
    surrogate = text("os") + b"\x8c" + bytes([len(name)]) + name + b"\x93" + tup(text("true")) + b"R"
    add("surrogate_global_name", make_zip(torch_members(b"\x80\x04" + dct((text("weight"), surrogate)) + STOP)),
        UNSAFE)
    # os.system beside a global whose name moves the cursor up and prints a clean verdict
    canary = canary_dir / "escape_global"
    body = tup(call(glob("os", "system"), text(f"touch '{canary}'")),
               glob("builtins", "\x1b[1A\x1b[2K\rsafe (torch-zip)\x1b]0;title\x07"))
    add("escape_sequence_global", make_zip(torch_members(whole(dct((text("weight"), body))))), UNSAFE, canary)
    return cases


# ------------------------------------------------------------------------------------------------
# bounded resources: few bytes that would become many GB of memory, time or output


def stride0_zip(count: int, numel: int, value: float = 1e5) -> bytes:
    """A torch zip of ``count`` distinct stride-0 views (``numel - k`` elements each) of one stored float."""
    pairs = [(text(f"w{k}"), call(glob("torch._utils", "_rebuild_tensor_v2"), storage_pid(1), integer(0),
                                  tup(integer(numel - k)), tup(integer(0)), b"\x89", ordered_dict()))
             for k in range(count)]
    return make_zip(torch_members(whole(dct(*pairs)), {"0": struct.pack("<f", value)}))


def dcp_directory(path: Path, size: list[int], chunks: list[tuple[list[int], list[int], bytes]]) -> Path:
    """A DCP checkpoint of one float32 tensor ``w`` of ``size`` saved as ``chunks`` ``(offsets, sizes,
    torch.save archive)``, every archive in ``__0_0.distcp``; the metadata is DCP's own classes, pickled."""
    import torch
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, Metadata, MetadataIndex,
                                                       TensorProperties, TensorStorageMetadata)

    path.mkdir(parents=True, exist_ok=True)
    data, storage_data, listed, placed = bytearray(), {}, [], {}
    for offsets, sizes, archive in chunks:
        listed.append(ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes)))
        if archive not in placed:  # one copy of each distinct archive
            placed[archive] = len(data)
            data += archive
        # keyed by identity here (colliding offsets would make this dict quadratic); pickled as DCP's own
        storage_data[_AsPickled(MetadataIndex("w", torch.Size(offsets)))] = _StorageInfo(
            "__0_0.distcp", placed[archive], len(archive))
    entry = TensorStorageMetadata(properties=TensorProperties(dtype=torch.float32), size=torch.Size(size),
                                  chunks=listed)
    metadata = Metadata(state_dict_metadata={"w": entry}, planner_data={"w": ("w",)}, storage_data=storage_data)
    (path / ".metadata").write_bytes(pickle.dumps(metadata, protocol=2))
    (path / "__0_0.distcp").write_bytes(bytes(data))
    return path


class _AsPickled:
    """Pickles as the object it wraps (the pickler checks ``__class__``), hashes by identity."""

    def __init__(self, wrapped: object) -> None:
        self.wrapped = wrapped

    @property  # type: ignore[misc]
    def __class__(self) -> type:  # noqa: D105
        return type(self.wrapped)

    def __reduce_ex__(self, protocol: int) -> object:
        return self.wrapped.__reduce_ex__(protocol)


def colliding_pairs(count: int) -> list[tuple[int, int]]:
    """``count`` pairs of non-negative ints under 2**62 whose tuples all have one ``hash`` (CPython's
    xxHash-based tuple hash inverted for the second item; ints hash to themselves mod 2**61 - 1)."""
    mask, modulus = (1 << 64) - 1, (1 << 61) - 1
    prime1, prime2, prime5 = 11400714785074694791, 14029467366897019727, 2870177450012600261

    def after_first(a: int) -> int:
        lane = (prime5 + (a % modulus) * prime2) & mask
        return ((((lane << 31) | (lane >> 33)) & mask) * prime1) & mask

    inverse = pow(prime2, -1, 1 << 64)
    target = after_first(0)  # the state of (0, 0) before its second rotation
    pairs, a = [(0, 0)], 1
    while len(pairs) < count:
        b = ((target - after_first(a)) * inverse) & mask
        if b < modulus:  # an int hashes to b only if b < 2**61 - 1
            pairs.append((a, b))
        a += 1
    return pairs


def _expanded_archive(numel: int) -> bytes:
    """``torch.save`` of one float expanded (stride 0) to ``numel`` elements: ~1.5 KB."""
    import io

    import torch

    buffer = io.BytesIO()
    torch.save(torch.ones(1).expand(numel), buffer)
    return buffer.getvalue()


def _bounds_cases(directory: Path, canary_dir: Path) -> list[Case]:
    """Inputs of a few KB to a few MB that every command must refuse quickly and in bounded memory."""
    folder = directory / "bounds"
    folder.mkdir(exist_ok=True)
    cases: list[Case] = []

    def add(name: str, content: bytes) -> None:
        path = folder / f"{name}.pt"
        path.write_bytes(content)
        cases.append(Case(name, path, REFUSE))

    # 16 chunks of 2 KB whose stride-0 views "hold" 256 MiB each: assembling them allocated 4 GiB
    numel = 64 << 20
    archive = _expanded_archive(numel)
    cases.append(Case("dcp_stride0_chunks", dcp_directory(
        folder / "dcp_stride0_chunks", [16 * numel], [([k * numel], [numel], archive) for k in range(16)]), REFUSE))
    # a data.pkl deflated ~25:1 (under the old 100:1 bound): minutes of opcodes per MB of file
    rng = random.Random(2)
    soup = b"".join(b"N0" * rng.randint(20, 60) + b"K" + bytes([rng.randrange(256)]) + b"0" for _ in range(40_000))
    members = torch_members(whole(dct((text("weight"), rebuild()), (text("junk"), b"N0" + soup + b"N"))),
                            {"0": FOUR_FLOATS})
    members[0].method = 8
    add("zip_deflated_pickle_25_to_1", make_zip(members))
    # one 1 MiB string referenced 300 times: 1 MiB of pickle, 300 MiB for json/repr/a safetensors header
    shared = text("x" * (1 << 20)) + b"r" + struct.pack("<I", 1)
    add("pickle_shared_string", make_zip(torch_members(whole(dct(
        (text("weight"), rebuild()), (text("names"), b"](" + shared + (b"j" + struct.pack("<I", 1)) * 299 + b"e"))),
        {"0": FOUR_FLOATS})))
    # two equal dict keys nested 990 tuples deep: comparing them recursed to Python's limit, so which refusal a
    # reader gave depended on how deep its stack already was; the one within a frame's cut LONG_BINPUT hid a 2 GiB memo
    deep_key = b"K\x01" + b"\x85" * 990
    add("pickle_deep_equal_tuple_keys", make_zip(torch_members(whole(dct(
        (text("weight"), rebuild()), (text("k"), b"}" + deep_key + b"Ns" + deep_key + b"Ns"))), {"0": FOUR_FLOATS})))
    body = b"}Nr\x00\x00\x00"
    add("pickle_frame_cut_memo_index", make_zip(torch_members(
        b"\x80\x04\x95" + struct.pack("<Q", len(body)) + body + b"\x000\x8c\x08\x00\x00\x00\x04xxxx0.")))
    return cases


def _zip_members_cases(directory: Path, canary_dir: Path) -> list[Case]:
    """Zips whose members torch locates differently from a strict zip reader: their pickles are judged.

    torch finds members by the central directory (never comparing the local header's name), ignores
    CRCs, compares names ignoring ASCII case and picks one of several same-named members by its zip
    library's sort order; a pickle it would run is therefore scanned (exit 1), never called corrupt.
    """
    files = directory / "zip_members"
    files.mkdir(exist_ok=True)
    body, canary = payloads(canary_dir)["os_system"]
    hostile_pickle = whole(dct((text("weight"), body)))

    def members(change) -> list[Member]:  # noqa: ANN001 — change(list of Member) mutates it
        listed = torch_members(good_zip_pickle(), {"0": FOUR_FLOATS})
        change(listed)
        return listed

    def payload_as_datapkl(**fields: object):  # noqa: ANN202
        return lambda m: m.__setitem__(0, Member("archive/data.pkl", hostile_pickle, **fields))

    specs = [
        # torch reads (one of) the duplicates; scan reads both, loading refuses the ambiguity
        ("zip_duplicate_datapkl", lambda m: m.append(Member("archive/data.pkl", hostile_pickle))),
        ("zip_duplicate_datapkl_by_case", lambda m: m.append(Member("archive/DATA.pkl", hostile_pickle))),
        ("zip_local_name_differs", payload_as_datapkl(local_name="archive/data.pkx")),
        ("zip_bad_crc_datapkl", payload_as_datapkl(crc=0x12345678)),
        ("zip_datapkl_upper_case", lambda m: m.__setitem__(0, Member("archive/DATA.PKL", hostile_pickle))),
        # torch never reads these (it finds no data.pkl, or refuses a member outside the folder); scan still judges them
        ("zip_datapkl_behind_dotdot", lambda m: m.__setitem__(0, Member("archive/data/../data.pkl", hostile_pickle))),
        ("zip_absolute_member", lambda m: m.append(Member("/tmp/evil.pkl", whole(body)))),
        ("zip_payload_named_like_storage_folder", lambda m: m.append(Member("other/evil", whole(body)))),
    ]
    cases = []
    for name, change in specs:
        path = files / f"{name}.pt"
        path.write_bytes(make_zip(members(change)))
        cases.append(Case(name, path, UNSAFE, canary))
    return cases


def _formats_cases(directory: Path, canary_dir: Path) -> list[Case]:
    """TorchScript archives and sharded .bin folders that lie: a payload in the module pickle or a shard,
    a class whose code restores its state itself, an attribute the pickle lacks, code that is not text;
    an index naming a shard outside its folder, a missing shard, a FIFO shard, a shard linked outside,
    a tensor its shard lacks. (scan calls every TorchScript archive unsafe: torch.jit.load builds its
    ``__torch__`` classes and runs their code.)"""
    import re
    import zipfile

    cases: list[Case] = []
    where = directory / "formats"
    where.mkdir(exist_ok=True)
    body, canary = payloads(canary_dir)["os_system"]
    real = _torchscript_archive(where / "torchscript_real.pt")
    if real is not None:
        with zipfile.ZipFile(real) as archive:
            members = {info.filename: archive.read(info) for info in archive.infolist()}
        top = next(iter(members)).split("/", 1)[0]
        code = next(name for name in members if name.endswith(".py"))

        def archive_with(name: str, expect: str, change: dict[str, bytes], case_canary: Path | None = None) -> None:
            path = where / f"{name}.pt"
            with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as archive:
                for member, data in {**members, **change}.items():
                    archive.writestr(member, data)
            cases.append(Case(name, path, expect, case_canary))

        # the module's "training" flag (BINUNICODE, BINPUT n, NEWTRUE) becomes os.system(...)
        data_pkl = members[f"{top}/data.pkl"]
        flagged = re.sub(rb"(training(?:q.)?)\x88", lambda m: m.group(1) + body, data_pkl, count=1, flags=re.S)
        if flagged != data_pkl:
            archive_with("ts_os_system_in_module", UNSAFE, {f"{top}/data.pkl": flagged}, canary)
        source = members[code].decode()
        archive_with("ts_class_restores_itself", UNSAFE,
                     {code: (source + "  def __setstate__(self, state: Tuple[Tensor, Tensor]) -> NoneType:\n"
                                      "    return None\n").encode()})
        archive_with("ts_attribute_not_pickled", UNSAFE,
                     {code: source.replace("  weight : Tensor\n", "  weight : Tensor\n  ghost : Tensor\n").encode()})
        archive_with("ts_code_not_text", UNSAFE, {code: b"\xff\xfe" + members[code]})

    outside = where / "outside"
    outside.mkdir(exist_ok=True)
    (outside / "pytorch_model-00001-of-00002.bin").write_bytes(good_zip())
    two = {"weight": "pytorch_model-00001-of-00002.bin", "other": "pytorch_model-00002-of-00002.bin"}
    second = make_zip(torch_members(whole(dct((text("other"), rebuild()))), {"0": FOUR_FLOATS}))

    def repo(name: str, weight_map: dict[str, str], expect: str = REFUSE, first: bytes | None = None,
             case_canary: Path | None = None) -> Path:
        folder = where / name
        folder.mkdir(exist_ok=True)
        (folder / "pytorch_model.bin.index.json").write_text(json.dumps({"weight_map": weight_map}))
        (folder / "pytorch_model-00002-of-00002.bin").write_bytes(second)
        if first is not None:
            (folder / "pytorch_model-00001-of-00002.bin").write_bytes(first)
        cases.append(Case(name, folder, expect, case_canary))
        return folder

    repo("bin_index_names_a_shard_outside", {**two, "weight": "../outside/pytorch_model-00001-of-00002.bin"})
    repo("bin_shard_missing", two)
    repo("bin_tensor_not_in_its_shard", {**two, "ghost": "pytorch_model-00002-of-00002.bin"}, first=good_zip())
    repo("bin_shard_payload", two, UNSAFE, make_zip(torch_members(whole(dct((text("weight"), body))))), canary)
    linked = repo("bin_shard_linked_outside", two)
    if not (linked / "pytorch_model-00001-of-00002.bin").is_symlink():
        (linked / "pytorch_model-00001-of-00002.bin").symlink_to(outside / "pytorch_model-00001-of-00002.bin")
    if hasattr(os, "mkfifo"):
        fifo = repo("bin_shard_fifo", two)
        if not (fifo / "pytorch_model-00001-of-00002.bin").exists():
            os.mkfifo(fifo / "pytorch_model-00001-of-00002.bin")
    return cases


def _carry_cases(directory: Path) -> list[Case]:
    """safetensors files whose ckptool.entries metadata (the container around the weights) is hostile:
    a global the encoding never carries, nesting past any stack, a hash-collision flood, too many values."""
    weights = {"weight": f32([1], 0, 4)}

    def entries_text(node: str) -> str:
        return '{"$ckptool":"entries","version":1,"container":{"model":{"$ckptool":"weights"},"x":' + node + "}}"

    made = {
        "carry_global_os_system": entries_text('{"$ckptool":"object","global":"os.system","build":"reduce",'
                                               '"args":["touch /tmp/ckptool-carry-canary"]}'),
        "carry_deep_nesting": entries_text("[" * 50_000 + "]" * 50_000),
        "carry_hash_collisions": entries_text('{"$ckptool":"set","items":['
                                              + ",".join(str(i * (2**61 - 1)) for i in range(1, 5000)) + "]}"),
        "carry_too_many_values": entries_text("[" + ",".join(["0"] * 1_100_000) + "]"),
        "carry_weights_inside_a_key": entries_text('{"$ckptool":"dict","items":[[{"$ckptool":"weights"},1]]}'),
    }
    cases = []
    for name, value in made.items():
        path = directory / "files" / f"{name}.safetensors"
        path.write_bytes(safetensors_file({"__metadata__": {"ckptool.entries": value}, **weights}, FOUR_FLOATS[:4]))
    return cases


def _emit_cases(directory: Path) -> list[Case]:
    """Objects of a class allowed by default (argparse.Namespace) given their parts out of pickle's
    order — state twice, items after the state: no pickler writes them, a rewrite could not keep
    them, so every command refuses the file."""
    namespace = glob("argparse", "Namespace") + b")\x81"  # EMPTY_TUPLE NEWOBJ
    state = dct((text("lr"), integer(1)))
    made = {
        "emit_state_twice": namespace + state + b"b" + state + b"b",
        "emit_items_after_state": namespace + state + b"b" + b"(" + text("x") + b"e",  # MARK item APPENDS
    }
    cases = []
    for name, thing in made.items():
        path = directory / "files" / f"{name}.pt"
        data_pkl = whole(dct((text("weight"), rebuild()), (text("args"), thing)))
        path.write_bytes(make_zip(torch_members(data_pkl, {"0": FOUR_FLOATS})))
        cases.append(Case(name, path, REFUSE))
    return cases


def _deflate_zeros(size: int) -> bytes:
    compressor = zlib.compressobj(9, zlib.DEFLATED, -15)
    chunk = bytes(1 << 20)
    out = [compressor.compress(chunk) for _ in range(size >> 20)]
    return b"".join(out) + compressor.flush()


def _with_extra_central(data: bytes, member: Member, offset: int) -> bytes:
    """Append a central-directory record for ``member`` at ``offset`` (inside another member's data)."""
    end = data.rfind(b"PK\x05\x06")
    count, central_size, central_start = struct.unpack("<HII", data[end + 10 : end + 20])
    name = member.name.encode()
    record = struct.pack("<IHHHHHHIIIHHHHHII", 0x02014B50, 20, 20, 0x800, 0, 0, 0x21, zlib.crc32(member.data),
                         len(member.data), len(member.data), len(name), 0, 0, 0, 0, 0, offset) + name
    tail = struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, count + 1, count + 1, central_size + len(record),
                       central_start, 0)
    return data[:end] + record + tail


def _torchscript_archive(path: Path) -> Path | None:
    """A real torch.jit.save archive (None if TorchScript is unavailable)."""
    try:
        import torch

        torch.jit.save(torch.jit.script(torch.nn.Linear(2, 2)), str(path))
    except Exception:  # TorchScript is optional in some torch builds
        return None
    return path
