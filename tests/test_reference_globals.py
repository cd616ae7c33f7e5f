"""A class outside the allowlist that a pickle only refers to (a dict key, a value, an item) is read as data.

Lightning 1.x keys a checkpoint's ``callbacks`` entry by the ``ModelCheckpoint`` class itself; nothing of the
class runs when such a pickle is read. ckptool reads it with no flag, as the inert placeholder class an
``--allow-global`` read gives it (ckptool/pickles/references.py). Any other use — a call by REDUCE, NEWOBJ,
NEWOBJ_EX, OBJ or INST, however the class reaches the call (a GLOBAL, the memo, an extension code, a nested
name spelled through it), an argument an object or a tensor keeps, BUILD on it, items put into it, a
persistent id naming it — is refused exactly as before: the same error, word for word, as a resolver that
reads no global as data gives (``TodaysResolver`` below). A code-running name is refused however it is used.
Every case runs through the C walk and run and through the Python ones (``CKPTOOL_PURE_PYTHON``'s path).
"""

from __future__ import annotations

import copyreg
import json
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import ckptool
from ckptool import pickles
from ckptool.pickles import opcode_guard, unpickle
from ckptool.pickles.placeholders import OpaqueObject
from ckptool.pickles.refusal import refusal

hostile = pytest.importorskip("hostile")

MODULE, NAME = "pytorch_lightning.callbacks.model_checkpoint", "ModelCheckpoint"
FULL = f"{MODULE}.{NAME}"
CALLBACK = hostile.glob(MODULE, NAME)
OTHER = hostile.glob("research.models", "Net")
PROTO4 = b"\x80\x04"


class TodaysResolver(pickles.GlobalResolver):
    """The resolver as it was before a referenced class was data: every global outside the allowlist refused."""

    def data_references(self) -> list[str]:
        return []


@pytest.fixture(params=["c", "python"])
def walks(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The C guard walk and unpickler run where they were built, or the Python ones (the reference)."""
    if request.param == "c":
        if not (unpickle.FAST and opcode_guard.NATIVE):
            pytest.skip("the C extensions are not built")
    else:
        monkeypatch.setattr(unpickle, "FAST", False)
        monkeypatch.setattr(opcode_guard, "NATIVE", False)
    return str(request.param)


def canon(obj: Any, seen: dict[int, int] | None = None) -> Any:
    """A comparable form of a tree: placeholder classes by name and identity, sharing as back-references."""
    seen = {} if seen is None else seen
    if isinstance(obj, type):
        return ("class", getattr(obj, "_global", obj.__qualname__), id(obj))
    if isinstance(obj, str | bytes | int | float | bool | type(None)):
        return obj
    if id(obj) in seen:
        return ("ref", seen[id(obj)])
    seen[id(obj)] = len(seen)
    if isinstance(obj, dict):
        state = getattr(obj, "__dict__", None)
        return (type(obj).__name__, [(canon(k, seen), canon(v, seen)) for k, v in dict.items(obj)],
                [(name, canon(value, seen)) for name, value in sorted(state.items())] if state else None)
    if isinstance(obj, list | tuple):
        return (type(obj).__name__, [canon(item, seen) for item in obj])
    if isinstance(obj, set | frozenset):
        return (type(obj).__name__, sorted(repr(canon(item, {})) for item in obj))
    if isinstance(obj, OpaqueObject):
        return ("object", obj._global, obj._mode, canon(obj._args, seen), canon(obj._state, seen),
                canon(obj._items, seen), canon(obj._setitems, seen))
    return (type(obj).__name__, repr(obj))


def read(data: bytes, resolver: pickles.GlobalResolver, persistent_load: Any = None) -> tuple:
    try:
        tree = pickles.loads(data, resolver, persistent_load)
    except pickles.RefusedGlobal as e:  # as every command words it
        return ("refused", str(refusal(e)), e.names, e.complete, e.called_on)
    except ckptool.CkptError as e:
        return (type(e).__name__, str(e))
    return ("read", canon(tree))


def outcome(data: bytes, persistent_load: Any = None) -> tuple:
    """What ckptool reads of ``data`` with no flag, and what it read before a referenced class was data."""
    return read(data, pickles.GlobalResolver(), persistent_load), read(data, TodaysResolver(), persistent_load)


def value_only_pickles() -> dict[str, bytes]:
    """Pickles that hold ModelCheckpoint (and ``research.models.Net``) as values only."""
    state = hostile.dct((hostile.text("monitor"), b"N"), (hostile.text("dirpath"), hostile.text("/logs")))
    stack_global = hostile.text(MODULE) + hostile.text(NAME) + b"\x93"
    return {
        "dict key (Lightning 1.x callbacks)": hostile.whole(hostile.dct((hostile.text("callbacks"),
                                                                          hostile.dct((CALLBACK, state))))),
        "dict value": hostile.whole(hostile.dct((hostile.text("cls"), CALLBACK))),
        "list item": hostile.whole(hostile.lst(CALLBACK, hostile.integer(1))),
        "tuple item": hostile.whole(hostile.tup(CALLBACK, OTHER)),
        "the whole pickle": hostile.whole(CALLBACK),
        "memo shared, key and value": hostile.whole(b"}(" + CALLBACK + b"q\x05" + b"h\x05" + b"u"),
        "two GLOBALs of one name": hostile.whole(hostile.lst(CALLBACK, hostile.dct((CALLBACK, CALLBACK)))),
        "STACK_GLOBAL (protocol 4)": PROTO4 + b"}(" + stack_global + b"\x94" + hostile.text("x") + b"u.",
        "FROZENSET item (protocol 4)": PROTO4 + b"(" + CALLBACK + OTHER + b"\x91.",
        "builtins.set item": hostile.whole(hostile.call(hostile.glob("builtins", "set"), hostile.lst(CALLBACK))),
        "OrderedDict value": hostile.whole(hostile.call(hostile.glob("collections", "OrderedDict"),
                                                        hostile.lst(hostile.tup(hostile.text("k"), CALLBACK)))),
        "nested name spelled by getattr": hostile.whole(hostile.dct((hostile.text("k"), hostile.call(
            hostile.glob("builtins", "getattr"), CALLBACK, hostile.text("Inner"))))),
        "deep in plain containers": hostile.whole(hostile.lst(hostile.tup(hostile.dct(
            (hostile.text("a"), hostile.lst(hostile.lst(CALLBACK)))), OTHER))),
    }


@pytest.mark.parametrize("case", sorted(value_only_pickles()))
def test_a_class_held_only_as_a_value_is_read_with_no_flag(case: str, walks: str) -> None:
    data = value_only_pickles()[case]
    resolver = pickles.GlobalResolver()
    now, before = read(data, resolver), read(data, TodaysResolver())
    assert now[0] == "read", now
    assert before[0] == "refused" and before[3], before
    assert resolver.referenced == before[2]  # what was read as data: every name refused before, in its order
    assert not resolver.refused
    # the very tree (placeholder classes included, by identity) an --allow-global read of those names gives
    assert now == read(data, pickles.GlobalResolver(before[2]))


def test_the_placeholder_is_the_class_allow_global_gives(walks: str) -> None:
    tree = pickles.loads(value_only_pickles()["dict key (Lightning 1.x callbacks)"], pickles.GlobalResolver())
    (key,) = tree["callbacks"]
    assert key is pickles.opaque_type(FULL) and key._global == FULL and issubclass(key, OpaqueObject)
    assert tree["callbacks"][key] == {"monitor": None, "dirpath": "/logs"}


def used_pickles() -> dict[str, bytes]:
    """Pickles that call ModelCheckpoint, or hold it where something uses it; most also hold it as a value."""
    keyed = hostile.dct((CALLBACK, hostile.integer(1)))  # the reference the file also holds
    called = hostile.call(CALLBACK)
    getattr_call = hostile.call(hostile.glob("builtins", "getattr"), CALLBACK, hostile.text("Inner"))
    return {
        "REDUCE": hostile.whole(hostile.lst(keyed, called)),
        "REDUCE, the result popped": hostile.whole(called + b"0" + keyed),
        "REDUCE through the memo": hostile.whole(b"](" + CALLBACK + b"q\x07" + b"0" + keyed + b"h\x07)R" + b"e"),
        "REDUCE through the memo, protocol 4": PROTO4 + b"](" + hostile.text(MODULE) + hostile.text(NAME)
        + b"\x93\x94" + b"0}(h\x02K\x01u" + b"h\x02)Re.",
        "NEWOBJ": hostile.whole(hostile.lst(keyed, CALLBACK + b")\x81")),
        "NEWOBJ, the result popped": hostile.whole(CALLBACK + b")\x81" + b"0" + keyed),
        "NEWOBJ_EX, the result popped (protocol 4)": PROTO4 + CALLBACK + b")}\x92" + b"0" + keyed + b".",
        "OBJ, the result popped": hostile.whole(b"(" + CALLBACK + b"o" + b"0" + keyed),
        "INST, the result popped": hostile.whole(b"(i" + MODULE.encode() + b"\n" + NAME.encode() + b"\n0" + keyed),
        "a nested name spelled through it, called and popped": hostile.whole(getattr_call + b")R0" + keyed),
        "NEWOBJ_EX (protocol 4)": PROTO4 + b"](" + CALLBACK + b")}\x92" + b"e.",
        "OBJ": hostile.whole(hostile.lst(keyed, b"(" + CALLBACK + b"o")),
        "INST": hostile.whole(hostile.lst(keyed, b"(i" + MODULE.encode() + b"\n" + NAME.encode() + b"\n")),
        "a nested name spelled through it, called": hostile.whole(hostile.lst(keyed, getattr_call + b")R")),
        "an argument an allowed object keeps (defaultdict's factory)": hostile.whole(hostile.lst(
            keyed, hostile.call(hostile.glob("collections", "defaultdict"), CALLBACK))),
        "an allowed object's state (argparse.Namespace)": hostile.whole(hostile.lst(
            keyed, hostile.glob("argparse", "Namespace") + b")\x81" + hostile.dct((hostile.text("cb"), CALLBACK))
            + b"b")),
        "an OrderedDict's attribute (BUILD)": hostile.whole(
            hostile.ordered_dict() + hostile.dct((hostile.text("_metadata"), CALLBACK)) + b"b"),
        "BUILD on it": hostile.whole(CALLBACK + hostile.dct((hostile.text("x"), hostile.integer(1))) + b"b"),
        "APPEND into it": hostile.whole(hostile.lst(keyed, CALLBACK + hostile.integer(1) + b"a")),
        "APPENDS into it": hostile.whole(hostile.lst(keyed, CALLBACK + b"(K\x01e")),
        "SETITEM into it": hostile.whole(CALLBACK + hostile.text("k") + hostile.integer(1) + b"s"),
        "beside another global that is called": hostile.whole(hostile.lst(keyed, hostile.call(OTHER))),
        "then a corrupt tail (the read stops early)": hostile.whole(hostile.lst(
            keyed, hostile.call(hostile.glob("torch", "Size"), hostile.text("x")))),
    }


@pytest.mark.parametrize("case", sorted(used_pickles()))
def test_a_class_the_pickle_uses_is_refused_exactly_as_before(case: str, walks: str) -> None:
    now, before = outcome(used_pickles()[case])
    assert now[0] != "read", now
    assert now == before


def test_a_code_running_name_is_refused_even_as_a_dict_key(walks: str) -> None:
    for module, name in (("os", "system"), ("builtins", "eval"), ("torch.serialization.os", "system")):
        data = hostile.whole(hostile.dct((hostile.glob(module, name), hostile.integer(1))))
        now, before = outcome(data)
        assert now == before and now[0] == "refused" and "which runs code" in now[1], now
        assert "--allow-global" not in now[1] and "allow_globals" not in now[1]  # no flag offered for it


def test_every_refused_name_is_named_when_one_of_them_is_called(walks: str) -> None:
    data = hostile.whole(hostile.lst(hostile.dct((CALLBACK, b"N")), hostile.call(OTHER)))
    now, before = outcome(data)
    assert now == before
    assert now[2] == [FULL, "research.models.Net"]  # the referenced one too, in the order first named


class Registered:
    """``module.name`` in copyreg's extension registry under ``code`` (EXT1 names it), for a ``with`` block;
    leaving it removes the code and what the unpickler cached for it."""

    def __init__(self, module: str, name: str, code: int = 0x7A) -> None:
        self.module, self.name, self.code = module, name, code

    def __enter__(self) -> bytes:
        copyreg.add_extension(self.module, self.name, self.code)
        return b"\x82" + bytes([self.code])

    def __exit__(self, *exc: object) -> None:
        copyreg.remove_extension(self.module, self.name, self.code)


EXTENSION = ("pickle uses an extension code (EXT1, EXT2, EXT4): the global it names is the loading process's "
             "copyreg registry's, not the file's, and the unpickler caches it across reads (torch's loader refuses "
             "it too) — refused, nothing was executed")


def test_an_extension_code_is_refused_however_it_is_used(walks: str) -> None:
    """Which global an EXT code names is the process's copyreg registry's, and CPython's unpickler caches what
    find_class gave for it across reads: once any read resolved it (scan's dry run, an ``'*'`` read), later
    reads would take it unjudged. The guard refuses the opcode, before anything resolves."""
    for module, name in ((MODULE, NAME), ("os", "system")):
        with Registered(module, name) as ext:
            held = hostile.whole(hostile.dct((hostile.text("cls"), ext)))
            called = hostile.whole(hostile.dct((hostile.text("cls"), ext + hostile.tup(hostile.text("x")) + b"R")))
            with pytest.raises(ckptool.CkptError, match="extension code"):
                pickles.loads(held, pickles.GlobalResolver(permissive=True))  # nothing resolved, nothing cached
            for data in (held, called):
                for resolver in (pickles.GlobalResolver(), pickles.GlobalResolver(["*"]), TodaysResolver()):
                    assert read(data, resolver) == ("InputError", EXTENSION)


def test_a_persistent_id_naming_it_is_refused_as_before(tmp_path: Path, walks: str) -> None:
    pid = hostile.tup(hostile.text("storage"), CALLBACK, hostile.text("0"), hostile.text("cpu"),
                      hostile.integer(4)) + b"Q"
    data = hostile.whole(hostile.dct((hostile.text("w"), pid)))
    path = tmp_path / "pid.pt"
    path.write_bytes(hostile.make_zip(hostile.torch_members(data, {"0": hostile.FOUR_FLOATS})))
    with pytest.raises(ckptool.CkptError) as refused:
        ckptool.load(path)
    assert f"pickle imports {FULL}, which could run code (the read stopped early" in str(refused.value)


def test_a_tensors_hooks_holding_it_are_refused(tmp_path: Path, walks: str) -> None:
    hooks = hostile.call(hostile.glob("collections", "OrderedDict"),
                         hostile.lst(hostile.tup(hostile.integer(0), CALLBACK)))
    tensor = hostile.call(hostile.glob("torch._utils", "_rebuild_tensor_v2"), hostile.storage_pid(4),
                          hostile.integer(0), hostile.tup(hostile.integer(4)), hostile.tup(hostile.integer(1)),
                          b"\x89", hooks)
    path = tmp_path / "hooks.pt"
    path.write_bytes(hostile.make_zip(hostile.torch_members(hostile.whole(hostile.dct((hostile.text("w"), tensor))),
                                                            {"0": hostile.FOUR_FLOATS})))
    with pytest.raises(ckptool.CkptError, match=f"pickle imports {FULL}, which could run code — refused"):
        ckptool.load(path)


def test_a_run_given_up_half_way_judges_calls_alike(walks: str) -> None:
    """A pickle this operation emitted reaches the C run without the guard's counts: it may give up half way
    (at POP), after it called the class; CPython's unpickler then reads it again, and the verdict is the same."""
    for data in (hostile.whole(hostile.lst(hostile.dct((CALLBACK, b"N")), hostile.call(CALLBACK) + b"0N")),
                 hostile.whole(hostile.lst(hostile.dct((CALLBACK, b"N")), b"N0N"))):
        cache = pickles.GuardCache()
        cache.add_emitted(data)
        given_up = read(data, pickles.GlobalResolver(guard_cache=cache))
        assert given_up == read(data, pickles.GlobalResolver())


def test_a_flood_of_referenced_classes_is_read_once_each() -> None:
    data = hostile.whole(b"](" + b"".join(b"cm%d\nN\n" % k for k in range(60_000)) + b"e")
    resolver = pickles.GlobalResolver()
    tree = pickles.loads(data, resolver)
    assert len(tree) == len(resolver.referenced) == len(set(resolver.referenced)) == 60_000


def test_a_rewrite_writes_the_class_back_and_reads_back_with_no_flag(walks: str) -> None:
    tree = pickles.loads(value_only_pickles()["dict key (Lightning 1.x callbacks)"], pickles.GlobalResolver())
    emitted, _storages = pickles.dump(tree)
    again = pickles.loads(emitted, resolver := pickles.GlobalResolver())
    assert canon(again) == canon(tree) and resolver.referenced == [FULL]


def lightning_zip(tmp_path: Path, call: bool) -> Path:
    """A torch zip ``{"state_dict": {"w": tensor}, "callbacks": {ModelCheckpoint: {...}}}`` written by hand; with
    ``call``, also an object of the class (ModelCheckpoint())."""
    callbacks = hostile.dct((CALLBACK, hostile.dct((hostile.text("monitor"), b"N"))))
    extra = [(hostile.text("made"), hostile.call(CALLBACK))] if call else []
    data = hostile.whole(hostile.dct((hostile.text("state_dict"), hostile.dct((hostile.text("w"), hostile.rebuild()))),
                                     (hostile.text("callbacks"), callbacks), *extra))
    path = tmp_path / ("called.ckpt" if call else "referenced.ckpt")
    path.write_bytes(hostile.make_zip(hostile.torch_members(data, {"0": hostile.FOUR_FLOATS})))
    return path


def run(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "ckptool", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=300)


@pytest.mark.parametrize("pure", [False, True])
def test_commands_read_a_referenced_class_and_refuse_a_called_one(tmp_path: Path, pure: bool,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    if pure:
        monkeypatch.setenv("CKPTOOL_PURE_PYTHON", "1")
    referenced, called = lightning_zip(tmp_path, call=False), lightning_zip(tmp_path, call=True)
    inspected = run("inspect", "--json", str(referenced), cwd=tmp_path)
    assert inspected.returncode == 0, inspected.stderr
    report = json.loads(inspected.stdout)
    assert report["entries"]["callbacks"]["type"] == "dict" and FULL in report["globals"]
    scanned = run("scan", "--json", str(referenced), cwd=tmp_path)
    assert scanned.returncode == 1
    verdict = json.loads(scanned.stdout)
    assert verdict["verdict"] == "unknown" and verdict["verdicts"][FULL] == "unknown" and verdict["readable"]
    out = tmp_path / "out.pt"
    converted = run("convert", str(referenced), "-o", str(out), cwd=tmp_path)
    assert converted.returncode == 0, converted.stderr
    assert run("inspect", str(out), cwd=tmp_path).returncode == 0  # the class written back, read with no flag
    for command in (["inspect"], ["convert", "-o", str(tmp_path / "no.safetensors")], ["strip"]):
        refused = run(command[0], str(called), *command[1:], cwd=tmp_path)
        assert refused.returncode == 3
        assert refused.stderr == (
            f"ckptool: error: {called}: pickle imports {FULL}, which could run code — refused, nothing was executed "
            f"(if you trust this file, allow it by name: --allow-global {FULL})\n"
        )
    assert not (tmp_path / "no.safetensors").exists()
    scanned = run("scan", str(called), cwd=tmp_path)
    assert scanned.returncode == 1 and "ckptool reads them as inert data only with --allow-global" in scanned.stdout


def test_torch_refuses_the_referenced_class_ckptool_reads(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    path = lightning_zip(tmp_path, call=False)
    with pytest.raises(Exception, match=f"Unsupported global: GLOBAL {FULL}"):
        torch.load(path, weights_only=True)
    checkpoint = ckptool.load(path)
    assert checkpoint.tensors["w"].shape == (4,)
    data = struct.unpack("<4f", b"".join(checkpoint.tensors["w"].iter_bytes()))
    assert data == (1.0, 2.0, 3.0, 4.0)


def test_inspect_shows_a_referenced_class_as_python_shows_the_class(tmp_path: Path) -> None:
    data = hostile.whole(hostile.dct((hostile.text("state_dict"), hostile.dct((hostile.text("w"), hostile.rebuild()))),
                                     (hostile.text("callbacks"), hostile.dct((CALLBACK, b"N")))))
    path = tmp_path / "callbacks.pt"
    path.write_bytes(hostile.make_zip(hostile.torch_members(data, {"0": hostile.FOUR_FLOATS})))
    entry = ckptool.inspect(path).entries["callbacks"]
    assert entry == {"type": "dict", "summary": f"{{<class '{FULL}'>: None}}"}  # a class key: no JSON value
