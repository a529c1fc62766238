"""Reads from a remote tier cost one round trip a chunk (a real redis-server on 127.0.0.1).

A load's reads run on threads beside the model runner, where every round trip is also a wait
for the GIL (docs/performance.md, "I/O threads' cores, and the GIL"): the store reads a
remote tier's chunk without asking the server first whether it holds it, and the read's own
"missing" stands for the lookup.
The server's command counters say what went over the wire.
"""

from __future__ import annotations

import pytest
import redis
from tierkit import footprint_bytes, key, tiny_layout

from kvtier.tiers import open_store
from kvtier.tiers.storeconfig import StoreConfig

pytestmark = pytest.mark.redis
LAYOUT = tiny_layout(4)


def payload(i: int) -> bytes:
    return bytes((i * 7 + j) % 251 for j in range(LAYOUT.bytes_per_chunk))


def calls(client: redis.Redis, command: str) -> int:
    stats = client.info("commandstats").get(f"cmdstat_{command}")
    return int(stats["calls"]) if stats else 0


def test_a_remote_chunk_is_read_in_one_round_trip_and_a_vanished_one_is_a_counted_miss(
        redis_url: str) -> None:
    config = StoreConfig.parse({"tiers": [
        {"kind": "memory", "capacity": footprint_bytes("memory", LAYOUT)},  # one chunk
        {"kind": "redis", "url": redis_url, "capacity": 0}]})
    client = redis.Redis.from_url(redis_url)
    with open_store(config, LAYOUT) as store:
        for i in range(4):
            store.put(key(i), memoryview(payload(i)))
        assert store.flush(10)
        assert store.lookup([key(i) for i in range(4)]).tiers == ("redis",) * 3 + ("memory",)
        client.delete(*client.keys(f"*{key(1).hex()}*"))  # gone between lookup and load
        client.config_resetstat()

        spares = [memoryview(bytearray(LAYOUT.bytes_per_chunk)) for _ in range(4)]
        with store.lend_as_landed([key(0), key(2), key(3)], spares, in_order=True) as lending:
            assert [(loan.view.tier, bytes(loan.view.data)) for loan in lending] == [
                ("redis", payload(0)), ("redis", payload(2)), ("memory", payload(3))]
        with store.lend_as_landed([key(1)], spares) as lending:
            assert list(lending) == [] and lending.failed_tier is None  # absent: no fault
        # One HMGET per chunk read from redis (0, 1 and 2), no lookup before it.
        assert calls(client, "hmget") == 3
        assert calls(client, "exists") == 0
        assert store.stats().failures["redis"].get("missing") == 1
