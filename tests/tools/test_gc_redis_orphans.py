"""`kvtier gc` over a redis tier's orphans (issue 12, item 7): parts without a header, as a
put that failed part-way or an older kvtier left them, against a real redis-server. How the
tier leaves none (and gives them a short TTL): tests/faults/test_redis_orphans.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import redis
import yaml
from orphankit import (
    LAYOUT,
    headerless,
    payload,
    redis_config,
    redis_tier,
)
from redis_server import RedisServer
from tierkit import key

from kvtier.tiers.redis.inventory import RedisInventory
from kvtier.tools.admin.gc import GcRequest, run_gc
from kvtier.tools.cli.main import main

pytestmark = pytest.mark.redis
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
