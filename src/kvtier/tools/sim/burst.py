"""A burst of long prompts whose KV sits in one slow tier: load, recompute, or the rule.

The scenario of SGLang's file-tier report (sgl-project/sglang#26305): `clients` prompts of
`tokens` tokens arrive at once; each prompt's KV was stored earlier in a file tier, and
nothing of it is left in the GPU's prefix cache. Mean TTFT is taken three ways, on the
engine of `kvtier.tools.sim.engine` unchanged:
  - recompute: no tier (every prompt is prefilled);
  - naive: load_when "always" (every hit loaded, whatever it costs);
  - rule: load_when "faster" (kvtier's default: a hit loaded only as far as it loads faster
    than it recomputes, engine.py).
Loads queue on the tier's one read channel and prefills on the GPU's steps, so a burst makes
both wait.

Primitives:
    FILE_LATENCY_S, MODEL                       -- the file tier's latency; the model
    burst_ttft(tokens, clients, file_gbps, load_when, **inputs) -> mean TTFT (s)
    fit_file_gbps(tokens, clients, ratio)       -- the bandwidth giving a naive/recompute ratio
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from kvtier.tools.ops.hardware import PREFILL_MFU
from kvtier.tools.sim.cost import STEP_OVERHEAD_S
from kvtier.tools.sim.engine import EngineConfig
from kvtier.tools.sim.fleet import SimConfig, build_fleet
from kvtier.tools.sim.tiers import TierSpec
from kvtier.tools.sim.workload import Request

# A local file system's open + first read of a load (the "shared" preset's NFS is 2 ms).
FILE_LATENCY_S = 1e-3
_BLOCK = 16  # tokens per block (vLLM's GPU default)
MODEL = "llama-3.1-8b"  # the model of the other validation rows (the report names none)


def burst_ttft(tokens: int, clients: int, file_gbps: float | None, load_when: str = "faster",
               inputs: Mapping[str, float] | None = None) -> float:
    """Mean TTFT (s) of `clients` prompts of `tokens` tokens arriving together.

    Args:
        file_gbps: read bandwidth of the file tier holding every prompt's KV; None: no tier
            (the prompts are recomputed).
        load_when: the engine's rule, "faster" or "always".
        inputs: "mfu", "step_overhead_s", "link_gbps" override the cost model's defaults
            (MODEL on one H100).
    Raises:
        ConfigError: a bad model, load_when or bandwidth.
    """
    inputs = inputs or {}
    tiers = () if file_gbps is None else (TierSpec("file", 1 << 50, file_gbps, FILE_LATENCY_S),)
    cfg = SimConfig(model=MODEL, tiers=tiers, requests=0,
                    engine=EngineConfig(block_tokens=_BLOCK, load_when=load_when),
                    mfu=inputs.get("mfu", PREFILL_MFU),
                    step_overhead_s=inputs.get("step_overhead_s", STEP_OVERHEAD_S),
                    link_gbps=inputs.get("link_gbps"))
    engine = build_fleet(cfg)[0][0]
    blocks = tokens // _BLOCK
    requests = []
    for c in range(clients):
        first = 1 + c * (blocks + 1)  # no block shared between prompts
        hashes = list(range(first, first + blocks + 1))
        if engine.tiers.enabled:
            for i, h in enumerate(hashes[:blocks]):
                engine.tiers.store(h, hashes[i - 1] if i else None)
        requests.append(Request(c, c, 0.0, tokens, 1, hashes, blocks))
    for req in requests:
        engine.submit(req)
    engine.run_until(math.inf)
    return sum(r.first_token_s - r.arrival_s for r in requests) / clients


def fit_file_gbps(tokens: int, clients: int, ratio: float,
                  inputs: Mapping[str, float] | None = None) -> float:
    """The file tier's bandwidth (GB/s, 0.1-100) at which a naive cache's mean TTFT is
    `ratio` times recompute's, by bisection (the naive TTFT falls as bandwidth grows)."""
    recompute = burst_ttft(tokens, clients, None, inputs=inputs)
    lo, hi = 0.1, 100.0
    for _ in range(30):
        mid = math.sqrt(lo * hi)
        if burst_ttft(tokens, clients, mid, "always", inputs) / recompute > ratio:
            lo = mid
        else:
            hi = mid
        if hi / lo < 1.001:
            break
    return math.sqrt(lo * hi)
