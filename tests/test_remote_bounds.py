"""Stores that lie, trickle or fail: every remote read stops where it asked to, ends in bounded time, and says
so in one line; URLs ckptool does not read are refused in one line; no spelling of an input is ever written.

The stores are real loopback servers (``objectstore.LyingServer``) reached through each reader ckptool has:
fsspec's HTTP filesystem (``https://`` inputs), the light S3 reader (:mod:`ckptool.files.stores`), s3fs (where the
light reader steps aside) and gcsfs. Object-store aliasing runs on SeaweedFS (``bucket``) and ``memory://``.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("fsspec", reason="URLs need the remote extra")
pytest.importorskip("s3fs", reason="s3:// needs the remote extra")

from click.testing import CliRunner  # noqa: E402
from objectstore import LyingServer  # noqa: E402

from ckptool.files import remote, stores  # noqa: E402
from ckptool.cli.main import main  # noqa: E402
from ckptool.files.remote import identity  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
FIXTURES = REPO / "fixtures"
WRAPPED = FIXTURES / "ddp_lenet_wrapped.pt"  # 1.5 MB; its keys carry "module."
GPU = FIXTURES / "gpu_cuda1_ddp_lenet.pt"  # storages tagged cuda:1: what remap rewrites
MiB = 1 << 20
READERS = ("http", "stores", "s3fs", "gcsfs")


@pytest.fixture(autouse=True)
def _clean(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """No AWS_* or proxy setting of the machine; no storage options, cached readers or connections left behind."""
    for name in [k for k in os.environ if k.startswith("AWS_") or k.lower().endswith("_proxy")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("AWS_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", os.devnull)
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.delenv("STORAGE_EMULATOR_HOST", raising=False)
    remote.set_storage_options(None)
    stores.clear()
    yield
    remote.set_storage_options(None)
    stores.clear()


@pytest.fixture(scope="module")
def liar() -> Iterator[LyingServer]:
    with LyingServer({"in.pt": WRAPPED.read_bytes()}, trickle_s=0.5) as server:
        yield server


def where(reader: str, server: LyingServer, mode: str, monkeypatch: pytest.MonkeyPatch) -> tuple[str, list[str]]:
    """(the URL of ``in.pt`` served in ``mode``, the command-line options) through ``reader``."""
    if reader == "http":
        return server.url(mode, "in.pt"), []
    if reader == "gcsfs":
        return f"gs://{mode}/in.pt", ["--storage-option", f"endpoint_url={server.base_url}",
                                      "--storage-option", "token=anon"]
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "lying-key")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "lying-secret")
    monkeypatch.setenv("AWS_ENDPOINT_URL", server.base_url)
    # use_ssl is an s3fs option the light reader does not reproduce: s3fs reads
    return f"s3://{mode}/in.pt", (["--storage-option", "use_ssl=false"] if reader == "s3fs" else [])


def cli(*args: object) -> tuple[int, str, str]:
    result = CliRunner().invoke(main, [str(a) for a in args])
    return result.exit_code, result.stdout, result.stderr


def one_line(stderr: str) -> str:
    lines = stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("ckptool: error: "), stderr
    return lines[0]


# ------------------------------------------------------------------------------------------------ bounds


@pytest.mark.parametrize("reader", READERS)
def test_an_honest_store_is_read_by_ranges(reader: str, liar: LyingServer, monkeypatch: pytest.MonkeyPatch) -> None:
    url, options = where(reader, liar, "ok", monkeypatch)
    code, out, err = cli("inspect", url, "--json", *options)
    assert code == 0, err
    assert '"bytes_read": 524288' in out  # the head and the zip directory, no tensor data


@pytest.mark.parametrize("reader", READERS)
@pytest.mark.parametrize(("mode", "says"), [
    ("huge", "sent more than the 262144 bytes of the range it named"),
    ("other", "sent bytes 1-262144 where 0-262143 were asked"),
    ("whole", "ignored the byte range"),
    ("more", "sent bytes 0-262143 without saying how many"),
])
def test_an_answer_other_than_asked_is_refused_unread(reader: str, mode: str, says: str, liar: LyingServer,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    url, options = where(reader, liar, mode, monkeypatch)
    sent = liar.bytes_sent
    code, _, err = cli("inspect", url, *options)
    line = one_line(err)
    assert code == 3 and says in line and "reads no more than it asks for" in line
    assert "local path" in line  # the next step
    # a 3 GiB body for a 256 KiB range: what the client took is what the sockets' buffers held, no more
    assert liar.bytes_sent - sent < 64 * MiB


@pytest.mark.parametrize("reader", READERS)
def test_a_trickling_store_times_out_in_one_line(reader: str, liar: LyingServer,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CKPTOOL_REMOTE_TIMEOUT", "1.5")  # a byte every 0.5 s would take 36 hours
    url, options = where(reader, liar, "trickle", monkeypatch)
    code, _, err = cli("inspect", url, *options)
    line = one_line(err)
    assert code == 3 and "timed out" in line and "within 1.5 s" in line and "CKPTOOL_REMOTE_TIMEOUT" in line
    assert "retry" in line


@pytest.mark.parametrize("reader", ["http", "stores"])
def test_headers_a_byte_at_a_time_time_out_too(reader: str, liar: LyingServer,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CKPTOOL_REMOTE_TIMEOUT", "1.5")
    url, options = where(reader, liar, "trickle-headers", monkeypatch)
    code, _, err = cli("inspect", url, *options)
    assert code == 3 and "timed out" in one_line(err)


def test_the_time_limit_is_the_documented_default_unless_set(monkeypatch: pytest.MonkeyPatch) -> None:
    from ckptool.files import bounded

    monkeypatch.delenv(bounded.TIMEOUT_ENV, raising=False)
    assert bounded.request_timeout_s() == bounded.DEFAULT_TIMEOUT_S
    for value, seconds in (("2.5", 2.5), ("0", bounded.DEFAULT_TIMEOUT_S), ("soon", bounded.DEFAULT_TIMEOUT_S)):
        monkeypatch.setenv(bounded.TIMEOUT_ENV, value)
        assert bounded.request_timeout_s() == seconds


@pytest.mark.parametrize(("status", "content_range", "length", "start", "end", "expected"), [
    (206, "bytes 0-9/100", 10, 0, 10, (10, False)),
    (206, "bytes 0-9/*", None, 0, 10, (10, True)),  # no length: a byte past the range is refused
    (206, "bytes 90-99/100", 10, 90, 120, (10, False)),  # the object's end comes first
    (200, None, 100, 0, 10, (10, False)),  # the whole object for a range from 0: read to the range's end
    (206, "bytes 0-19/100", 20, 0, 10, "sent bytes 0-19 where 0-9"),
    (206, "bytes 1-10/100", 10, 0, 10, "sent bytes 1-10 where 0-9"),
    (206, "bytes 0-9/100", 1 << 40, 0, 10, "a body of 1099511627776 bytes"),
    (206, None, 10, 0, 10, "without naming it"),
    (200, None, 100, 5, 10, "ignored the byte range"),
    (204, None, 0, 0, 10, "answered 204"),
])
def test_judge(status: int, content_range: str | None, length: int | None, start: int, end: int,
               expected: Any) -> None:
    from ckptool.files.bounded import RangeRefused, judge

    if isinstance(expected, tuple):
        assert judge(status, content_range, length, start, end) == expected
    else:
        with pytest.raises(RangeRefused, match=expected):
            judge(status, content_range, length, start, end)


# ------------------------------------------------------------------------------------------------ failures


def _run(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """The command as a user runs it: its real stderr, where a library's logger or warning would land."""
    environment = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    environment.update(env, PYTHONPATH=str(REPO), AWS_CONFIG_FILE=os.devnull, AWS_SHARED_CREDENTIALS_FILE=os.devnull)
    return subprocess.run([sys.executable, "-m", "ckptool", *args], capture_output=True, text=True, env=environment,
                          timeout=300)


@pytest.mark.parametrize(("reader", "mode", "says"), [
    ("gcsfs", "fail403", "access denied (403)"),
    ("gcsfs", "fail500", "the store failed (500)"),
    ("http", "fail403", "access denied (403)"),
    ("http", "fail500", "the store failed (500)"),
    ("stores", "fail500", "the store failed (500)"),
])
def test_a_failing_store_is_one_line_without_its_text(reader: str, mode: str, says: str,
                                                      liar: LyingServer) -> None:
    env = {"CKPTOOL_REMOTE_TIMEOUT": "4"}
    if reader == "gcsfs":
        url, options = f"gs://{mode}/in.pt", ["--storage-option", f"endpoint_url={liar.base_url}",
                                              "--storage-option", "token=anon"]
    elif reader == "http":
        url, options = liar.url(mode, "in.pt", userinfo="reader:s3cret-password@"), []
    else:
        url, options = f"s3://{mode}/in.pt", []
        env.update(AWS_ACCESS_KEY_ID="k", AWS_SECRET_ACCESS_KEY="s3cret-password", AWS_ENDPOINT_URL=liar.base_url)
    done = _run(["inspect", url, *options], env)
    assert done.returncode == 3, done.stderr
    line = one_line(done.stderr)  # no traceback, no library's log line, no warning
    assert says in line
    assert "RAW-STORE-TEXT" not in done.stderr and "X-Amz-Signature" not in done.stderr
    assert "s3cret" not in done.stderr


@pytest.mark.parametrize("url", ["gs://reader:s3cret-password@bucket/in.pt", "s3://reader:s3cret-password@b/in.pt"])
def test_a_bucket_url_with_a_password_is_refused_before_any_request(url: str) -> None:
    done = _run(["inspect", url], {})
    assert done.returncode == 3
    line = one_line(done.stderr)
    assert "carry no user or password" in line and "s3cret" not in line and "reader" not in line


# ------------------------------------------------------------------------------------------------ schemes


UNSUPPORTED = ["ftp://127.0.0.1:1/in.pt", "ftp://user:s3cret-password@host/in.pt", "sftp://host/in.pt",
               "hdfs://namenode/in.pt", "reference://in.pt", "zip://in.pt::file:///tmp/x.zip",
               "zip://in.pt::s3://user:s3cret-password@b/x.zip", "webhdfs://h/in.pt"]


@pytest.mark.parametrize("url", UNSUPPORTED)
@pytest.mark.parametrize("command", ["inspect", "scan", "verify", "convert"])
def test_a_url_ckptool_does_not_read_is_one_line_naming_what_it_reads(url: str, command: str,
                                                                      tmp_path: Path) -> None:
    args = {"inspect": ["inspect", url], "scan": ["scan", url], "verify": ["verify", url],
            "convert": ["convert", url, "-o", tmp_path / "out.safetensors"]}[command]
    code, _, err = cli(*args)
    line = one_line(err)
    assert code == 3, err
    assert "not supported" in line and "s3://" in line and "gs://" in line and "https://" in line
    assert "s3cret" not in line
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("url", ["ftp://host/out.safetensors", "sftp://user:s3cret-password@host/out.pt",
                                 "zip://out.pt::file:///tmp/x.zip", "reference://out.pt"])
def test_an_output_url_ckptool_does_not_write_is_one_line(url: str) -> None:
    code, _, err = cli("convert", WRAPPED, "-o", url)
    line = one_line(err)
    assert code == 3 and "not supported" in line and "writes to s3://" in line and "s3cret" not in line


# ------------------------------------------------------------------------------------------------ identities


@pytest.mark.parametrize(("a", "b"), [
    ("s3://b/k", "s3a://b/k"), ("s3://b/k", "s3n://b/k"), ("s3://b/k", "S3://B/k/"), ("s3://b/k", "s3:///b/k"),
    ("s3://b/run/k", "s3://b/run/./x/../k"), ("s3://b/k.pt", "s3://b/k%2Ept"), ("gs://b/k", "gcs://b/k"),
    ("https://h.example/a", "https://user:pw@H.EXAMPLE:443/a/"), ("http://h/a", "http://h:80/./a"),
    ("memory://t/x", "memory:///t/x"),
])
def test_spellings_of_one_object_have_one_identity(a: str, b: str) -> None:
    assert identity(a) == identity(b)


@pytest.mark.parametrize(("a", "b"), [
    ("s3://b/k", "s3://b/k2"), ("s3://b/k", "gs://b/k"), ("http://h/a", "https://h/a"),
    ("http://h:8080/a", "http://h/a"), ("s3://b/a//k", "s3://b/a/k"), ("s3://b1/k", "s3://b2/k"),
])
def test_different_objects_have_different_identities(a: str, b: str) -> None:
    assert identity(a) != identity(b)


def test_local_spellings_are_one_real_path(tmp_path: Path) -> None:
    target = tmp_path / "in.pt"
    target.write_bytes(b"x")
    (tmp_path / "link.pt").symlink_to(target)
    spellings = [str(target), f"file://{target}", f"file://localhost{target}", f"local://{target}",
                 f"file://{tmp_path}/sub/../in%2Ept", str(tmp_path / "link.pt")]
    assert len({identity(spelling) for spelling in spellings}) == 1


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _spellings(path: Path) -> list[str]:
    return [f"local://{path}", f"file://localhost{path}", f"file://{path.parent}/{path.name[:-3]}%2E{path.name[-2:]}",
            f"local://{path.parent}/./{path.name}"]


@pytest.mark.parametrize("spelling", range(4))
@pytest.mark.parametrize("command", ["strip", "add-prefix", "remap", "convert", "convert-pt"])
def test_no_spelling_of_a_local_input_is_written(command: str, spelling: int, tmp_path: Path) -> None:
    source = tmp_path / "in.pt"
    source.write_bytes((GPU if command == "remap" else WRAPPED).read_bytes())
    before = _digest(source)
    out = _spellings(source)[spelling]
    args = {"strip": ["strip", source, "-o", out], "add-prefix": ["add-prefix", source, "-o", out],
            "remap": ["remap", source, "-o", out, "--to", "cpu"], "convert": ["convert", source, "-o", out],
            "convert-pt": ["convert", source, "-o", out, "--to", "pt"]}[command]
    code, _, err = cli(*args, "--force")
    assert code == 3 and "is the input file" in one_line(err)
    assert _digest(source) == before and sorted(p.name for p in tmp_path.iterdir()) == ["in.pt"]


def test_no_spelling_of_a_local_input_folder_is_a_conversion_s_out_dir(tmp_path: Path) -> None:
    import ckptool

    folder = tmp_path / "models"
    folder.mkdir()
    source = folder / "model.safetensors"
    ckptool.save(ckptool.load(WRAPPED).strip_prefix(), source)
    before = _digest(source)
    code, _, err = cli("convert", source, "--out-dir", f"local://{folder}/.", "--force")
    assert code == 3 and "is the input file" in one_line(err)
    assert _digest(source) == before


@pytest.fixture
def memory_folder() -> Iterator[str]:
    import fsspec

    name = f"alias-{uuid.uuid4().hex[:8]}"
    yield name
    fs = fsspec.filesystem("memory")
    if fs.exists(f"/{name}"):
        fs.rm(f"/{name}", recursive=True)


def test_no_spelling_of_a_memory_input_is_written(memory_folder: str) -> None:
    import fsspec

    fs = fsspec.filesystem("memory")
    fs.pipe(f"/{memory_folder}/in.pt", WRAPPED.read_bytes())
    for out in (f"memory:///{memory_folder}/in.pt", f"memory://{memory_folder}/x/../in.pt/"):
        code, _, err = cli("strip", f"memory://{memory_folder}/in.pt", "-o", out, "--force")
        assert code == 3 and "is the input file" in one_line(err)
    assert fs.cat_file(f"/{memory_folder}/in.pt") == WRAPPED.read_bytes()


# ------------------------------------------------------------------------------------------------ on S3


@pytest.mark.parametrize("command", ["strip", "add-prefix", "remap", "convert"])
def test_no_spelling_of_an_s3_input_is_written(command: str, seaweedfs: Any, bucket: str,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in seaweedfs.env.items():
        monkeypatch.setenv(name, value)
    name = bucket[5:]
    source_bytes = (GPU if command == "remap" else WRAPPED).read_bytes()
    seaweedfs.admin.put_object(Bucket=name, Key="run/in.pt", Body=source_bytes)
    for out in (f"s3a://{name}/run/in.pt", f"s3n://{name}/run/./in.pt", f"s3://{name}/run/x/../in.pt",
                f"S3A://{name}/run/in.pt/"):
        args = {"strip": ["strip"], "add-prefix": ["add-prefix"], "remap": ["remap", "--to", "cpu"],
                "convert": ["convert", "--to", "pt"]}[command]
        code, _, err = cli(*args[:1], f"s3://{name}/run/in.pt", "-o", out, "--force", *args[1:])
        line = one_line(err)
        assert code == 3 and "is the input file" in line, (out, err)
        assert "--in-place" not in line  # a URL is never rewritten in place: not offered
    assert seaweedfs.list_objects(name) == {"run/in.pt": len(source_bytes)}
    assert seaweedfs.admin.get_object(Bucket=name, Key="run/in.pt")["Body"].read() == source_bytes


def test_no_spelling_of_an_s3_input_folder_is_a_conversion_s_out_dir(seaweedfs: Any, bucket: str,
                                                                     monkeypatch: pytest.MonkeyPatch,
                                                                     tmp_path: Path) -> None:
    import ckptool

    for key, value in seaweedfs.env.items():
        monkeypatch.setenv(key, value)
    name = bucket[5:]
    local = tmp_path / "model.safetensors"
    ckptool.save(ckptool.load(WRAPPED).strip_prefix(), local)
    seaweedfs.admin.put_object(Bucket=name, Key="models/model.safetensors", Body=local.read_bytes())
    code, _, err = cli("convert", f"s3://{name}/models/model.safetensors", "--out-dir", f"s3a://{name}/models/",
                       "--force")
    assert code == 3 and "is the input file" in one_line(err)
    assert seaweedfs.admin.get_object(Bucket=name, Key="models/model.safetensors")["Body"].read() == \
        local.read_bytes()
