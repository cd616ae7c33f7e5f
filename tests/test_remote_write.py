"""Outputs at URLs: convert, strip, remap, add-prefix and save() write to object storage with the
promises they keep on disk — the object appears only complete and checked, --force rules, one-line
errors — against fsspec's memory:// (fast) and a real S3 server (SeaweedFS)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

fsspec = pytest.importorskip("fsspec")
torch = pytest.importorskip("torch")

import ckptool  # noqa: E402
from ckptool.files import remote
from ckptool.io import upload, write_check  # noqa: E402
from ckptool.base.errors import OutputError, UsageError  # noqa: E402
from ckptool.io.writer import save  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
FIXTURES = REPO / "fixtures"
WRAPPED = FIXTURES / "ddp_lenet_wrapped.pt"  # {model: {module.* weights}, optimizer, epoch}
GPU = FIXTURES / "gpu_cuda1_ddp_lenet.pt"
INDEX = "model.safetensors.index.json"


# ------------------------------------------------------------------------------------------------ helpers


@pytest.fixture(autouse=True)
def _fresh_state(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """Counters reset, staging in a folder the test can look into, no storage options left behind."""
    staging = tmp_path / "staging"
    staging.mkdir()
    monkeypatch.setenv("CKPTOOL_STAGING_DIR", str(staging))
    remote.STATS.reset()
    yield staging
    remote.set_storage_options(None)


def _memory_fs() -> Any:
    return fsspec.filesystem("memory")


@pytest.fixture
def memory_bucket() -> Iterator[str]:
    """A fresh top folder of fsspec's (process-wide) memory filesystem, as ``memory://<name>``."""
    name = f"bucket-{uuid.uuid4().hex[:8]}"
    yield f"memory://{name}"
    fs = _memory_fs()
    if fs.exists(f"/{name}"):
        fs.rm(f"/{name}", recursive=True)


def _local_conversion(tmp_path: Path, source: Path, name: str, **options: Any) -> bytes:
    """The bytes the same write makes on disk (the output named the same, so its archive name matches)."""
    folder = tmp_path / f"local-{uuid.uuid4().hex[:6]}"
    folder.mkdir()
    save(ckptool.load(source, allow_globals=options.pop("allow_globals", ())), folder / name, **options)
    return (folder / name).read_bytes()


def _big_checkpoint(path: Path, mib: int = 12) -> Path:
    """A plain state dict of about ``mib`` MiB (several upload parts)."""
    generator = torch.Generator().manual_seed(0)
    weights = {f"layer{i}.weight": torch.randn(256, 1024, generator=generator) for i in range(mib)}
    torch.save(weights, path)
    return path


# ------------------------------------------------------------------------------------------------ memory://


def test_a_safetensors_output_in_memory_equals_the_local_one(tmp_path: Path, memory_bucket: str,
                                                             _fresh_state: Path) -> None:
    report = save(ckptool.load(WRAPPED), f"{memory_bucket}/out/model.safetensors")
    fs = _memory_fs()
    stored = fs.cat(f"{memory_bucket}/out/model.safetensors")
    assert stored == _local_conversion(tmp_path, WRAPPED, "model.safetensors")
    assert str(report.path) == f"{memory_bucket}/out/model.safetensors"
    assert [str(f) for f in report.files] == [f"{memory_bucket}/out/model.safetensors"]
    assert report.checked == len(ckptool.load(WRAPPED).tensors)
    assert remote.STATS.bytes_written == len(stored)
    assert list(_fresh_state.iterdir()) == []  # the staging folder is gone


def test_an_existing_object_is_refused_without_force_and_replaced_with_it(memory_bucket: str) -> None:
    url = f"{memory_bucket}/model.pt"
    fs = _memory_fs()
    fs.pipe(url, b"earlier bytes")
    with pytest.raises(OutputError) as refused:
        save(ckptool.load(WRAPPED), url)
    # the wording of a local output's refusal
    assert str(refused.value) == f"{url}: already exists — pass force=True to overwrite it, or choose another out"
    assert fs.cat(url) == b"earlier bytes"
    save(ckptool.load(WRAPPED), url, force=True)
    assert ckptool.fingerprint(ckptool.load(WRAPPED).tensors) == _fingerprint_of_bytes(fs.cat(url), ".pt")


def _fingerprint_of_bytes(data: bytes, suffix: str) -> str:
    import tempfile

    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / f"read{suffix}"
        path.write_bytes(data)
        return ckptool.fingerprint(ckptool.load(path).tensors)


def test_a_sharded_output_uploads_its_index_last_and_drops_the_earlier_sets_shards(memory_bucket: str,
                                                                                   monkeypatch: pytest.MonkeyPatch
                                                                                   ) -> None:
    completed: list[str] = []
    real = upload._StreamUpload.complete

    def recording(self: upload._StreamUpload) -> None:
        real(self)
        completed.append(self.remote.name)

    monkeypatch.setattr(upload._StreamUpload, "complete", recording)
    url = f"{memory_bucket}/sharded"
    checkpoint = ckptool.load(WRAPPED)
    report = save(checkpoint, url, max_shard_size=20_000)
    fs = _memory_fs()
    names = sorted(p.rsplit("/", 1)[1] for p in fs.ls(url, detail=False))
    shards = [name for name in names if name != INDEX]
    assert len(shards) > 1 and INDEX in names
    assert completed[-1] == INDEX and sorted(completed[:-1]) == shards
    index = json.loads(fs.cat(f"{url}/{INDEX}"))
    assert sorted(set(index["weight_map"].values())) == shards
    assert sorted(str(f) for f in report.files) == sorted(f"{url}/{name}" for name in names)
    # again without force: refused, as a local folder holding the set is
    with pytest.raises(OutputError, match=f"already holds {INDEX} and more of its files"):
        save(checkpoint, url, max_shard_size=20_000)
    # with force and bigger shards: fewer shards, the earlier ones the new index does not name are removed
    fs.pipe(f"{url}/README.md", b"kept")
    save(checkpoint, url, max_shard_size=10_000_000, force=True)
    left = sorted(p.rsplit("/", 1)[1] for p in fs.ls(url, detail=False))
    assert left == ["README.md", "model-00001-of-00001.safetensors", INDEX] or \
        left == sorted(["README.md", "model-00001-of-00001.safetensors", INDEX])
    assert _fingerprint_of_bytes(fs.cat(f"{url}/model-00001-of-00001.safetensors"), ".safetensors") == \
        ckptool.fingerprint(checkpoint.tensors)


def test_a_failed_upload_leaves_nothing_and_removes_the_staging_folder(memory_bucket: str, _fresh_state: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    def failing(self: upload._StreamUpload) -> None:
        raise ConnectionResetError("connection lost")

    monkeypatch.setattr(upload._StreamUpload, "complete", failing)
    url = f"{memory_bucket}/model.safetensors"
    with pytest.raises(OutputError) as failed:
        save(ckptool.load(WRAPPED), url)
    assert "\n" not in str(failed.value) and str(failed.value).startswith(url)
    assert "nothing was written" in str(failed.value)
    assert not _memory_fs().exists(url)
    assert list(_fresh_state.iterdir()) == []


def test_a_check_that_fails_on_the_staged_file_uploads_nothing_and_names_the_url(
        memory_bucket: str, _fresh_state: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from ckptool.io import write_check
    from ckptool.base.errors import FingerprintMismatchError

    def mismatch(*args: Any, **kwargs: Any) -> int:
        raise FingerprintMismatchError("tensor 'x' reads back different from what was written — the output was "
                                       "deleted; check the disk and try again")

    monkeypatch.setattr(write_check, "verify_output", mismatch)
    url = f"{memory_bucket}/model.safetensors"
    with pytest.raises(FingerprintMismatchError) as failed:
        save(ckptool.load(WRAPPED), url)
    assert str(failed.value).startswith(url + ": ")
    assert str(_fresh_state) not in str(failed.value)
    assert not _memory_fs().exists(url)
    assert list(_fresh_state.iterdir()) == []


def test_read_only_urls_and_in_place_are_usage_errors(memory_bucket: str) -> None:
    with pytest.raises(UsageError, match=r"https:// is read-only"):
        save(ckptool.load(WRAPPED), "https://example.com/model.safetensors")
    with pytest.raises(UsageError, match=r"in_place"):
        save(ckptool.load(WRAPPED), f"{memory_bucket}/model.pt", in_place=True)


def test_dry_run_to_a_url_writes_nothing(memory_bucket: str, _fresh_state: Path) -> None:
    url = f"{memory_bucket}/model.safetensors"
    report = save(ckptool.load(WRAPPED), url, dry_run=True)
    assert report.dry_run and [str(f) for f in report.files] == [url]
    assert not _memory_fs().exists(url)
    assert list(_fresh_state.iterdir()) == []


def test_the_api_operations_take_url_outputs(memory_bucket: str) -> None:
    from ckptool.ops import rewrite as operations

    report = operations.strip(WRAPPED, f"{memory_bucket}/stripped.pt")
    assert report.details["renamed"] > 0 and str(report.target) == f"{memory_bucket}/stripped.pt"
    stripped = _memory_fs().cat(f"{memory_bucket}/stripped.pt")
    keys = _keys_of(stripped, ".pt")
    assert keys and not any(key.startswith("module.") for key in keys)


def test_a_many_input_convert_into_a_url_folder(memory_bucket: str) -> None:
    from ckptool.ops import rewrite as operations

    plan = operations.plan_convert([WRAPPED, GPU], out_dir=f"{memory_bucket}/many")
    report = operations.convert(plan, operations.ConvertOptions())
    assert not report.failed
    names = sorted(p.rsplit("/", 1)[1] for p in _memory_fs().ls(f"{memory_bucket}/many", detail=False))
    assert names == ["ddp_lenet_wrapped.safetensors", "gpu_cuda1_ddp_lenet.safetensors"]
    _memory_fs().pipe(f"{memory_bucket}/object", b"x")
    with pytest.raises(UsageError, match="is an object, not a folder"):
        operations.plan_convert([WRAPPED], out_dir=f"{memory_bucket}/object")


def test_a_dcp_folder_to_a_url_is_a_usage_error(memory_bucket: str) -> None:
    from ckptool.ops import rewrite as operations

    plan = operations.plan_convert([WRAPPED], out=f"{memory_bucket}/model.dcp", to="dcp")
    with pytest.raises(UsageError, match="local path only"):
        operations.convert(plan, operations.ConvertOptions(to="dcp"))
    assert not _memory_fs().exists(f"{memory_bucket}/model.dcp")


def test_cli_an_https_output_is_a_usage_error_naming_no_credentials(tmp_path: Path) -> None:
    done = _cli(dict(os.environ), "convert", str(WRAPPED), "-o", "https://user:pw@example.com/m.safetensors")
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip() == ("ckptool: error: https://example.com/m.safetensors: https:// is read-only — write "
                                   "the output to a local path, s3:// or gs://")


def test_the_upload_has_its_own_progress_after_the_write(memory_bucket: str) -> None:
    from ckptool.base import progress

    bars: list[dict[str, Any]] = []

    def factory(total: int | None, description: str) -> Any:
        record: dict[str, Any] = {"total": total, "description": description, "done": 0}
        bars.append(record)

        class Bar:
            total = property(lambda self: record["total"], lambda self, value: record.update(total=value))

            def update(self, n: int = 1) -> None:
                record["done"] += n

            def refresh(self) -> None:
                pass

            def close(self) -> None:
                pass

        return Bar()

    with progress.showing(factory):
        save(ckptool.load(WRAPPED), f"{memory_bucket}/model.safetensors")
    size = _memory_fs().info(f"{memory_bucket}/model.safetensors")["size"]
    assert bars[-1] == {"total": size, "description": "upload model.safetensors", "done": size}
    assert bars[0]["description"] == "model.safetensors"  # the staged write's own bar comes first


def _keys_of(data: bytes, suffix: str) -> list[str]:
    import tempfile

    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / f"read{suffix}"
        path.write_bytes(data)
        return list(ckptool.load(path).tensors)


# ------------------------------------------------------------------------------------------------ a real S3 server
# SeaweedFS on free loopback ports: the session's ``seaweedfs``, ``bucket`` and ``s3_faults`` fixtures
# (tests/objectstore.py, registered by conftest.py).


# quick failures where the server is gone: one retry, short timeouts
FAST_FAILING = {"config_kwargs": {"retries": {"max_attempts": 2, "mode": "standard"}, "connect_timeout": 2,
                                  "read_timeout": 20}}


@pytest.fixture
def s3(seaweedfs: Any) -> Any:
    """The API talks to the session's server (storage options, reset after the test)."""
    remote.set_storage_options(seaweedfs.storage_options)
    return seaweedfs


def _s3fs(seaweedfs: Any) -> Any:
    import s3fs

    return s3fs.S3FileSystem(**seaweedfs.storage_options, skip_instance_cache=True)


def _cli(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    env = {**env, "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-m", "ckptool", *args], capture_output=True, text=True, env=env,
                          timeout=300)


def test_cli_convert_to_s3_equals_the_local_conversion(seaweedfs: Any, bucket: str, tmp_path: Path) -> None:
    url = f"{bucket}/runs/7/model.safetensors"
    done = _cli(seaweedfs.subprocess_env(), "convert", str(WRAPPED), "-o", url, "--json")
    assert done.returncode == 0, done.stderr
    assert f'"output": "{url}"' in done.stdout
    stored = _s3fs(seaweedfs).cat(url)
    assert stored == _local_conversion(tmp_path, WRAPPED, "model.safetensors")
    assert seaweedfs.list_multipart_uploads(bucket) == []


def test_cli_convert_to_an_s3_folder_writes_every_shard_and_the_index(seaweedfs: Any, bucket: str) -> None:
    url = f"{bucket}/sharded/"
    done = _cli(seaweedfs.subprocess_env(), "convert", str(WRAPPED), "-o", url, "--max-shard-size", "20KB")
    assert done.returncode == 0, done.stderr
    objects = seaweedfs.list_objects(bucket, "sharded/")
    index = json.loads(_s3fs(seaweedfs).cat(f"{bucket}/sharded/{INDEX}"))
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1
    assert sorted(objects) == sorted([f"sharded/{name}" for name in shards] + [f"sharded/{INDEX}"])
    read = ckptool.load(_download(seaweedfs, f"{bucket}/sharded", objects))
    assert ckptool.fingerprint(read.tensors) == ckptool.fingerprint(ckptool.load(WRAPPED).tensors)


def _download(seaweedfs: Any, url: str, objects: dict[str, int]) -> Path:
    import tempfile

    folder = Path(tempfile.mkdtemp()) / "download"
    folder.mkdir()
    fs = _s3fs(seaweedfs)
    for key in objects:
        fs.get(f"{url.split('/', 3)[2]}/{key}", str(folder / key.rsplit("/", 1)[1]))
    return folder


def test_cli_out_dir_on_s3_converts_each_input(seaweedfs: Any, bucket: str) -> None:
    done = _cli(seaweedfs.subprocess_env(), "convert", str(WRAPPED), str(GPU), "--out-dir", f"{bucket}/many")
    assert done.returncode == 0, done.stderr
    assert sorted(seaweedfs.list_objects(bucket, "many/")) == ["many/ddp_lenet_wrapped.safetensors",
                                                               "many/gpu_cuda1_ddp_lenet.safetensors"]


@pytest.mark.parametrize("command", [["strip"], ["add-prefix", "--prefix", "net."], ["remap", "--to", "cpu"]],
                         ids=lambda c: c[0])
def test_cli_rewrites_to_s3_equal_the_local_rewrite(seaweedfs: Any, bucket: str, tmp_path: Path,
                                                    command: list[str]) -> None:
    source = GPU
    url = f"{bucket}/{command[0]}/out.pt"
    done = _cli(seaweedfs.subprocess_env(), command[0], str(source), "-o", url, *command[1:])
    assert done.returncode == 0, done.stderr
    local = tmp_path / "out.pt"
    here = _cli(dict(os.environ), command[0], str(source), "-o", str(local), *command[1:])
    assert here.returncode == 0, here.stderr
    # a .pt carries a random serialization id (as torch's own saves do): compared by content
    fetched = tmp_path / "fetched.pt"
    fetched.write_bytes(_s3fs(seaweedfs).cat(url))
    ours, theirs = ckptool.load(fetched), ckptool.load(local)
    assert ckptool.fingerprint(ours.tensors) == ckptool.fingerprint(theirs.tensors)
    assert list(ours.tensors) == list(theirs.tensors) and ours.saved_devices() == theirs.saved_devices()
    assert sorted(map(str, ours.entries())) == sorted(map(str, theirs.entries()))
    assert len(fetched.read_bytes()) == len(local.read_bytes())


def test_cli_existing_object_needs_force(seaweedfs: Any, bucket: str) -> None:
    url = f"{bucket}/model.safetensors"
    fs = _s3fs(seaweedfs)
    fs.pipe(url, b"earlier")
    before = fs.info(url)["ETag"]
    refused = _cli(seaweedfs.subprocess_env(), "convert", str(WRAPPED), "-o", url)
    assert refused.returncode == 3
    assert refused.stderr.strip() == (f"ckptool: error: {url}: already exists — pass --force to overwrite it, or "
                                      "choose another -o")
    fs.invalidate_cache()
    assert fs.cat(url) == b"earlier" and fs.info(url)["ETag"] == before
    forced = _cli(seaweedfs.subprocess_env(), "convert", str(WRAPPED), "-o", url, "--force")
    assert forced.returncode == 0, forced.stderr
    fs.invalidate_cache()
    assert _fingerprint_of_bytes(fs.cat(url), ".safetensors") == ckptool.fingerprint(ckptool.load(WRAPPED).tensors)


def test_cli_a_missing_bucket_and_wrong_credentials_are_one_line_exit_3(seaweedfs: Any, bucket: str) -> None:
    missing = _cli(seaweedfs.subprocess_env(), "convert", str(WRAPPED), "-o", "s3://no-such-bucket-ckpt/m.pt")
    assert missing.returncode == 3
    assert missing.stderr.count("\n") == 1 and "bucket no-such-bucket-ckpt does not exist (404)" in missing.stderr
    env = {**seaweedfs.subprocess_env(), "AWS_ACCESS_KEY_ID": "WRONGKEY", "AWS_SECRET_ACCESS_KEY": "wrong-secret"}
    denied = _cli(env, "convert", str(WRAPPED), "-o", f"{bucket}/m.pt")
    if denied.returncode == 0:
        pytest.skip("this SeaweedFS accepts any credentials (started without an identity file)")
    assert denied.returncode == 3
    assert denied.stderr.count("\n") == 1 and "access denied (403" in denied.stderr
    assert "wrong-secret" not in denied.stderr and "WRONGKEY" not in denied.stderr


def test_upload_is_sent_in_parts_and_the_object_is_checked(s3: Any, bucket: str, tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(upload, "PART_SIZE", 5 * 1024 * 1024)
    sent: list[int] = []
    real = upload._StoreUpload.part

    def counting(self: upload._StoreUpload, number: int, data: bytes) -> bytes:
        sent.append(len(data))
        return real(self, number, data)

    monkeypatch.setattr(upload._StoreUpload, "part", counting)
    source = _big_checkpoint(tmp_path / "big.pt")
    url = f"{bucket}/big.safetensors"
    save(ckptool.load(source), url)
    stored = _s3fs(s3).cat(url)
    assert len(sent) == -(-len(stored) // (5 * 1024 * 1024)) > 1 and sum(sent) == len(stored)
    assert stored == _local_conversion(tmp_path, source, "big.safetensors")
    assert remote.STATS.bytes_written == len(stored)


def test_ctrl_c_mid_upload_aborts_it(s3: Any, bucket: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                     _fresh_state: Path) -> None:
    monkeypatch.setattr(upload, "PART_SIZE", 5 * 1024 * 1024)
    real = upload._StoreUpload.part

    def interrupted(self: upload._StoreUpload, number: int, data: bytes) -> bytes:
        if number == 2:
            raise KeyboardInterrupt
        return real(self, number, data)

    monkeypatch.setattr(upload._StoreUpload, "part", interrupted)
    with pytest.raises(KeyboardInterrupt):
        save(ckptool.load(_big_checkpoint(tmp_path / "big.pt")), f"{bucket}/big.safetensors")
    assert s3.list_objects(bucket) == {}
    assert s3.list_multipart_uploads(bucket) == []
    assert list(_fresh_state.iterdir()) == []


def test_a_failure_while_the_set_is_held_open_aborts_every_upload(s3: Any, bucket: str,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Every shard is sent and held open; a failure before the first completion leaves neither objects nor parts."""
    def failing(self: upload._StoreUpload) -> None:
        raise OSError("the store went away")

    monkeypatch.setattr(upload._StoreUpload, "complete", failing)
    url = f"{bucket}/sharded"
    with pytest.raises(OutputError) as failed:
        save(ckptool.load(WRAPPED), url, max_shard_size=20_000)
    assert "\n" not in str(failed.value) and "nothing was written" in str(failed.value)
    assert s3.list_objects(bucket) == {}
    assert s3.list_multipart_uploads(bucket) == []


def test_server_killed_mid_upload_leaves_no_object_and_says_so_in_one_line(
        s3: Any, bucket: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    remote.set_storage_options({**s3.storage_options, **FAST_FAILING})
    monkeypatch.setattr(upload, "PARTS_IN_FLIGHT", 1)
    monkeypatch.setattr(upload, "PART_SIZE", 5 * 1024 * 1024)
    real = upload._StoreUpload.part

    def killing(self: upload._StoreUpload, number: int, data: bytes) -> bytes:
        if number == 2:
            s3.kill()
        return real(self, number, data)

    monkeypatch.setattr(upload._StoreUpload, "part", killing)
    source = _big_checkpoint(tmp_path / "big.pt")
    url = f"{bucket}/big.safetensors"
    with pytest.raises(OutputError) as failed:
        save(ckptool.load(source), url)
    message = str(failed.value)
    assert message.startswith(f"{url}: ") and "\n" not in message
    assert "aborting the upload may have failed too" in message and "no object was written" in message
    s3.restart()
    assert s3.list_objects(bucket) == {}
    monkeypatch.undo()
    remote.set_storage_options(s3.storage_options)
    monkeypatch.setenv("CKPTOOL_STAGING_DIR", str(tmp_path / "staging"))
    save(ckptool.load(source), url)  # the next write is not held up by what the first left
    assert _s3fs(s3).cat(url) == _local_conversion(tmp_path, source, "big.safetensors")


def test_bytes_altered_on_the_way_fail_the_write_and_leave_nothing(s3: Any, bucket: str, tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """A part whose bytes change after their MD5 was taken: the store's checksum of the parts at completion is
    not that of the bytes meant, and the object is deleted."""
    monkeypatch.setattr(upload, "PART_SIZE", 5 * 1024 * 1024)
    real = upload._StoreUpload.part

    def corrupted_on_the_way(self: upload._StoreUpload, number: int, data: bytes) -> bytes:
        real(self, number, data)
        return bytes([data[0] ^ 1]) + data[1:]  # a bit flipped after the MD5 was taken

    monkeypatch.setattr(upload._StoreUpload, "part", corrupted_on_the_way)
    url = f"{bucket}/big.safetensors"
    with pytest.raises(OutputError) as failed:
        save(ckptool.load(_big_checkpoint(tmp_path / "big.pt")), url)
    message = str(failed.value)
    assert message.startswith(f"{url}: the store's checksum of the parts (") and "\n" not in message
    assert "the object was deleted" in message
    assert s3.list_objects(bucket) == {}
    assert s3.list_multipart_uploads(bucket) == []


def test_throttled_parts_are_retried_and_a_store_that_keeps_refusing_is_one_line(
        s3_faults: Any, seaweedfs: Any, bucket: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(upload, "PART_SIZE", 5 * 1024 * 1024)
    remote.set_storage_options({**s3_faults.storage_options, **FAST_FAILING})
    source = _big_checkpoint(tmp_path / "big.pt")
    s3_faults.slow_down(times=2, op="UploadPart")
    url = f"{bucket}/big.safetensors"
    save(ckptool.load(source), url)
    throttled = [r for r in s3_faults.requests if r.operation == "UploadPart" and r.status == 503]
    assert len(throttled) == 2
    assert _s3fs(seaweedfs).cat(url) == _local_conversion(tmp_path, source, "big.safetensors")
    s3_faults.slow_down(times=None, op="UploadPart")
    with pytest.raises(OutputError) as failed:
        save(ckptool.load(source), f"{bucket}/again.safetensors")
    message = str(failed.value)
    assert message.startswith(f"{bucket}/again.safetensors: the store is throttling requests (503")
    assert "\n" not in message and "the upload was aborted: nothing was written" in message
    assert seaweedfs.list_multipart_uploads(bucket) == []
    assert sorted(seaweedfs.list_objects(bucket)) == ["big.safetensors"]


def test_a_sharded_s3_output_is_invisible_until_every_shard_is_sent_and_its_index_comes_last(
        s3: Any, bucket: str, monkeypatch: pytest.MonkeyPatch) -> None:
    order: list[str] = []
    seen_at_first_completion: list[dict[str, int]] = []
    real = upload._StoreUpload.complete

    def recording(self: upload._StoreUpload) -> None:
        if not order:
            seen_at_first_completion.append(s3.list_objects(bucket))
        real(self)
        order.append(self.remote.name)

    monkeypatch.setattr(upload._StoreUpload, "complete", recording)
    url = f"{bucket}/sharded"
    save(ckptool.load(WRAPPED), url, max_shard_size=20_000)
    assert seen_at_first_completion == [{}]  # every file was sent, none visible yet
    objects = s3.list_objects(bucket, "sharded/")
    assert order[-1] == INDEX and len(order) == len(objects) > 2
    assert sorted(f"sharded/{name}" for name in order) == sorted(objects)
    assert s3.list_multipart_uploads(bucket) == []


@pytest.mark.parametrize("signum,code", [(2, 130), (15, 143)], ids=["SIGINT", "SIGTERM"])
def test_cli_ctrl_c_while_a_part_is_on_its_way_aborts_the_upload(s3_faults: Any, seaweedfs: Any, bucket: str,
                                                                tmp_path: Path, signum: int, code: int) -> None:
    source = _big_checkpoint(tmp_path / "big.pt", mib=20)
    s3_faults.delay(3.0, op="UploadPart")  # every part waits at the proxy: a Ctrl-C lands mid-upload
    env = {**s3_faults.endpoint.subprocess_env(), "PYTHONPATH": str(REPO), "CKPTOOL_STAGING_DIR": str(tmp_path)}
    process = subprocess.Popen([sys.executable, "-m", "ckptool", "convert", str(source), "-o",
                                f"{bucket}/big.safetensors"], env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not any(r.operation == "UploadPart" for r in s3_faults.requests):
        assert process.poll() is None and time.monotonic() < deadline, process.communicate()
        time.sleep(0.05)
    process.send_signal(signum)
    out, err = process.communicate(timeout=120)
    assert process.returncode == code, err
    assert seaweedfs.list_objects(bucket) == {}
    assert seaweedfs.list_multipart_uploads(bucket) == []
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(upload.STAGING_PREFIX)] == []


def test_cli_connections_lost_mid_part_abort_the_upload_in_one_line(s3_faults: Any, seaweedfs: Any, bucket: str,
                                                                    tmp_path: Path) -> None:
    source = _big_checkpoint(tmp_path / "big.pt", mib=20)
    s3_faults.drop(after_bytes=1 << 20, op="UploadPart", times=None)
    env = {**s3_faults.endpoint.subprocess_env(), "PYTHONPATH": str(REPO), "CKPTOOL_STAGING_DIR": str(tmp_path)}
    done = subprocess.run([sys.executable, "-m", "ckptool", "convert", str(source), "-o",
                           f"{bucket}/big.safetensors"], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 3, done.stderr
    assert done.stderr.count("\n") == 1 and done.stderr.startswith(f"ckptool: error: {bucket}/big.safetensors: ")
    assert "the upload was aborted: nothing was written" in done.stderr
    assert seaweedfs.list_objects(bucket) == {}
    assert seaweedfs.list_multipart_uploads(bucket) == []


# ------------------------------------------------------------------------------------------------ streamed


def test_a_safetensors_output_is_sent_while_written_and_never_staged_whole(s3: Any, bucket: str, tmp_path: Path,
                                                                            monkeypatch: pytest.MonkeyPatch,
                                                                            _fresh_state: Path) -> None:
    """Its parts go to the store as the write lands them, and leave the local disk once sent and re-read: the
    staging folder never holds more than a few parts. Nothing is visible until the check passed."""
    from ckptool.io import streamed

    monkeypatch.setattr(upload, "PART_SIZE", 5 * 1024 * 1024)
    source = _big_checkpoint(tmp_path / "big.pt", mib=24)
    url = f"{bucket}/big.safetensors"
    staged: list[int] = []
    visible: list[dict[str, int]] = []
    real_part = upload._StoreUpload.part

    def watching(self: upload._StoreUpload, number: int, data: bytes) -> bytes:
        staged.append(sum(p.stat().st_blocks * 512 for p in _fresh_state.rglob("*") if p.is_file()))
        return real_part(self, number, data)

    real_verify = write_check.verify_output

    def verifying(*args: Any, **kwargs: Any) -> int:
        visible.append(s3.list_objects(bucket))  # every part sent, the check not yet passed
        return real_verify(*args, **kwargs)

    monkeypatch.setattr(upload._StoreUpload, "part", watching)
    monkeypatch.setattr(write_check, "verify_output", verifying)
    save(ckptool.load(source), url)
    stored = _s3fs(s3).cat(url)
    assert stored == _local_conversion(tmp_path, source, "big.safetensors")
    assert len(staged) == -(-len(stored) // (5 * 1024 * 1024)) > 4 and visible[0] == {}
    if streamed._PUNCH is not None:
        assert max(staged) <= 4 * 5 * 1024 * 1024 < len(stored)  # a few parts on disk, never the whole output
    assert remote.STATS.bytes_written == len(stored) and s3.list_multipart_uploads(bucket) == []


def test_a_streamed_output_whose_check_fails_leaves_nothing(s3: Any, bucket: str, tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """Every part is with the store when the check runs; a mismatch aborts the upload: no object, no parts."""
    from ckptool.base.errors import FingerprintMismatchError

    monkeypatch.setattr(upload, "PART_SIZE", 5 * 1024 * 1024)

    def mismatch(*args: Any, **kwargs: Any) -> int:
        raise FingerprintMismatchError("tensor 'layer0.weight' reads back different from what was written")

    monkeypatch.setattr(write_check, "verify_output", mismatch)
    url = f"{bucket}/big.safetensors"
    with pytest.raises(FingerprintMismatchError):
        save(ckptool.load(_big_checkpoint(tmp_path / "big.pt")), url)
    assert s3.list_objects(bucket) == {}
    assert s3.list_multipart_uploads(bucket) == []


def test_a_write_that_goes_back_over_sent_bytes_aborts_the_upload(s3: Any, bucket: str, tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Only final bytes are sent: a writer that rewrote bytes already with the store fails, and nothing is left."""
    from ckptool.formats import safetensors

    monkeypatch.setattr(upload, "PART_SIZE", 5 * 1024 * 1024)
    real = safetensors.write_file

    def patching(handle: Any, *args: Any, **kwargs: Any) -> Any:
        result = real(handle, *args, **kwargs)
        handle.seek(8)
        handle.write(b"{")  # as a fingerprint patched into the header would
        return result

    monkeypatch.setattr(safetensors, "write_file", patching)
    url = f"{bucket}/big.safetensors"
    with pytest.raises(OutputError) as failed:
        save(ckptool.load(_big_checkpoint(tmp_path / "big.pt")), url)
    assert "already sent to the store" in str(failed.value) and "\n" not in str(failed.value)
    assert s3.list_objects(bucket) == {}
    assert s3.list_multipart_uploads(bucket) == []


def test_a_fingerprinted_or_pt_output_is_staged_then_uploaded(s3: Any, bucket: str, tmp_path: Path) -> None:
    source = _big_checkpoint(tmp_path / "big.pt", mib=2)
    fingerprinted = save(ckptool.load(source), f"{bucket}/f.safetensors", fingerprint=True)
    assert fingerprinted.fingerprint and len(_s3fs(s3).cat(f"{bucket}/f.safetensors")) > 2 * 1024 * 1024
    save(ckptool.load(source), f"{bucket}/p.pt")
    fetched = tmp_path / "p.pt"
    fetched.write_bytes(_s3fs(s3).cat(f"{bucket}/p.pt"))
    assert ckptool.fingerprint(ckptool.load(fetched).tensors) == fingerprinted.fingerprint
