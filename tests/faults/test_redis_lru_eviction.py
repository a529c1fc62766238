"""A redis-server that evicts on its own (`maxmemory` with `allkeys-lru`, the setting the
redis tier recommends with `capacity: 0`), against a real redis-server on 127.0.0.1.

The server evicts values one by one, not chunks: a chunk's header can outlive its parts.
Lookups asked for the header alone, so such a chunk was "held": the engine planned a load
that then missed, and a put of it was skipped as held. Worse, every lookup refreshed the
header's LRU clock and not its parts', so lookups made headers outlive their parts. Found in
an operator drill: with the scheduler's lookups running beside the puts, half the chunks
lookups called held could not be read. A chunk is now held when its header and its first
part exist (one EXISTS of both: every chunk has a first part), which keeps that part as
recently used as its header too.
"""

from __future__ import annotations

import pytest
import redis
from orphankit import LAYOUT, payload, redis_tier
from redis_server import RedisServer
from tierkit import key

from kvtier.core.tier import OK

pytestmark = pytest.mark.redis


def test_a_header_whose_first_part_was_evicted_is_not_held_and_is_rewritten(
        redis_url: str) -> None:
    tier = redis_tier(redis_url)
    client = redis.Redis.from_url(redis_url)
    names = tier.names.values(key(1))
    try:
        assert tier.put(key(1), payload(1)) == OK
        client.delete(names[1])  # the server's LRU took the first part, not the header
        assert not tier.contains(key(1)) and tier.contains_many([key(1)]) == [False]
        assert tier.put(key(1), payload(1)) == OK and tier.stats().puts == 2  # rewritten
        out = memoryview(bytearray(LAYOUT.bytes_per_chunk))
        assert tier.get_into(key(1), out) == OK and bytes(out) == bytes(payload(1))
        assert tier.contains(key(1))
    finally:
        client.delete(*names)
        tier.close()


def test_under_allkeys_lru_every_chunk_lookups_call_held_can_be_read(
        redis_server: RedisServer) -> None:
    """One part a chunk (part_bytes >= the chunk, as the default 8 MiB is for most models),
    a server that holds about 50 of 200 chunks, and the scheduler's lookups of recent
    prefixes between puts: every chunk a lookup calls held is read whole."""
    client = redis_server.client()
    client.config_set("maxmemory-policy", "allkeys-lru")
    client.config_set("maxmemory", 4 * 1024 * 1024)
    tier = redis_tier(redis_server.url, part_bytes=LAYOUT.bytes_per_chunk)
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
    unreadable = [i for i in held if tier.get_into(key(i), out) != OK]
    assert unreadable == [], f"{len(unreadable)} of {len(held)} chunks held could not be read"
    tier.close()
