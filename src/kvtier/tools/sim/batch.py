"""An offline batch of unique prompts under KV pressure: what a CPU tier buys by preemption.

The scenario of the vLLM offloading blog's throughput table (seed 004): N unique prompts of
P tokens, each generating O tokens, all submitted at once to one engine. No prompt shares a
block with another, so the GPU prefix cache and the tiers can only help a request that was
preempted: vLLM stores every block to the CPU tier as it is computed, and when a preempted
request is admitted again its blocks are looked up there (after the GPU prefix cache) and
loaded instead of re-prefilled. Without a tier (or once the tier has dropped them) they are
recomputed.

The engine is `kvtier.tools.sim.engine.Engine` unchanged (first-come-first-served admission while
the pool has blocks for the whole prompt, the most recently admitted decoding request
preempted when a block is missing, recompute on resumption); this module only builds the
requests and reads the counters.

Primitives:
    BatchConfig   -- frozen description of one run
    BatchResult   -- throughput, preemptions, tokens recomputed and loaded, recompute share
    run_batch(config, cpu_bytes) -> BatchResult
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from kvtier.errors import ConfigError
from kvtier.tools.ops.hardware import PREFILL_MFU
from kvtier.tools.sim.cost import STEP_OVERHEAD_S
from kvtier.tools.sim.engine import EngineConfig
from kvtier.tools.sim.fleet import SimConfig, build_fleet
from kvtier.tools.sim.tiers import TIER_PRESETS
from kvtier.tools.sim.workload import Request


@dataclass(frozen=True, slots=True)
class BatchConfig:
    """One offline batch run (the defaults are the blog's scenario and vLLM's H100 defaults)."""

    model: str = "llama-3.1-8b"  # preset or config.json
    gpu: str = "h100"  # GPU profile
    requests: int = 10_000  # unique prompts, all submitted at t = 0
    prompt_tokens: int = 512  # tokens per prompt
    output_tokens: int = 512  # tokens each request generates (the blog does not say)
    block_tokens: int = 16  # vLLM's default GPU block size
    max_num_seqs: int = 1024  # vLLM V1's default on a >= 70 GiB GPU
    max_batched_tokens: int = 16384  # vLLM V1's offline default on an H100
    gpu_memory_utilization: float = 0.9  # vLLM's default
    kv_blocks: int | None = None  # GPU pool in blocks; None: from the model and the GPU
    mfu: float = PREFILL_MFU  # prefill FLOPs utilisation: the price of a recompute
    link_gbps: float | None = None  # host -> GPU bandwidth; None: the GPU's PCIe profile
    step_overhead_s: float = STEP_OVERHEAD_S  # fixed CPU cost per engine step

    def __post_init__(self) -> None:
        for name in ("requests", "prompt_tokens", "output_tokens"):
            if getattr(self, name) < 1:
                raise ConfigError(f"batch.{name}", getattr(self, name), "an integer >= 1")


@dataclass(frozen=True, slots=True)
class BatchResult:
    """What one batch run did."""

    cpu_bytes: int  # capacity of the CPU tier (0: no offload)
    throughput_tok_s: float  # generated tokens per simulated second
    sim_s: float  # simulated seconds until the last request finished
    preemptions: int  # running requests evicted for lack of GPU blocks
    recomputed_tokens: int  # tokens prefilled again after a preemption
    loaded_tokens: int  # tokens loaded from the CPU tier instead
    gpu_resume_tokens: int  # tokens a resumed request found still in the GPU prefix cache
    recompute_share: float  # share of the engine's time spent recomputing (FLOPs estimate)
    gpu_pool_tokens: int  # tokens of KV the GPU pool holds


def _requests(cfg: BatchConfig) -> list[Request]:
    per = -(-(cfg.prompt_tokens + cfg.output_tokens) // cfg.block_tokens)
    full = (cfg.prompt_tokens + cfg.output_tokens) // cfg.block_tokens
    # Disjoint hash ranges: no two prompts share a block.
    return [Request(i, i, 0.0, cfg.prompt_tokens, cfg.output_tokens,
                    list(range(1 + i * per, 1 + (i + 1) * per)), full)
            for i in range(cfg.requests)]


def run_batch(cfg: BatchConfig, cpu_bytes: int) -> BatchResult:
    """Run the batch with a CPU tier of `cpu_bytes` (0: no offload) and report.

    Raises:
        ConfigError: as SimConfig / build_fleet (bad model, GPU, or a pool too small).
    """
    if cpu_bytes < 0:
        raise ConfigError("cpu_bytes", cpu_bytes, "bytes >= 0")
    tiers = (replace(TIER_PRESETS["cpu"], capacity_bytes=cpu_bytes),) if cpu_bytes else ()
    engine_cfg = EngineConfig(block_tokens=cfg.block_tokens, max_num_seqs=cfg.max_num_seqs,
                              max_batched_tokens=cfg.max_batched_tokens,
                              gpu_memory_utilization=cfg.gpu_memory_utilization,
                              kv_blocks=cfg.kv_blocks)
    sim = SimConfig(model=cfg.model, gpu=cfg.gpu, engine=engine_cfg, tiers=tiers, requests=0,
                    mfu=cfg.mfu, link_gbps=cfg.link_gbps, step_overhead_s=cfg.step_overhead_s)
    engines, _ = build_fleet(sim)
    engine = engines[0]
    for req in _requests(cfg):
        engine.submit(req)
    engine.run_until(math.inf)
    s, cost = engine.stats, engine.cost
    end = s.last_finish_s
    # A recomputed token costs its matmuls (attention over <= 1k tokens is < 5% of them).
    recompute_s = s.recomputed_tokens * cost.dense_flops_per_token / cost.flops_per_s
    return BatchResult(
        cpu_bytes=cpu_bytes,
        throughput_tok_s=s.output_tokens / end if end > 0 else 0.0,
        sim_s=end,
        preemptions=s.preemptions,
        recomputed_tokens=s.recomputed_tokens,
        loaded_tokens=s.loaded_blocks * cfg.block_tokens,
        gpu_resume_tokens=s.gpu_hit_blocks * cfg.block_tokens,  # unique prompts
        recompute_share=recompute_s / s.busy_s if s.busy_s > 0 else 0.0,
        gpu_pool_tokens=engine.kv.total * cfg.block_tokens,
    )
