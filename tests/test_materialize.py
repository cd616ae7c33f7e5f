"""materialize.py: lazy references -> real tensors (ties and views kept), and load_into's key fitting."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import safetensors.torch
import torch
from torch import nn

import ckptool
from ckptool.base.errors import InputError
from ckptool.ops.load_into import (
    KeyRewrite,
    LoadMismatchError,
    best_rewrite,
    group_by_module,
    load_into,
    materialize_storage,
    module_of,
    to_state_dict,
)
from ckptool.tensors.refs import StorageRef
from ckptool.files.ranges import ByteRange
from training.models import LeNet, build_model


def lenet_state(seed: int = 0, num_classes: int = 10) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    return LeNet(num_classes=num_classes).state_dict()


def assert_loaded(model: nn.Module, expected: dict[str, torch.Tensor], *, prefix: str = "") -> None:
    state = model.state_dict()
    assert set(state) == {prefix + key for key in expected}
    for key, tensor in expected.items():
        assert torch.equal(state[prefix + key].cpu(), tensor), key  # DataParallel moves a model to cuda:0 where there is one


# ---------------------------------------------------------------------------------------------- to_state_dict


@pytest.mark.parametrize("fixture", ["single_lenet.pt", "legacy_mlp.pt", "mlp.safetensors",
                                     "sharded/model.safetensors.index.json", "views.pt", "lightning_mlp.ckpt"])
def test_to_state_dict_equals_torchs_own_reader(fixtures_dir: Path, fixture: str) -> None:
    path = fixtures_dir / fixture
    checkpoint = ckptool.load(path)
    state_dict = to_state_dict(checkpoint.tensors)
    if path.suffix == ".safetensors":
        expected = safetensors.torch.load_file(path)
    elif path.name.endswith(".index.json"):
        expected = {}
        for shard in sorted(path.parent.glob("*.safetensors")):
            expected.update(safetensors.torch.load_file(shard))
    else:
        loaded = torch.load(path, weights_only=True, map_location="cpu")
        for key in checkpoint.layout:
            loaded = loaded[key]
        expected = loaded
    assert set(state_dict) == set(expected)
    for name, tensor in expected.items():
        got = state_dict[name]
        assert got.dtype == tensor.dtype and got.shape == tensor.shape, name
        assert got.stride() == tensor.stride(), name  # views keep their saved strides
        assert torch.equal(got, tensor), name


def test_tied_weights_stay_tied(fixtures_dir: Path, tmp_path: Path) -> None:
    embed = nn.Embedding(11, 6)
    head = nn.Linear(6, 11, bias=False)
    head.weight = embed.weight
    path = tmp_path / "tied.pt"
    torch.save({"embed.weight": embed.weight, "head.weight": head.weight}, path)
    state_dict = to_state_dict(ckptool.load(path).tensors)
    assert state_dict["embed.weight"].data_ptr() == state_dict["head.weight"].data_ptr()
    assert torch.equal(state_dict["head.weight"], embed.weight.detach())
    fixture = fixtures_dir / "tied_lm.pt"
    if fixture.exists():
        tied = to_state_dict(ckptool.load(fixture).tensors)
        assert tied["embed.weight"].data_ptr() == tied["head.weight"].data_ptr()


def test_views_share_one_storage(tmp_path: Path) -> None:
    fused = torch.arange(24, dtype=torch.float32).reshape(6, 4)
    path = tmp_path / "views.pt"
    torch.save({"q": fused[0:2], "k": fused[2:4], "v": fused[4:6], "t": fused.t()}, path)
    state_dict = to_state_dict(ckptool.load(path).tensors)
    storages = {tensor.untyped_storage().data_ptr() for tensor in state_dict.values()}
    assert len(storages) == 1
    assert state_dict["k"].storage_offset() == 8
    assert state_dict["t"].stride() == (1, 4)
    assert torch.equal(state_dict["v"], fused[4:6]) and torch.equal(state_dict["t"], fused.t())


def test_tied_tensors_stay_tied_through_safetensors_aliases(tmp_path: Path) -> None:
    weight = torch.randn(5, 3)
    source = tmp_path / "tied.pt"
    torch.save({"a": weight, "b": weight}, source)
    target = tmp_path / "tied.safetensors"
    ckptool.save(ckptool.load(source), target)
    state_dict = to_state_dict(ckptool.load(target).tensors)
    assert state_dict["a"].data_ptr() == state_dict["b"].data_ptr()


def test_mmap_and_read_give_the_same_bytes_and_unaligned_bytes_are_copied(tmp_path: Path) -> None:
    values = torch.arange(10, dtype=torch.float32)
    path = tmp_path / "raw.bin"
    path.write_bytes(b"xyz" + values.numpy().tobytes())  # 3-byte offset: not float-aligned
    storage = StorageRef(key="0", dtype=ckptool.tensors.dtypes.by_name("F32"), numel=10, location="cpu",
                         data=ByteRange(path, 3, 40))
    for mmap in (True, False):
        untyped = materialize_storage(storage, mmap=mmap, alignment=4)
        tensor = torch.empty(0, dtype=torch.float32).set_(untyped, 0, (10,), (1,))
        assert tensor.data_ptr() % 4 == 0
        assert torch.equal(tensor, values)


def test_mmap_copy_is_private(tmp_path: Path) -> None:
    path = tmp_path / "w.pt"
    torch.save({"w": torch.zeros(4096)}, path)
    before = path.read_bytes()
    state_dict = to_state_dict(ckptool.load(path).tensors)
    state_dict["w"].add_(1.0)  # copy-on-write: the file must not change
    assert path.read_bytes() == before


def test_truncated_storage_is_an_input_error(tmp_path: Path) -> None:
    path = tmp_path / "short.bin"
    path.write_bytes(b"\0" * 16)
    storage = StorageRef(key="7", dtype=ckptool.tensors.dtypes.by_name("F32"), numel=8, location="cpu",
                         data=ByteRange(path, 0, 32))
    with pytest.raises(InputError, match="storage '7' ends after the end of the file"):
        materialize_storage(storage)


def test_import_ckptool_does_not_import_torch() -> None:
    import subprocess
    import sys

    code = "import sys, ckptool, ckptool.ops.load_into, ckptool.verification.models; print('torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"


# ---------------------------------------------------------------------------------------------- key fitting


def test_best_rewrite_prefers_the_identity_and_finds_stacks() -> None:
    shapes = {"fc.weight": (2, 3), "fc.bias": (2,)}
    assert best_rewrite(shapes, shapes).rewrite == KeyRewrite()
    stacked = {"module._orig_mod." + key: shape for key, shape in shapes.items()}
    assert best_rewrite(stacked, shapes, checkpoint_prefix="module._orig_mod.").rewrite == \
        KeyRewrite(strip="module._orig_mod.")
    wrapped_model = {"module." + key: shape for key, shape in shapes.items()}
    assert best_rewrite(shapes, wrapped_model).rewrite == KeyRewrite(add="module.")
    # Lightning's model. is found even without the Lightning markers
    assert best_rewrite({"model." + k: s for k, s in shapes.items()}, shapes).rewrite == KeyRewrite(strip="model.")


def test_module_grouping() -> None:
    assert module_of("layer1.0.conv1.weight") == "layer1.0"
    assert module_of("weight") == "(top level)"
    assert group_by_module(["conv1.weight", "conv1.bias", "fc.weight"]) == {
        "conv1": ["conv1.weight", "conv1.bias"], "fc": ["fc.weight"]}


# ---------------------------------------------------------------------------------------------- load_into


@pytest.mark.parametrize("prefix", ["module.", "_orig_mod.", "module._orig_mod."])
def test_load_into_strips_wrapper_prefixes(tmp_path: Path, prefix: str) -> None:
    expected = lenet_state(seed=3)
    path = tmp_path / "wrapped.pt"
    torch.save({"model": {prefix + key: value for key, value in expected.items()}, "epoch": 2}, path)
    model = LeNet()
    report = load_into(model, path)
    assert report.rewrite == KeyRewrite(strip=prefix)
    assert (report.matched, report.missing, report.unexpected, report.mismatched) == (8, 0, 0, 0)
    assert_loaded(model, expected)


def test_load_into_lightning_checkpoint(tmp_path: Path) -> None:
    torch.manual_seed(4)
    mlp = build_model("mlp")
    path = tmp_path / "lit.ckpt"
    torch.save({"state_dict": {"model." + k: v for k, v in mlp.state_dict().items()},
                "pytorch-lightning_version": "2.4.0", "hyper_parameters": {"lr": 0.1}, "epoch": 1}, path)
    model = build_model("mlp")
    report = load_into(model, path)
    assert report.rewrite == KeyRewrite(strip="model.")
    assert report.layout == ("state_dict",)
    assert_loaded(model, mlp.state_dict())


def test_load_into_data_parallel_model_adds_module_prefix(tmp_path: Path) -> None:
    expected = lenet_state(seed=5)
    path = tmp_path / "bare.safetensors"
    safetensors.torch.save_file(expected, path)
    wrapped = nn.DataParallel(LeNet())
    report = load_into(wrapped, path)
    assert report.rewrite == KeyRewrite(add="module.")
    assert report.model == "DataParallel(LeNet)"
    assert_loaded(wrapped, expected, prefix="module.")


@pytest.mark.parametrize(("fixture", "model"), [("ddp_lenet_wrapped.pt", "lenet"), ("compiled_mlp.pt", "mlp"),
                                                 ("lightning_mlp.ckpt", "mlp"), ("ddp_compiled_lenet.pt", "lenet"),
                                                 ("gpu_cuda1_ddp_lenet.pt", "lenet"), ("dp_mlp_wrapped.pt", "mlp")])
def test_load_into_real_fixtures(fixtures_dir: Path, fixture: str, model: str) -> None:
    path = fixtures_dir / fixture
    network = build_model(model)
    report = load_into(network, path)
    assert not report.rewrite.is_identity
    checkpoint = ckptool.load(path)
    for key, tensor in to_state_dict(checkpoint.tensors).items():
        assert torch.equal(network.state_dict()[report.rewrite.apply(key)], tensor), key


def test_load_into_without_fix_names_the_strip_command(tmp_path: Path) -> None:
    path = tmp_path / "ddp.pt"
    torch.save({"module." + k: v for k, v in lenet_state().items()}, path)
    model = LeNet()
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(LoadMismatchError) as caught:
        load_into(model, path, fix=False)
    error = caught.value
    assert error.exit_code == 1
    assert str(error) == (f'{path}: every weight key carries "module." (DataParallel/DDP) but LeNet\'s keys have '
                          f"no prefix — run: ckptool strip {path} -o {tmp_path / 'ddp.stripped.pt'}")
    assert error.diagnosis.cause == "prefix"
    assert error.diagnosis.to_json()["unexpected"] == {"module.conv1": ["module.conv1.weight", "module.conv1.bias"],
                                                        "module.conv2": ["module.conv2.weight", "module.conv2.bias"],
                                                        "module.fc1": ["module.fc1.weight", "module.fc1.bias"],
                                                        "module.fc2": ["module.fc2.weight", "module.fc2.bias"]}
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items()), "nothing may be loaded"


def test_bare_checkpoint_into_wrapped_model_without_fix_names_add_prefix(tmp_path: Path) -> None:
    path = tmp_path / "plain.pt"
    torch.save(lenet_state(), path)
    with pytest.raises(LoadMismatchError) as caught:
        load_into(nn.DataParallel(LeNet()), path, fix=False)
    assert f"ckptool add-prefix {path} -o {tmp_path / 'plain.prefixed.pt'} --prefix module." in str(caught.value)


def test_wrong_architecture_is_diagnosed(tmp_path: Path) -> None:
    torch.manual_seed(0)
    path = tmp_path / "mlp.pt"
    torch.save(build_model("mlp").state_dict(), path)
    with pytest.raises(LoadMismatchError) as caught:
        load_into(LeNet(), path)
    diagnosis = caught.value.diagnosis
    assert diagnosis.cause == "architecture"
    assert diagnosis.message == ("holds a different architecture than LeNet: 3 of its 8 tensors found with the right "
                                 "shape (missing: conv1, conv2; unexpected: none; other shapes: fc1) — pass the model "
                                 "this checkpoint was trained with")
    assert [m.key for m in diagnosis.mismatched] == ["fc1.weight"]
    assert group_by_module(diagnosis.missing) == {"conv1": ["conv1.weight", "conv1.bias"],
                                                  "conv2": ["conv2.weight", "conv2.bias"]}


def test_classifier_head_of_another_size_is_diagnosed(tmp_path: Path) -> None:
    path = tmp_path / "five.pt"
    torch.save({"module." + k: v for k, v in lenet_state(num_classes=5).items()}, path)
    with pytest.raises(LoadMismatchError) as caught:
        load_into(LeNet(), path)
    diagnosis = caught.value.diagnosis
    assert [m.key for m in diagnosis.fitted_mismatched] == ["fc2.weight", "fc2.bias"]
    assert "the classifier head differs: fc2.weight is [5, 128] in the checkpoint but [10, 128] in LeNet" \
        in diagnosis.problem
    assert "num_classes=5" in diagnosis.fix


def test_a_missing_buffer_is_a_partial_mismatch(tmp_path: Path) -> None:
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8))
    state_dict = model.state_dict()
    del state_dict["1.num_batches_tracked"]
    path = tmp_path / "partial.pt"
    torch.save(state_dict, path)
    with pytest.raises(LoadMismatchError) as caught:
        load_into(model, path)
    assert caught.value.diagnosis.cause == "partial"
    assert str(caught.value) == (f"{path}: 1 of Sequential's keys are missing (1.num_batches_tracked) — check that the "
                                 "checkpoint was saved from this version of the model")
