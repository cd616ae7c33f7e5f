"""ckptool.load_state_dict: any checkpoint as {name: torch.Tensor}, held to torch's and safetensors' own readers.

Every comparison is against ``torch.load(weights_only=True)``, ``safetensors.torch.load_file`` or
``torch.jit.load(f).state_dict()`` of the same file: values bit for bit (``torch.equal``), dtypes, shapes,
strides and storage offsets, and which keys share a storage.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

import ckptool
from ckptool.ops import state_dict as state_dict_module

MANIFEST = json.loads((Path(__file__).resolve().parent.parent / "fixtures" / "manifest.json").read_text())
FIXTURES = {entry["file"]: entry for entry in MANIFEST["fixtures"]}


def same_tensors(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    """Equal keys in the same order, and each tensor equal with its dtype, shape, strides and offset."""
    assert list(got) == list(expected)
    for key, want in expected.items():
        tensor = got[key]
        assert tensor.dtype == want.dtype and tensor.shape == want.shape, key
        assert tensor.device.type == "cpu", key
        assert tensor.stride() == want.stride() and tensor.storage_offset() == want.storage_offset(), key
        assert torch.equal(tensor, want), key


def at(container: Any, layout: list[Any]) -> Any:
    for key in layout:
        container = container[key]
    return container


def torch_reading(path: Path, entry: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The weights of a fixture as torch (or safetensors) reads them."""
    if entry["format"] == "safetensors":
        return load_file(path)
    if entry["format"] == "safetensors-sharded":
        index = json.loads(path.read_text())
        merged: dict[str, torch.Tensor] = {}
        for shard in dict.fromkeys(index["weight_map"].values()):
            merged.update(load_file(path.parent / shard))
        return {key: merged[key] for key in index["weight_map"]}
    if entry["format"] == "torchscript":
        return dict(torch.jit.load(path, map_location="cpu").state_dict())
    loaded = torch.load(path, weights_only=True, map_location="cpu")  # GPU-saved fixtures: onto the CPU
    return dict(at(loaded, entry["layout"]))


@pytest.mark.parametrize("name", sorted(FIXTURES))
def test_every_fixture_as_torch_reads_it(fixtures_dir: Path, name: str) -> None:
    entry = FIXTURES[name]
    path = fixtures_dir / name
    got = ckptool.load_state_dict(path)
    expected = torch_reading(path, entry)
    if entry["format"] == "safetensors-sharded":  # safetensors' own order is by name; the index's is the weight map's
        assert sorted(got) == sorted(expected)
        got = {key: got[key] for key in expected}
    same_tensors(got, expected)
    for group in entry["tied"] or []:  # torch.load gives tied tensors one storage: so does ckptool
        pointers = {got[key].untyped_storage().data_ptr() for key in group}
        assert len(pointers) == 1, group


def test_wrapper_prefixes_stay(fixtures_dir: Path) -> None:
    for name in ("dp_mlp_wrapped.pt", "compiled_mlp.pt", "ddp_compiled_lenet.pt"):
        got = ckptool.load_state_dict(fixtures_dir / name)
        assert got and all(key.startswith(FIXTURES[name]["prefix"]) for key in got), name


def test_sharded_bin_folder_and_its_index(fixtures_dir: Path) -> None:
    folder = fixtures_dir / "wild" / "sharded_bin"
    index = json.loads((folder / "pytorch_model.bin.index.json").read_text())
    expected: dict[str, torch.Tensor] = {}
    for shard in dict.fromkeys(index["weight_map"].values()):
        expected.update(torch.load(folder / shard, weights_only=True))
    for given in (folder, folder / "pytorch_model.bin.index.json"):
        got = ckptool.load_state_dict(given)
        assert sorted(got) == sorted(expected)
        same_tensors({key: got[key] for key in expected}, expected)


def test_weights_chosen_in_a_container(tmp_path: Path) -> None:
    generator = torch.Generator().manual_seed(3)
    model = {"fc.weight": torch.randn(4, 3, generator=generator), "fc.bias": torch.randn(4, generator=generator)}
    ema = {key: value * 0.5 for key, value in model.items()}
    torch.save({"model": model, "ema": ema, "epoch": 7}, tmp_path / "run.pt")
    same_tensors(ckptool.load_state_dict(tmp_path / "run.pt"), model)
    same_tensors(ckptool.load_state_dict(tmp_path / "run.pt", weights="ema"), ema)
    with pytest.raises(ckptool.InputError, match="no weights at 'emma'"):
        ckptool.load_state_dict(tmp_path / "run.pt", weights="emma")


def test_ema_of_a_timm_container(fixtures_dir: Path) -> None:
    path = fixtures_dir / "wild" / "ema_container.pt"
    loaded = torch.load(path, weights_only=True)
    same_tensors(ckptool.load_state_dict(path, weights="state_dict_ema"), dict(loaded["state_dict_ema"]))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision(tmp_path: Path, dtype: torch.dtype) -> None:
    generator = torch.Generator().manual_seed(5)
    weights = {
        "a": torch.randn(33, 7, generator=generator).to(dtype),
        "b": torch.randn(5, generator=generator).to(dtype),
    }
    torch.save(weights, tmp_path / "half.pt")
    save_file(weights, tmp_path / "half.safetensors")
    same_tensors(ckptool.load_state_dict(tmp_path / "half.pt"), torch.load(tmp_path / "half.pt", weights_only=True))
    same_tensors(ckptool.load_state_dict(tmp_path / "half.safetensors"), load_file(tmp_path / "half.safetensors"))


def test_legacy_format(tmp_path: Path) -> None:
    weights = {"w": torch.arange(12, dtype=torch.float64).reshape(3, 4), "t": torch.arange(12.0).reshape(3, 4).t()}
    torch.save(weights, tmp_path / "legacy.pt", _use_new_zipfile_serialization=False)
    got = ckptool.load_state_dict(tmp_path / "legacy.pt")
    same_tensors(got, torch.load(tmp_path / "legacy.pt", weights_only=True))


def test_entries_that_are_not_tensors_are_left_out(tmp_path: Path) -> None:
    state = {"w": torch.ones(2), "_step": 3, "n": torch.tensor(4)}
    torch.save(state, tmp_path / "mixed.pt")
    got = ckptool.load_state_dict(tmp_path / "mixed.pt")
    assert list(got) == ["w", "n"] and torch.equal(got["n"], torch.tensor(4))


def test_conjugate_and_negative_views(tmp_path: Path) -> None:
    generator = torch.Generator().manual_seed(9)
    base = torch.randn(4, dtype=torch.complex64, generator=generator)
    torch.save({"conj": base.conj(), "neg": torch._neg_view(base), "plain": base}, tmp_path / "bits.pt")
    got = ckptool.load_state_dict(tmp_path / "bits.pt")
    expected = torch.load(tmp_path / "bits.pt", weights_only=True)
    same_tensors(got, expected)
    assert got["conj"].is_conj() == expected["conj"].is_conj() and got["neg"].is_neg() == expected["neg"].is_neg()


def test_sparse_nested_and_quantized_as_torch_gives_them(tmp_path: Path) -> None:
    generator = torch.Generator().manual_seed(4)
    state = {
        "coo": torch.randn(4, 5, generator=generator).relu().to_sparse(),
        "csr": torch.randn(3, 3, generator=generator).relu().to_sparse_csr(),
        "nested": torch.nested.nested_tensor([torch.randn(2, 3, generator=generator), torch.randn(4, 3)]),
        "quantized": torch.quantize_per_tensor(torch.randn(6, generator=generator), 0.1, 3, torch.quint8),
    }
    torch.save(state, tmp_path / "layouts.pt")
    got = ckptool.load_state_dict(tmp_path / "layouts.pt")
    expected = torch.load(tmp_path / "layouts.pt", weights_only=True)
    assert list(got) == list(expected)
    assert got["coo"].layout == torch.sparse_coo and torch.equal(got["coo"].to_dense(), expected["coo"].to_dense())
    assert got["csr"].layout == torch.sparse_csr and torch.equal(got["csr"].to_dense(), expected["csr"].to_dense())
    assert got["nested"].is_nested
    assert all(torch.equal(a, b) for a, b in zip(got["nested"].unbind(), expected["nested"].unbind(), strict=True))
    assert got["quantized"].is_quantized and got["quantized"].q_scale() == expected["quantized"].q_scale()
    assert torch.equal(got["quantized"].int_repr(), expected["quantized"].int_repr())


def test_mapped_bytes_stay_private(tmp_path: Path) -> None:
    """Aligned bytes are mapped copy-on-write: writing to a tensor never writes the file."""
    torch.save({"w": torch.zeros(4096)}, tmp_path / "zeros.pt")
    before = (tmp_path / "zeros.pt").read_bytes()
    got = ckptool.load_state_dict(tmp_path / "zeros.pt")
    got["w"] += 1
    assert (tmp_path / "zeros.pt").read_bytes() == before
    assert torch.equal(ckptool.load_state_dict(tmp_path / "zeros.pt")["w"], torch.zeros(4096))


def test_a_loaded_checkpoint(fixtures_dir: Path) -> None:
    checkpoint = ckptool.load(fixtures_dir / "tied_lm.pt")
    same_tensors(ckptool.load_state_dict(checkpoint), torch.load(fixtures_dir / "tied_lm.pt", weights_only=True))
    with pytest.raises(ckptool.CkptError, match="variant='fp16' chooses the files of a folder"):
        ckptool.load_state_dict(checkpoint, variant="fp16")


def test_model_folder_components_and_variant(tmp_path: Path) -> None:
    folder = tmp_path / "pipeline"
    unet = {"conv.weight": torch.arange(6.0).reshape(2, 3)}
    encoder = {"embed.weight": torch.ones(3, 2)}
    (folder / "unet").mkdir(parents=True)
    (folder / "text_encoder").mkdir()
    (folder / "model_index.json").write_text(
        json.dumps(
            {
                "_class_name": "StableDiffusionPipeline",
                "unet": ["diffusers", "UNet2DConditionModel"],
                "text_encoder": ["transformers", "CLIPTextModel"],
            }
        )
    )
    save_file(unet, folder / "unet" / "diffusion_pytorch_model.safetensors")
    save_file({k: v.half() for k, v in unet.items()}, folder / "unet" / "diffusion_pytorch_model.fp16.safetensors")
    save_file(encoder, folder / "text_encoder" / "model.safetensors")
    whole = ckptool.load_state_dict(folder)
    assert sorted(whole) == ["text_encoder/embed.weight", "unet/conv.weight"]
    same_tensors(ckptool.load_state_dict(folder, weights="unet"), unet)
    half = ckptool.load_state_dict(folder, weights="unet", variant="fp16")
    assert half["conv.weight"].dtype == torch.float16 and torch.equal(half["conv.weight"].float(), unet["conv.weight"])


def test_hostile_pickle_is_refused_and_nothing_runs(tmp_path: Path) -> None:
    canary = tmp_path / "canary"

    class Payload:
        def __reduce__(self) -> tuple[Any, tuple[str]]:
            return (os.system, (f"touch {canary}",))  # named in the pickle, never called by anyone

    torch.save({"w": torch.ones(2), "payload": Payload()}, tmp_path / "hostile.pt")
    with pytest.raises(ckptool.UnsafeCheckpointError) as refused:
        ckptool.load_state_dict(tmp_path / "hostile.pt")
    assert refused.value.globals == [f"{os.system.__module__}.system"]  # posix.system: os.system, by its real name
    assert "runs code" in str(refused.value)  # and no option offered that would allow it
    assert not canary.exists()


# ---------------------------------------------------------------------------------------------- devices


def test_cuda_without_a_gpu_is_one_line(fixtures_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(state_dict_module, "available_devices", lambda: ["cpu"])  # this machine, without a GPU
    for device in ("cuda", torch.device("cuda:1")):
        with pytest.raises(ckptool.CkptError) as refused:
            ckptool.load_state_dict(fixtures_dir / "tied_lm.pt", device=device)
        assert refused.value.exit_code == 2  # a usage error: the input was never read
        name = str(device)
        assert str(refused.value) == (
            f"device={name!r} is not available on this machine (available: cpu) — "
            "load onto the CPU with device='cpu', or run where that device is"
        )


def test_malformed_device(fixtures_dir: Path) -> None:
    with pytest.raises(ckptool.CkptError, match="device='gpu0' is not a device — pass one like 'cpu', 'cuda'"):
        ckptool.load_state_dict(fixtures_dir / "tied_lm.pt", device="gpu0")


def test_meta_device_reads_no_values(fixtures_dir: Path) -> None:
    expected = torch.load(fixtures_dir / "views.pt", weights_only=True)
    got = ckptool.load_state_dict(fixtures_dir / "views.pt", device="meta")
    assert list(got) == list(expected)
    for key, want in expected.items():
        tensor = got[key]
        assert tensor.device.type == "meta" and tensor.dtype == want.dtype and tensor.shape == want.shape
        assert tensor.stride() == want.stride() and tensor.storage_offset() == want.storage_offset()


def test_the_move_keeps_views_and_ties(fixtures_dir: Path) -> None:
    """The storage-by-storage move, run to the CPU: each storage moved once, every view rebuilt on it."""
    for name in ("views.pt", "tied_lm.pt"):
        checkpoint = ckptool.load(fixtures_dir / name)
        moved = state_dict_module._on_device(dict(checkpoint.state_dict), torch.device("cpu"))
        same_tensors(moved, torch.load(fixtures_dir / name, weights_only=True))
        for group in FIXTURES[name]["tied"]:
            assert len({moved[key].untyped_storage().data_ptr() for key in group}) == 1


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_onto_a_gpu(fixtures_dir: Path) -> None:
    for name in ("views.pt", "tied_lm.pt", "gpu_cuda1_ddp_lenet.pt", "mlp.safetensors"):
        expected = torch_reading(fixtures_dir / name, FIXTURES[name])
        got = ckptool.load_state_dict(fixtures_dir / name, device="cuda")
        assert list(got) == list(expected)
        for key, want in expected.items():
            assert got[key].device == torch.device("cuda", torch.cuda.current_device()), key
            assert got[key].stride() == want.stride() and got[key].storage_offset() == want.storage_offset()
            assert torch.equal(got[key].cpu(), want), key
        for group in FIXTURES[name]["tied"]:
            assert len({got[key].untyped_storage().data_ptr() for key in group}) == 1, group
