"""Restore cost from /metrics and the router weights it implies (issue 26)."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

from kvtier.integrations.vllm.metrics import COUNTERS, GAUGES, PREFIX
from kvtier.tools.ops import restorecost
from kvtier.tools.ops.restorecost import parse_restore_costs, router_weight


def _canned() -> str:
    reg = CollectorRegistry()
    assert "tier_hit_decisions" in COUNTERS
    assert "tier_restore_seconds_per_1k_tokens" in GAUGES
    dec = Counter(PREFIX + "tier_hit_decisions", "d", ["tier", "reason"], registry=reg)
    dec.labels("disk", "loaded").inc(7)
    dec.labels("disk", "recompute_faster").inc(3)
    restore = Gauge(PREFIX + "tier_restore_seconds_per_1k_tokens", "r", ["tier"], registry=reg)
    restore.labels("disk").set(0.02)
    restore.labels("redis").set(0.5)
    Gauge(PREFIX + "recompute_seconds_per_1k_tokens", "c", registry=reg).set(0.1)
    return generate_latest(reg).decode()


def test_parse_and_weights() -> None:
    costs = parse_restore_costs(_canned())
    assert costs.recompute_s_per_1k == 0.1
    assert costs.restore_s_per_1k == {"disk": 0.02, "redis": 0.5}
    assert costs.decisions["disk"] == {"loaded": 7.0, "recompute_faster": 3.0}
    # A tier four-fifths faster than recompute saves 0.8; one slower saves nothing.
    assert abs(router_weight(0.02, 0.1) - 0.8) < 1e-9
    assert router_weight(0.5, 0.1) == 0.0
    assert router_weight(0.0, 0.1) == 1.0


def test_the_series_names_are_the_connectors() -> None:
    # restorecost restates metrics.PREFIX so that plan and inspect never import vllm.
    assert restorecost.PREFIX == PREFIX
    for name in (restorecost.RESTORE_GAUGE, restorecost.RECOMPUTE_GAUGE):
        assert name.removeprefix(PREFIX) in GAUGES
    assert restorecost.DECISIONS_COUNTER.removeprefix(PREFIX) in COUNTERS
