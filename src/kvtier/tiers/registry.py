"""The tier registry: which tier kinds exist and where each lives, imported only when used.

One line per kind maps it to "module:Class". The class is the whole tier (`TierClass`): it is
built as `TierClass(config, layout)`, its `config_model` attribute is its config's pydantic
model (a `kvtier.tiers.storeconfig.TierSettings` subclass with `kind: Literal["<kind>"]`), it
states the kind's facts (`kvtier.core.tier.Tier`: medium, locality, ...), and it may offer the
optional class-level abilities `probe` (`ProbeSource`), `open_inventory` (`InventorySource`)
and `refuse_owned` (`DirectoryOwnerSource`). Adding a tier kind is its module plus one line
here (see `kvtier/tiers/example.py`).

Tier modules are imported lazily, when a config names their kind: a store without a redis
tier never imports the redis client.

Primitives: `TIER_CLASSES`, `TierClass`, `tier_class`, `config_model`, `public_kinds`.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any, Protocol

from kvtier.config import FrozenModel
from kvtier.core.tier import Locality, Medium, Tier

if TYPE_CHECKING:
    from kvtier.core.layout import KVLayout

# kind -> "module:Class"
TIER_CLASSES: dict[str, str] = {
    "memory": "kvtier.tiers.memory:MemoryTier",
    "disk": "kvtier.tiers.files.disk:DiskTier",
    "shared": "kvtier.tiers.files.shared:SharedTier",
    "redis": "kvtier.tiers.redis.tier:RedisTier",
    "s3": "kvtier.tiers.s3.tier:S3Tier",
    "example": "kvtier.tiers.example:ExampleTier",  # the tutorial tier: tests and docs only
}
_UNLISTED = frozenset({"example"})  # accepted, but not offered in error messages or docs


class TierClass(Protocol):
    """A tier kind's class, as the registry finds it: its constructor, its config model and
    the kind's facts (the class attributes `kvtier.core.tier.Tier` declares)."""

    config_model: type[FrozenModel]  # a kvtier.tiers.storeconfig.TierSettings subclass
    medium: Medium
    locality: Locality
    has_path: bool
    has_server: bool
    capacity_split_by_rank: bool

    def __call__(self, config: Any, layout: KVLayout) -> Tier: ...


def tier_class(kind: str) -> TierClass:
    """The class of tier `kind` (its module imported now).

    Raises:
        KeyError: no such kind (config validation rejects those first).
    """
    module_name, class_name = TIER_CLASSES[kind].split(":")
    cls: TierClass = getattr(importlib.import_module(module_name), class_name)
    return cls


def config_model(kind: str) -> type[FrozenModel]:
    """The pydantic model of tier `kind`'s config (its module imported now)."""
    return tier_class(kind).config_model


def public_kinds() -> list[str]:
    """The tier kinds offered to operators, sorted."""
    return sorted(k for k in TIER_CLASSES if k not in _UNLISTED)
