"""Casts (``convert --dtype``, ``cast_weights``) against torch's own ``tensor.to(dtype)``, bit for bit.

Each pair of fp64, fp32, fp16 and bf16 is cast in numpy, chunk by chunk; these tests build the
values where casts go wrong — subnormals in and out, ±0, ±Inf, NaNs of every sign and payload,
ties to even and to odd, the largest finite values and just past them, fp64 values that round
differently through fp32 — plus random bit patterns, and compare every output bit with torch.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

import ckptool
from ckptool.model import cast
from ckptool.model.cast import cast_weights
from ckptool.cli.main import main
from ckptool.base.errors import InputError

NAMES = ("F64", "F32", "F16", "BF16")
TORCH = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
ALIAS = {"F64": "fp64", "F32": "fp32", "F16": "fp16", "BF16": "bf16"}
UNSIGNED = {"F64": np.uint64, "F32": np.uint32, "F16": np.uint16, "BF16": np.uint16}
SIGNED = {8: torch.int64, 4: torch.int32, 2: torch.int16}
INF = {"F64": 0x7FF0000000000000, "F32": 0x7F800000, "F16": 0x7C00, "BF16": 0x7F80}
PAIRS = [(s, t) for s in NAMES for t in NAMES if s != t]
# torch's NaN bits differ between its vectorised kernels and its scalar code (and so between CPUs);
# ckptool writes the vectorised kernels' bits, which are what torch gives on these CPUs
VECTORISED = torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")


def _bits(values: np.ndarray, name: str) -> np.ndarray:
    return np.ascontiguousarray(values).view(UNSIGNED[name])


def _floats(name: str, values: list[float]) -> np.ndarray:
    """``values`` as ``name`` (bf16: the fp32 value's top half, so give bf16-exact values)."""
    if name == "BF16":
        return (np.array(values, np.float32).view(np.uint32) >> 16).astype(np.uint16)
    return _bits(np.array(values, {"F64": np.float64, "F32": np.float32, "F16": np.float16}[name]), name)


def _edge_values(source: str, target: str) -> np.ndarray:
    """Bit patterns of ``source`` where a cast to ``target`` is easy to get wrong."""
    u = UNSIGNED[source]
    width = np.dtype(u).itemsize * 8
    sign = 1 << (width - 1)
    inf = INF[source]
    mantissa = {"F64": 52, "F32": 23, "F16": 10, "BF16": 7}
    patterns = [0, sign, inf, inf | sign, inf + 1, (inf + 1) | sign, inf | (1 << (mantissa[source] - 1)),
                (inf | (1 << (mantissa[source] - 1))) | sign, sign - 1, (sign - 1) | sign, inf | 0b101,
                1, 2, 3, (1 << mantissa[source]) - 1, 1 << mantissa[source], inf - 1, (inf - 1) | sign]
    dropped = mantissa[source] - mantissa[target]
    if dropped > 0:  # around the rounding point: ties to even and to odd, one below, one above
        half = 1 << (dropped - 1)
        for base in (0x3F << (width - 8), 0x41 << (width - 8), 3 << (mantissa[source] - 2)):  # ~1, ~4, subnormal
            for kept_odd in (0, 1):
                start = base | (kept_odd << dropped)
                patterns += [start + half, start + half - 1, start + half + 1, (start + half) | sign]
    # around the target's largest finite value and its first subnormals, as source values
    t_max = {"F64": np.finfo(np.float64).max, "F32": float(np.finfo(np.float32).max), "F16": 65504.0,
             "BF16": float.fromhex("0x1.fep127")}[target]
    t_tiny = {"F64": 5e-324, "F32": float.fromhex("0x1p-149"), "F16": float.fromhex("0x1p-24"),
              "BF16": float.fromhex("0x1p-133")}[target]
    near = []
    for value in (t_max, t_tiny, t_tiny / 2, t_tiny * 1.5, t_tiny * 0.75):
        near.append(value)
    if source in ("F64", "F32") and target != "F64":
        wide = np.array(near, np.float64 if source == "F64" else np.float32)
        patterns += [int(x) for x in _bits(wide, source)]
        patterns += [int(x) + d for x in _bits(wide, source) for d in (-1, 1, 1 << 12, 1 << 28) if
                     d < 1 << mantissa[source]]
    if source == "F64":  # values that round differently straight to a half type than through fp32
        patterns += [int(x) for x in _bits(np.array([1 + 2**-11 + 2**-40, 1 + 2**-8 + 2**-40, 65519.99999999,
                                                      -(1 + 2**-11 + 2**-40)], np.float64), "F64")]
    patterns = [p % (1 << width) for p in patterns]
    nans = [inf | p for p in (1, 2, 0x55, (1 << mantissa[source]) - 1, 1 << (mantissa[source] - 1))]
    patterns += nans + [n | sign for n in nans]
    return np.array(patterns, dtype=u)


def _sample(source: str, target: str, count: int) -> np.ndarray:
    rng = np.random.default_rng(sum(map(ord, source + target)))
    u = UNSIGNED[source]
    random = rng.integers(0, np.iinfo(u).max, size=count, dtype=u, endpoint=True)
    edges = _edge_values(source, target)
    random[:edges.size] = edges
    random[count // 2:count // 2 + edges.size] = edges  # again past the first chunk boundary
    return random


def _torch_cast(bits: np.ndarray, source: str, target: str) -> np.ndarray:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # each thread's share of a tensor ends in torch's scalar tail (other NaN bits)
    try:
        tensor = torch.from_numpy(bits.view(f"i{bits.itemsize}")).view(TORCH[source])
        out = tensor.to(TORCH[target]).view(SIGNED[torch.finfo(TORCH[target]).bits // 8])
    finally:
        torch.set_num_threads(threads)
    return out.numpy().view(UNSIGNED[target])


def _assert_same_bits(mine: np.ndarray, theirs: np.ndarray, source_bits: np.ndarray, target: str) -> None:
    magnitude = theirs & ~np.array(1 << (theirs.itemsize * 8 - 1), dtype=theirs.dtype)
    nan = magnitude > INF[target]
    compared = np.ones_like(nan) if VECTORISED else ~nan
    wrong = np.nonzero((mine != theirs) & compared)[0]
    assert not wrong.size, [(hex(int(source_bits[i])), hex(int(mine[i])), hex(int(theirs[i]))) for i in wrong[:6]]
    mine_magnitude = mine & ~np.array(1 << (mine.itemsize * 8 - 1), dtype=mine.dtype)
    assert np.array_equal(mine_magnitude > INF[target], nan), "NaN must stay NaN, and only NaN be NaN"


@pytest.mark.parametrize(("source", "target"), PAIRS)
def test_every_pair_casts_as_torch_does_bit_for_bit(source: str, target: str, tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cast, "CAST_CHUNK", 4096)  # many chunks, and specials on both sides of a boundary
    count = 4096 * 5 + 64
    bits = _sample(source, target, count)
    path = tmp_path / "in.safetensors"
    save_file({"w": torch.from_numpy(bits.view(f"i{bits.itemsize}").copy()).view(TORCH[source])}, path)
    casted = cast_weights(ckptool.load(path), ALIAS[target], allow_overflow=True).tensors["w"]
    assert casted.dtype.name == target
    mine = np.frombuffer(casted.read_bytes(), UNSIGNED[target])
    _assert_same_bits(mine, _torch_cast(bits, source, target), bits, target)


def _finite_to_inf(bits: np.ndarray, source: str, target: str) -> bool:
    values = torch.from_numpy(bits.view(f"i{bits.itemsize}")).view(TORCH[source])
    return bool((torch.isfinite(values) & torch.isinf(values.to(TORCH[target]))).any())


@pytest.mark.parametrize(("source", "target"), [p for p in PAIRS if p not in
                                                 {("F16", "F32"), ("F16", "F64"), ("BF16", "F32"), ("BF16", "F64"),
                                                  ("F32", "F64"), ("F16", "BF16")}])
def test_overflow_is_refused_exactly_where_torch_gives_inf(source: str, target: str, tmp_path: Path) -> None:
    edges = _edge_values(source, target)
    refused = 0
    for index, pattern in enumerate(edges):
        one = np.array([pattern] * 3, dtype=edges.dtype)
        path = tmp_path / f"in{index}.safetensors"
        save_file({"w": torch.from_numpy(one.view(f"i{one.itemsize}").copy()).view(TORCH[source])}, path)
        out = tmp_path / f"out{index}.safetensors"
        overflows = _finite_to_inf(one, source, target)
        if overflows:
            refused += 1
            with pytest.raises(InputError, match="would turn finite values into Inf in 1 tensor"):
                ckptool.save(cast_weights(ckptool.load(path), ALIAS[target]), out)
            assert not out.exists() and not list(tmp_path.glob(".*"))  # nothing written, no temp left
        else:
            ckptool.save(cast_weights(ckptool.load(path), ALIAS[target]), out)
    assert refused  # the edge values include the target's largest finite value and just past it


def _checkpoint(path: Path) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    big = torch.randn(700, 1000, generator=g)  # over a cast step: several chunks
    big[3, :4] = torch.tensor([float("nan"), float("inf"), -0.0, 1e-42])
    state = {"big": big, "t": big[:300, :200].t(), "half": torch.randn(64, 33, generator=g).half(),
             "bf": torch.randn(17, generator=g).bfloat16(), "double": torch.randn(5, 7, generator=g).double(),
             "steps": torch.tensor(7), "ids": torch.arange(10), "empty": torch.empty(0, 4)}
    state["tied"] = state["big"]
    torch.save(state, path)
    return state


@pytest.mark.parametrize("dtype", ["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("output", ["x.safetensors", "x.pt", "shards"])
def test_convert_dtype_matches_torch_load_and_to(tmp_path: Path, dtype: str, output: str) -> None:
    source = tmp_path / "model.pt"
    state = _checkpoint(source)
    out = tmp_path / output
    extra = ["--max-shard-size", "1MB"] if output == "shards" else []
    result = CliRunner().invoke(main, ["convert", str(source), "-o", str(out), "--dtype", dtype, *extra])
    assert result.exit_code == 0, result.output
    if output == "x.pt":
        loaded = torch.load(out, weights_only=True)
    elif output == "shards":
        index = json.loads((out / "model.safetensors.index.json").read_text())
        assert len(set(index["weight_map"].values())) > 1
        loaded = {k: v for name in set(index["weight_map"].values()) for k, v in load_file(out / name).items()}
        loaded.update({k: loaded[v] for k, v in _aliases(out).items()})
    else:
        loaded = load_file(out)
        loaded.update({k: loaded[v] for k, v in _aliases_file(out).items()})
    want = TORCH[{"bf16": "BF16", "fp16": "F16", "fp32": "F32"}[dtype]]
    assert set(loaded) == set(state)
    for key, value in state.items():
        expected = value.to(want) if value.is_floating_point() else value
        assert loaded[key].dtype == expected.dtype and loaded[key].shape == expected.shape, key
        width = SIGNED.get(expected.element_size())
        if value.is_floating_point():  # bits, NaN included (a tensor this small is all torch's scalar tail here)
            same = torch.equal(loaded[key].view(width), expected.contiguous().view(width)) or \
                torch.equal(torch.nan_to_num(loaded[key]), torch.nan_to_num(expected))
            assert same, key
        else:
            assert torch.equal(loaded[key], expected), key


def _aliases_file(path: Path) -> dict[str, str]:
    with open(path, "rb") as handle:
        size = int.from_bytes(handle.read(8), "little")
        header = json.loads(handle.read(size))
    return json.loads(header.get("__metadata__", {}).get("ckptool.aliases", "{}"))


def _aliases(folder: Path) -> dict[str, str]:
    aliases: dict[str, str] = {}
    for shard in folder.glob("model-*.safetensors"):
        aliases.update(_aliases_file(shard))
    return aliases


_NO_TORCH = r"""
import sys
from ckptool.cli.main import main
try:
    main(sys.argv[1:])
except SystemExit as e:
    print(f"CODE:{e.code}")
loaded = sorted(name for name in sys.modules if name == "torch" or name.startswith("torch."))
print("TORCH:" + ",".join(loaded))
"""


@pytest.mark.parametrize("dtype", ["bf16", "fp16", "fp64"])
def test_a_cast_imports_no_torch(tmp_path: Path, dtype: str) -> None:
    source = tmp_path / "model.pt"
    _checkpoint(source)
    for out in (tmp_path / "x.safetensors", tmp_path / "x.pt"):
        done = subprocess.run([sys.executable, "-c", _NO_TORCH, "convert", str(source), "-o", str(out),
                               "--dtype", dtype, "--fingerprint"], capture_output=True, text=True,
                              cwd=Path(__file__).resolve().parent.parent)
        assert "CODE:0\n" in done.stdout and "TORCH:\n" in done.stdout, done.stdout + done.stderr
        assert out.exists()


def test_a_refused_cast_imports_no_torch_and_writes_nothing(tmp_path: Path) -> None:
    source = tmp_path / "big.pt"
    torch.save({"a": torch.tensor([1.0, 1e5]), "b": torch.ones(3)}, source)
    out = tmp_path / "x.safetensors"
    done = subprocess.run([sys.executable, "-c", _NO_TORCH,
                           "convert", str(source), "-o", str(out), "--dtype", "fp16"], capture_output=True, text=True,
                          cwd=Path(__file__).resolve().parent.parent)
    assert "CODE:3\n" in done.stdout and "TORCH:\n" in done.stdout and not out.exists(), done.stdout + done.stderr
    assert "would turn finite values into Inf in 1 tensor(s): 'a'" in done.stdout + done.stderr


@pytest.mark.parametrize("output", ["x.pt", "x.safetensors", "shards"])
def test_a_refused_cast_leaves_nothing_behind(tmp_path: Path, output: str) -> None:
    # the overflow is found in the write's own pass, after other tensors (and shards) were written
    source = tmp_path / "big.pt"
    torch.save({"a": torch.ones(300_000), "m": torch.ones(300_000), "z": torch.tensor([1.0, 1e5])}, source)
    args = ["convert", str(source), "-o", str(tmp_path / output), "--dtype", "fp16", "--fingerprint"]
    result = CliRunner().invoke(main, args + (["--max-shard-size", "1MB"] if output == "shards" else []))
    assert result.exit_code == 3, result.output
    assert "would turn finite values into Inf in 1 tensor(s): 'z'" in result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["big.pt"]


def test_cast_bytes_that_read_back_different_are_caught(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # the expected CRC of a cast tensor is summed as it is computed; the re-read behind the writer must match it
    from ckptool.io import write_check
    from ckptool.base.errors import FingerprintMismatchError

    source = tmp_path / "model.pt"
    torch.save({"w": torch.randn(3_000_000), "b": torch.randn(10)}, source)
    reads = write_check.read_into

    def flipped(fd: int, view: memoryview, offset: int, path: Path) -> None:
        reads(fd, view, offset, path)
        view[len(view) // 2] ^= 1

    monkeypatch.setattr(write_check, "read_into", flipped)
    out = tmp_path / "x.safetensors"
    with pytest.raises(FingerprintMismatchError, match="reads back different"):
        ckptool.save(cast_weights(ckptool.load(source), "bf16"), out)
    assert not out.exists()
