"""Reading ``ckptool.entries`` back: the records' decoder, and the limits a reader enforces.

:func:`ckptool.formats.entries.decode` parses the JSON and hands it to :class:`_Decoder`, which
builds each NODE (the encoding is :mod:`ckptool.formats.entries`') and refuses anything malformed
or over a limit with one :class:`EntriesError` line.
"""

from __future__ import annotations

import base64
import binascii
import math
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterator
from typing import Any

from ckptool.base.errors import InputError
from ckptool.pickles.allowlist import DEFAULT_EXTRA_GLOBALS
from ckptool.pickles.placeholders import StateDict, opaque_type
from ckptool.tensors import dtypes
from ckptool.tensors.refs import DeviceRef, DTypeRef, SizeRef

ENTRIES_KEY = "ckptool.entries"
VERSION = 1
TAG = "$ckptool"

# Globals whose objects are carried as the call the pickle makes: the data-only classes ckptool
# reads by default (SECURITY.md gives each one's reason). A .pt rewrite re-emits them, and the
# re-read accepts them without any --allow-global; no other global is ever decoded.
CARRIED_GLOBALS = frozenset(DEFAULT_EXTRA_GLOBALS)

# Limits a reader enforces on ckptool.entries (and a writer keeps to, so that every file it writes
# reads back): configs, schedulers and metrics are kilobytes; these leave room for far more.
MAX_ENTRIES_CHARS = 16 << 20
MAX_DEPTH = 100
MAX_VALUES = 1_000_000
MAX_HASH_COLLISIONS = 16
MAX_INT_DIGITS = 4000  # below Python's own 4300-digit limit on int <-> str
MAX_ARRAY_BYTES = 1 << 20  # a numpy array's (or a bytes value's) raw bytes carried as base64


class EntriesError(InputError):
    """The ``ckptool.entries`` metadata of a safetensors file is malformed or over a limit."""


class _Weights:
    """Where the weights go in a decoded container, until the reader puts them there."""

    def __repr__(self) -> str:
        return "<weights>"


WEIGHTS = _Weights()


def _malformed(what: str) -> EntriesError:
    return EntriesError(
        f"metadata {ENTRIES_KEY} {what} — the file is corrupt or not from ckptool; "
        "read its weights with the safetensors library, or remove that metadata entry"
    )


def _refuse_constant(name: str) -> Any:
    raise _malformed(f"holds the non-JSON number {name} (non-finite floats are records)")


class _Record:
    """One record being decoded: its type (``tag``), its fields, and where it lies."""

    __slots__ = ("node", "tag", "fields", "path", "depth")

    def __init__(self, node: dict, path: tuple[Any, ...] | None, depth: int) -> None:
        self.node, self.tag, self.path, self.depth = node, node[TAG], path, depth
        self.fields = set(node) - {TAG}

    def need(self, *names: str, optional: tuple[str, ...] = ()) -> None:
        """Refuse the record unless it has all of ``names``, and nothing but them and ``optional``."""
        fields = self.fields
        if not set(names) <= fields or not fields <= set(names) | set(optional):
            raise _malformed(f"has a {str(self.tag)[:40]!r} record with fields {sorted(fields)[:8]}")

    def items_of(self, name: str = "items") -> list:
        items = self.node[name]
        if type(items) is not list:
            raise _malformed(f"has a {self.tag!r} record whose {name} is not a list")
        return items

    def inside(self, key: Any) -> tuple[Any, ...] | None:
        """Where an item at ``key`` of this record lies (None where no layout reaches)."""
        return None if self.path is None else self.path + (key,)


class _Decoder:
    def __init__(self, tensors: dict[str, Any] | None = None) -> None:
        self.values = 0
        self.layout: tuple[Any, ...] | None = None
        self.tensors = tensors  # the file's tensors by name, which a flattened tree's records name
        self.in_tree = False
        self.flattened = False
        self.named: set[str] = set()

    def node(self, node: Any, path: tuple[Any, ...] | None, depth: int) -> Any:
        """``path``: where this node lies as the weights' layout would reach it (None: a place no
        layout can reach — a key, a set, an object's arguments)."""
        self.values += 1
        if self.values > MAX_VALUES:
            raise _malformed(f"holds over {MAX_VALUES} values (the limit)")
        if depth > MAX_DEPTH:
            raise _malformed(f"nests over {MAX_DEPTH} levels")
        if node is None or type(node) in (bool, str, float):
            return node
        if type(node) is int:
            return node
        if type(node) is list:
            return [
                self.node(item, None if path is None else path + (index,), depth + 1) for index, item in enumerate(node)
            ]
        if type(node) is not dict:
            raise _malformed(f"holds a {type(node).__name__}")
        if TAG not in node:
            return {
                key: self.node(value, None if path is None else path + (key,), depth + 1) for key, value in node.items()
            }
        return self.record(node, path, depth)

    def record(self, node: dict, path: tuple[Any, ...] | None, depth: int) -> Any:
        record = _Record(node, path, depth)
        tag = record.tag
        decode = _RECORDS.get(tag) if isinstance(tag, str) else None
        if decode is None:
            raise _malformed(f"has a record of unknown type {str(tag)[:40]!r} (written by a newer ckptool?)")
        return decode(self, record)

    def _pairs(self, record: _Record) -> Iterator[tuple[Any, Any]]:
        for pair in record.items_of():
            if type(pair) is not list or len(pair) != 2:
                raise _malformed(f"has a {record.tag!r} record whose items are not [key, value] pairs")
            key = self.key(pair[0], record.depth)
            yield key, self.node(pair[1], record.inside(key), record.depth + 1)

    def _weights(self, record: _Record) -> Any:
        record.need(optional=("tree",))
        if record.path is None or self.layout is not None or self.in_tree:
            raise _malformed("places the weights twice, or where no key path reaches")
        self.layout = record.path
        if "tree" not in record.node:
            return WEIGHTS
        self.in_tree = self.flattened = True
        try:
            return self.node(record.node["tree"], None, record.depth + 1)
        finally:
            self.in_tree = False

    def _tensor(self, record: _Record) -> Any:
        record.need("name")
        name = record.node["name"]
        if not self.in_tree or type(name) is not str or name in self.named:
            raise _malformed("names a tensor outside the weights' tree, or one tensor twice")
        self.named.add(name)
        if self.tensors is None:
            return None  # only the entries' names were asked for
        if name not in self.tensors:
            raise _malformed(f"names the tensor {name[:60]!r}, which the file does not hold")
        return self.tensors[name]

    def _float(self, record: _Record) -> float:
        record.need("value")
        values = {"inf": math.inf, "-inf": -math.inf, "nan": math.nan}
        if record.node["value"] not in values:
            raise _malformed(f"has a float record of {str(record.node['value'])[:20]!r}")
        return values[record.node["value"]]

    def _complex(self, record: _Record) -> complex:
        record.need("real", "imag")
        parts = [self.node(record.node[name], None, record.depth + 1) for name in ("real", "imag")]
        if not all(type(part) in (float, int) for part in parts):
            raise _malformed("has a complex record whose parts are not numbers")
        return complex(*parts)

    def _bytes(self, record: _Record) -> bytes | bytearray:
        record.need("base64")
        text = record.node["base64"]
        try:
            data = base64.b64decode(text, validate=True) if type(text) is str else None
        except (binascii.Error, ValueError):
            data = None
        if data is None:
            raise _malformed(f"has a {record.tag} record that is not base64")
        return bytearray(data) if record.tag == "bytearray" else data

    def _tuple(self, record: _Record) -> tuple[Any, ...]:
        record.need("items")
        return tuple(
            self.node(item, record.inside(index), record.depth + 1) for index, item in enumerate(record.items_of())
        )

    def _set(self, record: _Record) -> set[Any] | frozenset[Any]:
        record.need("items")
        keys = [self.key(item, record.depth) for item in record.items_of()]
        _check_collisions(keys)
        return set(keys) if record.tag == "set" else frozenset(keys)

    def _mapping(self, record: _Record) -> dict:
        tag = record.tag
        record.need("items", optional=("attrs",) if tag == "OrderedDict" else ())
        built = list(self._pairs(record))
        _check_collisions([key for key, _ in built])
        if tag == "dict":
            return dict(built)
        if tag == "Counter":
            return Counter(dict(built))
        mapping = StateDict(built)
        if "attrs" in record.node:
            mapping.__dict__.update(self.attrs(record.node["attrs"], record.depth))
        return mapping

    def _device(self, record: _Record) -> DeviceRef:
        record.need("args")
        args = record.items_of("args")
        if not 1 <= len(args) <= 2 or not all(type(arg) in (str, int) for arg in args):  # as the reader's
            raise _malformed("has a malformed torch.device record")
        return DeviceRef(tuple(args))

    def _size(self, record: _Record) -> SizeRef:
        record.need("items")
        sizes = record.items_of()
        if len(sizes) > 64 or not all(type(size) is int and 0 <= size < 1 << 63 for size in sizes):
            raise _malformed("has a malformed torch.Size record")
        return SizeRef(tuple(sizes))

    def _dtype(self, record: _Record) -> DTypeRef:
        record.need("name")
        name = record.node["name"]
        if name not in dtypes.BY_TORCH_NAME and name not in dtypes.VALUE_ONLY_TORCH_NAMES:
            raise _malformed(f"names the unknown torch dtype {str(name)[:30]!r}")
        return DTypeRef("torch", name)

    def _global(self, record: _Record) -> type:
        record.need("name")
        return opaque_type(self.carried(record.node["name"]))

    def _object(self, record: _Record) -> Any:
        node = record.node
        record.need("global", "build", "args", optional=("state",))
        cls = opaque_type(self.carried(node["global"]))
        args = tuple(self.node(item, None, record.depth + 1) for item in record.items_of("args"))
        if node["build"] == "reduce":
            obj = cls(*args)
        elif node["build"] == "newobj":
            obj = cls.__new__(cls, *args)
        else:
            raise _malformed(f"has an object record built by {str(node['build'])[:20]!r}")
        if "state" in node:
            obj.__setstate__(self.node(node["state"], None, record.depth + 1))
        return obj

    def key(self, node: Any, depth: int) -> Any:
        key = self.node(node, None, depth + 1)
        try:
            hash(key)
        except TypeError:
            raise _malformed(f"has a dict key or set item of type {type(key).__name__}, which cannot be one") from None
        return key

    def attrs(self, node: Any, depth: int) -> dict[str, Any]:
        attrs = self.node(node, None, depth + 1)
        if type(attrs) is not dict or not all(
            type(name) is str and not hasattr(OrderedDict, name) and not name.startswith("__") for name in attrs
        ):
            raise _malformed("gives an OrderedDict attributes that would hide its contents")
        return attrs

    @staticmethod
    def carried(name: Any) -> str:
        if name not in CARRIED_GLOBALS:
            raise _malformed(f"names the global {str(name)[:60]!r}, which it never carries")
        return name


# each record type's decoder, by the record's tag
_RECORDS: dict[str, Callable[[_Decoder, _Record], Any]] = {
    "weights": _Decoder._weights,
    "tensor": _Decoder._tensor,
    "float": _Decoder._float,
    "complex": _Decoder._complex,
    "bytes": _Decoder._bytes,
    "bytearray": _Decoder._bytes,
    "tuple": _Decoder._tuple,
    "set": _Decoder._set,
    "frozenset": _Decoder._set,
    "dict": _Decoder._mapping,
    "Counter": _Decoder._mapping,
    "OrderedDict": _Decoder._mapping,
    "torch.device": _Decoder._device,
    "torch.Size": _Decoder._size,
    "torch.dtype": _Decoder._dtype,
    "global": _Decoder._global,
    "object": _Decoder._object,
}


def _check_collisions(keys: list[Any]) -> None:
    """Keys of one hash (ints, floats and tuples of them hash predictably) make building a dict quadratic."""
    buckets: Counter = Counter(hash(key) for key in keys)
    if buckets and max(buckets.values()) > MAX_HASH_COLLISIONS:
        raise _malformed(f"puts over {MAX_HASH_COLLISIONS} distinct keys with one hash in a dict or set")
