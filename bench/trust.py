"""The trust review's cases, before and after: each command's exit, verdict, peak memory and time.

    .venv/bin/python -m bench.trust                      # this checkout
    .venv/bin/python -m bench.trust --checkout OLD_TREE  # another checkout of ckptool (its C built in place)

Every case is built fresh: the names that resolve to code (``bench.peers.corpus``'s ``trust/`` entries:
dotted builtins, re-exports, the ultralytics ``best.pt`` with ``getattr(torch.os, 'system')``, omegaconf
conversions, a frame-hidden ``os.system``), scanned with no flag and with ``--allow-global '*'``; then the
bombs: a frame that cuts ``LONG_BINPUT``'s index (812 bytes), a frame that hides a tuple-hashing bomb
(~1.6 KB), 80,000 refused globals, 1,000,000 globals under ``'*'``, and equal keys nested 990 deep under
both guard walks. Each run is a process of its own, measured by ``/usr/bin/time`` and stopped at
``--timeout`` seconds. Nothing in a case ever runs: ckptool only reads them.
"""

from __future__ import annotations

import argparse
import json
import os
import struct
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))
import hostile  # noqa: E402


def _frame(body: bytes, after: bytes) -> bytes:
    return b"\x80\x04\x95" + struct.pack("<Q", len(body)) + body + after


def bombs(out: Path) -> dict[str, Path]:
    out.mkdir(parents=True, exist_ok=True)
    files: dict[str, bytes] = {}
    # 812 bytes: LONG_BINPUT's 4-byte index cut by the frame's end; a file reader takes it from after the frame
    files["frame_memo_bomb.pt"] = hostile.make_zip(hostile.torch_members(
        _frame(b"}Nr\x00\x00\x00", b"\x000\x8c\x08\x00\x00\x00\x04xxxx0.")))
    # a frame that cuts a SHORT_BINUNICODE: the file reader skips 5 bytes and runs what the bytes show as data:
    # a tuple doubled 60 times through the memo, used as a dict key (hashing it visits 2**60 tuples)
    doubled = b"K\x01\x94" + b"".join(b"h%ch%c\x86\x94" % (level, level) for level in range(60)) + b"0" * 61
    hidden = b"0" + doubled + b"h<N"  # pop the string, push the deepest tuple and None
    while any(byte >= 0x80 for byte in struct.pack("<I", len(hidden))):  # its length is read as UTF-8 text
        hidden = b"N0" + hidden
    files["frame_hash_bomb.pt"] = hostile.make_zip(hostile.torch_members(
        _frame(b"}\x8c\x06abcde", b"f" + b"B" + struct.pack("<I", len(hidden)) + hidden + b"s.")))
    names = 80_000
    files["refused_globals_80k.pkl"] = hostile.whole(b"](" + b"".join(b"cm%d\nN\n0" % k for k in range(names)) + b"e")
    files["globals_1m.pkl"] = hostile.whole(b"](" + b"".join(b"cm%d\nN\n0" % k for k in range(1_000_000)) + b"e")
    deep = b"K\x01" + b"\x85" * 990
    files["deep_equal_keys.pt"] = hostile.make_zip(hostile.torch_members(hostile.whole(hostile.dct(
        (hostile.text("weight"), hostile.rebuild()), (hostile.text("k"), b"}" + deep + b"Ns" + deep + b"Ns"))),
        {"0": hostile.FOUR_FLOATS}))
    paths = {}
    for name, data in files.items():
        (out / name).write_bytes(data)
        paths[name] = out / name
    return paths


def run(checkout: Path, args: list[str], timeout: int, env: dict[str, str] | None = None) -> dict:
    environment = {**os.environ, "PYTHONPATH": str(checkout), **(env or {})}
    command = ["/usr/bin/time", "-f", "%M %e", sys.executable, "-m", "ckptool", *args]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=environment,
                              cwd=tempfile.gettempdir())
    except subprocess.TimeoutExpired:
        return {"exit": "timeout", "rss_mb": None, "seconds": f">{timeout}", "said": ""}
    lines = done.stderr.strip().splitlines()
    rss, seconds = lines[-1].split()
    said = done.stdout.splitlines()[0] if done.stdout else (lines[0] if len(lines) > 1 else "")
    return {"exit": done.returncode, "rss_mb": round(int(rss) / 1024), "seconds": float(seconds), "said": said[:160]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkout", type=Path, default=REPO, help="the ckptool tree to run (default: this one)")
    parser.add_argument("--timeout", type=int, default=120)
    parser.add_argument("--json", type=Path, help="also write the rows here")
    args = parser.parse_args(argv)
    from bench.peers import corpus

    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        out = Path(scratch)
        for entry in corpus.trust_entries(out):
            path = out / entry.path
            for flags in ([], ["--allow-global", "*"]):
                result = run(args.checkout, ["scan", str(path), *flags], args.timeout)
                result["said"] = result["said"].replace(str(path), "").lstrip(": ").replace(str(out), "<corpus>")
                rows.append({"case": entry.name, "command": "scan" + (" '*'" if flags else ""), **result})
        for name, path in bombs(out / "bombs").items():
            commands = [["scan", str(path)], ["inspect", str(path)]]
            if name.startswith("globals_1m"):
                commands = [["scan", str(path), "--allow-global", "*"]]
            for command in commands:
                rows.append({"case": name, "command": command[0] + ("" if len(command) == 2 else " '*'"),
                             **run(args.checkout, command, args.timeout)})
            if name == "deep_equal_keys.pt":
                rows.append({"case": name, "command": "scan (Python walk)",
                             **run(args.checkout, ["scan", str(path)], args.timeout,
                                   {"CKPTOOL_PURE_PYTHON": "1"})})
    print("| case | command | exit | peak MB | s | says |")
    print("|---|---|---|---|---|---|")
    for row in rows:
        print(f"| {row['case']} | {row['command']} | {row['exit']} | {row['rss_mb']} | {row['seconds']} | "
              f"{row.get('said', '')} |")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
