"""models.py: model SPECs, the family registry and its entry points; ckptool never imports training."""

from __future__ import annotations

import ast
import importlib
import sys
import tomllib
from pathlib import Path

import pytest
import torch
from torch import nn

from ckptool.verification import models
from ckptool.base.errors import UsageError
from ckptool.verification.models import ENTRY_POINT_GROUP, parse_model_spec, register, registered_family

CKPTOOL = Path(__file__).resolve().parent.parent / "ckptool"


@pytest.fixture
def registry(monkeypatch: pytest.MonkeyPatch) -> dict:
    """The registry as it is now, restored after the test (families it registers go away)."""
    families = dict(models._FAMILIES)
    monkeypatch.setattr(models, "_FAMILIES", families)
    return families


def imports_of_training(path: Path) -> list[str]:
    """Every ``import training...`` / ``from training...`` / ``import_module("training...")`` in a file."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            function = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            if function in ("import_module", "__import__") and isinstance(node.args[0].value, str):
                names = [node.args[0].value]
        found += [f"{path.name}:{node.lineno} {name}" for name in names if name.split(".")[0] == "training"]
    return found


def test_ckptool_never_imports_training() -> None:
    """The training runs register their models with ckptool, never the other way round."""
    found = [hit for path in sorted(CKPTOOL.rglob("*.py")) for hit in imports_of_training(path)]
    assert found == []


def test_training_models_come_through_the_registry() -> None:
    import training.models  # registers itself on import, as its entry point does when installed

    spec = parse_model_spec("training:lenet")
    assert (spec.family, spec.name, spec.default_input_shape) == ("training", "lenet", (1, 1, 28, 28))
    family = registered_family("training")
    assert family is not None and list(family.builders) == ["lenet", "mlp", "resnet18"]
    images, labels = family.test_set(7)
    assert images.shape == (7, 1, 28, 28) and labels.shape == (7,)
    assert type(spec.build()) is training.models.LeNet


def test_the_declared_entry_point_registers_the_training_models(registry: dict) -> None:
    """training/pyproject.toml's entry point names the function that registers the family it names."""
    declared = tomllib.loads((CKPTOOL.parent / "training" / "pyproject.toml").read_text())
    entry_points = declared["project"]["entry-points"][ENTRY_POINT_GROUP]
    assert list(entry_points) == ["training"]
    module_name, _, function = entry_points["training"].partition(":")
    registry.clear()
    getattr(importlib.import_module(module_name), function)()
    assert list(registry) == ["training"]


def write_distribution(site: Path, family: str) -> None:
    """An installed package on ``site`` that offers ``family`` through a ckptool.models entry point."""
    (site / "tiny_family-1.0.dist-info").mkdir(parents=True)
    (site / "tiny_family-1.0.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: tiny-family\n"
                                                                 "Version: 1.0\n")
    (site / "tiny_family-1.0.dist-info" / "entry_points.txt").write_text(
        f"[{ENTRY_POINT_GROUP}]\n{family} = tiny_family:offer\n")
    (site / "tiny_family.py").write_text(
        "import torch\n"
        "from ckptool.verification.models import register\n"
        "def offer():\n"
        f"    register({family!r}, {{'two': lambda: torch.nn.Linear(3, 2)}}, input_shape=(4, 3),\n"
        "             test_set=lambda size: (torch.ones(size, 3), torch.zeros(size, dtype=torch.long)))\n"
    )


def test_an_installed_package_offers_a_family_through_its_entry_point(tmp_path: Path, registry: dict,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    import ckptool

    write_distribution(tmp_path / "site", "tinies")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.delitem(sys.modules, "tiny_family", raising=False)
    parse_model_spec("torchvision:resnet18")
    assert "tiny_family" not in sys.modules  # loaded only when a SPEC names its family
    spec = parse_model_spec("tinies:two")
    assert "tiny_family" in sys.modules
    assert (spec.family, spec.name, spec.default_input_shape) == ("tinies", "two", (4, 3))
    torch.manual_seed(0)
    path = tmp_path / "two.pt"
    torch.save(nn.Linear(3, 2).state_dict(), path)
    report = ckptool.verify(path, model_spec="tinies:two", devices="cpu")
    assert report.ok, report.failure
    assert report.input_shape == (4, 3) and report.devices[0].accuracy is not None  # the family's test set
    with pytest.raises(UsageError, match=r"^model_spec='tinies:three': unknown tinies model 'three' — choose one of: two$"):
        parse_model_spec("tinies:three")


def test_an_entry_point_that_fails_is_a_usage_error(tmp_path: Path, registry: dict,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    write_distribution(tmp_path / "site", "broken")
    (tmp_path / "site" / "tiny_family.py").write_text("def offer():\n    raise RuntimeError('no GPU build')\n")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.delitem(sys.modules, "tiny_family", raising=False)
    with pytest.raises(UsageError, match=r"^model_spec='broken:two': the broken models could not be loaded from "
                                         r"tiny_family:offer \(RuntimeError: no GPU build\) — reinstall"):
        parse_model_spec("broken:two")


def test_register_offers_a_family_to_verify(registry: dict) -> None:
    register("mine", {"tiny": lambda: nn.Linear(3, 2)}, input_shape=(1, 3))
    spec = parse_model_spec("mine:tiny")
    assert (spec.family, spec.default_input_shape) == ("mine", (1, 3)) and isinstance(spec.build(), nn.Linear)
    with pytest.raises(UsageError, match="mine models take no arguments"):
        parse_model_spec("mine:tiny?width=3")
    for name in ("torchvision", "python", "not-a-name"):
        with pytest.raises(ValueError, match="must be an identifier"):
            register(name, {})


def test_an_unregistered_family_is_user_code() -> None:
    spec = parse_model_spec("my_nets:tiny")
    assert (spec.family, spec.name) == ("python", "my_nets:tiny")
