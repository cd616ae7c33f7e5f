"""A ``.pt`` rewrite names a nested class or function exactly as its input did, or the write fails.

pickle names a nested qualified name (``Outer.Inner``) two ways: protocol 4 by STACK_GLOBAL with the dotted
name (module ``m``, name ``Outer.Inner``), below it by a call ``getattr(m.Outer, 'Inner')``. A rewrite that
spells it otherwise (``GLOBAL 'm.Outer' 'Inner'``) does not load: Python imports ``m.Outer`` as a module.
Each form is written back as read — for an object of the class (called) as for the class held as a value —
and a write whose output reads back naming a class otherwise than its input is refused (the write check).

The stand-in module lives in the test's folder; only the subprocesses that save and load import it.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from click.testing import CliRunner

import ckptool
from ckptool.cli.main import main
from ckptool.base.errors import FingerprintMismatchError
from ckptool.pickles import emit

torch = pytest.importorskip("torch")

NESTED = """
    class Outer:
        class Inner:
            def __init__(self, x=0):
                self.x = x

            def __eq__(self, other):
                return type(self) is type(other) and self.__dict__ == other.__dict__

        class Made:  # rebuilt by calling the nested class itself: REDUCE on it
            def __init__(self, x):
                self.x = x

            def __reduce__(self):
                return (Outer.Made, (self.x,))

            def __eq__(self, other):
                return type(self) is type(other) and self.x == other.x

        class Deep:
            class Er:
                def __init__(self, x=0):
                    self.x = x

                def __eq__(self, other):
                    return type(self) is type(other) and self.__dict__ == other.__dict__

        @staticmethod
        def make(x):
            return ("made", x)
    """

# an instance built by NEWOBJ and BUILD, one rebuilt by calling its class, the class and a function as values
CONTAINER = ('{"state_dict": {"w": torch.arange(3.0)}, "inner": Outer.Inner(3), "made": Outer.Made(4), '
             '"made2": Outer.Made(5), "cls": Outer.Inner, "fn": Outer.make, "deep": Outer.Deep.Er(5), '
             '"deep_cls": Outer.Deep.Er}')


@pytest.fixture(scope="module")
def stand_ins(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("stand_ins")
    (folder / "nestmod.py").write_text(textwrap.dedent(NESTED))
    return folder


def _python(stand_ins: Path, script: str) -> str:
    prelude = f"import sys, torch\nsys.path.insert(0, {str(stand_ins)!r})\nfrom nestmod import Outer\n"
    done = subprocess.run([sys.executable, "-c", prelude + textwrap.dedent(script)], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    return done.stdout


def _saved(stand_ins: Path, folder: Path, protocol: int) -> Path:
    path = folder / f"nested_p{protocol}.pt"
    _python(stand_ins, f"torch.save({CONTAINER}, {str(path)!r}, pickle_protocol={protocol})")
    return path


@pytest.mark.parametrize("protocol", [2, 4])
@pytest.mark.parametrize("command", [["convert"], ["add-prefix", "--prefix", "m."], ["remap", "--to", "cpu"]])
def test_a_rewrite_loads_in_torch_as_its_input_does(stand_ins: Path, tmp_path: Path, protocol: int,
                                                    command: list[str]) -> None:
    source = _saved(stand_ins, tmp_path, protocol)
    out = tmp_path / "out.pt"
    result = CliRunner().invoke(main, [command[0], str(source), *command[1:], "-o", str(out),
                                       "--allow-global", "nestmod.*"])
    assert result.exit_code == 0, result.stderr
    verdict = _python(stand_ins, f"""
        a = torch.load({str(source)!r}, weights_only=False)
        b = torch.load({str(out)!r}, weights_only=False)
        assert list(a) == list(b), (list(a), list(b))
        for key in a:
            if key == "state_dict":
                assert all(torch.equal(a[key][n], b[key][("m." if {command[0] == "add-prefix"} else "") + n])
                           for n in a[key])
            else:
                assert a[key] == b[key] and type(a[key]) is type(b[key]), (key, a[key], b[key])
        print("same")
        """)
    assert verdict.strip() == "same"


@pytest.mark.parametrize("protocol", [2, 4])
def test_a_rewrite_spelling_a_name_otherwise_is_refused(stand_ins: Path, tmp_path: Path, protocol: int,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    source = _saved(stand_ins, tmp_path, protocol)
    checkpoint = ckptool.load(source, allow_globals=["nestmod.*"])

    def split_at_the_last_dot(self: emit._Emitter, cls: type) -> None:  # the old emitter's spelling
        self.global_(cls._global)  # type: ignore[attr-defined]

    monkeypatch.setattr(emit._Emitter, "_class", split_at_the_last_dot)
    out = tmp_path / "out.pt"
    with pytest.raises(FingerprintMismatchError, match="nestmod.Outer"):
        ckptool.save(checkpoint, out)
    assert not out.exists() and not list(tmp_path.glob(".ckptool-tmp-*"))
