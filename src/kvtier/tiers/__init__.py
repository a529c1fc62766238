"""The tier registry: one module per tier, imported only when a store uses it.

Every tier is built the same way: `TierClass(config, layout)`.

Primitives: `build_tier`, `TIER_CLASSES`.
"""

from __future__ import annotations

import importlib

from kvtier.config import TierConfig
from kvtier.core.layout import KVLayout
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
