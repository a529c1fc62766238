"""What a run did to the server's Prometheus counters: scrape `/metrics` before and after.

vLLM exports prefix-cache counters in tokens: `vllm:prefix_cache_queries` / `_hits` (its own
KV cache) and `vllm:external_prefix_cache_queries` / `_hits` (what a KV connector such as
kvtier supplied). kvtier's own metrics are named `kvtier_*`. A scrape is flattened to
`name{labels}` -> value, with the per-engine labels (`engine`, `model_name`) summed away, so
that a diff reads the same on one engine or several.

Primitives: `Scrape` (a dict), `parse_metrics(text)`, `scrape(url)` (async), `diff(before,
after)`, `hit_rates(delta)`, `WATCHED`.
"""

from __future__ import annotations

from collections.abc import Mapping

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

Scrape = dict[str, float]

# Counters of vLLM that the report shows; kvtier_* metrics are shown too, whatever they are.
WATCHED: tuple[str, ...] = (
    "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
    "vllm:external_prefix_cache_queries_total", "vllm:external_prefix_cache_hits_total",
    "vllm:num_preemptions_total", "vllm:prompt_tokens_total", "vllm:generation_tokens_total",
)
_DROP_LABELS = frozenset({"engine", "model_name"})
# Samples that only grow, so that after - before is what the run did.
_MONOTONIC_SUFFIXES = ("_total", "_count", "_sum", "_bucket")


def parse_metrics(text: str) -> Scrape:
    """Flatten Prometheus text exposition to `name{k=v,...}` -> value (per-engine labels summed).

    Raises:
        ValueError: the text is not Prometheus exposition format.
    """
    out: Scrape = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.endswith("_created"):
                continue  # creation timestamps, not measurements
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items())
                              if k not in _DROP_LABELS)
            key = f"{sample.name}{{{labels}}}" if labels else sample.name
            out[key] = out.get(key, 0.0) + float(sample.value)
    return out


async def scrape(url: str, timeout_s: float = 10.0) -> Scrape | None:
    """The server's `/metrics`, flattened; None when it has none or does not answer (a
    benchmark of an endpoint without metrics still runs, it just reports no hit rates)."""
    from kvtier.tools.bench.serving.client import api_base

    try:
        timeout = aiohttp.ClientTimeout(total=timeout_s)
        async with aiohttp.ClientSession(timeout=timeout) as session, \
                session.get(api_base(url) + "/metrics") as resp:
            if resp.status != 200:
                return None
            return parse_metrics(await resp.text())
    except (aiohttp.ClientError, TimeoutError, ValueError):
        return None


def diff(before: Mapping[str, float], after: Mapping[str, float]) -> Scrape:
    """after - before for counters (and histogram counts/sums), `after` for gauges; only the
    watched vLLM counters and any kvtier metric."""
    out: Scrape = {}
    for key, value in after.items():
        name = key.split("{", 1)[0]
        if name not in WATCHED and not _is_kvtier(name):
            continue
        if name.endswith(_MONOTONIC_SUFFIXES):
            out[key] = value - before.get(key, 0.0)
        else:
            out[key] = value
    return out


def hit_rates(delta: Mapping[str, float]) -> dict[str, float | None]:
    """Hit rates of the run, each None where nothing was queried:
      - "prefix_cache": vLLM's own prefix cache (tokens);
      - "external_prefix_cache": what the KV connector supplied (tokens);
      - "kvtier_lookup": prompt tokens kvtier could load / tokens asked about;
      - "kvtier_tier:<name>": chunk reads a tier served / chunk reads asked of it.
    """
    rates: dict[str, float | None] = {}
    for kind in ("prefix_cache", "external_prefix_cache"):
        rates[kind] = _rate(delta.get(f"vllm:{kind}_hits_total", 0.0),
                            delta.get(f"vllm:{kind}_queries_total", 0.0))
    lookups = kvtier_counters(delta, "lookup_tokens_total")
    if lookups:
        rates["kvtier_lookup"] = _rate(
            sum(kvtier_counters(delta, "lookup_hit_tokens_total").values()),
            sum(lookups.values()))
    hits = kvtier_counters(delta, "tier_hits_total")
    for tier, queries in kvtier_counters(delta, "tier_queries_total").items():
        rates[f"kvtier_tier:{tier}"] = _rate(hits.get(tier, 0.0), queries)
    return rates


def kvtier_counters(delta: Mapping[str, float], suffix: str) -> dict[str, float]:
    """kvtier metric `<prefix>kvtier_<suffix>` summed per `tier` label ("" when unlabelled)."""
    out: dict[str, float] = {}
    for key, value in delta.items():
        name, _, labels = key.partition("{")
        if _is_kvtier(name) and name.endswith("kvtier_" + suffix):
            tier = next((part.split("=", 1)[1] for part in labels.rstrip("}").split(",")
                         if part.startswith("tier=")), "")
            out[tier] = out.get(tier, 0.0) + value
    return out


def _is_kvtier(name: str) -> bool:
    return name.startswith(("kvtier", "vllm:kvtier"))


def _rate(hits: float, queries: float) -> float | None:
    return hits / queries if queries > 0 else None
