"""The C and Python twins give the same result, the same bytes and the same message, on drawn inputs.

- A safetensors header: the C parse (``_fastload.parse_header``) gives what the Python parse gives or
  declines (the Python parse then reads it and says why it refuses), whatever the keys' JSON escapes
  spell (``\\u005f_metadata__`` is the metadata, as json.loads and the safetensors library read it);
  and the Python parse reads no header the safetensors library refuses (a lone surrogate escape, a
  second ``__metadata__``, a field twice, ``-0``), and reads the same names and metadata where both read.
- A ``.pt`` written from a safetensors file or a torch.save'd container: the same pickle bytes and the
  same storages whichever parse read the header and whichever unpickler read the pickle
  (``PURE_PYTHON_HEADER``, ``unpickle.FAST``), and the same file bytes but
  its random serialization id: which tuple objects the reader shares between tensors does not show.
"""

from __future__ import annotations

import io
import json
import math
import struct
import zipfile
from collections import OrderedDict
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ckptool
from ckptool.tensors import dtypes
from ckptool import pickles
from ckptool.base.errors import CkptError, InputError
from ckptool.formats import safetensors
from ckptool.pickles import unpickle
from ckptool.io.writer import pt_container

torch = pytest.importorskip("torch")
safe_open = pytest.importorskip("safetensors").safe_open

pytestmark = pytest.mark.skipif(unpickle._fastload is None,
                                reason="the C extension (ckptool/native/_fastload.c) was not built here")

SETTINGS = settings(max_examples=80, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
DTYPES = sorted(safetensors._DTYPES)


# ----------------------------------------------------------------------------------------- the header


def _spelled(text: str, draw: Any, escaping: bool = True) -> str:
    """``text`` as a JSON string, each character drawn as itself or (``escaping``) as its escape."""
    out = []
    escaping = escaping and draw(st.booleans())
    for char in text:
        if char in '"\\' or ord(char) < 0x20:
            out.append(json.dumps(char)[1:-1])
        elif escaping and draw(st.booleans()):
            out.append(f"\\u{ord(char):04x}" if ord(char) < 0x10000 else json.dumps(char)[1:-1])
        else:
            out.append(char)
    return '"' + "".join(out) + '"'


KEYS = st.sampled_from(["a", "b.weight", "__metadata__", "dtype", "é", "😀", "\x00", "k" * 70, "\ud800", "\udc00x"])


@st.composite
def headers(draw: Any) -> tuple[bytes, int]:
    """A header's bytes and its file's size: entries and metadata under keys spelled with escapes, a few
    keys twice, and now and then a number or a string no JSON writer makes."""
    pieces, position = [], 0
    for _ in range(draw(st.integers(0, 4))):
        if draw(st.integers(0, 4)) == 0:  # metadata, under any spelling of its key
            items = [f"{_spelled(draw(KEYS), draw)}:{_spelled(draw(KEYS), draw)}" for _ in range(draw(st.integers(0, 2)))]
            pieces.append(f"{_spelled('__metadata__', draw)}:{{{','.join(items)}}}")
            continue
        dtype = draw(st.sampled_from(DTYPES))
        shape = draw(st.lists(st.integers(0, 3), max_size=3))
        nbytes = math.prod(shape) * dtypes.BY_NAME[dtype].itemsize
        fields = [f"{_spelled('dtype', draw, draw(st.integers(0, 7)) == 0)}:{_spelled(dtype, draw)}",
                  f'"shape":{json.dumps(shape)}',
                  f'"data_offsets":[{position},{position + nbytes}]']
        if draw(st.integers(0, 9)) == 0:
            fields.append(draw(st.sampled_from(['"dtype":"F32"', '"shape":[-0]', '"data_offsets":[-0,0]'])))
        pieces.append(f"{_spelled(draw(KEYS), draw)}:{{{','.join(fields)}}}")
        position += nbytes
    return ("{" + ",".join(pieces) + "}").encode("utf-8", "surrogatepass"), position


def _python_parse(raw: bytes, size: int) -> tuple[Any, Any]:
    try:
        header = safetensors._parsed(Path("x"), raw)
        metadata = header.pop("__metadata__", None) or {}
        if not isinstance(metadata, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                     for k, v in metadata.items()):
            return ("refused", "metadata"), None
        return safetensors._each_tensor(header, Path("x"), 100, 100 + size), metadata
    except InputError as e:
        return ("refused", str(e)), None


def _described(tensors: dict) -> list[tuple]:
    return [(name, t.dtype.name, t.shape, t.stride, t.storage.data.offset, t.storage.data.length)
            for name, t in tensors.items()]


@settings(SETTINGS, max_examples=300)
@given(headers())
def test_the_c_parse_reads_a_header_as_json_and_the_safetensors_library_do(tmp_path: Path, drawn: tuple) -> None:
    raw, size = drawn
    expected, metadata = _python_parse(raw, size)
    got = unpickle._fastload.parse_header(raw, Path("x"), 100, 100 + size, safetensors._HEADER_CONSTANTS)
    if got is not None:  # taken in C: exactly the Python parse's reading
        assert metadata is not None, (raw, expected)
        assert _described(got[0]) == _described(expected) and got[1] == metadata, raw
    path = tmp_path / "drawn.safetensors"
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(size))
    try:
        with safe_open(str(path), "np") as handle:
            library = (sorted(handle.keys()), handle.metadata() or {})
    except Exception:  # noqa: BLE001 — the library's refusal, whatever its type
        library = None
    if metadata is not None:  # what ckptool reads, the library reads alike
        assert library is not None, raw
        assert library == (sorted(expected), metadata), raw


def test_an_escaped_metadata_key_is_the_metadata_in_both_parses(tmp_path: Path) -> None:
    entry = '{"dtype":"F32","shape":[1],"data_offsets":[0,4]}'
    raw = ('{"\\u005f_metadata__":' + entry + "}").encode()
    assert unpickle._fastload.parse_header(raw, Path("x"), 100, 104, safetensors._HEADER_CONSTANTS) is None
    with pytest.raises(InputError, match="__metadata__ must map strings to strings"):
        _read(tmp_path, raw, 4, pure=False)
    raw = ('{"\\u005f_metadata__":{"format":"pt"},"a":' + entry + "}").encode()
    for pure in (False, True):
        assert _read(tmp_path, raw, 4, pure=pure).metadata == {"format": "pt"}


def _read(tmp_path: Path, raw: bytes, size: int, *, pure: bool) -> safetensors.SafetensorsContents:
    path = tmp_path / "h.safetensors"
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(size))
    previous = safetensors.PURE_PYTHON_HEADER
    safetensors.PURE_PYTHON_HEADER = pure
    try:
        with path.open("rb") as handle:
            return safetensors.read_file(path, handle)
    finally:
        safetensors.PURE_PYTHON_HEADER = previous


# ------------------------------------------------------------------------------------- the .pt written


PATHS = ["c", "python"]


def _emitted(path: Path, header: str, monkeypatch: pytest.MonkeyPatch) -> tuple:
    """The pickle a ``.pt`` write of ``path`` emits and its storages, read on the path named."""
    monkeypatch.setattr(safetensors, "PURE_PYTHON_HEADER", header == "python")
    monkeypatch.setattr(unpickle, "FAST", header == "c")
    try:
        checkpoint = ckptool.load(path)
        blob, storages = pickles.dump(pt_container(checkpoint), renumber_storages=True)
    except CkptError as e:
        return ("refused", type(e).__name__, str(e))
    return blob, [(key, storage.dtype.name, storage.numel, storage.data.offset, storage.data.length)
                  for key, storage in storages]


NAMES = st.one_of(st.sampled_from(["w", "a.b", "layer.0.weight", "é", "n" * 70, "ü" * 40]),
                  st.text(st.characters(blacklist_categories=["Cs"]), max_size=12))


@st.composite
def safetensors_files(draw: Any) -> tuple[dict, dict]:
    shapes = draw(st.lists(st.lists(st.integers(0, 3), max_size=4), min_size=1, max_size=3))  # few: shared
    tensors = {}
    for name in draw(st.lists(NAMES, min_size=1, max_size=12, unique=True)):
        tensors[name] = (draw(st.sampled_from(DTYPES)), draw(st.sampled_from(shapes)))
    metadata = draw(st.sampled_from([{}, {"format": "pt"}, {"note": "é\n"}]))
    return tensors, metadata


def _write_safetensors(path: Path, tensors: dict, metadata: dict) -> None:
    header: dict[str, Any] = {"__metadata__": metadata} if metadata else {}
    position = 0
    for name, (dtype, shape) in tensors.items():
        nbytes = math.prod(shape) * dtypes.BY_NAME[dtype].itemsize
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [position, position + nbytes]}
        position += nbytes
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(range(256)) * (position // 256) + bytes(position % 256))


@SETTINGS
@given(safetensors_files())
def test_a_pt_from_safetensors_is_the_same_bytes_on_every_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                              drawn: tuple) -> None:
    path = tmp_path / "drawn.safetensors"
    _write_safetensors(path, *drawn)
    results = {which: _emitted(path, which, monkeypatch) for which in PATHS}
    assert len({repr(result) for result in results.values()}) == 1, results


@st.composite
def containers(draw: Any) -> Any:
    """A torch.save'd training container: tensors (some shared, some views), plain values, nested dicts."""
    base = [torch.arange(n, dtype=draw(st.sampled_from([torch.float32, torch.int64, torch.float16])))
            for n in draw(st.lists(st.integers(1, 6), min_size=1, max_size=3))]
    leaves = st.one_of(st.sampled_from(base), st.builds(lambda t: t[1:], st.sampled_from(base)),
                       st.integers(-(2**70), 2**70), st.text(max_size=5), st.none(), st.floats(allow_nan=False),
                       st.just(10**700))
    tree = st.recursive(leaves, lambda kids: st.one_of(
        st.lists(kids, max_size=3), st.tuples(kids, kids),
        st.dictionaries(st.one_of(st.text(max_size=4), st.integers(-3, 3)), kids, max_size=3),
        st.builds(lambda d: OrderedDict(d), st.dictionaries(st.text(max_size=4), kids, max_size=3))), max_leaves=12)
    state_dict = OrderedDict((f"layer.{i}", draw(st.sampled_from(base))) for i in range(draw(st.integers(1, 5))))
    return {"state_dict": state_dict, "extra": draw(tree)}


@SETTINGS
@given(containers())
def test_a_pt_rewrite_is_the_same_bytes_on_every_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                      container: Any) -> None:
    path = tmp_path / "drawn.pt"
    torch.save(container, path)
    results = {which: _emitted(path, which, monkeypatch) for which in PATHS}
    assert len({repr(result) for result in results.values()}) == 1, results


def _members(path: Path) -> dict[str, bytes]:
    with zipfile.ZipFile(path) as archive:
        return {info.filename.split("/", 1)[1]: archive.read(info) for info in archive.infolist()
                if not info.filename.endswith("serialization_id")}


def test_a_converted_file_is_the_same_bytes_on_every_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    source = tmp_path / "model.safetensors"
    shapes = [[4, 4], [4], [2, 3, 1], [0, 2]]
    _write_safetensors(source, {f"blocks.{i}.{kind}": (DTYPES[i % len(DTYPES)], shapes[i % 4])
                                for i in range(40) for kind in ("weight", "bias")}, {"format": "pt"})
    written = []
    for header in PATHS:
        monkeypatch.setattr(safetensors, "PURE_PYTHON_HEADER", header == "python")
        out = tmp_path / f"{header}.pt"
        ckptool.save(ckptool.load(source), out)
        written.append(_members(out))
    assert all(members == written[0] for members in written[1:])
    assert len(written[0]) > 80
    loaded = torch.load(io.BytesIO((tmp_path / "c.pt").read_bytes()), weights_only=True)
    assert len(loaded) == 80
