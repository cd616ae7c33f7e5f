"""fixtures/: the committed checkpoints, their manifest, and the script that regenerates them.

The manifest is what ckptool's own tests trust, so it is checked here against torch's reading of
every file, recomputed independently of make_fixtures.py (its own dtype table, storage grouping
and fingerprint), and the script is re-run to prove the committed tensors are what it makes.
"""

from __future__ import annotations

import collections
import hashlib
import json
import re
import subprocess
import warnings
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import safetensors.torch
import torch

from training.models import MODELS, build_model

# independent of ckptool.tensors.dtypes on purpose: the manifest is checked, not assumed
DTYPE_NAMES = {torch.float32: "F32", torch.float64: "F64", torch.float16: "F16", torch.bfloat16: "BF16", torch.int64: "I64", torch.int32: "I32", torch.uint8: "U8", torch.bool: "BOOL"}
# fields that may differ between two regenerations: legacy pickles hold storage addresses as keys,
# TorchScript archives a random serialization id and hash-ordered code
BYTE_FIELDS = {"sha256", "shard_sha256", "file_bytes"}
MAX_FIXTURE_BYTES = 2 * 1024 * 1024
# regenerating on another CPU or torch build: one epoch of training on different kernels stays this close
RTOL, ATOL = 1e-3, 1e-4
KNOWN_PREFIXES = ("module.", "_orig_mod.", "model.")

FIXTURES_DIR = Path(__file__).resolve().parent.parent / "fixtures"
MANIFEST = json.loads((FIXTURES_DIR / "manifest.json").read_text())
ENTRIES = {entry["file"]: entry for entry in MANIFEST["fixtures"]}
CHECKPOINT_ENTRIES = [name for name, entry in ENTRIES.items() if entry["format"] != "torchscript"]
TORCH_ENTRIES = [name for name, entry in ENTRIES.items() if entry["format"] in ("torch-zip", "torch-legacy")]
CUDA_ENTRIES = [name for name, entry in ENTRIES.items() if any(tag.startswith("cuda") for tag in (entry["saved_devices"] or {}))]
# checkpoints as other people's code saves them (fixtures/make_wild.py); kept out of ENTRIES, which readers iterate
WILD = {entry["file"]: entry for entry in MANIFEST.get("wild", [])}
MAX_WILD_BYTES = 50 * 1024
REFERENCE_READER = Path(__file__).resolve().parent.parent / "scripts" / "realworld_reference.py"


def same_environment(regenerated: Path) -> bool:
    """Trained tensors are bit-reproducible only with the torch build and CPU kernels that made them: the
    environment the committed fixtures were made in (manifest.json) against the one they were just made in."""
    fresh = json.loads((regenerated / "manifest.json").read_text())["environment"]
    assert {"torch", "cpu_capability", "machine", "cpu", "cpu_flags"} <= fresh.keys()
    return MANIFEST["environment"] == fresh


def sha256_of(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def fingerprint(state_dict: dict[str, torch.Tensor]) -> str:
    digest = hashlib.sha256()
    for key in sorted(state_dict):
        tensor = state_dict[key].detach().cpu()
        header = json.dumps([key, DTYPE_NAMES[tensor.dtype], list(tensor.shape)], separators=(",", ":")).encode()
        data = tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        for part in (header, data):
            digest.update(len(part).to_bytes(8, "little"))
            digest.update(part)
    return "sha256:" + digest.hexdigest()


def load_any(directory: Path, entry: dict) -> object:
    """The whole object of a fixture, on the CPU: torch.load, safetensors (merged shards) or a TorchScript state_dict."""
    path = directory / entry["file"]
    if entry["format"] == "safetensors":
        return safetensors.torch.load_file(str(path))
    if entry["format"] == "safetensors-sharded":
        merged: dict[str, torch.Tensor] = {}
        for shard in entry["shards"]:
            merged.update(safetensors.torch.load_file(str(path.parent / shard)))
        return merged
    if entry["format"] == "torchscript":
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch.jit.load is deprecated, still what such archives need
            return dict(torch.jit.load(str(path), map_location="cpu").state_dict())
    return torch.load(path, weights_only=True, map_location="cpu")


def leaves(obj: object, path: tuple = ()) -> Iterator[tuple[tuple, object]]:
    """Every leaf (tensor or plain value) of nested dicts/lists/tuples, with its key path."""
    if isinstance(obj, dict):
        for key, value in obj.items():
            yield from leaves(value, (*path, key))
    elif isinstance(obj, (list, tuple)):
        for index, value in enumerate(obj):
            yield from leaves(value, (*path, index))
    else:
        yield path, obj


def weights_of(obj: object, layout: list[str]) -> dict[str, torch.Tensor]:
    for key in layout:
        obj = obj[key]  # type: ignore[index]
    assert isinstance(obj, dict)
    return obj


@pytest.fixture(scope="module")
def regenerated(tmp_path_factory: pytest.TempPathFactory, subprocess_env: dict[str, str], repo_root: Path, python_executable: str) -> Path:
    """The fixtures made afresh by ``python fixtures/make_fixtures.py --out TMP``."""
    out = tmp_path_factory.mktemp("regenerated")
    completed = subprocess.run(
        [python_executable, str(repo_root / "fixtures" / "make_fixtures.py"), "--out", str(out)],
        cwd=out, env=subprocess_env, capture_output=True, text=True, timeout=900,
    )
    assert completed.returncode == 0, completed.stderr[-4000:]
    return out


# --------------------------------------------------------------------------------------------
# the committed files and the manifest


def test_manifest_covers_every_fixture_file(fixtures_dir: Path) -> None:
    on_disk = {str(p.relative_to(fixtures_dir)) for p in fixtures_dir.rglob("*") if p.is_file()}
    on_disk -= {"make_fixtures.py", "make_wild.py", "make_sd_ckpt.py", "manifest.json", "README.md"}
    # frameworks/: files training frameworks wrote, described by their own cases.json (tests/test_frameworks*.py);
    # gpu/: files a real GPU wrote, described by their own recorded.json (tests/test_gpu_recorded.py)
    on_disk = {name for name in on_disk
               if "__pycache__" not in name and not name.startswith(("standins/", "frameworks/", "gpu/"))}
    listed = set(ENTRIES) | set(WILD)
    for entry in [*ENTRIES.values(), *WILD.values()]:
        listed |= {str(Path(entry["file"]).parent / shard) for shard in entry.get("shards", [])}
    assert on_disk == listed


@pytest.mark.parametrize("name", sorted(ENTRIES) + sorted(WILD))
def test_committed_file_matches_manifest_sha256_and_is_small(name: str, fixtures_dir: Path) -> None:
    entry = ENTRIES.get(name) or WILD[name]
    limit = MAX_FIXTURE_BYTES if name in ENTRIES else MAX_WILD_BYTES
    path = fixtures_dir / name
    assert sha256_of(path) == entry["sha256"]
    for shard, digest in entry.get("shard_sha256", {}).items():
        assert sha256_of(path.parent / shard) == digest
        assert (path.parent / shard).stat().st_size < limit
    assert path.stat().st_size < limit


@pytest.mark.parametrize("name", CHECKPOINT_ENTRIES)
def test_manifest_agrees_with_torchs_view(name: str, fixtures_dir: Path) -> None:
    entry = ENTRIES[name]
    path = fixtures_dir / name
    locations: dict[int, str] = {}
    if entry["format"] in ("torch-zip", "torch-legacy"):

        def record(storage: torch.UntypedStorage, location: str) -> torch.UntypedStorage:
            locations[storage.data_ptr()] = location
            return storage

        obj = torch.load(path, weights_only=True, map_location=record)
        assert entry["saved_devices"] == dict(collections.Counter(locations.values()))
        expected_entries = sorted(key for key in obj if key != entry["layout"][0]) if entry["layout"] else []
        assert entry["entries"] == expected_entries
    else:
        obj = load_any(fixtures_dir, entry)
        assert entry["saved_devices"] == {} and entry["entries"] == []
    weights = weights_of(obj, entry["layout"])

    assert all(isinstance(value, torch.Tensor) for value in weights.values())
    assert all(key.startswith(entry["prefix"]) for key in weights)
    # the prefix is the whole wrapper stack: what is left are the model's own keys
    stripped = {key.removeprefix(entry["prefix"]): tensor for key, tensor in weights.items()}
    assert not any(key.startswith(KNOWN_PREFIXES) for key in stripped), "an undeclared wrapper prefix"
    if entry["model"] in MODELS:
        build_model(entry["model"]).load_state_dict(stripped, strict=True)
    assert entry["tensors"] == len(weights)
    assert entry["parameters"] == sum(t.numel() for t in weights.values())
    assert entry["bytes"] == sum(t.numel() * t.element_size() for t in weights.values())
    assert entry["dtypes"] == dict(collections.Counter(DTYPE_NAMES[t.dtype] for t in weights.values()))
    assert entry["fingerprint"] == fingerprint(weights)

    groups = collections.defaultdict(list)
    for key, tensor in weights.items():
        groups[tensor.untyped_storage().data_ptr()].append(key)
    assert entry["tied"] == sorted(sorted(keys) for keys in groups.values() if len(keys) > 1)
    if locations:
        assert entry["weights_saved_devices"] == dict(collections.Counter(locations[ptr] for ptr in groups))


@pytest.mark.parametrize("name", TORCH_ENTRIES + ["torchscript_mlp.pt"])
def test_plain_torch_load_behaves_as_the_manifest_says(name: str, fixtures_dir: Path) -> None:
    entry = ENTRIES[name]
    if entry["loads_with_plain_torch_load"]:
        torch.load(fixtures_dir / name, weights_only=True)
        return
    if name in CUDA_ENTRIES and torch.cuda.is_available():
        pytest.skip("a CUDA machine can load cuda-tagged storages")
    with pytest.raises(RuntimeError) as raised, warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch warns before refusing a TorchScript archive
        torch.load(fixtures_dir / name, weights_only=True)
    assert str(raised.value).strip().splitlines()[0] == entry["plain_torch_load_error"]


# --------------------------------------------------------------------------------------------
# the special fixtures


@pytest.mark.parametrize("name", CUDA_ENTRIES)
def test_gpu_fixtures_raise_the_real_cuda_error_on_cpu(name: str, fixtures_dir: Path) -> None:
    if torch.cuda.is_available():
        pytest.skip("needs a CPU-only machine")
    with pytest.raises(RuntimeError, match="Attempting to deserialize object on a CUDA device but torch.cuda.is_available.. is False"):
        torch.load(fixtures_dir / name, weights_only=True)
    checkpoint = torch.load(fixtures_dir / name, weights_only=True, map_location="cpu")
    assert all(t.device.type == "cpu" for t in checkpoint["model"].values())


def test_gpu_fixture_tags_are_what_a_gpu_run_writes(fixtures_dir: Path) -> None:
    # the weights and Adam moments live on the GPU; Adam's step counters stay on the CPU
    assert ENTRIES["gpu_cuda0_lenet.pt"]["weights_saved_devices"] == {"cuda:0": 8}
    assert ENTRIES["gpu_cuda1_ddp_lenet.pt"]["weights_saved_devices"] == {"cuda:1": 8}
    assert ENTRIES["gpu_cuda1_ddp_lenet.pt"]["saved_devices"] == {"cpu": 8, "cuda:1": 24}
    # same weights as the checkpoints they were re-saved from
    assert ENTRIES["gpu_cuda0_lenet.pt"]["fingerprint"] == ENTRIES["single_lenet.pt"]["fingerprint"]
    assert ENTRIES["gpu_cuda1_ddp_lenet.pt"]["fingerprint"] == ENTRIES["ddp_lenet_wrapped.pt"]["fingerprint"]


def test_location_tagger_is_registered_only_inside_the_block(tmp_path: Path, load_script) -> None:
    make_fixtures = load_script("fixtures/make_fixtures.py")
    registry_before = list(torch.serialization._package_registry)

    with pytest.raises(KeyError), make_fixtures.saved_locations(lambda storage: "cuda:3"):
        torch.save({"w": torch.ones(2)}, tmp_path / "tagged.pt")
        raise KeyError("an error inside the block must still unregister the tagger")
    assert torch.serialization._package_registry == registry_before

    seen: list[str] = []
    torch.load(tmp_path / "tagged.pt", weights_only=True, map_location=lambda storage, location: seen.append(location) or storage)
    assert seen == ["cuda:3"]
    torch.save({"w": torch.ones(2)}, tmp_path / "plain.pt")
    torch.load(tmp_path / "plain.pt", weights_only=True, map_location=lambda storage, location: seen.append(location) or storage)
    assert seen == ["cuda:3", "cpu"]


def test_torchscript_fixture_is_an_archive_not_a_checkpoint(fixtures_dir: Path) -> None:
    path = fixtures_dir / "torchscript_mlp.pt"
    with zipfile.ZipFile(path) as archive:
        names = archive.namelist()
    assert any("/code/" in name for name in names) and any(name.endswith("/constants.pkl") for name in names)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # deprecated, still what loads such archives
        module = torch.jit.load(str(path))
    assert isinstance(module, torch.jit.ScriptModule)
    assert module(torch.zeros(1, 1, 28, 28)).shape == (1, 10)


def test_legacy_fixture_is_not_a_zip(fixtures_dir: Path) -> None:
    assert not zipfile.is_zipfile(fixtures_dir / "legacy_mlp.pt")
    assert zipfile.is_zipfile(fixtures_dir / "single_lenet.pt")


def test_views_fixture_keeps_offsets_strides_and_dtypes(fixtures_dir: Path) -> None:
    state_dict = torch.load(fixtures_dir / "views.pt", weights_only=True)
    assert [state_dict[f"attn.{n}_proj.weight"].storage_offset() for n in "qkv"] == [0, 256, 512]
    assert not state_dict["attn.out_proj.weight"].is_contiguous()
    assert state_dict["embed_tokens.weight"].dtype == torch.bfloat16
    assert state_dict["norm.num_batches_tracked"].dim() == 0
    assert state_dict["position_ids"].dtype == torch.int64


def test_tied_fixture_shares_one_storage(fixtures_dir: Path) -> None:
    state_dict = torch.load(fixtures_dir / "tied_lm.pt", weights_only=True)
    assert set(state_dict) == {"embed.weight", "head.weight"}
    assert state_dict["embed.weight"].data_ptr() == state_dict["head.weight"].data_ptr()


def test_sharded_index_describes_its_shards(fixtures_dir: Path) -> None:
    directory = fixtures_dir / "sharded"
    index = json.loads((directory / "model.safetensors.index.json").read_text())
    tensors = {}
    for shard in sorted(set(index["weight_map"].values())):
        for key, tensor in safetensors.torch.load_file(str(directory / shard)).items():
            assert index["weight_map"][key] == shard
            tensors[key] = tensor
    assert set(tensors) == set(index["weight_map"])
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in tensors.values())
    single = torch.load(fixtures_dir / "single_lenet.pt", weights_only=True)["model"]
    assert all(torch.equal(single[key], tensors[key]) for key in single)


def test_readme_table_lists_every_fixture_with_its_sha256(fixtures_dir: Path) -> None:
    readme = (fixtures_dir / "README.md").read_text()
    assert "make_fixtures.py" in readme
    for name, entry in [*ENTRIES.items(), *WILD.items()]:
        assert f"| `{name}` |" in readme and entry["sha256"] in readme


def test_readme_sha256_table_matches_every_file_on_disk(fixtures_dir: Path) -> None:
    readme = (fixtures_dir / "README.md").read_text()
    table = readme[readme.index("## sha256 of every file"):]
    listed = dict(re.findall(r"^\| `([^`]+)` \| `([0-9a-f]{64})` \|$", table, flags=re.MULTILINE))
    on_disk = {str(p.relative_to(fixtures_dir)): sha256_of(p) for p in fixtures_dir.rglob("*")
               if p.is_file() and not {"__pycache__", "standins", "frameworks", "gpu"} & set(p.relative_to(fixtures_dir).parts)
               and p.name not in ("make_fixtures.py", "make_wild.py", "make_sd_ckpt.py", "manifest.json", "README.md")}
    assert listed == on_disk


# --------------------------------------------------------------------------------------------
# regeneration


@pytest.mark.parametrize("name", sorted(ENTRIES))
def test_regenerated_fixture_has_the_same_tensors(name: str, regenerated: Path, fixtures_dir: Path) -> None:
    entry = ENTRIES[name]
    committed = dict(leaves(load_any(fixtures_dir, entry)))
    fresh = dict(leaves(load_any(regenerated, entry)))
    assert committed.keys() == fresh.keys()
    exact = same_environment(regenerated)
    for path, value in committed.items():
        if isinstance(value, torch.Tensor):
            assert value.dtype == fresh[path].dtype and value.shape == fresh[path].shape, path
            if exact:
                assert torch.equal(value, fresh[path]), path
            else:  # another CPU or torch build: kernels may round differently
                torch.testing.assert_close(fresh[path], value, rtol=RTOL, atol=ATOL, msg=str(path))
        elif type(value) is float and not exact:
            # numbers computed by training (metrics.train_loss...) round like the tensors they come from
            # an accuracy counts test samples: a borderline one may flip (256 samples, 1/256 each)
            atol = 0.01 if "accuracy" in str(path[-1]) else ATOL
            assert type(fresh[path]) is float and fresh[path] == pytest.approx(value, rel=RTOL, abs=atol), path
        else:  # names, counts, configuration: the same everywhere
            assert type(value) is type(fresh[path]) and value == fresh[path], path


def test_regenerated_manifest_matches(regenerated: Path) -> None:
    fresh = json.loads((regenerated / "manifest.json").read_text())
    fresh_entries = {entry["file"]: entry for entry in fresh["fixtures"] + fresh["wild"]}
    assert fresh_entries.keys() == ENTRIES.keys() | WILD.keys()
    ignored = BYTE_FIELDS if same_environment(regenerated) else BYTE_FIELDS | {"fingerprint"}
    for name, entry in [*ENTRIES.items(), *WILD.items()]:
        for field, value in entry.items():
            if field not in ignored:
                assert fresh_entries[name][field] == value, (name, field)


# --------------------------------------------------------------------------------------------
# wild fixtures (fixtures/make_wild.py): torch's view of them, and what ckptool should do with each


def torch_reading(paths: list[Path], work: Path, env: dict[str, str], python: str) -> dict[str, dict]:
    """scripts/realworld_reference.py's reading (a throwaway subprocess; foreign classes are inert stubs).

    Independent of fixtures/standins: the classes the pickles name are fabricated there, not imported.
    """
    out = work / "torch_reading.pt"
    completed = subprocess.run([python, str(REFERENCE_READER), str(out), *map(str, paths)],
                               cwd=work, env=env, capture_output=True, text=True, timeout=600)
    assert completed.returncode == 0, completed.stderr[-3000:]
    return torch.load(out, weights_only=True)


def dict_at(view: dict, layout: list) -> dict[str, torch.Tensor]:
    matches = [tensors for path, tensors in view["dicts"] if list(path) == list(layout)]
    assert matches, f"torch finds no tensor dict at {layout} ({view['loader']}: {view['error']})"
    return matches[0]


def wild_weights(directory: Path, entry: dict, work: Path, env: dict[str, str], python: str,
                 layout: list | None = None) -> dict[str, torch.Tensor]:
    """The weights of a wild fixture as torch reads them (a whole module: what its state_dict() holds)."""
    path = directory / entry["file"]
    if entry["format"] == "torch-sharded-bin":
        merged: dict[str, torch.Tensor] = {}
        for shard in entry["shards"]:
            merged.update(torch.load(path.parent / shard, weights_only=True))
        return merged
    view = torch_reading([path], work, env, python)[str(path)]
    return dict_at(view, entry["layout"] if layout is None else layout)


def run_ckptool(*args: str, env: dict[str, str], python: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([python, "-m", "ckptool", *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=600)


def output_weights_fingerprints(view: dict) -> set[str]:
    """The fingerprint of every tensor dict torch finds in an output file."""
    return {fingerprint(tensors) for _path, tensors in view["dicts"] if tensors}


@pytest.mark.parametrize("name", sorted(WILD))
def test_wild_manifest_agrees_with_torchs_view(name: str, fixtures_dir: Path, tmp_path: Path,
                                               subprocess_env: dict[str, str], python_executable: str) -> None:
    entry = WILD[name]
    weights = wild_weights(fixtures_dir, entry, tmp_path, subprocess_env, python_executable)
    assert entry["tensors"] == len(weights)
    assert entry["parameters"] == sum(t.numel() for t in weights.values())
    assert entry["fingerprint"] == fingerprint(weights)
    assert all(key.startswith(entry["prefix"]) for key in weights)
    for alternative in entry["alternatives"].values():
        other = wild_weights(fixtures_dir, entry, tmp_path, subprocess_env, python_executable, alternative["layout"])
        assert alternative["fingerprint"] == fingerprint(other) != entry["fingerprint"]
    if entry["format"] == "torch-zip":
        # torch's weights-only loader refuses exactly the files the manifest says it does
        try:
            torch.load(fixtures_dir / name, weights_only=True)
            refused = False
        except Exception:  # noqa: BLE001
            refused = True
        assert refused is not entry["loads_with_plain_torch_load"]


def test_wild_whole_model_weights_skip_non_persistent_buffers(fixtures_dir: Path, tmp_path: Path,
                                                              subprocess_env: dict[str, str],
                                                              python_executable: str) -> None:
    entry = WILD["wild/whole_model.pt"]
    weights = wild_weights(fixtures_dir, entry, tmp_path, subprocess_env, python_executable)
    assert sorted(weights) == ["fc1.bias", "fc1.weight", "fc2.bias", "fc2.weight", "scale"]
    assert "tinynet.TinyMLP" in entry["globals"]
    assert not entry["loads_with_plain_torch_load"]


def test_wild_lightning_fixture_names_omegaconf_like_a_real_one() -> None:
    entry = WILD["wild/lightning_omegaconf.ckpt"]
    assert {"omegaconf.dictconfig.DictConfig", "omegaconf.listconfig.ListConfig", "omegaconf.nodes.AnyNode",
            "omegaconf.base.ContainerMetadata", "typing.Any"} <= set(entry["globals"])
    assert "omegaconf" in entry["plain_torch_load_error"]


@pytest.mark.parametrize("name", sorted(WILD))
def test_regenerated_wild_fixture_has_the_same_tensors(name: str, regenerated: Path, fixtures_dir: Path,
                                                       tmp_path: Path, subprocess_env: dict[str, str],
                                                       python_executable: str) -> None:
    entry = WILD[name]
    committed = wild_weights(fixtures_dir, entry, tmp_path, subprocess_env, python_executable)
    fresh = wild_weights(regenerated, entry, tmp_path, subprocess_env, python_executable)
    assert committed.keys() == fresh.keys()
    for key, tensor in committed.items():
        assert torch.equal(tensor, fresh[key]), key  # seeded initialisation, no training: exact everywhere


# what ckptool does with each wild fixture: every kind read, converted and chosen as torch reads it
def wild_params() -> list:
    return [pytest.param(name, id=name) for name in sorted(WILD)]


@pytest.mark.parametrize("name", wild_params())
def test_ckptool_inspect_finds_the_wild_weights(name: str, fixtures_dir: Path, repo_root: Path,
                                                subprocess_env: dict[str, str], python_executable: str) -> None:
    entry = WILD[name]
    completed = run_ckptool("inspect", "--json", "--fingerprint", str(fixtures_dir / name), *entry["ckptool_flags"],
                            env=subprocess_env, python=python_executable, cwd=repo_root)
    assert completed.returncode == 0, completed.stderr
    report = json.loads(completed.stdout)
    assert report["tensors"] == entry["tensors"]
    assert report["fingerprint"] == entry["fingerprint"]
    assert report["prefix"] == entry["prefix"]


@pytest.mark.parametrize("name", wild_params())
def test_ckptool_converts_the_wild_weights_to_safetensors(name: str, fixtures_dir: Path, repo_root: Path,
                                                          tmp_path: Path, subprocess_env: dict[str, str],
                                                          python_executable: str) -> None:
    entry = WILD[name]
    out = tmp_path / "out.safetensors"
    completed = run_ckptool("convert", str(fixtures_dir / name), "-o", str(out), *entry["ckptool_flags"],
                            env=subprocess_env, python=python_executable, cwd=repo_root)
    assert completed.returncode == 0, completed.stderr
    assert fingerprint(safetensors.torch.load_file(str(out))) == entry["fingerprint"]


@pytest.mark.parametrize("name", wild_params())
def test_ckptool_converts_the_wild_weights_to_pt(name: str, fixtures_dir: Path, repo_root: Path, tmp_path: Path,
                                                 subprocess_env: dict[str, str], python_executable: str) -> None:
    entry = WILD[name]
    out = tmp_path / "out.pt"
    completed = run_ckptool("convert", str(fixtures_dir / name), "-o", str(out), *entry["ckptool_flags"],
                            env=subprocess_env, python=python_executable, cwd=repo_root)
    assert completed.returncode == 0, completed.stderr
    view = torch_reading([out], tmp_path, subprocess_env, python_executable)[str(out)]
    assert entry["fingerprint"] in output_weights_fingerprints(view)


@pytest.mark.parametrize("name", [pytest.param(name, id=name) for name in sorted(WILD) if WILD[name]["alternatives"]])
def test_ckptool_weights_option_chooses_the_ema(name: str, fixtures_dir: Path, repo_root: Path,
                                                subprocess_env: dict[str, str], python_executable: str) -> None:
    entry = WILD[name]
    for alternative in entry["alternatives"].values():
        completed = run_ckptool("inspect", "--json", "--fingerprint", "--weights", ".".join(alternative["layout"]),
                                str(fixtures_dir / name), *entry["ckptool_flags"],
                                env=subprocess_env, python=python_executable, cwd=repo_root)
        assert completed.returncode == 0, completed.stderr
        assert json.loads(completed.stdout)["fingerprint"] == alternative["fingerprint"]


def test_ckptool_rewrite_keeps_numpy_config_entries(fixtures_dir: Path, repo_root: Path, tmp_path: Path,
                                                    subprocess_env: dict[str, str], python_executable: str) -> None:
    out = tmp_path / "out.pt"
    completed = run_ckptool("add-prefix", str(fixtures_dir / "wild" / "numpy_config.pt"), "-o", str(out),
                            "--prefix", "net.", *WILD["wild/numpy_config.pt"]["ckptool_flags"],
                            env=subprocess_env, python=python_executable, cwd=repo_root)
    assert completed.returncode == 0, completed.stderr
    # ckptool's own output of a file that names only numpy, torch and collections: safe to read back fully
    original = torch.load(fixtures_dir / "wild" / "numpy_config.pt", weights_only=False)
    rewritten = torch.load(out, weights_only=False)
    assert {"net." + key for key in original["state_dict"]} == set(rewritten["state_dict"])
    config = rewritten["config"]
    assert type(config["arr"]) is type(original["config"]["arr"]) and (config["arr"] == original["config"]["arr"]).all()
    assert type(config["lr"]) is type(original["config"]["lr"]) and config["lr"] == original["config"]["lr"]
    assert config["device"] == torch.device("cuda:0")
    assert rewritten["sched"] == original["sched"]
    assert type(rewritten["hist"]) is collections.defaultdict and rewritten["hist"] == original["hist"]
    assert rewritten["hist"].default_factory is list


def test_ckptool_reads_the_committed_torchscript_archive(fixtures_dir: Path, repo_root: Path,
                                                         subprocess_env: dict[str, str], python_executable: str) -> None:
    path = fixtures_dir / "torchscript_mlp.pt"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        weights = dict(torch.jit.load(str(path), map_location="cpu").state_dict())
    completed = run_ckptool("inspect", "--json", "--fingerprint", str(path),
                            env=subprocess_env, python=python_executable, cwd=repo_root)
    assert completed.returncode == 0, completed.stderr
    report = json.loads(completed.stdout)
    assert report["tensors"] == len(weights)
    assert report["fingerprint"] == fingerprint(weights)


def test_realworld_harness_passes_every_command_on_a_committed_gpu_fixture(fixtures_dir: Path, tmp_path: Path,
                                                                         load_script) -> None:
    # `make realworld` needs PyPI; its checks themselves run here, offline, on a file of the same kind
    realworld = load_script("scripts/realworld.py")
    entry = ENTRIES["gpu_cuda0_lenet.pt"]
    real = realworld.RealFile("gpu-lenet", "(committed)", "-", "-", entry["file"], entry["sha256"],
                              entry["file_bytes"], "training container tagged cuda:0", entry["layout"])
    outcomes = realworld.check_file(real, fixtures_dir / entry["file"], tmp_path)
    assert [o for o in outcomes if not o.passed] == []
    assert {o.command for o in outcomes} == {"torch-reference", "inspect", "inspect --json", "scan", "add-prefix",
                                             "strip", "remap --to cpu", "convert .safetensors", "convert .pt",
                                             "verify --against", "diff"}
