"""What a store's persistent tiers hold, read from the tiers' storage itself (directories,
Redis), without building the tiers: building a tier evicts to its quota, and an operator's
`kvtier inspect` must change nothing.

A namespace is a layout digest (KVLayout.digest()): each directory tier keeps a layout's
chunks under ROOT/<digest>/, the redis tier under <prefix><digest>:. The connector puts the
served model's fingerprint in the layout, so each checkpoint has namespaces of its own, and
each tier records a namespace's manifest when it opens it (tiers/manifest.py: the model's name
as served, its fingerprint, the layout, the kvtier version): ROOT/<digest>/manifest.json, or
<prefix><digest>:manifest. Chunk keys are hashes, so the manifest is the only way back from a
namespace to its model: namespaces written before manifests existed (or by a store opened
without a model, e.g. a bench), or whose manifest is unreadable, show the model as "unknown".

How a tier's storage is read is the tier's own business: a tier class that offers
`open_inventory` (`kvtier.core.tier.InventorySource`) is persistent; the others (memory)
live in a process and have nothing to inspect. An inventory that also offers
`ManifestSource` reads (and `kvtier gc` removes) manifests.

Primitives: `StoredChunk`, `NamespaceUsage`, `Inventory` (protocol; both from
kvtier.core.tier), `OrphanSource`, `ManifestSource`, `UnusedRemoval` and `StorageClock`
(its optional abilities), `storage_now`, `Removal`,
`persistent_tiers`, `open_inventories`, `read_manifests`, `summarize`, `UNKNOWN`.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, runtime_checkable

from kvtier.core.tier import Inventory, InventorySource, Removal, StoredChunk
from kvtier.errors import ConfigError
from kvtier.tiers import answers
from kvtier.tiers.files import directories
from kvtier.tiers.manifest import NamespaceManifest
from kvtier.tiers.registry import public_kinds, tier_class
from kvtier.tiers.storeconfig import StoreConfig, TierSettings

__all__ = ["UNKNOWN", "Inventory", "ManifestSource", "NamespaceUsage", "OrphanSource",
           "Removal", "StorageClock", "StoredChunk", "UnusedRemoval", "open_inventories",
           "persistent_tiers", "read_manifests", "storage_now", "summarize"]
UNKNOWN = "unknown"  # model and fingerprint of a namespace without a (valid) manifest


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
    model: str = UNKNOWN  # the model's name as served, from the namespace's manifest
    fingerprint: str = UNKNOWN  # the model's fingerprint (32 hex; "none" when not computed)
    weight_files: int | None = None  # checkpoint files in the fingerprint (0: weights not)


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


@runtime_checkable
class ManifestSource(Protocol):
    """An optional ability of an `Inventory`: the namespaces' manifests (tiers/manifest.py)."""

    def manifests(self) -> dict[str, NamespaceManifest | None]:
        """namespace -> its manifest (None: present but not a valid one), for every namespace
        that has one. Raises what `Inventory.chunks` raises; never for a bad manifest."""
        ...

    def remove_manifest(self, namespace: str) -> bool:
        """Delete `namespace`'s manifest; True when there was one."""
        ...


@runtime_checkable
class UnusedRemoval(Protocol):
    """An optional ability of an `Inventory` whose storage records each use of a chunk (a
    file's mtime, which every hit touches; a redis hash's idle time, its LRU set's score;
    not S3's LastModified, which reads leave): delete only what was not used since it was
    listed. `kvtier gc --quota/--max-age` chose its victims for being least recently used;
    one an engine read between the listing and the deletion is hot now and must stay."""

    def remove_unused(self, chunks: Sequence[StoredChunk]) -> Removal:
        """Delete these chunks, each unless used since it was listed (later than its
        `last_used_s`), checked just before it goes. Raises what `Inventory.remove` raises."""
        ...


@runtime_checkable
class StorageClock(Protocol):
    """An optional ability of an `Inventory` whose times of use (`StoredChunk.last_used_s`)
    are stamped by the storage's own clock, not this host's (a file's mtime: on NFS the
    server's; an S3 object's LastModified: the S3 server's): now by that clock, so that an
    age is one clock's difference. A gc host whose clock ran 10 minutes ahead took, with
    `--max-age 15m`, every chunk idle for 5 minutes for an idle one
    (tests/tools/test_gc_clock_skew.py, test_gc_s3_clock_skew.py). Redis' times are this
    host's (its clock less the server's idle time): it needs none."""

    def now_s(self) -> float:
        """Unix time now by the storage's clock; this host's where it cannot be read.
        Never raises."""
        ...


def storage_now(inventory: Inventory) -> float:
    """Now by the clock `inventory`'s times of use are stamped by (`StorageClock`), or by
    this host's."""
    return inventory.now_s() if isinstance(inventory, StorageClock) else time.time()


def read_manifests(inventory: Inventory) -> dict[str, NamespaceManifest | None]:
    """`inventory`'s manifests, or {} when it keeps none. Raises what `chunks` raises."""
    return inventory.manifests() if isinstance(inventory, ManifestSource) else {}


def persistent_tiers(config: StoreConfig) -> list[TierSettings]:
    """The tiers of `config` whose storage outlives a process (their kind offers
    inventories), in the config's order: what inspect and gc read."""
    return [t for t in config.tiers if _inventory_source(t.kind) is not None]


def open_inventories(config: StoreConfig, tier: str | None = None, *,
                     unanswered: dict[str, str] | None = None) -> list[Inventory]:
    """An inventory per persistent tier of `config` (memory tiers live in a process: none),
    or only the tier named `tier`. With `unanswered`, a tier whose directory does not answer
    within `directories.CHECK_TIMEOUT_S` (a dead hard-mounted NFS server blocks every call
    into it for ever), or does not exist, is left out and said there (tier name -> why),
    rather than hang or be listed as empty: a tier creates its directory when it starts, so
    a missing one is a wrong path, an unmounted volume, or a tier never started here.

    Raises:
        ConfigError: `config` has no persistent tier; `tier` names none of them; a redis
            password file or variable is unusable.
    """
    persistent = [(t, source) for t in config.tiers
                  if (source := _inventory_source(t.kind)) is not None]
    if not persistent:
        kinds = [k for k in public_kinds() if _inventory_source(k) is not None]
        raise ConfigError("tiers", [t.kind for t in config.tiers],
                          f"at least one persistent tier ({', '.join(kinds)}) to read: a "
                          "memory tier lives in its engine's process, nothing outside holds it")
    chosen = [(t, source) for t, source in persistent if tier in (None, t.tier_name)]
    if tier is not None and not chosen:
        names = [t.tier_name for t, _ in persistent]
        raise ConfigError("--tier", tier, f"a persistent tier of the config: {names}")
    if unanswered is not None:
        for t, _ in chosen:
            path = getattr(t, "path", None)
            if path is None:
                continue
            if not answers(Path(path), directories.CHECK_TIMEOUT_S):
                unanswered[t.tier_name] = (f"{path} did not answer within "
                                           f"{directories.CHECK_TIMEOUT_S:g} s (a dead mount?)")
            elif not Path(path).exists():
                unanswered[t.tier_name] = (f"{path} does not exist (a tier creates it when it "
                                           "starts: a wrong path, an unmounted volume, or no "
                                           "engine has used this tier here yet)")
        chosen = [(t, source) for t, source in chosen if t.tier_name not in unanswered]
    return [source.open_inventory(t) for t, source in chosen]


def _inventory_source(kind: str) -> InventorySource | None:
    """The class of tier `kind` when it offers inventories (a persistent tier), else None."""
    cls = tier_class(kind)
    return cls if isinstance(cls, InventorySource) else None


def summarize(inventory: Inventory, chunks: Sequence[StoredChunk],
              manifests: Mapping[str, NamespaceManifest | None] | None = None,
              ) -> list[NamespaceUsage]:
    """Per-namespace totals of `chunks` (all from `inventory`) with the model of each
    namespace's manifest (`manifests`, from `read_manifests`); a namespace with a manifest and
    no chunk is listed with 0 chunks. Namespaces sorted."""
    manifests = manifests or {}
    groups: dict[str, list[StoredChunk]] = {namespace: [] for namespace in manifests}
    for chunk in chunks:
        groups.setdefault(chunk.namespace, []).append(chunk)
    rows = []
    for namespace, group in sorted(groups.items()):
        manifest = manifests.get(namespace)
        rows.append(NamespaceUsage(
            inventory.name, inventory.kind, namespace, len(group),
            sum(c.size_bytes for c in group),
            min((c.last_used_s for c in group), default=None),
            max((c.last_used_s for c in group), default=None), None,
            model=manifest.model if manifest else UNKNOWN,
            fingerprint=(manifest.fingerprint or "none") if manifest else UNKNOWN,
            weight_files=manifest.weight_files if manifest else None))
    return rows
