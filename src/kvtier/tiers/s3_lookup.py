"""The s3 tier's lookups besides the HEADs themselves (tiers/s3.py): the short-lived memory of
chunks found absent, and the scheduler's probe over every TP rank's tier.

Why a negative cache: the scheduler asks again, every step, about the prefix of a request
that waits for blocks; without it each ask is one HEAD per chunk. An entry lives
`negative_cache_s` (1 s by default), so another engine's new chunk is missed that long at
most; this tier's own put forgets it at once. Bounded: past MAX_ENTRIES the expired entries
are dropped. (Measured: docs/performance.md, "The s3 tier".)

Primitives: `NegativeCache`, `S3Probe`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvtier.core.keys import ChunkKey
from kvtier.tiers.redis import TierProbe

if TYPE_CHECKING:
    from kvtier.tiers.s3 import S3Tier

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


class S3Probe(TierProbe):
    """The scheduler's probe: a chunk counts only when every layout's (TP rank's) object
    exists. Offers `BatchLookup` too, so a caller holding a whole prefix asks its HEADs in
    parallel (`S3Tier.contains_many`) rather than one after another."""

    def __init__(self, tiers: Sequence[S3Tier]) -> None:
        super().__init__(tiers, blocking_ok=False)
        self.s3_tiers = list(tiers)

    def contains_many(self, keys: Sequence[ChunkKey]) -> list[bool]:
        found = [True] * len(keys)
        for tier in self.s3_tiers:
            found = [f and held for f, held in zip(found, tier.contains_many(keys))]
        return found
