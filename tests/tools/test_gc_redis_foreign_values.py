"""`kvtier gc` and `kvtier inspect` over a redis tier whose names hold values of a type the
tier never stores there (another application's, or hand-made), against a real redis-server.

Found in a hunt of the one-hash format: a hash at a namespace manifest's name failed every
gc run and every inspect (WRONGTYPE from the manifest's GET), as did a string at an LRU set's
name (ZSCAN); an LRU set member that is no UTF-8 failed them with a UnicodeDecodeError.
Now such a manifest reads as none, such a set's scores are not used, such members are not
keys, and every rule still runs: chunks are kept or deleted by their own use.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import redis
from orphankit import payload, redis_config, redis_tier
from tierkit import key

from kvtier.tiers.redis.inventory import RedisInventory
from kvtier.tools.admin.gc import GcRequest, run_gc

pytestmark = pytest.mark.redis
WEEK_S = 7 * 86400

FOREIGN: dict[str, Callable[[redis.Redis, str], object]] = {
    "a hash at the manifest's name":
        lambda client, digest: client.hset(f"kvtier:{digest}:manifest", "note", b"x"),
    "a string at the LRU set's name":
        lambda client, digest: client.set(f"kvtier:{{{digest}}}:lru", b"x"),
    "an LRU set member that is no key":
        lambda client, digest: client.zadd(f"kvtier:{{{digest}}}:lru", {b"\xff\xfe": 1}),
    "a list at a chunk's name": lambda client, digest: client.rpush(
        f"kvtier:{digest}:{{{key(9).hex()}}}:c", b"x"),
}


@pytest.mark.parametrize("foreign", sorted(FOREIGN))
def test_gc_and_inspect_run_beside_a_foreign_value(redis_url: str, foreign: str) -> None:
    tier = redis_tier(redis_url)
    client = redis.Redis.from_url(redis_url)
    for i in range(3):
        assert tier.put(key(i), payload(i))
    FOREIGN[foreign](client, tier.names.digest)
    inventory = RedisInventory("redis", redis_config(redis_url))
    try:
        listed = {c.key_hex for c in inventory.chunks()}
        assert {key(i).hex() for i in range(3)} <= listed
        inventory.manifests()
        [kept] = run_gc([inventory], GcRequest(max_age_s=WEEK_S))
        assert kept.removed_chunks == 0 and all(tier.contains(key(i)) for i in range(3))
        run_gc([inventory], GcRequest(orphans_only=True))
        [emptied] = run_gc([inventory], GcRequest(quota_bytes=0))
        assert emptied.removed_chunks == len(listed)
        assert not any(tier.contains(key(i)) for i in range(3))
    finally:
        inventory.close()
        client.flushdb()
        tier.close()
