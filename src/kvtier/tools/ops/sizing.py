"""The `kvtier plan` math: from a model and a machine to tier sizes and serve commands.

Primitives:
    PlanRequest                  -- the inputs (frozen; defaults for all but model and GPU)
    TierEstimate, Alternative, Plan -- the results (frozen)
    make_plan(request)           -- compute a Plan

Steps: weights per GPU -> KV memory per GPU -> the CPU and NVMe tiers the host can give ->
for each way to serve (vLLM alone, vLLM native offload, kvtier, LMCache): whether it can serve
the model on this vLLM version, whether vLLM's hybrid KV cache manager stays on with it (which
decides what one session costs on hybrid models), live and warm sessions, load time vs
re-prefill, and the complete `vllm serve` command (kvtier.tools.ops.alternatives). For a
model with state layers, kvtier's chunk size and bytes per chunk (chunkplan.py). With
`node_engines`, the host's RAM is that many engines' (each in-process tier gets its share) and
one `kvtier node` pools their tiers (nodeplan.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from kvtier.errors import ConfigError
from kvtier.tools.ops.alternatives import (
    CHUNKED_HMA_ENV,
    Alternative,
    TierEstimate,
    build_alternatives,
    serve_flags,
    tier_estimates,
)
from kvtier.tools.ops.attention_kernels import long_context_block
from kvtier.tools.ops.chunkplan import ChunkPlan, plan_chunks
from kvtier.tools.ops.costmodel import prefill_seconds
from kvtier.tools.ops.flags import DISABLE_HMA, gib_number
from kvtier.tools.ops.kvdtypes import check_kv_dtype, per_tensor_fp8
from kvtier.tools.ops.modelspec import ModelSpec, kv_footprint, session_kv_bytes
from kvtier.tools.ops.nodeplan import NodePlan, plan_node
from kvtier.tools.ops.plan_request import PlanRequest
from kvtier.units import format_size

__all__ = ["Alternative", "Plan", "PlanRequest", "TierEstimate", "make_plan"]

_GIB = 1024**3
# Per-GPU memory vLLM needs besides weights and KV (activation peak, CUDA graphs, NCCL).
RUNTIME_RESERVE_BYTES = 2 * _GIB
# What plan assumes when not told (each said in Plan.assumptions, never used silently).
DEFAULT_HOST_RAM_PER_GPU = 256 * _GIB  # DGX-like nodes
DEFAULT_NVME_BYTES = 4 * 10**12  # one 4 TB drive
DEFAULT_CONTEXT_CAP = 32768
# Share of an NVMe drive the disk tier takes (filesystem overhead, free space for the SSD).
NVME_USABLE_FRACTION = 0.9
# The most of host RAM a CPU tier may take: the rest is the OS, the vLLM processes (tokenizer,
# CUDA contexts, pinned staging buffers) and the page cache NVMe reads go through. A tier
# above it is capped and flagged (issue 14: never 2400 GiB on a 2048 GiB host).
MAX_HOST_KV_FRACTION = 0.8


@dataclass(frozen=True, slots=True)
class Plan:
    """Everything `kvtier plan` reports. The top-level capacity fields are those of vLLM's
    native offload (the reference); each alternative carries its own."""

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
    hybrid_manager: bool  # whether vLLM's hybrid KV manager stays on with native offload
    hma_reason: str  # why
    tiers: tuple[TierEstimate, ...]  # HBM, CPU DRAM, NVMe, at native offload's session size
    cpu_tier_bytes: int  # recommended CPU tier (total across ranks), within the host's RAM
    cpu_offload_gib: float  # the same in GiB, rounded down to 0.01 (--kv-offloading-size)
    cpu_tier_wanted_bytes: int  # the CPU tier asked for, before the host-RAM cap
    host_ram_bytes: int  # the node's RAM (given or assumed)
    nvme_gib: float  # recommended disk tier size (total across ranks)
    serve_flags: tuple[str, ...]  # flags every alternative's command shares
    alternatives: tuple[Alternative, ...]  # each way to serve, refused ones included
    assumptions: tuple[str, ...] = ()  # defaults the figures rest on, to check
    notes: tuple[str, ...] = field(default=())  # warnings and advice, most important first
    chunks: ChunkPlan | None = None  # kvtier's chunks of a model with state layers
    node: NodePlan | None = None  # one kvtier node for request.node_engines engines

    def alternative(self, name: str) -> Alternative:
        """The alternative called `name` ("none", "native", "kvtier", "lmcache").

        Raises:
            KeyError: for another name.
        """
        for alt in self.alternatives:
            if alt.name == name:
                return alt
        raise KeyError(name)

    @property
    def host_ram_exceeded(self) -> bool:
        """The CPU tier asked for is more than the host can give (it was capped)."""
        return self.cpu_tier_wanted_bytes > self.cpu_tier_bytes


def make_plan(req: PlanRequest) -> Plan:
    """Compute the plan for `req`.

    Raises:
        ConfigError: for out-of-range inputs (tp, utilization, context, concurrency, dtype),
            and a TP size vLLM cannot split the model's heads by.
    """
    _validate(req)
    spec, tp = req.model, req.tp
    ctx = req.context_tokens or min(spec.max_position_embeddings or DEFAULT_CONTEXT_CAP,
                                    DEFAULT_CONTEXT_CAP)
    weights_gpu = math.ceil(spec.weights_bytes / tp)
    usable = int(req.gpu.hbm_bytes * req.gpu_memory_utilization)
    kv_gpu = usable - weights_gpu - RUNTIME_RESERVE_BYTES
    if kv_gpu <= 0:  # no command can serve it: none is printed
        raise ConfigError("hbm", _gib_text(req.gpu.hbm_bytes),
                          f"room for the weights ({_gib_text(weights_gpu)} a GPU at --tp {tp}) "
                          f"and vLLM's runtime ({_gib_text(RUNTIME_RESERVE_BYTES)}) within "
                          f"{req.gpu_memory_utilization:g} of it: raise --tp or use a larger "
                          "GPU")
    reprefill = prefill_seconds(spec, ctx, req.gpu, tp)
    engines = max(1, req.node_engines)
    host_ram = req.host_ram_bytes or DEFAULT_HOST_RAM_PER_GPU * tp * engines
    engine_ram = host_ram // engines  # what one engine's tiers may take of the host's RAM
    wanted = req.cpu_tier_bytes if req.cpu_tier_bytes is not None else int(
        engine_ram * req.host_kv_fraction)
    cpu_bytes = min(wanted, int(engine_ram * MAX_HOST_KV_FRACTION))
    cpu_gib = float(gib_number(cpu_bytes / _GIB))
    nvme_total = DEFAULT_NVME_BYTES if req.nvme_bytes is None else req.nvme_bytes
    nvme_gib = float(gib_number(nvme_total * NVME_USABLE_FRACTION / _GIB))
    long_block = 32 if req.gpu.pcie_gen == 0 else long_context_block(
        req.gpu.sm_major, spec.mla is not None, req.kv_dtype)
    flags = serve_flags(req.tp, req.gpu_memory_utilization, ctx, req.kv_dtype, long_block)
    chunks = plan_chunks(spec, req.kv_dtype, tp, on_cpu=req.gpu.pcie_gen == 0,
                         block_size=long_block if "--block-size" in flags else None,
                         tokens_per_chunk=req.tokens_per_chunk)
    alts = build_alternatives(req, ctx, kv_gpu, cpu_gib, nvme_gib, reprefill, flags, chunks)
    native = next(a for a in alts if a.name == "native")
    kvtier = next(a for a in alts if a.name == "kvtier")
    # A session takes more room in a tier than in HBM where kvtier's chunks each carry a
    # model's states, and where sliding-window layers keep their window in HBM but every
    # chunk in a tier (both offloaders: alternatives.py). The tiers are then kvtier's (the
    # NVMe tier is not native offload's), which loads whole chunks, unless it is refused.
    stored_owner = kvtier if kvtier.refused is None and \
        kvtier.stored_session_bytes_total is not None else native
    stored = None if stored_owner.stored_session_bytes_total is None \
        else stored_owner.stored_session_bytes_total // tp
    plan = Plan(
        request=req, context_tokens=ctx, weights_bytes=spec.weights_bytes,
        weights_per_gpu_bytes=weights_gpu, kv_bytes_per_token_rank=native.bytes_per_token_rank,
        kv_bytes_per_token_total=native.bytes_per_token_rank * tp,
        session_bytes_total=native.session_bytes_total, gpu_kv_bytes_per_gpu=kv_gpu,
        gpu_kv_tokens=native.gpu_kv_tokens, live_sessions=native.live_sessions,
        reprefill_s=reprefill, hybrid_manager=native.hybrid_manager,
        hma_reason=native.hma_reason, cpu_tier_bytes=cpu_bytes,
        tiers=tier_estimates(req, native.session_bytes_total // tp, kv_gpu, cpu_bytes,
                             int(nvme_gib * _GIB), reprefill, stored,
                             load_stored=stored_owner is kvtier),
        cpu_offload_gib=cpu_gib, cpu_tier_wanted_bytes=wanted, host_ram_bytes=host_ram,
        nvme_gib=nvme_gib, serve_flags=tuple(flags), alternatives=alts,
        assumptions=tuple(_assumptions(req, ctx, host_ram, nvme_gib)), chunks=chunks,
        node=None if not req.node_engines else plan_node(
            req, ctx, host_ram, cpu_gib, nvme_gib, kvtier, tuple(flags), chunks))
    return _with_notes(plan, kv_gpu)


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
    check_kv_dtype(req.kv_dtype)
    _validate_tp(req.model, req.tp)
    _validate_node(req)


def _validate_node(req: PlanRequest) -> None:
    if req.node_engines < 0:
        raise ConfigError("--node-engines", req.node_engines,
                          "an integer >= 1: engines of this model on one node (0 = no node)")
    if req.node_shm_bytes < 0:
        raise ConfigError("--node-shm", req.node_shm_bytes, "a size > 0 (the node's /dev/shm)")
    if req.node_engines and not req.node_socket.startswith("/"):
        raise ConfigError("--node-socket", req.node_socket,
                          "an absolute path (the engines' `node` key takes no other)")


def _tp_splits(spec: ModelSpec, tp: int) -> bool:
    """Whether vLLM can shard `spec` over `tp` ranks (ModelConfig.verify_with_parallel_config
    and QKVParallelLinear): query heads divide evenly; KV heads divide evenly, or (more ranks
    than KV heads) each KV head is replicated on tp/kv ranks. MLA has one latent per layer."""
    heads, kv = spec.num_attention_heads, spec.num_kv_heads
    if heads % tp:
        return False
    return spec.mla is not None or (kv % tp == 0 if tp <= kv else tp % kv == 0)


def _validate_tp(spec: ModelSpec, tp: int) -> None:
    if _tp_splits(spec, tp):
        return
    allowed = [t for t in range(1, spec.num_attention_heads + 1) if _tp_splits(spec, t)]
    kv = "" if spec.mla is not None else f" and {spec.num_kv_heads} KV heads"
    raise ConfigError("tp", tp, f"a size vLLM can split {spec.num_attention_heads} attention "
                      f"heads{kv} by: one of {', '.join(map(str, allowed))}")


def _assumptions(req: PlanRequest, ctx: int, host_ram: int, nvme_gib: float) -> list[str]:
    spec, out = req.model, []
    if spec.params_estimated:
        out.append(f"{spec.param_count / 1e9:.2f}B parameters at "
                   f"{spec.weight_bytes_per_param:g} B each, estimated from config.json "
                   "(shapes, torch_dtype, quantization_config); pass --params with the real "
                   "count")
    if not req.host_ram_bytes:
        gpus = "" if not req.node_engines else (
            f" x {req.node_engines} engines x TP {req.tp}")
        out.append(f"host RAM {_gib_text(host_ram)} ({_gib_text(DEFAULT_HOST_RAM_PER_GPU)} "
                   f"per GPU{gpus}, DGX-like); pass --host-ram")
    if req.node_engines and not req.node_shm_bytes:
        out.append(f"the node's /dev/shm is {_gib_text(host_ram // 2)}, half its RAM (a "
                   "tmpfs's default); pass --node-shm")
    if req.nvme_bytes is None:
        out.append(f"a {DEFAULT_NVME_BYTES / 1e12:g} TB NVMe drive at {req.nvme_path}, "
                   f"{NVME_USABLE_FRACTION:.0%} of it ({nvme_gib:g} GiB) for the disk tier; "
                   "pass --nvme SIZE, or --nvme 0 for no disk tier")
    if not req.context_tokens:
        out.append(f"sessions of {ctx:,} tokens (the model's maximum, at most "
                   f"{DEFAULT_CONTEXT_CAP:,}); pass --context")
    if req.pcie_gen is None and req.gpu.pcie_gen:
        out.append(f"PCIe Gen{req.gpu.pcie_gen} host links (the GPU's own); pass --pcie-gen")
    return out


def _with_notes(plan: Plan, kv_gpu: int) -> Plan:
    return replace(plan, notes=tuple(_notes(plan, kv_gpu)))


def _notes(plan: Plan, kv_gpu: int) -> list[str]:
    req, ctx, spec, notes = plan.request, plan.context_tokens, plan.request.model, []
    if plan.host_ram_exceeded:
        engines = max(1, req.node_engines)
        share = "" if engines == 1 else f" (one engine's share: 1/{engines})"
        notes.append(f"the CPU tier asked for ({_gib_text(plan.cpu_tier_wanted_bytes)}) is "
                     f"more than the host can give: {MAX_HOST_KV_FRACTION:.0%} of its "
                     f"{_gib_text(plan.host_ram_bytes // engines)} RAM{share} is "
                     f"{_gib_text(plan.cpu_tier_bytes)}; the commands use that (pass "
                     "--host-ram if the host has more)")
    if plan.live_sessions < req.concurrency:
        notes.append(f"HBM holds {plan.live_sessions} live session(s) at {ctx} tokens, below "
                     f"the target {req.concurrency}: offload adds WARM sessions (no "
                     "re-prefill on return), not live ones; shorten the context or add GPUs "
                     "for more live sessions")
    if spec.max_position_embeddings and ctx > spec.max_position_embeddings:
        notes.append(f"context {ctx} exceeds the model's max_position_embeddings "
                     f"({spec.max_position_embeddings}): vLLM refuses such a --max-model-len "
                     "unless the model's rope scaling extends it (or "
                     "VLLM_ALLOW_LONG_MAX_MODEL_LEN=1, at the outputs' risk)")
    if plan.cpu_tier_bytes <= kv_gpu * req.tp:
        notes.append("the CPU tier is not larger than the GPUs' KV cache: it would only "
                     "mirror HBM and add no hit rate; give it more host RAM or skip offload")
    for tier in plan.tiers[1:]:
        if tier.speedup < 1:
            notes.append(f"{tier.name}: loading a {ctx}-token session ({tier.load_s:.2f} s) "
                         f"is slower than re-prefilling it; this tier does not pay here")
    if per_tensor_fp8(req.kv_dtype):
        notes.append("FP8 KV: without calibrated k/v scales in the checkpoint vLLM uses "
                     "scale 1.0 and may clip outliers at long context; prefer BF16 KV + offload")
    notes += [n for alt in plan.alternatives for n in alt.notes]
    if spec.chunked_attention:
        notes.append(_chunked_note(plan))
    if plan.chunks is not None and plan.alternative("kvtier").refused is None:
        notes.append(state_note(plan.chunks, ctx))
    if req.tp > 1:
        notes.append(f"sizes are per engine, the total across its {req.tp} TP ranks: kvtier's "
                     f"capacities and --kv-offloading-size split evenly (each rank's CPU tier "
                     f"{_gib_text(plan.cpu_tier_bytes / req.tp)}); LMCache's sizes are per rank")
    if req.node_engines > 1:
        notes.append(f"{req.node_engines} engines on the node: each in-process command is one "
                     f"engine's, its CPU tier 1/{req.node_engines} of the host's KV RAM; their "
                     "disk tiers would each need a path of their own and a share of the NVMe "
                     "(the node's one disk tier has the drive)")
    if req.vllm_version is None and DISABLE_HMA in plan.alternative("native").flags:
        notes.append("vLLM version unknown: the native-offload command includes "
                     "--disable-hybrid-kv-cache-manager (needed on v0.18-v0.20); pass "
                     "--vllm-version to decide")
    return notes


def _chunked_note(plan: Plan) -> str:
    """What Llama 4's chunked layers cost with vLLM's default, and with the manager kept."""
    req, ctx = plan.request, plan.context_tokens
    kept = session_kv_bytes(kv_footprint(req.model, req.kv_dtype, req.tp), ctx) * req.tp
    return (f"chunked local attention: vLLM turns its hybrid KV cache manager off for it "
            f"(config/vllm.py: 'a latency regression'), so its {req.model.count('sliding')} "
            f"chunked layers keep the whole context: {_gib_text(plan.session_bytes_total)} a "
            f"{ctx:,}-token session; {CHUNKED_HMA_ENV}=1 keeps one "
            f"{req.model.sliding_window:,}-token chunk of them ({_gib_text(kept)}) with vLLM "
            "alone or native offload, not with kvtier (it refuses a chunked group)")


def state_note(chunks: ChunkPlan, ctx: int) -> str:
    """What the model's state layers mean for kvtier's tiers at `ctx` tokens (per engine)."""
    tp = chunks.tp
    share = chunks.state_bytes_per_seq / chunks.chunk_bytes
    return (f"state layers: vLLM's GPU pool keeps one copy of a sequence's states "
            f"({format_size(chunks.state_bytes_per_seq * tp)}), which does not grow with the "
            f"context; kvtier's tiers store a copy with every chunk of "
            f"{chunks.tokens_per_chunk:,} tokens ({chunks.how}), so a {ctx:,}-token session "
            f"there is {chunks.chunks(ctx):,} chunks x "
            f"({format_size(chunks.chunk_kv_bytes * tp)} KV + "
            f"{format_size(chunks.state_bytes_per_seq * tp)} state) = "
            f"{format_size(chunks.session_bytes(ctx) * tp)}, {share:.0%} of it state; "
            "a larger tokens_per_chunk (a multiple of the block) lowers that share")


def _gib_text(n: float) -> str:
    """Bytes as GiB with at most one decimal ("12 GiB", "12.5 GiB")."""
    return f"{n / _GIB:.1f}".removesuffix(".0") + " GiB"

