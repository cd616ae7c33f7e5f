"""Reading ``s3://`` objects with the standard library alone: HEAD, ranged GET and a one-key listing, signed
with AWS Signature Version 4, over one kept-alive connection per host.

s3fs (aiobotocore, aiohttp, botocore and its JSON service models) costs most of a second to import and set
up, while ``inspect`` of a ``.pt`` needs three small requests. :func:`reader_for` gives a reader when it can
reproduce what botocore would do for the URL — credentials from the storage options (``key``, ``secret``,
``token``), the ``AWS_*`` variables or the shared credentials file, or ``anon=True``; an endpoint from the
options or ``AWS_ENDPOINT_URL[_S3]``, else AWS — and None otherwise (an instance role, SSO, assume-role, a
proxy, a storage option it does not know...), in which case the caller uses s3fs unchanged.

Requests are retried as botocore's standard mode does (5 attempts, exponential backoff with jitter, on 500,
502, 503, 504, 429, throttling codes and dropped connections). Failures are :class:`S3Error` with a
botocore-like ``response`` (status and code, never a credential) or the socket's own error.

A store is no more trusted than a file: an answer is judged before its body and read no further than
asked (:func:`ckptool.files.bounded.judge`: a range's body up to the range, an error's up to
:data:`~ckptool.files.bounded.ERROR_BODY_LIMIT`, a listing's up to :data:`LISTING_LIMIT`), and each request,
headers to last byte, ends within :func:`ckptool.files.bounded.request_timeout_s` (a watchdog shuts its socket;
:class:`~ckptool.files.bounded.RequestTimedOut`, not retried: a store that trickles would trickle again).
"""

from __future__ import annotations

import datetime
import hashlib
import hmac
import http.client
import json
import os
import random
import re
import socket
import threading
import time
import urllib.parse
from collections.abc import Mapping
from typing import Any, Literal

from ckptool.files.bounded import ERROR_BODY_LIMIT, RangeRefused, RequestTimedOut, judge, request_timeout_s

CONNECT_TIMEOUT_S = 10.0
READ_TIMEOUT_S = 60.0
MAX_ATTEMPTS = 5
BACKOFF_BASE_S = 1.0  # the n-th retry waits random() * min(MAX_BACKOFF_S, BACKOFF_BASE_S * 2**(n-1))
MAX_BACKOFF_S = 20.0
LISTING_LIMIT = 1 << 20  # a one-key listing is a few hundred bytes
EMPTY_SHA256 = hashlib.sha256(b"").hexdigest()
RETRY_STATUSES = frozenset({429, 500, 502, 503, 504})
RETRY_CODES = frozenset(
    {
        "SlowDown",
        "Throttling",
        "ThrottlingException",
        "ThrottledException",
        "RequestThrottledException",
        "TooManyRequestsException",
        "RequestLimitExceeded",
        "BandwidthLimitExceeded",
        "RequestThrottled",
        "RequestTimeout",
        "RequestTimeoutException",
        "PriorRequestNotComplete",
        "InternalError",
    }
)

# options s3fs takes that change nothing about how an object is read
_HARMLESS_OPTIONS = frozenset(
    {
        "skip_instance_cache",
        "use_listings_cache",
        "listings_expiry_time",
        "max_paths",
        "default_block_size",
        "default_fill_cache",
        "default_cache_type",
        "max_concurrency",
        "asynchronous",
        "loop",
    }
)
_KNOWN_CLIENT_KWARGS = frozenset({"endpoint_url", "region_name"})
_KNOWN_CONFIG_KWARGS = frozenset({"retries", "connect_timeout", "read_timeout", "max_pool_connections"})
# variables that make botocore do something this reader does not (a role, a proxy, a CA bundle, FIPS...)
_UNSUPPORTED_ENV = (
    "AWS_ROLE_ARN",
    "AWS_WEB_IDENTITY_TOKEN_FILE",
    "AWS_USE_FIPS_ENDPOINT",
    "AWS_USE_DUALSTACK_ENDPOINT",
    "AWS_S3_USE_ARN_REGION",
    "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI",
    "AWS_CONTAINER_CREDENTIALS_FULL_URI",
    "HTTP_PROXY",
    "HTTPS_PROXY",
    "http_proxy",
    "https_proxy",
    "ALL_PROXY",
    "all_proxy",
    "AWS_IGNORE_CONFIGURED_ENDPOINT_URLS",
)
_ENV_NAMES = (
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "AWS_SECURITY_TOKEN",
    "AWS_PROFILE",
    "AWS_DEFAULT_PROFILE",
    "AWS_SHARED_CREDENTIALS_FILE",
    "AWS_CONFIG_FILE",
    "AWS_ENDPOINT_URL",
    "AWS_ENDPOINT_URL_S3",
    "AWS_REGION",
    "AWS_DEFAULT_REGION",
    "AWS_CA_BUNDLE",
    "HOME",
) + _UNSUPPORTED_ENV

# what happened, for tests and diagnostics: readers made, times s3fs was left to do the work, requests sent
COUNTS = {"readers": 0, "fallbacks": 0, "requests": 0}
_counts_lock = threading.Lock()
_DNS_BUCKET = re.compile(r"^[a-z0-9][a-z0-9-]{1,61}[a-z0-9]$")
_readers: dict[str, Any] = {}
_readers_lock = threading.Lock()


class S3Error(Exception):
    """A request the store refused: ``status`` and ``code`` (and ``response`` shaped as botocore's)."""

    def __init__(self, status: int, code: str = "") -> None:
        super().__init__(f"{status}{' ' + code if code else ''}")
        self.status = status
        self.code = code
        self.response = {"Error": {"Code": code or str(status)}, "ResponseMetadata": {"HTTPStatusCode": status}}


class Credentials:
    __slots__ = ("key", "secret", "token")

    def __init__(self, key: str, secret: str, token: str | None) -> None:
        self.key, self.secret, self.token = key, secret, token or None

    def __repr__(self) -> str:  # never the secret
        return f"Credentials(key={self.key[:4]}...)"


# -- what botocore would use --------------------------------------------------------------------------------


def _profile_section(parser: Any, profile: str, config_file: bool) -> Mapping[str, str] | None:
    name = profile if (not config_file or profile == "default") else f"profile {profile}"
    if parser.has_section(name):
        return parser[name]
    if config_file and profile == "default" and parser.has_section("profile default"):
        return parser["profile default"]
    return None


def _read_ini(path: str) -> Any:
    import configparser

    parser = configparser.RawConfigParser()
    try:
        with open(os.path.expanduser(path), encoding="utf-8") as handle:
            parser.read_file(handle)
    except FileNotFoundError:
        return parser
    except (OSError, configparser.Error, UnicodeDecodeError):
        return None
    return parser


def _config_profile(env: Mapping[str, str]) -> Mapping[str, str] | None | Literal[False]:
    """The profile's section of the config file: a mapping, None when absent, False when unreadable."""
    parser = _read_ini(env.get("AWS_CONFIG_FILE") or "~/.aws/config")
    if parser is None:
        return False
    profile = env.get("AWS_PROFILE") or env.get("AWS_DEFAULT_PROFILE") or "default"
    return _profile_section(parser, profile, True)


def resolve_credentials(options: Mapping[str, Any], env: Mapping[str, str]) -> Credentials | None | Literal[False]:
    """Credentials in botocore's order for what is supported here; ``False`` for anonymous; None when they
    would come from somewhere else (a role, SSO, a process, the instance) or not at all."""
    if options.get("anon"):
        return False
    key, secret = options.get("key"), options.get("secret")
    if key or secret:
        if not (isinstance(key, str) and isinstance(secret, str) and key and secret):
            return None
        token = options.get("token")
        return Credentials(key, secret, token if isinstance(token, str) else None)
    if env.get("AWS_ACCESS_KEY_ID") or env.get("AWS_SECRET_ACCESS_KEY"):
        if not (env.get("AWS_ACCESS_KEY_ID") and env.get("AWS_SECRET_ACCESS_KEY")):
            return None  # botocore refuses partial credentials
        return Credentials(
            env["AWS_ACCESS_KEY_ID"],
            env["AWS_SECRET_ACCESS_KEY"],
            env.get("AWS_SESSION_TOKEN") or env.get("AWS_SECURITY_TOKEN"),
        )
    # botocore tries assume-role, web identity and SSO (all from the config file) before the credentials file
    config = _config_profile(env)
    if config is False:
        return None
    if config is not None and any(
        name in config
        for name in (
            "role_arn",
            "web_identity_token_file",
            "sso_session",
            "sso_start_url",
            "sso_account_id",
            "credential_process",
            "credential_source",
            "source_profile",
        )
    ):
        return None
    parser = _read_ini(env.get("AWS_SHARED_CREDENTIALS_FILE") or "~/.aws/credentials")
    if parser is None:
        return None
    profile = env.get("AWS_PROFILE") or env.get("AWS_DEFAULT_PROFILE") or "default"
    section = _profile_section(parser, profile, False)
    if section is not None and section.get("aws_access_key_id") and section.get("aws_secret_access_key"):
        return Credentials(
            section["aws_access_key_id"].strip(),
            section["aws_secret_access_key"].strip(),
            (section.get("aws_session_token") or section.get("aws_security_token") or "").strip(),
        )
    return None  # the config file's own keys, a process, an instance role...: botocore's business


def _understood(options: Mapping[str, Any]) -> bool:
    for name, value in options.items():
        if name in ("key", "secret", "token", "anon", "endpoint_url") or name in _HARMLESS_OPTIONS:
            continue
        if name == "client_kwargs" and isinstance(value, dict) and set(value) <= _KNOWN_CLIENT_KWARGS:
            continue
        if name == "config_kwargs" and isinstance(value, dict) and set(value) <= _KNOWN_CONFIG_KWARGS:
            continue
        return False
    return True


def reader_for(options: Mapping[str, Any], env: Mapping[str, str] | None = None) -> S3Reader | None:
    """A reader for the storage options and environment, or None where s3fs must do the work."""
    env = os.environ if env is None else env
    snapshot = json.dumps([options, [env.get(name) for name in _ENV_NAMES]], sort_keys=True, default=str)
    with _readers_lock:
        if snapshot in _readers:
            found = _readers[snapshot]
            if found is None:
                COUNTS["fallbacks"] += 1
            return found
    reader = _make_reader(options, env)
    with _readers_lock:
        _readers[snapshot] = reader
        COUNTS["readers" if reader is not None else "fallbacks"] += 1
    return reader


def _make_reader(options: Mapping[str, Any], env: Mapping[str, str]) -> S3Reader | None:
    if not _understood(options) or any(env.get(name) for name in _UNSUPPORTED_ENV):
        return None
    config = _config_profile(env)
    if config is False or (
        config
        and any(
            name in config
            for name in ("endpoint_url", "services", "s3", "ca_bundle", "use_fips_endpoint", "use_dualstack_endpoint")
        )
    ):
        return None  # the profile's own endpoint or S3 settings: botocore's business
    credentials = resolve_credentials(options, env)
    if credentials is None:
        return None
    client = options.get("client_kwargs") or {}
    endpoint = (
        options.get("endpoint_url")
        or client.get("endpoint_url")
        or env.get("AWS_ENDPOINT_URL_S3")
        or env.get("AWS_ENDPOINT_URL")
    )
    region = client.get("region_name") or env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION")
    if not region:
        region = (config.get("region") if config else None) or "us-east-1"
    if endpoint is not None:
        parsed = urllib.parse.urlsplit(str(endpoint))
        if parsed.scheme not in ("http", "https") or not parsed.hostname or parsed.query:
            return None
    config_kwargs = options.get("config_kwargs") or {}
    retries = config_kwargs.get("retries") or {}
    if (
        not isinstance(retries, dict)
        or retries.get("mode", "standard") != "standard"
        or set(retries) - {"mode", "max_attempts", "total_max_attempts"}
    ):
        return None
    attempts = retries.get("total_max_attempts") or (
        retries["max_attempts"] + 1 if retries.get("max_attempts") is not None else MAX_ATTEMPTS
    )
    return S3Reader(
        credentials or None,
        str(endpoint).rstrip("/") if endpoint else None,
        str(region),
        connect_timeout=float(config_kwargs.get("connect_timeout", CONNECT_TIMEOUT_S)),
        read_timeout=float(config_kwargs.get("read_timeout", READ_TIMEOUT_S)),
        ca_bundle=env.get("AWS_CA_BUNDLE") or None,
        attempts=max(1, int(attempts)),
    )


# -- signing ------------------------------------------------------------------------------------------------


def quote(text: str, safe: str = "") -> str:
    """SigV4's URI encoding: every byte but ``A-Za-z0-9-_.~`` (and ``safe``) as %XX."""
    return urllib.parse.quote(text, safe="-_.~" + safe)


def _hmac(key: bytes, message: str) -> bytes:
    return hmac.new(key, message.encode("utf-8"), hashlib.sha256).digest()


def sign(
    method: str,
    host: str,
    path: str,
    query: Mapping[str, str],
    headers: dict[str, str],
    credentials: Credentials,
    region: str,
    now: datetime.datetime | None = None,
) -> dict[str, str]:
    """``headers`` plus ``host``, ``x-amz-date``, ``x-amz-content-sha256``, ``x-amz-security-token`` (with a
    session token) and ``Authorization`` for an empty-bodied request; ``path`` already URI-encoded."""
    now = now or datetime.datetime.now(datetime.timezone.utc)
    amz_date = now.strftime("%Y%m%dT%H%M%SZ")
    day = amz_date[:8]
    signed = {name.lower(): " ".join(str(value).split()) for name, value in headers.items()}
    signed.update({"host": host, "x-amz-date": amz_date, "x-amz-content-sha256": EMPTY_SHA256})
    if credentials.token:
        signed["x-amz-security-token"] = credentials.token
    names = sorted(signed)
    canonical_query = "&".join(f"{quote(k)}={quote(v)}" for k, v in sorted(query.items()))
    canonical = "\n".join(
        [method, path, canonical_query, "".join(f"{n}:{signed[n]}\n" for n in names), ";".join(names), EMPTY_SHA256]
    )
    scope = f"{day}/{region}/s3/aws4_request"
    to_sign = "\n".join(["AWS4-HMAC-SHA256", amz_date, scope, hashlib.sha256(canonical.encode("utf-8")).hexdigest()])
    key = _hmac(_hmac(_hmac(_hmac(("AWS4" + credentials.secret).encode("utf-8"), day), region), "s3"), "aws4_request")
    signature = hmac.new(key, to_sign.encode("utf-8"), hashlib.sha256).hexdigest()
    signed["authorization"] = (
        f"AWS4-HMAC-SHA256 Credential={credentials.key}/{scope}, SignedHeaders={';'.join(names)}, Signature={signature}"
    )
    return signed


# -- connections --------------------------------------------------------------------------------------------


class _Pool:
    """Idle kept-alive connections per (scheme, host, port); a connection serves one request at a time."""

    def __init__(self) -> None:
        self._idle: dict[tuple[str, str, int], list[http.client.HTTPConnection]] = {}
        self._lock = threading.Lock()

    def get(
        self, scheme: str, host: str, port: int, connect_timeout: float, ca_bundle: str | None = None
    ) -> tuple[http.client.HTTPConnection, bool]:
        with self._lock:
            idle = self._idle.get((scheme, host, port))
            if idle:
                return idle.pop(), True
        if scheme == "https":
            import ssl

            context = ssl.create_default_context(cafile=ca_bundle)
            return http.client.HTTPSConnection(host, port, timeout=connect_timeout, context=context), False
        return http.client.HTTPConnection(host, port, timeout=connect_timeout), False

    def put(self, scheme: str, host: str, port: int, connection: http.client.HTTPConnection) -> None:
        with self._lock:
            idle = self._idle.setdefault((scheme, host, port), [])
            if len(idle) < 16:
                idle.append(connection)
                return
        connection.close()

    def clear(self) -> None:
        with self._lock:
            connections = [c for idle in self._idle.values() for c in idle]
            self._idle.clear()
        for connection in connections:
            connection.close()


POOL = _Pool()


def _error_code(body: bytes) -> str:
    if not body:
        return ""
    try:
        import xml.etree.ElementTree as ElementTree

        root = ElementTree.fromstring(body)
    except Exception:
        return ""
    for element in root.iter():
        if element.tag.rsplit("}", 1)[-1] == "Code" and element.text:
            return element.text.strip()
    return ""


# -- the reader ---------------------------------------------------------------------------------------------


class S3Reader:
    """``info``, ``cat_file``, ``cat_ranges`` and ``is_prefix`` on ``bucket/key`` paths, as s3fs names them."""

    def __init__(
        self,
        credentials: Credentials | None,
        endpoint: str | None,
        region: str,
        *,
        connect_timeout: float = CONNECT_TIMEOUT_S,
        read_timeout: float = READ_TIMEOUT_S,
        ca_bundle: str | None = None,
        attempts: int = MAX_ATTEMPTS,
    ) -> None:
        self.attempts = attempts
        self.ca_bundle = ca_bundle
        self.credentials = credentials
        self.endpoint = endpoint
        self.region = region
        self.connect_timeout = connect_timeout
        self.read_timeout = read_timeout
        self._bucket_regions: dict[str, str] = {}

    def __repr__(self) -> str:
        return f"S3Reader(endpoint={self.endpoint or 'aws'}, region={self.region})"

    # where a request goes
    def _target(self, bucket: str, key: str, region: str) -> tuple[str, str, int, str, str]:
        """(scheme, host, port, Host header, encoded path)."""
        encoded = quote(key, "/")
        if self.endpoint is not None:
            parsed = urllib.parse.urlsplit(self.endpoint)
            scheme = parsed.scheme
            base = parsed.path.rstrip("/")
            path = f"{quote(base, '/')}/{quote(bucket)}" + (f"/{encoded}" if key else "/")
            host = parsed.hostname or ""
            port = parsed.port or (443 if scheme == "https" else 80)
        else:
            scheme, port = "https", 443
            if not _DNS_BUCKET.match(bucket):  # botocore's rule: a name that is no DNS label goes in the path
                host = f"s3.{region}.amazonaws.com"
                path = f"/{quote(bucket)}/{encoded}"
            else:
                host = f"{bucket}.s3.{region}.amazonaws.com"
                path = f"/{encoded}"
        header = host if port == (443 if scheme == "https" else 80) else f"{host}:{port}"
        if ":" in host and not host.startswith("["):  # IPv6 literal
            header = f"[{host}]" if port == (443 if scheme == "https" else 80) else f"[{host}]:{port}"
        return scheme, host, port, header, path

    def request(
        self,
        method: str,
        bucket: str,
        key: str,
        *,
        query: Mapping[str, str] | None = None,
        headers: Mapping[str, str] | None = None,
        span: tuple[int, int] | None = None,
    ) -> tuple[int, dict[str, str], bytes]:
        """(status, lower-cased headers, body) of a 2xx answer; S3Error for any other, after retries.

        ``span``: the bytes ``[start, end)`` a ranged GET asks for; its body is read as
        :func:`ckptool.files.bounded.judge` allows (RangeRefused otherwise). RequestTimedOut when one try
        outlasts :func:`ckptool.files.bounded.request_timeout_s`."""
        query = dict(query or {})
        region = self._bucket_regions.get(bucket, self.region)
        redirected = False
        attempt = 0
        while True:
            attempt += 1
            try:
                status, answer, body = self._once(method, bucket, key, query, dict(headers or {}), region, span)
            except (RequestTimedOut, RangeRefused):
                raise
            except (ConnectionError, http.client.HTTPException, TimeoutError, OSError) as e:
                if attempt >= self.attempts or not _retryable_exception(e):
                    if isinstance(e, socket.gaierror):  # as botocore says it: the endpoint cannot be reached
                        raise ConnectionError("cannot resolve the endpoint's host name") from e
                    raise
                self._sleep(attempt)
                continue
            if 200 <= status < 300:
                return status, answer, body
            code = _error_code(body)
            new_region = answer.get("x-amz-bucket-region")
            if (
                status in (301, 307, 400)
                and new_region
                and new_region != region
                and not redirected
                and self.endpoint is None
            ):
                redirected = True
                region = self._bucket_regions[bucket] = new_region
                attempt -= 1
                continue
            if (status in RETRY_STATUSES or code in RETRY_CODES) and attempt < self.attempts:
                self._sleep(attempt)
                continue
            raise S3Error(status, code)

    @staticmethod
    def _sleep(attempt: int) -> None:
        time.sleep(random.random() * min(MAX_BACKOFF_S, BACKOFF_BASE_S * 2 ** (attempt - 1)))

    def _once(
        self,
        method: str,
        bucket: str,
        key: str,
        query: dict[str, str],
        headers: dict[str, str],
        region: str,
        span: tuple[int, int] | None = None,
    ) -> tuple[int, dict[str, str], bytes]:
        scheme, host, port, host_header, path = self._target(bucket, key, region)
        if self.credentials is not None:
            sent = sign(method, host_header, path, query, headers, self.credentials, region)
        else:
            sent = {name.lower(): value for name, value in headers.items()}
            sent["host"] = host_header
        sent["user-agent"] = "ckptool"
        target = path + ("?" + "&".join(f"{quote(k)}={quote(v)}" for k, v in sorted(query.items())) if query else "")
        seconds = request_timeout_s()
        watchdog = _Watchdog(seconds)
        fresh_tried = False
        try:
            while True:
                connection, reused = POOL.get(scheme, host, port, self.connect_timeout, self.ca_bundle)
                watchdog.watch(connection)
                try:
                    if connection.sock is None:
                        connection.connect()
                        connection.sock.settimeout(self.read_timeout)  # type: ignore[attr-defined]
                    watchdog.check()
                    with _counts_lock:
                        COUNTS["requests"] += 1
                    connection.request(method, target, headers=sent)
                    response = connection.getresponse()
                    answer = {k.lower(): v for k, v in response.getheaders()}
                    body = self._body(method, response, answer, span)
                    watchdog.check()
                except (ConnectionError, http.client.BadStatusLine, BrokenPipeError) as e:
                    connection.close()
                    watchdog.check()
                    if reused and not fresh_tried and not isinstance(e, ConnectionRefusedError):
                        fresh_tried = True  # the store closed an idle connection: one more try on a new one
                        continue
                    raise
                except BaseException:
                    connection.close()
                    watchdog.check()
                    raise
                if response.will_close or not response.isclosed():  # a body left unread: no reuse
                    connection.close()
                else:
                    POOL.put(scheme, host, port, connection)
                return response.status, answer, body
        finally:
            watchdog.stop()

    @staticmethod
    def _body(
        method: str, response: http.client.HTTPResponse, headers: Mapping[str, str], span: tuple[int, int] | None
    ) -> bytes:
        """The body, read no further than the request asked (see the module's docstring)."""
        if method == "HEAD":
            return b""
        status = response.status
        if not 200 <= status < 300:
            return response.read(ERROR_BODY_LIMIT)
        if span is None:
            body = response.read(LISTING_LIMIT + 1)
            if len(body) > LISTING_LIMIT:
                raise RangeRefused(f"sent more than {LISTING_LIMIT} bytes for a one-key listing")
            return body
        try:
            declared = int(headers["content-length"]) if "content-length" in headers else None
        except ValueError:
            declared = None
        length, refuse_more = judge(status, headers.get("content-range"), declared, *span)
        body = response.read(length)
        if len(body) < length:  # the answer ended early (a dropped connection): retried, as botocore does
            raise http.client.IncompleteRead(body, length - len(body))
        if refuse_more and response.read(1):
            raise RangeRefused(f"sent more than the {length} bytes of the range it named")
        return body

    # what remote.py asks for
    @staticmethod
    def split(path: str) -> tuple[str, str]:
        bucket, _, key = path.partition("/")
        return bucket, key

    def info(self, path: str) -> dict[str, Any]:
        """s3fs's ``info``: a file's size, or a prefix as a directory; FileNotFoundError when neither."""
        bucket, key = self.split(path)
        try:
            _, headers, _ = self.request("HEAD", bucket, key)
        except S3Error as e:
            if e.status != 404:
                raise
        else:
            return {
                "name": path,
                "type": "file",
                "size": int(headers.get("content-length", 0)),
                "ETag": headers.get("etag", ""),
                "LastModified": headers.get("last-modified", ""),
            }
        try:
            if self.is_prefix(bucket, key):
                return {"name": path, "type": "directory", "size": 0}
        except S3Error as e:
            if e.status != 404:
                raise
        raise FileNotFoundError(path)

    def is_prefix(self, bucket: str, key: str) -> bool:
        _, _, body = self.request(
            "GET",
            bucket,
            "",
            query={"list-type": "2", "prefix": key.rstrip("/") + "/", "delimiter": "/", "max-keys": "1"},
        )
        import xml.etree.ElementTree as ElementTree

        root = ElementTree.fromstring(body)
        return any(element.tag.rsplit("}", 1)[-1] in ("Contents", "CommonPrefixes") for element in root)

    def cat_file(self, path: str, start: int | None = None, end: int | None = None) -> bytes:
        """Bytes [start, end) of the object (to its end without ``end``), never more: a longer or other
        answer is RangeRefused."""
        bucket, key = self.split(path)
        first = start or 0
        if end is None:
            end = int(self.info(path).get("size") or 0)
        if end <= first:
            return b""
        try:
            _, _, body = self.request(
                "GET", bucket, key, headers={"Range": f"bytes={first}-{end - 1}"}, span=(first, end)
            )
        except S3Error as e:
            if e.status == 416:
                return b""
            raise
        return body

    def cat_ranges(self, paths: list[str], starts: list[int], ends: list[int]) -> list[bytes]:
        if len(paths) == 1:
            return [self.cat_file(paths[0], starts[0], ends[0])]
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(max_workers=min(8, len(paths))) as pool:
            return list(pool.map(self.cat_file, paths, starts, ends))


class _Watchdog:
    """Shuts the socket of a request still running after ``seconds`` (headers and body included: a store
    sending a byte a second never trips the socket's own timeout); :meth:`check` then raises RequestTimedOut."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self._connection: http.client.HTTPConnection | None = None
        self._expired = threading.Event()
        self._timer = threading.Timer(seconds, self._expire)
        self._timer.daemon = True
        self._timer.start()

    def watch(self, connection: http.client.HTTPConnection) -> None:
        self._connection = connection

    def _expire(self) -> None:
        self._expired.set()
        sock = self._connection.sock if self._connection is not None else None
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def check(self) -> None:
        if self._expired.is_set():
            if self._connection is not None:
                self._connection.close()
            raise RequestTimedOut(self.seconds)

    def stop(self) -> None:
        self._timer.cancel()


def _retryable_exception(error: BaseException) -> bool:
    if isinstance(error, (ConnectionRefusedError, socket.gaierror)):
        return True  # botocore retries an endpoint it cannot reach, too
    return isinstance(error, (ConnectionError, http.client.HTTPException, TimeoutError, socket.timeout))
