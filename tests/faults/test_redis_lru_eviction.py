"""A redis-server that evicts on its own (`maxmemory` with `allkeys-lru`, the setting the
redis tier recommends with `capacity: 0`; also allkeys-lfu, and volatile-lru with `ttl_s`),
against a real redis-server on 127.0.0.1.

The server evicts keys one by one. When a chunk was a header value plus a value per part,
it evicted a chunk's later parts alone: lookups (header and first part) called such a chunk
held, the engine planned a load that then missed, and a put of it was skipped as held. Found
in an operator drill: 7 of 16 chunks lookups called held could not be read. A chunk is now
one hash (tiers/redis/names.py), written whole in one transaction and evicted whole: held
means loadable.
"""

from __future__ import annotations

from typing import Any

import pytest
import redis
from orphankit import LAYOUT, payload, redis_tier
from redis_server import RedisServer
from tierkit import key

from kvtier.core.tier import MISSING, OK

pytestmark = pytest.mark.redis


def test_a_hash_without_a_part_is_a_counted_miss_and_is_rewritten(redis_url: str) -> None:
    """No writer of today leaves one (a transaction writes every field), but a hash that lacks
    a part its header needs (an older or foreign writer) is a counted miss, deleted, and the
    next put stores the chunk again."""
    tier = redis_tier(redis_url)  # 16 KiB parts: four a chunk
    client = redis.Redis.from_url(redis_url)
    name = tier.names.chunk(key(1))
    try:
        assert tier.put(key(1), payload(1)) == OK
        assert client.hdel(name, "2") == 1
        out = memoryview(bytearray(LAYOUT.bytes_per_chunk))
        assert tier.get_into(key(1), out) == MISSING and tier.stats().misses == 1
        assert not tier.contains(key(1)) and tier.contains_many([key(1)]) == [False]
        assert tier.put(key(1), payload(1)) == OK and tier.stats().puts == 2  # rewritten
        assert tier.get_into(key(1), out) == OK and bytes(out) == bytes(payload(1))
    finally:
        client.delete(name)
        tier.close()


@pytest.mark.parametrize(("policy", "part_bytes", "settings"), [
    ("allkeys-lru", LAYOUT.bytes_per_chunk, {}),  # one part a chunk (part_bytes >= the chunk)
    ("allkeys-lru", 16 * 1024, {}),  # four parts a chunk
    ("allkeys-lfu", 16 * 1024, {}),
    ("volatile-lru", 12 * 1024, {"ttl_s": 3600}),  # six parts; the server evicts TTL'd keys
])
def test_under_server_eviction_every_chunk_lookups_call_held_can_be_read(
        redis_server: RedisServer, policy: str, part_bytes: int,
        settings: dict[str, Any]) -> None:
    """A server that holds about 50 of 200 chunks, and the scheduler's lookups of recent
    prefixes between puts: every chunk a lookup calls held is read whole, with its bytes.
    With a value per part, 4-part chunks under allkeys-lru left most chunks called held
    unreadable."""
    client = redis_server.client()
    client.config_set("maxmemory-policy", policy)
    client.config_set("maxmemory", 4 * 1024 * 1024)
    tier = redis_tier(redis_server.url, part_bytes=part_bytes, **settings)
    count = 200
    for i in range(count):
        tier.put(key(i), payload(i))
        tier.contains_many([key(j) for j in range(max(0, i - 40), i)])
    client.config_set("maxmemory", 0)  # no eviction from here: the reads' replies use memory
    held = [i for i, found in enumerate(tier.contains_many([key(i) for i in range(count)]))
            if found]
    assert held, "the server evicted every chunk: the drill proved nothing"
    assert client.info("stats")["evicted_keys"] > 0, "nothing evicted: the drill proved nothing"
    out = memoryview(bytearray(LAYOUT.bytes_per_chunk))
    unreadable = []
    for i in held:
        out[:] = bytes(len(out))
        if tier.get_into(key(i), out) != OK or bytes(out) != bytes(payload(i)):
            unreadable.append(i)
    assert unreadable == [], f"{len(unreadable)} of {len(held)} chunks held could not be read"
    tier.close()
