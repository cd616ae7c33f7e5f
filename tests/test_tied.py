"""Tied weights in safetensors outputs: the name kept is the first in the state dict (the module that
registered the weight first), as transformers' own save keeps it; every other name is recorded as an
alias that ckptool re-ties on reading."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from click.testing import CliRunner
from safetensors import safe_open
from safetensors.torch import load_model
from torch import nn

import ckptool
from ckptool.cli.main import main


class TinyLM(nn.Module):
    """GPT-2's shape: the input embedding registered (under ``transformer.``) before the output head
    that shares its weight; ``lm_head.weight`` sorts before ``transformer.wte.weight``."""

    def __init__(self) -> None:
        super().__init__()
        self.transformer = nn.ModuleDict({"wte": nn.Embedding(11, 4), "ln_f": nn.LayerNorm(4)})
        self.lm_head = nn.Linear(4, 11, bias=False)
        self.lm_head.weight = self.transformer["wte"].weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.transformer["ln_f"](self.transformer["wte"](ids)))


def _convert(source: Path, out: Path, *extra: str) -> None:
    result = CliRunner().invoke(main, ["convert", str(source), "-o", str(out), *extra])
    assert result.exit_code == 0, result.output


def _stored(path: Path) -> tuple[set[str], dict[str, str]]:
    with safe_open(str(path), "pt") as handle:
        metadata = handle.metadata() or {}
        return set(handle.keys()), json.loads(metadata.get("ckptool.aliases", "{}"))


def test_the_input_embedding_is_stored_and_the_head_is_its_alias(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = TinyLM()
    source = tmp_path / "pytorch_model.bin"
    torch.save(model.state_dict(), source)
    out = tmp_path / "model.safetensors"
    _convert(source, out)
    stored, aliases = _stored(out)
    assert "transformer.wte.weight" in stored and "lm_head.weight" not in stored
    assert aliases == {"lm_head.weight": "transformer.wte.weight"}
    # safetensors' own loader re-ties the head from the embedding the file holds
    fresh = TinyLM()
    load_model(fresh, str(out))
    ids = torch.tensor([[1, 2, 3]])
    assert torch.equal(fresh(ids), model(ids))
    # ckptool reads every name back, tied, and the output is identical to the input
    reread = ckptool.load(out)
    assert set(reread.tensors) == set(model.state_dict())
    assert ckptool.diff(source, out).identical


def test_three_names_tied_keep_the_first_and_sharded_outputs_store_it_once(tmp_path: Path) -> None:
    torch.manual_seed(1)
    shared = torch.randn(64, 8)
    state = {"b.embed": shared, "a.head": shared, "c.extra": shared, "z.bias": torch.randn(64)}
    source = tmp_path / "tied.pt"
    torch.save(state, source)
    out = tmp_path / "tied.safetensors"
    _convert(source, out)
    stored, aliases = _stored(out)
    assert stored == {"b.embed", "z.bias"}
    assert aliases == {"a.head": "b.embed", "c.extra": "b.embed"}
    folder = tmp_path / "sharded"
    _convert(source, folder, "--max-shard-size", "1KB")
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    shards = {name for name in index["weight_map"].values()}
    names_stored: set[str] = set()
    for shard in shards:
        keys, _ = _stored(folder / shard)
        assert not keys & names_stored
        names_stored |= keys
    assert names_stored == {"b.embed", "z.bias"}
    assert ckptool.diff(source, folder).identical
