"""The s3 tier's connection (see tiers/s3/tier.py): credentials found where the AWS tools find
them, a boto3 client with the tier's timeouts and boto's own retries off, and what each
error means (the endpoint is down, throttling, absent, refused credentials).

boto3 is imported here only, when a tier, an inventory or the doctor needs it: kvtier imports
without it (tests/cache/test_package_border.py); `pip install kvtier[s3]`.

Why boto3 (docs/performance.md, "The s3 tier"): measured beside obstore on the same server it
was slower per call, but it is the one client that reads every standard credential place
(the shared credentials file and profiles included), writes lifecycle rules, and sends
CRC32 upload checksums; the data path is this module and s3.py, so a faster client is a
change of one module.

Primitives: `Client`, `S3Errors`, `error_code`, `is_throttle`, `is_absent`, `is_refused`,
`refusal_of_credentials`, `open_session`, `connect`, `credentials_source`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from kvtier.errors import ConfigError
from kvtier.tiers.s3.config import S3TierConfig
from kvtier.tiers.tlsfiles import check_ca_file

log = logging.getLogger("kvtier.tiers.s3.tier")
Client = Any  # a botocore S3 client (typed by boto3-stubs only)
INSTALL = "the s3 tier needs boto3: pip install 'kvtier[s3]'"
THROTTLE_CODES = frozenset({"SlowDown", "Throttling", "ThrottlingException", "503",
                            "RequestLimitExceeded", "ServiceUnavailable", "TooManyRequests"})
ABSENT_CODES = frozenset({"404", "NoSuchKey", "NotFound"})
REFUSED_CODES = frozenset({"InvalidAccessKeyId", "SignatureDoesNotMatch", "AccessDenied",
                           "403", "InvalidToken", "ExpiredToken", "AuthorizationHeaderMalformed"})


class S3Errors:
    """The botocore exception classes, imported on first use: `down` (no answer: refused,
    reset, timed out) and `answered` (the server replied with an error)."""

    def __init__(self) -> None:
        try:
            from botocore import exceptions as exc
        except ImportError as err:
            raise ConfigError("kind", "s3", INSTALL) from err
        self.down: tuple[type[BaseException], ...] = (
            exc.ConnectionError, exc.HTTPClientError, OSError)
        self.answered: tuple[type[BaseException], ...] = (exc.ClientError,)
        self.no_credentials: tuple[type[BaseException], ...] = (
            exc.NoCredentialsError, exc.PartialCredentialsError)


def error_code(exc: BaseException) -> str:
    """The S3 error code of a ClientError ("NoSuchKey", "SlowDown", "404", ...), or ""."""
    response = getattr(exc, "response", None) or {}
    code = str(response.get("Error", {}).get("Code", ""))
    status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    return code or (str(status) if status else "")


def _status(exc: BaseException) -> int:
    response = getattr(exc, "response", None) or {}
    return int(response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0)


def is_throttle(exc: BaseException) -> bool:
    """A 503 SlowDown (or another "too many requests" reply): back off, then retry."""
    return error_code(exc) in THROTTLE_CODES or _status(exc) in (429, 503)


def is_held(exc: BaseException) -> bool:
    """A conditional PUT (If-None-Match: *) refused because the object exists (412)."""
    return error_code(exc) in ("PreconditionFailed", "412") or _status(exc) == 412


def is_absent(exc: BaseException) -> bool:
    return error_code(exc) in ABSENT_CODES or _status(exc) == 404


def is_refused(exc: BaseException) -> bool:
    """The server refused the credentials or their rights (403)."""
    return error_code(exc) in REFUSED_CODES or _status(exc) == 403


def refusal_of_credentials(get_absent: Callable[[], object],
                           answered: tuple[type[BaseException], ...]) -> str:
    """After a HEAD of the bucket answered 403: the error code that refuses the credentials
    ("InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken", ...; "NoSuchBucket": no
    such bucket), or "" where the server knows them and denied the HEAD only. AWS answers
    HeadBucket 403 to credentials without s3:ListBucket, which the tier needs only with a
    `capacity` (docs/s3.md): least-privilege credentials were refused at start-up. A HEAD's
    answer has no body to tell the two apart; `get_absent` (a GET of an object no one writes)
    has: AccessDenied, or the object absent, from a server that knows the credentials.

    Raises: what `get_absent` raises but an `answered` error (the endpoint down).
    """
    try:
        get_absent()
    except answered as exc:
        code = error_code(exc)
        if code == "AccessDenied" or (is_absent(exc) and code != "NoSuchBucket"):
            return ""
        return code or "403"
    return ""


def open_session(config: S3TierConfig) -> Any:
    """A boto3 Session whose credentials come from `credentials_file` (and `profile`) when
    set, else botocore's chain (environment, shared file, config file, IRSA web identity,
    container and instance roles).

    Raises:
        ConfigError: boto3 missing; `credentials_file` unreadable; `profile` unknown; no
            credentials found anywhere (the message names where it looked, never a key).
    """
    try:
        import boto3
        import botocore.session
        from botocore.exceptions import ProfileNotFound
    except ImportError as err:
        raise ConfigError("kind", "s3", INSTALL) from err
    core = botocore.session.Session()
    if config.credentials_file is not None:
        path = config.credentials_file
        try:
            text = path.read_text()
        except OSError as exc:
            raise ConfigError("credentials_file", str(path),
                              f"a readable AWS shared-credentials file ({exc.strerror})") from None
        if "aws_access_key_id" not in text:
            raise ConfigError("credentials_file", str(path),
                              "an AWS shared-credentials file ([profile] with "
                              "aws_access_key_id and aws_secret_access_key)")
        if path.stat().st_mode & 0o077:
            log.warning("s3 credentials file %s is readable by others; chmod 600 it", path)
        core.set_config_variable("credentials_file", str(path))
    try:
        session = boto3.Session(botocore_session=core, profile_name=config.profile,
                                region_name=config.region)
        credentials = session.get_credentials()
    except ProfileNotFound:
        raise ConfigError("profile", config.profile, "a profile of the credentials file "
                          f"({config.credentials_file or '~/.aws/credentials'})") from None
    if credentials is None or not credentials.access_key or not credentials.secret_key:
        field = "credentials_file" if config.credentials_file is not None else "credentials"
        raise ConfigError(field, str(config.credentials_file or "none found"),
                          "S3 credentials: AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY in the "
                          "environment, a shared credentials file (credentials_file, "
                          "AWS_SHARED_CREDENTIALS_FILE, ~/.aws/credentials) with `profile`, "
                          "or an instance/IRSA role")
    return session


def credentials_source(session: Any) -> str:
    """Where the session's credentials came from ("env", "shared-credentials-file", ...)."""
    credentials = session.get_credentials()
    return str(getattr(credentials, "method", "") or "unknown")


def connect(config: S3TierConfig, session: Any, max_connections: int,
            read_timeout_s: float | None = None) -> Client:
    """A client of `session` for the tier's endpoint: its timeouts, TLS verification, and
    botocore's retries off (the tier retries throttled writes within its own deadline).

    Raises:
        ConfigError: `tls_ca_file` is unreadable or holds no certificate (tiers/tlsfiles.py).
    """
    from botocore.config import Config

    if config.tls_verify:
        check_ca_file(config.tls_ca_file)

    options: dict[str, Any] = {
        "connect_timeout": config.connect_timeout_s,
        "read_timeout": read_timeout_s or config.request_timeout_s,
        "retries": {"total_max_attempts": 1, "mode": "standard"},
        "max_pool_connections": max_connections,
        "s3": {"addressing_style": config.addressing_style},
        "tcp_keepalive": True,
    }
    if config.upload_checksum == "none":  # botocore >= 1.36 otherwise adds CRC32 itself
        options["request_checksum_calculation"] = "when_required"
        options["response_checksum_validation"] = "when_required"
    verify: bool | str = config.tls_verify
    if config.tls_verify and config.tls_ca_file is not None:
        verify = str(config.tls_ca_file)
    return session.client("s3", endpoint_url=config.endpoint_url, region_name=config.region,
                          verify=verify, config=Config(**options))
