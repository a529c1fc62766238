"""The `kvtier plan` math: from a model and a machine to tier sizes and serve flags.

Primitives:
    PlanRequest           -- the inputs (frozen; defaults for all but model and GPU)
    TierEstimate, Plan    -- the results (frozen)
    make_plan(request)    -- compute a Plan

Steps: weights per GPU -> KV memory per GPU -> live sessions at the context length ->
warm sessions per tier -> time to load one session from each tier vs re-prefilling it ->
recommended sizes and the flags for kvtier, vLLM native offload and LMCache.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from kvtier.errors import ConfigError
from kvtier.integrations.vllm.config import CONNECTOR_CLASS
from kvtier.ops import flags
from kvtier.ops.costmodel import prefill_seconds, transfer_seconds
from kvtier.ops.hardware import GpuProfile, LinkProfile, dram_link, host_link, nvme_link
from kvtier.ops.modelspec import ModelSpec, kv_dtype_bytes, kv_footprint, session_kv_bytes
from kvtier.ops.vllm_versions import Version, hma_verdict

_GIB = 1024**3
# Per-GPU memory vLLM needs besides weights and KV (activation peak, CUDA graphs, NCCL).
RUNTIME_RESERVE_BYTES = 2 * _GIB
# Contexts from which the operator's guide recommends --block-size 32 / a prefill cap.
LONG_CONTEXT_BLOCK32 = 128 * 1024
LONG_PROMPT_BATCH_CAP = 32 * 1024
MAX_NUM_BATCHED_TOKENS = 8192


@dataclass(frozen=True, slots=True)
class PlanRequest:
    """What `kvtier plan` is asked; sizes in bytes."""

    model: ModelSpec  # from load_model_spec
    gpu: GpuProfile  # from gpu_profile
    tp: int = 1  # tensor-parallel size (GPUs per instance)
    gpu_memory_utilization: float = 0.9  # vLLM --gpu-memory-utilization
    host_ram_bytes: int = 0  # host RAM of the node; 0 = 256 GiB per GPU (DGX-like)
    host_kv_fraction: float = 0.6  # share of host RAM given to the CPU tier (50-70% advised)
    nvme_bytes: int = 4 * 10**12  # local NVMe space for the disk tier; 0 = no disk tier
    nvme_path: str = "/mnt/nvme/kvtier"  # where the disk tier lives
    nvme_gen: int = 4  # NVMe PCIe generation
    pcie_gen: int | None = None  # host<->GPU link generation; None = the GPU's own
    context_tokens: int = 0  # typical session length; 0 = min(model max, 32k)
    concurrency: int = 16  # sessions expected to run at once
    kv_dtype: str = "bf16"  # vLLM --kv-cache-dtype
    vllm_version: Version | None = None  # decides the hybrid-manager flag
    cpu_tier_bytes: int | None = None  # force the CPU tier size (total across ranks)


@dataclass(frozen=True, slots=True)
class TierEstimate:
    """What one tier holds and how fast a session comes back from it."""

    name: str  # "GPU HBM", "CPU DRAM", "NVMe"
    capacity_bytes: int  # total across TP ranks
    warm_sessions: int  # sessions of `context_tokens` it holds
    link: LinkProfile | None  # bottleneck path back to the GPU; None for HBM itself
    load_s: float  # time to bring one session's KV back to the GPUs
    speedup: float  # re-prefill time / load time (inf for HBM)


@dataclass(frozen=True, slots=True)
class Plan:
    """Everything `kvtier plan` reports."""

    request: PlanRequest
    context_tokens: int  # the resolved context length
    weights_bytes: int  # whole model
    weights_per_gpu_bytes: int
    kv_bytes_per_token_rank: int  # per rank, below the sliding window
    kv_bytes_per_token_total: int  # all ranks
    session_bytes_total: int  # one session at context_tokens, all ranks (what a tier stores)
    gpu_kv_bytes_per_gpu: int  # HBM left for KV on each GPU
    gpu_kv_tokens: int  # tokens of KV the GPUs hold at this context
    live_sessions: int  # sessions at context_tokens that fit in HBM at once
    reprefill_s: float  # time to recompute one session's KV
    hybrid_manager: bool  # whether vLLM's hybrid KV manager stays on with offload
    hma_reason: str  # why
    tiers: tuple[TierEstimate, ...]
    cpu_offload_gib: int  # recommended --kv-offloading-size (total)
    nvme_gib: int  # recommended disk tier size
    serve_flags: tuple[str, ...]  # long-context knobs for every backend
    kvtier_flags: tuple[str, ...]
    native_flags: tuple[str, ...]
    lmcache_flags: tuple[str, ...]
    lmcache_env: dict[str, str] = field(default_factory=dict)
    notes: tuple[str, ...] = ()  # warnings and advice, most important first


def make_plan(req: PlanRequest) -> Plan:
    """Compute the plan for `req`.

    Raises:
        ConfigError: for out-of-range inputs (tp, utilization, context, concurrency, dtype).
    """
    _validate(req)
    spec, tp = req.model, req.tp
    ctx = req.context_tokens or min(spec.max_position_embeddings or 32768, 32768)
    hybrid_model = len(set(spec.layer_kinds)) > 1
    verdict = hma_verdict(req.vllm_version, "OffloadingConnector", hybrid_model)
    hma_on = verdict.required is False
    fp = kv_footprint(spec, req.kv_dtype, tp, hybrid_manager=hma_on)
    session_rank = session_kv_bytes(fp, ctx)
    weights_gpu = math.ceil(spec.weights_bytes / tp)
    kv_gpu = max(0, int(req.gpu.hbm_bytes * req.gpu_memory_utilization)
                 - weights_gpu - RUNTIME_RESERVE_BYTES)
    live = kv_gpu // session_rank
    reprefill = prefill_seconds(spec, ctx, req.gpu, tp)
    host_ram = req.host_ram_bytes or 256 * _GIB * tp
    cpu_bytes = req.cpu_tier_bytes if req.cpu_tier_bytes is not None else int(
        host_ram * req.host_kv_fraction)
    cpu_gib = cpu_bytes // _GIB // tp * tp  # a multiple of TP: per-rank LMCache sizes stay whole
    nvme_gib = int(req.nvme_bytes * 0.9) // _GIB
    tiers = _tiers(req, session_rank, kv_gpu, live, cpu_gib * _GIB, nvme_gib * _GIB, reprefill)
    store = {"tiers": [{"kind": "memory", "capacity": f"{cpu_gib}GiB"}] + (
        [{"kind": "disk", "path": req.nvme_path, "capacity": f"{nvme_gib}GiB"}]
        if nvme_gib else [])}
    kvtier_verdict = hma_verdict(req.vllm_version, CONNECTOR_CLASS, hybrid_model)
    return Plan(
        request=req, context_tokens=ctx, weights_bytes=spec.weights_bytes,
        weights_per_gpu_bytes=weights_gpu, kv_bytes_per_token_rank=fp.bytes_per_token,
        kv_bytes_per_token_total=fp.bytes_per_token * tp, session_bytes_total=session_rank * tp,
        gpu_kv_bytes_per_gpu=kv_gpu, gpu_kv_tokens=int(kv_gpu / session_rank * ctx),
        live_sessions=live, reprefill_s=reprefill, hybrid_manager=hma_on,
        hma_reason=verdict.reason, tiers=tiers, cpu_offload_gib=cpu_gib, nvme_gib=nvme_gib,
        serve_flags=tuple(_serve_flags(ctx)),
        kvtier_flags=tuple(flags.kvtier_flags(store, kvtier_verdict.required is not False)),
        native_flags=tuple(flags.native_offload_flags(cpu_gib, not hma_on)),
        lmcache_flags=tuple(flags.lmcache_flags(True)),
        lmcache_env=flags.lmcache_env(cpu_gib, tp, req.nvme_path if nvme_gib else None,
                                      nvme_gib),
        notes=tuple(_notes(req, ctx, live, kv_gpu, cpu_gib * _GIB, tiers, hybrid_model,
                           verdict.required)),
    )


def _validate(req: PlanRequest) -> None:
    if req.tp < 1:
        raise ConfigError("tp", req.tp, "an integer >= 1")
    if not 0 < req.gpu_memory_utilization <= 1:
        raise ConfigError("gpu_memory_utilization", req.gpu_memory_utilization, "in (0, 1]")
    if not 0 < req.host_kv_fraction <= 1:
        raise ConfigError("host_kv_fraction", req.host_kv_fraction, "in (0, 1]")
    if req.context_tokens < 0:
        raise ConfigError("context", req.context_tokens, "a token count >= 0 (0 = default)")
    if req.concurrency < 1:
        raise ConfigError("concurrency", req.concurrency, "an integer >= 1")
    kv_dtype_bytes(req.kv_dtype)


def _tiers(
    req: PlanRequest, session_rank: int, kv_gpu: int, live: int, cpu_bytes: int,
    nvme_bytes: int, reprefill: float,
) -> tuple[TierEstimate, ...]:
    tp, session_total = req.tp, session_rank * req.tp
    pcie = host_link(req.gpu, req.pcie_gen)
    # Each GPU pulls its own shard over its own link; all of them share host DRAM.
    host_load = max(transfer_seconds(session_rank, pcie),
                    transfer_seconds(session_total, dram_link()))
    disk = nvme_link(req.nvme_gen)
    disk_load = max(transfer_seconds(session_total, disk), host_load)
    tiers = [TierEstimate("GPU HBM", kv_gpu * tp, live, None, 0.0, math.inf),
             TierEstimate("CPU DRAM", cpu_bytes, cpu_bytes // session_total, pcie, host_load,
                          reprefill / host_load)]
    if nvme_bytes:
        tiers.append(TierEstimate("NVMe", nvme_bytes, nvme_bytes // session_total, disk,
                                  disk_load, reprefill / disk_load))
    return tuple(tiers)


def _serve_flags(ctx: int) -> list[str]:
    out = ["--max-model-len", str(ctx), "--enable-prefix-caching"]
    if ctx >= LONG_CONTEXT_BLOCK32:
        out += ["--block-size", "32"]
    if ctx >= LONG_PROMPT_BATCH_CAP:
        out += ["--max-num-batched-tokens", str(MAX_NUM_BATCHED_TOKENS)]
    return out


def _notes(
    req: PlanRequest, ctx: int, live: int, kv_gpu: int, cpu_bytes: int,
    tiers: tuple[TierEstimate, ...], hybrid_model: bool, hma_required: bool | None,
) -> list[str]:
    spec, notes = req.model, []
    if kv_gpu == 0:
        notes.append("the weights do not fit: raise --tensor-parallel-size or use a larger GPU")
    elif live < req.concurrency:
        notes.append(f"HBM holds {live} live session(s) at {ctx} tokens, below the target "
                     f"{req.concurrency}: offload adds WARM sessions (no re-prefill on return), "
                     "not live ones; shorten the context or add GPUs for more live sessions")
    if spec.max_position_embeddings and ctx > spec.max_position_embeddings:
        notes.append(f"context {ctx} exceeds the model's max_position_embeddings "
                     f"({spec.max_position_embeddings})")
    if cpu_bytes <= kv_gpu * req.tp:
        notes.append("the CPU tier is not larger than the GPUs' KV cache: it would only "
                     "mirror HBM and add no hit rate; give it more host RAM or skip offload")
    for tier in tiers[1:]:
        if tier.speedup < 1:
            notes.append(f"{tier.name}: loading a {ctx}-token session ({tier.load_s:.2f} s) "
                         f"is slower than re-prefilling it; this tier does not pay here")
    if req.kv_dtype.lower().startswith("fp8"):
        notes.append("FP8 KV: without calibrated k/v scales in the checkpoint vLLM uses "
                     "scale 1.0 and may clip outliers at long context; prefer BF16 KV + offload")
    if hybrid_model:
        notes.append("hybrid-attention model: LMCache cannot serve it (LMCache#3106); use "
                     "native offload on vLLM v0.21.0+ or kvtier")
    if req.tp > 1:
        notes.append(f"sizes are per engine, the total across its {req.tp} TP ranks: kvtier's "
                     f"capacities and --kv-offloading-size split evenly (each rank's CPU tier "
                     f"{_gib_text(cpu_bytes / req.tp)}); LMCache's sizes are per rank")
    if hma_required is None:
        notes.append("vLLM version unknown: the native-offload flags include "
                     "--disable-hybrid-kv-cache-manager (needed on v0.18-v0.20); pass "
                     "--vllm-version to decide")
    return notes


def _gib_text(n: float) -> str:
    """Bytes as GiB with at most one decimal ("12 GiB", "12.5 GiB")."""
    return f"{n / _GIB:.1f}".removesuffix(".0") + " GiB"
