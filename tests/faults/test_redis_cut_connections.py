"""A connection to the redis tier's server cut in the middle of a put's transaction (between
its MULTI and its EXEC) or of a read's reply, as a network or a restarting server cuts it,
through a proxy (tests/cutproxy.py) in front of a real redis-server.

What must hold: no call raises; a cut put is a dropped write (counted) that leaves nothing at
the chunk's name (the server discards a client's queued MULTI when it goes), or, cut after
its EXEC went out, the whole chunk; a cut read is a counted miss whose bytes are never
taken for the chunk; the tier is back once the connection is, with every chunk whole.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import pytest
import redis
from cutproxy import CuttingProxy
from orphankit import LAYOUT, payload, redis_tier
from redis_server import RedisServer
from tierkit import key

from kvtier.core.tier import OK, UNAVAILABLE
from kvtier.tiers.redis.tier import RedisTier

pytestmark = pytest.mark.redis
DEADLINE_S = 20.0  # the tier's back-off (retry_max_s 0.5) on a loaded machine, with room


@pytest.fixture
def proxy(redis_server: RedisServer) -> Iterator[CuttingProxy]:
    cutting = CuttingProxy(redis_server.port)
    yield cutting
    cutting.close()


def until(condition: Callable[[], bool]) -> bool:
    deadline = time.monotonic() + DEADLINE_S
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return False


def connected_clients(server: redis.Redis) -> int:
    return int(server.info("clients")["connected_clients"])


def read_back(tier: RedisTier, i: int) -> bool:
    out = memoryview(bytearray(LAYOUT.bytes_per_chunk))
    result = tier.get_into(key(i), out)
    assert not result.ok or bytes(out) == bytes(payload(i)), "a hit with wrong bytes"
    return result.ok


# Bytes client-to-server after which the put is cut: in its HEXISTS (107 bytes), then past
# its MULTI and DEL (218) in its first HSET, in its second part, in the header's HSET (from
# 66,202: four parts of 16 KiB, the header 4 KiB), before EXEC (at ~70,400).
@pytest.mark.parametrize("up_bytes", [60, 260, 30_000, 68_500])
def test_a_put_cut_before_its_exec_leaves_nothing_and_the_tier_recovers(
        redis_server: RedisServer, proxy: CuttingProxy, up_bytes: int) -> None:
    server = redis_server.client()
    tier = redis_tier(proxy.url, retry_max_s=0.5, ttl_s=3600)
    name = tier.names.chunk(key(1))
    try:
        # Connected, through the proxy (reads and writes; lookups have connections of
        # their own, which a put does not use).
        tier.warm(1)
        before = connected_clients(server)
        proxy.cut(up=up_bytes)
        assert tier.put(key(1), payload(1)) == UNAVAILABLE
        assert tier.stats().dropped_writes == 1
        assert until(lambda: connected_clients(server) < before), "the cut never reached it"
        assert not server.exists(name), "a cut transaction left part of its chunk"
        assert server.info("commandstats").get("cmdstat_exec", {}).get("calls", 0) == 0
        proxy.cut()
        assert until(lambda: tier.put(key(1), payload(1)) == OK)
        assert read_back(tier, 1)
    finally:
        tier.close()


def test_a_put_cut_after_its_exec_is_dropped_and_its_chunk_whole(
        redis_server: RedisServer, proxy: CuttingProxy) -> None:
    """The EXEC went out, its reply was cut: the put is counted dropped, and the chunk the
    server committed is whole and read back."""
    server = redis_server.client()
    tier = redis_tier(proxy.url, retry_max_s=0.5)
    try:
        tier.warm(1)
        # Replies: HEXISTS ":0", MULTI "+OK", six "+QUEUED" (DEL, four parts, the header),
        # then EXEC's array, which the server sends once it ran the transaction: cut in it.
        proxy.cut(down=len(b":0\r\n+OK\r\n") + 6 * len(b"+QUEUED\r\n") + 2)
        assert tier.put(key(1), payload(1)) == UNAVAILABLE
        assert until(lambda: server.exists(tier.names.chunk(key(1))) == 1)
        proxy.cut()
        assert until(lambda: read_back(tier, 1))
        assert tier.stats().dropped_writes == 1
    finally:
        tier.close()


# Bytes of the read's reply after which it is cut: in the array's header line, in the chunk's
# header value, in its second part, in the PEXPIRE's reply (after every part).
REPLY_BYTES = len(b"*5\r\n$4096\r\n\r\n") + 4096 + 4 * (len(b"$16384\r\n\r\n") + 16384)


@pytest.mark.parametrize("down_bytes", [2, 2000, 25_000, REPLY_BYTES + 2])
def test_a_read_cut_mid_reply_is_a_counted_miss_then_reads_again(
        redis_server: RedisServer, proxy: CuttingProxy, down_bytes: int) -> None:
    tier = redis_tier(proxy.url, retry_max_s=0.5, ttl_s=3600)
    try:
        assert tier.put(key(1), payload(1)) == OK
        proxy.cut(down=down_bytes)
        out = memoryview(bytearray(LAYOUT.bytes_per_chunk))
        assert tier.get_into(key(1), out) == UNAVAILABLE
        assert tier.stats().misses == 1 and tier.stats().hits == 0
        proxy.cut()
        assert until(lambda: read_back(tier, 1))
        assert tier.stats().corrupt_reads == 0
    finally:
        tier.close()
