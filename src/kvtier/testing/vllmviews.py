"""vLLM 0.33's KV cache tensors, built by vLLM's own rules on any device, without vLLM: what a
connector's `register_kv_caches` receives on a CUDA engine, for `kvtier bench copy`, the GPU
run-book (scripts/gpu-check.sh) and the tests that prove kvtier's layout code against it on CPU.

A port of vLLM 0.33.0's allocation for one attention KV cache group (Apache-2.0, vLLM
contributors): `vllm/v1/core/kv_cache_planning.py` (a group's `KVCacheTensor`: layer and block
strides of layer-outermost and block-outermost layouts), `vllm/v1/kv_cache_interface.py`
(`compute_layer_kv_cache_shape_bytes`, `compute_layout_strides`, `create_kv_cache_views`:
one logical `[B, H, N, C]` view per layer, C in bytes then viewed as the KV dtype, kernel
blocks as `[B * r, H, N / r, C]`) and `vllm/v1/kv_cache_layout.py` (`KVCacheLayout`: each
layout a permutation of the logical `[L, B, H, N, C]` axes into memory order).

Primitives: `LAYOUTS`, `VllmCacheSpec`, `vllm_kv_caches`.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import prod

import torch

# vLLM 0.33's KVCacheLayout: logical axes [L, B, H, N, C] in physical (memory) order.
LAYOUTS: dict[str, tuple[int, int, int, int, int]] = {
    "LBHNC": (0, 1, 2, 3, 4),
    "LBNHC": (0, 1, 3, 2, 4),  # FlashAttention's default on Hopper (NHD)
    "LHBNC": (0, 2, 1, 3, 4),
    "BLHNC": (1, 0, 2, 3, 4),  # FlashInfer (trtllm-gen) on Blackwell, block-outermost
    "BLNHC": (1, 0, 3, 2, 4),
    "BHLNC": (1, 2, 0, 3, 4),
}
_L, _B = 0, 1


@dataclass(frozen=True, slots=True)
class VllmCacheSpec:
    """The fields of vLLM 0.33's AttentionSpec that place a layer's KV (one KV cache group)."""

    block_size: int  # the manager's block size, tokens
    num_kv_heads: int
    head_size: int
    head_size_v: int  # == head_size for K/V attention; 0 for MLA's latent
    dtype: torch.dtype

    @property
    def content_bytes(self) -> int:
        return (self.head_size + self.head_size_v) * torch.empty((), dtype=self.dtype) \
            .element_size()

    @property
    def page_size_bytes(self) -> int:
        return self.num_kv_heads * self.block_size * self.content_bytes

    def shape_bytes(self, num_blocks: int, kernel_block_size: int | None) -> tuple[int, ...]:
        """vLLM's `compute_layer_kv_cache_shape_bytes`: (B, H, N, C bytes)."""
        bs = kernel_block_size or self.block_size
        assert self.block_size % bs == 0
        return (num_blocks * (self.block_size // bs), self.num_kv_heads, bs, self.content_bytes)


def _strides(shape: tuple[int, ...], order: tuple[int, ...],
             fixed: tuple[int | None, ...]) -> tuple[int, ...]:
    """vLLM's `compute_layout_strides` (no page padding): byte strides in logical order."""
    strides, current = [0] * 5, 1
    for dim in reversed(order):
        strides[dim] = fixed[dim] or current
        current = strides[dim] * shape[dim]
    return tuple(strides)


def vllm_kv_caches(spec: VllmCacheSpec, num_layers: int, num_blocks: int, layout: str,
                   device: torch.device | str = "cpu", kernel_block_size: int | None = None,
                   prefix: str = "model.layers", fill: bool = True) -> dict[str, torch.Tensor]:
    """The per-layer views vLLM 0.33 hands a connector for one attention group of
    `num_layers` layers in `layout`, all in one allocation (random bytes when `fill`).

    Raises:
        ValueError: where vLLM 0.33 refuses the split (kernel blocks of a block-outermost
            layout with more than one layer), with vLLM's own advice.
    """
    order = LAYOUTS[layout]
    page = spec.page_size_bytes
    # kv_cache_planning: block-outermost layouts pack every layer's page of a block together.
    packed = num_layers * page if order[0] == _B else None
    layer_stride, block_stride = _strides((num_layers, *spec.shape_bytes(num_blocks, None)),
                                          order, (None, packed, None, None, None))[:2]
    size = num_blocks * num_layers * page
    shape = spec.shape_bytes(num_blocks, kernel_block_size)
    ratio = shape[0] // num_blocks
    if ratio > 1:
        dense = prod(spec.shape_bytes(1, None)[1:])
        if block_stride != dense:
            raise ValueError(
                f"The resolved KV cache layout ({layout}) does not store blocks as dense, "
                f"unpadded pages (block stride {block_stride} != page {dense}), so a manager "
                f"block cannot be split into {ratio} kernel blocks of {kernel_block_size} "
                f"tokens. Reduce --block-size to {kernel_block_size} or set "
                "VLLM_KV_CACHE_LAYOUT to a layer-compact layout (e.g. LBNHC).")
        block_stride //= ratio
    raw = torch.zeros(size, dtype=torch.int8, device=device)
    if fill:
        gen = torch.Generator(device="cpu").manual_seed(size % 9973)
        raw.copy_(torch.randint(-128, 128, (size,), dtype=torch.int8, generator=gen))
    strides = _strides((num_layers, *shape), order, (layer_stride, block_stride, None, None, None))
    view_5d = torch.as_strided(raw, (num_layers, *shape), strides, raw.storage_offset())
    return {f"{prefix}.{i}.self_attn.attn": view_5d[i].view(spec.dtype)
            for i in range(num_layers)}
