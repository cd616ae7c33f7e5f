"""Text that came from a file, made safe to print on a terminal.

Names, metadata, location tags, pickle globals and file names are the file author's choice. Printed
raw, an escape sequence could clear the screen, retitle the window or overwrite a ``scan`` verdict,
and a newline could forge a line of output. Every text renderer and every error message goes
through :func:`printable`; JSON output is exact instead (``json.dumps`` escapes controls itself).
"""

from __future__ import annotations


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
    text = str(text)
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
