"""Which of the workers' tiers hold a chunk, as the scheduler learns it: the tiers' stored and
removed events in the workers' reports (a store goes to the top tier, RAM, first), else the
tier whose probe found it (kvtier.core.locator). A load reads each chunk from the fastest tier
holding it, so that tier is where a hit's chunk is expected to come from.

Scheduler side, one thread. Bounded: past `max_keys` the least recently seen are forgotten;
a chunk nothing is known of is expected from the slowest tier (the tiers that send no events,
e.g. Redis, sit last in the usual configurations).

Primitives: `Holders`.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from kvtier.core.keys import ChunkKey


class Holders:
    """Chunk key -> the tiers known to hold it, as a bit mask over `tiers` (fastest first)."""

    def __init__(self, tiers: Sequence[str], max_keys: int) -> None:
        self._tiers = list(tiers)
        self._bits = {name: 1 << i for i, name in enumerate(self._tiers)}
        self._held: OrderedDict[ChunkKey, int] = OrderedDict()
        self._max_keys = max(1, max_keys)

    def stored(self, key: ChunkKey, tier: str) -> None:
        bit = self._bits.get(tier)
        if bit is not None:
            self._held[key] = self._held.get(key, 0) | bit
            self._held.move_to_end(key)
            while len(self._held) > self._max_keys:
                self._held.popitem(last=False)

    def removed(self, key: ChunkKey, tier: str) -> None:
        mask = self._held.get(key)
        if mask is not None:
            self._held[key] = mask & ~self._bits.get(tier, 0)

    def holds(self, key: ChunkKey, tier: str) -> bool:
        return bool(self._held.get(key, 0) & self._bits.get(tier, 0))

    def source(self, key: ChunkKey, found_in: str | None = None) -> str:
        """The tier a load of `key` is expected to read: the fastest known to hold it, else
        `found_in` (the tier a probe found it in), else the slowest tier."""
        mask = self._held.get(key, 0)
        if mask:
            return self._tiers[(mask & -mask).bit_length() - 1]
        return found_in if found_in in self._bits else self._tiers[-1]
