"""The redis tier's connections opened as its store starts (`Warmable`, core/store.py), against
a real redis-server: a store's first load had paid a connection (and its greeting) per read in
flight, inside the load's time (docs/performance.md, "A node's first load").

The story: opening a store with a redis tier opens `io_threads` connections to the server in
the background, which reads then use; closing the store closes them; a server that is down
costs the warm-up one failed connect, never the tier's circuit breaker, and the store serves
(misses) as before; a tier closed under the warm-up (a store opened and closed at once)
raises nothing from it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import redis
from tierkit import key, tiny_layout

from kvtier.tiers import build_tier, open_store
from kvtier.tiers.redis.tier import RedisTier
from kvtier.tiers.storeconfig import StoreConfig

pytestmark = pytest.mark.redis
LAYOUT = tiny_layout()
THREADS = 6


def _store_config(url: str) -> StoreConfig:
    return StoreConfig.parse({"io_threads": THREADS, "tiers": [
        {"kind": "memory", "capacity": "1MiB"},
        # A connect's deadline a loaded 2-core machine meets (the warm-up stops at its first
        # failed connect: at 300 ms it once opened fewer than THREADS beside other lanes).
        {"kind": "redis", "url": url, "capacity": 0, "connect_timeout_ms": 5000}]})


def _clients(url: str) -> Callable[[], int]:
    admin = redis.Redis.from_url(url)

    def count() -> int:  # connections but the one asking
        return len(admin.client_list()) - 1
    return count


def _wait(condition: Callable[[], bool], what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def test_a_store_opens_its_reads_connections_as_it_starts(redis_server: object) -> None:
    # A server of its own: the session's may still hold an earlier test's connections,
    # closed whenever their pools are collected (it did once: 1 == 0).
    redis_url = redis_server.url  # type: ignore[attr-defined]
    clients = _clients(redis_url)
    assert clients() == 0
    store = open_store(_store_config(redis_url), LAYOUT)
    # The reads' and one for lookups (the redis tier's client with their short deadline).
    _wait(lambda: clients() == THREADS + 1, f"{THREADS} + 1 connections")
    # The server counts a connection as it accepts it, before its greeting is done and the
    # warm-up hands it back to its pool: a read then opened one more (8 == 7, under load).
    _wait(lambda: not any(t.name == "kvtier-warm" for t in threading.enumerate()),
          "the warm-up done")
    # The reads and lookups use them: a load of a missing chunk opens none more.
    out = memoryview(bytearray(LAYOUT.bytes_per_chunk))
    assert store.get_into(key(1), out) is None
    assert clients() == THREADS + 1
    store.close()
    _wait(lambda: clients() == 0, "the connections closed")


def test_a_server_down_at_start_costs_the_warm_up_only(redis_server: object) -> None:
    url = redis_server.url  # type: ignore[attr-defined]
    redis_server.stop()  # type: ignore[attr-defined]
    store = open_store(_store_config(url), LAYOUT)
    tier = store.tiers[1]
    assert isinstance(tier, RedisTier)
    tier.warm(THREADS)  # what the store's thread does: one failed connect, then it stops
    assert tier.guard.is_up(url.split("//")[1].split("/")[0])  # the breaker untouched
    redis_server.start()  # type: ignore[attr-defined]
    store.put(key(2), memoryview(bytes(LAYOUT.bytes_per_chunk)))
    store.flush(10)
    out = memoryview(bytearray(LAYOUT.bytes_per_chunk))
    _wait(lambda: tier.get_into(key(2), out).ok, "the tier serving again")
    store.close()


def test_a_tier_closed_while_it_warms_up_raises_nothing(
        redis_server: object, monkeypatch: pytest.MonkeyPatch) -> None:
    """A store opened and closed at once (`kvtier inspect`, a leak soak's open/close
    cycles): its tier closes under the warm-up's first greeting. redis-py then read from the
    socket `close` took (AttributeError), which the store's warm-up thread logged at error,
    with its traceback."""
    import redis.connection

    url = redis_server.url  # type: ignore[attr-defined]
    clients = _clients(url)
    tier = build_tier(_store_config(url).tiers[1], LAYOUT)  # no store: no warm-up thread
    assert isinstance(tier, RedisTier)
    real_read = redis.connection.AbstractConnection.read_response

    def closed_under_it(self: Any, *args: Any, **kwargs: Any) -> Any:
        tier.close()  # the fault: another thread closes the tier mid-greeting
        return real_read(self, *args, **kwargs)

    monkeypatch.setattr(redis.connection.AbstractConnection, "read_response",
                        closed_under_it)
    tier.warm(THREADS)  # `Warmable.warm` never raises
    monkeypatch.undo()
    _wait(lambda: clients() == 0, "the connections closed")
