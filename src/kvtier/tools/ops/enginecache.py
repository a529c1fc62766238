"""What a running engine's /metrics say of its kvtier cache: the tokens it found and did not
load, by reason, and what each of its tiers holds now.

Read from a kvtier-served vLLM's Prometheus text (engines summed), for `kvtier inspect
--metrics`. The reasons are the connector's (integrations/vllm/metrics.LOST_HIT_REASONS,
restated here so that inspect never imports vllm; tests/tools/test_enginecache.py checks they
agree): recompute_faster, vllm_declined, load_failed, no_state.

Primitives: `LOST_HIT_REASONS`, `TierResidency`, `EngineCache`, `parse_engine_cache(text)`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

from kvtier.tools.ops.restorecost import PREFIX

LOST_HIT_REASONS = ("recompute_faster", "vllm_declined", "load_failed", "load_too_slow",
                    "no_state")
LOST_COUNTER = PREFIX + "lost_hit_tokens_total"
FOUND_COUNTER = PREFIX + "lookup_hit_tokens_total"
LOADED_COUNTER = PREFIX + "loaded_tokens_total"
# Gauge -> TierResidency field.
_RESIDENCY = {PREFIX + "tier_chunks": "chunks", PREFIX + "tier_used_bytes": "used_bytes",
              PREFIX + "tier_capacity_bytes": "capacity_bytes"}


@dataclass(slots=True)
class TierResidency:
    """What one tier holds now, as the engine sees it (its layout's namespace)."""

    chunks: float = 0.0
    used_bytes: float = 0.0
    capacity_bytes: float = 0.0


@dataclass(frozen=True, slots=True)
class EngineCache:
    """The tokens found, loaded and lost (by reason) so far, and each tier's residency."""

    found_tokens: float = 0.0
    loaded_tokens: float = 0.0
    lost_tokens: dict[str, float] = field(default_factory=dict)  # reason -> tokens
    residency: dict[str, TierResidency] = field(default_factory=dict)  # tier -> now


def parse_engine_cache(text: str) -> EngineCache:
    """The series above from a Prometheus exposition `text`, summed over engines; every
    reason present (0 where the server has none)."""
    found = loaded = 0.0
    lost = dict.fromkeys(LOST_HIT_REASONS, 0.0)
    residency: dict[str, TierResidency] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == LOST_COUNTER:
                reason = s.labels.get("reason", "")
                lost[reason] = lost.get(reason, 0.0) + s.value
            elif s.name == FOUND_COUNTER:
                found += s.value
            elif s.name == LOADED_COUNTER:
                loaded += s.value
            elif s.name in _RESIDENCY and "tier" in s.labels:
                held = residency.setdefault(s.labels["tier"], TierResidency())
                name = _RESIDENCY[s.name]
                setattr(held, name, getattr(held, name) + s.value)
    return EngineCache(found, loaded, lost, residency)
