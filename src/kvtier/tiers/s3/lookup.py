"""The s3 tier's lookups besides the HEADs themselves (tiers/s3/tier.py): the short-lived memory of
chunks found absent. (The scheduler's probe over every TP rank's tier is redis.py's
`TierProbe`, whose `contains_many` asks each tier's parallel HEADs.)

Why a negative cache: the scheduler asks again, every step, about the prefix of a request
that waits for blocks; without it each ask is one HEAD per chunk. An entry lives
`negative_cache_s` (1 s by default), so another engine's new chunk is missed that long at
most; this tier's own put forgets it at once. Bounded: past MAX_ENTRIES the expired entries
are dropped. (Measured: docs/performance.md, "The s3 tier".)

Primitives: `NegativeCache`.
"""

from __future__ import annotations

import threading
import time

from kvtier.core.keys import ChunkKey

MAX_ENTRIES = 100_000  # ~10 MB of keys and times at most


class NegativeCache:
    """Keys found absent, each for `ttl_s` (0: nothing is remembered). Thread-safe."""

    def __init__(self, ttl_s: float) -> None:
        self.ttl_s = ttl_s
        self._until: dict[ChunkKey, float] = {}  # key -> monotonic expiry
        self._lock = threading.Lock()

    def absent(self, key: ChunkKey) -> bool:
        """Whether `key` was found absent less than `ttl_s` ago."""
        with self._lock:
            return self._until.get(key, 0.0) > time.monotonic()

    def remember(self, key: ChunkKey) -> None:
        if self.ttl_s <= 0:
            return
        now = time.monotonic()
        with self._lock:
            if len(self._until) > MAX_ENTRIES:
                self._until = {k: t for k, t in self._until.items() if t > now}
            self._until[key] = now + self.ttl_s

    def forget(self, key: ChunkKey) -> None:
        with self._lock:
            self._until.pop(key, None)
