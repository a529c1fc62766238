"""The connector's settings schema: the one description of `kv_connector_extra_config`.

Primitives:
  - `ConnectorConfig` (frozen, validated), `ConnectorConfig.parse(extra, where)`,
    `ConnectorConfig.known_keys()`: what the connector accepts, parsed once at the edge.
  - `kvtier_transfer_config(extra)`: vLLM's `kv_transfer_config` loading the connector with
    `extra`, validated by the same parser the connector runs.
  - `CONNECTOR_CLASS`, `CONNECTOR_MODULE`, `CONNECTOR_KEYS`, `TOKENS_PER_CHUNK`,
    `MAX_REQUEST_DURATION_S`.
  - `PoolEvents`: where the shared tiers' KV events go, once for the fleet.
  - `chunk_sizes_allowed(tokens_per_chunk, block_size)`: what a tokens_per_chunk vLLM's
    block does not divide may be instead, in words (the connector's and the tools').
  - `RequestControls.from_params(kv_transfer_params)` (per-request switches),
    `RequestControls.within_role(kv_role)` (what vLLM's kv_role leaves of them),
    `RequestControls.retain_s_for(end_tokens)` (a chunk's pin), `PrefixPin`.

This module imports neither vllm nor torch (the package imports the connector lazily), so
`kvtier serve`, `kvtier plan`, `kvtier doctor` and the benches use it instead of copying it.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from kvtier.errors import ConfigError
from kvtier.integrations.vllm.badparams import IgnoredParams
from kvtier.node.eventpub import check_endpoint
from kvtier.node.protocol import BELOW_TIER as NODE_BELOW_TIER
from kvtier.node.protocol import RAM_TIER as NODE_TIER
from kvtier.redaction import MASK, secret_field
from kvtier.tiers.storeconfig import StoreConfig

logger = logging.getLogger(__name__)
# Bad per-request switches of the callers that bring no `IgnoredParams` of their own.
_IGNORED = IgnoredParams(logger)

WHERE = "kv_connector_extra_config"
# vLLM loads the connector as getattr(import_module(CONNECTOR_MODULE), CONNECTOR_CLASS).
CONNECTOR_CLASS = "KVTierConnector"
CONNECTOR_MODULE = "kvtier.integrations.vllm"
# Default tokens per stored chunk: 2 MiB of KV for the bench model, 32 MiB for Llama-3-8B.
TOKENS_PER_CHUNK = 256
# Used when the extra config names no tiers: host RAM only.
DEFAULT_TIERS: tuple[dict[str, Any], ...] = ({"kind": "memory", "capacity": "2GiB"},)
# The connector's own keys; every other key of the extra config belongs to StoreConfig.
CONNECTOR_KEYS = frozenset({"tokens_per_chunk", "index_max_keys", "load_mode", "store_mode",
                            "load_when", "node", "event_block_size", "pool_events",
                            "tail_chunks"})
# Store settings that mean nothing to an engine of a node (the node's store has its own).
NODE_OWN_KEYS = frozenset({"write_queue_depth", "io_cores"})
# Keys the scheduler remembers as stored, in node mode (the node's capacity is its own).
NODE_INDEX_KEYS = 1 << 20
# How a hit is loaded: "sync" inside the step that needs it (the whole batch waits for it),
# "async" while other requests keep running (the request waits one step or more), "auto":
# inline on an idle engine (no batch to protect) or when the load's measured cost is at most a
# fifth of the engine's step, async otherwise (loadcost.py; until measured: a hit held in RAM
# inline, one below RAM async).
LOAD_MODES = ("auto", "sync", "async")
# How a step's stores run: "sync" gathered into the store before the step returns; "async" on
# the worker's store thread while the engine goes on (a finished or preempted request's blocks
# are kept until its gathers are done); "auto": async, except where blocks may be freed while
# their request runs (models with several KV cache groups: sliding windows, state layers) and
# on a disaggregated prefill instance (kv_producer), whose step waits for its writes anyway.
STORE_MODES = ("auto", "sync", "async")
# How much of a hit is loaded: "faster": the part expected to load faster than the engine
# recomputes it, from measured costs (offer.py; until measured, all of it); "always": all.
# Unset: "faster", but "always" on a disaggregated decode instance (kv_consumer): it exists so
# that prompts are prefilled elsewhere, and a short prompt its own cheap prefill would beat the
# load of (the rule's call on a small model) must still not be recomputed there.
LOAD_WHEN = ("faster", "always")


@dataclass(frozen=True, slots=True)
class PoolEvents:
    """Where an engine publishes the KV events of its shared tiers (those its class says are
    REMOTE: every engine hits them), once for the fleet, on kvtier's own ZMQ publisher:
    topic `kv@pool:<pool>@<model>`, llm-d's pool pseudo-pod (llm-d-router PR #2586, open: a
    `pool:` entry counts for every endpoint). `pool_events` in the extra config:
        {"endpoint": "tcp://llm-d-epp:5558", "pool": "fleet", "model": "Qwen/Qwen3-8B"}
    """

    endpoint: str  # a ZMQ endpoint (kvtier.node.eventpub.ALLOWED)
    pool: str  # the pool pseudo-pod's name
    model: str  # the served model name, as the engines' own topics (kv@<pod>@<model>) say it
    # The events' medium, the router's tier-weight key: PR #2586's "shared_storage" (default
    # weight 0.4) or "object_store" (0.2); configurable while the PR is open.
    medium: str = "shared_storage"

    @property
    def topic(self) -> str:
        return f"kv@pool:{self.pool}@{self.model}"

    @classmethod
    def parse(cls, value: Any, where: str) -> PoolEvents:
        """The settings in `value` (the `pool_events` mapping).

        Raises:
            ConfigError: naming `where.pool_events[.field]`, the value and what is allowed.
        """
        field = f"{where}.pool_events"
        allowed = ("endpoint", "pool", "model", "medium")
        if not isinstance(value, Mapping) or set(value) - set(allowed):
            raise ConfigError(field, value, f"a mapping of {allowed} (medium optional)")
        for name in allowed:
            item = value.get(name)
            if item is None and name == "medium":
                continue
            if not isinstance(item, str) or not item or "@" in item:
                raise ConfigError(f"{field}.{name}", item, "a non-empty string without '@' "
                                  "(llm-d splits the topic kv@pool:<pool>@<model> at '@')")
        check_endpoint(value["endpoint"], f"{field}.endpoint")
        return cls(**value)


@dataclass(frozen=True, slots=True)
class ConnectorConfig:
    """Validated connector settings: the connector's own keys plus the store config.

    `kv_connector_extra_config` example:
        {"tokens_per_chunk": 256,
         "tiers": [{"kind": "memory", "capacity": "8GiB"},
                   {"kind": "disk", "path": "/mnt/nvme/kvtier", "capacity": "200GiB"}]}
    """

    # tiers, sizes (per engine: the total of its TP ranks), paths, write-behind settings
    store: StoreConfig
    # Tokens per stored chunk; a multiple of vLLM's block size (checked against it later).
    tokens_per_chunk: int = TOKENS_PER_CHUNK
    # Whether the operator set tokens_per_chunk; if not, `for_block_size` may raise it to a
    # multiple of a block size that TOKENS_PER_CHUNK is not one of.
    tokens_per_chunk_set: bool = False
    # Keys the scheduler remembers as stored (~100 B each). None: as many chunks as the
    # tiers can hold together, so the index forgets about as fast as the tiers evict.
    index_max_keys: int | None = None
    # See LOAD_MODES.
    load_mode: str = "auto"
    # See STORE_MODES.
    store_mode: str = "auto"
    # See LOAD_WHEN; None: not set (`load_when_for`).
    load_when: str | None = None
    # The Unix socket of the node's cache (`kvtier node serve`): every tier is the node's and
    # nothing below its RAM runs in vLLM's processes. None: the tiers run in this engine.
    node: str | None = None
    # Tokens per block of the KV events for routers (--kv-events-config): a divisor of
    # tokens_per_chunk, each chunk announced as that many chained blocks; NVIDIA Dynamo's
    # router takes only blocks of its own size (its --kv-block-size, the engine's block size).
    # None: one block a chunk.
    event_block_size: int | None = None
    # Publish the shared tiers' events once for the fleet (PoolEvents); None: they go out
    # with the others, on the engine's own topic (vLLM's publisher).
    pool_events: PoolEvents | None = None
    # Store each request's tails (the full blocks past its last full chunk, at the end of its
    # prompt and at its end) so that a hit ends at any block boundary, not only at a chunk's
    # end (keys.tail_key). False: hits end at chunk boundaries, and a request stores full
    # chunks only (no tail's write, a chunk's size, for each request).
    tail_chunks: bool = True

    @staticmethod
    def known_keys() -> frozenset[str]:
        """Every key the extra config may hold: the connector's own and StoreConfig's."""
        return CONNECTOR_KEYS | frozenset(StoreConfig.model_fields)

    @classmethod
    def parse(cls, extra: Mapping[str, Any] | None, where: str = WHERE) -> ConnectorConfig:
        """Return the settings in `extra` (vLLM's kv_connector_extra_config, or a config
        file's contents); tiers default to DEFAULT_TIERS.

        Args:
            extra: the mapping to parse (not modified).
            where: the prefix of field names in errors (a file's path, for a file).

        Raises:
            ConfigError: naming `where.field`, on an unknown key or a bad value.
        """
        extra = dict(extra or {})
        allowed = cls.known_keys()
        unknown = sorted(set(extra) - allowed, key=str)  # a YAML key may be a number
        if unknown:
            value = MASK if secret_field(unknown[0]) else extra[unknown[0]]
            raise ConfigError(f"{where}.{unknown[0]}", value, f"a known key: {sorted(allowed)}")
        values = {k: extra.pop(k) for k in CONNECTOR_KEYS if k in extra}
        for name, value in values.items():
            choices = {"load_mode": LOAD_MODES, "store_mode": STORE_MODES,
                       "load_when": LOAD_WHEN}
            if name == "node":
                if not isinstance(value, str) or not value.startswith("/"):
                    raise ConfigError(f"{where}.node", value,
                                      "the absolute path of the node's socket")
                if "tiers" in extra:
                    raise ConfigError(f"{where}.tiers", extra["tiers"],
                                      "none with node set: the tiers are the node's "
                                      "(its own config, kvtier node serve --config)")
                for own in NODE_OWN_KEYS & set(extra):
                    raise ConfigError(f"{where}.{own}", extra[own],
                                      "none with node set: the node's write queues and I/O "
                                      "threads are its own (kvtier node serve --config)")
            elif name == "pool_events":
                if "node" in extra or "node" in values:
                    raise ConfigError(f"{where}.pool_events", value,
                                      "none with node set: the node publishes its tiers' events "
                                      "(kvtier node serve --events-endpoint)")
                values[name] = PoolEvents.parse(value, where)
            elif name in choices:
                modes = choices[name]
                if value not in modes:
                    raise ConfigError(f"{where}.{name}", value, f"one of {modes}")
            elif name == "tail_chunks":
                if not isinstance(value, bool):
                    raise ConfigError(f"{where}.{name}", value, "true or false")
            elif isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{where}.{name}", value, "a positive integer")
        event_block = values.get("event_block_size")
        chunk = values.get("tokens_per_chunk", TOKENS_PER_CHUNK)
        if event_block is not None and chunk % event_block:
            raise ConfigError(f"{where}.event_block_size", event_block,
                              f"a divisor of tokens_per_chunk ({chunk})")
        extra.setdefault("tiers", [dict(t) for t in DEFAULT_TIERS])
        store = StoreConfig.parse(extra, where=where)
        for i, tier in enumerate(store.tiers):
            quota = getattr(tier, "engine_quota", None)
            if quota is not None:
                raise ConfigError(f"{where}.tiers[{i}].engine_quota",
                                  quota.model_dump(exclude_none=True),
                                  "none in an engine: it limits each engine of a kvtier node "
                                  "(the node's own config, kvtier node serve --config)")
        return cls(store=store, tokens_per_chunk_set="tokens_per_chunk" in values, **values)

    def load_when_for(self, kv_role: str | None) -> str:
        """load_when on an engine of vLLM's `kv_role`: as set, or else "always" on a
        "kv_consumer" and "faster" elsewhere (LOAD_WHEN)."""
        if self.load_when is not None:
            return self.load_when
        return "always" if kv_role == "kv_consumer" else "faster"

    def tier_names(self) -> list[str]:
        """The tiers this engine loads from, fastest first (in node mode: the node's RAM and
        what lies below it)."""
        return [NODE_TIER, NODE_BELOW_TIER] if self.node else [t.tier_name
                                                               for t in self.store.tiers]

    def index_keys(self, bytes_per_chunk: int) -> int:
        """The scheduler index's bound in keys (see index_max_keys), for chunks of
        `bytes_per_chunk` summed over the tensor-parallel ranks (capacities are per engine)."""
        if self.index_max_keys is not None:
            return self.index_max_keys
        if self.node:
            return NODE_INDEX_KEYS
        return max(1024, sum(t.capacity for t in self.store.tiers) // bytes_per_chunk)

    def for_block_size(self, block_size: int) -> ConnectorConfig:
        """These settings for vLLM's block size: tokens_per_chunk, when the operator did not
        set it and TOKENS_PER_CHUNK is not a multiple of `block_size`, becomes the smallest
        multiple of it at least TOKENS_PER_CHUNK. Models with state layers get large blocks
        (vLLM's "align" mode sizes an attention page to hold a state page: 384 or 4,224
        tokens), and then a chunk of one block ends at every state vLLM keeps.

        Raises:
            ConfigError: a tokens_per_chunk set by the operator that is not a multiple of
                `block_size` (check_block_size).
        """
        self.check_block_size(block_size)
        if self.tokens_per_chunk % block_size == 0:
            return self
        chunk = -(-TOKENS_PER_CHUNK // block_size) * block_size
        if self.event_block_size is not None and chunk % self.event_block_size:
            raise ConfigError(f"{WHERE}.event_block_size", self.event_block_size,
                              f"a divisor of tokens_per_chunk ({chunk} for vLLM's "
                              f"block_size {block_size}): set tokens_per_chunk")
        return replace(self, tokens_per_chunk=chunk)

    def check_block_size(self, block_size: int) -> None:
        """Raise ConfigError unless tokens_per_chunk is a multiple of vLLM's block size, or
        unset (`for_block_size` picks one)."""
        if self.tokens_per_chunk_set and self.tokens_per_chunk % block_size:
            raise ConfigError(f"{WHERE}.tokens_per_chunk", self.tokens_per_chunk,
                              chunk_sizes_allowed(self.tokens_per_chunk, block_size))


def chunk_sizes_allowed(tokens_per_chunk: int, block_size: int) -> str:
    """What a tokens_per_chunk of vLLM's `block_size` may be, with the multiples nearest to
    `tokens_per_chunk` as examples: the connector's refusal at engine start and the
    operator tools' checks ahead of it (kvtier audit, kvtier doctor) word it alike."""
    below = tokens_per_chunk // block_size * block_size
    nearest = " or ".join(str(m) for m in (below, below + block_size) if m > 0)
    return (f"a multiple of vLLM's block_size ({block_size}), e.g. {nearest} (the block is "
            "the engine's --block-size, or its platform's default); or leave it unset: "
            f"kvtier picks the smallest multiple of the block from {TOKENS_PER_CHUNK} tokens")


def kvtier_transfer_config(extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """vLLM's `kv_transfer_config` (`--kv-transfer-config`, `LLM(kv_transfer_config=...)`)
    loading kvtier's connector with `extra` as its kv_connector_extra_config.

    `extra` is checked here by `ConnectorConfig.parse`, the parser the connector runs, so a
    config that passes here is one the connector accepts. It is passed on as given.

    Raises:
        ConfigError: naming the field, on an unknown key or a bad value.
    """
    ConnectorConfig.parse(extra)
    return {"kv_connector": CONNECTOR_CLASS, "kv_connector_module_path": CONNECTOR_MODULE,
            "kv_role": "kv_both", "kv_connector_extra_config": dict(extra or {})}


@dataclass(frozen=True, slots=True)
class PrefixPin:
    """A pin of a prompt's first `tokens` tokens for `retain_s` seconds
    (`kv_transfer_params.retain_prefixes`: what a `cache_control` marker asks, cachecontrol.py)."""

    tokens: int  # the prefix's length in tokens; a chunk is pinned if it ends within it
    retain_s: float  # the pin's length, as retain_s


@dataclass(frozen=True, slots=True)
class RequestControls:
    """Per-request switches from the request's `kv_transfer_params`."""

    skip_load: bool = False  # never load this request's prefix from kvtier
    skip_store: bool = False  # never store this request's chunks
    max_offload_tokens: int | None = None  # store at most the first N tokens (0 = none)
    # Pin this request's chunks for this many seconds (LRU never evicts them meanwhile; tiers
    # bound pinned bytes by their max_pinned_share); a hit extends the pin. None: no pin.
    retain_s: float | None = None
    # This request's chunks expire this many seconds after they are stored (a miss from then
    # on, space reclaimed); None: the tier's own ttl_s, if any.
    ttl_s: float | None = None
    # Pins of the prompt's first tokens only: a chunk ending within a prefix is pinned for
    # its retain_s (the longest of those holding it, or retain_s if longer). Empty: none.
    retain_prefixes: tuple[PrefixPin, ...] = ()

    def retain_s_for(self, end_tokens: int) -> float | None:
        """The pin of the chunk that ends after the prompt's first `end_tokens` tokens:
        the longest of retain_s and the prefix pins holding it; None: not pinned."""
        pins = [p.retain_s for p in self.retain_prefixes if end_tokens <= p.tokens]
        if self.retain_s is not None:
            pins.append(self.retain_s)
        return max(pins, default=None)

    @classmethod
    def from_params(cls, params: Mapping[str, Any] | None,
                    ignored: IgnoredParams | None = None) -> RequestControls:
        """Read the switches; a bad value is logged (by `ignored`: once per field at warning,
        bounded, badparams.py; default this module's) and ignored (one request's typo must
        not take down the engine), unknown keys are left for other connectors."""
        if not params:
            return cls()
        ignored = ignored or _IGNORED
        if not isinstance(params, Mapping):  # vLLM's offline API passes what it is given
            ignored.ignore("", params, "an object of kvtier's switches, see docs/retention.md")
            return cls()
        skip_load = params.get("skip_load", False)
        skip_store = params.get("skip_store", False)
        limit = params.get("max_offload_tokens")
        if not isinstance(skip_load, bool):
            ignored.ignore("skip_load", skip_load, "true or false")
            skip_load = False
        if not isinstance(skip_store, bool):
            ignored.ignore("skip_store", skip_store, "true or false")
            skip_store = False
        if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int)
                                  or limit < 0):
            ignored.ignore("max_offload_tokens", limit, "a number of tokens >= 0")
            limit = None
        return cls(skip_load=skip_load, skip_store=skip_store, max_offload_tokens=limit,
                   retain_s=_duration(params, "retain_s", ignored),
                   ttl_s=_duration(params, "ttl_s", ignored),
                   retain_prefixes=_prefix_pins(params.get("retain_prefixes"), ignored))

    def within_role(self, kv_role: str | None) -> RequestControls:
        """These switches as the engine's vLLM `kv_role` allows them: a "kv_producer" (a
        disaggregated prefill instance) only stores, a "kv_consumer" (a decode instance) only
        loads, "kv_both" (or None) does both (docs/sharing.md, disaggregated prefill)."""
        return replace(self, skip_load=self.skip_load or kv_role == "kv_producer",
                       skip_store=self.skip_store or kv_role == "kv_consumer")


# A request's retain_s / ttl_s must be below this (~31 years): a larger one is a typo (and
# inf or NaN no duration); `kvtier warm` refuses what the engine would ignore.
MAX_REQUEST_DURATION_S = 1e9


def _duration(params: Mapping[str, Any], name: str,
              ignored: IgnoredParams | None) -> float | None:
    """A positive number of seconds from `params[name]`, or None (absent or invalid: logged
    by `ignored`, if any, and ignored, like every per-request switch)."""
    value = params.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) \
            or not 0 < value < MAX_REQUEST_DURATION_S:
        if ignored is not None:
            ignored.ignore(name, value, "a number of seconds > 0")
        return None
    return float(value)


def _prefix_pins(value: Any, ignored: IgnoredParams) -> tuple[PrefixPin, ...]:
    """`kv_transfer_params.retain_prefixes`: a list of {"tokens": N > 0, "retain_s": S > 0};
    absent: none; anything else is logged and ignored, like every per-request switch."""
    if value is None:
        return ()
    pins = []
    if isinstance(value, list) and len(value) <= 64:
        for item in value:
            if not isinstance(item, Mapping):
                break
            tokens, seconds = item.get("tokens"), _duration(item, "retain_s", None)
            if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1 \
                    or seconds is None:
                break
            pins.append(PrefixPin(tokens, seconds))
        else:
            return tuple(pins)
    ignored.ignore("retain_prefixes", value,
                   'a list of at most 64 {"tokens": N, "retain_s": seconds}')
    return ()
