"""transformers: a tiny GPT-2 (tied ``lm_head``/``wte``) from ``GPT2Config``, saved by ``save_pretrained`` (safetensors
and sharded ``.bin``) and by a ``Trainer`` run that leaves ``checkpoint-N/`` folders.

Imported only inside the frameworks venv (see README.md beside this file). No hub: the model is built from a
config, the driver sets ``HF_HUB_OFFLINE=1``.
"""

from __future__ import annotations

import inspect
import shutil
import tempfile
from pathlib import Path

SEED = 0
TRAIN_STEPS = 4
SAVE_STEPS = 2


def config():
    from transformers import GPT2Config

    return GPT2Config(vocab_size=96, n_positions=32, n_embd=16, n_layer=2, n_head=2, tie_word_embeddings=True,
                      bos_token_id=0, eos_token_id=0)


def tiny_gpt2():
    import torch
    from transformers import GPT2LMHeadModel

    torch.manual_seed(SEED)
    model = GPT2LMHeadModel(config())
    if model.lm_head.weight.data_ptr() != model.transformer.wte.weight.data_ptr():
        raise RuntimeError("GPT2LMHeadModel did not tie lm_head to wte")
    return model


def save_pretrained_bin(model, folder: Path, max_shard_size: str) -> str:  # noqa: ANN001
    """Pickled ``.bin`` shards + ``pytorch_model.bin.index.json``: ``save_pretrained(safe_serialization=False)``
    where transformers still has it (4.x), else the Hugging Face hub library's own sharded torch save, which
    transformers 4.x called for it (transformers 5 writes safetensors only, and still reads ``.bin``)."""
    if "safe_serialization" in inspect.signature(model.save_pretrained).parameters:
        model.save_pretrained(folder, safe_serialization=False, max_shard_size=max_shard_size)
        return f"save_pretrained(safe_serialization=False, max_shard_size={max_shard_size!r})"
    from huggingface_hub import save_torch_state_dict

    model.config.save_pretrained(folder)
    save_torch_state_dict(model.state_dict(), folder, safe_serialization=False, max_shard_size=max_shard_size)
    return (f"huggingface_hub.save_torch_state_dict(model.state_dict(), safe_serialization=False, "
            f"max_shard_size={max_shard_size!r}) + config.json (transformers 5 writes no .bin)")


class TokenDataset:
    """Random token sequences; labels are the inputs (causal LM)."""

    def __init__(self, count: int = 16, length: int = 12) -> None:
        import torch

        generator = torch.Generator().manual_seed(SEED)
        self.items = [torch.randint(1, 96, (length,), generator=generator) for _ in range(count)]

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> dict:
        return {"input_ids": self.items[index], "labels": self.items[index].clone()}


def train(out: Path) -> None:
    from transformers import Trainer, TrainingArguments

    model = tiny_gpt2()
    arguments = {"output_dir": str(out), "max_steps": TRAIN_STEPS, "save_steps": SAVE_STEPS, "save_strategy": "steps",
                 "per_device_train_batch_size": 4, "learning_rate": 1e-3, "report_to": [], "seed": SEED,
                 "logging_steps": 1, "use_cpu": True, "dataloader_num_workers": 0, "disable_tqdm": True}
    accepted = inspect.signature(TrainingArguments.__init__).parameters
    args = TrainingArguments(**{key: value for key, value in arguments.items() if key in accepted})
    Trainer(model=model, args=args, train_dataset=TokenDataset()).train()


def write(out: Path) -> list[dict]:
    model = tiny_gpt2()
    model.save_pretrained(out / "save_pretrained")  # safetensors, the default
    cases = [
        {"id": "save-pretrained-safetensors", "path": "save_pretrained/model.safetensors", "allow_globals": [],
         "load_back": "from_pretrained", "fixture": True,
         "about": "save_pretrained() default: one model.safetensors, the tied lm_head left out"},
    ]
    how = save_pretrained_bin(model, out / "save_pretrained_bin", "20KB")
    if not sorted((out / "save_pretrained_bin").glob("pytorch_model-*.bin"))[1:]:
        raise RuntimeError(f"{how} wrote no shards: {sorted(p.name for p in (out / 'save_pretrained_bin').iterdir())}")
    cases.append({"id": "save-pretrained-sharded-bin", "path": "save_pretrained_bin", "allow_globals": [],
                  "load_back": "from_pretrained", "fixture": True,
                  "about": f"{how}: pytorch_model-0000N-of-0000M.bin shards + pytorch_model.bin.index.json, "
                           "lm_head.weight and transformer.wte.weight one storage"})
    train(out / "trainer")
    checkpoint = f"trainer/checkpoint-{TRAIN_STEPS}"
    if not (out / checkpoint).is_dir():
        raise RuntimeError(f"Trainer left no {checkpoint}: {sorted(p.name for p in (out / 'trainer').iterdir())}")
    weights = next(name for name in ("model.safetensors", "pytorch_model.bin") if (out / checkpoint / name).exists())
    cases += [
        {"id": "trainer-checkpoint-folder", "path": checkpoint, "allow_globals": [], "load_back": "from_pretrained",
         "about": "Trainer's checkpoint-N/ folder: weights + optimizer.pt, scheduler.pt, rng_state.pth, "
                  "trainer_state.json, training_args.bin"},
        {"id": "trainer-model", "path": f"{checkpoint}/{weights}", "allow_globals": [],
         "load_back": "from_pretrained", "about": "the weights file Trainer saved in checkpoint-N/"},
        {"id": "trainer-optimizer", "path": f"{checkpoint}/optimizer.pt", "allow_globals": [], "load_back": None,
         "fixture": True, "about": "Trainer's AdamW state (no model weights)"},
        {"id": "trainer-scheduler", "path": f"{checkpoint}/scheduler.pt", "allow_globals": [], "load_back": None,
         "fixture": True, "about": "Trainer's LambdaLR state"},
        {"id": "trainer-rng-state", "path": f"{checkpoint}/rng_state.pth", "allow_globals": [], "load_back": None,
         "fixture": True, "about": "python, numpy and torch RNG states"},
        {"id": "trainer-training-args", "path": f"{checkpoint}/training_args.bin",
         "allow_globals": ["transformers.*", "accelerate.*"], "load_back": None, "fixture": True,
         "about": "torch.save(TrainingArguments): transformers' own classes and enums"},
    ]
    return cases


# ---------------------------------------------------------------------------------------------- load back


def model_folder(config_from: Path, weights: Path, into: Path) -> Path:
    """A folder ``from_pretrained`` reads: the original config.json beside ckptool's weights (a safetensors or
    .pt file, or a folder of shards + index)."""
    into.mkdir(parents=True, exist_ok=True)
    shutil.copy2(config_from / "config.json", into / "config.json")
    if weights.is_dir():
        for member in weights.iterdir():
            shutil.copy2(member, into / member.name)
    elif weights.suffix == ".safetensors":
        shutil.copy2(weights, into / "model.safetensors")
    else:
        shutil.copy2(weights, into / "pytorch_model.bin")
    return into


def load_back(case: dict, outputs: dict[str, str]) -> str:
    import torch
    from transformers import GPT2LMHeadModel

    source = Path(outputs["input"])
    folder = source if source.is_dir() else source.parent
    original = GPT2LMHeadModel.from_pretrained(folder).eval()
    probe = torch.randint(1, 96, (2, 10), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = original(probe).logits
    checked = []
    with tempfile.TemporaryDirectory(prefix="ckptool-fw-transformers-") as scratch:
        for name in ("safetensors", "pt", "strip"):
            if name not in outputs:
                if name == "safetensors":
                    raise AssertionError("no safetensors output to load")
                continue
            built = model_folder(folder, Path(outputs[name]), Path(scratch) / name)
            model = GPT2LMHeadModel.from_pretrained(built).eval()
            if model.lm_head.weight.data_ptr() != model.transformer.wte.weight.data_ptr():
                raise AssertionError(f"{name}: lm_head is not tied to wte after from_pretrained")
            if model.transformer.wte.weight.device.type == "meta":
                raise AssertionError(f"{name}: the embedding stayed on the meta device")
            with torch.no_grad():
                logits = model(probe).logits
            if not torch.equal(logits, expected):
                raise AssertionError(f"{name}: logits differ from the original's (max abs "
                                     f"{(logits - expected).abs().max().item():.3g})")
            checked.append(name)
    return "from_pretrained gives equal logits, lm_head tied: " + ", ".join(checked)
