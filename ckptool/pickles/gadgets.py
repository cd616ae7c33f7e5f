"""Which globals run code or reach the system: judged by what a name resolves to, not how it is spelled.

A pickle names a global as ``module.qualified.name``, and the unpickler that runs it imports the
module and follows the dots. So ``torch.serialization.os.system`` is ``os.system`` (torch.serialization
imports os), ``argparse._os.system`` too, ``builtins.eval.__call__`` is ``eval``, and
``numpy.testing.runstring`` is ``numpy.testing._private.utils.runstring``. :func:`runs_code` says
dangerous when, for some reading of the name:

1. a component after the module's first is a dunder (``__call__``, ``__self__``, ``__globals__``,
   ``__builtins__``, ``__subclasses__``): attribute walks through dunders reach every function and
   module of the process (``copyreg.__newobj__``, which only calls a class's ``__new__``, excepted);
2. the name or one of its prefixes is a known code-running global or module (:data:`CODE_RUNNING`:
   processes, imports, files, the network, pickle loaders, torch's and numpy's own loaders and exec
   helpers, test and build tooling; and :mod:`.gadget_table`, the functions a census of torch's,
   numpy's and the standard library's sources finds calling such things, with their aliases);
3. a later component is a system module re-exported by another (``X.os``, ``X._os``, ``X.subprocess``,
   ``X.pickle``, ``X.builtins``, ``X.sys``, ...): the rest is judged as a name of that module;
4. the name is in the standard library (``sys.stdlib_module_names``: a fixed set) and not one of its
   inert names (:data:`STDLIB_INERT`: data classes and pure functions). The standard library's
   other functions open files, start processes, import modules or register hooks; no checkpoint
   needs them.

Names outside the standard library, torch and numpy are judged only by rules 1–3: a framework's own
classes are *unknown* (they need trust), not dangerous. The tables are plain data, the same on every
machine: no module is imported to judge a name. ``scripts/gadget_census.py`` writes the census's
table; ``tests/test_gadgets.py`` holds every table to the torch, numpy and Python installed, so a
release of theirs that adds a gadget or an alias fails the tests until the table is written again.
"""

from __future__ import annotations

import builtins
import sys
from typing import Final

from ckptool.pickles.gadget_names import (
    CODE_RUNNING,
    CODE_RUNNING_MODULES,
    MODULE_OBJECTS,
    SYSTEM_MODULES,
)

# Names inside a code-running module that are data (read by ckptool's own format readers): the names under
# these modules' (not the modules themselves, which a package may shadow with something else)
_INERT_WITHIN: Final = (
    "torch.jit._pickle.",  # TorchScript's list tags: each returns its argument
    "numpy.random._pickle.",  # numpy's random generators, rebuilt from their state
    "torch.distributed.checkpoint.metadata.",  # DCP's metadata records (dataclasses)
    "torch.distributed.checkpoint.filesystem._StorageInfo",
    "torch.serialization._get_layout",  # a layout's name, as torch pickles it
)

# System modules whose name, as a later component, is that module re-exported (``torch.os``, ``argparse._os``):
# every code-running module but those whose names are also common method names, and the modules whose own
# listed names are code-running
_REEXPORTED: Final = frozenset(
    {module.split(".")[0] for module in SYSTEM_MODULES} - {"test", "sh", "profile", "trace", "code", "site", "http"}
) | {
    "builtins",
    "builtin",
    "io",
    "codecs",
    "types",
    "operator",
    "pathlib",
    "uuid",
    "argparse",
    "logging",
    "copyreg",
    "typing",
    "numpy",
    "torch",
}
# Of those, modules not code-running as a whole whose module object still reaches code (a BUILD on it
# replaces their functions; an attribute walk from it reaches eval)
_REACHING_MODULES: Final = frozenset({"builtins", "builtin", "io", "codecs", "types", "operator", "copyreg"})

# The standard library's inert names: classes that hold values and functions that only compute. A whole
# module where every name is so; otherwise the names themselves. Everything else of the standard library
# is judged dangerous (rule 4).
_INERT_STDLIB_MODULES: Final = frozenset(
    {
        "math",
        "cmath",
        "itertools",
        "heapq",
        "bisect",
        "numbers",
        "fractions",
        "decimal",
        "_decimal",
        "_pydecimal",
        "datetime",
        "_datetime",
        "_pydatetime",
        "statistics",
        "string",
        "struct",
        "_struct",
        "array",
        "copy",
        "collections",
        "_collections",
        "_collections_abc",
        "enum",
        "abc",
        "_abc",
        "re",
        "_sre",
        "sre_compile",
        "sre_parse",
        "sre_constants",
        "functools",
        "_functools",
        "operator",
        "_operator",
        "random",
        "_random",
        "ipaddress",
        "typing",
        "zoneinfo",
        "textwrap",
        "keyword",
        "reprlib",
        "graphlib",
        "weakref",
        "_weakref",
        "_weakrefset",
        "colorsys",
        "unicodedata",
        "hashlib",
        "_hashlib",
        "hmac",
        "binascii",
        "contextvars",
    }
)
_INERT_STDLIB_NAMES: Final = frozenset(
    {
        *(
            f"builtins.{name}"
            for name in (
                "abs",
                "all",
                "any",
                "ascii",
                "bin",
                "bool",
                "bytearray",
                "bytes",
                "callable",
                "chr",
                "classmethod",
                "complex",
                "dict",
                "divmod",
                "enumerate",
                "filter",
                "float",
                "format",
                "frozenset",
                "hash",
                "hex",
                "id",
                "int",
                "isinstance",
                "issubclass",
                "iter",
                "len",
                "list",
                "map",
                "max",
                "min",
                "next",
                "object",
                "oct",
                "ord",
                "pow",
                "print",
                "property",
                "range",
                "repr",
                "reversed",
                "round",
                "set",
                "slice",
                "sorted",
                "staticmethod",
                "str",
                "sum",
                "super",
                "tuple",
                "type",
                "zip",
                "Ellipsis",
                "NotImplemented",
                "memoryview",
            )
        ),
        "_codecs.encode",
        "_codecs.decode",
        "codecs.encode",
        "codecs.decode",
        "copyreg._reconstructor",
        "copyreg.__newobj__",
        "copyreg.__newobj_ex__",
        "types.SimpleNamespace",
        "types.MappingProxyType",
        "types.NoneType",
        "types.EllipsisType",
        "types.NotImplementedType",
        "types.GenericAlias",
        "types.UnionType",
        "io.BytesIO",
        "_io.BytesIO",
        "io.StringIO",
        "_io.StringIO",
        "logging.getLogger",
        "time.struct_time",
        "uuid.UUID",
        "uuid.SafeUUID",
        "argparse.Namespace",
        "decimal.Decimal",
        *(
            f"{module}.{name}"
            for module in ("pathlib", "pathlib._local")
            for name in ("Path", "PosixPath", "WindowsPath", "PurePath", "PurePosixPath", "PureWindowsPath")
        ),
    }
)
_DUNDER_EXCEPTIONS: Final = frozenset({"copyreg.__newobj__", "copyreg.__newobj_ex__"})
# torch's and numpy's test suites, installed with them: they run subprocesses, write files, load pickles
_TESTED_PACKAGES: Final = frozenset({"torch", "numpy"})
_TEST_FOLDERS: Final = frozenset({"tests", "testing", "conftest"})
_STDLIB: Final = frozenset(sys.stdlib_module_names) | {"__builtin__", "copy_reg"}
_BUILTIN_EXCEPTIONS: Final = frozenset(
    name for name, value in vars(builtins).items() if isinstance(value, type) and issubclass(value, BaseException)
)


def _is_dunder(part: str) -> bool:
    return len(part) > 4 and part.startswith("__") and part.endswith("__")


def _inert_prefix(name: str) -> int:
    """How many components of ``name`` are one of the data names a code-running module holds
    (:data:`_INERT_WITHIN`); 0 if none."""
    if name.startswith(_INERT_WITHIN):
        for inert in _INERT_WITHIN:
            if inert.endswith(".") and name.startswith(inert):
                return inert.count(".")
            if name == inert or name.startswith(inert + "."):
                return inert.count(".") + 1
    return 0


def _listed(name: str, table: frozenset[str] = frozenset()) -> bool:
    """Rule 2: ``name`` or a prefix of it (whole components) is a code-running global or module (in the
    tables here, or in ``table``: the census's), and it is not one of the data names such a module holds."""
    if _inert_prefix(name):
        return False
    end = len(name)
    while end > 0:
        prefix = name[:end]
        if prefix in CODE_RUNNING or prefix in table:
            return True
        end = name.rfind(".", 0, end)
    return False


def _inert_stdlib(name: str) -> bool:
    """Whether a standard-library name is one of its data classes or pure functions (rule 4)."""
    if name in _INERT_STDLIB_NAMES:
        return True
    module, _, attribute = name.partition(".")
    if module == "builtins":
        return attribute.partition(".")[0] in _BUILTIN_EXCEPTIONS
    prefix = name
    while prefix:
        if prefix in _INERT_STDLIB_MODULES:
            return True
        prefix = prefix.rpartition(".")[0]
    return False


def judge(name: str, table: frozenset[str], *, stdlib_rule: bool = True) -> bool:
    """:func:`runs_code` with the census's ``table`` given (``scripts/gadget_census.py`` builds it with this),
    and rule 4 left out when ``stdlib_rule`` is False (what a name is known to do, not what is presumed)."""
    parts = name.split(".")
    if name not in _DUNDER_EXCEPTIONS and any(_is_dunder(part) for part in parts[1:]):
        return True
    if parts[0] == "__torch__":
        return False  # a TorchScript class: compiled by torch.jit.load, never imported
    inert = _inert_prefix(name)
    for at in range(max(inert, 1), len(parts)):
        module = parts[at].strip("_")
        if module in _REEXPORTED:  # a system module imported by another: the rest is that module's name
            rest = parts[at + 1 :]
            if not rest:
                if module in CODE_RUNNING_MODULES or module in _REACHING_MODULES:
                    return True  # the module object: anything reached through it, or set on it by BUILD
            elif _listed(".".join(["builtins" if module == "builtin" else module, *rest]), table):
                return True
    if inert:
        return False
    if (
        name in MODULE_OBJECTS
        or _listed(name, table)
        or (parts[0] in _TESTED_PACKAGES and not _TEST_FOLDERS.isdisjoint(parts))
    ):
        return True
    return stdlib_rule and parts[0] in _STDLIB and not _inert_stdlib(name)


_TABLE: frozenset[str] | None = None  # the census's table, read when a name is first judged


def runs_code(name: str) -> bool:
    """Whether the global ``name`` (Python 3 spelling, ``module.qualified.name``) runs code or reaches the
    system under some reading of its dots: the module doc's four rules, with the census's table."""
    global _TABLE
    if _TABLE is None:
        from ckptool.pickles.gadget_table import NAMES

        _TABLE = NAMES
    return judge(name, _TABLE)
