"""The tests' redis-server harness (tests/redis_server.py) leaves no server behind when one
does not come up: `start` raised once its deadline passed with the process still running,
and a fixture whose set-up raises never tears down, so that redis-server outlived the test
run. A server that never answers is injected (its PING fails); the process is real."""

from __future__ import annotations

from pathlib import Path

import psutil
import pytest
import redis_server
from redis_server import RedisServer

pytestmark = pytest.mark.redis


def _redis_children() -> set[int]:
    return {p.pid for p in psutil.Process().children(recursive=True)
            if p.name().startswith("redis-server")}


def test_a_server_that_never_answers_is_killed_when_its_start_fails(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    if redis_server.REDIS_SERVER is None:
        pytest.skip(redis_server.SKIP_REASON)
    before = _redis_children()

    def no_answer(_self: RedisServer) -> bytes:
        raise OSError("injected: not listening")

    monkeypatch.setattr(RedisServer, "_ping", no_answer)
    monkeypatch.setattr(redis_server, "START_TIMEOUT_S", 0.5)
    server = RedisServer(tmp_path / "redis")
    try:
        with pytest.raises(RuntimeError, match="did not start"):
            server.start()
        assert _redis_children() - before == set()
    finally:
        for pid in _redis_children() - before:
            psutil.Process(pid).kill()
