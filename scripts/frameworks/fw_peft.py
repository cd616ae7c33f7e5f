"""PEFT: LoRA adapters saved by ``PeftModel.save_pretrained`` (``adapter_config.json`` + ``adapter_model.safetensors``,
or ``adapter_model.bin`` with ``safe_serialization=False``) on a tiny Llama built from ``LlamaConfig``, and on a tiny
diffusers ``UNet2DConditionModel`` (``to_q``, ``to_k``, ``to_v``, ``to_out.0``); and the Llama itself as a model
folder with one ``pytorch_model.bin`` (``config.json`` beside it, no index), as transformers 4.x saved it.

Imported only inside the frameworks venv (see README.md beside this file). No hub: every model is built from a
config; the driver sets ``HF_HUB_OFFLINE=1``. The adapters' LoRA weights are random (``init_lora_weights=False``):
a loaded adapter then changes the outputs, so an adapter that did not load is seen.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

SEED = 0
VOCAB = 64
LLAMA_TARGETS = ["q_proj", "v_proj"]
UNET_TARGETS = ["to_q", "to_k", "to_v", "to_out.0"]


def tiny_llama():
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(SEED)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32,
                         tie_word_embeddings=False, bos_token_id=0, eos_token_id=1, pad_token_id=2)
    return LlamaForCausalLM(config)


def tiny_unet():
    from fw_diffusers import tiny_unet as diffusers_unet  # this folder is on the path: the same tiny UNet

    return diffusers_unet()


def lora(targets: list[str], task_type: str | None = None):
    import torch
    from peft import LoraConfig

    torch.manual_seed(SEED + 1)
    return LoraConfig(r=2, lora_alpha=4, target_modules=targets, init_lora_weights=False, task_type=task_type)


def save_single_bin(model, folder: Path) -> str:  # noqa: ANN001
    """config.json + one ``pytorch_model.bin``: ``save_pretrained(safe_serialization=False)`` where transformers
    still has it (4.x), else the hub library's own torch save, which transformers 4.x called for it."""
    import inspect

    if "safe_serialization" in inspect.signature(model.save_pretrained).parameters:
        model.save_pretrained(folder, safe_serialization=False)
        how = "save_pretrained(safe_serialization=False)"
    else:
        from huggingface_hub import save_torch_state_dict

        model.config.save_pretrained(folder)
        save_torch_state_dict(model.state_dict(), folder, safe_serialization=False)
        how = ("huggingface_hub.save_torch_state_dict(model.state_dict(), safe_serialization=False) + config.json "
               "(transformers 5 writes no .bin)")
    written = sorted(p.name for p in folder.iterdir())
    if written != ["config.json", "pytorch_model.bin"]:
        raise RuntimeError(f"{how} wrote {written}, not one pytorch_model.bin beside config.json")
    return how


def write(out: Path) -> list[dict]:
    """Saves in a child process with string hashing fixed (PEFT writes ``target_modules`` from a set: its order in
    adapter_config.json follows the hash seed), so a rewrite gives the same bytes."""
    environment = dict(os.environ, PYTHONHASHSEED="0")
    completed = subprocess.run([sys.executable, str(Path(__file__).resolve()), "save", str(out)], env=environment,
                               check=True, capture_output=True, text=True)
    how = completed.stdout.strip().splitlines()[-1]
    return cases(how)


def save(out: Path) -> str:
    """Every folder ``write`` lists; how the single .bin was written."""
    from peft import get_peft_model

    how = save_single_bin(tiny_llama(), out / "llama_bin")
    model = get_peft_model(tiny_llama(), lora(LLAMA_TARGETS, "CAUSAL_LM"))
    model.save_pretrained(out / "lora_llama")
    model.save_pretrained(out / "lora_llama_bin", safe_serialization=False)
    tiny_unet().save_pretrained(out / "unet_base")
    get_peft_model(tiny_unet(), lora(UNET_TARGETS)).save_pretrained(out / "lora_unet")
    for folder, weights in (("lora_llama", "adapter_model.safetensors"), ("lora_llama_bin", "adapter_model.bin"),
                            ("lora_unet", "adapter_model.safetensors")):
        if not (out / folder / weights).is_file() or not (out / folder / "adapter_config.json").is_file():
            raise RuntimeError(f"{folder}: save_pretrained wrote {sorted(p.name for p in (out / folder).iterdir())}")
    return how


def cases(how: str) -> list[dict]:
    return [
        {"id": "llama-single-bin", "path": "llama_bin", "allow_globals": [], "load_back": "auto_model",
         "fixture": True, "tree": True,
         "about": f"a tiny LlamaForCausalLM from LlamaConfig, {how}: one pytorch_model.bin, no index"},
        {"id": "lora-llama", "path": "lora_llama", "allow_globals": [], "load_back": "peft_llama", "fixture": True,
         "tree": True, "base": "llama_bin",
         "about": "PeftModel.save_pretrained(): adapter_config.json + adapter_model.safetensors + README.md; LoRA "
                  f"r=2 on {LLAMA_TARGETS} of the tiny Llama"},
        {"id": "lora-llama-bin", "path": "lora_llama_bin", "allow_globals": [], "load_back": "peft_llama",
         "fixture": True, "tree": True, "base": "llama_bin",
         "about": "PeftModel.save_pretrained(safe_serialization=False): adapter_config.json + adapter_model.bin"},
        {"id": "lora-unet", "path": "lora_unet", "allow_globals": [], "load_back": "peft_unet", "fixture": True,
         "tree": True, "base": "unet_base",
         "about": f"get_peft_model(UNet2DConditionModel, LoraConfig(target_modules={UNET_TARGETS})).save_pretrained()"
                  ": adapter_config.json + adapter_model.safetensors"},
    ]


# ---------------------------------------------------------------------------------------------- load back


def root_of(case: dict, outputs: dict[str, str]) -> Path:
    """The folder ``write`` wrote into: the input's path less the case's relative path."""
    root = Path(outputs["input"])
    for _part in Path(case["path"]).parts:
        root = root.parent
    return root


def llama_logits(model):  # noqa: ANN001
    import torch

    probe = torch.randint(3, VOCAB, (2, 10), generator=torch.Generator().manual_seed(SEED + 5))
    with torch.no_grad():
        return model.eval()(probe).logits


def hidden_states(model):  # noqa: ANN001
    import torch

    probe = torch.randint(3, VOCAB, (2, 10), generator=torch.Generator().manual_seed(SEED + 5))
    with torch.no_grad():
        return model.eval()(probe).last_hidden_state


def unet_prediction(model):  # noqa: ANN001
    from fw_diffusers import unet_output

    return unet_output(model)


def equal(name: str, got, expected) -> None:  # noqa: ANN001
    import numpy as np
    import torch

    got = got if isinstance(got, np.ndarray) else got.numpy()
    expected = expected if isinstance(expected, np.ndarray) else expected.numpy()
    if got.shape != expected.shape or not np.array_equal(got, expected):
        raise AssertionError(f"{name}: outputs differ from the input's "
                             f"(max abs {float(torch.as_tensor(got - expected).abs().max()):.3g})")


def differ(name: str, adapted, base) -> None:  # noqa: ANN001
    import numpy as np

    if np.array_equal(np.asarray(adapted), np.asarray(base)):
        raise AssertionError(f"{name}: the adapter leaves the base model's outputs unchanged: the check has no teeth")


def load_auto_model(outputs: dict[str, str]) -> str:
    from transformers import AutoModel, AutoModelForCausalLM

    source, converted = Path(outputs["input"]), Path(outputs["safetensors"])
    equal("AutoModelForCausalLM", llama_logits(AutoModelForCausalLM.from_pretrained(converted)),
          llama_logits(AutoModelForCausalLM.from_pretrained(source)))
    equal("AutoModel", hidden_states(AutoModel.from_pretrained(converted)),
          hidden_states(AutoModel.from_pretrained(source)))
    return ("AutoModelForCausalLM.from_pretrained(convert's folder) gives equal logits, AutoModel equal hidden "
            "states")


def load_peft(case: dict, outputs: dict[str, str]) -> str:
    from peft import PeftModel

    base_folder = root_of(case, outputs) / case["base"]
    if case["load_back"] == "peft_llama":
        from transformers import AutoModelForCausalLM

        def base():  # noqa: ANN202
            return AutoModelForCausalLM.from_pretrained(base_folder)

        run, what = llama_logits, "logits"
    else:
        from diffusers import UNet2DConditionModel

        def base():  # noqa: ANN202
            return UNet2DConditionModel.from_pretrained(base_folder)

        run, what = unet_prediction, "noise predictions"
    expected = run(PeftModel.from_pretrained(base(), outputs["input"]))
    differ("input adapter", expected, run(base()))
    equal("safetensors", run(PeftModel.from_pretrained(base(), outputs["safetensors"])), expected)
    checked = ["convert's folder"]
    with tempfile.TemporaryDirectory(prefix="ckptool-fw-peft-") as scratch:
        for name in ("strip", "remap", "pt"):
            if name in outputs:
                folder = adapter_folder(Path(outputs["input"]), Path(outputs[name]), Path(scratch) / name)
                equal(name, run(PeftModel.from_pretrained(base(), folder)), expected)
                checked.append(name)
    return f"PeftModel.from_pretrained(base, ...) gives the input adapter's {what}: " + ", ".join(checked)


def adapter_folder(config_from: Path, weights: Path, into: Path) -> Path:
    """An adapter folder PEFT reads: the input's adapter_config.json beside one of ckptool's single-file outputs,
    under PEFT's own file name."""
    into.mkdir(parents=True)
    shutil.copy2(config_from / "adapter_config.json", into / "adapter_config.json")
    shutil.copy2(weights, into / ("adapter_model" + (".safetensors" if weights.suffix == ".safetensors" else ".bin")))
    return into


def load_back(case: dict, outputs: dict[str, str]) -> str:
    if "safetensors" not in outputs:
        raise AssertionError("no safetensors output to load")
    if case["load_back"] == "auto_model":
        return load_auto_model(outputs)
    if case["load_back"] in ("peft_llama", "peft_unet"):
        return load_peft(case, outputs)
    raise ValueError(f"unknown load_back {case['load_back']!r}")


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "save":
        sys.path.insert(0, str(Path(__file__).resolve().parent))  # fw_diffusers, for the tiny UNet
        print(save(Path(sys.argv[2])))
    else:
        sys.exit("usage: python fw_peft.py save OUT_DIR")
