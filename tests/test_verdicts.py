"""Framework checkpoints read with no flag, and scan's three verdicts: safe, unknown, dangerous.

The data-only globals frameworks store (paths, dates, ``defaultdict(list)``, ``Namespace``,
Lightning's ``AttributeDict``, omegaconf's containers and nodes) are read as inert placeholders
without ``--allow-global``; ``scan`` calls a file ``safe`` (allowlisted only), ``unknown`` (a
package's own classes: trust, not alarm) or ``dangerous`` (code-running or system globals).

Files are real ``torch.save`` output made in a subprocess with stand-in modules written under
``tmp_path``, so this process never imports them.
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
from standins import OMEGACONF  # noqa: E402 — after the importorskip guards

STAND_INS = {
    "lightning/__init__.py": "",
    "lightning/fabric/__init__.py": "",
    "lightning/fabric/utilities/__init__.py": "",
    "lightning/fabric/utilities/data.py": """
        class AttributeDict(dict):
            def __getattr__(self, key):
                try:
                    return self[key]
                except KeyError as e:
                    raise AttributeError(key) from e
            def __setattr__(self, key, value):
                self[key] = value
        """,
    **OMEGACONF,
    "mylib/__init__.py": "",
    "mylib/config.py": """
        class Config:
            def __init__(self, depth):
                self.depth = depth
        """,
}

# What Lightning's default ModelCheckpoint and save_hyperparameters store, in miniature.
FRAMEWORK = """
    import argparse, collections, datetime, decimal, pathlib, typing, uuid
    from lightning.fabric.utilities.data import AttributeDict
    from omegaconf.dictconfig import DictConfig
    from omegaconf.listconfig import ListConfig
    from omegaconf.base import ContainerMetadata, Metadata
    from omegaconf.nodes import AnyNode, StringNode, IntegerNode, FloatNode, BooleanNode
    loops = collections.defaultdict(list)
    loops["fit"].append(1)
    counts = collections.defaultdict(int, {"a": 2})
    hparams = DictConfig({"lr": FloatNode(0.1), "name": StringNode("x"), "layers": IntegerNode(3),
                          "bias": BooleanNode(True), "extra": AnyNode(None), "sizes": ListConfig([1])},
                         ContainerMetadata(ref_type=typing.Any, key_type=str, element_type=typing.Any,
                                           meta=Metadata(flags={})))
    when = datetime.datetime(2024, 5, 6, 7, 8, 9, 10, tzinfo=datetime.timezone(datetime.timedelta(hours=2)))
    VALUE = {
        "state_dict": {"w": torch.arange(4.0)},
        "hyper_parameters": AttributeDict(lr=0.1, sizes=[1, 2]),
        "omegaconf": hparams,
        "callbacks": {"ModelCheckpoint{'monitor': None}": {"dirpath": pathlib.PosixPath("/runs/x/checkpoints"),
                                                           "pure": pathlib.PureWindowsPath("C:/runs"),
                                                           "best_model_path": ""}},
        "loops": loops, "counts": counts, "queue": collections.deque([1, 2], 5),
        "args": argparse.Namespace(lr=0.1, seed=3), "tags": {"a", "b"},
        "when": when, "day": datetime.date(2024, 5, 6), "clock": datetime.time(7, 8),
        "price": decimal.Decimal("1.25"), "run_id": uuid.UUID(int=12345),
    }
    torch.save(VALUE, OUT)
    """

# A nested comparison of what torch.load builds (the stand-ins define no __eq__).
SAME = """
    def same(a, b):
        if type(a) is not type(b):
            return False
        if isinstance(a, torch.Tensor):
            return torch.equal(a, b)
        if isinstance(a, dict):
            return list(a) == list(b) and all(same(a[k], b[k]) for k in a) and same(getattr(a, "__dict__", {}),
                                                                                    getattr(b, "__dict__", {}))
        if isinstance(a, (list, tuple)):
            return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
        if hasattr(a, "__dict__") and not isinstance(a, type):
            return same(vars(a), vars(b))
        return a == b
    """


def stand_ins(tmp_path: Path) -> Path:
    modules = tmp_path / "stand_ins"
    for relative, source in STAND_INS.items():
        (modules / relative).parent.mkdir(parents=True, exist_ok=True)
        (modules / relative).write_text(textwrap.dedent(source))
    return modules


def in_subprocess(tmp_path: Path, code: str, **paths: Path) -> None:
    """Run ``code`` in a throwaway interpreter that can import the stand-ins (``torch`` and ``paths`` defined)."""
    header = f"import sys, torch\nsys.path.insert(0, {str(stand_ins(tmp_path))!r})\n"
    header += "".join(f"{name} = {str(path)!r}\n" for name, path in paths.items())
    subprocess.run([sys.executable, "-c", header + textwrap.dedent(code)], check=True, timeout=300)


def saved(tmp_path: Path, name: str, code: str) -> Path:
    out = tmp_path / name
    in_subprocess(tmp_path, code, OUT=out)
    return out


def run(*args: object) -> tuple[int, str, str]:
    result = CliRunner().invoke(main, [str(a) for a in args])
    return result.exit_code, result.stdout, result.stderr


def scan_json(*args: object) -> tuple[int, dict]:
    code, out, err = run("scan", *args, "--json")
    assert code in (0, 1), err
    return code, json.loads(out)


def assert_stand_ins_not_imported() -> None:
    assert not any(name.split(".")[0] in ("omegaconf", "lightning", "mylib") for name in sys.modules)


FRAMEWORK_GLOBALS = {
    "lightning.fabric.utilities.data.AttributeDict", "omegaconf.dictconfig.DictConfig",
    "omegaconf.listconfig.ListConfig", "omegaconf.base.ContainerMetadata", "omegaconf.base.Metadata",
    "omegaconf.nodes.FloatNode", "typing.Any", "pathlib.PosixPath", "pathlib.PureWindowsPath",
    "collections.defaultdict", "builtins.list", "builtins.int", "collections.deque", "argparse.Namespace",
    "datetime.datetime", "datetime.timezone", "datetime.timedelta", "datetime.date", "datetime.time",
    "decimal.Decimal", "uuid.UUID",
}


# ------------------------------------------------------------------------------------------------ data-only globals


def test_a_framework_checkpoint_is_read_with_no_flag_and_its_globals_are_listed(tmp_path: Path) -> None:
    path = saved(tmp_path, "epoch=0-step=4.ckpt", FRAMEWORK)
    code, out, err = run("inspect", path, "--json")
    assert code == 0, err
    listed = {ckptool.pickles.python3_name(name) for name in json.loads(out)["globals"]}  # __builtin__.long: int
    assert listed >= FRAMEWORK_GLOBALS
    assert len(ckptool.load(path).tensors) == 1
    code, out, err = run("convert", path, "-o", tmp_path / "weights.safetensors")
    assert code == 0, err
    code, report = scan_json(path)
    assert code == 0 and report["verdict"] == "safe" and report["safe"] is True and report["unsafe"] == []
    assert set(report["verdicts"].values()) == {"allowed"}
    assert_stand_ins_not_imported()


def test_a_pt_rewrite_of_a_framework_checkpoint_loads_in_torch_equal(tmp_path: Path) -> None:
    path = saved(tmp_path, "last.ckpt", FRAMEWORK)
    out = tmp_path / "remapped.ckpt"
    code, _, err = run("remap", path, "--to", "cpu", "-o", out)
    assert code == 0, err
    in_subprocess(tmp_path, SAME + """
        a = torch.load(A, weights_only=False)
        b = torch.load(B, weights_only=False)
        assert list(a) == list(b), (list(a), list(b))
        for key in a:
            assert same(a[key], b[key]), key
        assert b["loops"]["new"] == [] and b["counts"]["new"] == 0  # the factories survived as classes
        """, A=path, B=out)
    assert_stand_ins_not_imported()


# ------------------------------------------------------------------------------------------------ three verdicts


def test_unknown_globals_are_unknown_not_dangerous_and_allow_global_moves_them(tmp_path: Path) -> None:
    path = saved(tmp_path, "config.pt", """
        import mylib.config
        torch.save({"w": torch.ones(2), "config": mylib.config.Config(3), "dir": __import__("pathlib").Path("/x")}, OUT)
        """)
    code, report = scan_json(path)
    assert code == 1 and report["verdict"] == "unknown" and report["dangerous"] == []
    verdicts = report["verdicts"]
    assert verdicts["mylib.config.Config"] == "unknown" and verdicts["pathlib.PosixPath"] == "allowed"
    assert report["unsafe"] == ["mylib.config.Config"] and report["safe"] is False
    code, out, _ = run("scan", path)
    assert code == 1 and ": UNKNOWN (" in out.splitlines()[0] and "! mylib.config.Config" in out
    assert "1 unknown global(s)" in out and "only with --allow-global" in out and "dangerous" not in out
    for allowed in ("mylib.config.Config", "mylib.*"):
        code, report = scan_json(path, "--allow-global", allowed)
        assert code == 0 and report["verdict"] == "safe" and report["verdicts"]["mylib.config.Config"] == "allowed"
    assert_stand_ins_not_imported()


def code_running_file(tmp_path: Path) -> tuple[Path, Path]:
    """A checkpoint whose config is ``os.system('touch CANARY')``, beside an unknown global."""
    canary = tmp_path / "canary"
    body = hostile.dct((hostile.text("weight"), hostile.rebuild()),
                       (hostile.text("config"), hostile.call(hostile.glob("mylib.config", "Config"))),
                       (hostile.text("run"), hostile.call(hostile.glob("os", "system"),
                                                          hostile.text(f"touch {canary}"))))
    path = tmp_path / "payload.pt"
    path.write_bytes(hostile.make_zip(hostile.torch_members(hostile.whole(body), {"0": hostile.FOUR_FLOATS})))
    return path, canary


@pytest.mark.parametrize("allowed", [[], ["mylib.*"], ["*"], ["os.*"], ["os.system", "mylib.*"]])
def test_a_code_running_global_is_dangerous_whatever_the_flags(tmp_path: Path, allowed: list[str]) -> None:
    """An exact name reads it as inert data (never a pattern), but torch.load would still call it: scan says so."""
    path, canary = code_running_file(tmp_path)
    flags = [word for name in allowed for word in ("--allow-global", name)]
    code, report = scan_json(path, *flags)
    assert code == 1 and report["verdict"] == "dangerous" and report["dangerous"] == ["os.system"]
    assert report["verdicts"]["os.system"] == "dangerous" and "os.system" in report["unsafe"]
    assert report["verdicts"]["mylib.config.Config"] == ("unknown" if allowed in ([], ["os.*"]) else "allowed")
    code, out, _ = run("scan", path, *flags)
    assert code == 1 and ": DANGEROUS (" in out.splitlines()[0] and "!!os.system" in out
    assert "do not torch.load this file" in out
    readable = "os.system" in allowed
    assert ("ckptool refuses to load this file" in out) is not readable
    assert run("inspect", path, *flags)[0] == (0 if readable else 3)
    assert not canary.exists()


def test_a_whole_module_pickle_is_unknown(tmp_path: Path) -> None:
    path = saved(tmp_path, "model.pt", "torch.save(torch.nn.Sequential(torch.nn.Linear(2, 2)), OUT)")
    code, report = scan_json(path)
    assert code == 1 and report["verdict"] == "unknown" and report["dangerous"] == []
    assert report["verdicts"]["torch.nn.modules.linear.Linear"] == "unknown"


def test_a_torchscript_archive_is_unknown_and_scan_says_ckptool_reads_it(tmp_path: Path) -> None:
    path = saved(tmp_path, "scripted.pt", "torch.jit.save(torch.jit.script(torch.nn.Linear(2, 2)), OUT)")
    code, report = scan_json(path)
    assert code == 1 and report["verdict"] == "unknown" and report["readable"] is True
    assert report["format"] == "torchscript" and report["dangerous"] == []
    assert any(name.startswith("__torch__.") and verdict == "unknown" for name, verdict in report["verdicts"].items())
    code, out, _ = run("scan", path)
    assert code == 1 and "refuses" not in out and "ckptool reads the file with them as inert placeholders" in out


def test_every_payload_of_the_hostile_corpus_is_dangerous_or_refused(tmp_path: Path) -> None:
    """A case whose payload would run code never gets a milder verdict than dangerous."""
    checked = 0
    for case in hostile.build_corpus(tmp_path / "corpus"):
        if case.canary is None:
            continue
        try:
            report = ckptool.scan(case.path)
        except ckptool.CkptError:
            continue
        checked += 1
        assert report.verdict == "dangerous" and report.dangerous, (case.name, report.unsafe)
    assert checked >= 50


PICKLESCAN = Path("/work/shared/corpus/picklescan/tests")
PICKLESCAN_BENIGN = {"pytorch_model.bin", "new_pytorch_model.bin"}
PICKLESCAN_PLAIN_DATA = {  # benign pickles, arrays and archives of arrays (test_hostile.py's list)
    "benign0_v0.pkl", "benign0_v3.pkl", "benign0_v4.pkl", "int_array.npy", "object_array.npy",
    "int_arrays.npz", "int_arrays_compressed.npz", "object_arrays.npz", "object_arrays_compressed.npz",
}


@pytest.mark.skipif(not PICKLESCAN.is_dir(), reason=f"public corpus not found at {PICKLESCAN}")
def test_every_malicious_file_of_the_public_corpus_is_dangerous_or_refused() -> None:
    files = sorted(p for folder in ("data", "data2") for p in (PICKLESCAN / folder).glob("*") if p.is_file())
    judged = []
    for path in files:
        try:
            report = ckptool.scan(path)
        except ckptool.CkptError:
            continue
        if path.name in PICKLESCAN_BENIGN:
            assert report.verdict == "safe", path.name
            continue
        if path.name in PICKLESCAN_PLAIN_DATA:  # data, no checkpoint: judged as a tree scan judges it
            assert report.verdict == "safe" and "checkpoint ckptool loads" in report.problems[0], path.name
            continue
        judged.append(path.name)
        assert report.verdict == "dangerous", (path.name, report.unsafe)
    assert len(judged) >= 80


def test_the_committed_lightning_fixture_reads_with_no_flag_and_scans_safe(fixtures_dir: Path) -> None:
    """A checkpoint saved by a Lightning-style run with omegaconf hyper-parameters (fixtures/README.md)."""
    path = fixtures_dir / "wild" / "lightning_omegaconf.ckpt"
    code, out, err = run("inspect", path, "--json")
    assert code == 0, err
    assert {"omegaconf.dictconfig.DictConfig", "typing.Any"} <= set(json.loads(out)["globals"])
    code, report = scan_json(path)
    assert code == 0 and report["verdict"] == "safe"
    assert_stand_ins_not_imported()
