"""The connector's CUDA data path: chunks between vLLM's paged KV on a GPU and pinned host
memory, asynchronous on side streams.

UNTESTED ON HARDWARE: written against torch's documented stream and event API without a GPU
in reach (tests/gpu/test_cuda_copy.py and `kvtier bench copy` check it where one is).

Stores (after the forward pass, from `wait_for_save`): on the store stream, which first waits
for the work the compute stream has queued so far, the chunk's blocks are gathered into a
device staging buffer (one kernel), then copied to a pinned host buffer (DMA). The compute
stream waits only for the gather, which takes microseconds on the device, before its next
kernels may overwrite the blocks; the DMA overlaps the next forward pass. A completion
thread waits for the DMA, puts the pinned bytes into the store (a host memcpy into the
memory tier's pinned slab) and frees the buffers; `take_stored` reports those keys.

Loads (before the forward pass, from `start_load_kv`): the chunk is borrowed from the store
(the memory tier lends its pinned slot; a slower tier is read into a pinned buffer), copied
to a device staging buffer on the load stream and scattered into the blocks there; the
compute stream waits for that event, so the forward pass starts no earlier than its KV is
in place, and the host thread never waits for the copy. The borrow, which keeps the host
slot from being reused, is returned once the copy's event has completed.

Staging buffers are a fixed ring (`depth` chunks per direction, on the device and pinned on
the host); when all are busy the caller waits for the oldest (back-pressure, never an
unbounded queue).

Primitives: `CudaChunkMover`.
"""

from __future__ import annotations

import logging
import queue
import threading
from contextlib import AbstractContextManager, ExitStack
from dataclasses import dataclass, field
from typing import Protocol

import torch

from kvtier.core.keys import ChunkKey
from kvtier.core.store import ChunkView
from kvtier.integrations.vllm.paged import PagedKV

log = logging.getLogger(__name__)


class _Store(Protocol):
    """What the mover needs of kvtier's store (TieredStore provides it)."""

    def borrow(self, key: ChunkKey,
               spare: memoryview) -> AbstractContextManager[ChunkView | None]: ...

    def put(self, key: ChunkKey, data: memoryview) -> bool: ...


@dataclass(slots=True)
class _Slot:
    """One chunk-sized staging buffer on the device and its pinned host twin."""

    device: torch.Tensor  # uint8 [chunk_bytes] on the GPU
    host: torch.Tensor  # uint8 [chunk_bytes], pinned
    host_view: memoryview = field(init=False)

    def __post_init__(self) -> None:
        self.host_view = self.host.numpy().data


@dataclass(slots=True)
class _PendingLoad:
    done: torch.cuda.Event  # recorded on the load stream after the scatter
    slot: _Slot
    borrow: ExitStack  # holds the store's borrow of the host bytes until `done`


class CudaChunkMover:
    """Asynchronous chunk loads and stores for a `PagedKV` on a CUDA device.

    Every method is called from the model runner's thread, except that the completion thread
    runs the store's `put` (thread-safe).
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

        self._free_store_slots: queue.Queue[_Slot] = queue.Queue()
        for _ in range(depth):
            self._free_store_slots.put(slot())
        self._free_load_slots = [slot() for _ in range(depth)]
        self._pending_loads: list[_PendingLoad] = []
        self._stored: list[ChunkKey] = []
        self._stored_lock = threading.Lock()
        self._completions: queue.Queue[tuple[_Store, ChunkKey, _Slot, torch.cuda.Event]
                                       | None] = queue.Queue()
        self._completer = threading.Thread(target=self._complete_stores,
                                           name="kvtier-cuda-store", daemon=True)
        self._completer.start()

    # -- stores ---------------------------------------------------------------------------
    def submit_store(self, store: _Store, key: ChunkKey, block_ids: tuple[int, ...]) -> None:
        """Queue one chunk's device -> host copy and its put into `store`. Returns at once
        unless every store buffer is still in flight (then waits for the oldest)."""
        slot = self._free_store_slots.get()
        compute = torch.cuda.current_stream(self._device)
        self._store_stream.wait_stream(compute)  # the forward pass wrote these blocks
        gathered = torch.cuda.Event()
        copied = torch.cuda.Event()
        with torch.cuda.stream(self._store_stream):
            self._paged.gather(block_ids, slot.device)
            gathered.record(self._store_stream)
            slot.host.copy_(slot.device, non_blocking=True)
            copied.record(self._store_stream)
        # Later kernels may overwrite the blocks only once the gather has read them.
        compute.wait_event(gathered)
        self._completions.put((store, key, slot, copied))

    def _complete_stores(self) -> None:
        while (job := self._completions.get()) is not None:
            store, key, slot, copied = job
            try:
                copied.synchronize()
                if store.put(key, slot.host_view):
                    with self._stored_lock:
                        self._stored.append(key)
            except Exception:  # a failed store is a future miss, never a dead thread
                log.exception("kvtier: CUDA store of %s failed", key.hex())
            finally:
                self._free_store_slots.put(slot)

    def take_stored(self) -> list[ChunkKey]:
        """Keys whose stores completed since the last call; also returns finished loads'
        borrows."""
        self._release_loads(wait=False)
        with self._stored_lock:
            stored, self._stored = self._stored, []
        return stored

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
