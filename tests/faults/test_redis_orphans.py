"""Redis puts that fail part-way leave nothing behind (issue 12, item 7), against a real
redis-server with a small `maxmemory` and `maxmemory-policy noeviction`.

A 64 KiB chunk goes as 4 parts of 16 KiB then a header. With the server squeezed to a few
KiB of headroom, it accepts the first parts and refuses the rest ("OOM command not allowed").
Before the fix those parts stayed for ever: no header (never read), no TTL, no LRU entry.
Now: parts carry a 60 s TTL until the header's commit lifts it, the tier deletes them when
the server refuses the write, and `kvtier gc` deletes any still there (through the tier's
inventory; gc itself: tests/tools/test_gc_redis_orphans.py). The partial writes are
seen in the server's own command counters (SETs executed and SETs refused in one put).
"""

from __future__ import annotations

import logging
from typing import Any

import pytest
import redis
from orphankit import (
    LAYOUT,
    headerless,
    payload,
    redis_config,
    redis_tier,
    squeeze,
    squeezed_puts,
)
from redis_server import RedisServer
from tierkit import key

from kvtier.tiers.redis.inventory import RedisInventory
from kvtier.tiers.redis.write import PART_TTL_MS

pytestmark = pytest.mark.redis
def test_a_refused_put_deletes_its_parts_at_once(redis_server: RedisServer,
                                                 tight: redis.Redis) -> None:
    tier = redis_tier(redis_server.url)
    partial = 0
    for was_partial in squeezed_puts(tier, tight, 0):
        partial += was_partial
        assert headerless(tight) == {}, "a refused put left parts behind"
    assert partial >= 1, "no put was refused part-way: the test proved nothing"
    stats = tier.stats()
    assert stats.dropped_writes >= partial and stats.puts >= 1
    tier.close()


def test_parts_left_by_a_failed_cleanup_expire_and_gc_deletes_them(
        redis_server: RedisServer, tight: redis.Redis,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The cleanup itself fails (injected): the parts left carry the short TTL, so the
    server deletes them within PART_TTL_MS, and the tier's inventory (what `kvtier gc
    --orphans` runs on) deletes them now, leaving every committed chunk readable."""
    def cleanup_fails(client: Any, names: list[str]) -> int:
        raise redis.ConnectionError("injected: the connection dropped before the cleanup")

    monkeypatch.setattr("kvtier.tiers.redis.tier.abort_chunk", cleanup_fails)
    tier = redis_tier(redis_server.url)
    assert any(list(squeezed_puts(tier, tight, 0)))  # every put made, some partial
    tight.config_set("maxmemory", 0)
    left = headerless(tight)
    assert left, "a partial put must have left parts (the cleanup was disabled)"
    for names in left.values():
        for name in names:
            assert 0 < tight.pttl(name) <= PART_TTL_MS, f"{name} has no short TTL"
    committed = [i for i in range(32) if tier.contains(key(i))]
    assert committed
    for i in committed:  # a committed chunk's TTL was lifted by the commit
        assert all(tight.pttl(n) == -1 for n in tier.names.values(key(i)))

    # What `kvtier gc --orphans` runs on (tests/tools/test_gc_redis_orphans.py): the tier's
    # inventory lists the parts left as orphans (listing deletes nothing), then removes them.
    inventory = RedisInventory("redis", redis_config(redis_server.url))
    try:
        orphans = inventory.orphans()
        assert sorted(n for o in orphans for n in o.locations) == \
            sorted(n for names in left.values() for n in names)
        assert headerless(tight) == left
        inventory.remove_orphans(orphans)
    finally:
        inventory.close()
    assert headerless(tight) == {}
    out = bytearray(LAYOUT.bytes_per_chunk)
    for i in committed:
        assert tier.get_into(key(i), memoryview(out)).ok
    tier.close()


def test_the_commit_lifts_the_part_ttl_to_the_tiers_own(redis_url: str) -> None:
    """With `ttl_s`, the parts get the chunk's TTL, not the 60 s of an uncommitted part."""
    tier = redis_tier(redis_url, ttl_s=3600)
    assert tier.put(key(1), payload(1))
    client = redis.Redis.from_url(redis_url)
    ttls = [client.pttl(name) for name in tier.names.values(key(1))]
    assert all(PART_TTL_MS < ttl <= 3_600_000 for ttl in ttls), ttls
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
            headers = {raw.decode().split("{")[1][:32] for raw in tight.scan_iter("kvtier:*:h")}
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
        client.delete(*foreign, *tier.names.values(key(1)))
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
