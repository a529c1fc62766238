"""The s3 tier's config model (kind "s3"); see kvtier/tiers/s3/tier.py for the tier.

In a module of its own (not tier.py) because the client code (client.py), the operator's
inventory (inventory.py) and `kvtier doctor` read it without importing the tier.

Credentials are never part of the config: the standard places (environment, the shared
credentials file, a profile, instance or IRSA roles: botocore's chain), or a file named by
`credentials_file`. An inline key is refused with an error naming the field, and the value
is masked in that error.

Primitives: `S3TierConfig`, `INLINE_CREDENTIALS`.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

from pydantic import Field, field_validator, model_validator

from kvtier.config import ByteSize
from kvtier.errors import FieldError
from kvtier.redaction import MASK, url_credentials
from kvtier.tiers.encoding import EncodedTierSettings

# Fields an operator may try to put keys in; each is refused (never stored, never echoed).
INLINE_CREDENTIALS = ("access_key_id", "secret_access_key", "session_token",
                      "aws_access_key_id", "aws_secret_access_key", "aws_session_token")
_REFUSED = ("never inline: a key in the config sits in config files, process listings and "
            "logs; use the environment (AWS_ACCESS_KEY_ID, ...), a shared credentials file "
            "(credentials_file, profile), or an instance/IRSA role")
# The characters any bucket name may have: AWS's rules for new buckets (lowercase letters,
# digits, '.', '-', 3-63) are stricter than its legacy us-east-1 names and GCS's (which may
# hold uppercase letters and '_', up to 255 and 222 characters): a space, a '/' or a '!' is
# a typo everywhere.
_BUCKET_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{1,253}[A-Za-z0-9]")


class S3TierConfig(EncodedTierSettings):
    """An S3-compatible bucket (AWS S3, GCS's S3 interface, R2, Ceph RGW, MinIO, ...).

    `codec` and the encryption settings: `kvtier.tiers.encoding.EncodedTierSettings`.
    """

    kind: Literal["s3"]
    capacity: ByteSize = 0  # bytes kvtier keeps per namespace (periodic listing); 0 = no bound
    bucket: str  # the bucket (created by the operator: the tier never creates one)
    endpoint_url: str | None = None  # e.g. https://minio.local:9000; None = AWS's for `region`
    region: str = "us-east-1"  # the bucket's region (signing); never empty
    key_prefix: str = "kvtier"  # every object name starts with "<key_prefix>/"
    credentials_file: Path | None = None  # an AWS shared-credentials file (INI, mode 0600)
    profile: str | None = None  # profile in that file (or ~/.aws); None = AWS_PROFILE/default
    tls_verify: bool = True  # verify the endpoint's certificate (https)
    tls_ca_file: Path | None = None  # CA bundle that signed it; None = the system CAs
    addressing_style: Literal["auto", "path", "virtual"] = "auto"  # path for most on-prem
    # Integrity checksum the server verifies on upload ("none" for servers without it)
    upload_checksum: Literal["CRC32", "CRC32C", "SHA256", "none"] = "CRC32"
    # A put is one PUT with If-None-Match: * (the server refuses it when the object exists:
    # AWS S3 since 2024, MinIO, R2, Ceph RGW 18+, moto). False: a HEAD first, for servers
    # that ignore the header (they would overwrite a held chunk). admit_after > 1 HEADs too.
    conditional_put: bool = True
    connect_timeout_s: float = Field(1.0, gt=0, le=60)  # longest wait for a connection
    request_timeout_s: float = Field(2.0, gt=0, le=600)  # longest wait for any reply bytes
    # A batch of existence checks (one HEAD per chunk) gives up after this: the keys not
    # answered are misses. Keep it below the store's lookup_timeout_s.
    lookup_timeout_s: float = Field(1.0, gt=0, le=60)
    lookup_concurrency: int = Field(32, ge=1, le=256)  # HEADs in flight per batch
    # A chunk found absent is not asked again for this long (its own puts clear it)
    negative_cache_s: float = Field(1.0, ge=0, le=60)
    # A put throttled (503 SlowDown) is retried with backoff until this, then dropped
    write_timeout_s: float = Field(5.0, gt=0, le=600)
    # Longest backoff between retries of a down endpoint; at most an hour (`.inf` grew the
    # backoff without end: an endpoint back after a blip was skipped for days).
    retry_max_s: float = Field(30.0, gt=0, le=3600)
    # Objects expire this many days after they were written (a bucket lifecycle rule on the
    # prefix when manage_lifecycle, else the operator's rule: docs/s3.md); None = never
    ttl_days: int | None = Field(None, ge=1)
    manage_lifecycle: bool = False  # let kvtier write the lifecycle rule for ttl_days
    listing_interval_s: float = Field(300.0, ge=1)  # capacity > 0: list this often at most
    max_listed_objects: int = Field(1_000_000, ge=1000)  # a listing stops after this many
    io_threads: int = Field(8, ge=1, le=64)  # write-behind threads the store gives this tier
    # Refused (INLINE_CREDENTIALS): declared so that the error names the field.
    access_key_id: None = None
    secret_access_key: None = None
    session_token: None = None
    aws_access_key_id: None = None
    aws_secret_access_key: None = None
    aws_session_token: None = None

    @model_validator(mode="before")
    @classmethod
    def _mask_inline_credentials(cls, data: Any) -> Any:
        # The refusal below must not echo the key: ConfigError shows the refused value.
        if isinstance(data, dict) and any(data.get(n) is not None for n in INLINE_CREDENTIALS):
            return {k: MASK if k in INLINE_CREDENTIALS and v is not None else v
                    for k, v in data.items()}
        return data

    @field_validator(*INLINE_CREDENTIALS, mode="before")
    @classmethod
    def _refuse_inline(cls, value: Any) -> None:
        if value is not None:
            raise ValueError(_REFUSED)
        return None

    @field_validator("endpoint_url")
    @classmethod
    def _endpoint(cls, url: str | None) -> str | None:
        if url is None:
            return None
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise ValueError("an http:// or https:// URL")
        found = url_credentials(url)
        if found or "@" in parts.netloc:
            raise ValueError(f"no credentials in the URL ({'; '.join(found) or 'userinfo'}: "
                             f"shown as {MASK}); {_REFUSED}")
        # botocore would fail on the first request, in a worker, rather than here
        try:
            port_ok = parts.port is None or 1 <= parts.port <= 65535
        except ValueError:  # not a number, or above 65535
            port_ok = False
        if not port_ok:
            raise ValueError("a port from 1 to 65535 (e.g. https://minio.local:9000)")
        return url.rstrip("/")

    @field_validator("bucket")
    @classmethod
    def _bucket(cls, bucket: str) -> str:
        if not _BUCKET_NAME.fullmatch(bucket) or ".." in bucket:
            raise ValueError("a bucket name: letters, digits, '.' (never two in a row), '-' "
                             "and '_', beginning and ending with a letter or digit, 3 to 63 "
                             "characters on AWS (lowercase; legacy names up to 255)")
        return bucket

    @field_validator("region")
    @classmethod
    def _region(cls, region: str) -> str:
        if not region.strip():
            raise ValueError("a region name such as 'us-east-1' (requests are signed for it)")
        return region

    @field_validator("key_prefix")
    @classmethod
    def _prefix(cls, prefix: str) -> str:
        prefix = prefix.strip("/")
        if not prefix:
            raise ValueError("a non-empty prefix (every object of the tier is named under it)")
        return prefix

    @field_validator("eviction")
    @classmethod
    def _lru_only(cls, eviction: str) -> str:
        if eviction != "lru":
            raise ValueError("'lru' (capacity evicts the least recently written objects)")
        return eviction

    @model_validator(mode="after")
    def _consistent(self) -> S3TierConfig:
        if self.manage_lifecycle and self.ttl_days is None:
            raise ValueError("manage_lifecycle needs ttl_days (the rule's expiry)")
        if self.tls_ca_file is not None and not self.tls_verify:
            raise ValueError("tls_ca_file is set but tls_verify is false")
        # Never dropped silently: the operator would believe the CA verifies a connection
        # that is clear text (the redis tier refuses the same). Names the field to fix.
        clear_text = self.endpoint_url is not None and urlsplit(self.endpoint_url).scheme == "http"
        if self.tls_ca_file is not None and clear_text:
            raise FieldError("tls_ca_file", str(self.tls_ca_file),
                             f"no CA with a clear-text endpoint ({self.endpoint_url}): "
                             "use an https:// endpoint_url, or leave tls_ca_file out")
        return self

    @property
    def endpoint_name(self) -> str:
        """The endpoint for display and the circuit breaker: host[:port], no credentials."""
        if self.endpoint_url is None:
            return f"s3.{self.region}.amazonaws.com"
        return urlsplit(self.endpoint_url).netloc
