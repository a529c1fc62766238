"""Requests the endpoint answers with a refusal, against moto's S3 server (an emulator).

Credentials revoked mid-run: moto with authentication on after its first requests
(INITIAL_NO_AUTH_ACTION_COUNT: the bucket's creation, the tier's two start-up checks and one
put pass; every request after is refused, 403, as a revoked key or an expired session token
is).

The endpoint answers, so the tier stays up: puts are dropped and reads miss, counted.
Found by an operator drill: before the fix reads and lookups refused this way logged
nothing at all, and each refused put one line at info: an engine whose key was revoked said
nothing at the default log level. Now the first refusal of each error code is a warning
that says credentials were refused; the next ones are at debug (no log flood).

Deletes refused per object: a user whose policy denies s3:DeleteObject gets a 200
DeleteObjects reply listing AccessDenied for each key (moto answers so, as AWS does). Found
by the same drill: the capacity listing took every object it asked to delete for gone, so
`chunks`/`used_bytes` dropped below what the bucket holds, REMOVED events announced chunks
still served, nothing was logged, and the bound was never kept. Now those objects stay
counted, no event goes out, and the refusal is a warning.

Absent objects answered 403: AWS answers a HEAD or GET of an object that does not exist with
403 (AccessDenied), not 404, to credentials without s3:ListBucket, a common least-privilege
policy. With `conditional_put: false` (or admission on) each put HEADs first: every put was
dropped as refused, and lookups warned of refused credentials. The tier learns it from its
start-up HEAD of an object no one writes; moto answers 404 whatever the policy, so the 403 is
injected at the client, in AWS's reply shape. AWS answers such credentials' HEAD of the
bucket 403 too (HeadBucket needs s3:ListBucket), which the tier took for refused
credentials: it refused to start for the least-privilege policy docs/s3.md describes. Now a
GET of an object no one writes tells them apart (AccessDenied: credentials the server knows);
unknown credentials still stop the start (test_s3_faults.py).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
from s3_server import MotoServer, S3Endpoint, moto_available, without_list_bucket
from tierkit import key, tiny_layout

from kvtier.core.chunkformat import HEADER_BYTES
from kvtier.core.keys import ChunkKey
from kvtier.core.tier import IO_ERROR, MISSING, OK, EventKind
from kvtier.tiers import build_tier
from kvtier.tiers.manifest import NamespaceInfo, new_manifest
from kvtier.tiers.s3 import tier as s3_tier
from kvtier.tiers.s3.tier import S3Tier
from kvtier.tiers.storeconfig import StoreConfig

pytestmark = pytest.mark.s3
LOGGER = "kvtier.tiers.s3.tier"


def test_credentials_revoked_mid_run_are_a_warning_not_silence(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    if not moto_available():
        pytest.skip("moto[server] is not installed")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIAREVOKED000000000")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "revoked-secret")
    server = MotoServer(tmp_path / "moto", env={"INITIAL_NO_AUTH_ACTION_COUNT": "4"}).start()
    layout = tiny_layout()
    try:
        tier = build_tier(StoreConfig.parse({"tiers": [{
            "kind": "s3", "endpoint_url": server.url, "bucket": "kvtier-test",
            "addressing_style": "path", "request_timeout_s": 5.0}]}).tiers[0], layout)
        assert isinstance(tier, S3Tier)
        data = memoryview(bytes(layout.bytes_per_chunk))
        out = memoryview(bytearray(layout.bytes_per_chunk))
        assert tier.put(key(1), data) == OK  # the last request let through
        with caplog.at_level(logging.DEBUG, logger=LOGGER):
            assert tier.get_into(key(1), out) == IO_ERROR
            assert tier.contains_many([key(1)]) == [False]
            first = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
            for i in range(2, 5):
                assert tier.put(key(i), data) == IO_ERROR
                assert tier.get_into(key(1), out) == IO_ERROR
                assert tier.contains_many([key(1)]) == [False]
        warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
        assert first and all("credentials refused" in w for w in first), first
        assert len(warnings) <= 3, warnings  # once per code: the GET's, the HEAD's, the PUT's
        assert "revoked-secret" not in caplog.text
        stats = tier.stats()
        assert (stats.misses, stats.dropped_writes) == (4, 3) and tier.available()
        tier.close()
    finally:
        server.stop()


def test_objects_the_server_refuses_to_delete_stay_counted_and_are_not_announced(
        s3_session: S3Endpoint, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """The refusal is injected at the client, in the reply's own shape: moto with
    authentication on refuses the listing's own signed requests (SignatureDoesNotMatch), so a
    real IAM policy cannot drive the listing there."""
    layout = tiny_layout()
    object_bytes = HEADER_BYTES + layout.bytes_per_chunk
    tier = build_tier(StoreConfig.parse({"tiers": [{
        "kind": "s3", **s3_session.settings(), "capacity": 3 * object_bytes,
        "listing_interval_s": 3600}]}).tiers[0], layout)
    assert isinstance(tier, S3Tier)
    removed: list[ChunkKey] = []
    tier.events.listen(lambda _tier, event, k, _retired: removed.append(k)
                       if event is EventKind.REMOVED else None)
    allowed = tier._client.delete_objects

    def denied(**request: Any) -> dict[str, Any]:
        return {"Deleted": [], "Errors": [
            {"Key": o["Key"], "Code": "AccessDenied", "Message": "Access Denied"}
            for o in request["Delete"]["Objects"]]}

    monkeypatch.setattr(tier._client, "delete_objects", denied)
    keys = [key(i) for i in range(6)]
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        for i, k in enumerate(keys):
            assert tier.put(k, memoryview(bytes([i]) * layout.bytes_per_chunk)) == OK
        if tier._listing is not None:
            tier._listing.join(30)  # the first put's listing
        tier.enforce_capacity()
    stats = tier.stats()
    assert (stats.chunks, stats.used_bytes, stats.evictions) == (6, 6 * object_bytes, 0)
    assert removed == [] and tier.contains_many(keys) == [True] * 6
    warnings = [r.getMessage() for r in caplog.records if r.name == LOGGER]
    assert len(warnings) == 1 and "AccessDenied" in warnings[0], warnings

    monkeypatch.setattr(tier._client, "delete_objects", allowed)  # the right granted
    tier.enforce_capacity()
    stats = tier.stats()
    assert (stats.chunks, stats.used_bytes, stats.evictions) == (3, 3 * object_bytes, 3)
    assert len(removed) == 3 and not any(tier.contains_many(removed))
    tier.close()


def test_absent_objects_answered_403_without_list_bucket_are_misses_and_puts_store(
        s3_session: S3Endpoint, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    connect = s3_tier.connect

    def connect_without_list_bucket(*args: Any, **kwargs: Any) -> Any:
        return without_list_bucket(connect(*args, **kwargs))

    monkeypatch.setattr(s3_tier, "connect", connect_without_list_bucket)
    layout = tiny_layout()
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        tier = build_tier(StoreConfig.parse({"tiers": [{
            "kind": "s3", **s3_session.settings(), "conditional_put": False}]}).tiers[0],
            layout)
        assert isinstance(tier, S3Tier)
        tier.keep_manifest(new_manifest(layout, NamespaceInfo("m", "", 0)))  # GET first
        data = memoryview(bytes([7]) * layout.bytes_per_chunk)
        out = memoryview(bytearray(layout.bytes_per_chunk))
        assert tier.contains_many([key(1)]) == [False]
        assert tier.get_into(key(2), out) == MISSING
        assert tier.put(key(1), data) == OK
        assert tier.contains_many([key(1)]) == [True]
        assert tier.put(key(1), data) == OK  # held: not written again
        assert tier.get_into(key(1), out) == OK and bytes(out) == bytes(data)
        manifests = [o["Key"] for o in s3_session.client().list_objects_v2(
            Bucket=s3_session.bucket, Prefix=tier.names.manifest()).get("Contents", [])]
        stats = tier.stats()
        tier.close()
    assert (stats.puts, stats.dropped_writes) == (1, 0)
    assert manifests == [tier.names.manifest()]
    assert [r.getMessage() for r in caplog.records if r.name == LOGGER] == []
