"""accelerate: ``save_state`` and ``save_model`` from a real 2-process run (``torchrun --nproc_per_node 2``, gloo).

Imported only inside the frameworks venv (see README.md beside this file). ``write`` launches this file under
torchrun (``python -m torch.distributed.run --nproc_per_node 2 fw_accelerate.py train OUT``).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

SEED = 0
FEATURES, HIDDEN, CLASSES = 8, 16, 3


def tiny_model():
    from torch import nn

    return nn.Sequential(nn.Linear(FEATURES, HIDDEN), nn.ReLU(), nn.LayerNorm(HIDDEN), nn.Linear(HIDDEN, CLASSES))


def train(out: Path) -> None:
    """Both ranks: a few DDP steps, then save_state (every rank takes part) and save_model (main process)."""
    import torch
    from accelerate import Accelerator
    from accelerate.utils import set_seed
    from torch.nn import functional as F
    from torch.utils.data import DataLoader, TensorDataset

    accelerator = Accelerator(cpu=True)
    set_seed(SEED)
    model = tiny_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=1.0, end_factor=0.1, total_iters=4)
    generator = torch.Generator().manual_seed(SEED)
    x = torch.randn(64, FEATURES, generator=generator)
    y = (x[:, 0] > 0).long() + (x[:, 1] > 0).long()
    loader = DataLoader(TensorDataset(x, y), batch_size=8, shuffle=True, generator=generator)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    if accelerator.num_processes != 2 or accelerator.distributed_type.value != "MULTI_CPU":
        raise RuntimeError(f"expected 2 CPU processes, got {accelerator.num_processes} "
                           f"({accelerator.distributed_type})")
    for step, (inputs, labels) in enumerate(loader):
        loss = F.cross_entropy(model(inputs), labels)
        accelerator.backward(loss)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        if step == 2:
            break
    accelerator.wait_for_everyone()
    accelerator.save_state(str(out / "save_state"))  # the safetensors default
    accelerator.save_state(str(out / "save_state_bin"), safe_serialization=False)
    accelerator.wait_for_everyone()
    accelerator.save_model(model, str(out / "save_model"))  # model.safetensors
    accelerator.save_model(model, str(out / "save_model_sharded"), max_shard_size=400)
    accelerator.save_model(model, str(out / "save_model_bin"), safe_serialization=False)
    accelerator.wait_for_everyone()
    accelerator.end_training()


def write(out: Path) -> list[dict]:
    environment = dict(os.environ, OMP_NUM_THREADS="1")
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                    str(Path(__file__).resolve()), "train", str(out)], check=True, cwd=out, env=environment)
    return [
        {"id": "save-state-folder", "path": "save_state", "allow_globals": [], "load_back": "load_checkpoint_in_model",
         "about": "save_state(): model.safetensors, optimizer.bin, scheduler.bin, random_states_0.pkl, "
                  "random_states_1.pkl"},
        {"id": "save-state-model", "path": "save_state/model.safetensors", "allow_globals": [],
         "load_back": "load_checkpoint_in_model", "fixture": True, "about": "save_state()'s weights"},
        {"id": "save-state-optimizer", "path": "save_state/optimizer.bin", "allow_globals": [], "load_back": None,
         "fixture": True, "about": "save_state()'s AdamW state (no model weights)"},
        {"id": "save-state-scheduler", "path": "save_state/scheduler.bin", "allow_globals": [], "load_back": None,
         "fixture": True, "about": "save_state()'s LinearLR state"},
        {"id": "save-state-random-states", "path": "save_state/random_states_0.pkl", "allow_globals": [],
         "load_back": None, "fixture": True, "about": "rank 0's python, numpy and torch RNG states"},
        {"id": "save-state-bin-folder", "path": "save_state_bin", "allow_globals": [],
         "load_back": "load_checkpoint_in_model",
         "about": "save_state(safe_serialization=False): pytorch_model.bin, optimizer.bin, scheduler.bin, ..."},
        {"id": "save-state-bin-model", "path": "save_state_bin/pytorch_model.bin", "allow_globals": [],
         "load_back": "load_checkpoint_in_model", "fixture": True, "about": "save_state()'s pickled weights"},
        {"id": "save-model", "path": "save_model/model.safetensors", "allow_globals": [],
         "load_back": "load_checkpoint_in_model", "about": "save_model(): model.safetensors"},
        {"id": "save-model-sharded", "path": "save_model_sharded", "allow_globals": [],
         "load_back": "load_checkpoint_in_model", "fixture": True,
         "about": "save_model(max_shard_size=400): model-0000N-of-0000M.safetensors + index"},
        {"id": "save-model-bin", "path": "save_model_bin/pytorch_model.bin", "allow_globals": [],
         "load_back": "load_checkpoint_in_model", "about": "save_model(safe_serialization=False)"},
    ]


# ---------------------------------------------------------------------------------------------- load back


def load_back(case: dict, outputs: dict[str, str]) -> str:
    import torch
    from accelerate.utils import load_checkpoint_in_model

    source = Path(outputs["input"])
    original = tiny_model()
    load_checkpoint_in_model(original, str(source if source.is_file() else weights_in(source)), strict=True)
    expected = original.state_dict()
    checked = []
    for name in ("safetensors", "pt", "strip", "remap"):
        if name not in outputs:
            if name == "safetensors":
                raise AssertionError("no safetensors output to load")
            continue
        model = tiny_model()
        load_checkpoint_in_model(model, outputs[name], strict=True)
        for key, tensor in model.state_dict().items():
            if not torch.equal(tensor, expected[key]):
                raise AssertionError(f"{name}: {key} differs from the original")
        checked.append(name)
    return "load_checkpoint_in_model(strict=True) gives equal weights: " + ", ".join(checked)


def weights_in(folder: Path) -> Path:
    """The weights a save_state / save_model folder holds: its index, or its one weights file."""
    for name in ("model.safetensors.index.json", "pytorch_model.bin.index.json", "model.safetensors",
                 "pytorch_model.bin"):
        if (folder / name).exists():
            return folder / name
    raise FileNotFoundError(f"{folder}: no model weights")


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "train":
        train(Path(sys.argv[2]))
    else:
        sys.exit("usage: torchrun --nproc_per_node 2 fw_accelerate.py train OUT_DIR")
