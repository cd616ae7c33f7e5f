"""What a stranger's file can no longer get past: nested names, conversions that run code, global floods.

- A ``torch.save``d object of a nested class (protocol 2 spells ``Outer.Inner`` as
  ``getattr(Outer, 'Inner')``) is the global ``Outer.Inner``: both guard walks let it take its state,
  ``'*'`` reads it, scan calls it unknown (not the ``getattr`` dangerous), and a ``.pt`` rewrite loads in
  torch as the same object.
- ``builtins.dict``/``list`` called on an omegaconf container while unpickling makes ``torch.load``
  resolve its interpolations (the resolvers the loading program registered run): scan says dangerous,
  every command refuses with no pattern offered, and only the class's exact name reads it.
- A pickle naming 100,000+ globals is refused by both walks before any placeholder is made; tens of
  thousands of refused globals are each named once (a list membership test made refusing them quadratic).
"""

from __future__ import annotations

import struct
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import ckptool
from ckptool import pickles
from ckptool.base.errors import CkptError, InputError
from ckptool.pickles import limits, opcode_guard

torch = pytest.importorskip("torch")
hostile = pytest.importorskip("hostile")
from standins import OMEGACONF  # noqa: E402

WALKS = [opcode_guard._python_walk] + ([opcode_guard._native_walk] if opcode_guard._native is not None else [])


def walked(data: bytes) -> set[tuple]:
    out = set()
    for walk in WALKS:
        try:
            stats = walk(data)
            out.add(("passed", stats.size, tuple(stats.globals)))
        except InputError as e:
            out.add(("refused", str(e)))
    return out


def save_in_subprocess(tmp_path: Path, modules: dict[str, str], code: str) -> None:
    """Run ``code`` with ``torch`` imported and ``modules`` (path -> source) importable; this process never imports them."""
    root = tmp_path / "modules"
    for relative, source in modules.items():
        (root / relative).parent.mkdir(parents=True, exist_ok=True)
        (root / relative).write_text(textwrap.dedent(source))
    script = f"import sys, torch\nsys.path.insert(0, {str(root)!r})\n" + textwrap.dedent(code)
    subprocess.run([sys.executable, "-c", script], check=True, timeout=300, cwd=tmp_path)


NESTED = {"nestmod.py": """
    class Outer:
        class Inner:
            def __init__(self, value):
                self.value = value
    """}


def test_a_nested_class_instance_is_its_nested_name(tmp_path: Path) -> None:
    save_in_subprocess(tmp_path, NESTED, """
        import nestmod
        torch.save({"w": torch.arange(3.0), "obj": nestmod.Outer.Inner(7)}, "nested.pt")
    """)
    path = tmp_path / "nested.pt"
    report = ckptool.scan(path)
    assert report.verdict == "unknown" and report.unsafe == ["nestmod.Outer", "nestmod.Outer.Inner"]
    assert ckptool.scan(path, allow_globals=["*"]).verdict == "safe"
    with pytest.raises(CkptError, match="nestmod.Outer.Inner"):
        ckptool.load(path)
    out = tmp_path / "out.pt"
    done = subprocess.run([sys.executable, "-m", "ckptool", "convert", str(path), "-o", str(out), "--allow-global", "*"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    check = f"""
        import nestmod
        a, b = (torch.load(p, weights_only=False) for p in ({str(path)!r}, {str(out)!r}))
        assert type(b["obj"]) is nestmod.Outer.Inner and b["obj"].value == a["obj"].value == 7
        assert torch.equal(a["w"], b["w"])
    """
    save_in_subprocess(tmp_path, NESTED, check)


def test_both_walks_read_getattr_of_a_global_as_the_nested_global() -> None:
    lookup = hostile.glob("builtins", "getattr")
    nested = hostile.call(lookup, hostile.glob("nestmod", "Outer"), hostile.text("Inner"))
    built = hostile.whole(hostile.call(nested, hostile.integer(7)) + hostile.dct((hostile.text("value"), b"K\x07")) + b"b")
    assert walked(built) == {("passed", len(built), ("builtins.getattr", "nestmod.Outer"))}
    # not a plain identifier, or not a global: getattr itself, whose object takes no state
    for attribute in ("__class__", "a b", "x" * 300):
        odd = hostile.call(lookup, hostile.glob("nestmod", "Outer"), hostile.text(attribute))
        data = hostile.whole(hostile.call(odd, hostile.integer(7)) + b"}b")
        results = walked(data)
        assert len(results) == 1 and next(iter(results))[0] == "refused", results
    on_value = hostile.call(lookup, hostile.integer(1), hostile.text("real"))
    results = walked(hostile.whole(hostile.call(on_value) + b"}b"))
    assert len(results) == 1 and "sets state (BUILD) on a object" in next(iter(results))[1]


def omegaconf_files(tmp_path: Path) -> dict[str, Path]:
    save_in_subprocess(tmp_path, OMEGACONF, """
        import collections, typing
        from omegaconf.dictconfig import DictConfig
        from omegaconf.listconfig import ListConfig
        from omegaconf.base import ContainerMetadata, Metadata
        class Call:
            def __init__(self, fn, x): self.fn, self.x = fn, x
            def __reduce__(self): return (self.fn, (self.x,))
        meta = ContainerMetadata(ref_type=typing.Any, key_type=str, element_type=str, meta=Metadata(flags=1))
        config = DictConfig({"home": "${oc.env:HOME}"}, meta)
        for name, fn in (("dict", dict), ("list", list), ("ordereddict", collections.OrderedDict)):
            torch.save({"w": torch.ones(2), "hp": Call(fn, config)}, f"{name}.pt")
        torch.save({"w": torch.ones(2), "hp": config}, "plain.pt")
    """)
    return {name: tmp_path / f"{name}.pt" for name in ("dict", "list", "ordereddict", "plain")}


def test_a_call_that_converts_an_omegaconf_container_is_dangerous(tmp_path: Path) -> None:
    files = omegaconf_files(tmp_path)
    name = "omegaconf.dictconfig.DictConfig"
    assert ckptool.scan(files["plain"]).verdict == "safe"  # a config stored as data: nothing resolves it
    ckptool.load(files["plain"])
    for kind, call in (("dict", "builtins.dict"), ("list", "builtins.list")):
        report = ckptool.scan(files[kind])
        assert report.verdict == "dangerous" and report.verdicts[name] == "dangerous", report
        assert any(f"calls {call} on an object of {name}" in problem for problem in report.problems)
        for allowed in ([], ["omegaconf.*"], ["*"]):  # no pattern reads it, and the refusal offers no flag
            with pytest.raises(CkptError) as refused:
                ckptool.load(files[kind], allow_globals=allowed)
            assert "--allow-global" not in str(refused.value) and "runs that class's code" in str(refused.value)
        ckptool.load(files[kind], allow_globals=[name])  # its exact name: read as inert data
        assert ckptool.scan(files[kind], allow_globals=[name]).verdict == "dangerous"
    with pytest.raises(CkptError, match="OrderedDict built from"):
        ckptool.load(files["ordereddict"])


def test_a_flood_of_globals_is_refused_in_linear_time_and_bounded_memory() -> None:
    def names(count: int) -> bytes:
        return hostile.whole(b"](" + b"".join(b"cm%d\nN\n)R0" % k for k in range(count)) + b"e")  # each one called

    with pytest.raises(pickles.RefusedGlobal) as refused:  # every name, each once (a list lookup made it quadratic)
        pickles.loads(names(60_000), pickles.GlobalResolver())
    assert len(refused.value.names) == len(set(refused.value.names)) == 60_000
    flood = names(limits.MAX_GLOBALS + 1)
    assert walked(flood) == {("refused", f"pickle names over {limits.MAX_GLOBALS} globals (a memory bomb) — refused, "
                                         "nothing was executed")}
    with pytest.raises(InputError, match="names over"):
        pickles.loads(flood, pickles.GlobalResolver(["*"]))


def test_cpythons_unpickler_reads_through_python_so_a_signal_is_handled(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the C run declines a pickle, CPython's unpickler runs it in one C call that never checks for
    signals; it fills its buffer through ``Interruptible.peek``, Python code, so a handler runs every 128 KiB."""
    from ckptool.pickles import unpickle

    calls = []
    monkeypatch.setattr(unpickle, "FAST", False)
    monkeypatch.setattr(unpickle.Interruptible, "peek", lambda self, size=0: calls.append(size) or
                        self._blob[self.tell():self.tell() + max(size, 1)])
    data = hostile.whole(b"](" + b"\x8b\x04\x00\x00\x00\x01\x02\x03\x04" * 40_000 + b"e")  # LONG4: not the C run's
    assert pickles.loads(data, pickles.GlobalResolver()) == [0x04030201] * 40_000
    assert len(calls) >= len(data) // (256 << 10) >= 1  # CPython prefetches 128 KiB at a time


@pytest.mark.parametrize("module", ["builtins", "__builtin__"])
def test_a_complex_dict_key_is_read_however_the_pickle_spells_complex(tmp_path: Path, module: str) -> None:
    """torch.save writes ``__builtin__.complex``, ckptool's own rewrite ``builtins.complex``: both build a
    complex number, a hashable key (the guard once took the second for an unhashable torch record)."""
    key = hostile.call(hostile.glob(module, "complex"), b"G" + struct.pack(">d", 1.0), b"G" + struct.pack(">d", 2.0))
    data = hostile.whole(b"}" + key + b"K\x01s")
    assert walked(data) == {("passed", len(data), (f"{module}.complex",))}
    assert pickles.loads(data, pickles.GlobalResolver()) == {complex(1, 2): 1}
    path = tmp_path / "complex.pt"
    torch.save({"w": torch.ones(2), "keys": {complex(1, 2): 1}}, path)
    out = tmp_path / "out.pt"
    ckptool.save(ckptool.load(path), out)
    assert ckptool.load(out).container["keys"] == torch.load(out, weights_only=True)["keys"] == {complex(1, 2): 1}
