"""A real redis-server squeezed until it refuses writes, and what such writes could leave:
the kit of the redis tier's orphan tests (tests/faults/test_redis_orphans.py: the tier leaves
no partial chunk; tests/tools/test_gc_redis_orphans.py: `kvtier gc` deletes an older kvtier's
values). Not named conftest.py: see tierkit.py. The squeezed server is tests/conftest.py's
`tight` fixture.
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


def hset_counts(client: redis.Redis) -> tuple[int, int]:
    """HSETs the server executed and HSETs it refused (INFO commandstats), so far."""
    stats = client.info("commandstats").get("cmdstat_hset", {})
    return int(stats.get("calls", 0)), int(stats.get("rejected_calls", 0))


def partial_chunks(client: redis.Redis, fields: int, prefix: str = "kvtier:") -> list[str]:
    """The chunks' hashes (sorted) that lack their header or hold other than `fields`
    fields (header and parts)."""
    return sorted(raw.decode() for raw in client.scan_iter(match=f"{prefix}*:c")
                  if client.hlen(raw) != fields or not client.hexists(raw, "h"))


def older_values(tier: RedisTier, i: int, parts: int, header: bool = True) -> list[str]:
    """The value names an older kvtier gave chunk `key(i)`: a header, then a value a part."""
    base = tier.names.chunk(key(i)).removesuffix(":c") + ":"
    return [base + "h"] * header + [base + str(n) for n in range(parts)]


def older(client: redis.Redis, prefix: str = "kvtier:") -> list[str]:
    """Every value name of an older kvtier's form under `prefix` (sorted)."""
    return sorted(raw.decode() for raw in client.scan_iter(match=f"{prefix}*")
                  if not raw.decode().endswith((":c", ":lru", ":manifest")))


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


def squeezed_puts(tier: RedisTier, client: redis.Redis, first_key: int) -> Iterator[int]:
    """Puts under growing headroom; yields the key number of each refused put (FULL)."""
    for n, headroom in enumerate(range(0, 128 * 1024, HEADROOM_STEP)):
        squeeze(client, headroom)
        result = tier.put(key(first_key + n), payload(n))
        if not result.ok:
            assert result == FULL, result
            yield first_key + n
