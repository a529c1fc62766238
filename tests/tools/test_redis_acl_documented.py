"""configuration.md's list of the commands a redis tier's ACL user needs, granted as written
to a real redis-server's user (or a Redis Cluster's) and no more: the tier stores, finds,
reads and deletes chunks (bounded: evicts too), and `kvtier inspect` and `kvtier gc` run. The
list once left `ZREM` to a bounded tier's engines: a gc by that list deleted the chunks it
chose, then failed on the LRU set's ZREM, and reported the tier "not readable" with exit
status 1. Nor did it name what a Cluster's client asks (its slots, the command table)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import redis
import yaml
from redis_server import RedisClusterNodes, RedisServer
from tierkit import footprint_bytes, key, tiny_layout, until

from kvtier.core.retention import DEFAULT_META
from kvtier.tiers import build_tier
from kvtier.tiers.storeconfig import StoreConfig
from kvtier.tools.cli.main import main

pytestmark = pytest.mark.redis

ROW = next(line for line in (Path(__file__).resolve().parents[2] / "docs" / "configuration.md")
           .read_text().splitlines() if line.startswith("| Redis / Valkey | `redis` |"))
LAYOUT = tiny_layout(16)
PASSWORD = "acl-pw"


def granted(after: str) -> list[str]:
    """The commands the row lists in the code span right after `after`."""
    found = re.search(re.escape(after) + r" `([A-Z| ]+)`", ROW)
    assert found, after
    return found.group(1).split()


def acl_user(server: RedisServer, *lists: str) -> None:
    """User "kv", kvtier's keys only, with the commands of the row's `lists` and no more."""
    commands = [f"+{name.lower()}" for after in lists for name in granted(after)]
    server.client().execute_command("ACL", "SETUSER", "kv", "reset", "on", f">{PASSWORD}",
                                    "~kvtier:*", *commands)


def tier_settings(server: RedisServer, capacity_chunks: int) -> dict[str, object]:
    return {"kind": "redis", "url": server.url, "username": "kv", "password_env": "KV_PW",
            "capacity": capacity_chunks * footprint_bytes("redis", LAYOUT), "part_bytes": 1536}


def store_chunks(server: RedisServer, capacity_chunks: int, count: int) -> None:
    """`count` chunks put as user "kv", each found and read back, the last deleted."""
    config = StoreConfig.parse({"tiers": [tier_settings(server, capacity_chunks)]})
    tier = build_tier(config.tiers[0], LAYOUT)
    try:
        data = memoryview(bytes(range(256)) * (LAYOUT.bytes_per_chunk // 256))
        assert all(tier.put(key(i), data, DEFAULT_META) for i in range(count))
        out = bytearray(LAYOUT.bytes_per_chunk)
        assert tier.get_into(key(count - 1), memoryview(out), DEFAULT_META) and out == data
        assert tier.contains(key(count - 1)) and tier.delete(key(count - 1))
        if capacity_chunks:
            assert until(lambda: tier.stats().evictions > 0)
        assert tier.stats().dropped_writes == 0
    finally:
        tier.close()


def test_an_unbounded_tier_and_the_tools_run_on_the_documented_commands(
        redis_server: RedisServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    acl_user(redis_server, "it needs", "for `kvtier inspect`/`gc`",
             "for a `gc` that removes chunks", "for `gc --quota`/`--max-age`")
    monkeypatch.setenv("KV_PW", PASSWORD)
    store_chunks(redis_server, 0, 6)
    config = tmp_path / "kvtier.yaml"
    config.write_text(yaml.safe_dump({"tiers": [{"kind": "memory", "capacity": "64MiB"},
                                                tier_settings(redis_server, 0)]}))
    assert main(["inspect", "--config", str(config)]) == 0
    assert main(["gc", "--config", str(config), "--quota", "25KiB"]) == 0
    admin = redis_server.client()
    assert 0 < len(admin.keys("kvtier:*")) < 5
    assert main(["gc", "--config", str(config), "--namespace", LAYOUT.digest()]) == 0
    assert admin.keys("kvtier:*") == []


def test_a_cluster_tier_runs_on_the_documented_commands(redis_cluster: RedisClusterNodes,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """redis-py's cluster client asks each node its slots and the command table: without
    them it found "no cluster" and the tier dropped every write."""
    commands = [f"+{name.lower()}" for after in ("it needs", "with `cluster_nodes`")
                for name in granted(after)]
    for node in redis_cluster.nodes:
        node.client().execute_command("ACL", "SETUSER", "kv", "reset", "on", f">{PASSWORD}",
                                      "~kvtier:*", *commands)
    monkeypatch.setenv("KV_PW", PASSWORD)
    config = StoreConfig.parse({"tiers": [{
        "kind": "redis", "cluster_nodes": redis_cluster.addresses, "username": "kv",
        "password_env": "KV_PW", "part_bytes": 1536, "retry_max_s": 0.5}]})
    tier = build_tier(config.tiers[0], LAYOUT)
    try:
        data = memoryview(bytes(range(256)) * (LAYOUT.bytes_per_chunk // 256))
        assert all(tier.put(key(i), data, DEFAULT_META) for i in range(6))
        assert tier.contains_many([key(i) for i in range(6)]) == [True] * 6
        assert tier.stats().dropped_writes == 0
    finally:
        tier.close()


def test_a_bounded_tier_runs_on_the_documented_commands(
        redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch) -> None:
    acl_user(redis_server, "it needs", "with `capacity` > 0")
    monkeypatch.setenv("KV_PW", PASSWORD)
    store_chunks(redis_server, 4, 8)
    with pytest.raises(redis.exceptions.NoPermissionError):  # the user is held to the list
        redis.Redis.from_url(redis_server.url, username="kv", password=PASSWORD).keys("*")
