"""Prefill/transfer cost model: hand-checked sums and the vLLM blog's published range."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvtier.errors import ConfigError
from kvtier.tools.ops.costmodel import (
    _causal_pairs,
    prefill_flops,
    prefill_seconds,
    transfer_seconds,
)
from kvtier.tools.ops.hardware import gpu_profile, host_link, nvme_link
from kvtier.tools.ops.modelspec import kv_footprint, load_model_spec, session_kv_bytes

CONFIGS = Path(__file__).parents[1] / "data" / "configs"


def test_causal_pairs_by_hand():
    assert _causal_pairs(0, 4, None) == 1 + 2 + 3 + 4
    assert _causal_pairs(0, 4, 2) == 1 + 2 + 2 + 2
    assert _causal_pairs(2, 2, 3) == 3 + 3
    assert _causal_pairs(2, 3, None) == 3 + 4 + 5


def test_llama3_8b_prefill_flops_by_hand():
    s = load_model_spec(CONFIGS / "llama-3-8b.json")
    n = 1000
    matmul = 2 * (8_029_995_008 - 2 * 128256 * 4096) * n
    attention = 32 * (n * (n + 1) / 2) * 4 * 32 * 128
    assert prefill_flops(s, n) == pytest.approx(matmul + attention)
    assert prefill_flops(s, 0) == 0
    # A cached prefix only costs attention over it, never its matmuls again.
    assert prefill_flops(s, 100, cached_tokens=900) < prefill_flops(s, 1000) / 5


def test_cpu_hit_speedup_in_vllm_blog_range_for_llama3_8b_h100():
    # vLLM's KV-offloading blog: a CPU-tier hit is 2-22x faster than re-prefill for
    # Llama-3.1-8B on an H100 at 512-8k tokens. Our roofline must land in that band.
    s, h100 = load_model_spec(CONFIGS / "llama-3-8b.json"), gpu_profile("h100")
    for tokens in (512, 2048, 8192):
        load = transfer_seconds(session_kv_bytes(kv_footprint(s), tokens), host_link(h100))
        ratio = prefill_seconds(s, tokens, h100) / load
        assert 2 <= ratio <= 22, (tokens, ratio)


def test_links_and_profiles():
    assert host_link(gpu_profile("a100")).bandwidth_gbps == 25.0  # PCIe Gen4
    assert host_link(gpu_profile("h100")).bandwidth_gbps == 50.0  # PCIe Gen5
    assert nvme_link(5, 2).bandwidth_gbps == 24.0
    assert transfer_seconds(12e9, nvme_link(4)) == pytest.approx(2.0)
    assert gpu_profile("H200").hbm_bytes > gpu_profile("h100").hbm_bytes
    assert gpu_profile("h100", hbm="94GiB").hbm_bytes == 94 * 1024**3
    assert gpu_profile("cpu").pcie_gen == 0
    with pytest.raises(ConfigError):
        gpu_profile("tpu")
    with pytest.raises(ConfigError):
        nvme_link(3)
