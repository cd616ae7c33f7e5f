"""NumPy ``.npy`` arrays, for scan: an array of Python objects is stored as a pickle after its header.

``numpy.save`` writes an object array (dtype ``O``, or a structured dtype holding one) as
``pickle.dump(array)`` after the ``.npy`` header, and ``numpy.load(allow_pickle=True)`` runs that
pickle. ckptool never loads an ``.npy`` (it is no checkpoint), but ``scan`` judges that pickle like
any other; an ``.npz`` is a zip of them.
"""

from __future__ import annotations

import ast
import re
import struct

MAGIC = b"\x93NUMPY"
_MAX_HEADER = 10_000  # numpy.load's own default max_header_size
_OBJECT = re.compile(r"'[|<>=]?O'")  # the object type code, alone or a field's in a structured dtype


def pickle_offset(head: bytes) -> int | None:
    """Where the pickle of an object array starts in a ``.npy`` file whose first bytes are ``head``, or None
    when the file is no such array (a plain array holds raw numbers; a malformed header, nothing to judge)."""
    if not head.startswith(MAGIC) or len(head) < 10:
        return None
    major = head[6]
    if major == 1:
        size, start = struct.unpack_from("<H", head, 8)[0], 10
    elif major in (2, 3) and len(head) >= 12:
        size, start = struct.unpack_from("<I", head, 8)[0], 12
    else:
        return None
    if size > _MAX_HEADER or len(head) < start + size:
        return None
    try:
        header = ast.literal_eval(head[start : start + size].decode("latin1"))  # a dict of literals, nothing run
    except (ValueError, SyntaxError, MemoryError, RecursionError):
        return None
    descr = header.get("descr") if isinstance(header, dict) else None
    return start + size if _OBJECT.search(repr(descr)) else None


HEAD_BYTES = 12 + _MAX_HEADER  # enough of a file to find its pickle
