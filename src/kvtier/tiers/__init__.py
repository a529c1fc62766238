"""The tier registry: one module per tier, imported only when a store uses it.

Every tier is built the same way: `TierClass(config, layout)`. Tiers whose contents other
processes can see (files, remote stores) also offer a probe: a side-effect-free "is this chunk
stored?" for processes that do not own the tier (vLLM's scheduler).

Primitives: `build_tier`, `build_probe`, `TIER_CLASSES`.
"""

from __future__ import annotations

import importlib

from kvtier.config import TierConfig
from kvtier.core.keys import ChunkKey
from kvtier.core.layout import KVLayout
from kvtier.core.locator import Probe
from kvtier.core.tier import Tier

# kind -> "module:Class"
TIER_CLASSES: dict[str, str] = {
    "memory": "kvtier.tiers.memory:MemoryTier",
    "disk": "kvtier.tiers.disk:DiskTier",
    "shared": "kvtier.tiers.shared:SharedTier",
    "redis": "kvtier.tiers.redis:RedisTier",
}


def build_tier(config: TierConfig, layout: KVLayout) -> Tier:
    """Construct the tier that `config.kind` names."""
    module_name, class_name = TIER_CLASSES[config.kind].split(":")
    tier_class = getattr(importlib.import_module(module_name), class_name)
    return tier_class(config, layout)  # type: ignore[no-any-return]


def build_probe(config: TierConfig, layouts: list[KVLayout]) -> Probe | None:
    """A probe of the tier `config` names for chunks of all `layouts` (e.g. every TP rank's),
    or None for a tier private to its process (memory)."""
    from kvtier.tiers.chunkfiles import FileProbe

    digests = [layout.digest() for layout in layouts]
    if config.kind == "disk":
        return FileProbe(config.path, digests, blocking_ok=True)
    if config.kind == "shared":  # may be NFS: stat latency is the network's
        return FileProbe(config.path, digests, blocking_ok=False)
    if config.kind == "redis":  # connects lazily: building it does no I/O
        return TierProbe([build_tier(config, layout) for layout in layouts], blocking_ok=False)
    return None


class TierProbe:
    """A probe through tier objects whose construction has no side effects (redis): a chunk
    counts only when the tier of every layout (every TP rank) holds it."""

    def __init__(self, tiers: list[Tier], blocking_ok: bool) -> None:
        self.tiers = tiers
        self.blocking_ok = blocking_ok

    def contains(self, key: ChunkKey) -> bool:
        return all(tier.contains(key) for tier in self.tiers)
