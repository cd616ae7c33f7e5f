"""Bounded resources for any input, and numbers that do not lie.

A few KB must not become many GB: stride-0 views are refused (with the size they would become)
unless ``--allow-expansion``; a ``.pt`` rewrite copies them raw; floods of empty containers and
tiny ``--max-shard-size`` values stay within memory. Memory is checked by running the command
in a child with a generous address-space limit (``RLIMIT_AS``): a regression fails by its exit
code, never by a timing assert. A cast that turns finite values into Inf is refused, and verify
fails on NaN/Inf weights unless told they are meant.
"""

from __future__ import annotations

import json
import math
import os
import resource
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from ckptool.tensors import refs
from ckptool.cli.main import main
from ckptool.formats import safetensors

sys.path.insert(0, str(Path(__file__).parent))
import hostile  # noqa: E402 — the corpus generator beside this file

GiB = 1 << 30


def invoke(*args: object):
    return CliRunner().invoke(main, [str(a) for a in args])


def run_limited(args: list[object], address_space: int, cwd: Path, timeout: float = 600) -> subprocess.CompletedProcess:
    """``python -m ckptool ARGS`` in a child whose address space is capped (MemoryError past it)."""

    def cap() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (address_space, address_space))

    env = {k: v for k, v in os.environ.items() if k != "CKPTOOL_DEBUG"}
    env["PYTHONPATH"] = str(Path(__file__).parent.parent)
    return subprocess.run([sys.executable, "-m", "ckptool", *map(str, args)], cwd=cwd, env=env, preexec_fn=cap,
                          capture_output=True, text=True, timeout=timeout)


def one_error_line(stderr: str, path: Path) -> str:
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"ckptool: error: {path}"), stderr
    return lines[0]


@pytest.fixture
def expanding(tmp_path: Path) -> Path:
    """1.7 KB: eight stride-0 views of one stored float, 256 MiB each (2 GiB in full)."""
    path = tmp_path / "expanding.pt"
    path.write_bytes(hostile.stride0_zip(8, 64 << 20))
    return path


# ---------------------------------------------------------------------------------------------- expansion


@pytest.mark.parametrize("command", ["convert", "convert-dtype", "diff", "verify", "fingerprint"])
def test_stride0_views_are_refused_by_every_command_that_would_expand_them(expanding: Path, tmp_path: Path,
                                                                          command: str) -> None:
    out = tmp_path / "out"
    out.mkdir()
    args = {"convert": ["convert", expanding, "-o", out / "x.safetensors"],
            "convert-dtype": ["convert", expanding, "-o", out / "x.pt", "--dtype", "bf16"],
            "diff": ["diff", expanding, expanding],
            "verify": ["verify", expanding, "--devices", "cpu"],
            "fingerprint": ["inspect", expanding, "--fingerprint"]}[command]
    result = invoke(*args)
    assert result.exit_code == 3, result.output
    line = one_error_line(result.stderr, expanding)
    assert "expand 4 B of stored bytes to 2.0 GiB" in line and "--allow-expansion" in line
    assert not any(out.iterdir())


def test_inspect_describes_an_expanding_file_and_a_pt_rewrite_copies_it_raw(expanding: Path, tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    result = invoke("inspect", expanding, "--json")
    assert result.exit_code == 0, result.output
    assert any("8 tensor view(s) expand their storage" in note for note in json.loads(result.stdout)["notes"])

    def expanded(*_: object) -> None:
        raise AssertionError("a .pt rewrite expanded a stride-0 view")

    monkeypatch.setattr(refs.TensorRef, "_gather", expanded)
    out = tmp_path / "renamed.pt"
    result = invoke("add-prefix", expanding, "-o", out, "--prefix", "m.")
    assert result.exit_code == 0, result.output
    assert out.stat().st_size < 4096
    loaded = torch.load(out, weights_only=True)
    assert sorted(loaded) == [f"m.w{k}" for k in range(8)]
    for k in range(8):
        tensor = loaded[f"m.w{k}"]
        assert tensor.shape == ((64 << 20) - k,) and tensor.stride() == (0,)
        assert tensor.untyped_storage().nbytes() == 4 and float(tensor[0]) == 1e5


def test_allow_expansion_materializes_the_views_in_full(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(refs, "EXPANSION_SLACK", 0)  # a small file stands for a large one
    source = tmp_path / "small.pt"
    source.write_bytes(hostile.stride0_zip(2, 1000, value=2.5))
    out = tmp_path / "full.safetensors"
    result = invoke("convert", source, "-o", out)
    assert result.exit_code == 3 and "--allow-expansion" in result.stderr and not out.exists()
    result = invoke("convert", source, "-o", out, "--allow-expansion")
    assert result.exit_code == 0, result.output
    expected = torch.load(source, weights_only=True)
    from safetensors.torch import load_file

    written = load_file(out)
    assert sorted(written) == sorted(expected)
    for name, tensor in expected.items():
        assert torch.equal(written[name], tensor.contiguous())
    assert invoke("diff", source, out, "--allow-expansion").exit_code == 0
    assert invoke("verify", source, "--devices", "cpu", "--allow-expansion").exit_code == 0


def _stride0_channel_parameters(path: Path, count: int) -> Path:
    """A quantized qint8 tensor of ``count`` channels, one stored byte viewed at stride 0, whose per-channel
    float32 scales and int32 zero points are stride-0 views of one element each: ~2 KB of file."""
    from collections import OrderedDict

    from test_differential import Crafted

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        storage = torch.quantize_per_tensor(torch.zeros(1), 0.5, 2, torch.qint8)._typed_storage()
        qparams = (torch.per_channel_affine, torch.full((1,), 0.25).expand(count),
                   torch.ones(1, dtype=torch.int32).expand(count), 0)
        torch.save({"q": Crafted(torch._utils._rebuild_qtensor, (storage, 0, (count,), (0,), qparams, False,
                                                                 OrderedDict()))}, path)
    return path


@pytest.mark.parametrize("command", ["convert-dtype", "diff", "verify", "fingerprint"])
def test_stride0_quantization_parameters_count_as_what_they_expand_to(tmp_path: Path, command: str) -> None:
    """torch's quantizer holds per-channel parameters as float64 scales and int64 zero points: 200M channels of
    them are 3.2 GB from 8 stored bytes. They count as the expansion they are (they once counted as stored
    bytes: convert used 9.4 GB, diff 5.5 GB); a .pt rewrite copies them raw."""
    path = _stride0_channel_parameters(tmp_path / "channels.pt", 200_000_000)
    assert path.stat().st_size < 4096
    args = {"convert-dtype": ["convert", path, "-o", tmp_path / "bf16.pt", "--dtype", "bf16"],
            "diff": ["diff", path, path], "verify": ["verify", path, "--devices", "cpu"],
            "fingerprint": ["inspect", path, "--fingerprint"]}[command]
    completed = run_limited(args, int(1.5 * GiB), tmp_path)
    assert completed.returncode == 3, completed.stderr
    line = one_error_line(completed.stderr, path)
    assert "/scales]': 8 B viewed as 1.5 GiB" in line and "--allow-expansion" in line, line
    assert not (tmp_path / "bf16.pt").exists()


def test_a_pt_rewrite_copies_stride0_quantization_parameters_raw(tmp_path: Path) -> None:
    path = _stride0_channel_parameters(tmp_path / "channels.pt", 200_000_000)
    for command in (["convert", path, "-o", tmp_path / "out.pt"], ["inspect", path]):
        completed = run_limited(command, int(1.5 * GiB), tmp_path)
        assert completed.returncode == 0, completed.stderr
    assert "3 tensor view(s) expand their storage" in completed.stdout
    assert (tmp_path / "out.pt").stat().st_size < 4096
    small = _stride0_channel_parameters(tmp_path / "small.pt", 5)  # the same record, values torch can hold
    assert invoke("convert", small, "-o", tmp_path / "small_out.pt").exit_code == 0
    expected, written = (torch.load(p, weights_only=True)["q"] for p in (small, tmp_path / "small_out.pt"))
    assert torch.equal(written.int_repr(), expected.int_repr())
    assert torch.equal(written.q_per_channel_scales(), expected.q_per_channel_scales())
    assert torch.equal(written.q_per_channel_zero_points(), expected.q_per_channel_zero_points())


# ---------------------------------------------------------------------------------------------- pickles


def _datapkl_list(body: bytes, path: Path) -> Path:
    """A torch zip whose data.pkl is ``{"weight": tensor, "junk": [BODY...]}``."""
    pickle = hostile.whole(hostile.dct((hostile.text("weight"), hostile.rebuild()),
                                       (hostile.text("junk"), b"](" + body + b"e")))
    path.write_bytes(hostile.make_zip(hostile.torch_members(pickle, {"0": hostile.FOUR_FLOATS})))
    return path


def test_six_million_empty_lists_are_read_in_bounded_memory(tmp_path: Path) -> None:
    # 6 MB of EMPTY_LIST: 0.5 GiB of lists; every walk over them once took a record or a pair per list (1.5 GiB+)
    path = _datapkl_list(b"]" * 6_000_000, tmp_path / "lists.pt")
    completed = run_limited(["inspect", path], int(1.5 * GiB), tmp_path)
    assert completed.returncode == 0, completed.stderr
    assert "tensors        1" in completed.stdout


def test_an_empty_set_flood_is_refused_before_it_is_built(tmp_path: Path) -> None:
    # 5 MB of EMPTY_SET would build 1.1 GB of sets: refused by the estimate, not by running out of memory
    path = _datapkl_list(b"\x8f" * 5_000_000, tmp_path / "sets.pt")
    completed = run_limited(["inspect", path], 2 * GiB, tmp_path)
    assert completed.returncode == 3, completed.stderr
    assert "memory bomb" in one_error_line(completed.stderr, path)


def test_dcp_chunk_offsets_with_one_hash_are_read_in_linear_time(tmp_path: Path) -> None:
    # 20 000 offsets (a, b) whose tuples share one hash: indexing them by tuple took over 300 s, now
    # a few (the metadata is then refused: the chunks cover 20 000 of 2**124 elements). The timeout
    # only keeps a regression from hanging the suite.
    small = hostile._expanded_archive(1)
    directory = hostile.dcp_directory(tmp_path / "colliding", [1 << 62, 1 << 62],
                                      [(list(key), [1, 1], small) for key in hostile.colliding_pairs(20_000)])
    try:
        completed = run_limited(["inspect", directory], 2 * GiB, tmp_path, timeout=150)
    except subprocess.TimeoutExpired:
        pytest.fail("inspect of 20 000 colliding DCP offsets ran past 150 s (quadratic indexing)")
    assert completed.returncode == 3
    assert "its chunks hold 20000 of" in one_error_line(completed.stderr, directory)


# ---------------------------------------------------------------------------------------------- shards


def _views_of_one_storage(count: int, path: Path) -> Path:
    """``count`` one-element tensors, each its own view of one storage."""
    pairs = [(hostile.text(f"t{k}"), hostile.call(hostile.glob("torch._utils", "_rebuild_tensor_v2"),
                                                 hostile.storage_pid(count), hostile.integer(k),
                                                 hostile.tup(hostile.integer(1)), hostile.tup(hostile.integer(1)),
                                                 b"\x89", hostile.ordered_dict()))
             for k in range(count)]
    path.write_bytes(hostile.make_zip(hostile.torch_members(hostile.whole(hostile.dct(*pairs)),
                                                            {"0": bytes(4 * count)})))
    return path


def test_a_tiny_max_shard_size_over_many_tensors_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from ckptool.io import writer

    monkeypatch.setattr(writer, "MAX_SHARDS", 50)  # the real bound is 10 000; 51 tensors stand for 10 001
    source = _views_of_one_storage(51, tmp_path / "many.pt")
    out = tmp_path / "out"
    out.mkdir()
    result = invoke("convert", source, "-o", out / "sharded", "--max-shard-size", "1B")
    assert result.exit_code == 2, result.output
    line = one_error_line(result.stderr, source)
    assert "would make 51 shards, over the 50-shard limit" in line and "at least 5 bytes" in line
    assert not any(out.iterdir())


def test_many_shards_are_written_one_at_a_time_in_bounded_memory(tmp_path: Path) -> None:
    # each shard's re-read once held an 8 MiB buffer and a thread until the end: 300 shards, 2.4 GiB
    source = _views_of_one_storage(300, tmp_path / "many.pt")
    out = tmp_path / "out"
    out.mkdir()
    completed = run_limited(["convert", source, "-o", out / "sharded", "--max-shard-size", "1B"], int(1.5 * GiB),
                            tmp_path)
    assert completed.returncode == 0, completed.stderr
    assert sorted(p.name for p in out.iterdir()) == ["sharded"]
    files = sorted(p.name for p in (out / "sharded").iterdir())
    assert len(files) == 301 and safetensors.INDEX_NAME in files
    expected = torch.load(source, weights_only=True)
    from safetensors.torch import load_file

    assert torch.equal(load_file(out / "sharded" / safetensors.shard_file_name(299, 300))["t299"], expected["t299"])


def test_a_failed_sharded_write_leaves_no_temp_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    real = safetensors.write_tensors

    def second_fails(*args: object, **kwargs: object) -> None:
        calls.append(1)
        if len(calls) == 2:
            raise MemoryError
        real(*args, **kwargs)

    monkeypatch.setattr(safetensors, "write_tensors", second_fails)
    source = _views_of_one_storage(3, tmp_path / "three.pt")
    out = tmp_path / "out"
    out.mkdir()
    result = invoke("convert", source, "-o", out / "sharded", "--max-shard-size", "1B")
    assert result.exit_code == 3 and len(result.stderr.strip().splitlines()) == 1
    assert "ran out of memory" in result.stderr
    assert not any(out.iterdir())


# ---------------------------------------------------------------------------------------------- numbers


def test_a_cast_that_overflows_is_refused_naming_the_tensors(tmp_path: Path) -> None:
    source = tmp_path / "big.pt"
    torch.save({"a": torch.tensor([1e5, 1.0]), "b": torch.tensor([1.0]), "c": torch.tensor([-7e4], dtype=torch.float64),
                "d": torch.tensor([float("inf"), float("nan"), 6e4]), "e": torch.tensor([1e38]).bfloat16(),
                "i": torch.tensor([10**6])}, source)
    out = tmp_path / "half.safetensors"
    result = invoke("convert", source, "-o", out, "--dtype", "fp16")
    assert result.exit_code == 3 and not out.exists()
    line = one_error_line(result.stderr, source)
    assert "would turn finite values into Inf in 3 tensor(s): 'a', 'c', 'e'" in line and "--allow-overflow" in line
    assert invoke("convert", source, "-o", tmp_path / "bf16.safetensors", "--dtype", "bf16").exit_code == 0
    result = invoke("convert", source, "-o", out, "--dtype", "fp16", "--allow-overflow")
    assert result.exit_code == 0, result.output
    from safetensors.torch import load_file

    assert torch.isinf(load_file(out)["a"][0]) and torch.equal(load_file(out)["i"], torch.tensor([10**6]))
    result = invoke("verify", out, "--devices", "cpu")
    assert result.exit_code == 1 and "4 weight tensor(s) hold NaN or Inf" in result.stderr  # a, c, e and d


def test_verify_fails_on_nonfinite_weights_unless_allowed(tmp_path: Path) -> None:
    path = tmp_path / "mask.pt"
    torch.save({"w": torch.ones(3), "attn.mask": torch.tensor([0.0, float("-inf")])}, path)
    result = invoke("verify", path, "--devices", "cpu")
    assert result.exit_code == 1
    assert "1 weight tensor(s) hold NaN or Inf: attn.mask (0 NaN, 1 Inf)" in result.stderr
    assert invoke("verify", path, "--devices", "cpu", "--allow-nonfinite-key", "*.mask").exit_code == 0
    assert invoke("verify", path, "--devices", "cpu", "--allow-nonfinite").exit_code == 0
    assert invoke("verify", path, "--devices", "cpu", "--allow-nonfinite-key", "w").exit_code == 1


def test_a_header_over_the_format_limit_is_refused_before_writing(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    # a config that is not shared (so no pickle limit applies) but larger than any safetensors header may be;
    # the entries' own limit (far below, where such a config is left behind and named) raised past it
    from ckptool.formats import entries

    monkeypatch.setattr(entries, "MAX_ENTRIES_CHARS", 2 * safetensors.MAX_HEADER_BYTES)
    source = tmp_path / "big_config.pt"
    torch.save({"model": {"w": torch.ones(2)}, "config": {"notes": "x" * (safetensors.MAX_HEADER_BYTES + 1)}}, source)
    out = tmp_path / "out"
    out.mkdir()
    result = invoke("convert", source, "-o", out / "model.safetensors")
    assert result.exit_code == 3 and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert "over the format's" in result.stderr and "--to pt" in result.stderr
    assert not any(out.iterdir())


def _expansion_by_the_loop(tensors: dict, monkeypatch: pytest.MonkeyPatch) -> refs.Expansion:
    with monkeypatch.context() as patched:
        patched.setattr(refs, "_IS_TENSOR_REF", lambda value: False)  # the loop, which tells views apart
        return refs.expansion(tensors)


def test_expansion_of_untied_views_is_measured_as_the_loop_measures_it(fixtures_dir: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """The C-speed path (a storage per view) against the loop, on every fixture and on 3,000 drawn views: sizes,
    offsets and strides (0 among them) over storages that hold too few, enough or more bytes."""
    import copy
    import random

    import ckptool

    measured = 0
    for path in sorted(fixtures_dir.glob("*.pt")) + sorted(fixtures_dir.glob("*.safetensors")):
        try:
            tensors = ckptool.load(path).tensors
        except ckptool.CkptError:
            continue
        assert refs.expansion(tensors) == _expansion_by_the_loop(tensors, monkeypatch), path.name
        measured += 1
    assert measured >= 10
    base = list(ckptool.load(fixtures_dir / "single_lenet.pt").tensors.values())
    rng = random.Random(20261127)
    expanding = whole = 0
    for _ in range(3000):
        tensors = {}
        all_whole = rng.random() < 0.25  # every view all of its storage's bytes (refs.whole_plain's path)
        for index in range(rng.randint(1, 6)):
            view = copy.copy(rng.choice(base))
            view.storage = copy.copy(view.storage)
            view.storage.numel = rng.randint(0, 30)
            dims = rng.randint(0, 3)
            view.shape = tuple(rng.randint(0, 4) for _ in range(dims))
            view.stride = tuple(rng.choice([0, 1, 2, 5]) for _ in range(dims))
            view.offset = rng.randint(0, 3)
            if all_whole:
                view.stride, view.offset = refs.contiguous_stride(view.shape), 0
                view.storage.data = refs.ByteRange(path, 0, math.prod(view.shape) * view.dtype.itemsize)
            tensors[f"t{index}"] = view
        fast = refs.expansion(tensors)
        assert fast == _expansion_by_the_loop(tensors, monkeypatch)
        expanding += bool(fast.expanding)
        whole += refs.whole_plain(list(tensors.values())) is not None
    assert 300 < expanding < 2700 and whole > 500  # every kind drawn often


def test_check_tree_counts_a_plain_tensor_as_a_leaf_and_enters_any_other(fixtures_dir: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Nesting at the limit passes and one level more is refused: a plain tensor is a leaf (height 1), a tensor with
    hooks is entered (its hooks one level more), and a cycle back through such a tensor ends as a leaf."""
    import copy
    from collections import OrderedDict

    import ckptool
    from ckptool.base.errors import InputError
    from ckptool.pickles import limits, unpickle

    monkeypatch.setattr(limits, "MAX_NESTING", 6)
    plain = next(iter(ckptool.load(fixtures_dir / "single_lenet.pt").tensors.values()))
    hooked = copy.copy(plain)
    hooked.backward_hooks = OrderedDict(hook="a hook")

    def nest(leaf: object, levels: int) -> object:
        for _ in range(levels):
            leaf = [leaf, "text", 1]
        return leaf

    def refused(tree: object) -> bool:
        try:
            unpickle.check_tree(tree)
        except InputError:
            return True
        return False

    assert not refused(nest(plain, 5)) and refused(nest(plain, 6))  # lists 5 + the tensor 1
    assert not refused(nest(hooked, 4)) and refused(nest(hooked, 5))  # lists 4 + the tensor + its hooks
    assert not refused({f"w{index}": plain for index in range(1000)})  # a state dict: one level over its tensors
    loop: list = []
    cyclic = copy.copy(plain)
    cyclic.backward_hooks = OrderedDict(back=loop)
    loop.append(cyclic)
    assert not refused(nest(loop, 2))
