"""The redis tier's capacity: its LRU index when `capacity` > 0; the server's own when it is 0.

  - capacity > 0: per namespace (prefix + layout) and across every client (the index,
    below). A chunk whose index update the server refuses (OOM right after the chunk's
    commit, an ACL user without TIME) is deleted, not left uncounted, and so is one evicted
    whose delete failed, with a later eviction (tiers/redis/undeleted.py). For a server
    shared with other data (which maxmemory eviction would also throw out), or to split one
    server between namespaces. Costs one more round trip per put, on the node holding the
    set. Counts whole chunks of the uncompressed size, compressed or not.
  - capacity = 0 (recommended for a dedicated cache server or cluster): the server's `maxmemory`
    with `allkeys-lru` (or `allkeys-lfu`) evicts, with Redis's exact memory accounting (real
    bytes: compression holds more chunks), no extra round trip and no hot index key; it evicts
    whole chunks (one hash each, tiers/redis/names.py). With the default `noeviction` policy a
    full server refuses writes: they are counted as dropped writes. `chunks`/`used_bytes` are
    then not tracked (see `kvtier inspect`).

One sorted set per namespace (prefix + layout), <prefix>{<digest>}:lru, scores chunks by last use
on the server's clock, so every client on every host shares one recency order. One Lua script
adds a new chunk, applies the hits batched since the last call and pops the least recently used
beyond capacity, atomically, so concurrent writers never overshoot. Hits are not sent one by one
(a round trip per read): they are batched and flushed with the next put, or when
`TOUCH_FLUSH_KEYS` are pending or `TOUCH_FLUSH_S` has passed.

The index holds no connection: every call goes through the tier's circuit breaker (`Runner`), and
a failed call is logged and skipped, as the tier's own writes are.

Primitives: `RedisLRUIndex`, `Runner`, `TOUCH_FLUSH_S`, `TOUCH_FLUSH_KEYS`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol, TypeVar

import redis

from kvtier.core.keys import ChunkKey
from kvtier.core.tier import TierCounters
from kvtier.errors import TierUnavailable
from kvtier.tiers.redis.client import Client

# The tier's logger, not this module's: operators filter on "kvtier.tiers.redis.tier" for the tier.
log = logging.getLogger("kvtier.tiers.redis.tier")
T = TypeVar("T")
TOUCH_FLUSH_S = 1.0  # hits are reported to the LRU index at least this often...
TOUCH_FLUSH_KEYS = 256  # ...or when this many are pending

# KEYS[1] the namespace's LRU set; ARGV: capacity (chunks), TTL (ms, 0 = none), the new chunk
# ("" for none), then chunks hit since the last call. Returns {chunks held, {victim, score...}}.
# A value of another type at the set's name (the tier's own name) is replaced, as a put
# replaces one at a chunk's: left there, it failed every put (WRONGTYPE), none stored.
_INDEX_SCRIPT = """
local kind = redis.call('TYPE', KEYS[1])['ok']
if kind ~= 'zset' and kind ~= 'none' then redis.call('DEL', KEYS[1]) end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local ttl_ms = tonumber(ARGV[2])
if ttl_ms > 0 then redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now - ttl_ms * 1000) end
for i = 4, #ARGV do redis.call('ZADD', KEYS[1], 'XX', now, ARGV[i]) end
if ARGV[3] ~= '' then redis.call('ZADD', KEYS[1], now, ARGV[3]) end
local victims = {}
local excess = redis.call('ZCARD', KEYS[1]) - tonumber(ARGV[1])
if excess > 0 then victims = redis.call('ZPOPMIN', KEYS[1], excess) end
return {redis.call('ZCARD', KEYS[1]), victims}
"""


class Runner(Protocol):
    """Runs `call(client)` on the server holding value `name`, through the tier's circuit
    breaker; raises TierUnavailable or redis.RedisError (RedisTier._run_for)."""

    def __call__(self, name: str, call: Callable[[Client], T], /) -> T: ...


class RedisLRUIndex:
    """A namespace's LRU set: bounds the tier to `capacity_chunks` chunks. Thread-safe.

    Keeps the tier's `chunks`/`used_bytes` counters and counts `evictions`; the values of the
    chunks it evicts are deleted through `evict`. No method raises on a server failure.
    """

    def __init__(self, tier_name: str, index_name: str, capacity_chunks: int, ttl_ms: int | None,
                 stored_bytes: int, counters: TierCounters, run: Runner,
                 evict: Callable[[Sequence[str]], None]) -> None:
        self.tier_name = tier_name
        self.name = index_name  # the sorted set's key: <prefix>{<digest>}:lru
        self.capacity_chunks = capacity_chunks
        self.ttl_ms = ttl_ms
        self.stored_bytes = stored_bytes  # one chunk's values, as stored
        self._counters = counters
        self._run = run
        self._evict = evict
        self._touch_lock = threading.Lock()
        self._touched: set[str] = set()
        self._touched_at = 0.0
        self._script: Any = None

    def touch(self, key: ChunkKey) -> None:
        """Note a hit; flushed with the next `add`, or now when due."""
        with self._touch_lock:
            self._touched.add(key.hex())
            due = (len(self._touched) >= TOUCH_FLUSH_KEYS
                   or time.monotonic() - self._touched_at > TOUCH_FLUSH_S)
        if due:
            self.update("")

    @property
    def pending(self) -> bool:
        """Whether hits wait to be flushed."""
        return bool(self._touched)

    def update(self, new_hex: str) -> TierUnavailable | redis.RedisError | None:
        """Add `new_hex` (unless ""), apply pending hits, evict beyond capacity. Returns
        why the index was not updated (the server down, or its error reply: OOM on a full
        server), else None."""
        with self._touch_lock:
            touched, self._touched = self._touched, set()
            self._touched_at = time.monotonic()
        args = [self.capacity_chunks, self.ttl_ms or 0, new_hex, *touched]
        try:
            held, flat = self._run(self.name, lambda c: self._script_for(c)(
                keys=[self.name], args=args, client=c))
        except (TierUnavailable, redis.RedisError) as exc:
            log.debug("redis tier %r: index update failed (%s)", self.tier_name, exc)
            return exc
        victims = [v.decode() for v in flat[::2]]
        if victims:
            self._evict(victims)
            self._counters.add(evictions=len(victims))
        self._counters.set(chunks=int(held), used_bytes=int(held) * self.stored_bytes)
        return None

    def remove(self, hex_keys: list[str]) -> None:
        """Drop chunks from the index (deleted, or found bad)."""
        def zrem(client: Client) -> int:
            pipe = client.pipeline(transaction=False)
            pipe.zrem(self.name, *hex_keys)
            pipe.zcard(self.name)
            return int(pipe.execute()[1])

        try:
            held = self._run(self.name, zrem)
        except (TierUnavailable, redis.RedisError):
            return
        self._counters.set(chunks=held, used_bytes=held * self.stored_bytes)

    def _script_for(self, client: Client) -> Any:
        # Registering does no I/O (it hashes the script); the Script runs EVALSHA on the client
        # it is called with and loads the script into a server that lacks it.
        if self._script is None:
            self._script = client.register_script(_INDEX_SCRIPT)
        return self._script
