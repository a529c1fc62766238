"""Restore cost and router weights: what a cache hit on each tier is worth.

Primitives:
- ``router_weight(restore_s, recompute_s)``: the share of a prefill that a hit on a tier
  saves, ``1 - restore_s / recompute_s`` clipped to [0, 1]; vLLM's own GPU prefix cache is
  1.0 (its hits cost no restore). Routers that weigh hits by medium (llm-d's precise
  prefix-cache scorer, Dynamo's KV router) can take these in place of static guesses.
- ``STATIC_WEIGHTS``: those guesses (llm-d GPU 1.0 / CPU 0.8; Dynamo host 0.75 / disk 0.25).
- ``parse_restore_costs(text)``: per-tier restore seconds per 1k tokens, recompute's, and the
  hit decision counts (issue 26, offer.py) from a server's /metrics text.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

from kvtier.integrations.vllm.metrics import PREFIX

STATIC_WEIGHTS: dict[str, dict[str, float]] = {
    "llm-d": {"gpu": 1.0, "cpu": 0.8},
    "dynamo": {"host": 0.75, "disk": 0.25},
}


def router_weight(restore_s: float, recompute_s: float) -> float:
    """Share of the replaced prefill a hit saves: ``1 - restore_s / recompute_s`` in [0, 1].

    Raises ValueError if ``recompute_s`` is not positive.
    """
    if recompute_s <= 0:
        raise ValueError(f"recompute_s must be > 0, got {recompute_s}")
    return min(1.0, max(0.0, 1.0 - restore_s / recompute_s))


@dataclass(frozen=True, slots=True)
class RestoreCosts:
    """Measured costs read from /metrics (seconds per 1k tokens; counts by tier/reason)."""

    restore_s_per_1k: dict[str, float] = field(default_factory=dict)
    recompute_s_per_1k: float | None = None
    decisions: dict[str, dict[str, float]] = field(default_factory=dict)


def parse_restore_costs(text: str) -> RestoreCosts:
    """Read the issue-26 series from a Prometheus exposition ``text`` (engines summed)."""
    restore: dict[str, float] = {}
    recompute: float | None = None
    decisions: dict[str, dict[str, float]] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == PREFIX + "tier_restore_seconds_per_1k_tokens":
                restore[s.labels["tier"]] = s.value
            elif s.name == PREFIX + "recompute_seconds_per_1k_tokens":
                recompute = s.value
            elif s.name == PREFIX + "tier_hit_decisions_total":
                per = decisions.setdefault(s.labels["tier"], {})
                per[s.labels["reason"]] = per.get(s.labels["reason"], 0.0) + s.value
    return RestoreCosts(restore, recompute, decisions)
