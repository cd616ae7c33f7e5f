"""Wrapper prefixes on state_dict keys: detect, strip, add. Pure: state_dict in -> state_dict out."""

from __future__ import annotations

import fnmatch
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from functools import partial
from itertools import repeat
from operator import itemgetter
from typing import Any

from ckptool.base.errors import KeyCollisionError, NothingToDoError, UsageError
from ckptool.base.suggest import Wording, option
from ckptool.model.tree import copy_mapping

DDP_PREFIX = "module."  # nn.DataParallel / DistributedDataParallel: model.state_dict() of the wrapper
COMPILE_PREFIX = "_orig_mod."  # torch.compile: the OptimizedModule keeps the model as _orig_mod
LIGHTNING_PREFIX = "model."  # Lightning convention: the LightningModule holds the network as self.model
WRAPPER_PREFIXES = (DDP_PREFIX, COMPILE_PREFIX, LIGHTNING_PREFIX)


def _empty_prefix(doing: str) -> Wording:
    return f"the prefix to {doing} is empty — pass " + option("prefix", None) + ", e.g. " + option("prefix", DDP_PREFIX)


def detect_prefix(keys: Iterable[str], *, lightning: bool = False) -> str:
    """The stack of wrapper prefixes every key carries, e.g. ``"module._orig_mod."``.

    ``model.`` is a common real module name, so it counts only in a Lightning-style checkpoint
    (``lightning=True``) or when another wrapper prefix follows it (``model._orig_mod.``).

    Example:
        >>> detect_prefix(["module._orig_mod.fc.weight", "module._orig_mod.fc.bias"])
        'module._orig_mod.'
    """
    names = list(filter(_IS_STR, keys))
    if not names:
        return ""
    # every name starts with a string exactly where the names' longest common start does, and that is the
    # common start of the least and the greatest name: two C passes, however many keys (100,000 in a MoE)
    common = os.path.commonprefix([min(names), max(names)])
    stack = ""
    while True:
        for prefix in WRAPPER_PREFIXES:
            whole = stack + prefix
            if not common.startswith(whole) or whole in names:  # in every key, and every key is longer
                continue
            if (
                prefix == LIGHTNING_PREFIX
                and not lightning
                and not any(common.startswith(whole + p) for p in (DDP_PREFIX, COMPILE_PREFIX))
            ):
                continue
            stack = whole
            break
        else:
            return stack


_IS_STR = partial(type.__instancecheck__, str)  # isinstance(key, str), called from C by filter


def _rename_metadata(state_dict: Mapping[str, Any], rename) -> dict | None:
    metadata = getattr(state_dict, "_metadata", None)
    if not isinstance(metadata, dict):
        return None
    renamed = copy_mapping(metadata, items=[])
    for key, value in dict.items(metadata):
        renamed[rename(key) if isinstance(key, str) else key] = value
    return renamed


def _with_keys(state_dict: Mapping[str, Any], items: list[tuple[Any, Any]], metadata: dict | None) -> dict:
    result = copy_mapping(state_dict, items=items) if isinstance(state_dict, dict) else dict(items)
    if metadata is not None:
        result._metadata = metadata  # type: ignore[attr-defined]
    return result


def strip_prefix(state_dict: Mapping[str, Any], prefix: str) -> dict:
    """Remove ``prefix`` from every key that carries it; other keys stay as they are.

    Raises:
        NothingToDoError: no key carries the prefix.
        KeyCollisionError: two keys would become one.
    """
    if not prefix:
        raise UsageError(_empty_prefix("strip"))
    head = prefix[:-1] if prefix.endswith(".") else prefix

    def rename(meta_key: str) -> str:
        if meta_key == head:
            return ""
        return meta_key[len(prefix) :] if meta_key.startswith(prefix) else meta_key

    keys = list(state_dict)
    if keys and all(map(_IS_STR, keys)) and all(map(str.startswith, keys, repeat(prefix))):
        # the usual wrapped state dict (tested in C): every key carries the prefix, so none collide once stripped
        cut = len(prefix)
        # keys and values in the mapping's own order (an OrderedDict moved to its end iterates apart from its dict)
        return _with_keys(
            state_dict,
            list(zip(map(itemgetter(slice(cut, None)), keys), state_dict.values())),
            _rename_metadata(state_dict, rename),
        )
    if not any(isinstance(key, str) and key.startswith(prefix) for key in keys):
        raise NothingToDoError(f'no key starts with "{prefix}" — nothing to strip')
    items: list[tuple[Any, Any]] = []
    seen: dict[Any, Any] = {}
    for key, value in state_dict.items():
        new_key = key[len(prefix) :] if isinstance(key, str) and key.startswith(prefix) else key
        if new_key in seen:
            raise KeyCollisionError(
                f'stripping "{prefix}" maps both {seen[new_key]!r} and {key!r} to {new_key!r} — '
                "strip a different prefix or rename one key first"
            )
        seen[new_key] = key
        items.append((new_key, value))
    return _with_keys(state_dict, items, _rename_metadata(state_dict, rename))


def add_prefix(state_dict: Mapping[str, Any], prefix: str) -> dict:
    """Put ``prefix`` in front of every key (e.g. to resume a DDP run from plain weights)."""
    if not prefix:
        raise UsageError(_empty_prefix("add"))
    items = [(prefix + key if isinstance(key, str) else key, value) for key, value in state_dict.items()]
    head = prefix[:-1] if prefix.endswith(".") else prefix

    def rename(meta_key: str) -> str:
        return head if meta_key == "" else prefix + meta_key

    return _with_keys(state_dict, items, _rename_metadata(state_dict, rename))


def parse_rename(rule: str) -> tuple[re.Pattern[str], str]:
    """``PATTERN=REPLACEMENT`` (split at the last ``=``) as a compiled regex and its replacement
    (``\\1`` for a group), as :func:`re.sub` takes them.

    Raises:
        UsageError: no ``=``, or a pattern that is not a regular expression.
    """
    pattern, sep, replacement = rule.rpartition("=")
    if not sep or not pattern:
        raise UsageError(
            f"rename rule {rule!r} is not PATTERN=REPLACEMENT — e.g. "
            + option("rename", r"^backbone\.=")
            + " to drop a leading backbone."
        )
    try:
        return re.compile(pattern), replacement
    except re.error as e:
        raise UsageError(f"rename pattern {pattern!r} is not a regular expression ({e})") from e


def rename_keys(state_dict: Mapping[str, Any], rules: Sequence[tuple[re.Pattern[str], str]]) -> tuple[dict, int]:
    """Each key rewritten by every rule in turn (``pattern.sub(replacement, key)``, as mmengine's
    ``revise_keys`` does), and how many keys changed.

    Raises:
        KeyCollisionError: two keys would become one.
        UsageError: a rule whose replacement refers to a group the pattern lacks.
    """

    def rename(key: str) -> str:
        for pattern, replacement in rules:
            try:
                key = pattern.sub(replacement, key)
            except (re.error, IndexError) as e:
                raise UsageError(f"rename {pattern.pattern!r}={replacement!r}: {e}") from e
        return key

    items: list[tuple[Any, Any]] = []
    seen: dict[Any, Any] = {}
    changed = 0
    for key, value in state_dict.items():
        new_key = rename(key) if isinstance(key, str) else key
        changed += new_key != key
        if new_key in seen:
            raise KeyCollisionError(
                f"renaming maps both {seen[new_key]!r} and {key!r} to {new_key!r} — make the rule tell them apart"
            )
        seen[new_key] = key
        items.append((new_key, value))
    return _with_keys(state_dict, items, _rename_metadata(state_dict, rename)), changed


def matching(keys: Iterable[Any], patterns: Sequence[str]) -> list[Any]:
    """The string keys that one of the shell ``patterns`` matches whole (``head.*``, ``*.num_batches_tracked``)."""
    return [key for key in keys if isinstance(key, str) and any(fnmatch.fnmatchcase(key, p) for p in patterns)]


def drop_keys(state_dict: Mapping[str, Any], dropped: Sequence[Any]) -> dict:
    """``state_dict`` without the keys ``dropped``."""
    gone = set(dropped)
    return _with_keys(
        state_dict, [(k, v) for k, v in state_dict.items() if k not in gone], getattr(state_dict, "_metadata", None)
    )
