"""keys.py: wrapper detection and pure prefix rewrites."""

from __future__ import annotations

from collections import OrderedDict

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ckptool.base.errors import KeyCollisionError, NothingToDoError
from ckptool.model.keys import add_prefix, detect_prefix, strip_prefix


@pytest.mark.parametrize(
    ("keys", "lightning", "expected"),
    [
        (["module.fc.weight", "module.fc.bias"], False, "module."),
        (["module.module.fc.weight"], False, "module.module."),
        (["_orig_mod.module.fc.weight", "_orig_mod.module.fc.bias"], False, "_orig_mod.module."),
        (["model._orig_mod.fc.weight"], False, "model._orig_mod."),
        (["model.fc.weight", "model.fc.bias"], False, ""),  # a real submodule called model
        (["model.fc.weight", "model.fc.bias"], True, "model."),
        (["module.fc.weight", "fc.bias"], False, ""),
        (["fc.weight"], False, ""),
        ([], False, ""),
    ],
)
def test_detect_prefix(keys: list[str], lightning: bool, expected: str) -> None:
    assert detect_prefix(keys, lightning=lightning) == expected


def test_strip_keeps_order_type_and_metadata() -> None:
    state_dict = OrderedDict([("module.b", 1), ("module.a", 2)])
    state_dict._metadata = OrderedDict([("", {"version": 1}), ("module", {"version": 1}), ("module.a", {"v": 2})])
    stripped = strip_prefix(state_dict, "module.")
    assert isinstance(stripped, OrderedDict)
    assert list(stripped.items()) == [("b", 1), ("a", 2)]
    assert list(stripped._metadata) == ["", "a"]  # "" and "module" both become the root entry
    assert list(state_dict) == ["module.b", "module.a"], "input must not change"


def test_strip_errors() -> None:
    with pytest.raises(NothingToDoError):
        strip_prefix({"fc.weight": 1}, "module.")
    with pytest.raises(KeyCollisionError, match="'module.fc' and 'fc'"):
        strip_prefix({"module.fc": 1, "fc": 2}, "module.")


def test_add_then_strip_round_trips() -> None:
    state_dict = {"fc.weight": 1, "fc.bias": 2}
    assert strip_prefix(add_prefix(state_dict, "module."), "module.") == state_dict


def _detect_prefix_by_stripping(keys: list, lightning: bool) -> str:
    """detect_prefix as its rules read: strip each wrapper prefix every key carries, one at a time."""
    remaining = [key for key in keys if isinstance(key, str)]
    stack = ""
    while remaining:
        for prefix in ("module.", "_orig_mod.", "model."):
            if not all(key.startswith(prefix) for key in remaining) or prefix in remaining:
                continue
            stripped = [key[len(prefix):] for key in remaining]
            if prefix == "model." and not lightning and not any(
                    all(key.startswith(p) for key in stripped) for p in ("module.", "_orig_mod.")):
                continue
            stack += prefix
            remaining = stripped
            break
        else:
            break
    return stack


PIECES = ["module.", "_orig_mod.", "model.", "module", "model", "mod", ".", "m", "", "fc.weight", "é."]


@settings(max_examples=3000, deadline=None)
@given(st.lists(st.one_of(st.lists(st.sampled_from(PIECES), max_size=5).map("".join), st.integers(0, 3)),
                max_size=6), st.booleans())
def test_detect_prefix_is_the_stripping_rule(keys: list, lightning: bool) -> None:
    """The common start of the least and greatest key stands for every key: the same answer as stripping."""
    assert detect_prefix(keys, lightning=lightning) == _detect_prefix_by_stripping(keys, lightning)


def _strip_one_by_one(state_dict: dict, prefix: str) -> list:
    return [(key[len(prefix):] if isinstance(key, str) and key.startswith(prefix) else key, value)
            for key, value in state_dict.items()]


@settings(max_examples=1500, deadline=None)
@given(st.lists(st.one_of(st.lists(st.sampled_from(PIECES), max_size=4).map("".join), st.integers(0, 3)),
                max_size=6, unique=True), st.sampled_from(["module.", "model.", "_orig_mod.", "m"]), st.booleans())
def test_strip_prefix_renames_each_key_in_the_mappings_own_order(keys: list, prefix: str, reorder: bool) -> None:
    """Every key carrying the prefix (the one-pass path) or some (the loop): the same pairs, in the mapping's own
    order, also for an OrderedDict reordered after it was built."""
    state_dict = OrderedDict((key, index) for index, key in enumerate(keys))
    if reorder and keys:
        state_dict.move_to_end(keys[0])
    expected = _strip_one_by_one(state_dict, prefix)
    try:
        stripped = strip_prefix(state_dict, prefix)
    except NothingToDoError:
        assert not any(isinstance(key, str) and key.startswith(prefix) for key in keys)
        return
    except KeyCollisionError:
        assert len({key for key, _ in expected}) < len(expected)
        return
    assert list(stripped.items()) == expected


def test_strip_prefix_of_every_key_in_one_pass_keeps_the_order_an_ordered_dict_was_moved_to() -> None:
    state_dict = OrderedDict([("module.a", 1), ("module.b", 2), ("module.c", 3)])
    state_dict.move_to_end("module.a")
    assert list(strip_prefix(state_dict, "module.").items()) == [("b", 2), ("c", 3), ("a", 1)]
