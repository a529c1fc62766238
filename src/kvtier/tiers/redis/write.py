"""How the redis tier writes a chunk so that a write failing part-way leaves nothing behind
(issue 12, item 7; see tiers/redis/tier.py for the value names).

SETting the parts, then the header, in one pipeline is not enough: under `maxmemory` with
`noeviction` the server refuses the later SETs ("OOM command not allowed") after accepting
the first ones, and the parts it keeps have no header, no TTL and no LRU entry: never read,
never evicted, never deleted. So:
  1. the parts are SET with a short TTL, PART_TTL_MS: until committed they are garbage that
     the server itself deletes within that bound, whatever happens to this process;
  2. one Lua script, in the same pipeline (one round trip), commits the chunk
     atomically: only when every part is still there, it SETs the header and lifts the parts'
     TTL (PERSIST, or the tier's own `ttl_s`). Its first write is the header, so a full
     server refuses the script before it changed anything;
  3. on a failure the server reported, the parts are deleted at once (best effort,
     `ABORT_SCRIPT`: only while no header exists, so a concurrent writer's committed copy
     of the same chunk is never touched).
`kvtier gc` finds parts left without a header by anything else (an older kvtier, a
killed process's parts inside their TTL) through `RedisInventory.orphans`.

Primitives: `PART_TTL_MS`, `COMMIT_SCRIPT`, `ABORT_SCRIPT`, `write_chunk`, `abort_chunk`.
"""

from __future__ import annotations

from typing import Any

import redis

PART_TTL_MS = 60_000  # an uncommitted part is deleted by the server within this bound

# KEYS[1] the header, KEYS[2..] the parts; ARGV[1] the header value, ARGV[2] the chunk's TTL
# in ms (0 = none). Returns 1 committed, 0 a part was missing (nothing written).
COMMIT_SCRIPT = """
for i = 2, #KEYS do
  if redis.call('EXISTS', KEYS[i]) == 0 then return 0 end
end
local ttl_ms = tonumber(ARGV[2])
if ttl_ms > 0 then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ttl_ms)
  for i = 2, #KEYS do redis.call('PEXPIRE', KEYS[i], ttl_ms) end
else
  redis.call('SET', KEYS[1], ARGV[1])
  for i = 2, #KEYS do redis.call('PERSIST', KEYS[i]) end
end
return 1
"""

# KEYS[1] the header, KEYS[2..] the parts: delete the parts unless the header exists.
# Returns the number of values deleted. DEL is allowed on a full server.
ABORT_SCRIPT = """
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
return redis.call('DEL', unpack(KEYS, 2))
"""


def write_chunk(client: Any, names: list[str], header: bytes, payload: memoryview,
                part_bytes: int, ttl_ms: int | None) -> None:
    """Write a chunk's parts (with PART_TTL_MS) and commit its header, in one round trip.

    Args:
        client: a redis.Redis or RedisCluster (the names share one hash slot).
        names: the header's name, then the parts' (ChunkNames.values).
        header, payload: the header value and the payload (format "B"), cut in `part_bytes`.
        ttl_ms: the chunk's TTL once committed; None = none.

    Raises:
        redis.ResponseError: the server refused a value (e.g. "OOM command not allowed"), or
            a part was gone before the commit; the chunk was not committed.
        redis.ConnectionError, redis.TimeoutError: as the client raises them (the parts'
            TTL then bounds what is left).
    """
    pipe = client.pipeline(transaction=False)
    for i, name in enumerate(names[1:]):
        pipe.set(name, payload[i * part_bytes : (i + 1) * part_bytes], px=PART_TTL_MS)
    # EVAL, not EVALSHA: redis-py's pipelines load registered scripts with one more round
    # trip per execute; a few hundred bytes of script text cost less than that. Through
    # execute_command: redis-py's ClusterPipeline blocks its eval() helper.
    pipe.execute_command("EVAL", COMMIT_SCRIPT, len(names), *names, header, ttl_ms or 0)
    replies = pipe.execute(raise_on_error=False)
    errors = [reply for reply in replies if isinstance(reply, Exception)]
    if errors:
        raise errors[0]
    if replies[-1] != 1:
        raise redis.ResponseError("a part was gone before the header was written "
                                  "(evicted by the server); not committed")


def abort_chunk(client: Any, names: list[str]) -> int:
    """Delete the parts of a chunk whose commit failed, unless a header exists (another
    writer committed it). Returns the values deleted. Raises redis.RedisError."""
    return int(client.execute_command("EVAL", ABORT_SCRIPT, len(names), *names))
