"""`kvtier gc --quota/--max-age` beside running engines on a redis tier: a victim an engine
reads (or writes again) between gc's listing and its deletion is hot now, and stays.

gc listed the server's chunks, chose the least recently used, then deleted them whatever
had happened since: a chunk an engine had just read went, and the engine's next request for
it missed and recomputed. The deletion now asks the server first what it recorded of the
chunk's use: its hash's idle time (every read resets it; checked by the script that deletes
it), and, with `capacity` > 0, its LRU set's score (the only exact record under an LFU
`maxmemory-policy`; without one, its LFU counter). The shared-directory twin:
tests/tools/test_gc_used_since_listed.py.
Against a real redis-server; a chunk's age is set on the server (RESTORE ... IDLETIME, or its
LRU set's score), as the file tests set mtimes.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis
from orphankit import LAYOUT, PART_BYTES, payload, redis_config, redis_tier
from redis.cluster import RedisCluster
from redis_server import RedisClusterNodes, RedisServer
from tierkit import key

from kvtier.core.tier import StoredChunk
from kvtier.tiers import build_tier
from kvtier.tiers.redis.config import RedisTierConfig
from kvtier.tiers.redis.inventory import RedisInventory
from kvtier.tiers.storeconfig import StoreConfig
from kvtier.tools.admin.gc import GcRequest, run_gc

pytestmark = pytest.mark.redis
HOUR_S = 3600


class RacedInventory(RedisInventory):
    """The redis tier's inventory, with an engine's use of the tier injected between gc's
    listing and its deletion (the race, made certain)."""

    def __init__(self, url: str | RedisTierConfig, meanwhile: Callable[[], None],
                 **settings: Any) -> None:
        config = url if isinstance(url, RedisTierConfig) else redis_config(url, **settings)
        super().__init__("redis", config)
        self._meanwhile = meanwhile

    def chunks(self) -> Iterator[StoredChunk]:
        yield from super().chunks()
        self._meanwhile()


def age_by_idle_time(client: redis.Redis | RedisCluster, names: list[str], idle_s: int) -> None:
    """Make each hash look unread for `idle_s` (its value restored with that idle time)."""
    for name in names:
        client.execute_command("RESTORE", name, 0, client.dump(name), "REPLACE",
                               "IDLETIME", idle_s)


def chunk_names(client: redis.Redis | RedisCluster) -> list[str]:
    return sorted(n.decode() for n in client.scan_iter(match="*:c"))


def test_gc_keeps_a_victim_an_engine_read_after_the_listing(redis_url: str) -> None:
    """Capacity 0 (the server's maxmemory bounds the tier): the hash's idle time says."""
    engine = redis_tier(redis_url)
    for i in range(4):
        assert engine.put(key(i), payload(i))
    client = redis.Redis.from_url(redis_url)
    age_by_idle_time(client, chunk_names(client), HOUR_S)
    out = memoryview(bytearray(LAYOUT.bytes_per_chunk))

    def engine_reads_one() -> None:
        assert engine.get_into(key(2), out)  # a hit: the hash's idle time starts again

    inventory = RacedInventory(redis_url, engine_reads_one)
    try:
        [outcome] = run_gc([inventory], GcRequest(max_age_s=600))
    finally:
        inventory.close()
    assert engine.contains(key(2)), "gc deleted a chunk read after it listed it"
    assert [engine.contains(key(i)) for i in range(4)] == [False, False, True, False]
    assert (outcome.removed_chunks, outcome.kept_used, outcome.kept_chunks) == (3, 1, 1)
    engine.close()


def test_gc_keeps_a_victim_written_again_after_the_listing(redis_url: str) -> None:
    """Deleted and stored again by an engine after gc listed it: a new hash, just used."""
    engine = redis_tier(redis_url)
    for i in range(3):
        assert engine.put(key(i), payload(i))
    client = redis.Redis.from_url(redis_url)
    age_by_idle_time(client, chunk_names(client), HOUR_S)

    def engine_writes_one_again() -> None:
        assert engine.delete(key(0))
        assert engine.put(key(0), payload(0))

    inventory = RacedInventory(redis_url, engine_writes_one_again)
    try:
        [outcome] = run_gc([inventory], GcRequest(quota_bytes=1))
    finally:
        inventory.close()
    assert [engine.contains(key(i)) for i in range(3)] == [True, False, False]
    assert (outcome.removed_chunks, outcome.kept_used) == (2, 1)
    engine.close()


def test_with_an_lfu_policy_the_lru_set_says_what_was_read(redis_server: RedisServer) -> None:
    """An LFU `maxmemory-policy` keeps no idle time: with `capacity` > 0 the tier's LRU set
    records each hit (batched: flushed here by the engine's close), and a victim scored
    later than the listing saw stays; the others go, and leave the set."""
    client = redis_server.client()
    client.config_set("maxmemory-policy", "allkeys-lfu")
    url, capacity = redis_server.url, 64 * LAYOUT.bytes_per_chunk
    engine = redis_tier(url, capacity=capacity)
    for i in range(4):
        assert engine.put(key(i), payload(i))
    [index] = [n for n in client.scan_iter(match="*:lru")]
    hour_ago_us = int((time.time() - HOUR_S) * 1e6)
    client.zadd(index, {key(i).hex(): hour_ago_us + i for i in range(4)}, xx=True)
    out = memoryview(bytearray(LAYOUT.bytes_per_chunk))

    def engine_reads_one_and_stops() -> None:
        assert engine.get_into(key(1), out)
        engine.close()  # its pending hits reach the LRU set

    inventory = RacedInventory(url, engine_reads_one_and_stops, capacity=capacity)
    try:
        [outcome] = run_gc([inventory], GcRequest(max_age_s=600))
    finally:
        inventory.close()
    after = redis_tier(url, capacity=capacity)
    assert [after.contains(key(i)) for i in range(4)] == [False, True, False, False]
    assert (outcome.removed_chunks, outcome.kept_used) == (3, 1)
    assert [m.decode() for m in client.zrange(index, 0, -1)] == [key(1).hex()]
    after.close()


def test_with_an_lfu_policy_and_no_lru_set_the_lfu_counter_says_what_was_read(
        redis_server: RedisServer) -> None:
    """An LFU `maxmemory-policy` and `capacity` 0: the server records no time of use, so every
    chunk is listed as used now and `--quota` takes victims in key order; a victim read since
    the listing shows a higher LFU counter (OBJECT FREQ: a cold chunk's rises for certain on a
    use) and stays. It went before: nothing else records a use there."""
    client = redis_server.client()
    client.config_set("maxmemory-policy", "allkeys-lfu")
    engine = redis_tier(redis_server.url)
    for i in range(4):
        assert engine.put(key(i), payload(i))
    for name in chunk_names(client):  # cold: LFU counter 0 (idle for minutes)
        client.execute_command("RESTORE", name, 0, client.dump(name), "REPLACE", "FREQ", 0)
    out = memoryview(bytearray(LAYOUT.bytes_per_chunk))

    def engine_reads_one() -> None:
        assert engine.get_into(key(2), out)  # its counter 0 -> 1

    # A minute's decay between the read and the deletion would take the use back off the
    # counter: start well inside a minute of the server's clock (this host's).
    deadline = time.monotonic() + 20
    while time.time() % 60 > 45 and time.monotonic() < deadline:
        time.sleep(0.1)
    inventory = RacedInventory(redis_server.url, engine_reads_one)
    try:
        [outcome] = run_gc([inventory], GcRequest(quota_bytes=1))
    finally:
        inventory.close()
    assert [engine.contains(key(i)) for i in range(4)] == [False, False, True, False]
    assert (outcome.removed_chunks, outcome.kept_used) == (3, 1)
    engine.close()


def test_a_whole_namespace_goes_whatever_its_use(redis_url: str) -> None:
    """`--namespace` alone evicts a namespace whole: a read since the listing keeps nothing."""
    engine = redis_tier(redis_url)
    for i in range(3):
        assert engine.put(key(i), payload(i))
    out = memoryview(bytearray(LAYOUT.bytes_per_chunk))
    inventory = RacedInventory(redis_url, lambda: engine.get_into(key(0), out))
    try:
        [outcome] = run_gc([inventory], GcRequest(namespace=LAYOUT.digest()))
    finally:
        inventory.close()
    assert not any(engine.contains(key(i)) for i in range(3))
    assert (outcome.removed_chunks, outcome.kept_used) == (3, 0)
    engine.close()


def test_on_a_cluster_each_victim_is_checked_on_its_node(
        redis_cluster: RedisClusterNodes) -> None:
    """A Redis Cluster: each chunk's check-and-delete runs on the node of its slot."""
    config = StoreConfig.parse({"tiers": [{"kind": "redis", "capacity": 0,
                                           "cluster_nodes": redis_cluster.addresses,
                                           "part_bytes": PART_BYTES}]}).tiers[0]
    assert isinstance(config, RedisTierConfig)
    engine: Any = build_tier(config, LAYOUT)
    for i in range(6):
        assert engine.put(key(i), payload(i))
    client = RedisCluster(host="127.0.0.1", port=redis_cluster.nodes[0].port)
    age_by_idle_time(client, chunk_names(client), HOUR_S)
    out = memoryview(bytearray(LAYOUT.bytes_per_chunk))
    inventory = RacedInventory(config, lambda: engine.get_into(key(4), out))
    try:
        [outcome] = run_gc([inventory], GcRequest(max_age_s=600))
    finally:
        inventory.close()
    assert [engine.contains(key(i)) for i in range(6)] == [i == 4 for i in range(6)]
    assert (outcome.removed_chunks, outcome.kept_used) == (5, 1)
    client.close()
    engine.close()
