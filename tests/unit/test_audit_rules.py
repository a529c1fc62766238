"""Every audit rule: one deployment that triggers it, one that does not.

Each case is (rule id, command line, env, vLLM version). The "clean" command line is the
nearest correct variant of the triggering one, so each pair pins the rule's boundary.
"""

from __future__ import annotations

import json

import pytest

from kvtier.ops.audit import AuditOptions, Severity, all_rules, parse_command_line, run_audit
from kvtier.ops.audit.rules_env import installed_vllm_env_names
from kvtier.ops.vllm_versions import installed_vllm_version

V20, V21, V32 = (0, 20, 2), (0, 21, 0), (0, 32, 0)
NATIVE = "--kv-offloading-backend native --kv-offloading-size"
HMA = "--disable-hybrid-kv-cache-manager"
LMC = "--kv-transfer-config '{\"kv_connector\":\"LMCacheConnectorV1\",\"kv_role\":\"kv_both\"}'"
FS_TIER = json.dumps({"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
                      "kv_connector_extra_config": {
                          "spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": 10**10,
                          "secondary_tiers": [{"type": "fs", "root_dir": "/mnt/kv"}]}})
KVTIER_SHARED = json.dumps({"kv_connector": "KVTierConnector",
                            "kv_connector_module_path": "kvtier.integrations.vllm",
                            "kv_role": "kv_both", "kv_connector_extra_config": {
                                "tiers": [{"kind": "shared", "path": "/mnt/kv",
                                           "capacity": "1TiB"}]}})
EAGLE3 = ("--speculative-config "
          "'{\"method\":\"eagle3\",\"model\":\"x\",\"num_speculative_tokens\":3}'")

# rule id -> (triggering case, clean case); a case is (command, env, version, severity).
CASES = {
    "cpu-offload-gb-not-kv": (
        ("vllm serve m --cpu-offload-gb 40", {}, V21, Severity.WARNING),
        (f"vllm serve m {NATIVE} 40", {}, V21, None)),
    "offload-size-per-gpu": (
        (f"vllm serve m -tp 8 {NATIVE} 200", {}, V21, Severity.WARNING),
        (f"vllm serve m -tp 8 {NATIVE} 1600", {}, V21, None)),
    "offload-needs-hma-flag": (
        (f"vllm serve m {NATIVE} 100", {}, V20, Severity.ERROR),
        (f"vllm serve m {NATIVE} 100 {HMA}", {}, V20, None)),
    "hma-flag-unneeded": (
        (f"vllm serve m {NATIVE} 100 {HMA}", {}, V21, Severity.INFO),
        (f"vllm serve m {NATIVE} 100 {HMA}", {}, V20, None)),
    "offload-without-prefix-caching": (
        (f"vllm serve m {NATIVE} 100 --no-enable-prefix-caching", {}, V21, Severity.ERROR),
        (f"vllm serve m {NATIVE} 100 --enable-prefix-caching", {}, V21, None)),
    "shared-storage-hash-seed": (
        (f"vllm serve m --kv-transfer-config '{FS_TIER}'", {}, V21, Severity.ERROR),
        (f"vllm serve m --kv-transfer-config '{FS_TIER}'", {"PYTHONHASHSEED": "0"}, V21, None)),
    "offload-ep-eagle3": (
        (f"vllm serve m {NATIVE} 100 --enable-expert-parallel {EAGLE3}", {}, V21,
         Severity.ERROR),
        (f"vllm serve m {NATIVE} 100 {EAGLE3}", {}, V21, None)),
    "hybrid-spec-decode-prefix-hits": (
        (f"vllm serve google/gemma-4-31b-it {EAGLE3}", {}, V21, Severity.WARNING),
        ("vllm serve google/gemma-4-31b-it", {}, V21, None)),
    "lmcache-size-mismatch": (
        (f"vllm serve m -tp 4 {LMC} --kv-offloading-size 400 {HMA}",
         {"LMCACHE_MAX_LOCAL_CPU_SIZE": "400"}, V21, Severity.ERROR),
        (f"vllm serve m -tp 4 {LMC} --kv-offloading-size 400 {HMA}",
         {"LMCACHE_MAX_LOCAL_CPU_SIZE": "100"}, V21, None)),
    "lmcache-hybrid-model": (
        (f"vllm serve Qwen/Qwen3.5-35B-A3B {LMC} {HMA}", {}, V21, Severity.ERROR),
        (f"vllm serve Qwen/Qwen3-32B {LMC} {HMA}", {}, V21, None)),
    "lmcache-local-cpu-off": (
        (f"vllm serve m {LMC} {HMA}", {"LMCACHE_LOCAL_CPU": "False"}, V21, Severity.ERROR),
        (f"vllm serve m {LMC} {HMA}", {"LMCACHE_LOCAL_CPU": "True"}, V21, None)),
    "fp8-kv-without-scales": (
        ("vllm serve m --kv-cache-dtype fp8", {}, V21, Severity.WARNING),
        ("vllm serve m --kv-cache-dtype auto", {}, V21, None)),
    "calculate-kv-scales-deprecated": (
        ("vllm serve m --kv-cache-dtype fp8 --calculate-kv-scales", {}, V32, Severity.ERROR),
        ("vllm serve m --kv-cache-dtype fp8", {}, V32, None)),
    "enforce-eager-workaround": (
        ("vllm serve meta-llama/Llama-3.1-8B --enforce-eager", {}, V21, Severity.WARNING),
        ("vllm serve meta-llama/Llama-3.1-8B", {}, V21, None)),
    "max-model-len-too-high": (
        ("vllm serve m --max-model-len 200000", {}, V21, Severity.WARNING),
        ("vllm serve m --max-model-len 12000", {}, V21, None)),
    "block-size-long-context": (
        ("vllm serve m --max-model-len 200000", {}, V21, Severity.INFO),
        ("vllm serve m --max-model-len 200000 --block-size 32", {}, V21, None)),
    "no-max-num-batched-tokens": (
        ("vllm serve m --max-model-len 65536", {}, V21, Severity.WARNING),
        ("vllm serve m --max-model-len 65536 --max-num-batched-tokens 8192", {}, V21, None)),
    "nonexistent-env-var": (
        ("vllm serve m", {"VLLM_USE_FASTSAFETENSOR": "1"}, V21, Severity.WARNING),
        ("vllm serve m --load-format fastsafetensors", {"HF_HUB_ENABLE_HF_TRANSFER": "1"},
         V21, None)),
    "flag-predates-version": (
        (f"vllm serve m {NATIVE} 100", {}, (0, 11, 0), Severity.ERROR),
        (f"vllm serve m {NATIVE} 100", {}, (0, 11, 1), None)),
    "lmcache-not-bundled": (
        (f"vllm serve m {LMC}", {}, (0, 12, 0), Severity.WARNING),
        (f"vllm serve m {LMC} {HMA}", {}, (0, 14, 0), None)),
    "version-unknown": (
        (f"vllm serve m {NATIVE} 100", {}, None, Severity.INFO),
        (f"vllm serve m {NATIVE} 100", {}, V21, None)),
    "kvtier-shared-block-size": (
        (f"vllm serve m --kv-transfer-config '{KVTIER_SHARED}'", {}, V21, Severity.INFO),
        (f"vllm serve m --block-size 16 --kv-transfer-config '{KVTIER_SHARED}'", {}, V21,
         None)),
    "cpu-connector-reserves-core": (
        (f"vllm serve m --kv-transfer-config '{KVTIER_SHARED}'", {"VLLM_CPU_KVCACHE_SPACE": "8"},
         V21, Severity.WARNING),
        (f"vllm serve m --kv-transfer-config '{KVTIER_SHARED}'",
         {"VLLM_CPU_KVCACHE_SPACE": "8", "VLLM_CPU_NUM_OF_RESERVED_CPU": "1"}, V21, None)),
}
OPTS = AuditOptions(typical_context_tokens=10_000)


def findings_of(rule_id, case):
    command, env, version, _ = case
    cmd = parse_command_line(command, env=env, vllm_version=version)
    return [f for f in run_audit(cmd, OPTS) if f.rule == rule_id]


def test_every_rule_has_cases():
    assert {r.id for r in all_rules()} == set(CASES)


@pytest.mark.parametrize("rule_id", sorted(CASES))
def test_rule_triggers(rule_id):
    case = CASES[rule_id][0]
    found = findings_of(rule_id, case)
    assert found, f"{rule_id} did not fire on {case[0]!r}"
    assert found[0].severity is case[3]
    assert found[0].what and found[0].why and found[0].fix


@pytest.mark.parametrize("rule_id", sorted(CASES))
def test_rule_stays_quiet(rule_id):
    assert findings_of(rule_id, CASES[rule_id][1]) == []


def test_hma_flag_unknown_version_is_a_warning_not_an_error():
    found = findings_of("offload-needs-hma-flag", (f"vllm serve m {NATIVE} 100", {}, None, None))
    assert [f.severity for f in found] == [Severity.WARNING]


def test_native_offload_on_hybrid_model_at_v21_needs_no_flag():
    found = findings_of("offload-needs-hma-flag",
                        (f"vllm serve Qwen/Qwen3.5-35B-A3B {NATIVE} 100", {}, V21, None))
    assert found == []


def test_kvtier_shared_tier_does_not_need_hash_seed():
    # kvtier's chunk keys are blake3 over token ids, independent of PYTHONHASHSEED.
    assert findings_of("shared-storage-hash-seed",
                       (f"vllm serve m --kv-transfer-config '{KVTIER_SHARED}'", {}, V21,
                        None)) == []


def test_lmcache_with_tp_needs_hash_seed():
    found = findings_of("shared-storage-hash-seed", (f"vllm serve m -tp 2 {LMC}", {}, V21, None))
    assert found and "TP=2" in found[0].what


def test_hybrid_model_from_config_json_beats_name_guess():
    gemma_like = {"hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 4,
                  "sliding_window": 16, "sliding_window_pattern": 2}
    cmd = parse_command_line(f"vllm serve /models/custom {LMC} {HMA}", vllm_version=V21,
                             model_config=gemma_like)
    assert any(f.rule == "lmcache-hybrid-model" and "config.json" in f.what
               for f in run_audit(cmd))


def test_fp8_with_kv_scales_in_checkpoint_is_fine():
    config = {"hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 2,
              "quantization_config": {"quant_method": "compressed-tensors",
                                      "kv_cache_scheme": {"num_bits": 8, "type": "float"}}}
    cmd = parse_command_line("vllm serve m --kv-cache-dtype fp8", model_config=config)
    assert not [f for f in run_audit(cmd) if f.rule == "fp8-kv-without-scales"]


@pytest.mark.skipif(installed_vllm_env_names() is None, reason="needs vLLM installed")
def test_env_var_unknown_to_installed_vllm():
    installed = installed_vllm_version()
    cmd = parse_command_line("vllm serve m", env={"VLLM_MADE_UP_KNOB": "1",
                                                  "VLLM_HOST_IP": "10.0.0.1"},
                             vllm_version=installed)
    names = [f.what.split()[0] for f in run_audit(cmd) if f.rule == "nonexistent-env-var"]
    assert names == ["VLLM_MADE_UP_KNOB"]
    # Auditing a different release: the installed envs.py is not evidence.
    other = parse_command_line("vllm serve m", env={"VLLM_MADE_UP_KNOB": "1"},
                               vllm_version=(0, 9, 0))
    assert not [f for f in run_audit(other) if f.rule == "nonexistent-env-var"]


def test_findings_sorted_most_severe_first():
    cmd = parse_command_line(f"vllm serve m --enforce-eager {NATIVE} 100 "
                             "--no-enable-prefix-caching --max-model-len 200000",
                             vllm_version=V20)
    severities = [f.severity for f in run_audit(cmd)]
    assert severities == sorted(severities, reverse=True)
    assert severities[0] is Severity.ERROR


def test_kvtier_without_a_shared_tier_needs_no_common_block_size():
    private = json.dumps({"kv_connector": "KVTierConnector", "kv_role": "kv_both",
                          "kv_connector_module_path": "kvtier.integrations.vllm",
                          "kv_connector_extra_config": {"tiers": [
                              {"kind": "memory", "capacity": "8GiB"},
                              {"kind": "disk", "path": "/nvme/kv", "capacity": "1TiB"}]}})
    assert findings_of("kvtier-shared-block-size",
                       (f"vllm serve m --kv-transfer-config '{private}'", {}, V21, None)) == []
