"""Frames: the guard walks exactly the opcodes the running unpickler reads, or refuses the pickle.

CPython's C unpickler reading a file object (``io.BytesIO``, as torch.load and ckptool run it) serves a
frame's opcodes from one buffer; an argument cut by the frame's end is read from the bytes after the
frame and the frame's rest dropped, while ``pickle.loads`` reads straight on and the Python unpickler
refuses. The guard refuses every pickle where that happens. Drawn pickles (hypothesis: a list of
values appended to a list, each opcode family, memo stores and reads, GLOBAL marks whose lookups the
unpicklers report) are cut into frames at drawn offsets, and:

- the C walk and the Python walk agree, result for result and message for message;
- a pickle the guard passes is read alike by every reader (C from BytesIO, C with ``peek``, the Python
  unpickler): same value, same globals looked up, in the order the walk lists them;
- a frame ending inside an opcode is refused, and so is whatever the Python unpickler calls a frame
  error;
- for a refused one, scan's model of the file reader (``frames.file_reader_view``) names the globals
  the real C unpickler looks up, in its order.
"""

from __future__ import annotations

import io
import os
import pickle
import pickletools
import struct
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from ckptool.base.errors import InputError
from ckptool.pickles import frames, opcode_guard
from ckptool.pickles.opcode_guard import Truncated
from ckptool.ops.scan import static_globals

sys.path.insert(0, str(Path(__file__).parent))
import hostile  # noqa: E402

EXAMPLES = int(os.environ.get("CKPTOOL_FUZZ_EXAMPLES", "400"))


def _walks() -> list:
    walks = [opcode_guard._python_walk]
    if opcode_guard._native is not None:
        walks.append(opcode_guard._native_walk)
    return walks


def outcome(walk, data: bytes) -> tuple:  # noqa: ANN001
    try:
        stats = walk(data)
    except Truncated as e:
        return ("Truncated", str(e))
    except InputError as e:
        return ("refused", str(e))
    return ("passed", stats.size, tuple(stats.counts), tuple(stats.globals))


# ---------------------------------------------------------------------------------------------- readers


def _recording(base: type) -> type:
    class Recording(base):  # type: ignore[misc, valid-type]
        def __init__(self, file, calls: list) -> None:  # noqa: ANN001
            super().__init__(file)
            self.calls = calls

        def find_class(self, module: str, name: str) -> str:  # noqa: D102 — nothing is imported
            self.calls.append(f"{module}.{name}")
            return f"<{module}.{name}>"

    return Recording


_C, _PY = _recording(pickle.Unpickler), _recording(pickle._Unpickler)  # type: ignore[attr-defined]


def read(reader: str, data: bytes) -> tuple:
    """One reader's value (or error type) and the globals it looked up, in order."""
    calls: list[str] = []
    if reader == "c-bytesio":
        unpickler = _C(io.BytesIO(data), calls)
    elif reader == "c-peek":
        unpickler = _C(io.BufferedReader(io.BytesIO(data), buffer_size=64), calls)
    else:
        unpickler = _PY(io.BytesIO(data), calls)
    try:
        value = unpickler.load()
    except Exception as e:  # noqa: BLE001 — a malformed pickle's error, whatever the reader raises
        return ("error", type(e).__name__, str(e)), calls
    return ("value", value), calls


# ---------------------------------------------------------------------------------------------- drawn pickles


def _line_int(value: int) -> bytes:
    return b"I" + str(value).encode() + b"\n"


VALUES = st.one_of(
    st.integers(0, 255).map(lambda v: b"K" + bytes([v])),
    st.integers(0, 65535).map(lambda v: b"M" + struct.pack("<H", v)),
    st.integers(-(2**31), 2**31 - 1).map(lambda v: b"J" + struct.pack("<i", v)),
    st.integers(-(2**70), 2**70).map(lambda v: b"\x8a" + bytes([len(pickle.encode_long(v))]) + pickle.encode_long(v)),
    st.integers(-(10**6), 10**6).map(_line_int),
    st.floats(allow_nan=False).map(lambda v: b"G" + struct.pack(">d", v)),
    st.text(max_size=12).map(lambda v: b"\x8c" + bytes([len(v.encode())]) + v.encode()),
    st.text(max_size=12).map(lambda v: b"X" + struct.pack("<I", len(v.encode())) + v.encode()),
    st.text(alphabet="abcxyz", max_size=12).map(lambda v: b"V" + v.encode() + b"\n"),
    st.binary(max_size=12).map(lambda v: b"C" + bytes([len(v)]) + v),
    st.binary(max_size=12).map(lambda v: b"B" + struct.pack("<I", len(v)) + v),
    st.binary(max_size=12).map(lambda v: b"\x8e" + struct.pack("<Q", len(v)) + v),
    st.sampled_from([b"N", b"\x88", b"\x89", b")", b"]", b"}"]),
    st.integers(0, 99).map(lambda k: b"cm\nn%d\n" % k),  # a GLOBAL: the readers report its lookup
)


@st.composite
def framed_pickles(draw: st.DrawFn) -> tuple[bytes, list[int], list[tuple[int, int]]]:
    """A protocol-4 pickle ``[v0, v1, ...]`` cut into frames, with where its opcodes start and its frames lie."""
    body = [b"]"]
    stored = 0
    for value in draw(st.lists(VALUES, max_size=12)):
        body.append(value)
        if stored < 250 and draw(st.booleans()):
            body.append(b"\x94")  # MEMOIZE: a later item may read it back
            stored += 1
        body.append(b"a")
        if stored and draw(st.integers(0, 4)) == 0:
            body.append(b"h" + bytes([draw(st.integers(0, stored - 1))]) + b"a")
    body.append(b".")
    # where each opcode starts in the unframed bytes (pickletools knows every argument's length)
    flat = b"".join(body)
    starts = [at for _, _, at in pickletools.genops(b"\x80\x04" + flat)]
    starts = [at - 2 for at in starts if at >= 2] + [len(flat)]
    # frames: cut points anywhere (inside an opcode too), each piece framed or not, a length that may lie
    cuts = sorted(set(draw(st.lists(st.integers(0, len(flat)), max_size=4)) + [0, len(flat)]))
    out, placed = bytearray(b"\x80\x04"), []
    for begin, end in zip(cuts, cuts[1:]):
        if draw(st.booleans()):
            size = end - begin + draw(st.sampled_from([0, 0, 0, 0, -1, 1]))
            out += b"\x95" + struct.pack("<Q", max(size, 0))
            placed.append((begin, end))
        out += flat[begin:end]
    return bytes(out), starts, placed


def _cuts_an_opcode(starts: list[int], placed: list[tuple[int, int]]) -> bool:
    """Whether a frame (its length true to its piece) ends strictly inside an opcode."""
    opcode_starts = set(starts)
    return any(end not in opcode_starts for _, end in placed)


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(framed_pickles())
@example((b"\x80\x04\x95\x05\x00\x00\x00\x00\x00\x00\x00}\x8c\x04abcdC\x02xy\x8c\x01zs.", [], []))
@example((b"\x80\x04]cm\nn10\n\x94a\x8e\t\x00\x00\x00\x00\x00\x00\x00\x95\x1b\x00\x00\x00\x00\x00\x00\x00"
          b"S\x00\x00\x00\x00\x00\x00\x00\x00ah\x00aK\x00ah\x00aK\x00aI0\na.", [], []))  # a frame header as bytes
def test_the_guard_reads_what_every_unpickler_reads_or_refuses(drawn: tuple) -> None:
    data, starts, placed = drawn
    results = [outcome(walk, data) for walk in _walks()]
    assert len(set(results)) == 1, results  # the C walk is the Python walk's twin
    verdict = results[0]
    readers = {name: read(name, data) for name in ("c-bytesio", "c-peek", "python")}
    if verdict[0] == "passed":
        # every reader runs the same opcodes: the same value, or each fails (on an argument none of them takes,
        # an unquoted STRING say: the guard leaves that to the unpickler, which refuses it however it reads)
        outcomes = {repr(result) if result[0] == "value" else "error" for result, _ in readers.values()}
        assert len(outcomes) == 1, readers
        looked_up = {tuple(calls) for _, calls in readers.values()}
        assert len(looked_up) == 1, readers
        calls = list(looked_up.pop())  # the globals the walk lists are those looked up, in order
        assert calls == list(verdict[3]) if outcomes != {"error"} else calls == list(verdict[3])[:len(calls)]
    else:
        python_result = readers["python"][0]
        assert verdict[0] == "Truncated" or "frame" in verdict[1] or python_result[0] == "error", (verdict, readers)
    if python_result_is_frame_error(readers["python"][0]):
        assert verdict[0] != "passed", (verdict, readers)
    # scan's model of the file reader names what the C unpickler over BytesIO looked up
    view = frames.file_reader_view(data)
    c_result, c_calls = readers["c-bytesio"]
    if view is not None:
        named = static_globals(view)[0]
        assert named[:len(c_calls)] == c_calls, (named, c_calls)
        if c_result[0] == "value":
            assert named == c_calls
    elif verdict[0] == "passed":  # what the walk lists, as far as the reader got
        assert c_calls == list(verdict[3])[:len(c_calls) if c_result[0] == "error" else None]


def python_result_is_frame_error(result: tuple) -> bool:
    return result[0] == "error" and "frame" in result[2]


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(framed_pickles())
def test_a_frame_ending_inside_an_opcode_is_refused(drawn: tuple) -> None:
    data, starts, placed = drawn
    honest = pickletools_frames(data) == [end - begin for begin, end in placed]
    if honest and _cuts_an_opcode(starts, placed):
        for walk in _walks():
            assert outcome(walk, data)[0] != "passed"


def pickletools_frames(data: bytes) -> list[int]:
    """The lengths the pickle's FRAME opcodes claim, read linearly (a cut frame makes them read wrongly: none)."""
    try:
        return [arg for op, arg, _ in pickletools.genops(data) if op.name == "FRAME"]
    except Exception:  # noqa: BLE001
        return []


# ---------------------------------------------------------------------------------------------- whole files


def _hidden_call(canary: Path) -> bytes:
    """A pickle whose bytes show ``{'abcd': b'...'}`` and which CPython's unpickler reading a file runs as
    ``{'cdC#': os.system('touch <canary>')}``: SHORT_BINUNICODE's 4 bytes are cut by the frame's end."""
    payload = b"cos\nsystem\n" + b"X" + struct.pack("<I", len(f"touch {canary}")) + f"touch {canary}".encode() + b"\x85R"
    body = b"}\x8c\x04ab"
    return b"\x80\x04\x95" + struct.pack("<Q", len(body)) + body + b"cd" + b"C" + bytes([len(payload)]) + payload + b"s."


def test_the_disguise_really_runs_under_a_file_reader(tmp_path: Path) -> None:
    """The premise, shown without running anything: the C unpickler over BytesIO looks os.system up,
    the bytes as they lie name no global, and pickle.loads reads other opcodes again."""
    data = _hidden_call(tmp_path / "canary")
    _, calls = read("c-bytesio", data)
    assert calls == ["os.system"]
    assert static_globals(data)[0] == []
    assert read("python", data)[0][0] == "error"


def test_scan_names_a_call_a_frame_hides_and_every_command_refuses(tmp_path: Path) -> None:
    import ckptool
    from ckptool.base.errors import CkptError

    path = tmp_path / "hidden.pt"
    path.write_bytes(hostile.make_zip(hostile.torch_members(_hidden_call(tmp_path / "canary"))))
    report = ckptool.scan(path)
    assert report.verdict == "dangerous" and "os.system" in report.dangerous
    assert any("past the end of its frame" in problem for problem in report.problems)
    with pytest.raises(CkptError, match="past the end of its frame"):
        ckptool.load(path, allow_globals=["*"])
    assert not (tmp_path / "canary").exists()


def test_a_memo_bomb_behind_a_frame_is_refused_in_bounded_memory(tmp_path: Path) -> None:
    """812 bytes that made the unpickler allocate and zero a 2 GiB memo: LONG_BINPUT's index cut by the
    frame's end, so a file reader takes the index from the bytes after it."""
    import resource
    import subprocess

    body = b"}Nr\x00\x00\x00"
    data = (b"\x80\x04\x95" + struct.pack("<Q", len(body)) + body + b"\x00" + b"0" + b"\x8c\x08" + b"\x00\x00\x00\x04"
            + b"xxxx" + b"0" + b".")
    path = tmp_path / "bomb.pt"
    path.write_bytes(hostile.make_zip(hostile.torch_members(data)))
    limit = 1 << 30

    def cap() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (limit + (512 << 20), limit + (512 << 20)))

    for command in ("scan", "inspect"):
        done = subprocess.run([sys.executable, "-m", "ckptool", command, str(path)], capture_output=True, text=True,
                              timeout=120, preexec_fn=cap)
        assert done.returncode == 3, done.stderr
        assert "past the end of its frame" in done.stderr and "Traceback" not in done.stderr


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(framed_pickles(), st.binary(max_size=8))
def test_a_pickles_end_is_found_as_its_opcodes_lie(drawn: tuple, tail: bytes) -> None:
    """scan cuts a refused pickle at its STOP without decoding it (frames.pickle_end): where pickletools,
    which decodes every argument, finds it."""
    data = drawn[0] + tail
    try:
        ends = [at + 1 for op, _, at in pickletools.genops(data) if op.name == "STOP"]
    except Exception:  # noqa: BLE001 — an argument pickletools cannot decode: only the skip's bounds matter
        assert 0 < frames.pickle_end(data) <= len(data)
        return
    assert frames.pickle_end(data) == ends[0]


# a text file is told from a protocol-0 pickle by its opcodes (frames.opens_as_pickle): scan's tree walk

PLAIN_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text() | st.binary(),
    lambda inner: st.lists(inner, max_size=4) | st.tuples(inner, inner) | st.dictionaries(st.text(max_size=4), inner, max_size=4),
    max_leaves=20,
)


@settings(max_examples=EXAMPLES, deadline=None)
@given(PLAIN_VALUES, st.integers(0, 5), st.integers(1, 400))
def test_every_pickle_opens_as_one_and_so_does_any_prefix_of_it(value: object, protocol: int, cut: int) -> None:
    data = pickle.dumps(value, protocol=protocol)
    assert frames.opens_as_pickle(data, whole=True)
    assert frames.opens_as_pickle(data[: min(cut, len(data))], whole=False)  # the first bytes of a larger file
    if cut < len(data):
        assert not frames.opens_as_pickle(data[:cut], whole=True)  # the whole file, but cut short


def test_a_class_reference_and_a_call_open_as_a_pickle() -> None:
    assert frames.opens_as_pickle(b"cposix\nsystem\np0\n(Vid\np1\ntp2\nRp3\n.", whole=True)
    assert frames.opens_as_pickle(pickle.dumps(pickle.PickleError, protocol=0), whole=True)


def test_text_that_opens_with_an_opcode_is_no_pickle() -> None:
    """The repository's own texts (code, docs, configs: files not made for this test), and a few that open
    with a letter that is also an opcode, read as text."""
    root = Path(__file__).resolve().parent.parent
    texts = [path.read_bytes() for pattern in ("*.md", "*.toml", "*.yaml", "Makefile", "ckptool/**/*.py", "tests/*.py")
             for path in root.glob(pattern) if path.is_file()]
    texts += [b"config: 1\n", b"import torch\n", b"layers:\n  - 1\n", b"(a) b.\n", b"}\n", b"]\n", b"lp0\n"]
    assert len(texts) > 100
    for text in texts:
        assert not frames.opens_as_pickle(text[: frames.TEXT_PICKLE_PREFIX], whole=len(text) <= frames.TEXT_PICKLE_PREFIX), text[:80]
