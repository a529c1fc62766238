"""`kvtier plan`'s numbers for the field's published models, each checked by hand.

The configs in tests/data/configs are the models' published Hugging Face config.json files
(the fields sizing reads, as published). One attention layer keeps, per token and rank,
2 (K and V) x KV heads on the rank x head_dim x bytes per element; MLA keeps one latent of
kv_lora_rank + qk_rope_head_dim elements on every rank.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvtier.tools.ops.hardware import gpu_profile
from kvtier.tools.ops.modelspec import (
    hma_padding_layers,
    kv_footprint,
    load_model_spec,
    parse_model_config,
    session_kv_bytes,
    stored_kv_bytes,
)
from kvtier.tools.ops.sizing import PlanRequest, make_plan

CONFIGS = Path(__file__).parents[1] / "data" / "configs"
KIB, MIB, GIB = 1024, 1024**2, 1024**3
V33 = (0, 33, 0)


def spec(model: str):
    return load_model_spec(CONFIGS / f"{model}.json")


def plan(model: str, **kw):
    kw.setdefault("gpu", gpu_profile("h100"))
    kw.setdefault("vllm_version", V33)
    return make_plan(PlanRequest(model=spec(model), **kw))


# (model, layers full/sliding/linear, BF16 bytes per token on one rank, by hand)
PER_TOKEN = [
    # 32 layers x 2 x 8 KV heads x 128 x 2 B = 131,072 B = 128 KiB
    ("llama-3.1-8b", (32, 0, 0), 32 * 2 * 8 * 128 * 2),
    # 80 layers x 2 x 8 x 128 x 2 B = 327,680 B = 320 KiB
    ("llama-3.1-70b", (80, 0, 0), 80 * 2 * 8 * 128 * 2),
    # 64 layers x 2 x 8 x 128 x 2 B = 262,144 B = 256 KiB
    ("qwen3-32b", (64, 0, 0), 64 * 2 * 8 * 128 * 2),
    # MoE changes no KV: 48 layers x 2 x 4 KV heads x 128 x 2 B = 98,304 B = 96 KiB
    ("qwen3-30b-a3b", (48, 0, 0), 48 * 2 * 4 * 128 * 2),
    # 12 of 48 layers attend (full_attention_interval 4): 12 x 2 x 2 x 256 x 2 B = 24 KiB;
    # the 36 gated-DeltaNet layers keep a state per sequence instead
    ("qwen3-next-80b-a3b", (12, 0, 36), 12 * 2 * 2 * 256 * 2),
    # MLA: 61 layers x (512 + 64) latent x 2 B = 70,272 B (not 61 x 2 x 128 x 192 x 2)
    ("deepseek-v3", (61, 0, 0), 61 * (512 + 64) * 2),
    # 62 layers x 2 x 16 x 128 x 2 B = 507,904 B below the window (10 full, 52 sliding)
    ("gemma-3-27b", (10, 52, 0), 62 * 2 * 16 * 128 * 2),
    # 36 layers x 2 x 8 x 64 x 2 B = 73,728 B below the window (18 full, 18 sliding)
    ("gpt-oss-120b", (18, 18, 0), 36 * 2 * 8 * 64 * 2),
    # text_config: 40 layers x 2 x 8 x 128 x 2 B = 163,840 B = 160 KiB
    ("mistral-small-3.1-24b", (40, 0, 0), 40 * 2 * 8 * 128 * 2),
    # 46 layers (the MTP layer is not one of them) x 2 x 8 x 128 x 2 B = 188,416 B
    ("glm-4.5-air", (46, 0, 0), 46 * 2 * 8 * 128 * 2),
    # 48 layers x 2 x 8 x 128 x 2 B = 196,608 B below the chunk: 12 NoPE layers attend to
    # everything, 36 to their own 8192-token chunk
    ("llama-4-scout", (12, 36, 0), 48 * 2 * 8 * 128 * 2),
]


@pytest.mark.parametrize("model, kinds, bf16", PER_TOKEN, ids=[m for m, _, _ in PER_TOKEN])
def test_kv_bytes_per_token_bf16_and_fp8_match_the_hand_computation(model, kinds, bf16):
    s = spec(model)
    assert (s.count("full"), s.count("sliding"), s.count("linear")) == kinds
    assert kv_footprint(s, "bf16").bytes_per_token == bf16
    assert kv_footprint(s, "fp8").bytes_per_token == bf16 // 2  # one byte an element


def test_qwen3_next_kv_heads_are_replicated_above_their_count():
    # 2 KV heads on TP 4: each rank keeps one (vLLM replicates): 12 x 2 x 1 x 256 x 2 B.
    assert kv_footprint(spec("qwen3-next-80b-a3b"), "bf16", 4).bytes_per_token == 12_288


def test_deepseek_v3_latent_is_whole_on_every_rank():
    assert kv_footprint(spec("deepseek-v3"), "bf16", 8).bytes_per_token == 70_272


# --- Llama 4: chunked local attention ---

def test_llama4_scout_chunked_layers_keep_one_chunk_only_where_vllm_keeps_the_manager():
    # vLLM llama4.py: a layer whose no_rope_layers entry is 0 is NoPE global attention; the
    # others use ChunkedLocalAttention over attention_chunk_size = 8192 tokens. TP 4: 2 KV
    # heads a rank, 2 x 2 x 128 x 2 B = 1,024 B a layer. With the hybrid manager a
    # 131,072-token session on a rank is 12 x 1,024 x 131,072 + 36 x 1,024 x 8,192
    # = 1,912,602,624 B; x 4 ranks = 7,650,410,496 B.
    s = spec("llama-4-scout")
    assert s.sliding_window == 8192 and s.chunked_attention
    kept = session_kv_bytes(kv_footprint(s, "bf16", 4), 131072) * 4
    assert kept == 7_650_410_496
    # But vLLM 0.21-0.33 (config/vllm.py) turn the manager off for chunked local attention
    # unless VLLM_ALLOW_CHUNKED_LOCAL_ATTN_WITH_HYBRID_KV_CACHE=1: by default the chunked
    # layers are full ones, 48 x 4,096 B x 131,072 = 25,769,803,776 B, whatever the backend.
    p = plan("llama-4-scout", tp=4, context_tokens=131072)
    for alt in p.alternatives:
        assert not alt.hybrid_manager and alt.session_bytes_total == 25_769_803_776, alt.name
    note = next(n for n in p.notes if n.startswith("chunked local attention"))
    assert "VLLM_ALLOW_CHUNKED_LOCAL_ATTN_WITH_HYBRID_KV_CACHE=1" in note and "7.1 GiB" in note


def test_llama4_scout_kvtier_runs_without_the_hybrid_manager():
    # kvtier's connector refuses a ChunkedLocalAttentionSpec group (integrations/vllm/
    # groups.py): its command turns the manager off even where the environment would keep it.
    kvtier = plan("llama-4-scout", tp=4, context_tokens=131072).alternative("kvtier")
    assert kvtier.refused is None and not kvtier.hybrid_manager
    assert "--disable-hybrid-kv-cache-manager" in kvtier.command


def test_llama4_scout_and_maverick_parameters_count_the_shared_expert():
    # Scout, per layer (all 48 MoE): 16 routed + 1 shared expert of 3 x 5120 x 8192
    # (125,829,120 each) + router 5120 x 16; attention 2 x 5120 x 5120 + 2 x 5120 x 1024;
    # embeddings 2 x 202,048 x 5120. Total 107.8B (published 109B with the vision tower),
    # active (1 routed + shared) 17.2B (published 17B). Maverick: 128 experts on every second
    # layer, dense layers of intermediate_size_mlp 16384: 400.7B (published 400B).
    s = spec("llama-4-scout")
    assert round(s.param_count / 1e9, 1) == 107.8
    assert round(s.active_param_count / 1e9, 1) == 17.2
    cfg = json.loads((CONFIGS / "llama-4-scout.json").read_text())
    cfg["text_config"].update(num_local_experts=128, interleave_moe_layer_step=2)
    maverick = parse_model_config(cfg)
    assert round(maverick.param_count / 1e9, 1) == 400.7
    assert round(maverick.active_param_count / 1e9, 1) == 17.2


def test_llama4_without_no_rope_layers_takes_transformers_default():
    # An empty `no_rope_layers` (as early Scout configs had) is transformers' default: every
    # 4th layer NoPE (no_rope_layer_interval 4).
    cfg = json.loads((CONFIGS / "llama-4-scout.json").read_text())
    cfg["text_config"]["no_rope_layers"] = []
    s = parse_model_config(cfg)
    assert s.layer_kinds[:4] == ("sliding", "sliding", "sliding", "full")
    assert s.count("full") == 12


# --- vLLM's hybrid manager: group padding in HBM, every chunk in a tier ---

def test_gemma3_sliding_layers_are_padded_to_whole_groups_in_hbm():
    # vLLM kv_cache_planning.py: 10 full, 52 sliding -> groups of 10 (52 >= 1.5 x 10); the
    # sliding layers take 6 groups = 60 layers, 8 of them padding ("Add 8 padding layers").
    # A 32,768-token session on one rank: 10 x 8,192 x 32,768 + 60 x 8,192 x 1,024
    # = 2,684,354,560 + 503,316,480 = 3,187,671,040 B (not 52 x ...: 3,120,562,176).
    assert hma_padding_layers(10, 52) == (0, 8)
    assert hma_padding_layers(18, 18) == (0, 0)  # gpt-oss: two groups of 18
    assert hma_padding_layers(12, 36) == (0, 0)  # Llama 4 Scout: 1 + 3 groups of 12
    assert hma_padding_layers(12, 13) == (1, 0)  # 13 < 1.5 x 12: groups of 13
    fp = kv_footprint(spec("gemma-3-27b"))
    assert session_kv_bytes(fp, 32768) == 3_187_671_040
    assert plan("gemma-3-27b", context_tokens=32768).session_bytes_total == 3_187_671_040


def test_gemma3_offload_tiers_store_every_chunk_of_the_sliding_layers():
    # Both offloaders store a chunk as it is computed, with every layer in it (kvtier: a
    # chunk holds every KV cache group; vLLM native: each group's chunks, loading only a
    # window's). A 32,768-token session in a tier: 507,904 B x 32,768 = 16,642,998,272 B.
    # The default CPU tier, 60% of 256 GiB = 164,926,744,166 B, holds 9 of them, not the 52
    # that the HBM size (window-capped) gave.
    fp = kv_footprint(spec("gemma-3-27b"))
    assert stored_kv_bytes(fp, 32768) == 16_642_998_272
    p = plan("gemma-3-27b", context_tokens=32768)
    for name in ("native", "kvtier"):
        alt = p.alternative(name)
        assert alt.stored_session_bytes_total == 16_642_998_272, name
        assert alt.tiers[1].name == "CPU DRAM" and alt.tiers[1].warm_sessions == 9, name
    assert p.tiers[1].warm_sessions == 9


def test_gpt_oss_120b_hbm_keeps_the_window_and_tiers_the_context():
    # 18 full + 18 sliding (window 128) layers of 2 x 8 x 64 x 2 B = 2,048 B; no padding.
    # HBM: 18 x 2,048 x 32,768 + 18 x 2,048 x 128 = 1,212,678,144 B; a tier stores
    # 36 x 2,048 x 32,768 = 2,415,919,104 B.
    p = plan("gpt-oss-120b", context_tokens=32768)
    kvtier = p.alternative("kvtier")
    assert kvtier.session_bytes_total == 1_212_678_144
    assert kvtier.stored_session_bytes_total == 2_415_919_104


def test_full_attention_models_store_what_hbm_holds():
    assert plan("llama-3.1-8b", context_tokens=8192).alternative(
        "kvtier").stored_session_bytes_total is None


# --- the seeds' published numbers ---

def test_offloading_blog_block_sizes_after_the_contiguous_layout():
    # vLLM's KV offloading blog (v0.12.0 layout): one 16-token block of all layers is 2 MB
    # for Llama-3.1-8B, 2 MB for DeepSeek-R1-Distill-32B (on TP 2: 4 KV heads a rank) and
    # 0.5 MB for Llama-3.2-1B (16 layers x 2 x 8 x 64 x 2 B = 32 KiB a token).
    assert kv_footprint(spec("llama-3.1-8b")).bytes_per_token * 16 == 2 * MIB
    assert kv_footprint(spec("deepseek-r1-distill-qwen-32b"), tp=2).bytes_per_token * 16 \
        == 2 * MIB
    assert kv_footprint(spec("llama-3.2-1b")).bytes_per_token * 16 == 512 * KIB


def test_llama31_70b_session_sizes_the_seeds_quote():
    # A seed says an 8K-token Llama-3.1-70B session is "20GB wasted": it is 8,192 x 320 KiB
    # = 2.5 GiB (20 GB would be 8 sessions). Another asks for "a 4K-token KV at 70B FP8
    # (500 MB)": 4,096 x 160 KiB = 640 MiB.
    s = spec("llama-3.1-70b")
    assert session_kv_bytes(kv_footprint(s, "bf16"), 8192) == 5 * GIB // 2
    assert session_kv_bytes(kv_footprint(s, "fp8"), 4096) == 640 * MIB
    assert plan("llama-3.1-70b", tp=4, context_tokens=8192).session_bytes_total == 5 * GIB // 2


def test_gemma3_kvtier_loads_whole_chunks_native_offload_the_window():
    # kvtier reads a chunk file whole (tiers/files/chunkfiles.py read_into, checksummed) and
    # copies each chunk whole to the GPU before scattering it (worker/streams.py): a
    # 32,768-token Gemma 3 27B session moves 16,642,998,272 B, not the 3,187,671,040 B HBM
    # keeps. Over PCIe Gen5 at 50 GB/s: 0.333 s (native offload, which loads only the
    # window's blocks of a sliding group: 0.064 s); from one Gen4 NVMe at 6 GB/s: 2.774 s.
    p = plan("gemma-3-27b", context_tokens=32768)
    kvtier, native = p.alternative("kvtier"), p.alternative("native")
    assert kvtier.tiers[1].load_s == pytest.approx(16_642_998_272 / 50e9)
    assert kvtier.tiers[2].load_s == pytest.approx(16_642_998_272 / 6e9)
    assert native.tiers[1].load_s == pytest.approx(3_187_671_040 / 50e9)
    assert [t.load_s for t in p.tiers] == [t.load_s for t in kvtier.tiers]


def test_qwen3_next_kvtier_loads_every_chunks_state_copy():
    # Qwen3-Next on TP 4, 32,768 tokens: kvtier's chunks of 272 tokens (one align-mode block)
    # each hold 272 x 12,288 B = 3,342,336 B of KV and a 9,879,552 B copy of the 36 DeltaNet
    # layers' states; a hit moves all 121 of them: 121 x 13,221,888 = 1,599,848,448 B a rank,
    # 0.0320 s over PCIe Gen5 at 50 GB/s (what HBM holds, 412,532,736 B, would be 0.0083 s).
    kvtier = plan("qwen3-next-80b-a3b", tp=4, context_tokens=32768).alternative("kvtier")
    assert kvtier.stored_session_bytes_total == 4 * 1_599_848_448
    assert kvtier.tiers[1].load_s == pytest.approx(1_599_848_448 / 50e9)


def test_gpt_oss_120b_keeps_all_but_its_experts_in_bf16():
    # vLLM's Mxfp4Config quantizes the routed experts only (quantization/mxfp4.py: linear
    # layers unquantized). Experts: 36 layers x 128 x 3 x 2880 x 2880 = 114,661,785,600
    # params at 4.25 bits = 60,914,073,600 B; the other 2,127,052,800 params (attention,
    # router, embeddings) at 2 B = 4,254,105,600 B; 65,168,179,200 B = 60.7 GiB (OpenAI's
    # model card: a 60.8 GiB checkpoint). All at 4.25 bits it read 57.8 GiB.
    s = spec("gpt-oss-120b")
    assert s.weights_bytes == pytest.approx(65_168_179_200, abs=1)


@pytest.mark.parametrize("quant, published_gb", [
    # neuralmagic's Meta-Llama-3.1-8B-Instruct-FP8 (compressed-tensors, lm_head ignored):
    # 6,979,321,856 linear params x 1 B + 2 x 128,256 x 4096 = 1,050,673,152 embedding and
    # head params x 2 B = 9.08 GB; its checkpoint: 9.08 GB (all at 1 B it read 8.03 GB)
    ({"quant_method": "compressed-tensors", "config_groups": {"group_0": {
        "targets": ["Linear"], "weights": {"num_bits": 8, "type": "float"}}},
      "ignore": ["lm_head"]}, 9.08),
    # hugging-quants' AWQ INT4: 6.98e9 x 0.5 B + 1.05e9 x 2 B = 5.59 GB; its checkpoint:
    # 5.73 GB (the rest: its group-128 scales and zeros, not modelled)
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True}, 5.73),
])
def test_quantized_llama31_8b_keeps_embedding_and_head_in_bf16(quant, published_gb):
    cfg = json.loads((CONFIGS / "llama-3.1-8b.json").read_text())
    s = parse_model_config(cfg | {"quantization_config": quant})
    linear = s.param_count - 1_050_673_152
    assert s.weights_bytes == pytest.approx(linear * quant.get("bits", 8) / 8
                                            + 1_050_673_152 * 2, abs=1)
    assert s.weights_bytes / 1e9 == pytest.approx(published_gb, rel=0.03)
