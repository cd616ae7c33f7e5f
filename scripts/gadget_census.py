"""Write ckptool/pickles/gadget_table.py: the torch, numpy and standard-library names that run code.

    .venv/bin/python scripts/gadget_census.py          # after a torch or numpy upgrade: the table again
    .venv/bin/python scripts/gadget_census.py --check  # what tests/test_gadgets.py checks: exit 1 if stale

Two passes over what is installed:

1. a census of the sources (``ast``; nothing is imported): every function whose body calls something that
   runs code or reaches the system (``exec``, ``eval``, ``open``, ``os.system``, ``subprocess``,
   ``pickle.load``, ``importlib.import_module`` of a name it is given, ``ctypes``, ``torch.load``, ...),
   named as its source file's module and its qualname; and a class whose ``__init__``, ``__new__`` or
   ``__setstate__`` does so, as the class (calling it, or NEWOBJ and BUILD, runs them);
2. the aliases (torch and numpy imported here, never by ckptool): every attribute of every torch, numpy
   and inert standard-library module that *is* a function, class or module known to run code, under
   the spelling a pickle can use (``numpy.testing.runstring``, ``torch.serialization.os``).

The table keeps only names :mod:`ckptool.pickles.gadgets`' own rules do not already judge dangerous.
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import inspect
import os
import re
import sys
import sysconfig
import types
import warnings
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TABLE = REPO / "ckptool" / "pickles" / "gadget_table.py"

# What a function calls that runs code or reaches the system: a name, or (the called object's last name, attribute)
SINK_NAMES = {"exec", "eval", "compile", "open", "__import__", "execfile", "input", "breakpoint"}
SINK_CALLS: dict[str, set[str] | None] = {
    "os": {"system", "popen", "remove", "unlink", "rmdir", "removedirs", "makedirs", "mkdir", "rename", "renames",
           "replace", "execv", "execve", "execvp", "execl", "execlp", "spawnv", "spawnl", "spawnve", "kill", "killpg",
           "chmod", "chown", "symlink", "link", "truncate", "startfile", "fork", "posix_spawn", "open", "write",
           "putenv", "unsetenv", "chdir"},
    "subprocess": None, "pickle": {"load", "loads", "Unpickler"}, "_pickle": None, "marshal": {"load", "loads"},
    "importlib": {"import_module", "reload", "__import__"}, "ctypes": None, "shutil": None, "socket": None,
    "runpy": None, "tempfile": None, "urllib": None, "request": {"urlopen", "urlretrieve"}, "requests": None,
    "torch": {"load"}, "cdll": None, "windll": None, "pty": None, "webbrowser": None, "dill": None,
    "cloudpickle": None, "ops": {"load_library"}, "classes": {"load_library"},
}
_SINK_TEXT = re.compile(r"\b(exec|eval|compile|open|__import__|execfile|input|breakpoint|system|popen|subprocess|"
                        r"pickle|marshal|import_module|ctypes|shutil|socket|runpy|tempfile|urllib|requests|load|"
                        r"cdll|windll|pty|webbrowser|dill|remove|unlink|rmdir|mkdir|rename|replace|kill|chmod|fork|"
                        r"makedirs|removedirs|renames|exec\w*|spawn\w*|symlink|link|truncate|startfile|write|"
                        r"putenv|unsetenv|chdir|reload|cloudpickle|load_library|urlopen|urlretrieve)\b")
CONSTRUCTORS = {"__init__", "__new__", "__setstate__", "__init_subclass__", "__class_getitem__"}

# What the census flags whose call cannot run code a pickle chooses, each with the reason
NOT_GADGETS: dict[str, str] = {
    "collections.namedtuple": "evals a fixed lambda over field names it has checked to be identifiers",
    "string.Formatter.get_field": "calls getattr only for names in a format string: returns values, calls nothing",
    "re._compiler.compile": "compiles a regular expression, not code",
    "sre_compile.compile": "compiles a regular expression, not code",
    "zoneinfo._zoneinfo.ZoneInfo._new_instance": "opens the time-zone file its key names, a key it has checked to "
                                                 "stay inside the time-zone folders",
    "zoneinfo._tzpath.available_timezones": "lists the time-zone folders' file names",
    **dict.fromkeys([f"torch.{device}.streams.{kind}._as_parameter_" for device in ("cuda", "xpu")
                     for kind in ("Stream", "Event")], "a property: the stream's handle as a ctypes pointer"),
}
STDLIB = Path(sysconfig.get_paths()["stdlib"])


def _constant_import(call: ast.Call) -> bool:
    """``importlib.import_module("torch._decomp")``: a fixed module, which a pickle cannot choose."""
    return bool(call.args) and isinstance(call.args[0], ast.Constant) and len(call.args) + len(call.keywords) <= 2


def _calls_a_sink(function: ast.AST) -> bool:
    for node in ast.walk(function):
        if not isinstance(node, ast.Call):
            continue
        called = node.func
        if isinstance(called, ast.Name) and called.id in SINK_NAMES:
            if not (called.id == "__import__" and _constant_import(node)):
                return True
        elif isinstance(called, ast.Attribute):
            if called.attr in ("import_module", "__import__") and _constant_import(node):
                continue
            owner = called.value
            name = owner.id if isinstance(owner, ast.Name) else owner.attr if isinstance(owner, ast.Attribute) else None
            if name in SINK_CALLS and (SINK_CALLS[name] is None or called.attr in SINK_CALLS[name]):  # type: ignore[operator]
                return True
    return False


def census(root: Path, package: str | None) -> set[str]:
    """The flagged names under ``root`` (or its ``package`` folder): module from the file's path, then the qualname."""
    found: set[str] = set()
    for folder, subfolders, files in os.walk(root / package if package else root):
        subfolders[:] = [name for name in subfolders if name not in ("site-packages", "__pycache__")]
        for file in files:
            if not file.endswith(".py"):
                continue
            path = Path(folder) / file
            text = path.read_text(encoding="utf-8", errors="replace")
            if not _SINK_TEXT.search(text):
                continue
            module = ".".join(path.relative_to(root).with_suffix("").parts).removesuffix(".__init__")
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    tree = ast.parse(text)
            except SyntaxError:
                continue

            def visit(node: ast.AST, prefix: str) -> None:
                for child in ast.iter_child_nodes(node):
                    if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                        if _calls_a_sink(child):
                            found.add(f"{module}.{prefix}{child.name}")
                            if prefix and child.name in CONSTRUCTORS:
                                found.add(f"{module}.{prefix[:-1]}")
                    elif isinstance(child, ast.ClassDef):
                        visit(child, f"{prefix}{child.name}.")

            visit(tree, "")
    return found - set(NOT_GADGETS)


def site_of(package: str) -> Path:
    spec = importlib.util.find_spec(package)  # the top package's location: nothing of it runs
    assert spec is not None and spec.origin is not None, package
    return Path(spec.origin).parent.parent


def flagged() -> set[str]:
    return census(site_of("torch"), "torch") | census(site_of("numpy"), "numpy") | census(STDLIB, None)


def _defined_as(obj: object, roots: tuple[Path, ...]) -> str | None:
    """A function's or class's name as its source file's module and qualname; a module's own name."""
    if isinstance(obj, types.ModuleType):
        return obj.__name__
    if not isinstance(obj, type | types.FunctionType | types.BuiltinFunctionType):
        return None
    qualname = getattr(obj, "__qualname__", None)
    if not isinstance(qualname, str) or "<" in qualname:
        return None
    try:
        file = inspect.getsourcefile(obj)  # type: ignore[arg-type]
    except (TypeError, OSError):
        file = None
    if file:
        path = Path(file).resolve()
        for root in roots:
            if path.is_relative_to(root):
                return ".".join(path.relative_to(root).with_suffix("").parts).removesuffix(".__init__") + "." + qualname
    module = getattr(obj, "__module__", None)
    return f"{module}.{qualname}" if isinstance(module, str) else None


def import_everything() -> None:
    """Import every module of torch and numpy but their test suites (a pickle naming ``torch.x.y`` imports
    ``torch.x``, whose attributes are then aliases too), quietly; one that fails to import is skipped."""
    import contextlib
    import io
    import pkgutil

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import numpy
        import torch

        for package in (torch, numpy):
            for module in pkgutil.walk_packages(package.__path__, package.__name__ + ".", onerror=lambda name: None):
                if not {"tests", "testing", "benchmarks"}.isdisjoint(module.name.split(".")):
                    continue
                try:
                    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
                        importlib.import_module(module.name)
                except BaseException:  # noqa: BLE001 — an optional dependency missing, a platform it is not for
                    continue


def aliases(known: set[str]) -> set[str]:
    """Spellings of code-running names, as attributes of torch's, numpy's and the inert standard-library
    modules, that the rules with ``known`` as the table do not judge dangerous."""
    from ckptool.pickles import gadgets

    import_everything()
    table = frozenset(known)
    roots = (site_of("torch").resolve(), STDLIB.resolve())
    inert = gadgets._INERT_STDLIB_MODULES
    found: set[str] = set()
    for name, module in sorted(sys.modules.items()):
        top = name.split(".")[0]
        if not isinstance(module, types.ModuleType) or not (top in ("torch", "numpy") or top in inert):
            continue
        try:
            attributes = list(vars(module).items())
        except TypeError:
            continue
        for attribute, obj in attributes:
            if not isinstance(attribute, str) or not attribute.isidentifier():
                continue
            alias = f"{name}.{attribute}"
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                defined = _defined_as(obj, roots)
            if defined is None or defined == alias or gadgets.judge(alias, table):
                continue
            if gadgets.judge(defined, table, stdlib_rule=False):
                found.add(alias)
    return found


def table() -> set[str]:
    """The names the table must hold: flagged functions and classes, and aliases, until no alias is new."""
    from ckptool.pickles import gadgets

    names = {name for name in flagged() if not gadgets.judge(name, frozenset())}
    while True:
        new = aliases(names) - names
        if not new:
            return names
        names |= new


def write(names: set[str]) -> None:
    import numpy
    import torch

    lines = [
        '"""Generated by scripts/gadget_census.py — do not edit; run it again after a torch or numpy upgrade.',
        "",
        "The names a census of torch's, numpy's and the standard library's sources finds running code or",
        "reaching the system, and their aliases, beyond what ckptool.pickles.gadgets' own rules judge dangerous.",
        f"Written from torch {torch.__version__}, numpy {numpy.__version__}, Python {sys.version.split()[0]}.",
        '"""',
        "",
        "NAMES: frozenset[str] = frozenset({",
        *(f"    {name!r}," for name in sorted(names)),
        "})",
        "",
    ]
    TABLE.write_text("\n".join(lines), encoding="utf-8")


def stale() -> list[str]:
    """Names the census and aliases find that the written table and rules do not judge dangerous."""
    from ckptool.pickles import gadgets
    from ckptool.pickles.gadget_table import NAMES

    missed = [name for name in flagged() if not gadgets.judge(name, NAMES)]
    return sorted(missed + sorted(aliases(set(NAMES))))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if the written table misses a name")
    parser.add_argument("--check-aliases", action="store_true",
                        help="only the aliases: exit 1 if the written table misses one (a fresh process imports "
                             "exactly torch and numpy, so the modules walked are always the same)")
    args = parser.parse_args()
    sys.path.insert(0, str(REPO))
    if args.check_aliases:
        from ckptool.pickles.gadget_table import NAMES

        missed = sorted(aliases(set(NAMES)))
        for name in missed:
            print(name)
        return 1 if missed else 0
    if args.check:
        missed = stale()
        for name in missed:
            print(name)
        return 1 if missed else 0
    names = table()
    write(names)
    print(f"{TABLE.relative_to(REPO)}: {len(names)} names")
    return 0


if __name__ == "__main__":
    sys.exit(main())
