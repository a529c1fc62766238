"""`kvtier gc` over a redis tier's orphans: the values an older kvtier stored a chunk in (a
header and a value per part, or parts a failed write left without a header), which no reader
reads now that a chunk is one hash, against a real redis-server. How the tier's own writes
leave nothing partial: tests/faults/test_redis_orphans.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import redis
import yaml
from orphankit import (
    LAYOUT,
    older,
    older_values,
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
def test_gc_deletes_an_older_kvtiers_values_and_spares_chunks(redis_url: str) -> None:
    """An older kvtier's values (a whole chunk: header and parts; two parts without a
    header) are found by any gc run and deleted; chunks are not touched unless a rule
    selects them."""
    tier = redis_tier(redis_url)
    for i in range(3):
        assert tier.put(key(i), payload(i))
    client = redis.Redis.from_url(redis_url)
    whole, headless = older_values(tier, 8, 4), older_values(tier, 9, 2, header=False)
    for name in whole + headless:
        client.set(name, b"x" * 100)
    inventory = RedisInventory("redis", redis_config(redis_url))
    try:
        assert sorted(o.locations for o in inventory.orphans()) == sorted(
            [tuple(sorted(whole)), tuple(sorted(headless))])
        assert sorted(c.key_hex for c in inventory.chunks()) == [key(i).hex() for i in range(3)]
        [outcome] = run_gc([inventory], GcRequest(max_age_s=7 * 86400))
    finally:
        inventory.close()
    assert (outcome.removed_orphans, outcome.removed_chunks, outcome.kept_chunks) == (2, 0, 3)
    assert client.exists(*whole, *headless) == 0 and older(client) == []
    assert all(tier.contains(key(i)) for i in range(3))
    tier.close()


def test_gc_orphans_deletes_older_values_and_a_dry_run_nothing(
        redis_server: RedisServer, tmp_path: Path) -> None:
    """`kvtier gc --orphans`, from the command line: a dry run leaves the orphans (an older
    kvtier's values), a run deletes them, and every chunk stays readable."""
    tier = redis_tier(redis_server.url)
    for i in range(3):
        assert tier.put(key(i), payload(i))
    client = redis_server.client()
    for name in older_values(tier, 9, 2, header=False) + older_values(tier, 8, 4):
        client.set(name, b"x" * 100)
    left = older(client)
    assert left
    config = tmp_path / "kvtier.yaml"
    config.write_text(yaml.safe_dump({"tiers": [{"kind": "redis", "url": redis_server.url,
                                                 "capacity": 0}]}))
    assert main(["gc", "--config", str(config), "--orphans", "--dry-run"]) == 0
    assert older(client) == left
    assert main(["gc", "--config", str(config), "--orphans"]) == 0
    assert older(client) == []
    out = bytearray(LAYOUT.bytes_per_chunk)
    for i in range(3):
        assert tier.get_into(key(i), memoryview(out)).ok
    tier.close()
