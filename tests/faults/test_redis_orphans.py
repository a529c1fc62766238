"""Redis puts that the server refuses leave nothing behind (issue 12, item 7), against a real
redis-server with a small `maxmemory` and `maxmemory-policy noeviction`.

A 64 KiB chunk goes as a hash of 4 parts of 16 KiB and a header. With the server squeezed to
a few KiB of headroom, it refuses the chunk ("OOM command not allowed"). When a chunk was a
value per part, the server accepted the first parts and refused the rest, and those parts
stayed (a TTL and a cleanup then bounded them). Now a chunk is one MULTI/EXEC transaction
(tiers/redis/write.py): the server refuses it whole, so no hash is ever left partial; an older
kvtier's values are orphans `kvtier gc` deletes (tests/tools/test_gc_redis_orphans.py).
"""

from __future__ import annotations

import logging

import pytest
import redis
from orphankit import (
    LAYOUT,
    hset_counts,
    partial_chunks,
    payload,
    redis_config,
    redis_tier,
    squeeze,
    squeezed_puts,
)
from redis_server import RedisServer
from tierkit import key

from kvtier.tiers.redis.inventory import RedisInventory

pytestmark = pytest.mark.redis


def test_a_refused_put_leaves_no_part_of_its_chunk(redis_server: RedisServer,
                                                   tight: redis.Redis) -> None:
    tier = redis_tier(redis_server.url)
    refused = list(squeezed_puts(tier, tight, 0))
    assert refused, "no put was refused: the test proved nothing"
    assert hset_counts(tight)[1] > 0, "the server refused no HSET: the test proved nothing"
    tight.config_set("maxmemory", 0)
    assert partial_chunks(tight, fields=5) == [], "a refused put left part of a chunk"
    assert not any(tier.contains(key(i)) for i in refused)
    stats = tier.stats()
    assert stats.dropped_writes >= len(refused) and stats.puts >= 1
    out = memoryview(bytearray(LAYOUT.bytes_per_chunk))
    for i in range(32):
        if tier.contains(key(i)):
            assert tier.get_into(key(i), out).ok and bytes(out) == bytes(payload(i))
    tier.close()


def test_a_chunk_carries_the_tiers_ttl(redis_url: str) -> None:
    tier = redis_tier(redis_url, ttl_s=3600)
    assert tier.put(key(1), payload(1))
    client = redis.Redis.from_url(redis_url)
    assert 0 < client.pttl(tier.names.chunk(key(1))) <= 3_600_000
    client.delete(tier.names.chunk(key(1)))
    tier.close()


def test_a_chunk_whose_index_update_a_full_server_refuses_is_not_kept(
        redis_server: RedisServer, tight: redis.Redis, caplog: pytest.LogCaptureFixture) -> None:
    """capacity > 0: the server lets a put's commit in and, now over maxmemory, refuses the
    LRU index's script (OOM) that should count it. Before the fix that chunk stayed, counted
    by no index: never evicted (no TTL), beyond capacity, missing from `chunks`; found by
    squeezing the server step by step. Now the put deletes it and reports the server full."""
    tier = redis_tier(redis_server.url, capacity=20 * (4096 + LAYOUT.bytes_per_chunk))
    with caplog.at_level(logging.DEBUG, logger="kvtier.tiers.redis.tier"):
        for n, headroom in enumerate(range(0, 256 * 1024, 2 * 1024)):
            squeeze(tight, headroom)
            result = tier.put(key(n), payload(n))
            headers = {raw.decode().split("{")[1][:32] for raw in tight.scan_iter("kvtier:*:c")}
            indexed = {raw.decode() for raw in tight.zrange(tier.names.index, 0, -1)}
            assert headers == indexed, f"put {n} ({result}): chunks the index does not count"
    refusals = [r for r in caplog.records if "index update failed" in r.getMessage()
                and "memory" in r.getMessage()]
    assert refusals, "the index was never refused: the test proved nothing"
    assert tier.stats().chunks == tight.zcard(tier.names.index)
    tier.close()


@pytest.mark.parametrize("prefix", ["", "kvtier:"])
def test_another_applications_keys_under_the_prefix_are_never_chunks_or_orphans(
        redis_url: str, prefix: str) -> None:
    """A server shared with an application whose keys use a 32-hex-digit hash tag (a UUID),
    under the tier's prefix (all of them with key_prefix ""). Found in an operator drill:
    the inventory took any `<x>:{<32 chars>}:<y>` for a chunk's value, so `kvtier gc
    --orphans` deleted `session:{<uuid>}:data`, and `kvtier gc` listed `cart:{<uuid>}:h` as
    a chunk to evict. Now only names of the tier's form count (a layout digest, a key in
    hex, "h" or a part number), as the s3 inventory already required."""
    client = redis.Redis.from_url(redis_url)
    tier = redis_tier(redis_url, key_prefix=prefix)
    assert tier.put(key(1), payload(1))
    foreign = {f"{prefix}session:{{550e8400e29b41d4a716446655440000}}:data": b"a session",
               f"{prefix}cart:{{550e8400e29b41d4a716446655440001}}:h": b"a cart",
               f"{prefix}cart:{{550e8400e29b41d4a716446655440002}}:c": b"a cart",
               f"{prefix}{LAYOUT.digest()}:{{{'Z' * 32}}}:0": b"not hex",
               f"{prefix}config:manifest": b"{}"}
    for name, value in foreign.items():
        client.set(name, value)
    inventory = RedisInventory("redis", redis_config(redis_url, key_prefix=prefix))
    try:
        assert [c.key_hex for c in inventory.chunks()] == [key(1).hex()]
        assert inventory.orphans() == []
        assert list(inventory.manifests()) in ([], [LAYOUT.digest()])
        inventory.remove(list(inventory.chunks()))
        inventory.remove_orphans(inventory.orphans())
        assert {n: client.get(n) for n in foreign} == foreign, "a foreign key was deleted"
    finally:
        client.delete(*foreign, tier.names.chunk(key(1)))
        inventory.close()
        tier.close()


@pytest.mark.parametrize("prefix", ["kv?:", "kv*:", "kv[a]:", "kv\\:"])
def test_a_prefix_with_glob_characters_lists_its_own_chunks_only(
        redis_url: str, prefix: str) -> None:
    """Two deployments share a server under key prefixes "kvX:" and one with a glob
    character. Found in an operator drill: the inventory's SCAN took the prefix for a
    pattern, so "kv?:" and "kv*:" listed (and `kvtier gc` evicted) the other deployment's
    chunks, and "kv[a]:" and "kv\\:" listed none of their own (gc never cleaned them)."""
    ours = redis_tier(redis_url, key_prefix=prefix)
    theirs = redis_tier(redis_url, key_prefix="kvX:")
    assert ours.put(key(1), payload(1)) and theirs.put(key(2), payload(2))
    inventory = RedisInventory("redis", redis_config(redis_url, key_prefix=prefix))
    try:
        assert [c.key_hex for c in inventory.chunks()] == [key(1).hex()]
        assert inventory.remove(list(inventory.chunks())) == 1
        assert not ours.contains(key(1)) and theirs.contains(key(2))
    finally:
        inventory.close()
        ours.close()
        theirs.close()
