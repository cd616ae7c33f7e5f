"""The storage options and environment of ``s3://``, ``gs://`` and ``http(s)://`` as obstore's configuration.

The options are s3fs's and gcsfs's names (``key``, ``secret``, ``token``, ``anon``, ``endpoint_url``,
``client_kwargs.region_name``, ``config_kwargs.retries``...), and obstore's own config keys pass through; an option
a protocol does not take is :class:`OptionError`. From the environment: ``AWS_*`` and ``AWS_ENDPOINT_URL[_S3]``,
the shared-credentials file's profile, the config file's region; ``GOOGLE_*`` and ``STORAGE_EMULATOR_HOST``.

What obstore itself does not read is recovered here where it can be: a profile whose credentials come from a
role, SSO or a process is read through boto3 when it is installed (:func:`profile_provider`); a bucket in
another AWS region than the one configured is asked for its region (:func:`bucket_region`).
"""

from __future__ import annotations

import os
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Mapping
from typing import Any

MAX_ATTEMPTS = 5  # a request is tried this many times in all (botocore's standard mode)
CONNECT_TIMEOUT_S = 10.0
MIN_CHUNK = 256 * 1024  # a range's body is taken in pieces of this size (or the range, if smaller)
S3_PROTOCOLS = frozenset({"s3", "s3a", "s3n"})
GS_PROTOCOLS = frozenset({"gs", "gcs"})

# options s3fs/gcsfs take that change nothing about how an object is read
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
        "use_ssl",
    }
)
_S3_CONFIG = frozenset(
    {
        "access_key_id",
        "secret_access_key",
        "session_token",
        "region",
        "default_region",
        "endpoint",
        "skip_signature",
        "virtual_hosted_style_request",
        "unsigned_payload",
        "checksum_algorithm",
        "request_payer",
        "server_side_encryption",
        "sse_kms_key_id",
        "sse_bucket_key_enabled",
        "conditional_put",
        "copy_if_not_exists",
        "disable_tagging",
        "imdsv1_fallback",
        "metadata_endpoint",
        "container_credentials_relative_uri",
        "s3_express",
    }
)
_GCS_CONFIG = frozenset(
    {"service_account", "service_account_key", "base_url", "bearer_token", "application_credentials", "skip_signature"}
)
_ENV_NAMES = (
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "AWS_PROFILE",
    "AWS_DEFAULT_PROFILE",
    "AWS_SHARED_CREDENTIALS_FILE",
    "AWS_CONFIG_FILE",
    "AWS_ENDPOINT_URL",
    "AWS_ENDPOINT_URL_S3",
    "AWS_REGION",
    "AWS_DEFAULT_REGION",
    "STORAGE_EMULATOR_HOST",
    "GOOGLE_APPLICATION_CREDENTIALS",
    "HOME",
)


class OptionError(ValueError):
    """A storage option the protocol does not take (its name only)."""


# -- the options ------------------------------------------------------------------------------------------


def _read_ini(path: str) -> Any:
    import configparser

    parser = configparser.RawConfigParser()
    try:
        with open(os.path.expanduser(path), encoding="utf-8") as handle:
            parser.read_file(handle)
    except (OSError, configparser.Error, UnicodeDecodeError):
        return None
    return parser


def _profile(env: Mapping[str, str], config_file: bool) -> Mapping[str, str] | None:
    """The profile's section of the AWS config (or shared credentials) file, or None."""
    name = env.get("AWS_PROFILE") or env.get("AWS_DEFAULT_PROFILE") or "default"
    if config_file:
        parser = _read_ini(env.get("AWS_CONFIG_FILE") or "~/.aws/config")
        section = name if name == "default" else f"profile {name}"
        if parser is not None and not parser.has_section(section) and name == "default":
            section = "profile default"
    else:
        parser = _read_ini(env.get("AWS_SHARED_CREDENTIALS_FILE") or "~/.aws/credentials")
        section = name
    if parser is None or not parser.has_section(section):
        return None
    return parser[section]


def s3_config(options: Mapping[str, Any], env: Mapping[str, str]) -> tuple[dict[str, Any], dict[str, Any], int]:
    """(obstore's S3 config, client options, attempts) for s3fs-style ``options`` and the environment.

    Raises:
        OptionError: an option S3 does not take.
    """
    config: dict[str, Any] = {}
    client: dict[str, Any] = {}
    attempts = MAX_ATTEMPTS
    for name, value in options.items():
        if name in _HARMLESS_OPTIONS:
            continue
        if name == "key":
            config["access_key_id"] = str(value)
        elif name == "secret":
            config["secret_access_key"] = str(value)
        elif name == "token":
            if value:
                config["session_token"] = str(value)
        elif name == "anon":
            if value:
                config["skip_signature"] = True
        elif name == "endpoint_url":
            config["endpoint"] = str(value)
        elif name == "client_kwargs" and isinstance(value, dict) and set(value) <= {"endpoint_url", "region_name"}:
            if value.get("endpoint_url"):
                config["endpoint"] = str(value["endpoint_url"])
            if value.get("region_name"):
                config["region"] = str(value["region_name"])
        elif (
            name == "config_kwargs"
            and isinstance(value, dict)
            and set(value) <= {"retries", "connect_timeout", "read_timeout", "max_pool_connections"}
        ):
            retries = value.get("retries") or {}
            if not isinstance(retries, dict):
                raise OptionError("config_kwargs.retries")
            if retries.get("total_max_attempts"):
                attempts = int(retries["total_max_attempts"])
            elif retries.get("max_attempts") is not None:
                attempts = int(retries["max_attempts"]) + 1
            if value.get("connect_timeout") is not None:
                client["connect_timeout"] = f"{float(value['connect_timeout']):g}s"
        elif name in _S3_CONFIG:
            config[name] = value
        else:
            raise OptionError(name)
    if "endpoint" not in config:
        endpoint = env.get("AWS_ENDPOINT_URL_S3") or env.get("AWS_ENDPOINT_URL")
        if endpoint:
            config["endpoint"] = endpoint
    profile = None
    if not config.get("skip_signature") and "access_key_id" not in config and not env.get("AWS_ACCESS_KEY_ID"):
        profile = _profile(env, False)  # a shared-credentials profile: read as botocore would
        if profile is not None and profile.get("aws_access_key_id") and profile.get("aws_secret_access_key"):
            config["access_key_id"] = profile["aws_access_key_id"].strip()
            config["secret_access_key"] = profile["aws_secret_access_key"].strip()
            token = (profile.get("aws_session_token") or "").strip()
            if token:
                config["session_token"] = token
    if "region" not in config and not (env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION")):
        section = _profile(env, True)
        config["region"] = (section.get("region") if section is not None else None) or "us-east-1"
    if str(config.get("endpoint", "")).startswith("http://"):
        client["allow_http"] = True
    return config, client, max(1, attempts)


def gcs_config(options: Mapping[str, Any], env: Mapping[str, str]) -> tuple[dict[str, Any], dict[str, Any], int]:
    """(obstore's GCS config, client options, attempts) for gcsfs-style ``options`` and the environment."""
    config: dict[str, Any] = {}
    for name, value in options.items():
        if name in _HARMLESS_OPTIONS or name == "project":
            continue
        if name == "token":
            if value in ("anon", None):
                config["skip_signature"] = True
            elif isinstance(value, str) and value not in ("google_default", "cloud", "cache", "browser"):
                config["service_account"] = value  # a service account's key file
        elif name == "endpoint_url":
            config["base_url"] = str(value)
        elif name in _GCS_CONFIG:
            config[name] = value
        else:
            raise OptionError(name)
    if "base_url" not in config and env.get("STORAGE_EMULATOR_HOST"):
        host = env["STORAGE_EMULATOR_HOST"]
        config["base_url"] = host if "://" in host else "http://" + host
    client = {"allow_http": True} if str(config.get("base_url", "")).startswith("http://") else {}
    return config, client, MAX_ATTEMPTS


def http_config(options: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any], int]:
    """(no config, client options, attempts) for an ``http(s)://`` URL: only ``headers`` is taken."""
    unknown = [name for name in options if name not in _HARMLESS_OPTIONS and name != "headers"]
    if unknown:
        raise OptionError(unknown[0])
    headers = options.get("headers") or {}
    client: dict[str, Any] = {"default_headers": dict(headers)} if headers else {}
    client["allow_http"] = True
    return {}, client, MAX_ATTEMPTS


# a profile's keys that name credentials obtained elsewhere (botocore's providers), not written in the file
_INDIRECT_KEYS = ("role_arn", "credential_process", "sso_session", "sso_start_url", "web_identity_token_file")


def profile_provider(config: Mapping[str, Any], env: Mapping[str, str]) -> Any | None:
    """obstore's boto3 credential provider for the AWS profile, where its credentials are not in the files as keys
    (a role, SSO, a process) and boto3 is installed; else None (obstore's own chain: environment, web identity,
    container and instance credentials)."""
    if config.get("skip_signature") or config.get("access_key_id") or env.get("AWS_ACCESS_KEY_ID"):
        return None
    section = _profile(env, True)
    if section is None or not any(section.get(key) for key in _INDIRECT_KEYS):
        return None
    import importlib

    try:
        boto3 = importlib.import_module("boto3")
        provider = importlib.import_module("obstore.auth.boto3").Boto3CredentialProvider
        name = env.get("AWS_PROFILE") or env.get("AWS_DEFAULT_PROFILE") or None
        return provider(boto3.Session(profile_name=name))
    except ImportError:
        return None
    except Exception:  # noqa: BLE001 (boto3 found no credentials there: obstore's chain says what is missing)
        return None


AWS_REGION_PROBE = "https://s3.amazonaws.com/"


def bucket_region(bucket: str, seconds: float) -> str | None:
    """The region AWS names for ``bucket`` (``x-amz-bucket-region`` of an unsigned HEAD, as the AWS SDKs ask
    it), or None where it does not say."""
    request = urllib.request.Request(AWS_REGION_PROBE + urllib.parse.quote(bucket), method="HEAD")
    try:
        with urllib.request.urlopen(request, timeout=seconds) as answer:  # noqa: S310 (a fixed https URL)
            return answer.headers.get("x-amz-bucket-region")
    except urllib.error.HTTPError as e:
        return e.headers.get("x-amz-bucket-region") if e.headers is not None else None
    except (OSError, ValueError):
        return None
