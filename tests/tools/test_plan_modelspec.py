"""KV bytes per token and parameter counts, hand-checked against published architectures.

Fixtures in tests/data/configs/ were written from the models' public config.json numbers.
Hand formulas: GQA/MHA layer = 2 (K,V) x kv_heads x head_dim x dtype bytes; MLA layer =
(kv_lora_rank + qk_rope_head_dim) x dtype bytes.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kvtier.errors import ConfigError
from kvtier.tools.ops.modelspec import (
    kv_dtype_bytes,
    kv_footprint,
    load_model_spec,
    parse_model_config,
    session_kv_bytes,
)

CONFIGS = Path(__file__).parents[1] / "data" / "configs"


def spec(name: str):
    return load_model_spec(CONFIGS / f"{name}.json")


@pytest.mark.parametrize("name, attention, per_token", [
    ("llama-3-8b", "gqa", 2 * 8 * 128 * 2 * 32),  # 128 KiB
    ("llama-3-70b", "gqa", 2 * 8 * 128 * 2 * 80),  # 320 KiB
    ("qwen3-4b", "gqa", 2 * 8 * 128 * 2 * 36),  # 144 KiB
    ("deepseek-v3", "mla", (512 + 64) * 2 * 61),  # 68.6 KiB: latent, not 128 heads
])
def test_kv_bytes_per_token_bf16(name, attention, per_token):
    s = spec(name)
    assert s.attention_kind == attention
    assert kv_footprint(s, "bf16").bytes_per_token == per_token


def test_fp8_halves_kv():
    s = spec("llama-3-70b")
    assert kv_footprint(s, "fp8").bytes_per_token * 2 == kv_footprint(s, "auto").bytes_per_token


def test_gqa_heads_split_across_tp_and_replicate_below_one_per_rank():
    s = spec("llama-3-8b")  # 8 KV heads
    assert kv_footprint(s, tp=8).bytes_per_token == 2 * 1 * 128 * 2 * 32
    # TP=16 > 8 heads: vLLM keeps one (replicated) head per rank, not half a head.
    assert kv_footprint(s, tp=16).bytes_per_token == 2 * 1 * 128 * 2 * 32


def test_mla_latent_is_replicated_on_every_rank():
    s = spec("deepseek-v3")
    assert kv_footprint(s, tp=8).bytes_per_token == (512 + 64) * 2 * 61


def test_gemma3_sliding_layers_capped_at_window():
    s = spec("gemma-3-27b")  # nested text_config, 5 local : 1 global, window 1024
    assert (s.count("full"), s.count("sliding"), s.sliding_window) == (10, 52, 1024)
    fp = kv_footprint(s)
    layer = 2 * 16 * 128 * 2
    assert fp.full_bytes_per_token == 10 * layer
    # In HBM the 52 sliding layers take 6 groups of 10 (the hybrid manager's padding: 60).
    assert session_kv_bytes(fp, 32768) == 10 * layer * 32768 + 60 * layer * 1024
    assert session_kv_bytes(fp, 512) == 70 * layer * 512  # below the window: all groups


def test_gemma3_without_hybrid_manager_pays_full_context_on_sliding_layers():
    fp = kv_footprint(spec("gemma-3-27b"), hybrid_manager=False)
    assert fp.sliding_window is None
    assert session_kv_bytes(fp, 32768) == 62 * 2 * 16 * 128 * 2 * 32768


def test_qwen3_next_linear_layers_have_state_not_per_token_kv():
    s = spec("qwen3-next-80b-a3b")  # every 4th layer is full attention
    assert (s.count("full"), s.count("linear")) == (12, 36)
    fp = kv_footprint(s)
    assert fp.full_bytes_per_token == 12 * 2 * 2 * 256 * 2
    # gated DeltaNet state per layer: conv (2*16*128 + 32*128) x 3 + ssm 32 x 128 x 128, BF16
    per_layer = ((2 * 2048 + 4096) * 3 + 32 * 128 * 128) * 2
    assert fp.state_bytes_per_seq == 36 * per_layer
    assert session_kv_bytes(fp, 1000) == 1000 * 12 * 2048 + 36 * per_layer


def test_mistral_style_window_on_all_layers_and_qwen_disabled_window():
    base = {"hidden_size": 4096, "num_attention_heads": 32, "num_hidden_layers": 4,
            "num_key_value_heads": 8, "vocab_size": 32000, "intermediate_size": 14336}
    mistral = parse_model_config({**base, "sliding_window": 4096})
    assert mistral.layer_kinds == ("sliding",) * 4
    qwen = parse_model_config({**base, "sliding_window": 4096, "use_sliding_window": False})
    assert qwen.layer_kinds == ("full",) * 4
    jamba = parse_model_config({**base, "attn_layer_period": 2, "attn_layer_offset": 1,
                                "mamba_d_state": 16, "mamba_d_conv": 4, "mamba_expand": 2})
    assert jamba.layer_kinds == ("linear", "full", "linear", "full")
    # Mamba-1 state: d_inner x (d_conv - 1) conv + d_inner x d_state ssm, BF16
    assert jamba.linear_state_bytes == (8192 * 3 + 8192 * 16) * 2


def test_all_sliding_model_keeps_its_window_with_the_hybrid_manager_off():
    # vLLM promotes sliding layers to full ones only next to full layers
    # (_promote_local_kv_cache_specs); an all-sliding model stays one sliding group (issue 14).
    base = {"hidden_size": 4096, "num_attention_heads": 32, "num_hidden_layers": 4,
            "num_key_value_heads": 8, "vocab_size": 32000, "intermediate_size": 14336}
    mistral = parse_model_config({**base, "sliding_window": 4096})
    for hma in (True, False):
        fp = kv_footprint(mistral, hybrid_manager=hma)
        assert fp.sliding_window == 4096
        assert session_kv_bytes(fp, 32768) == 4096 * 4 * 2 * 8 * 128 * 2


@pytest.mark.parametrize("name, published, tolerance", [
    ("llama-3-8b", 8.03e9, 0.01),
    ("llama-3-70b", 70.6e9, 0.01),
    ("deepseek-v3", 671e9, 0.01),
    ("gemma-3-27b", 27.0e9, 0.02),  # text tower only; the 0.4B vision tower is not counted
    ("qwen3-next-80b-a3b", 80e9, 0.02),
    ("qwen3-4b", 4.02e9, 0.01),
])
def test_parameter_count_matches_published(name, published, tolerance):
    assert spec(name).param_count == pytest.approx(published, rel=tolerance)


def test_moe_active_params_and_fp8_weights():
    s = spec("deepseek-v3")
    assert s.active_param_count == pytest.approx(37e9, rel=0.03)  # published 37B active
    # FP8 checkpoint: 1 B a weight, but the embedding and LM head (2 x 129,280 x 7168) in BF16
    assert s.weights_bytes == pytest.approx(
        (s.param_count - s.embedding_param_count) + 2 * s.embedding_param_count, abs=1)
    assert spec("llama-3-8b").weights_bytes == pytest.approx(16.06e9, rel=0.01)


LLAMA = load_model_spec(CONFIGS / "llama-3-8b.json")


@pytest.mark.parametrize("quant, per_param", [
    ({"quant_method": "mxfp4"}, 4.25 / 8),  # GPT-OSS: 4-bit values, a scale per 32
    ({"quant_method": "bitsandbytes", "load_in_4bit": True, "load_in_8bit": False}, 0.5),
    ({"quant_method": "bitsandbytes", "load_in_4bit": False, "load_in_8bit": True}, 1.0),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {
        "group_0": {"targets": ["Linear"], "weights": {"num_bits": 4, "type": "int"}}}}, 0.5),
    ({"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {
        "group_0": {"targets": ["Linear"], "weights": {"num_bits": 8, "type": "float"}}}}, 1.0),
    ({"quant_method": "modelopt", "quant_algo": "NVFP4"}, 0.5),
    ({"quant_method": "modelopt", "quant_algo": "FP8"}, 1.0),
    ({"quant_method": "awq", "bits": 4}, 0.5),
])
def test_quantized_weights_are_sized_by_their_format(quant, per_param):
    """These 4-bit formats were sized as the checkpoint's bf16: twice to four times the
    weights, and GPU KV that much smaller."""
    import json

    raw = json.loads((CONFIGS / "llama-3-8b.json").read_text()) | {"quantization_config": quant}
    quantized = parse_model_config(raw)
    assert quantized.param_count == LLAMA.param_count
    # the linear layers quantized; vLLM keeps the embedding and LM head in the dtype (BF16),
    # but MXFP4 (experts only: a dense model has none, so all of it is read as MXFP4)
    kept = 0 if quant["quant_method"] == "mxfp4" else LLAMA.embedding_param_count
    assert quantized.weights_bytes == pytest.approx(
        (LLAMA.param_count - kept) * per_param + kept * 2, abs=1)


def test_gpt_oss_120b_fits_the_one_80gb_gpu_it_is_made_for():
    """MXFP4 experts: ~61 GiB of weights (its checkpoint: 65 GB); plan refused it on one H100
    ("217.5 GiB a GPU at --tp 1")."""
    from kvtier.tools.ops.hardware import gpu_profile
    from kvtier.tools.ops.plan_request import PlanRequest
    from kvtier.tools.ops.sizing import make_plan

    oss = spec("gpt-oss-120b")
    assert oss.param_count == pytest.approx(116.8e9, rel=0.02)  # published: 116.8B
    assert 55 * 2**30 < oss.weights_bytes < 65 * 2**30
    plan = make_plan(PlanRequest(model=oss, model_ref="openai/gpt-oss-120b",
                                 gpu=gpu_profile("h100"), tp=1))
    assert plan.live_sessions >= 1


def test_param_override():
    assert load_model_spec(CONFIGS / "llama-3-8b.json", param_count=7_000_000_000).weights_bytes \
        == 14_000_000_000


def test_bad_inputs_raise_config_error(tmp_path):
    with pytest.raises(ConfigError, match="model"):
        load_model_spec(tmp_path / "missing.json")
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="valid JSON"):
        load_model_spec(tmp_path)
    with pytest.raises(ConfigError, match="hidden_size"):
        parse_model_config({"num_attention_heads": 8, "num_hidden_layers": 2})
    with pytest.raises(ConfigError, match="kv_dtype"):
        kv_dtype_bytes("int3")
    with pytest.raises(ConfigError, match="tp"):
        kv_footprint(spec("llama-3-8b"), tp=0)


@pytest.mark.parametrize("field, value", [("sliding_window", "x"), ("head_dim", [128]),
                                          ("num_key_value_heads", True),
                                          ("max_position_embeddings", {"a": 1})])
def test_a_non_number_is_named_by_its_field(field, value) -> None:  # type: ignore[no-untyped-def]
    raw = {"hidden_size": 4096, "num_attention_heads": 32, "num_hidden_layers": 32,
           field: value}
    with pytest.raises(ConfigError, match=f"config.json:{field}"):
        parse_model_config(raw)
