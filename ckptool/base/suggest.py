"""Every fix ckptool suggests, spelled in one place: ckptool command lines and the options a refusal names.

A command line (``ckptool strip /data/ddp.pt -o /data/ddp.stripped.pt``) names every file by its
absolute path and quotes every path and value with :func:`shlex.quote`, so a suggestion pasted into
a POSIX shell, in any folder, runs the command it shows, whatever the file is called. A command for
a file the caller read with ``allow_globals`` (``--allow-global 'omegaconf.*'``) carries the same
entries, since the command reads that file again. An option a refusal asks for (``force``,
``allow_globals``, ``in_place``) is an
:class:`Option` inside the error's :class:`Wording`: the command line spells it as its flag
(``--allow-global NAME``), the Python API as the keyword argument (``allow_globals=['NAME']``), so
no library message names a flag an API caller cannot pass.

Example:
    >>> command("strip", "my model.pt", out="model.pt")
    "ckptool strip 'my model.pt' -o model.pt"
    >>> command("strip", Path("/data/my model.pt"), out=Path("/data/model.pt"), allow_globals=["omegaconf.*"])
    "ckptool strip '/data/my model.pt' -o /data/model.pt --allow-global 'omegaconf.*'"
    >>> wording = "already exists — pass " + option("force") + " to overwrite it"
    >>> wording.render(flag), str(wording)
    ('already exists — pass --force to overwrite it', 'already exists — pass force=True to overwrite it')
"""

from __future__ import annotations

import shlex
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ckptool.base.text import url_name

PROGRAM = "ckptool"

# keyword argument -> command-line flag, where the flag is not the keyword spelled with dashes
_FLAGS = {
    "out": "-o",
    "allow_globals": "--allow-global",
    "to_device": "--to",
    "mapping": "--map",
    "model_spec": "--model",
    "model_args": "--model-arg",
    "storage_options": "--storage-option",
}
# keyword argument -> the flag that gives it a list, where the switch and the list are two flags
# (``allow_nonfinite=True`` is --allow-nonfinite, ``allow_nonfinite=['*.mask']`` --allow-nonfinite-key)
_LIST_FLAGS = {"allow_nonfinite": "--allow-nonfinite-key"}


class Metavar(str):
    """A stand-in for a value the user chooses (``OUT``, ``DIR``): shown as the flag and the stand-in
    on the command line (``-o OUT``), as the bare keyword in the API (``out``)."""


class Given(str):
    """The value the caller gave, shown as this text after the flag (``--dtype 'bf17'``) or the
    keyword (``dtype='bf17'``): a refusal quotes what it refuses, it does not suggest it."""


class Typed(str):
    """The value the caller gave, shown after the flag as the command line took it
    (``--model training:x``) and after the keyword as the Python value (``model_spec='training:x'``)."""

    python: str

    def __new__(cls, value: Any) -> Typed:
        typed = super().__new__(cls, str(value))
        typed.python = repr(value)
        return typed


@dataclass(frozen=True)
class Option:
    """An option the caller can pass: ``name`` is the API's keyword argument; ``value`` is True for
    a switch, a value (a list for a repeatable option), a :class:`Metavar`, or None for the option
    itself whatever its value (``choose another -o``)."""

    name: str
    value: Any = True

    def __add__(self, other: str | Option | Wording) -> Wording:
        return Wording(self) + other

    def __radd__(self, other: str) -> Wording:
        return other + Wording(self)


class Wording:
    """A message whose options are spelled by the reader: flags for the CLI, keywords for the API.

    Built with ``+`` from strings and :class:`Option` s; the strings are the message's own words
    and whatever it quotes from a file, the options are never text (a file cannot forge one).
    """

    def __init__(self, *parts: str | Option) -> None:
        self.parts = tuple(parts)

    def __add__(self, other: str | Option | Wording) -> Wording:
        return Wording(*self.parts, *_parts(other))

    def __radd__(self, other: str) -> Wording:
        return Wording(*_parts(other), *self.parts)

    def render(self, spell: Callable[[Option], str]) -> str:
        """The text, each option spelled by ``spell`` (:func:`flag` or :func:`keyword`)."""
        return "".join(part if isinstance(part, str) else spell(part) for part in self.parts)

    def map_text(self, change: Callable[[str], str]) -> Wording:
        """The same message with ``change`` applied to its words (each run of text between options)."""
        return Wording(*(change(part) if isinstance(part, str) else part for part in self.parts))

    def __str__(self) -> str:
        return self.render(keyword)

    def __repr__(self) -> str:
        return f"Wording({str(self)!r})"


def _parts(other: str | Option | Wording) -> tuple[str | Option, ...]:
    if isinstance(other, Wording):
        return other.parts
    if isinstance(other, str | Option):
        return (other,)
    return NotImplemented


def option(name: str, value: Any = True) -> Option:
    """The option ``name`` (an API keyword argument) with ``value``, for a :class:`Wording`."""
    return Option(name, value)


def given(name: str, value: Any) -> Option:
    """The option ``name`` as the caller gave it, ``value`` shown as its ``repr``."""
    return Option(name, Given(repr(value)))


def typed(name: str, value: Any) -> Option:
    """The option ``name`` as the caller gave it, ``value`` shown bare after the flag and as its
    ``repr`` after the keyword (``--to pt`` / ``to='pt'``)."""
    return Option(name, Typed(value))


def keyword(item: Option) -> str:
    """``item`` as the Python API takes it: ``force=True``, ``allow_globals=['pkg.Name']``, ``out``."""
    if item.value is None or isinstance(item.value, Metavar):
        return item.name
    if isinstance(item.value, Typed):
        return f"{item.name}={item.value.python}"
    if isinstance(item.value, Given):
        return f"{item.name}={item.value}"
    return f"{item.name}={item.value!r}"


def flag(item: Option) -> str:
    """``item`` as the command line takes it: ``--force``, ``--allow-global pkg.Name``, ``-o OUT``."""
    name = _FLAGS.get(item.name, "--" + item.name.replace("_", "-"))
    value = item.value
    if value is True or value is None:
        return name
    if isinstance(value, Metavar | Given | Typed):
        return f"{name} {value}"
    if isinstance(value, list | tuple):
        name = _LIST_FLAGS.get(item.name, name)
        return " ".join(f"{name} {quote(each)}" for each in value)
    return f"{name} {quote(value)}"


def quote(value: Path | str) -> str:
    """A path or value as a POSIX shell reads it back unchanged (the one quoting rule for suggestions)."""
    return shlex.quote(str(value))


def command(name: str, *arguments: Path | str, **options: Any) -> str:
    """The ckptool command line ``name`` with its quoted ``arguments`` and ``options`` (keyword -> value).

    A :class:`~pathlib.Path` (an argument or an option's value) is written absolute, so the command
    runs from any folder; a ``str`` is written as it is (a stand-in such as ``OUT.pt``). An option
    whose value is None, False or an empty list is left out.

    Example:
        >>> command("remap", "gpu.pt", out="gpu.cpu.pt", to="cpu")
        'ckptool remap gpu.pt -o gpu.cpu.pt --to cpu'
    """
    words = [PROGRAM, name, *(quote(_placed(argument)) for argument in arguments)]
    words += [
        flag(Option(key, _placed(value)))
        for key, value in options.items()
        if value is not None and value is not False and not (isinstance(value, list | tuple) and not value)
    ]
    return " ".join(words)


def _placed(value: Any) -> Any:
    """A path as a command run from another folder must name it (absolute; not resolved, so a
    link or ``..`` in it is followed as the user's own path was); any other value as it is."""
    return value.absolute() if isinstance(value, Path) else value


# what stem() takes off a name, longest first: a version or a date in the name stays
# (chgnet_0.3.0.pth.tar -> chgnet_0.3.0), and so does a suffix that is not a checkpoint's
CHECKPOINT_SUFFIXES = (
    ".safetensors.index.json",
    ".pth.tar",
    ".safetensors",
    ".ckpt",
    ".pth",
    ".bin",
    ".pt",
    ".tar",
    ".dcp",
)


def _where(path: Any) -> Any:
    """A local path as a :class:`Path`; a URL (:class:`~ckptool.files.remote.RemotePath`) as it is."""
    if isinstance(path, Path):
        return path
    if isinstance(path, str) and "://" not in path:
        return Path(path)
    return path  # a URL, decided where the user named it (``ckptool.files.remote.RemotePath``)


def stem(path: Path | str) -> str:
    """A checkpoint's name without its checkpoint suffixes: ``chgnet_0.3.0.pth.tar`` -> ``chgnet_0.3.0``,
    ``model.safetensors`` -> ``model``, ``run.v2.pt`` -> ``run.v2`` (``checkpoint`` if nothing is left)."""
    name = url_name(path) if isinstance(path, str) and "://" in path else _where(path).name
    lowered = name.lower()
    for suffix in CHECKPOINT_SUFFIXES:
        if lowered.endswith(suffix):
            name = name[: -len(suffix)]
            break
    return name or "checkpoint"


def sibling(path: Path, tag: str, suffix: str) -> Path:
    """Where a suggested command writes: beside ``path``, named ``<stem>.<tag><suffix>`` (``<stem><suffix>``
    with no tag), the stem being the name without its checkpoint suffixes (:func:`stem`)."""
    name = stem(path)
    return path.with_name(f"{name}.{tag}{suffix}" if tag else f"{name}{suffix}")


def strip(
    path: Path, *, suffix: str, prefix: str | None = None, allow_globals: Sequence[str] = (), to_cpu: bool = False
) -> str:
    """The strip command for ``path``, writing beside it with ``suffix`` (a rewrite keeps the input's format:
    its format's ``default_suffix``; ``--prefix`` only when not the detected stack);
    ``allow_globals``: the entries ``path`` was read with, carried by the command; ``to_cpu``: the same
    write also moves every saved storage tag to the CPU (one command from a GPU cluster's file to a laptop's)."""
    out = sibling(_where(path), "cpu" if to_cpu else "stripped", suffix)
    return command(
        "strip", _where(path), out=out, prefix=prefix, to="cpu" if to_cpu else None, allow_globals=list(allow_globals)
    )


def remap_to_cpu(path: Path, *, allow_globals: Sequence[str] = ()) -> str:
    """The remap command that moves every saved storage tag of ``path`` to the CPU."""
    return command(
        "remap", _where(path), out=sibling(_where(path), "cpu", ".pt"), to="cpu", allow_globals=list(allow_globals)
    )


def to_safetensors(path: Path, *, allow_globals: Sequence[str] = ()) -> str:
    """The convert command that writes ``path``'s weights as safetensors beside it."""
    return command(
        "convert", _where(path), out=sibling(_where(path), "", ".safetensors"), allow_globals=list(allow_globals)
    )


def each(commands: Sequence[str]) -> str:
    """Several commands run one after the other, stopping at the first that fails."""
    return " && ".join(commands)


def optimizer_to_safetensors(path: Path, *, folder: bool = False, allow_globals: Sequence[str] = ()) -> str:
    """The convert command that writes the optimizer state in ``path`` (an optimizer file, or a
    training ``folder``) as safetensors beside it, its tensors named ``state.<param>.<name>``."""
    return command(
        "convert",
        _where(path),
        out=sibling(_where(path), "optimizer" if folder else "", ".safetensors"),
        weights="state",
        allow_globals=list(allow_globals),
    )
