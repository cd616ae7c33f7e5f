"""The allowlist: which globals a pickle may name, and the inert placeholder each one becomes.

:data:`TORCH_GLOBALS` is torch's own ``weights_only`` set, each name mapped to the placeholder or
checking rebuild that stands for it (:mod:`ckptool.pickles.rebuilds`); :data:`DEFAULT_EXTRA_GLOBALS`
the data-only classes training scripts store, recorded as :class:`OpaqueObject`\\ s. SECURITY.md
gives the reason for each. :class:`GlobalResolver` applies them (and a user's ``--allow-global``
names and shell patterns) to one read; anything else is collected, and the read raises one
:class:`RefusedGlobal` naming all of them. :func:`runs_code` tells the globals known to run code or
reach the system (``os.system``, ``builtins.eval``) from merely unknown ones.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from ckptool.pickles import gadgets, layouts, limits, quantized
from ckptool.pickles.placeholders import (
    _OPAQUE_TYPES,
    OpaqueObject,
    StorageTypeRef,
    TypeRef,
    attribute_type,
    opaque_type,
    refuse_build,
)
from ckptool.pickles.rebuilds import (
    _builtin_bytearray,
    _builtin_complex,
    _builtin_set,
    _codecs_encode,
    _counter,
    _ordered_dict,
    _rebuild_device_tensor_from_cpu_tensor,
    _rebuild_from_type_v2,
    _rebuild_meta_tensor_no_storage,
    _rebuild_parameter,
    _rebuild_parameter_with_state,
    _rebuild_tensor,
    _rebuild_tensor_v2,
    _rebuild_tensor_v3,
    _torch_device,
    _torch_size,
)
from ckptool.tensors import dtypes
from ckptool.tensors.refs import DTypeRef

if TYPE_CHECKING:
    from ckptool.pickles.guard_cache import GuardCache


class RefusedGlobal(Exception):
    """Raised after a pickle's walk when it names globals outside the allowlist.

    ``names`` lists every refused global in the order the pickle first names them (``name`` is the
    first); ``complete`` is False when the walk, carried on with inert placeholders past the first
    refusal, stopped early on something else, so more names may follow those listed; ``called_on``
    maps a data class refused because a call converts one of its objects while unpickling (its own
    code would run) to that call.
    """

    def __init__(
        self, names: str | Sequence[str], *, complete: bool = True, called_on: Mapping[str, str] | None = None
    ) -> None:
        self.names = [names] if isinstance(names, str) else list(names)
        self.name = self.names[0]
        self.complete = complete
        self.called_on = dict(called_on or {})
        super().__init__(", ".join(self.names))


def _build_torch_globals() -> dict[str, Any]:
    table: dict[str, Any] = {
        "collections.OrderedDict": _ordered_dict,
        "collections.Counter": _counter,
        "_codecs.encode": _codecs_encode,
        "builtins.set": _builtin_set,
        "builtins.bytearray": _builtin_bytearray,
        "builtins.complex": _builtin_complex,
        "torch.Size": _torch_size,
        "torch.device": _torch_device,
        "torch._utils._rebuild_tensor": _rebuild_tensor,
        "torch._utils._rebuild_tensor_v2": _rebuild_tensor_v2,
        "torch._utils._rebuild_tensor_v3": _rebuild_tensor_v3,
        "torch._utils._rebuild_parameter": _rebuild_parameter,
        "torch._utils._rebuild_parameter_with_state": _rebuild_parameter_with_state,
        "torch._tensor._rebuild_from_type_v2": _rebuild_from_type_v2,
        "torch._utils._rebuild_meta_tensor_no_storage": _rebuild_meta_tensor_no_storage,
        "torch._utils._rebuild_device_tensor_from_cpu_tensor": _rebuild_device_tensor_from_cpu_tensor,
        "torch.Tensor": TypeRef("torch", "Tensor"),
        "torch.storage.UntypedStorage": StorageTypeRef("torch.storage", "UntypedStorage", dtypes.BY_NAME["U8"]),
        "torch.UntypedStorage": StorageTypeRef("torch", "UntypedStorage", dtypes.BY_NAME["U8"]),
    }
    for storage_class, dtype in dtypes.BY_STORAGE_CLASS.items():
        table[f"torch.{storage_class}"] = StorageTypeRef("torch", storage_class, dtype)
        # what files saved from a GPU named their storages before typed storages lost their device;
        # torch reads them by dtype alone (the location tag says where the bytes were)
        table[f"torch.cuda.{storage_class}"] = StorageTypeRef("torch.cuda", storage_class, dtype)
    for torch_name in (*dtypes.BY_TORCH_NAME, *dtypes.VALUE_ONLY_TORCH_NAMES):
        table[f"torch.{torch_name}"] = DTypeRef("torch", torch_name)
    for value in table.values():
        if callable(value) and not isinstance(value, type):
            # BUILD on a function would set its __defaults__ for every later load in this process
            value.__setstate__ = refuse_build
    return table


# Globals torch's own weights_only unpickler allows, mapped to inert placeholders: the plain tensors' table, then
# sparse and nested tensors and the layouts they name (whose parameter rebuilds take a layout tensor too), and
# quantized tensors, storages and their schemes.
TORCH_GLOBALS: dict[str, Any] = {
    **_build_torch_globals(),
    **layouts.GLOBALS,
    **layouts.WRAPPED_REBUILDS,
    **quantized.GLOBALS,
}

# Data-only globals found in real checkpoints beyond torch's list: recorded, never constructed.
# Each is a class whose construction (or, under a real pickle, its REDUCE/NEWOBJ and BUILD path)
# with any argument only stores values: no file, process, network or import is touched, and no
# code of the saving package runs. SECURITY.md gives each one's reason.
_NUMPY_GLOBALS = (  # metrics and RNG states saved as numpy values
    "numpy.core.multiarray._reconstruct",
    "numpy._core.multiarray._reconstruct",
    "numpy.core.multiarray.scalar",
    "numpy._core.multiarray.scalar",
    "numpy.ndarray",
    "numpy.dtype",
)
_STDLIB_DATA_GLOBALS = (
    "argparse.Namespace",  # parsed training arguments (fairseq, many research repos)
    # paths (Lightning's ModelCheckpoint.dirpath): a path object is its string parts; building one
    # touches no file system. Python 3.13 defines them in pathlib._local.
    *(
        f"{module}.{name}"
        for module in ("pathlib", "pathlib._local")
        for name in ("Path", "PosixPath", "WindowsPath", "PurePath", "PurePosixPath", "PureWindowsPath")
    ),
    "datetime.date",
    "datetime.datetime",
    "datetime.time",
    "datetime.timedelta",
    "datetime.timezone",
    "decimal.Decimal",
    "uuid.UUID",
    "uuid.SafeUUID",
    # containers: a defaultdict stores its factory and calls it only on a later missing-key lookup,
    # never while it is unpickled; a deque stores items and a maximum length
    "collections.defaultdict",
    "collections.deque",
    # classes held as values (a defaultdict's factory, omegaconf's key and element types): a class is
    # data unless called, and ckptool calls nothing; a pickle that calls one gets a record of the call
    *(f"builtins.{name}" for name in ("list", "dict", "tuple", "int", "float", "str", "bool", "bytes", "frozenset")),
    "typing.Any",
    "typing.Dict",
    "typing.List",
)
_FRAMEWORK_DATA_GLOBALS = (
    # Lightning's hyper-parameters: a dict subclass that also reads its keys as attributes
    "lightning.fabric.utilities.data.AttributeDict",
    "lightning_fabric.utilities.data.AttributeDict",
    "pytorch_lightning.utilities.parsing.AttributeDict",
    "lightning.pytorch.utilities.parsing.AttributeDict",
    # omegaconf (Hydra / Lightning hyper-parameters): containers and nodes whose __setstate__ only
    # stores their fields; interpolations and resolvers run when a value is read, never on unpickling
    "omegaconf.dictconfig.DictConfig",
    "omegaconf.listconfig.ListConfig",
    "omegaconf.base.ContainerMetadata",
    "omegaconf.base.Metadata",
    *(
        f"omegaconf.nodes.{name}"
        for name in (
            "AnyNode",
            "StringNode",
            "IntegerNode",
            "FloatNode",
            "BooleanNode",
            "BytesNode",
            "PathNode",
            "EnumNode",
            "ValueNode",
            "InterpolationResultNode",
        )
    ),
)
DEFAULT_EXTRA_GLOBALS: tuple[str, ...] = (
    *_STDLIB_DATA_GLOBALS[:1],
    *_NUMPY_GLOBALS,
    *_STDLIB_DATA_GLOBALS[1:],
    *_FRAMEWORK_DATA_GLOBALS,
)


def runs_code(full_name: str) -> bool:
    """Whether ``full_name`` is a global known to run code or reach the system rather than merely unknown,
    judged by what it resolves to (:func:`ckptool.pickles.gadgets.runs_code`: ``os.system``,
    ``torch.serialization.os.system``, ``builtins.eval.__call__``); torch's own rebuilds never are. Every
    global outside the allowlist is refused whatever this says; it decides how a refusal and scan describe
    a name ("runs code" rather than "unknown"), that a refusal naming one suggests no flag, and that no
    pattern (``--allow-global 'builtins.*'``, ``'*'``) allows one: only its exact name does."""
    full_name = python3_name(full_name)
    return full_name not in TORCH_GLOBALS and gadgets.runs_code(full_name)


# Calls that iterate or convert their argument, and the packages whose objects run their own code then
_CONVERTERS: frozenset[str] = frozenset(
    {
        *(
            f"builtins.{name}"
            for name in (
                "dict",
                "list",
                "tuple",
                "set",
                "frozenset",
                "str",
                "int",
                "float",
                "bool",
                "bytes",
                "bytearray",
                "complex",
                "sorted",
                "iter",
                "next",
                "max",
                "min",
                "sum",
                "any",
                "all",
                "enumerate",
                "zip",
                "map",
                "filter",
                "reversed",
                "len",
                "repr",
                "format",
                "hash",
                "print",
                "ascii",
            )
        ),
        "collections.deque",
        "collections.defaultdict",
        "collections.ChainMap",
    }
)
_RUN_WHEN_CONVERTED = ("omegaconf.",)


def may_convert(names: Iterable[str]) -> bool:
    """Whether globals a pickle named hold both a call that iterates or converts its arguments
    (``builtins.dict``) and a class whose own code such a call would run (omegaconf's)."""
    spelled = [python3_name(name) for name in names]
    return any(name in _CONVERTERS for name in spelled) and any(
        name.startswith(_RUN_WHEN_CONVERTED) for name in spelled
    )


_OPAQUE_TYPES_KEPT = 100_000  # placeholder classes kept between reads (each read adds at most MAX_GLOBALS)

# Pickle's protocol-2 spelling of a nested name (``HistoryBuffer.min``): ``getattr(<global>, 'min')``.
ATTRIBUTE_LOOKUP = "builtins.getattr"


def is_attribute_name(name: object) -> bool:
    """Whether ``getattr(<global>, name)`` can be pickle's spelling of a nested name: a plain
    identifier, no dunder (``__globals__``, ``__subclasses__`` reach far beyond the class)."""
    return type(name) is str and name.isidentifier() and not (name.startswith("__") and name.endswith("__"))


_PATTERN_CHARACTERS = frozenset("*?[")


def is_pattern(allowed: str) -> bool:
    """Whether an ``--allow-global`` entry is a shell pattern (``omegaconf.*``) rather than a name."""
    return not _PATTERN_CHARACTERS.isdisjoint(allowed)


def _py2_modules() -> frozenset[str]:
    import _compat_pickle

    return frozenset(_compat_pickle.IMPORT_MAPPING) | frozenset(module for module, _ in _compat_pickle.NAME_MAPPING)


_PY2_MODULES = _py2_modules()


def python3_name(full_name: str) -> str:
    """A global as Python 3 names it: protocol-2 pickles (torch.save's) name ``__builtin__.set``,
    ``copy_reg._reconstructor``...; pickle's own compatibility table (``_compat_pickle``, which
    torch's weights_only loader applies too) maps them before any allowlist is consulted."""
    module, _, name = full_name.rpartition(".")
    if module not in _PY2_MODULES:
        return full_name
    return ".".join(_python3(module, name))


def _python3(module: str, name: str) -> tuple[str, str]:
    import _compat_pickle

    mapped = _compat_pickle.NAME_MAPPING.get((module, name))
    if mapped is not None:
        return mapped
    return _compat_pickle.IMPORT_MAPPING.get(module, module), name


class GlobalResolver:
    """Maps a pickle's ``module.name`` to a placeholder, or refuses it.

    A refused name is recorded in ``refused`` (first-seen order) and resolved to an inert
    placeholder all the same, so the walk goes on and finds every other refused name;
    :func:`~ckptool.pickles.loads` raises one :class:`RefusedGlobal` naming them all when the walk
    ends. Nothing is called either way: the placeholder is a record.

    Args:
        allow_globals: extra names to accept as :class:`OpaqueObject` placeholders, each an exact
            ``module.Name`` or a shell pattern matched against the whole dotted name
            (``omegaconf.*``, ``pathlib.*Path``, ``*`` for every name). ``TORCH_GLOBALS`` keep
            their checking rebuilds whatever a pattern says, and a pattern never allows a global
            that :func:`runs_code` (name it exactly to read it).
        permissive: scan mode — record every global and return a harmless placeholder for all.
        guard_cache: the pickles this read's operation already walked (a scan that then loads,
            a write that re-reads its output); none: every pickle is walked.
    """

    def __init__(
        self, allow_globals: Sequence[str] = (), *, permissive: bool = False, guard_cache: GuardCache | None = None
    ) -> None:
        self.named = {python3_name(name) for name in allow_globals if not is_pattern(name)}  # the caller's own
        self.extra = set(DEFAULT_EXTRA_GLOBALS) | self.named
        self.patterns = tuple(dict.fromkeys(name for name in allow_globals if is_pattern(name)))
        self.allow_globals = tuple(allow_globals)  # as the caller gave them
        self.permissive = permissive
        self.guard_cache = guard_cache
        self.seen: dict[str, int] = {}
        self.refused: list[str] = []
        self._refused: set[str] = set()  # the same names: a flood of them is refused in linear time
        self._lookups: list[type] = []  # one getattr placeholder per GLOBAL naming it (see _attribute_lookup)
        # data classes a call iterates or converts while unpickling (builtins.dict(<DictConfig>)): the class's own
        # code then runs, so it needs the caller's trust (name -> the call)
        self.called_on: dict[str, str] = {}
        # refused globals that may yet be data (never called, held only as values; references.py): name -> whether
        # the pickle has called it (placeholders.WATCHED); and those the read accepted so
        self.references: dict[str, bool] = {}
        self.referenced: list[str] = []
        self._references_kept: dict[str, bool] = {}
        if len(_OPAQUE_TYPES) > _OPAQUE_TYPES_KEPT:  # placeholders of earlier reads: no read holds them by name
            _OPAQUE_TYPES.clear()

    def records(self) -> tuple[dict[str, int], int, int]:
        """What resolving has recorded so far, for :meth:`restore` (which calls the pickle made: kept here)."""
        self._references_kept = dict(self.references)
        return dict(self.seen), len(self.refused), len(self._lookups)

    def restore(self, records: tuple[dict[str, int], int, int]) -> None:
        """Forget what was resolved since :meth:`records` (a run given up, to be run again)."""
        seen, refused, lookups = records
        self.seen.clear()
        self.seen.update(seen)
        del self.refused[refused:]
        self._refused = set(self.refused)
        del self._lookups[lookups:]
        self.references.clear()
        self.references.update(self._references_kept)

    def is_allowed(self, full_name: str) -> bool:
        full_name = python3_name(full_name)
        if full_name in self.called_on:  # no more data: a call runs its code; like a code-running name, exact only
            return full_name in self.named
        return full_name in TORCH_GLOBALS or full_name in self.extra or self._matches(full_name)

    def _refuse(self, full_name: str) -> None:
        if full_name not in self._refused:
            self._refused.add(full_name)
            self.refused.append(full_name)

    def _refuse_class(self, full_name: str) -> None:
        """Refuse a global the pickle names (GLOBAL, STACK_GLOBAL, a nested name): refused for good if it runs
        code; else it may yet be read as data, if the pickle never calls it (:meth:`data_references`)."""
        self._refuse(full_name)
        if not full_name.startswith("<") and not runs_code(full_name):
            self.references.setdefault(full_name, False)

    def _matches(self, full_name: str) -> bool:
        """Whether one of the user's patterns allows ``full_name`` (a Python 3 name): by matching it,
        or by being it (a global may be named ``x.[a]``)."""
        if not self.patterns or full_name.startswith("<") or runs_code(full_name):
            return False  # "<unresolved STACK_GLOBAL>" is scan's mark for a name it could not read, not a name
        return full_name in self.patterns or any(fnmatch.fnmatchcase(full_name, pattern) for pattern in self.patterns)

    def resolve(self, module: str, name: str) -> Any:
        full_name = spelled = f"{module}.{name}"
        if module in _PY2_MODULES:
            module, name = _python3(module, name)
            full_name = f"{module}.{name}"
        if full_name == ATTRIBUTE_LOOKUP:  # counted by what it is called with (see _attribute_lookup)
            return self._attribute_lookup(spelled)
        self._count(spelled)  # as the file names it
        if full_name in TORCH_GLOBALS:  # before any pattern: torch's globals keep their checks under '*'
            return TORCH_GLOBALS[full_name]
        if not (full_name in self.extra or self._matches(full_name)):
            self._refuse_class(full_name)  # an inert placeholder all the same lets the walk go on to every other one
        return opaque_type(full_name, module)

    def _count(self, spelled: str) -> None:
        count = self.seen.get(spelled)
        if count is None and len(self.seen) >= limits.MAX_GLOBALS:
            raise limits.refuse(f"names over {limits.MAX_GLOBALS} distinct globals (a memory bomb)")
        self.seen[spelled] = 1 if count is None else count + 1

    def may_convert(self) -> bool:
        """Whether the pickle named a call that may convert an object whose class's code it runs
        (:func:`may_convert`): its tree is then looked through for such calls (:meth:`called`)."""
        return may_convert(self.seen)

    def called(self, call: OpaqueObject) -> None:
        """An allowed call the pickle makes (``builtins.dict(<DictConfig>)``): on an object of a class whose own
        code it would run (omegaconf's containers resolve interpolations when iterated, running the resolvers
        the loading program registered: ``${oc.env:...}`` reads the environment, and the ``eval`` resolver many
        projects register runs any code), that class is refused like a code-running name: read only when the
        caller names it exactly."""
        if call._global in _CONVERTERS and call._mode == "reduce" and isinstance(call._args, tuple):
            for arg in call._args:
                if isinstance(arg, OpaqueObject) and arg._global.startswith(_RUN_WHEN_CONVERTED):
                    self._called_on(arg._global, call._global)

    def _called_on(self, class_name: str, call: str) -> None:
        self.called_on.setdefault(class_name, call)
        if class_name not in self.named:  # as for a code-running name: no pattern, only its exact name reads it
            self._refuse(class_name)

    def _attribute_lookup(self, spelled: str) -> type:
        """The placeholder for one GLOBAL naming ``builtins.getattr``, judged by its calls.

        ``getattr(<global>, 'name')`` with a plain name is pickle's protocol-2 spelling of the
        nested global ``<global>.name`` (a method or nested class): it resolves to that global's
        placeholder, allowed or refused by that name like any other (``mmengine.*`` allows
        ``mmengine.logging.history_buffer.HistoryBuffer.min``). Any other call, or the function
        kept uncalled, is ``builtins.getattr`` itself, which runs code: refused unless named exactly,
        then recorded as an inert call.
        """
        resolver = self

        def __new__(cls: type, *args: Any, **kwargs: Any) -> Any:
            if not kwargs and len(args) == 2:
                parent, attribute = args
                if (
                    isinstance(parent, type)
                    and issubclass(parent, OpaqueObject)
                    and parent._global
                    and parent._global != ATTRIBUTE_LOOKUP
                    and is_attribute_name(attribute)
                ):
                    cls._use = cls._use or "named"  # type: ignore[attr-defined]
                    return resolver._nested(parent, attribute)
            if cls._use != "called":  # type: ignore[attr-defined]
                cls._use = "called"  # type: ignore[attr-defined]
                resolver._record_lookup(spelled)
            return OpaqueObject.__new__(cls, *args, **kwargs)

        lookup = type(
            "getattr",
            (OpaqueObject,),
            {"_global": ATTRIBUTE_LOOKUP, "__slots__": (), "__new__": __new__, "_use": "", "_spelled": spelled},
        )
        self._lookups.append(lookup)
        return lookup

    def _nested(self, parent: type, attribute: str) -> type:
        full_name = f"{parent._global}.{attribute}"  # type: ignore[attr-defined]
        self._count(full_name)
        if not (full_name in self.extra or self._matches(full_name)):
            self._refuse_class(full_name)
        return attribute_type(parent, attribute)

    def _record_lookup(self, spelled: str) -> None:
        self._count(spelled)
        if ATTRIBUTE_LOOKUP not in self.extra:
            self._refuse(ATTRIBUTE_LOOKUP)

    def _settle_lookups(self) -> None:
        for lookup in self._lookups:  # a getattr the pickle named but never called: the function itself
            if not lookup._use:  # type: ignore[attr-defined]
                lookup._use = "called"  # type: ignore[attr-defined]
                self._record_lookup(lookup._spelled)  # type: ignore[attr-defined]

    def data_references(self) -> list[str]:
        """The globals refused so far when each of them may be data: named by the pickle, known to run no code,
        and never called (no object of it built); else none. The read accepts them when its tree holds them only
        as values (:func:`ckptool.pickles.references.accept_data_references`)."""
        self._settle_lookups()
        if self.permissive or not self.refused or any(self.references.get(name, True) for name in self.refused):
            return []
        return list(self.refused)

    def accept(self, names: list[str]) -> None:
        """Read ``names`` (refused so far) as data after all: the pickle holds them only as values."""
        gone = set(names)
        self.refused[:] = [name for name in self.refused if name not in gone]
        self._refused -= gone
        self.referenced += [name for name in names if name not in self.referenced]

    def refusal(self, *, complete: bool = True) -> RefusedGlobal | None:
        """The one refusal naming every global refused so far (none in permissive mode, or if none was)."""
        self._settle_lookups()
        if self.permissive or not self.refused:
            return None
        return RefusedGlobal(self.refused, complete=complete, called_on=self.called_on)
