"""A redis tier closed while its warm-up opens connections: the warm-up must see the tier
closed as soon as its client's pool is being closed, and drop what it reopens. `close`
used to let its clients go after closing them (it had let go first): a warm-up thread that
went on between the two found the tier still holding its client, reopened connections into
the closed pool and kept them open (a connection to the server per warm-up, for as long as
the client lived). The interleaving is injected; the server is real.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import redis
from tierkit import tiny_layout

from kvtier.tiers import open_store
from kvtier.tiers.redis.tier import RedisTier
from kvtier.tiers.storeconfig import StoreConfig

pytestmark = pytest.mark.redis
THREADS = 2


def _wait(condition: Any, what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def test_a_warm_up_under_close_leaves_no_connection_open(
        redis_server: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    url = redis_server.url
    admin = redis.Redis.from_url(url)

    def clients() -> int:  # connections but the one asking
        return len(admin.client_list()) - 1

    store = open_store(StoreConfig.parse({"io_threads": THREADS, "tiers": [
        {"kind": "memory", "capacity": "1MiB"},
        {"kind": "redis", "url": url, "capacity": 0, "connect_timeout_ms": 5000}]}),
        tiny_layout())
    _wait(lambda: clients() == THREADS + 1, "the store's own warm-up")
    tier = store.tiers[1]
    assert isinstance(tier, RedisTier)
    client = tier._client
    assert isinstance(client, redis.Redis)
    pool = client.connection_pool
    gate, warmed = threading.Event(), threading.Event()
    asked: list[int] = []
    get_connection, close = pool.get_connection, client.close

    def blocked_get(*args: Any, **kwargs: Any) -> Any:  # the fault: the first waits for close
        asked.append(1)
        if len(asked) == 1:
            assert gate.wait(30)
        return get_connection(*args, **kwargs)

    def closing() -> None:  # the warm-up goes on while the pool is being closed
        close()
        gate.set()
        assert warmed.wait(30)

    monkeypatch.setattr(pool, "get_connection", blocked_get)
    monkeypatch.setattr(client, "close", closing)

    def warm() -> None:
        try:
            tier.warm(THREADS)
        finally:
            warmed.set()

    thread = threading.Thread(target=warm)
    thread.start()
    _wait(lambda: bool(asked), "the warm-up's first connection asked for")
    store.close()
    thread.join(30)
    assert not thread.is_alive()
    _wait(lambda: clients() == 0, "every connection of the closed tier closed", 10.0)
    admin.close()
