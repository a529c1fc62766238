"""What an s3 tier's bucket holds, as `kvtier.core.tier.Inventory` (`kvtier inspect`,
`kvtier gc`), read by listing without building the tier; the object names (`S3Names`); the
capacity bound from a listing; the lifecycle rule for `ttl_days`; the namespaces' manifests.

Cost of a listing: ListObjectsV2 returns up to 1,000 objects a request, so a namespace of N
chunks costs ceil(N / 1000) requests (~5-20 ms each against a nearby endpoint; AWS bills a LIST at
the PUT rate) and ~150 bytes of memory per listed object while the
listing is sorted. It stops after `max_listed_objects` (default 1M: ~150 MB, 1,000 requests):
a namespace larger than that is bounded by the lifecycle rule alone. The tier lists at most
every `listing_interval_s`, on a thread of its own, never on the data path.

Only names of kvtier's form are taken for chunks (<prefix>/<32 hex digest>/<2 hex>/<key hex>,
the shard matching the key); anything else under the prefix is a foreign object, listed by
no one and deleted by no one (tests/faults/test_s3_faults.py).

An object's age (`kvtier gc --max-age`, `kvtier inspect`) is measured by the server's clock,
which stamped its LastModified, not by the clock of the host gc runs on (`S3Inventory.now_s`,
tiers/s3/serverclock.py).

Primitives: `S3Names`, `S3Inventory`, `parse_chunk_name`, `enforce_capacity`,
`put_lifecycle`, `write_manifest`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from kvtier.core.keys import KEY_BYTES, ChunkKey
from kvtier.core.tier import StoredChunk
from kvtier.tiers.manifest import FILE_NAME, NamespaceManifest, is_layout_name, parse_manifest
from kvtier.tiers.s3.client import S3Errors, connect, is_absent, open_session
from kvtier.tiers.s3.config import S3TierConfig
from kvtier.tiers.s3.serverclock import ServerClock

log = logging.getLogger(__name__)
DELETE_BATCH = 1000  # keys per DeleteObjects request (the S3 maximum)
_HEX = frozenset("0123456789abcdef")


@dataclass(frozen=True, slots=True)
class S3Names:
    """Object names of one namespace (see kvtier/tiers/s3/tier.py)."""

    prefix: str  # config.key_prefix, no slashes around it
    digest: str  # the layout digest

    def chunk(self, key: ChunkKey) -> str:
        hex_key = key.hex()
        return f"{self.prefix}/{self.digest}/{hex_key[:2]}/{hex_key}"

    def manifest(self) -> str:
        return f"{self.prefix}/{self.digest}/{FILE_NAME}"

    def namespace_prefix(self) -> str:
        return f"{self.prefix}/{self.digest}/"


def parse_chunk_name(prefix: str, name: str) -> tuple[str, str] | None:
    """(namespace, key hex) of a chunk object's name, or None for any other object."""
    parts = name[len(prefix) + 1:].split("/") if name.startswith(prefix + "/") else []
    if len(parts) != 3:
        return None
    namespace, shard, key_hex = parts
    if (not is_layout_name(namespace) or len(key_hex) != 2 * KEY_BYTES
            or not set(key_hex) <= _HEX or shard != key_hex[:2]):
        return None
    return namespace, key_hex


def _list(client: Any, bucket: str, prefix: str, limit: int | None = None
          ) -> Iterator[dict[str, Any]]:
    """Every object under `prefix` (ListObjectsV2 pages of 1,000), at most `limit`."""
    seen = 0
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        for item in page.get("Contents", []):
            yield item
            seen += 1
            if limit is not None and seen >= limit:
                return


def _delete(client: Any, bucket: str, names: Sequence[str]) -> tuple[set[str], dict[str, str]]:
    """Delete objects by name, DELETE_BATCH a request. Returns the names the server deleted,
    and the error code of each it refused (a 200 reply that lists AccessDenied per key: no
    s3:DeleteObject right)."""
    deleted: set[str] = set()
    refused: dict[str, str] = {}
    for start in range(0, len(names), DELETE_BATCH):
        batch = names[start : start + DELETE_BATCH]
        reply = client.delete_objects(Bucket=bucket, Delete={
            "Objects": [{"Key": name} for name in batch], "Quiet": False})
        deleted.update(str(item.get("Key")) for item in reply.get("Deleted", []))
        refused.update((str(item.get("Key")), str(item.get("Code") or "unknown"))
                       for item in reply.get("Errors", []))
    return deleted, refused


def enforce_capacity(client: Any, config: S3TierConfig, names: S3Names, capacity_bytes: int
                     ) -> tuple[int, int, int, list[str], dict[str, str]]:
    """List a namespace's chunks and delete the least recently written beyond
    `capacity_bytes`. Returns (chunks kept, bytes kept, chunks deleted, the key hex of each
    chunk deleted, the error code of each object the server refused to delete: those are
    counted as kept).

    Raises: botocore errors (the caller's circuit breaker classifies them).
    """
    found = [(item["LastModified"].timestamp(), item["Key"], int(item["Size"]))
             for item in _list(client, config.bucket, names.namespace_prefix(),
                               config.max_listed_objects)
             if parse_chunk_name(config.key_prefix, item["Key"]) is not None]
    found.sort()
    used = sum(size for _t, _name, size in found)
    victims: dict[str, int] = {}
    while found and used > capacity_bytes:
        _t, name, size = found.pop(0)
        victims[name] = size
        used -= size
    deleted, refused = _delete(client, config.bucket, list(victims)) if victims else (set(), {})
    kept = [name for name in victims if name not in deleted]  # still there: still counted
    gone = [parsed[1] for name in victims
            if name in deleted and (parsed := parse_chunk_name(config.key_prefix, name))]
    return (len(found) + len(kept), used + sum(victims[name] for name in kept), len(deleted),
            gone, refused)


def put_lifecycle(client: Any, config: S3TierConfig, log: logging.Logger) -> None:
    """Write (or replace) the bucket's lifecycle rule "kvtier-<prefix>": objects under the
    prefix expire `ttl_days` after they were written; other rules are kept. Logs a refusal
    (the operator may not allow it), never raises."""
    errors = S3Errors()
    rule_id = f"kvtier-{config.key_prefix}"[:255]
    try:
        try:
            rules = client.get_bucket_lifecycle_configuration(Bucket=config.bucket)["Rules"]
        except errors.answered as exc:  # NoSuchLifecycleConfiguration: none yet
            if "NoSuchLifecycle" not in str(exc):
                raise
            rules = []
        rules = [r for r in rules if r.get("ID") != rule_id] + [{
            "ID": rule_id, "Status": "Enabled",
            "Filter": {"Prefix": config.key_prefix + "/"},
            "Expiration": {"Days": config.ttl_days}}]
        client.put_bucket_lifecycle_configuration(
            Bucket=config.bucket, LifecycleConfiguration={"Rules": rules})
    except (*errors.answered, *errors.down) as exc:
        log.warning("s3 tier %r: lifecycle rule for ttl_days not written (%s); set one on "
                    "the prefix yourself (docs/s3.md)", config.tier_name, type(exc).__name__)
        return
    log.info("s3 tier %r: lifecycle rule %r expires objects under %s/ after %d day(s)",
             config.tier_name, rule_id, config.key_prefix, config.ttl_days)


def write_manifest(client: Any, bucket: str, names: S3Names, manifest: NamespaceManifest,
                   says_absent: Callable[[BaseException], bool] = is_absent) -> bool:
    """Put `manifest` unless an equal one is there (keeping the first `created_s`). True
    when written. `says_absent`: whether a GET's error answer means no manifest yet (a 403
    does too, to credentials without s3:ListBucket). Raises: botocore errors."""
    errors = S3Errors()
    try:
        current = client.get_object(Bucket=bucket, Key=names.manifest())["Body"].read()
    except errors.answered as exc:
        if not says_absent(exc):
            raise
        current = None
    if manifest.same_as(parse_manifest(current, manifest.namespace)):
        return False
    client.put_object(Bucket=bucket, Key=names.manifest(), Body=manifest.to_json())
    return True


class S3Inventory:
    """An s3 tier's chunks and manifests, every namespace under its prefix."""

    def __init__(self, name: str, config: S3TierConfig) -> None:
        self.name, self.kind = name, "s3"
        self.config = config
        self.client: Any = connect(config, open_session(config), 16,
                                   max(config.request_timeout_s, 30.0))
        self.server_clock = ServerClock(self.client)

    def chunks(self) -> Iterator[StoredChunk]:
        """Every chunk object (a listing: no object is read, none looks used)."""
        for item in _list(self.client, self.config.bucket, self.config.key_prefix + "/"):
            parsed = parse_chunk_name(self.config.key_prefix, item["Key"])
            if parsed is not None:
                yield StoredChunk(parsed[0], parsed[1], int(item["Size"]),
                                  item["LastModified"].timestamp(), (item["Key"],))

    def now_s(self) -> float:
        """`StorageClock`: now by the server's clock, which stamps LastModified: the `Date`
        of its last answer (the listing gc has just made) plus the time passed since; a
        request of its own (a listing of one object) when none answered yet; this host's
        clock where no answer carries a Date (logged). Never raises."""
        now = self.server_clock.now_s()
        if now is None:
            errors = S3Errors()
            try:
                self.client.list_objects_v2(Bucket=self.config.bucket, MaxKeys=1,
                                            Prefix=self.config.key_prefix + "/")
            except (*errors.answered, *errors.down):
                pass  # an error answer carries a Date as well; none: this host's clock
            now = self.server_clock.now_s()
        if now is None:
            log.warning("s3 tier %r: the server's answers carry no Date; ages are taken by "
                        "this host's clock", self.name)
            return time.time()
        return now

    def remove(self, chunks: Sequence[StoredChunk]) -> int:
        names = [name for chunk in chunks for name in chunk.locations
                 if parse_chunk_name(self.config.key_prefix, name) is not None]
        return len(_delete(self.client, self.config.bucket, names)[0])

    def manifests(self) -> dict[str, NamespaceManifest | None]:
        """namespace -> its manifest (None: an object that is not a valid one)."""
        found: dict[str, NamespaceManifest | None] = {}
        for item in _list(self.client, self.config.bucket, self.config.key_prefix + "/"):
            parts = item["Key"][len(self.config.key_prefix) + 1:].split("/")
            if len(parts) == 2 and parts[1] == FILE_NAME and is_layout_name(parts[0]):
                data = self.client.get_object(Bucket=self.config.bucket,
                                              Key=item["Key"])["Body"].read()
                found[parts[0]] = parse_manifest(data, parts[0])
        return found

    def remove_manifest(self, namespace: str) -> bool:
        """Delete `namespace`'s manifest; True when there was one."""
        names = S3Names(self.config.key_prefix, namespace)
        try:
            self.client.head_object(Bucket=self.config.bucket, Key=names.manifest())
        except S3Errors().answered:
            return False
        self.client.delete_object(Bucket=self.config.bucket, Key=names.manifest())
        return True

    def close(self) -> None:
        self.client.close()
