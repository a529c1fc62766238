"""A redis-server that stops answering (paused with SIGSTOP: its port still accepts, nothing
replies) while the tier is asked whether it holds chunks. A lookup waits on a request's path
(the node's checks at each store, a failed load's report on the model runner's thread), yet
it waited out `socket_timeout_ms`, the deadline of the tier's transfers: an operator who
raised that for large chunks over a slow link had each lookup held as long (here a minute).
Now a lookup's reply is due within `lookup_timeout_ms`, on connections of its own: late, it
is a miss, counted (`lookup_timeouts`) and logged once; the server's next lookups miss at
once until a retry answers in time, and the server itself is not taken for down (its reads
and writes keep their own deadline).
"""

from __future__ import annotations

import logging
import os
import signal
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import pytest
from redis_server import RedisServer
from tierkit import key, until

from kvtier.core.layout import KVLayout
from kvtier.tiers import build_tier, open_store
from kvtier.tiers.redis.tier import RedisTier
from kvtier.tiers.storeconfig import StoreConfig

pytestmark = [pytest.mark.redis, pytest.mark.timeout(120)]
TRANSFER_TIMEOUT_MS = 60_000  # socket_timeout_ms: a transfer's deadline, raised for big chunks
LOOKUP_TIMEOUT_MS = 200
# How long the test waits for a lookup of the paused server: far past its budget (a loaded
# machine), far short of the transfers' deadline, which the lookup waited before.
WAIT_S = TRANSFER_TIMEOUT_MS / 1000 / 4


@contextmanager
def paused(server: RedisServer) -> Iterator[None]:
    """The server stopped (SIGSTOP) inside the block, continued (SIGCONT) after it."""
    assert server.proc is not None
    os.kill(server.proc.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(server.proc.pid, signal.SIGCONT)


def test_a_lookup_of_a_paused_server_misses_within_its_budget_not_the_socket_timeout(
        redis_server: RedisServer, layout: KVLayout, caplog: pytest.LogCaptureFixture) -> None:
    config = StoreConfig.parse({"tiers": [{
        "kind": "redis", "url": redis_server.url, "socket_timeout_ms": TRANSFER_TIMEOUT_MS,
        "lookup_timeout_ms": LOOKUP_TIMEOUT_MS, "retry_max_s": 0.5}]})
    tier = build_tier(config.tiers[0], layout)
    assert isinstance(tier, RedisTier)
    asking = ThreadPoolExecutor(1, "lookup")
    try:
        assert tier.put(key(1), memoryview(bytes(layout.bytes_per_chunk)))
        assert tier.contains_many([key(1), key(2)]) == [True, False]  # its connection open
        with paused(redis_server), caplog.at_level(logging.WARNING, "kvtier"):
            # Before: this waited out the minute of socket_timeout_ms.
            assert asking.submit(tier.contains_many, [key(1)]).result(WAIT_S) == [False]
            assert tier.stats().lookup_timeouts == 1
            # The next lookups miss (without asking, within the backoff: a loaded machine
            # may pass it, and a retry then times out once more), and the server is not
            # taken for down: its transfers still wait their own deadline.
            assert asking.submit(tier.contains, key(1)).result(WAIT_S) is False
            assert asking.submit(tier.contains_many, [key(1)]).result(WAIT_S) == [False]
            assert tier.stats().lookup_timeouts >= 1
            assert tier.available()
        warnings = [r.getMessage() for r in caplog.records if "(lookups)" in r.getMessage()]
        assert len(warnings) == 1 and "lookup_timeout_ms (200 ms)" in warnings[0], warnings
        # Answering again: a retry after the backoff finds the chunk.
        assert until(lambda: tier.contains(key(1)))
        assert tier.contains_many([key(1), key(2)]) == [True, False]
    finally:
        asking.shutdown(wait=False, cancel_futures=True)
        tier.close()


def test_the_nodes_question_to_a_paused_server_below_ram_misses_within_the_budget(
        redis_server: RedisServer, layout: KVLayout) -> None:
    """The store's batch lookup, as the node asks it at each store RAM has no slot for and
    for an engine's Lookup below RAM (node/server.py, node/connection.py): no stall guard
    of the store bounds it, only the tier's own deadline."""
    store = open_store(StoreConfig.parse({"read_timeout_s": 3600, "tiers": [
        {"kind": "memory", "capacity": "1MiB"},
        {"kind": "redis", "url": redis_server.url, "socket_timeout_ms": TRANSFER_TIMEOUT_MS,
         "lookup_timeout_ms": LOOKUP_TIMEOUT_MS}]}), layout)
    asking = ThreadPoolExecutor(1, "lookup")
    try:
        [_memory, below] = store.tiers
        assert below.put(key(1), memoryview(bytes(layout.bytes_per_chunk)))
        assert store.contains_many([key(1), key(2)]) == [True, False]
        with paused(redis_server):
            assert asking.submit(store.contains_many, [key(1)]).result(WAIT_S) == [False]
        assert store.stats().tiers[1].lookup_timeouts == 1
    finally:
        asking.shutdown(wait=False, cancel_futures=True)
        store.close()
