"""The state of Mamba / linear-attention layers, read from a config.json, and the attention
block size vLLM's "align" mamba cache mode gives a model that has them.

Primitives:
    StateShape, state_shape(cfg, hidden)   -- one state layer's conv and recurrent state
    align_block_size(attn_bytes_per_token, state_page_bytes, cache_block, kernel_base)
                                           -- vLLM's attention block size in align mode

Shapes follow vLLM 0.32's `MambaStateShapeCalculator` (model_executor/layers/mamba/
mamba_utils.py) as each model class calls it:
  - "gdn" (Qwen3-Next, Qwen3.5): conv (2*k_heads*k_dim + v_heads*v_dim, kernel-1), recurrent
    (v_heads, v_dim, k_dim);
  - "mamba2" (Nemotron-H, Granite-4 hybrids, Falcon-H1, Bamba, Zamba2): conv
    (inner + 2*n_groups*d_state, kernel-1), SSM (heads, head_dim, d_state); groups are
    replicated up to the TP size when it does not divide them (`extra_groups_for_head_shards`);
  - "mamba1" (Jamba, Mamba): conv (inner, kernel-1), SSM (inner, d_state);
  - "short_conv" (LFM2): conv (conv_dim, conv_L_cache-1), no recurrent state.
Dtypes (`MambaStateDtypeCalculator`): the conv state in the model dtype (mamba_cache_dtype
"auto"); the recurrent state in the model dtype too (mamba_ssm_cache_dtype "auto"), except
Nemotron-H, which vLLM sets to the config's `mamba_ssm_cache_dtype` or float32
(NemotronHForCausalLMConfig), and Qwen3.5, set to the config's `mamba_ssm_dtype` when it has
one. The model dtype is taken as 16-bit: vLLM serves float32 checkpoints in 16 bits by default.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

StateFamily = Literal["gdn", "mamba2", "mamba1", "short_conv"]

_MODEL_DTYPE_BYTES = 2
_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "fp32": 4, "bf16": 2, "fp16": 2}


@dataclass(frozen=True, slots=True)
class StateShape:
    """One state layer's per-sequence state, before tensor parallelism."""

    family: StateFamily  # which kind of state layer
    conv_channels: int  # conv state channels (split over TP ranks)
    conv_width: int  # conv state length: the kernel size - 1
    heads: int  # recurrent state rows split over TP ranks (0: no recurrent state)
    head_elems: int  # recurrent state elements per head
    conv_elem_bytes: int  # bytes per conv state element (vLLM's dtype)
    state_elem_bytes: int  # bytes per recurrent state element (vLLM's dtype)
    n_groups: int = 0  # Mamba2 B/C groups (replicated up to the TP size)
    group_channels: int = 0  # conv channels per group (2 * d_state)

    def bytes_per_rank(self, tp: int = 1) -> int:
        """Bytes of this layer's state for one sequence on one of `tp` ranks."""
        groups = self.n_groups
        if groups and groups % tp:
            groups = tp  # vLLM replicates the groups so every head shard has its own
        channels = self.conv_channels + (groups - self.n_groups) * self.group_channels
        conv = -(-channels // tp) * self.conv_width * self.conv_elem_bytes
        return conv + -(-self.heads // tp) * self.head_elems * self.state_elem_bytes


def state_shape(cfg: Mapping[str, Any], hidden: int) -> StateShape | None:
    """The state of one of the model's state layers; None for a model without them.

    The family is read from the keys the config has (vLLM's model classes read the same).
    """
    k = _model_type(cfg)
    if cfg.get("linear_num_value_heads"):  # gated DeltaNet
        vh, vd = int(cfg["linear_num_value_heads"]), int(cfg["linear_value_head_dim"])
        kh, kd = int(cfg["linear_num_key_heads"]), int(cfg["linear_key_head_dim"])
        ssm = _DTYPE_BYTES.get(str(cfg.get("mamba_ssm_dtype")), _MODEL_DTYPE_BYTES)
        return StateShape("gdn", 2 * kh * kd + vh * vd,
                          int(cfg.get("linear_conv_kernel_dim") or 4) - 1, vh, vd * kd,
                          _MODEL_DTYPE_BYTES, ssm)
    if cfg.get("conv_L_cache"):  # LFM2 short convolution
        return StateShape("short_conv", int(cfg.get("conv_dim") or hidden),
                          int(cfg["conv_L_cache"]) - 1, 0, 0, _MODEL_DTYPE_BYTES, 0)
    d_state = _first(cfg, "ssm_state_size", "mamba_d_state", "state_size")
    if not d_state:
        return None
    conv = int(_first(cfg, "conv_kernel", "mamba_d_conv") or 4) - 1
    inner = int(cfg.get("mamba_d_ssm") or 0) or _inner(cfg, hidden)
    heads = _first(cfg, "mamba_num_heads", "mamba_n_heads", "n_mamba_heads")
    ssm = _MODEL_DTYPE_BYTES
    if k == "nemotron_h":  # vLLM's NemotronHForCausalLMConfig: float32 unless the config says
        ssm = _DTYPE_BYTES.get(str(cfg.get("mamba_ssm_cache_dtype") or "float32"), 4)
    if not heads:  # Mamba1: no heads, no groups
        return StateShape("mamba1", inner, conv, inner, d_state, _MODEL_DTYPE_BYTES, ssm)
    head_dim = int(_first(cfg, "mamba_head_dim", "mamba_d_head", "mamba_headdim")
                   or inner // heads)
    groups = int(_first(cfg, "n_groups", "mamba_n_groups", "mamba_ngroups") or 1)
    return StateShape("mamba2", inner + 2 * groups * d_state, conv, heads, head_dim * d_state,
                      _MODEL_DTYPE_BYTES, ssm, n_groups=groups, group_channels=2 * d_state)


def align_block_size(attn_bytes_per_token: int, state_page_bytes: int, cache_block: int,
                     kernel_base: int) -> int:
    """vLLM's attention block size for a hybrid model in align mode
    (`Platform._align_hybrid_block_size`): the smallest multiple of the kernel alignment
    whose attention page (one layer's KV of the block) holds one state page, never below the
    block size asked for.

    Args:
        attn_bytes_per_token: one attention layer's KV of one token on one rank.
        state_page_bytes: one state layer's state of one sequence on one rank.
        cache_block: the block size before alignment (`--block-size`, else the platform's).
        kernel_base: the attention backend's smallest kernel block (16 for FlashAttention,
            32 for vLLM's CPU backend).
    """
    align = max(kernel_base, cache_block)
    size = align * -(-state_page_bytes // (align * attn_bytes_per_token))
    size = kernel_base * -(-size // kernel_base)
    return max(cache_block, size)


def _model_type(cfg: Mapping[str, Any]) -> str:
    return str(cfg.get("model_type") or "").lower()


def _first(cfg: Mapping[str, Any], *keys: str) -> int:
    for key in keys:
        if cfg.get(key):
            return int(cfg[key])
    return 0


def _inner(cfg: Mapping[str, Any], hidden: int) -> int:
    if cfg.get("mamba_num_heads") and cfg.get("mamba_head_dim"):  # Nemotron-H
        return int(cfg["mamba_num_heads"]) * int(cfg["mamba_head_dim"])
    return int(float(cfg.get("mamba_expand") or cfg.get("expand") or 2) * hidden)
