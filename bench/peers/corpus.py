"""The scan corpus the peer benchmark runs on, written into one folder with a manifest of labels.

    .venv/bin/python -m bench.peers.corpus OUT        # writes OUT/ and OUT/manifest.json

Four parts, each case under a stable name (the key of ``results.json``, independent of OUT):

* ``hostile/<case>``: every case of ``tests/hostile.py``'s ``build_corpus`` (ckptool's hostile suite);
  ``unsafe`` cases are *malicious*, ``refuse`` cases *malformed* (they attack the reader, not the
  loader: no code payload), except those that carry a canary (malicious). Cases that are no regular
  file or folder, or a folder holding a FIFO (a scanner would wait on it forever), are left out.
* ``picklescan/<path>``: the public picklescan corpus (``../shared/corpus/picklescan``; skipped when
  absent), labelled by its README: ``benign*``, the numpy arrays but ``dns_exfiltration.npy``,
  ``not_a_pickle.bin``, ``bad_pytorch.pt`` (a PNG header), the password-protected zip and the two
  bare-tensor ``pytorch_model.bin`` files are *benign*; every other file is *malicious*
  (``broken_model.pkl`` included: it calls ``builtins.exec`` before it breaks).
* ``fixtures/<path>``: every checkpoint file under the repository's ``fixtures/`` (*benign*).
* ``trust/<case>``: names that resolve to code through an attribute path (a builtin behind a dotted
  qualname, a module re-exported as another's attribute), a whole-model pickle with one such entry,
  omegaconf containers converted at load time (interpolations resolved), and a FRAME whose end falls
  inside an opcode's argument (*malicious*). Each as a torch zip (``.pt``) and, where a bare pickle
  makes sense, a ``.pkl``.

Nothing here runs a payload: every pickle is assembled opcode by opcode (the omegaconf containers are
``pickle.dumps`` of stand-in classes in a child process, which only writes bytes). Each payload that
leaves a trace would create its canary under ``OUT/canary/`` or delete its victim under
``OUT/victims/``; the tests check both. The same folder gives the same bytes (the canary paths are
absolute, so another folder gives other bytes and the same names), except the hostile suite's edited
TorchScript archives, which ``zipfile`` stamps with the time they were written.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import stat
import struct
import subprocess
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
def _picklescan_corpus() -> Path:
    """The public picklescan corpus: where the tests look for it (``CKPTOOL_PICKLESCAN_CORPUS``, its ``tests/``
    folder), beside this checkout, or where this workplace keeps it (a fresh clone elsewhere finds it too)."""
    configured = os.environ.get("CKPTOOL_PICKLESCAN_CORPUS")
    candidates = [Path(configured).parent] if configured else []
    candidates += [REPO.parent / "shared" / "corpus" / "picklescan", Path("/work/shared/corpus/picklescan")]
    return next((candidate for candidate in candidates if candidate.is_dir()), candidates[0])


PICKLESCAN_CORPUS = _picklescan_corpus()
FIXTURES = REPO / "fixtures"
STANDINS = FIXTURES / "standins"
MALICIOUS, BENIGN, MALFORMED = "malicious", "benign", "malformed"
# fixtures/ also holds the scripts that made the checkpoints, their notes and records: not checkpoints
NOT_CHECKPOINTS = {".py", ".pyc", ".md", ".json", ".txt", ".yaml", ".toml"}
PICKLESCAN_BENIGN = {"not_a_pickle.bin", "bad_pytorch.pt", "benign_password_protected.zip", "pytorch_model.bin",
                     "new_pytorch_model.bin"}


@dataclass(frozen=True)
class Entry:
    """One file (or folder) of the corpus: its stable name, where it is under OUT, and its label."""

    name: str
    path: str  # relative to the corpus folder
    label: str
    source: str  # hostile, picklescan, fixtures or trust
    canary: str | None = None  # created if the payload ever runs (relative to the corpus folder)
    victim: str | None = None  # deleted if the payload ever runs
    note: str = ""


def _hostile_module():  # noqa: ANN202 — tests/hostile.py, imported by path when tests/ is not on sys.path
    try:
        import hostile
    except ImportError:
        sys.path.insert(0, str(REPO / "tests"))
        import hostile
    return hostile


# ------------------------------------------------------------------------------------------------ hostile


def _scannable(path: Path) -> bool:
    """A regular file, or a folder holding only files, folders and links (no FIFO, socket or device)."""
    try:
        mode = path.lstat().st_mode
    except OSError:
        return False
    if stat.S_ISREG(mode):
        return True
    if not stat.S_ISDIR(mode):
        return False
    for child in path.rglob("*"):
        child_mode = child.lstat().st_mode
        if not (stat.S_ISREG(child_mode) or stat.S_ISDIR(child_mode) or stat.S_ISLNK(child_mode)):
            return False
    return True


def hostile_entries(out: Path) -> list[Entry]:
    hostile = _hostile_module()
    import torch

    torch.manual_seed(0)  # the TorchScript cases script a freshly initialised Linear: the same weights every build
    entries = []
    for case in hostile.build_corpus(out / "hostile"):
        if not _scannable(case.path):
            continue
        label = MALICIOUS if case.expect == hostile.UNSAFE or case.canary is not None else MALFORMED
        entries.append(Entry(f"hostile/{case.name}", str(case.path.relative_to(out)), label, "hostile",
                             canary=str(case.canary.relative_to(out)) if case.canary else None,
                             note=f"expect {case.expect}"))
    return entries


# ------------------------------------------------------------------------------------------------ copies


def picklescan_label(path: Path) -> str:
    name = path.name
    if name.startswith("benign") or name in PICKLESCAN_BENIGN:
        return BENIGN
    if path.suffix in (".npy", ".npz") and name != "dns_exfiltration.npy":
        return BENIGN
    return MALICIOUS


def copied_entries(out: Path, source: Path, kind: str) -> list[Entry]:
    """Every checkpoint file under ``source`` copied to ``out/kind/`` (same relative paths)."""
    entries = []
    for path in sorted(source.rglob("*")):
        if (not path.is_file() or path.suffix in NOT_CHECKPOINTS or path.name in ("LICENSE", "README")
                or "__pycache__" in path.parts):
            continue
        relative = path.relative_to(source)
        target = out / kind / relative
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, target)
        label = picklescan_label(path) if kind == "picklescan" else BENIGN
        entries.append(Entry(f"{kind}/{relative}", str(target.relative_to(out)), label, kind))
    return entries


# ------------------------------------------------------------------------------------------------ trust holes


def _stack_global(module: str, qualname: str) -> bytes:
    hostile = _hostile_module()
    return hostile.text(module) + hostile.text(qualname) + b"\x93"  # STACK_GLOBAL (protocol 4)


def _dotted_global(module: str, qualname: str) -> bytes:
    return b"c" + module.encode() + b"\n" + qualname.encode() + b"\n"  # GLOBAL; dots resolved from protocol 4 on


def _getattr_chain(module: str, qualname: str) -> bytes:
    """``getattr(getattr(GLOBAL module first, 'second'), ...)``: how protocol 2 spells a dotted name."""
    hostile = _hostile_module()
    first, *rest = qualname.split(".")
    value = hostile.glob(module, first)
    for part in rest:
        value = hostile.call(hostile.glob("builtins", "getattr"), value, hostile.text(part))
    return value


# (case slug, module, qualname, what the call gets): a builtin or a code-running function reached
# through attributes of a module the allowlist or a framework makes look harmless
BUILTIN_DOTTED = [
    ("eval_call", "builtins", "eval.__call__", "python"),
    ("exec_call", "builtins", "exec.__call__", "python"),
    ("getattr_self_eval", "builtins", "getattr.__self__.eval", "python"),
]
REEXPORTS = [
    ("torch_os_system", "torch", "os.system", "shell"),
    ("torch_serialization_os_system", "torch.serialization", "os.system", "shell"),
    ("pathlib_os_system", "pathlib", "os.system", "shell"),
    ("uuid_os_system", "uuid", "os.system", "shell"),
    ("argparse_os_system", "argparse", "_os.system", "shell"),
    ("torch_serialization_pickle_loads", "torch.serialization", "pickle.loads", "pickle"),
    ("numpy_testing_runstring", "numpy", "testing.runstring", "python_globals"),
    ("torch_fx_exec_with_source", "torch.fx", "graph_module._exec_with_source", "python_globals"),
    ("torch_storage_load_from_bytes", "torch", "storage._load_from_bytes", "torch_load"),
    ("pathlib_write_text", "pathlib", "PosixPath.write_text", "write_text"),
    ("pathlib_unlink", "pathlib", "PosixPath.unlink", "unlink"),
]


def _arguments(kind: str, canary: Path, victim: Path) -> list[bytes]:
    """The arguments that make the call leave its trace (create ``canary`` or delete ``victim``)."""
    hostile = _hostile_module()
    shell = hostile.text(f"touch '{canary}'")
    python = hostile.text(f"open({str(canary)!r}, 'w').close()")
    os_system = hostile.whole(hostile.call(hostile.glob("os", "system"), shell))
    path = hostile.call(hostile.glob("pathlib", "PosixPath"), hostile.text(str(canary)))
    return {
        "shell": [shell],
        "python": [python],
        "python_globals": [python, hostile.dct()],
        "pickle": [hostile.raw_bytes(os_system)],
        # torch.load of a legacy stream runs its magic-number pickle first
        "torch_load": [hostile.raw_bytes(hostile.legacy_stream(hostile.whole(hostile.dct()), [], magic=os_system))],
        "write_text": [path, hostile.text("written at load time")],
        "unlink": [hostile.call(hostile.glob("pathlib", "PosixPath"), hostile.text(str(victim)))],
    }[kind]


def _with_weight(payload: bytes, protocol: int, key: str = "extra") -> bytes:
    """data.pkl of ``{"weight": tensor, key: payload}``: a real state-dict entry beside the payload."""
    hostile = _hostile_module()
    head = b"\x80" + bytes([protocol])
    return head + hostile.dct((hostile.text("weight"), hostile.rebuild()), (hostile.text(key), payload)) + hostile.STOP


def frame_desync(hidden: bytes) -> bytes:
    """A protocol-4 pickle whose FRAME ends inside a string's bytes.

    The linear opcode walk (and ``pickle.loads``, whose buffer is the whole pickle) reads
    ``{"abcdecd": <hidden as bytes>}``. CPython's C unpickler reading a file (``pickle.Unpickler(BytesIO)``,
    what ``torch.load`` does with a zip's ``data.pkl``) buffers the frame, and a read past its end
    drops the frame's last bytes and reads on from the file: the string becomes ``cd`` plus the
    BINBYTES header, and ``hidden`` runs as opcodes.
    """
    while any(byte >= 0x80 for byte in struct.pack("<I", len(hidden))):  # the header must decode as UTF-8
        hidden = b"N0" + hidden  # NONE POP: changes nothing
    header = b"B" + struct.pack("<I", len(hidden))  # BINBYTES
    leftover, filler = b"abcde", b"cd"  # as long as the header: both readings take 7 bytes for the string
    body = b"}" + b"\x8c" + bytes([len(leftover) + len(filler)]) + leftover  # EMPTY_DICT SHORT_BINUNICODE
    return b"\x80\x04" + b"\x95" + struct.pack("<Q", len(body)) + body + filler + header + hidden + b"s."


def _omegaconf_pickles() -> dict[str, bytes]:
    """Protocol-2 pickles of omegaconf containers holding ``${oc.env:HOME}`` (the stand-in classes of
    fixtures/standins, which pickle as OmegaConf 2.x does), made in a child process so this one never
    imports a module named omegaconf."""
    script = (
        "import pickle, sys\n"
        f"sys.path.insert(0, {str(STANDINS)!r})\n"
        "from omegaconf.dictconfig import DictConfig\n"
        "from omegaconf.listconfig import ListConfig\n"
        "made = {'dict': DictConfig({'home': '${oc.env:HOME}'}), 'list': ListConfig(['${oc.env:HOME}'])}\n"
        "sys.stdout.write(repr({k: pickle.dumps(v, protocol=2) for k, v in made.items()}))\n"
    )
    # -B: no __pycache__ left in fixtures/standins
    output = subprocess.run([sys.executable, "-I", "-B", "-c", script], check=True, capture_output=True,
                            text=True).stdout
    import ast

    return ast.literal_eval(output)


def trust_entries(out: Path) -> list[Entry]:
    hostile = _hostile_module()
    folder, canaries, victims = out / "trust", out / "canary", out / "victims"
    for place in (folder, canaries, victims):
        place.mkdir(parents=True, exist_ok=True)
    entries: list[Entry] = []

    def add(name: str, data: bytes, *, canary: Path | None = None, victim: Path | None = None, note: str = "") -> None:
        path = folder / name
        path.write_bytes(data)
        entries.append(Entry(f"trust/{name}", str(path.relative_to(out)), MALICIOUS, "trust",
                             canary=str(canary.relative_to(out)) if canary else None,
                             victim=str(victim.relative_to(out)) if victim else None, note=note))

    def both(stem: str, spell: Callable[[str, str], bytes], module: str, qualname: str, kind: str, protocol: int,
             note: str) -> None:
        """``stem.pt`` (the call as one entry of a state dict) and ``stem.pkl`` (the call alone) of the global
        ``spell(module, qualname)`` pushes, given the arguments ``kind`` names."""
        for suffix in ("pt", "pkl"):
            canary, victim = canaries / f"{stem}_{suffix}", victims / f"{stem}_{suffix}"
            if kind == "unlink":
                victim.write_text("deleted only if the pickle ran\n")
            payload = hostile.call(spell(module, qualname), *_arguments(kind, canary, victim))
            if suffix == "pt":
                members = hostile.torch_members(_with_weight(payload, protocol), {"0": hostile.FOUR_FLOATS})
                data = hostile.make_zip(members)
            else:
                data = b"\x80" + bytes([protocol]) + payload + hostile.STOP
            add(f"{stem}.{suffix}", data, canary=None if kind == "unlink" else canary,
                victim=victim if kind == "unlink" else None, note=note)

    for slug, module, qualname, kind in BUILTIN_DOTTED:
        both(f"dotted_{slug}_stack_global", _stack_global, module, qualname, kind, 4,
             f"{module}.{qualname} (STACK_GLOBAL, protocol 4)")
        both(f"dotted_{slug}_global", _dotted_global, module, qualname, kind, 4,
             f"{module}.{qualname} (GLOBAL, protocol 4)")
    for slug, module, qualname, kind in REEXPORTS:
        both(f"reexport_{slug}_p4", _stack_global, module, qualname, kind, 4,
             f"{module}.{qualname} (STACK_GLOBAL {module!r} {qualname!r}, protocol 4)")
        both(f"reexport_{slug}_p2", _getattr_chain, module, qualname, kind, 2,
             f"{module}.{qualname} (getattr chain from GLOBAL {module} {qualname.split('.')[0]}, protocol 2)")

    # a real whole-model checkpoint (ultralytics' best.pt) with one more top-level entry
    best = FIXTURES / "frameworks" / "ultralytics" / "ultralytics_best" / "best.pt"
    if best.is_file():
        import zipfile

        canary = canaries / "ultralytics_torch_os_system"
        payload = hostile.call(_getattr_chain("torch", "os.system"), hostile.text(f"touch '{canary}'"))
        with zipfile.ZipFile(best) as archive:
            members = [hostile.Member(info.filename, archive.read(info)) for info in archive.infolist()]
        data_pkl = next(m for m in members if m.name.endswith("/data.pkl"))
        assert data_pkl.data.endswith(b"u."), "best.pt's data.pkl no longer ends with its top dict's SETITEMS"
        # the top dict is alone on the stack at STOP: key, value, SETITEM adds one entry to it
        data_pkl.data = data_pkl.data[:-1] + hostile.text("extra") + payload + b"s" + hostile.STOP
        add("ultralytics_torch_os_system.pt", hostile.make_zip(members), canary=canary,
            note="fixtures' ultralytics best.pt plus 'extra': getattr(torch.os, 'system')(...)")

    # omegaconf containers converted by a builtin at load time: iterating one resolves ${oc.env:HOME}
    configs = _omegaconf_pickles()
    for stem, (module, name), config in (("omegaconf_dict_env", ("builtins", "dict"), "dict"),
                                         ("omegaconf_list_env", ("builtins", "list"), "list"),
                                         ("omegaconf_ordereddict_env", ("collections", "OrderedDict"), "dict")):
        body = configs[config][2:-1]  # the container's opcodes, without PROTO and STOP
        payload = hostile.call(hostile.glob(module, name), body)
        note = f"{module}.{name}({'DictConfig' if config == 'dict' else 'ListConfig'} holding ${{oc.env:HOME}})"
        add(f"{stem}.pt", hostile.make_zip(hostile.torch_members(_with_weight(payload, 2, "hparams"),
                                                                 {"0": hostile.FOUR_FLOATS})), note=note)
        add(f"{stem}.pkl", hostile.whole(payload), note=note)

    # FRAME desync hiding os.system from the linear walk
    for suffix in ("pkl", "pt"):
        canary = canaries / f"frame_hidden_os_system_{suffix}"
        data = frame_desync(hostile.call(hostile.glob("os", "system"), hostile.text(f"touch '{canary}'")))
        if suffix == "pt":
            data = hostile.make_zip(hostile.torch_members(data))
        add(f"frame_hidden_os_system.{suffix}", data, canary=canary,
            note="os.system seen only by a file-reading C unpickler (FRAME ends inside a string)")
    return entries


# ------------------------------------------------------------------------------------------------ all


def build(out: Path, *, picklescan: Path | None = PICKLESCAN_CORPUS) -> list[Entry]:
    """Write the whole corpus under ``out`` and ``out/manifest.json``; return its entries.

    ``picklescan=None`` (or a folder that is not there) leaves the public picklescan corpus out.
    """
    out = Path(out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    entries = hostile_entries(out)
    if picklescan is not None and Path(picklescan).is_dir():
        entries += copied_entries(out, Path(picklescan), "picklescan")
    entries += copied_entries(out, FIXTURES, "fixtures")
    entries += trust_entries(out)
    names = [entry.name for entry in entries]
    duplicates = sorted({name for name in names if names.count(name) > 1})
    assert not duplicates, f"corpus names must be unique: {duplicates}"
    (out / "manifest.json").write_text(json.dumps([asdict(entry) for entry in entries], indent=1) + "\n")
    return entries


def load_manifest(out: Path) -> list[Entry]:
    return [Entry(**record) for record in json.loads((Path(out) / "manifest.json").read_text())]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path, help="folder to write the corpus into")
    parser.add_argument("--picklescan", type=Path, default=PICKLESCAN_CORPUS,
                        help="the public picklescan corpus (default: %(default)s; left out when absent)")
    args = parser.parse_args(argv)
    entries = build(args.out, picklescan=args.picklescan)
    counts: dict[str, int] = {}
    for entry in entries:
        counts[f"{entry.source}/{entry.label}"] = counts.get(f"{entry.source}/{entry.label}", 0) + 1
    print(f"{len(entries)} entries in {args.out}: " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())))
    return 0


if __name__ == "__main__":
    sys.exit(main())
