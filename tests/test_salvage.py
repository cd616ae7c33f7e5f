"""Weights from whole-model pickles (``torch.save(model)``) and the choice of one set of weights
(``--weights PATH``: an EMA copy, the second module of a container), against real torch.save files.

Every state dict ckptool reads from a pickled module is compared with ``model.state_dict()``
computed by the process that saved it: the same keys in the same order, ``torch.equal`` values.
"""

from __future__ import annotations

import json
import pickle
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from torch import nn

import ckptool
from ckptool.cli.main import main
from ckptool.ops.load_into import to_state_dict


def run(*args: object) -> tuple[int, str, str]:
    result = CliRunner().invoke(main, [str(a) for a in args])
    return result.exit_code, result.stdout, result.stderr


def allowed(path: Path) -> list[str]:
    """The globals a whole-model pickle needs allowed: the ones scan lists as outside the allowlist."""
    return list(ckptool.scan(path).unsafe)


def flags(names: list[str]) -> list[str]:
    return [part for name in names for part in ("--allow-global", name)]


def assert_same_state_dict(got: dict, expected: dict) -> None:
    assert list(got) == list(expected)
    for key, value in expected.items():
        assert type(got[key]) is torch.Tensor, key  # a plain tensor, as state_dict() gives a parameter
        assert got[key].dtype == value.dtype and torch.equal(got[key], value), key


def reference_model() -> nn.Module:
    """Linear without bias (a None parameter), BatchNorm1d (num_batches_tracked), a submodule shared
    by two places, a None submodule, a non-persistent and a persistent buffer."""
    torch.manual_seed(0)
    shared = nn.Linear(3, 3)
    model = nn.Sequential(nn.Linear(4, 3, bias=False), nn.BatchNorm1d(3), shared, nn.ReLU(), shared)
    model.register_module("gap", None)
    model.register_buffer("scratch", torch.ones(2), persistent=False)
    model.register_buffer("steps", torch.tensor([7]))
    model[1].running_mean.add_(0.5)
    model[1].num_batches_tracked.add_(3)
    return model


def test_whole_module_reads_as_its_state_dict(tmp_path: Path) -> None:
    model = reference_model()
    path = tmp_path / "whole.pt"
    torch.save(model, path)
    checkpoint = ckptool.load(path, allow_globals=allowed(path))
    assert checkpoint.layout == () and checkpoint.module_class == "torch.nn.modules.container.Sequential"
    assert_same_state_dict(to_state_dict(checkpoint.tensors), model.state_dict())
    assert "scratch" not in checkpoint.tensors and "4.weight" in checkpoint.tensors
    assert [names for names in ckptool.inspect(path, allow_globals=allowed(path)).tied] == \
        [["2.bias", "4.bias"], ["2.weight", "4.weight"]]


@pytest.mark.parametrize("suffix", [".pt", ".safetensors"])
def test_whole_model_container_converts_to_plain_weights(tmp_path: Path, suffix: str) -> None:
    model, ema = reference_model(), reference_model()
    with torch.no_grad():
        for parameter in ema.parameters():
            parameter.mul_(0.5)
    path = tmp_path / "run.pt"
    torch.save({"model": model, "ema": ema, "epoch": 1}, path)
    names = allowed(path)

    code, out, err = run("inspect", path, "--json", *flags(names))
    assert code == 0, err
    data = json.loads(out)
    assert data["layout"] == ["model"] and data["module_class"] == "torch.nn.modules.container.Sequential"
    assert [(c["weights"], c["kind"], c["tensors"], c["chosen"]) for c in data["candidates"]] == [
        ("model", "whole-model pickle", len(model.state_dict()), True),
        ("ema", "whole-model pickle", len(ema.state_dict()), False)]
    code, out, _ = run("inspect", path, *flags(names))
    assert "weights at     'model' (whole-model pickle: torch.nn.modules.container.Sequential, 11 tensors)" in out

    for weights, expected in ((None, model), ("ema", ema)):
        out_path = tmp_path / f"{weights}{suffix}"
        code, out, err = run("convert", path, "-o", out_path, *flags(names),
                             *(["--weights", weights] if weights else []))
        assert code == 0, err
        if suffix == ".pt":
            assert "plain state dict" in out
            loaded = torch.load(out_path, weights_only=True)  # no class of the model in the output
            assert_same_state_dict(loaded, expected.state_dict())
        else:
            from safetensors.torch import load_file

            loaded = load_file(out_path)
            assert set(loaded) <= set(expected.state_dict())
            assert all(torch.equal(loaded[key], expected.state_dict()[key]) for key in loaded)
            by_key = sorted(expected.state_dict().items())  # safetensors keeps keys sorted
            assert_same_state_dict(dict(sorted(to_state_dict(ckptool.load(out_path).tensors).items())), dict(by_key))
        code, _, err = run("verify", path, "--devices", "cpu", "--against", out_path, *flags(names),
                           *(["--weights", weights] if weights else []))
        assert code == 0, err
        code, _, err = run("diff", path, out_path, *flags(names), *(["--weights", weights] if weights else []))
        assert code == 0, err

    into = reference_model()
    for parameter in into.parameters():
        nn.init.zeros_(parameter)
    ckptool.load_into(into, path, allow_globals=names, weights="ema")
    assert_same_state_dict(into.state_dict(), ema.state_dict())


def test_strip_of_a_data_parallel_model_writes_the_bare_weights(tmp_path: Path) -> None:
    model = reference_model()
    path = tmp_path / "dp.pt"
    torch.save({"model": nn.DataParallel(model), "epoch": 2}, path)
    names = allowed(path)
    checkpoint = ckptool.load(path, allow_globals=names)
    assert checkpoint.prefix == "module." and list(checkpoint.tensors)[:2] == ["module.steps", "module.0.weight"]
    code, out, err = run("strip", path, "-o", tmp_path / "bare.pt", *flags(names))
    assert code == 0, err
    assert_same_state_dict(torch.load(tmp_path / "bare.pt", weights_only=True), model.state_dict())


def test_pickle_without_non_persistent_set_keeps_every_buffer(tmp_path: Path) -> None:
    """A module pickled before torch had non-persistent buffers: torch's __setstate__ fills in an
    empty set, so every buffer is in its state dict."""
    model = reference_model()
    for module in model.modules():
        del module.__dict__["_non_persistent_buffers_set"]
    path = tmp_path / "old.pt"
    torch.save(model, path)
    expected = torch.load(path, weights_only=False).state_dict()
    assert "scratch" in expected
    checkpoint = ckptool.load(path, allow_globals=allowed(path))
    assert_same_state_dict(to_state_dict(checkpoint.tensors), expected)


def test_module_that_contains_itself_is_refused(tmp_path: Path) -> None:
    model = nn.Sequential(nn.Linear(2, 2))
    model._modules["again"] = model
    path = tmp_path / "cycle.pt"
    torch.save(model, path)
    code, out, err = run("convert", path, "-o", tmp_path / "out.pt", *flags(allowed(path)))
    assert code == 3 and out == ""
    assert err.count("\n") == 1 and "contains itself" in err and str(path) in err
    assert not (tmp_path / "out.pt").exists()


CUSTOM_MODULE = '''
import pathlib
import torch
from torch import nn

CANARY = pathlib.Path({canary!r})


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(1, 2, 3)
        self.head = nn.Linear(2, 2)
        self.register_buffer("anchors", torch.arange(4.0))
        self.register_buffer("cache", torch.zeros(3), persistent=False)

    def __setstate__(self, state):
        CANARY.write_text("the checkpoint's code ran")
        super().__setstate__(state)
'''

SAVE = '''
import sys
import torch
sys.path.insert(0, sys.argv[1])
from netmod import Net
torch.manual_seed(1)
model, ema = Net(), Net()
torch.save({{"model": model, "ema": ema, "optimizer": None, "train_args": {{"epochs": 3}}}}, {ckpt!r})
torch.save(model.state_dict(), {model_sd!r})
torch.save(ema.state_dict(), {ema_sd!r})
'''


def test_custom_module_class_is_never_imported_or_run(tmp_path: Path) -> None:
    """The model's class lives in a folder only the saving process knew; its __setstate__ would
    leave a canary file. ckptool reads, converts, diffs and verifies without it ever running."""
    code_dir, canary = tmp_path / "code", tmp_path / "canary.txt"
    code_dir.mkdir()
    (code_dir / "netmod.py").write_text(CUSTOM_MODULE.format(canary=str(canary)))
    ckpt, model_sd, ema_sd = tmp_path / "yolo.pt", tmp_path / "model_sd.pt", tmp_path / "ema_sd.pt"
    script = SAVE.format(ckpt=str(ckpt), model_sd=str(model_sd), ema_sd=str(ema_sd))
    subprocess.run([sys.executable, "-c", textwrap.dedent(script), str(code_dir)], check=True, timeout=300)
    assert not canary.exists()
    names = allowed(ckpt)
    assert "netmod.Net" in names

    code, out, err = run("inspect", ckpt, *flags(names))
    assert code == 0, err
    assert "weights at     'model' (whole-model pickle: netmod.Net, 5 tensors)" in out
    assert "entry          ema: whole-model pickle netmod.Net, 5 tensors" in out
    for weights, expected_path in (("model", model_sd), ("ema", ema_sd)):
        expected = torch.load(expected_path, weights_only=True)
        checkpoint = ckptool.load(ckpt, allow_globals=names, weights=weights)
        assert_same_state_dict(to_state_dict(checkpoint.tensors), expected)
        out_path = tmp_path / f"{weights}.safetensors"
        code, _, err = run("convert", ckpt, "-o", out_path, "--weights", weights, *flags(names))
        assert code == 0, err
        code, _, err = run("diff", out_path, expected_path)
        assert code == 0, err
        code, _, err = run("verify", ckpt, "--weights", weights, "--devices", "cpu", *flags(names))
        assert code == 0, err
    assert "netmod" not in sys.modules
    assert not canary.exists()


def ema_checkpoint(tmp_path: Path) -> tuple[Path, dict, dict]:
    torch.manual_seed(2)
    live = {"fc.weight": torch.randn(3, 2), "fc.bias": torch.randn(3)}
    ema = {key: value * 0.9 for key, value in live.items()}
    path = tmp_path / "timm.pt"
    torch.save({"state_dict": live, "state_dict_ema": ema, "epoch": 7, "arch": "toy"}, path)
    return path, live, ema


def test_inspect_lists_every_set_of_weights(tmp_path: Path) -> None:
    path, _, _ = ema_checkpoint(tmp_path)
    code, out, _ = run("inspect", path, "--json")
    assert code == 0
    candidates = json.loads(out)["candidates"]
    assert [(c["weights"], c["layout"], c["chosen"], c["tensors"]) for c in candidates] == [
        ("state_dict", ["state_dict"], True, 2), ("state_dict_ema", ["state_dict_ema"], False, 2)]
    code, out, _ = run("inspect", path, "--weights", "state_dict_ema")
    assert code == 0
    assert "weights set    state_dict_ema  (state dict, 2 tensors)  (chosen)" in out
    assert "--weights state_dict" in out


def test_weights_option_converts_the_ema(tmp_path: Path) -> None:
    path, live, ema = ema_checkpoint(tmp_path)
    code, _, err = run("convert", path, "-o", tmp_path / "ema.safetensors", "--weights", "state_dict_ema")
    assert code == 0, err
    from safetensors.torch import load_file

    got = load_file(tmp_path / "ema.safetensors")
    assert set(got) == set(ema) and all(torch.equal(got[key], ema[key]) for key in ema)


def test_rewrite_of_chosen_weights_changes_only_that_subtree(tmp_path: Path) -> None:
    path, live, ema = ema_checkpoint(tmp_path)
    code, _, err = run("add-prefix", path, "-o", tmp_path / "out.pt", "--weights", "state_dict_ema")
    assert code == 0, err
    written = torch.load(tmp_path / "out.pt", weights_only=True)
    assert list(written) == ["state_dict", "state_dict_ema", "epoch", "arch"]
    assert list(written["state_dict"]) == list(live)  # the live weights untouched
    assert list(written["state_dict_ema"]) == [f"module.{key}" for key in ema]
    assert all(torch.equal(written["state_dict_ema"][f"module.{key}"], ema[key]) for key in ema)


def test_bad_weights_path_is_one_line_naming_the_candidates(tmp_path: Path) -> None:
    path, _, _ = ema_checkpoint(tmp_path)
    for command in (["inspect", path], ["convert", path, "-o", tmp_path / "x.safetensors"],
                    ["strip", path, "-o", tmp_path / "x.pt"], ["diff", path, path], ["verify", path]):
        code, out, err = run(*command, "--weights", "state_dict_emma")
        assert code == 3 and out == "", command
        assert err.count("\n") == 1
        assert str(path) in err and "'state_dict_emma'" in err and "'state_dict', 'state_dict_ema'" in err
        assert "--weights PATH" in err
    assert not (tmp_path / "x.pt").exists() and not (tmp_path / "x.safetensors").exists()
    with pytest.raises(ckptool.InputError, match="pass one of them as weights$"):
        ckptool.load(path, weights="epoch")


def test_weights_paths_with_dots_and_slashes(tmp_path: Path) -> None:
    from ckptool.model.checkpoint import resolve_weights, spell_weights

    tensor = torch.ones(1)
    path = tmp_path / "nested.pt"
    torch.save({"model.ema": {"a": tensor}, "model": {"ema": {"b": tensor}, "live": {"c": tensor}},
                "runs": [{"d": tensor}]}, path)
    container = ckptool.load(path).container
    assert resolve_weights(container, "model.ema") == ("model.ema",)
    assert resolve_weights(container, "model/ema") == ("model", "ema")
    assert resolve_weights(container, "model.live") == ("model", "live")
    assert resolve_weights(container, "runs.0") == ("runs", 0)
    assert resolve_weights(container, "") == ()
    assert spell_weights(container, ("model", "ema")) == "model/ema"
    assert spell_weights(container, ("model", "live")) == "model.live"
    assert list(ckptool.load(path, weights="model/ema").tensors) == ["b"]
    assert list(ckptool.load(path, weights=("runs", 0)).tensors) == ["d"]


def test_rewrites_of_a_whole_model_write_its_weights_alone(tmp_path: Path) -> None:
    """strip, add-prefix and convert of a whole-model pickle write the plain state dict (.pt) or the
    weights (.safetensors), so the container's other entries do not block a safetensors name; remap
    changes device tags only and writes the model itself back."""
    model = reference_model()
    path = tmp_path / "run.pt"
    torch.save({"model": model, "epoch": 4}, path)
    names = flags(allowed(path))
    code, _, err = run("convert", path, "-o", tmp_path / "plain.pt", *names)
    assert code == 0, err
    assert_same_state_dict(torch.load(tmp_path / "plain.pt", weights_only=True), model.state_dict())
    code, out, err = run("remap", path, "-o", tmp_path / "cpu.pt", "--to", "cpu", *names)
    assert code == 0, err
    assert "rewrote the pickled model itself" in out
    with pytest.raises(pickle.UnpicklingError):  # the model's classes went along: weights_only refuses them
        torch.load(tmp_path / "cpu.pt", weights_only=True)
    remapped = torch.load(tmp_path / "cpu.pt", weights_only=False)  # this test's own torch classes only
    assert remapped["epoch"] == 4
    assert_same_state_dict(remapped["model"].state_dict(), model.state_dict())
    code, _, err = run("add-prefix", path, "-o", tmp_path / "ddp.safetensors", *names)
    assert code == 0, err
    from safetensors.torch import load_file

    assert set(load_file(tmp_path / "ddp.safetensors")) == {f"module.{key}" for key in model.state_dict()} - \
        {"module.4.weight", "module.4.bias"}  # tied to 2.*: stored once, recorded as aliases


def test_shared_submodules_listing_too_many_paths_are_refused(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """One submodule shared twice at each of 12 levels lists 4096 paths (torch walks them all too):
    the walk stops at the limit and says so, in one line."""
    from ckptool.model import modules

    node: nn.Module = nn.Linear(1, 1)
    for _ in range(12):
        node = nn.Sequential(node, node)
    path = tmp_path / "wide.pt"
    torch.save(node, path)
    monkeypatch.setattr(modules, "MAX_MODULE_VISITS", 1000)
    code, out, err = run("inspect", path, *flags(allowed(path)))
    assert code == 3 and out == "" and err.count("\n") == 1
    assert "over 1,000 submodules" in err and str(path) in err
    monkeypatch.setattr(modules, "MAX_MODULE_VISITS", 100_000)
    checkpoint = ckptool.load(path, allow_globals=allowed(path))
    assert len(checkpoint.tensors) == 2 * 4096 == len(node.state_dict())
