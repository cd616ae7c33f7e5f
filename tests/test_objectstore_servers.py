"""The object-storage servers the remote tests run against (tests/objectstore.py) do what those tests rely on.

SeaweedFS through s3fs: put, get, ranges, multipart uploads, identities and 403, unfinished uploads listed
until aborted (and kept by a server that dies), the standard AWS variables for a subprocess. The fault proxy:
503 SlowDown retried then served, throttling that never ends, 403, connections dropped mid-body, requests
counted by S3 operation. The http server through fsspec: HEAD, ranges with the bytes they cost, 404, 416,
listings, basic auth.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:  # imported in the tests, once pytest_plugins has loaded the module as a plugin
    from objectstore import FaultProxy, RangeHTTPServer, SeaweedFS

pytest_plugins = ["objectstore"]  # its fixtures: seaweedfs, bucket, s3_faults, http_server

pytest.importorskip("s3fs", reason="the object-storage tests need s3fs (pip install 'ckptool[remote]')")
# s3fs brings botocore
from botocore.exceptions import ConnectionClosedError, EndpointConnectionError, ReadTimeoutError  # noqa: E402

MiB = 1 << 20
# A connection cut while the client still sends (a broken pipe) or once it waits for the answer (closed)
CONNECTION_LOST = (EndpointConnectionError, ConnectionClosedError)


def _payload(size: int, seed: int = 0) -> bytes:
    """Bytes that differ at every offset (a misplaced range cannot compare equal)."""
    block = bytes((seed + i * 7) % 251 for i in range(251))
    return (block * (size // len(block) + 1))[:size]


def _quick(server: SeaweedFS | FaultProxy, s3_attempts: int = 1, attempts: int = 1):
    """An s3fs filesystem that gives up fast: ``attempts`` s3fs tries of ``s3_attempts`` botocore tries each."""
    return server.filesystem(retries=attempts, config_kwargs={
        "retries": {"total_max_attempts": s3_attempts, "mode": "standard"}, "connect_timeout": 5, "read_timeout": 30})


def _abandon(writer) -> None:
    """Abort an s3fs upload in progress (s3fs's discard) and mark the file closed, so that its finaliser does not
    try to finish what was thrown away."""
    writer.discard()
    writer.closed = True


# --------------------------------------------------------------------------------------------------------------
# SeaweedFS


def test_put_get_and_ranges_through_s3fs(seaweedfs: SeaweedFS, bucket: str) -> None:
    fs = seaweedfs.filesystem()
    data = _payload(100_000)
    fs.pipe(f"{bucket}/dir/obj.bin", data)
    assert fs.cat_file(f"{bucket}/dir/obj.bin") == data
    assert fs.cat_file(f"{bucket}/dir/obj.bin", start=1000, end=1010) == data[1000:1010]
    assert fs.size(f"{bucket}/dir/obj.bin") == len(data)
    assert fs.ls(bucket, detail=False) == [f"{bucket.removeprefix('s3://')}/dir"]
    assert seaweedfs.list_objects(bucket) == {"dir/obj.bin": len(data)}
    with pytest.raises(FileNotFoundError):
        fs.cat_file(f"{bucket}/missing")


def test_each_test_gets_an_empty_bucket_of_its_own(seaweedfs: SeaweedFS, bucket: str) -> None:
    assert bucket.startswith("s3://test-each-test-gets-an-empty-bucket")
    assert seaweedfs.list_objects(bucket) == {}
    assert seaweedfs.list_multipart_uploads(bucket) == []


def test_wrong_credentials_get_403_and_the_read_only_identity_cannot_write(seaweedfs: SeaweedFS,
                                                                           bucket: str) -> None:
    seaweedfs.filesystem().pipe(f"{bucket}/obj", b"payload")
    for key, secret in [(seaweedfs.credentials[0], "not-the-secret"), ("NOSUCHKEY", "nothing")]:
        stranger = seaweedfs.endpoint.with_credentials(key, secret).filesystem(retries=1)
        with pytest.raises(PermissionError):
            stranger.cat_file(f"{bucket}/obj")
    reader = seaweedfs.read_only.filesystem(retries=1)
    assert reader.cat_file(f"{bucket}/obj") == b"payload"
    with pytest.raises(PermissionError):
        reader.pipe(f"{bucket}/other", b"nope")
    assert seaweedfs.list_objects(bucket) == {"obj": 7}


def test_multipart_upload_of_12_mib_in_5_mib_parts(seaweedfs: SeaweedFS, bucket: str) -> None:
    fs = seaweedfs.filesystem(fixed_upload_size=True)  # parts of block_size, not one part of all that is buffered
    data = _payload(12 * MiB, seed=3)
    with fs.open(f"{bucket}/big.bin", "wb", block_size=5 * MiB) as out:
        for offset in range(0, len(data), MiB):
            out.write(data[offset:offset + MiB])
    assert fs.cat_file(f"{bucket}/big.bin") == data
    etag = seaweedfs.admin.head_object(Bucket=bucket.removeprefix("s3://"), Key="big.bin")["ETag"]
    assert etag.strip('"').endswith("-3")  # a multipart ETag names its part count: 5 + 5 + 2 MiB
    assert seaweedfs.list_multipart_uploads(bucket) == []


def test_an_unfinished_upload_is_listed_until_aborted(seaweedfs: SeaweedFS, bucket: str) -> None:
    fs = seaweedfs.filesystem(fixed_upload_size=True)
    writer = fs.open(f"{bucket}/partial.bin", "wb", block_size=5 * MiB)
    writer.write(_payload(6 * MiB))  # past one block: the upload begins and its first part goes up
    uploads = seaweedfs.list_multipart_uploads(bucket)
    assert [upload["Key"] for upload in uploads] == ["partial.bin"]
    assert uploads[0]["UploadId"] == writer.mpu["UploadId"]
    _abandon(writer)  # s3fs aborts the multipart upload
    assert seaweedfs.list_multipart_uploads(bucket) == []
    assert seaweedfs.list_objects(bucket) == {}


def test_the_aws_variables_lead_a_subprocess_to_the_server(seaweedfs: SeaweedFS, bucket: str,
                                                           tmp_path: Path) -> None:
    seaweedfs.filesystem().pipe(f"{bucket}/obj", b"read in a subprocess")
    script = "import s3fs, sys; sys.stdout.write(s3fs.S3FileSystem().cat_file(sys.argv[1]).decode())"
    environment = seaweedfs.subprocess_env({**os.environ, "AWS_PROFILE": "no-such-profile"})
    assert "AWS_PROFILE" not in environment and environment["AWS_ENDPOINT_URL"] == seaweedfs.endpoint_url
    done = subprocess.run([sys.executable, "-c", script, f"{bucket}/obj"], env=environment, cwd=tmp_path,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout == "read in a subprocess"


def test_free_port_pairs_leave_room_for_the_grpc_ports() -> None:
    from objectstore import free_port_pairs, port_is_free

    ports = free_port_pairs(4)
    assert len(set(ports) | {port + 10000 for port in ports}) == 8
    assert all(port_is_free(port) and port_is_free(port + 10000) and port + 10000 < 65536 for port in ports)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads the listening sockets from /proc")
def test_the_server_listens_only_on_the_ports_it_chose(seaweedfs: SeaweedFS) -> None:
    """Another SeaweedFS on the machine holds weed's default ports: every port this one opens is chosen."""
    from objectstore import GRPC_OFFSET, listening_ports

    seaweedfs.ensure_running()
    assert seaweedfs.process is not None
    chosen = set(seaweedfs.ports.values()) | {port + GRPC_OFFSET for port in seaweedfs.ports.values()}
    opened = listening_ports(seaweedfs.process.pid)
    assert seaweedfs.ports["s3"] in opened and opened <= chosen, sorted(opened - chosen)


def test_held_ports_make_a_server_on_them_fail_to_bind() -> None:
    import socket

    from objectstore import free_port_pairs, held_ports

    port = free_port_pairs(1)[0]
    with held_ports([port]) as held:
        assert held == [port]
        with socket.socket() as other, pytest.raises(OSError):
            other.bind(("127.0.0.1", port))


# --------------------------------------------------------------------------------------------------------------
# fault proxy


def test_a_server_killed_mid_upload_keeps_the_unfinished_upload_and_comes_back_with_its_objects(
        seaweedfs: SeaweedFS, s3_faults: FaultProxy, bucket: str) -> None:
    seaweedfs.filesystem().pipe(f"{bucket}/kept.bin", b"stored before the crash")
    process = seaweedfs.process
    assert process is not None
    s3_faults.before(lambda _: seaweedfs.kill(), op="UploadPart", skip=1)  # it dies as the second part arrives
    fs = s3_faults.filesystem(fixed_upload_size=True, retries=1,
                              config_kwargs={"retries": {"total_max_attempts": 1, "mode": "standard"}})
    writer = fs.open(f"{bucket}/interrupted.bin", "wb", block_size=5 * MiB)
    with pytest.raises(CONNECTION_LOST):
        writer.write(_payload(11 * MiB))
    assert [(r.operation, r.action) for r in s3_faults.requests][:3] == [
        ("CreateMultipartUpload", "forward"), ("UploadPart", "forward"),
        ("UploadPart", "call, drop (upstream unreachable)")]
    assert process.poll() is not None and not seaweedfs.running
    with pytest.raises(ProcessLookupError):
        os.killpg(process.pid, 0)  # nothing of its process group is left
    with pytest.raises(EndpointConnectionError):
        _quick(seaweedfs).cat_file(f"{bucket}/kept.bin")
    seaweedfs.restart()
    assert seaweedfs.filesystem().cat_file(f"{bucket}/kept.bin") == b"stored before the crash"
    # No client could abort while it was down: the upload is still there, and no object was made of it.
    assert [upload["Key"] for upload in seaweedfs.list_multipart_uploads(bucket)] == ["interrupted.bin"]
    assert seaweedfs.list_objects(bucket) == {"kept.bin": 23}
    _abandon(writer)  # an abort once it is back clears it
    assert seaweedfs.list_multipart_uploads(bucket) == []


def test_a_delayed_answer_runs_into_the_client_read_timeout(s3_faults: FaultProxy, bucket: str) -> None:
    s3_faults.filesystem().pipe(f"{bucket}/obj", b"late")
    s3_faults.delay(3.0, op="GetObject", times=1)
    impatient = s3_faults.filesystem(retries=1, config_kwargs={
        "retries": {"total_max_attempts": 1, "mode": "standard"}, "read_timeout": 0.5})
    with pytest.raises(ReadTimeoutError):
        impatient.cat_file(f"{bucket}/obj")
    assert s3_faults.filesystem().cat_file(f"{bucket}/obj") == b"late"  # the rule acted once
    assert [r.action for r in s3_faults.seen(op="GetObject")] == ["delay", "forward"]


def test_the_proxy_forwards_and_counts_a_multipart_upload(s3_faults: FaultProxy, seaweedfs: SeaweedFS,
                                                          bucket: str) -> None:
    fs = s3_faults.filesystem(fixed_upload_size=True)
    data = _payload(11 * MiB, seed=5)
    with fs.open(f"{bucket}/through-proxy.bin", "wb", block_size=5 * MiB) as out:
        out.write(data)
    assert [(r.operation, r.status) for r in s3_faults.requests] == [
        ("CreateMultipartUpload", 200), ("UploadPart", 200), ("UploadPart", 200), ("UploadPart", 200),
        ("CompleteMultipartUpload", 200)]
    s3_faults.reset_counts()
    assert fs.cat_file(f"{bucket}/through-proxy.bin", start=MiB, end=2 * MiB) == data[MiB:2 * MiB]
    assert s3_faults.count(op="GetObject") == 1
    assert sum(r.body_bytes_sent for r in s3_faults.seen(op="GetObject")) == MiB
    assert seaweedfs.filesystem().cat_file(f"{bucket}/through-proxy.bin") == data


def test_slow_down_is_retried_then_served(s3_faults: FaultProxy, bucket: str) -> None:
    s3_faults.filesystem().pipe(f"{bucket}/obj", b"eventually")
    s3_faults.reset_counts()
    s3_faults.slow_down(times=2, op="GetObject")
    fs = _quick(s3_faults, attempts=3)
    assert fs.cat_file(f"{bucket}/obj") == b"eventually"
    assert [r.action for r in s3_faults.seen(op="GetObject")] == ["error 503", "error 503", "forward"]


def test_throttling_without_end_gives_up_after_the_retries(s3_faults: FaultProxy, bucket: str) -> None:
    s3_faults.filesystem().pipe(f"{bucket}/obj", b"never served")
    s3_faults.reset_counts()
    s3_faults.slow_down(times=None, method="GET")
    with pytest.raises(OSError, match="SlowDown|reduce your request rate"):
        _quick(s3_faults, attempts=3).cat_file(f"{bucket}/obj")
    assert s3_faults.count(op="GetObject", action="error 503") == 3


def test_access_denied_is_not_retried(s3_faults: FaultProxy, bucket: str) -> None:
    s3_faults.deny(op="PutObject")
    with pytest.raises(PermissionError):
        _quick(s3_faults, s3_attempts=3, attempts=3).pipe(f"{bucket}/obj", b"refused")
    assert s3_faults.count(op="PutObject") == 1
    assert s3_faults.seen(op="PutObject")[0].status == 403


def test_a_connection_dropped_mid_upload_leaves_no_object(s3_faults: FaultProxy, seaweedfs: SeaweedFS,
                                                          bucket: str) -> None:
    s3_faults.drop(op="PutObject", after_bytes=10_000, times=None)
    with pytest.raises(CONNECTION_LOST):
        _quick(s3_faults).pipe(f"{bucket}/obj", _payload(100_000))
    # one try, or two where aiohttp re-sent the PUT once because the dropped connection was a reused keep-alive one
    assert {r.action for r in s3_faults.seen(op="PutObject")} == {"drop"}
    assert seaweedfs.list_objects(bucket) == {}
    s3_faults.clear()
    s3_faults.drop(op="PutObject", after_bytes=10_000, times=1)  # once: the retry goes through
    _quick(s3_faults, attempts=2).pipe(f"{bucket}/obj", _payload(100_000))
    assert seaweedfs.list_objects(bucket) == {"obj": 100_000}


def test_a_download_dropped_mid_body_is_cut_where_told(s3_faults: FaultProxy, bucket: str) -> None:
    data = _payload(3 * MiB)
    s3_faults.filesystem().pipe(f"{bucket}/obj", data)
    s3_faults.reset_counts()
    s3_faults.drop(op="GetObject", after_bytes=4096, times=1)
    assert s3_faults.filesystem().cat_file(f"{bucket}/obj") == data  # s3fs reads again after the cut
    gets = s3_faults.seen(op="GetObject")
    assert [(r.action, r.body_bytes_sent) for r in gets] == [("drop", 4096), ("forward", len(data))]


def test_a_fault_can_spare_the_first_requests_and_pick_by_operation(s3_faults: FaultProxy, seaweedfs: SeaweedFS,
                                                                    bucket: str) -> None:
    s3_faults.fail(500, "InternalError", op="UploadPart", skip=1, times=None)
    fs = s3_faults.filesystem(fixed_upload_size=True, retries=1,
                              config_kwargs={"retries": {"total_max_attempts": 1, "mode": "standard"}})
    writer = fs.open(f"{bucket}/obj", "wb", block_size=5 * MiB)
    with pytest.raises(OSError):
        writer.write(_payload(11 * MiB))  # part 1 goes through, part 2 fails
        writer.close()
    assert [(r.operation, r.action) for r in s3_faults.requests] == [
        ("CreateMultipartUpload", "forward"), ("UploadPart", "forward"), ("UploadPart", "error 500")]
    assert len(seaweedfs.list_multipart_uploads(bucket)) == 1
    _abandon(writer)
    assert seaweedfs.list_multipart_uploads(bucket) == []


# --------------------------------------------------------------------------------------------------------------
# http server with Range


@pytest.fixture
def http_fs():
    fsspec = pytest.importorskip("fsspec")
    pytest.importorskip("aiohttp", reason="fsspec's http filesystem needs aiohttp")
    return lambda **options: fsspec.filesystem("http", skip_instance_cache=True, **options)


def test_http_head_and_ranges_cost_only_what_they_read(http_server: RangeHTTPServer, http_fs) -> None:
    data = _payload(3 * MiB, seed=9)
    (http_server.root / "sub").mkdir()
    (http_server.root / "sub" / "model file.bin").write_bytes(data)
    url = http_server.url("sub/model file.bin")
    fs = http_fs()
    assert fs.size(url) == len(data)
    assert [(r.method, r.status) for r in http_server.requests] == [("HEAD", 200)]
    assert http_server.bytes_sent == 0
    http_server.reset_counts()
    assert fs.cat_file(url, start=1000, end=1100) == data[1000:1100]
    assert [(r.method, r.status, r.headers["range"]) for r in http_server.requests] == [
        ("GET", 206, "bytes=1000-1099")]
    assert http_server.bytes_sent == 100
    http_server.reset_counts()
    with fs.open(url, "rb", block_size=64 * 1024) as remote:
        remote.seek(2 * MiB)
        assert remote.read(10) == data[2 * MiB:2 * MiB + 10]
    assert http_server.bytes_sent <= 64 * 1024 + 10  # one block, not the file
    assert fs.cat_file(url) == data


def test_http_missing_file_listing_and_unsatisfiable_range(http_server: RangeHTTPServer, http_fs) -> None:
    (http_server.root / "a.bin").write_bytes(b"abc")
    (http_server.root / "shards").mkdir()
    (http_server.root / "shards" / "s1.bin").write_bytes(b"1")
    fs = http_fs()
    with pytest.raises(FileNotFoundError):
        fs.cat_file(http_server.url("missing.bin"))
    assert sorted(fs.ls(http_server.url(), detail=False)) == [http_server.url("a.bin"), http_server.url("shards") + "/"]
    assert fs.ls(http_server.url("shards"), detail=False) == [http_server.url("shards/s1.bin")]
    import urllib.error
    import urllib.request

    request = urllib.request.Request(http_server.url("a.bin"), headers={"Range": "bytes=5-9"})
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request, timeout=10)
    refused.value.close()
    assert refused.value.code == 416 and refused.value.headers["Content-Range"] == "bytes */3"


def test_http_basic_auth_401_without_and_403_with_wrong_credentials(http_server: RangeHTTPServer,
                                                                    http_fs) -> None:
    (http_server.root / "private.bin").write_bytes(b"secret bytes")
    http_server.auth = ("reader", "open-sesame")
    url = http_server.url("private.bin")
    for options in ({}, {"headers": {"Authorization": "Basic d3Jvbmc6d3Jvbmc="}}):
        with pytest.raises(Exception):
            http_fs(**options).cat_file(url)
    assert [r.status for r in http_server.requests] == [401, 403]
    assert http_fs(**http_server.storage_options).cat_file(url) == b"secret bytes"


def test_http_server_that_ignores_ranges(tmp_path: Path, http_fs) -> None:
    from objectstore import RangeHTTPServer

    (tmp_path / "f.bin").write_bytes(b"0123456789")
    with RangeHTTPServer(tmp_path, ranges=False) as server:
        import urllib.request

        request = urllib.request.Request(server.url("f.bin"), headers={"Range": "bytes=2-4"})
        with urllib.request.urlopen(request, timeout=10) as answer:
            assert answer.status == 200 and answer.headers["Accept-Ranges"] == "none"
            assert answer.read() == b"0123456789"
        assert server.bytes_sent == 10


@pytest.mark.parametrize(("header", "expected"), [
    (None, None), ("bytes=0-0", (0, 0)), ("bytes=2-5", (2, 5)), ("bytes=7-", (7, 9)), ("bytes=-3", (7, 9)),
    ("bytes=-30", (0, 9)), ("bytes=5-100", (5, 9)), ("bytes=10-12", "unsatisfiable"), ("bytes=-0", "unsatisfiable"),
    ("bytes=0-1,4-5", None), ("items=0-1", None), ("bytes=5-2", None),
])
def test_parse_range(header: str | None, expected: object) -> None:
    from objectstore import parse_range

    assert parse_range(header, 10) == expected
