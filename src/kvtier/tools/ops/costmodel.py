"""Time estimates from FLOPs and bandwidth: prefill, decode and KV transfers.

Primitives:
    prefill_flops(spec, new_tokens, cached_tokens)   -- FLOPs to prefill new tokens
    prefill_seconds(spec, new_tokens, gpu, tp, ...)  -- the same at PREFILL_MFU of peak
    decode_step_seconds(spec, fp, batch, context, gpu) -- one memory-bound decode step
    transfer_seconds(nbytes, link)                   -- bytes over a LinkProfile

These are first-order roofline numbers, meant for comparing "load from a tier" against
"re-prefill" (plan) and for the simulator's cost model; they omit kernel launch overheads
and scheduler time, so they flatter very short prompts.
"""

from __future__ import annotations

from kvtier.tools.ops.hardware import PREFILL_MFU, GpuProfile, LinkProfile
from kvtier.tools.ops.modelspec import KVFootprint, ModelSpec, session_kv_bytes

# Fraction of peak memory bandwidth a decode step reaches.
DECODE_BANDWIDTH_EFFICIENCY = 0.8


def prefill_flops(spec: ModelSpec, new_tokens: int, cached_tokens: int = 0) -> float:
    """FLOPs to prefill `new_tokens` after `cached_tokens` already in the KV cache.

    Matmuls: 2 x (active parameters excluding embeddings) per new token (the LM head runs for
    one position only and is left out).
    Attention: 2 matmuls (QK^T, AV) per (query, key) pair, causal, per attention layer;
    sliding layers see at most `sliding_window` keys. Linear/Mamba layers are counted in
    the matmul term only (their scan is linear and small).
    """
    if new_tokens <= 0:
        return 0.0
    dense = 2.0 * (spec.active_param_count - spec.embedding_param_count) * new_tokens
    if spec.mla is not None:
        qk = spec.mla.qk_nope_head_dim + spec.mla.qk_rope_head_dim
        pair = 2.0 * spec.num_attention_heads * (qk + spec.mla.v_head_dim)
    else:
        pair = 4.0 * spec.num_attention_heads * spec.head_dim
    full_pairs = _causal_pairs(cached_tokens, new_tokens, None)
    attn = spec.count("full") * full_pairs * pair
    if spec.count("sliding"):
        attn += spec.count("sliding") * _causal_pairs(
            cached_tokens, new_tokens, spec.sliding_window) * pair
    return dense + attn


def prefill_seconds(
    spec: ModelSpec, new_tokens: int, gpu: GpuProfile, tp: int = 1,
    cached_tokens: int = 0, mfu: float = PREFILL_MFU, fp8_compute: bool = False,
) -> float:
    """Seconds to prefill on `tp` devices at `mfu` of their dense peak."""
    peak = (gpu.fp8_tflops if fp8_compute else gpu.bf16_tflops) * 1e12 * tp * mfu
    return prefill_flops(spec, new_tokens, cached_tokens) / peak


def decode_step_seconds(
    spec: ModelSpec, fp: KVFootprint, batch: int, context_tokens: int, gpu: GpuProfile
) -> float:
    """One decode step of `batch` sequences at `context_tokens`, memory-bound, per rank.

    Each rank reads its weight shard (MoE: at most the experts `batch` tokens can touch)
    and every sequence's KV once.
    """
    touched = min(spec.param_count, spec.active_param_count * max(batch, 1))
    weights = touched * spec.weight_bytes_per_param / fp.tp
    kv = batch * session_kv_bytes(fp, context_tokens)
    return (weights + kv) / (gpu.hbm_bandwidth_gbps * 1e9 * DECODE_BANDWIDTH_EFFICIENCY)


def transfer_seconds(nbytes: float, link: LinkProfile) -> float:
    """Seconds to move `nbytes` over `link` at its effective bandwidth."""
    return nbytes / (link.bandwidth_gbps * 1e9)


def _causal_pairs(cached: int, new: int, window: int | None) -> float:
    """Sum over new positions p in [cached, cached+new) of keys attended (p+1, capped)."""
    lo, hi = cached + 1, cached + new  # keys seen by the first and last new token
    if window is None or hi <= window:
        return (lo + hi) * new / 2.0
    if lo >= window:
        return float(window) * new
    below = window - lo + 1  # positions whose key count is still under the window
    return (lo + window) * below / 2.0 + float(window) * (new - below)
