"""The format registry: the one place formats are named, and enough to add a format with one file and one line."""

from __future__ import annotations

import ast
import json
import math
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch

import ckptool
from ckptool import formats

PACKAGE = Path(ckptool.__file__).resolve().parent
# what scan calls a file before it is read, besides the registered names (torch_zip, torch_legacy)
SCAN_KINDS = {"torchscript", "pickle"}


def _format_names() -> set[str]:
    return {fmt.name for fmt in formats.registered()} | SCAN_KINDS


def _constants(node: ast.AST) -> list[str]:
    """The string constants ``node`` is, or holds as a tuple, list or set literal."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, ast.Tuple | ast.List | ast.Set):
        return [value for element in node.elts for value in _constants(element)]
    return []


def _branches_on_format_names(source: str, names: set[str]) -> list[tuple[int, str]]:
    """Comparisons (``==``, ``in``, ``match``/``case``, ``startswith``/``endswith``) against a format name."""
    found = []
    for node in ast.walk(ast.parse(source)):
        operands: list[ast.AST] = []
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                and node.func.attr in ("startswith", "endswith"):
            operands = list(node.args)
        elif isinstance(node, ast.MatchValue):
            operands = [node.value]
        for operand in operands:
            for value in _constants(operand):
                if value in names:
                    found.append((node.lineno, value))
    return found


def test_only_the_registry_names_formats() -> None:
    names = _format_names()
    assert {"torch-zip", "torch-legacy", "safetensors", "safetensors-sharded", "dcp"} <= names
    offenders = []
    for module in sorted(PACKAGE.rglob("*.py")):
        relative = module.relative_to(PACKAGE)
        if relative.parts[0] == "formats":
            continue
        for line, name in _branches_on_format_names(module.read_text(), names):
            offenders.append(f"ckptool/{relative.as_posix()}:{line} compares with {name!r}")
    assert not offenders, "branch on a capability of formats.for_name(...) instead:\n" + "\n".join(offenders)


def test_the_check_finds_each_kind_of_branch() -> None:
    source = textwrap.dedent("""
        if checkpoint.format == "dcp": pass
        if kind in ("torch-zip", "torchscript"): pass
        if fmt.startswith("safetensors"): pass
        match fmt:
            case "torch-legacy": pass
        if suffix == ".safetensors" or to == "pt": pass
    """)
    found = _branches_on_format_names(source, _format_names())
    assert sorted(found) == [(2, "dcp"), (3, "torch-zip"), (3, "torchscript"), (4, "safetensors"), (6, "torch-legacy")]


# A format added as one module and one registry line: a magic line, a JSON line of
# {name: [dtype, shape]}, then each tensor's bytes in that order.
TOY_MODULE = """
import json
import math
from pathlib import Path

from ckptool.tensors import dtypes
from ckptool.base.errors import InputError
from ckptool.formats import Contents, Format, ReadOptions
from ckptool.tensors.refs import StorageRef, TensorRef, contiguous_stride
from ckptool.files.ranges import ByteRange

MAGIC = b"TOYCKPT1\\n"


def sniff(head, path):
    return head is not None and head.startswith(MAGIC)


def read(path: Path, options: ReadOptions) -> Contents:
    handle = options.handle
    handle.seek(len(MAGIC))
    try:
        header = json.loads(handle.readline())
    except ValueError as e:
        raise InputError("toy header is not JSON", path=path) from e
    position = handle.tell()
    tensors = {}
    for name, (dtype_name, shape) in header.items():
        dtype = dtypes.BY_NAME[dtype_name]
        numel = math.prod(shape)
        storage = StorageRef(key=name, dtype=dtype, numel=numel, location="cpu",
                             data=ByteRange(path, position, numel * dtype.itemsize))
        tensors[name] = TensorRef(storage=storage, dtype=dtype, shape=tuple(shape), stride=contiguous_stride(shape))
        position += numel * dtype.itemsize
    return Contents(container={"model": tensors, "step": 7}, files=[path])


FORMAT = Format(name="toy", sniff=sniff, read=read, has_location_tags=False)
"""


def _toy_file(path: Path, weights: dict[str, torch.Tensor]) -> Path:
    import json

    names = {"torch.float32": "F32", "torch.int64": "I64"}
    header = {name: [names[str(t.dtype)], list(t.shape)] for name, t in weights.items()}
    with open(path, "wb") as handle:
        handle.write(b"TOYCKPT1\n" + json.dumps(header).encode() + b"\n")
        for tensor in weights.values():
            handle.write(tensor.contiguous().numpy().tobytes())
    return path


def test_a_format_is_one_module_and_one_registry_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    weights = {"fc.weight": torch.arange(6, dtype=torch.float32).reshape(2, 3), "fc.bias": torch.tensor([5, -1])}
    source = _toy_file(tmp_path / "model.toy", weights)
    with pytest.raises(ckptool.UnsupportedFormatError, match="is a text file, not a PyTorch checkpoint"):
        ckptool.load(source)

    package = tmp_path / "plugins"
    package.mkdir()
    (package / "toyformat.py").write_text(TOY_MODULE)
    monkeypatch.syspath_prepend(str(package))
    monkeypatch.setattr(formats, "REGISTRY", [*formats.REGISTRY, "toyformat:FORMAT"])
    try:
        checkpoint = ckptool.load(source)
        assert checkpoint.format == "toy" and checkpoint.layout == ("model",)
        assert sorted(checkpoint.tensors) == ["fc.bias", "fc.weight"]
        summary = ckptool.inspect(source)  # its capabilities answer for it: no location tags
        assert summary.format == "toy" and summary.saved_devices == {} and summary.tensors == 2
        report = ckptool.scan(source)
        assert report.safe and report.format == "toy" and report.pickles == []
        saved = ckptool.save(checkpoint, tmp_path / "model.safetensors")
        from safetensors.torch import load_file

        written = load_file(saved.path)
        assert written.keys() == weights.keys()
        assert all(torch.equal(written[name], tensor) for name, tensor in weights.items())
    finally:
        monkeypatch.undo()  # the registry line removed
        sys.modules.pop("toyformat", None)
    with pytest.raises(ckptool.UnsupportedFormatError, match="is a text file, not a PyTorch checkpoint"):
        ckptool.load(source)


class _HeaderEntry:
    """What the safetensors header reads of a tensor: its shape and dtype."""

    def __init__(self, shape: tuple, dtype: object) -> None:
        self.shape, self.dtype = shape, dtype


def test_the_safetensors_header_is_the_bytes_json_writes_for_it() -> None:
    """The header is written from columns: byte for byte what json.dumps writes for its dicts, on names that need
    escaping (quotes, backslashes, controls, DEL, non-ASCII, lone surrogates), shapes with 0, bools and large
    sizes, and metadata."""
    import math
    import random

    from ckptool.tensors import dtypes
    from ckptool.formats import safetensors

    rng = random.Random(20261127)
    alphabet = ["a", "é", '"', "\\", "\n", "\x00", "\u2028", "😀", "/", " ", "\x7f", "\ud800"]
    kinds = [dtypes.BY_NAME[name] for name in ("F32", "BF16", "I64", "BOOL", "U8")]
    for _ in range(2000):
        tensors = {}
        for index in range(rng.randint(0, 5)):
            name = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 6))) + str(index)
            sizes = [0, 1, 2, 7, True, False, 10**12] if rng.random() < 0.3 else [0, 1, 2, 7, 10**12, 2**63 - 1]
            shape = tuple(rng.choice(sizes) for _ in range(rng.randint(0, 3)))
            tensors[name] = _HeaderEntry(shape, rng.choice(kinds))
        metadata = {"kéy": 'v"al', "n": "1"} if rng.random() < 0.5 else {}
        header: dict = {"__metadata__": dict(metadata)} if metadata else {}
        position = 0
        for name, entry in tensors.items():
            end = position + math.prod(entry.shape) * entry.dtype.itemsize
            header[name] = {"dtype": entry.dtype.name, "shape": list(entry.shape), "data_offsets": [position, end]}
            position = end
        nbytes = [math.prod(entry.shape) * entry.dtype.itemsize for entry in tensors.values()]
        encoded = safetensors._encode_header(list(tensors), [entry.dtype.name for entry in tensors.values()],
                                             [entry.shape for entry in tensors.values()], nbytes, metadata)
        assert encoded == json.dumps(header, separators=(",", ":")).encode("utf-8")
        assert sum(nbytes) == position


def test_the_safetensors_header_parsed_in_c_checks_each_field_as_the_entry_checks_do() -> None:
    """The header parsed in C (_fastload.parse_header) against json and the entry-by-entry checks: on drawn headers,
    valid and broken in every field the entry check tests, it gives the same tensors (names, order, dtypes, shapes,
    strides, bytes) or declines, and it declines every header the entry check refuses."""
    import random

    from ckptool.tensors import dtypes
    from ckptool.base.errors import InputError
    from ckptool.formats import safetensors
    from ckptool.pickles.unpickle import FAST, _fastload

    if not FAST:
        pytest.skip("the C extension (ckptool/native/_fastload.c) was not built here")
    rng = random.Random(20261127)
    path = Path("x.safetensors")
    names = [name for name in sorted(safetensors.FORMAT_DTYPES) if name in dtypes.BY_NAME]
    accepted = declined = 0
    for _ in range(3000):
        header: dict = {}
        position = 0
        for index in range(rng.randint(0, 6)):
            # (2**40: an empty tensor's strides past int64, (0, 2**40, 2**40) -> (2**80, 2**40, 1))
            dtype, shape, nbytes = _drawn_entry(rng, names, [0, 1, 2, 3, 2**40])
            if nbytes > 1 << 30:
                shape, nbytes = [0, *shape], 0
            header[f"t{rng.randint(0, 9)}{index}"] = {"dtype": dtype, "shape": shape,
                                                       "data_offsets": [position, position + nbytes]}
            position += nbytes
        if header and rng.random() < 0.6:  # break one thing
            entry = rng.choice(list(header.values()))
            how = rng.randrange(14)
            if how == 0:
                entry["dtype"] = rng.choice(["F99", 3, None, ["F32"]])
            elif how == 1:
                entry["shape"] = rng.choice([[-1], [True], [1.0], "2", [2**63], [2**62, 4], [1] * 65, None])
            elif how == 2:
                entry["data_offsets"] = rng.choice([[0], [0, 1, 2], None, [-1, 3], [0.0, 4], [False, 0]])
            elif how == 3:
                entry["data_offsets"] = [entry["data_offsets"][0] + 1, entry["data_offsets"][1] + 1]
            elif how == 4:
                entry["extra"] = 1
            elif how == 5:
                del entry["dtype"]
            elif how == 6:
                header[rng.choice(list(header))] = rng.choice([[], "x", 1, None])
            elif how == 7:
                position += rng.choice([-1, 1, 8])  # a file shorter or longer than the data
            elif how == 8:
                entry["data_offsets"] = [entry["data_offsets"][0], entry["data_offsets"][1] + 1]
            elif how == 9:  # two tensors swapped in place: still tiled
                values = list(header.values())
                if len(values) > 1:
                    values[0]["data_offsets"], values[-1]["data_offsets"] = values[-1]["data_offsets"], values[0]["data_offsets"]
            elif how == 10:
                entry["shape"] = entry["shape"] + [0]
                entry["data_offsets"] = [entry["data_offsets"][0]] * 2
            elif how == 11:
                entry["dtype"] = "BOOL" if entry["dtype"] != "BOOL" else "F64"
            elif how == 12:
                entry["shape"] = tuple(entry["shape"])
            else:
                entry["data_offsets"] = [entry["data_offsets"][0], True]
        file_size = 100 + position
        raw = json.dumps(header).encode()  # (a tuple shape is a list to JSON: both read it so)
        try:
            expected = safetensors._each_tensor(json.loads(raw), path, 100, file_size)
        except InputError:
            expected = None
        parsed = _fastload.parse_header(raw, path, 100, file_size, safetensors._HEADER_CONSTANTS)
        got = parsed[0] if parsed is not None else None
        if expected is None:
            assert got is None, header
            declined += 1
            continue
        if got is None:
            assert not header  # the usual header is never declined
            continue
        accepted += 1
        assert list(got) == list(expected)
        for name, tensor in got.items():
            other = expected[name]
            assert (tensor.dtype, tensor.shape, tensor.stride, tensor.offset, tensor.storage.key, tensor.storage.dtype,
                    tensor.storage.numel, tensor.storage.location, tensor.storage.data) == \
                   (other.dtype, other.shape, other.stride, other.offset, other.storage.key, other.storage.dtype,
                    other.storage.numel, other.storage.location, other.storage.data)
            assert type(tensor.shape) is tuple and type(tensor.storage.numel) is int
    assert accepted > 500 and declined > 500


def test_the_safetensors_header_parsed_in_c_is_the_one_json_and_the_entry_checks_give() -> None:
    """_fastload.parse_header (the header's bytes straight into tensors) against json.loads and the entry-by-entry
    checks, on drawn headers written every way JSON allows (spacing, key order, escapes, non-ASCII names,
    metadata) and then bent byte by byte and token by token (numbers as floats, signs and leading zeros,
    duplicate keys, invalid UTF-8, a gap, trailing bytes): it gives the same tensors and metadata or declines,
    and declines every header the Python path refuses."""
    import math
    import random

    from ckptool.tensors import dtypes
    from ckptool.base.errors import InputError
    from ckptool.formats import safetensors
    from ckptool.pickles.unpickle import FAST, _fastload

    if not FAST:
        pytest.skip("the C extension (ckptool/native/_fastload.c) was not built here")
    rng = random.Random(20261127)
    path = Path("x.safetensors")
    names = sorted(safetensors._DTYPES)
    TOKEN_BENDS = {  # noqa: N806
        0: [(b"]", b".0]")], 1: [(b"[0,", b"[-0,")], 2: [(b"[0,", b"[00,")],
        7: [(b'"dtype"', b'"dtype": "F32", "dtype"')],  # a key twice (json keeps the last)
        8: [(b'"m.', b'"\xff\xfe.')], 9: [(b'"shape"', b'"shape": [1], "extra"')],
        10: [(b"e+", b"E"), (b"0]", b"1e0]")],
        11: [(b'"__metadata__"', b'"__metadata__": {}, "__metadata__"')], 12: [(b'"format"', b'"format": 1, "f"')],
    }
    alphabet = ["a", "b", ".", "0", "é", '"', "\\", "\n", "😀", "\ud800", "/", " ", "\x7f", "\u2028"]

    def reference(raw: bytes, file_size: int) -> tuple | None:
        try:
            header = safetensors._parsed(path, raw)
            metadata = header.pop("__metadata__", None) or {}
            if not isinstance(metadata, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                         for k, v in metadata.items()):
                return None
            return safetensors._each_tensor(header, path, 100, file_size), metadata
        except InputError:
            return None

    accepted = refused = 0
    for _ in range(4000):
        header: dict = {}
        position = 0
        for index in range(rng.randint(1, 5)):
            dtype, shape, nbytes = _drawn_entry(rng, names, [0, 1, 2, 3, 10])
            name = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 4))) if rng.random() < 0.3 else f"m.{index}"
            fields = [("dtype", dtype), ("shape", shape), ("data_offsets", [position, position + nbytes])]
            if rng.random() < 0.2:
                rng.shuffle(fields)
            header[name + str(index)] = dict(fields)
            position += nbytes
        if rng.random() < 0.5:
            metadata = {"format": "pt", rng.choice(alphabet) + "k": "".join(rng.choice(alphabet) for _ in range(5))}
            items = list(header.items())
            items.insert(rng.randint(0, len(items)), ("__metadata__", metadata))
            header = dict(items)
        separators = rng.choice([(",", ":"), (", ", ": "), (",", ": ")])
        text = json.dumps(header, separators=separators, ensure_ascii=rng.random() < 0.5,
                          indent=rng.choice([None, None, 2]))
        raw = text.encode("utf-8", "surrogatepass") + b" " * rng.randint(0, 7)
        file_size = 100 + position
        bend = rng.randrange(16)
        if bend in TOKEN_BENDS:  # one token written otherwise
            for old, new in TOKEN_BENDS[bend]:
                raw = raw.replace(old, new, 1)
        elif bend == 3:
            at = rng.randrange(len(raw))
            raw = raw[:at] + bytes([rng.randrange(256)]) + raw[at + 1:]
        elif bend == 4:
            at = rng.randrange(len(raw))
            raw = raw[:at] + raw[at + 1:]
        elif bend == 5:
            raw = raw.rstrip() + rng.choice([b"x", b"}", b",", b"\x00"])
        elif bend == 6:
            file_size += rng.choice([-1, 1])
        got = _fastload.parse_header(raw, path, 100, file_size, safetensors._HEADER_CONSTANTS)
        expected = reference(raw, file_size)
        if expected is None:
            assert got is None, raw
            refused += 1
            continue
        if got is None:  # declined: only a key twice (json's last one wins; the Python path reads it), or -0
            assert bend in (1, 7, 11, 12), raw  # (-0 is an int to json)
            continue
        accepted += 1
        tensors, metadata = got
        assert metadata == expected[1] and list(metadata) == list(expected[1])
        assert list(tensors) == list(expected[0])
        for name, tensor in tensors.items():
            other = expected[0][name]
            assert (tensor.dtype, tensor.shape, tensor.stride, tensor.offset, tensor.storage.key, tensor.storage.dtype,
                    tensor.storage.numel, tensor.storage.location, tensor.storage.data) == \
                   (other.dtype, other.shape, other.stride, other.offset, other.storage.key, other.storage.dtype,
                    other.storage.numel, other.storage.location, other.storage.data)
            assert type(tensor.shape) is tuple and all(type(size) is int for size in tensor.shape)
    assert accepted > 1000 and refused > 1000, (accepted, refused)


def _drawn_entry(rng: Any, dtype_names: list[str], sizes: list[int]) -> tuple[str, list[int], int]:
    """A drawn safetensors header entry: its dtype's name, a shape of up to 3 of ``sizes``, its byte count."""
    from ckptool.tensors import dtypes

    dtype = rng.choice(dtype_names)
    shape = [rng.choice(sizes) for _ in range(rng.randint(0, 3))]
    return dtype, shape, math.prod(shape) * dtypes.BY_NAME[dtype].itemsize
