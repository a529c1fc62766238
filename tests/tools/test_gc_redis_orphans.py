"""`kvtier gc` over a redis tier's orphans (issue 12, item 7): parts without a header, as a
put that failed part-way or an older kvtier left them, against a real redis-server. How the
tier leaves none (and gives them a short TTL): tests/faults/test_redis_orphans.py.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
import yaml
from redis_server import RedisServer
from tierkit import key, tiny_layout

from kvtier.core.layout import KVLayout
from kvtier.tiers import build_tier
from kvtier.tiers.redis.config import RedisTierConfig
from kvtier.tiers.redis.inventory import RedisInventory
from kvtier.tiers.redis.tier import RedisTier
from kvtier.tiers.storeconfig import StoreConfig
from kvtier.tools.admin.gc import GcRequest, run_gc
from kvtier.tools.cli.main import main

pytestmark = pytest.mark.redis
LAYOUT = tiny_layout(tokens_per_chunk=256)  # 64 KiB chunks
PART_BYTES = 16 * 1024  # 4 parts a chunk
HEADROOM_STEP = 4 * 1024  # the server is squeezed to 0, 4, 8... KiB above what it holds


def payload(i: int, layout: KVLayout = LAYOUT) -> memoryview:
    return memoryview(bytes((i * 11 + j) % 251 for j in range(256)) * (
        layout.bytes_per_chunk // 256))


@pytest.fixture
def tight(redis_server: RedisServer) -> Iterator[redis.Redis]:
    """An admin client of a server that refuses writes when full (noeviction)."""
    client = redis_server.client()
    client.config_set("maxmemory-policy", "noeviction")
    yield client
    client.config_set("maxmemory", 0)


def squeeze(client: redis.Redis, headroom_bytes: int) -> None:
    """maxmemory = what the server uses now + `headroom_bytes`."""
    client.config_set("maxmemory", 0)
    client.config_set("maxmemory", int(client.info("memory")["used_memory"]) + headroom_bytes)


def set_counts(client: redis.Redis) -> tuple[int, int]:
    """SETs the server executed and SETs it refused (INFO commandstats), so far."""
    stats = client.info("commandstats").get("cmdstat_set", {})
    return int(stats.get("calls", 0)), int(stats.get("rejected_calls", 0))


def headerless(client: redis.Redis, prefix: str = "kvtier:") -> dict[str, list[str]]:
    """Chunk -> its values, for every chunk whose values exist without a header."""
    groups: dict[str, list[str]] = {}
    for raw in client.scan_iter(match=f"{prefix}*"):
        name = raw.decode()
        if not name.endswith(":lru"):
            groups.setdefault(name.rpartition(":")[0], []).append(name)
    return {base: names for base, names in groups.items() if base + ":h" not in names}


def redis_config(url: str, **settings: Any) -> RedisTierConfig:
    config = StoreConfig.parse({"tiers": [{"kind": "redis", "url": url, "capacity": 0,
                                           "part_bytes": PART_BYTES, **settings}]})
    tier_config = config.tiers[0]
    assert isinstance(tier_config, RedisTierConfig)
    return tier_config


def redis_tier(url: str, **settings: Any) -> RedisTier:
    tier = build_tier(redis_config(url, **settings), LAYOUT)
    assert isinstance(tier, RedisTier)
    return tier


def test_gc_deletes_orphans_without_a_ttl_and_spares_committed_chunks(
        redis_url: str) -> None:
    """Parts an older kvtier left (no header, no TTL) are found by any gc run and deleted;
    chunks, their header included, are not touched unless a rule selects them."""
    tier = redis_tier(redis_url)
    for i in range(3):
        assert tier.put(key(i), payload(i))
    client = redis.Redis.from_url(redis_url)
    orphan_names = tier.names.values(key(9))[1:3]  # two parts, never a header
    for name in orphan_names:
        client.set(name, b"x" * 100)
    inventory = RedisInventory("redis", redis_config(redis_url))
    try:
        assert [o.locations for o in inventory.orphans()] == [tuple(sorted(orphan_names))]
        assert sorted(c.key_hex for c in inventory.chunks()) == [key(i).hex() for i in range(3)]
        [outcome] = run_gc([inventory], GcRequest(max_age_s=7 * 86400))
    finally:
        inventory.close()
    assert (outcome.removed_orphans, outcome.removed_chunks, outcome.kept_chunks) == (1, 0, 3)
    assert client.exists(*orphan_names) == 0 and headerless(client) == {}
    assert all(tier.contains(key(i)) for i in range(3))
    tier.close()


def test_gc_orphans_deletes_the_parts_left_and_a_dry_run_nothing(
        redis_server: RedisServer, tmp_path: Path) -> None:
    """`kvtier gc --orphans`, from the command line: a dry run leaves the orphans, a run
    deletes them, and every committed chunk stays readable."""
    tier = redis_tier(redis_server.url)
    for i in range(3):
        assert tier.put(key(i), payload(i))
    client = redis_server.client()
    for name in tier.names.values(key(9))[1:3]:  # two parts, never a header
        client.set(name, b"x" * 100)
    left = headerless(client)
    assert left
    config = tmp_path / "kvtier.yaml"
    config.write_text(yaml.safe_dump({"tiers": [{"kind": "redis", "url": redis_server.url,
                                                 "capacity": 0}]}))
    assert main(["gc", "--config", str(config), "--orphans", "--dry-run"]) == 0
    assert headerless(client) == left
    assert main(["gc", "--config", str(config), "--orphans"]) == 0
    assert headerless(client) == {}
    out = bytearray(LAYOUT.bytes_per_chunk)
    for i in range(3):
        assert tier.get_into(key(i), memoryview(out)).ok
    tier.close()
