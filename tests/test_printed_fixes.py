"""Every fix ``inspect`` prints as a ckptool command runs when pasted.

For each checkpoint — the committed fixtures and a few made here that inspect has something to say about
(no names for the tensors, globals torch.load refuses, tensors saved on a GPU) — ``inspect`` runs on a copy,
and each ``fix: ckptool ...`` line it prints is run as a shell would split it, from another folder: it must
succeed, and write only beside the copy.
"""

from __future__ import annotations

import argparse
import pathlib
import shlex
import shutil
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from click.testing import CliRunner  # noqa: E402

from ckptool.cli.main import main  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
FIXTURES = REPO / "fixtures"
COMMITTED = sorted(path.name for path in FIXTURES.iterdir()
                   if path.suffix in (".pt", ".ckpt", ".safetensors") or path.name == "sharded")
MADE = {
    # weights in a list, beside a global torch.load refuses: no names, so nothing convert could write
    "nameless_with_args.pt": lambda: {"args": argparse.Namespace(lr=0.1), "weights": [torch.ones(2), torch.zeros(3)]},
    "nameless_list.pt": lambda: [torch.ones(2), torch.zeros(3)],
    # named weights beside a global torch.load refuses: convert keeps the weights
    "named_with_path.pt": lambda: {"p": pathlib.PurePosixPath("/runs/1"), "w": torch.ones(2)},
    "prefixed_with_args.pt": lambda: {"args": argparse.Namespace(lr=0.1),
                                      "state_dict": {"module.w": torch.ones(2), "module.b": torch.zeros(2)}},
}


def cli(*args: object) -> tuple[int, str, str]:
    result = CliRunner().invoke(main, [str(a) for a in args])
    return result.exit_code, result.stdout, result.stderr


def printed_fixes(path: Path) -> list[str]:
    code, out, err = cli("inspect", path)
    assert code == 0, err
    return [line.split("fix: ", 1)[1] for line in out.splitlines() if line.strip().startswith("fix: ckptool ")]


def run_each(fixes: list[str], folder: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    elsewhere = folder.parent / "elsewhere"
    elsewhere.mkdir(exist_ok=True)
    monkeypatch.chdir(elsewhere)  # suggestions name absolute paths: they run from any folder
    for fix in fixes:
        for command in fix.split(" && "):
            words = shlex.split(command)
            assert words[0] == "ckptool"
            before = set(folder.iterdir())
            code, _, err = cli(*words[1:])
            assert code == 0, f"printed fix failed: {command}\n{err}"
            assert set(folder.iterdir()) > before or "--in-place" in words, command  # it wrote beside the input
    assert not list(elsewhere.iterdir())


@pytest.mark.parametrize("name", COMMITTED)
def test_the_fixes_printed_for_a_fixture_run(name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    folder = tmp_path / "copy"
    folder.mkdir()
    source = FIXTURES / name
    copy = folder / name
    if source.is_dir():
        shutil.copytree(source, copy)
    else:
        shutil.copy(source, copy)
    run_each(printed_fixes(copy), folder, monkeypatch)


@pytest.mark.parametrize("name", sorted(MADE))
def test_the_fixes_printed_for_a_made_checkpoint_run(name: str, tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    folder = tmp_path / "copy"
    folder.mkdir()
    path = folder / name
    torch.save(MADE[name](), path)
    fixes = printed_fixes(path)
    if name.startswith("nameless"):  # nothing a ckptool command can fix; inspect says what is there
        assert not any(" convert " in fix for fix in fixes), fixes
    else:
        assert fixes, "a fix was expected"
    run_each(fixes, folder, monkeypatch)
