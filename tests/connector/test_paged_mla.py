"""MLA (DeepSeek-style latent KV) through `PagedKV`: vLLM's MLA cache layout
`[num_blocks, block_size, kv_lora_rank + qk_rope_head_dim]` (one latent per token, no heads,
no K/V split) <-> kvtier chunks `[layers, blocks, block_size, head_size]`.

Pure torch on vLLM-shaped tensors (no engine). The vectorized copies are checked against a
per-layer, per-block reference written from the documented layout, with the layers in one
allocation (one op over all layers) and in separate ones, on the numpy and the torch paths.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm")

from kvtier.errors import ConfigError
from kvtier.integrations.vllm.worker.connector_worker import PagedKV

LAYERS, BLOCKS, BS, LATENT = 3, 10, 16, 96  # LATENT: kv_lora_rank 64 + qk_rope_head_dim 32


def mla_kv(shared: bool) -> dict[str, torch.Tensor]:
    """Layers shaped like vLLM's MLA cache, in one allocation (as vLLM allocates them) or not."""
    gen = torch.Generator().manual_seed(1)
    if shared:
        base = torch.randn(LAYERS, BLOCKS, BS, LATENT, generator=gen).to(torch.bfloat16)
        return {f"model.layers.{i}.self_attn.attn": base[i] for i in range(LAYERS)}
    return {f"model.layers.{i}.self_attn.attn":
            torch.randn(BLOCKS, BS, LATENT, generator=gen).to(torch.bfloat16)
            for i in range(LAYERS)}


def reference_chunk(kv: dict[str, torch.Tensor], blocks: tuple[int, ...]) -> torch.Tensor:
    """The documented chunk order, built one (layer, block) at a time."""
    return torch.stack([torch.stack([layer[b] for b in blocks]) for layer in kv.values()])


@pytest.mark.parametrize("shared", [True, False])
@pytest.mark.parametrize("torch_ops", [False, True])
def test_gather_matches_the_per_block_reference(shared: bool, torch_ops: bool) -> None:
    kv = mla_kv(shared)
    paged = PagedKV(kv, BS, torch_ops=torch_ops)
    assert paged.content == "latent" and paged.single_allocation == shared
    blocks = (7, 2, 9)
    chunk = torch.empty(LAYERS * len(blocks) * BS * LATENT, dtype=torch.bfloat16)
    paged.gather(blocks, chunk)
    assert torch.equal(chunk.view(LAYERS, len(blocks), BS, LATENT), reference_chunk(kv, blocks))


@pytest.mark.parametrize("shared", [True, False])
@pytest.mark.parametrize("torch_ops", [False, True])
def test_scatter_round_trips_and_spares_blocks_before_first_block(
        shared: bool, torch_ops: bool) -> None:
    kv = mla_kv(shared)
    paged = PagedKV(kv, BS, torch_ops=torch_ops)
    chunk = torch.empty(LAYERS, 3, BS, LATENT, dtype=torch.bfloat16)
    paged.gather((0, 1, 2), chunk)
    before = {name: t.clone() for name, t in kv.items()}
    paged.scatter(chunk, (5, 6, 8), first_block=1)  # block 5 is a local hit: untouched
    for name, t in kv.items():
        assert torch.equal(t[5], before[name][5])
        assert torch.equal(t[6], before[name][1])
        assert torch.equal(t[8], before[name][2])
        assert torch.equal(t[7], before[name][7])  # not a target


def test_layout_is_one_latent_per_token() -> None:
    paged = PagedKV(mla_kv(True), BS)
    layout = paged.layout(32, tp_rank=1, tp_world_size=2)
    assert (layout.kv_factor, layout.num_kv_heads, layout.head_size) == (1, 1, LATENT)
    assert layout.bytes_per_chunk == LAYERS * 32 * LATENT * 2
    # Each rank stores its copy under its own digest (see docs/sharing.md).
    assert (layout.tp_rank, layout.tp_world_size) == (1, 2)
    assert layout.digest() != paged.layout(32, tp_rank=0, tp_world_size=2).digest()


def test_mla_layout_digest_differs_from_a_k_v_layout_of_the_same_bytes() -> None:
    # An MLA chunk of latent 2*D and a K+V chunk of one head of dim D have the same size;
    # they must never share keys.
    mla = PagedKV({"l": torch.zeros(4, BS, 2 * 8)}, BS).layout(BS)
    kv = PagedKV({"l": torch.zeros(4, 1, BS, 2 * 8)}, BS).layout(BS)
    assert mla.bytes_per_chunk == kv.bytes_per_chunk
    assert mla.digest() != kv.digest()


def test_mixed_layer_shapes_are_refused() -> None:
    kv = mla_kv(False)
    kv["model.layers.9.self_attn.attn"] = torch.zeros(BLOCKS, BS, LATENT + 1,
                                                      dtype=torch.bfloat16)
    with pytest.raises(ConfigError, match=r"kv cache of model\.layers\.9"):
        PagedKV(kv, BS)


def test_a_3d_tensor_of_another_block_size_is_refused() -> None:
    with pytest.raises(ConfigError, match="kv cache tensor shape"):
        PagedKV({"l": torch.zeros(BLOCKS, BS * 2, LATENT)}, BS)


def test_mla_on_vllm_cpu_is_refused_in_one_line_naming_it() -> None:
    from kvtier.integrations.vllm.models import ModelTraits, check_supported, unsupported_reason

    served = ModelTraits(model="/models/dsv2", architecture="DeepseekV2ForCausalLM")
    assert unsupported_reason(served) is None  # MLA on CUDA: served
    refused = ModelTraits(model="/models/dsv2", architecture="DeepseekV2ForCausalLM",
                          mla_on_cpu=True)
    with pytest.raises(ConfigError) as info:
        check_supported(refused)
    message = str(info.value)
    assert "\n" not in message and "/models/dsv2" in message and "DeepseekV2ForCausalLM" in message
    assert "CPU_MLA" in message and "AMX_MLA" in message and "CUDA" in message
