"""mmengine: a tiny ``BaseModel`` trained one epoch by a real ``Runner``, saved by its ``CheckpointHook``.

Imported only inside the frameworks venv. ``write(out)`` runs mmengine's ``Runner`` on the CPU over a
small in-memory dataset (1 epoch); its ``CheckpointHook`` writes ``epoch_1.pth`` ({meta, state_dict,
message_hub, optimizer, param_schedulers}: the meta holds the config text, the message hub mmengine's
``HistoryBuffer`` records and numpy values). ``load_back`` loads ckptool's outputs with
``mmengine.runner.load_checkpoint`` into a fresh model (strict) and checks its outputs.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

FEATURES = 8
CLASSES = 3


def _model_class() -> type:
    from mmengine.model import BaseModel

    class ToyClassifier(BaseModel):
        """Two linear layers and a batch norm: parameters and buffers (running stats, a counter)."""

        def __init__(self) -> None:
            super().__init__()
            self.backbone = nn.Sequential(nn.Linear(FEATURES, 16), nn.BatchNorm1d(16), nn.ReLU())
            self.head = nn.Linear(16, CLASSES)

        def forward(self, inputs: torch.Tensor, labels: torch.Tensor | None = None, mode: str = "tensor"):
            logits = self.head(self.backbone(inputs))
            if mode == "loss":
                return {"loss": nn.functional.cross_entropy(logits, labels)}
            return logits

    return ToyClassifier


class ToyDataset(torch.utils.data.Dataset):
    """Separable points: the label is the argmax of the first CLASSES features."""

    def __init__(self, size: int = 32) -> None:
        generator = torch.Generator().manual_seed(0)
        self.inputs = torch.randn(size, FEATURES, generator=generator)
        self.labels = self.inputs[:, :CLASSES].argmax(1)
        self.metainfo = {"classes": tuple(f"class{i}" for i in range(CLASSES))}

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> dict:
        return {"inputs": self.inputs[index], "labels": self.labels[index]}


def write(out: Path) -> list[dict]:
    from mmengine.runner import Runner

    out.mkdir(parents=True, exist_ok=True)
    runner = Runner(
        model=_model_class()(),
        work_dir=str(out),
        experiment_name="toy",
        train_dataloader=dict(batch_size=8, dataset=ToyDataset(), num_workers=0,
                              sampler=dict(type="DefaultSampler", shuffle=True),
                              collate_fn=dict(type="default_collate")),
        optim_wrapper=dict(optimizer=dict(type="SGD", lr=0.1, momentum=0.9)),
        param_scheduler=dict(type="MultiStepLR", milestones=[1], gamma=0.1),
        train_cfg=dict(by_epoch=True, max_epochs=1),
        default_hooks=dict(checkpoint=dict(type="CheckpointHook", interval=1),
                           logger=dict(type="LoggerHook", interval=1)),
        randomness=dict(seed=0),
        env_cfg=dict(dist_cfg=dict(backend="gloo")),
        visualizer=dict(type="Visualizer", vis_backends=[dict(type="LocalVisBackend")]),
    )
    runner.train()
    # the message hub's HistoryBuffer records and the statistics methods their state names (pickle's
    # getattr(HistoryBuffer, 'min') spelling): the one refusal names all five
    history_buffer = "mmengine.logging.history_buffer.HistoryBuffer"
    allow_globals = [history_buffer, *(f"{history_buffer}.{name}" for name in ("min", "max", "current", "mean"))]
    return [{"id": "mmengine_runner_epoch_1", "path": "epoch_1.pth", "allow_globals": allow_globals, "fixture": True,
             "load_back": "mmengine.runner.load_checkpoint into a fresh BaseModel (strict), outputs equal"}]


def _outputs(path: Path, *, trusted: bool = False) -> torch.Tensor:
    """The fresh model's outputs after ``mmengine.runner.load_checkpoint(model, path, strict=True)``.

    mmengine's loader calls ``torch.load`` with torch's default, ``weights_only=True``, which refuses
    the runner's own files (its message hub holds ``HistoryBuffer`` records and numpy values); ``trusted`` reads them
    as an mmengine user on torch >= 2.6 must (``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD``): only for files this
    harness wrote or ckptool rewrote from them.
    """
    import os
    from unittest import mock

    from mmengine.runner import load_checkpoint

    model = _model_class()()
    environment = {"TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD": "1"} if trusted else {}
    with mock.patch.dict(os.environ, environment):
        load_checkpoint(model, str(path), map_location="cpu", strict=True)
    model.eval()
    with torch.no_grad():
        return model(torch.randn(4, FEATURES, generator=torch.Generator().manual_seed(1)))


def load_back(case: dict, ckptool_outputs: dict[str, str]) -> str:
    """Load every ckptool output (``.pt``/``.pth`` and safetensors) into a fresh model (strict).

    The reference is the original file (``"input"``) read by mmengine's loader. A ``.pt`` output is
    read by that loader as it is (weights-only outputs) or, when it carries the runner's
    ``HistoryBuffer`` records and numpy values as the original does, the trusted way; a
    safetensors output is a flat state dict, loaded with ``load_state_dict(strict=True)``.
    """
    import pickle

    from safetensors.torch import load_file

    source = Path(ckptool_outputs["input"])
    expected = _outputs(source, trusted=True)
    checked = []
    for command, output in sorted(ckptool_outputs.items()):
        path = Path(output)
        if command in ("input", "add-prefix") or not path.is_file() or path.suffix not in (".pt", ".safetensors"):
            continue
        how = command
        if path.suffix == ".safetensors":
            model = _model_class()()
            model.load_state_dict(load_file(path), strict=True)
            model.eval()
            with torch.no_grad():
                got = model(torch.randn(4, FEATURES, generator=torch.Generator().manual_seed(1)))
        else:
            try:
                got = _outputs(path)
            except pickle.UnpicklingError:  # torch's weights_only refusal: HistoryBuffer records, numpy values
                got = _outputs(path, trusted=True)
                how = f"{command} (trusted load: the runner's numpy and HistoryBuffer values kept)"
        if not torch.equal(got, expected):
            raise AssertionError(f"{command}: {path.name} gives other outputs than the original")
        checked.append(how)
    if not checked:
        raise AssertionError("no ckptool output to load back")
    return "mmengine.runner.load_checkpoint (strict), equal outputs: " + ", ".join(checked)
