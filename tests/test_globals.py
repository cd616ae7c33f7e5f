"""Pickle globals outside the allowlist: one refusal names them all, ``--allow-global`` takes shell
patterns (``'*'`` reads every global as an inert record), and the fixes ckptool prints carry the
caller's flags and run from any folder.

Files with foreign globals are real ``torch.save`` output: stand-in classes (a fake ``omegaconf``)
are written to a module folder under ``tmp_path`` and saved in a subprocess, so this process never
imports them — and must not, whatever a command reads.
"""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from click.testing import CliRunner

import ckptool
from ckptool.cli.main import main
from ckptool.ops.load_into import to_state_dict

torch = pytest.importorskip("torch")
hostile = pytest.importorskip("hostile")
from standins import OMEGACONF  # noqa: E402 — after the importorskip guards

# What Lightning's omegaconf hyper-parameters pickle, in miniature (module -> source).
STAND_INS = {
    **OMEGACONF,
}

# A Lightning-style checkpoint naming 14 globals torch's weights_only set does not hold.
LIGHTNING = """
    import collections, pathlib, typing
    from omegaconf.dictconfig import DictConfig
    from omegaconf.listconfig import ListConfig
    from omegaconf.base import ContainerMetadata, Metadata
    from omegaconf.nodes import AnyNode, StringNode, IntegerNode, FloatNode, BooleanNode
    loops = collections.defaultdict(list)
    loops["fit"].append(1)
    hparams = DictConfig({"lr": FloatNode(0.1), "name": StringNode("x"), "layers": IntegerNode(3),
                          "bias": BooleanNode(True), "extra": AnyNode(None), "sizes": ListConfig([1])},
                         ContainerMetadata(ref_type=typing.Any, key_type=dict, element_type=list,
                                           meta=Metadata(flags=1)))
    torch.save({"state_dict": {"w": torch.ones(2)}, "hyper_parameters": hparams, "loops": loops,
                "log_dir": pathlib.PosixPath("/runs/x")}, OUT)
    """
LIGHTNING_GLOBALS = [  # in the order the pickle first names them
    "omegaconf.dictconfig.DictConfig", "omegaconf.nodes.FloatNode", "omegaconf.nodes.StringNode",
    "omegaconf.nodes.IntegerNode", "omegaconf.nodes.BooleanNode", "omegaconf.nodes.AnyNode",
    "omegaconf.listconfig.ListConfig", "omegaconf.base.ContainerMetadata", "typing.Any", "builtins.dict",
    "builtins.list", "omegaconf.base.Metadata", "collections.defaultdict", "pathlib.PosixPath",
]


@pytest.fixture(autouse=True)
def numpy_and_namespace_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """These tests use Lightning's globals as the foreign ones a refusal names; ckptool reads them by
    default (tests/test_verdicts.py), so here the default allowlist is what it was before it did."""
    from ckptool.pickles import allowlist

    monkeypatch.setattr(allowlist, "DEFAULT_EXTRA_GLOBALS",
                        tuple(name for name in allowlist.DEFAULT_EXTRA_GLOBALS
                              if name == "argparse.Namespace" or name.startswith("numpy.")))


def foreign_save(tmp_path: Path, name: str, code: str) -> Path:
    """Run ``code`` (with ``torch`` and ``OUT`` defined) in a subprocess that can import the stand-ins."""
    modules = tmp_path / "stand_ins"
    for relative, source in STAND_INS.items():
        (modules / relative).parent.mkdir(parents=True, exist_ok=True)
        (modules / relative).write_text(textwrap.dedent(source))
    out = tmp_path / name
    script = f"import sys, torch\nsys.path.insert(0, {str(modules)!r})\nOUT = {str(out)!r}\n" + textwrap.dedent(code)
    subprocess.run([sys.executable, "-c", script], check=True, timeout=300)
    return out


def run(*args: object) -> tuple[int, str, str]:
    result = CliRunner().invoke(main, [str(a) for a in args])
    return result.exit_code, result.stdout, result.stderr


def one_line_refusal(code: int, err: str) -> str:
    """The one stderr line of a refusal (exit 3, no traceback)."""
    assert code == 3 and err.count("\n") == 1 and "Traceback" not in err, (code, err)
    return err


def flags_after(line: str, marker: str, end: str) -> list[str]:
    """The command-line words a message prints between ``marker`` and ``end``."""
    fragment = line.split(marker, 1)[1]
    return shlex.split(fragment[: fragment.index(end)] if end in fragment else fragment.rstrip(")\n"))


def assert_stand_ins_not_imported() -> None:
    assert not any(name == "omegaconf" or name.startswith("omegaconf.") for name in sys.modules)


# ------------------------------------------------------------------------------------------------ one refusal


def test_one_refusal_names_every_global_and_its_flags_make_the_next_run_read_the_file(tmp_path: Path) -> None:
    lightning = foreign_save(tmp_path, "lightning.ckpt", LIGHTNING)
    line = one_line_refusal(*run("inspect", lightning)[::2])
    shown = ", ".join(LIGHTNING_GLOBALS[:10]) + " and 4 more"
    assert f"pickle imports 14 globals outside the allowlist: {shown}, any of which could run code" in line, line
    assert "--allow-global '*'" in line
    flags = flags_after(line, "allow them: ", ", or read every global")
    assert flags == ["--allow-global", "omegaconf.*", "--allow-global", "typing.Any", "--allow-global", "builtins.*",
                     "--allow-global", "collections.defaultdict", "--allow-global", "pathlib.PosixPath"]
    code, out, err = run("inspect", lightning, "--json", *flags)  # pasted as printed
    assert code == 0, err
    assert {name.replace("__builtin__.", "builtins.") for name in json.loads(out)["globals"]} >= set(LIGHTNING_GLOBALS)
    code, _, err = run("scan", lightning, *flags)
    assert code == 0, err
    assert_stand_ins_not_imported()


def test_a_global_named_only_inside_a_refused_call_is_in_the_same_refusal(tmp_path: Path) -> None:
    """``defaultdict(list)`` names ``builtins.list`` as its argument: one run finds both."""
    path = foreign_save(tmp_path, "loops.pt", """
        import collections
        loops = collections.defaultdict(list)
        loops["fit"].append(1)
        torch.save({"w": torch.ones(2), "loops": loops}, OUT)
        """)
    line = one_line_refusal(*run("strip", path, "-o", tmp_path / "out.pt", "--prefix", "x.")[::2])
    assert "pickle imports 2 globals outside the allowlist: collections.defaultdict, builtins.list, any of which" in line
    flags = flags_after(line, "allow them: ", ")")
    assert flags == ["--allow-global", "collections.defaultdict", "--allow-global", "builtins.list"]
    code, out, err = run("inspect", path, *flags)
    assert code == 0 and "collections.defaultdict" in out, err
    with pytest.raises(ckptool.UnsafeCheckpointError) as refused:
        ckptool.load(path)
    assert refused.value.globals == ["collections.defaultdict", "builtins.list"]
    assert "allow them: allow_globals=['collections.defaultdict', 'builtins.list'])" in str(refused.value)
    assert not (tmp_path / "out.pt").exists()


# ------------------------------------------------------------------------------------------------ patterns


@pytest.mark.parametrize(("allowed", "still_refused"), [
    (["omegaconf.*", "typing.*", "builtins.*", "collections.*", "pathlib.*Path"], []),
    (["omegaconf.*", "typing.Any", "builtins.[dl]i[cs]t", "collections.default?ict", "pathlib.Posix*"], []),
    (["omegaconf.nodes.*", "*Config", "typing.Any", "builtins.*", "collections.*", "pathlib.*"],
     ["omegaconf.base.ContainerMetadata", "omegaconf.base.Metadata"]),
    (["*"], []),
])
def test_patterns_allow_what_they_match_on_the_whole_dotted_name(tmp_path: Path, allowed: list[str],
                                                                  still_refused: list[str]) -> None:
    lightning = foreign_save(tmp_path, "lightning.ckpt", LIGHTNING)
    if still_refused:
        with pytest.raises(ckptool.UnsafeCheckpointError) as refused:
            ckptool.load(lightning, allow_globals=allowed)
        assert refused.value.globals == still_refused
        code, _, err = run("inspect", lightning, *(word for name in allowed for word in ("--allow-global", name)))
        one_line_refusal(code, err)
    else:
        checkpoint = ckptool.load(lightning, allow_globals=allowed)
        assert checkpoint.allow_globals == tuple(allowed) and list(checkpoint.tensors) == ["w"]
        assert ckptool.scan(lightning, allow_globals=tuple(allowed)).safe
        code, out, err = run("inspect", lightning, *(word for name in allowed for word in ("--allow-global", name)))
        assert code == 0 and "hyper_parameters: omegaconf.dictconfig.DictConfig object" in out, err
    assert_stand_ins_not_imported()


def test_star_reads_every_global_inert_in_every_reading_command(tmp_path: Path) -> None:
    lightning = foreign_save(tmp_path, "lightning.ckpt", LIGHTNING)
    other = foreign_save(tmp_path, "other.ckpt", LIGHTNING)
    for argv in (["inspect", lightning], ["scan", lightning], ["diff", lightning, other],
                 ["convert", lightning, "-o", tmp_path / "weights.safetensors"]):
        code, out, err = run(*argv, "--allow-global", "*")
        assert code == 0, (argv, err)
        refused = 1 if argv[0] == "scan" else 3  # the others are still refused
        assert run(*argv, "--allow-global", "omegaconf.*")[0] == refused, argv
    assert torch.equal(to_state_dict(ckptool.load(tmp_path / "weights.safetensors").tensors)["w"], torch.ones(2))
    assert_stand_ins_not_imported()


def test_torch_globals_keep_their_checking_rebuilds_under_star(tmp_path: Path) -> None:
    """A pattern never replaces a torch global: a tensor rebuild with a bad offset is still refused by
    its check, beside a foreign global that ``'*'`` accepts."""
    def file(offset: int) -> Path:
        body = hostile.dct((hostile.text("weight"), hostile.rebuild(offset=offset)),
                           (hostile.text("config"), hostile.call(hostile.glob("mylib.config", "Config"))))
        path = tmp_path / f"offset{offset}.pt"
        path.write_bytes(hostile.make_zip(hostile.torch_members(hostile.whole(body), {"0": hostile.FOUR_FLOATS})))
        return path

    assert ckptool.load(file(0), allow_globals=["*"]).globals["mylib.config.Config"] == 1
    code, _, err = run("inspect", file(100), "--allow-global", "*")
    line = one_line_refusal(code, err)
    assert "mylib" not in line and "offset" in line, line
    for pattern in ("*", "torch.*", "torch._utils.*"):
        with pytest.raises(ckptool.InputError, match="offset"):
            ckptool.load(file(100), allow_globals=[pattern])


# ------------------------------------------------------------------------------------------------ code-running globals


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


@pytest.mark.parametrize("allowed", [[], ["*"], ["os.*"], ["mylib.*", "*.system"]])
def test_a_refusal_naming_a_code_running_global_suggests_no_flag(tmp_path: Path, allowed: list[str]) -> None:
    """No pattern allows a global known to run code, and the refusal says not to trust the file
    instead of printing the flag that would read it."""
    path, canary = code_running_file(tmp_path)
    code, _, err = run("inspect", path, *(word for name in allowed for word in ("--allow-global", name)))
    line = one_line_refusal(code, err)
    assert "os.system" in line and "runs code" in line and "should not be trusted" in line, line
    assert "--allow-global" not in line, line
    with pytest.raises(ckptool.UnsafeCheckpointError) as refused:
        ckptool.load(path, allow_globals=allowed)
    assert "os.system" in refused.value.globals and "allow_globals" not in str(refused.value)
    code, out, _ = run("scan", path, "--json", *(word for name in allowed for word in ("--allow-global", name)))
    report = json.loads(out)
    assert code == 1 and report["dangerous"] == ["os.system"] and "os.system" in report["unsafe"]
    assert "!!os.system" in run("scan", path)[1]
    assert not canary.exists()


def test_an_exact_name_still_reads_a_code_running_global_as_inert_data(tmp_path: Path) -> None:
    path, canary = code_running_file(tmp_path)
    checkpoint = ckptool.load(path, allow_globals=["os.system", "mylib.*"])
    assert checkpoint.globals["os.system"] == 1 and not canary.exists()


PICKLESCAN = Path("/work/shared/corpus/picklescan/tests")  # the public corpus test_hostile.py reads too
PICKLESCAN_BENIGN = {"pytorch_model.bin", "new_pytorch_model.bin"}


def test_star_reads_no_hostile_payload(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every hostile case whose pickle names a code-running global stays refused under ``'*'``, and
    of the public picklescan corpus (where present) ``'*'`` reads only its two benign checkpoints."""
    monkeypatch.chdir(tmp_path)  # where a payload that ran would leave its file
    if PICKLESCAN.is_dir():
        read = []
        for path in sorted(p for p in PICKLESCAN.rglob("*") if p.is_file()):
            try:
                ckptool.load(path, allow_globals=["*"])
            except ckptool.CkptError:
                continue
            read.append(path.name)
        assert set(read) == PICKLESCAN_BENIGN and [p.name for p in tmp_path.iterdir()] == []
    cases = [case for case in hostile.build_corpus(tmp_path / "corpus") if case.expect == hostile.UNSAFE]
    checked = 0
    for case in cases:
        try:
            report = ckptool.scan(case.path)
        except ckptool.CkptError:
            continue
        if not report.dangerous:
            continue
        checked += 1
        with pytest.raises(ckptool.CkptError):
            ckptool.load(case.path, allow_globals=["*"])
    assert checked >= 20 and not any((tmp_path / "corpus" / "canary").iterdir())


# ------------------------------------------------------------------------------------------------ printed fixes


def test_printed_fixes_carry_the_callers_flags_and_run_from_another_folder(tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """inspect's fixes name the input's full stem, quote odd names, carry ``--allow-global`` as the
    caller passed it, and work pasted into another folder."""
    folder = tmp_path / "my runs"
    folder.mkdir()
    path = foreign_save(folder, "chgnet's_0.3.0.pth.tar", """
        import collections
        from omegaconf.dictconfig import DictConfig
        weights = collections.OrderedDict(w=torch.ones(2), b=torch.zeros(1))
        torch.save({"state_dict": {"module." + key: value for key, value in weights.items()},
                    "hyper_parameters": DictConfig({"lr": 0.1}, None)}, OUT)
        """)
    for where in ("here", "elsewhere"):
        (tmp_path / where).mkdir()
    monkeypatch.chdir(tmp_path / "here")
    code, out, err = run("inspect", Path("..") / "my runs" / path.name, "--allow-global", "omegaconf.*")
    assert code == 0, err
    fixes = [line.split("fix: ", 1)[1] for line in out.splitlines() if line.strip().startswith("fix: ")]
    assert len(fixes) == 2 and all(fix.endswith(" --allow-global 'omegaconf.*'") for fix in fixes), fixes
    monkeypatch.chdir(tmp_path / "elsewhere")
    for fix in fixes:
        argv = shlex.split(fix)
        assert argv[0] == "ckptool"
        code, _, err = run(*argv[1:])
        assert code == 0, (fix, err)
    assert sorted(p.name for p in folder.iterdir() if p.is_file()) == [
        "chgnet's_0.3.0.pth.tar", "chgnet's_0.3.0.safetensors", "chgnet's_0.3.0.stripped.pt"]
    assert not [*(tmp_path / "here").iterdir(), *(tmp_path / "elsewhere").iterdir()]
    stripped = ckptool.load(folder / "chgnet's_0.3.0.stripped.pt", allow_globals=["omegaconf.*"])
    assert list(stripped.tensors) == ["w", "b"]


def test_diff_and_load_fixes_carry_the_callers_flags(tmp_path: Path) -> None:
    a = foreign_save(tmp_path, "a.pt", """
        from omegaconf.dictconfig import DictConfig
        torch.save({"module.w": torch.ones(2), "cfg": DictConfig({}, None)}, OUT)
        """)
    b = foreign_save(tmp_path, "b.pt", """torch.save({"w": torch.ones(2)}, OUT)""")
    note = ckptool.diff(a, b, allow_globals=["omegaconf.*"]).notes[0]
    assert note.endswith(f"ckptool strip {a} -o {tmp_path / 'a.stripped.pt'} --allow-global 'omegaconf.*'"), note
    model = torch.nn.Module()
    model.w = torch.nn.Parameter(torch.zeros(2))
    with pytest.raises(ckptool.CkptError) as mismatch:
        ckptool.load_into(model, a, fix=False, allow_globals=["omegaconf.*"])
    assert f"ckptool strip {a} -o {tmp_path / 'a.stripped.pt'} --allow-global 'omegaconf.*'" in str(mismatch.value)


def test_an_entry_with_pattern_characters_also_allows_the_global_it_spells(tmp_path: Path) -> None:
    """A global may itself be named with ``[`` or ``?``: the entry that spells it allows it."""
    body = hostile.dct((hostile.text("weight"), hostile.rebuild()),
                       (hostile.text("config"), hostile.call(hostile.glob("mylib", "Config[v2]"))))
    path = tmp_path / "odd.pt"
    path.write_bytes(hostile.make_zip(hostile.torch_members(hostile.whole(body), {"0": hostile.FOUR_FLOATS})))
    line = one_line_refusal(*run("inspect", path)[::2])
    flags = flags_after(line, "allow it by name: ", ")")
    assert flags == ["--allow-global", "mylib.Config[v2]"]
    code, _, err = run("inspect", path, *flags)
    assert code == 0, err

