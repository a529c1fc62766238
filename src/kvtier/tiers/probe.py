"""A probe ("is this chunk stored?", `kvtier.core.tier.Probe`) through tier objects whose
construction has no side effects: the remote tiers (redis, s3) build one per layout and ask
them all, so that a chunk counts only when every tensor-parallel rank's shard is stored.

Primitives: `TierProbe`.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvtier.core.keys import ChunkKey
from kvtier.core.tier import BatchLookup, Tier


class TierProbe:
    """A probe through tier objects whose construction has no side effects (redis, s3): a
    chunk counts only when the tier of every layout (every TP rank) holds it."""

    def __init__(self, tiers: Sequence[Tier], blocking_ok: bool) -> None:
        self.tiers = list(tiers)
        self.blocking_ok = blocking_ok

    def contains(self, key: ChunkKey) -> bool:
        return all(tier.contains(key) for tier in self.tiers)

    def contains_many(self, keys: Sequence[ChunkKey]) -> list[bool]:
        """`contains` of each key (`BatchLookup`): one batched lookup per tier that offers
        one (a pipelined round trip, parallel HEADs), else a key at a time."""
        found = [True] * len(keys)
        for tier in self.tiers:
            held = (tier.contains_many(keys) if isinstance(tier, BatchLookup)
                    else [tier.contains(key) for key in keys])
            found = [f and h for f, h in zip(found, held)]
        return found

    def close(self) -> None:
        """Close every layout's tier object (their connections, their lookup threads)."""
        for tier in self.tiers:
            tier.close()
