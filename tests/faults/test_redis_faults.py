"""Fault drills against a real redis-server on 127.0.0.1: the server killed mid-run and
restarted, the server stalled by `DEBUG SLEEP`, values corrupted or truncated behind the
tier's back, ACL authentication, and a 3-node Redis Cluster losing a node.

What must hold throughout: no call raises, no call blocks longer than the configured timeout
(plus generous slack for a loaded CI machine), lookups and reads miss, writes are dropped and
counted, and the tier comes back by itself when the server does.
"""

from __future__ import annotations

import logging
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import pytest
import redis
from redis.backoff import NoBackoff
from redis.cluster import key_slot
from redis.retry import Retry
from redis_server import REDIS_CLI, RedisClusterNodes, RedisServer
from tierkit import key, tier_settings, tiny_layout, until

from kvtier.core.layout import KVLayout
from kvtier.errors import ConfigError
from kvtier.tiers import build_tier, open_store
from kvtier.tiers.redis.tier import RedisTier
from kvtier.tiers.storeconfig import StoreConfig

pytestmark = pytest.mark.redis
T = TypeVar("T")
TIMEOUT_MS = 200  # socket and connect timeouts of the tiers below
SLACK_S = 1.0  # for a loaded CI machine; the bound checked is connect + socket timeout + this
# (1.4 s in all: still well under the 2 s DEBUG SLEEP stall, which a blocked call would wait)
BOUND_S = 2 * TIMEOUT_MS / 1000 + SLACK_S


def payload(i: int, layout: KVLayout) -> bytes:
    return bytes((i * 7 + j) % 251 for j in range(layout.bytes_per_chunk))


def redis_tier(layout: KVLayout, **settings: Any) -> RedisTier:
    config = StoreConfig.parse({"tiers": [{
        "kind": "redis", "socket_timeout_ms": TIMEOUT_MS, "connect_timeout_ms": TIMEOUT_MS,
        "retry_max_s": 0.5, "part_bytes": 1536, **settings}]})
    tier = build_tier(config.tiers[0], layout)
    assert isinstance(tier, RedisTier)
    return tier


def timed(call: Callable[[], T]) -> tuple[T, float]:
    start = time.monotonic()
    result = call()
    return result, time.monotonic() - start


def read(tier: RedisTier, i: int, layout: KVLayout) -> bool:
    out = bytearray(layout.bytes_per_chunk)
    hit = tier.get_into(key(i), memoryview(out)).ok
    assert not hit or bytes(out) == payload(i, layout), "a hit returned wrong bytes"
    return hit


@pytest.mark.timing
def test_redis_killed_mid_run_misses_fast_drops_writes_and_recovers(
        redis_server: RedisServer, layout: KVLayout) -> None:
    """Chunks are stored and read; the server is SIGKILLed; every call still returns at once
    (misses, dropped writes, counted), and once the server is back on the same port the tier
    serves again by itself."""
    tier = redis_tier(layout, url=redis_server.url, capacity="1MiB")
    for i in range(4):
        assert tier.put(key(i), memoryview(payload(i, layout)))
    assert all(read(tier, i, layout) for i in range(4))

    redis_server.stop()
    durations = []
    for i in range(40):  # a bounded "engine loop" while the server is gone
        # Each lambda binds this turn's i (i=i), though all are called within the turn.
        for call in (lambda i=i: tier.contains(key(i % 4)),
                     lambda i=i: read(tier, i % 4, layout),
                     lambda i=i: tier.put(key(100 + i), memoryview(payload(100 + i, layout))),
                     lambda: tier.contains_many([key(0), key(1)])):
            result, elapsed = timed(call)
            assert not (any(result) if isinstance(result, list) else result)  # misses
            durations.append(elapsed)
    assert max(durations) < BOUND_S
    # Fast failure while down: most calls did no I/O at all (the breaker was open).
    assert sorted(durations)[len(durations) // 2] < 0.01
    stats = tier.stats()
    assert stats.dropped_writes == 40 and stats.misses >= 40 and stats.hits == 4
    assert not tier.available()

    redis_server.start()  # same port, empty (no persistence)
    assert until(lambda: tier.put(key(7), memoryview(payload(7, layout))), timeout_s=5)
    assert read(tier, 7, layout) and tier.available()
    tier.close()


@pytest.mark.timing
def test_a_store_starts_and_serves_with_redis_down(tmp_path: Path, layout: KVLayout) -> None:
    """memory -> redis, with nothing listening on the redis port: the store is built, puts and
    lookups work from memory, the redis writes behind are dropped and counted. When a server
    appears on that port, writes reach it without restarting anything."""
    server = RedisServer(tmp_path / "late")
    config = StoreConfig.parse({"tiers": [
        tier_settings("memory", tmp_path, layout, capacity_chunks=2),
        {"kind": "redis", "url": server.url, "capacity": "1MiB", "retry_max_s": 0.3,
         "socket_timeout_ms": TIMEOUT_MS, "connect_timeout_ms": TIMEOUT_MS}]})
    with open_store(config, layout) as store:
        for i in range(6):
            _, elapsed = timed(lambda i=i: store.put(key(i), memoryview(payload(i, layout))))
            assert elapsed < BOUND_S
        assert store.flush(timeout_s=10)
        assert store.lookup([key(4), key(5)]).tiers == ("memory", "memory")
        redis_stats = store.stats().tiers[1]
        assert redis_stats.puts == 0 and redis_stats.dropped_writes + sum(
            store.stats().queue_drops.values()) >= 1
        try:
            server.start()
            assert until(lambda: store.put(key(50), memoryview(payload(50, layout)))
                         and store.flush(5) and store.stats().tiers[1].puts >= 1)
            # Evicted from memory (room for 2), found in redis by a batched lookup.
            for i in (51, 52):
                store.put(key(i), memoryview(payload(i, layout)))
            store.flush(5)
            assert store.lookup([key(50)]).tiers == ("redis",)
        finally:
            server.stop()


@pytest.mark.timing
def test_a_stalled_server_never_blocks_a_call_past_the_timeout(
        redis_server: RedisServer, layout: KVLayout) -> None:
    """Another client runs DEBUG SLEEP 2: the server answers nobody for 2 s. Every call of
    the tier returns within the timeout (+ slack): the first ones time out, the rest fail
    fast; after the stall the tier serves again."""
    tier = redis_tier(layout, url=redis_server.url)
    assert tier.put(key(1), memoryview(payload(1, layout)))
    assert read(tier, 1, layout)
    assert REDIS_CLI
    sleeper = subprocess.Popen([REDIS_CLI, "-p", str(redis_server.port), "DEBUG", "SLEEP", "2"],
                               stdout=subprocess.DEVNULL)
    try:
        # Wait until the server is really stalled (a PING with a short timeout goes
        # unanswered): on a loaded machine redis-cli may take a while to start.
        probe = redis_server.client(socket_timeout=0.05, retry=Retry(NoBackoff(), 0))
        assert until(lambda: _stalled(probe), timeout_s=5)
        durations = []
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline:
            for call in (lambda: read(tier, 1, layout), lambda: tier.contains(key(1)),
                         lambda: tier.put(key(2), memoryview(payload(2, layout)))):
                result, elapsed = timed(call)
                assert not result
                durations.append(elapsed)
        assert max(durations) < BOUND_S
        assert tier.stats().dropped_writes >= 1
    finally:
        sleeper.wait(timeout=10)
    assert until(lambda: read(tier, 1, layout), timeout_s=5)
    tier.close()


def _stalled(client: redis.Redis) -> bool:
    try:
        client.ping()
        return False
    except redis.TimeoutError:
        return True


def _corrupt(client: redis.Redis, name: str, how: str) -> None:
    """Damage the chunk whose hash is `name` (header "h", parts "0".."2")."""
    def flip(field: str, at: int, bit: int) -> None:
        value = bytearray(client.hget(name, field) or b"")
        value[at] ^= bit
        client.hset(name, field, bytes(value))

    if how == "bit flip in the payload":
        flip("0", 100, 0x01)
    elif how == "bit flip in the header":
        flip("h", 40, 0x80)
    elif how == "truncated part":
        client.hset(name, "2", (client.hget(name, "2") or b"")[:-10])
    elif how == "truncated header":
        client.hset(name, "h", (client.hget(name, "h") or b"")[:30])
    elif how == "part too long":
        client.hset(name, "0", (client.hget(name, "0") or b"") + b"x")
    elif how == "another chunk's values":  # valid data, stored under the wrong key
        other = name.replace(key(2).hex(), key(3).hex())
        client.hset(name, mapping=client.hgetall(other))
    else:
        raise AssertionError(how)


@pytest.mark.parametrize("how", ["bit flip in the payload", "bit flip in the header",
                                 "truncated part", "truncated header", "part too long",
                                 "another chunk's values"])
def test_corrupt_or_truncated_values_are_counted_misses_and_removed(
        redis_url: str, layout: KVLayout, how: str, caplog: pytest.LogCaptureFixture) -> None:
    tier = redis_tier(layout, url=redis_url)
    for i in (2, 3):
        assert tier.put(key(i), memoryview(payload(i, layout)))
    name = tier.names.chunk(key(2))
    client = redis.Redis.from_url(redis_url)
    assert client.hlen(name) == 4  # header + 3 parts of <= 1.5 KiB
    _corrupt(client, name, how)
    with caplog.at_level(logging.WARNING, logger="kvtier.tiers.redis.tier"):
        assert read(tier, 2, layout) is False
    assert "corrupt" in caplog.text
    stats = tier.stats()
    assert (stats.corrupt_reads, stats.misses) == (1, 1)
    assert client.exists(name) == 0, "corrupt values must be deleted"
    assert read(tier, 3, layout), "the other chunk is still served"
    assert tier.put(key(2), memoryview(payload(2, layout))) and read(tier, 2, layout)


def test_a_missing_part_is_a_miss_not_a_crash(redis_url: str, layout: KVLayout) -> None:
    tier = redis_tier(layout, url=redis_url)
    tier.put(key(4), memoryview(payload(4, layout)))
    client = redis.Redis.from_url(redis_url)
    client.hdel(tier.names.chunk(key(4)), "1")
    assert read(tier, 4, layout) is False
    assert tier.stats().corrupt_reads == 0 and not tier.contains(key(4))


def test_acl_user_with_password_from_a_file(redis_server: RedisServer, tmp_path: Path,
                                            layout: KVLayout,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """A least-privilege ACL user limited to kvtier's keys, the default user disabled. The
    password comes from a 0600 file (or the environment); a wrong one leaves the tier
    unavailable (misses, dropped writes, no exception); a password in the URL is refused."""
    admin = redis_server.client()
    admin.execute_command("ACL", "SETUSER", "kvcache", "on", ">s3cret-pw", "~kvtier:*",
                          "+@read", "+@write", "+@keyspace", "+@scripting", "+@transaction",
                          "+@connection", "+time", "-@dangerous")
    # MULTI/EXEC: every put; EVAL and TIME: the LRU index's script (capacity > 0)
    admin.execute_command("ACL", "SETUSER", "default", "off")
    password_file = tmp_path / "redis-password"
    password_file.write_text("s3cret-pw\n")
    password_file.chmod(0o600)

    tier = redis_tier(layout, url=redis_server.url, username="kvcache",
                      password_file=str(password_file), capacity="1MiB")
    assert tier.put(key(1), memoryview(payload(1, layout))) and read(tier, 1, layout)
    assert tier.contains_many([key(1), key(2)]) == [True, False]

    monkeypatch.setenv("KVTIER_REDIS_PASSWORD", "s3cret-pw")
    from_env = redis_tier(layout, url=redis_server.url, username="kvcache")
    assert read(from_env, 1, layout)

    monkeypatch.setenv("KVTIER_REDIS_PASSWORD", "wrong")
    wrong = redis_tier(layout, url=redis_server.url, username="kvcache")
    assert read(wrong, 1, layout) is False
    assert not wrong.put(key(3), memoryview(payload(3, layout)))
    assert wrong.stats().dropped_writes == 1 and not wrong.available()

    with pytest.raises(ConfigError, match="no password in the URL"):
        redis_tier(layout, url=f"redis://kvcache:s3cret-pw@127.0.0.1:{redis_server.port}/0")
    with pytest.raises(ConfigError, match="password_file"):
        redis_tier(layout, url=redis_server.url, password_file=str(tmp_path / "missing"))


def _slot_owners(cluster: RedisClusterNodes) -> Callable[[str], int]:
    """name -> index of the node serving its slot (from CLUSTER SLOTS, asked once)."""
    ranges = cluster.nodes[0].client().execute_command("CLUSTER", "SLOTS")
    ports = [n.port for n in cluster.nodes]

    def node_of(name: str) -> int:
        slot = key_slot(name.encode())
        for start, end, primary, *_ in ranges:
            if start <= slot <= end:
                return ports.index(int(primary[1]))
        raise AssertionError(f"slot {slot} not covered")

    return node_of


@pytest.mark.timing
def test_cluster_spreads_chunks_and_a_dead_node_costs_only_its_slots(
        redis_cluster: RedisClusterNodes) -> None:
    """30 chunks of 3 parts over a 3-node cluster land on every node, each chunk (a hash) on
    one node. With one node killed, exactly the chunks of its slots miss, quickly; the others
    still hit, and writes to the live nodes still succeed."""
    layout = tiny_layout()
    tier = redis_tier(layout, cluster_nodes=redis_cluster.addresses)
    node_of = _slot_owners(redis_cluster)
    owner = {i: node_of(tier.names.chunk(key(i))) for i in range(30)}
    for i in range(30):
        assert tier.put(key(i), memoryview(payload(i, layout)))
    sizes = [node.client().dbsize() for node in redis_cluster.nodes]
    assert all(size > 0 for size in sizes) and sum(sizes) == 30  # a hash a chunk

    dead = owner[0]
    redis_cluster.nodes[dead].stop()
    for _ in range(2):  # the second round runs with the dead node's breaker open
        hits, elapsed = timed(lambda: {i for i in range(30) if read(tier, i, layout)})
        assert hits == {i for i in range(30) if owner[i] != dead}
        assert elapsed < 30 * BOUND_S
    found = tier.contains_many([key(i) for i in range(30)])
    assert found == [owner[i] != dead for i in range(30)]
    alive = next(i for i in range(100, 200) if node_of(tier.names.chunk(key(i))) != dead)
    assert tier.put(key(alive), memoryview(payload(alive, layout)))
    tier.close()


@pytest.mark.timing
def test_concurrent_readers_while_the_server_dies(redis_server: RedisServer,
                                                  layout: KVLayout) -> None:
    """8 threads read and write while the server is killed under them: no exception escapes
    a thread, and each call stays within the bound."""
    tier = redis_tier(layout, url=redis_server.url)
    for i in range(8):
        tier.put(key(i), memoryview(payload(i, layout)))
    errors: list[BaseException] = []
    slowest = [0.0]
    running = threading.Semaphore(0)  # released by each thread once its first call is done

    def worker(t: int) -> None:
        try:
            for n in range(60):
                _, elapsed = timed(lambda n=n: read(tier, (t + n) % 8, layout))
                slowest[0] = max(slowest[0], elapsed)
                tier.put(key(1000 + t * 100 + n), memoryview(payload(n, layout)))
                if n == 0:
                    running.release()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(8)]
    for thread in threads:
        thread.start()
    for _ in threads:  # all of them mid-run when the server dies
        assert running.acquire(timeout=30) or errors, "a reader never made its first call"
    redis_server.stop()
    for thread in threads:
        thread.join(timeout=60)
    assert not errors and slowest[0] < BOUND_S
