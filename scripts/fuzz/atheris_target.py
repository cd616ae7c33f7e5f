"""The coverage-guided fuzz (on demand): libFuzzer, through atheris, steering the same oracles by ckptool's coverage.

``python scripts/fuzz/run.py atheris`` (FUZZ_SECONDS long) runs this; it needs the atheris package
(``pip install atheris``: a wheel for CPython on Linux), which CI's ``make fuzz`` does not. Coverage is of
ckptool's Python code (atheris instruments it at import); the C extensions are the checkout's own, run
without sanitizers (gcc's ASan runtime would take over libFuzzer's coverage hooks): a memory error shows
as a crash, whose input ``run.py replay`` then runs under ASan and UBSan. Every input goes through all of
twins.py. Half the mutations are libFuzzer's own, half mutate.py's structure-aware ones. An input that makes
an oracle fail is an exception here: libFuzzer saves it (``crash-<sha1>`` in the findings folder) and stops.

    atheris_target.py [libFuzzer flags] CORPUS_DIR SEED_DIR...    (the first directory receives new inputs)
"""

from __future__ import annotations

import random
import struct
import sys
import tempfile
from pathlib import Path

import atheris

sys.path.insert(0, str(Path(__file__).resolve().parent))
# the Python walk of the guard is left out: instrumented, the reference walk of a 100 KB hostile pickle took
# minutes; its C twin is what the fuzz is after, and both are run on every input regardless
_GUARD_WALK = ["ckptool.pickles.opcode_guard", "ckptool.pickles.guard_records", "ckptool.pickles.guard_steps",
               "ckptool.pickles.guard_entry"]
with atheris.instrument_imports(include=["ckptool"], exclude=_GUARD_WALK):
    import twins

import mutate  # noqa: E402

WORK = Path(tempfile.mkdtemp(prefix="ckptool-atheris-"))
OUT = WORK / "out"
OUT.mkdir()
MAX_LEN = 2 << 20


def suffix_of(data: bytes) -> str:
    if len(data) >= 9 and data[8:9] == b"{" and struct.unpack_from("<Q", data)[0] <= len(data) - 8:
        return ".safetensors"
    return ".pt"


def test_one_input(data: bytes) -> None:
    path = WORK / f"input{suffix_of(data)}"
    path.write_bytes(data)
    try:
        problems = twins.check(path, OUT)
    finally:
        path.unlink()
        for leftover in OUT.rglob("*"):
            if leftover.is_file():
                leftover.unlink()
    if problems:
        raise AssertionError("\n".join(problems))


def custom_mutator(data: bytes, max_size: int, seed: int) -> bytes:
    rng = random.Random(seed)
    if rng.random() < 0.5:
        return atheris.Mutate(data, max_size)
    try:
        described = mutate.describe("input", data)
        mutant, _ = mutate.mutate(rng, described, [described], mutate.pickle_blobs([described]))
    except Exception:  # noqa: BLE001 — a mutator's own bug must not end the fuzz: libFuzzer's mutation instead
        return atheris.Mutate(data, max_size)
    return mutant[:max_size]


def main() -> None:
    argv = [sys.argv[0], f"-max_len={MAX_LEN}", *sys.argv[1:]]
    atheris.Setup(argv, test_one_input, custom_mutator=custom_mutator)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
