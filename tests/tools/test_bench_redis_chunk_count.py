"""The benches that wait for the write-behind to fill a redis-server (`bench link`, `bench
interference` with `--tier redis`) count its chunks by name, against a real redis-server:
when a chunk became one hash (`...:c`), a count of headers (`...:h`) stayed 0 and the wait
never ended."""

from __future__ import annotations

import pytest
import redis
from orphankit import payload, redis_tier
from tierkit import key

from kvtier.tools.bench.emulators.remote_redis import stored_chunks

pytestmark = pytest.mark.redis


def test_stored_chunks_counts_the_tiers_chunks_only(redis_url: str) -> None:
    tier = redis_tier(redis_url, capacity="1MiB")  # an LRU set beside the chunks
    client = redis.Redis.from_url(redis_url)
    try:
        for i in range(3):
            assert tier.put(key(i), payload(i))
        client.set("kvtier:other", b"not a chunk")
        assert stored_chunks(redis_url) == 3
    finally:
        client.delete("kvtier:other", tier.names.index,
                      *(tier.names.chunk(key(i)) for i in range(3)))
        tier.close()
