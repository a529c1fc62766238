"""The redis tier's connections have TCP keepalive on, against a real redis-server (and a
3-node Redis Cluster) on 127.0.0.1, read off the connected sockets with getsockopt.

Found in a review: the tier left keepalive to redis-py, which before version 8 (pyproject
allows >= 5) turns it off, so a pooled connection whose peer vanished without a FIN or RST
(a NAT timeout, a node powered off) stayed open for ever and the next call on it waited out
the socket timeout. The tier now sets it, with its own timers, whatever the version.
tiers/redis/client.py says why no `health_check_interval`.
"""

from __future__ import annotations

import socket

import pytest
import redis
from orphankit import LAYOUT, payload, redis_tier
from redis_server import RedisClusterNodes
from tierkit import key

from kvtier.core.tier import OK
from kvtier.tiers import build_tier
from kvtier.tiers.redis.tier import RedisTier
from kvtier.tiers.storeconfig import StoreConfig

pytestmark = pytest.mark.redis


def _assert_keepalive(sock: socket.socket | None) -> None:
    assert sock is not None, "the connection is not connected"
    assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) != 0
    if hasattr(socket, "TCP_KEEPIDLE"):  # Linux: idle 60 s, a probe each 10 s, 3 of them
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE) == 60
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL) == 10
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT) == 3


def test_a_servers_pooled_connections_have_tcp_keepalive(redis_url: str) -> None:
    tier = redis_tier(redis_url)
    try:
        tier.warm(2)
        out = memoryview(bytearray(LAYOUT.bytes_per_chunk))
        assert tier.put(key(1), payload(1)) == OK and tier.get_into(key(1), out) == OK
        client = tier._connected()
        assert isinstance(client, redis.Redis)
        pool = client.connection_pool
        connections = [*pool._available_connections, *pool._in_use_connections]
        assert len(connections) >= 2
        for conn in connections:
            _assert_keepalive(conn._sock)
    finally:
        redis.Redis.from_url(redis_url).delete(tier.names.chunk(key(1)))
        tier.close()


def test_a_clusters_node_connections_have_tcp_keepalive(
        redis_cluster: RedisClusterNodes) -> None:
    config = StoreConfig.parse({"tiers": [{"kind": "redis", "capacity": 0, "part_bytes": "16KiB",
                                           "cluster_nodes": redis_cluster.addresses}]})
    tier = build_tier(config.tiers[0], LAYOUT)
    assert isinstance(tier, RedisTier)
    try:
        out = memoryview(bytearray(LAYOUT.bytes_per_chunk))
        for i in range(6):  # chunks on every node
            assert tier.put(key(i), payload(i)) == OK and tier.get_into(key(i), out) == OK
        client = tier._connected()
        assert isinstance(client, redis.RedisCluster)
        socks = [conn._sock for node in client.get_nodes() if node.redis_connection
                 for conn in node.redis_connection.connection_pool._available_connections]
        assert socks
        for sock in socks:
            _assert_keepalive(sock)
    finally:
        tier.close()
