"""timm: a tiny ResNet trained a few steps, saved by timm's own ``CheckpointSaver`` with an EMA copy.

Imported only inside the frameworks venv. ``write(out)`` trains a narrow ``resnet10t`` (built from its config, no
download) for a few steps on random images with ``ModelEmaV3`` and lets ``CheckpointSaver`` write
``last.pth.tar`` ({epoch, arch, state_dict, optimizer, version, args, state_dict_ema, metric}) the way
timm's ``train.py`` does. ``load_back`` reads ckptool's outputs with ``timm.models.load_checkpoint``
(the EMA set with ``use_ema=True`` where the output kept it) and checks the logits.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

ARCH = "resnet10t"
NUM_CLASSES = 4
IMAGE = 32
# resnet10t's layout at an eighth of its width: ~14k parameters, so that the checkpoint (weights, EMA
# and SGD momentum) stays a small test fixture
CHANNELS = (8, 8, 16, 16)
STEM_WIDTH = 8


def _model() -> torch.nn.Module:
    import timm

    return timm.create_model(ARCH, pretrained=False, num_classes=NUM_CLASSES, channels=CHANNELS, stem_width=STEM_WIDTH)


def _input() -> torch.Tensor:
    return torch.randn(2, 3, IMAGE, IMAGE, generator=torch.Generator().manual_seed(0))


def write(out: Path) -> list[dict]:
    from timm.utils import CheckpointSaver, ModelEmaV3

    torch.manual_seed(0)
    out.mkdir(parents=True, exist_ok=True)
    model = _model()
    ema = ModelEmaV3(model, decay=0.9)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    args = argparse.Namespace(model=ARCH, num_classes=NUM_CLASSES, lr=0.05, epochs=1, model_ema=True)
    saver = CheckpointSaver(model=model, optimizer=optimizer, args=args, model_ema=ema,
                            checkpoint_dir=str(out), recovery_dir=str(out), decreasing=False, max_history=1)
    generator = torch.Generator().manual_seed(1)
    model.train()
    for step in range(3):
        images = torch.randn(4, 3, IMAGE, IMAGE, generator=generator)
        labels = torch.randint(0, NUM_CLASSES, (4,), generator=generator)
        loss = torch.nn.functional.cross_entropy(model(images), labels)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        ema.update(model, step=step)
    saver.save_checkpoint(epoch=0, metric=0.5)
    return [{"id": "timm_checkpoint_saver_ema", "path": "last.pth.tar", "allow_globals": [], "fixture": True,
             "load_back": "timm.models.load_checkpoint (use_ema=False and True) into resnet10t, logits equal"}]


def _logits(path: Path, *, use_ema: bool) -> torch.Tensor:
    from timm.models import load_checkpoint

    model = _model()
    load_checkpoint(model, str(path), use_ema=use_ema, strict=True)
    model.eval()
    with torch.no_grad():
        return model(_input())


def _has_ema(path: Path) -> bool:
    from timm.models._helpers import _torch_load  # timm's weights_only read (argparse.Namespace allowed)

    if path.suffix == ".safetensors":
        return False
    checkpoint = _torch_load(str(path), map_location="cpu", weights_only=True)
    return isinstance(checkpoint, dict) and "state_dict_ema" in checkpoint


def load_back(case: dict, ckptool_outputs: dict[str, str]) -> str:
    """Load every ckptool output with timm's loader; each must give the logits the original gives.

    ``ckptool_outputs`` maps a command to its output, ``"input"`` to the original file.
    """
    source = Path(ckptool_outputs["input"])
    expected = {use_ema: _logits(source, use_ema=use_ema) for use_ema in (False, True)}
    if torch.equal(expected[False], expected[True]):
        raise AssertionError("the EMA weights give the same logits as the live ones: the test cannot tell them apart")
    checked = []
    for command, output in sorted(ckptool_outputs.items()):
        path = Path(output)
        if command in ("input", "add-prefix") or not (path.is_file() and path.suffix in (".pt", ".safetensors")):
            continue
        # a safetensors output holds one set, the live weights; a .pt rewrite keeps both
        for use_ema in ((False, True) if _has_ema(path) else (False,)):
            logits = _logits(path, use_ema=use_ema)
            if not torch.equal(logits, expected[use_ema]):
                raise AssertionError(f"{command}: {path.name} (use_ema={use_ema}) gives other logits than the original")
            checked.append(f"{command}{' ema' if use_ema else ''}")
    if not checked:
        raise AssertionError("no ckptool output to load back")
    return "timm.models.load_checkpoint, equal logits: " + ", ".join(checked)
