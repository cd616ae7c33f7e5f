"""TorchScript archives (``torch.jit.save``): their parameters and buffers, read without running their code.

A TorchScript archive is a torch zip whose ``data.pkl`` pickles the module tree: each module is
an object of a ``__torch__.*`` class built by ``NEWOBJ`` and given its attributes by ``BUILD``
(a dict), tensors are persistent ids into ``data/`` exactly as in ``torch.save``. The classes
are defined in ``code/__torch__/...py`` (TorchScript source), which also declares which
attributes are parameters (``__parameters__ = [...]``), which are buffers (``__buffers__ =
[...]``), and in which order the attributes lie (torch's loader sets the object's slots in that
order, taking each value by name from the BUILD dict). ``constants.pkl`` holds the code's tensor
constants, which no ``state_dict`` lists.

Here the ``__torch__`` classes become inert placeholders (nothing is imported or called), the
class declarations are read as text (bounded, never compiled or run: a list of names is read token
by token within a budget, each name a single string literal), and the weights are gathered as
``torch.jit.load(f).state_dict()`` gives them: in each module its parameters, then its buffers
(every one: a loaded archive knows no non-persistent buffers), then each child module, depth
first, each in declaration order. A class that restores its state with its own code
(``__setstate__``) is refused: its attributes are whatever that code makes of the state.

Read-only: a rewrite writes the weights as a plain state-dict ``.pt`` and says so.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from ckptool import pickles
from ckptool.base.errors import InputError, UnsupportedFormatError
from ckptool.formats import Contents, Format, ReadOptions, zipio
from ckptool.tensors.refs import StorageRef, TensorRef, human_size

# A class's declaration is at most this long (a real one: a few KB; torchvision's largest, ~100 KB).
MAX_CODE_BYTES = 16 << 20
# code files read for one archive, and their text in all (ResNet-18: 33 files, 35 KB; ViT-B/16: 60 KB)
MAX_CODE_FILES = 10_000
MAX_CODE_TOTAL = 64 << 20
# A class's list of parameter or buffer names: its text, its names, one name's text. Each name is
# decoded on its own (a single string literal), so memory stays near the text's size whatever it holds.
MAX_LIST_BYTES = 4 << 20
MAX_LIST_NAMES = 100_000
MAX_NAME_BYTES = 64 << 10
# attributes one class declares (a real module: tens)
MAX_ATTRIBUTES = 100_000
MAX_MODULES = 1_000_000
# how deep modules nest (real models: under 20)
MAX_MODULE_DEPTH = 200

_CLASS_LINE = re.compile(r"^class ([A-Za-z_][A-Za-z0-9_]*)\(([A-Za-z_][A-Za-z0-9_.]*)\):[ \t\r\f\v]*$", re.MULTILINE)
_DECLARED = re.compile(r"^  ([A-Za-z_][A-Za-z0-9_]*) : (.+)$")
_QUOTED_DECLARED = re.compile(r'^  __annotations__\[("(?:[^"\\]|\\.)*")\] = (.+)$')
# classes torch defines in C++ (``torch.classes.quantized.LinearPackedParamsBase``): no code declares them
_BUILT_IN = "__torch__.torch.classes."
# torch renames a class it compiled twice (``___torch_mangle_7.M``); messages name it as written (``M``)
_MANGLE = re.compile(r"___torch_mangle_\d+\.")
_LIST = re.compile(r"^  (__parameters__|__buffers__) = (\[.*\])\s*$")
# one Python string literal, as torch's printer writes a name (quotes, backslash escapes), and the list's
# separators; nothing else may stand in a list of names
_STRING = re.compile(r'"[^"\\\n]*(?:\\.[^"\\\n]*)*"|\'[^\'\\\n]*(?:\\.[^\'\\\n]*)*\'')
_SPACE = re.compile(r"\s*")


def never(head: bytes | None, path: Path) -> bool:
    """Not claimed by its head: the torch zip reader hands a TorchScript archive over (the members say it)."""
    return False


def read(path: Path, options: ReadOptions) -> Contents:
    """Refused: a TorchScript archive is read by the torch zip reader, which finds its members first."""
    raise UnsupportedFormatError("is not a zip archive — a TorchScript archive is a torch zip", path=path)


@dataclass
class _Class:
    """What a module class's TorchScript declaration says."""

    name: str
    is_module: bool
    attributes: list[tuple[str, str]]  # (name, declared type), in slot order
    parameters: set[str]
    buffers: set[str]
    restores_itself: bool  # defines __setstate__: its state is what that code makes of it


class _Resolver:
    """The archive's globals: ``__torch__.*`` classes as inert placeholders, ``torch.jit._pickle``'s
    container tags as the identity they are, everything else through the read's own allowlist."""

    def __init__(self, outer: pickles.GlobalResolver) -> None:
        self.outer = outer
        self.guard_cache = outer.guard_cache

    def resolve(self, module: str, name: str) -> Any:
        full_name = f"{module}.{name}"
        if module == "__torch__" or module.startswith("__torch__."):
            self.outer.seen[full_name] = self.outer.seen.get(full_name, 0) + 1
            return pickles.opaque_type(full_name)
        tag = _JIT_PICKLE.get(full_name)
        if tag is not None:
            self.outer.seen[full_name] = self.outer.seen.get(full_name, 0) + 1
            return tag
        return self.outer.resolve(module, name)

    def refusal(self, *, complete: bool = True) -> pickles.RefusedGlobal | None:
        return self.outer.refusal(complete=complete)

    def records(self) -> tuple[dict[str, int], int, int]:  # what it records is recorded in outer
        return self.outer.records()

    def restore(self, records: tuple[dict[str, int], int, int]) -> None:
        self.outer.restore(records)


def _same(value: Any) -> Any:
    return value


def _untagged(value: Any, type_str: Any = None) -> Any:
    return value


# torch.jit._pickle's functions, which return their first argument (torch's own definitions)
_JIT_PICKLE: dict[str, Any] = {
    "torch.jit._pickle.build_intlist": _same,
    "torch.jit._pickle.build_tensorlist": _same,
    "torch.jit._pickle.build_doublelist": _same,
    "torch.jit._pickle.build_boollist": _same,
    "torch.jit._pickle.restore_type_tag": _untagged,
}


def read_archive(path: Path, options: ReadOptions, members: zipio.Members, top: str, *, big_endian: bool) -> Contents:
    """The parameters and buffers of a TorchScript archive, as ``torch.jit.load(f).state_dict()`` gives them."""
    from ckptool.formats.zip_storages import storage_loader

    handle = options.handle
    assert handle is not None
    pickle_member = members.get(f"{top}/data.pkl")
    if pickle_member is None:
        raise UnsupportedFormatError(
            "is a TorchScript archive without data.pkl (its module) — the file is truncated or corrupt", path=path
        )
    data = zipio.read_member(path, handle, pickle_member, limit=pickles.MAX_PICKLE_BYTES)
    storages: dict[str, StorageRef] = {}
    persistent_load = storage_loader(path, members, top, storages, big_endian=big_endian)
    root = pickles.loads(data, _Resolver(options.resolver), persistent_load)  # type: ignore[arg-type]
    classes = _Classes(path, handle, members, top)
    root_class = classes.of(root)
    if root_class is None or not root_class.is_module:
        raise UnsupportedFormatError(
            f"is a TorchScript archive whose data.pkl holds {pickles.brief(root)}, not a "
            "module — ckptool reads the weights of saved modules",
            path=path,
        )
    walk = _Walk(path, classes)
    walk.module(root, "", 0)
    notes = [
        f"TorchScript archive of {root_class.name}: {walk.parameters} parameters and {walk.buffers} buffers "
        f"read as torch.jit.load(f).state_dict() gives them; its code ({classes.files} class file(s) read as text) "
        "was not run; a rewrite writes them as a plain state-dict .pt"
    ]
    return Contents(
        container=walk.state_dict, files=[path], notes=notes, metadata={"torchscript.module": root_class.name}
    )


class _Classes:
    """Class declarations, read from ``code/`` as text the first time an object of the class is met."""

    def __init__(self, path: Path, handle: Any, members: zipio.Members, top: str) -> None:
        self.path, self.handle, self.members, self.top = path, handle, members, top
        # each file's text and where each class it declares starts, found in one pass over it
        self.sources: dict[str, tuple[str, dict[str, tuple[int, str]]] | None] = {}
        self.parsed: dict[str, _Class | None] = {}
        self.files = 0
        self.text_read = 0

    def of(self, obj: Any) -> _Class | None:
        """The declaration of ``obj``'s class; None for an object not of a ``__torch__`` class."""
        if not isinstance(obj, pickles.OpaqueObject) or not obj.global_name.startswith("__torch__."):
            return None
        qualified = obj.global_name
        if qualified not in self.parsed:
            self.parsed[qualified] = self._parse(qualified)
        return self.parsed[qualified]

    def _source(self, qualifier: str) -> tuple[str, dict[str, tuple[int, str]]] | None:
        """The text of ``code/<qualifier as a path>.py`` (where torch's importer looks) and its classes'
        starts, or None."""
        if qualifier in self.sources:
            return self.sources[qualifier]
        if len(self.sources) >= MAX_CODE_FILES:
            raise InputError(
                f"TorchScript archive names classes in over {MAX_CODE_FILES} code files — refused", path=self.path
            )
        member = self.members.get(f"{self.top}/code/{qualifier.replace('.', '/')}.py")
        source = None
        if member is not None:
            if self.text_read + member.size > MAX_CODE_TOTAL:
                raise InputError(
                    f"TorchScript archive's code files hold over {human_size(MAX_CODE_TOTAL)} of text "
                    "(a real model's: well under 1 MiB) — refused",
                    path=self.path,
                )
            raw = zipio.read_member(self.path, self.handle, member, limit=MAX_CODE_BYTES)
            self.text_read += len(raw)
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise InputError(
                    f"TorchScript code {member.name!r} is not UTF-8 text — the archive is corrupt", path=self.path
                ) from e
            starts: dict[str, tuple[int, str]] = {}
            for match in _CLASS_LINE.finditer(text):  # the first declaration of a name is the one read
                starts.setdefault(match.group(1), (match.end(), match.group(2)))
            source = (text, starts)
            self.files += 1
        self.sources[qualifier] = source
        return source

    def _parse(self, qualified: str) -> _Class | None:
        if qualified.startswith(_BUILT_IN):
            return None  # a class torch defines in C++ (packed quantized weights): never a module
        qualifier, _, name = qualified.rpartition(".")
        source = self._source(qualifier)
        found = source[1].get(name) if source is not None else None
        shown = _MANGLE.sub("", qualified.removeprefix("__torch__."))
        if source is None or found is None:
            # a module whose class is not declared would silently lose its weights; torch cannot load it either
            raise InputError(
                f"TorchScript class {shown} is not declared in the archive's code/ "
                f"({qualifier.replace('.', '/')}.py) — torch.jit.load refuses it too; the archive is "
                "truncated or corrupt",
                path=self.path,
            )
        text, (position, base) = source[0], found
        declared = _Class(
            name=shown,
            is_module=base == "Module",
            attributes=[],
            parameters=set(),
            buffers=set(),
            restores_itself=False,
        )
        for line in _lines_from(text, position):
            if line and not line.startswith(" "):
                break  # the next top-level statement ends the class
            if line.startswith("  def __setstate__("):
                declared.restores_itself = True
            listed = _LIST.match(line)
            if listed:
                names = self._names(listed.group(2), qualified, listed.group(1))
                (declared.parameters if listed.group(1) == "__parameters__" else declared.buffers).update(names)
                continue
            quoted = _QUOTED_DECLARED.match(line)
            if quoted:
                declared.attributes.append((self._string(quoted.group(1), qualified), quoted.group(2).strip()))
            else:
                plain = _DECLARED.match(line)
                if not plain or " = " in plain.group(2):  # ``name : Final[int] = 3`` is a constant, not a slot
                    continue
                declared.attributes.append((plain.group(1), plain.group(2).strip()))
            if len(declared.attributes) > MAX_ATTRIBUTES:
                raise InputError(
                    f"TorchScript class {shown} declares over {MAX_ATTRIBUTES} attributes — refused", path=self.path
                )
        counts = Counter(name for name, _ in declared.attributes)
        if len(counts) != len(declared.attributes):
            twice = next(name for name, count in counts.items() if count > 1)
            raise InputError(
                f"TorchScript class {declared.name} declares attribute {twice!r} twice — the archive is corrupt",
                path=self.path,
            )
        return declared

    def _string(self, text: str, qualified: str) -> str:
        """One string literal's value (a name), decoded as torch's TorchScript parser decodes it."""
        if len(text) > MAX_NAME_BYTES:
            raise InputError(
                f"TorchScript class {qualified} declares a name of over {MAX_NAME_BYTES} characters — refused",
                path=self.path,
            )
        value = torch_string(text)
        if value is None:
            raise InputError(
                f"TorchScript class {qualified} declares {text[:60]!r}, not a string literal torch "
                "reads — torch.jit.load refuses it too; the archive is corrupt",
                path=self.path,
            )
        return value

    def _names(self, text: str, qualified: str, kind: str) -> list[str]:
        """A ``[...]`` list of names, read token by token within :data:`MAX_LIST_BYTES` and
        :data:`MAX_LIST_NAMES`: any other literal (numbers, nested lists) is refused, not parsed."""
        if len(text) > MAX_LIST_BYTES:
            raise InputError(
                f"TorchScript class {qualified} declares {kind} in over {human_size(MAX_LIST_BYTES)} of text — refused",
                path=self.path,
            )
        names: list[str] = []
        position, end = _after_space(text, 1), len(text) - 1  # inside the brackets
        while position < end:
            token = _STRING.match(text, position)
            if token is None:
                raise InputError(
                    f"TorchScript class {qualified} declares {kind} as {text[:60]!r}, not a list of "
                    "names — the archive is corrupt",
                    path=self.path,
                )
            names.append(self._string(token.group(), qualified))
            if len(names) > MAX_LIST_NAMES:
                raise InputError(
                    f"TorchScript class {qualified} declares over {MAX_LIST_NAMES} {kind} — refused", path=self.path
                )
            position = _after_space(text, token.end())
            if position < end and text[position] != ",":
                raise InputError(
                    f"TorchScript class {qualified} declares {kind} as {text[:60]!r}, not a list of "
                    "names — the archive is corrupt",
                    path=self.path,
                )
            position = _after_space(text, position + 1) if position < end else position
        return names


# the escapes torch's TorchScript parser reads in a string literal (parseStringLiteral); \\x, \\u, \\r and the
# rest it refuses, but three octal digits
_ESCAPES = {"\\": "\\", "'": "'", '"': '"', "a": "\a", "b": "\b", "f": "\f", "n": "\n", "v": "\v", "t": "\t"}
_OCTAL = re.compile(r"[0-7]{3}")


def torch_string(text: str) -> str | None:
    """The value of a quoted string literal as TorchScript reads it, or None where torch refuses it.
    (An octal escape past 127 is refused too: torch puts its byte alone into UTF-8 text.)"""
    if len(text) < 2 or text[0] not in "'\"" or text[-1] != text[0]:
        return None
    body, pieces, position = text[1:-1], [], 0
    while (slash := body.find("\\", position)) != -1:
        pieces.append(body[position:slash])
        escaped = body[slash + 1 : slash + 2]
        if escaped in _ESCAPES:
            pieces.append(_ESCAPES[escaped])
            position = slash + 2
        elif _OCTAL.fullmatch(body, slash + 1, slash + 4) and int(body[slash + 1 : slash + 4], 8) < 0o200:
            pieces.append(chr(int(body[slash + 1 : slash + 4], 8)))
            position = slash + 4
        else:
            return None
    pieces.append(body[position:])
    return "".join(pieces)


def _after_space(text: str, position: int) -> int:
    match = _SPACE.match(text, position)  # (\s* matches anywhere, if only nothing)
    return match.end() if match else position


def _lines_from(text: str, position: int) -> Iterator[str]:
    """The lines of ``text`` after ``position`` (the end of a class line), one at a time (no list of them)."""
    start = text.find("\n", position)
    while start != -1:
        stop = text.find("\n", start + 1)
        yield text[start + 1 : stop if stop != -1 else len(text)].rstrip("\r")
        start = stop


class _Walk:
    """The state_dict walk: a module's parameters, its buffers, then its child modules."""

    def __init__(self, path: Path, classes: _Classes) -> None:
        self.path, self.classes = path, classes
        self.state_dict: dict[str, TensorRef] = {}
        self.parameters = self.buffers = self.modules = 0
        self.on_path: set[int] = set()

    def module(self, obj: Any, prefix: str, depth: int) -> None:
        where = f"module {prefix[:-1]!r}" if prefix else "top-level module"
        declared = self.classes.of(obj)
        assert declared is not None and declared.is_module
        self.modules += 1
        if self.modules > MAX_MODULES or depth > MAX_MODULE_DEPTH:
            raise InputError(
                f"TorchScript archive holds over {MAX_MODULES} modules or nests them over "
                f"{MAX_MODULE_DEPTH} deep — refused",
                path=self.path,
            )
        if id(obj) in self.on_path:
            raise InputError(f"TorchScript {where} contains itself — the archive is corrupt", path=self.path)
        if declared.restores_itself:
            raise UnsupportedFormatError(
                f"is a TorchScript archive whose {where} ({declared.name}) restores its state with its own code "
                "(__setstate__), which ckptool does not run — load it with torch.jit.load where you trust it and "
                "save its state_dict() with torch.save",
                path=self.path,
            )
        state = obj.state
        if not isinstance(state, dict):
            raise InputError(
                f"TorchScript {where} ({declared.name}) has state {pickles.brief(state)}, not a dict of "
                "attributes — the archive is corrupt",
                path=self.path,
            )
        values = []
        for name, type_text in declared.attributes:
            if name not in state:
                raise InputError(
                    f"TorchScript {where} ({declared.name}) declares attribute {name!r} that its "
                    "data.pkl does not hold — torch.jit.load refuses it too; the archive is corrupt",
                    path=self.path,
                )
            values.append((name, type_text, state[name]))
        self.on_path.add(id(obj))
        # torch lists a module's parameters (each that holds a tensor), then its buffers (those declared
        # as Tensor), then its children — each in the order the class declares its attributes
        for name, _, value in values:
            if name in declared.parameters and value is not None:
                self._add(prefix + name, value)
                self.parameters += 1
        for name, type_text, value in values:
            if name in declared.buffers and type_text == "Tensor":
                self._add(prefix + name, value)
                self.buffers += 1
        for name, _, value in values:
            child = self.classes.of(value)
            if child is not None and child.is_module:
                self.module(value, f"{prefix}{name}.", depth + 1)
        self.on_path.discard(id(obj))

    def _add(self, key: str, value: Any) -> None:
        if not isinstance(value, TensorRef):
            raise UnsupportedFormatError(
                f"is a TorchScript archive whose tensor {key!r} is {pickles.brief(value)}, "
                "which ckptool does not read from TorchScript archives",
                path=self.path,
            )
        value.validate(path=self.path, name=key)
        # state_dict() detaches: the weights are plain tensors, whatever the module's grad flags were
        self.state_dict[key] = replace(value, requires_grad=False)


FORMAT = Format(
    name="torchscript",
    sniff=never,
    read=read,
    rewrite_note="a TorchScript archive is rewritten as a plain state-dict .pt of its parameters and buffers "
    "(its code is not carried)",
    torch_load_refuses="a TorchScript archive: torch.load(weights_only=True) refuses it, torch.jit.load runs its code",
    weights_only=True,
    in_place_refused="is a TorchScript archive: a rewrite writes a plain state-dict .pt, which would replace the "
    "archive and its code",
)
