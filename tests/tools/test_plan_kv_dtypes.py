"""`kvtier plan` sizes vLLM 0.33's packed KV cache dtypes as vLLM lays them out (kvdtypes.py,
each slot size hand-checked against the vLLM file it cites) and refuses by name the ones a plan
cannot size. Before, every one of them was "kv_dtype: one of auto, bf16, ..."."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvtier.errors import ConfigError
from kvtier.tools.ops.hardware import gpu_profile
from kvtier.tools.ops.kvdtypes import layer_token_bytes
from kvtier.tools.ops.modelspec import kv_footprint, load_model_spec
from kvtier.tools.ops.sizing import PlanRequest, make_plan

CONFIGS = Path(__file__).parents[1] / "data" / "configs"

# Llama-3-8B: 32 layers, 8 KV heads of 128. Per (token, KV head) slot, K and V together:
SLOT_BYTES = {
    "bf16": 2 * 128 * 2,
    "fp8": 2 * 128,
    "int8_per_token_head": 2 * 128 + 2 * 4,  # int8 data + one fp32 scale per side
    "fp8_per_token_head": 2 * 128 + 2 * 4,
    "int4_per_token_head": 128 + 2 * 4,  # two values a byte
    "nvfp4": 2 * (64 + 8),  # per side: fp4 data + one fp8 scale per 16 elements
    "nvfp4_4over6": 2 * (64 + 8),
    "turboquant_k8v4": 128 + (64 + 4),  # fp8 keys; 4-bit values + fp16 scale and zero
    "turboquant_4bit_nc": (64 + 2) + (64 + 4),  # 4-bit keys + fp16 norm
    "turboquant_k3v4_nc": (48 + 2) + (64 + 4),
    "turboquant_3bit_nc": (48 + 2) + (48 + 4),
}


@pytest.mark.parametrize("dtype", sorted(SLOT_BYTES))
def test_plan_sizes_each_dtype_as_vllm_lays_it_out(dtype: str) -> None:
    spec = load_model_spec(CONFIGS / "llama-3-8b.json")
    assert kv_footprint(spec, dtype).bytes_per_token == 32 * 8 * SLOT_BYTES[dtype]
    plan = make_plan(PlanRequest(model=spec, gpu=gpu_profile("h100"), kv_dtype=dtype,
                                 context_tokens=8192, concurrency=8))
    assert plan.kv_bytes_per_token_rank == 32 * 8 * SLOT_BYTES[dtype]


def test_turboquant_slot_is_rounded_up_to_even_bytes() -> None:
    # head 100, 3-bit keys: 38 + 2 (norm), 4-bit values: 50 + 4 -> 94, even already;
    # head 90: 34 + 2 + 45 + 4 = 85 -> 86
    assert layer_token_bytes("turboquant_k3v4_nc", 100, 1) == 94
    assert layer_token_bytes("turboquant_k3v4_nc", 90, 1) == 34 + 2 + 45 + 4 + 1


def test_deepseek_mla_layouts_are_one_blob_per_token_and_layer() -> None:
    spec = load_model_spec(CONFIGS / "deepseek-v3.json")
    layers = spec.count("full") + spec.count("sliding")
    assert kv_footprint(spec, "fp8_ds_mla", tp=8).bytes_per_token == layers * 656
    assert kv_footprint(spec, "nvfp4_ds_mla", tp=8).bytes_per_token == layers * 352
    with pytest.raises(ConfigError, match=r"nvfp4.*MLA"):
        kv_footprint(spec, "nvfp4")
    with pytest.raises(ConfigError, match=r"fp8_ds_mla.*no MLA"):
        kv_footprint(load_model_spec(CONFIGS / "llama-3-8b.json"), "fp8_ds_mla")


@pytest.mark.parametrize("dtype", ["octave_k3v4", "octave_k3v3", "octave_k3v3_compact",
                                   "ultraquant_4bit"])
def test_dtypes_plan_cannot_size_are_refused_by_name_not_guessed(dtype: str) -> None:
    spec = load_model_spec(CONFIGS / "llama-3-8b.json")
    with pytest.raises(ConfigError, match=rf"kv_dtype.*{dtype}.*can size"):
        make_plan(PlanRequest(model=spec, gpu=gpu_profile("h100"), kv_dtype=dtype))


@pytest.mark.parametrize(("dtype", "flag", "fp8_note"), [
    ("bf16", None, False), ("fp8", "fp8", True), ("nvfp4", "nvfp4", False),
    ("int8_per_token_head", "int8_per_token_head", False),
    ("fp8_per_token_head", "fp8_per_token_head", False),  # scales computed, not calibrated
])
def test_the_printed_command_runs_the_dtype_the_plan_sized(dtype: str, flag: str | None,
                                                         fp8_note: bool) -> None:
    """The commands passed `--kv-cache-dtype` for fp8* only: a plan sized for nvfp4 printed
    a command that runs a 16-bit cache, twice and more the bytes it sized."""
    spec = load_model_spec(CONFIGS / "llama-3-8b.json")
    plan = make_plan(PlanRequest(model=spec, gpu=gpu_profile("h100"), kv_dtype=dtype))
    flags = plan.serve_flags  # every alternative's command has them
    given = flags[flags.index("--kv-cache-dtype") + 1] if "--kv-cache-dtype" in flags else None
    assert given == flag, flags
    assert any(n.startswith("FP8 KV:") for n in plan.notes) == fp8_note


@pytest.mark.parametrize(("dtype", "stores"), [
    ("auto", True), ("fp8_e5m2", True), ("nvfp4", False), ("int8_per_token_head", False),
    ("turboquant_k8v4", False)])
def test_kvtier_is_refused_for_a_cache_its_connector_refuses(dtype: str, stores: bool) -> None:
    """The connector refuses packed layouts at start-up (kvformat.attention_format): the
    plan offered a kvtier command for them that vLLM would not start with."""
    spec = load_model_spec(CONFIGS / "llama-3-8b.json")
    plan = make_plan(PlanRequest(model=spec, gpu=gpu_profile("h100"), kv_dtype=dtype))
    kvtier = plan.alternative("kvtier")
    assert (kvtier.refused is None) == stores, kvtier.refused
    assert stores or (dtype in str(kvtier.refused) and kvtier.command == "")
    assert plan.alternative("native").refused is None
