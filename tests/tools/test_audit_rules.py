"""Every audit rule: one deployment that triggers it, one that does not.

Each case is (rule id, command line, env, vLLM version). The "clean" command line is the
nearest correct variant of the triggering one, so each pair pins the rule's boundary.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvtier.tools.ops.audit import (
    AuditOptions,
    Finding,
    Severity,
    all_rules,
    parse_command_line,
    parse_kubernetes,
    run_audit,
)
from kvtier.tools.ops.audit.rules_env import installed_vllm_env_names
from kvtier.tools.ops.hardware import gpu_profile
from kvtier.tools.ops.vllm_versions import installed_vllm_version

V20, V21, V32, V33 = (0, 20, 2), (0, 21, 0), (0, 32, 0), (0, 33, 0)
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
KVTIER_MODULE = "kvtier.integrations.vllm"


def transfer(connector="OffloadingConnector", **extra):
    """A `--kv-transfer-config '...'` flag for `connector` with `extra` as its settings."""
    cfg = {"kv_connector": connector, "kv_role": "kv_both", "kv_connector_extra_config": extra}
    if connector == "KVTierConnector":
        cfg["kv_connector_module_path"] = KVTIER_MODULE
    return f"--kv-transfer-config '{json.dumps(cfg)}'"


CPU10 = {"cpu_bytes_to_use": 10**10}
TIERING = {"spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": 10**10}
FS = {"type": "fs", "root_dir": "/mnt/kv"}
MEM_BAD, MEM_OK = {"kind": "memory", "capacity": "-5"}, {"kind": "memory", "capacity": "5GiB"}
EAGLE3 = ("--speculative-config "
          "'{\"method\":\"eagle3\",\"model\":\"x\",\"num_speculative_tokens\":3}'")

# rule id -> (triggering case, clean case); a case is (command, env, version, severity),
# and optionally the AuditOptions (default OPTS).
NO_TRAFFIC = AuditOptions()  # --typical-context not given
CASES = {
    "not-a-vllm-command": (
        ("ls -la /", {}, V32, Severity.ERROR),
        ("vllm serve m", {}, V32, None)),
    "unrecognized-vllm-argument": (
        ("vllm serve m --max-modle-len 8192", {}, V21, Severity.ERROR),
        ("vllm serve m --max_model_len=8192", {}, V21, None)),
    "max-model-len-traffic-unknown": (
        ("vllm serve m --max-model-len 200000", {}, V33, Severity.INFO, NO_TRAFFIC),
        ("vllm serve m --max-model-len 65536", {}, V33, None, NO_TRAFFIC)),
    "block-size-kernel-split": (
        ("vllm serve m --attention-backend FLASHINFER --block-size 128", {}, V33, Severity.INFO),
        ("vllm serve m --attention-backend FLASHINFER --block-size 64", {}, V33, None)),
    "block-size-no-kernel": (
        ("vllm serve m --block-size 8", {}, V33, Severity.ERROR),
        ("vllm serve m --block-size 32", {}, V33, None)),
    "cpu-offload-gb-not-kv": (
        ("vllm serve m --cpu-offload-gb 40", {}, V21, Severity.WARNING),
        (f"vllm serve m {NATIVE} 40", {}, V21, None)),
    # vLLM turns offload on only with a size: the backend alone silently does nothing
    "offload-backend-without-size": (
        ("vllm serve m --kv-offloading-backend native", {}, V33, Severity.WARNING),
        (f"vllm serve m {NATIVE} 40", {}, V33, None)),
    # from v0.24 the lmcache backend is LMCache's MP server: the size is not passed on
    "lmcache-backend-is-mp": (
        ("vllm serve m --kv-offloading-backend lmcache --kv-offloading-size 100", {}, V33,
         Severity.WARNING),
        ("vllm serve m --kv-offloading-backend lmcache --kv-offloading-size 100", {}, V21,
         None)),
    "offload-size-per-gpu": (
        (f"vllm serve m -tp 8 {NATIVE} 200", {}, V21, Severity.WARNING),
        (f"vllm serve m -tp 8 {NATIVE} 1600", {}, V21, None)),
    # vLLM overwrites kv_connector with its offload backend's: kvtier was never loaded
    "offload-size-replaces-connector": (
        (f"vllm serve m {NATIVE} 100 {transfer('KVTierConnector')}", {}, V32, Severity.ERROR),
        (f"vllm serve m {NATIVE} 100 {transfer('OffloadingConnector', **CPU10)}", {}, V32,
         None)),
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
        (f"vllm serve m -dp 2 --kv-transfer-config '{FS_TIER}'", {}, V21, Severity.ERROR),
        (f"vllm serve m -dp 2 --kv-transfer-config '{FS_TIER}'", {"PYTHONHASHSEED": "0"}, V21,
         None)),
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
        ("vllm serve m --max-model-len 65536 --no-enable-chunked-prefill", {}, V21,
         Severity.WARNING),
        (("vllm serve m --max-model-len 65536 --no-enable-chunked-prefill "
          "--max-num-batched-tokens 8192"), {}, V21, None)),
    "malformed-flag-value": (
        ("vllm serve m --tensor-parallel-size 0", {}, V21, Severity.ERROR),
        ("vllm serve m --tensor-parallel-size 2", {}, V21, None)),
    "malformed-kv-transfer-config": (
        ("vllm serve m --kv-transfer-config '{\"kv_connector\":\"OffloadingConnector\"'", {},
         V21, Severity.ERROR),
        # with its kv_role: vLLM refuses a connector without one ("Please specify kv_role")
        ("vllm serve m --kv-transfer-config "
         "'{\"kv_connector\":\"OffloadingConnector\",\"kv_role\":\"kv_both\"}'", {}, V21, None)),
    "unknown-kv-connector": (
        (f"vllm serve m {transfer('OfloadingConnector', **CPU10)}", {}, V21, Severity.ERROR),
        (f"vllm serve m {transfer('OffloadingConnector', **CPU10)}", {}, V21, None)),
    "kvtier-connector-config": (
        (f"vllm serve m {transfer('KVTierConnector', tiers=[MEM_BAD])}", {}, V21,
         Severity.ERROR),
        (f"vllm serve m {transfer('KVTierConnector', tiers=[MEM_OK])}", {}, V21, None)),
    "kvtier-unsupported-model": (
        (f"vllm serve nvidia/Nemotron-H-8B-Base-8K {transfer('KVTierConnector')}", {}, V21,
         Severity.WARNING),
        (f"vllm serve Qwen/Qwen3-Next-80B-A3B {transfer('KVTierConnector')}", {}, V21, None)),
    "state-model-without-hma": (
        (f"vllm serve Qwen/Qwen3.5-35B-A3B {NATIVE} 100 {HMA}", {}, V20, Severity.WARNING),
        (f"vllm serve Qwen/Qwen3.5-35B-A3B {NATIVE} 100", {}, V21, None)),
    "kvtier-state-cache-mode": (
        (f"vllm serve LiquidAI/LFM2-1.2B --no-enable-prefix-caching "
         f"{transfer('KVTierConnector')}", {}, V32, Severity.WARNING),
        (f"vllm serve LiquidAI/LFM2-1.2B {transfer('KVTierConnector')}", {}, V32, None)),
    "offload-cpu-bytes-required": (
        (f"vllm serve m {transfer(num_cpu_blocks=8192)}", {}, V21, Severity.ERROR),
        (f"vllm serve m {transfer(**CPU10)}", {}, V21, None)),
    "offload-block-size-multiple": (
        (f"vllm serve m --block-size 16 {transfer(block_size=24, **CPU10)}", {}, V21,
         Severity.ERROR),
        (f"vllm serve m --block-size 16 {transfer(block_size=64, **CPU10)}", {}, V21, None)),
    "offload-tiering-store-threshold": (
        (f"vllm serve m {transfer(store_threshold=2, secondary_tiers=[FS], **TIERING)}", {},
         V21, Severity.ERROR),
        (f"vllm serve m {transfer(store_threshold=2, **CPU10)}", {}, V21, None)),
    "offload-tiering-kv-events": (
        (f"vllm serve m {transfer(self_describing_kv_events=True, **TIERING)}", {}, V21,
         Severity.ERROR),
        (f"vllm serve m {transfer(self_describing_kv_events=True, **CPU10)}", {}, V21, None)),
    "offload-secondary-tiers": (
        (f"vllm serve m {transfer(secondary_tiers=[{'type': 'fs'}], **TIERING)}", {}, V21,
         Severity.ERROR),
        (f"vllm serve m {transfer(secondary_tiers=[FS], **TIERING)}", {}, V21, None)),
    "offload-fs-tier-unbounded": (
        (f"vllm serve m {transfer(secondary_tiers=[FS], **TIERING)}", {}, V33,
         Severity.WARNING),
        (f"vllm serve m {transfer(**TIERING)}", {}, V33, None)),
    "offload-config-values": (
        (f"vllm serve m {transfer(eviction_policy='fifo', **CPU10)}", {}, V21, Severity.ERROR),
        (f"vllm serve m {transfer(eviction_policy='arc', **CPU10)}", {}, V21, None)),
    "offload-config-unknown-key": (
        (f"vllm serve m {transfer(evicton_policy='arc', **CPU10)}", {}, V21, Severity.WARNING),
        (f"vllm serve m {transfer(eviction_policy='arc', **CPU10)}", {}, V21, None)),
    "lmcache-unknown-env-var": (
        (f"vllm serve m {LMC} {HMA}", {"LMCACHE_MAX_LOCAL_CPU_SIZ": "20"}, V21,
         Severity.WARNING),
        (f"vllm serve m {LMC} {HMA}", {"LMCACHE_MAX_LOCAL_CPU_SIZE": "20"}, V21, None)),
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
    "native-offload-on-cpu-backend": (
        (f"vllm serve m {transfer('OffloadingConnector', **CPU10)}",
         {"VLLM_CPU_KVCACHE_SPACE": "8"}, V33, Severity.ERROR),
        (f"vllm serve m {transfer('KVTierConnector')}", {"VLLM_CPU_KVCACHE_SPACE": "8"}, V33,
         None)),
    "connector-refuses-sleep-mode": (
        (f"vllm serve m --enable-sleep-mode {transfer('KVTierConnector')}", {}, V33,
         Severity.ERROR),
        (f"vllm serve m {transfer('KVTierConnector')}", {}, V33, None)),
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
    command, env, version = case[:3]
    cmd = parse_command_line(command, env=env, vllm_version=version)
    return [f for f in run_audit(cmd, case[4] if len(case) > 4 else OPTS)
            if f.rule == rule_id]


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


def test_kvtiers_connector_needs_no_hma_flag_whatever_the_version():
    """kvtier's connector supports the hybrid manager on every release it runs on: with no
    --vllm-version the audit told kvtier's users to add the flag (found by trying)."""
    for version in (None, V20, V21, V32):
        found = findings_of("offload-needs-hma-flag",
                            (f"vllm serve m {transfer('KVTierConnector')}", {}, version, None))
        assert found == [], version


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


def severities(rule_id, command, env=None, version=V21, **kwargs):
    cmd = parse_command_line(command, env=env or {}, vllm_version=version, **kwargs)
    return [f.severity for f in run_audit(cmd, OPTS) if f.rule == rule_id]


# --- malformed input (issue 14: these used to audit clean) ---

@pytest.mark.parametrize("raw, words", [
    ("'{\"kv_connector\":\"OffloadingConnector\"'", "truncated JSON"),
    ("\"{'kv_connector': 'OffloadingConnector'}\"", "a Python dict"),
    ("'[1,2]'", "a JSON array"),
    ("null", "JSON null"),
    ("'\"OffloadingConnector\"'", "a JSON string"),
])
def test_malformed_transfer_config_says_what_is_wrong(raw, words):
    cmd = parse_command_line(f"vllm serve m --kv-transfer-config {raw}", vllm_version=V21)
    found = [f for f in run_audit(cmd) if f.rule == "malformed-kv-transfer-config"]
    assert [f.severity for f in found] == [Severity.ERROR]
    assert "--kv-transfer-config" in found[0].what and words in found[0].what


def test_transfer_config_entry_without_connector_or_with_a_list_as_extra():
    bad = json.dumps({"kv_role": "kv_both", "kv_connector_extra_config": [1]})
    found = [f.what for f in run_audit(parse_command_line(
        f"vllm serve m --kv-transfer-config '{bad}'")) if f.rule == "malformed-kv-transfer-config"]
    assert len(found) == 2 and "kv_connector is missing" in found[0]


def test_unknown_connector_in_a_multiconnector_child_and_kvtier_without_module_path():
    multi = json.dumps({"kv_connector": "MultiConnector", "kv_role": "kv_both",
                        "kv_connector_extra_config": {"connectors": [
                            {"kv_connector": "NixlConector", "kv_role": "kv_both"}]}})
    found = [f.what for f in run_audit(parse_command_line(
        f"vllm serve m --kv-transfer-config '{multi}'")) if f.rule == "unknown-kv-connector"]
    assert found == [("--kv-transfer-config.connectors[0].kv_connector 'NixlConector' is not "
                      "a connector vLLM knows (did you mean 'NixlConnector'?)")]
    bare = json.dumps({"kv_connector": "KVTierConnector", "kv_role": "kv_both"})
    # kvtier's plugin registers the name (vllm.general_plugins): a note, not an error.
    assert severities("unknown-kv-connector", f"vllm serve m --kv-transfer-config '{bare}'") == [
        Severity.INFO]
    custom = json.dumps({"kv_connector": "MyConnector", "kv_connector_module_path": "my.mod"})
    assert severities("unknown-kv-connector",
                      f"vllm serve m --kv-transfer-config '{custom}'") == []


@pytest.mark.parametrize("entry, said, severity", [
    ({"kv_connector": "KVTierConnector"}, "kv_role is missing", Severity.ERROR),
    ({"kv_connector": "KVTierConnector", "kv_role": "both"}, "'both', not one of",
     Severity.ERROR),
    ({"kv_connector": "KVTierConnector", "kv_role": "kv_both", "kv_conector_extra_config": {}},
     "did you mean 'kv_connector_extra_config'", Severity.ERROR),
    ({"kv_connector": "KVTierConnector", "kv_role": "kv_both", "buffer": 1},
     "buffer is not a key of vLLM's KVTransferConfig", Severity.WARNING),  # on 0.32: error
])
def test_kv_transfer_config_keys_and_role_as_vllm_validates_them(entry, said, severity):
    """vLLM's KVTransferConfig refuses an unknown key and a connector without a kv_role, or
    with another role than its three, at start-up: the audit passed them (a misspelt
    kv_connector_extra_config left kvtier's settings out of every check)."""
    cfg = json.dumps({**entry, "kv_connector_module_path": KVTIER_MODULE})
    cmd = parse_command_line(f"vllm serve m --kv-transfer-config '{cfg}'")
    found = [f for f in run_audit(cmd) if f.rule == "malformed-kv-transfer-config"]
    assert [f.severity for f in found] == [severity] and said in found[0].what
    on_table = parse_command_line(f"vllm serve m --kv-transfer-config '{cfg}'",
                                  vllm_version=V32)
    assert [f.severity for f in run_audit(on_table)
            if f.rule == "malformed-kv-transfer-config"] == [Severity.ERROR]


@pytest.mark.parametrize("connector, module, said", [
    ("KVTierConnector", "kvtier.integration.vllm", "'kvtier.integration.vllm' is no module"),
    ("KVTierConector", KVTIER_MODULE, "'KVTierConector' is not in kvtier.integrations.vllm"),
    ("KVTierConnector", "kvtier..vllm", "is no module of kvtier"),
])
def test_a_typo_in_kvtiers_connector_or_module_is_an_error(connector, module, said):
    """vLLM imports the module and takes the class from it at start-up; with a module path
    the audit checked neither (nor kvtier's config, whose connector it no longer saw)."""
    cfg = json.dumps({"kv_connector": connector, "kv_connector_module_path": module,
                      "kv_role": "kv_both"})
    cmd = parse_command_line(f"vllm serve m --kv-transfer-config '{cfg}'")
    found = [f for f in run_audit(cmd) if f.rule == "unknown-kv-connector"]
    assert [f.severity for f in found] == [Severity.ERROR] and said in found[0].what


def test_kvtiers_connector_by_either_module_is_known():
    for module in (KVTIER_MODULE, "kvtier.integrations.vllm.connector"):
        cfg = json.dumps({"kv_connector": "KVTierConnector", "kv_connector_module_path": module,
                          "kv_role": "kv_both"})
        assert severities("unknown-kv-connector",
                          f"vllm serve m --kv-transfer-config '{cfg}'") == []


def test_kvtier_config_checked_by_kvtiers_own_schema():
    cmd = parse_command_line(f"vllm serve m {transfer('KVTierConnector', tokens_per_chunk='x')}")
    found = [f for f in run_audit(cmd) if f.rule == "kvtier-connector-config"]
    assert "tokens_per_chunk" in found[0].what and "'x'" in found[0].what
    # tokens_per_chunk must be a multiple of the GPU block size when that is stated
    assert severities("kvtier-connector-config", "vllm serve m --block-size 48 "
                      f"{transfer('KVTierConnector', tokens_per_chunk=256)}") == [Severity.ERROR]
    assert severities("kvtier-connector-config", "vllm serve m --block-size 64 "
                      f"{transfer('KVTierConnector', tokens_per_chunk=256)}") == []


def test_kvtier_tokens_per_chunk_against_vllms_default_block_on_cuda():
    """Without --block-size a CUDA engine's block is its kernel's default (16): a chunk of
    1,000 tokens is refused at start-up all the same, and the audit passed it."""
    cmd = parse_command_line(f"vllm serve m {transfer('KVTierConnector', tokens_per_chunk=1000)}")
    [found] = [f for f in run_audit(cmd) if f.rule == "kvtier-connector-config"]
    assert "not a multiple of vLLM's default block size on CUDA (16)" in found.what
    assert "e.g. 992 or 1008" in found.fix and "--block-size" in found.fix
    assert severities("kvtier-connector-config",
                      f"vllm serve m {transfer('KVTierConnector', tokens_per_chunk=512)}") == []


def test_kvtier_tokens_per_chunk_against_vllms_default_block_on_the_cpu_backend():
    """The README's config with a tokens_per_chunk of 100, or of 48, on vLLM's CPU backend
    (default block 128) passed the audit and failed at engine start; for an MLA model the
    block depends on the CPU (16 without AMX, whatever --block-size says): a warning."""
    cpu = AuditOptions(gpu=gpu_profile("cpu"))

    def found(model: str, tokens: int, flags: str = "") -> list[Finding]:
        cmd = parse_command_line(f"vllm serve {model} {flags} "
                                 f"{transfer('KVTierConnector', tokens_per_chunk=tokens)}")
        return [f for f in run_audit(cmd, cpu) if f.rule == "kvtier-connector-config"]

    for tokens in (100, 48):
        [finding] = found("m", tokens)
        assert finding.severity is Severity.ERROR
        assert f"tokens_per_chunk = {tokens} is not a multiple of vLLM's default block size " \
               "on the CPU backend (128" in finding.what
    assert found("m", 512) == [] and found("m", 48, "--block-size 16") == []
    [mla] = found("deepseek-ai/DeepSeek-V2-Lite", 256, "--block-size 96")
    assert mla.severity is Severity.WARNING and "depends on the CPU" in mla.why
    assert [f.severity for f in found("deepseek-ai/DeepSeek-V2-Lite", 100)] == [Severity.ERROR]
    assert found("deepseek-ai/DeepSeek-V2-Lite", 256) == []


def test_kvtier_config_in_dotted_words_is_read_as_vllm_builds_it():
    """vLLM 0.32 builds --kv-transfer-config from `--kv-transfer-config.KEY VALUE` words
    (values as JSON, "1k" as 1,000); the audit read only the JSON form and passed them all."""
    dotted = ("vllm serve m --block-size 16 --kv-transfer-config.kv_connector KVTierConnector "
              "--kv_transfer_config.kv_role=kv_both "
              "--kv-transfer-config.kv_connector_extra_config.tokens_per_chunk 100 "
              "--kv-transfer-config.kv_connector_extra_config.index_max_keys 1k")
    cmd = parse_command_line(dotted)
    assert cmd.transfer_config == {"kv_connector": "KVTierConnector", "kv_role": "kv_both",
                                   "kv_connector_extra_config": {"tokens_per_chunk": 100,
                                                                 "index_max_keys": 1000}}
    [found] = [f for f in run_audit(cmd) if f.rule == "kvtier-connector-config"]
    assert "tokens_per_chunk = 100 is not a multiple of --block-size 16" in found.what


def test_json_and_dotted_kv_transfer_config_together_is_an_error():
    """vLLM appends the dotted words' object after the JSON and argparse keeps the last: the
    JSON's connector is dropped, and the server runs without kvtier, silently."""
    both = (f"vllm serve m {transfer('KVTierConnector')} "
            "--kv-transfer-config.kv_connector_extra_config.tokens_per_chunk 512")
    cmd = parse_command_line(both)
    assert cmd.transfer_config == {"kv_connector_extra_config": {"tokens_per_chunk": 512}}
    found = [f.what for f in run_audit(cmd) if f.rule == "malformed-kv-transfer-config"]
    assert any("given as JSON and as --kv-transfer-config.KEY words" in w for w in found)
    assert any("kv_connector is missing" in w for w in found)


def test_kvtier_on_a_mamba_model_from_config_json_is_an_error():
    nemotron_h = {"hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 4,
                  "hybrid_override_pattern": "M*M*"}
    assert severities("kvtier-unsupported-model",
                      f"vllm serve /models/x {transfer('KVTierConnector')}",
                      model_config=nemotron_h) == [Severity.ERROR]


QWEN3_NEXT_CONFIG = json.loads((Path(__file__).parents[1] / "data" / "configs"
                                 / "qwen3-next-80b-a3b.json").read_text())


@pytest.mark.parametrize("model", ["nvidia/Nemotron-H-8B-Base-8K",
                                   "ibm-granite/granite-4.0-h-small",
                                   "tiiuae/Falcon-H1-34B-Instruct", "Zyphra/Zamba2-7B",
                                   "ai21labs/AI21-Jamba-Mini-1.7"])
def test_kvtier_refuses_every_mamba_family_lmcache_too(model):
    found = [f for f in run_audit(parse_command_line(
        f"vllm serve {model} {transfer('KVTierConnector')}", vllm_version=V32))
        if f.rule == "kvtier-unsupported-model"]
    assert [f.severity for f in found] == [Severity.WARNING]
    assert "mamba" in found[0].what and "prefill checkpoint" in found[0].why
    lmcache = [f for f in run_audit(parse_command_line(f"vllm serve {model} {LMC}",
                                                       vllm_version=V32))
               if f.rule == "lmcache-hybrid-model"]
    assert lmcache and "kvtier" not in lmcache[0].fix  # kvtier would refuse it too


@pytest.mark.parametrize("model", ["Qwen/Qwen3-Next-80B-A3B-Instruct", "Qwen/Qwen3.5-35B-A3B",
                                   "LiquidAI/LFM2-1.2B"])
def test_kvtier_serves_gdn_and_short_conv_in_align_mode(model):
    kv = transfer("KVTierConnector")
    assert severities("kvtier-unsupported-model", f"vllm serve {model} {kv}", version=V32) == []
    assert severities("kvtier-state-cache-mode", f"vllm serve {model} {kv}", version=V32) == []
    # vLLM 0.32 turns an explicit "none" into "align" when prefix caching is on
    assert severities("kvtier-state-cache-mode",
                      f"vllm serve {model} --mamba-cache-mode none {kv}", version=V32) == []
    for flags in ("--no-enable-prefix-caching", "--mamba-cache-mode all"):
        assert severities("kvtier-state-cache-mode", f"vllm serve {model} {flags} {kv}",
                          version=V32) == [Severity.WARNING]
    lmcache = [f for f in run_audit(parse_command_line(f"vllm serve {model} {LMC}",
                                                       vllm_version=V32))
               if f.rule == "lmcache-hybrid-model"]
    assert lmcache and "kvtier's connector" in lmcache[0].fix


def test_native_offload_before_v021_on_a_state_model_is_told_to_upgrade():
    # v0.20's native offload needs the manager off, which a state-layer model cannot run with
    found = findings_of("offload-needs-hma-flag",
                        (f"vllm serve Qwen/Qwen3.5-35B-A3B {NATIVE} 100", {}, V20, None))
    assert "do not add the flag" in found[0].fix and "v0.21.0+" in found[0].fix
    assert "add --disable" in findings_of("offload-needs-hma-flag",
                                          (f"vllm serve m {NATIVE} 100", {}, V20, None))[0].fix


def test_state_rules_from_config_json_are_errors():
    kv = transfer("KVTierConnector")
    assert severities("kvtier-state-cache-mode",
                      f"vllm serve /models/x --no-enable-prefix-caching {kv}",
                      model_config=QWEN3_NEXT_CONFIG) == [Severity.ERROR]
    assert severities("kvtier-unsupported-model", f"vllm serve /models/x {kv}",
                      model_config=QWEN3_NEXT_CONFIG) == []


@pytest.mark.parametrize("flags", ["--block-size abc", "-tp 0", "--max-model-len 0",
                                   "--gpu-memory-utilization 1.5", "--kv-offloading-size -5",
                                   "--kv-offloading-backend nativ", "--max-num-seqs"])
def test_malformed_flag_values(flags):
    assert severities("malformed-flag-value", f"vllm serve m {flags}") == [Severity.ERROR]


@pytest.mark.parametrize("flags", ["--max-model-len 32k", "--max-model-len auto",
                                   "--max-num-batched-tokens 8K", "--kv-offloading-size 0"])
def test_flag_values_vllm_accepts(flags):
    assert severities("malformed-flag-value", f"vllm serve m {flags}") == []


# --- OffloadingConnector config keys (seed 003) ---

def test_cpu_bytes_to_use_on_releases_before_it_is_not_required():
    assert severities("offload-cpu-bytes-required", f"vllm serve m {transfer(num_cpu_blocks=8)}",
                      version=(0, 12, 0)) == []
    assert severities("offload-cpu-bytes-required",
                      f"vllm serve m {transfer(cpu_bytes_to_use=0)}") == [Severity.ERROR]


def test_out_of_tree_spec_keeps_its_own_keys():
    llmd = transfer(spec_name="SharedStorageOffloadingSpec",
                    spec_module_path="llmd_fs_backend.spec",
                    shared_storage_path="/mnt/kv-cache/", block_size=256, threads_per_gpu=64)
    findings = run_audit(parse_command_line(f"vllm serve m --block-size 16 {llmd}",
                                            vllm_version=V21))
    assert not [f for f in findings if f.rule.startswith("offload-c")
                or f.rule == "offload-block-size-multiple"]


def test_offload_block_size_against_the_cuda_default_is_an_error():
    # Issue 23: block_size 24 with vLLM's default GPU block size (16 on CUDA) used to be a
    # mere warning; vLLM refuses it at start-up.
    found = findings_of("offload-block-size-multiple",
                        (f"vllm serve m {transfer(block_size=24, **CPU10)}", {}, V33, None))
    assert [f.severity for f in found] == [Severity.ERROR]
    assert "default block size on CUDA (16)" in found[0].what and "e.g. 32" in found[0].fix
    assert findings_of("offload-block-size-multiple",
                       (f"vllm serve m {transfer(block_size=48, **CPU10)}", {}, V33, None)) == []


def test_offload_block_size_against_an_mla_kernels_default_block():
    # DeepSeek with FP8 KV on Hopper: FlashMLA, which takes 64-token blocks only, so vLLM's
    # default block is 64 and an offloaded block of 48 is not a whole number of them.
    case = (f"vllm serve deepseek-ai/DeepSeek-V3 --kv-cache-dtype fp8 "
            f"{transfer(block_size=48, **CPU10)}", {}, V33, None)
    found = findings_of("offload-block-size-multiple", case)
    assert [f.severity for f in found] == [Severity.ERROR]
    assert "(64 for FLASHMLA)" in found[0].what


def test_offload_block_size_off_cuda_stays_a_warning():
    # The CPU backend's default block size differs by release: the audit cannot be sure.
    cpu = AuditOptions(gpu=gpu_profile("cpu"))
    found = findings_of("offload-block-size-multiple",
                        (f"vllm serve m {transfer(block_size=24, **CPU10)}", {}, V33, None, cpu))
    assert [f.severity for f in found] == [Severity.WARNING]


def test_secondary_tier_type_and_key_typos_suggest_the_documented_name():
    tiers = [{"type": "fss", "root_dir": "/x"},
             {"type": "fs", "root_dir": "/x", "n_read_thread": 8}]
    cmd = parse_command_line(f"vllm serve m {transfer(secondary_tiers=tiers, **TIERING)}")
    whats = [f.what for f in run_audit(cmd) if f.rule == "offload-secondary-tiers"]
    assert "did you mean 'fs'" in whats[0] and "did you mean 'n_read_threads'" in whats[1]
    # secondary tiers under the single-tier spec are ignored by vLLM
    assert severities("offload-secondary-tiers",
                      f"vllm serve m {transfer(secondary_tiers=[FS], **CPU10)}") == [
        Severity.WARNING]


def test_lmcache_unknown_name_without_a_near_miss_is_information():
    assert severities("lmcache-unknown-env-var", f"vllm serve m {LMC}",
                      env={"LMCACHE_SOMETHING_ELSE": "1"}) == [Severity.INFO]


# --- the hash seed: an error only where sharing is shown (issue 14) ---

def test_single_instance_with_a_local_fs_tier_is_a_warning_not_an_error():
    assert severities("shared-storage-hash-seed",
                      f"vllm serve m --kv-transfer-config '{FS_TIER}'") == [Severity.WARNING]


def test_lmcache_remote_store_without_hash_seed_is_an_error():
    assert severities("shared-storage-hash-seed", f"vllm serve m {LMC}",
                      env={"LMCACHE_REMOTE_URL": "redis://10.0.0.5:6379"}) == [Severity.ERROR]


def test_lmcache_local_disk_single_instance_is_a_warning():
    assert severities("shared-storage-hash-seed", f"vllm serve m {LMC}",
                      env={"LMCACHE_LOCAL_DISK": "file:///nvme/lmc"}) == [Severity.WARNING]


FS_DEPLOYMENT = """
apiVersion: apps/v1
kind: Deployment
spec:
  replicas: {replicas}
  template:
    spec:
      volumes:
      - name: kv
        {volume}
      containers:
      - name: vllm
        image: vllm/vllm-openai:v0.21.0
        args: ["--model=m", "--kv-transfer-config", '{config}']
        volumeMounts:
        - {{name: kv, mountPath: /mnt}}
"""


@pytest.mark.parametrize("replicas, volume, severity", [
    (1, "hostPath: {path: /nvme}", Severity.WARNING),
    (3, "hostPath: {path: /nvme}", Severity.ERROR),
    (1, "nfs: {server: nas, path: /kv}", Severity.ERROR),
])
def test_manifest_replicas_or_a_network_volume_show_sharing(replicas, volume, severity):
    text = FS_DEPLOYMENT.format(replicas=replicas, volume=volume, config=FS_TIER)
    cmd = parse_kubernetes(text)
    assert [f.severity for f in run_audit(cmd) if f.rule == "shared-storage-hash-seed"] == [
        severity]


# --- vLLM's default step cap (issue 14) ---

@pytest.mark.parametrize("gpu", ["h100", "a100", "l40s"])
def test_long_context_with_chunked_prefill_on_uses_vllms_default_cap(gpu):
    cmd = parse_command_line("vllm serve m --max-model-len 131072", vllm_version=V21)
    assert not [f for f in run_audit(cmd, AuditOptions(gpu=gpu_profile(gpu)))
                if f.rule == "no-max-num-batched-tokens"]


def test_every_needs_and_reads_option_is_an_audit_option():
    options = {"--typical-context", "--model-config", "--gpu", "--vllm-version"}
    for r in all_rules():
        assert set(r.needs) | set(r.reads) <= options, r.id


@pytest.mark.parametrize(("command", "env", "found"), [
    (f"vllm serve m {NATIVE} 8", {"VLLM_CPU_KVCACHE_SPACE": "8"}, True),
    (f"vllm serve m {NATIVE} 8 --kv-offloading-backend lmcache",
     {"VLLM_CPU_KVCACHE_SPACE": "8"}, False),
    (f"vllm serve m {transfer('OffloadingConnector', **TIERING)}",
     {"VLLM_TARGET_DEVICE": "cpu"}, True),
    (f"vllm serve m {NATIVE} 8", {}, False),  # CUDA: served
])
def test_native_offload_on_the_cpu_backend(command, env, found):
    """vLLM's CPUOffloadingSpec (and the Tiering spec built on it) raises on the CPU backend
    (seed 003: CUDA, ROCm and XPU only); the audit passed such a command."""
    cmd = parse_command_line(command, env=env, vllm_version=V33)
    rules = [f.rule for f in run_audit(cmd, OPTS)]
    assert ("native-offload-on-cpu-backend" in rules) is found


@pytest.mark.parametrize(("extra", "version", "warned"), [
    ({**TIERING, "tier_poll_interval_s": 0.01}, V33, False),
    ({**TIERING, "sync_load_budget_bytes": 1 << 20}, V33, False),
    ({**CPU10, "sync_load_budget_bytes": 1 << 20}, None, False),
    ({**CPU10, "tier_poll_interval_s": 0.01}, V33, True),  # the CPU spec does not read it
    ({**TIERING, "tier_poll_interval_s": 0.01}, V32, True),  # 0.32 does not read it
    ({**CPU10, "tier_pol_interval_s": 0.01}, V33, True),  # a typo stays one
])
def test_vllm_033s_offloading_keys_are_known(extra, version, warned):
    """vLLM 0.33 reads `tier_poll_interval_s` (tiering spec) and `sync_load_budget_bytes`:
    the audit called them unknown keys with no effect."""
    cmd = parse_command_line(f"vllm serve m {transfer('OffloadingConnector', **extra)}",
                             vllm_version=version)
    found = [f for f in run_audit(cmd, OPTS) if f.rule == "offload-config-unknown-key"]
    assert bool(found) is warned, [f.what for f in found]


@pytest.mark.parametrize("dtype", ["fp8_per_token_head", "fp8_ds_mla"])
def test_fp8_layouts_with_computed_scales_need_no_checkpoint_scales(dtype):
    """vLLM computes these layouts' scales per token and head (or per MLA blob): the rule,
    which fired on every "fp8*" name, is for per-tensor FP8 only."""
    cmd = parse_command_line(f"vllm serve m --kv-cache-dtype {dtype}")
    assert not [f for f in run_audit(cmd) if f.rule == "fp8-kv-without-scales"]
    cmd = parse_command_line("vllm serve m --kv-cache-dtype fp8_e5m2")
    assert [f for f in run_audit(cmd) if f.rule == "fp8-kv-without-scales"]
