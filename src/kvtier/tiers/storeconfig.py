"""The store's configuration: a store is an ordered list of tiers, fastest first, and its
write-behind settings, validated once at the edge (CLI, YAML/JSON, vLLM extra config).

Sizes accept ints or strings like "8GiB". Any invalid value raises `ConfigError` naming the
field, the value and what is allowed. Each tier's own fields are a `TierSettings` subclass
in its tier module (e.g. `kvtier.tiers.files.disk.DiskTierConfig`), found by kind through the tier
registry, so adding a tier kind does not touch this file. It lives with the tier factory
(`kvtier.tiers`): `kvtier.config` (the primitives every config model uses) knows no tier.

Example (YAML):
    tiers:
      - {kind: memory, capacity: 8GiB}
      - {kind: disk, path: /mnt/nvme/kvtier, capacity: 200GiB}
      - {kind: shared, path: /mnt/shared/kvtier, capacity: 2TiB, eviction: lru}

Capacities are per engine (one vLLM instance on one node), like vLLM's `cpu_bytes_to_use` /
`--kv-offloading-size`: the total across its tensor-parallel ranks. Each rank stores its own
shard of every chunk (its KV heads, under its own layout digest) in its own store, so a tier
whose class has `capacity_split_by_rank` (a rank enforces the capacity on its own chunks)
gives each rank `capacity // tp_world_size` (`StoreConfig.per_rank`). A shared directory's
quota is one ledger for the whole directory, enforced together by every writer of every
engine: it is never split.

Primitives: `StoreConfig` (with `.parse`, `.load`, `.per_rank`), `TierSettings` (the base of
every tier's config model).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, SerializeAsAny, ValidationInfo, field_validator

from kvtier.config import READING_ONLY, ByteSize, FrozenModel, parse_model, read_config_file
from kvtier.core.threads import parse_io_cores
from kvtier.errors import ConfigError, TierConfigError
from kvtier.tiers.registry import TIER_CLASSES, config_model, public_kinds, tier_class


class TierSettings(FrozenModel):
    """What every tier's config has. Each tier module subclasses it with its own fields and
    a `kind: Literal[...]` (see `kvtier/tiers/example.py`); the registry finds the subclass
    by kind (`kvtier.tiers.registry.config_model`)."""

    kind: str  # the tier kind, a key of kvtier.tiers.TIER_CLASSES
    name: str | None = None  # unique name in the store; defaults to `kind`
    capacity: ByteSize  # bytes this tier may hold, e.g. "8GiB"
    # which chunk leaves first when full (kvtier.core.policies; "prefix": docs/configuration.md)
    eviction: Literal["lru", "arc", "prefix"] = "lru"
    admit_after: int = Field(1, ge=1)  # store a chunk only on its N-th offer (1 = always)

    @property
    def tier_name(self) -> str:
        return self.name or self.kind


def _tier_config(item: object, index: int, context: dict[str, Any] | None) -> object:
    """One `tiers` entry as its kind's config model (an instance passes through), validated
    with the config's `context`.

    Raises:
        TierConfigError: no or an unknown kind, or an invalid value for that kind.
    """
    if isinstance(item, TierSettings) or not isinstance(item, dict):
        return item  # a model already, or not a mapping: pydantic's own error names it
    kinds = public_kinds()
    kind = item.get("kind")
    if kind is None:
        raise TierConfigError(f"tiers.{index}.kind", None,
                              "a tier kind, one of " + ", ".join(repr(k) for k in kinds))
    if not isinstance(kind, str) or kind not in TIER_CLASSES:
        raise TierConfigError(f"tiers.{index}.kind", kind, f"one of {kinds}")
    try:
        return parse_model(config_model(kind), item, f"tiers.{index}.{kind}", context)
    except ConfigError as exc:
        raise TierConfigError(exc.field, exc.value, exc.allowed) from None


class StoreConfig(FrozenModel):
    """A tiered store: tiers in order, fastest first, and its write-behind settings."""

    # fastest first; each entry is its kind's model (SerializeAsAny: dumped with its own fields)
    tiers: list[SerializeAsAny[TierSettings]] = Field(min_length=1)
    write_queue_depth: int = Field(64, ge=1)  # chunks waiting per lower tier before drops
    # Threads for parallel reads and lookups; a vLLM worker's load reads up to this many
    # chunks at once (worker.py's `load_batch_for`: 16 of 2 MiB, 8 of 4 MiB or more; 8 read
    # the VM disk 25-30% faster than 4, 16 small ones 12-16% faster than 8:
    # docs/performance.md).
    io_threads: int = Field(16, ge=1, le=64)
    # Cores of those threads (and the vLLM worker's load and store threads): "auto" (the
    # engine's cores, not just the one(s) vLLM's CPU backend binds the model runner to),
    # "inherit", or a list like "2,3" (kvtier/core/threads.py).
    io_cores: str = "auto"
    # A read of a tier below RAM not finished within this is abandoned (the load is
    # recomputed) and the tier is skipped until it answers again: a dead NFS mount or a
    # server that never replies costs hits, never a hung engine.
    read_timeout_s: float = Field(5.0, gt=0, le=3600)
    # The scheduler waits this long for a slow tier's lookup (shared directory, Redis) before
    # treating the rest of the prefix as a miss; probes are skipped while one stays stuck.
    lookup_timeout_s: float = Field(2.0, gt=0, le=3600)

    @field_validator("io_cores")
    @classmethod
    def _io_cores(cls, io_cores: str) -> str:
        return parse_io_cores(io_cores)

    @field_validator("tiers", mode="before")
    @classmethod
    def _typed_tiers(cls, tiers: object, info: ValidationInfo) -> object:
        """Each dict entry becomes its kind's model, found through the tier registry."""
        if not isinstance(tiers, list):
            return tiers
        return [_tier_config(item, index, info.context) for index, item in enumerate(tiers)]

    # Names unique, RAM first, a directory a file tier. A field validator (not a model
    # validator) so the ConfigError names "tiers" rather than the whole config
    # (tests/cache/test_config.py).
    @field_validator("tiers")
    @classmethod
    def _tiers_fit_together(cls, tiers: list[TierSettings]) -> list[TierSettings]:
        names = [t.tier_name for t in tiers]
        for name in names:
            if names.count(name) > 1:
                raise ValueError(f"tier name {name!r} is used twice; give tiers distinct names")
        # Fastest first: every store waits for the first tier, and a RAM tier behind a
        # slower one would hold only what that one already does.
        slower = next((i for i, t in enumerate(tiers) if t.kind != "memory"), len(tiers))
        for tier in tiers[slower + 1:]:
            if tier.kind == "memory":
                raise ValueError(f"tier {tier.tier_name!r} (memory) after "
                                 f"{tiers[slower].tier_name!r} ({tiers[slower].kind}): tiers "
                                 "go fastest first, RAM first")
        # Two file tiers on one directory would each count the other's chunks as its own.
        directories: dict[str, str] = {}
        for tier in tiers:
            path = getattr(tier, "path", None)
            if path is None:
                continue
            real = os.path.normpath(os.path.abspath(path))  # no I/O: a dead mount hangs
            if real in directories:
                raise ValueError(f"tiers {directories[real]!r} and {tier.tier_name!r} share "
                                 f"the directory {real}; give each tier its own")
            directories[real] = tier.tier_name
        return tiers

    def per_rank(self, tp_world_size: int) -> StoreConfig:
        """This config as one of `tp_world_size` tensor-parallel ranks builds its store: the
        capacity of every tier whose class has `capacity_split_by_rank` divided evenly
        (rounded down), the rest unchanged. Capacities in a config are per engine, the total
        of its ranks.

        Raises:
            ConfigError: `tp_world_size` < 1.
        """
        if isinstance(tp_world_size, bool) or tp_world_size < 1:
            raise ConfigError("tensor_parallel_size", tp_world_size, "an integer >= 1")
        if tp_world_size == 1:
            return self
        # A positive capacity stays positive: a redis tier's 0 means "no bound of kvtier's".
        tiers = [t.model_copy(update={"capacity": max(t.capacity // tp_world_size,
                                                      min(t.capacity, 1))})
                 if tier_class(t.kind).capacity_split_by_rank else t for t in self.tiers]
        return self.model_copy(update={"tiers": tiers})

    @classmethod
    def parse(cls, data: object, where: str = "config",
              reading_only: bool = False) -> StoreConfig:
        """Validate a dict (from JSON, YAML or vLLM's kv_connector_extra_config);
        `reading_only`: for a command that only reads the tiers (a directory it cannot
        write is accepted).

        Raises:
            ConfigError: naming `where.field`, the value and what is allowed.
        """
        return parse_model(cls, data, where, READING_ONLY if reading_only else None)

    @classmethod
    def load(cls, path: str | Path) -> StoreConfig:
        """Read and validate a YAML or JSON file.

        Raises:
            ConfigError: unreadable file, bad syntax or an invalid value.
        """
        return cls.parse(read_config_file(path), where=str(path))
