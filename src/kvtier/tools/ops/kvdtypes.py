"""Bytes per token of one attention layer for each vLLM `--kv-cache-dtype` (vLLM 0.33).

Plain dtypes are one size per element. vLLM 0.33's quantized ones pack each (token, KV head)
into a slot whose size is not `elements x bytes`: scales, norms and packing come with it, and
`kvtier plan` sized them wrong or refused them as unknown. The slot sizes below are the ones
vLLM's own `customize_spec` hooks give (`state_content_bytes` in vllm/v1/kv_cache_interface.py);
each table cites its file. Dtypes whose slot depends on something a plan cannot know (a
platform's RoPE split, an environment-chosen group size) are refused by name, not guessed.

    check_kv_dtype(name)                         -- ConfigError unless plan can size `name`
    layer_token_bytes(name, head_dim, kv_heads, mla_latent) -- bytes / token / layer on a rank
    plain_dtype_bytes(name)                      -- bytes per element of a plain dtype
    serve_flag_value(name)  -- what `vllm serve --kv-cache-dtype` takes (None: the default)
    per_tensor_fp8(name)    -- FP8 with one scale per tensor (the checkpoint's, or 1.0)
    kvtier_stores(name)     -- whether kvtier's connector stores a cache of that dtype
"""

from __future__ import annotations

import math

from kvtier.errors import ConfigError

_SIXTEEN_BIT = ("auto", "bf16", "bfloat16", "fp16", "float16", "half")
_PER_TENSOR_FP8 = ("fp8", "fp8_e4m3", "fp8_e5m2", "fp8_inc")
_PLAIN_BYTES = {
    "auto": 2, "bf16": 2, "bfloat16": 2, "fp16": 2, "float16": 2, "half": 2,
    "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1, "fp8_inc": 1,
}
# Per-token-head int8/fp8/int4: data plus one fp32 scale per K and per V side, inline after
# each head's data (vllm/v1/attention/backends/triton_attn.py, customize_spec); int4 packs
# two values a byte. Value: bytes of data per element of K (and of V).
_PER_TOKEN_HEAD_DATA = {"int8_per_token_head": 1.0, "fp8_per_token_head": 1.0,
                        "int4_per_token_head": 0.5}
_PER_TOKEN_HEAD_SCALE = 4  # torch.float32
# NVFP4: per side head_size // 2 bytes of fp4 data + head_size // 16 fp8 block scales
# (vllm/utils/torch_utils.py nvfp4_kv_cache_full_dim; vllm/v1/attention/backends/flashinfer.py).
_NVFP4 = ("nvfp4", "nvfp4_4over6")
# TurboQuant: (key bits, value bits) per preset, K+V packed in one slot per head
# (vllm/model_executor/layers/quantization/turboquant/config.py TQ_PRESETS, slot_size_aligned).
_TURBOQUANT = {"turboquant_k8v4": (8, 4), "turboquant_4bit_nc": (4, 4),
               "turboquant_k3v4_nc": (3, 4), "turboquant_3bit_nc": (3, 3)}
# DeepSeek MLA layouts: one opaque blob per token and layer (NoPE + RoPE + scales), whatever
# the latent size (vllm/model_executor/layers/attention/mla_attention.py).
_DS_MLA = {"fp8_ds_mla": 656, "nvfp4_ds_mla": 352}
# Known to vLLM 0.33 but not sizable from the flags a plan has: why, per dtype.
_UNSIZABLE = {
    "octave_k3v4": "its slot depends on the platform's registered RoPE dimension (ROCm)",
    "octave_k3v3": "its slot depends on the platform's registered RoPE dimension (ROCm)",
    "octave_k3v3_compact": "its slot depends on the platform's registered RoPE dimension (ROCm)",
    "ultraquant_4bit": "its scale group size is chosen at run time (ultraquant/format.py)",
}
_SIZABLE = (*_PLAIN_BYTES, *_PER_TOKEN_HEAD_DATA, *_NVFP4, *_TURBOQUANT, *_DS_MLA)


def _key(kv_dtype: str) -> str:
    return kv_dtype.strip().lower()


def check_kv_dtype(kv_dtype: str) -> None:
    """Raise ConfigError naming `kv_dtype` unless plan can size it (any model)."""
    key = _key(kv_dtype)
    if key in _UNSIZABLE:
        raise ConfigError("kv_dtype", kv_dtype,
                          f"a dtype kvtier plan can size: {_UNSIZABLE[key]}")
    if key not in _SIZABLE:
        raise ConfigError("kv_dtype", kv_dtype, f"one of {', '.join(sorted(_SIZABLE))}")


def plain_dtype_bytes(kv_dtype: str) -> int:
    """Bytes per element of a plain (unpacked) dtype; ConfigError for any other."""
    check_kv_dtype(kv_dtype)
    key = _key(kv_dtype)
    if key not in _PLAIN_BYTES:
        raise ConfigError("kv_dtype", kv_dtype, "a dtype of one size per element ("
                          f"{', '.join(sorted(_PLAIN_BYTES))}); it packs scales per head")
    return _PLAIN_BYTES[key]


def serve_flag_value(kv_dtype: str) -> str | None:
    """The `--kv-cache-dtype` value for the serve command, None for a 16-bit cache (vLLM's
    default "auto" is the model's dtype; "bf16" is not one of vLLM's choices)."""
    key = _key(kv_dtype)
    return None if key in _SIXTEEN_BIT else key


def per_tensor_fp8(kv_dtype: str) -> bool:
    """FP8 with one k/v scale per tensor (from the checkpoint, else 1.0): the per-token-head
    and DeepSeek MLA layouts compute their scales and are not."""
    return _key(kv_dtype) in _PER_TENSOR_FP8


def kvtier_stores(kv_dtype: str) -> bool:
    """Whether kvtier's connector stores this cache: plain elements only, the packed
    layouts' scales live outside the K and V it stores and it refuses them at start-up
    (kvtier.integrations.vllm.kvformat.attention_format)."""
    return _key(kv_dtype) in _PLAIN_BYTES


def _head_slot_bytes(key: str, head_dim: int) -> int:
    """K+V bytes of one (token, KV head) slot for a non-MLA layer."""
    if key in _PLAIN_BYTES:
        return 2 * head_dim * _PLAIN_BYTES[key]
    if key in _PER_TOKEN_HEAD_DATA:
        return int(2 * head_dim * _PER_TOKEN_HEAD_DATA[key]) + 2 * _PER_TOKEN_HEAD_SCALE
    if key in _NVFP4:
        return 2 * (head_dim // 2 + head_dim // 16)
    key_bits, value_bits = _TURBOQUANT[key]
    keys = head_dim if key_bits == 8 else math.ceil(head_dim * key_bits / 8) + 2  # fp16 norm
    values = math.ceil(head_dim * value_bits / 8) + 4  # fp16 scale and zero
    return keys + values + (keys + values) % 2  # rounded up to even


def layer_token_bytes(kv_dtype: str, head_dim: int, kv_heads: int,
                      mla_latent: int | None = None) -> int:
    """Bytes one token takes in one attention layer on one rank.

    Args:
        head_dim: the layer's head size (K and V alike).
        kv_heads: KV heads on this rank (not used for MLA).
        mla_latent: kv_lora_rank + qk_rope_head_dim for an MLA layer, None otherwise.

    Raises:
        ConfigError: naming the dtype when it is unknown, unsizable, or does not fit the
            attention (a DeepSeek MLA layout on a non-MLA model, a per-head one on MLA).
    """
    check_kv_dtype(kv_dtype)
    key = _key(kv_dtype)
    if mla_latent is not None:
        if key in _DS_MLA:
            return _DS_MLA[key]
        if key in _PLAIN_BYTES:
            return mla_latent * _PLAIN_BYTES[key]
        raise ConfigError("kv_dtype", kv_dtype, "for an MLA model a plain dtype or "
                          f"{', '.join(sorted(_DS_MLA))} (it packs per KV head)")
    if key in _DS_MLA:
        raise ConfigError("kv_dtype", kv_dtype, "a non-MLA dtype: the model has no MLA")
    return kv_heads * _head_slot_bytes(key, head_dim)
