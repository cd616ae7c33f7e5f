"""The emitter's fast path: a plain tensor (a state dict's usual entry) written in one piece.

A plain tensor is ``_rebuild_tensor_v2`` of a storage met by value: no subclass, no parameter, no trailing
arguments, empty backward hooks, a shape and stride of at most 3 ints. :class:`PlainTensors` writes exactly the
bytes :class:`ckptool.pickles.emit._Emitter` writes for one value by value (its arguments' tuple, the hooks'
``OrderedDict``, each numbered alike), from templates made once: the GETs of the globals every such tensor
names, the persistent id's prefix. :func:`write_pairs` writes a batch of SETITEMS' pairs with it, a str key
and a plain tensor at a time, and hands anything else to the emitter's general path.
"""

from __future__ import annotations

import pickle
import struct
import weakref
from collections import OrderedDict
from typing import Any

from ckptool.pickles.placeholders import StateDict
from ckptool.tensors.refs import StorageRef, TensorRef

_P = pickle
SHARED_TEXT = 64  # bytes from which a string is memoised (shorter ones cost less than a memo entry)
REBUILD_V2 = "torch._utils._rebuild_tensor_v2"
_REBUILD_V2_KEY = "torch._utils\n_rebuild_tensor_v2"
_ORDERED_DICT_KEY = "collections\nOrderedDict"
_TUPLES = (b"", _P.TUPLE1, _P.TUPLE2, _P.TUPLE3)
_STORAGE_TAG = b"((X\x07\x00\x00\x00storage"  # the arguments' MARK, the persistent id's MARK and "storage"
_OP_INDEX = struct.Struct("<BI").pack
_TEXT_LENGTH = struct.Struct("<I").pack
_TAIL = struct.Struct("<BIBBIBBI").pack  # LONG_BINPUT i, TUPLE, LONG_BINPUT i + 1, REDUCE, LONG_BINPUT i + 2
_SMALL_INTS = [_P.BININT1 + bytes([value]) for value in range(256)]
_SHORT_GETS = [_P.BINGET + bytes([index]) for index in range(256)]
_SHORT_PUTS = [_P.BINPUT + bytes([index]) for index in range(256)]


def _get_bytes(index: int) -> bytes:
    return _SHORT_GETS[index] if index < 256 else _OP_INDEX(0x6A, index)  # BINGET, LONG_BINGET


def _put_bytes(index: int) -> bytes:
    return _SHORT_PUTS[index] if index < 256 else _OP_INDEX(0x72, index)  # BINPUT, LONG_BINPUT


def _int_bytes(value: int) -> bytes:
    """What :meth:`ckptool.pickles.emit._Emitter._int` writes for ``value``."""
    if 0 <= value < 256:
        return _SMALL_INTS[value]
    if 0 <= value < 65536:
        return _P.BININT2 + struct.pack("<H", value)
    if -(2**31) <= value < 2**31:
        return _P.BININT + struct.pack("<i", value)
    return long_bytes(value)


def long_bytes(value: int) -> bytes:
    """LONG1, or past 255 bytes (614 digits) LONG4, as pickle (and so torch.save) writes an int. torch's
    weights_only loader reads no LONG4: an int that long came from a pickle it did not load either (or from a
    container ckptool carried out of one), and is written back as that pickle held it."""
    encoded = pickle.encode_long(value)
    if len(encoded) < 256:
        return _P.LONG1 + bytes([len(encoded)]) + encoded
    return _P.LONG4 + struct.pack("<i", len(encoded)) + encoded


def _text_bytes(text: str) -> bytes | None:
    """BINUNICODE of ``text``, or None when it is long enough for the emitter to memoise it."""
    data = text.encode("utf-8", "surrogatepass")
    if len(data) >= SHARED_TEXT:
        return None
    return _P.BINUNICODE + _TEXT_LENGTH(len(data)) + data


def _is_plain(tensor: TensorRef, memo: dict[int, int]) -> bool:
    """Whether a tensor is written in one piece: rebuilt by ``_rebuild_tensor_v2`` with no more arguments, its
    hooks an empty ``OrderedDict`` of no attributes (or none), its storage, offset, shape, stride and flag of their
    exact types, at most 3 int dimensions, nothing of it but the hooks' object met before."""
    hooks, storage, shape, stride = tensor.backward_hooks, tensor.storage, tensor.shape, tensor.stride
    if (
        tensor.subclass is not None
        or tensor.parameter is not None
        or tensor.rebuild != REBUILD_V2
        or tensor.extra
        or (
            hooks is not None
            and (
                (type(hooks) is not OrderedDict and type(hooks) is not StateDict)
                or hooks
                or getattr(hooks, "__dict__", None)
                or id(hooks) in memo
            )
        )
        or type(storage) is not StorageRef
        or id(storage) in memo
        or type(tensor.offset) is not int
        or type(shape) is not tuple
        or type(stride) is not tuple
        or len(shape) > 3
        or len(stride) > 3
        or type(tensor.requires_grad) is not bool
        or type(storage.numel) is not int
        or type(storage.location) is not str
    ):
        return False
    dims = shape + stride
    return list(map(type, dims)).count(int) == len(dims)  # ints only (not an int's subclass, bool)


class PlainTensors:
    """An emitter's writer of plain tensors. Its templates hold memo indexes of globals, so it writes a tensor
    only once the general path has written (and memoised) every global that tensor names; until then it
    declines, and the emitter writes that tensor value by value."""

    def __init__(self, emitter: Any) -> None:
        # by weak reference: the emitter holds this writer, and a cycle between them would outlive a dump under a
        # frozen collector (base.gcpause: a command freezes what its passes built), holding every object it wrote
        self.emitter: Any = weakref.proxy(emitter)
        self.memo: dict[int, int] = emitter.memo  # (the emitter's own, bound once: one look-up less per tensor)
        self.keep: list[Any] = emitter.keep
        self.storages: dict[int, tuple[str, StorageRef]] = emitter.storages
        self.ready = False  # the rebuild's and OrderedDict's globals are memoised
        self.prefix = b""  # GET of the rebuild, then the MARKs and "storage" of the persistent id
        self.flags = (b"", b"")  # requires_grad False / True, the hooks' GET OrderedDict, its call
        self.heads: dict[str, bytes] = {}  # a storage class's global -> the prefix and its GET
        self.global_keys: dict[str, str] = {}  # a storage class's global -> its key in the global memo
        self.texts: dict[str, bytes] = {}  # a location -> its BINUNICODE
        self.dims: dict[tuple[int, ...], bytes] = {}  # a shape or stride -> its ints and TUPLEn

    def _refresh(self) -> None:
        global_memo = self.emitter.global_memo
        rebuild_at = global_memo.get(_REBUILD_V2_KEY)
        dict_at = global_memo.get(_ORDERED_DICT_KEY)
        if rebuild_at is not None and dict_at is not None:
            self.prefix = _get_bytes(rebuild_at) + _STORAGE_TAG
            tail = _get_bytes(dict_at) + b")R"
            self.flags = (_P.NEWFALSE + tail, _P.NEWTRUE + tail)
            self.ready = True

    def _head(self, storage: StorageRef) -> bytes | None:
        """The bytes before a storage's key: None while its class's global is not memoised."""
        type_global = storage.type_global or f"torch.{storage.dtype.storage_class or 'UntypedStorage'}"
        head = self.heads.get(type_global)
        if head is None:
            type_key = self.global_keys.get(type_global)
            if type_key is None:
                module, name = type_global.rsplit(".", 1)
                type_key = self.global_keys[type_global] = f"{module}\n{name}"
            type_at = self.emitter.global_memo.get(type_key)
            if type_at is None:
                return None
            head = self.heads[type_global] = self.prefix + _get_bytes(type_at)
        return head

    def _dims(self, dims: tuple[int, ...]) -> bytes:
        """A shape or stride (1 to 3 ints) and its TUPLEn, cached by value (ints only: equal tuples, equal bytes)."""
        written = self.dims[dims] = (
            b"".join([_SMALL_INTS[value] if 0 <= value < 256 else _int_bytes(value) for value in dims])
            + _TUPLES[len(dims)]
        )
        return written

    def tensor(self, tensor: TensorRef) -> bytes | None:
        """The bytes of a plain tensor, numbered and memoised as :meth:`ckptool.pickles.emit._Emitter.save`
        numbers and memoises them, or None, with nothing numbered, when it is not one (:func:`_is_plain`)."""
        memo = self.memo
        if not self.ready:
            self._refresh()
            if not self.ready:
                return None
        if not _is_plain(tensor, memo):
            return None
        storage = tensor.storage
        head = self.heads.get(storage.type_global) or self._head(storage)
        if head is None:
            return None  # a global's first use: written (and memoised) by the general path
        emitter, storages = self.emitter, self.storages
        entry = storages.get(id(storage))  # the emitter's _storage_key, inline
        if entry is None:
            entry = storages[id(storage)] = (str(len(storages)) if emitter.renumber else storage.key, storage)
        key = entry[0]
        location = storage.location
        location_bytes = self.texts.get(location)
        if location_bytes is None:
            location_bytes = _text_bytes(location)
        if type(key) is not str or location_bytes is None:
            return None
        data = key.encode("utf-8", "surrogatepass")  # _text_bytes, inline
        if len(data) >= SHARED_TEXT:
            return None  # the general path memoises such a string
        self.texts[location] = location_bytes
        numel, offset, shape, stride = storage.numel, tensor.offset, tensor.shape, tensor.stride
        index = emitter.next_index
        parts = [
            head,
            _P.BINUNICODE,
            _TEXT_LENGTH(len(data)),
            data,
            location_bytes,
            _SMALL_INTS[numel] if 0 <= numel < 256 else _int_bytes(numel),
            b"tQ",
            _SMALL_INTS[offset] if 0 <= offset < 256 else _int_bytes(offset),
        ]
        dims_bytes = self.dims
        for dims in (shape, stride):  # (numbered as pickle numbers them; written by value, never looked up)
            if dims:
                parts.append(dims_bytes.get(dims) or self._dims(dims))
                parts.append(_SHORT_PUTS[index] if index < 256 else _OP_INDEX(0x72, index))
                index += 1
            else:
                parts.append(_P.EMPTY_TUPLE)
        hooks = tensor.backward_hooks
        if hooks is not None:  # (a fresh OrderedDict in its place is numbered alike: nothing else can name it)
            memo[id(hooks)] = index
            self.keep.append(hooks)
        memo[id(tensor)] = index + 2  # (the arguments' tuple is fresh: numbered, never named again)
        self.keep.append(tensor)
        emitter.next_index = index + 3
        parts.append(self.flags[tensor.requires_grad])
        if index >= 256:  # the hooks' PUT, the arguments' TUPLE and PUT, the rebuild's REDUCE and PUT
            parts.append(_TAIL(0x72, index, 0x74, 0x72, index + 1, 0x52, 0x72, index + 2))
        else:
            parts += [_SHORT_PUTS[index], b"t", _put_bytes(index + 1), b"R", _put_bytes(index + 2)]
        return b"".join(parts)


def write_pairs(emitter: Any, batch: list) -> None:
    """The pairs of one SETITEMS batch: a str key and a plain tensor by :class:`PlainTensors`, gathered and written
    together; any other pair (and a pair it declines) by the emitter's general path, in order."""
    plain, memo, write, save = emitter.plain, emitter.memo, emitter.write, emitter.save
    parts: list[bytes] = []
    for key, value in batch:
        if type(key) is str and type(value) is TensorRef and id(value) not in memo and id(key) not in memo:
            data = key.encode("utf-8", "surrogatepass")  # _text_bytes, inline
            if len(data) < SHARED_TEXT:
                written = plain.tensor(value)
                if written is not None:
                    parts += (_P.BINUNICODE, _TEXT_LENGTH(len(data)), data, written)
                    continue
        if parts:
            write(b"".join(parts))
            parts.clear()
        save(key)
        save(value)
    if parts:
        write(b"".join(parts))
