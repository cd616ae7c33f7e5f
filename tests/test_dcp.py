"""torch.distributed.checkpoint (DCP) directories, written for real by a 2-rank gloo run.

One torchrun run (module fixture) writes two checkpoints:

* ``ddp``: an MLP wrapped in DDP after one AdamW step, saved as ``{"model", "optim", "epoch"}`` with
  ``get_state_dict`` + ``dcp.save`` — every tensor one chunk, optimizer values as bytes entries;
* ``sharded``: DTensors sharded over the 2 ranks (rows, columns, uneven splits, bf16, int64, uint16),
  one replicated and one plain 0-dim tensor — tensors split into chunks that ckptool assembles.

Each rank-0 also ``torch.save``s the reference tensors. Tampered copies of ``.metadata`` check
that ckptool refuses unsafe globals, paths outside the directory, out-of-range offsets and chunks
that do not tile their tensor — running nothing.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import shutil
import subprocess
import sys
import textwrap
import zipfile
import zlib
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

import ckptool
from ckptool.cli.main import main
from ckptool.tensors.dtypes import BY_TORCH_NAME
from ckptool.formats.zipio import pieces_crc
from training_runs import TEARDOWN_ABORT

REPO = Path(__file__).resolve().parent.parent
TORCHRUN_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
                      "MASTER_PORT", "TORCHELASTIC_RUN_ID")

WORKER = textwrap.dedent('''
    import sys
    from pathlib import Path

    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    out = Path(sys.argv[1])
    dist.init_process_group("gloo")
    rank = dist.get_rank()

    # --- DDP + AdamW, saved the way torch's docs show: get_state_dict + dcp.save
    torch.manual_seed(0)
    try:
        from training.models import build_model
        model = build_model("mlp")
    except ImportError:  # training/ absent: the same 784-128-10 MLP
        model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(784, 128), torch.nn.ReLU(),
                                    torch.nn.Linear(128, 10))
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
    torch.manual_seed(1 + rank)
    images, labels = torch.randn(8, 1, 28, 28), torch.randint(0, 10, (8,))
    torch.nn.functional.cross_entropy(ddp(images), labels).backward()
    optimizer.step()
    model_sd, optim_sd = get_state_dict(ddp, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd, "epoch": 1}, checkpoint_id=out / "ddp")
    if rank == 0:
        torch.save(model.state_dict(), out / "ddp_ref.pt")

    # --- DTensors sharded over both ranks: tensors saved as several chunks
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(2)
    full = {
        "w": torch.randn(10, 6),
        "b": torch.randn(7, 5),
        "h": torch.randn(5, 3).to(torch.bfloat16),
        "i": torch.arange(9, dtype=torch.int64),
        "r": torch.randn(4, 4),
        "u": torch.arange(12, dtype=torch.int32).to(torch.uint16).reshape(3, 4),
    }
    placements = {"w": Shard(0), "b": Shard(1), "h": Shard(0), "i": Shard(0), "r": Replicate()}
    sharded = {k: distribute_tensor(full[k], mesh, [p]) for k, p in placements.items()}
    # gloo cannot scatter uint16: build that DTensor from this rank's shard, no communication
    sharded["u"] = DTensor.from_local(full["u"].tensor_split(2)[rank].clone(), mesh, [Shard(0)], run_check=False,
                                      shape=full["u"].shape, stride=full["u"].stride())
    sharded["step"] = full["step"] = torch.tensor(3.0)
    dcp.save({"model": sharded}, checkpoint_id=out / "sharded")
    if rank == 0:
        torch.save(full, out / "sharded_ref.pt")
    # leave together: a rank tearing gloo down while the other still works aborts the process
    dist.barrier()
    dist.destroy_process_group()
''')


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The directory holding ``ddp/``, ``sharded/`` and their reference ``*_ref.pt`` files."""
    out = tmp_path_factory.mktemp("dcp")
    script = out / "worker.py"
    script.write_text(WORKER)
    env = {k: v for k, v in os.environ.items() if k not in TORCHRUN_VARIABLES}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env["OMP_NUM_THREADS"] = "1"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(script),
               str(out)]
    for _ in range(3):
        result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)
        # gloo's teardown aborting a rank after all the work is done (training_runs.TEARDOWN_ABORT) is not the
        # checkpoint under test: the run is repeated from scratch
        if result.returncode == 0 or TEARDOWN_ABORT not in result.stderr:
            break
        for child in out.iterdir():
            if child.is_dir():
                shutil.rmtree(child)
            elif child.name != "worker.py":
                child.unlink()
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return out


def torch_fingerprint(state_dict: dict[str, torch.Tensor]) -> str:
    """ckptool's fingerprint definition, computed from torch tensors."""
    digest = hashlib.sha256()
    for key in sorted(state_dict):
        tensor = state_dict[key].detach().contiguous()
        dtype = BY_TORCH_NAME[str(tensor.dtype).removeprefix("torch.")].name
        header = json.dumps([key, dtype, list(tensor.shape)], separators=(",", ":")).encode("utf-8")
        data = tensor.reshape(-1).view(torch.uint8).numpy().tobytes()
        digest.update(len(header).to_bytes(8, "little") + header + len(data).to_bytes(8, "little") + data)
    return "sha256:" + digest.hexdigest()


def run(*args: object) -> tuple[int, str]:
    result = CliRunner().invoke(main, [str(a) for a in args])
    return result.exit_code, result.output


def reference(written: Path, name: str) -> dict[str, torch.Tensor]:
    return torch.load(written / f"{name}_ref.pt", weights_only=True)


def tampered(written: Path, tmp_path: Path, name: str, change) -> Path:
    """A copy of checkpoint ``name`` whose .metadata went through ``change(metadata, directory)``."""
    directory = tmp_path / name
    shutil.copytree(written / name, directory)
    with open(directory / ".metadata", "rb") as handle:
        metadata = pickle.load(handle)  # our own file, written by the fixture
    data = change(metadata, directory)
    (directory / ".metadata").write_bytes(data if isinstance(data, bytes) else pickle.dumps(metadata))
    return directory


def storage_entry(metadata, fqn: str):
    return next(info for index, info in metadata.storage_data.items() if index.fqn == fqn)


# ---------------------------------------------------------------------------------------------- reading


def test_ddp_checkpoint_reads_with_the_models_weights(written: Path) -> None:
    checkpoint = ckptool.load(written / "ddp")
    assert checkpoint.format == "dcp" and checkpoint.layout == ("model",)
    expected = reference(written, "ddp")
    assert sorted(checkpoint.tensors) == sorted(expected)
    assert ckptool.fingerprint(checkpoint.tensors) == torch_fingerprint(expected)
    # single-chunk tensors point straight at their bytes in the .distcp files
    assert all(t.storage.producer is None and t.storage.data.path.suffix == ".distcp"
               for t in checkpoint.tensors.values())
    # the rest of the container is nested back from planner_data
    assert checkpoint.container["epoch"] == 1
    optim = checkpoint.container["optim"]
    assert set(optim) == {"state", "param_groups"}
    assert optim["param_groups"][0]["lr"] == pytest.approx(1e-3)
    assert sorted(optim["param_groups"][0]["params"]) == sorted(expected)
    assert sorted(optim["state"]) == sorted(expected)
    assert all(set(state) == {"exp_avg", "exp_avg_sq", "step"} for state in optim["state"].values())
    assert {p.name for p in checkpoint.files} >= {".metadata", "__0_0.distcp", "__1_0.distcp"}


def test_ddp_checkpoint_converts_to_safetensors_and_pt(written: Path, tmp_path: Path) -> None:
    from safetensors.torch import load_file

    expected = reference(written, "ddp")
    checkpoint = ckptool.load(written / "ddp")
    report = ckptool.save(checkpoint, tmp_path / "m.safetensors", fingerprint=True)
    assert report.fingerprint == torch_fingerprint(expected)
    loaded = load_file(tmp_path / "m.safetensors")
    assert sorted(loaded) == sorted(expected)
    assert all(torch.equal(loaded[k], expected[k]) for k in expected)

    report = ckptool.save(checkpoint, tmp_path / "m.pt", fingerprint=True)
    assert report.fingerprint == torch_fingerprint(expected)
    whole = torch.load(tmp_path / "m.pt", weights_only=True)
    assert set(whole) == {"model", "optim", "epoch"} and whole["epoch"] == 1
    assert all(torch.equal(whole["model"][k], expected[k]) for k in expected)
    assert whole["optim"]["param_groups"][0]["betas"] == (0.9, 0.999)


def test_sharded_tensors_are_assembled_from_their_chunks(written: Path, tmp_path: Path) -> None:
    from safetensors.torch import load_file

    expected = reference(written, "sharded")
    checkpoint = ckptool.load(written / "sharded")
    assert checkpoint.format == "dcp" and checkpoint.layout == ("model",)
    tensors = checkpoint.tensors
    assert sorted(tensors) == sorted(expected)
    assembled = {k for k, t in tensors.items() if t.storage.producer is not None}
    assert assembled == {"w", "b", "h", "i", "u"}  # "r" (replicated) and "step" are one chunk each
    assert {k: t.dtype.name for k, t in tensors.items()} == {
        "w": "F32", "b": "F32", "h": "BF16", "i": "I64", "r": "F32", "u": "U16", "step": "F32"}
    assert ckptool.fingerprint(tensors) == torch_fingerprint(expected)

    for name in ("s.safetensors", "s.pt"):
        report = ckptool.save(checkpoint, tmp_path / name, fingerprint=True)
        assert report.fingerprint == torch_fingerprint(expected)
    loaded = load_file(tmp_path / "s.safetensors")
    assert all(torch.equal(loaded[k], expected[k]) for k in expected)
    whole = torch.load(tmp_path / "s.pt", weights_only=True)["model"]
    assert all(torch.equal(whole[k], expected[k]) and whole[k].dtype == expected[k].dtype for k in expected)


def _bytes_of(tensor: torch.Tensor) -> bytes:
    return tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def test_row_shards_keep_their_stored_crcs_and_the_pt_zip_checks_out(written: Path, tmp_path: Path) -> None:
    """Row shards carry the CRC their chunk archive stored; the .pt member made of them gets the
    combination of those CRCs (its bytes copied by the kernel), which must be the CRC of its bytes."""
    expected = reference(written, "sharded")
    tensors = ckptool.load(written / "sharded").tensors
    by_rows = {k for k, t in tensors.items() if t.storage.pieces is not None}
    assert by_rows == {"w", "h", "i", "u"}  # "b" is split by columns: assembled, not pieced
    for name in sorted(by_rows):
        pieces = tensors[name].storage.pieces
        assert len(pieces) == 2 and all(p.crc32 is not None for p in pieces), name
        assert pieces_crc(pieces) == zlib.crc32(_bytes_of(expected[name])), name

    ckptool.save(ckptool.load(written / "sharded"), tmp_path / "s.pt")
    with zipfile.ZipFile(tmp_path / "s.pt") as archive:
        assert archive.testzip() is None  # every member's recorded CRC matches its bytes (torch.load never checks)
        crcs = {info.CRC for info in archive.infolist() if "/data/" in info.filename}
    assert {zlib.crc32(_bytes_of(expected[name])) for name in by_rows} <= crcs
    whole = torch.load(tmp_path / "s.pt", weights_only=True)["model"]
    assert all(torch.equal(whole[k], expected[k]) and whole[k].dtype == expected[k].dtype for k in expected)


@pytest.mark.parametrize("name", ["stale.pt", "stale.safetensors"])
def test_a_shard_whose_stored_crc_is_stale_still_writes_the_right_bytes_under_the_right_crc(
        written: Path, tmp_path: Path, name: str) -> None:
    """The .pt member's CRC is combined from the shards' stored CRCs without reading them. torch never
    checks those CRCs, so a stale one (a file patched after saving) is no corruption: the write check
    sums the source where a recorded CRC disagrees, and a .pt output is rewritten under CRCs summed
    from its bytes."""
    checkpoint = ckptool.load(written / "sharded")
    piece = checkpoint.tensors["w"].storage.pieces[1]
    piece.crc32 ^= 0x00010000
    out = tmp_path / name
    ckptool.save(checkpoint, out)
    assert ckptool.fingerprint(ckptool.load(out).tensors) == torch_fingerprint(reference(written, "sharded"))
    if name.endswith(".pt"):
        with zipfile.ZipFile(out) as archive:
            assert archive.testzip() is None


def test_without_planner_data_the_keys_stay_flat(written: Path, tmp_path: Path) -> None:
    def drop(metadata, _):
        metadata.planner_data = None

    checkpoint = ckptool.load(tampered(written, tmp_path, "sharded", drop))
    assert checkpoint.layout == () and "model.w" in checkpoint.container
    expected = {f"model.{k}": v for k, v in reference(written, "sharded").items()}
    assert ckptool.fingerprint(checkpoint.tensors) == torch_fingerprint(expected)


def test_reading_never_imports_torch(written: Path) -> None:
    code = textwrap.dedent(f'''
        import sys, ckptool
        for name in ("ddp", "sharded"):
            ckptool.inspect({str(written)!r} + "/" + name, fingerprint=True)  # assembles the sharded tensors
            ckptool.scan({str(written)!r} + "/" + name)
        assert "torch" not in sys.modules, sorted(m for m in sys.modules if m.startswith("torch"))
    ''')
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]


# ---------------------------------------------------------------------------------------------- CLI


def test_inspect_and_scan_report_dcp(written: Path) -> None:
    code, out = run("inspect", written / "ddp")
    assert code == 0 and "dcp" in out and "'model'" in out
    code, out = run("inspect", written / "sharded", "--json", "--fingerprint")
    data = json.loads(out)
    assert code == 0 and data["format"] == "dcp" and data["layout"] == ["model"] and data["tensors"] == 7
    assert data["fingerprint"] == torch_fingerprint(reference(written, "sharded"))
    code, out = run("scan", written / "ddp", "--json")
    report = json.loads(out)
    assert code == 0 and report["safe"] is True and report["format"] == "dcp"
    assert ".metadata" in report["pickles"] and len(report["pickles"]) > 1  # the embedded data.pkl's too
    assert "torch.distributed.checkpoint.metadata.Metadata" in report["globals"]


# ---------------------------------------------------------------------------------------------- refusals


class _Evil:
    def __init__(self, command: str) -> None:
        self.command = command

    def __reduce__(self):
        return os.system, (self.command,)


def test_a_metadata_global_that_runs_code_is_refused_and_flagged(written: Path, tmp_path: Path) -> None:
    canary = tmp_path / "CANARY"

    def inject(metadata, _):
        metadata.version = _Evil(f"touch {canary}")
        data = pickle.dumps(metadata, protocol=2)
        assert data.count(b"cposix\nsystem\n") == 1
        return data.replace(b"cposix\nsystem\n", b"cos\nsystem\n")

    directory = tampered(written, tmp_path, "ddp", inject)
    code, out = run("inspect", directory)
    assert code == 3 and "os.system" in out
    with pytest.raises(ckptool.UnsafeCheckpointError):
        ckptool.load(directory)
    code, out = run("scan", directory, "--json")
    assert code == 1 and json.loads(out)["unsafe"] == ["os.system"]
    code, _ = run("convert", directory, "-o", tmp_path / "out.safetensors")
    assert code == 3 and not (tmp_path / "out.safetensors").exists()
    assert not canary.exists()


def test_an_embedded_value_that_runs_code_is_refused_and_flagged(written: Path, tmp_path: Path) -> None:
    canary = tmp_path / "CANARY"

    def replace_epoch(metadata, directory):
        import io

        buffer = io.BytesIO()
        torch.save(_Evil(f"touch {canary}"), buffer)
        info = storage_entry(metadata, "epoch")
        target = directory / info.relative_path
        info.offset, info.length = target.stat().st_size, len(buffer.getvalue())
        with open(target, "ab") as handle:
            handle.write(buffer.getvalue())

    directory = tampered(written, tmp_path, "ddp", replace_epoch)
    code, out = run("inspect", directory)
    assert code == 3 and "system" in out
    code, out = run("scan", directory, "--json")
    assert code == 1 and any(g.endswith(".system") for g in json.loads(out)["unsafe"])
    assert not canary.exists()


@pytest.mark.parametrize("where", ["../x", "/etc/passwd", "sub/__0_0.distcp"])
def test_a_data_path_outside_the_directory_is_refused(written: Path, tmp_path: Path, where: str) -> None:
    (tmp_path / "x").write_bytes(b"PK\x03\x04" + b"\0" * 4096)

    def escape(metadata, _):
        storage_entry(metadata, next(k for k in metadata.state_dict_metadata if k.startswith("model."))
                      ).relative_path = where

    code, out = run("inspect", tampered(written, tmp_path, "ddp", escape))
    assert code == 3 and "outside the checkpoint directory" in out


def test_an_offset_past_the_end_of_the_file_is_refused(written: Path, tmp_path: Path) -> None:
    def past_end(metadata, directory):
        info = storage_entry(metadata, "optim.param_groups.0.lr")
        info.offset = (directory / info.relative_path).stat().st_size - 10

    code, out = run("inspect", tampered(written, tmp_path, "ddp", past_end))
    assert code == 3 and "truncated or corrupt" in out


@pytest.mark.parametrize("how", ["deleted", "symlink"])
def test_a_missing_data_file_is_refused(written: Path, tmp_path: Path, how: str) -> None:
    directory = tmp_path / "ddp"
    shutil.copytree(written / "ddp", directory)
    (directory / "__1_0.distcp").unlink()
    if how == "symlink":  # data must be a regular file inside the directory, not a link to elsewhere
        (directory / "__1_0.distcp").symlink_to(written / "ddp" / "__1_0.distcp")
    code, out = run("inspect", directory)
    assert code == 3 and "__1_0.distcp" in out and ("missing" if how == "deleted" else "outside the folder") in out


def _chunks(metadata, fqn: str):
    return metadata.state_dict_metadata[fqn].chunks


def test_chunks_that_overlap_or_leave_gaps_are_refused(written: Path, tmp_path: Path) -> None:
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

    def overlap(metadata, _):  # rows 0-5 and 5-8 of 10: as many elements, but row 5 twice and row 9 never
        first, second = _chunks(metadata, "model.w")
        first.sizes, second.sizes = torch.Size([6, 6]), torch.Size([4, 6])

    code, out = run("inspect", tampered(written, tmp_path / "a", "sharded", overlap))
    assert code == 3 and "overlap" in out

    def gap(metadata, _):
        _chunks(metadata, "model.w").pop()

    code, out = run("inspect", tampered(written, tmp_path / "b", "sharded", gap))
    assert code == 3 and "30 of 60 elements" in out

    def outside(metadata, _):
        _chunks(metadata, "model.i").append(ChunkStorageMetadata(offsets=torch.Size([8]), sizes=torch.Size([4])))

    code, out = run("inspect", tampered(written, tmp_path / "c", "sharded", outside))
    assert code == 3 and "reaches outside" in out


def test_a_chunk_that_is_not_what_the_metadata_says_is_refused(written: Path, tmp_path: Path) -> None:
    def swap(metadata, _):  # model.r's 4x4 float chunk is listed where model.w's first 5x6 chunk was
        w_index = next(i for i in metadata.storage_data if i.fqn == "model.w" and tuple(i.offset) == (0, 0))
        metadata.storage_data[w_index] = storage_entry(metadata, "model.r")

    code, out = run("inspect", tampered(written, tmp_path, "sharded", swap))
    assert code == 3 and "not F32 [5, 6]" in out
