"""What CPython's unpickler reads from a framed pickle when it reads a file object: for scan only.

Protocol 4 groups opcodes into frames. CPython's C unpickler reading a file object that has no
``peek`` (``io.BytesIO``: what ``torch.load`` hands it for a zip's ``data.pkl``) takes each frame in
one read and serves the following reads from that buffer; a read the buffer's rest cannot hold is
served from the bytes after the frame, and the rest is dropped. Given bytes (``pickle.loads``) it
reads straight on across the frame's end; the Python unpickler refuses. An argument that crosses a
frame's end therefore makes readers run different opcodes: the guard refuses such a pickle
(:mod:`.opcode_guard`), and :func:`file_reader_view` lets scan name what the file reader would run.
"""

from __future__ import annotations

# opcode -> (how its argument is read, the width of a fixed argument or of a length)
_FIXED = {0x80: 1, 0x4A: 4, 0x4B: 1, 0x4D: 2, 0x47: 8, 0x68: 1, 0x6A: 4, 0x71: 1, 0x72: 4, 0x82: 1, 0x83: 2, 0x84: 4}
_LINES = {0x49: 1, 0x4C: 1, 0x46: 1, 0x53: 1, 0x56: 1, 0x67: 1, 0x70: 1, 0x50: 1, 0x63: 2, 0x69: 2}
_COUNTED = {0x54: 4, 0x55: 1, 0x58: 4, 0x8C: 1, 0x8D: 8, 0x8A: 1, 0x8B: 4}  # read the length, then the bytes
_COUNTED_INTO = {0x42: 4, 0x43: 1, 0x8E: 8, 0x96: 8}  # bytes read into place: the buffer's rest, then the file
_NO_ARGUMENT = frozenset(b"().0125NQRabdeflostu}]\x81\x85\x86\x87\x88\x89\x8f\x90\x91\x92\x93\x94\x97\x98")
_FRAME, _STOP = 0x95, 0x2E


class _End(Exception):
    """The file reader would stop here (the data ends, or an opcode it does not know)."""


class _FileReader:
    """CPython's ``_Unpickler_Read``/``_Unpickler_Readline``/``_Unpickler_ReadInto`` over a file object
    without ``peek``: a buffer (the last read, or a frame) and the file's position."""

    def __init__(self, data: bytes) -> None:
        self.data, self.at = data, 0
        self.buffer, self.used = b"", 0
        self.dropped = False  # whether a read left buffered bytes unread: the view departs from the data

    def read(self, size: int) -> bytes:
        if size <= len(self.buffer) - self.used:
            self.used += size
            return self.buffer[self.used - size : self.used]
        self.dropped = self.dropped or self.used < len(self.buffer)
        chunk = self.data[self.at : self.at + size]  # the buffer's rest is dropped
        if len(chunk) < size:
            raise _End
        self.at += size
        self.buffer, self.used = chunk, size
        return chunk

    def read_into(self, size: int) -> bytes:
        rest = self.buffer[self.used : self.used + size]
        self.used += len(rest)
        more = size - len(rest)
        chunk = self.data[self.at : self.at + more]
        if len(chunk) < more:
            raise _End
        self.at += more
        return rest + chunk

    def readline(self) -> bytes:
        newline = self.buffer.find(b"\n", self.used)
        if newline >= 0:
            line = self.buffer[self.used : newline + 1]
            self.used = newline + 1
            return line
        self.dropped = self.dropped or self.used < len(self.buffer)
        newline = self.data.find(b"\n", self.at)
        if newline < 0:
            raise _End
        line = self.data[self.at : newline + 1]
        self.at = newline + 1
        self.buffer, self.used = line, len(line)
        return line

    def frame(self) -> None:
        size = int.from_bytes(self.read(8), "little")
        self.read(size)
        self.used -= size  # the frame's opcodes are served from the buffer that holds it


def pickle_end(data: bytes) -> int:
    """Where the first pickle in ``data`` ends (just after its STOP), its opcodes read as they lie (each
    argument skipped, none decoded); ``len(data)`` when it has no STOP there or an opcode is unknown."""
    at, end = 0, len(data)
    try:
        while at < end:
            code = data[at]
            at += 1
            if code == _STOP:
                return at
            if code in _FIXED:
                at += _FIXED[code]
            elif code == _FRAME:
                at += 8
            elif code in _LINES:
                for _ in range(_LINES[code]):
                    newline = data.find(b"\n", at)
                    if newline < 0:
                        return end
                    at = newline + 1
            elif code in _COUNTED or code in _COUNTED_INTO:
                width = _COUNTED.get(code) or _COUNTED_INTO[code]
                size = int.from_bytes(data[at : at + width], "little", signed=code in (0x8A, 0x8B, 0x54))
                if size < 0:
                    return end
                at += width + size
            elif code not in _NO_ARGUMENT:
                return end
    except IndexError:
        pass
    return end


def file_reader_view(data: bytes) -> bytes | None:
    """The opcodes and arguments CPython's unpickler reads from ``data`` through ``io.BytesIO``, as one
    unframed pickle (up to its STOP, or as far as that reader would get); None when it reads ``data``
    as it lies, so the view adds nothing. Reads are bounded: no byte is served more than twice."""
    if _FRAME not in data:  # no frame, no buffer to drop: the reader reads the bytes as they lie
        return None
    reader = _FileReader(data)
    out = bytearray()
    try:
        while True:
            code = reader.read(1)[0]
            if code == _FRAME:
                reader.frame()
                continue
            out.append(code)
            if code in _FIXED:
                out += reader.read(_FIXED[code])
            elif code in _LINES:
                for _ in range(_LINES[code]):
                    out += reader.readline()
            elif code in _COUNTED or code in _COUNTED_INTO:
                width = _COUNTED.get(code) or _COUNTED_INTO[code]
                head = reader.read(width)
                size = int.from_bytes(head, "little", signed=code in (0x8A, 0x8B, 0x54))
                if size < 0:
                    break
                out += head
                out += reader.read(size) if code in _COUNTED else reader.read_into(size)
            elif code not in _NO_ARGUMENT:
                break
            if code == _STOP:
                break
    except _End:
        pass
    return bytes(out) if reader.dropped else None


TEXT_PICKLE_PREFIX = 64 << 10  # the bytes of a text file read to tell a protocol-0 pickle from other text


def opens_as_pickle(data: bytes, *, whole: bool) -> bool:
    """Whether ``data`` (a file's first bytes; all of it when ``whole``) reads as a pickle: every
    opcode known and its argument whole, no opcode taking from the stack what was not put there,
    and, where it stops, one object left on the stack and no mark open. Text that merely opens with
    a letter that is also an opcode (``config:``, ``import torch``) fails within a few opcodes.
    A prefix that is not the whole file passes when the walk reaches its last bytes unrefuted. Only
    the opcodes are read: nothing is decoded into objects, nothing is run."""
    import io
    import pickletools

    mark = pickletools.markobject
    depth, last = 0, 0
    marks: list[int] = []
    try:
        for op, _argument, position in pickletools.genops(io.BytesIO(data)):
            last = position or 0
            before = op.stack_before
            if mark in before:  # everything down to the last mark, and what lies below it
                if not marks:
                    return False
                depth = marks.pop() - before.index(mark)
            else:
                depth -= len(before)
            if depth < 0:
                return False
            if op.name == "MARK":
                marks.append(depth)
                continue
            depth += len(op.stack_after)
            if op.name == "STOP":
                return depth == 0 and not marks
    except Exception:  # an unknown opcode or an argument cut short  # noqa: BLE001  # genops raises several kinds
        return not whole and last >= len(data) - 1024
    return not whole and last >= len(data) - 1024
