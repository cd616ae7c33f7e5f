"""On-disk formats: one interface, and the registry every reader, writer and scan dispatches through.

Each format module defines a :class:`Format`: how to recognise a file or folder (``sniff``), how
to read it into :class:`Contents` (a container of lazy references; the reader builds the
:class:`~ckptool.model.checkpoint.Checkpoint`), which pickles ``scan`` judges (``pickle_blobs``), and
the facts other modules need about it (capabilities). :data:`REGISTRY` lists them in sniffing
order. Adding a format is one new module here plus one line in :data:`REGISTRY`.

The registry imports a format module only when a search reaches it: importing one format module
(or ``ckptool --help``) imports no other, and reading a ``.pt`` imports no folder format.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO

if TYPE_CHECKING:  # pragma: no cover
    from ckptool import pickles

# Sniffing order: the first format whose ``sniff`` claims an input reads it: the zip magic before
# a safetensors header before a JSON index before a legacy pickle stream (whose first byte is any
# of several pickle opcodes). A folder is claimed by a format's ``sniff`` (DCP's ``.metadata``)
# before any format looks in it for its file (a safetensors index). Entries are imported as the
# search reaches them, so a file input never imports the folder formats after it. An entry is
# ``module:attribute``; a module name with a leading dot lies in this package.
REGISTRY: list[str] = [
    ".torch_zip:FORMAT",  # "PK\x03\x04"
    ".safetensors:FORMAT",  # a u64 header length, then "{"
    ".training_folder:FORMAT",  # a folder holding a training run's state (optimizer.pt, random_states_0.pkl...)
    ".model_folder:FORMAT",  # a folder of components (a pipeline), or weights with configs, variants, a bare .bin
    ".torch_sharded:FORMAT",  # a *.bin.index.json, and a folder holding one (and no safetensors weights)
    ".safetensors:SHARDED",  # a *.safetensors.index.json (and a folder holding one)
    ".torch_legacy:FORMAT",  # a pickle opcode first
    ".torchscript:FORMAT",  # never sniffed: the torch zip reader hands over an archive holding code/
    ".dcp:FORMAT",  # a folder holding .metadata
]


@dataclass
class ReadOptions:
    """What the reader hands a format's ``read`` and ``pickle_blobs``.

    Attributes:
        handle: the opened file (opened without blocking, inside its folder's bounds); None for a
            folder format.
        head: the file's first bytes (up to 64; ``b""`` for a folder).
        resolver: the pickle allowlist of this read; it records every global it resolves.
        variant: the weights variant asked for in a model folder (``fp16``: ``*.fp16.safetensors``),
            or None for the default weights.
    """

    handle: BinaryIO | None
    head: bytes
    resolver: pickles.GlobalResolver
    variant: str | None = None


@dataclass
class Contents:
    """What a format's ``read`` returns: the object tree with lazy tensors, and what it spans."""

    container: Any
    files: list[Path]
    metadata: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    # the narrower format the input proved to be, when the format that claimed it handed it over
    # (a torch zip that holds TorchScript code): None, the claiming format itself
    format: str | None = None
    # where the weights lie in ``container`` when the format records it (a safetensors file's
    # ckptool.formats.entries); None: found as for any container (a weights-only format's: the container)
    layout: tuple[Any, ...] | None = None
    # the weights at ``layout`` are an optimizer's state dict, read by its tensors' key paths
    # (a safetensors file ckptool wrote from one)
    flattened: bool = False
    # a training folder's layout (its model files and the training state beside them), for the
    # folder input that was read through one of its files
    folder: Any = None


@dataclass(frozen=True)
class PickleBlob:
    """One pickle of a checkpoint, for scan: where it lies, its bytes, and whether a load reads it."""

    label: str
    data: bytes
    read_by_load: bool = True
    file: str | None = None  # the file of a folder input it lies in, when the input spans several (a training folder)


@dataclass
class Pickles:
    """Every pickle scan judges in one input, and what scan calls the input before it is read
    (its format's name, or a narrower word: ``torchscript``, ``pickle``)."""

    kind: str
    blobs: list[PickleBlob]
    notes: list[str] = field(default_factory=list)  # what scan says besides the pickles (a TorchScript archive's code)


@dataclass(frozen=True)
class Format:
    """One on-disk format: how it is recognised, read and scanned, and what callers need to know.

    Attributes:
        name: the name :attr:`Checkpoint.format` carries.
        sniff: ``sniff(head, path)``: whether this format reads the input; ``head`` is the file's
            first bytes, or None when ``path`` is a folder.
        read: ``read(path, options) -> Contents``.
        pickle_blobs: ``pickle_blobs(path, options) -> Pickles``: the pickles scan judges; None
            for a format that holds none (see :meth:`scan_pickles`).
        find_in_folder: for a format whose file a folder input names (a safetensors index, or
            the folder's one ``.safetensors``): that file inside the folder, or None.
        scan_resolver: widens scan's allowlist by the format's own metadata classes, which the
            reader reads as inert records (DCP's); None: the load's own allowlist.
        default_suffix: the suffix of the file a rewrite (strip, add-prefix, remap) of this
            format writes, for the commands ckptool suggests.
        rewrite_target: the ``--to`` a rewrite of this format writes when the output's name
            does not say.
        target: the ``--to`` that writes this format (None: ckptool does not write it).
        suffixes: the file-name suffixes that name this format as an output.
        sharded: written as a folder of shards (chosen with a folder or ``--max-shard-size``).
        folder_output: the format a folder output, or a name without a suffix, is written in.
        weights_only: the container is the weights mapping itself; nothing else fits in the format.
        has_location_tags: storages record the device they were saved on.
        rewrite_note: said when a checkpoint of this format is rewritten as a ``.pt`` (its own
            serialization is not the one written), or None.
        torch_load_refuses: why ``torch.load`` cannot read this format (inspect suggests a
            convert), or None.
        in_place_refused: why a rewrite may not replace an input of this format (``--in-place``):
            the input is more than the rewrite writes back; None: it may.
        own_saver: a format ckptool's own writer does not write: torch's own saver writes it
            (DCP: ``ckptool.ops.dcp_write``), and what it wrote is checked as every write is.
        owns: for a folder format, which files below a folder it claims its reader reads as its own:
            ``owns(folder)(path from the folder)``; a claimed folder whose other files hold checkpoints
            is no single model (a tree scan walks it). None: only the files named by the format's
            index or single file (the sharded formats).
    """

    name: str
    sniff: Callable[[bytes | None, Path], bool]
    read: Callable[[Path, ReadOptions], Contents]
    pickle_blobs: Callable[[Path, ReadOptions], Pickles] | None = None
    find_in_folder: Callable[[Path], Path | None] | None = None
    scan_resolver: Callable[[pickles.GlobalResolver], pickles.GlobalResolver] | None = None
    default_suffix: str = ".pt"
    rewrite_target: str = "pt"
    target: str | None = None
    suffixes: tuple[str, ...] = ()
    sharded: bool = False
    folder_output: bool = False
    weights_only: bool = False
    has_location_tags: bool = True
    rewrite_note: str | None = None
    torch_load_refuses: str | None = None
    in_place_refused: str | None = None
    own_saver: bool = False
    owns: Callable[[Path], Callable[[str], bool]] | None = None

    def scan_pickles(self, path: Path, options: ReadOptions) -> Pickles:
        """The pickles scan judges in ``path`` (none for a format without ``pickle_blobs``)."""
        if self.pickle_blobs is None:
            return Pickles(self.name, [])
        return self.pickle_blobs(path, options)


_loaded: dict[str, Format] = {}


def _formats() -> Iterator[Format]:
    """The registered formats in order, each imported when the iteration reaches it."""
    for entry in list(REGISTRY):
        fmt = _loaded.get(entry)
        if fmt is None:
            module, _, attribute = entry.partition(":")
            fmt = _loaded[entry] = getattr(importlib.import_module(module, __name__), attribute)
        yield fmt


def registered() -> tuple[Format, ...]:
    """Every registered format, in sniffing order."""
    return tuple(_formats())


def for_name(name: str) -> Format:
    """The format a :attr:`Checkpoint.format` names.

    Raises:
        KeyError: no registered format has that name.
    """
    for fmt in _formats():
        if fmt.name == name:
            return fmt
    raise KeyError(f"no checkpoint format is named {name!r}")


def sniff(head: bytes | None, path: Path) -> Format | None:
    """The first registered format that claims the input (``head`` None for a folder), or None."""
    for fmt in _formats():
        if fmt.sniff(head, path):
            return fmt
    return None


def in_folder(directory: Path) -> Path | None:
    """The file a folder input is read through (a safetensors index, or its one file), or None."""
    for fmt in _formats():
        if fmt.find_in_folder is not None:
            found = fmt.find_in_folder(directory)
            if found is not None:
                return found
    return None


def for_suffix(path: Path) -> Format | None:
    """The format an output file's suffix names (compared ignoring case), or None."""
    suffix = path.suffix.lower()
    for fmt in _formats():
        if suffix in fmt.suffixes:
            return fmt
    return None


def for_target(to: str, *, sharded: bool = False) -> Format | None:
    """The format ``--to`` names (its sharded variant with ``sharded``), or None."""
    for fmt in _formats():
        if fmt.target == to and fmt.sharded == sharded:
            return fmt
    return None


def folder_output() -> Format:
    """The format a folder output (or an output name without a suffix) is written in."""
    return next(fmt for fmt in _formats() if fmt.folder_output)


# ---------------------------------------------------------------------------------------------
# what a file is when no format claims it


PICKLE_FIRST_BYTES = frozenset(b"\x80(cSVIJKLFGN]}l)dtq.")  # the opcodes a pickle can open with

_SIGNATURES = (
    (b"\x89PNG", "a PNG image"),
    (b"\xff\xd8\xff", "a JPEG image"),
    (b"GIF8", "a GIF image"),
    (b"\x1f\x8b", "a gzip archive — decompress it first"),
    (b"7z\xbc\xaf", "a 7z archive — extract it first"),
    (b"BZh", "a bzip2 archive — decompress it first"),
    (b"\xfd7zXZ", "an xz archive — decompress it first"),
    (b"\x93NUMPY", "a NumPy .npy array (numpy.load reads it)"),
    (b"\x89HDF", "an HDF5 file (Keras?)"),
    (b"GGUF", "a GGUF file (llama.cpp)"),
    (b"%PDF", "a PDF document"),
    (b"\x7fELF", "an executable"),
    (b"PK\x05\x06", "an empty zip archive"),
)


def describe(head: bytes) -> str | None:
    """What a file that is no checkpoint is, by its signature (``"a PNG image"``), or None."""
    for magic, what in _SIGNATURES:
        if head.startswith(magic):
            return what
    return None


def looks_like_text(head: bytes) -> bool:
    """Whether the file's first bytes are printable UTF-8 text."""
    try:
        text = head.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return all(ch.isprintable() or ch in "\r\n\t" for ch in text)
