"""A redis-server still loading its dataset (a restart, a replica's sync, `DEBUG RELOAD`)
answers every data command with `-LOADING Redis is loading the dataset in memory`, for as
long as loading a large RDB takes: the server is not serving yet, so the redis tier takes it
for down (a counted miss, the server backed off from, retried later), as redis-py does
(BusyLoadingError is one of its ConnectionErrors), against a real redis-server on 127.0.0.1.

Found by a hunt: the tier's own read path (tiers/redis/replies.py) made every error reply a
plain ResponseError, so a loading server was a server that refused the read: a warning
("the server refused a read"), a miss, and no backoff, each read a round trip again.

The server here loads slowly on purpose (`key-load-delay` per key, events processed every
1 KiB), reloaded by `DEBUG RELOAD` on a thread of its own; the test reads while it loads and
kills the server once done, which ends the reload.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time

import pytest
import redis
from orphankit import LAYOUT, payload, redis_tier
from redis_server import RedisServer
from tierkit import key

from kvtier.core.tier import UNAVAILABLE

pytestmark = pytest.mark.redis
LOGGER = "kvtier.tiers.redis.tier"
FILLER_KEYS = 100_000  # loaded at KEY_LOAD_DELAY_US each: 20 s, far past the test's reads
KEY_LOAD_DELAY_US = 200
LOADING_DEADLINE_S = 30.0


def _reload(server: RedisServer) -> None:
    """DEBUG RELOAD: the server saves, then loads its dataset again, blocking this caller."""
    with contextlib.suppress(redis.ConnectionError):  # the test killed the server mid-load
        server.client(socket_timeout=None).execute_command("DEBUG", "RELOAD")


def _await_loading(server: RedisServer) -> None:
    """Return once the server answers LOADING (its reload under way)."""
    probe = server.client(socket_timeout=2)
    deadline = time.monotonic() + LOADING_DEADLINE_S
    while time.monotonic() < deadline:
        try:
            probe.ping()
        except redis.BusyLoadingError:
            probe.close()
            return
        time.sleep(0.01)
    raise AssertionError("the server never started loading")


def test_a_server_loading_its_dataset_is_down_for_a_while_not_refusing(
        redis_server: RedisServer, caplog: pytest.LogCaptureFixture) -> None:
    tier = redis_tier(redis_server.url)
    assert tier.put(key(1), payload(1)).ok
    out = memoryview(bytearray(LAYOUT.bytes_per_chunk))
    assert tier.get_into(key(1), out).ok  # the tier's pooled connection is open and idle
    admin = redis_server.client()
    admin.execute_command("DEBUG", "POPULATE", FILLER_KEYS, "filler")
    admin.config_set("loading-process-events-interval-bytes", 1024)
    admin.config_set("key-load-delay", KEY_LOAD_DELAY_US)
    reload = threading.Thread(target=_reload, args=(redis_server,), daemon=True)
    reload.start()
    _await_loading(redis_server)
    with caplog.at_level(logging.DEBUG, logger=LOGGER):
        assert tier.get_into(key(1), out) == UNAVAILABLE
        assert not tier.available()  # backed off: the next reads do no I/O until retried
        assert tier.get_into(key(1), out) == UNAVAILABLE
    assert tier.stats().misses == 2
    refusals = [r.getMessage() for r in caplog.records
                if r.name == LOGGER and "refused" in r.getMessage()]
    assert refusals == []
    tier.close()
    redis_server.stop()
    reload.join(timeout=LOADING_DEADLINE_S)
    assert not reload.is_alive()
