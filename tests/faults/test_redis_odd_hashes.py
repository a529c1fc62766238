"""Odd values at a chunk's name that no kvtier of today writes, against a real redis-server
on 127.0.0.1: a hash whose header field someone deleted (HDEL), a hash of foreign fields
only, a list or a string at the name, a header forged (a valid checksum) to claim a body far
larger than any chunk's, a value of another type at the namespace manifest's name.

Found in a hunt of the one-hash format: lookups and puts asked EXISTS, so a hash without its
header was "held" for good: every lookup planned a load that missed (uncounted, unlogged,
never removed) and every put of the chunk was skipped as held; a list at the name was held
until a read removed it. A forged header's body size asked the server for a field per
kilobyte it claimed (1 GiB: a million field names, 1.2 s of the engine's read). A hash at
the manifest's name failed the manifest's write, a warning after every put. Now held means
the header field is there (HEXISTS; a foreign type is not held), a put replaces whatever is
at the name, parts without a header are a logged miss and removed, a body larger than any
chunk's is corrupt before a field more is asked, and the manifest replaces a foreign value.
Likewise the LRU set (`capacity` > 0): a string at its name failed every put's index update
(WRONGTYPE), so every put was dropped; the index's script now replaces it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import pytest
import redis
from orphankit import LAYOUT, payload, redis_tier
from tierkit import key

from kvtier.core.chunkformat import ChunkHeader, _pack
from kvtier.core.tier import MISSING, OK, Failure
from kvtier.tiers.manifest import NamespaceManifest, parse_manifest
from kvtier.tiers.redis.tier import RedisTier

pytestmark = pytest.mark.redis
LOGGER = "kvtier.tiers.redis.tier"


def _header_deleted(client: redis.Redis, tier: RedisTier, name: str) -> None:
    assert tier.put(key(1), payload(1)) == OK
    assert client.hdel(name, "h") == 1


ODD_VALUES: dict[str, Callable[[redis.Redis, RedisTier, str], object]] = {
    "header deleted": _header_deleted,
    "foreign fields only": lambda client, tier, name: client.hset(name, "note", b"x"),
    "a list": lambda client, tier, name: client.rpush(name, b"x"),
    "a string": lambda client, tier, name: client.set(name, b"x"),
}


@pytest.mark.parametrize("odd", sorted(ODD_VALUES))
def test_an_odd_value_at_a_chunks_name_is_not_held_and_a_put_replaces_it(
        redis_url: str, odd: str) -> None:
    tier = redis_tier(redis_url)
    client = redis.Redis.from_url(redis_url)
    name = tier.names.chunk(key(1))
    try:
        assert tier.put(key(2), payload(2)) == OK
        ODD_VALUES[odd](client, tier, name)
        assert not tier.contains(key(1))
        assert tier.contains_many([key(1), key(2)]) == [False, True]
        assert tier.put(key(1), payload(1)) == OK, "skipped as held: never stored again"
        assert tier.contains(key(1)) and client.type(name) == b"hash"
        out = memoryview(bytearray(LAYOUT.bytes_per_chunk))
        assert tier.get_into(key(1), out) == OK and bytes(out) == bytes(payload(1))
    finally:
        client.delete(name, tier.names.chunk(key(2)))
        tier.close()


def test_parts_without_their_header_are_a_logged_miss_and_removed(
        redis_url: str, caplog: pytest.LogCaptureFixture) -> None:
    tier = redis_tier(redis_url)
    client = redis.Redis.from_url(redis_url)
    name = tier.names.chunk(key(1))
    try:
        _header_deleted(client, tier, name)
        out = memoryview(bytearray(LAYOUT.bytes_per_chunk))
        with caplog.at_level(logging.INFO, logger=LOGGER):
            assert tier.get_into(key(1), out) == MISSING
        assert "lacks its header" in caplog.text
        assert tier.stats().misses == 1 and not client.exists(name)
    finally:
        client.delete(name)
        tier.close()


def test_a_header_claiming_a_huge_body_is_corrupt_without_asking_for_its_parts(
        redis_url: str) -> None:
    """A header with a valid checksum (anyone who can write to the server can forge one)
    whose body is 1 GiB, over four parts of 1 KiB (the smallest part a writer cuts: the
    reader takes it for a writer's part size)."""
    tier = redis_tier(redis_url)
    client = redis.Redis.from_url(redis_url)
    name = tier.names.chunk(key(5))
    try:
        header = _pack(key(5), tier.names.digest, ChunkHeader(
            2, LAYOUT.bytes_per_chunk, 0, body_bytes=1 << 30))
        client.hset(name, mapping={"h": header, **{str(i): b"a" * 1024 for i in range(4)}})
        reads_before = client.info("commandstats").get("cmdstat_hmget", {}).get("calls", 0)
        out = memoryview(bytearray(LAYOUT.bytes_per_chunk))
        assert tier.get_into(key(5), out).failure is Failure.CORRUPT
        reads = client.info("commandstats")["cmdstat_hmget"]["calls"] - reads_before
        assert reads == 1, f"{reads} HMGETs: the forged size's fields were asked for"
        assert tier.stats().corrupt_reads == 1 and not client.exists(name)
    finally:
        client.delete(name)
        tier.close()


def test_a_foreign_value_at_the_manifests_name_is_replaced_not_warned_on_each_put(
        redis_url: str, caplog: pytest.LogCaptureFixture) -> None:
    tier = redis_tier(redis_url)
    client = redis.Redis.from_url(redis_url)
    name = f"kvtier:{tier.names.digest}:manifest"
    try:
        client.hset(name, "note", b"x")
        manifest = NamespaceManifest(tier.names.digest, "model", "f" * 32, 1, {})
        tier.keep_manifest(manifest)
        with caplog.at_level(logging.WARNING, logger=LOGGER):
            for i in range(3):
                assert tier.put(key(i), payload(i)) == OK
        assert "manifest not written" not in caplog.text
        written = parse_manifest(client.get(name), tier.names.digest)
        assert written is not None and written.model == "model"
    finally:
        client.flushdb()
        tier.close()


def test_a_foreign_value_at_the_lru_sets_name_is_replaced_and_puts_are_kept(
        redis_url: str) -> None:
    tier = redis_tier(redis_url, capacity=16 * LAYOUT.bytes_per_chunk)
    client = redis.Redis.from_url(redis_url)
    try:
        client.set(tier.names.index, b"another application's string")
        assert [tier.put(key(i), payload(i)) for i in range(3)] == [OK] * 3
        assert client.type(tier.names.index) == b"zset"
        assert client.zcard(tier.names.index) == 3 and tier.stats().chunks == 3
    finally:
        client.flushdb()
        tier.close()
