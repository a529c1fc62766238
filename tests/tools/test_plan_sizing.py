"""The plan math against hand-checked cases and the seeds' worked examples."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest

from kvtier.errors import ConfigError
from kvtier.integrations.vllm.config import kvtier_transfer_config
from kvtier.tools.ops.flags import lmcache_env, native_offload_flags, sglang_per_rank_to_vllm_total
from kvtier.tools.ops.hardware import gpu_profile
from kvtier.tools.ops.modelspec import kv_footprint, load_model_spec
from kvtier.tools.ops.sizing import Plan, PlanRequest, make_plan

CONFIGS = Path(__file__).parents[1] / "data" / "configs"
GIB = 1024**3


def req(model: str, **kw) -> PlanRequest:
    kw.setdefault("gpu", gpu_profile("h100"))
    return PlanRequest(model=load_model_spec(CONFIGS / f"{model}.json"), **kw)


def flag(plan: Plan, alternative: str, name: str) -> str:
    """The value of flag `name` in an alternative's own flags."""
    flags = plan.alternative(alternative).flags
    return flags[flags.index(name) + 1]


def test_sglang_per_rank_200gb_on_8_gpus_is_1600_on_vllm():
    # Operator's guide: "200 GB per GPU x 8 GPUs = 1600 GB, use --kv-offloading-size 1600".
    assert sglang_per_rank_to_vllm_total(200, 8) == 1600
    plan = make_plan(req("llama-3-70b", tp=8, cpu_tier_bytes=1600 * GIB,
                         vllm_version=(0, 21, 0)))
    assert plan.cpu_offload_gib == 1600
    assert flag(plan, "native", "--kv-offloading-size") == "1600"
    # LMCache allocates per rank: 1600 / 8 = 200 per worker keeps the same total.
    assert plan.alternative("lmcache").env["LMCACHE_MAX_LOCAL_CPU_SIZE"] == "200"
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
    assert "--disable-hybrid-kv-cache-manager" in old.alternative("native").flags
    assert "--disable-hybrid-kv-cache-manager" not in new.alternative("native").flags
    # LMCache needs it on every version.
    assert "--disable-hybrid-kv-cache-manager" in new.alternative("lmcache").flags


def test_sliding_window_model_loses_capacity_when_hma_must_be_off():
    on = make_plan(req("gemma-3-27b", context_tokens=32768, vllm_version=(0, 21, 0)))
    off = make_plan(req("gemma-3-27b", context_tokens=32768, vllm_version=(0, 20, 0)))
    assert on.hybrid_manager and not off.hybrid_manager
    assert on.live_sessions > 3 * off.live_sessions
    assert "LMCache cannot serve" in (on.alternative("lmcache").refused or "")


def test_weights_not_fitting_are_refused_and_a_tiny_host_noted():
    # No command can serve it: none is printed (a note beside four commands, rc 0, before).
    with pytest.raises(ConfigError, match=r"hbm=.*raise --tp or use a larger GPU"):
        make_plan(req("llama-3-70b", gpu=gpu_profile("l40s"), tp=1))
    small = make_plan(req("llama-3-8b", host_ram_bytes=32 * GIB))
    assert any("mirror HBM" in n for n in small.notes)


@pytest.mark.parametrize("args, said", [
    (["--host-ram", "0"], "--host-ram='0': a size of at least 1GiB"),  # was: 256 GiB assumed
    # A unit left out: 64 B of RAM were planned (a CPU tier of 38 B, --kv-offloading-size 0),
    # and --hbm 94 was refused as "hbm='0 GiB'", not as the 94 typed.
    (["--host-ram", "64"], "--host-ram='64': a size of at least 1GiB, e.g. 512GiB (a bare "
                           "number is bytes)"),
    (["--hbm", "94"], "--hbm='94': a size of at least 1GiB"),
    (["--nvme", "64"], "--nvme='64': a size of at least 1GiB"),  # was: no disk tier, no word
    (["--nvme-path", "rel dir/kv"], "an absolute path"),  # was: file://rel dir/kv/
    (["--params", "1e30"], "--params: '1e30': at most"),  # was: named the GPU's HBM
    (["--hbm", "10GiB"], "raise --tp or use a larger GPU"),  # was: 4 commands and rc 0
])
def test_plan_refuses_input_it_cannot_plan_for(capsys: pytest.CaptureFixture[str],
                                               args: list[str], said: str) -> None:
    from kvtier.tools.cli.main import main

    try:
        code = main(["plan", str(CONFIGS / "llama-3-8b.json"), *args])
    except SystemExit as exc:  # argparse's own refusal of a flag's value
        code = exc.code
    assert code == 2
    err = capsys.readouterr().err
    assert said in err and "vllm serve" not in err


def test_long_context_gets_block_size_and_batch_cap():
    plan = make_plan(req("deepseek-v3", gpu=gpu_profile("h200"), tp=8, context_tokens=131072))
    assert plan.serve_flags[plan.serve_flags.index("--block-size") + 1] == "32"
    assert "--max-num-batched-tokens" in plan.serve_flags
    short = make_plan(req("llama-3-8b", context_tokens=4096))
    assert "--block-size" not in short.serve_flags
    assert "--max-num-batched-tokens" not in short.serve_flags


def test_kvtier_flags_carry_validated_store_config():
    plan = make_plan(req("llama-3-8b", host_ram_bytes=200 * GIB, nvme_bytes=0))
    cfg = flag(plan, "kvtier", "--kv-transfer-config")
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
    config = json.loads(flag(plan, "kvtier", "--kv-transfer-config"))
    memory = config["kv_connector_extra_config"]["tiers"][0]
    assert memory == {"kind": "memory", "capacity": "1600GiB"}
    [note] = [n for n in plan.notes if "per engine" in n]
    assert "8 TP ranks" in note and "each rank's CPU tier 200 GiB" in note
    assert not any("per engine" in n for n in make_plan(req("llama-3-8b")).notes)


def test_every_command_is_complete_and_carries_tp():
    # issue 14: the serve line once lacked --tensor-parallel-size, so a `--tp 8` plan pasted
    # as printed loaded all 131 GiB of a 70B model's weights onto one GPU.
    plan = make_plan(req("llama-3-70b", tp=8, vllm_version=(0, 21, 0),
                         model_ref="meta-llama/Llama-3.1-70B-Instruct"))
    assert [a.name for a in plan.alternatives] == ["none", "native", "kvtier", "lmcache"]
    for alt in plan.alternatives:
        words = shlex.split(alt.command)
        env = [w for w in words[:words.index("vllm")] if "=" in w]
        assert words[len(env):len(env) + 3] == ["vllm", "serve",
                                                "meta-llama/Llama-3.1-70B-Instruct"]
        assert words[words.index("--tensor-parallel-size") + 1] == "8"
        assert words.count("--enable-prefix-caching") == 1
        assert words[words.index("--max-model-len") + 1] == "8192"
    lmcache = shlex.split(plan.alternative("lmcache").command)
    assert "LMCACHE_MAX_LOCAL_CPU_SIZE=153.6" in lmcache  # 60% of 2048 GiB = 1228.8, / 8 ranks


def test_all_sliding_window_model_keeps_its_window_without_the_hybrid_manager():
    # Mistral-7B v0.1: 32 layers, all sliding (window 4096), 8 KV heads x 128, BF16.
    # KV per token = 2 (K, V) x 8 x 128 x 2 B x 32 layers = 131,072 B; the default context
    # is min(32768, 32768) = 32768. vLLM promotes sliding layers to full only next to full
    # layers (_promote_local_kv_cache_specs), so even with the hybrid manager off (v0.20,
    # and kvtier/LMCache on any version) a session keeps 4096 tokens:
    # 4096 x 131,072 = 536,870,912 B = 512 MiB, not 32768 x 131,072 = 4 GiB.
    # HBM for KV: 81559 MiB x 0.9 = 76,968,728,985 B - weights 7,241,465,856 params x 2 B
    # = 14,482,931,712 B - 2 GiB reserve = 60,338,313,625 B; / 512 MiB = 112.4 -> 112
    # sessions (at 4 GiB it would be 14).
    for version in ((0, 20, 0), (0, 21, 0)):
        plan = make_plan(req("mistral-7b-v0.1", vllm_version=version))
        assert plan.context_tokens == 32768
        assert plan.gpu_kv_bytes_per_gpu == 60_338_313_625
        for alt in plan.alternatives:
            assert alt.session_bytes_total == 512 * 1024**2, alt.name
            assert alt.live_sessions == 112, alt.name
        assert plan.alternative("lmcache").refused is None  # one attention kind: not hybrid


def test_hybrid_sliding_model_capacity_follows_each_backend():
    # Gemma 3 27B on v0.21: native offload and kvtier (SupportsHMA) keep the hybrid manager
    # (sliding layers capped at 1024 tokens); with the manager off, the sliding layers would
    # cost the whole context (the old v0.20 native case below).
    plan = make_plan(req("gemma-3-27b", context_tokens=32768, vllm_version=(0, 21, 0)))
    native, kvtier = plan.alternative("native"), plan.alternative("kvtier")
    assert native.hybrid_manager and kvtier.hybrid_manager
    assert kvtier.session_bytes_total == native.session_bytes_total
    assert "--disable-hybrid-kv-cache-manager" not in kvtier.command
    assert not any(n.startswith("kvtier connector") and "whole context" in n
                   for n in plan.notes)
    old = make_plan(req("gemma-3-27b", context_tokens=32768, vllm_version=(0, 20, 0)))
    old_native = old.alternative("native")
    assert not old_native.hybrid_manager
    assert old_native.session_bytes_total > 3 * native.session_bytes_total
    assert any(n.startswith("vLLM native") and "whole context" in n for n in old.notes)
    # LMCache cannot serve it: no command at all, the reason instead.
    lmcache = plan.alternative("lmcache")
    assert lmcache.refused and "LMCache#3106" in lmcache.refused and lmcache.command == ""


def test_linear_attention_hybrid_goes_to_kvtier_or_native_never_lmcache():
    # Qwen3-Next: gated DeltaNet layers beside attention. kvtier serves them in vLLM's align
    # mode, which the plan's --enable-prefix-caching gives (integrations.vllm.models); LMCache
    # cannot (LMCache#3106). Nemotron-H's Mamba2 layers: kvtier refuses them at start-up.
    plan = make_plan(req("qwen3-next-80b-a3b", tp=4, vllm_version=(0, 21, 0)))
    kvtier = plan.alternative("kvtier")
    assert kvtier.refused is None and "--enable-prefix-caching" in kvtier.command
    assert plan.alternative("lmcache").command == ""
    mamba = make_plan(req("nemotron-h-8b", vllm_version=(0, 21, 0))).alternative("kvtier")
    assert mamba.refused and "kvtier refuses this model" in mamba.refused
    native = plan.alternative("native")
    assert native.refused is None and native.hybrid_manager
    assert "--disable-hybrid-kv-cache-manager" not in native.command
    # Before v0.21 native offload needs the manager off, which such a model cannot run with.
    old = make_plan(req("qwen3-next-80b-a3b", tp=4, vllm_version=(0, 20, 0)))
    assert old.alternative("native").refused
    assert [a.name for a in old.alternatives if a.refused is None] == ["none", "kvtier"]


def test_cpu_tier_is_capped_by_host_ram_and_flagged():
    # issue 14: SGLang's 300 GB per rank x 8 = 2400 GiB was advised on a 2048 GiB host.
    plan = make_plan(req("llama-3-70b", tp=8, host_ram_bytes=2048 * GIB,
                         cpu_tier_bytes=2400 * GIB, vllm_version=(0, 21, 0)))
    assert plan.host_ram_exceeded and plan.cpu_tier_wanted_bytes == 2400 * GIB
    assert plan.cpu_tier_bytes == int(2048 * GIB * 0.8)  # 1638.4 GiB
    assert flag(plan, "native", "--kv-offloading-size") == "1638.4"
    assert any("more than the host can give" in n for n in plan.notes)
    assert not make_plan(req("llama-3-70b", tp=8, host_ram_bytes=2048 * GIB,
                             cpu_tier_bytes=1600 * GIB)).host_ram_exceeded


@pytest.mark.parametrize("tp", [3, 5, 6, 64])
def test_tp_that_cannot_split_the_heads_is_an_error(tp):
    # Llama-3-8B: 32 query heads, 8 KV heads. vLLM needs heads % tp == 0 and either
    # kv % tp == 0 or (tp > kv) tp % kv == 0.
    with pytest.raises(ConfigError, match="1, 2, 4, 8, 16, 32"):
        make_plan(req("llama-3-8b", tp=tp))


def test_tp_beyond_kv_heads_replicates_and_mla_ignores_kv_heads():
    assert make_plan(req("llama-3-8b", tp=16)).kv_bytes_per_token_rank == 32 * 2 * 128 * 2
    make_plan(req("deepseek-v3", gpu=gpu_profile("h200"), tp=8))  # 128 heads, MLA


def test_cpu_tier_is_not_rounded_down_to_whole_gib():
    # issue 14: 6 GB (5.588 GiB) once became 5 GiB, 10.5% fewer tokens. Now 5.58 GiB: -0.14%.
    plan = make_plan(req("qwen3-4b", cpu_tier_bytes=6 * 10**9, nvme_bytes=0,
                         vllm_version=(0, 21, 0)))
    size = float(flag(plan, "native", "--kv-offloading-size"))
    assert size == 5.58 and 1 - size * GIB / (6 * 10**9) < 0.01
    cfg = json.loads(flag(plan, "kvtier", "--kv-transfer-config"))
    assert cfg["kv_connector_extra_config"]["tiers"] == [{"kind": "memory",
                                                          "capacity": "5.58GiB"}]
    assert plan.alternative("lmcache").env["LMCACHE_MAX_LOCAL_CPU_SIZE"] == "5.58"


def test_defaults_are_stated_as_assumptions():
    plan = make_plan(req("llama-3-8b"))
    text = " ".join(plan.assumptions)
    assert "estimated from config.json" in text and "pass --params" in text
    assert "4 TB NVMe" in text and "90%" in text and "--host-ram" in text
    given = PlanRequest(model=load_model_spec(CONFIGS / "llama-3-8b.json", 8_030_000_000),
                        gpu=gpu_profile("h100"), nvme_bytes=2 * 10**12,
                        host_ram_bytes=512 * GIB, context_tokens=8192, pcie_gen=5)
    assert make_plan(given).assumptions == ()


def test_unknown_version_never_disables_the_manager_a_linear_hybrid_needs():
    # Without the hybrid manager vLLM cannot serve Mamba/linear layers: with the version
    # unknown, native offload's command is v0.21.0+'s, and says so.
    plan = make_plan(req("qwen3-next-80b-a3b", tp=4))
    native = plan.alternative("native")
    assert native.refused is None and "--disable-hybrid-kv-cache-manager" not in native.command
    assert "v0.21.0" in native.hma_reason
    assert not any("vLLM version unknown" in n for n in plan.notes)
    assert any("vLLM version unknown" in n for n in make_plan(req("llama-3-8b")).notes)
