"""Issue 23: the audit knows vLLM 0.33 on CUDA: the attention kernels' block sizes, the
block-outermost layouts that refuse a split, the traffic's context lengths, and 0.33's
defaults (async scheduling, the V2 model runner)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvtier.tools.ops.attention_kernels import CUDA_BACKENDS, choose_backend, long_context_block
from kvtier.tools.ops.audit import AuditOptions, Severity, parse_command_line, run_audit
from kvtier.tools.ops.hardware import gpu_profile
from kvtier.tools.ops.vllm_versions import defaults_for

V32, V33 = (0, 32, 0), (0, 33, 0)
CONFIGS = Path(__file__).parents[1] / "data" / "configs"
FI = "--attention-backend FLASHINFER"
DEEPSEEK = "vllm serve deepseek-ai/DeepSeek-V3 --kv-cache-dtype fp8"


def findings(command, env=None, version=V33, options=None, model_config=None):
    cmd = parse_command_line(command, env=env or {}, vllm_version=version,
                             model_config=model_config)
    return run_audit(cmd, options or AuditOptions(typical_context_tokens=8192))


def of(rule_id, *args, **kwargs):
    return [f for f in findings(*args, **kwargs) if f.rule == rule_id]


# --- the table (vllm/v1/attention/backends/*.py, vllm/v1/worker/utils.py) ---

@pytest.mark.parametrize("backend, block, kernel", [
    ("FLASHINFER", 128, 64),  # outside SM100: 16/32/64, the largest that divides
    ("FLASHINFER", 96, 32),
    ("FLASHINFER", 48, 16),  # taken (48 % 16 == 0), split in three
    ("FLASHINFER", 64, 64),
    ("FLASHINFER", 24, None),  # no size divides it: the backend is ruled out
    ("FLASH_ATTN", 1024, 1024),  # any multiple of 16, as it is
    ("FLASH_ATTN", 24, None),
    ("FLASHMLA", 256, 64),
    ("FLASHMLA", 32, None),
    ("CUTLASS_MLA", 256, 128),
])
def test_kernel_block_for_a_block_size(backend, block, kernel):
    assert CUDA_BACKENDS[backend].kernel_block(block) == kernel


def test_default_block_is_16_or_the_smallest_the_kernel_takes():
    assert CUDA_BACKENDS["FLASHINFER"].preferred_block() == 16
    assert CUDA_BACKENDS["FLASHMLA"].preferred_block() == 64
    assert CUDA_BACKENDS["CUTLASS_MLA"].preferred_block() == 128


@pytest.mark.parametrize("sm, mla, kv_dtype, backend", [
    (9, False, "auto", "FLASH_ATTN"),
    (9, False, "fp8", "FLASH_ATTN"),  # FA3 takes FP8 KV on Hopper
    (8, False, "fp8", "FLASHINFER"),  # FA2 does not: FlashInfer is next
    (9, True, "bf16", "FLASH_ATTN_MLA"),
    (9, True, "fp8", "FLASHMLA"),  # FlashAttention MLA takes no FP8 KV
    (8, True, "auto", "TRITON_MLA"),  # FlashMLA and FA MLA are Hopper+ only
])
def test_vllm_backend_order_on_ampere_and_hopper(sm, mla, kv_dtype, backend):
    choice = choose_backend(sm, mla, kv_dtype)
    assert choice is not None and choice.backend is not None
    assert choice.backend.name == backend and choice.splits == 1


def test_a_block_size_the_first_backend_refuses_falls_back():
    choice = choose_backend(9, True, "fp8", 32)
    assert choice.backend.name == "TRITON_MLA" and choice.precluded == ("FLASHMLA",)
    assert long_context_block(9, True, "fp8") == 64
    assert long_context_block(9, False, "auto") == 32


def test_unmodelled_gpus_and_unknown_backends_are_not_guessed():
    assert choose_backend(10, False, "auto", 128) is None  # Blackwell's order differs
    assert choose_backend(9, False, "auto", 128, named="ROCM_ATTN") is None


# --- block-size-kernel-split ---

def test_split_is_information_on_a_layer_compact_layout():
    found = of("block-size-kernel-split", f"vllm serve m {FI} --block-size 128",
               env={"VLLM_KV_CACHE_LAYOUT": "HND"})
    assert [f.severity for f in found] == [Severity.INFO]
    assert "2 kernel blocks of 64 tokens" in found[0].what


@pytest.mark.parametrize("layout", ["BLHNC", "BLNHC", "BHLNC", "blhnc"])
def test_split_with_a_block_outermost_layout_is_an_error_naming_vllms_fix(layout):
    found = of("block-size-kernel-split", f"vllm serve m {FI} --block-size 128",
               env={"VLLM_KV_CACHE_LAYOUT": layout})
    assert [f.severity for f in found] == [Severity.ERROR]
    assert "cannot be split into" in found[0].why
    assert "reduce --block-size to 64" in found[0].fix and "LBNHC" in found[0].fix


def test_no_split_no_finding():
    env = {"VLLM_KV_CACHE_LAYOUT": "BLHNC"}
    assert of("block-size-kernel-split", f"vllm serve m {FI} --block-size 64", env=env) == []
    # FlashAttention, vLLM's choice on an H100, takes any multiple of 16 as it is.
    assert of("block-size-kernel-split", "vllm serve m --block-size 256", env=env) == []
    # Without --block-size vLLM picks a size the kernel takes.
    assert of("block-size-kernel-split", f"vllm serve m {FI}", env=env) == []


def test_backend_named_in_attention_config_or_picked_for_mla():
    cfg = json.dumps({"backend": "flashinfer"})
    assert of("block-size-kernel-split", f"vllm serve m -ac '{cfg}' --block-size 128")
    found = of("block-size-kernel-split", f"{DEEPSEEK} --block-size 128")
    assert found and "FLASHMLA" in found[0].what and "guessed" in found[0].what


def test_kernel_rules_judge_vllm_033_on_cuda_only():
    assert of("block-size-kernel-split", f"vllm serve m {FI} --block-size 128",
              version=V32) == []
    cpu = AuditOptions(gpu=gpu_profile("cpu"))
    assert of("block-size-kernel-split", f"vllm serve m {FI} --block-size 128",
              options=cpu) == []


# --- block-size-no-kernel ---

def test_block_size_ruling_out_flashmla_is_a_warning():
    found = of("block-size-no-kernel", f"{DEEPSEEK} --block-size 32")
    assert [f.severity for f in found] == [Severity.WARNING]
    assert "FLASHMLA" in found[0].what and "TRITON_MLA" in found[0].what
    assert of("block-size-no-kernel", f"{DEEPSEEK} --block-size 64") == []


def test_named_backend_that_refuses_the_block_size_is_an_error():
    found = of("block-size-no-kernel", f"vllm serve m {FI} --block-size 40")
    assert [f.severity for f in found] == [Severity.ERROR]
    assert "16/32/64" in found[0].what


# --- max-model-len-traffic-unknown (seed 000) ---

def test_long_model_maximum_without_the_traffic_asks_for_its_p95_p99():
    config = json.loads((CONFIGS / "deepseek-v3.json").read_text())
    found = of("max-model-len-traffic-unknown", "vllm serve /models/ds", options=AuditOptions(),
               model_config=config)
    assert [f.severity for f in found] == [Severity.INFO]
    assert "163840" in found[0].what and "model's maximum" in found[0].what
    assert "p95-p99" in found[0].fix and "--typical-context" in found[0].fix


def test_given_traffic_hands_over_to_max_model_len_too_high():
    command = "vllm serve m --max-model-len 200000"
    assert of("max-model-len-traffic-unknown", command) == []
    assert of("max-model-len-too-high", command)


# --- vLLM 0.33 defaults ---

def test_033_defaults_are_known_from_033_on():
    assert [d.setting for d in defaults_for(V33)] == ["async scheduling", "V2 model runner"]
    assert all(d.default == "on" for d in defaults_for((0, 34, 1)))
    assert defaults_for(V32) == () and defaults_for(None) == ()


def test_kvtier_line_on_033_with_its_defaults_stated_draws_no_finding_about_them():
    kvtier = json.dumps({"kv_connector": "KVTierConnector", "kv_role": "kv_both",
                         "kv_connector_module_path": "kvtier.integrations.vllm",
                         "kv_connector_extra_config": {
                             "tiers": [{"kind": "memory", "capacity": "8GiB"}]}})
    for flag in ("--async-scheduling", "--no-async-scheduling"):
        cmd = parse_command_line(f"vllm serve {flag} m --kv-transfer-config '{kvtier}'",
                                 env={"VLLM_USE_V2_MODEL_RUNNER": "1"}, vllm_version=V33)
        assert cmd.model == "m"  # a boolean flag: it does not take the model as its value
        text = " ".join(f"{f.what} {f.why}" for f in run_audit(cmd)).lower()
        assert "async" not in text and "v2_model_runner" not in text


# --- packed KV dtypes: each runs on the backends that declare it, not on FP8's ---

@pytest.mark.parametrize("kv_dtype, backend", [
    # vLLM 0.33 `supported_kv_cache_dtypes`: FlashAttention takes auto/fp8/fp8_e4m3 only
    ("int8_per_token_head", "TRITON_ATTN"),  # triton_attn.py, per-token-head scales
    ("fp8_per_token_head", "TRITON_ATTN"),  # "fp8..." but not per-tensor FP8
    ("int4_per_token_head", "TRITON_ATTN"),
    ("nvfp4", "FLASHINFER"),  # flashinfer.py: its FA2 path on SM80/90/120
    ("turboquant_k8v4", "TURBOQUANT"),  # turboquant_attn.py takes only turboquant_*
    ("fp8_e5m2", "FLASHINFER"),  # fa_utils.py: FlashAttention refuses e5m2
])
def test_packed_kv_dtypes_pick_the_backend_that_declares_them(kv_dtype, backend):
    choice = choose_backend(9, False, kv_dtype)
    assert choice is not None and choice.backend is not None
    assert choice.backend.name == backend


def test_a_kv_dtype_no_backend_takes_on_the_gpu_is_refused_not_guessed():
    # nvfp4_4over6 needs SM100's trtllm-gen kernels; FP8 e5m2 has no MLA backend.
    for mla, kv_dtype in ((False, "nvfp4_4over6"), (True, "fp8_e5m2")):
        choice = choose_backend(9, mla, kv_dtype)
        assert choice is not None and choice.backend is None and choice.dtype_refused
    named = choose_backend(9, False, "int8_per_token_head", named="FLASH_ATTN")
    assert named is not None and named.dtype_refused


def test_nvfp4_block_128_is_split_by_flashinfer_not_taken_by_flash_attn():
    # Under FP8's table FLASH_ATTN (any multiple of 16) took 128 as it is: no finding. With
    # NVFP4 vLLM runs FlashInfer (16/32/64): each 128-token block is 2 kernel blocks of 64.
    found = of("block-size-kernel-split",
               "vllm serve meta-llama/Llama-3.1-8B --kv-cache-dtype nvfp4 --block-size 128")
    assert [f.severity for f in found] == [Severity.INFO]
    assert "FLASHINFER" in found[0].what and "2 kernel blocks of 64 tokens" in found[0].what


def test_a_refused_dtype_is_not_called_a_block_size_problem():
    assert of("block-size-no-kernel", "vllm serve meta-llama/Llama-3.1-8B --kv-cache-dtype "
              "nvfp4_4over6 --block-size 32") == []
