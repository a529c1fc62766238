"""The simulator's cost model agrees with kvtier.tools.ops' math and behaves like a roofline."""

from __future__ import annotations

import pytest

from kvtier.errors import ConfigError
from kvtier.tools.ops.costmodel import prefill_seconds
from kvtier.tools.ops.hardware import gpu_profile
from kvtier.tools.sim.cost import build_cost_model, model_spec


@pytest.fixture(scope="module")
def llama8b_h100():  # type: ignore[no-untyped-def]
    return build_cost_model(model_spec("llama-3.1-8b"), gpu_profile("h100"), 1)


def test_kv_bytes_per_token_of_llama_8b(llama8b_h100) -> None:  # type: ignore[no-untyped-def]
    # 32 layers x 8 KV heads x 128 dims x (K and V) x 2 bytes = 128 KiB.
    assert llama8b_h100.kv_bytes_per_token == 32 * 8 * 128 * 2 * 2


def test_long_prefill_matches_ops_prefill_seconds(llama8b_h100) -> None:  # type: ignore[no-untyped-def]
    n = 8192
    pairs = n * (n + 1) / 2
    step = llama8b_h100.step_s(n, pairs, n) - llama8b_h100.step_overhead_s
    expected = prefill_seconds(model_spec("llama-3.1-8b"), n, gpu_profile("h100"))
    assert step == pytest.approx(expected, rel=0.01)


def test_decode_is_memory_bound_and_grows_with_context(llama8b_h100) -> None:  # type: ignore[no-untyped-def]
    c = llama8b_h100
    one = c.decode_step_s(1, 1000) - c.step_overhead_s
    weights_s = c.weight_bytes_per_rank / c.hbm_bytes_per_s
    assert one == pytest.approx(weights_s, rel=0.02)
    assert c.decode_step_s(64, 64 * 4000) > c.decode_step_s(64, 64 * 1000)


def test_tensor_parallel_splits_work_and_adds_links() -> None:
    spec, gpu = model_spec("llama-3.1-70b"), gpu_profile("h100")
    tp1, tp8 = build_cost_model(spec, gpu, 1), build_cost_model(spec, gpu, 8)
    assert tp8.link_gbps == 8 * tp1.link_gbps
    assert tp8.kv_bytes_per_token == tp1.kv_bytes_per_token  # 8 KV heads over 8 ranks
    assert tp8.step_s(4096, 0, 0) < tp1.step_s(4096, 0, 0) / 6


def test_kv_capacity_and_its_errors(llama8b_h100) -> None:  # type: ignore[no-untyped-def]
    tokens = llama8b_h100.kv_capacity_tokens(0.9)
    # ~80 GiB x 0.9 - 16 GB weights - 2 GiB reserve, at 128 KiB per token.
    assert 420_000 < tokens < 470_000
    with pytest.raises(ConfigError):
        llama8b_h100.kv_capacity_tokens(0.1)


@pytest.mark.parametrize("kwargs", [{"mfu": 0.0}, {"mfu": 1.5}, {"step_overhead_s": -1.0}])
def test_bad_cost_parameters(kwargs: dict) -> None:
    with pytest.raises(ConfigError):
        build_cost_model(model_spec("llama-3.1-8b"), gpu_profile("h100"), 1, **kwargs)


def test_unknown_model() -> None:
    with pytest.raises(ConfigError):
        model_spec("no-such-model")
