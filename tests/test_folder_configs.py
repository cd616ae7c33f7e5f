"""The non-weight files of model folders, described from their content (ckptool.ops.folder_configs).

The file contents are the shapes the libraries write: diffusers 0.42.1's ``save_pretrained`` of a tiny
StableDiffusionPipeline, PEFT 0.21.2's ``save_pretrained`` of a LoRA and a DoRA adapter, transformers
5.24.0's configs (all made in the frameworks venv), Stable Diffusion v1.5's hub ``model_index.json`` and
CLIP preprocessor config, and sentence-transformers' documented ``modules.json`` and
``config_sentence_transformers.json``. Damaged, oversized, deeply nested and odd-shaped files must give
a ``problem`` (or a plain description), never an exception.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from ckptool.ops import folder_configs
from ckptool.ops.folder_configs import (
    ConfigInfo,
    describe_config,
    front_matter,
    is_lora_weights_name,
    kind_of,
    pipeline_code_files,
    pipeline_components,
)

# diffusers 0.42.1: StableDiffusionPipeline(...).save_pretrained(...) with no safety checker
SD_MODEL_INDEX = {
    "_class_name": "StableDiffusionPipeline",
    "_diffusers_version": "0.42.1",
    "feature_extractor": [None, None],
    "image_encoder": [None, None],
    "requires_safety_checker": False,
    "safety_checker": [None, None],
    "scheduler": ["diffusers", "PNDMScheduler"],
    "text_encoder": ["transformers", "CLIPTextModel"],
    "tokenizer": ["transformers", "CLIPTokenizer"],
    "unet": ["diffusers", "UNet2DConditionModel"],
    "vae": ["diffusers", "AutoencoderKL"],
}
# the hub's stable-diffusion-v1-5: the safety checker's library is a diffusers pipeline module
SD15_MODEL_INDEX = {
    "_class_name": "StableDiffusionPipeline",
    "_diffusers_version": "0.6.0",
    "feature_extractor": ["transformers", "CLIPImageProcessor"],
    "safety_checker": ["stable_diffusion", "StableDiffusionSafetyChecker"],
    "scheduler": ["diffusers", "PNDMScheduler"],
    "text_encoder": ["transformers", "CLIPTextModel"],
    "tokenizer": ["transformers", "CLIPTokenizer"],
    "unet": ["diffusers", "UNet2DConditionModel"],
    "vae": ["diffusers", "AutoencoderKL"],
}
SCHEDULER_CONFIG = {
    "_class_name": "PNDMScheduler",
    "_diffusers_version": "0.42.1",
    "beta_end": 0.012,
    "beta_schedule": "scaled_linear",
    "beta_start": 0.00085,
    "num_train_timesteps": 1000,
    "prediction_type": "epsilon",
    "set_alpha_to_one": False,
    "skip_prk_steps": True,
    "steps_offset": 1,
    "timestep_spacing": "leading",
    "trained_betas": None,
}
VAE_CONFIG = {
    "_class_name": "AutoencoderKL",
    "_diffusers_version": "0.42.1",
    "act_fn": "silu",
    "block_out_channels": [4],
    "down_block_types": ["DownEncoderBlock2D"],
    "force_upcast": True,
    "in_channels": 3,
    "latent_channels": 4,
    "latents_mean": None,
    "latents_std": None,
    "layers_per_block": 1,
    "mid_block_add_attention": True,
    "norm_num_groups": 4,
    "out_channels": 3,
    "sample_size": 32,
    "scaling_factor": 0.18215,
    "shift_factor": None,
    "up_block_types": ["UpDecoderBlock2D"],
    "use_post_quant_conv": True,
    "use_quant_conv": True,
}


def peft_lora(**changes: Any) -> dict[str, Any]:
    """adapter_config.json as PEFT 0.21.2's save_pretrained writes a LoRA's (every key it writes)."""
    config = {
        "alora_invocation_tokens": None,
        "alpha_pattern": {},
        "arrow_config": None,
        "auto_mapping": None,
        "base_model_name_or_path": "hf-internal-testing/tiny-random-LlamaForCausalLM",
        "bias": "none",
        "corda_config": None,
        "ensure_weight_tying": False,
        "eva_config": None,
        "exclude_modules": None,
        "fan_in_fan_out": False,
        "inference_mode": True,
        "init_lora_weights": True,
        "kasa_config": None,
        "layer_replication": None,
        "layers_pattern": None,
        "layers_to_transform": None,
        "loftq_config": {},
        "lora_alpha": 16,
        "lora_bias": False,
        "lora_dropout": 0.05,
        "lora_ga_config": None,
        "megatron_config": None,
        "megatron_core": "megatron.core",
        "modules_to_save": None,
        "monteclora_config": None,
        "peft_type": "LORA",
        "peft_version": "0.21.2",
        "qalora_group_size": 16,
        "r": 8,
        "rank_pattern": {},
        "revision": None,
        "target_modules": ["v_proj", "q_proj"],  # PEFT saves a set: any order
        "target_parameters": None,
        "task_type": "CAUSAL_LM",
        "trainable_token_indices": None,
        "use_bdlora": None,
        "use_dora": False,
        "use_qalora": False,
        "use_rslora": False,
        "velora_config": None,
    }
    config.update(changes)
    return config


def write(folder: Path, name: str, content: Any) -> Path:
    path = folder / name
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(content, bytes):
        path.write_bytes(content)
    elif isinstance(content, str):
        path.write_text(content, encoding="utf-8")
    else:
        path.write_text(json.dumps(content, indent=2), encoding="utf-8")
    return path


def described(folder: Path, name: str, content: Any) -> ConfigInfo:
    info = describe_config(write(folder, name, content))
    assert info is not None
    json.dumps(info.to_json(), allow_nan=False)  # --json ready: plain JSON, no NaN
    return info


# ---------------------------------------------------------------------------------------------- names


@pytest.mark.parametrize(
    ("name", "kind"),
    [
        ("model_index.json", "pipeline index"),
        ("config.json", "model config"),
        ("adapter_config.json", "LoRA adapter config"),
        ("scheduler_config.json", "scheduler config"),
        ("tokenizer_config.json", "tokenizer"),
        ("tokenizer.json", "tokenizer"),
        ("vocab.json", "tokenizer"),
        ("merges.txt", "tokenizer"),
        ("special_tokens_map.json", "tokenizer"),
        ("spiece.model", "tokenizer"),
        ("preprocessor_config.json", "preprocessor config"),
        ("generation_config.json", "generation config"),
        ("modules.json", "sentence-transformers modules"),
        ("config_sentence_transformers.json", "sentence-transformers modules"),
        ("README.md", "README"),
        ("readme.md", "README"),
        ("model.safetensors.index.json", "weights index"),
        ("diffusion_pytorch_model.fp16.safetensors", "weights"),
        ("pytorch_model.bin", "weights"),
        (".gitattributes", "other"),
        ("LICENSE.txt", "other"),
    ],
)
def test_kind_by_name(name: str, kind: str) -> None:
    assert kind_of(name) == kind


def test_lora_weights_names() -> None:
    assert is_lora_weights_name("pytorch_lora_weights.safetensors")  # diffusers' save_lora_weights: no config
    assert is_lora_weights_name("pytorch_lora_weights.bin")
    assert is_lora_weights_name("adapter_model.safetensors")  # PEFT's, beside adapter_config.json
    assert not is_lora_weights_name("diffusion_pytorch_model.safetensors")
    assert not is_lora_weights_name("lora.safetensors")  # a name anyone may choose says nothing


def test_weights_and_directories_are_not_described(tmp_path: Path) -> None:
    assert describe_config(write(tmp_path, "model.safetensors", b"\x08\x00\x00\x00\x00\x00\x00\x00{}      ")) is None
    assert describe_config(write(tmp_path, "pytorch_lora_weights.safetensors", b"x")) is None
    (tmp_path / "unet").mkdir()
    assert describe_config(tmp_path / "unet") is None


# ---------------------------------------------------------------------------------------------- diffusers


def test_pipeline_index_as_diffusers_saves_it(tmp_path: Path) -> None:
    info = described(tmp_path, "model_index.json", SD_MODEL_INDEX)
    assert (info.kind, info.problem) == ("pipeline index", None)
    assert info.summary == (
        "diffusers pipeline StableDiffusionPipeline (diffusers 0.42.1): scheduler PNDMScheduler, "
        "text_encoder CLIPTextModel, tokenizer CLIPTokenizer, unet UNet2DConditionModel, vae AutoencoderKL; "
        "not saved: feature_extractor, image_encoder, safety_checker"
    )
    assert pipeline_components(info) == {
        "feature_extractor": (None, None),
        "image_encoder": (None, None),
        "safety_checker": (None, None),
        "scheduler": ("diffusers", "PNDMScheduler"),
        "text_encoder": ("transformers", "CLIPTextModel"),
        "tokenizer": ("transformers", "CLIPTokenizer"),
        "unet": ("diffusers", "UNet2DConditionModel"),
        "vae": ("diffusers", "AutoencoderKL"),
    }
    assert info.details["pipeline"] == "StableDiffusionPipeline"
    assert info.details["diffusers_version"] == "0.42.1"
    assert info.details["options"] == {"requires_safety_checker": False}  # not a component
    assert pipeline_code_files(info) == []


def test_pipeline_component_from_another_library_names_where_its_code_would_be(tmp_path: Path) -> None:
    info = described(tmp_path, "model_index.json", SD15_MODEL_INDEX)
    assert pipeline_components(info)["safety_checker"] == ("stable_diffusion", "StableDiffusionSafetyChecker")
    assert info.details["other_libraries"] == ["stable_diffusion"]
    # diffusers imports safety_checker/stable_diffusion.py when it exists (custom code), else its own module
    assert pipeline_code_files(info) == ["safety_checker/stable_diffusion.py"]
    assert "custom code" not in info.summary  # it is diffusers' own pipeline module on the hub


def test_custom_pipeline_class_is_code(tmp_path: Path) -> None:
    index = {**SD_MODEL_INDEX, "_class_name": ["pipeline", "MyPipeline"]}
    info = described(tmp_path, "model_index.json", index)
    assert info.details["pipeline"] == "pipeline.MyPipeline"
    assert info.details["custom_code"] == ["pipeline.py"]
    assert "custom code: pipeline.py (runs only when trusted)" in info.summary
    assert pipeline_code_files(info) == ["pipeline.py"]


def test_pipeline_index_without_class_is_a_problem(tmp_path: Path) -> None:
    info = described(tmp_path, "model_index.json", {"unet": ["diffusers", "UNet2DConditionModel"]})
    assert info.problem == "no _class_name: not a diffusers pipeline index"
    assert pipeline_components(info) == {}


def test_diffusers_component_config(tmp_path: Path) -> None:
    info = described(tmp_path, "vae/config.json", VAE_CONFIG)
    assert info.summary == "diffusers AutoencoderKL config (diffusers 0.42.1)"
    assert info.details["library"] == "diffusers" and info.details["class"] == "AutoencoderKL"


def test_scheduler_config(tmp_path: Path) -> None:
    info = described(tmp_path, "scheduler/scheduler_config.json", SCHEDULER_CONFIG)
    assert info.summary == "diffusers PNDMScheduler: 1000 training timesteps, epsilon prediction"
    assert info.details["class"] == "PNDMScheduler" and info.details["num_train_timesteps"] == 1000


def test_preprocessor_config_of_stable_diffusion(tmp_path: Path) -> None:
    config = {  # stable-diffusion-v1-5's feature_extractor/preprocessor_config.json
        "crop_size": {"height": 224, "width": 224},
        "do_center_crop": True,
        "do_convert_rgb": True,
        "do_normalize": True,
        "do_rescale": True,
        "do_resize": True,
        "feature_extractor_type": "CLIPFeatureExtractor",
        "image_mean": [0.48145466, 0.4578275, 0.40821073],
        "image_processor_type": "CLIPImageProcessor",
        "image_std": [0.26862954, 0.26130258, 0.27577711],
        "resample": 3,
        "rescale_factor": 0.00392156862745098,
        "size": {"shortest_edge": 224},
    }
    info = described(tmp_path, "feature_extractor/preprocessor_config.json", config)
    assert info.summary == "preprocessor CLIPImageProcessor / CLIPFeatureExtractor, size 224"
    assert info.details["image_processor_type"] == "CLIPImageProcessor"


# ---------------------------------------------------------------------------------------------- PEFT


def test_lora_adapter_config(tmp_path: Path) -> None:
    info = described(tmp_path, "adapter_config.json", peft_lora())
    assert info.kind == "LoRA adapter config"
    assert info.summary == (
        "LoRA adapter: rank 8, alpha 16, targets q_proj, v_proj; "
        "base model hf-internal-testing/tiny-random-LlamaForCausalLM"
    )
    assert info.details == {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": 8,
        "lora_alpha": 16,
        "base_model_name_or_path": "hf-internal-testing/tiny-random-LlamaForCausalLM",
        "peft_version": "0.21.2",
        "target_modules": ["v_proj", "q_proj"],
        "target_modules_regex": False,
        "use_dora": False,
        "use_rslora": False,
        "rank_pattern": False,
        "alpha_pattern": False,
        "bytes": info.details["bytes"],
    }


def test_dora_adapter_with_regex_targets_and_rank_pattern(tmp_path: Path) -> None:
    config = peft_lora(  # PEFT 0.21.2's save of LoraConfig(r=4, target_modules=r".*\.c_attn", use_dora=True, ...)
        r=4,
        lora_alpha=8,
        target_modules=r".*\.c_attn",
        use_dora=True,
        rank_pattern={"h.0.attn.c_attn": 2},
        base_model_name_or_path=None,
        task_type=None,
        modules_to_save=["lm_head"],
    )
    info = described(tmp_path, "adapter_config.json", config)
    assert info.summary == (
        r"LoRA (DoRA) adapter: rank 4, per-module ranks, alpha 8, targets by regex .*\.c_attn, also saves lm_head"
    )
    assert info.details["target_modules_regex"] is True
    assert info.details["rank_pattern"] is True and info.details["alpha_pattern"] is False
    assert info.details["modules_to_save"] == ["lm_head"]
    assert "base_model_name_or_path" not in info.details  # null: no base model recorded


def test_other_peft_types(tmp_path: Path) -> None:
    loha = {"peft_type": "LOHA", "r": 8, "alpha": 8, "target_modules": ["to_k", "to_q"], "task_type": None}
    assert (
        described(tmp_path, "a/adapter_config.json", loha).summary
        == "LoHa adapter: rank 8, alpha 8, targets to_k, to_q"
    )
    prompt = {
        "peft_type": "PROMPT_TUNING",
        "num_virtual_tokens": 20,
        "base_model_name_or_path": "bigscience/bloomz-560m",
        "task_type": "CAUSAL_LM",
    }
    info = described(tmp_path, "b/adapter_config.json", prompt)
    assert info.summary == "prompt tuning adapter: 20 virtual tokens; base model bigscience/bloomz-560m"
    assert described(tmp_path, "c/adapter_config.json", {"peft_type": "NEW_METHOD"}).summary == "NEW_METHOD adapter"
    linear = described(tmp_path, "d/adapter_config.json", peft_lora(target_modules="all-linear"))
    assert "targets all-linear;" in linear.summary and linear.details["target_modules_regex"] is False


def test_adapter_config_without_peft_type_is_a_problem(tmp_path: Path) -> None:
    info = described(tmp_path, "adapter_config.json", {"r": 8, "lora_alpha": 16})
    assert info.problem == "no peft_type: not a PEFT adapter config"


# ---------------------------------------------------------------------------------------------- transformers


def test_transformers_config_from_the_framework_fixture(repo_root: Path) -> None:
    path = repo_root / "fixtures/frameworks/transformers/save-pretrained-sharded-bin/save_pretrained_bin/config.json"
    info = describe_config(path)
    assert info is not None and info.problem is None
    assert info.summary == "transformers model config: gpt2, GPT2LMHeadModel, float32 (transformers 5.24.0)"
    assert info.details["model_type"] == "gpt2" and info.details["architectures"] == ["GPT2LMHeadModel"]


def test_transformers_4_config_says_torch_dtype(tmp_path: Path) -> None:
    config = {
        "_name_or_path": "bert-base-uncased",
        "architectures": ["BertModel"],
        "hidden_size": 384,
        "model_type": "bert",
        "torch_dtype": "float16",
        "transformers_version": "4.43.4",
    }
    info = described(tmp_path, "config.json", config)
    assert info.summary == "transformers model config: bert, BertModel, float16 (transformers 4.43.4)"
    assert info.details["dtype"] == "float16"


def test_sentence_transformers_pooling_config(tmp_path: Path) -> None:
    config = {  # all-MiniLM-L6-v2's 1_Pooling/config.json
        "word_embedding_dimension": 384,
        "pooling_mode_cls_token": False,
        "pooling_mode_mean_tokens": True,
        "pooling_mode_max_tokens": False,
        "pooling_mode_mean_sqrt_len_tokens": False,
        "pooling_mode_weightedmean_tokens": False,
        "pooling_mode_lasttoken": False,
        "include_prompt": True,
    }
    info = described(tmp_path, "1_Pooling/config.json", config)
    assert info.summary == "sentence-transformers pooling config: mean_tokens, dimension 384"
    other = described(tmp_path, "x/config.json", {"hidden": 3, "layers": 2})
    assert other.summary == "config of another library (2 keys)" and other.problem is None


def test_generation_config(tmp_path: Path) -> None:
    config = {  # transformers 5.24.0, GPT2LMHeadModel.save_pretrained
        "_from_model_config": True,
        "bos_token_id": 50256,
        "eos_token_id": 50256,
        "output_attentions": False,
        "output_hidden_states": False,
        "transformers_version": "5.24.0",
        "use_cache": True,
    }
    assert described(tmp_path, "generation_config.json", config).summary == "generation config: bos 50256, eos 50256"
    sampling = {"do_sample": True, "eos_token_id": [128001, 128009], "max_new_tokens": 256, "temperature": 0.6}
    info = described(tmp_path, "g/generation_config.json", sampling)
    assert info.summary == "generation config: eos [128001, 128009], max_new_tokens 256, sampling"


# ---------------------------------------------------------------------------------------------- tokenizers


def test_tokenizer_files(tmp_path: Path) -> None:
    config = {  # transformers 5.24.0, CLIPTokenizer.save_pretrained
        "backend": "tokenizers",
        "bos_token": "<|startoftext|>",
        "eos_token": "<|endoftext|>",
        "model_max_length": 1000000000000000019884624838656,
        "pad_token": "<|endoftext|>",
        "tokenizer_class": "CLIPTokenizer",
        "unk_token": "<|endoftext|>",
    }
    info = described(tmp_path, "tokenizer_config.json", config)
    assert info.summary == "tokenizer CLIPTokenizer"  # 1e30: transformers' "no limit"
    assert info.details["special_tokens"] == {
        "bos": "<|startoftext|>",
        "eos": "<|endoftext|>",
        "pad": "<|endoftext|>",
        "unk": "<|endoftext|>",
    }
    chat = {
        "tokenizer_class": "LlamaTokenizerFast",
        "model_max_length": 131072,
        "bos_token": {"content": "<s>", "lstrip": False, "normalized": False, "rstrip": False, "single_word": False},
        "chat_template": "{% for message in messages %}{{ message['content'] }}{% endfor %}",
    }
    info = described(tmp_path, "l/tokenizer_config.json", chat)
    assert info.summary == "tokenizer LlamaTokenizerFast, max length 131072, chat template"
    assert info.details["special_tokens"] == {"bos": "<s>"}
    tokenizer = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [{"id": 0, "content": "<|startoftext|>", "special": True}],
        "normalizer": {"type": "NFC"},
        "model": {"type": "BPE", "dropout": None, "vocab": {"a": 0, "b": 1, "ab</w>": 2}, "merges": [["a", "b</w>"]]},
    }
    info = described(tmp_path, "tokenizer.json", tokenizer)
    assert info.summary == "tokenizers BPE tokenizer, vocabulary of 3"
    assert info.details["added_tokens"] == 1
    assert described(tmp_path, "vocab.json", {"a": 0, "b": 1}).summary == "vocabulary of 2 tokens"
    assert described(tmp_path, "merges.txt", "#version: 0.2\na b</w>\nc d\n").summary == "2 BPE merges"
    assert described(tmp_path, "vocab.txt", "[PAD]\n[UNK]\nthe\n").summary == "vocabulary of 3 tokens"
    specials = {"bos_token": "<s>", "eos_token": {"content": "</s>"}, "additional_special_tokens": ["<x>"]}
    assert described(tmp_path, "special_tokens_map.json", specials).summary == "special tokens: bos, eos"


def test_tokenizer_models_by_their_first_bytes(tmp_path: Path) -> None:
    piece = b"\n\x0b\n\x05<unk>\x15\x00\x00\x00\x00\x18\x02" + bytes(100)  # SentencePiece's ModelProto
    assert described(tmp_path, "spiece.model", piece).summary == "SentencePiece model, 116 B"
    ranks = b"IQ== 0\nIg== 1\nIw== 2\n"  # Llama 3's tokenizer.model: tiktoken's base64 ranks
    assert described(tmp_path, "tokenizer.model", ranks).summary == "tiktoken ranks, 21 B"


def test_big_tokenizer_json_is_described_by_its_size(tmp_path: Path) -> None:
    big = b'{"model": {"type": "BPE", "vocab": {' + b'"t": 0, ' * 600_000 + b'"u": 1}}}'
    info = described(tmp_path, "tokenizer.json", big)
    assert info.problem is None and "over 4 MiB: not parsed" in info.summary


# ---------------------------------------------------------------------------------------------- sentence-transformers


def test_sentence_transformers_modules(tmp_path: Path) -> None:
    modules = [  # all-MiniLM-L6-v2 as SentenceTransformer.save_pretrained writes it
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"},
    ]
    info = described(tmp_path, "modules.json", modules)
    assert info.summary == (
        "sentence-transformers modules: Transformer (root), Pooling (1_Pooling), Normalize (2_Normalize)"
    )
    assert [module["path"] for module in info.details["modules"]] == ["", "1_Pooling", "2_Normalize"]
    assert info.details["custom_code"] == []
    custom = [*modules[:1], {"idx": 1, "name": "1", "path": "1_Decay", "type": "decay_pooling.DecayMeanPooling"}]
    info = described(tmp_path, "c/modules.json", custom)
    assert info.details["custom_code"] == ["decay_pooling.DecayMeanPooling"]
    assert info.summary.endswith("; custom code: decay_pooling.DecayMeanPooling (runs only when trusted)")


@pytest.mark.parametrize("path", ["../outside", "/etc", "a/../../b", "..\\x"])
def test_module_path_leading_out_of_the_folder_is_a_problem(tmp_path: Path, path: str) -> None:
    modules = [{"idx": 0, "name": "0", "path": path, "type": "sentence_transformers.models.Dense"}]
    info = described(tmp_path, "modules.json", modules)
    assert info.problem is not None and "leads out of the folder" in info.problem


def test_sentence_transformers_config(tmp_path: Path) -> None:
    config = {
        "__version__": {"sentence_transformers": "3.0.1", "transformers": "4.43.4", "pytorch": "2.5.0"},
        "prompts": {},
        "default_prompt_name": None,
        "similarity_fn_name": None,
    }
    info = described(tmp_path, "config_sentence_transformers.json", config)
    assert info.summary == "sentence-transformers config (3.0.1)"
    assert info.details["versions"]["transformers"] == "4.43.4"
    prompted = {
        **config,
        "prompts": {"s2p_query": "Instruct: ", "s2s_query": "Similar: "},
        "similarity_fn_name": "cosine",
    }
    info = described(tmp_path, "p/config_sentence_transformers.json", prompted)
    assert info.summary == "sentence-transformers config (3.0.1): similarity cosine, prompts s2p_query, s2s_query"
    bert = described(tmp_path, "sentence_bert_config.json", {"max_seq_length": 256, "do_lower_case": False})
    assert bert.summary == "sentence-transformers Transformer module config: max_seq_length 256"


# ---------------------------------------------------------------------------------------------- README, index, other


MODEL_CARD = """---
language:
- en
license: apache-2.0   # the card's licence
library_name: sentence-transformers
tags:
- sentence-transformers
- feature-extraction
base_model:
- "sentence-transformers/all-MiniLM-L6-v2"
widget:
- source_sentence: 'a: b'
pipeline_tag: sentence-similarity
---

<!-- generated -->
```python
# not a heading: code
```

# SentenceTransformer based on sentence-transformers/all-MiniLM-L6-v2

## Model Details
"""


def test_model_card(tmp_path: Path) -> None:
    info = described(tmp_path, "README.md", MODEL_CARD)
    assert info.kind == "README"
    assert info.details["title"] == "SentenceTransformer based on sentence-transformers/all-MiniLM-L6-v2"
    assert info.details["license"] == "apache-2.0"
    assert info.details["library_name"] == "sentence-transformers"
    assert info.details["base_model"] == ["sentence-transformers/all-MiniLM-L6-v2"]
    assert info.details["tags"] == ["sentence-transformers", "feature-extraction"]
    assert info.details["pipeline_tag"] == "sentence-similarity"
    assert info.summary == (
        "model card 'SentenceTransformer based on sentence-transformers/all-MiniLM-L6-v2': library "
        "sentence-transformers, license apache-2.0, base model sentence-transformers/all-MiniLM-L6-v2"
    )
    peft_card = "---\nbase_model: ''\nlibrary_name: peft\n---\n\n# Model Card for Model ID\n"  # PEFT 0.21.2
    assert described(tmp_path, "p/README.md", peft_card).summary == "model card 'Model Card for Model ID': library peft"
    assert described(tmp_path, "n/README.md", "no heading at all\n").summary == "model card (no heading)"
    unclosed = described(tmp_path, "u/README.md", "---\nlicense: mit\n# Title\n")
    assert unclosed.problem == "front matter is not closed by a --- line"


def test_front_matter_parser_builds_nothing_from_tags() -> None:
    lines = ["license: !!python/object/apply:os.system ['echo hi']", "base_model: [a/b, 'c/d']", "tags:", "  - x"]
    assert front_matter(lines) == {
        "license": "!!python/object/apply:os.system ['echo hi']",  # text, as written
        "base_model": ["a/b", "c/d"],
        "tags": ["x"],
    }


def test_weights_index_from_the_sharded_fixture(repo_root: Path) -> None:
    info = describe_config(repo_root / "fixtures/sharded/model.safetensors.index.json")
    assert info is not None and info.kind == "weights index" and info.problem is None
    assert info.details["shards"] == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    assert info.summary.startswith("index of 2 shards, 8 tensors")


def test_other_files_by_size(tmp_path: Path) -> None:
    info = described(tmp_path, ".gitattributes", "*.safetensors filter=lfs diff=lfs merge=lfs -text\n")
    assert (info.kind, info.summary, info.details) == ("other", "file of 50 B", {"bytes": 50})


# ---------------------------------------------------------------------------------------------- damaged inputs


@pytest.mark.parametrize(
    ("content", "problem"),
    [
        (b'{"_class_name": "UNet2DConditionModel",', "not valid JSON"),
        (b"\xff\xfe{}", "not UTF-8 text"),
        (b"[" * 100_000 + b"]" * 100_000, "JSON nested too deeply to be a config"),
        (b'{"a": ' * 50_000 + b"1" + b"}" * 50_000, "JSON nested too deeply to be a config"),
        (b"[1, 2]", "JSON, but not an object"),
        (b'{"n": 1' + b"0" * 5000 + b"}", "not valid JSON"),  # past Python's int digits limit
    ],
)
def test_damaged_json_gives_a_problem(tmp_path: Path, content: bytes, problem: str) -> None:
    info = described(tmp_path, "config.json", content)
    assert info.problem is not None and info.problem.startswith(problem), info.problem
    assert info.summary == info.problem and len(info.summary) < 200


def test_oversized_config_is_not_read(tmp_path: Path) -> None:
    path = write(tmp_path, "model_index.json", b'{"_class_name": "X", "pad": "' + b"x" * (5 << 20) + b'"}')
    info = describe_config(path)
    assert info is not None and info.problem == "5.2 MB, over 4 MiB — too big for a config, not read"


def test_missing_fifo_and_outside_files_are_problems(tmp_path: Path) -> None:
    missing = describe_config(tmp_path / "config.json")
    assert missing is not None and missing.problem is not None and "does not exist" in missing.problem
    os.mkfifo(tmp_path / "model_index.json")  # a FIFO is never opened for reading (that would block)
    fifo = describe_config(tmp_path / "model_index.json")
    assert fifo is not None and fifo.problem is not None and "a FIFO" in fifo.problem
    outside = write(tmp_path, "elsewhere/secret.json", {"_class_name": "X"})
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "scheduler_config.json").symlink_to(outside)
    linked = describe_config(folder / "scheduler_config.json", folder=folder)
    assert linked is not None and linked.problem is not None and "outside" in linked.problem
    assert describe_config(folder / "scheduler_config.json") is not None  # named by the user: followed


ODD_VALUES = [None, True, 0, -1, 1.5, float("nan"), "", "x" * 2000, [], [None, {}], {}, {"content": 3}, [["a"]]]


@pytest.mark.parametrize("name", sorted(n for n, kind in folder_configs._KINDS.items() if n.endswith(".json")))
def test_odd_values_never_raise(tmp_path: Path, name: str) -> None:
    """Every key a describer reads, given every kind of JSON value: a description, never an exception."""
    keys = [
        *("_class_name", "_diffusers_version", "unet", "model_type", "architectures", "dtype", "torch_dtype"),
        *("transformers_version", "pooling_mode", "pooling_mode_mean_tokens", "word_embedding_dimension"),
        *("peft_type", "r", "lora_alpha", "alpha", "target_modules", "modules_to_save", "rank_pattern"),
        *("use_dora", "num_virtual_tokens", "base_model_name_or_path", "num_train_timesteps", "prediction_type"),
        *("tokenizer_class", "model_max_length", "bos_token", "chat_template", "model", "added_tokens", "size"),
        *("image_processor_type", "eos_token_id", "max_new_tokens", "max_length", "do_sample", "__version__"),
        *("prompts", "similarity_fn_name", "max_seq_length", "weight_map", "metadata"),
    ]
    base = {"_class_name": "X", "peft_type": "LORA"}
    for index, value in enumerate(ODD_VALUES):
        for key in keys:
            folder = tmp_path / f"{index}-{key}"
            described(folder, name, {**base, key: value})
        described(tmp_path / f"top-{index}", name, value)
        described(tmp_path / f"list-{index}", name, [{"path": value, "type": value}])
