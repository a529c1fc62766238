"""The connector's worker copies: vLLM's CPU paged KV <-> kvtier chunk byte order.

Pure torch on vLLM-shaped tensors (no engine); importing vllm takes a few seconds.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm")

from kvtier.errors import ConfigError  # noqa: E402
from kvtier.integrations.vllm.config import ConnectorConfig, RequestControls  # noqa: E402
from kvtier.integrations.vllm.worker import PagedKV  # noqa: E402

LAYERS, BLOCKS, HEADS, BS, DIM = 2, 8, 2, 32, 16


def cpu_kv() -> dict[str, torch.Tensor]:
    """Layers shaped like the CPU backend's: [blocks, heads, block_size, 2*dim]."""
    gen = torch.Generator().manual_seed(0)
    return {f"model.layers.{i}.self_attn.attn":
            torch.randn(BLOCKS, HEADS, BS, 2 * DIM, generator=gen).to(torch.bfloat16)
            for i in range(LAYERS)}


def test_chunk_holds_k_then_v_per_layer_head_and_token() -> None:
    kv = cpu_kv()
    paged = PagedKV(kv, BS)
    chunk = torch.empty(LAYERS, 2, HEADS, 2 * BS, DIM, dtype=torch.bfloat16)
    paged.gather((5, 2), chunk)
    layer1 = kv["model.layers.1.self_attn.attn"]
    # The CPU kernel's view: per block and head, K rows [0, BS) then V rows [BS, 2*BS).
    rows = layer1.view(BLOCKS, HEADS, 2 * BS, DIM)
    assert torch.equal(chunk[1, 0, 1, 3], rows[5, 1, 3])  # K, token 3 (block 5)
    assert torch.equal(chunk[1, 1, 1, 3], rows[5, 1, BS + 3])  # V, token 3
    assert torch.equal(chunk[1, 1, 0, BS + 7], rows[2, 0, BS + 7])  # V, token 39 (block 2)


def test_scatter_restores_gathered_blocks_and_spares_the_local_ones() -> None:
    kv = cpu_kv()
    paged = PagedKV(kv, BS)
    chunk = torch.empty(LAYERS, 2, HEADS, 2 * BS, DIM, dtype=torch.bfloat16)
    paged.gather((0, 1), chunk)
    before = {name: t.clone() for name, t in kv.items()}
    paged.scatter(chunk, (6, 7), first_block=1)  # block 6 is a local hit: untouched
    for name, t in kv.items():
        assert torch.equal(t[7], before[name][1])
        assert torch.equal(t[6], before[name][6])
    layout = paged.layout(64)
    assert layout.bytes_per_chunk == chunk.numel() * 2


def test_unknown_kv_shapes_and_bad_settings_are_refused() -> None:
    with pytest.raises(ConfigError, match="shape"):
        PagedKV({"l0": torch.zeros(4, 3, 5)}, BS)
    with pytest.raises(ConfigError, match="tokens_per_chunk"):
        ConnectorConfig.parse({"tokens_per_chunk": 48}).check_block_size(32)
    with pytest.raises(ConfigError, match="tokens_per_chunk"):
        ConnectorConfig.parse({"tokens_per_chunk": "64"})
    with pytest.raises(ConfigError, match="tiers"):
        ConnectorConfig.parse({"tiers": []})
    controls = RequestControls.from_params({"skip_load": "yes", "max_offload_tokens": 128})
    assert controls == RequestControls(skip_load=False, max_offload_tokens=128)
