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
    from kvtier.bench.client import api_base

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
        if name not in WATCHED and not name.startswith("kvtier"):
            continue
        if name.endswith(_MONOTONIC_SUFFIXES):
            out[key] = value - before.get(key, 0.0)
        else:
            out[key] = value
    return out


def hit_rates(delta: Mapping[str, float]) -> dict[str, float | None]:
    """Token hit rates of the run: vLLM's own prefix cache and the connector's (external).

    Returns `{"prefix_cache": hits/queries, "external_prefix_cache": ...}`, None where no
    query was counted.
    """
    rates: dict[str, float | None] = {}
    for kind in ("prefix_cache", "external_prefix_cache"):
        queries = delta.get(f"vllm:{kind}_queries_total", 0.0)
        hits = delta.get(f"vllm:{kind}_hits_total", 0.0)
        rates[kind] = hits / queries if queries > 0 else None
    return rates
