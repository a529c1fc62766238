"""kvtier's counters as vLLM connector stats, logged by vLLM and exported on its /metrics.

Flow: each worker's `ConnectorWorker` and the scheduler's `ConnectorScheduler` keep counter
*deltas* since they were last asked; vLLM collects them every step through
`get_kv_connector_stats`, merges workers and scheduler with `aggregate`, logs `reduce()` and
feeds `KVTierPromMetrics.observe`, which adds the deltas to Prometheus counters and sets the
gauges, and observes each latency into its histogram. The payload is plain dicts (vLLM ships
it between processes):
    {"counters": {name: {labels: value}}, "gauges": {name: {"tier@rank": value}},
     "observations": {name: {labels: [seconds, ...]}}}
where labels is the metric's label values joined by "/" (`LABELS`: the tier, "disk/timeout"
for a tier and a failure reason, "sync" for a load mode) or "" for connector-wide ones.
Gauges are keyed by rank so that merging workers keeps every rank, and merging intervals keeps
the newest value. Histograms travel as the interval's observations, as vLLM's own NIXL
connector ships its transfer times: vLLM asks every step, so a list holds one step's loads
(and one store per rank); merging concatenates them. Under tensor parallelism bytes, seconds
and tier counters add up over the ranks (each moves its own shard) and so do gauges (a tier's
capacity is the engine's total); token counts and `unsafe_stores_skipped` are the engine's,
counted by rank 0 only; each rank observes its own latencies (the slowest rank's is the one
the step waits for, and p99 over all ranks' observations shows it).

Latencies (histograms, `HISTOGRAMS`): `load_request_seconds` is one request's hit, from the
first chunk read to the last block filled: what a request's TTFT pays for a hit (mode="sync":
inside the step, which waits for it; "async": from the start of the load to the step that saw
it end). `store_step_seconds` is one step's stores (mode="sync": the step waits for them;
"async": on the store thread while the engine goes on). Per request and
per step rather than per chunk: that is what a user and the engine wait for; per chunk a tier's
average read is `tier_read_seconds / tier_hits`.

Primitives: `COUNTERS`, `GAUGES`, `HISTOGRAMS`, `LABELS`, `LOST_HIT_REASONS`, `StatsDelta`,
`KVTierConnectorStats`, `KVTierPromMetrics`.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

from kvtier.core.store import StoreStats
from kvtier.core.tier import Failure

# "vllm:" so that LLM.get_metrics() (which keeps only vllm: names) and vLLM's own
# unregistering between engines cover them; "kvtier_" says whose they are.
PREFIX = "vllm:kvtier_"
# name -> help; names starting with "tier_" carry a `tier` label (and more, see `LABELS`).
COUNTERS: dict[str, str] = {
    "tier_hits": "Chunk reads served by the tier",
    "tier_queries": "Chunk reads asked of the tier (hits + misses)",
    "tier_bytes_read": "Payload bytes read from the tier",
    "tier_bytes_written": "Payload bytes written to the tier",
    "tier_read_seconds": "Seconds spent reading from the tier",
    "tier_write_seconds": "Seconds spent writing to the tier",
    "tier_evictions": "Chunks evicted from the tier to make room",
    "tier_corrupt_reads": "Chunks that failed verification (treated as misses, removed)",
    "tier_dropped_writes": "Writes the tier did not store (I/O error, full disk, full queue)",
    "tier_lookup_timeouts": "Lookups not answered within the tier's lookup deadline (redis "
                            "lookup_timeout_ms, s3 lookup_timeout_s): misses",
    "tier_failures": "Tier calls the store made that failed, by reason (kvtier.core.tier.Failure:"
                     " missing, corrupt, io_error, unavailable, timeout, full, declined, ...)",
    "lookup_tokens": "Prompt tokens the scheduler asked kvtier about",
    "lookup_hit_tokens": "Prompt tokens kvtier could load (beyond vLLM's own cache)",
    "uncacheable_requests": "Requests neither looked up nor stored: their KV depends on "
                            "something kvtier cannot key (see request_keys.py: an unknown "
                            "extra key, a LoRA adapter changed or reloaded in place), or was "
                            "computed before a cache reset",
    "ignored_request_params": "Bad kv_transfer_params values of API requests, ignored "
                              "(each field's first logged at warning, the rest at debug)",
    "cache_resets": "Resets of the connector's cache (reset_prefix_cache(reset_connector=True), "
                    "e.g. after a weight update in place): chunks stored before are never "
                    "offered to this engine again",
    "loaded_tokens": "Tokens loaded into vLLM's KV cache",
    "loaded_bytes": "KV bytes loaded into vLLM's KV cache",
    "load_seconds": "Seconds the workers spent loading KV (read + copy into blocks)",
    "load_read_seconds": "Seconds loads (inline and asynchronous) waited for the tiers' "
                         "reads; the rest of a load is the copy into vLLM's blocks",
    "load_failures": "Chunks whose load failed (vLLM recomputed them)",
    "async_loads": "Requests whose hit was loaded while the engine ran others (load_mode)",
    "prefetched_chunks": "Chunks read into the RAM tier ahead of their load (waiting requests)",
    "async_load_seconds": "Seconds from the start to the end of asynchronous loads (summed)",
    "unsafe_stores_skipped": "Chunks not stored because they were computed over a failed "
                             "load (stored once recomputed)",
    "dropped_window_chunks": "Chunks not stored because a sliding-window layer group had "
                             "freed blocks of them (tokens_per_chunk above the window)",
    "stored_tokens": "Tokens stored from vLLM's KV cache (written by this engine; not "
                     "those kvtier held already: already_held_tokens)",
    "stored_bytes": "KV bytes stored from vLLM's KV cache (written by this engine)",
    "already_held_tokens": "Tokens a store found held already, so not written (stored "
                           "before by this engine, or, through a node, by another)",
    "store_seconds": "Seconds the workers spent storing KV (copy out of blocks + top tier), "
                     "on the engine's thread or the store thread (store_mode)",
    "store_wait_seconds": "Seconds engine steps waited for stores: synchronous stores, or "
                          "an earlier step's asynchronous stores still running",
    "held_requests": "Finished requests whose blocks vLLM kept one more step because an "
                     "asynchronous store of them could still be reading them",
    # Retention (kvtier.core.retention; tiers that keep tenants, pins and expiry)
    "tier_tenant_evictions": "Chunks of a tenant evicted from the tier (by its own quota or "
                             "the tier's LRU); tenant: a hash prefix of its cache salt, "
                             "'default' (no salt) or 'other'",
    "tier_quota_evictions": "Chunks evicted because their tenant was at its tenant_quota",
    "tier_pins_refused": "Pins (kv_transfer_params.retain_s, retain_prefixes: cache_control "
                         "markers) refused because the tier's "
                         "pinned bytes reached max_pinned_share (stored unpinned)",
    "tier_expired": "Chunks removed from the tier because their TTL passed",
    # Metadata operations a file tier asked of its filesystem (kvtier.tiers.files.fsops): on NFS
    # or Lustre each is a round trip to the server the fleet shares.
    "tier_meta_stats": "stat/lstat calls the tier made on its directory",
    "tier_meta_opens": "Opens of files and directories the tier made on its directory",
    "tier_meta_unlinks": "Files the tier unlinked in its directory",
    "tier_meta_dir_reads": "Directory listings the tier read",
    "tier_meta_other": "Renames, mkdirs, utimes and ftruncates the tier made",
    "tier_hit_decisions": "Chunks of hits held by the tier, by the scheduler's decision "
                          "(offer.py): loaded, trial (loaded against the rule, to measure the "
                          "tier again) or recompute_faster (left to vLLM to recompute)",
    "lost_hit_tokens": "Tokens kvtier found (lookup_hit_tokens) but did not load into vLLM's "
                       "KV cache, by reason (LOST_HIT_REASONS: recompute_faster, "
                       "vllm_declined, load_failed, load_too_slow, no_state)",
}
GAUGES: dict[str, str] = {
    "tier_used_bytes": "Bytes the tier holds now",
    "tier_capacity_bytes": "Bytes the tier may hold",
    "tier_chunks": "Chunks the tier holds now",
    "tier_policy_horizon_ops": "The reuse horizon the tier's eviction policy learned from "
                               "the traffic, in operations (puts and hits; eviction: prefix, "
                               "0 until learned; 0 for the other policies)",
    "tier_pinned_bytes": "Bytes of pinned chunks (retain_s) the tier holds now",
    "tier_tenant_used_bytes": "Bytes a tenant's chunks take in the tier now (tenant as in "
                              "tier_tenant_evictions)",
    "tier_restore_seconds_per_1k_tokens": "Measured seconds to restore 1,000 tokens of KV "
                                          "from the tier into the engine (median of its "
                                          "last loads, loadcost.py)",
    "recompute_seconds_per_1k_tokens": "Measured seconds for the engine to prefill a "
                                       "prompt's first 1,000 tokens (stepcost.py)",
}
HISTOGRAMS: dict[str, str] = {
    "load_request_seconds": "Seconds to load one request's hit into vLLM's KV cache (read + "
                            "copy into blocks); mode=sync: the step waits for it, async: from "
                            "its start to the step that saw it end",
    "store_step_seconds": "Seconds one step's stores took (copy out of blocks + top tier); "
                          "mode=sync: the step waits for them, async: on the store thread",
}
# Label names beyond vLLM's own (model_name, engine), in the order of a payload key's parts.
LABELS: dict[str, list[str]] = {
    **{name: ["tier"] for name in (*COUNTERS, *GAUGES) if name.startswith("tier_")},
    "tier_failures": ["tier", "reason"],
    "tier_tenant_evictions": ["tier", "tenant"],
    "tier_tenant_used_bytes": ["tier", "tenant"],
    "tier_hit_decisions": ["tier", "reason"],
    "lost_hit_tokens": ["reason"],
    "load_request_seconds": ["mode"],
    "store_step_seconds": ["mode"],
}
# The reasons of tier_hit_decisions (offer.py).
DECISIONS = ("loaded", "trial", "recompute_faster")
# The reasons of lost_hit_tokens: why tokens kvtier found were not loaded (configuration.md).
# Counted by the scheduler (scheduler/losthits.py) when vLLM allocates a request's blocks:
#   recompute_faster: cut by the load-or-recompute rule (offer.py), vLLM recomputes them;
#   vllm_declined: offered, but vLLM allocated fewer external tokens (its own cache's
#     partial block, a sliding-window replay), or found for a request that skips
#     prefix-cache reads (offered nothing: vLLM would take nothing).
# Counted by the worker that ran the load (rank 0; worker/connector_worker.py):
#   load_failed: the load stopped at a chunk a tier did not deliver (gone or corrupt since
#     the lookup, a tier that erred, was down, stalled or timed out) and the rest of that
#     request's hit, all recomputed by vLLM;
#   load_too_slow: the load ran past its budget, the hit's expected recompute (issue 45:
#     KVTierMetadata.load_budgets_s): the chunks not landed by then, recomputed;
#   no_state: models with state layers: the chunk ending the hit holds no state.
LOST_HIT_REASONS = ("recompute_faster", "vllm_declined", "load_failed", "load_too_slow",
                    "no_state")
# From a fast RAM hit (~1 ms) to a stalled tier's read deadline (seconds).
LATENCY_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                     10.0, 30.0)
# At most this many observations of one series per report (vLLM asks every step, so a report
# holds a few; the bound keeps a report small should nobody ask for a while).
MAX_OBSERVATIONS = 4096
_TIER_FIELDS = {  # counter -> TierStats field (queries = hits + misses, handled apart)
    "tier_hits": "hits", "tier_bytes_read": "bytes_read", "tier_bytes_written": "bytes_written",
    "tier_read_seconds": "read_s", "tier_write_seconds": "write_s",
    "tier_evictions": "evictions", "tier_corrupt_reads": "corrupt_reads",
    "tier_dropped_writes": "dropped_writes", "tier_lookup_timeouts": "lookup_timeouts",
    "tier_meta_stats": "meta_stats", "tier_meta_opens": "meta_opens",
    "tier_meta_unlinks": "meta_unlinks", "tier_meta_dir_reads": "meta_dir_reads",
    "tier_meta_other": "meta_other",
}


@dataclass
class StatsDelta:
    """Counter deltas since the last `take()`, for one side (a worker or the scheduler)."""

    rank: int = 0
    counters: dict[str, dict[str, float]] = field(default_factory=lambda: defaultdict(dict))
    observations: dict[str, dict[str, list[float]]] = field(
        default_factory=lambda: defaultdict(dict))
    _last_store: dict[str, dict[str, float]] = field(default_factory=dict)
    _last_failures: dict[str, int] = field(default_factory=dict)
    _gauges: dict[str, dict[str, float]] = field(default_factory=dict)
    _last_kept: dict[tuple[str, str], int] = field(default_factory=dict)

    def add(self, name: str, value: float, tier: str = "") -> None:
        if value:
            self.counters[name][tier] = self.counters[name].get(tier, 0) + value

    def set_gauge(self, name: str, labels: str, value: float) -> None:
        """Set gauge `name` (labels: its `LABELS` values joined by "/") for this rank."""
        self._gauges.setdefault(name, {})[f"{labels}@{self.rank}"] = value

    def observe(self, name: str, seconds: float, labels: str = "") -> None:
        """One latency for histogram `name` (labels: its `LABELS` values joined by "/")."""
        series = self.observations[name].setdefault(labels, [])
        if len(series) < MAX_OBSERVATIONS:
            series.append(seconds)

    def observe_store(self, stats: StoreStats) -> None:
        """Turn the store's cumulative counters into deltas; refresh the gauges."""
        for tier in stats.tiers:
            now = {name: float(getattr(tier, f)) for name, f in _TIER_FIELDS.items()}
            now["tier_queries"] = float(tier.hits + tier.misses)
            now["tier_dropped_writes"] += stats.queue_drops.get(tier.name, 0)
            last = self._last_store.get(tier.name, {})
            for name, value in now.items():
                self.add(name, value - last.get(name, 0.0), tier.name)
            self._last_store[tier.name] = now
            where = f"{tier.name}@{self.rank}"
            self._gauges.setdefault("tier_used_bytes", {})[where] = tier.used_bytes
            self._gauges.setdefault("tier_capacity_bytes", {})[where] = tier.capacity_bytes
            self._gauges.setdefault("tier_chunks", {})[where] = tier.chunks
            if self.rank == 0:  # each rank's shard sees the same traffic: not summed
                self._gauges.setdefault("tier_policy_horizon_ops", {})[where] = \
                    tier.policy_horizon_ops
        self._observe_retention(stats)
        for tier_name, by_reason in stats.failures.items():
            for reason, count in by_reason.items():
                key = f"{tier_name}/{reason}"
                self.add("tier_failures", count - self._last_failures.get(key, 0), key)
                self._last_failures[key] = count

    def _observe_retention(self, stats: StoreStats) -> None:
        """Pins, expiries and per-tenant usage of the tiers that keep them: counters as
        deltas, gauges refreshed (a tenant gone from a tier reads 0)."""
        for tier_name, kept in stats.retention.items():
            now = {("tier_pins_refused", tier_name): kept.pins_refused,
                   ("tier_expired", tier_name): kept.expired,
                   ("tier_quota_evictions", tier_name): kept.quota_evictions}
            now |= {("tier_tenant_evictions", f"{tier_name}/{u.tenant}"): u.evictions
                    for u in kept.tenants}
            for (name, labels), value in now.items():
                last = self._last_kept.get((name, labels), 0)
                if value > last:
                    self.add(name, value - last, labels)
                    self._last_kept[(name, labels)] = value
            rank = f"@{self.rank}"
            self._gauges.setdefault("tier_pinned_bytes", {})[tier_name + rank] = \
                kept.pinned_bytes
            tenants = self._gauges.setdefault("tier_tenant_used_bytes", {})
            for where in tenants:
                if where.startswith(tier_name + "/"):
                    tenants[where] = 0
            for usage in kept.tenants:
                tenants[f"{tier_name}/{usage.tenant}{rank}"] = usage.used_bytes

    def take(self) -> KVTierConnectorStats | None:
        """The deltas (and current gauges) since the last call, or None if nothing moved."""
        counters = {k: dict(v) for k, v in self.counters.items() if v}
        observations = {k: dict(v) for k, v in self.observations.items() if v}
        self.counters = defaultdict(dict)
        self.observations = defaultdict(dict)
        stats = KVTierConnectorStats(data={"counters": counters,
                                           "gauges": {k: dict(v) for k, v in self._gauges.items()},
                                           "observations": observations})
        return None if stats.is_empty() else stats


class KVTierConnectorStats(KVConnectorStats):
    """vLLM's container for kvtier's deltas; see the module docstring for the payload."""

    def reset(self) -> None:
        self.data = {"counters": {}, "gauges": {}, "observations": {}}

    def aggregate(self, other: KVConnectorStats) -> KVTierConnectorStats:
        counters = {k: dict(v) for k, v in self.data.get("counters", {}).items()}
        for name, by_tier in other.data.get("counters", {}).items():
            mine = counters.setdefault(name, {})
            for tier, value in by_tier.items():
                mine[tier] = mine.get(tier, 0) + value
        gauges = {k: dict(v) for k, v in self.data.get("gauges", {}).items()}
        for name, by_where in other.data.get("gauges", {}).items():
            gauges.setdefault(name, {}).update(by_where)  # newer interval / other rank
        observations = {k: {labels: list(seconds) for labels, seconds in v.items()}
                        for k, v in self.data.get("observations", {}).items()}
        for name, by_labels in other.data.get("observations", {}).items():
            seen = observations.setdefault(name, {})
            for labels, seconds in by_labels.items():
                seen.setdefault(labels, []).extend(seconds)
        return KVTierConnectorStats(data={"counters": counters, "gauges": gauges,
                                          "observations": observations})

    def reduce(self) -> dict[str, int | float]:
        """One line's worth for vLLM's periodic log: totals, per-tier hits/queries."""
        counters = self.data.get("counters", {})
        out: dict[str, int | float] = {}
        for name in ("loaded_tokens", "stored_tokens", "load_failures"):
            out[name] = sum(counters.get(name, {}).values())
        seconds = sum(counters.get("load_seconds", {}).values())
        loaded = sum(counters.get("loaded_bytes", {}).values())
        out["load_GBps"] = round(loaded / seconds / 1e9, 3) if seconds else 0.0
        for tier, hits in counters.get("tier_hits", {}).items():
            out[f"{tier}_hits"] = hits
            out[f"{tier}_queries"] = counters.get("tier_queries", {}).get(tier, hits)
        return out

    def is_empty(self) -> bool:
        counters = self.data.get("counters", {})
        observations = self.data.get("observations", {})
        return (not any(v for by_tier in counters.values() for v in by_tier.values())
                and not any(self.data.get("gauges", {}).values())
                and not any(s for by_labels in observations.values() for s in by_labels.values()))


class KVTierPromMetrics(KVConnectorPromMetrics):
    """kvtier's Prometheus counters, gauges and histograms, labelled per engine (and per
    tier, failure reason or load mode: `LABELS`)."""

    def __init__(self, vllm_config: Any, metric_types: dict[type, type],
                 labelnames: list[str], per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        _unregister_kvtier_metrics()  # vLLM only unregisters its own "vllm:" names
        self._metrics: dict[str, Any] = {}
        for name, doc in COUNTERS.items():
            self._metrics[name] = self._counter_cls(
                name=PREFIX + name, documentation=doc, labelnames=self._labels_for(name))
        gauge_cls: Any = self._gauge_cls  # vLLM's gauge classes take multiprocess_mode
        for name, doc in GAUGES.items():
            self._metrics[name] = gauge_cls(
                name=PREFIX + name, documentation=doc, labelnames=self._labels_for(name),
                multiprocess_mode="mostrecent")
        histogram_cls: Any = self._histogram_cls  # typed as Counter by vLLM
        for name, doc in HISTOGRAMS.items():
            self._metrics[name] = histogram_cls(
                name=PREFIX + name, documentation=doc, labelnames=self._labels_for(name),
                buckets=LATENCY_BUCKETS_S)
        # Every series starts at 0 (Prometheus' advice): a panel or an alert over a counter
        # that has not moved yet (corrupt reads, timeouts) finds a series, and the first
        # increment is a rise from 0 rather than a new series rate() cannot see.
        self._tiers_seen: set[tuple[int, str]] = set()
        for engine_idx in self.per_engine_labelvalues:
            for name in (*COUNTERS, *HISTOGRAMS):
                if name not in LABELS:
                    self._child(name, engine_idx, "")
            for reason in LOST_HIT_REASONS:
                self._child("lost_hit_tokens", engine_idx, reason)
            for mode in ("sync", "async"):
                self._child("load_request_seconds", engine_idx, mode)
                self._child("store_step_seconds", engine_idx, mode)

    def _start_tier(self, engine_idx: int, tier: str) -> None:
        """Create a tier's counters at 0 the first time the tier reports."""
        if (engine_idx, tier) in self._tiers_seen:
            return
        self._tiers_seen.add((engine_idx, tier))
        for name in COUNTERS:
            if LABELS.get(name) == ["tier"]:
                self._child(name, engine_idx, tier)
        for reason in Failure:
            self._child("tier_failures", engine_idx, f"{tier}/{reason.value}")
        for decision in DECISIONS:
            self._child("tier_hit_decisions", engine_idx, f"{tier}/{decision}")

    def _labels_for(self, name: str) -> list[str]:
        return self._labelnames + LABELS.get(name, [])

    def _child(self, name: str, engine_idx: int, labels: str) -> Any:
        values = [str(v) for v in self.per_engine_labelvalues.get(engine_idx, [])]
        extra = len(LABELS.get(name, []))
        # rsplit: a tier's name may hold a "/", a reason or a mode never does.
        return self._metrics[name].labels(*values, *(labels.rsplit("/", extra - 1) if extra
                                                     else []))

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for name, by_tier in transfer_stats_data.get("counters", {}).items():
            if name in COUNTERS:
                for tier, value in by_tier.items():
                    if value > 0:
                        self._child(name, engine_idx, tier).inc(value)
        for name, by_where in transfer_stats_data.get("gauges", {}).items():
            if name in GAUGES:
                totals: dict[str, float] = defaultdict(float)
                for where, value in by_where.items():
                    totals[where.rsplit("@", 1)[0]] += value  # summed over TP ranks
                for labels, value in totals.items():
                    if LABELS.get(name) == ["tier"]:  # not "tier/tenant"
                        self._start_tier(engine_idx, labels)
                    self._child(name, engine_idx, labels).set(value)
        for name, by_labels in transfer_stats_data.get("observations", {}).items():
            if name in HISTOGRAMS:
                for labels, seconds in by_labels.items():
                    child = self._child(name, engine_idx, labels)
                    for value in seconds:
                        child.observe(value)


def _unregister_kvtier_metrics() -> None:
    from prometheus_client import REGISTRY

    for collector in list(REGISTRY._collector_to_names):
        if getattr(collector, "_name", "").startswith(PREFIX):
            REGISTRY.unregister(collector)
