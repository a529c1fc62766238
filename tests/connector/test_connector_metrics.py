"""kvtier's connector stats: deltas, merging across workers and intervals, Prometheus export.

No engine here: these check the algebra vLLM relies on (aggregate / reduce / observe) with
the real prometheus_client registry. The engine-level flow is checked in the e2e modules.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from prometheus_client import REGISTRY, Counter, Gauge, Histogram

from kvtier.core.store import StoreStats
from kvtier.core.tier import TierStats
from kvtier.integrations.vllm.metrics import (
    COUNTERS,
    GAUGES,
    HISTOGRAMS,
    PREFIX,
    KVTierConnectorStats,
    KVTierPromMetrics,
    StatsDelta,
)

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"


class _VllmConfig:
    kv_transfer_config = None


def _store(hits: int, misses: int, used: int) -> StoreStats:
    tier = TierStats(name="memory", hits=hits, misses=misses, bytes_read=hits * 10,
                     used_bytes=used, capacity_bytes=1000, chunks=used // 100)
    return StoreStats(tiers=(tier,), queued_writes=0, queue_drops={"memory": 0})


def test_store_counters_become_deltas_between_takes() -> None:
    """A worker reports what moved since its last report, not running totals."""
    delta = StatsDelta(rank=0)
    delta.observe_store(_store(hits=3, misses=1, used=300))
    first = delta.take()
    assert first is not None
    assert first.data["counters"]["tier_hits"] == {"memory": 3}
    assert first.data["counters"]["tier_queries"] == {"memory": 4}
    delta.observe_store(_store(hits=5, misses=1, used=500))
    second = delta.take()
    assert second is not None
    assert second.data["counters"]["tier_hits"] == {"memory": 2}
    assert "tier_queries" in second.data["counters"]
    assert second.data["gauges"]["tier_used_bytes"] == {"memory@0": 500}


def test_a_tiers_late_lookups_are_exported() -> None:
    """A remote tier's lookups past their deadline (redis lookup_timeout_ms, s3
    lookup_timeout_s) were in its stats and `kvtier node status` but not in /metrics."""
    delta = StatsDelta(rank=0)
    tier = TierStats(name="redis", lookup_timeouts=2)
    delta.observe_store(StoreStats(tiers=(tier,), queued_writes=0, queue_drops={}))
    taken = delta.take()
    assert taken is not None and taken.data["counters"]["tier_lookup_timeouts"] == {"redis": 2}
    prom = KVTierPromMetrics(_VllmConfig(), {Counter: Counter, Gauge: Gauge, Histogram: Histogram},
                             ["model_name", "engine"], {0: ["tiny", 0]})
    prom.observe(taken.data)
    labels = {"model_name": "tiny", "engine": "0", "tier": "redis"}
    assert REGISTRY.get_sample_value("vllm:kvtier_tier_lookup_timeouts_total", labels) == 2


def test_the_learned_horizon_is_rank_zeros_not_a_sum_over_ranks() -> None:
    """Each TP rank's tier learns from the same traffic: rank 0 reports it, others do not
    (the export sums a gauge over ranks)."""
    tier = TierStats(name="memory", policy_horizon_ops=25_000.0)
    stats = StoreStats(tiers=(tier,), queued_writes=0, queue_drops={"memory": 0})
    for rank, expected in ((0, {"memory@0": 25_000.0}), (1, None)):
        delta = StatsDelta(rank=rank)
        delta.observe_store(stats)
        taken = delta.take()
        assert taken is not None
        assert taken.data["gauges"].get("tier_policy_horizon_ops") == expected


def test_nothing_moved_means_no_stats() -> None:
    delta = StatsDelta()
    assert delta.take() is None
    delta.add("loaded_tokens", 0)
    assert delta.take() is None


def test_aggregate_sums_counters_and_keeps_each_ranks_newest_gauge() -> None:
    """Two TP ranks merge into one report; a later interval replaces a rank's gauge."""
    rank0 = KVTierConnectorStats(data={"counters": {"loaded_tokens": {"": 64}},
                                       "gauges": {"tier_used_bytes": {"memory@0": 100}}})
    rank1 = KVTierConnectorStats(data={"counters": {"loaded_tokens": {"": 64}},
                                       "gauges": {"tier_used_bytes": {"memory@1": 120}}})
    later = KVTierConnectorStats(data={"counters": {"load_failures": {"": 1}},
                                       "gauges": {"tier_used_bytes": {"memory@0": 300}}})
    merged = rank0.aggregate(rank1).aggregate(later)
    assert merged.data["counters"] == {"loaded_tokens": {"": 128}, "load_failures": {"": 1}}
    assert merged.data["gauges"]["tier_used_bytes"] == {"memory@0": 300, "memory@1": 120}
    assert merged.reduce()["loaded_tokens"] == 128
    assert merged.reduce()["load_failures"] == 1
    assert rank0.data["counters"] == {"loaded_tokens": {"": 64}}  # inputs untouched


def test_prometheus_export_labels_tiers_and_sums_gauges_over_ranks() -> None:
    prom = KVTierPromMetrics(_VllmConfig(), {Counter: Counter, Gauge: Gauge, Histogram: Histogram},
                             ["model_name", "engine"], {0: ["tiny", 0]})
    prom.observe({"counters": {"tier_hits": {"disk": 2}, "loaded_tokens": {"": 64}},
                  "gauges": {"tier_used_bytes": {"disk@0": 100, "disk@1": 50}}})
    prom.observe({"counters": {"tier_hits": {"disk": 3}}, "gauges": {}})
    labels = {"model_name": "tiny", "engine": "0"}
    disk_labels = {**labels, "tier": "disk"}
    assert REGISTRY.get_sample_value("vllm:kvtier_tier_hits_total", disk_labels) == 5
    assert REGISTRY.get_sample_value("vllm:kvtier_loaded_tokens_total", labels) == 64
    assert REGISTRY.get_sample_value("vllm:kvtier_tier_used_bytes", disk_labels) == 150
    # A second engine in the same process re-registers without "Duplicated timeseries".
    KVTierPromMetrics(_VllmConfig(), {Counter: Counter, Gauge: Gauge, Histogram: Histogram},
                      ["model_name", "engine"], {0: ["tiny", 0]})


def test_tier_failures_become_deltas_by_tier_and_reason() -> None:
    """The store's cumulative failure counts reach Prometheus as `tier/reason` deltas."""
    delta = StatsDelta(rank=0)
    stats = _store(hits=0, misses=2, used=0)
    stats.failures["disk"] = {"timeout": 2, "corrupt": 1}
    delta.observe_store(stats)
    first = delta.take()
    assert first is not None
    assert first.data["counters"]["tier_failures"] == {"disk/timeout": 2, "disk/corrupt": 1}
    stats.failures["disk"] = {"timeout": 5, "corrupt": 1}
    delta.observe_store(stats)
    second = delta.take()
    assert second is not None
    assert second.data["counters"]["tier_failures"] == {"disk/timeout": 3}


def test_latencies_travel_as_observations_and_merge_by_concatenation() -> None:
    """Histograms ship the interval's observations; two ranks' reports keep both."""
    rank0, rank1 = StatsDelta(rank=0), StatsDelta(rank=1)
    rank0.observe("load_request_seconds", 0.002, "sync")
    rank0.observe("store_step_seconds", 0.01, "async")
    rank1.observe("load_request_seconds", 0.004, "sync")
    first, second = rank0.take(), rank1.take()
    assert first is not None and second is not None  # observations alone are worth a report
    merged = first.aggregate(second)
    assert merged.data["observations"]["load_request_seconds"] == {"sync": [0.002, 0.004]}
    assert merged.data["observations"]["store_step_seconds"] == {"async": [0.01]}
    assert rank0.take() is None  # taken: the next report starts empty


def test_prometheus_export_of_histograms_and_failure_reasons() -> None:
    prom = KVTierPromMetrics(_VllmConfig(), {Counter: Counter, Gauge: Gauge, Histogram: Histogram},
                             ["model_name", "engine"], {0: ["tiny", 0]})
    prom.observe({"counters": {"tier_failures": {"disk/timeout": 2}}, "gauges": {},
                  "observations": {"load_request_seconds": {"sync": [0.002, 0.3]},
                                   "store_step_seconds": {"async": [0.004]}}})
    labels = {"model_name": "tiny", "engine": "0"}
    get = REGISTRY.get_sample_value
    assert get("vllm:kvtier_tier_failures_total",
               {**labels, "tier": "disk", "reason": "timeout"}) == 2
    sync = {**labels, "mode": "sync"}
    assert get("vllm:kvtier_load_request_seconds_count", sync) == 2
    assert get("vllm:kvtier_load_request_seconds_bucket", {**sync, "le": "0.0025"}) == 1
    assert get("vllm:kvtier_load_request_seconds_bucket", {**sync, "le": "+Inf"}) == 2
    assert get("vllm:kvtier_store_step_seconds_count", {**labels, "mode": "async"}) == 1


def test_series_start_at_zero_so_alerts_and_panels_find_them() -> None:
    """Counters that have not moved (no corrupt read yet) are exported at 0, per tier once
    the tier has reported, so that an alert's rate() sees their first rise."""
    prom = KVTierPromMetrics(_VllmConfig(), {Counter: Counter, Gauge: Gauge, Histogram: Histogram},
                             ["model_name", "engine"], {0: ["tiny", 0]})
    labels = {"model_name": "tiny", "engine": "0"}
    get = REGISTRY.get_sample_value
    assert get("vllm:kvtier_load_failures_total", labels) == 0
    assert get("vllm:kvtier_load_request_seconds_count", {**labels, "mode": "async"}) == 0
    assert get("vllm:kvtier_store_step_seconds_count", {**labels, "mode": "async"}) == 0
    assert get("vllm:kvtier_tier_corrupt_reads_total", {**labels, "tier": "disk"}) is None
    prom.observe({"counters": {}, "gauges": {"tier_used_bytes": {"disk@0": 1}}})
    assert get("vllm:kvtier_tier_corrupt_reads_total", {**labels, "tier": "disk"}) == 0
    assert get("vllm:kvtier_tier_failures_total",
               {**labels, "tier": "disk", "reason": "timeout"}) == 0


def test_the_dashboard_and_alerts_name_only_series_kvtier_exports() -> None:
    """A misspelt series evaluates to nothing, silently: every vllm:kvtier_* name in
    deploy/grafana and deploy/prometheus must be one of these."""
    exported = ({f"{PREFIX}{n}_total" for n in COUNTERS} | {PREFIX + n for n in GAUGES}
                | {f"{PREFIX}{n}_{s}" for n in HISTOGRAMS for s in ("bucket", "sum", "count")})
    panels = json.loads((DEPLOY / "grafana" / "kvtier-dashboard.json").read_text())["panels"]
    texts = [t["expr"] for p in panels for t in p.get("targets", [])]
    texts.append((DEPLOY / "prometheus" / "kvtier-alerts.yml").read_text())
    named = {m for text in texts for m in re.findall(r"vllm:kvtier_\w+", text)}
    assert len(named) > 20
    assert named <= exported, sorted(named - exported)
