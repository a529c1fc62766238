"""The connector's settings, parsed once from vLLM's `kv_connector_extra_config`.

Primitives: `ConnectorConfig` (frozen, validated), `ConnectorConfig.parse(extra)`,
`RequestControls.from_params(kv_transfer_params)` (per-request switches).

This module does not import vllm, so it is unit-testable on its own.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kvtier.errors import ConfigError
from kvtier.units import parse_size

logger = logging.getLogger(__name__)

WHERE = "kv_connector_extra_config"
_KNOWN_KEYS = frozenset({"tokens_per_chunk", "store", "placeholder_capacity"})


@dataclass(frozen=True, slots=True)
class ConnectorConfig:
    """Validated connector settings."""

    # Tokens per stored chunk; a multiple of vLLM's block size (checked against it later).
    tokens_per_chunk: int = 256
    # The kvtier store config (tiers, sizes, paths), handed as-is to
    # `kvtier.config.StoreConfig.parse` once the core store is wired in.
    store: Mapping[str, Any] = field(default_factory=dict)
    # Phase 1 only: byte budget of the in-process placeholder store (see placeholder.py).
    placeholder_capacity_bytes: int = 1 << 30

    @classmethod
    def parse(cls, extra: Mapping[str, Any] | None) -> ConnectorConfig:
        """Return the settings in `extra` (vLLM's kv_connector_extra_config).

        Raises:
            ConfigError: naming the field, on an unknown key or a bad value.
        """
        extra = dict(extra or {})
        unknown = sorted(set(extra) - _KNOWN_KEYS)
        if unknown:
            raise ConfigError(f"{WHERE}.{unknown[0]}", extra[unknown[0]],
                              f"a known key: {sorted(_KNOWN_KEYS)}")
        tpc = extra.get("tokens_per_chunk", cls.tokens_per_chunk)
        if isinstance(tpc, bool) or not isinstance(tpc, int) or tpc < 1:
            raise ConfigError(f"{WHERE}.tokens_per_chunk", tpc, "a positive integer")
        store = extra.get("store", {})
        if not isinstance(store, Mapping):
            raise ConfigError(f"{WHERE}.store", store, "a mapping (the kvtier store config)")
        capacity = parse_size(extra.get("placeholder_capacity", 1 << 30),
                              field=f"{WHERE}.placeholder_capacity")
        return cls(tokens_per_chunk=tpc, store=dict(store), placeholder_capacity_bytes=capacity)

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
