"""The connector's CUDA data path: chunks between vLLM's paged KV on a GPU and pinned host
memory, asynchronous on side streams.

UNTESTED ON HARDWARE: written against torch's documented stream and event API without a GPU
in reach (tests/gpu/test_cuda_copy.py and `kvtier bench copy` check it where one is).

Stores (after the forward pass, from `wait_for_save`), a step's chunks as one job: on the
store stream, which first waits for the work the compute stream has queued so far, each
chunk's blocks are gathered into a device staging buffer (one kernel each). The compute stream
waits only for the gathers, which take microseconds on the device, before its next kernels may
overwrite the blocks, so no block needs to outlive its request. A completion thread then puts
each chunk into the store (`TieredStore.put_from`): the memory tier reserves a slot of its
pinned slab, the DMA copies the staging buffer straight into it (no host staging copy), and the
slot is committed once the DMA's event has completed; the job's future (`StoreJob`) resolves
when the step's chunks are in, which the worker joins and reports like the CPU's store thread.

Loads (before the forward pass, from `start_load_kv`): the chunk is borrowed from the store
(the memory tier lends its pinned slot; a slower tier is read into a pinned buffer), copied
to a device staging buffer on the load stream and scattered into the blocks there; the
compute stream waits for that event, so the forward pass starts no earlier than its KV is
in place, and the host thread never waits for the copy. The borrow, which keeps the host
slot from being reused, is returned once the copy's event has completed.

Staging buffers are a fixed ring (`depth` chunks per direction, on the device; loads also
have pinned host twins); when all are busy the caller waits for the oldest (back-pressure,
never an unbounded queue).

Primitives: `CudaChunkMover`.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from contextlib import AbstractContextManager, ExitStack
from dataclasses import dataclass, field
from typing import Protocol

import torch

from kvtier.core.keys import ChunkKey
from kvtier.core.retention import ChunkMeta
from kvtier.core.store import ChunkView
from kvtier.integrations.vllm.messages import ChunkTransfer
from kvtier.integrations.vllm.paged import PagedKV
from kvtier.integrations.vllm.storejob import StoreJob

log = logging.getLogger(__name__)


class _Store(Protocol):
    """What the mover needs of kvtier's store (TieredStore provides it)."""

    def borrow(self, key: ChunkKey,
               spare: memoryview) -> AbstractContextManager[ChunkView | None]: ...

    def put_from(self, key: ChunkKey, fill: Callable[[memoryview], None],
                 spare: memoryview, meta: ChunkMeta | None = None) -> bool: ...


@dataclass(slots=True)
class _Slot:
    """One chunk-sized staging buffer on the device and its pinned host twin."""

    device: torch.Tensor  # uint8 [chunk_bytes] on the GPU
    host: torch.Tensor  # uint8 [chunk_bytes], pinned
    host_view: memoryview = field(init=False)

    def __post_init__(self) -> None:
        self.host_view = self.host.numpy().data


@dataclass(slots=True)
class _StoreBatch:
    """Stores of one step gathered on the device, waiting for their puts: the whole step, or
    as many chunks as there were free staging buffers (the step's last batch resolves it)."""

    store: _Store
    stored: list[ChunkTransfer]  # the step's chunks put so far (shared by its batches)
    transfers: list[ChunkTransfer] = field(default_factory=list)
    metas: list[ChunkMeta | None] = field(default_factory=list)
    slots: list[torch.Tensor] = field(default_factory=list)  # staging buffers, one a transfer
    done: Future[StoreJob] | None = None  # the step's last batch: its result
    started: float = 0.0  # time.perf_counter() of the step's first gather


@dataclass(slots=True)
class _PendingLoad:
    done: torch.cuda.Event  # recorded on the load stream after the scatter
    slot: _Slot
    borrow: ExitStack  # holds the store's borrow of the host bytes until `done`


class CudaChunkMover:
    """Asynchronous chunk loads and stores for a `PagedKV` on a CUDA device.

    Every method is called from the model runner's thread, except that the completion thread
    runs the store's `put_from` (thread-safe).
    """

    def __init__(self, paged: PagedKV, chunk_bytes: int, depth: int = 4) -> None:
        """Args:
            paged: vLLM's KV cache on a CUDA device.
            chunk_bytes: bytes of one chunk (KVLayout.bytes_per_chunk).
            depth: staging buffers per direction (device memory: 2 * depth chunks).
        """
        self._paged = paged
        self._device = paged.device
        self._store_stream = torch.cuda.Stream(self._device)
        self._load_stream = torch.cuda.Stream(self._device)

        def slot() -> _Slot:
            return _Slot(torch.empty(chunk_bytes, dtype=torch.uint8, device=self._device),
                         torch.empty(chunk_bytes, dtype=torch.uint8, pin_memory=True))

        self._free_store_slots: queue.Queue[torch.Tensor] = queue.Queue()
        for _ in range(depth):
            self._free_store_slots.put(torch.empty(chunk_bytes, dtype=torch.uint8,
                                                   device=self._device))
        # Where a chunk the memory tier declines is copied before the lower tiers get it.
        self._spare = torch.empty(chunk_bytes, dtype=torch.uint8, pin_memory=True)
        self._free_load_slots = [slot() for _ in range(depth)]
        self._pending_loads: list[_PendingLoad] = []
        self._completions: queue.Queue[_StoreBatch | None] = queue.Queue()
        self._completer = threading.Thread(target=self._complete_stores,
                                           name="kvtier-cuda-store", daemon=True)
        self._completer.start()

    # -- stores ---------------------------------------------------------------------------
    def submit_stores(self, store: _Store, transfers: list[ChunkTransfer],
                      metas: list[ChunkMeta | None]) -> Future[StoreJob]:
        """Gather a step's chunks on the store stream and queue their puts into `store`
        (`metas`: each chunk's tenant, pin and expiry); the future resolves once they are
        in. Returns without waiting for the device unless every staging buffer is in
        flight (then it waits for the oldest: back-pressure)."""
        started, stored = time.perf_counter(), list[ChunkTransfer]()
        compute = torch.cuda.current_stream(self._device)
        self._store_stream.wait_stream(compute)  # the forward pass wrote these blocks
        batch = _StoreBatch(store, stored)
        for transfer, meta in zip(transfers, metas, strict=True):
            if self._free_store_slots.empty() and batch.slots:
                self._send(batch, compute)  # its buffers come back as its puts end
                batch = _StoreBatch(store, stored)
            slot = self._free_store_slots.get()
            with torch.cuda.stream(self._store_stream):
                self._paged.gather(transfer.block_ids, slot)
            batch.transfers.append(transfer)
            batch.metas.append(meta)
            batch.slots.append(slot)
        batch.done, batch.started = Future(), started
        self._send(batch, compute)
        return batch.done

    def _send(self, batch: _StoreBatch, compute: torch.cuda.Stream) -> None:
        """Hand a batch of gathers to the completion thread."""
        gathered = torch.cuda.Event()
        gathered.record(self._store_stream)
        # Later kernels may overwrite the blocks only once the gathers have read them.
        compute.wait_event(gathered)
        self._completions.put(batch)

    def _complete_stores(self) -> None:
        torch.cuda.set_device(self._device)  # vLLM's rank may not use device 0
        spare = self._spare.numpy().data
        while (batch := self._completions.get()) is not None:
            for transfer, meta, slot in zip(batch.transfers, batch.metas, batch.slots,
                                            strict=True):
                try:
                    if batch.store.put_from(transfer.key, self._copy_out(slot), spare, meta):
                        batch.stored.append(transfer)
                except Exception:  # a failed store is a future miss, never a dead thread
                    log.exception("kvtier: CUDA store of %s failed", transfer.key.hex())
                finally:
                    self._free_store_slots.put(slot)
            if batch.done is not None:
                batch.done.set_result(StoreJob(batch.stored,
                                               time.perf_counter() - batch.started, "async"))

    def _copy_out(self, slot: torch.Tensor) -> Callable[[memoryview], None]:
        """A `put_from` fill: DMA the staging buffer into the (pinned) view, and wait for it
        (completion thread: the step does not wait)."""
        def fill(view: memoryview) -> None:
            copied = torch.cuda.Event()
            with torch.cuda.stream(self._store_stream):
                torch.frombuffer(view, dtype=torch.uint8).copy_(slot, non_blocking=True)
                copied.record(self._store_stream)
            copied.synchronize()
        return fill

    def release_loads(self) -> None:
        """Return finished loads' borrows (model runner thread, once a step)."""
        self._release_loads(wait=False)

    # -- loads ----------------------------------------------------------------------------
    def load(self, store: _Store, key: ChunkKey, block_ids: tuple[int, ...],
             first_block: int) -> str | None:
        """Queue one chunk's host -> device copy and scatter, ahead of the forward pass on
        the compute stream. Returns the serving tier's name, or None on a miss (nothing
        queued, the blocks are untouched)."""
        slot = self._take_load_slot()
        borrow = ExitStack()
        lent = borrow.enter_context(store.borrow(key, slot.host_view))
        if lent is None:
            borrow.close()
            self._free_load_slots.append(slot)
            return None
        host = torch.frombuffer(lent.data, dtype=torch.uint8)
        compute = torch.cuda.current_stream(self._device)
        # The blocks may have belonged to a request whose kernels are still queued.
        self._load_stream.wait_stream(compute)
        done = torch.cuda.Event()
        with torch.cuda.stream(self._load_stream):
            slot.device.copy_(host, non_blocking=True)
            self._paged.scatter(slot.device, block_ids, first_block)
            done.record(self._load_stream)
        compute.wait_event(done)
        self._pending_loads.append(_PendingLoad(done, slot, borrow))
        return lent.tier

    def _take_load_slot(self) -> _Slot:
        self._release_loads(wait=False)
        if not self._free_load_slots:
            self._release_oldest_load()
        return self._free_load_slots.pop()

    def _release_oldest_load(self) -> None:
        pending = self._pending_loads.pop(0)
        pending.done.synchronize()
        pending.borrow.close()
        self._free_load_slots.append(pending.slot)

    def _release_loads(self, wait: bool) -> None:
        while self._pending_loads and (wait or self._pending_loads[0].done.query()):
            self._release_oldest_load()

    def close(self) -> None:
        """Wait for every queued copy and put; stop the completion thread."""
        self._release_loads(wait=True)
        self._completions.put(None)
        self._completer.join()
