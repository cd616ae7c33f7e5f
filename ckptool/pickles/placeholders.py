"""The inert stand-ins the restricted unpickler builds for the globals it allows.

A pickle's globals never become the classes or functions they name: a storage class becomes a
:class:`StorageTypeRef`, ``torch.Tensor`` a :class:`TypeRef`, an allowed class ckptool does not
model an :class:`OpaqueObject` recording how it was built, and ``collections.OrderedDict`` a
:class:`StateDict` that refuses attributes hiding its contents. (Tensors, storages, dtypes, sizes
and devices are the format-neutral records of :mod:`ckptool.tensors.refs`, which the safetensors and DCP
readers build too; these types exist only because a pickle names them.)
"""

from __future__ import annotations

from collections import OrderedDict
from contextvars import ContextVar
from typing import Any

from ckptool.base.errors import InputError
from ckptool.pickles.limits import brief
from ckptool.tensors.dtypes import DType


def refuse_build(state: Any) -> None:
    """``__setstate__`` of every shared placeholder: BUILD on one would change it for every later load."""
    raise InputError("pickle sets state (BUILD) on an allowlisted global — torch never writes that; refused")


class TypeRef:
    """A class global torch's weights_only set allows as a value (``torch.Tensor``): a name, never the class."""

    __slots__ = ("module", "name")

    def __init__(self, module: str, name: str) -> None:
        self.module, self.name = module, name

    def __setstate__(self, state: Any) -> None:  # one instance per class is shared by every load
        refuse_build(state)

    def __repr__(self) -> str:
        return f"{self.module}.{self.name}"


class StorageTypeRef:
    """A storage class global (``torch.FloatStorage``, ``torch.storage.UntypedStorage``)."""

    __slots__ = ("module", "name", "dtype")

    def __init__(self, module: str, name: str, dtype: DType) -> None:
        self.module, self.name, self.dtype = module, name, dtype

    def __setstate__(self, state: Any) -> None:  # one instance per class is shared by every load
        refuse_build(state)


# The refused globals a read watches while its unpickler runs (see unpickle.loads): name -> whether the pickle
# has called it. A refused class the pickle never calls and holds only as a value is data (references.py); an
# object of one is made here, however the pickle calls it (REDUCE, NEWOBJ, NEWOBJ_EX, OBJ, INST; by a GLOBAL,
# the memo), so every such call is seen.
WATCHED: ContextVar[dict[str, bool] | None] = ContextVar("ckptool_watched_globals", default=None)


def watched_names(cls: type) -> list[str]:
    """The globals a placeholder class stands for: its own and, for a nested name read from
    ``getattr(<parent>, 'name')``, each enclosing one (calling ``Outer.Inner`` uses ``Outer`` too)."""
    names: list[str] = []
    node: Any = cls
    while node is not None:
        names.append(node._global)
        node = node._parent
    return names


class OpaqueObject:
    """An allowed object of a class ckptool does not model: its construction is recorded, never run.

    ``_mode`` is ``"newobj"`` (built by NEWOBJ: ``cls.__new__(cls, *args)``), ``"newobj_ex"``
    (NEWOBJ_EX with keyword arguments: ``_args`` is then the pair ``(args, kwargs)``, so every walk
    of ``_args`` sees both) or ``"reduce"`` (built by calling the global). State from BUILD (a dict,
    or a ``(state, slotstate)`` pair, kept as given) and items from APPEND(S)/SETITEM(S) are kept so
    :func:`dump` can re-emit the object exactly.
    """

    _global: str = ""
    _module: str | None = None  # where ``_global``'s module ends, when not at its last dot (see opaque_type)
    # a nested name read as pickle's protocol-2 spelling getattr(parent, attribute) (see attribute_type)
    _parent: type | None = None
    _attribute: str = ""
    # per instance, set by __new__ and __init__ (annotations only: no class attribute)
    _args: tuple[Any, ...]
    _mode: str
    _state: Any
    _items: list[Any]
    _setitems: list[Any]

    def __new__(cls, *args: Any, **kwargs: Any) -> OpaqueObject:
        watched = WATCHED.get()
        if watched:  # a call of a global the read refused: it is then no mere value
            for name in watched_names(cls):
                if name in watched:
                    watched[name] = True
        obj = object.__new__(cls)
        obj._args = (args, kwargs) if kwargs else args
        obj._mode = "newobj_ex" if kwargs else "newobj"
        obj._state = None
        obj._items = []
        obj._setitems = []
        return obj

    def __init__(self, *args: Any) -> None:
        self._mode = "reduce"

    def __setstate__(self, state: Any) -> None:
        if self._state is not None:
            # pickle never writes it; the class would apply both, a rewrite could keep only one
            raise InputError(
                f"pickle sets the state of one {self._global} object twice (two BUILDs) — no pickler "
                "writes that, and a rewrite could keep only one; refused (re-save the object with "
                "torch.save from the program that made it)"
            )
        self._state = state

    # pickle gives an object its appended items, then its set items, then its state (save_reduce's
    # order, the one dump writes back); items out of that order could change what the class builds
    def _check_order(self, what: str, later: bool) -> None:
        if self._state is not None or later:
            raise InputError(
                f"pickle {what} one {self._global} object after its "
                f"{'state (BUILD)' if self._state is not None else 'set items'} — no pickler writes "
                "that, and a rewrite would reorder it; refused (re-save the object with torch.save "
                "from the program that made it)"
            )

    def append(self, item: Any) -> None:
        self._check_order("appends items to", bool(self._setitems))
        self._items.append(item)

    def extend(self, items: Any) -> None:
        self._check_order("appends items to", bool(self._setitems))
        self._items.extend(items)

    def __setitem__(self, key: Any, value: Any) -> None:
        self._check_order("sets items on", False)
        self._setitems.append((key, value))

    def reduce_args(self) -> tuple:
        """The arguments the pickle passes to the global (a placeholder may hold them in another form)."""
        return self._args

    def __repr__(self) -> str:
        return f"<{self._global}>"

    @property
    def global_name(self) -> str:
        return self._global

    @property
    def state(self) -> Any:
        return self._state


_OPAQUE_TYPES: dict[str, type] = {}


def opaque_type(full_name: str, module: str | None = None) -> type:
    """The placeholder class standing for global ``full_name`` (one class per name).

    ``module``: the module part as the pickle gave it, where that is not all before the last dot —
    protocol 4 (STACK_GLOBAL) names a nested class ``Outer.Inner`` in module ``m``, which a rewrite
    must name the same way to load.
    """
    if module is not None and (not full_name.startswith(module + ".") or "." not in full_name[len(module) + 1 :]):
        module = None  # the usual split, at the last dot
    key = full_name if module is None else f"{module}:{full_name[len(module) + 1 :]}"
    cls = _OPAQUE_TYPES.get(key)
    if cls is None:
        home, _, qualname = full_name.rpartition(".") if module is None else (module, "", full_name[len(module) + 1 :])
        attributes: dict[str, Any] = {"_global": full_name, "__slots__": ()}
        # named as the global: a class held as a value shows as Python shows that class (<class 'm.Name'>)
        attributes.update(__module__=home or "builtins", __qualname__=qualname)
        if module is not None:
            attributes["_module"] = module
        cls = type(full_name.rsplit(".", 1)[-1], (OpaqueObject,), attributes)
        _OPAQUE_TYPES[key] = cls
    return cls


def attribute_type(parent: type, attribute: str) -> type:
    """The placeholder class for global ``parent.attribute`` read from ``getattr(parent, 'attribute')``.

    Below protocol 4, pickle names a nested qualified name (a method ``HistoryBuffer.min``, a class
    ``Outer.Inner``) by a call ``builtins.getattr(<the enclosing global>, 'attribute')``; the reader
    takes that call for the global it spells, and the writer spells it back the same way.
    """
    parent_name: str = parent._global  # type: ignore[attr-defined]
    key = f"{parent_name}\n{attribute}"
    cls = _OPAQUE_TYPES.get(key)
    if cls is None:
        cls = type(
            attribute,
            (OpaqueObject,),
            {
                "_global": f"{parent_name}.{attribute}",
                "_parent": parent,
                "_attribute": attribute,
                "__slots__": (),
                "__module__": parent.__module__,
                "__qualname__": f"{parent.__qualname__}.{attribute}",
            },
        )
        _OPAQUE_TYPES[key] = cls
    return cls


class StateDict(OrderedDict):
    """The ``collections.OrderedDict`` a pickle builds (a state_dict), whose attributes a pickle cannot
    turn against its readers.

    torch's loader applies BUILD state to an OrderedDict as ``__dict__.update(state)``; torch.save
    writes one attribute that way, ``_metadata`` (module versions). An attribute named like a method
    (``items``, ``keys``, ``get``...) would shadow it for every reader that calls ``obj.items()`` —
    ckptool, json, other tools — while torch's own value is the mapping's real contents. Such state
    is refused; other attributes are kept as torch keeps them.
    """

    __slots__ = ()  # instances still have a __dict__ (OrderedDict's), which BUILD fills

    def __setstate__(self, state: Any) -> None:
        if not isinstance(state, dict):
            raise InputError(
                f"pickle sets the state of an OrderedDict to {brief(state)}, not a dict of attributes — refused"
            )
        for name in dict.keys(state):
            if type(name) is not str or hasattr(OrderedDict, name) or name.startswith("__"):
                raise InputError(
                    f"pickle sets attribute {brief(name)} on an OrderedDict, hiding its own "
                    "contents from readers (torch.save never writes that) — refused"
                )
        self.__dict__.update(state)

    def __reduce__(self) -> Any:  # copy/deepcopy/pickle treat it as the OrderedDict it stands for
        state = dict(self.__dict__) or None
        return (OrderedDict, (), state, None, iter(dict.items(self)))


# shown as what the file holds (repr, inspect's entries, error messages): an OrderedDict
StateDict.__name__ = StateDict.__qualname__ = "OrderedDict"
