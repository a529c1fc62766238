"""A real redis-server squeezed until it refuses writes part-way, and what such writes leave:
the kit of the redis tier's orphan tests (tests/faults/test_redis_orphans.py: the tier leaves
none; tests/tools/test_gc_redis_orphans.py: `kvtier gc` deletes those left anyway). Not named
conftest.py: see tierkit.py. The squeezed server is tests/conftest.py's `tight` fixture.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import redis
from tierkit import key, tiny_layout

from kvtier.core.layout import KVLayout
from kvtier.core.tier import FULL
from kvtier.tiers import build_tier
from kvtier.tiers.redis.config import RedisTierConfig
from kvtier.tiers.redis.tier import RedisTier
from kvtier.tiers.storeconfig import StoreConfig

LAYOUT = tiny_layout(tokens_per_chunk=256)  # 64 KiB chunks
PART_BYTES = 16 * 1024  # 4 parts a chunk
HEADROOM_STEP = 4 * 1024  # the server is squeezed to 0, 4, 8... KiB above what it holds


def payload(i: int, layout: KVLayout = LAYOUT) -> memoryview:
    return memoryview(bytes((i * 11 + j) % 251 for j in range(256)) * (
        layout.bytes_per_chunk // 256))


def squeeze(client: redis.Redis, headroom_bytes: int) -> None:
    """maxmemory = what the server uses now + `headroom_bytes`."""
    client.config_set("maxmemory", 0)
    client.config_set("maxmemory", int(client.info("memory")["used_memory"]) + headroom_bytes)


def set_counts(client: redis.Redis) -> tuple[int, int]:
    """SETs the server executed and SETs it refused (INFO commandstats), so far."""
    stats = client.info("commandstats").get("cmdstat_set", {})
    return int(stats.get("calls", 0)), int(stats.get("rejected_calls", 0))


def headerless(client: redis.Redis, prefix: str = "kvtier:") -> dict[str, list[str]]:
    """Chunk -> its values (sorted: SCAN's order changes as the keyspace does), for every
    chunk whose values exist without a header."""
    groups: dict[str, list[str]] = {}
    for raw in client.scan_iter(match=f"{prefix}*"):
        name = raw.decode()
        if not name.endswith(":lru"):
            groups.setdefault(name.rpartition(":")[0], []).append(name)
    return {base: sorted(names) for base, names in groups.items() if base + ":h" not in names}


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


def squeezed_puts(tier: RedisTier, client: redis.Redis, first_key: int) -> Iterator[bool]:
    """Puts under growing headroom; yields, for each refused put, whether the server
    executed part of it (some SETs done, some refused) - a partial write."""
    for n, headroom in enumerate(range(0, 128 * 1024, HEADROOM_STEP)):
        squeeze(client, headroom)
        before = set_counts(client)
        result = tier.put(key(first_key + n), payload(n))
        after = set_counts(client)
        if not result.ok:
            assert result == FULL, result
            yield after[0] > before[0] and after[1] > before[1]
