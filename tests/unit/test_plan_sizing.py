"""The plan math against hand-checked cases and the seeds' worked examples."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvtier.errors import ConfigError
from kvtier.integrations.vllm.config import kvtier_transfer_config
from kvtier.ops.flags import lmcache_env, native_offload_flags, sglang_per_rank_to_vllm_total
from kvtier.ops.hardware import gpu_profile
from kvtier.ops.modelspec import kv_footprint, load_model_spec
from kvtier.ops.sizing import PlanRequest, make_plan

CONFIGS = Path(__file__).parents[1] / "data" / "configs"
GIB = 1024**3


def req(model: str, **kw) -> PlanRequest:
    kw.setdefault("gpu", gpu_profile("h100"))
    return PlanRequest(model=load_model_spec(CONFIGS / f"{model}.json"), **kw)


def test_sglang_per_rank_200gb_on_8_gpus_is_1600_on_vllm():
    # Operator's guide: "200 GB per GPU x 8 GPUs = 1600 GB, use --kv-offloading-size 1600".
    assert sglang_per_rank_to_vllm_total(200, 8) == 1600
    plan = make_plan(req("llama-3-70b", tp=8, cpu_tier_bytes=1600 * GIB,
                         vllm_version=(0, 21, 0)))
    assert plan.cpu_offload_gib == 1600
    assert plan.native_flags[plan.native_flags.index("--kv-offloading-size") + 1] == "1600"
    # LMCache allocates per rank: 1600 / 8 = 200 per worker keeps the same total.
    assert plan.lmcache_env["LMCACHE_MAX_LOCAL_CPU_SIZE"] == "200"
    with pytest.raises(ConfigError):
        sglang_per_rank_to_vllm_total(200, 0)


def test_qwen3_4b_6gb_tier_holds_about_41k_tokens():
    # Operator's guide: "the worked Qwen3-4B cap (~41 K tokens for 6 GB)".
    fp = kv_footprint(load_model_spec(CONFIGS / "qwen3-4b.json"))
    assert 6 * 10**9 // fp.bytes_per_token == 40690


def test_llama3_8b_on_one_h100_live_sessions_hand_checked():
    # HBM 81559 MiB x 0.9 = 76,968,728,985 B; minus weights 16,059,990,016 B and the 2 GiB
    # runtime reserve = 58,761,255,321 B of KV; one 8192-token session = 8192 x 128 KiB
    # = 1 GiB -> 54 live sessions.
    plan = make_plan(req("llama-3-8b", context_tokens=8192, concurrency=8))
    assert plan.gpu_kv_bytes_per_gpu == 58_761_255_321
    assert plan.live_sessions == 54
    assert plan.session_bytes_total == 8192 * 131072
    assert not any("live session" in n for n in plan.notes)


def test_nvme_100k_bf16_70b_loads_in_5_to_7_s_and_beats_10_s_reprefill():
    # Operator's guide: a 100k-token BF16 context loads from Gen4 NVMe in ~5-7 s, still
    # beating a ~10 s re-prefill; DRAM is ~20x faster than NVMe.
    plan = make_plan(req("llama-3-70b", tp=8, context_tokens=100_000, nvme_gen=4,
                         vllm_version=(0, 21, 0)))
    hbm, dram, nvme = plan.tiers
    assert 5.0 <= nvme.load_s <= 7.0
    assert 7.0 <= plan.reprefill_s <= 12.0
    assert nvme.speedup > 1
    assert dram.load_s * 20 <= nvme.load_s
    assert hbm.warm_sessions == plan.live_sessions


def test_bigger_host_ram_never_holds_fewer_warm_sessions():
    warm = [make_plan(req("llama-3-8b", host_ram_bytes=ram * GIB)).tiers[1].warm_sessions
            for ram in (64, 128, 256, 512, 1024)]
    assert warm == sorted(warm) and warm[0] < warm[-1]


def test_hma_flag_follows_version_for_native_offload():
    old = make_plan(req("llama-3-8b", vllm_version=(0, 20, 2)))
    new = make_plan(req("llama-3-8b", vllm_version=(0, 21, 0)))
    assert "--disable-hybrid-kv-cache-manager" in old.native_flags
    assert "--disable-hybrid-kv-cache-manager" not in new.native_flags
    # LMCache needs it on every version.
    assert "--disable-hybrid-kv-cache-manager" in new.lmcache_flags


def test_sliding_window_model_loses_capacity_when_hma_must_be_off():
    on = make_plan(req("gemma-3-27b", context_tokens=32768, vllm_version=(0, 21, 0)))
    off = make_plan(req("gemma-3-27b", context_tokens=32768, vllm_version=(0, 20, 0)))
    assert on.hybrid_manager and not off.hybrid_manager
    assert on.live_sessions > 3 * off.live_sessions
    assert any("LMCache cannot serve" in n for n in on.notes)


def test_notes_for_weights_not_fitting_and_tiny_host():
    plan = make_plan(req("llama-3-70b", gpu=gpu_profile("l40s"), tp=1))
    assert plan.live_sessions == 0
    assert any("do not fit" in n for n in plan.notes)
    small = make_plan(req("llama-3-8b", host_ram_bytes=32 * GIB))
    assert any("mirror HBM" in n for n in small.notes)


def test_long_context_gets_block_size_and_batch_cap():
    plan = make_plan(req("deepseek-v3", gpu=gpu_profile("h200"), tp=8, context_tokens=131072))
    assert plan.serve_flags[plan.serve_flags.index("--block-size") + 1] == "32"
    assert "--max-num-batched-tokens" in plan.serve_flags
    short = make_plan(req("llama-3-8b", context_tokens=4096))
    assert "--block-size" not in short.serve_flags
    assert "--max-num-batched-tokens" not in short.serve_flags


def test_kvtier_flags_carry_validated_store_config():
    plan = make_plan(req("llama-3-8b", host_ram_bytes=200 * GIB, nvme_bytes=0))
    cfg = plan.kvtier_flags[plan.kvtier_flags.index("--kv-transfer-config") + 1]
    assert '"kv_connector":"KVTierConnector"' in cfg
    assert '"tiers":[{"kind":"memory","capacity":"120GiB"}]' in cfg
    with pytest.raises(ConfigError):
        kvtier_transfer_config({"tiers": [{"kind": "tape", "capacity": "1GiB"}]})


def test_lmcache_env_divides_by_tp_and_keeps_local_cpu_on():
    env = lmcache_env(800, 4, "/mnt/nvme/lm", 2000)
    assert env["LMCACHE_MAX_LOCAL_CPU_SIZE"] == "200"
    assert env["LMCACHE_MAX_LOCAL_DISK_SIZE"] == "500"
    assert env["LMCACHE_LOCAL_CPU"] == "True" and env["PYTHONHASHSEED"] == "0"
    assert native_offload_flags(800, False)[-1] == "800"


@pytest.mark.parametrize("field, kw", [
    ("tp", {"tp": 0}), ("gpu_memory_utilization", {"gpu_memory_utilization": 1.5}),
    ("concurrency", {"concurrency": 0}), ("kv_dtype", {"kv_dtype": "int4"}),
])
def test_bad_requests_raise_config_error(field, kw):
    with pytest.raises(ConfigError, match=field):
        make_plan(req("llama-3-8b", **kw))


def test_kvtier_capacity_is_the_same_total_as_native_offload_at_tp_8():
    """One meaning of a capacity at any TP (issue 11, item 4): the plan's kvtier memory tier
    is the engine's total, equal to --kv-offloading-size; the note says each rank's share."""
    plan = make_plan(req("llama-3-70b", tp=8, cpu_tier_bytes=1600 * GIB,
                         vllm_version=(0, 21, 0)))
    config = json.loads(plan.kvtier_flags[plan.kvtier_flags.index("--kv-transfer-config") + 1])
    memory = config["kv_connector_extra_config"]["tiers"][0]
    assert memory == {"kind": "memory", "capacity": "1600GiB"}
    [note] = [n for n in plan.notes if "per engine" in n]
    assert "8 TP ranks" in note and "each rank's CPU tier 200 GiB" in note
    assert not any("per engine" in n for n in make_plan(req("llama-3-8b")).notes)
