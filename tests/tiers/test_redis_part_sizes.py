"""Engines whose redis tiers cut chunks with different `part_bytes` share one server, as
during a rolling change of the setting, against a real redis-server on 127.0.0.1.

Found by an operator drill: a tier judged every part by its own `part_bytes`, so a chunk
another engine cut otherwise was "corrupt" (a warning, `corrupt_reads`) and deleted, and
a chunk cut finer than the reader's names reach "lost a part" and deleted: each half of
the fleet destroyed the other's chunks. A reader now takes the part size from the chunk's
first part (when every part agrees with it; a damaged chunk is still corrupt:
tests/faults/test_redis_faults.py) and fetches the parts beyond its own names in one more
round trip. The checksum still guards every byte.
"""

from __future__ import annotations

import pytest
import redis
from orphankit import LAYOUT, payload, redis_tier
from tierkit import key

from kvtier.tiers.redis.tier import RedisTier

pytestmark = pytest.mark.redis
KIB = 1024  # LAYOUT's chunks are 64 KiB


def _read(tier: RedisTier, i: int) -> bool:
    out = memoryview(bytearray(LAYOUT.bytes_per_chunk))
    hit = tier.get_into(key(i), out).ok
    assert not hit or bytes(out) == bytes(payload(i)), "a hit returned wrong bytes"
    return hit


@pytest.mark.parametrize(("writer_kib", "reader_kib"),
                         [(16, 32), (32, 16), (16, 64), (64, 16), (48, 16), (16, 48)])
def test_a_chunk_cut_with_another_part_bytes_is_read_not_deleted(
        redis_url: str, writer_kib: int, reader_kib: int) -> None:
    writer = redis_tier(redis_url, part_bytes=writer_kib * KIB)
    reader = redis_tier(redis_url, part_bytes=reader_kib * KIB)
    client = redis.Redis.from_url(redis_url)
    i = writer_kib * 100 + reader_kib
    name = writer.names.chunk(key(i))
    try:
        assert writer.put(key(i), payload(i))
        stored = set(client.hkeys(name))
        assert len(stored) == 1 + -(-LAYOUT.bytes_per_chunk // (writer_kib * KIB))
        assert _read(reader, i), "another engine's chunk was not read"
        assert _read(writer, i)
        stats = reader.stats()
        assert (stats.hits, stats.misses, stats.corrupt_reads) == (1, 0, 0)
        assert set(client.hkeys(name)) == stored
    finally:
        client.delete(name)
        writer.close()
        reader.close()


def test_reading_a_chunk_cut_finer_refreshes_its_ttl(redis_url: str) -> None:
    writer = redis_tier(redis_url, part_bytes=16 * KIB, ttl_s=3600)
    reader = redis_tier(redis_url, part_bytes=64 * KIB, ttl_s=3600)
    client = redis.Redis.from_url(redis_url)
    name = writer.names.chunk(key(7))
    try:
        assert writer.put(key(7), payload(7))
        assert client.hlen(name) == 5 and len(reader.names.fields()) == 2
        client.pexpire(name, 50_000)  # well below the tiers' ttl_s
        assert _read(reader, 7)
        assert client.pttl(name) > 50_000, client.pttl(name)
    finally:
        client.delete(name)
        writer.close()
        reader.close()


def test_a_first_part_shorter_than_any_writers_parts_is_corrupt_in_one_read(
        redis_url: str) -> None:
    """A 1-byte first part (damage, not another engine's cut: none cuts under 1 KiB) is a
    corrupt chunk, judged on the one HMGET: its size is never taken for a part size, which
    asked the server for a name per byte of the chunk in a second read (65,535 names here;
    millions for a large chunk)."""
    tier = redis_tier(redis_url, part_bytes=1024 * KIB)  # one part a 64 KiB chunk
    client = redis.Redis.from_url(redis_url)
    assert tier.put(key(9), payload(9))
    client.hset(tier.names.chunk(key(9)), "0", b"x")
    client.config_resetstat()
    out = memoryview(bytearray(LAYOUT.bytes_per_chunk))
    assert not tier.get_into(key(9), out).ok and tier.stats().corrupt_reads == 1
    assert client.info("commandstats")["cmdstat_hmget"]["calls"] == 1
    tier.close()
