"""Read and write checkpoint pickles without running them.

:class:`RestrictedUnpickler` resolves every global through an allowlist (:class:`GlobalResolver`)
and builds inert placeholders: tensors become :class:`~ckptool.tensors.refs.TensorRef`, storages come from
the format reader, other allowed objects (``argparse.Namespace``, numpy scalars) become
:class:`OpaqueObject` records. Nothing a pickle names is ever imported or called.

:func:`dump` writes such an object tree back as a protocol-2 pickle using only the opcodes
torch's ``weights_only`` unpickler accepts, re-emitting every placeholder as the global it came
from — so a rewritten checkpoint loads wherever the original did.

The modules, each using only those above it:

- :mod:`.limits` — every ceiling a pickle must stay under, and :func:`brief` for messages;
- :mod:`.placeholders` — the inert types globals become (``StorageTypeRef``, ``OpaqueObject``, ``StateDict``);
- :mod:`.rebuilds` — what the allowed callables do instead (check their arguments, build records);
- :mod:`.gadgets` (with :mod:`.gadget_table`, written by ``scripts/gadget_census.py``) — ``runs_code``: which
  names run code or reach the system, judged by what they resolve to;
- :mod:`.allowlist` — ``TORCH_GLOBALS``, ``DEFAULT_EXTRA_GLOBALS`` and the ``GlobalResolver`` applying them;
- :mod:`.guard_cache` — ``PickleStats`` (what a walk saw) and ``GuardCache`` (what one operation walked);
- :mod:`.opcode_guard` — ``guard``: the opcode walk refusing what would hang or flood the C unpickler;
- :mod:`.frames` — ``file_reader_view``: the opcodes a file reader runs where a frame cuts an argument (scan);
- :mod:`.references` — which refused classes a pickle only refers to, never calls: read as data;
- :mod:`.unpickle` — ``loads``: guard, restricted unpickler, tree check;
- :mod:`.emit` — ``dump``, the writer, which needs only the placeholder types.

A limit is read as ``limits.NAME`` wherever it applies: change it there (``pickles.limits``), not
through the copy this package re-exports.
"""

from __future__ import annotations

from ckptool.pickles import limits
from ckptool.pickles.allowlist import (
    ATTRIBUTE_LOOKUP,
    DEFAULT_EXTRA_GLOBALS,
    TORCH_GLOBALS,
    GlobalResolver,
    RefusedGlobal,
    is_pattern,
    may_convert,
    python3_name,
    runs_code,
)
from ckptool.pickles.emit import dump
from ckptool.pickles.frames import file_reader_view
from ckptool.pickles.guard_cache import GuardCache, PickleStats
from ckptool.pickles.limits import (
    MAX_EXPANDED_NODES,
    MAX_EXPANDED_TEXT,
    MAX_HASH_COLLISIONS,
    MAX_KEY_NODES,
    MAX_NESTING,
    MAX_PICKLE_BYTES,
    MAX_UNPICKLED_BYTES,
    brief,
)
from ckptool.pickles.opcode_guard import guard, guard_stats
from ckptool.pickles.placeholders import OpaqueObject, StateDict, StorageTypeRef, TypeRef, opaque_type
from ckptool.pickles.rebuilds import PARAMETER_DESCRIPTORS
from ckptool.pickles.unpickle import RestrictedUnpickler, check_tree, loads, read_pickle

__all__ = [
    "ATTRIBUTE_LOOKUP",
    "DEFAULT_EXTRA_GLOBALS",
    "MAX_EXPANDED_NODES",
    "MAX_EXPANDED_TEXT",
    "MAX_HASH_COLLISIONS",
    "MAX_KEY_NODES",
    "MAX_NESTING",
    "MAX_PICKLE_BYTES",
    "MAX_UNPICKLED_BYTES",
    "PARAMETER_DESCRIPTORS",
    "TORCH_GLOBALS",
    "GlobalResolver",
    "GuardCache",
    "OpaqueObject",
    "PickleStats",
    "RefusedGlobal",
    "RestrictedUnpickler",
    "StateDict",
    "StorageTypeRef",
    "TypeRef",
    "brief",
    "check_tree",
    "dump",
    "file_reader_view",
    "guard",
    "guard_stats",
    "is_pattern",
    "limits",
    "loads",
    "may_convert",
    "opaque_type",
    "python3_name",
    "read_pickle",
    "runs_code",
]
