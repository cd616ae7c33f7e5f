"""Text that came from a file, made safe to print on a terminal.

Names, metadata, location tags, pickle globals and file names are the file author's choice. Printed
raw, an escape sequence could clear the screen, retitle the window or overwrite a ``scan`` verdict,
and a newline could forge a line of output. Every text renderer and every error message goes
through :func:`printable`; JSON output is exact instead (``json.dumps`` escapes controls itself).
"""

from __future__ import annotations

import re
import reprlib
import urllib.parse


def printable(text: object) -> str:
    """``str(text)`` with every non-printable character written as a Python-style escape.

    Escaped: C0 and C1 controls (ESC, CR, BEL, newline...), DEL, format characters such as the
    bidirectional overrides (U+202E) and zero-width joiners, line/paragraph separators, other
    non-space separators and lone surrogates — everything ``str.isprintable`` rejects. Printable
    characters, the space included, are kept, so ordinary non-ASCII names read as they are.

    Example:
        >>> printable("conv\\x1b[2J.weight\\n")
        'conv\\\\x1b[2J.weight\\\\n'
    """
    text = text if type(text) is str else value_str(text)  # (an int past 4300 digits has no str)
    if text.isprintable():
        return text
    return "".join(char if char.isprintable() else _escape(char) for char in text)


_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _escape(char: str) -> str:
    if char in _NAMED:
        return _NAMED[char]
    code = ord(char)
    if code < 0x100:
        return f"\\x{code:02x}"
    if code < 0x10000:
        return f"\\u{code:04x}"
    return f"\\U{code:08x}"


def int_text(value: int) -> str:
    """``str(value)``, or ``<int of N bits>`` for an int too long for Python to write in digits.

    Python refuses to turn an int of more than 4300 digits into text (``ValueError``: the
    conversion's time grows with the square of the length, and a pickle can hold an int of
    billions of digits). Its bit length costs nothing and says its size exactly.

    Example:
        >>> int_text(-12), int_text(1 << 20000), int_text(-(1 << 20000))
        ('-12', '<int of 20001 bits>', '<negative int of 20001 bits>')
    """
    try:
        return str(value)
    except ValueError:
        return f"<{'negative ' if value < 0 else ''}int of {value.bit_length()} bits>"


class _LongIntRepr(reprlib.Repr):
    """repr, bounded in depth and length, with each int too long for digits as :func:`int_text` writes it."""

    def repr_int(self, x: int, level: int) -> str:
        return int_text(x)

    def repr1(self, x: object, level: int) -> str:
        if isinstance(x, int) and not isinstance(x, bool):  # an int subclass too (reprlib names it by its type)
            return int_text(int(x))
        return super().repr1(x, level)

    def repr_OrderedDict(self, x: dict, level: int) -> str:  # (a state dict's class too: it calls itself so)
        return f"OrderedDict({self.repr_dict(x, level)})"


_LONG_INTS = _LongIntRepr()
_LONG_INTS.maxlevel, _LONG_INTS.maxdict, _LONG_INTS.maxlist, _LONG_INTS.maxtuple = 6, 100, 100, 100
_LONG_INTS.maxset = _LONG_INTS.maxfrozenset = 100
_LONG_INTS.maxstring = _LONG_INTS.maxother = 400


def value_repr(value: object) -> str:
    """``repr(value)``; where that fails on an int too long for digits (held anywhere inside it), a repr
    that shows each such int as :func:`int_text` does (bounded in depth and length).

    Example:
        >>> value_repr({"lr": 1 << 20000})
        "{'lr': <int of 20001 bits>}"
    """
    try:
        return repr(value)
    except ValueError:
        return _LONG_INTS.repr(value)


def value_str(value: object) -> str:
    """``str(value)`` (a key named in a path), with an int too long for digits shown as :func:`int_text`
    shows it, wherever it lies inside ``value``.

    Example:
        >>> value_str(3), value_str((1 << 20000, "a"))
        ('3', "(<int of 20001 bits>, 'a')")
    """
    try:
        return str(value)
    except ValueError:
        return int_text(value) if isinstance(value, int) else _LONG_INTS.repr(value)


_USERINFO = re.compile(r"([A-Za-z][A-Za-z0-9+.\-]*://)[^/?#@]*@")  # user:password@ after any scheme's ://


def url_name(url: str) -> str:
    """The last component of a URL's path, as ``Path.name`` gives a local path's (no query, no trailing ``/``)."""
    return url.split("?", 1)[0].rstrip("/").rsplit("/", 1)[-1]


def shown_url(url: str) -> str:
    """``url`` as a message may print it: without user:password (a chained URL's inner ones too), and
    with a query (a presigned URL's signature is a credential) shown as ``?...``."""
    parsed = urllib.parse.urlsplit(url)
    try:
        host = parsed.hostname or ""
        if parsed.port is not None:
            host += f":{parsed.port}"
    except ValueError:  # not host:port (a chained URL's "a::b"): shown as written, less any credentials
        host = ""
    if not host:  # s3://user@bucket is not a thing, but never print it
        host = parsed.netloc.rsplit("@", 1)[-1]
    shown = f"{parsed.scheme}://{host}{parsed.path}"
    if parsed.query:
        shown += "?..."
    return _USERINFO.sub(r"\1", shown)
