"""Model folders as inputs: diffusers pipelines, a folder holding one ``.bin``, variants, PEFT adapter
folders, sentence-transformers repos, diffusers training folders; and ``convert`` of a folder.

The folders are laid out as the libraries lay them out (the names their ``save_pretrained`` writes,
``torch.save``'d and ``save_file``'d weights, their JSON configs); the frameworks' own writes are
checked in ``tests/test_frameworks.py`` and ``make frameworks``. Every value ckptool reads is
compared with torch's or safetensors' own reading of the file.
"""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

import ckptool
from ckptool.base.errors import InputError, UnsafeCheckpointError
from ckptool.cli.main import main
from ckptool.ops.load_into import to_state_dict


def weights(seed: int, names: tuple[str, ...] = ("conv_in.weight", "conv_in.bias", "mid.attn.to_q.weight")) -> dict:
    generator = torch.Generator().manual_seed(seed)
    shapes = {"conv_in.weight": (4, 2, 3, 3), "conv_in.bias": (4,), "mid.attn.to_q.weight": (4, 4)}
    return {name: torch.randn(shapes.get(name, (3, 3)), generator=generator) for name in names}


def write_json(path: Path, value: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(value, indent=2, sort_keys=True) + "\n")


def pipeline(root: Path, *, text_encoder_bin: bool = True, fp16: bool = False) -> Path:
    """A Stable Diffusion pipeline's tree: model_index.json, unet/, vae/, text_encoder/, tokenizer/, scheduler/."""
    write_json(
        root / "model_index.json",
        {
            "_class_name": "StableDiffusionPipeline",
            "_diffusers_version": "0.39.0",
            "scheduler": ["diffusers", "PNDMScheduler"],
            "text_encoder": ["transformers", "CLIPTextModel"],
            "tokenizer": ["transformers", "CLIPTokenizer"],
            "unet": ["diffusers", "UNet2DConditionModel"],
            "vae": ["diffusers", "AutoencoderKL"],
        },
    )
    for seed, name in enumerate(("unet", "vae")):
        write_json(root / name / "config.json", {"_class_name": "UNet2DConditionModel", "_diffusers_version": "0.39.0"})
        state = weights(seed)
        save_file(state, str(root / name / "diffusion_pytorch_model.safetensors"), metadata={"format": "pt"})
        if fp16:
            half = {key: value.half() for key, value in state.items()}
            save_file(half, str(root / name / "diffusion_pytorch_model.fp16.safetensors"), metadata={"format": "pt"})
    write_json(
        root / "text_encoder" / "config.json", {"architectures": ["CLIPTextModel"], "model_type": "clip_text_model"}
    )
    text = weights(7, ("text_model.embeddings.token_embedding.weight", "text_model.final_layer_norm.weight"))
    if text_encoder_bin:
        torch.save(text, root / "text_encoder" / "pytorch_model.bin")
    else:
        save_file(text, str(root / "text_encoder" / "model.safetensors"), metadata={"format": "pt"})
    write_json(root / "tokenizer" / "tokenizer_config.json", {"tokenizer_class": "CLIPTokenizer"})
    (root / "tokenizer" / "merges.txt").write_text("#version: 0.2\nl o\n")
    write_json(root / "tokenizer" / "vocab.json", {"<|endoftext|>": 0, "lo": 1})
    write_json(
        root / "scheduler" / "scheduler_config.json", {"_class_name": "PNDMScheduler", "num_train_timesteps": 1000}
    )
    return root


def run(*args: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(main, [str(arg) for arg in args])
    assert not isinstance(result.exception, AssertionError | TypeError | AttributeError | KeyError), result.exception
    return result.exit_code, result.stdout, result.stderr


def inspect_json(*args: str) -> dict:
    code, out, err = run("inspect", *args, "--json")
    assert code == 0, err
    return json.loads(out)


def values(path: Path | str, **options: str) -> dict[str, torch.Tensor]:
    checkpoint = ckptool.load(path, **options)
    return to_state_dict(checkpoint.tensors, mmap=False)


def torch_values(root: Path) -> dict[str, torch.Tensor]:
    """The pipeline's weights as torch and safetensors read each file, as '<component>/<key>'."""
    found = {}
    for name in ("text_encoder", "unet", "vae"):
        folder = root / name
        for file in sorted(folder.iterdir()):
            if file.name.endswith(".bin"):
                state = torch.load(file, weights_only=True)
            elif file.name.endswith(".safetensors") and ".fp16." not in file.name:
                state = load_file(file)
            else:
                continue
            found.update({f"{name}/{key}": value for key, value in state.items()})
    return found


def assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for key, value in want.items():
        assert got[key].dtype == value.dtype and torch.equal(got[key], value), key


# ------------------------------------------------------------------------------------------------ reading


def test_a_pipeline_reads_as_its_components_together(tmp_path: Path) -> None:
    root = pipeline(tmp_path / "sd")
    assert_same(values(root), torch_values(root))
    data = inspect_json(root)
    assert data["format"] == "model-folder"
    assert data["tensors"] == 8
    assert [c["weights"] for c in data["candidates"]] == ["text_encoder", "unet", "vae"]
    assert [c["tensors"] for c in data["candidates"]] == [2, 3, 3]
    listed = [file["file"] for file in data["training_folder"]["files"]]
    assert "model_index.json" in listed and "scheduler/scheduler_config.json" in listed
    assert "tokenizer/vocab.json" in listed and "unet/diffusion_pytorch_model.safetensors" not in listed


@pytest.mark.parametrize("spelling", ["unet", "unet/"])
def test_weights_chooses_one_component(tmp_path: Path, spelling: str) -> None:
    root = pipeline(tmp_path / "sd")
    got = values(root, weights=spelling)
    assert_same(got, load_file(root / "unet" / "diffusion_pytorch_model.safetensors"))
    data = inspect_json(root, "--weights", spelling)
    assert data["format"] == "safetensors" and data["tensors"] == 3
    assert [c["chosen"] for c in data["candidates"]] == [False, True, False]


def test_a_component_that_is_one_bin_is_read(tmp_path: Path) -> None:
    root = pipeline(tmp_path / "sd")
    got = values(root, weights="text_encoder")
    assert_same(got, torch.load(root / "text_encoder" / "pytorch_model.bin", weights_only=True))
    # the sub-folder alone, as a user points at it
    assert_same(values(root / "text_encoder"), got)


@pytest.mark.parametrize("name", ["pytorch_model.bin", "adapter_model.bin", "diffusion_pytorch_model.bin"])
def test_a_folder_of_one_bin_and_no_index_is_read(tmp_path: Path, name: str) -> None:
    folder = tmp_path / "model"
    folder.mkdir()
    state = weights(3)
    torch.save(state, folder / name)
    assert_same(values(folder), state)
    code, out, err = run("inspect", folder)
    assert code == 0, err


def adapter_config(folder: Path, base: str) -> None:
    """A PEFT LoRA adapter's adapter_config.json, as save_pretrained writes its main fields."""
    write_json(
        folder / "adapter_config.json",
        {"peft_type": "LORA", "r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"],
         "base_model_name_or_path": base, "task_type": "CAUSAL_LM"},
    )  # fmt: skip


def test_a_peft_adapter_folder(tmp_path: Path) -> None:
    folder = tmp_path / "adapter"
    adapter_config(folder, "tiny-gpt2")
    state = weights(
        4, ("base_model.model.h.0.attn.q_proj.lora_A.weight", "base_model.model.h.0.attn.q_proj.lora_B.weight")
    )
    torch.save(state, folder / "adapter_model.bin")
    assert_same(values(folder), state)
    data = inspect_json(folder)
    assert data["training_folder"]["kind"] == "PEFT adapter folder"


def test_variants_side_by_side(tmp_path: Path) -> None:
    root = pipeline(tmp_path / "sd", fp16=True)
    default = values(root, weights="unet")
    assert {value.dtype for value in default.values()} == {torch.float32}
    half = values(root, weights="unet", variant="fp16")
    assert_same(half, load_file(root / "unet" / "diffusion_pytorch_model.fp16.safetensors"))
    # a component without the variant is read from its default weights
    both = values(root, variant="fp16")
    assert both["text_encoder/text_model.final_layer_norm.weight"].dtype == torch.float32
    assert both["unet/conv_in.bias"].dtype == torch.float16
    code, _, err = run("inspect", root, "--variant", "bf16")
    assert code == 3 and "no 'bf16' variant" in err and "fp16" in err and "Traceback" not in err


def test_a_folder_holding_only_a_variant_is_read(tmp_path: Path) -> None:
    folder = tmp_path / "unet"
    state = {key: value.half() for key, value in weights(5).items()}
    save_file(state, str(folder.mkdir() or folder / "diffusion_pytorch_model.fp16.safetensors"))
    assert_same(values(folder), state)


def test_variant_of_a_plain_file_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "model.safetensors"
    save_file(weights(1), str(path))
    with pytest.raises(InputError, match="no 'fp16' variant"):
        ckptool.load(path, variant="fp16")


def test_sentence_transformers_layout(tmp_path: Path) -> None:
    root = tmp_path / "st"
    write_json(root / "config.json", {"model_type": "bert"})
    (root / "modules.json").write_text(json.dumps([{"idx": 0, "name": "0", "path": "", "type": "x.Transformer"}]))
    save_file(weights(1), str(root / "model.safetensors"))
    write_json(root / "1_Pooling" / "config.json", {"pooling_mode_mean_tokens": True})
    dense = weights(2, ("linear.weight", "linear.bias"))
    save_file(dense, str(root / "2_Dense" / "model.safetensors") if (root / "2_Dense").mkdir() is None else "")
    got = values(root)
    assert sorted({key.split("/")[0] for key in got}) == ["2_Dense", "model"]
    assert_same(values(root, weights="2_Dense"), dense)


def test_a_diffusers_training_folder(tmp_path: Path) -> None:
    """checkpoint-N/ as accelerate save_state writes it, with the save hooks of diffusers' training
    scripts writing unet/ and unet_ema/ through save_pretrained."""
    root = tmp_path / "checkpoint-500"
    live, ema = weights(1), weights(2)
    for name, state in (("unet", live), ("unet_ema", ema)):
        write_json(root / name / "config.json", {"_class_name": "UNet2DConditionModel"})
        save_file(state, str(root / name / "diffusion_pytorch_model.safetensors"))
    net = torch.nn.Linear(2, 2)
    optimizer = torch.optim.AdamW(net.parameters())
    net(torch.randn(1, 2)).sum().backward()
    optimizer.step()
    torch.save(optimizer.state_dict(), root / "optimizer.bin")
    torch.save(torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0).state_dict(), root / "scheduler.bin")
    torch.save(
        {"step": 500, "random_state": None, "torch_manual_seed": torch.random.get_rng_state()},
        root / "random_states_0.pkl",
    )
    assert_same(values(root), live)
    assert_same(values(root, weights="unet_ema"), ema)
    data = inspect_json(root)
    assert [c["weights"] for c in data["candidates"][:2]] == ["unet", "unet_ema"]
    assert data["training_folder"]["step"] == 500
    code, out, err = run("scan", root)
    assert code == 0, out + err


# ------------------------------------------------------------------------------------------------ trust


def evil_pickle() -> bytes:
    """A pickle whose load calls os.system (built by hand, never loaded)."""
    return b"\x80\x02cposix\nsystem\nq\x00X\x04\x00\x00\x00trueq\x01\x85q\x02Rq\x03."


def test_a_pickle_in_a_component_runs_nothing_and_scan_finds_it(tmp_path: Path) -> None:
    root = pipeline(tmp_path / "sd")
    (root / "text_encoder" / "pytorch_model.bin").write_bytes(evil_pickle())
    code, out, err = run("scan", root)
    assert code == 1 and "posix.system" in out + err, out + err
    for command in (["inspect", root], ["convert", root, "-o", tmp_path / "out/"], ["diff", root, root]):
        code, out, err = run(*command)
        assert code == 3 and "Traceback" not in err, (command, out, err)
    assert not (tmp_path / "out").exists()
    with pytest.raises(UnsafeCheckpointError):
        ckptool.load(root)


def test_scan_judges_pickles_below_the_top(tmp_path: Path) -> None:
    """A pickle in a folder that is no component (a scheduler's) is judged too."""
    root = pipeline(tmp_path / "sd", text_encoder_bin=False)
    (root / "scheduler" / "scheduler.pkl").write_bytes(evil_pickle())
    code, out, err = run("scan", root)
    assert code == 1 and "scheduler/scheduler.pkl" in out + err, out + err
    code, out, err = run("convert", root, "-o", tmp_path / "out/")
    assert code == 3 and "run code" in err and not (tmp_path / "out").exists(), err
    assert pickle  # (the module builds nothing with pickle: the bytes above are written by hand)


# ------------------------------------------------------------------------------------------------ convert


def test_convert_writes_the_same_tree(tmp_path: Path) -> None:
    root = pipeline(tmp_path / "sd", fp16=True)
    out = tmp_path / "converted"
    code, stdout, err = run("convert", root, "-o", f"{out}/")
    assert code == 0, err
    written = sorted(str(path.relative_to(out)) for path in out.rglob("*") if path.is_file())
    assert written == [
        "model_index.json",
        "scheduler/scheduler_config.json",
        "text_encoder/config.json",
        "text_encoder/model.safetensors",
        "tokenizer/merges.txt",
        "tokenizer/tokenizer_config.json",
        "tokenizer/vocab.json",
        "unet/config.json",
        "unet/diffusion_pytorch_model.fp16.safetensors",
        "unet/diffusion_pytorch_model.safetensors",
        "vae/config.json",
        "vae/diffusion_pytorch_model.fp16.safetensors",
        "vae/diffusion_pytorch_model.safetensors",
    ]
    for name in written:
        if not name.endswith(".safetensors"):
            assert (out / name).read_bytes() == (root / name).read_bytes(), name
    assert_same(
        load_file(out / "text_encoder" / "model.safetensors"),
        torch.load(root / "text_encoder" / "pytorch_model.bin", weights_only=True),
    )
    for name in ("unet/diffusion_pytorch_model.fp16.safetensors", "vae/diffusion_pytorch_model.safetensors"):
        assert_same(load_file(out / name), load_file(root / name))
    code, stdout, err = run("diff", root, out)
    assert code == 0 and "identical" in stdout, stdout + err
    # an existing output needs --force; the input is never an output
    code, _, err = run("convert", root, "-o", f"{out}/")
    assert code == 3 and "--force" in err
    code, _, err = run("convert", root, "-o", f"{out}/", "--force")
    assert code == 0, err
    code, _, err = run("convert", root, "-o", f"{root}/inner/")
    assert code == 3 and not (root / "inner").exists(), err


def test_convert_shards_with_the_library_names(tmp_path: Path) -> None:
    root = pipeline(tmp_path / "sd", fp16=True)
    out = tmp_path / "sharded"
    code, _, err = run("convert", root, "-o", f"{out}/", "--variant", "fp16", "--max-shard-size", "100B")
    assert code == 0, err
    names = sorted(path.name for path in (out / "unet").iterdir())
    assert "diffusion_pytorch_model.safetensors.index.fp16.json" in names
    assert "diffusion_pytorch_model.fp16-00001-of-00003.safetensors" in names, names
    assert not any(name == "diffusion_pytorch_model.safetensors" for name in names)
    index = json.loads((out / "unet" / "diffusion_pytorch_model.safetensors.index.fp16.json").read_text())
    got = {}
    for key, shard in index["weight_map"].items():
        got[key] = load_file(out / "unet" / shard)[key]
    assert_same(got, load_file(root / "unet" / "diffusion_pytorch_model.fp16.safetensors"))


def test_convert_of_many_components_to_one_file_is_refused(tmp_path: Path) -> None:
    root = pipeline(tmp_path / "sd")
    code, _, err = run("convert", root, "-o", tmp_path / "one.safetensors")
    assert code == 2 and "--weights" in err and not (tmp_path / "one.safetensors").exists()
    code, _, err = run("convert", root, "--weights", "unet", "-o", tmp_path / "unet.safetensors")
    assert code == 0, err
    assert_same(
        load_file(tmp_path / "unet.safetensors"), load_file(root / "unet" / "diffusion_pytorch_model.safetensors")
    )


def test_inspect_lists_components_variants_and_configs(tmp_path: Path) -> None:
    root = pipeline(tmp_path / "sd", fp16=True)
    code, out, err = run("inspect", root)
    assert code == 0, err
    lines = out.splitlines()
    assert any("3 components, read together" in line for line in lines), out
    unet = next(line for line in lines if " unet/diffusion_pytorch_model.safetensors " in line)
    assert "safetensors" in unet and "3 tensors" in unet and "variants: fp16" in unet and "--weights unet" in unet
    assert any(line.startswith("  variants       fp16") for line in lines), out
    assert any("model_index.json" in line and "StableDiffusionPipeline" in line for line in lines), out
    assert any("scheduler/scheduler_config.json" in line and "PNDMScheduler" in line for line in lines), out
    data = inspect_json(root, "--variant", "fp16")
    parts = {part["name"]: part for part in data["training_folder"]["components"]}
    assert parts["unet"]["file"] == "unet/diffusion_pytorch_model.fp16.safetensors"
    assert parts["unet"]["variant"] == "fp16" and parts["unet"]["dtypes"] == {"F16": 3}
    assert parts["text_encoder"]["variant"] is None and parts["text_encoder"]["format"] == "torch-zip"
    assert data["training_folder"]["variants"] == ["fp16"]


def test_inspect_says_what_an_adapter_is(tmp_path: Path) -> None:
    folder = tmp_path / "adapter"
    adapter_config(folder, "tiny-llama")
    save_file(weights(4, ("base_model.model.q_proj.lora_A.weight",)), str(folder / "adapter_model.safetensors"))
    code, out, err = run("inspect", folder)
    assert code == 0, err
    line = next(line for line in out.splitlines() if "adapter_config.json" in line)
    assert "rank 8" in line and "alpha 16" in line and "q_proj" in line and "tiny-llama" in line, line


def test_a_refusal_names_the_file_inside_the_folder(tmp_path: Path) -> None:
    root = pipeline(tmp_path / "sd")
    (root / "text_encoder" / "pytorch_model.bin").write_bytes(evil_pickle())
    code, _, err = run("inspect", root)
    assert code == 3 and "text_encoder/pytorch_model.bin: pickle imports posix.system" in err, err


def test_a_variant_names_its_flag_and_reads_in_a_folder_side_only(tmp_path: Path) -> None:
    root = pipeline(tmp_path / "sd", fp16=True)
    file = root / "unet" / "diffusion_pytorch_model.fp16.safetensors"
    code, _, err = run("inspect", file, "--variant", "fp16")
    assert code == 3 and "--variant chooses among a model folder's weights files" in err and "Option(" not in err
    code, out, err = run("diff", root, file, "--weights", "unet", "--variant", "fp16")
    assert code == 0 and "identical" in out, out + err
    code, out, err = run("verify", root, "--weights", "unet", "--variant", "fp16", "--against", file)
    assert code == 0, out + err


def test_a_pipeline_in_object_storage_reads_as_on_disk(tmp_path: Path, memory: str) -> None:
    """A pipeline under a URL (fsspec's memory:// store): the same components, variants and verdict."""
    import fsspec

    root = pipeline(tmp_path / "sd", fp16=True)
    fs = fsspec.filesystem("memory")
    for file in sorted(root.rglob("*")):
        if file.is_file():
            fs.pipe(f"{memory}/sd/{file.relative_to(root).as_posix()}", file.read_bytes())
    url = f"memory://{memory}/sd"
    assert_same(values(url), torch_values(root))
    assert_same(values(url, weights="unet", variant="fp16"), values(root, weights="unet", variant="fp16"))
    assert ckptool.scan(url).verdict == "safe"
    parts = ckptool.inspect(url).training_folder.components
    assert [part.file for part in parts] == [part.file for part in ckptool.inspect(root).training_folder.components]


@pytest.mark.parametrize("command", [["strip"], ["add-prefix"], ["remap", "--to", "cpu"]])
def test_a_rewrite_of_many_components_names_one(tmp_path: Path, command: list[str]) -> None:
    root = pipeline(tmp_path / "sd")
    code, _, err = run(command[0], root, "-o", tmp_path / "out.pt", *command[1:])
    assert code == 2 and "--weights COMPONENT" in err and not (tmp_path / "out.pt").exists(), err
    code, _, err = run(command[0], root, "--weights", "text_encoder", "-o", tmp_path / "te.pt", *command[1:])
    assert code in (0, 1), err  # strip of keys without a prefix: nothing to do (1)


def test_a_pipeline_saved_on_a_gpu_is_told_to_convert(tmp_path: Path) -> None:
    """A component torch.save'd on cuda:1 (tags as a GPU run writes them, no GPU needed): inspect's fix is a
    convert of the whole folder, which loads on any machine."""
    from ckptool.io.writer import save

    root = pipeline(tmp_path / "sd")
    te = root / "text_encoder" / "pytorch_model.bin"
    checkpoint = ckptool.load(te)
    save(checkpoint.remap(lambda tag: "cuda:1"), te, to="pt", force=True, in_place=True)
    assert "cuda:1" in ckptool.inspect(te).saved_devices
    code, out, err = run("inspect", root)
    assert code == 0, err
    fix = next(line for line in out.splitlines() if "fix:" in line)
    assert "ckptool convert" in fix and str(tmp_path / "sd-safetensors") in fix, out
    command = fix.split("fix: ", 1)[1].split()
    code, _, err = run(*command[1:])
    assert code == 0, err
    converted = Path(command[command.index("-o") + 1])
    assert_same(values(converted / "text_encoder" / "model.safetensors"), values(te))


def test_convert_puts_every_file_of_the_tree_on_disk_before_the_rename(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The copied configs deep in the tree are fsynced too (not only the files at the output's top)."""
    import os

    from ckptool.files import atomic

    synced: list[str] = []
    real = os.fsync

    def recording(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real(fd)

    monkeypatch.setattr(atomic.os, "fsync", recording)
    root = pipeline(tmp_path / "sd")
    code, _, err = run("convert", root, "-o", f"{tmp_path / 'out'}/")
    assert code == 0, err
    names = set()
    for path in synced:  # written in a temp folder beside the output, renamed in after the fsyncs
        parts = Path(path).parts
        temp = [index for index, part in enumerate(parts) if part.startswith(atomic.TEMP_PREFIX)]
        if temp and Path(path).is_relative_to(tmp_path):
            names.add("/".join(parts[temp[0] + 1 :]))
    assert {"unet/config.json", "tokenizer/vocab.json", "scheduler/scheduler_config.json", "unet"} <= names, names
