"""What the other files of a model folder say: configs, tokenizers, model cards, read by their content.

Beside its weights a Hugging Face model folder keeps the files that say what the weights are for: a
diffusers pipeline's ``model_index.json`` (each component a library and a class), a component's or a
transformers model's ``config.json``, a PEFT adapter's ``adapter_config.json`` (type, rank, alpha,
target modules, base model), scheduler, tokenizer, preprocessor and generation configs, a
sentence-transformers ``modules.json``, the model card. :func:`describe_config` describes one such
file in a line plus JSON-able details, importing and running nothing: a JSON file is read only up to
:data:`MAX_JSON_BYTES` and parsed by the json module (nesting too deep for it is a ``RecursionError``,
caught); a binary tokenizer model is described by its first bytes and size. Whatever is damaged,
oversized or of another shape gives a short ``problem``, never an exception. A model card's YAML front
matter is read by a small line parser that takes a few top-level keys (no YAML library, no tags).
Tokenizers, sentence-transformers and model cards are described in :mod:`ckptool.ops.folder_texts`.

Example:
    >>> info = describe_config(Path("lora/adapter_config.json"))   # doctest: +SKIP
    >>> info.summary                                                 # doctest: +SKIP
    'LoRA adapter: rank 8, alpha 16, targets q_proj, v_proj; base model hf-internal-testing/tiny-random-gpt2'
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

from ckptool.base.errors import CkptError
from ckptool.files import inputs
from ckptool.files.byteio import file_size, read_capped
from ckptool.model.describe import human_bytes
from ckptool.ops.folder_texts import (
    Described,
    Malformed,
    an_object,
    count,
    integer,
    joined,
    listed,
    model_card,
    picked,
    plain,
    sentence_transformers,
    short,
    strings,
    tokenizer_json,
    tokenizer_model,
    tokenizer_text,
)
from ckptool.ops.folder_texts import front_matter as front_matter  # imported from here too

MAX_JSON_BYTES = 4 << 20  # a config is a few KB; a tokenizer.json past this is described by its size alone
MAX_TEXT_BYTES = 4 << 20  # the most of a model card, merges.txt or vocab.txt read

PIPELINE_INDEX = "pipeline index"
MODEL_CONFIG = "model config"
ADAPTER_CONFIG = "LoRA adapter config"
SCHEDULER_CONFIG = "scheduler config"
TOKENIZER = "tokenizer"
PREPROCESSOR_CONFIG = "preprocessor config"
GENERATION_CONFIG = "generation config"
SENTENCE_TRANSFORMERS = "sentence-transformers modules"
WEIGHTS_INDEX = "weights index"
README = "README"
WEIGHTS = "weights"
OTHER = "other"

_TOKENIZER_NAMES = """tokenizer_config.json tokenizer.json vocab.json vocab.txt merges.txt special_tokens_map.json
    added_tokens.json spiece.model tokenizer.model sentencepiece.bpe.model chat_template.jinja chat_template.json"""
_PREPROCESSOR_NAMES = "preprocessor_config.json processor_config.json video_preprocessor_config.json"
_SENTENCE_TRANSFORMERS_NAMES = "modules.json config_sentence_transformers.json sentence_bert_config.json"
_KINDS = {
    "model_index.json": PIPELINE_INDEX,
    "config.json": MODEL_CONFIG,
    "adapter_config.json": ADAPTER_CONFIG,
    "scheduler_config.json": SCHEDULER_CONFIG,
    "generation_config.json": GENERATION_CONFIG,
    **dict.fromkeys(_TOKENIZER_NAMES.split(), TOKENIZER),
    **dict.fromkeys(_PREPROCESSOR_NAMES.split(), PREPROCESSOR_CONFIG),
    **dict.fromkeys(_SENTENCE_TRANSFORMERS_NAMES.split(), SENTENCE_TRANSFORMERS),
}
_README_NAMES = {"readme.md", "readme", "model_card.md", "modelcard.md"}
# weights (and pickles) by suffix: the reader's, not described here; a variant sits before the suffix
# (diffusion_pytorch_model.fp16.safetensors)
WEIGHTS_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".pkl", ".msgpack", ".h5", ".onnx", ".gguf")
# LoRA weights by name: diffusers' save_lora_weights (no config beside them) and a PEFT adapter's
LORA_WEIGHTS_NAMES = {
    f"{stem}.{suffix}" for stem in ("pytorch_lora_weights", "adapter_model") for suffix in ("safetensors", "bin")
}
# a component's library besides these is one of diffusers' pipeline modules ("stable_diffusion"), another
# installed library, or a module of the component's own folder (``<component>/<library>.py``: code)
_PIPELINE_LIBRARIES = {"diffusers", "transformers"}
_PEFT_NAMES = {  # PEFT's PeftType as people write it
    "LORA": "LoRA",
    "LOHA": "LoHa",
    "LOKR": "LoKr",
    "ADALORA": "AdaLoRA",
    "VERA": "VeRA",
    "FOURIERFT": "FourierFT",
    "PROMPT_TUNING": "prompt tuning",
    "P_TUNING": "p-tuning",
    "PREFIX_TUNING": "prefix tuning",
}


@dataclass
class ConfigInfo:
    """One non-weight file of a model folder, described from its content.

    Attributes:
        file: the file's name.
        kind: what its name says it is (:func:`kind_of`): ``"pipeline index"``, ``"model config"``,
            ``"LoRA adapter config"``, ``"scheduler config"``, ``"tokenizer"``, ``"preprocessor config"``,
            ``"generation config"``, ``"sentence-transformers modules"``, ``"weights index"``,
            ``"README"`` or ``"other"``.
        summary: one line for people.
        details: the facts behind it, JSON-able (e.g. ``components`` of a pipeline index).
        problem: why the file could not be described (too big, not UTF-8, malformed), else None.
    """

    file: str
    kind: str
    summary: str
    details: dict[str, Any] = field(default_factory=dict)
    problem: str | None = None

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def kind_of(name: str) -> str:
    """What a file of a model folder is, by its name alone (one of the ``kind`` values of
    :class:`ConfigInfo`, or ``"weights"`` for a weights or pickle file by its suffix).

    Example:
        >>> kind_of("model_index.json"), kind_of("diffusion_pytorch_model.fp16.safetensors")
        ('pipeline index', 'weights')
    """
    if name in _KINDS:
        return _KINDS[name]
    if name.lower() in _README_NAMES:
        return README
    if name.endswith(".index.json"):
        return WEIGHTS_INDEX
    if name.lower().endswith(WEIGHTS_SUFFIXES):
        return WEIGHTS
    return OTHER


def is_lora_weights_name(name: str) -> bool:
    """Whether ``name`` is a file name LoRA weights are saved under: diffusers' ``save_lora_weights``
    (``pytorch_lora_weights.safetensors``/``.bin``, which has no config beside it) or a PEFT adapter's
    (``adapter_model.safetensors``/``.bin``, beside its ``adapter_config.json``)."""
    return name in LORA_WEIGHTS_NAMES


def pipeline_components(info: ConfigInfo) -> dict[str, tuple[str | None, str | None]]:
    """A pipeline index's components: name -> (library, class), ``(None, None)`` for one not saved.

    Example:
        >>> pipeline_components(describe_config(Path("sd/model_index.json")))["unet"]   # doctest: +SKIP
        ('diffusers', 'UNet2DConditionModel')
    """
    components = info.details.get("components") if info.kind == PIPELINE_INDEX else None
    if not isinstance(components, dict):
        return {}
    return {name: (pair[0], pair[1]) for name, pair in components.items()}


def pipeline_code_files(info: ConfigInfo) -> list[str]:
    """The files of a pipeline folder that, where they exist, hold code its index names: a custom
    pipeline's module (``_class_name`` ``[module, class]``: ``<module>.py``) and a custom component's
    (``<component>/<library>.py``, which diffusers imports for a library outside diffusers and
    transformers). Paths relative to the folder; the caller checks which exist.
    """
    if info.kind != PIPELINE_INDEX:
        return []
    files = list(info.details.get("custom_code", []))
    for name, (library, _) in pipeline_components(info).items():
        if library is not None and library not in _PIPELINE_LIBRARIES:
            files.append(f"{name}/{library}.py")
    return files


def describe_config(path: Path, *, folder: Path | None = None) -> ConfigInfo | None:
    """Describe a non-weight file of a model folder from its content; never raises for the content.

    Args:
        path: the file (a local path, or a URL's location as :func:`ckptool.files.inputs.location` gives).
        folder: the model folder it belongs to: the file must then lie inside it (or, for a hub cache
            snapshot, inside the repo's ``blobs/``), as every file of a folder input must.

    Returns:
        The description, or None for a directory and for a weights or pickle file (by its suffix:
        :data:`WEIGHTS_SUFFIXES`), which the reader reads. A file that is missing, not a regular file,
        too big, not UTF-8 or malformed gives a description whose ``problem`` says so.
    """
    name = path.name
    kind = kind_of(name)
    if kind == WEIGHTS:
        return None
    try:
        if path.is_dir():
            return None
        opened = inputs.open_member(folder, path, what=name) if folder is not None else inputs.open_regular(path)
        with opened as handle:
            return _describe_open(name, kind, handle)
    except CkptError as e:
        return ConfigInfo(name, kind, f"unreadable: {e.message}", problem=e.message)
    except OSError as e:
        cause = e.strerror or type(e).__name__
        return ConfigInfo(name, kind, f"unreadable: {cause}", problem=f"cannot be read ({cause})")


def _describe_open(name: str, kind: str, handle: BinaryIO) -> ConfigInfo:
    """The file ``name`` of ``kind``, open as ``handle``: read within the bounds, then described."""
    size = file_size(handle)
    if kind == OTHER:
        return ConfigInfo(name, kind, f"file of {human_bytes(size)}", {"bytes": size})
    if name.endswith(".json"):
        raw = read_capped(handle, MAX_JSON_BYTES)
        if raw is None:
            return _too_big(name, kind, size)
        try:
            value = json.loads(raw.decode("utf-8"))
        except UnicodeDecodeError:
            return _problem(name, kind, size, "not UTF-8 text")
        except RecursionError:
            return _problem(name, kind, size, "JSON nested too deeply to be a config")
        except ValueError as e:
            return _problem(name, kind, size, f"not valid JSON ({short(str(e))})")
        return _described(name, kind, size, lambda: _JSON_DESCRIBERS[kind](name, value))
    if name.endswith(".model"):  # binary: its first bytes say which kind, its size the rest
        return ConfigInfo(name, kind, tokenizer_model(handle.read(64), size), {"bytes": size})
    raw = handle.read(MAX_TEXT_BYTES)  # text: as much as the bound allows (a model card's head is what counts)
    complete = len(raw) == size
    text = _utf8(raw, complete)
    if text is None:
        return _problem(name, kind, size, "not UTF-8 text")
    describe = model_card if kind == README else tokenizer_text
    return _described(name, kind, size, lambda: describe(name, text, complete))


def _utf8(raw: bytes, complete: bool) -> str | None:
    """``raw`` as UTF-8 text, or None; the head of a longer file may end inside a character."""
    for cut in range(1 if complete else 4):
        try:
            return raw[: len(raw) - cut].decode("utf-8")
        except UnicodeDecodeError:
            continue
    return None


def _problem(name: str, kind: str, size: int, problem: str) -> ConfigInfo:
    return ConfigInfo(name, kind, problem, {"bytes": size}, problem=problem)


def _described(name: str, kind: str, size: int, describe: Callable[[], Described]) -> ConfigInfo:
    try:
        summary, details = describe()
    except Malformed as e:
        return _problem(name, kind, size, str(e))
    details.setdefault("bytes", size)
    return ConfigInfo(name, kind, summary, details)


def _too_big(name: str, kind: str, size: int) -> ConfigInfo:
    limit = f"{MAX_JSON_BYTES >> 20} MiB"
    if kind == TOKENIZER:  # a large vocabulary is normal (tokenizer.json of 17 MB): described by its size
        return ConfigInfo(name, kind, f"tokenizer file of {human_bytes(size)} (over {limit}: not parsed)")
    return _problem(name, kind, size, f"{human_bytes(size)}, over {limit} — too big for a config, not read")


def _version(config: dict[str, Any], key: str, library: str) -> dict[str, Any]:
    found = config.get(key)
    return {f"{library}_version": found} if isinstance(found, str) else {}


def _version_note(details: dict[str, Any], library: str) -> str:
    found = details.get(f"{library}_version")
    return f" ({library} {short(found, 20)})" if isinstance(found, str) else ""


# ---------------------------------------------------------------------------------------------- diffusers


def _pipeline_index(name: str, value: Any) -> Described:
    index = an_object(name, value)
    pipeline = index.get("_class_name")
    custom: list[str] = []
    if strings(pipeline) and len(pipeline) == 2:  # a custom pipeline: [module file, class] of the folder or hub
        custom.append(f"{pipeline[0]}.py")
        pipeline = f"{pipeline[0]}.{pipeline[1]}"
    if not isinstance(pipeline, str):
        raise Malformed("no _class_name: not a diffusers pipeline index")
    components: dict[str, list[str | None]] = {}
    options: dict[str, Any] = {}
    others: dict[str, None] = {}
    for key, item in index.items():
        if key.startswith("_"):
            continue
        if isinstance(item, list) and len(item) == 2 and all(part is None or isinstance(part, str) for part in item):
            components[key] = [item[0], item[1]]
            if item[0] is not None and item[0] not in _PIPELINE_LIBRARIES:
                others[item[0]] = None
        elif plain(item) is not None:
            options[key] = plain(item)
    details: dict[str, Any] = {"pipeline": plain(pipeline), **_version(index, "_diffusers_version", "diffusers")}
    details.update(components=components, options=options, other_libraries=list(others))
    if custom:
        details["custom_code"] = custom
    saved = [f"{key} {cls}" for key, (_, cls) in components.items() if cls is not None]
    unsaved = [key for key, (_, cls) in components.items() if cls is None]
    summary = f"diffusers pipeline {short(pipeline)}{_version_note(details, 'diffusers')}: {listed(saved) or 'none'}"
    if unsaved:
        summary += f"; not saved: {listed(unsaved)}"
    if custom:
        summary += f"; custom code: {listed(custom)} (runs only when trusted)"
    return summary, details


def _scheduler_config(name: str, value: Any) -> Described:
    config = an_object(name, value)
    cls = config.get("_class_name")
    if not isinstance(cls, str):
        raise Malformed("no _class_name: not a diffusers scheduler config")
    details = {"class": plain(cls), **_version(config, "_diffusers_version", "diffusers")}
    details.update(picked(config, ("num_train_timesteps", "prediction_type", "beta_schedule", "timestep_spacing")))
    parts = []
    steps, prediction = details.get("num_train_timesteps"), details.get("prediction_type")
    if integer(steps):
        parts.append(f"{steps} training timesteps")
    if isinstance(prediction, str):
        parts.append(f"{short(prediction, 20)} prediction")
    return joined(f"diffusers {short(cls)}", parts), details


# ---------------------------------------------------------------------------------------------- models


def _model_config(name: str, value: Any) -> Described:
    config = an_object(name, value)
    cls = config.get("_class_name")
    if isinstance(cls, str):  # a diffusers component (UNet2DConditionModel, AutoencoderKL...)
        component = {"library": "diffusers", "class": plain(cls), **_version(config, "_diffusers_version", "diffusers")}
        return f"diffusers {short(cls)} config" + _version_note(component, "diffusers"), component
    if any(key in config for key in ("model_type", "architectures", "transformers_version")):
        return _transformers_config(config)
    modes = [key.removeprefix("pooling_mode_") for key in config if key.startswith("pooling_mode_")]
    if modes or "pooling_mode" in config:  # a sentence-transformers Pooling module's config (1_Pooling/)
        chosen = [mode for mode in modes if config[f"pooling_mode_{mode}"] is True]
        if isinstance(config.get("pooling_mode"), str):
            chosen = [config["pooling_mode"]]
        details: dict[str, Any] = {"library": "sentence-transformers", "pooling": chosen}
        parts = [", ".join(short(mode, 30) for mode in chosen) or "none"]
        dimension = config.get("word_embedding_dimension", config.get("embedding_dimension"))
        if integer(dimension):
            details["dimension"] = dimension
            parts.append(f"dimension {dimension}")
        return joined("sentence-transformers pooling config", parts), details
    return f"config of another library ({count(len(config), 'key')})", {"library": None, "keys": len(config)}


def _transformers_config(config: dict[str, Any]) -> Described:
    details = {"library": "transformers", **picked(config, ("model_type", "architectures"))}
    dtype = config.get("dtype", config.get("torch_dtype"))  # transformers 5 writes dtype, 4.x torch_dtype
    details.update(_version(config, "transformers_version", "transformers"))
    parts = [short(str(details.get("model_type", "unknown type")), 40)]
    if strings(details.get("architectures")) and details["architectures"]:
        parts.append(listed(details["architectures"]))
    if isinstance(dtype, str):
        details["dtype"] = dtype
        parts.append(short(dtype, 20))
    return "transformers model config: " + ", ".join(parts) + _version_note(details, "transformers"), details


def _preprocessor_config(name: str, value: Any) -> Described:
    config = an_object(name, value)
    keys = ("image_processor_type", "feature_extractor_type", "processor_class", "video_processor_type")
    details = picked(config, keys)
    classes = [details[key] for key in keys if isinstance(details.get(key), str)]
    summary = "preprocessor " + (" / ".join(short(cls, 40) for cls in dict.fromkeys(classes)) or "(no class named)")
    size = config.get("size")  # 224, or {"shortest_edge": 224}, or {"height": 224, "width": 224}
    sides = [size] if integer(size) else list(size.values()) if isinstance(size, dict) else []
    if sides and all(integer(side) for side in sides):
        details["size"] = size
        summary += f", size {short('x'.join(map(str, sides)), 30)}"
    return summary, details


def _generation_config(name: str, value: Any) -> Described:
    config = an_object(name, value)
    keys = ("bos_token_id", "eos_token_id", "pad_token_id", "max_length", "max_new_tokens", "do_sample")
    details = picked(config, (*keys, "temperature", "top_p", "top_k", "transformers_version"))
    parts = [f"{key.removesuffix('_token_id')} {short(str(details[key]), 30)}" for key in keys[:3] if key in details]
    for key in ("max_new_tokens", "max_length"):
        if integer(details.get(key)):
            parts.append(f"{key} {details[key]}")
            break
    if details.get("do_sample") is True:
        parts.append("sampling")
    return joined("generation config", parts), details


# ---------------------------------------------------------------------------------------------- PEFT


def _targets(targets: Any) -> str | None:
    if isinstance(targets, str):
        return targets if targets == "all-linear" else f"by regex {short(targets, 60)}"
    return listed(sorted(targets)) if strings(targets) else None


def _adapter_config(name: str, value: Any) -> Described:
    config = an_object(name, value)
    peft_type = config.get("peft_type")
    if not isinstance(peft_type, str):
        raise Malformed("no peft_type: not a PEFT adapter config")
    keys = ("peft_type", "task_type", "r", "lora_alpha", "alpha", "base_model_name_or_path", "peft_version")
    details = picked(config, keys)
    targets = config.get("target_modules")
    if isinstance(targets, str) or strings(targets):  # a list of module names, or a regex over their paths
        details["target_modules"] = targets
        details["target_modules_regex"] = isinstance(targets, str) and targets != "all-linear"
    if strings(config.get("modules_to_save")):
        details["modules_to_save"] = config["modules_to_save"]
    for flag in ("use_dora", "use_rslora"):
        if isinstance(config.get(flag), bool):
            details[flag] = config[flag]
    for pattern in ("rank_pattern", "alpha_pattern"):  # per-module ranks and alphas
        details[pattern] = isinstance(config.get(pattern), dict) and bool(config[pattern])
    label = _PEFT_NAMES.get(peft_type, short(peft_type, 30)) + (" (DoRA)" if details.get("use_dora") else "")
    parts = []
    if integer(details.get("r")):
        parts.append(f"rank {details['r']}" + (", per-module ranks" if details["rank_pattern"] else ""))
    alpha = details.get("lora_alpha", details.get("alpha"))
    if isinstance(alpha, int | float) and not isinstance(alpha, bool):
        parts.append(f"alpha {alpha:g}" + (", per-module alphas" if details["alpha_pattern"] else ""))
    if integer(config.get("num_virtual_tokens")):
        parts.append(f"{config['num_virtual_tokens']} virtual tokens")
    shown = _targets(targets)
    if shown is not None:
        parts.append(f"targets {shown}")
    if "modules_to_save" in details:
        parts.append(f"also saves {listed(details['modules_to_save'])}")
    summary = joined(f"{label} adapter", parts)
    base = details.get("base_model_name_or_path")
    return summary + (f"; base model {short(base)}" if isinstance(base, str) and base else ""), details


# ---------------------------------------------------------------------------------------------- weights index


def _weights_index(name: str, value: Any) -> Described:
    index = an_object(name, value)
    weight_map = index.get("weight_map")
    if not isinstance(weight_map, dict) or not all(isinstance(item, str) for item in weight_map.values()):
        raise Malformed("no weight_map of tensor names to files — not a weights index")
    shards = sorted(set(weight_map.values()))
    metadata = index.get("metadata")
    total = metadata.get("total_size") if isinstance(metadata, dict) else None
    details: dict[str, Any] = {"tensors": len(weight_map), "shards": shards}
    summary = f"index of {count(len(shards), 'shard')}, {count(len(weight_map), 'tensor')}"
    if integer(total) and total >= 0:
        details["total_size"] = total
        summary += f", {human_bytes(total)}"
    return summary, details


_JSON_DESCRIBERS: dict[str, Callable[[str, Any], Described]] = {
    PIPELINE_INDEX: _pipeline_index,
    MODEL_CONFIG: _model_config,
    ADAPTER_CONFIG: _adapter_config,
    SCHEDULER_CONFIG: _scheduler_config,
    TOKENIZER: tokenizer_json,
    PREPROCESSOR_CONFIG: _preprocessor_config,
    GENERATION_CONFIG: _generation_config,
    SENTENCE_TRANSFORMERS: sentence_transformers,
    WEIGHTS_INDEX: _weights_index,
}
