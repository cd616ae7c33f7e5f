"""The container around the weights, as safetensors metadata: one versioned JSON encoding.

A safetensors file holds tensors and a string-to-string metadata map. A training checkpoint holds
more: an epoch, a config (nested beside the weights, with tuples, ``inf``, int-keyed dicts,
numpy values, ``torch.device``), a scheduler, an optimizer. :func:`encode` writes the whole
container except the weights subtree as the metadata value ``ckptool.entries``; :func:`decode`
reads it back, and the safetensors reader puts the weights at the place the encoding marks, so
``pt -> safetensors -> pt`` gives back the container's entries as torch loads them.

The encoding (version 1). The value is a JSON object ``{"$ckptool": "entries", "version": 1,
"container": NODE}``. A NODE is plain JSON where plain JSON says exactly what the value is, and
otherwise a record: a JSON object whose key ``"$ckptool"`` names the type.

======================  =====================================================================
value                   NODE
======================  =====================================================================
None, bool, str         itself
int                     itself (JSON keeps ``3`` and ``3.0`` apart; at most 4000 digits)
float                   itself when finite; ``{"$ckptool": "float", "value": "inf"|"-inf"|"nan"}``
complex                 ``{"$ckptool": "complex", "real": NODE, "imag": NODE}``
list                    a JSON array of NODEs
tuple                   ``{"$ckptool": "tuple", "items": [NODE, ...]}``
dict                    a JSON object of NODEs when every key is a str and none is ``"$ckptool"``;
                        else ``{"$ckptool": "dict", "items": [[KEY, NODE], ...]}``
OrderedDict             ``{"$ckptool": "OrderedDict", "items": [[KEY, NODE], ...], "attrs": {...}}``
                        (``attrs``: its attributes, a state_dict's ``_metadata``; omitted if none)
collections.Counter     ``{"$ckptool": "Counter", "items": [[KEY, NODE], ...]}``
set, frozenset          ``{"$ckptool": "set"|"frozenset", "items": [KEY, ...]}``
bytes, bytearray        ``{"$ckptool": "bytes"|"bytearray", "base64": "..."}``
torch.device            ``{"$ckptool": "torch.device", "args": ["cuda", 1]}``
torch.Size              ``{"$ckptool": "torch.Size", "items": [2, 3]}``
torch dtype             ``{"$ckptool": "torch.dtype", "name": "float16"}``
numpy arrays, scalars,  ``{"$ckptool": "object", "global": G, "build": "reduce"|"newobj",
dtypes; argparse          "args": [NODE, ...], "state": NODE}`` — the call the pickle makes, for G
.Namespace                in :data:`CARRIED_GLOBALS` only; a class passed as an argument is
                          ``{"$ckptool": "global", "name": G}``
the weights             ``{"$ckptool": "weights"}``, exactly once: where the weights mapping lies
flattened weights       ``{"$ckptool": "weights", "tree": NODE}``: weights that are not a mapping
                        of names (an optimizer's state dict) lie here as NODE, each of its tensors
                        ``{"$ckptool": "tensor", "name": NAME}``, NAME the file's tensor
======================  =====================================================================

KEY is a NODE that decodes to a hashable value. Numpy values are kept as the pickle's own call
(``numpy._core.multiarray._reconstruct`` with its state: shape, dtype, byte order, Fortran order,
raw bytes) rather than as extra tensors: the metadata stays the container's only other part, no
tensor name can collide with a weight's, no numpy import is needed to read or write them, and a
``.pt`` rewrite re-emits exactly what torch's loader rebuilds (the same dtype and byte order, an
object array or a 0-d array alike). The cost is size: an array's bytes are base64 in the header,
so arrays over :data:`MAX_ARRAY_BYTES` are left behind, named.

What cannot be represented is left out and named by its key path in the notes :func:`encode`
returns: tensors outside the weights (an optimizer's state is named once, as a whole), objects of
other allowed globals (their meaning is their code's), cycles, and anything past the limits a
reader accepts. A list, tuple or set with such an item is left out whole (its other items would
change places).

Reading is bounded (the metadata is the file's, and files are hostile): at most
:data:`MAX_ENTRIES_CHARS` of JSON, :data:`MAX_DEPTH` levels, :data:`MAX_VALUES` values, and
:data:`~.entries_decoder.MAX_HASH_COLLISIONS` keys of one dict or set sharing a hash. Anything
else malformed is refused with one :class:`EntriesError` line.

Example:
    >>> text, dropped = encode({"model": {"w": tensor}, "epoch": 3, "betas": (0.9, 0.99)}, ("model",))  # doctest: +SKIP
    >>> decode(text).container                                                          # doctest: +SKIP
    {'model': <weights>, 'epoch': 3, 'betas': (0.9, 0.99)}
"""

from __future__ import annotations

import base64
import json
import math
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from typing import Any

from ckptool.base.text import value_str
from ckptool.formats.entries_decoder import (
    CARRIED_GLOBALS,
    ENTRIES_KEY,
    MAX_ARRAY_BYTES,
    MAX_DEPTH,
    MAX_ENTRIES_CHARS,
    MAX_INT_DIGITS,
    MAX_VALUES,
    TAG,
    VERSION,
    WEIGHTS,
    EntriesError,
    _Decoder,
    _malformed,
    _refuse_constant,
)
from ckptool.pickles.placeholders import OpaqueObject, StateDict
from ckptool.tensors.refs import DeviceRef, DTypeRef, SizeRef, StorageRef, TensorRef

OPTIMIZER_ADVICE = "safetensors holds weights only; keep the .pt for resuming"
TENSOR_ADVICE = "safetensors holds the weights only; keep the .pt for it"


@dataclass
class Decoded:
    """What :func:`decode` read: the container (the weights mapping at ``layout``), or for metadata
    written by ckptool before version 1 (top-level JSON entries, no place for the weights) the
    entries alone with ``layout`` None."""

    container: Any
    layout: tuple[Any, ...] | None
    notes: list[str] = field(default_factory=list)
    # the weights were flattened: the tree at ``layout`` holds the file's tensors by name (already placed)
    flattened: bool = False


def key_path(path: tuple[Any, ...]) -> str:
    """A key path as notes show it: ``optimizer.state.0`` (``(top level)`` for the container)."""
    return ".".join(map(value_str, path)) or "(top level)"


class _Inside:
    """A step of a key path into a value's parts no layout reaches (a dict key, a complex number's
    parts, an object's arguments): never equal to a real key, so the weights are never placed there."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __str__(self) -> str:
        return f"({self.name})"


_KEY, _PART, _ARGS, _STATE = _Inside("key"), _Inside("part"), _Inside("args"), _Inside("state")


# ------------------------------------------------------------------------------------------------ encode


class _Drop(Exception):
    """A value the encoding cannot carry: what it is, and what to do instead."""

    def __init__(self, what: str, advice: str = "") -> None:
        super().__init__(what)
        self.what, self.advice = what, advice


class _OverBudget(Exception):
    pass


def _note(path: tuple[Any, ...], drop: _Drop) -> str:
    return f"{key_path(path)}: {drop.what} not carried" + (f" — {drop.advice}" if drop.advice else "")


def _tensor_count(value: Any) -> int:
    from ckptool.model.tree import iter_tensors

    return sum(1 for _ in iter_tensors(value))


def _is_optimizer_state(value: Any) -> bool:
    # torch.optim.Optimizer.state_dict(): {"state": {index: {...tensors}}, "param_groups": [...]}
    return isinstance(value, dict) and "state" in value and "param_groups" in value


class _Encoder:
    def __init__(self, weights_path: tuple[Any, ...], tensor_names: dict[int, str] | None = None) -> None:
        self.weights_path = weights_path
        # flattened weights: id(tensor) -> its name in the file, for the tensors of the tree at weights_path
        self.tensor_names = tensor_names
        self.named: set[str] = set()
        self._naming: list[str] = []  # named, in order: what a value dropped after naming them takes back
        self.placed = False
        self.values = 0
        self.open: set[int] = set()  # containers on the current path: a cycle would never end
        self.notes: list[str] = []

    def node(self, value: Any, path: tuple[Any, ...], depth: int) -> Any:
        if path == self.weights_path and not self.placed:
            self.placed = True
            if self.tensor_names is not None:  # the tree itself goes along, its tensors by name
                return {TAG: "weights", "tree": self.node(value, path + (_Inside("weights"),), depth + 1)}
            self._weights_members(value, path)
            return {TAG: "weights"}
        self.values += 1
        if self.values > MAX_VALUES:
            raise _OverBudget
        if depth > MAX_DEPTH:
            raise _Drop(f"a value nested over {MAX_DEPTH} levels deep")
        kind = type(value)
        if value is None or kind in (bool, str):
            return value
        if kind is int:
            if value.bit_length() > MAX_INT_DIGITS * 3:  # ~3.3 bits a digit: conservative
                raise _Drop(f"an integer of {value.bit_length()} bits (JSON readers take {MAX_INT_DIGITS} digits)")
            return value
        if kind is float:
            if math.isfinite(value):
                return value
            return {TAG: "float", "value": "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")}
        if kind is complex:
            return {
                TAG: "complex",
                "real": self.node(value.real, path + (_PART,), depth + 1),
                "imag": self.node(value.imag, path + (_PART,), depth + 1),
            }
        if kind in (bytes, bytearray):
            if len(value) > MAX_ARRAY_BYTES:
                raise _Drop(
                    f"{len(value)} bytes (over the {MAX_ARRAY_BYTES}-byte limit for metadata)", "keep the .pt for it"
                )
            return {TAG: kind.__name__, "base64": base64.b64encode(bytes(value)).decode("ascii")}
        if isinstance(value, TensorRef):
            name = self.tensor_names.get(id(value)) if self.tensor_names is not None else None
            if name is not None:
                if name not in self.named:
                    self.named.add(name)
                    self._naming.append(name)
                return {TAG: "tensor", "name": name}
            raise _Drop(f"a tensor ({value.dtype.torch_name} {list(value.shape)}) outside the weights", TENSOR_ADVICE)
        if isinstance(value, StorageRef):
            raise _Drop(
                f"a storage ({value.dtype.torch_name}, {value.numel} elements) outside the weights", TENSOR_ADVICE
            )
        if kind is DeviceRef:
            return {TAG: "torch.device", "args": list(value.args)}
        if kind is SizeRef:
            return {TAG: "torch.Size", "items": list(value)}
        if kind is DTypeRef:
            if value.module != "torch":
                raise _Drop(f"a dtype {value.module}.{value.name}")
            return {TAG: "torch.dtype", "name": value.name}
        if isinstance(value, OpaqueObject):
            return self._object(value, path, depth)
        if isinstance(value, type) and issubclass(value, OpaqueObject):
            if value._global not in CARRIED_GLOBALS or getattr(value, "_module", None) is not None:
                raise _Drop(f"the class {value._global}", "keep the .pt for it")
            return {TAG: "global", "name": value._global}
        if id(value) in self.open:
            raise _Drop("a reference back to a container holding it (a cycle)")
        self.open.add(id(value))
        try:
            return self._container(value, kind, path, depth)
        finally:
            self.open.discard(id(value))

    def _container(self, value: Any, kind: type, path: tuple[Any, ...], depth: int) -> Any:
        if kind is list:
            return self._items(value, path, depth, "list")
        if kind is tuple:
            return {TAG: "tuple", "items": self._items(value, path, depth, "tuple")}
        if kind in (set, frozenset):
            return {TAG: kind.__name__, "items": [self._key(item, path, depth) for item in value]}
        if isinstance(value, dict):
            if _is_optimizer_state(value) and self.tensor_names is None and (count := _tensor_count(value)):
                raise _Drop(f"optimizer state ({count} tensors)", OPTIMIZER_ADVICE)
            pairs = self._pairs(value, path, depth)
            if kind is dict:
                if all(type(k) is str for k, _ in pairs) and TAG not in value:
                    return {k: v for k, v in pairs}
                return {TAG: "dict", "items": [[self._key(k, path, depth), v] for k, v in pairs]}
            if kind is Counter:
                return {TAG: "Counter", "items": [[self._key(k, path, depth), v] for k, v in pairs]}
            if kind in (StateDict, OrderedDict):
                record: dict[str, Any] = {
                    TAG: "OrderedDict",
                    "items": [[self._key(k, path, depth), v] for k, v in pairs],
                }
                attrs = dict(getattr(value, "__dict__", {}) or {})
                if attrs:
                    record["attrs"] = self.node(attrs, path + (_Inside("attributes"),), depth + 1)
                return record
        raise _Drop(f"a {kind.__name__}", "keep the .pt for it")

    def _items(self, values: Any, path: tuple[Any, ...], depth: int, kind: str) -> list[Any]:
        encoded = []
        for index, item in enumerate(values):
            try:
                encoded.append(self.node(item, path + (index,), depth + 1))
            except _Drop as e:
                # leaving one item out would move the others: the sequence goes whole, named here
                raise _Drop(f"a {kind} whose item {index} is {e.what}, so the whole {kind} is", e.advice) from None
        return encoded

    def _pairs(self, mapping: dict, path: tuple[Any, ...], depth: int) -> list[tuple[Any, Any]]:
        pairs: list[tuple[Any, Any]] = []
        dropped_tensors: list[Any] = []
        for key, item in dict.items(mapping):
            named = len(self._naming)
            try:
                pairs.append((key, self.node(item, path + (key,), depth + 1)))
            except _Drop as e:
                # its tensors are not in the tree after all (a key inside it could not be carried)
                self.named.difference_update(self._naming[named:])
                del self._naming[named:]
                if isinstance(item, TensorRef):
                    dropped_tensors.append(key)
                else:
                    self.notes.append(_note(path + (key,), e))
        if len(dropped_tensors) == 1 and pairs:
            tensor = dict.__getitem__(mapping, dropped_tensors[0])
            self.notes.append(
                _note(
                    path + (dropped_tensors[0],),
                    _Drop(
                        f"a tensor ({tensor.dtype.torch_name} {list(tensor.shape)}) outside the weights", TENSOR_ADVICE
                    ),
                )
            )
        elif dropped_tensors:  # a second state_dict (an EMA copy, buffers): named once, with its keys
            shown = ", ".join(map(value_str, dropped_tensors[:3])) + (", ..." if len(dropped_tensors) > 3 else "")
            drop = _Drop(f"{len(dropped_tensors)} tensor(s) outside the weights ({shown})", TENSOR_ADVICE)
            if not pairs:  # nothing but tensors: an empty mapping left behind would pass for the real one
                raise drop
            self.notes.append(_note(path, drop))
        return pairs

    def _key(self, key: Any, path: tuple[Any, ...], depth: int) -> Any:
        if key is WEIGHTS:
            raise _Drop("a key")
        return self.node(key, path + (_KEY,), depth + 1)

    def _object(self, value: OpaqueObject, path: tuple[Any, ...], depth: int) -> Any:
        name = value.global_name
        # the calls a record can spell: a plain call or cls.__new__(cls, *args), a class named at its last dot
        if (
            name not in CARRIED_GLOBALS
            or value._items
            or value._setitems
            or value._mode not in ("reduce", "newobj")
            or getattr(type(value), "_module", None) is not None
        ):
            raise _Drop(
                f"an object of {name} (read as inert data; its meaning is its class's code)", "keep the .pt for it"
            )
        if (
            name.endswith("._reconstruct")
            and isinstance(value.state, tuple)
            and len(value.state) == 5
            and isinstance(value.state[4], bytes)
            and len(value.state[4]) > MAX_ARRAY_BYTES
        ):
            raise _Drop(
                f"a numpy array of {len(value.state[4])} bytes (over the {MAX_ARRAY_BYTES}-byte limit for metadata)",
                "keep the .pt for it",
            )
        if id(value) in self.open:
            raise _Drop("a reference back to an object holding it (a cycle)")
        self.open.add(id(value))
        try:
            record: dict[str, Any] = {
                TAG: "object",
                "global": name,
                "build": value._mode,
                "args": self._items(value.reduce_args(), path + (_ARGS,), depth, "list of arguments"),
            }
            if value.state is not None:
                record["state"] = self.node(value.state, path + (_STATE,), depth + 1)
        finally:
            self.open.discard(id(value))
        return record

    def _weights_members(self, weights: Any, path: tuple[Any, ...]) -> None:
        """A weights mapping's values that are not tensors (safetensors stores tensors only)."""
        from ckptool.pickles.layouts import LayoutTensor

        if not isinstance(weights, dict):
            return
        for key, value in dict.items(weights):
            if not isinstance(value, TensorRef | LayoutTensor):
                self.notes.append(
                    f"{key_path(path + (key,))}: a non-tensor value ({type(value).__name__}) among "
                    "the weights not carried — safetensors stores tensors only"
                )


def encode(
    container: Any, weights_path: tuple[Any, ...], *, tensor_names: dict[int, str] | None = None
) -> tuple[str | None, list[str]]:
    """The container minus the weights at ``weights_path``, as the ``ckptool.entries`` value.

    ``tensor_names``: the weights are flattened (an optimizer's state dict, see
    :func:`ckptool.model.optimizers.flatten`): ``id(tensor) -> name`` of each of its tensors; the tree at
    ``weights_path`` goes along with its tensors by name, so the reader builds it again.

    Returns:
        ``(json_text, dropped)``: ``json_text`` is None when nothing but the weights is there to
        carry; ``dropped`` names, by key path, every value left out and why (one line each).
    """
    encoder = _Encoder(tuple(weights_path), tensor_names)
    if not weights_path and tensor_names is None:
        encoder._weights_members(container, ())
        return None, encoder.notes
    try:
        tree = encoder.node(container, (), 0)
    except _OverBudget:
        return None, [
            f"(top level): the entries beside the weights hold over {MAX_VALUES} values not carried — "
            "keep the .pt for them"
        ]
    except _Drop as e:
        return None, [*encoder.notes, _note((), e)]
    if not encoder.placed:
        return None, [
            *encoder.notes,
            f"{key_path(weights_path)}: the container around the weights not carried — "
            "the place of the weights cannot be represented; keep the .pt for it",
        ]
    if tensor_names is not None and encoder.named != set(tensor_names.values()):
        # a tensor inside a value the encoding could not carry: the tree would not place every tensor
        return None, [
            *encoder.notes,
            f"{key_path(weights_path)}: the structure around the tensors not carried "
            "(a value holding tensors could not be encoded); keep the .pt for it",
        ]
    text = json.dumps({TAG: "entries", "version": VERSION, "container": tree}, allow_nan=False, separators=(",", ":"))
    if len(text) > MAX_ENTRIES_CHARS:
        return None, [
            *encoder.notes,
            f"(top level): the entries beside the weights ({len(text)} characters of "
            f"JSON, over the {MAX_ENTRIES_CHARS} limit) not carried — keep the .pt for them",
        ]
    return text, encoder.notes


# ------------------------------------------------------------------------------------------------ decode


def decode(json_text: str, tensors: dict[str, Any] | None = None) -> Decoded:
    """Read a ``ckptool.entries`` value: the container with :data:`WEIGHTS` where the weights go.

    Metadata from a ckptool before version 1 (a JSON object of top-level entries, which records no
    place for the weights) is read as those entries, with ``layout`` None. Flattened weights (a
    ``tree``) are built from ``tensors``, the file's tensors by name, each of which the tree must
    place exactly once.

    Raises:
        EntriesError: malformed, of another version, or over a limit (one line, naming the key).
    """
    if len(json_text) > MAX_ENTRIES_CHARS:
        raise _malformed(f"is {len(json_text)} characters, over the {MAX_ENTRIES_CHARS} limit")
    try:
        value = json.loads(json_text, parse_constant=_refuse_constant)
    except (ValueError, RecursionError) as e:
        raise _malformed(f"is not JSON ({type(e).__name__})") from e
    if type(value) is not dict:
        raise _malformed("is not a JSON object")
    decoder = _Decoder(tensors)
    if TAG not in value:  # written before the encoding had a version: top-level JSON entries
        return Decoded(decoder.node(value, None, 0), None)
    if value.get(TAG) != "entries" or set(value) != {TAG, "version", "container"}:
        raise _malformed("is not an entries record")
    if value["version"] != VERSION:
        raise EntriesError(
            f"metadata {ENTRIES_KEY} is version {str(value['version'])[:10]}, which this ckptool "
            f"does not read (it reads {VERSION}) — upgrade ckptool"
        )
    container = decoder.node(value["container"], (), 0)
    if decoder.layout is None:
        raise _malformed("marks no place for the weights")
    if decoder.flattened and tensors is not None and decoder.named != set(tensors):
        raise _malformed(f"places {len(decoder.named)} tensors in the weights' tree, but the file holds {len(tensors)}")
    return Decoded(container, decoder.layout, flattened=decoder.flattened)


def restore(decoded: Decoded, weights: dict) -> Any:
    """The decoded container with ``weights`` where the encoding marked them."""
    assert decoded.layout is not None
    if decoded.flattened:  # the tree already holds the tensors
        return decoded.container
    from ckptool.model.tree import replace_at

    return replace_at(decoded.container, decoded.layout, weights)


def restored_notes(layout: tuple[Any, ...] | None, metadata: dict[str, str], *, flattened: bool = False) -> list[str]:
    """What a .pt output written from a safetensors input says about the container: restored from
    ``ckptool.entries`` (weights at ``layout``; an optimizer's state built again around its tensors
    when ``flattened``), or an older ckptool's entries it could not place."""
    if flattened:
        return [
            f"restored the optimizer state carried in metadata {ENTRIES_KEY} around its tensors"
            + (f" (at {key_path(layout)})" if layout else "")
        ]
    if layout:
        return [f"restored the container carried in metadata {ENTRIES_KEY} (weights at {key_path(layout)})"]
    raw = metadata.get(ENTRIES_KEY)
    if raw is None:
        return []
    try:
        names = [value_str(key) for key in decode(raw).container]
    except EntriesError:
        names = []
    shown = ", ".join(names[:4]) + (", ..." if len(names) > 4 else "")
    return [
        f"(top level): entries {shown} from metadata {ENTRIES_KEY} not carried — an older ckptool wrote them "
        "without the place of the weights; they stay in the safetensors metadata"
    ]
