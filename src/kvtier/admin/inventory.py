"""What a store's persistent tiers hold, read from the tiers' storage itself (directories,
Redis), without building the tiers: building a tier evicts to its quota, and an operator's
`kvtier inspect` must change nothing.

A namespace is a layout digest (KVLayout.digest()): each directory tier keeps a layout's
chunks under ROOT/<digest>/, the redis tier under <prefix><digest>:. Chunk keys are hashes,
so the model behind a namespace is not recoverable from storage; `kvtier plan` or the engine's
logs map models to digests.

How a tier's storage is read is the tier's own business: a tier class that offers
`open_inventory` (`kvtier.core.tier.InventorySource`) is persistent; the others (memory)
live in a process and have nothing to inspect.

Primitives: `StoredChunk`, `NamespaceUsage`, `Inventory` (protocol; both from
kvtier.core.tier), `OrphanSource` (its optional ability), `open_inventories`, `summarize`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from kvtier.config import StoreConfig
from kvtier.core.tier import Inventory, InventorySource, StoredChunk
from kvtier.errors import ConfigError
from kvtier.tiers.registry import tier_class

__all__ = ["Inventory", "NamespaceUsage", "OrphanSource", "StoredChunk", "open_inventories",
           "summarize"]


@dataclass(frozen=True, slots=True)
class NamespaceUsage:
    """What one tier holds of one namespace."""

    tier: str  # the tier's name in the store config
    kind: str  # disk, shared, redis
    namespace: str
    chunks: int
    size_bytes: int
    oldest_s: float | None  # unix time of the least recently used chunk
    newest_s: float | None  # unix time of the most recently used chunk
    hits: int | None  # hits recorded by the storage itself; None when it records none


@runtime_checkable
class OrphanSource(Protocol):
    """An optional ability of an `Inventory`: values a failed write left behind that no
    reader can reach (redis parts without their header), which `kvtier gc` deletes."""

    def orphans(self) -> list[StoredChunk]:
        """Every orphan, every namespace. Raises what `Inventory.chunks` raises."""
        ...

    def remove_orphans(self, orphans: Sequence[StoredChunk]) -> int:
        """Delete these orphans (those not completed since); the values deleted."""
        ...


def open_inventories(config: StoreConfig, tier: str | None = None) -> list[Inventory]:
    """An inventory per persistent tier of `config` (memory tiers live in a process: none),
    or only the tier named `tier`.

    Raises:
        ConfigError: `tier` names no persistent tier of the config; a redis password file
            or variable is unusable.
    """
    persistent = [t for t in config.tiers if isinstance(tier_class(t.kind), InventorySource)]
    chosen = [t for t in persistent if tier in (None, t.tier_name)]
    if tier is not None and not chosen:
        names = [t.tier_name for t in persistent]
        raise ConfigError("--tier", tier, f"a persistent tier of the config: {names}")
    return [tier_class(t.kind).open_inventory(t) for t in chosen]


def summarize(inventory: Inventory, chunks: Sequence[StoredChunk]) -> list[NamespaceUsage]:
    """Per-namespace totals of `chunks` (all from `inventory`), namespaces sorted."""
    groups: dict[str, list[StoredChunk]] = {}
    for chunk in chunks:
        groups.setdefault(chunk.namespace, []).append(chunk)
    return [
        NamespaceUsage(inventory.name, inventory.kind, namespace, len(group),
                       sum(c.size_bytes for c in group), min(c.last_used_s for c in group),
                       max(c.last_used_s for c in group), None)
        for namespace, group in sorted(groups.items())
    ]
