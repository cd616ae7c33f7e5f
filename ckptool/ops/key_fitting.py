"""Fitting a checkpoint's keys to a model's, and saying why they do not fit.

:func:`best_rewrite` tries the key rewrites a training run makes necessary (strip
``module.``/``_orig_mod.``/``model.``, add the prefix the model's own keys carry) and keeps the one
that matches most keys with equal shapes. When nothing fits, :func:`diagnose` builds a
:class:`LoadDiagnosis` — what is missing, unexpected or of another shape, grouped by module, the
likely cause, and the command that fixes it — which :class:`LoadMismatchError` carries.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ckptool import formats
from ckptool.base import suggest
from ckptool.base.errors import CkptError
from ckptool.model.keys import COMPILE_PREFIX, DDP_PREFIX, LIGHTNING_PREFIX, WRAPPER_PREFIXES, detect_prefix

if TYPE_CHECKING:  # pragma: no cover - typing only; torch is imported lazily at run time
    from torch import nn

WRAPPER_NAMES = {
    DDP_PREFIX: "DataParallel/DDP",
    COMPILE_PREFIX: "torch.compile",
    LIGHTNING_PREFIX: "Lightning",
}
# a module path deeper than this is grouped under its first components ("layer1.0.conv1" -> "layer1.0")
GROUP_DEPTH = 2
# below this share of the model's keys found with the right shape, the checkpoint is another architecture
ARCHITECTURE_THRESHOLD = 0.5


# ---------------------------------------------------------------------------------------------- key fitting


@dataclass(frozen=True)
class KeyRewrite:
    """Strip ``strip`` from the keys that carry it, then put ``add`` in front of every key."""

    strip: str = ""
    add: str = ""

    @property
    def is_identity(self) -> bool:
        return not self.strip and not self.add

    def apply(self, key: str) -> str:
        if self.strip and key.startswith(self.strip):
            key = key[len(self.strip) :]
        return self.add + key

    def describe(self) -> str:
        """``strip "module."``, ``add "module."``, both, or ``keys as stored``."""
        parts = []
        if self.strip:
            parts.append(f'strip "{self.strip}"')
        if self.add:
            parts.append(f'add "{self.add}"')
        return " and ".join(parts) or "keys as stored"


@dataclass
class ShapeMismatch:
    """A key both sides have, with different shapes."""

    key: str
    checkpoint_shape: tuple[int, ...]
    model_shape: tuple[int, ...]

    def to_json(self) -> dict[str, Any]:
        return {"key": self.key, "checkpoint_shape": list(self.checkpoint_shape), "model_shape": list(self.model_shape)}


@dataclass
class KeyMatch:
    """How a checkpoint's keys, rewritten by ``rewrite``, meet a model's keys."""

    rewrite: KeyRewrite
    matched: int
    missing: list[str]
    unexpected: list[str]
    mismatched: list[ShapeMismatch]

    @property
    def fits(self) -> bool:
        return not self.missing and not self.unexpected and not self.mismatched


def match_keys(
    checkpoint_shapes: Mapping[str, tuple[int, ...]],
    model_shapes: Mapping[str, tuple[int, ...]],
    rewrite: KeyRewrite = KeyRewrite(),
) -> KeyMatch | None:
    """Compare keys after ``rewrite``; None if the rewrite maps two checkpoint keys onto one."""
    renamed: dict[str, tuple[int, ...]] = {}
    for key, shape in checkpoint_shapes.items():
        new_key = rewrite.apply(key)
        if new_key in renamed:
            return None
        renamed[new_key] = shape
    missing = [key for key in model_shapes if key not in renamed]
    unexpected = [key for key in renamed if key not in model_shapes]
    mismatched = [
        ShapeMismatch(key, renamed[key], model_shapes[key])
        for key in model_shapes
        if key in renamed and tuple(renamed[key]) != tuple(model_shapes[key])
    ]
    matched = sum(1 for key in model_shapes if key in renamed) - len(mismatched)
    return KeyMatch(rewrite, matched, missing, unexpected, mismatched)


def _stack_parts(stack: str) -> list[str]:
    """``"module._orig_mod."`` -> ``["module.", "module._orig_mod."]``."""
    parts, current = [], ""
    for piece in stack.split(".")[:-1]:
        current += piece + "."
        parts.append(current)
    return parts


def candidate_rewrites(checkpoint_prefix: str, model_prefix: str) -> list[KeyRewrite]:
    """The rewrites worth trying, simplest first (the order breaks ties)."""
    strips = ["", checkpoint_prefix, *_stack_parts(checkpoint_prefix), *WRAPPER_PREFIXES]
    adds = ["", model_prefix, *_stack_parts(model_prefix), DDP_PREFIX]
    seen: list[KeyRewrite] = []
    for add in adds:
        for strip in strips:
            rewrite = KeyRewrite(strip, add)
            if rewrite not in seen:
                seen.append(rewrite)
    return sorted(seen, key=lambda r: bool(r.strip) + bool(r.add))


def best_rewrite(
    checkpoint_shapes: Mapping[str, tuple[int, ...]],
    model_shapes: Mapping[str, tuple[int, ...]],
    *,
    checkpoint_prefix: str = "",
) -> KeyMatch:
    """The rewrite that makes most of the model's keys present with equal shapes.

    Example:
        >>> best_rewrite({"module.fc.weight": (2, 3)}, {"fc.weight": (2, 3)}).rewrite.describe()
        'strip "module."'
    """
    model_prefix = detect_prefix(model_shapes, lightning=True)
    best: KeyMatch | None = None
    for rewrite in candidate_rewrites(checkpoint_prefix, model_prefix):
        match = match_keys(checkpoint_shapes, model_shapes, rewrite)
        if match is None:
            continue
        score = (match.matched, -len(match.mismatched), -len(match.unexpected))
        if best is None or score > (best.matched, -len(best.mismatched), -len(best.unexpected)):
            best = match
    assert best is not None  # the identity rewrite never collides (keys of a dict are unique)
    return best


# ---------------------------------------------------------------------------------------------- diagnosis


def module_of(key: str, depth: int = GROUP_DEPTH) -> str:
    """The module a key belongs to, cut to ``depth`` components: ``layer1.0.conv1.weight`` -> ``layer1.0``."""
    parts = key.split(".")[:-1]
    return ".".join(parts[:depth]) or "(top level)"


def group_by_module(keys: Iterable[str]) -> dict[str, list[str]]:
    """Keys grouped by :func:`module_of`, in first-seen order."""
    groups: dict[str, list[str]] = {}
    for key in keys:
        groups.setdefault(module_of(key), []).append(key)
    return groups


def _wrappers(stack: str) -> str:
    return " + ".join(WRAPPER_NAMES.get(part, part) for part in (p + "." for p in stack.rstrip(".").split(".")))


def _shape(shape: tuple[int, ...]) -> str:
    return "[" + ", ".join(str(d) for d in shape) + "]"


def fix_command(
    path: Path, rewrite: KeyRewrite, *, checkpoint_prefix: str, format_: str, allow_globals: Sequence[str] = ()
) -> str:
    """The ckptool command(s) that apply ``rewrite`` to the file at ``path`` (read with ``allow_globals``)."""
    suffix = formats.for_name(format_).default_suffix
    commands = []
    source = path
    if rewrite.strip:
        target = suggest.sibling(path, "stripped", suffix)
        commands.append(
            suggest.command(
                "strip",
                source,
                out=target,
                prefix=rewrite.strip if rewrite.strip != checkpoint_prefix else None,
                allow_globals=list(allow_globals),
            )
        )
        source = target
    if rewrite.add:
        commands.append(
            suggest.command(
                "add-prefix",
                source,
                out=suggest.sibling(path, "prefixed", suffix),
                prefix=rewrite.add,
                allow_globals=list(allow_globals),
            )
        )
    return suggest.each(commands)


@dataclass
class LoadDiagnosis:
    """Why a checkpoint does not load into a model, and what fixes it.

    Attributes:
        path: the checkpoint.
        model: the model's class name (``LeNet``, ``DataParallel(LeNet)``).
        cause: ``prefix`` (a wrapper stack on one side), ``head`` (only the last layer's shape differs),
            ``architecture`` (another network), ``partial`` (some keys missing or extra).
        problem: one sentence saying what is wrong.
        fix: the next step — a command where one exists.
        rewrite: the key rewrite that fits best (``KeyRewrite()`` if none helps).
        missing / unexpected / mismatched: as seen with the keys as stored.
        fitted_*: the same after ``rewrite``.
    """

    path: Path
    model: str
    cause: str
    problem: str
    fix: str
    rewrite: KeyRewrite
    model_keys: int
    matched: int
    missing: list[str]
    unexpected: list[str]
    mismatched: list[ShapeMismatch]
    fitted_matched: int
    fitted_missing: list[str]
    fitted_unexpected: list[str]
    fitted_mismatched: list[ShapeMismatch]

    @property
    def message(self) -> str:
        """One line: the problem and the next step."""
        return f"{self.problem} — {self.fix}"

    def to_json(self) -> dict[str, Any]:
        return {
            "path": str(self.path),
            "model": self.model,
            "cause": self.cause,
            "problem": self.problem,
            "fix": self.fix,
            "rewrite": None if self.rewrite.is_identity else self.rewrite.describe(),
            "model_keys": self.model_keys,
            "matched": self.matched,
            "missing": group_by_module(self.missing),
            "unexpected": group_by_module(self.unexpected),
            "mismatched": [m.to_json() for m in self.mismatched],
            "after_rewrite": {
                "matched": self.fitted_matched,
                "missing": group_by_module(self.fitted_missing),
                "unexpected": group_by_module(self.fitted_unexpected),
                "mismatched": [m.to_json() for m in self.fitted_mismatched],
            },
        }


class LoadMismatchError(CkptError):
    """The checkpoint's weights do not fit the model; ``diagnosis`` says why and what fixes it."""

    exit_code = 1

    def __init__(self, diagnosis: LoadDiagnosis) -> None:
        super().__init__(diagnosis.message, path=diagnosis.path)
        self.diagnosis = diagnosis


def model_name(model: nn.Module) -> str:
    """``LeNet``; a wrapper shows what it wraps: ``DataParallel(LeNet)``."""
    inner = getattr(model, "module", None) or getattr(model, "_orig_mod", None)
    name = type(model).__name__
    if inner is not None and hasattr(inner, "state_dict") and inner is not model:
        return f"{name}({model_name(inner)})"
    return name


def _last_layer(model_keys: list[str]) -> str:
    return module_of(model_keys[-1], depth=64) if model_keys else ""


def _prefix_sentence(model: str, model_prefix: str, rewrite: KeyRewrite) -> str:
    """What the key rewrite that fits says of the two sides' prefixes."""
    model_side = f'{model}\'s keys start with "{model_prefix}"' if model_prefix else f"{model}'s keys have no prefix"
    if rewrite.strip and not rewrite.add:
        return f'every weight key carries "{rewrite.strip}" ({_wrappers(rewrite.strip)}) but {model_side}'
    if rewrite.add and not rewrite.strip:
        return (
            f'{model}\'s keys start with "{rewrite.add}" ({_wrappers(rewrite.add)}) but the weight keys do not carry it'
        )
    return f'the weight keys carry "{rewrite.strip}" but {model}\'s keys start with "{rewrite.add}"'


def _shape_cause(model: str, model_keys: list[str], fitted: KeyMatch) -> tuple[str, str, str]:
    """``(cause, sentence, fix)`` when every key fits but some shapes differ: the head, or the architecture."""
    last = _last_layer(model_keys)
    if all(module_of(m.key, depth=64) == last for m in fitted.mismatched):
        head = fitted.mismatched[0]
        classes = head.checkpoint_shape[0] if head.checkpoint_shape else "?"
        return (
            "head",
            f"the classifier head differs: {head.key} is {_shape(head.checkpoint_shape)} in the "
            f"checkpoint but {_shape(head.model_shape)} in {model}",
            f"build the model with a {classes}-class head (e.g. num_classes={classes})",
        )
    modules = ", ".join(dict.fromkeys(module_of(m.key) for m in fitted.mismatched))
    return (
        "architecture",
        f"holds a different architecture than {model}: {len(fitted.mismatched)} of its {len(model_keys)} "
        f"tensors have other shapes in the checkpoint ({modules})",
        "pass the model this checkpoint was trained with",
    )


def _key_cause(model: str, total: int, fitted: KeyMatch) -> tuple[str, str, str]:
    """``(cause, sentence, fix)`` when keys are missing or unexpected: another architecture, or a few keys."""
    if fitted.matched < ARCHITECTURE_THRESHOLD * total or len(fitted.mismatched) > 1:
        missing = ", ".join(group_by_module(fitted.missing)) or "none"
        extra = ", ".join(group_by_module(fitted.unexpected)) or "none"
        return (
            "architecture",
            f"holds a different architecture than {model}: {fitted.matched} of its {total} tensors "
            f"found with the right shape (missing: {missing}; unexpected: {extra}"
            + (
                f"; other shapes: {', '.join(dict.fromkeys(module_of(m.key) for m in fitted.mismatched))}"
                if fitted.mismatched
                else ""
            )
            + ")",
            "pass the model this checkpoint was trained with",
        )
    parts = []
    if fitted.missing:
        parts.append(
            f"{len(fitted.missing)} of {model}'s keys are missing "
            f"({', '.join(fitted.missing[:3])}{', ...' if len(fitted.missing) > 3 else ''})"
        )
    if fitted.unexpected:
        parts.append(
            f"{len(fitted.unexpected)} keys are unexpected "
            f"({', '.join(fitted.unexpected[:3])}{', ...' if len(fitted.unexpected) > 3 else ''})"
        )
    if fitted.mismatched:
        parts.append(
            f"{fitted.mismatched[0].key} is {_shape(fitted.mismatched[0].checkpoint_shape)} in the "
            f"checkpoint but {_shape(fitted.mismatched[0].model_shape)} in {model}"
        )
    return "partial", "; ".join(parts), "check that the checkpoint was saved from this version of the model"


def diagnose(
    path: Path,
    format_: str,
    model: str,
    model_keys: list[str],
    as_stored: KeyMatch,
    fitted: KeyMatch,
    *,
    checkpoint_prefix: str,
    model_prefix: str,
    allow_globals: Sequence[str] = (),
) -> LoadDiagnosis:
    """Name the cause of a mismatch and the next step (pure: keys and shapes in, diagnosis out)."""
    rewrite = fitted.rewrite
    sentences: list[str] = []
    fixes: list[str] = []
    cause = "partial"
    keys_fit = not fitted.missing and not fitted.unexpected
    if not rewrite.is_identity and fitted.matched + len(fitted.mismatched) > as_stored.matched + len(
        as_stored.mismatched
    ):
        cause = "prefix"
        sentences.append(_prefix_sentence(model, model_prefix, rewrite))
        fixes.append(
            "run: "
            + fix_command(
                path, rewrite, checkpoint_prefix=checkpoint_prefix, format_=format_, allow_globals=allow_globals
            )
        )
    total = len(model_keys)
    found = None
    if keys_fit and fitted.mismatched:
        found = _shape_cause(model, model_keys, fitted)
    elif not keys_fit:
        found = _key_cause(model, total, fitted)
    if found is not None:
        kind, sentence, step = found
        cause = kind if cause == "partial" else cause
        sentences.append(sentence)
        fixes.append(step)
    if not sentences:  # only reachable if the rewrite alone fits but was not applied
        sentences.append(f"the keys fit {model} only after a rewrite ({rewrite.describe()})")
    problem = "; then ".join(sentences) if cause == "prefix" and len(sentences) > 1 else "; ".join(sentences)
    fix = ", then ".join(fixes) if fixes else "check that the checkpoint belongs to this model"
    return LoadDiagnosis(
        path=path,
        model=model,
        cause=cause,
        problem=problem,
        fix=fix,
        rewrite=rewrite,
        model_keys=total,
        matched=as_stored.matched,
        missing=as_stored.missing,
        unexpected=as_stored.unexpected,
        mismatched=as_stored.mismatched,
        fitted_matched=fitted.matched,
        fitted_missing=fitted.missing,
        fitted_unexpected=fitted.unexpected,
        fitted_mismatched=fitted.mismatched,
    )
