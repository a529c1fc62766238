"""Gathers and scatters of a batch of chunks, one index upload and one index kernel per batch,
for the device mover (streams.py), where paged.py's `gather` / `scatter` take one of each per
chunk: at 2 MiB chunks on an H200 a chunk's host work (~100-130 us of Python and CUDA calls)
outlasted its DMA (~40 us) (issue 47).

How: a layer group's block-major view `[L, num_blocks, H, kv, r, n, D]` (paged.py) is seen as
one dimension of rows, a row being one layer's block (at `l * layer_stride + b * block_stride`
elements, both multiples of their gcd), over the rest `[H, kv, r, n, D]`; a batch of k chunks
in a staging buffer, one after the other in chunk order `[L, blocks_per_chunk, ...]`, is
`k * L * blocks_per_chunk` such rows. A gather is then one `index_select` of rows (straight
into the staging buffer when one group holds every layer), a scatter one `index_copy_` (after
an `index_select` of the rows it keeps when a chunk starts past its first block or holds
vLLM's null block). Layers not evenly spaced in one allocation are each their own rows (one
op per layer a batch). Chunks with a state region (models with state layers) are moved chunk
by chunk by paged.py, within the batch's one queued work.

The indices are built on the thread that plans the batch (`plan_gather`, `plan_scatter`: the
mover's) and uploaded by the work queued on the device's stream (`gather`, `scatter`), from
pinned memory, so asynchronously. Bytes are moved as integers of the KV dtype's width (fp8
and bfloat16 alike).

Primitives: `PagedBatches`, `BatchPlan`.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from kvtier.integrations.vllm.transfers import ChunkTransfer
from kvtier.integrations.vllm.worker.paged import PagedKV, pad_blocks

_SAME_WIDTH_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@dataclass(frozen=True, slots=True)
class _Rows:
    """Layers of one group seen as rows: row `l * layer_step + b * block_step` is layer l's
    block b."""

    rows: torch.Tensor  # [rows, H, kv, r, n, D], integers of the KV dtype's width
    first_layer: int  # its first layer in a chunk
    layers: int
    group: int  # whose block ids (a chunk's ids are the groups', concatenated)
    layer_step: int
    block_step: int


@dataclass(frozen=True, slots=True)
class BatchPlan:
    """One batch's copies, planned on the host: what `gather` / `scatter` queue."""

    transfers: tuple[ChunkTransfer, ...]  # in staging order
    index: torch.Tensor | None  # every op's indices in one host tensor; None: chunk by chunk
    # (rows source, slice of `index` into its rows, slice into the staging rows, or None:
    # every staging row in order)
    ops: tuple[tuple[int, slice, slice | None], ...]


def move_width(paged: PagedKV) -> torch.dtype:
    """The widest integer type every layer's bytes can be moved as: the gather and scatter
    kernels (`index_select`, `index_copy_`) cost per element, and a row's innermost run (a
    head's D values, contiguous) moved as int64 is 4x fewer elements than as bf16, 8x fewer
    than as fp8 (issue 47: on an H200 a load lost ~6 ns an element a chunk, the scatter's
    time). Needs every stride and offset of every view a multiple of the width; else the KV
    dtype's own width."""
    own = paged.dtype.itemsize
    for nbytes in (8, 4, 2):
        if nbytes <= own:
            break
        width = _SAME_WIDTH_INT[nbytes]
        try:
            for _layers, whole, views in paged.group_views:
                for view in [whole] if whole is not None else views:
                    view.view(width)
        except RuntimeError:
            continue
        return width
    return _SAME_WIDTH_INT[own]


def _as_rows(view: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    """(rows, layer_step, block_step) of an `[L, num_blocks, ...]` view (strided, no copy)."""
    block_stride = view.stride(1)
    layer_stride = view.stride(0) if view.shape[0] > 1 else block_stride
    step = math.gcd(layer_stride, block_stride)
    count = ((view.shape[0] - 1) * layer_stride + (view.shape[1] - 1) * block_stride) // step + 1
    rows = view.as_strided((count, *view.shape[2:]), (step, *view.stride()[2:]),
                           view.storage_offset())
    return rows, layer_stride // step, block_stride // step


class PagedBatches:
    """Batches of chunks gathered from and scattered into a `PagedKV` (see the module
    docstring). `plan_*` on any thread; `gather` / `scatter` on the thread that queues the
    device's work (on CUDA, under the stream `Device.run` makes current).

    `counts` tallies the "index uploads" and "index kernels" planned (tools: `kvtier bench
    mover`; chunks with a state region count one of each a chunk and group).
    """

    def __init__(self, paged: PagedKV, chunk_bytes: int) -> None:
        self._paged = paged
        self.chunk_bytes = chunk_bytes
        self._layers = len(paged.tensors)
        self._per_chunk = paged.chunk_view(torch.empty(chunk_bytes, dtype=torch.uint8,
                                                       device="meta")).shape[1]
        width = move_width(paged)
        self._width = width
        self._sources: list[_Rows] = []
        for group, (layers, whole, views) in enumerate(paged.group_views):
            lo = layers.start or 0
            if whole is not None:
                rows, layer_step, block_step = _as_rows(whole.view(width))
                self._sources.append(_Rows(rows, lo, whole.shape[0], group, layer_step,
                                           block_step))
                continue
            for i, view in enumerate(views):
                rows, layer_step, block_step = _as_rows(view.view(width).unsqueeze(0))
                self._sources.append(_Rows(rows, lo + i, 1, group, layer_step, block_step))
        self._groups = len(paged.group_views)
        # One group holds every layer in one allocation: a batch moves in one op.
        self._whole = len(self._sources) == 1 and self._sources[0].layers == self._layers
        self._pinned = paged.device.type != "cpu"
        self.counts: Counter[str] = Counter()

    # -- planning (host) --------------------------------------------------------------------
    def plan_gather(self, transfers: Sequence[ChunkTransfer]) -> BatchPlan:
        """The indices to gather `transfers` (whole chunks) into a staging buffer in order."""
        if self._paged.state_bytes:
            return self._chunk_by_chunk(transfers)
        ids = self._ids(transfers)
        if self._whole:
            return self._plan(transfers, [self._rows(self._sources[0], ids).ravel()], False)
        staging = self._staging_rows(ids.shape)
        return self._plan(transfers, [part for source in self._sources for part in (
            self._rows(source, ids).ravel(), staging[:, self._layer_range(source)].ravel())],
            True)

    def plan_scatter(self, transfers: Sequence[ChunkTransfer]) -> BatchPlan:
        """The indices to scatter a staging buffer holding `transfers` into their blocks:
        each from its `first_block` on, never into vLLM's null block."""
        if self._paged.state_bytes:
            return self._chunk_by_chunk(transfers)
        ids = self._ids(transfers)
        first = np.array([t.first_block for t in transfers], dtype=np.int64)
        ends = np.array([t.num_blocks for t in transfers], dtype=np.int64)
        null = self._paged.null_block
        nulls = null is not None and bool((ids == null).any())
        tails = bool((ends < ids.shape[2]).any())
        if self._whole and not nulls and not first.any() and not tails:  # every block
            return self._plan(transfers, [self._rows(self._sources[0], ids).ravel()], False)
        staging, per = self._staging_rows(ids.shape), ids.shape[2]
        positions = np.arange(per)[None, None, :]
        kept = (positions >= first[:, None, None]) & (positions < ends[:, None, None])
        if nulls:
            kept = kept & (ids != null)  # [k, groups, per]
        kept = np.broadcast_to(kept, ids.shape)
        parts: list[np.ndarray] = []
        for source in self._sources:
            mask = np.broadcast_to(kept[:, source.group][:, None, :],
                                   (len(transfers), source.layers, per))
            parts += [self._rows(source, ids)[mask],
                      staging[:, self._layer_range(source)][mask]]
        return self._plan(transfers, parts, True)

    def _chunk_by_chunk(self, transfers: Sequence[ChunkTransfer]) -> BatchPlan:
        self.counts["index uploads"] += len(transfers) * self._groups
        self.counts["index kernels"] += len(transfers) * self._groups
        return BatchPlan(tuple(transfers), None, ())

    def _plan(self, transfers: Sequence[ChunkTransfer], parts: list[np.ndarray],
              per_source: bool) -> BatchPlan:
        """A plan of one op per source (`parts`: its rows, then their staging rows), or of
        one op over every staging row in order (`parts`: the rows of the one source)."""
        index, slices = _concatenated(parts)
        if not per_source:
            ops: list[tuple[int, slice, slice | None]] = [(0, slices[0], None)]
        else:
            ops = [(s, slices[2 * s], slices[2 * s + 1]) for s in range(len(self._sources))
                   if slices[2 * s].stop > slices[2 * s].start]
        self.counts["index uploads"] += 1
        self.counts["index kernels"] += sum(1 if staged is None else 2 for _, _, staged in ops)
        return BatchPlan(tuple(transfers), self._host(index), tuple(ops))

    def _ids(self, transfers: Sequence[ChunkTransfer]) -> np.ndarray:
        """The chunks' block ids as [chunks, groups, blocks per chunk]; a chunk's tail (fewer
        blocks: tails are single-group) padded with its last block (paged.pad_blocks)."""
        ids = np.array([pad_blocks(t.block_ids, self._per_chunk) if t.groups == 1
                        else t.block_ids for t in transfers], dtype=np.int64)
        if ids.ndim != 2 or ids.shape[1] % self._groups:
            raise ValueError(f"block ids of {ids.shape} for {self._groups} groups")
        return ids.reshape(len(transfers), self._groups, -1)

    def _staging_rows(self, shape: tuple[int, ...]) -> np.ndarray:
        """[chunks, L, per]: the row of the staging buffer holding each layer's block, for
        block ids of `shape` [chunks, groups, per]."""
        chunks, _groups, per = shape
        return np.arange(chunks * self._layers * per, dtype=np.int64).reshape(
            chunks, self._layers, per)

    @staticmethod
    def _layer_range(source: _Rows) -> slice:
        return slice(source.first_layer, source.first_layer + source.layers)

    @staticmethod
    def _rows(source: _Rows, ids: np.ndarray) -> np.ndarray:
        """[chunks, layers, per]: the source's rows of the chunks' blocks."""
        layers = np.arange(source.layers, dtype=np.int64)[None, :, None] * source.layer_step
        rows: np.ndarray = layers + ids[:, source.group][:, None, :] * source.block_step
        return rows

    def _host(self, index: np.ndarray) -> torch.Tensor:
        tensor = torch.from_numpy(index)
        # Pinned, so that the upload is asynchronous on the stream (no host sync).
        return tensor.pin_memory() if self._pinned else tensor

    # -- the device's work ------------------------------------------------------------------
    def gather(self, plan: BatchPlan, staging: torch.Tensor) -> None:
        """Copy the plan's chunks' blocks into `staging` (a device buffer of at least as many
        chunks), chunk after chunk. On CUDA, queued on the current stream."""
        if plan.index is None:
            for i, t in enumerate(plan.transfers):
                self._paged.gather(t.block_ids, self._chunk(staging, i), t.state_blocks)
            return
        index, out = self._upload(plan.index), self._out(staging, len(plan.transfers))
        for s, rows_at, staged_at in plan.ops:
            rows = self._sources[s].rows
            if staged_at is None:
                torch.index_select(rows, 0, index[rows_at], out=out)
            else:
                out.index_copy_(0, index[staged_at], rows.index_select(0, index[rows_at]))

    def scatter(self, plan: BatchPlan, staging: torch.Tensor) -> None:
        """Copy `staging` (the plan's chunks, chunk after chunk) into their blocks. On CUDA,
        queued on the current stream."""
        if plan.index is None:
            for i, t in enumerate(plan.transfers):
                self._paged.scatter(self._chunk(staging, i), t.block_ids, t.first_block,
                                    t.state_blocks)
            return
        index, out = self._upload(plan.index), self._out(staging, len(plan.transfers))
        for s, rows_at, staged_at in plan.ops:
            values = out if staged_at is None else out.index_select(0, index[staged_at])
            self._sources[s].rows.index_copy_(0, index[rows_at], values)

    def _chunk(self, staging: torch.Tensor, i: int) -> torch.Tensor:
        return staging[i * self.chunk_bytes:(i + 1) * self.chunk_bytes]

    def _out(self, staging: torch.Tensor, chunks: int) -> torch.Tensor:
        """The staging buffer's first `chunks` chunks as rows [chunks * L * per, ...]."""
        rest = self._sources[0].rows.shape[1:]
        return staging[:chunks * self.chunk_bytes].view(self._width).view(-1, *rest)

    def _upload(self, index: torch.Tensor) -> torch.Tensor:
        if index.device == self._paged.device:
            return index
        return index.to(self._paged.device, non_blocking=True)


def _concatenated(parts: list[np.ndarray]) -> tuple[np.ndarray, list[slice]]:
    """One int64 array of `parts`, and each part's slice of it."""
    slices, at = [], 0
    for part in parts:
        slices.append(slice(at, at + part.size))
        at += part.size
    joined: np.ndarray = np.concatenate(parts) if parts else np.empty(0, dtype=np.int64)
    return joined, slices
