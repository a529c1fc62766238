"""The tiers, by family (`memory.py` and `example.py`; `files/`: disk and shared; `redis/`;
`s3/`), each kind found through `kvtier.tiers.registry`, what the families share beside them
(storeconfig, retention, encoding, manifest, probe), and the functions that build them from a
config. A family never imports another.

Every tier is built the same way: `TierClass(config, layout)`. Tiers whose contents other
processes can see (files, remote stores) also offer a probe: a side-effect-free "is this chunk
stored?" for processes that do not own the tier (vLLM's scheduler).

`open_store` with a `NamespaceInfo` (the model behind the layout's namespace: the connector's
workers pass one) also has each persistent tier record the namespace's manifest
(tiers/manifest.py), read back by `kvtier inspect` and `kvtier gc --fingerprint`.

Primitives: `open_store`, `build_tier`, `build_probe`, `store_settings`, `TIER_CLASSES`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvtier.core.layout import KVLayout
from kvtier.core.store import StoreSettings, TieredStore
from kvtier.core.threads import resolve_io_cores
from kvtier.core.tier import ManifestKeeper, Probe, ProbeSource, Tier
from kvtier.tiers.manifest import NamespaceInfo, new_manifest
from kvtier.tiers.registry import TIER_CLASSES, tier_class

if TYPE_CHECKING:
    from kvtier.tiers.storeconfig import StoreConfig, TierSettings

__all__ = ["TIER_CLASSES", "build_probe", "build_tier", "open_store", "store_settings"]


def build_tier(config: TierSettings, layout: KVLayout) -> Tier:
    """Construct the tier that `config.kind` names, for chunks of `layout`.

    Raises:
        ConfigError: a setting the config model cannot check is unusable (e.g. a password
            file); OSError: the tier's directory cannot be created.
    """
    tier: Tier = tier_class(config.kind)(config, layout)
    return tier


def build_probe(config: TierSettings, layouts: Sequence[KVLayout]) -> Probe | None:
    """A probe of the tier `config` names for chunks of all `layouts` (e.g. every TP rank's),
    or None for a tier private to its process (memory)."""
    cls = tier_class(config.kind)
    return cls.probe(config, layouts) if isinstance(cls, ProbeSource) else None


def store_settings(config: StoreConfig, engine_bound: bool = False) -> StoreSettings:
    """The store-wide settings of `config`: write-behind depth, read threads and their cores
    (`engine_bound`: see `resolve_io_cores`), and each tier's `io_threads` (when its kind has
    one) as its write-behind threads."""
    return StoreSettings(
        write_queue_depth=config.write_queue_depth,
        io_threads=config.io_threads,
        io_cores=resolve_io_cores(config.io_cores, engine_bound),
        read_timeout_s=config.read_timeout_s,
        write_threads={t.tier_name: getattr(t, "io_threads", 1) for t in config.tiers},
    )


def open_store(config: StoreConfig, layout: KVLayout, info: NamespaceInfo | None = None,
               engine_bound: bool = False) -> TieredStore:
    """Build every tier `config` names, fastest first, and compose them into a store. With
    `info` (the model behind `layout`'s namespace), each persistent tier records the
    namespace's manifest (`ManifestKeeper`, tiers/manifest.py; a failure is only logged).
    `engine_bound`: opened on a thread whose cores the engine chose (a vLLM worker's model
    runner), not the operator: `io_cores` "auto" may widen them (core/threads.py).

    Raises:
        ConfigError: a tier's settings are unusable; OSError: a tier's directory cannot be
            created. Tiers built before the failure are closed.
    """
    tiers: list[Tier] = []
    try:
        for tier_config in config.tiers:
            tiers.append(build_tier(tier_config, layout))
    except BaseException:
        for tier in tiers:
            tier.close()
        raise
    if info is not None:
        manifest = new_manifest(layout, info)
        for tier in tiers:
            if isinstance(tier, ManifestKeeper):
                tier.keep_manifest(manifest)
    return TieredStore(tiers, store_settings(config, engine_bound))
