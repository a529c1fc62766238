"""Parameter counts and recurrent-state sizes estimated from config.json shapes.

Primitives:
    ParamCount, count_params(cfg, kinds, mla, head_dim)
    linear_state_bytes(cfg, hidden)         -> fixed state of one Mamba/linear layer

The count covers embeddings, attention (standard or MLA), linear-attention/Mamba mixers and
gated MLPs (dense or mixture-of-experts, with shared experts). Norms and biases are left out:
they are well under 0.1% of any model this tool sizes. Checked against published totals in
tests/tools/test_plan_modelspec.py (Llama-3-8B 8.03B, Llama-3-70B 70.6B, DeepSeek-V3 671B).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvtier.tools.ops.statesize import state_shape


@dataclass(frozen=True, slots=True)
class MlaSpec:
    """Multi-head latent attention numbers (DeepSeek-style compressed KV)."""

    kv_lora_rank: int  # width of the compressed KV latent that is cached
    qk_rope_head_dim: int  # decoupled RoPE key width, cached next to the latent
    qk_nope_head_dim: int  # per-head non-RoPE query/key width (weights only)
    v_head_dim: int  # per-head value width (weights only)
    q_lora_rank: int | None  # query compression rank; None when queries are not compressed


@dataclass(frozen=True, slots=True)
class ParamCount:
    """Parameter totals of one model."""

    total: int  # every parameter
    active: int  # parameters one token passes through (top-k experts for MoE)
    embedding: int  # input embedding + LM head (no FLOPs in prefill but one position)
    routed_experts: int = 0  # the MoE layers' routed experts (shared ones not included)


def count_params(
    cfg: Mapping[str, Any], kinds: Sequence[str], mla: MlaSpec | None, head_dim: int
) -> ParamCount:
    """Estimate the parameter counts of a model from its config shapes."""
    hidden = int(cfg["hidden_size"])
    vocab = int(cfg.get("vocab_size") or 0)
    embed = vocab * hidden * (1 if cfg.get("tie_word_embeddings") else 2)
    attn = _mla_params(cfg, mla) if mla else _attention_params(cfg, head_dim)
    mixer = _linear_mixer_params(cfg, hidden)
    total = active = embed
    routed = 0
    for i, kind in enumerate(kinds):
        layer = mixer if kind == "linear" else attn
        mlp_total, mlp_active, mlp_routed = _mlp_params(cfg, hidden, i)
        total += layer + mlp_total
        active += layer + mlp_active
        routed += mlp_routed
    return ParamCount(total=total, active=active, embedding=embed, routed_experts=routed)


def linear_state_bytes(cfg: Mapping[str, Any], hidden: int) -> int:
    """Per-sequence state of one linear-attention or Mamba layer (conv + SSM), in bytes, at
    TP size 1 (statesize.py: vLLM's shapes and dtypes); 0 for a model without such layers."""
    shape = state_shape(cfg, hidden)
    return 0 if shape is None else shape.bytes_per_rank(1)


def _mamba_inner(cfg: Mapping[str, Any], hidden: int) -> int:
    if cfg.get("mamba_num_heads") and cfg.get("mamba_head_dim"):
        return int(cfg["mamba_num_heads"]) * int(cfg["mamba_head_dim"])
    return int(cfg.get("mamba_expand") or cfg.get("expand") or 2) * hidden


def _attention_params(cfg: Mapping[str, Any], head_dim: int) -> int:
    hidden = int(cfg["hidden_size"])
    heads = int(cfg["num_attention_heads"])
    kv = int(cfg.get("num_key_value_heads") or heads)
    return 2 * hidden * heads * head_dim + 2 * hidden * kv * head_dim  # q, o + k, v


def _mla_params(cfg: Mapping[str, Any], mla: MlaSpec) -> int:
    hidden = int(cfg["hidden_size"])
    heads = int(cfg["num_attention_heads"])
    qk = mla.qk_nope_head_dim + mla.qk_rope_head_dim
    if mla.q_lora_rank:
        q = hidden * mla.q_lora_rank + mla.q_lora_rank * heads * qk
    else:
        q = hidden * heads * qk
    kv_a = hidden * (mla.kv_lora_rank + mla.qk_rope_head_dim)
    kv_b = mla.kv_lora_rank * heads * (mla.qk_nope_head_dim + mla.v_head_dim)
    return q + kv_a + kv_b + heads * mla.v_head_dim * hidden


def _linear_mixer_params(cfg: Mapping[str, Any], hidden: int) -> int:
    if cfg.get("linear_num_value_heads"):
        kd = int(cfg["linear_num_key_heads"]) * int(cfg["linear_key_head_dim"])
        vh = int(cfg["linear_num_value_heads"])
        vd = vh * int(cfg["linear_value_head_dim"])
        # in_proj_qkvz + in_proj_ba + out_proj
        return hidden * (2 * kd + 2 * vd) + hidden * 2 * vh + vd * hidden
    d_inner = _mamba_inner(cfg, hidden)
    return 3 * hidden * d_inner  # in_proj (x and gate) + out_proj, ignoring small terms


def _mlp_params(cfg: Mapping[str, Any], hidden: int, layer: int) -> tuple[int, int, int]:
    """(total, active, routed experts') MLP parameters of decoder layer `layer`."""
    experts = int(cfg.get("n_routed_experts") or cfg.get("num_experts")
                  or cfg.get("num_local_experts") or 0)
    dense_inter = int(cfg.get("intermediate_size") or 4 * hidden)
    dense_first = int(cfg.get("first_k_dense_replace") or 0)
    sparse_step = int(cfg.get("decoder_sparse_step") or 1)
    # Llama 4: every `interleave_moe_layer_step`-th layer is MoE, with one shared expert of
    # the experts' width beside the routed ones (vLLM llama4.py Llama4MoE); the other layers
    # are dense MLPs of `intermediate_size_mlp`. Scout read 101.7B (the 48 shared experts'
    # 6.0B missing) for its published 109B (107.7B of it the text model's).
    llama4_step = cfg.get("interleave_moe_layer_step")
    if llama4_step:
        sparse_step = int(llama4_step)
        dense_inter = int(cfg.get("intermediate_size_mlp") or dense_inter)
    mlp_only = set(cfg.get("mlp_only_layers") or ())
    is_moe = (experts > 0 and layer >= dense_first and layer not in mlp_only
              and (layer + 1) % sparse_step == 0)
    if not is_moe:
        dense = 3 * hidden * dense_inter
        return dense, dense, 0
    inter = int(cfg.get("moe_intermediate_size") or cfg.get("intermediate_size")
                or dense_inter)
    per_expert = 3 * hidden * inter
    shared_inter = int(cfg.get("shared_expert_intermediate_size") or 0)
    shared_count = 1 if llama4_step else int(cfg.get("n_shared_experts") or 0)
    shared = 3 * hidden * shared_inter if shared_inter else shared_count * per_expert
    router = hidden * experts
    top_k = int(cfg.get("num_experts_per_tok") or 1)
    return (experts * per_expert + shared + router, top_k * per_expert + shared + router,
            experts * per_expert)
