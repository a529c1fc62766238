"""The redis tier's replies are parsed by hiredis, a dependency of kvtier: redis-py's own parser
costs twice the CPU per byte, under the GIL the engine's model runner needs too
(docs/performance.md, "Redis replies parsed by hiredis"). Without it (an install that left it
out) redis-py falls back to its own parser, and kvtier says so once."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import redis.connection
import tierkit
from tierkit import key, make_tier, tiny_layout

from kvtier.tiers import redis_client

pytestmark = pytest.mark.redis


def test_kvtiers_install_parses_redis_replies_with_hiredis() -> None:
    from redis._parsers import _HiredisParser

    assert redis.connection.DefaultParser is _HiredisParser


def test_without_hiredis_kvtier_says_so_once(
        redis_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(redis_client, "HIREDIS_AVAILABLE", False)
    redis_client._warn_without_hiredis.cache_clear()
    monkeypatch.setattr(tierkit, "REDIS_URL", redis_url)
    layout = tiny_layout()
    data = bytes(range(256)) * (layout.bytes_per_chunk // 256)
    with caplog.at_level(logging.WARNING, "kvtier.tiers.redis"):
        for i in range(2):  # two tiers, two clients: one warning
            tier = make_tier("redis", tmp_path, layout, 8)
            assert tier.put(key(i), memoryview(data))
            out = memoryview(bytearray(layout.bytes_per_chunk))
            assert tier.get_into(key(i), out).ok
            assert out == data
            tier.close()
    assert [r.message for r in caplog.records].count(
        "redis tier: hiredis is not installed, so redis-py parses replies in Python (2x the "
        "CPU per chunk read, under the GIL); pip install hiredis") == 1
    redis_client._warn_without_hiredis.cache_clear()
