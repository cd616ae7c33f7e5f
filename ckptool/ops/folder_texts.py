"""Tokenizer files, sentence-transformers module lists and model cards of a model folder, described.

The part of :mod:`ckptool.ops.folder_configs` for these files, with the small value helpers every
description there shares.

Each describer takes what was read (a parsed JSON value, or text) and returns a one-line summary and
JSON-able details, or raises :class:`Malformed` when the content is not of the shape its name
promises. Nothing recurses over the content, so no shape of it can exhaust the stack.
"""

from __future__ import annotations

import math
import re
from typing import Any, TypeGuard

from ckptool.model.describe import human_bytes

LISTED = 6  # names shown in a summary before "and N more"
SHORT = 80  # characters of a value a summary shows
_FRONT_MATTER_KEYS = ("base_model", "library_name", "license", "pipeline_tag", "tags")

Described = tuple[str, dict[str, Any]]


class Malformed(Exception):
    """The content is not of the shape its name promises (the message says how)."""


# ---------------------------------------------------------------------------------------------- values


def short(text: str, limit: int = SHORT) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def plain(value: Any) -> Any:
    """``value`` as details may hold it: a scalar (a non-finite float as text, a long string cut), a
    short list of scalars; None for anything else."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, str):
        return value if len(value) <= 1000 else value[:1000] + "..."
    if isinstance(value, bool | int | float) or value is None:
        return value
    if isinstance(value, list) and len(value) <= 256 and all(isinstance(item, str | int | float) for item in value):
        return [plain(item) for item in value]
    return None


def picked(value: dict[str, Any], keys: tuple[str, ...]) -> dict[str, Any]:
    """The keys of ``value`` among ``keys`` whose values are plain (see :func:`plain`)."""
    return {key: plain(value[key]) for key in keys if key in value and plain(value[key]) is not None}


def listed(names: list[str]) -> str:
    shown = ", ".join(short(str(item), 40) for item in names[:LISTED])
    return shown + (f" and {len(names) - LISTED} more" if len(names) > LISTED else "")


def joined(head: str, parts: list[str]) -> str:
    """``head: part, part``, or ``head`` alone."""
    return head + (": " + ", ".join(parts) if parts else "")


def count(number: int, noun: str) -> str:
    return f"{number} {noun}{'s' * (number != 1)}"


def an_object(name: str, value: Any) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise Malformed(f"JSON, but not an object — not a {name} as its name says")
    return value


def integer(value: Any) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def strings(value: Any) -> TypeGuard[list[str]]:
    return isinstance(value, list) and all(isinstance(item, str) for item in value)


# ---------------------------------------------------------------------------------------------- tokenizers


def _special_token(value: Any) -> str | None:
    if isinstance(value, dict):  # {"content": "<s>", "lstrip": false, ...}: an AddedToken as saved
        value = value.get("content")
    return value if isinstance(value, str) else None


def _tokenizer_config(config: dict[str, Any]) -> Described:
    details = picked(config, ("tokenizer_class", "model_max_length", "padding_side"))
    tokens = {key.removesuffix("_token"): _special_token(config[key]) for key in config if key.endswith("_token")}
    details["special_tokens"] = {key: token for key, token in tokens.items() if token is not None}
    details["chat_template"] = "chat_template" in config
    cls = details.get("tokenizer_class")
    parts = [f"tokenizer {short(cls, 40)}" if isinstance(cls, str) else "tokenizer config (no tokenizer_class)"]
    length = details.get("model_max_length")
    if integer(length) and length < 10**9:  # transformers writes 1e30 for "no limit"
        parts.append(f"max length {length}")
    if details["chat_template"]:
        parts.append("chat template")
    return ", ".join(parts), details


def _tokenizers_file(config: dict[str, Any]) -> Described:
    """``tokenizer.json`` (the tokenizers library's): its model type, vocabulary and added tokens."""
    model = config.get("model")
    kind = model.get("type") if isinstance(model, dict) else None
    vocab = model.get("vocab") if isinstance(model, dict) else None
    added = config.get("added_tokens")
    details: dict[str, Any] = {"model": kind if isinstance(kind, str) else None}
    summary = f"tokenizers {short(kind, 20)} tokenizer" if isinstance(kind, str) else "tokenizers file"
    if isinstance(vocab, dict | list):
        details["vocab_size"] = len(vocab)
        summary += f", vocabulary of {len(vocab)}"
    if isinstance(added, list):
        details["added_tokens"] = len(added)
    return summary, details


def tokenizer_json(name: str, value: Any) -> Described:
    config = an_object(name, value)
    if name == "tokenizer_config.json":
        return _tokenizer_config(config)
    if name == "tokenizer.json":
        return _tokenizers_file(config)
    if name == "special_tokens_map.json":
        named = [key.removesuffix("_token") for key, item in config.items() if _special_token(item) is not None]
        return f"special tokens: {listed(named) or 'none'}", {"special_tokens": named}
    if name == "chat_template.json":
        return "chat template", {"chat_template": isinstance(config.get("chat_template"), str)}
    return f"vocabulary of {count(len(config), 'token')}", {"tokens": len(config)}  # vocab.json, added_tokens.json


def tokenizer_model(head: bytes, size: int) -> str:
    """A ``*.model`` tokenizer by its first bytes: a SentencePiece protobuf starts with its first
    piece's field (0x0a), tiktoken's ranks (Llama 3's ``tokenizer.model``) with base64 and a rank."""
    if head[:1] == b"\n":
        return f"SentencePiece model, {human_bytes(size)}"
    if re.match(rb"[A-Za-z0-9+/=]+ \d+\n", head):
        return f"tiktoken ranks, {human_bytes(size)}"
    return f"tokenizer model of {human_bytes(size)}"


def tokenizer_text(name: str, text: str, complete: bool) -> Described:
    """``merges.txt``, ``vocab.txt`` or ``chat_template.jinja``; ``complete``: the whole file was read."""
    lines = [line for line in text.splitlines() if line.strip()]
    at_least = "" if complete else "at least "
    if name == "merges.txt":
        merges = [line for line in lines if not line.startswith("#version")]
        return f"{at_least}{count(len(merges), 'BPE merge')}", {"merges": len(merges), "complete": complete}
    if name == "vocab.txt":
        return f"vocabulary of {at_least}{count(len(lines), 'token')}", {"tokens": len(lines), "complete": complete}
    return f"chat template, {count(len(lines), 'line')}", {"lines": len(lines)}


# ---------------------------------------------------------------------------------------------- sentence-transformers


def sentence_transformers(name: str, value: Any) -> Described:
    if name == "modules.json":
        return _modules(value)
    config = an_object(name, value)
    if name == "sentence_bert_config.json":
        details = picked(config, ("max_seq_length", "do_lower_case"))
        length = details.get("max_seq_length")
        return joined(
            "sentence-transformers Transformer module config", [f"max_seq_length {length}"] if integer(length) else []
        ), details
    details = picked(config, ("model_type", "default_prompt_name", "similarity_fn_name"))
    versions = config.get("__version__")
    if isinstance(versions, dict):
        details["versions"] = {key: item for key, item in versions.items() if isinstance(item, str)}
    prompts = config.get("prompts")
    details["prompts"] = sorted(prompts) if isinstance(prompts, dict) else []
    version = details.get("versions", {}).get("sentence_transformers")
    summary = "sentence-transformers config" + (f" ({short(version, 20)})" if isinstance(version, str) else "")
    parts = []
    similarity = details.get("similarity_fn_name")
    if isinstance(similarity, str):
        parts.append(f"similarity {short(similarity, 20)}")
    if details["prompts"]:
        parts.append(f"prompts {listed(details['prompts'])}")
    return joined(summary, parts), details


def _modules(value: Any) -> Described:
    """``modules.json``: the modules run in order, each with its folder (``""``: the root) and class."""
    if not isinstance(value, list) or not all(isinstance(item, dict) for item in value):
        raise Malformed("not a list of modules — not a sentence-transformers modules.json")
    modules = []
    for item in value:
        path, kind = item.get("path"), item.get("type")
        if not isinstance(path, str) or not isinstance(kind, str):
            raise Malformed("a module without a path and type — not a sentence-transformers modules.json")
        if path.startswith(("/", "\\")) or ".." in re.split(r"[/\\]", path):
            raise Malformed(f"module path {short(path, 40)!r} leads out of the folder")
        modules.append({"idx": plain(item.get("idx")), "name": plain(item.get("name")), "path": path, "type": kind})
    # a type outside the library is a module of the folder or of another hub repo: code, loaded only when trusted
    custom = [module["type"] for module in modules if not module["type"].startswith("sentence_transformers.")]
    shown = [f"{module['type'].rpartition('.')[2]} ({module['path'] or 'root'})" for module in modules]
    summary = "sentence-transformers modules: " + (listed(shown) or "none")
    if custom:
        summary += f"; custom code: {listed(custom)} (runs only when trusted)"
    return summary, {"modules": modules, "custom_code": custom}


# ---------------------------------------------------------------------------------------------- model cards


def model_card(name: str, text: str, complete: bool) -> Described:
    """A model card (``README.md``): a few keys of its YAML front matter and its first heading."""
    lines = text.splitlines()
    details: dict[str, Any] = {}
    body = 0
    if lines and lines[0].strip() == "---":
        end = next((index for index, line in enumerate(lines[1:], 1) if line.strip() in ("---", "...")), None)
        if end is None:
            raise Malformed("front matter is not closed by a --- line" + ("" if complete else " in its first 4 MiB"))
        details.update(front_matter(lines[1:end]))
        body = end + 1
    title = _first_heading(lines[body:])
    if title is not None:
        details["title"] = title
    parts = []
    for key, label in (("library_name", "library"), ("license", "license"), ("base_model", "base model")):
        found = details.get(key)
        shown = listed(found) if isinstance(found, list) else found
        if shown:
            parts.append(f"{label} {short(shown)}")
    return joined(f"model card {short(title)!r}" if title else "model card (no heading)", parts), details


def _first_heading(lines: list[str]) -> str | None:
    fenced = False
    for line in lines:
        stripped = line.strip()
        if stripped.startswith(("```", "~~~")):
            fenced = not fenced
        elif not fenced and re.match(r"#{1,6}\s+\S", stripped):
            return stripped.lstrip("#").strip().rstrip("#").strip()
    return None


def front_matter(lines: list[str]) -> dict[str, Any]:
    """``base_model``, ``library_name``, ``license``, ``pipeline_tag`` and ``tags`` from a model card's
    YAML front matter (the lines between its ``---`` lines), each a string or a list of strings.

    A line parser, not YAML: ``key: value`` at the start of a line (quotes removed), ``key: [a, b]``,
    or ``key:`` followed by ``- item`` lines. Other keys and deeper structure are skipped; nothing
    is built from tags.

    Example:
        >>> front_matter(["license: apache-2.0", "base_model:", "- stabilityai/sdxl", "tags: [lora]"])
        {'license': 'apache-2.0', 'base_model': ['stabilityai/sdxl'], 'tags': ['lora']}
    """
    found: dict[str, Any] = {}
    key: str | None = None  # the key whose "- item" lines follow
    for line in lines:
        item = re.match(r"\s*-\s+(.*)$", line)
        if key is not None and item:
            found.setdefault(key, []).append(_yaml_scalar(item.group(1)))
            continue
        key = None
        pair = re.match(r"([A-Za-z_][\w-]*):(?:\s+(.*))?$", line.rstrip())
        if not pair or pair.group(1) not in _FRONT_MATTER_KEYS:
            continue
        name, value = pair.group(1), (pair.group(2) or "").strip()
        if not value:
            key = name
        elif value.startswith("[") and value.endswith("]"):
            found[name] = [_yaml_scalar(part) for part in value[1:-1].split(",") if part.strip()]
        else:
            found[name] = _yaml_scalar(value)
    return found


def _yaml_scalar(text: str) -> str:
    text = text.strip()
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"":
        return short(text[1:-1], 200)
    return short(re.sub(r"\s+#.*$", "", text), 200)  # an unquoted value's comment dropped
