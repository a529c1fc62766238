"""The ways `kvtier plan` offers to serve a model, each with its own capacity and command.

Primitives:
    TierEstimate, Alternative        -- results (frozen)
    serve_flags(tp, util, ctx, kv_dtype, long_block) -- the flags every command shares
    tier_estimates(...)              -- what each tier holds and how fast a session returns
    build_alternatives(req, ..., chunks) -- every alternative, refused ones included

Alternatives: "none" (vLLM's own prefix cache, no offload), "native" (vLLM's CPU offload),
"kvtier" (its connector, CPU + NVMe tiers), "lmcache" (LMCache in-process, CPU + NVMe).
Each runs with its own state of vLLM's hybrid KV cache manager, so on hybrid models each has
its own session size (kvtier's tiers of a model with state layers store a copy of the states
with every chunk: chunkplan.py): LMCache runs with the manager off (it does not implement
`SupportsHMA`: vLLM then allocates sliding layers for the whole context), native offload keeps
it on from v0.21.0 (issue 14), kvtier keeps it on (its connector is `SupportsHMA`). An
alternative that cannot serve the model at the given vLLM version keeps its figures, with
`refused` saying why and no command.
"""

from __future__ import annotations

import math
import shlex
from dataclasses import dataclass, replace
from typing import Any

from kvtier.core.tier import Medium
from kvtier.integrations.vllm.config import CONNECTOR_CLASS
from kvtier.integrations.vllm.models import ModelTraits, unsupported_reason
from kvtier.tools.ops import flags as backend_flags
from kvtier.tools.ops.chunkplan import ChunkPlan
from kvtier.tools.ops.costmodel import transfer_seconds
from kvtier.tools.ops.hardware import LinkProfile, dram_link, host_link, nvme_link
from kvtier.tools.ops.kvdtypes import kvtier_stores, serve_flag_value
from kvtier.tools.ops.modelspec import (
    KVFootprint,
    ModelSpec,
    hf_layer_types,
    kv_footprint,
    session_kv_bytes,
    stored_kv_bytes,
)
from kvtier.tools.ops.plan_request import PlanRequest
from kvtier.tools.ops.restorecost import GPU_MEDIUM
from kvtier.tools.ops.vllm_versions import (
    NATIVE_OFFLOAD_HMA_SINCE,
    Version,
    format_version,
    gates_for_flag,
    hma_verdict,
)

_GIB = 1024**3
# Contexts from which the operator's guide recommends --block-size 32 / a prefill cap.
LONG_CONTEXT_BLOCK32 = 128 * 1024
LONG_PROMPT_BATCH_CAP = 32 * 1024
MAX_NUM_BATCHED_TOKENS = 8192
NAMES = ("none", "native", "kvtier", "lmcache")
_TITLES = {"none": "vLLM prefix cache only (no offload)", "native": "vLLM native CPU offload",
           "kvtier": "kvtier connector (CPU + NVMe)", "lmcache": "LMCache in-process (CPU + NVMe)"}
_CONNECTORS = {"native": "OffloadingConnector", "kvtier": CONNECTOR_CLASS,
               "lmcache": "LMCacheConnectorV1"}
_PREFIX = "--enable-prefix-caching"  # in the shared flags; dropped from each backend's own
CHUNKED_HMA_ENV = "VLLM_ALLOW_CHUNKED_LOCAL_ATTN_WITH_HYBRID_KV_CACHE"
CHUNKED_HMA_REASON = (f"vLLM turns the hybrid manager off for chunked local attention (Llama "
                      f"4) unless {CHUNKED_HMA_ENV}=1, and kvtier's connector stores full and "
                      "sliding-window groups only: the chunked layers cost the whole context")


@dataclass(frozen=True, slots=True)
class TierEstimate:
    """What one tier holds and how fast a session comes back from it."""

    name: str  # "GPU HBM", "CPU DRAM", "NVMe"
    capacity_bytes: int  # total across TP ranks
    warm_sessions: int  # sessions of `context_tokens` it holds
    link: LinkProfile | None  # bottleneck path back to the GPU; None for HBM itself
    load_s: float  # time to bring one session's KV back to the GPUs
    speedup: float  # re-prefill time / load time (inf for HBM)
    medium: str  # "GPU", or where a kvtier tier of it keeps chunks (kvtier.core.tier.Medium)


@dataclass(frozen=True, slots=True)
class Alternative:
    """One way to serve the model, with what it holds and the command that runs it."""

    name: str  # "none", "native", "kvtier" or "lmcache"
    title: str  # for display
    refused: str | None  # why it cannot serve this model at this version; None = it can
    hybrid_manager: bool  # vLLM's hybrid KV cache manager stays on with it
    hma_reason: str  # why
    bytes_per_token_rank: int  # KV per token per rank below any sliding window
    session_bytes_total: int  # one session at the context length, all ranks
    live_sessions: int  # sessions that fit in HBM at once
    gpu_kv_tokens: int  # tokens of KV the GPUs hold
    tiers: tuple[TierEstimate, ...]  # the tiers it uses, HBM first
    flags: tuple[str, ...]  # its own flags, after the shared serve flags
    env: dict[str, str]  # environment it needs (LMCache)
    command: str  # the complete `vllm serve` line; "" when refused
    notes: tuple[str, ...] = ()  # what an operator must know about it
    # one session as its CPU/NVMe tiers store it, all ranks, where that differs from
    # session_bytes_total (kvtier on a model with state layers); None where it does not
    stored_session_bytes_total: int | None = None


def serve_flags(tp: int, gpu_memory_utilization: float, ctx: int, kv_dtype: str,
                long_block: int = 32) -> list[str]:
    """The flags every alternative's command shares: TP (issue 14: without it a `--tp 8`
    plan's command loads all weights on one GPU), the memory share the plan assumed,
    the context, prefix caching, and the operator's guide's long-context knobs (`long_block`:
    the --block-size for long contexts, 32 unless the attention kernel needs more)."""
    out = ["--tensor-parallel-size", str(tp), "--gpu-memory-utilization",
           f"{gpu_memory_utilization:g}", "--max-model-len", str(ctx), _PREFIX]
    cache_dtype = serve_flag_value(kv_dtype)  # the dtype the plan sized (nvfp4 too)
    if cache_dtype is not None:
        out += ["--kv-cache-dtype", cache_dtype]
    if ctx >= LONG_CONTEXT_BLOCK32:
        out += ["--block-size", str(long_block)]
    if ctx >= LONG_PROMPT_BATCH_CAP:
        out += ["--max-num-batched-tokens", str(MAX_NUM_BATCHED_TOKENS)]
    return out


def tier_estimates(
    req: PlanRequest, session_rank: int, kv_gpu: int, cpu_bytes: int, nvme_bytes: int,
    reprefill: float, stored_rank: int | None = None, load_stored: bool = False,
) -> tuple[TierEstimate, ...]:
    """HBM, then the CPU tier (if `cpu_bytes`) and the NVMe tier (if `nvme_bytes`).

    `session_rank` is what one session holds in HBM on one rank; `stored_rank`, what it
    takes in a CPU or NVMe tier when that is more (kvtier's chunks of a model with state
    layers each carry the states; a sliding-window layer's chunks are all stored). A load
    moves `session_rank`, or with `load_stored` the stored bytes: kvtier reads and copies
    whole chunks (tiers/files/chunkfiles.py `read_into`; worker/streams.py copies each chunk
    to a staging buffer and scatters from there), vLLM's native offload only the groups'
    blocks a hit needs.
    """
    tp = req.tp
    stored_total = (stored_rank or session_rank) * tp
    load_rank = stored_rank if load_stored and stored_rank else session_rank
    load_total = load_rank * tp
    pcie = host_link(req.gpu, req.pcie_gen)
    # Each GPU pulls its own shard over its own link; all of them share host DRAM.
    host_load = max(transfer_seconds(load_rank, pcie),
                    transfer_seconds(load_total, dram_link()))
    disk = nvme_link(req.nvme_gen)
    disk_load = max(transfer_seconds(load_total, disk), host_load)
    tiers = [TierEstimate("GPU HBM", kv_gpu * tp, kv_gpu // session_rank, None, 0.0, math.inf,
                          GPU_MEDIUM)]
    if cpu_bytes:
        tiers.append(TierEstimate("CPU DRAM", cpu_bytes, cpu_bytes // stored_total, pcie,
                                  host_load, reprefill / host_load, Medium.CPU.value))
    if nvme_bytes:
        tiers.append(TierEstimate("NVMe", nvme_bytes, nvme_bytes // stored_total, disk,
                                  disk_load, reprefill / disk_load, Medium.STORAGE.value))
    return tuple(tiers)


def build_alternatives(
    req: PlanRequest, ctx: int, kv_gpu: int, cpu_gib: float, nvme_gib: float,
    reprefill: float, shared: list[str], chunks: ChunkPlan | None = None,
) -> tuple[Alternative, ...]:
    """Every alternative for `req` (see the module docstring), in NAMES order; `chunks`:
    kvtier's chunks of a model with state layers (chunkplan.plan_chunks).

    Raises:
        ConfigError: when kvtier's connector would refuse the store config plan builds.
    """
    spec = req.model
    hybrid = spec.hybrid
    out = []
    for name in NAMES:
        hma_on, reason, disable = _hma(name, req.vllm_version, hybrid, spec)
        refused = _refusal(name, spec, req.vllm_version, hybrid, req.kv_dtype)
        fp = kv_footprint(spec, req.kv_dtype, req.tp, hybrid_manager=hma_on)
        session_rank = session_kv_bytes(fp, ctx)
        cpu = 0 if name == "none" else int(cpu_gib * _GIB)
        nvme = int(nvme_gib * _GIB) if name in ("kvtier", "lmcache") else 0
        stored = _stored_session_rank(name, fp, ctx, chunks)
        tiers = tier_estimates(req, session_rank, kv_gpu, cpu, nvme, reprefill, stored,
                               load_stored=name == "kvtier")
        own, env = _flags(name, req, cpu_gib, nvme_gib, disable)
        out.append(Alternative(
            name=name, title=_TITLES[name], refused=refused, hybrid_manager=hma_on,
            hma_reason=reason, bytes_per_token_rank=fp.bytes_per_token,
            session_bytes_total=session_rank * req.tp, live_sessions=kv_gpu // session_rank,
            gpu_kv_tokens=int(kv_gpu / session_rank * ctx), tiers=tiers, flags=tuple(own),
            env=env, command="" if refused else command_line(req.model_ref, shared, own, env),
            stored_session_bytes_total=None if stored is None else stored * req.tp))
    return tuple(_with_capacity_notes(out))


def _stored_session_rank(name: str, fp: KVFootprint, ctx: int,
                         chunks: ChunkPlan | None) -> int | None:
    """One session as alternative `name`'s CPU and NVMe tiers store it, on one rank, where
    that is more than HBM holds of it; None where it is not.

    Both offloaders store a chunk as its tokens are computed, every layer of it: a
    sliding-window layer's chunks too (kvtier: integrations/vllm/groups.py, a chunk holds
    every group; vLLM 0.33 native: offloading/scheduler.py stores every group's chunks and
    loads only a window's). HBM keeps a sliding layer's window; a tier keeps the context.
    """
    if name == "none":
        return None
    if chunks is not None and name == "kvtier":
        return chunks.session_bytes(ctx)
    stored = stored_kv_bytes(fp, ctx)
    return stored if stored > session_kv_bytes(fp, ctx) else None


def command_line(model_ref: str, shared: list[str], own: list[str], env: dict[str, str]) -> str:
    """One copy-pasteable shell line: `ENV=... vllm serve MODEL FLAGS...`."""
    words = [f"{k}={shlex.quote(v)}" for k, v in env.items()]
    words += ["vllm", "serve", shlex.quote(model_ref)]
    return " ".join(words + [shlex.quote(f) for f in (*shared, *own)])


def _hma(name: str, version: Version | None, hybrid: bool,
         spec: ModelSpec) -> tuple[bool, str, bool]:
    """(manager on, why, pass --disable-hybrid-kv-cache-manager) for alternative `name`."""
    if spec.chunked_attention:
        # vLLM (config/vllm.py; read in 0.21, 0.32, 0.33) turns the manager off for chunked
        # local attention unless VLLM_ALLOW_CHUNKED_LOCAL_ATTN_WITH_HYBRID_KV_CACHE=1;
        # kvtier's connector refuses a ChunkedLocalAttentionSpec group (groups.py), so its
        # command says so too, whatever the environment.
        needs_flag = name != "none" and (name == "kvtier" or hma_verdict(
            version, _CONNECTORS[name], False,
            via_transfer_config=name != "native").required is True)
        return False, CHUNKED_HMA_REASON, needs_flag
    if name == "none":
        return True, "no KV connector: vLLM keeps its hybrid KV cache manager", False
    verdict = hma_verdict(version, _CONNECTORS[name], hybrid,
                          via_transfer_config=name != "native")
    if name == "native" and version is None and spec.state_layers:
        # Without the manager vLLM cannot serve Mamba/linear layers at all: the only
        # working native command is v0.21.0+'s, without the flag.
        return True, (f"Mamba/linear-attention layers need the manager: native offload "
                      f"keeps it on from {format_version(NATIVE_OFFLOAD_HMA_SINCE)}"), False
    # The flag where vLLM needs it or would turn the manager off anyway (LMCache): explicit
    on = verdict.required is False and verdict.manager_on is not False
    return on, verdict.reason, not on


def _refusal(name: str, spec: ModelSpec, version: Version | None, hybrid: bool,
             kv_dtype: str) -> str | None:
    linear = spec.state_layers > 0
    if name == "kvtier" and not kvtier_stores(kv_dtype):
        return (f"kvtier refuses a --kv-cache-dtype {kv_dtype} cache: its scales or packing "
                "live outside the per-token K and V kvtier stores; serve it with "
                "--kv-cache-dtype auto or fp8 (per-tensor scales)")
    if name == "kvtier":
        # The plan's commands turn prefix caching on: vLLM's "align" mamba cache mode.
        traits = ModelTraits(
            model=spec.name, architecture=spec.architecture or spec.model_type,
            attention_free=spec.count("full") + spec.count("sliding") == 0, hybrid=linear,
            encoder_decoder=spec.encoder_decoder, layer_types=hf_layer_types(spec),
            state_prefix_caching=True)
        found = unsupported_reason(traits)
        return None if found is None else f"kvtier refuses this model: {found[0]}; {found[1]}"
    # Llama 4's chunked layers run as one full-attention group (vLLM's default for them)
    if name == "lmcache" and hybrid and not spec.chunked_attention:
        return ("LMCache cannot serve hybrid-attention models (LMCache#3106: its storage path "
                "materialises one KV shape and fails on mixed attention groups)")
    if name == "native" and version is not None:
        since = gates_for_flag("--kv-offloading-size")[0].since
        if version < since:
            return f"the --kv-offloading-* flags appeared in {format_version(since)}"
        if linear and version < NATIVE_OFFLOAD_HMA_SINCE:
            return (f"before {format_version(NATIVE_OFFLOAD_HMA_SINCE)} native offload needs "
                    "--disable-hybrid-kv-cache-manager, and without the manager vLLM cannot "
                    "serve Mamba/linear-attention layers; upgrade vLLM")
    return None


def _flags(name: str, req: PlanRequest, cpu_gib: float, nvme_gib: float,
           disable_hma: bool) -> tuple[list[str], dict[str, str]]:
    env: dict[str, str] = {}
    if name == "none":
        own: list[str] = []
    elif name == "native":
        own = backend_flags.native_offload_flags(cpu_gib, disable_hma)
    elif name == "kvtier":
        tiers: list[dict[str, Any]] = [
            {"kind": "memory", "capacity": f"{backend_flags.gib_number(cpu_gib)}GiB"}]
        if nvme_gib:
            tiers.append({"kind": "disk", "path": req.nvme_path,
                          "capacity": f"{backend_flags.gib_number(nvme_gib)}GiB"})
        extra: dict[str, Any] = {"tiers": tiers}
        if req.tokens_per_chunk is not None:
            extra = {"tokens_per_chunk": req.tokens_per_chunk} | extra
        own = backend_flags.kvtier_flags(extra, disable_hma)
    else:
        own = backend_flags.lmcache_flags(disable_hma)
        env = backend_flags.lmcache_env(cpu_gib, req.tp,
                                        req.nvme_path if nvme_gib else None, nvme_gib)
    return [f for f in own if f != _PREFIX], env


def _with_capacity_notes(alts: list[Alternative]) -> list[Alternative]:
    """Say where an alternative holds fewer live sessions than vLLM alone: the hybrid
    manager is off with it, so sliding layers cost the whole context."""
    base = alts[0]
    out = []
    for alt in alts:
        if alt.refused is None and alt.session_bytes_total > base.session_bytes_total:
            note = (f"{alt.title}: runs with the hybrid KV cache manager off, so vLLM allocates "
                    f"the sliding-window layers for the whole context: one session costs "
                    f"{alt.session_bytes_total / _GIB:.2f} GiB instead of "
                    f"{base.session_bytes_total / _GIB:.2f} GiB ({alt.live_sessions} live "
                    f"sessions instead of {base.live_sessions})")
            alt = replace(alt, notes=(*alt.notes, note))
        out.append(alt)
    return out

