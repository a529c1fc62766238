"""Restore cost and router weights: what a cache hit on each tier is worth.

The weight of a tier, for a router that weighs cache hits by medium (llm-d's precise
prefix-cache scorer, NVIDIA Dynamo's KV router), is the share of the prefill a hit on it
saves:

    weight = 1 - restore_s / recompute_s, clipped to [0, 1]

where restore_s is the time to bring the hit's KV back from the tier to the GPU and
recompute_s the time to prefill the same tokens (both per 1k tokens, or both for one
session). vLLM's own GPU prefix cache is 1.0 (its hits cost no restore); a tier that restores
slower than recompute is 0 (kvtier's rule, load_when "faster", recomputes such a hit anyway:
integrations/vllm/scheduler/offer.py). The same number serves both routers; what differs is the
key it
replaces: llm-d's "gpu" and "cpu" media, Dynamo's "host" and "disk" tiers.

Primitives:
- ``router_weight(restore_s, recompute_s)``: the formula above.
- ``STATIC_WEIGHTS``: the routers' static guesses (llm-d GPU 1.0 / CPU 0.8; Dynamo host 0.75 /
  disk 0.25), and ``static_guesses(medium)``: those that stand for a tier of that medium.
- ``parse_restore_costs(text)``: per-tier restore seconds per 1k tokens, recompute's, and the
  hit decision counts (issue 26, offer.py) from a server's /metrics text;
  ``fetch_metrics(url)`` reads that text.
- ``TierWeight``, ``tier_weight(...)``, ``measured_weights(costs, media)``: a table row per
  tier, from a cost model (kvtier plan) or from /metrics (plan and inspect);
  ``tier_media(store)``: each configured tier's medium, from its kind's class;
  ``read_measured(url, store)``: all of it from a server.
"""
from __future__ import annotations

import urllib.error
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from prometheus_client.parser import text_string_to_metric_families

from kvtier.core.tier import Medium
from kvtier.errors import ConfigError
from kvtier.tiers.registry import tier_class
from kvtier.tiers.storeconfig import StoreConfig

# kvtier.integrations.vllm.metrics.PREFIX, restated so that plan and inspect never import
# vllm (tests/tools/test_startup.py); tests/tools/test_restorecost.py checks they agree.
PREFIX = "vllm:kvtier_"
RESTORE_GAUGE = PREFIX + "tier_restore_seconds_per_1k_tokens"
RECOMPUTE_GAUGE = PREFIX + "recompute_seconds_per_1k_tokens"
DECISIONS_COUNTER = PREFIX + "tier_hit_decisions"

STATIC_WEIGHTS: dict[str, dict[str, float]] = {
    "llm-d": {"gpu": 1.0, "cpu": 0.8},
    "dynamo": {"host": 0.75, "disk": 0.25},
}
ROUTERS = tuple(STATIC_WEIGHTS)
WEIGHT_FORMULA = "weight = 1 - restore_s / recompute_s, clipped to [0, 1]"
GPU_MEDIUM = "GPU"  # the GPU's own memory, beside kvtier's media (kvtier.core.tier.Medium)
# Which static guess stands for a tier of each medium, per router (none: the router has
# no key for it).
_STATIC_KEYS: dict[str, dict[str, str]] = {
    GPU_MEDIUM: {"llm-d": "gpu"},
    Medium.CPU.value: {"llm-d": "cpu", "dynamo": "host"},
    Medium.STORAGE.value: {"dynamo": "disk"},
}
METRICS_TIMEOUT_S = 5.0
# The option `kvtier inspect` and `kvtier plan` take the URL from: their errors name it, as a
# user typed it (not as a config field, `metrics=`).
METRICS_OPTION = "--metrics"


def router_weight(restore_s: float, recompute_s: float) -> float:
    """Share of the replaced prefill a hit saves: ``1 - restore_s / recompute_s`` in [0, 1].

    Raises ValueError if ``recompute_s`` is not positive.
    """
    if recompute_s <= 0:
        raise ValueError(f"recompute_s must be > 0, got {recompute_s}")
    return min(1.0, max(0.0, 1.0 - restore_s / recompute_s))


def static_guesses(medium: str | None) -> dict[str, float]:
    """Router -> its static weight for a tier of `medium` ("GPU", "CPU", "STORAGE"); a
    router without a key for that medium, or an unknown medium, is left out."""
    keys = _STATIC_KEYS.get(medium or "", {})
    return {router: STATIC_WEIGHTS[router][key] for router, key in keys.items()}


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
            if s.name == RESTORE_GAUGE:
                restore[s.labels["tier"]] = s.value
            elif s.name == RECOMPUTE_GAUGE:
                recompute = s.value
            elif s.name == DECISIONS_COUNTER + "_total":
                per = decisions.setdefault(s.labels["tier"], {})
                per[s.labels["reason"]] = per.get(s.labels["reason"], 0.0) + s.value
    return RestoreCosts(restore, recompute, decisions)


def fetch_metrics(url: str, timeout_s: float = METRICS_TIMEOUT_S) -> str:
    """The Prometheus text of a vLLM server's /metrics. `url` is the endpoint, or the
    server's base URL (then /metrics is appended): the value of the commands' `--metrics`
    option, which the errors name. Any thread.

    Raises:
        ConfigError: the URL is not http(s), or does not answer with a Prometheus text.
    """
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ConfigError(METRICS_OPTION, url, "an http(s) URL of a kvtier-served vLLM's "
                          "/metrics endpoint (http://HOST:PORT/metrics) or of the server "
                          "(http://HOST:PORT)")
    endpoint = url.rstrip("/") + "/metrics" if parts.path in ("", "/") else url
    try:
        with urllib.request.urlopen(endpoint, timeout=timeout_s) as response:
            text = str(response.read().decode())
    except urllib.error.HTTPError as exc:
        raise ConfigError(METRICS_OPTION, url,
                          f"a /metrics endpoint ({endpoint}: HTTP {exc.code})") from None
    except (OSError, ValueError) as exc:  # URLError, a timeout, a body that is not text
        reason = getattr(exc, "reason", exc)
        raise ConfigError(METRICS_OPTION, url, f"a reachable /metrics endpoint ({endpoint} "
                          f"unreachable: {reason})") from None
    try:  # another service on that port: "invalid input: could not convert string to float"
        for _ in text_string_to_metric_families(text):
            pass
    except ValueError as exc:
        raise ConfigError(METRICS_OPTION, url, f"a /metrics endpoint ({endpoint} answered "
                          f"with something other than Prometheus metrics: {exc})") from None
    return text


@dataclass(frozen=True, slots=True)
class TierWeight:
    """One tier's restore cost next to recompute's, and the router weight they imply."""

    tier: str  # a kvtier tier's name, or a plan's "GPU HBM" / "CPU DRAM" / "NVMe"
    source: str  # "model" (plan's cost model) or "measured" (a server's /metrics)
    medium: str | None  # "GPU", "CPU", "STORAGE"; None: unknown (no config names its kind)
    restore_s_per_1k: float | None  # seconds to restore 1k tokens; None: not measured yet
    recompute_s_per_1k: float | None  # seconds to recompute 1k tokens; None: not measured
    weight: float | None  # router_weight of the two; None while either is unknown
    static: dict[str, float]  # router -> the static guess this weight can replace


def tier_weight(tier: str, source: str, medium: str | None, restore_s_per_1k: float | None,
                recompute_s_per_1k: float | None) -> TierWeight:
    """The row of one tier (weight None while a side is unknown or recompute is 0)."""
    weight = None
    if restore_s_per_1k is not None and recompute_s_per_1k:
        weight = router_weight(restore_s_per_1k, recompute_s_per_1k)
    return TierWeight(tier, source, medium, restore_s_per_1k, recompute_s_per_1k, weight,
                      static_guesses(medium))


def measured_weights(costs: RestoreCosts,
                     media: Mapping[str, str] | None = None) -> tuple[TierWeight, ...]:
    """A row per tier the server reports (restore gauge or decisions), by name.

    Args:
        media: tier name -> medium, from the store config when there is one.
    """
    media = media or {}
    names = sorted(set(costs.restore_s_per_1k) | set(costs.decisions))
    return tuple(tier_weight(name, "measured", media.get(name), costs.restore_s_per_1k.get(name),
                             costs.recompute_s_per_1k) for name in names)


def tier_media(store: StoreConfig) -> dict[str, str]:
    """Tier name -> the medium of its kind's class (`kvtier.core.tier.Tier.medium`)."""
    return {t.tier_name: tier_class(t.kind).medium.value for t in store.tiers}


def read_measured(url: str, store: StoreConfig | None = None) -> tuple[RestoreCosts,
                                                                       tuple[TierWeight, ...]]:
    """A server's measured costs and the row of each tier it reports; `store` (its kvtier
    config) gives the tiers' media.

    Raises:
        ConfigError: as fetch_metrics.
    """
    costs = parse_restore_costs(fetch_metrics(url))
    return costs, measured_weights(costs, tier_media(store) if store else None)
