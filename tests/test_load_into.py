"""load_into's options: the model stays where it is, strict=False loads what fits, filter_fn as timm takes it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

import ckptool
from ckptool.ops.load_into import LoadMismatchError


class Net(nn.Module):
    def __init__(self, classes: int = 10, extra: bool = False) -> None:
        super().__init__()
        self.body = nn.Linear(4, 8)
        self.head = nn.Linear(8, classes)
        if extra:
            self.adapter = nn.Linear(8, 8)


def _saved(tmp_path: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    trained = nn.DataParallel(Net())
    path = tmp_path / "ddp.pt"
    torch.save({"model": trained.state_dict(), "epoch": 1}, path)
    # on a CUDA machine DataParallel moves the module to cuda:0: the file is tagged so, the expectations are on the CPU
    return path, {k.removeprefix("module."): v.cpu() for k, v in trained.state_dict().items()}


def test_the_model_stays_where_it_is(tmp_path: Path) -> None:
    path, saved = _saved(tmp_path)
    model = Net().double()  # on the CPU in float64: the load copies into its own tensors, cast on the way

    def refuse_to_move(*args: object, **kwargs: object) -> nn.Module:
        raise AssertionError("load_into moved the model")

    model.to = refuse_to_move  # type: ignore[method-assign]
    report = ckptool.load_into(model, path)
    assert report.device == "cpu" and report.matched == 4 and report.casts == {"F32->F64": 4}
    assert model.body.weight.dtype == torch.float64
    assert torch.equal(model.body.weight, saved["body.weight"].double())


def test_strict_false_loads_what_fits_and_reports_the_rest(tmp_path: Path) -> None:
    path, saved = _saved(tmp_path)
    model = Net(classes=3, extra=True)  # a new head and an adapter the checkpoint lacks
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(LoadMismatchError):
        ckptool.load_into(model, path)
    report = ckptool.load_into(model, path, strict=False)
    assert report.rewrite.describe() == 'strip "module."'
    assert report.matched == 2 and report.mismatched_keys == ["head.weight", "head.bias"]
    assert report.missing_keys == ["head.weight", "head.bias", "adapter.weight", "adapter.bias"]
    assert report.unexpected_keys == []
    assert torch.equal(model.body.weight, saved["body.weight"]) and torch.equal(model.body.bias, saved["body.bias"])
    assert torch.equal(model.head.weight, before["head.weight"])  # kept its own values
    assert torch.equal(model.adapter.weight, before["adapter.weight"])


def test_filter_fn_as_timm_takes_it(tmp_path: Path) -> None:
    path, saved = _saved(tmp_path)
    calls = []

    def drop_head(state_dict: dict[str, torch.Tensor], model: nn.Module) -> dict[str, torch.Tensor]:
        calls.append((sorted(state_dict), type(model).__name__))
        return {k: v for k, v in state_dict.items() if not k.startswith("head.")}

    model = Net(classes=3)
    before = model.head.weight.clone()
    report = ckptool.load_into(model, path, strict=False, filter_fn=drop_head)
    assert calls == [(["body.bias", "body.weight", "head.bias", "head.weight"], "Net")]  # keys after the rewrite
    assert report.skipped == ["head.weight", "head.bias"] and report.matched == 2
    assert report.missing_keys == ["head.weight", "head.bias"] and report.mismatched_keys == []
    assert torch.equal(model.body.weight, saved["body.weight"]) and torch.equal(model.head.weight, before)
    with pytest.raises(LoadMismatchError, match="filter_fn left 2 of Net's keys without weights"):
        ckptool.load_into(Net(), path, filter_fn=drop_head)  # strict: the dropped keys must not be the model's


def test_filter_fn_may_change_values(tmp_path: Path) -> None:
    path, saved = _saved(tmp_path)
    model = Net()
    ckptool.load_into(model, path, filter_fn=lambda sd, m: {k: v * 2 for k, v in sd.items()})
    assert torch.equal(model.head.bias, saved["head.bias"] * 2)
