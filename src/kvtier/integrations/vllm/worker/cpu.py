"""Chunk loads and stores for a `PagedKV` in host memory (vLLM's CPU backend): the CPU mover,
beside streams.py's device mover (mover.ChunkMover). The worker (worker.py) decides what moves
and when, and on which thread; a mover moves the bytes.

Loads borrow their chunks as they land (`TieredStore.lend_as_landed`), as many reads at once
as the caller has spare buffers: the memory tier lends its slots and the scatter reads them in
place, and a slower tier's chunks are read in parallel into slots the memory tier reserves (or
into the spares), so a load is one copy; each chunk is scattered as soon as its read lands,
the first landed first, while the next reads run, and given back once scattered. Stores gather
straight into a slot the memory tier reserves (`TieredStore.put_from`), one copy too. Every
complete load is timed (`LoadSample`, for load_mode "auto": loadcost.py).

Primitives: `CpuChunkMover`.
"""

from __future__ import annotations

import logging
import mmap
import time
import warnings
from collections import Counter, deque
from collections.abc import Callable, MutableSequence

import torch

from kvtier.core.keys import ChunkKey
from kvtier.core.loans import SpareBuffers
from kvtier.core.store import ChunkView, PendingPut
from kvtier.integrations.vllm.transfers import ChunkTransfer, LoadSample, chunk_meta
from kvtier.integrations.vllm.worker.chunkstore import ChunkStore
from kvtier.integrations.vllm.worker.device import Event
from kvtier.integrations.vllm.worker.mover import StoreJob
from kvtier.integrations.vllm.worker.paged import PagedKV

logger = logging.getLogger(__name__)
# A borrowed chunk is a read-only buffer; torch warns (once) that its tensor could write
# to it. The scatter only reads it.
warnings.filterwarnings("ignore", message="The given buffer is not writable",
                        category=UserWarning)


def spare_buffers(count: int, chunk_bytes: int,
                  allocate: Callable[[int], torch.Tensor] | None = None) -> SpareBuffers:
    """`count` chunk buffers: of `allocate(nbytes)` (a device's pinned memory), or plain host
    memory, page-aligned so that a disk tier reads into them with O_DIRECT (torch's own
    allocations are 64-byte aligned: each read then landed in a staging buffer and was copied
    once more) and allocated lazily by the OS (untouched until a slow tier is read into it).
    A lending replaces one an abandoned read may still write into by the same allocator."""
    if allocate is not None:
        device_allocate = allocate  # bound for the closure (mypy)
        return SpareBuffers([allocate(chunk_bytes).numpy().data for _ in range(count)],
                            lambda nbytes: device_allocate(nbytes).numpy().data)
    return SpareBuffers([memoryview(mmap.mmap(-1, chunk_bytes)) for _ in range(count)],
                        lambda nbytes: memoryview(mmap.mmap(-1, nbytes)))


class CpuChunkMover:
    """Loads (`load`) and stores (`store`) of chunks between a store and vLLM's blocks in
    host memory. `load` may run on the model runner's thread and on the load thread at once
    (each with spares of its own); `store` on one thread at a time."""

    def __init__(self, paged: PagedKV, store: ChunkStore, chunk_bytes: int,
                 note_state: Callable[[ChunkKey, bool], None]) -> None:
        """Args:
            note_state: told, for models with state layers, whether each chunk loaded or
                stored holds the state at its end (any thread).
        """
        self._paged = paged
        self._store = store
        self._note_state = note_state
        # Where a chunk the memory tier declines is gathered before the lower tiers get it.
        self._buffer = spare_buffers(1, chunk_bytes)[0]
        # Complete loads, timed; any thread appends, the worker's report takes them.
        self.samples: deque[LoadSample] = deque()

    def mark(self) -> None:
        """Host copies need no ordering (mover.ChunkMover)."""
        return None

    def load(self, transfers: list[ChunkTransfer], spares: MutableSequence[memoryview],
             after: Event | None = None, wait: bool = True, until: float | None = None) -> int:
        """Scatter a request's chunks from the store into their blocks, slower tiers' reads
        landing in `spares` (the caller's: as many reads run at once); the number loaded
        before the first miss (the blocks of any chunk scattered after it are recomputed by
        vLLM, as the miss's are); a chunk not landed by `until` is a miss (mover.ChunkMover).
        Done when it returns (`after`, `wait`: unused).

        Raises:
            ValueError: no spare buffer.
        """
        started, lent_by, read_s = time.perf_counter(), Counter[str](), 0.0
        # Each chunk is scattered as soon as its read lands, the first landed first (a late
        # read holds up no other), and given back at once: its spare takes the next read.
        # Models with state layers take them in order (a chunk's state goes into the
        # request's state blocks: none may be written past a miss).
        with self._store.lend_as_landed([t.key for t in transfers], spares,
                                        [chunk_meta(t) for t in transfers],
                                        in_order=bool(self._paged.state_bytes),
                                        until=until) as lending:
            reading = started
            # One thread: memory bandwidth, not the CPU, bounds a scatter; two threads
            # scattered 1.25x slower than one here (docs/performance.md).
            for loan in lending:
                read_s += time.perf_counter() - reading
                with loan:
                    if not self._scatter(transfers[loan.index], loan.view):
                        return loan.index
                    if not loan.view.copied_whole():
                        # Its slot was another chunk's by the end of the copy (a node's
                        # lending taken back): its blocks hold no KV of it; recomputed.
                        return loan.index
                    lent_by[loan.view.tier] += 1
                reading = time.perf_counter()
            read_s += time.perf_counter() - reading
            if lending.stopped_at < len(transfers):
                if lending.failed_tier is not None:  # a failed read costs its tier its time
                    lent_by[lending.failed_tier] += 1
                    # Past its deadline: slow, not failed; its time so far is a lower bound.
                    self.samples.append(LoadSample.since(started, lent_by, read_s,
                                                         failed=not lending.expired))
                return lending.stopped_at
        self.samples.append(LoadSample.since(started, lent_by, read_s))
        return len(transfers)

    def _scatter(self, transfer: ChunkTransfer, view: ChunkView) -> bool:
        """Copy a lent chunk into its blocks; False (nothing copied) when the load needs its
        state and it holds none."""
        chunk = torch.frombuffer(view.data, dtype=torch.uint8)
        if self._paged.state_bytes:
            has_state = self._paged.has_state(chunk)
            self._note_state(transfer.key, has_state)
            if transfer.state_blocks and not has_state:
                # A hit must end on a chunk with its state (one found by a probe after a
                # restart may have none): recompute, then back off.
                logger.info("kvtier: chunk %s holds no state; recomputed",
                            transfer.key.hex()[:16])
                return False
        self._paged.scatter(chunk, transfer.block_ids, transfer.first_block,
                            transfer.state_blocks)
        return True

    def store(self, transfers: list[ChunkTransfer], mode: str,
              after: Event | None = None) -> StoreJob:
        """Gather and put `transfers` in order (model runner thread: mode "sync", or the
        store thread: "async"). A chunk that raises is logged and not stored: a cache misses
        it later, the engine goes on."""
        start = time.perf_counter()
        stored: list[ChunkTransfer] = []
        held: list[ChunkTransfer] = []
        self._store.plan_puts([t.key for t in transfers], [chunk_meta(t) for t in transfers])
        for transfer in transfers:
            try:
                # A chunk the top tier holds already (e.g. a prefix vLLM itself had cached,
                # or another engine stored through the node) is held without a copy; lower
                # tiers are asked off this thread.
                put = self._store_chunk(transfer)
                if put.stored:
                    (held if put.held else stored).append(transfer)
            except Exception:
                logger.exception("kvtier: store of chunk %s failed", transfer.key.hex()[:16])
        return StoreJob(stored, time.perf_counter() - start, mode, held)

    def release(self) -> None:
        """Nothing is held past a call (mover.ChunkMover)."""

    def close(self) -> None:
        """Nothing is queued (mover.ChunkMover)."""

    def _store_chunk(self, transfer: ChunkTransfer) -> PendingPut:
        """Gather one chunk and put it in the store; the put, ended (`stored`, `held`)."""
        has_state: bool | None = None
        # Straight into a memory-tier slot (one copy), or into the mover's buffer first.
        with self._store.putting(transfer.key, self._buffer, chunk_meta(transfer)) as put:
            if put.data is not None:
                chunk = torch.frombuffer(put.data, dtype=torch.uint8)
                self._paged.gather(transfer.block_ids, chunk, transfer.state_blocks)
                has_state = self._paged.has_state(chunk)
        if put.stored and has_state is not None and self._paged.state_bytes:
            self._note_state(transfer.key, has_state)
        return put
