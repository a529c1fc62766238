"""A Redis Cluster resharding under the redis tier: a chunk's slot migrating from one node to
another (ASK redirections), then moved (MOVED), against three real redis-server nodes.

Found in a hunt: a put of a new chunk in a migrating slot was dropped (the slot's node
answers a key it lacks with ASK, and the whole transaction with EXECABORT; redis-py does not
follow ASK for a transaction), with a warning that the server "refused a write": every new
chunk of a migrating slot, for as long as the resharding lasted. The put now follows the
ASK to the slot's new node (tiers/redis/write.py). Lookups, reads and deletes followed the
redirections already; they are checked here too: no call raises, every hit is the chunk's.
"""

from __future__ import annotations

import pytest
from orphankit import LAYOUT, payload
from redis.cluster import key_slot
from redis_server import RedisClusterNodes, RedisServer
from tierkit import key

from kvtier.core.tier import OK
from kvtier.tiers import build_tier
from kvtier.tiers.redis.tier import RedisTier
from kvtier.tiers.storeconfig import StoreConfig

pytestmark = pytest.mark.redis


def cluster_tier(cluster: RedisClusterNodes) -> RedisTier:
    config = StoreConfig.parse({"tiers": [{"kind": "redis", "capacity": 0,
                                           "cluster_nodes": cluster.addresses,
                                           "part_bytes": 16 * 1024, "retry_max_s": 0.5}]})
    tier = build_tier(config.tiers[0], LAYOUT)
    assert isinstance(tier, RedisTier)
    return tier


def node_id(node: RedisServer) -> str:
    return str(node.client().execute_command("CLUSTER", "MYID").decode())


def owner_of(cluster: RedisClusterNodes, slot: int) -> RedisServer:
    for first, last, primary, *_ in cluster.nodes[0].client().execute_command(
            "CLUSTER", "SLOTS"):
        if first <= slot <= last:
            return next(node for node in cluster.nodes if node.port == int(primary[1]))
    raise AssertionError(f"slot {slot} not covered")


def test_a_put_into_a_migrating_slot_lands_on_its_new_node(
        redis_cluster: RedisClusterNodes) -> None:
    tier = cluster_tier(redis_cluster)
    out = memoryview(bytearray(LAYOUT.bytes_per_chunk))

    def reads_back(i: int) -> bool:
        result = tier.get_into(key(i), out)
        assert not result.ok or bytes(out) == bytes(payload(i)), "a hit with wrong bytes"
        return result.ok

    try:
        assert tier.put(key(1), payload(1)) == OK  # on the slot's node before the move
        name = tier.names.chunk(key(1))
        slot = key_slot(name.encode())
        source = owner_of(redis_cluster, slot)
        target = next(node for node in redis_cluster.nodes if node is not source)
        new = next(i for i in range(2, 10_000)
                   if key_slot(tier.names.chunk(key(i)).encode()) == slot)
        target.client().execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING",
                                        node_id(source))
        source.client().execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING",
                                        node_id(target))
        assert tier.put(key(new), payload(new)) == OK, "a new chunk of a migrating slot"
        asking = target.client(single_connection_client=True)  # the slot's node to be
        asking.execute_command("ASKING")
        assert asking.hlen(tier.names.chunk(key(new))) == 5  # header and four parts
        asking.close()
        assert tier.contains(key(new)) and reads_back(new)
        assert tier.contains(key(1)) and reads_back(1)  # not moved yet: on the source
        source.client().execute_command("MIGRATE", "127.0.0.1", target.port, "", 0, 5000,
                                        "KEYS", name)
        assert tier.contains_many([key(1), key(new)]) == [True, True]
        assert reads_back(1) and reads_back(new)
        for node in redis_cluster.nodes:
            node.client().execute_command("CLUSTER", "SETSLOT", slot, "NODE", node_id(target))
        assert reads_back(1) and reads_back(new)
        assert tier.delete(key(1)) and tier.put(key(1), payload(1)) == OK and reads_back(1)
        stats = tier.stats()
        assert (stats.dropped_writes, stats.misses, stats.corrupt_reads) == (0, 0, 0)
    finally:
        tier.close()
