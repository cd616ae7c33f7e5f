"""One line for a failed request to a store: the cause (404, 403, throttled, timed out, an answer other than asked)
and the next step, never the store's own text (it may quote a signed URL or a credential)."""

from __future__ import annotations

from typing import Any

from ckptool.base.errors import InputError
from ckptool.files import bounded

S3_NAMES = frozenset({"s3", "s3a", "s3n"})

# -- errors -------------------------------------------------------------------------------------


def _status_of(error: BaseException) -> tuple[int | None, str]:
    """(HTTP status, the store's error code) of a botocore/aiohttp/fsspec error, where it says."""
    response = getattr(error, "response", None)
    if isinstance(response, dict):
        meta = response.get("ResponseMetadata", {})
        code = str(response.get("Error", {}).get("Code", ""))
        status = meta.get("HTTPStatusCode")
        return (int(status) if status else None), code
    status = getattr(error, "status", None) or getattr(error, "code", None)
    if isinstance(status, int):
        return status, ""
    first = str(error).split(":", 1)[0] if isinstance(error, (OSError, ValueError)) else ""
    if first in _GCSFS_STATUS:  # gcsfs says these in words, the store's text after them
        return _GCSFS_STATUS[first], ""
    return None, ""


_GCSFS_STATUS = {"Forbidden": 403, "Bad Request": 400}


def _credentials_hint(path: Any) -> Any:
    """Where the credentials of ``path``'s protocol come from, for a refusal."""
    from ckptool.base.suggest import Metavar, option

    given = option("storage_options", Metavar("KEY=VALUE"))
    if path.protocol in S3_NAMES:
        return "check the credentials (AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, a profile, or " + given + ")"
    if path.protocol in ("gs", "gcs"):
        return (
            "check the credentials (GOOGLE_APPLICATION_CREDENTIALS, gcloud auth application-default login, or "
            + given
            + ")"
        )
    return "check the URL and any credentials it needs (" + given + ")"


def _endpoint_hint(path: Any) -> Any:
    """How ``path``'s protocol is pointed at a store, for a refusal."""
    from ckptool.base.suggest import Metavar, option

    if path.protocol in S3_NAMES:
        return (
            "check the endpoint (AWS_ENDPOINT_URL or "
            + option("storage_options", Metavar("endpoint_url=..."))
            + ") and that it is up"
        )
    if path.protocol in ("gs", "gcs"):
        return (
            "check the endpoint (STORAGE_EMULATOR_HOST or "
            + option("storage_options", Metavar("endpoint_url=..."))
            + ") and that it is up"
        )
    return "check the URL's host and that it is up"


def says_missing(error: FileNotFoundError) -> bool:
    """Whether a FileNotFoundError means "nothing there": fsspec's HTTP filesystem raises it for any failed
    request, a 403 or a 500 under it."""
    current: BaseException | None = error.__cause__ or error.__context__
    for _ in range(8):
        if current is None:
            return True
        status = _status_of(current)[0]
        if status is not None:
            return status in (404, 410)
        current = current.__cause__ or current.__context__
    return True


def remote_error(error: BaseException, path: Any, *, writing: bool = False) -> InputError:
    """One line for a failed request: the cause (404, 403, throttled, timeout, an answer other than asked...)
    and the next step; never the store's raw text (it may quote a signed URL or a credential)."""
    from ckptool.base.errors import OutputError

    kind = OutputError if writing else InputError
    chain: list[BaseException] = []
    current: BaseException | None = error
    while current is not None and len(chain) < 8:
        chain.append(current)
        current = current.__cause__ or current.__context__
    # fsspec's HTTP info turns any failure into FileNotFoundError: the status under it is the cause
    statuses = [status for status, _ in map(_status_of, chain) if status is not None]
    if statuses and isinstance(chain[0], FileNotFoundError) and statuses[0] != 404:
        chain = chain[1:]
    for item in chain:
        if isinstance(item, bounded.RangeRefused):  # its text is numbers only, ckptool's own
            return kind(
                f"the server {item} — refused (ckptool reads no more than it asks for); it does not serve "
                "byte ranges as asked: download the file and pass its local path",
                path=path,
            )  # type: ignore[return-value]
        if isinstance(item, bounded.RequestTimedOut):
            return kind(
                f"timed out: the store sent no complete answer within {item.seconds:g} s "
                f"({bounded.TIMEOUT_ENV} sets the limit) — check the network or the endpoint, then retry",
                path=path,
            )  # type: ignore[return-value]
        status, code = _status_of(item)
        code = "" if code == str(status) else code  # a bodiless answer's only "code" is its status
        if isinstance(item, FileNotFoundError) or status == 404 or code in ("NoSuchKey", "NoSuchBucket", "404"):
            what = "its bucket does not exist" if code == "NoSuchBucket" else "does not exist"
            return kind(f"{what} (404) — check the URL", path=path)  # type: ignore[return-value]
        if (
            isinstance(item, PermissionError)
            or status in (401, 403)
            or code in ("AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "403")
        ):
            return kind(
                f"access denied ({status or 403}{', ' + code if code else ''}) — " + _credentials_hint(path), path=path
            )  # type: ignore[return-value]
        if status in (429, 503) or code in ("SlowDown", "Throttling", "ThrottlingException", "RequestLimitExceeded"):
            return kind(
                f"the store is throttling requests ({status or 503}{' ' + code if code else ''}) and kept "
                "refusing after retries with backoff — try again later",
                path=path,
            )  # type: ignore[return-value]
        name = type(item).__name__
        if isinstance(item, TimeoutError) or "Timeout" in name:
            return kind("timed out talking to the store — check the network or the endpoint, then retry", path=path)  # type: ignore[return-value]
        if "Connect" in name or isinstance(item, ConnectionError):
            return kind("cannot connect to the store — " + _endpoint_hint(path), path=path)  # type: ignore[return-value]
        if status is not None and status >= 500:
            return kind(f"the store failed ({status}{' ' + code if code else ''}) — retry later", path=path)  # type: ignore[return-value]
        if status is not None and status >= 400:
            return kind(
                f"the store refused the request ({status}{' ' + code if code else ''}) — check the URL; "
                + _credentials_hint(path),
                path=path,
            )  # type: ignore[return-value]
    return kind(
        f"request failed ({type(error).__name__}{': ' + code if (code := _status_of(error)[1]) else ''}) — "
        "check the URL and the credentials",
        path=path,
    )  # type: ignore[return-value]
