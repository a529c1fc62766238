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

A directory on a dead hard-mounted NFS server blocks every call into it for ever, the first
`stat` of a tier's opening included: an engine (or a node) would never start. So a tier with a
path below the first is opened only once its directory answers a `stat` within the store's
`read_timeout_s` (a probe within `lookup_timeout_s`); else it is left out, logged, until the
store is opened again (an engine's restart).

`refuse_owned` refuses, before an engine starts, what its tiers' opening would refuse a whole
start-up later: a disk directory another engine owns.

Primitives: `open_store`, `build_tier`, `build_probe`, `refuse_owned`, `store_settings`,
`answers`, `TIER_CLASSES`.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Collection, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from kvtier.core.layout import KVLayout
from kvtier.core.stall import call_within
from kvtier.core.store import StoreSettings, TieredStore
from kvtier.core.threads import resolve_io_cores
from kvtier.core.tier import DirectoryOwnerSource, ManifestKeeper, Probe, ProbeSource, Tier
from kvtier.errors import DirectoryInUse
from kvtier.tiers.manifest import NamespaceInfo, new_manifest
from kvtier.tiers.registry import TIER_CLASSES, tier_class

if TYPE_CHECKING:
    from kvtier.tiers.storeconfig import StoreConfig, TierSettings

__all__ = ["TIER_CLASSES", "answers", "build_probe", "build_tier", "open_store",
           "refuse_owned", "store_settings"]
log = logging.getLogger(__name__)
OWNER_CHECK_S = 5.0  # `refuse_owned`: how long a tier's directory may take to answer a stat


def build_tier(config: TierSettings, layout: KVLayout) -> Tier:
    """Construct the tier that `config.kind` names, for chunks of `layout`.

    Raises:
        ConfigError: a setting the config model cannot check is unusable (e.g. a password
            file); OSError: the tier's directory cannot be created.
    """
    tier: Tier = tier_class(config.kind)(config, layout)
    return tier


def build_probe(config: TierSettings, layouts: Sequence[KVLayout],
                timeout_s: float | None = None) -> Probe | None:
    """A probe of the tier `config` names for chunks of all `layouts` (e.g. every TP rank's),
    or None for a tier private to its process (memory), and (with `timeout_s`) for one whose
    directory does not answer within it (`answers`)."""
    cls = tier_class(config.kind)
    if not isinstance(cls, ProbeSource):
        return None
    if timeout_s is not None and not _answers_or_say(config, timeout_s):
        return None
    return cls.probe(config, layouts)


def refuse_owned(config: StoreConfig, models: Collection[str],
                 timeout_s: float = OWNER_CHECK_S) -> None:
    """Refuse now what opening `config`'s tiers in an engine of one of `models` (a model's
    name as served) would refuse: a directory another process's open tier owns (a disk
    tier's: `DirectoryOwnerSource`). Call it before starting that engine (`kvtier serve`),
    never beside it. A directory that does not answer a `stat` within `timeout_s`, or cannot
    be listed, is left to the engine's own open to judge.

    Raises:
        DirectoryInUse: in one line: the directory, the owner's pid, the remedy.
    """
    for tier in config.tiers:
        cls = tier_class(tier.kind)
        path = getattr(tier, "path", None)
        if not isinstance(cls, DirectoryOwnerSource) or (
                path is not None and not answers(Path(path), timeout_s)):
            continue
        try:
            cls.refuse_owned(tier, models)
        except DirectoryInUse:
            raise
        except OSError as exc:
            log.info("tier %r: %s not checked for an owner (%s)", tier.tier_name, path, exc)


def answers(path: Path, timeout_s: float) -> bool:
    """Whether `path` answers a `stat` within `timeout_s`, found or not (a missing directory
    answers: its tier makes it). Asked on a daemon thread, left behind if it never returns."""

    def stat() -> None:
        with contextlib.suppress(OSError):
            os.stat(path)

    answered, _ = call_within(stat, timeout_s, "kvtier-path-stat")
    return answered


def _answers_or_say(config: TierSettings, timeout_s: float) -> bool:
    """`answers` for a tier with a path (True for one without), logged when it does not."""
    path = getattr(config, "path", None)
    if path is None or answers(Path(path), timeout_s):
        return True
    log.warning("tier %r: its directory %s did not answer within %g s (a dead mount?): left "
                "out, its chunks missed, until the cache is opened again (a restart)",
                config.tier_name, path, timeout_s)
    return False


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
    """Build every tier `config` names, fastest first (one below the first whose directory
    does not answer is left out: module docstring), and compose them into a store. With
    `info` (the model behind `layout`'s namespace), each persistent tier records the
    namespace's manifest (`ManifestKeeper`, tiers/manifest.py; a failure is only logged).
    `engine_bound`: opened on a thread whose cores the engine chose (a vLLM worker's model
    runner), not the operator: `io_cores` "auto" may widen them (core/threads.py).

    Raises:
        ConfigError: a tier's settings are unusable; DirectoryInUse: a disk tier's directory
            is another open tier's; OSError: a tier's directory cannot be created. Tiers
            built before the failure are closed.
    """
    tiers: list[Tier] = []
    try:
        for index, tier_config in enumerate(config.tiers):
            if index == 0 or _answers_or_say(tier_config, config.read_timeout_s):
                tiers.append(build_tier(tier_config, layout))
        if info is not None:
            manifest = new_manifest(layout, info)
            for tier in tiers:
                if isinstance(tier, ManifestKeeper):
                    tier.keep_manifest(manifest)
        return TieredStore(tiers, store_settings(config, engine_bound))
    except BaseException:  # a disk tier left open would own its directory until exit
        for tier in tiers:
            tier.close()
        raise
