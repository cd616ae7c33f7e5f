"""The import contract: ckptool's layers, stacked one way, and no import circles.

This test is the source of truth ARCHITECTURE.md draws from. Every ``import`` in ``ckptool/`` counts:
at module level, inside functions, and under ``TYPE_CHECKING`` alike, because each one is a
dependency a reader has to follow and a change can turn into a real import circle.

- A module imports only from its own layer or the layers below it (``LAYERS``, top first).
- The graph of imports between modules has no cycle, within a layer too. Importing ``a.b.c`` runs
  ``a/__init__.py`` and ``a/b/__init__.py`` first, so those edges count (the root package's
  ``__init__`` excepted: it imports nothing when it runs, only when a public name is first used).
- A folder's ``__init__.py`` imports only its own modules (the root facade and the format registry apart).
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "ckptool"

# top first; a module belongs to the layer of its first folder under ckptool/
LAYERS = [
    ("cli", "the command line: parse options, call one job, render text or --json"),
    ("ckptool", "the public Python API (ckptool/__init__.py): names the jobs, imports them on first use"),
    ("verification", "verify: load and evaluate on CPU and every device"),
    ("ops", "the jobs: inspect, scan, rewrite (strip/add-prefix/remap/convert), diff, load_into, DCP output"),
    ("io", "one reader for every format, one checked atomic writer, uploads"),
    ("formats", "one module per on-disk format, their registry"),
    ("model", "the model of a checkpoint: container, weights, keys, modules, optimizers, casts, devices"),
    ("pickles", "reading and writing pickles without running them: the guard, the allowlist, the emitter"),
    ("tensors", "lazy tensor references, dtypes, the content fingerprint"),
    ("files", "inputs, exact reads, URLs, atomic outputs, the copy engine, CRC"),
    ("native", "the C extensions behind one loader"),
    ("base", "errors, exit codes, safe text, --json documents, progress, suggested fixes"),
]
RANK = {name: rank for rank, (name, _) in enumerate(LAYERS)}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules() -> dict[str, Path]:
    return {module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def layer(module: str) -> str:
    parts = module.split(".")
    if len(parts) == 1 or parts[1] == "__main__":
        return "ckptool" if len(parts) == 1 else "cli"
    return parts[1] if len(parts) > 2 or parts[1] in RANK else "ckptool"


def imports(module: str, path: Path, known: dict[str, Path]) -> Iterator[tuple[int, str]]:
    """(line, module) for every ckptool module ``module`` imports, wherever the import statement is."""
    is_package = path.name == "__init__.py"
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".")[: None if is_package else -1]
                base = base[: len(base) - node.level + 1]
                prefix = ".".join(base + ([node.module] if node.module else []))
            else:
                prefix = node.module or ""
            targets = [f"{prefix}.{alias.name}" if f"{prefix}.{alias.name}" in known else prefix
                       for alias in node.names]
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != module:
                yield node.lineno, target


def graph() -> dict[str, set[str]]:
    known = modules()
    edges: dict[str, set[str]] = {name: set() for name in known}
    for name, path in known.items():
        for _, target in imports(name, path, known):
            edges[name].add(target)
            # importing a.b.c runs a.b's __init__ first (the root's runs no import: see the docstring)
            parent = target.rpartition(".")[0]
            while parent.count("."):
                if parent != name and not name.startswith(parent + "."):
                    edges[name].add(parent)
                parent = parent.rpartition(".")[0]
    return edges


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in edges:
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_every_module_lies_in_a_layer() -> None:
    strays = [name for name in modules() if layer(name) not in RANK]
    assert not strays, f"modules outside every layer (add a folder to LAYERS, or move them): {strays}"


def test_no_module_imports_from_a_layer_above_its_own() -> None:
    known = modules()
    upward = [f"{path.relative_to(PACKAGE.parent)}:{line}: {name} ({layer(name)}) imports {target} ({layer(target)})"
              for name, path in known.items() for line, target in imports(name, path, known)
              if RANK[layer(target)] < RANK[layer(name)]]
    assert not upward, "imports against the layers:\n" + "\n".join(upward)


def test_there_is_no_import_circle() -> None:
    found = cycles(graph())
    assert not found, "import circles:\n" + "\n".join(" <-> ".join(component) for component in found)


def test_folder_packages_import_only_their_own_modules() -> None:
    """A folder's ``__init__`` is empty, or re-exports its own modules' names (``ckptool.pickles``); importing
    one module of a folder never imports another folder."""
    known = modules()
    busy = [f"{name} imports {target}" for name, path in known.items()
            if path.name == "__init__.py" and name != "ckptool" and name not in CODE_PACKAGES
            for _, target in imports(name, path, known) if not target.startswith(name + ".")]
    assert not busy, f"folder __init__ files that import other folders: {busy}"


# packages whose __init__ is a module of its own layer (the format registry's interface)
CODE_PACKAGES = {"ckptool.formats"}


def layers_block() -> str:
    """The map of ARCHITECTURE.md's "Layers" section, drawn from the code: each layer top first, each of its
    modules with the first line of its docstring. ``python tests/test_architecture.py`` prints it."""
    lines = []
    for name, role in LAYERS:
        folder = "ckptool/__init__.py" if name == "ckptool" else f"ckptool/{name}/"
        lines.append(f"{folder:<28} {role}")
        for module, path in modules().items():
            if layer(module) != name or module == "ckptool" or path.name == "__init__.py" and name != "ckptool":
                continue
            doc = ast.get_docstring(ast.parse(path.read_text())) or ""
            first = doc.strip().splitlines()[0] if doc.strip() else ""
            shown = path.relative_to(PACKAGE).as_posix().split("/", 1)[-1]
            lines.append(f"  {shown:<26} {first[:88] + ('…' if len(first) > 88 else '')}".rstrip())
    return "\n".join(lines) + "\n"


def test_architecture_md_draws_the_layers_from_the_code() -> None:
    """ARCHITECTURE.md's map lists every module where it lies (regenerate: python tests/test_architecture.py)."""
    text = (PACKAGE.parent / "ARCHITECTURE.md").read_text()
    start = text.index("<!-- layers: generated by tests/test_architecture.py -->\n```\n") + 61
    end = text.index("```", start)
    assert text[start:end] == layers_block(), "ARCHITECTURE.md's layers are stale: run python tests/test_architecture.py"


def test_the_contract_sees_a_circle_and_an_upward_import(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The checks above find what they look for: a made-up package with one of each."""
    fake = tmp_path / "ckptool"
    (fake / "base").mkdir(parents=True)
    (fake / "files").mkdir()
    (fake / "__init__.py").write_text("")
    (fake / "base" / "__init__.py").write_text("")
    (fake / "files" / "__init__.py").write_text("")
    (fake / "base" / "errors.py").write_text("def f():\n    from ckptool.files import remote\n")
    (fake / "files" / "remote.py").write_text("from ckptool.base.errors import f\n")
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", fake)
    assert cycles(graph()) == [["ckptool.base.errors", "ckptool.files.remote"]]
    with pytest.raises(AssertionError, match=r"base/errors.py:2: ckptool.base.errors \(base\) imports"):
        test_no_module_imports_from_a_layer_above_its_own()


if __name__ == "__main__":
    print(layers_block(), end="")
