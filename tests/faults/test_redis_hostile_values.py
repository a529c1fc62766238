"""Values at a chunk's name that no kvtier wrote (another application's key, a corrupt
writer), against a real redis-server on 127.0.0.1.

Found in a review: a huge value in a chunk's hash was read whole into memory (a fresh
`bytes` of its size) before its size was judged, and a value of another type at the chunk's
name (not a hash) failed every read as an error reply, never removed, while lookups called
the chunk held. Now each value's length is judged before a byte of it is read: one longer
than any of the chunk's is refused unread (the connection dropped), and a value of another
type is a corrupt chunk; both are counted misses, and the value is deleted.
"""

from __future__ import annotations

import tracemalloc

import pytest
import redis
from orphankit import LAYOUT, payload, redis_tier
from tierkit import key

from kvtier.core.tier import OK

pytestmark = pytest.mark.redis
HUGE_BYTES = 64 * 1024 * 1024  # a thousand times the chunk (64 KiB)


@pytest.mark.parametrize("field", ["h", "0", "3"])
def test_a_huge_value_in_a_chunk_is_a_counted_miss_not_read_into_memory(
        redis_url: str, field: str) -> None:
    tier = redis_tier(redis_url)  # four parts of 16 KiB a chunk
    client = redis.Redis.from_url(redis_url)
    name = tier.names.chunk(key(1))
    try:
        assert tier.put(key(1), payload(1)) == OK and tier.put(key(2), payload(2)) == OK
        client.hset(name, field, b"\0" * HUGE_BYTES)
        out = memoryview(bytearray(LAYOUT.bytes_per_chunk))
        tracemalloc.start()
        try:
            result = tier.get_into(key(1), out)
            peak_bytes = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert not result.ok
        assert peak_bytes < HUGE_BYTES // 4, f"{peak_bytes} bytes allocated by the read"
        stats = tier.stats()
        assert (stats.misses, stats.corrupt_reads) == (1, 1)
        assert not client.exists(name), "the bad chunk was not deleted"
        assert tier.available()
        assert tier.get_into(key(2), out) == OK and bytes(out) == bytes(payload(2))
    finally:
        client.delete(name, tier.names.chunk(key(2)))
        tier.close()


def test_a_value_of_another_type_at_a_chunks_name_is_a_corrupt_miss_and_removed(
        redis_url: str) -> None:
    tier = redis_tier(redis_url)
    client = redis.Redis.from_url(redis_url)
    name = tier.names.chunk(key(3))
    try:
        client.set(name, b"another application's string")
        out = memoryview(bytearray(LAYOUT.bytes_per_chunk))
        assert not tier.get_into(key(3), out).ok
        stats = tier.stats()
        assert (stats.misses, stats.corrupt_reads) == (1, 1)
        assert not client.exists(name) and not tier.contains(key(3))
        assert tier.put(key(3), payload(3)) == OK
        assert tier.get_into(key(3), out) == OK and bytes(out) == bytes(payload(3))
    finally:
        client.delete(name)
        tier.close()
