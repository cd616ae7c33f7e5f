"""ultralytics: a very small YOLO detector trained two epochs on a few generated images.

Imported only inside the frameworks venv. ``write(out)`` draws a few images with one filled box each
(YOLO label files beside them), writes the dataset yaml and a tiny model yaml (one detection level, so
that the checkpoint stays under 300 KB), and trains with ``YOLO(yaml).train(...)`` for two epochs on the CPU
with nothing to download (``plots=False``, ``amp=False``: the AMP check would fetch weights). The
trainer writes ``weights/epoch0.pt`` mid-run (``save_period=1``: ``model`` None, the EMA as a whole
pickled ``DetectionModel``, optimizer state) and ``weights/last.pt``/``best.pt`` at the end (stripped:
the EMA's half-precision model as ``model``), beside the training arguments and metrics.

``load_back`` builds a fresh ``DetectionModel`` from the same yaml, loads the weights ckptool extracted
(``strip``/``convert``) with a strict ``load_state_dict`` and checks its outputs against the model in
the original file.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

IMAGE = 64
MODEL_YAML = """\
# a YOLOv8-style detector small enough for a test fixture: three strided convs, one C2f, one Detect level
nc: 2
backbone:
  - [-1, 1, Conv, [8, 3, 2]]    # 0 P1/2
  - [-1, 1, Conv, [16, 3, 2]]   # 1 P2/4
  - [-1, 1, C2f, [16, True]]    # 2
  - [-1, 1, Conv, [16, 3, 2]]   # 3 P3/8
head:
  - [[3], 1, Detect, [nc]]      # 4 Detect(P3)
"""


def _environment(out: Path) -> None:
    # settings and fonts under the run's folder, and never a download
    os.environ.setdefault("YOLO_CONFIG_DIR", str(out / "ultralytics-config"))
    os.environ.setdefault("YOLO_OFFLINE", "1")


def _dataset(root: Path) -> Path:
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    for split in ("train", "val"):
        (root / "images" / split).mkdir(parents=True, exist_ok=True)
        (root / "labels" / split).mkdir(parents=True, exist_ok=True)
        for index in range(4):
            pixels = rng.integers(0, 60, (IMAGE, IMAGE, 3), dtype=np.uint8)
            cls = index % 2
            x0, y0 = rng.integers(4, IMAGE // 2, 2)
            w, h = rng.integers(12, IMAGE // 2 - 2, 2)
            pixels[y0:y0 + h, x0:x0 + w] = (255, 40, 40) if cls == 0 else (40, 40, 255)
            Image.fromarray(pixels).save(root / "images" / split / f"{index}.png")
            box = ((x0 + w / 2) / IMAGE, (y0 + h / 2) / IMAGE, w / IMAGE, h / IMAGE)
            (root / "labels" / split / f"{index}.txt").write_text(f"{cls} " + " ".join(f"{v:.6f}" for v in box) + "\n")
    data = root / "data.yaml"
    data.write_text(f"path: {root}\ntrain: images/train\nval: images/val\nnames:\n  0: red\n  1: blue\n")
    return data


def write(out: Path) -> list[dict]:
    out = out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    _environment(out)
    from ultralytics import YOLO

    data = _dataset(out / "dataset")
    model_yaml = out / "tiny-yolo.yaml"
    model_yaml.write_text(MODEL_YAML)
    # two epochs, a checkpoint after each (save_period=1): epoch0.pt as the trainer writes it mid-run (no model,
    # the EMA's whole model, optimizer state); last.pt and best.pt stripped at the end (the EMA as 'model')
    YOLO(str(model_yaml)).train(data=str(data), epochs=2, save_period=1, imgsz=IMAGE, batch=4, device="cpu", workers=0,
                                amp=False, plots=False, val=True, seed=0, deterministic=True, project=str(out),
                                name="train", exist_ok=True, verbose=False, cache=False)
    cases = []
    for name in ("best", "last", "epoch0"):
        # a whole pickled model: its classes (ultralytics' and torch.nn's) need trust, asked for once as patterns
        cases.append({"id": f"ultralytics_{name}", "path": f"train/weights/{name}.pt",
                      "allow_globals": ["ultralytics.*", "torch.*"], "fixture": name == "best",
                      "load_back": "strict load_state_dict of the extracted weights into a fresh DetectionModel "
                                   "from the same yaml, outputs equal"})
    return cases


def _fresh_model(yaml_path: Path) -> torch.nn.Module:
    from ultralytics.nn.tasks import DetectionModel

    return DetectionModel(str(yaml_path), nc=2, verbose=False)


def _forward(model: torch.nn.Module) -> torch.Tensor:
    model.float().eval()
    with torch.no_grad():
        output = model(torch.rand(1, 3, IMAGE, IMAGE, generator=torch.Generator().manual_seed(3)))
    return output[0] if isinstance(output, list | tuple) else output


def load_back(case: dict, ckptool_outputs: dict[str, str]) -> str:
    """Each ckptool output back in ultralytics; its outputs must equal the original model's.

    Weights-only outputs (``strip``, ``convert`` and back, or a checkpoint whose ``model`` ckptool
    wrote as its state dict) go into a fresh DetectionModel from the
    same yaml with a strict ``load_state_dict``; an output that keeps the whole pickled model (``remap``)
    is read by ultralytics' own ``load_checkpoint``, as ``YOLO(path)`` reads a checkpoint.
    """
    import pickle

    from safetensors.torch import load_file
    from ultralytics.nn.tasks import load_checkpoint

    source = Path(ckptool_outputs["input"])
    root = source.parents[2]  # <out>/train/weights/best.pt
    _environment(root)
    yaml_path = root / "tiny-yolo.yaml"
    expected = _forward(load_checkpoint(str(source))[0])
    checked = []
    for command, output in sorted(ckptool_outputs.items()):
        path = Path(output)
        if command in ("input", "add-prefix") or not path.is_file() or path.suffix not in (".pt", ".safetensors"):
            continue
        if path.suffix == ".safetensors":
            state_dict = load_file(path)
        else:
            try:
                state_dict = torch.load(path, map_location="cpu", weights_only=True)
            except pickle.UnpicklingError:  # the whole model kept: ultralytics' own loader reads it
                got = _forward(load_checkpoint(str(path))[0])
                if not torch.equal(got, expected):
                    raise AssertionError(f"{command}: {path.name} gives other outputs than the original model")
                checked.append(f"{command} (ultralytics load_checkpoint)")
                continue
            if not all(isinstance(value, torch.Tensor) for value in state_dict.values()):
                # the checkpoint kept, its whole model written as its weights (the EMA's first, as ultralytics reads)
                state_dict = state_dict.get("ema") or state_dict["model"]
        model = _fresh_model(yaml_path)
        model.load_state_dict(state_dict, strict=True)
        if not torch.equal(_forward(model.half()), expected):
            raise AssertionError(f"{command}: {path.name} gives other outputs than the original model")
        checked.append(command)
    if not checked:
        raise AssertionError("no ckptool output to load back")
    return "DetectionModel, equal outputs: " + ", ".join(checked)
