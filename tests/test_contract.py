"""The output and error contract: what reaches a terminal, and how every failure ends.

- Text output escapes every control character that came from a file (names, metadata, location
  tags, pickle globals, file names): nothing a file holds can move the cursor, clear the screen,
  retitle the window or forge a line. --json stays exact.
- Every error is one line on stderr; a bug is exit 70, never 3 ("bad input"); a closed stdout
  (``| head -1``) ends the command quietly with 141, as git does.
- The library raises only CkptError subclasses, and names the -o path, never its temp file.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import save_file

import ckptool
from ckptool.cli.main import EXIT_CLOSED_PIPE, EXIT_INTERNAL, main
from ckptool.base.errors import CkptError, InputError
from ckptool.base.text import printable

sys.path.insert(0, str(Path(__file__).parent))
import hostile  # noqa: E402

# what a hostile name carries: clear screen + cursor home, set window title, carriage return, bell,
# right-to-left override, a newline that would forge a line, and DEL
NASTY = "\x1b[2J\x1b[H\x1b]0;owned\x07\r\u202e\nforged line\x7f"


def controls(text: str) -> list[str]:
    """Every character in ``text`` a terminal could act on, except the line breaks between lines."""
    return sorted({char for line in text.split("\n") for char in line if not char.isprintable()})


def run(*args: object):
    return CliRunner().invoke(main, [str(a) for a in args])


@pytest.fixture
def nasty_pt(tmp_path: Path) -> Path:
    """A real torch.save'd training checkpoint whose keys, entries and file name carry control characters."""
    path = tmp_path / f"model{NASTY}.pt"
    weights = {f"module.fc{NASTY}.weight": torch.ones(2, 3), "module.fc.bias": torch.zeros(2)}
    torch.save({"model": weights, f"note{NASTY}": f"value{NASTY}", "epoch": 1}, path)
    return path


@pytest.fixture
def nasty_safetensors(tmp_path: Path) -> Path:
    path = tmp_path / f"m{NASTY}.safetensors"
    save_file({f"w{NASTY}": torch.ones(2)}, path, metadata={f"k{NASTY}": f"v{NASTY}"})
    return path


def test_printable_escapes_every_control_and_keeps_ordinary_text() -> None:
    assert printable("conv1.weight é 中 ok") == "conv1.weight é 中 ok"
    escaped = printable(NASTY + "\ud800\u2028\x85\t")
    assert not controls(escaped) and "\n" not in escaped
    assert escaped == ("\\x1b[2J\\x1b[H\\x1b]0;owned\\x07\\r\\u202e\\nforged line\\x7f\\ud800\\u2028\\x85\\t")


@pytest.mark.parametrize("args", [["inspect"], ["inspect", "--tensors"], ["scan"]])
def test_text_output_escapes_names_entries_and_file_names(nasty_pt: Path, args: list[str]) -> None:
    result = run(args[0], nasty_pt, *args[1:])
    assert result.exit_code == 0, result.stderr
    assert not controls(result.stdout + result.stderr), result.stdout
    assert "forged line" not in result.stdout.replace("\\nforged line", "")  # only ever as part of an escape
    if args[0] == "inspect":
        assert "\\x1b[2J" in result.stdout and "\\u202e" in result.stdout


def test_safetensors_names_and_metadata_are_escaped(nasty_safetensors: Path, tmp_path: Path) -> None:
    for args in (["inspect", nasty_safetensors, "--tensors"], ["diff", nasty_safetensors, nasty_safetensors],
                 ["convert", nasty_safetensors, "-o", tmp_path / "out.pt"]):
        result = run(*args)
        assert result.exit_code == 0, result.stderr
        assert not controls(result.stdout + result.stderr), (args[0], result.stdout)


def test_json_output_is_exact_and_inert(nasty_pt: Path) -> None:
    result = run("inspect", nasty_pt, "--json", "--tensors")
    assert result.exit_code == 0
    assert result.stdout.isascii() and not controls(result.stdout)
    data = json.loads(result.stdout)
    assert data["path"] == str(nasty_pt)
    assert f"module.fc{NASTY}.weight" in [tensor["name"] for tensor in data["tensor_list"]]


def test_a_location_tag_is_escaped(tmp_path: Path) -> None:
    path = tmp_path / "tagged.pt"
    path.write_bytes(hostile.make_zip(hostile.torch_members(hostile.whole(hostile.dct((
        hostile.text("weight"),
        hostile.call(hostile.glob("torch._utils", "_rebuild_tensor_v2"),
                     hostile.tup(hostile.text("storage"), hostile.glob("torch", "FloatStorage"), hostile.text("0"),
                                 hostile.text(f"cuda:0{NASTY}"), hostile.integer(4)) + b"Q",
                     hostile.integer(0), hostile.tup(hostile.integer(4)), hostile.tup(hostile.integer(1)), b"\x89",
                     hostile.ordered_dict())))), {"0": hostile.FOUR_FLOATS})))
    for command in ("inspect", "scan", "verify"):
        result = run(command, path)
        assert not controls(result.stdout + result.stderr), (command, result.stdout, result.stderr)
        if result.exit_code == 3:
            assert len(result.stderr.splitlines()) == 1, result.stderr


def test_a_global_name_cannot_overwrite_the_scan_verdict(tmp_path: Path) -> None:
    # on a terminal: cursor up, erase the line, then print a clean verdict over "DANGEROUS"
    overwrite = "\x1b[1A\x1b[2K\rmodel.pt: safe (torch-zip; 1 pickle(s), 9 opcodes)"
    body = hostile.tup(hostile.call(hostile.glob("os", "system"), hostile.text("true")),
                       hostile.glob("builtins", overwrite))
    path = tmp_path / "model.pt"
    path.write_bytes(hostile.make_zip(hostile.torch_members(hostile.whole(hostile.dct((hostile.text("weight"), body))))))
    result = run("scan", path)
    assert result.exit_code == 1
    assert not controls(result.stdout)
    lines = result.stdout.splitlines()
    assert "DANGEROUS" in lines[0] and not any(": safe (" in line and "\\x1b" not in line for line in lines)


def test_a_lone_surrogate_in_a_global_name_is_unsafe_not_a_crash(tmp_path: Path,
                                                                 subprocess_env: dict[str, str]) -> None:
    name = b"sys\xed\xa0\x80tem"  # a lone surrogate, as pickle's own writer encodes it (surrogatepass)
    body = (hostile.text("os") + b"\x8c" + bytes([len(name)]) + name + b"\x93"  # SHORT_BINUNICODE, STACK_GLOBAL
            + hostile.tup(hostile.text("true")) + b"R")
    path = tmp_path / "surrogate.pt"
    path.write_bytes(hostile.make_zip(hostile.torch_members(
        b"\x80\x04" + hostile.dct((hostile.text("weight"), body)) + b".")))
    environment = {k: v for k, v in subprocess_env.items() if k != "CKPTOOL_DEBUG"}
    for args in (["scan", str(path)], ["scan", str(path), "--json"], ["inspect", str(path)]):
        completed = subprocess.run([sys.executable, "-m", "ckptool", *args], env=environment, capture_output=True,
                                   timeout=300)
        stdout, stderr = completed.stdout.decode(), completed.stderr.decode()
        assert completed.returncode == (1 if args[0] == "scan" else 3), (args, stdout, stderr)
        assert "Traceback" not in stderr and "internal error" not in stderr, stderr
        assert not controls(stdout + stderr)
        if args == ["scan", str(path)]:
            assert "DANGEROUS" in stdout and "os.sys\\ud800tem" in stdout, stdout
        if args[-1] == "--json":
            assert "os.sys\ud800tem" in json.loads(stdout)["unsafe"]


@pytest.mark.parametrize("name", ["bad\nname.pt", f"bad{NASTY}.pt"])
def test_an_error_is_one_escaped_line(tmp_path: Path, name: str) -> None:
    path = tmp_path / name
    path.write_bytes(b"not a checkpoint\n" * 4)
    for command in ("inspect", "scan", "strip"):
        result = run(command, path, *(["-o", tmp_path / "out.pt"] if command == "strip" else []))
        assert result.exit_code == 3
        assert result.stderr.count("\n") == 1 and result.stderr.startswith("ckptool: error: "), result.stderr
        assert not controls(result.stderr)
    with pytest.raises(InputError) as raised:
        ckptool.load(path)
    assert "\n" not in str(raised.value) and not controls(str(raised.value))


def test_an_element_count_of_2_to_the_63_is_refused(tmp_path: Path) -> None:
    # stride 0 needs no bytes for the elements, so only the count itself can refuse it
    for shape in ((1 << 32, 1 << 32), (1 << 62, 2), (3, 1 << 62)):
        path = tmp_path / "huge.pt"
        path.write_bytes(hostile.make_zip(hostile.torch_members(
            hostile.good_zip_pickle(shape=shape, stride=(0, 0)), {"0": hostile.FOUR_FLOATS})))
        for function in (ckptool.load, ckptool.inspect):
            with pytest.raises(InputError, match="2\\^63"):
                function(path)
    path.write_bytes(hostile.make_zip(hostile.torch_members(
        hostile.good_zip_pickle(shape=((1 << 62) - 1, 2), stride=(0, 0)), {"0": hostile.FOUR_FLOATS})))
    assert ckptool.load(path).tensors["weight"].numel == (1 << 63) - 2  # just below the limit: a stride-0 view


def test_a_closed_pipe_ends_quietly(fixtures_dir: Path, subprocess_env: dict[str, str]) -> None:
    # the reader is gone before ckptool writes a byte, as after `| head -1` on a long listing
    for args in (["inspect", "--tensors"], ["inspect", "--json"], ["scan"]):
        read_end, write_end = os.pipe()
        os.close(read_end)
        try:
            completed = subprocess.run([sys.executable, "-m", "ckptool", *args, str(fixtures_dir / "single_lenet.pt")],
                                       env=subprocess_env, stdout=write_end, stderr=subprocess.PIPE, text=True,
                                       timeout=300)
        finally:
            os.close(write_end)
        assert completed.returncode == EXIT_CLOSED_PIPE == 141, completed.stderr
        assert completed.stderr == ""


EXIT_PROBE = """
import atexit, sys, threading
from ckptool.cli.main import run
atexit.register(lambda: print("exit handler ran", file=sys.stderr))
if sys.argv[1] == "thread":  # another thread alive: the usual exit, which waits for it
    threading.Thread(target=lambda: (__import__("time").sleep(0.5), print("thread ended", file=sys.stderr))).start()
sys.argv = ["ckptool", *sys.argv[2:]]
run()
"""


@pytest.mark.parametrize("case", ["alone", "thread"])
def test_the_command_exits_with_its_code_its_whole_output_and_the_exit_handlers_run(
        fixtures_dir: Path, tmp_path: Path, subprocess_env: dict[str, str], case: str) -> None:
    """The command's exit (cli.run: the heap left to the kernel) keeps what an exit must: the exit code, every byte
    of stdout and stderr, the exit handlers, and a thread still running (waited for, as any exit waits)."""
    for args, code in ((["inspect", "--json", str(fixtures_dir / "single_lenet.pt")], 0),
                       (["inspect", str(tmp_path / "missing.pt")], 3),
                       (["strip", str(fixtures_dir / "dp_mlp_wrapped.pt"), "-o", str(tmp_path / f"{case}.pt")], 0)):
        completed = subprocess.run([sys.executable, "-c", EXIT_PROBE, case, *args], env=subprocess_env,
                                   capture_output=True, text=True, timeout=300)
        assert completed.returncode == code, completed.stderr
        assert completed.stderr.endswith("exit handler ran\n")  # (after the thread ended, as at any exit)
        assert ("thread ended\nexit handler ran\n" in completed.stderr) == (case == "thread")
        if args[1] == "--json":
            assert json.loads(completed.stdout)["tensors"] == 8
        if code == 3:
            assert completed.stderr.startswith("ckptool: error: ")
    assert ckptool.load(tmp_path / f"{case}.pt").prefix == ""


def test_a_command_holds_its_trees_to_its_exit_and_a_library_caller_frees_them(
        fixtures_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """What dies as a command ends (the input's tree, the write's read-back) is held to the exit, which leaves
    the heap to the kernel, instead of being freed object by object; the last few only, so a batch of files
    holds two files' trees, not every file's. A library caller frees them as usual."""
    import gc
    import weakref
    from collections import deque

    from ckptool.base import gcpause
    from ckptool.ops import rewrite as operations

    source = fixtures_dir / "dp_mlp_wrapped.pt"
    monkeypatch.setattr(gcpause, "_kept", deque(maxlen=4))
    monkeypatch.setattr(gcpause, "_freezing", False)
    operations.strip(source, tmp_path / "library.pt")
    assert len(gcpause._kept) == 0

    monkeypatch.setattr(gcpause, "_freezing", True)
    operations.strip(source, tmp_path / "command.pt")
    (read_back, inputs) = gcpause._kept  # the write's, then the command's
    checkpoint, stripped = inputs
    assert checkpoint.path == source and checkpoint.prefix == "module." and stripped.prefix == ""
    written, actual, expected = read_back
    assert sorted(written) == sorted(actual) == sorted(stripped.tensors) and actual == expected.values
    first = weakref.ref(checkpoint)
    del inputs, read_back, checkpoint, stripped, written, actual, expected
    gc.collect()
    assert first() is not None  # held
    for k in range(2):
        operations.strip(source, tmp_path / f"more{k}.pt")
    gc.collect()
    assert first() is None and len(gcpause._kept) == 4  # the first file's let go


def test_a_bug_is_exit_70_in_one_line(fixtures_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CKPTOOL_DEBUG", raising=False)

    def broken(*args: object, **kwargs: object) -> None:
        raise TypeError(f"unsupported operand\n{NASTY}")

    monkeypatch.setattr("ckptool.ops.inspect.inspect", broken)
    result = run("inspect", fixtures_dir / "single_lenet.pt")
    assert result.exit_code == EXIT_INTERNAL == 70
    assert result.stderr.count("\n") == 1 and not controls(result.stderr)
    assert result.stderr.startswith("ckptool: internal error: TypeError: ") and "report it" in result.stderr


def test_a_failed_read_back_names_the_output_not_its_temp_file(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    from ckptool.io import writer

    source = tmp_path / "in.pt"
    torch.save({"w": torch.ones(3)}, source)

    def read_back(checkpoint: object, guard_cache: object = None):
        def read(path: Path):
            raise InputError(f"truncated: {path} ends early", path=path)
        return read

    monkeypatch.setattr(writer, "read_back", read_back)
    for out in (tmp_path / "out.pt", tmp_path / "out.safetensors", tmp_path / "sharded"):
        extra = ["--max-shard-size", "8"] if out.name == "sharded" else []
        result = run("convert", source, "-o", out, *extra)
        assert result.exit_code == 3, result.stderr
        assert ".ckptool-tmp-" not in result.stderr and f"ckptool: error: {out}" in result.stderr, result.stderr
        with pytest.raises(CkptError) as raised:
            ckptool.save(ckptool.load(source), out, max_shard_size=8 if extra else None)
        assert ".ckptool-tmp-" not in str(raised.value) and raised.value.path == out
        assert not [p for p in tmp_path.iterdir() if p.name.startswith(".ckptool-tmp-")]


def test_entries_with_mixed_key_types_convert_to_safetensors(tmp_path: Path) -> None:
    # torch.save and torch.load(weights_only=True) take a dict whose keys mix int and str
    source = tmp_path / "mixed.pt"
    torch.save({"model": {"w": torch.ones(2)}, "config": {1: "a", "b": 2}, "epoch": 3}, source)
    assert torch.load(source, weights_only=True)["config"] == {1: "a", "b": 2}
    report = ckptool.save(ckptool.load(source), tmp_path / "out.safetensors")
    assert report.tensors == 1
    back = ckptool.load(tmp_path / "out.safetensors").container
    assert back["config"] == {1: "a", "b": 2} and back["epoch"] == 3  # carried with its keys' types


@pytest.mark.parametrize("function", ["load", "inspect", "scan", "diff", "load_into", "save", "fingerprint", "verify"])
def test_the_public_api_raises_only_ckpt_errors_even_for_a_bug(function: str, fixtures_dir: Path, tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    import ckptool.tensors.refs
    import ckptool.io.reader

    lenet = fixtures_dir / "single_lenet.pt"
    checkpoint = ckptool.load(lenet)

    def bug(*args: object, **kwargs: object) -> None:
        raise KeyError("a key ckptool forgot")

    # a bug deep inside: reading a file's structure, or its bytes
    monkeypatch.setattr(ckptool.io.reader, "_load", bug)
    monkeypatch.setattr(ckptool.tensors.refs.ByteRange, "iter_chunks", bug)
    monkeypatch.setattr(ckptool.tensors.refs.TensorRef, "iter_bytes", bug)
    monkeypatch.setattr(ckptool.tensors.refs.TensorRef, "iter_reused", bug)
    calls = {
        "load": lambda: ckptool.load(lenet),
        "inspect": lambda: ckptool.inspect(lenet),
        "scan": lambda: ckptool.scan(lenet),
        "diff": lambda: ckptool.diff(lenet, lenet),
        "load_into": lambda: ckptool.load_into(torch.nn.Linear(2, 2), lenet),
        "save": lambda: ckptool.save(checkpoint, tmp_path / "out.safetensors"),
        "fingerprint": lambda: ckptool.fingerprint(checkpoint.tensors),
        "verify": lambda: ckptool.verify(lenet),
    }
    with pytest.raises(ckptool.InternalError) as raised:  # a CkptError; anything else fails the test
        calls[function]()
    assert raised.value.exit_code == 70 and isinstance(raised.value.__cause__, KeyError)
    assert str(raised.value).count("\n") == 0 and "a bug in ckptool" in str(raised.value)


@pytest.mark.parametrize("function", ["load", "inspect", "scan", "diff", "load_into", "save", "fingerprint", "verify"])
def test_a_wrong_argument_is_the_callers_type_error_not_a_bug(function: str) -> None:
    """A misspelt keyword is a plain TypeError naming the function, as Python says it; not "a bug in ckptool"."""
    said = r"(got an unexpected keyword argument 'modle'|missing a required argument: '\w+')"
    with pytest.raises(TypeError, match=rf"^ckptool\.{function}\(\) {said}$"):
        getattr(ckptool, function)("x.pt", modle="training:lenet")


def test_a_library_warning_does_not_reach_stderr(tmp_path: Path, subprocess_env: dict[str, str]) -> None:
    path = tmp_path / "m.pt"
    torch.save({"w": torch.ones(2)}, path)
    code = f"""
import sys, warnings
from ckptool.ops import inspect as summary
from ckptool.cli.main import main
inspect = summary.inspect
def warning_inspect(*args, **kwargs):
    warnings.warn("invalid value encountered in cast {NASTY!r}", RuntimeWarning)
    return inspect(*args, **kwargs)
summary.inspect = warning_inspect
sys.argv = ["ckptool", "inspect", {str(path)!r}]
main()
"""
    environment = {k: v for k, v in subprocess_env.items() if k != "CKPTOOL_DEBUG"}
    completed = subprocess.run([sys.executable, "-W", "default", "-c", code], env=environment, capture_output=True,
                               text=True, timeout=300)
    assert completed.returncode == 0 and completed.stderr == "", completed.stderr


def test_a_command_started_with_stdout_closed_still_works(fixtures_dir: Path, subprocess_env: dict[str, str]) -> None:
    # `ckptool inspect x >&-`: Python starts with sys.stdout None; the check still runs, quietly
    completed = subprocess.run([sys.executable, "-m", "ckptool", "scan", str(fixtures_dir / "single_lenet.pt")],
                               env=subprocess_env, stderr=subprocess.PIPE, text=True, timeout=300,
                               preexec_fn=lambda: os.close(1))
    assert completed.returncode == 0 and completed.stderr == "", completed.stderr
