"""The ceilings a pickle must stay under, and how a refusal reads.

Every limit lives here, read as ``limits.NAME`` when a pickle is read (never copied at import), so
one module states them all and a test that lowers one lowers it everywhere.
"""

from __future__ import annotations

import reprlib
from typing import Any

from ckptool.base.errors import InputError

# The ceiling on one pickle's size: real checkpoints' pickles are a few MB even with 100k tensors.
MAX_PICKLE_BYTES = 1 << 30
# What a pickle may make the unpickler allocate (estimated before it runs, the guard's own records
# included): a 10-byte pickle can otherwise ask for a 64 GiB memo, and 1 MB of EMPTY_SET opcodes
# builds 200 MB of sets. Real checkpoints' pickles estimate at ~2 KB per tensor (200 MB for 100k).
MAX_UNPICKLED_BYTES = 1 << 30
# Distinct globals one pickle names (and GLOBAL opcodes the guard walks): each becomes a placeholder
# class (~1 KB); whole-model pickles name hundreds, 1,000,000 names held 2.6 GB.
MAX_GLOBALS = 100_000
# Nesting of the object tree: every walk over it (ours, json, repr, the writer) must fit the stack.
MAX_NESTING = 100
# One dict key or set element: hashing a tuple visits every element of every nested tuple.
MAX_KEY_NODES = 1000
# Distinct keys of one dict/set sharing one hash (ints, floats and tuples of them hash predictably,
# so a pickle can make every insertion collide and the load quadratic).
MAX_HASH_COLLISIONS = 16
# Objects the tree would hold if every shared reference were copied (json.dumps, repr, str do
# copy them): a list doubled 60 times by memo references is 60 objects and 2**60 when walked.
MAX_EXPANDED_NODES = 10_000_000
# Bytes of strings the tree would hold if every shared reference were copied (and 16 times the
# pickle's length): what json.dumps, repr or a safetensors header would write.
MAX_EXPANDED_TEXT = 256 << 20


def refuse(message: str) -> InputError:
    """The error for a pickle refused before anything it names could run."""
    return InputError(f"pickle {message} — refused, nothing was executed")


class _BriefRepr(reprlib.Repr):
    """reprlib bounds lists, tuples, dicts and strings; other objects get their type name only
    (a dataclass's own repr would walk every field, however large)."""

    def repr_instance(self, obj: Any, level: int) -> str:  # noqa: D102
        if type(obj) in (float, complex, bool, type(None)):
            return repr(obj)
        return f"<{type(obj).__name__}>"


_brief_repr = _BriefRepr()
_brief_repr.maxlevel, _brief_repr.maxstring, _brief_repr.maxother, _brief_repr.maxlong = 3, 60, 60, 40


def brief(value: Any) -> str:
    """A short repr for error messages: bounded in time and length whatever ``value`` holds."""
    try:
        return _brief_repr.repr(value)
    except Exception:  # a placeholder whose repr fails still gets a message
        return f"<{type(value).__name__}>"
