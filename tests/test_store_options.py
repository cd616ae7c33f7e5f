"""s3:// reads without s3fs (ckptool/files/s3read.py) against a real SeaweedFS that verifies SigV4 signatures.

The light reader must give the bytes s3fs gives, the same one-line errors, retry throttling as botocore does,
leave s3fs to do the work wherever it cannot reproduce botocore's credentials, and keep ``inspect`` free of
s3fs, aiobotocore and botocore.
"""

from __future__ import annotations

import datetime
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("s3fs", reason="s3:// needs the remote extra")

from ckptool.files import remote, s3read  # noqa: E402
from ckptool.base.errors import InputError  # noqa: E402
from ckptool.files.remote import RemoteFile, RemotePath  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
MODULE_RECORDER = Path(__file__).resolve().parent / "no_torch"
KEYS = ["plain.bin", "with space/and more.bin", "unicodé/ü-データ.bin", "plus+sign.bin", "eq=uals/a=b+c.bin",
        "deep/er/still/nested.bin"]
PAYLOAD = bytes(range(256)) * 1200 + b"tail"  # 307,204 bytes


@pytest.fixture(autouse=True)
def _clean(monkeypatch: pytest.MonkeyPatch) -> Any:
    """No AWS_* setting of the machine, fast backoff, no storage options or cached readers left behind."""
    for name in [k for k in os.environ if k.startswith("AWS_") or k.lower().endswith("_proxy")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("AWS_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", os.devnull)
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.setattr(s3read, "BACKOFF_BASE_S", 0.01)
    remote.set_storage_options(None)
    s3read._readers.clear()
    yield
    remote.set_storage_options(None)
    s3read._readers.clear()
    s3read.POOL.clear()


def _options(endpoint: Any, **extra: Any) -> dict[str, Any]:
    return {**endpoint.storage_options, **extra}


def test_signature_matches_the_published_sigv4_example() -> None:
    """The S3 documentation's GET-with-Range example (examplebucket, 2013-05-24) signs to its published value."""
    credentials = s3read.Credentials("AKIAIOSFODNN7EXAMPLE", "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY", None)
    headers = s3read.sign("GET", "examplebucket.s3.amazonaws.com", "/test.txt", {}, {"Range": "bytes=0-9"},
                          credentials, "us-east-1", datetime.datetime(2013, 5, 24, tzinfo=datetime.timezone.utc))
    assert headers["authorization"] == (
        "AWS4-HMAC-SHA256 Credential=AKIAIOSFODNN7EXAMPLE/20130524/us-east-1/s3/aws4_request, "
        "SignedHeaders=host;range;x-amz-content-sha256;x-amz-date, "
        "Signature=f0e8bdb87c964420e857bd35b5d6ed310bd44f0170aba48dd91039c6036bdb41")


def test_a_session_token_is_sent_and_signed(s3_faults: Any, bucket: str) -> None:
    s3_faults.filesystem().pipe(f"{bucket[5:]}/plain.bin", PAYLOAD)
    reader = s3read.reader_for(_options(s3_faults, token="session-token-value"), {})
    assert reader is not None and reader.credentials is not None and reader.credentials.token == "session-token-value"
    try:
        reader.info(f"{bucket[5:]}/plain.bin")
    except s3read.S3Error as refused:  # a store that checks tokens refuses a made-up one; the header went anyway
        assert refused.status == 403
    head = s3_faults.seen(method="HEAD")[-1].headers
    assert head["x-amz-security-token"] == "session-token-value"
    assert "x-amz-security-token" in head["authorization"].split("SignedHeaders=")[1].split(",")[0].split(";")
    assert "session-token-value" not in repr(reader.credentials)


def test_heads_and_ranges_equal_s3fs_for_awkward_keys(seaweedfs: Any, bucket: str) -> None:
    fs = seaweedfs.filesystem()
    name = bucket[5:]
    for number, key in enumerate(KEYS):
        fs.pipe(f"{name}/{key}", PAYLOAD[number:])
    reader = s3read.reader_for(seaweedfs.storage_options, {})
    assert reader is not None
    for number, key in enumerate(KEYS):
        path = f"{name}/{key}"
        size = len(PAYLOAD) - number
        assert reader.info(path)["size"] == fs.info(path)["size"] == size, key
        assert reader.info(path)["type"] == "file"
        for start, end in [(0, 10), (1000, 70_000), (size - 5, size), (size - 5, size + 100), (None, None)]:
            assert reader.cat_file(path, start, end) == fs.cat_file(path, start=start, end=end), (key, start, end)
        assert reader.cat_ranges([path] * 3, [0, 5, 100], [4, 300_000, 101]) == \
            [PAYLOAD[number:][0:4], PAYLOAD[number:][5:300_000], PAYLOAD[number:][100:101]]
    assert reader.info(f"{name}/deep/er")["type"] == "directory"
    with pytest.raises(FileNotFoundError):
        reader.info(f"{name}/deep/e")


def test_remote_reads_go_through_the_light_reader_and_count_as_before(seaweedfs: Any, bucket: str) -> None:
    seaweedfs.filesystem().pipe(f"{bucket[5:]}/with space/ü+=.bin", PAYLOAD)
    remote.set_storage_options(seaweedfs.storage_options)
    path = RemotePath(f"{bucket}/with space/ü+=.bin")
    sent = s3read.COUNTS["requests"]
    remote.STATS.reset()
    assert isinstance(path.reading_filesystem()[0], s3read.S3Reader)
    assert path.is_file() and path.exists() and path.size() == len(PAYLOAD)
    with RemoteFile(path) as handle:
        assert handle.read(10) == PAYLOAD[:10]
        assert handle.pread(50_000, len(PAYLOAD) - 50_000) == PAYLOAD[-50_000:]
        assert b"".join(handle.iter_chunks(7, len(PAYLOAD) - 7, chunk_size=65_536)) == PAYLOAD[7:]
    stats = remote.STATS.as_dict()
    assert stats["requests"] == 4 + 1 + 1 + 5  # 3 checks and the open's size, 2 windows, 5 chunks
    assert s3read.COUNTS["requests"] - sent == stats["requests"]
    assert not RemotePath(f"{bucket}/nothing-here.bin").exists()


def test_a_wrong_secret_is_the_access_denied_line(seaweedfs: Any, bucket: str) -> None:
    seaweedfs.filesystem().pipe(f"{bucket[5:]}/plain.bin", PAYLOAD)
    wrong = seaweedfs.endpoint.with_credentials(seaweedfs.credentials[0], "not-the-secret-at-all")
    remote.set_storage_options(wrong.storage_options)
    path = RemotePath(f"{bucket}/plain.bin")
    assert isinstance(path.reading_filesystem()[0], s3read.S3Reader)
    with pytest.raises(InputError) as refused:
        path.size()
    message = str(refused.value)
    assert "access denied (403" in message and "\n" not in message
    assert "not-the-secret-at-all" not in message and wrong.key not in message


def test_a_missing_key_is_the_404_line(seaweedfs: Any, bucket: str) -> None:
    remote.set_storage_options(seaweedfs.storage_options)
    path = RemotePath(f"{bucket}/absent.pt")
    with pytest.raises(InputError, match=r"does not exist \(404\)"):
        RemoteFile(path)
    reader = s3read.reader_for(seaweedfs.storage_options, {})
    assert reader is not None
    with pytest.raises(s3read.S3Error) as missing:
        reader.cat_file(f"{bucket[5:]}/absent.pt", 0, 10)
    assert missing.value.status == 404
    assert "does not exist (404)" in str(remote.remote_error(missing.value, path))


def test_slow_down_is_retried_then_succeeds(s3_faults: Any, bucket: str) -> None:
    s3_faults.filesystem().pipe(f"{bucket[5:]}/plain.bin", PAYLOAD)
    s3_faults.reset_counts()
    remote.set_storage_options(s3_faults.storage_options)
    s3_faults.slow_down(times=2, method="GET")
    s3_faults.drop(times=1, method="GET", after_bytes=100)
    with RemoteFile(RemotePath(f"{bucket}/plain.bin")) as handle:
        assert handle.pread(1000, 5) == PAYLOAD[5:1005]
    assert s3_faults.count(method="GET") == 4  # two 503s, a dropped answer, then the bytes


def test_slow_down_forever_is_the_throttled_line(s3_faults: Any, bucket: str) -> None:
    s3_faults.filesystem().pipe(f"{bucket[5:]}/plain.bin", PAYLOAD)
    s3_faults.reset_counts()
    remote.set_storage_options(s3_faults.storage_options)
    s3_faults.slow_down(times=None, method="GET")
    with RemoteFile(RemotePath(f"{bucket}/plain.bin")) as handle, pytest.raises(InputError) as refused:
        handle.pread(10, 0)
    assert "throttling requests (503 SlowDown)" in str(refused.value)
    assert s3_faults.count(method="GET") == s3read.MAX_ATTEMPTS
    s3_faults.reset_counts()
    remote.set_storage_options(_options(s3_faults, config_kwargs={"retries": {"total_max_attempts": 2}}))
    with RemoteFile(RemotePath(f"{bucket}/plain.bin"), size=len(PAYLOAD)) as handle, pytest.raises(InputError):
        handle.pread(10, 0)
    assert s3_faults.count(method="GET") == 2


def test_a_store_that_is_not_there_is_the_cannot_connect_line(seaweedfs: Any) -> None:
    import socket

    with socket.socket() as unused:  # a loopback port nothing listens on (bound, never listening)
        unused.bind(("127.0.0.1", 0))
        closed = seaweedfs.endpoint.__class__(f"http://127.0.0.1:{unused.getsockname()[1]}", *seaweedfs.credentials)
        remote.set_storage_options(closed.storage_options)
        path = RemotePath("s3://some-bucket/model.pt")
        assert isinstance(path.reading_filesystem()[0], s3read.S3Reader)
        with pytest.raises(InputError, match="cannot connect to the store"):
            path.size()


def test_anon_sends_unsigned_requests(s3_faults: Any, bucket: str) -> None:
    s3_faults.filesystem().pipe(f"{bucket[5:]}/plain.bin", PAYLOAD)
    remote.set_storage_options({"anon": True, "endpoint_url": s3_faults.endpoint_url})
    path = RemotePath(f"{bucket}/plain.bin")
    reader = path.reading_filesystem()[0]
    assert isinstance(reader, s3read.S3Reader) and reader.credentials is None
    with pytest.raises(InputError, match=r"access denied \(403"):  # this store lets no anonymous reader in
        path.size()
    head = s3_faults.seen(method="HEAD")[-1].headers
    assert "authorization" not in head and "x-amz-date" not in head


def test_a_slow_store_is_the_timed_out_line(s3_faults: Any, bucket: str) -> None:
    s3_faults.filesystem().pipe(f"{bucket[5:]}/plain.bin", PAYLOAD)
    remote.set_storage_options(_options(s3_faults, config_kwargs={"read_timeout": 0.3,
                                                                  "retries": {"total_max_attempts": 2}}))
    s3_faults.delay(2.0, method="GET")
    with RemoteFile(RemotePath(f"{bucket}/plain.bin"), size=len(PAYLOAD)) as handle, \
            pytest.raises(InputError, match="timed out talking to the store"):
        handle.pread(10, 0)


def test_a_bucket_in_another_aws_region_is_asked_again_there(monkeypatch: pytest.MonkeyPatch) -> None:
    reader = s3read.S3Reader(s3read.Credentials("AKIDEXAMPLE", "s", None), None, "us-east-1")
    asked: list[str] = []

    def once(method: str, bucket: str, key: str, query: Any, headers: Any, region: str, span: Any = None) -> Any:
        asked.append(region)
        if region == "us-east-1":
            return 301, {"x-amz-bucket-region": "eu-central-1"}, b""
        return 200, {"content-length": "7"}, b""

    monkeypatch.setattr(reader, "_once", once)
    assert reader.info("far-bucket/model.pt")["size"] == 7
    assert reader.info("far-bucket/model.pt")["size"] == 7  # the bucket's region is remembered
    assert asked == ["us-east-1", "eu-central-1", "eu-central-1"]


def test_a_shared_credentials_profile_is_used(seaweedfs: Any, bucket: str, tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    seaweedfs.filesystem().pipe(f"{bucket[5:]}/plain.bin", PAYLOAD)
    key, secret = seaweedfs.credentials
    (tmp_path / "credentials").write_text(f"[default]\naws_access_key_id = nope\naws_secret_access_key = nope\n"
                                          f"[work]\naws_access_key_id = {key}\naws_secret_access_key = {secret}\n")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "credentials"))
    monkeypatch.setenv("AWS_PROFILE", "work")
    monkeypatch.setenv("AWS_ENDPOINT_URL", seaweedfs.endpoint_url)
    path = RemotePath(f"{bucket}/plain.bin")
    assert isinstance(path.reading_filesystem()[0], s3read.S3Reader)
    assert path.size() == len(PAYLOAD)


def test_aws_addressing_and_the_profile_region(tmp_path: Path) -> None:
    (tmp_path / "config").write_text("[profile work]\nregion = eu-west-3\n")
    env = {"AWS_ACCESS_KEY_ID": "AKIDEXAMPLE", "AWS_SECRET_ACCESS_KEY": "s", "AWS_PROFILE": "work",
           "AWS_CONFIG_FILE": str(tmp_path / "config"), "AWS_SHARED_CREDENTIALS_FILE": os.devnull}
    reader = s3read.reader_for({}, env)
    assert reader is not None and reader.endpoint is None and reader.region == "eu-west-3"
    assert reader._target("my-bucket", "a b/ü+=.pt", "eu-west-3") == (
        "https", "my-bucket.s3.eu-west-3.amazonaws.com", 443, "my-bucket.s3.eu-west-3.amazonaws.com",
        "/a%20b/%C3%BC%2B%3D.pt")
    assert reader._target("my.dotted.bucket", "k", "eu-west-3")[1:] == (
        "s3.eu-west-3.amazonaws.com", 443, "s3.eu-west-3.amazonaws.com", "/my.dotted.bucket/k")
    assert s3read.reader_for({"client_kwargs": {"region_name": "ap-south-1"}}, env).region == "ap-south-1"


@pytest.mark.parametrize("case", ["no credentials", "a role in the profile", "an unknown option",
                                  "partial credentials", "an endpoint in the profile"])
def test_s3fs_does_the_work_where_the_credentials_are_not_ours(case: str, seaweedfs: Any, tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    import s3fs

    options: dict[str, Any] = {"client_kwargs": {"endpoint_url": seaweedfs.endpoint_url}}
    if case == "a role in the profile":
        (tmp_path / "config").write_text("[default]\nrole_arn = arn:aws:iam::123:role/r\nsource_profile = base\n")
        (tmp_path / "credentials").write_text("[default]\naws_access_key_id = a\naws_secret_access_key = b\n")
        monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "config"))
        monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "credentials"))
    elif case == "an endpoint in the profile":
        (tmp_path / "config").write_text("[default]\nendpoint_url = http://127.0.0.1:1\n")
        monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "config"))
        options = seaweedfs.storage_options
    elif case == "an unknown option":
        options = {**seaweedfs.storage_options, "requester_pays": True}
    elif case == "partial credentials":
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", seaweedfs.credentials[0])
    remote.set_storage_options(options)
    fallbacks = s3read.COUNTS["fallbacks"]
    fs, key = RemotePath("s3://some-bucket/model.pt").reading_filesystem()
    assert isinstance(fs, s3fs.S3FileSystem) and key == "some-bucket/model.pt"
    assert s3read.COUNTS["fallbacks"] == fallbacks + 1


def _inspect(endpoint: Any, tmp_path: Path, url: str, *options: str) -> tuple[subprocess.CompletedProcess[str],
                                                                            set[str]]:
    modules = tmp_path / f"modules-{len(list(tmp_path.glob('modules-*')))}.txt"
    env = endpoint.subprocess_env()
    env.update(CKPTOOL_TEST_MODULES_OUT=str(modules), PYTHONPATH=os.pathsep.join([str(MODULE_RECORDER), str(REPO)]))
    command = [sys.executable, "-m", "ckptool", "inspect", url, "--json"]
    for option in options:
        command += ["--storage-option", option]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    return done, set(modules.read_text().split()) if modules.exists() else set()


def test_cli_inspect_reads_s3_without_s3fs_and_prints_what_s3fs_gives(seaweedfs: Any, bucket: str,
                                                                     tmp_path: Path) -> None:
    url = f"{bucket}/ckpt dir/wrapped+1.pt"
    seaweedfs.filesystem().put(str(REPO / "fixtures" / "ddp_lenet_wrapped.pt"), url[5:])
    light, light_modules = _inspect(seaweedfs, tmp_path, url)
    assert light.returncode == 0, light.stderr
    assert light_modules and not {"s3fs", "aiobotocore", "botocore", "aiohttp", "fsspec"} & light_modules
    heavy, heavy_modules = _inspect(seaweedfs, tmp_path, url, "version_aware=false")  # an option only s3fs takes
    assert heavy.returncode == 0, heavy.stderr
    assert "s3fs" in heavy_modules
    assert light.stdout == heavy.stdout
    assert '"requests": 3' in light.stdout
