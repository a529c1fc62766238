"""The connector's settings, parsed once from vLLM's `kv_connector_extra_config`.

Primitives: `ConnectorConfig` (frozen, validated), `ConnectorConfig.parse(extra)`,
`RequestControls.from_params(kv_transfer_params)` (per-request switches).

This module does not import vllm, so it is unit-testable on its own.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvtier.config import StoreConfig
from kvtier.errors import ConfigError

logger = logging.getLogger(__name__)

WHERE = "kv_connector_extra_config"
# Used when the extra config names no tiers: host RAM only.
DEFAULT_TIERS: tuple[dict[str, Any], ...] = ({"kind": "memory", "capacity": "2GiB"},)
_CONNECTOR_KEYS = frozenset({"tokens_per_chunk", "index_max_keys"})


@dataclass(frozen=True, slots=True)
class ConnectorConfig:
    """Validated connector settings: the connector's own keys plus the store config.

    `kv_connector_extra_config` example:
        {"tokens_per_chunk": 256,
         "tiers": [{"kind": "memory", "capacity": "8GiB"},
                   {"kind": "disk", "path": "/mnt/nvme/kvtier", "capacity": "200GiB"}]}
    """

    store: StoreConfig  # tiers, sizes, paths, write-behind settings
    # Tokens per stored chunk; a multiple of vLLM's block size (checked against it later).
    tokens_per_chunk: int = 256
    # Keys the scheduler remembers as stored (~100 B each). None: as many chunks as the
    # tiers can hold together, so the index forgets about as fast as the tiers evict.
    index_max_keys: int | None = None

    @classmethod
    def parse(cls, extra: Mapping[str, Any] | None) -> ConnectorConfig:
        """Return the settings in `extra` (vLLM's kv_connector_extra_config).

        Raises:
            ConfigError: naming the field, on an unknown key or a bad value.
        """
        extra = dict(extra or {})
        allowed = _CONNECTOR_KEYS | set(StoreConfig.model_fields)
        unknown = sorted(set(extra) - allowed)
        if unknown:
            raise ConfigError(f"{WHERE}.{unknown[0]}", extra[unknown[0]],
                              f"a known key: {sorted(allowed)}")
        values = {k: extra.pop(k) for k in _CONNECTOR_KEYS if k in extra}
        for name, value in values.items():
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{WHERE}.{name}", value, "a positive integer")
        extra.setdefault("tiers", [dict(t) for t in DEFAULT_TIERS])
        return cls(store=StoreConfig.parse(extra, where=WHERE), **values)

    def index_keys(self, bytes_per_chunk: int) -> int:
        """The scheduler index's bound in keys (see index_max_keys)."""
        if self.index_max_keys is not None:
            return self.index_max_keys
        return max(1024, sum(t.capacity for t in self.store.tiers) // bytes_per_chunk)

    def check_block_size(self, block_size: int) -> None:
        """Raise ConfigError unless tokens_per_chunk is a multiple of vLLM's block size."""
        if self.tokens_per_chunk % block_size:
            raise ConfigError(f"{WHERE}.tokens_per_chunk", self.tokens_per_chunk,
                              f"a multiple of vLLM's block_size ({block_size})")


@dataclass(frozen=True, slots=True)
class RequestControls:
    """Per-request switches from the request's `kv_transfer_params`."""

    skip_load: bool = False  # never load this request's prefix from kvtier
    skip_store: bool = False  # never store this request's chunks
    max_offload_tokens: int | None = None  # store at most the first N tokens (0 = none)

    @classmethod
    def from_params(cls, params: Mapping[str, Any] | None) -> RequestControls:
        """Read the switches; a bad value is logged and ignored (one request's typo must not
        take down the engine), unknown keys are left for other connectors."""
        if not params:
            return cls()
        skip_load = params.get("skip_load", False)
        skip_store = params.get("skip_store", False)
        limit = params.get("max_offload_tokens")
        if not isinstance(skip_load, bool):
            logger.warning("kvtier: ignoring kv_transfer_params.skip_load=%r", skip_load)
            skip_load = False
        if not isinstance(skip_store, bool):
            logger.warning("kvtier: ignoring kv_transfer_params.skip_store=%r", skip_store)
            skip_store = False
        if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int)
                                  or limit < 0):
            logger.warning("kvtier: ignoring kv_transfer_params.max_offload_tokens=%r", limit)
            limit = None
        return cls(skip_load=skip_load, skip_store=skip_store, max_offload_tokens=limit)
