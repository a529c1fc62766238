"""The tier registry: which tier kinds exist and where each lives, imported only when used.

One line per kind maps it to "module:Class". The class is the whole tier: it is built as
`TierClass(config, layout)`, its `config_model` attribute is its config's pydantic model (a
`kvtier.config.TierSettings` subclass with `kind: Literal["<kind>"]`), and it may offer the
optional class-level abilities `probe` (`kvtier.core.locator.ProbeSource`) and
`open_inventory` (`kvtier.core.tier.InventorySource`). Adding a tier kind is its module plus
one line here (see `kvtier/tiers/example.py`).

This module imports nothing of kvtier, so that `kvtier.config` can find config models
through it without an import cycle.

Primitives: `TIER_CLASSES`, `tier_class`, `config_model`, `public_kinds`.
"""

from __future__ import annotations

import importlib
from typing import Any

from pydantic import BaseModel

# kind -> "module:Class"
TIER_CLASSES: dict[str, str] = {
    "memory": "kvtier.tiers.memory:MemoryTier",
    "disk": "kvtier.tiers.disk:DiskTier",
    "shared": "kvtier.tiers.shared:SharedTier",
    "redis": "kvtier.tiers.redis:RedisTier",
    "example": "kvtier.tiers.example:ExampleTier",  # the tutorial tier: tests and docs only
}
_UNLISTED = frozenset({"example"})  # accepted, but not offered in error messages or docs


def tier_class(kind: str) -> Any:
    """The class of tier `kind` (its module imported now).

    Raises:
        KeyError: no such kind (config validation rejects those first).
    """
    module_name, class_name = TIER_CLASSES[kind].split(":")
    return getattr(importlib.import_module(module_name), class_name)


def config_model(kind: str) -> type[BaseModel]:
    """The pydantic model of tier `kind`'s config (its module imported now): a subclass of
    `kvtier.config.TierSettings` (not imported here, which would be an import cycle)."""
    model: type[BaseModel] = tier_class(kind).config_model
    return model


def public_kinds() -> list[str]:
    """The tier kinds offered to operators, sorted."""
    return sorted(k for k in TIER_CLASSES if k not in _UNLISTED)
