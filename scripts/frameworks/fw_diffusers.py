"""diffusers: a tiny Stable Diffusion pipeline (UNet, VAE, CLIP text encoder, tokenizer, scheduler) built from
configs, saved by ``save_pretrained`` (safetensors, ``safe_serialization=False``, an ``fp16`` variant beside the
fp32 weights), one UNet saved alone as a ``.bin``, and a training folder as diffusers' text-to-image example
leaves it (accelerate ``save_state`` with the example's hooks: ``unet/`` and ``unet_ema/`` by ``save_pretrained``).

Imported only inside the frameworks venv (see README.md beside this file). No hub: every part is built from a
config and a hand-written vocabulary; the driver sets ``HF_HUB_OFFLINE=1``.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

SEED = 0
PROMPT = "a red cat"
SIZE = 8  # image height and width: the VAE has one block (no downsampling), the UNet two
STEPS = 2  # denoising steps of the load-back comparison
TRAIN_STEPS = 2
COMPONENTS = ("unet", "vae", "text_encoder")  # the pipeline's parts that hold weights
IMAGE_TOLERANCE = 1e-6
LORA_TARGETS = ["to_q", "to_k", "to_v", "to_out.0"]


# ---------------------------------------------------------------------------------------------- the tiny parts


def unet_config() -> dict:
    return {"sample_size": SIZE, "in_channels": 4, "out_channels": 4, "block_out_channels": (4, 8),
            "layers_per_block": 1, "cross_attention_dim": 8, "attention_head_dim": 2, "norm_num_groups": 2,
            "down_block_types": ("CrossAttnDownBlock2D", "DownBlock2D"),
            "up_block_types": ("UpBlock2D", "CrossAttnUpBlock2D")}


def small_unet_config() -> dict:
    """The training folder's UNet: one cross-attention block and no middle block, so that it, its EMA copy and
    AdamW's state (three records per parameter, each a zip member) fit a fixture."""
    return {**unet_config(), "block_out_channels": (4,), "down_block_types": ("CrossAttnDownBlock2D",),
            "up_block_types": ("CrossAttnUpBlock2D",), "mid_block_type": None, "time_embedding_dim": 8}


def tiny_unet(config: dict | None = None):
    import torch
    from diffusers import UNet2DConditionModel

    torch.manual_seed(SEED)
    return UNet2DConditionModel(**(config or unet_config()))


def tiny_vae():
    import torch
    from diffusers import AutoencoderKL

    torch.manual_seed(SEED + 1)
    return AutoencoderKL(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",),
                         up_block_types=("UpDecoderBlock2D",), block_out_channels=(4,), layers_per_block=1,
                         latent_channels=4, norm_num_groups=2, sample_size=SIZE)


def vocabulary() -> dict[str, int]:
    """CLIP's byte-level BPE vocabulary cut down to lowercase letters, alone and word-final, and its two specials."""
    letters = "abcdefghijklmnopqrstuvwxyz"
    tokens = ["<|startoftext|>", "<|endoftext|>", *letters, *(letter + "</w>" for letter in letters)]
    return {token: index for index, token in enumerate(tokens)}


def tiny_tokenizer():
    from transformers import CLIPTokenizer

    with tempfile.TemporaryDirectory(prefix="ckptool-fw-clip-vocab-") as scratch:
        vocab, merges = Path(scratch) / "vocab.json", Path(scratch) / "merges.txt"
        vocab.write_text(json.dumps(vocabulary()))
        merges.write_text("#version: 0.2\n")  # no merges: every word is spelled letter by letter
        return CLIPTokenizer(str(vocab), str(merges), model_max_length=16)


def tiny_text_encoder():
    import torch
    from transformers import CLIPTextConfig, CLIPTextModel

    torch.manual_seed(SEED + 2)
    config = CLIPTextConfig(vocab_size=len(vocabulary()), hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                            num_attention_heads=2, max_position_embeddings=16, projection_dim=8, bos_token_id=0,
                            eos_token_id=1, pad_token_id=1)
    return CLIPTextModel(config)


def tiny_pipeline():
    from diffusers import PNDMScheduler, StableDiffusionPipeline

    return StableDiffusionPipeline(vae=tiny_vae(), text_encoder=tiny_text_encoder(), tokenizer=tiny_tokenizer(),
                                   unet=tiny_unet(), scheduler=PNDMScheduler(skip_prk_steps=True, steps_offset=1),
                                   safety_checker=None, feature_extractor=None, requires_safety_checker=False)


def text_encoder_as_bin(folder: Path) -> str:
    """``text_encoder/pytorch_model.bin`` as transformers 4.x wrote it for ``safe_serialization=False``: transformers
    5 writes safetensors only (and still reads ``.bin``), so the hub library's own torch save writes it instead."""
    from huggingface_hub import save_torch_state_dict
    from transformers import CLIPTextModel

    encoder = folder / "text_encoder"
    if (encoder / "pytorch_model.bin").exists():
        return "the text encoder's save_pretrained wrote pytorch_model.bin"
    state_dict = CLIPTextModel.from_pretrained(encoder).state_dict()
    for stale in encoder.glob("model*.safetensors*"):
        stale.unlink()
    save_torch_state_dict(state_dict, encoder, safe_serialization=False)
    if not (encoder / "pytorch_model.bin").is_file():
        raise RuntimeError(f"save_torch_state_dict wrote {sorted(p.name for p in encoder.iterdir())}")
    return ("text_encoder/pytorch_model.bin by huggingface_hub.save_torch_state_dict(safe_serialization=False) "
            "(transformers 5 writes no .bin)")


# ---------------------------------------------------------------------------------------------- training folder


def train(out: Path) -> Path:
    """A few steps of diffusers' examples/text_to_image/train_text_to_image.py, on one CPU process: the UNet
    trained with AdamW, an ``EMAModel`` of it, and ``accelerator.save_state`` with the example's hooks, which write
    ``unet/`` and ``unet_ema/`` by ``save_pretrained`` instead of accelerate's ``model.safetensors``."""
    import torch
    from accelerate import Accelerator
    from accelerate.utils import set_seed
    from diffusers import DDPMScheduler, UNet2DConditionModel
    from diffusers.optimization import get_scheduler
    from diffusers.training_utils import EMAModel
    from torch.nn import functional as F

    accelerator = Accelerator(cpu=True)
    set_seed(SEED)
    unet = tiny_unet(small_unet_config())
    ema_unet = EMAModel(tiny_unet(small_unet_config()).parameters(), model_cls=UNet2DConditionModel,
                        model_config=unet.config)
    register_hooks(accelerator, ema_unet)
    noise_scheduler = DDPMScheduler()
    optimizer = torch.optim.AdamW(unet.parameters(), lr=1e-3)
    lr_scheduler = get_scheduler("constant", optimizer=optimizer)
    unet, optimizer, lr_scheduler = accelerator.prepare(unet, optimizer, lr_scheduler)
    generator = torch.Generator().manual_seed(SEED)
    for _ in range(TRAIN_STEPS):
        latents = torch.randn(2, 4, SIZE, SIZE, generator=generator)
        text_states = torch.randn(2, 4, 8, generator=generator)
        noise = torch.randn(latents.shape, generator=generator)
        timesteps = torch.randint(0, noise_scheduler.config.num_train_timesteps, (2,), generator=generator)
        noisy = noise_scheduler.add_noise(latents, noise, timesteps)
        loss = F.mse_loss(unet(noisy, timesteps, text_states).sample, noise)
        accelerator.backward(loss)
        optimizer.step()
        lr_scheduler.step()
        optimizer.zero_grad()
        ema_unet.step(unet.parameters())
    checkpoint = out / "train" / f"checkpoint-{TRAIN_STEPS}"
    accelerator.save_state(str(checkpoint))
    accelerator.end_training()
    return checkpoint


def register_hooks(accelerator, ema_unet) -> None:  # noqa: ANN001
    """The example's save and load hooks (diffusers examples/text_to_image/train_text_to_image.py, use_ema)."""
    from diffusers import UNet2DConditionModel
    from diffusers.training_utils import EMAModel

    def save_model_hook(models, weights, output_dir):  # noqa: ANN001, ANN202
        if accelerator.is_main_process:
            ema_unet.save_pretrained(os.path.join(output_dir, "unet_ema"))
            for model in models:
                model.save_pretrained(os.path.join(output_dir, "unet"))
                weights.pop()  # accelerate then saves no model.safetensors of its own

    def load_model_hook(models, input_dir):  # noqa: ANN001, ANN202
        loaded = EMAModel.from_pretrained(os.path.join(input_dir, "unet_ema"), UNet2DConditionModel)
        ema_unet.load_state_dict(loaded.state_dict())
        del loaded
        for _ in range(len(models)):
            model = models.pop()
            loaded = UNet2DConditionModel.from_pretrained(input_dir, subfolder="unet")
            model.register_to_config(**loaded.config)
            model.load_state_dict(loaded.state_dict())
            del loaded

    accelerator.register_save_state_pre_hook(save_model_hook)
    accelerator.register_load_state_pre_hook(load_model_hook)


def save_lora(out: Path) -> None:
    """A UNet LoRA as diffusers' examples/text_to_image/train_text_to_image_lora.py saves it: ``unet.add_adapter``,
    then ``StableDiffusionPipeline.save_lora_weights`` (``pytorch_lora_weights.safetensors``, or ``.bin``)."""
    import torch
    from diffusers import StableDiffusionPipeline
    from diffusers.utils import convert_state_dict_to_diffusers
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict

    unet = tiny_unet()
    torch.manual_seed(SEED + 3)
    # init_lora_weights=False: random up and down weights, so that a loaded LoRA changes the images
    unet.add_adapter(LoraConfig(r=2, lora_alpha=4, init_lora_weights=False, target_modules=LORA_TARGETS))
    layers = convert_state_dict_to_diffusers(get_peft_model_state_dict(unet))
    StableDiffusionPipeline.save_lora_weights(out / "lora", unet_lora_layers=layers)
    StableDiffusionPipeline.save_lora_weights(out / "lora_bin", unet_lora_layers=layers, safe_serialization=False)


# ---------------------------------------------------------------------------------------------- write


def write(out: Path) -> list[dict]:
    import torch

    tiny_pipeline().save_pretrained(out / "pipeline")
    tiny_pipeline().save_pretrained(out / "pipeline_bin", safe_serialization=False)
    how_bin = text_encoder_as_bin(out / "pipeline_bin")
    tiny_unet().save_pretrained(out / "unet_bin", safe_serialization=False)
    tiny_pipeline().save_pretrained(out / "pipeline_variants")
    tiny_pipeline().to(torch.float16).save_pretrained(out / "pipeline_variants", variant="fp16")
    checkpoint = train(out).relative_to(out)
    save_lora(out)
    for folder in ("pipeline", "pipeline_bin", "pipeline_variants"):
        missing = [name for name in COMPONENTS if not any((out / folder / name).glob("*model*"))]
        if missing:
            raise RuntimeError(f"{folder}: save_pretrained wrote no weights for {missing}")
    variants = sorted(p.name for p in (out / "pipeline_variants" / "unet").iterdir())
    if "diffusion_pytorch_model.fp16.safetensors" not in variants:
        raise RuntimeError(f"save_pretrained(variant='fp16') wrote {variants}")
    components = list(COMPONENTS)
    return [
        {"id": "pipeline-safetensors", "path": "pipeline", "allow_globals": [], "load_back": "pipeline",
         "weights": components, "fixture": True,
         "about": "StableDiffusionPipeline.save_pretrained(): model_index.json, unet/ vae/ text_encoder/ with "
                  "config and .safetensors, tokenizer/, scheduler/"},
        {"id": "pipeline-bin", "path": "pipeline_bin", "allow_globals": [], "load_back": "pipeline",
         "weights": components, "fixture": True,
         "about": "StableDiffusionPipeline.save_pretrained(safe_serialization=False): unet/ and vae/ "
                  f"diffusion_pytorch_model.bin; {how_bin}"},
        {"id": "unet-bin", "path": "unet_bin", "allow_globals": [], "load_back": "unet",
         "tree": True,
         "about": "UNet2DConditionModel.save_pretrained(safe_serialization=False): config.json + one "
                  "diffusion_pytorch_model.bin, no index"},
        {"id": "pipeline-variants", "path": "pipeline_variants", "allow_globals": [], "load_back": "pipeline",
         "weights": components, "fixture": True,
         "about": "save_pretrained() then .to(float16).save_pretrained(variant='fp16') into the same folder: "
                  "diffusion_pytorch_model.safetensors and diffusion_pytorch_model.fp16.safetensors side by side"},
        {"id": "pipeline-variants-fp16", "path": "pipeline_variants", "allow_globals": [], "load_back": "pipeline",
         "weights": components, "variant": "fp16", "fixture": True,
         "about": "the same folder read with --variant fp16: the float16 weights"},
        {"id": "lora-weights", "path": "lora", "allow_globals": [], "load_back": "load_lora_weights",
         "fixture": True, "tree": True,
         "about": "StableDiffusionPipeline.save_lora_weights(unet_lora_layers=...) of a UNet LoRA (add_adapter, "
                  f"{LORA_TARGETS}), as train_text_to_image_lora.py saves it: one pytorch_lora_weights.safetensors"},
        {"id": "lora-weights-bin", "path": "lora_bin", "allow_globals": [], "load_back": "load_lora_weights",
         "fixture": True, "tree": True,
         "about": "the same, save_lora_weights(safe_serialization=False): one pytorch_lora_weights.bin"},
        {"id": "training-checkpoint", "path": str(checkpoint), "allow_globals": [], "load_back": "load_state",
         "weights": ["unet", "unet_ema"], "fixture": True,
         "about": "diffusers' train_text_to_image.py checkpoint: accelerate save_state() with the example's hooks "
                  "(unet/ and unet_ema/ by save_pretrained, EMAModel), optimizer.bin (AdamW), scheduler.bin, "
                  "random_states_0.pkl"},
    ]


# ---------------------------------------------------------------------------------------------- load back


def images(folder: Path, variant: str | None):
    """The pipeline in ``folder`` run for STEPS denoising steps on PROMPT with a seeded generator: an array."""
    import torch
    from diffusers import DiffusionPipeline

    dtype = torch.float16 if variant == "fp16" else torch.float32
    pipe = DiffusionPipeline.from_pretrained(folder, variant=variant, torch_dtype=dtype)
    pipe.set_progress_bar_config(disable=True)
    with torch.no_grad():
        return pipe(PROMPT, num_inference_steps=STEPS, generator=torch.Generator().manual_seed(SEED),
                    output_type="np", height=SIZE, width=SIZE).images


def same_array(name: str, got, expected) -> None:  # noqa: ANN001
    import numpy as np

    if got.shape != expected.shape:
        raise AssertionError(f"{name}: output shape {got.shape}, the input's {expected.shape}")
    difference = float(np.abs(got.astype("float64") - expected.astype("float64")).max())
    if difference > IMAGE_TOLERANCE:
        raise AssertionError(f"{name}: outputs differ from the input's by up to {difference:.3g}")


def unet_output(model):  # noqa: ANN001
    """The UNet's noise prediction on seeded latents, timestep and text states."""
    import torch

    generator = torch.Generator().manual_seed(SEED + 7)
    latents = torch.randn(1, 4, SIZE, SIZE, generator=generator).to(model.dtype)
    states = torch.randn(1, 4, model.config.cross_attention_dim, generator=generator).to(model.dtype)
    with torch.no_grad():
        return model.eval()(latents, 10, states).sample.float().numpy()


def unet_folder(config_from: Path, weights: Path, into: Path) -> Path:
    """A folder ``UNet2DConditionModel.from_pretrained`` reads: the input's config.json beside one of ckptool's
    single-file outputs, under diffusers' own file name."""
    import shutil

    into.mkdir(parents=True, exist_ok=True)
    shutil.copy2(config_from / "config.json", into / "config.json")
    name = "diffusion_pytorch_model" + (".safetensors" if weights.suffix == ".safetensors" else ".bin")
    shutil.copy2(weights, into / name)
    return into


def load_unet_outputs(source: Path, outputs: dict[str, str], suffix: str = "") -> list[str]:
    """Every single-file output of the UNet (strip, add-prefix's round trip, remap, convert back to .pt) loaded by
    ``from_pretrained`` beside the input's config, its prediction equal to the input's."""
    from diffusers import UNet2DConditionModel

    expected = unet_output(UNet2DConditionModel.from_pretrained(source))
    checked = []
    with tempfile.TemporaryDirectory(prefix="ckptool-fw-diffusers-") as scratch:
        for name in ("strip", "remap", "pt"):
            if f"{name}{suffix}" not in outputs:
                continue
            built = unet_folder(source, Path(outputs[f"{name}{suffix}"]), Path(scratch) / name)
            same_array(f"{name}{suffix}", unet_output(UNet2DConditionModel.from_pretrained(built)), expected)
            checked.append(f"{name}{suffix}")
    return checked


def load_pipeline(case: dict, outputs: dict[str, str]) -> str:
    source, converted = Path(outputs["input"]), Path(outputs["safetensors"])
    variant = case.get("variant")
    same_array("safetensors", images(converted, variant), images(source, variant))
    loaded = [f"variant={variant!r}" if variant else "default"]
    if variant is None and "fp16" in {p.name.split(".")[1] for p in converted.glob("*/*.*.safetensors")}:
        same_array("safetensors (variant fp16)", images(converted, "fp16"), images(source, "fp16"))
        loaded.append("variant='fp16'")
    leftover = sorted(str(p.relative_to(converted)) for p in converted.rglob("*.bin"))
    if leftover:
        raise AssertionError(f"convert left pickled weights in its output: {leftover}")
    checked = load_unet_outputs(source / "unet", outputs, ":unet") if variant is None else []
    return (f"DiffusionPipeline.from_pretrained(convert's folder; {' and '.join(loaded)}) gives the input's "
            f"images ({STEPS} steps, seeded)"
            + (f"; UNet from_pretrained equal: {', '.join(checked)}" if checked else ""))


def load_training_folder(outputs: dict[str, str]) -> str:
    """Resume from ckptool's converted folder as the example does (``accelerator.load_state`` with its hooks), and
    from the input: the UNet, its EMA copy, AdamW's state and the schedule equal."""
    import torch
    from diffusers import UNet2DConditionModel

    source, converted = Path(outputs["input"]), Path(outputs["safetensors"])
    for part in ("unet", "unet_ema"):
        same_array(f"{part}/ from_pretrained", unet_output(UNet2DConditionModel.from_pretrained(converted / part)),
                   unet_output(UNet2DConditionModel.from_pretrained(source / part)))
    resumed, original = resume(converted), resume(source)
    untrained = tiny_unet(small_unet_config()).state_dict()
    if torch.equal(flat(original[0]), flat(untrained)):
        raise AssertionError("load_state of the input restored no trained weights: the check has no teeth")
    for name, got, expected in zip(("unet", "unet_ema", "optimizer", "scheduler"), resumed, original):
        if skeleton(got) != skeleton(expected) or not torch.equal(flat(got), flat(expected)):
            raise AssertionError(f"load_state of the converted folder: {name} differs from the input's")
    return ("accelerator.load_state(convert's folder) with the example's hooks resumes the same UNet, EMA, AdamW "
            "state and schedule; unet/ and unet_ema/ from_pretrained give equal predictions")


def resume(folder: Path) -> tuple:
    """What ``accelerator.load_state(folder)`` restores, as the example sets training up."""
    import torch
    from accelerate import Accelerator
    from diffusers import UNet2DConditionModel
    from diffusers.optimization import get_scheduler
    from diffusers.training_utils import EMAModel

    accelerator = Accelerator(cpu=True)
    unet = tiny_unet(small_unet_config())
    ema_unet = EMAModel(tiny_unet(small_unet_config()).parameters(), model_cls=UNet2DConditionModel,
                        model_config=unet.config)
    register_hooks(accelerator, ema_unet)
    optimizer = torch.optim.AdamW(unet.parameters(), lr=1e-3)
    lr_scheduler = get_scheduler("constant", optimizer=optimizer)
    unet, optimizer, lr_scheduler = accelerator.prepare(unet, optimizer, lr_scheduler)
    accelerator.load_state(str(folder))
    state = accelerator.unwrap_model(unet).state_dict()
    result = ({k: v.clone() for k, v in state.items()}, [p.clone() for p in ema_unet.shadow_params],
              optimizer.state_dict(), lr_scheduler.state_dict())
    accelerator.end_training()
    return result


def skeleton(value):  # noqa: ANN001, ANN201
    """A nested state with every tensor replaced by its dtype and shape: its structure and plain values."""
    import torch

    if isinstance(value, torch.Tensor):
        return ("tensor", str(value.dtype), tuple(value.shape))
    if isinstance(value, dict):
        return {str(key): skeleton(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [skeleton(item) for item in value]
    return value


def flat(value):  # noqa: ANN001, ANN201
    """Every tensor in a nested state, concatenated: one comparison."""
    import torch

    tensors: list = []

    def walk(item) -> None:  # noqa: ANN001
        if isinstance(item, torch.Tensor):
            tensors.append(item.detach().float().reshape(-1))
        elif isinstance(item, dict):
            for key in sorted(item, key=str):
                walk(item[key])
        elif isinstance(item, (list, tuple)):
            for element in item:
                walk(element)

    walk(value)
    return torch.cat(tensors) if tensors else torch.zeros(0)


def lora_images(folder: Path | None, weight_name: str | None = None):  # noqa: ANN201
    """The tiny pipeline with the LoRA in ``folder`` loaded (None: none), run as :func:`images` runs it."""
    import torch

    pipe = tiny_pipeline()
    pipe.set_progress_bar_config(disable=True)
    if folder is not None:
        pipe.load_lora_weights(str(folder), weight_name=weight_name)
    with torch.no_grad():
        return pipe(PROMPT, num_inference_steps=STEPS, generator=torch.Generator().manual_seed(SEED),
                    output_type="np", height=SIZE, width=SIZE).images


def load_lora(outputs: dict[str, str]) -> str:
    """``load_lora_weights`` of convert's folder, and of each single-file output, gives the input LoRA's images."""
    import numpy as np

    expected = lora_images(Path(outputs["input"]))
    if np.array_equal(expected, lora_images(None)):
        raise AssertionError("the LoRA leaves the images unchanged: the check has no teeth")
    same_array("safetensors", lora_images(Path(outputs["safetensors"])), expected)
    checked = ["convert's folder"]
    for name in ("strip", "remap", "pt"):
        if name in outputs:
            path = Path(outputs[name])
            same_array(name, lora_images(path.parent, path.name), expected)
            checked.append(name)
    return f"load_lora_weights gives the input LoRA's images ({STEPS} steps, seeded): " + ", ".join(checked)


def load_back(case: dict, outputs: dict[str, str]) -> str:
    if "safetensors" not in outputs:
        raise AssertionError("no safetensors output to load")
    if case["load_back"] == "load_lora_weights":
        return load_lora(outputs)
    if case["load_back"] == "pipeline":
        return load_pipeline(case, outputs)
    if case["load_back"] == "load_state":
        return load_training_folder(outputs)
    if case["load_back"] == "unet":
        from diffusers import UNet2DConditionModel

        source, converted = Path(outputs["input"]), Path(outputs["safetensors"])
        same_array("safetensors", unet_output(UNet2DConditionModel.from_pretrained(converted)),
                   unet_output(UNet2DConditionModel.from_pretrained(source)))
        checked = ["safetensors", *load_unet_outputs(source, outputs)]
        return "UNet2DConditionModel.from_pretrained gives equal predictions: " + ", ".join(checked)
    raise ValueError(f"unknown load_back {case['load_back']!r}")
