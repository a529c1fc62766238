"""Fault drill: a redis tier with a `capacity` whose evicted chunks' deletes fail.

The tier's LRU index (tiers/redis/index.py) pops the chunks beyond capacity from its sorted
set, then deletes their hashes in a second round trip. Where that delete failed (the server
marked down by another thread's failed call, a timeout under load, a Cluster node down while
the index's answers) the hashes stayed on the server, no longer in the index: never evicted
by it, uncounted, for ever (no `ttl_s`; a server with `noeviction` fills up one day). A leak
soak of Redis faults found the server holding more chunks than the capacity after each.
Now the tier deletes them with a later eviction's.

A real redis-server; the fault (a delete that fails) is injected into the tier's calls.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import redis
from tierkit import footprint_bytes, key, tiny_layout

from kvtier.errors import TierUnavailable
from kvtier.tiers import build_tier
from kvtier.tiers.redis.tier import RedisTier
from kvtier.tiers.storeconfig import StoreConfig

pytestmark = pytest.mark.redis
LAYOUT = tiny_layout()
CAPACITY = 4
FAULTS = 6  # evictions whose deletes fail


def chunk_hashes(url: str) -> int:
    return len(redis.Redis.from_url(url).keys("*:c"))


def test_chunks_evicted_while_their_deletes_fail_are_deleted_later(
        redis_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    config = StoreConfig.parse({"tiers": [{
        "kind": "redis", "url": redis_url,
        "capacity": CAPACITY * footprint_bytes("redis", LAYOUT)}]})
    tier = build_tier(config.tiers[0], LAYOUT)
    assert isinstance(tier, RedisTier)
    data = memoryview(bytes(LAYOUT.bytes_per_chunk))
    for i in range(CAPACITY):
        assert tier.put(key(i), data)
    run = tier._run
    failing = [FAULTS]

    def deletes_fail(endpoint: str, call: Callable[[Any], Any], **options: Any) -> Any:
        if call.__name__ == "delete" and failing[0]:
            failing[0] -= 1
            raise TierUnavailable("injected: the server did not answer the delete")
        return run(endpoint, call, **options)  # options: a lookup's

    monkeypatch.setattr(tier, "_run", deletes_fail)
    for i in range(CAPACITY, CAPACITY + FAULTS):  # each evicts one, whose delete fails
        assert tier.put(key(i), data)
    assert failing == [0]
    for i in range(100, 100 + 2 * CAPACITY):  # the server answers again
        assert tier.put(key(i), data)
    assert chunk_hashes(redis_url) == CAPACITY, "evicted chunks left on the server"
    assert tier.stats().chunks == CAPACITY
    tier.close()


def test_a_chunk_stored_again_after_its_delete_failed_is_counted_and_kept(
        redis_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    config = StoreConfig.parse({"tiers": [{
        "kind": "redis", "url": redis_url,
        "capacity": CAPACITY * footprint_bytes("redis", LAYOUT)}]})
    tier = build_tier(config.tiers[0], LAYOUT)
    assert isinstance(tier, RedisTier)
    data = memoryview(bytes(LAYOUT.bytes_per_chunk))
    for i in range(CAPACITY):
        assert tier.put(key(i), data)
    run = tier._run
    failing = [1]

    def delete_fails(endpoint: str, call: Callable[[Any], Any], **options: Any) -> Any:
        if call.__name__ == "delete" and failing[0]:
            failing[0] -= 1
            raise TierUnavailable("injected: the server did not answer the delete")
        return run(endpoint, call, **options)  # options: a lookup's

    monkeypatch.setattr(tier, "_run", delete_fails)
    assert tier.put(key(CAPACITY), data)  # evicts key(0): its delete fails
    assert chunk_hashes(redis_url) == CAPACITY + 1  # key(0)'s, outside the index
    # Stored again: written anew and counted (not HELD, left outside the index), and no
    # later eviction's delete throws it away.
    assert tier.put(key(0), data)
    assert tier.put(key(50), data)
    assert tier.contains(key(0))
    assert chunk_hashes(redis_url) == CAPACITY
    tier.close()
