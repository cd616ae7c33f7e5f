"""How the storage options and the environment become obstore's configuration (ckptool/files/store_options.py), and
the reader that obstore's stores answer through (ckptool/files/stores.py), against a real SeaweedFS that checks
signatures: s3fs's and gcsfs's option names, credentials from the options, the environment or a profile, the
region, retries and a bucket in another AWS region; ``inspect`` of a URL imports neither s3fs nor botocore.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("obstore", reason="URLs need the remote extra")

from ckptool.base.errors import InputError  # noqa: E402
from ckptool.files import remote, store_options, stores  # noqa: E402
from ckptool.files.remote import RemotePath  # noqa: E402
from ckptool.files.store_options import OptionError, gcs_config, http_config, s3_config  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
MODULE_RECORDER = Path(__file__).resolve().parent / "no_torch"
PAYLOAD = bytes(range(256)) * 1200 + b"tail"  # 307,204 bytes
NO_FILES = {"AWS_CONFIG_FILE": os.devnull, "AWS_SHARED_CREDENTIALS_FILE": os.devnull}


@pytest.fixture(autouse=True)
def _clean(monkeypatch: pytest.MonkeyPatch) -> Any:
    """No AWS_* setting of the machine, no storage options or cached readers left behind."""
    for name in [k for k in os.environ if k.startswith(("AWS_", "GOOGLE_")) or k.lower().endswith("_proxy")]:
        monkeypatch.delenv(name)
    for name, value in {**NO_FILES, "AWS_EC2_METADATA_DISABLED": "true"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("STORAGE_EMULATOR_HOST", raising=False)
    remote.set_storage_options(None)
    stores.clear()
    yield
    remote.set_storage_options(None)
    stores.clear()


# -- the options, without a store -------------------------------------------------------------------------


def test_s3fs_option_names_map_onto_obstores_keys() -> None:
    options = {"key": "AKID", "secret": "s3cr3t", "token": "tok", "endpoint_url": "http://127.0.0.1:9",
               "client_kwargs": {"region_name": "eu-west-3"}, "skip_instance_cache": True,
               "config_kwargs": {"retries": {"max_attempts": 2}, "connect_timeout": 3}}
    config, client, attempts = s3_config(options, NO_FILES)
    assert config == {"access_key_id": "AKID", "secret_access_key": "s3cr3t", "session_token": "tok",
                      "endpoint": "http://127.0.0.1:9", "region": "eu-west-3"}
    assert client == {"connect_timeout": "3s", "allow_http": True}
    assert attempts == 3  # botocore's max_attempts counts the retries
    assert s3_config({"config_kwargs": {"retries": {"total_max_attempts": 7}}}, NO_FILES)[2] == 7
    assert s3_config({"anon": True}, NO_FILES)[0] == {"skip_signature": True, "region": "us-east-1"}
    assert s3_config({"request_payer": True, "checksum_algorithm": "SHA256"}, NO_FILES)[0]["request_payer"] is True


@pytest.mark.parametrize("options", [{"version_aware": True}, {"client_kwargs": {"verify": False}},
                                     {"config_kwargs": {"retries": 3}}])
def test_an_option_s3_does_not_take_is_refused_by_name(options: dict[str, Any]) -> None:
    with pytest.raises(OptionError):
        s3_config(options, NO_FILES)


def test_the_environment_names_the_endpoint_and_region(tmp_path: Path) -> None:
    env = {**NO_FILES, "AWS_ENDPOINT_URL": "https://elsewhere.example", "AWS_ENDPOINT_URL_S3": "http://s3.example"}
    config, client, _ = s3_config({}, env)
    assert config["endpoint"] == "http://s3.example" and client == {"allow_http": True}
    assert "endpoint" not in s3_config({}, NO_FILES)[0]
    assert "region" not in s3_config({}, {**NO_FILES, "AWS_REGION": "ap-south-1"})[0]  # obstore reads AWS_REGION
    (tmp_path / "config").write_text("[profile work]\nregion = eu-west-3\n[default]\nregion = us-west-2\n")
    files = {"AWS_CONFIG_FILE": str(tmp_path / "config"), "AWS_SHARED_CREDENTIALS_FILE": os.devnull}
    assert s3_config({}, {**files, "AWS_PROFILE": "work"})[0]["region"] == "eu-west-3"
    assert s3_config({}, files)[0]["region"] == "us-west-2"
    assert s3_config({"client_kwargs": {"region_name": "ap-south-1"}}, files)[0]["region"] == "ap-south-1"


def test_a_shared_credentials_profile_gives_the_keys(tmp_path: Path) -> None:
    (tmp_path / "credentials").write_text("[default]\naws_access_key_id = A\naws_secret_access_key = B\n"
                                          "[work]\naws_access_key_id = C\naws_secret_access_key = D\n"
                                          "aws_session_token = E\n")
    env = {"AWS_CONFIG_FILE": os.devnull, "AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "credentials")}
    assert s3_config({}, env)[0]["access_key_id"] == "A"
    work = s3_config({}, {**env, "AWS_PROFILE": "work"})[0]
    assert (work["access_key_id"], work["secret_access_key"], work["session_token"]) == ("C", "D", "E")
    assert "access_key_id" not in s3_config({}, {**env, "AWS_ACCESS_KEY_ID": "X"})[0]  # the environment's own
    assert "access_key_id" not in s3_config({"anon": True}, env)[0]
    assert s3_config({"key": "K", "secret": "S"}, env)[0]["access_key_id"] == "K"


def test_a_role_profile_is_read_through_boto3_only_where_it_is_installed(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "config").write_text("[profile ci]\nrole_arn = arn:aws:iam::123:role/r\nsource_profile = base\n")
    env = {"AWS_CONFIG_FILE": str(tmp_path / "config"), "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
           "AWS_PROFILE": "ci"}
    monkeypatch.setitem(sys.modules, "boto3", None)  # not installed: obstore's own chain
    assert store_options.profile_provider({}, env) is None
    made: list[Any] = []

    class Session:
        def __init__(self, profile_name: str | None = None) -> None:
            made.append(profile_name)

    class Provider:
        def __init__(self, session: Session) -> None:
            self.session = session

    monkeypatch.setitem(sys.modules, "boto3", type(sys)("boto3"))
    sys.modules["boto3"].Session = Session  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "obstore.auth.boto3", type(sys)("obstore.auth.boto3"))
    sys.modules["obstore.auth.boto3"].Boto3CredentialProvider = Provider  # type: ignore[attr-defined]
    assert isinstance(store_options.profile_provider({}, env), Provider) and made == ["ci"]
    assert store_options.profile_provider({"access_key_id": "K"}, env) is None  # keys given: no provider
    assert store_options.profile_provider({}, {**env, "AWS_PROFILE": "other"}) is None  # no such profile


def test_gcsfs_and_http_options_map_and_others_are_refused() -> None:
    assert gcs_config({"token": "anon", "project": "p"}, {})[0] == {"skip_signature": True}
    assert gcs_config({"token": "/keys/sa.json"}, {})[0] == {"service_account": "/keys/sa.json"}
    config, client, _ = gcs_config({}, {"STORAGE_EMULATOR_HOST": "127.0.0.1:4443"})
    assert config == {"base_url": "http://127.0.0.1:4443"} and client == {"allow_http": True}
    with pytest.raises(OptionError):
        gcs_config({"requester_pays": True}, {})
    assert http_config({"headers": {"X-A": "1"}})[1]["default_headers"] == {"X-A": "1"}
    with pytest.raises(OptionError):
        http_config({"key": "K"})


def test_an_unknown_option_is_one_line_naming_it(seaweedfs: Any, bucket: str) -> None:
    remote.set_storage_options({**seaweedfs.storage_options, "version_aware": True})
    with pytest.raises(InputError) as refused:
        RemotePath(f"{bucket}/model.pt").size()
    assert "the storage options are not ones s3:// takes (version_aware)" in str(refused.value)


def test_a_bucket_in_another_aws_region_is_asked_again_there(monkeypatch: pytest.MonkeyPatch) -> None:
    """AWS answers 301 for a bucket of another region: its region is asked once, and the request made again there."""
    reader = stores.reader_for("s3", {"key": "AKID", "secret": "s"}, NO_FILES)
    asked: list[str | None] = []
    probes: list[str] = []

    def head(store: Any, key: str) -> dict[str, Any]:
        region = store.config.get("region")
        asked.append(region)
        if region != "eu-central-1":
            raise stores.StoreError(301, "PermanentRedirect")
        return {"size": 7, "e_tag": "x"}

    monkeypatch.setattr("obstore.head", head)
    monkeypatch.setattr(stores, "bucket_region", lambda bucket, seconds: probes.append(bucket) or "eu-central-1")
    assert reader.head("far-bucket/model.pt")["size"] == 7
    assert reader.head("far-bucket/model.pt")["size"] == 7  # the bucket's region is remembered
    assert asked == ["us-east-1", "eu-central-1", "eu-central-1"] and probes == ["far-bucket"]
    endpoint = stores.reader_for("s3", {"key": "AKID", "secret": "s", "endpoint_url": "http://127.0.0.1:9"}, NO_FILES)
    with pytest.raises(stores.StoreError):  # a store of its own (an endpoint) is not AWS: not asked again
        endpoint.head("far-bucket/model.pt")
    assert probes == ["far-bucket"]


# -- against the store ------------------------------------------------------------------------------------


def test_credentials_from_a_profile_read_the_store(seaweedfs: Any, bucket: str, tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    seaweedfs.filesystem().pipe(f"{bucket[5:]}/plain.bin", PAYLOAD)
    key, secret = seaweedfs.credentials
    (tmp_path / "credentials").write_text(f"[default]\naws_access_key_id = nope\naws_secret_access_key = nope\n"
                                          f"[work]\naws_access_key_id = {key}\naws_secret_access_key = {secret}\n")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "credentials"))
    monkeypatch.setenv("AWS_ENDPOINT_URL", seaweedfs.endpoint_url)
    path = RemotePath(f"{bucket}/plain.bin")
    with pytest.raises(InputError, match=r"access denied \(403"):  # the default profile's keys are wrong
        path.size()
    monkeypatch.setenv("AWS_PROFILE", "work")
    assert RemotePath(f"{bucket}/plain.bin").size() == len(PAYLOAD)


def test_anon_sends_unsigned_requests(s3_faults: Any, bucket: str) -> None:
    s3_faults.filesystem().pipe(f"{bucket[5:]}/plain.bin", PAYLOAD)
    remote.set_storage_options({"anon": True, "endpoint_url": s3_faults.endpoint_url})
    with pytest.raises(InputError, match=r"access denied \(403"):  # this store lets no anonymous reader in
        RemotePath(f"{bucket}/plain.bin").size()
    head = s3_faults.seen(method="HEAD")[-1].headers
    assert "authorization" not in head and "x-amz-date" not in head


def test_throttling_is_retried_as_many_times_as_asked(s3_faults: Any, bucket: str) -> None:
    s3_faults.filesystem().pipe(f"{bucket[5:]}/plain.bin", PAYLOAD)
    remote.set_storage_options({**s3_faults.storage_options, "config_kwargs": {"retries": {"total_max_attempts": 3}}})
    s3_faults.slow_down(times=2, method="HEAD")
    assert RemotePath(f"{bucket}/plain.bin").size() == len(PAYLOAD)
    s3_faults.slow_down(times=None, method="HEAD")
    stores.clear()
    with pytest.raises(InputError, match=r"throttling requests \(503"):
        RemotePath(f"{bucket}/other.bin").size()


def test_cli_inspect_of_a_url_imports_no_s3fs_nor_botocore(seaweedfs: Any, bucket: str, tmp_path: Path) -> None:
    url = f"{bucket}/ckpt dir/wrapped+1.pt"
    seaweedfs.filesystem().put(str(REPO / "fixtures" / "ddp_lenet_wrapped.pt"), url[5:])
    modules = tmp_path / "modules.txt"
    env = seaweedfs.subprocess_env()
    env.update(CKPTOOL_TEST_MODULES_OUT=str(modules), PYTHONPATH=os.pathsep.join([str(MODULE_RECORDER), str(REPO)]))
    done = subprocess.run([sys.executable, "-m", "ckptool", "inspect", url, "--json"], env=env, capture_output=True,
                          text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    loaded = set(modules.read_text().split())
    assert "obstore" in loaded and not {"s3fs", "aiobotocore", "botocore", "aiohttp", "fsspec"} & loaded
    assert '"requests": 3' in done.stdout
