"""What the s3 tier does beyond the contract suite (tests/tiers/test_tier_contract.py runs
that over it too): object names, the capacity bound from a listing, the lifecycle rule for
`ttl_days`, the negative cache, lookups of a long prefix in parallel, codecs, the probe.
Against the session's endpoint: moto's server (an emulator) or KVTIER_TEST_S3_*.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest
from s3_server import S3Endpoint
from tierkit import key, tiny_layout

import kvtier.tiers.s3.tier as s3_module
from kvtier.core.chunkformat import HEADER_BYTES
from kvtier.core.layout import KVLayout
from kvtier.core.tier import OK, BatchLookup, Locality, Medium
from kvtier.tiers import build_probe, build_tier
from kvtier.tiers.s3.tier import S3Tier
from kvtier.tiers.storeconfig import StoreConfig

pytestmark = pytest.mark.s3
LAYOUT = tiny_layout()
OBJECT_BYTES = HEADER_BYTES + LAYOUT.bytes_per_chunk


def payload(i: int, layout: KVLayout = LAYOUT) -> bytes:
    return bytes((i * 17 + j * 5) % 241 for j in range(layout.bytes_per_chunk))


def config_of(endpoint: S3Endpoint, **options: Any) -> Any:
    return StoreConfig.parse({"tiers": [{"kind": "s3", **endpoint.settings(),
                                         **options}]}).tiers[0]


def tier_of(endpoint: S3Endpoint, **options: Any) -> S3Tier:
    tier = build_tier(config_of(endpoint, **options), LAYOUT)
    assert isinstance(tier, S3Tier)
    return tier


def test_facts_and_object_names(s3_session: S3Endpoint) -> None:
    """STORAGE, REMOTE; one object per chunk at <prefix>/<digest>/<key[:2]>/<key>."""
    assert (S3Tier.medium, S3Tier.locality) == (Medium.STORAGE, Locality.REMOTE)
    tier = tier_of(s3_session)
    assert isinstance(tier, BatchLookup)
    assert tier.put(key(0x1234), memoryview(payload(1))) == OK
    objects = s3_session.client().list_objects_v2(Bucket=s3_session.bucket,
                                                  Prefix=tier.names.prefix + "/")["Contents"]
    hex_key = key(0x1234).hex()
    assert [(o["Key"], o["Size"]) for o in objects] == [
        (f"{tier.names.prefix}/{LAYOUT.digest()}/{hex_key[:2]}/{hex_key}", OBJECT_BYTES)]
    tier.close()


def test_capacity_is_enforced_from_a_listing_oldest_written_first(
        s3_session: S3Endpoint) -> None:
    """capacity of 3 objects, 6 written: the listing that a put starts (at most every
    listing_interval_s) removes the 3 oldest and sets the counters from what it listed."""
    tier = tier_of(s3_session, capacity=3 * OBJECT_BYTES, listing_interval_s=3600)
    for i in range(6):
        assert tier.put(key(i), memoryview(payload(i))) == OK
        time.sleep(0.01)  # distinct write times: the order of eviction
    wait_for_listings(tier)  # the first put's, so that no two listings evict at once
    tier.enforce_capacity()
    assert tier.contains_many([key(i) for i in range(6)]) == [False] * 3 + [True] * 3
    stats = tier.stats()
    assert (stats.chunks, stats.used_bytes, stats.evictions) == (3, 3 * OBJECT_BYTES, 3)
    tier.close()


def wait_for_listings(tier: S3Tier, timeout_s: float = 30) -> None:
    """Wait until no capacity listing of `tier` runs (its threads are named after it)."""
    deadline = time.monotonic() + timeout_s
    while any(t.name == f"kvtier-s3-list-{tier.name}" for t in threading.enumerate()):
        assert time.monotonic() < deadline, f"a listing still runs after {timeout_s} s"
        time.sleep(0.01)


def test_a_put_starts_the_periodic_listing(
        s3_session: S3Endpoint, monkeypatch: pytest.MonkeyPatch) -> None:
    """A put starts a capacity listing on a thread of its own; a put within
    listing_interval_s starts none. Counted when each listing ends, once no listing thread
    is alive (it may end before or after the second put: neither is asserted)."""
    tier = tier_of(s3_session, capacity=OBJECT_BYTES, listing_interval_s=3600)
    listing, ran_on = tier.enforce_capacity, []

    def counted() -> None:
        listing()
        ran_on.append(threading.current_thread())

    monkeypatch.setattr(tier, "enforce_capacity", counted)
    assert tier.put(key(1), memoryview(payload(1))) == OK
    assert tier.put(key(2), memoryview(payload(2))) == OK  # within the interval
    wait_for_listings(tier)
    assert len(ran_on) == 1 and ran_on[0] is not threading.current_thread()
    tier.close()


def test_a_listing_during_a_put_does_not_count_that_put_twice(
        s3_session: S3Endpoint, monkeypatch: pytest.MonkeyPatch) -> None:
    """A listing that sees a put's object before the put counts it must not set its count:
    the put's own count would then add the same chunk again (2 objects, 3 chunks counted).
    Seen in CI under load: the first put's listing overlapping the second put."""
    tier = tier_of(s3_session, capacity=10 * OBJECT_BYTES, listing_interval_s=3600)
    assert tier.put(key(0), memoryview(payload(0))) == OK
    wait_for_listings(tier)
    upload = tier._upload

    def upload_then_list(*args: Any) -> Any:
        result = upload(*args)
        tier.enforce_capacity()  # lists the new object; the put is not counted yet
        return result

    monkeypatch.setattr(tier, "_upload", upload_then_list)
    assert tier.put(key(1), memoryview(payload(1))) == OK
    assert (tier.stats().chunks, tier.stats().used_bytes) == (2, 2 * OBJECT_BYTES)
    monkeypatch.undo()
    tier.enforce_capacity()  # nothing under way: a listing sets the count
    assert (tier.stats().chunks, tier.stats().used_bytes) == (2, 2 * OBJECT_BYTES)
    tier.close()


def test_a_delete_during_a_listing_is_not_undone_by_its_count(
        s3_session: S3Endpoint, monkeypatch: pytest.MonkeyPatch) -> None:
    """A listing counts the objects, then this process deletes one before the listing sets
    the counters: the stale count (the deleted object included) must not be set. The
    listing runs again and counts what is there (the race a contract test once lost)."""
    tier = tier_of(s3_session, capacity=10 * OBJECT_BYTES, listing_interval_s=3600)
    for i in range(2):
        assert tier.put(key(i), memoryview(payload(i))) == OK
    wait_for_listings(tier)
    real, listings = s3_module.enforce_capacity, []

    def listed_then_deleted(*args: Any) -> Any:
        counted = real(*args)
        listings.append(counted[0])
        if len(listings) == 1:
            assert tier.delete(key(0))  # lands between this listing's LIST and its set
        return counted

    monkeypatch.setattr(s3_module, "enforce_capacity", listed_then_deleted)
    tier.enforce_capacity()
    assert listings == [2, 1]
    assert (tier.stats().chunks, tier.stats().used_bytes) == (1, OBJECT_BYTES)
    tier.close()


def test_ttl_days_is_written_as_the_buckets_lifecycle_rule_keeping_others(
        s3_session: S3Endpoint) -> None:
    if not s3_session.emulated:
        pytest.skip("does not rewrite a real bucket's lifecycle rules")
    client = s3_session.client()
    client.put_bucket_lifecycle_configuration(Bucket=s3_session.bucket, LifecycleConfiguration={
        "Rules": [{"ID": "theirs", "Status": "Enabled", "Filter": {"Prefix": "logs/"},
                   "Expiration": {"Days": 30}}]})
    tier = tier_of(s3_session, ttl_days=3, manage_lifecycle=True)
    rules = {r["ID"]: r for r in client.get_bucket_lifecycle_configuration(
        Bucket=s3_session.bucket)["Rules"]}
    ours = rules[f"kvtier-{tier.names.prefix}"]
    assert ours["Expiration"]["Days"] == 3
    assert ours["Filter"]["Prefix"] == tier.names.prefix + "/"
    assert "theirs" in rules
    client.delete_bucket_lifecycle(Bucket=s3_session.bucket)
    tier.close()


def test_an_absent_chunk_is_not_asked_again_until_the_negative_cache_expires(
        s3_session: S3Endpoint) -> None:
    """Another engine's chunk, stored just after this one looked: absent here for up to
    negative_cache_s, then found; this tier's own put clears its entry at once."""
    settings = s3_session.settings()
    other = build_tier(StoreConfig.parse({"tiers": [{"kind": "s3", **settings}]}).tiers[0],
                       LAYOUT)
    tier = build_tier(StoreConfig.parse({"tiers": [{"kind": "s3", **settings,
                                                    "negative_cache_s": 0.5}]}).tiers[0],
                      LAYOUT)
    assert tier.contains(key(1)) is False and tier.contains(key(2)) is False
    assert other.put(key(1), memoryview(payload(1))) == OK
    assert tier.contains(key(1)) is False  # remembered absent
    time.sleep(0.6)
    assert tier.contains(key(1)) is True
    assert tier.put(key(2), memoryview(payload(2))) == OK and tier.contains(key(2))
    tier.close()
    other.close()


@pytest.mark.timing
def test_a_long_prefix_is_looked_up_in_parallel_within_the_deadline(
        s3_session: S3Endpoint) -> None:
    """64 chunks, 40 held: each answer is right, within the deadline."""
    tier = tier_of(s3_session, lookup_timeout_s=10, lookup_concurrency=16)
    for i in range(40):
        tier.put(key(i), memoryview(payload(i)))
    keys = [key(i) for i in range(64)]
    started = time.perf_counter()
    found = tier.contains_many(keys)
    assert found == [True] * 40 + [False] * 24
    assert time.perf_counter() - started < 10
    tier.close()


@pytest.mark.timing
def test_a_lookup_past_its_deadline_reports_the_rest_absent(s3_session: S3Endpoint) -> None:
    tier = tier_of(s3_session, lookup_timeout_s=0.001, lookup_concurrency=1,
                   negative_cache_s=0)
    for i in range(4):
        tier.put(key(i), memoryview(payload(i)))
    started = time.perf_counter()
    # 2,000 HEADs one at a time would take seconds (several ms each on 127.0.0.1); the
    # deadline cuts them at 1 ms (the bound below leaves room for a loaded machine)
    found = tier.contains_many([key(i) for i in range(4)] * 500)
    assert time.perf_counter() - started < 3.0 and not all(found)
    tier.close()


@pytest.mark.parametrize("codec", ["zstd", "lz4"])
def test_compressed_chunks_round_trip(s3_session: S3Endpoint, codec: str) -> None:
    tier = tier_of(s3_session, codec=codec)
    data = bytes(LAYOUT.bytes_per_chunk // 2) + payload(3)[: LAYOUT.bytes_per_chunk // 2]
    assert tier.put(key(3), memoryview(data)) == OK
    out = bytearray(LAYOUT.bytes_per_chunk)
    assert tier.get_into(key(3), memoryview(out)) == OK and bytes(out) == data
    tier.close()


def test_the_probe_sees_every_layouts_copy(s3_session: S3Endpoint, tmp_path: Path) -> None:
    """A chunk counts for the scheduler only when every TP rank's copy is stored."""
    config = config_of(s3_session)
    rank0, rank1 = tiny_layout(16), tiny_layout(32)
    probe = build_probe(config, [rank0, rank1])
    assert probe is not None and probe.blocking_ok is False
    first = build_tier(config, rank0)
    first.put(key(1), memoryview(payload(1, rank0)))
    assert probe.contains(key(1)) is False
    second = build_tier(config, rank1)
    second.put(key(1), memoryview(payload(1, rank1)))
    time.sleep(1.1)  # the probe's negative cache (1 s)
    assert probe.contains(key(1)) is True
    assert isinstance(probe, BatchLookup)
    assert probe.contains_many([key(1), key(2)]) == [True, False]


@pytest.mark.parametrize("conditional", [True, False], ids=["if-none-match", "head-first"])
def test_a_held_chunk_is_not_rewritten(s3_session: S3Endpoint, conditional: bool) -> None:
    """One round trip (a PUT only if absent) or a HEAD first: either way a second put of a
    held chunk is OK, stores nothing, and the object keeps its first bytes."""
    tier = tier_of(s3_session, conditional_put=conditional)
    assert tier.put(key(1), memoryview(payload(1))) == OK
    assert tier.put(key(1), memoryview(payload(2))) == OK
    assert (tier.stats().puts, tier.stats().bytes_written) == (1, LAYOUT.bytes_per_chunk)
    out = bytearray(LAYOUT.bytes_per_chunk)
    assert tier.get_into(key(1), memoryview(out)) == OK and bytes(out) == payload(1)
    tier.close()
