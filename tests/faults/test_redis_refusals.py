"""A redis-server that answers every call with an error reply that is neither "down" nor
"full", against a real redis-server on 127.0.0.1: an ACL user without a command the tier
needs (NOPERM: here HSET, which every put runs), or a database index the server
does not have (every new connection's SELECT fails).

The server answers, so the tier stays up (no circuit breaker trips) and each put is a
counted dropped write, each read a counted miss. Found by an operator drill: before the
fix these refusals were logged at debug only, so a tier dropping every write said nothing
at the default log level. Now the first refusal of each kind is a warning naming it; the
next ones stay at debug (no log flood at thousands of puts a second).
"""

from __future__ import annotations

import logging

import pytest
from orphankit import LAYOUT, payload, redis_tier
from redis_server import RedisServer
from tierkit import key

from kvtier.core.tier import IO_ERROR

pytestmark = pytest.mark.redis
LOGGER = "kvtier.tiers.redis.tier"


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == LOGGER and r.levelno >= logging.WARNING]


def test_an_acl_user_without_hset_drops_writes_with_one_warning(
        redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    admin = redis_server.client()
    admin.execute_command("ACL", "SETUSER", "kvcache", "on", ">kv-s3cret", "~kvtier:*", "+@all",
                          "-hset")
    monkeypatch.setenv("KVTIER_REDIS_PASSWORD", "kv-s3cret")
    tier = redis_tier(redis_server.url, username="kvcache")
    with caplog.at_level(logging.DEBUG, logger=LOGGER):
        results = [tier.put(key(i), payload(i)) for i in range(3)]
    assert results == [IO_ERROR] * 3
    assert tier.stats().dropped_writes == 3 and tier.available()
    warnings = _warnings(caplog)
    assert len(warnings) == 1, warnings
    assert "hset" in warnings[0] and "NoPermissionError" in warnings[0]
    assert "kv-s3cret" not in caplog.text
    tier.close()


def test_a_database_index_the_server_lacks_is_one_warning(
        redis_server: RedisServer, caplog: pytest.LogCaptureFixture) -> None:
    tier = redis_tier(f"redis://127.0.0.1:{redis_server.port}/16")  # databases 0..15
    out = memoryview(bytearray(LAYOUT.bytes_per_chunk))
    with caplog.at_level(logging.DEBUG, logger=LOGGER):
        assert tier.put(key(1), payload(1)) == IO_ERROR
        assert tier.get_into(key(1), out) == IO_ERROR
        assert tier.put(key(2), payload(2)) == IO_ERROR
    stats = tier.stats()
    assert (stats.dropped_writes, stats.misses) == (2, 1) and tier.available()
    warnings = _warnings(caplog)
    assert len(warnings) == 1 and "DB index is out of range" in warnings[0], warnings
    tier.close()
