"""Nested names spelled ``getattr(<global>, 'name')``: pickle's protocol-2 form of a method or nested
class (``HistoryBuffer.min``, as mmengine's runner checkpoints hold in their message hub).

Such a call names the global ``<global>.name``: it is judged by that name (unknown, allowed by a
pattern such as ``'mylib.*'``), never as ``builtins.getattr`` itself, and a rewrite spells it back the
same way. Any other ``getattr`` call (on a value, with a dunder name) stays the code-running global.
Files are real ``torch.save`` output from a subprocess that imports a stand-in module; this process
never imports it.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from click.testing import CliRunner

import ckptool
from ckptool.cli.main import main

torch = pytest.importorskip("torch")
hostile = pytest.importorskip("hostile")

# mmengine's HistoryBuffer in miniature: its pickled state holds its class's statistics methods
HISTORY = """
    import numpy as np

    class HistoryBuffer:
        _statistics_methods = {}

        def __init__(self, values):
            self._log_history = np.asarray(values, dtype=np.float64)
            self._statistics_methods.setdefault("min", HistoryBuffer.min)
            self._statistics_methods.setdefault("mean", HistoryBuffer.mean)

        def min(self):
            return self._log_history.min()

        def mean(self):
            return self._log_history.mean()

        def __getstate__(self):
            self.__dict__.update(statistics_methods=self._statistics_methods)
            return self.__dict__
    """
NESTED = ["histbuf.HistoryBuffer", "histbuf.HistoryBuffer.min", "histbuf.HistoryBuffer.mean"]


@pytest.fixture(scope="module")
def runner_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An mmengine-like runner checkpoint: weights beside a message hub of HistoryBuffer records."""
    tmp_path = tmp_path_factory.mktemp("runner")
    modules = tmp_path / "stand_ins"
    modules.mkdir()
    (modules / "histbuf.py").write_text(textwrap.dedent(HISTORY))
    out = tmp_path / "epoch_1.pth"
    script = textwrap.dedent(f"""
        import sys, torch
        sys.path.insert(0, {str(modules)!r})
        from histbuf import HistoryBuffer
        torch.manual_seed(0)
        torch.save({{"meta": {{"epoch": 1}}, "state_dict": torch.nn.Linear(3, 2).state_dict(),
                    "message_hub": {{"log_scalars": {{"train/loss": HistoryBuffer([0.5, 0.25]),
                                                     "train/lr": HistoryBuffer([0.1])}}}}}}, {str(out)!r})
        """)
    subprocess.run([sys.executable, "-c", script], check=True, timeout=300)
    return out


def run(*args: object) -> tuple[int, str, str]:
    result = CliRunner().invoke(main, [str(a) for a in args])
    return result.exit_code, result.stdout, result.stderr


def test_a_method_reference_is_an_unknown_nested_global_not_a_getattr(runner_checkpoint: Path) -> None:
    path = runner_checkpoint
    report = ckptool.scan(path)
    assert report.verdict == "unknown" and report.dangerous == []
    assert report.unsafe == sorted(NESTED)
    assert not any("getattr" in name for name in report.globals)
    code, _, err = run("inspect", path)
    assert code == 3 and err.count("\n") == 1
    assert "3 globals outside the allowlist: " + ", ".join(NESTED) in err, err
    assert "should not be trusted" not in err
    assert "histbuf" not in sys.modules


def test_a_pattern_allows_the_nested_names_and_a_rewrite_spells_them_back(tmp_path: Path,
                                                                           runner_checkpoint: Path) -> None:
    path = runner_checkpoint
    assert ckptool.scan(path, allow_globals=("histbuf.*",)).verdict == "safe"
    out = tmp_path / "remapped.pth"
    code, _, err = run("remap", path, "-o", out, "--to", "cpu", "--allow-global", "histbuf.*")
    assert code == 0, err
    # torch itself, with the class importable, reads the rewrite as it reads the original
    script = textwrap.dedent(f"""
        import sys, torch
        sys.path.insert(0, {str(path.parent / 'stand_ins')!r})
        from histbuf import HistoryBuffer
        for name in ({str(path)!r}, {str(out)!r}):
            hub = torch.load(name, weights_only=False)["message_hub"]["log_scalars"]
            loss = hub["train/loss"]
            methods = loss.__dict__["statistics_methods"]
            assert methods == {{"min": HistoryBuffer.min, "mean": HistoryBuffer.mean}}, methods
            print(float(methods["mean"](loss)), float(hub["train/lr"].min()))
        """)
    lines = subprocess.run([sys.executable, "-c", script], check=True, capture_output=True, text=True,
                           timeout=300).stdout.split("\n")
    assert lines[0] == lines[1] == "0.375 0.1"
    assert ckptool.scan(out, allow_globals=("histbuf.*",)).unsafe == []
    code, out_json, err = run("diff", path, out, "--json", "--allow-global", "histbuf.*")
    assert code == 0 and json.loads(out_json)["identical"] is True, (out_json, err)


@pytest.mark.parametrize("target", [
    hostile.call(hostile.glob("collections", "OrderedDict")),  # getattr on a value, not a global
    hostile.glob("mylib", "Config"),  # with a dunder name (below)
])
def test_any_other_getattr_call_stays_a_code_running_global(tmp_path: Path, target: bytes) -> None:
    attribute = "__init__" if target.startswith(b"c") else "keys"
    body = hostile.dct((hostile.text("weight"), hostile.rebuild()),
                       (hostile.text("x"), hostile.call(hostile.glob("__builtin__", "getattr"), target,
                                                        hostile.text(attribute))))
    path = tmp_path / "getattr.pt"
    path.write_bytes(hostile.make_zip(hostile.torch_members(hostile.whole(body), {"0": hostile.FOUR_FLOATS})))
    report = ckptool.scan(path, allow_globals=("mylib.*",))
    assert report.verdict == "dangerous" and report.dangerous == ["__builtin__.getattr"], report
    with pytest.raises(ckptool.UnsafeCheckpointError) as refused:
        ckptool.load(path, allow_globals=["mylib.*"])
    assert refused.value.globals == ["builtins.getattr"]
