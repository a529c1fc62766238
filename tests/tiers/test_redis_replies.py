"""The redis tier's reads taken off the socket into the caller's buffer
(kvtier.tiers.redis.replies), against a real redis-server, and the reply parser against a
socket fed damaged replies (the faults a server or a network can inject).

The story: a chunk stored as is lands in the read's buffer with no copy of ours (its part comes
back as a view of that buffer), an encoded one goes through bytes and decodes as before; a
reply cut short, badly framed or refused is an error of redis-py's kinds, and a connection left
mid-reply (a server that stalls past the timeout) is dropped, so the next read has a clean one.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
import redis
from redis._parsers import _RESP2Parser
from redis.cluster import ClusterNode, RedisCluster
from redis_server import RedisClusterNodes
from tierkit import key, make_tier

from kvtier.core.layout import KVLayout
from kvtier.tiers import open_store
from kvtier.tiers.redis.read import ChunkReader
from kvtier.tiers.redis.replies import Replies, readable
from kvtier.tiers.redis.tier import RedisTier
from kvtier.tiers.storeconfig import StoreConfig

pytestmark = pytest.mark.redis
LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_size=64, dtype="bfloat16",
                  tokens_per_chunk=64)


def _tier(url: str, tmp_path: Path, **options: object) -> RedisTier:
    import tierkit

    tierkit.REDIS_URL = url
    tier = make_tier("redis", tmp_path, LAYOUT, 8, **options)
    assert isinstance(tier, RedisTier)
    return tier


def _reader(tier: RedisTier) -> ChunkReader:
    """A reader of `tier`'s chunks, as the tier builds its own."""
    return ChunkReader(tier.names, tier.encoder, tier.chunk_bytes, tier.part_bytes, tier.ttl_ms)


def _payload(i: int) -> memoryview:
    rng = np.random.default_rng(i)
    return memoryview(rng.integers(0, 255, LAYOUT.bytes_per_chunk, dtype=np.uint8).tobytes())


def test_a_plain_chunk_is_read_straight_into_the_buffer(redis_url: str, tmp_path: Path) -> None:
    tier = _tier(redis_url, tmp_path, part_bytes=16 << 10)  # 64 KiB: four parts
    tier.put(key(1), _payload(1))
    out = memoryview(bytearray(LAYOUT.bytes_per_chunk))
    client = redis.Redis.from_url(redis_url)
    values = _reader(tier).fetch(client, tier.names.chunk(key(1)), key(1), out)
    client.close()
    parts = [v for v in values[1:] if v is not None]
    assert len(parts) == 4
    assert all(isinstance(p, memoryview) and p.obj is out.obj for p in parts)
    assert bytes(out) == bytes(_payload(1))
    out[:] = bytes(len(out))
    assert tier.get_into(key(1), out).ok and bytes(out) == bytes(_payload(1))
    tier.close()


def test_an_encoded_chunk_goes_through_bytes(redis_url: str, tmp_path: Path) -> None:
    tier = _tier(redis_url, tmp_path, codec="zstd")
    data = memoryview(bytes(LAYOUT.bytes_per_chunk // 2) + bytes(_payload(2))[::2])
    tier.put(key(2), data)
    out = memoryview(bytearray(LAYOUT.bytes_per_chunk))
    client = redis.Redis.from_url(redis_url)
    values = _reader(tier).fetch(client, tier.names.chunk(key(2)), key(2), out)
    client.close()
    assert all(v is None or isinstance(v, bytes) for v in values)
    assert tier.get_into(key(2), out).ok and bytes(out) == bytes(data)
    tier.close()


def test_a_corrupt_part_read_in_place_is_a_counted_miss(redis_url: str, tmp_path: Path) -> None:
    tier = _tier(redis_url, tmp_path)
    tier.put(key(3), _payload(3))
    name = tier.names.chunk(key(3))
    client = redis.Redis.from_url(redis_url)
    damaged = bytearray(client.hget(name, "0") or b"")
    damaged[100] ^= 0xFF
    client.hset(name, "0", bytes(damaged))
    out = memoryview(bytearray(LAYOUT.bytes_per_chunk))
    assert tier.get_into(key(3), out).failure is not None
    assert tier.stats().corrupt_reads == 1
    assert not client.exists(name)  # removed
    tier.close()


def test_a_reply_past_the_timeout_drops_its_connection(redis_server: object,
                                                       tmp_path: Path) -> None:
    url = redis_server.url  # type: ignore[attr-defined]
    tier = _tier(url, tmp_path, socket_timeout_ms=300)
    for i in range(2):
        tier.put(key(i), _payload(i))
    pauser = redis.Redis.from_url(url)
    client = redis.Redis.from_url(url, socket_timeout=0.3)  # as the tier's, 300 ms
    reader = _reader(tier)
    out = memoryview(bytearray(LAYOUT.bytes_per_chunk))
    assert reader.fetch(client, tier.names.chunk(key(1)), key(1), out)  # a connection pooled
    pauser.execute_command("CLIENT", "PAUSE", 1000, "ALL")
    with pytest.raises(redis.TimeoutError):
        reader.fetch(client, tier.names.chunk(key(0)), key(0), out)
    pool = client.connection_pool
    assert all(c._sock is None for c in pool._available_connections)  # dropped, not reused
    pauser.execute_command("CLIENT", "UNPAUSE")
    out[:] = bytes(len(out))
    values = reader.fetch(client, tier.names.chunk(key(1)), key(1), out)
    assert reader.verify_into(key(1), values, out, None) and bytes(out) == bytes(_payload(1))
    assert tier.get_into(key(1), out).ok and bytes(out) == bytes(_payload(1))
    client.close()
    pauser.close()
    tier.close()


def test_a_connection_with_unread_bytes_is_left_to_redis_py(redis_url: str) -> None:
    client = redis.Redis.from_url(redis_url)
    conn = client.connection_pool.get_connection()
    conn.send_command("PING")
    conn.send_command("PING")
    time.sleep(0.1)  # both replies arrive; the first read buffers the second
    assert conn.read_response() in (b"PONG", "PONG", True)
    if conn._parser._buffer.unread_bytes():
        assert not readable(conn)
    conn.read_response()
    assert readable(conn)
    client.connection_pool.release(conn)
    client.close()


@pytest.fixture
def replies_of() -> Iterator[Callable[[bytes], Replies]]:
    """A parser over a socket that receives `raw` (in pieces) and then its end."""
    sockets: list[socket.socket] = []

    def replies(raw: bytes) -> Replies:
        ours, theirs = socket.socketpair()
        ours.settimeout(2)
        sockets.append(ours)
        threading.Thread(target=_feed, args=(theirs, raw), daemon=True).start()
        return Replies(ours)

    yield replies
    for sock in sockets:
        sock.close()


def _feed(theirs: socket.socket, raw: bytes) -> None:

    try:
        for i in range(0, len(raw), 7):  # lines and payloads split across reads
            theirs.sendall(raw[i : i + 7])
            time.sleep(0.001)
    except OSError:
        pass  # the parser gave up and its socket closed
    finally:
        theirs.close()


def test_replies_are_parsed_into_their_places(
        replies_of: Callable[[bytes], Replies]) -> None:
    replies = replies_of(b"*4\r\n$5\r\nhello\r\n$-1\r\n_\r\n$10\r\n0123456789\r\n:1\r\n+OK\r\n")
    target = bytearray(10)

    def place(i: int, length: int, earlier: list[object]) -> memoryview | None:
        assert earlier[:1] == [b"hello"] or i == 0
        return memoryview(target) if i == 3 else None

    values = replies.array(place)
    assert values is not None
    assert values[:3] == [b"hello", None, None] and bytes(values[3]) == b"0123456789"
    assert bytes(target) == b"0123456789"
    assert replies.value(0, None, []) == 1 and replies.value(0, None, []) == "OK"
    assert replies.drained


@pytest.mark.parametrize("raw, error", [
    (b"-ERR boom\r\n", redis.ResponseError),
    (b"*1\r\n$10\r\nabc", redis.ConnectionError),  # cut short: the server went away
    (b"*1\r\n$3\r\nabcXY", redis.ConnectionError),  # a payload not ended by CRLF
    (b"*1\r\n%2\r\n", redis.ConnectionError),  # a type this read never asks for
    (b"*1\r\n$" + b"9" * 100, redis.ConnectionError),  # a line without end
])
def test_a_damaged_reply_is_an_error_never_values(
        raw: bytes, error: type[Exception], replies_of: Callable[[bytes], Replies]) -> None:
    with pytest.raises(error):
        replies_of(raw).array(lambda i, n, e: None)


@pytest.mark.parametrize("text", [
    "LOADING Redis is loading the dataset in memory", "MOVED 3999 127.0.0.1:6381",
    "ASK 3999 127.0.0.1:6381", "MASTERDOWN Link with MASTER is down",
    "TRYAGAIN Multiple keys request during rehashing of slot",
    "BUSY Redis is busy running a script.", "OOM command not allowed", "ERR boom"])
def test_an_error_reply_is_the_exception_redis_py_makes_of_it(
        text: str, replies_of: Callable[[bytes], Replies]) -> None:
    """LOADING (a restarted server loading its dataset) is redis-py's BusyLoadingError, a
    ConnectionError the tier backs off from, not a refusal; a read's own parser once made
    every error reply a plain ResponseError."""
    expected = type(_RESP2Parser.parse_error(text))
    with pytest.raises(expected) as raised:
        replies_of(b"-" + text.encode() + b"\r\n").array(lambda i, n, e: None)
    assert type(raised.value) is expected
    if text.startswith("LOADING"):
        assert isinstance(raised.value, redis.ConnectionError)


def test_a_cluster_read_from_a_node_that_moved_the_slot_follows_redis_py(
        redis_cluster: RedisClusterNodes, monkeypatch: pytest.MonkeyPatch,
        tmp_path: Path) -> None:
    """A Cluster's read goes straight to the node its slot map names; one that answers MOVED
    (a stale map, injected here) is read again through redis-py, which follows the
    redirection: a hit, not a miss."""
    store = open_store(StoreConfig.parse({"tiers": [
        {"kind": "memory", "capacity": "1MiB"},
        {"kind": "redis", "cluster_nodes": redis_cluster.addresses, "capacity": 0}]}), LAYOUT)
    tier = store.tiers[1]
    assert isinstance(tier, RedisTier)
    tier.put(key(5), _payload(5))
    out = memoryview(bytearray(LAYOUT.bytes_per_chunk))
    assert tier.get_into(key(5), out).ok and bytes(out) == bytes(_payload(5))
    owner = RedisCluster.get_node_from_key
    wrong: list[str] = []

    def stale(client: RedisCluster, name: str, replica: bool = False) -> ClusterNode:
        right = owner(client, name, replica)
        node = next(n for n in client.get_primaries() if n.name != right.name)
        wrong.append(node.name)
        return node

    monkeypatch.setattr(RedisCluster, "get_node_from_key", stale)  # the reader's only
    out[:] = bytes(len(out))
    assert tier.get_into(key(5), out).ok and bytes(out) == bytes(_payload(5))
    assert wrong and tier.guard.is_up(wrong[0]) and tier.stats().misses == 0
    store.close()
