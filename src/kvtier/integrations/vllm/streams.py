"""Chunk loads and stores for a `PagedKV` on a device (CUDA), ordered by streams and events: the
device mover, beside cpu.py's (mover.ChunkMover). It orders its work only through the `Device`
protocol (device.py), so CI runs this very code against a CPU stand-in device whose copies run
late, on threads, and any missing wait corrupts data a test checks (tests/connector/
test_stream_mover.py); scripts/gpu-check.sh runs it on a GPU.

Loads. The worker calls `load` on its load thread (asynchronous loads: a hit below RAM is read
there, never on the model runner's thread) or inline on the model runner's thread (hits in
RAM). A batch of chunks is borrowed from the store (the memory tier lends its pinned slots; a
slower tier is read, in parallel, into pinned spares); then for each chunk, on the load stream:
wait for `after` (vLLM's work queued when the load was planned: the blocks may have belonged
to a request whose kernels are still queued), copy host -> a device staging buffer, scatter
into the blocks, record `done`. On the load thread the call waits for `done` before the load
is reported (vLLM schedules the request only then). Inline, the compute stream waits for
`done` instead, so the forward starts no earlier than its KV is in place and the host never
waits for the copy; the borrow (which keeps the RAM slot from being reused) and the staging
buffer are returned once `done` is reached (`release`, once a step).

States (models with state layers, groups.py): a chunk's state region rides in the same
staging buffer as its KV, and `PagedKV.scatter` / `gather` copy it in the same queued work as
the KV, so it is ordered by the same waits and events. Whether a chunk holds a state is read
from the host bytes before its copy is queued (a load that needs one stops at a chunk without,
as the CPU mover's does), and from the host bytes once a store's DMA is done.

Stores. The worker calls `store` on its store thread with `after` marked on the model runner's
thread by `wait_for_save` (the forward that wrote the blocks). On the store stream each chunk
is gathered into a staging buffer after `after`, then DMA'd straight into the slot the memory
tier reserves for it (`TieredStore.put_from`: pinned, no host staging copy); the store thread
waits for the DMA, the model runner never does, whatever the step's number of chunks. The
blocks cannot change meanwhile: a request that ends keeps its blocks until the worker has
joined the job (vLLM's finished_sending), and a preemption joins it before the next forward
(worker.py).

Staging buffers are a small pool per direction (`staging` chunks each, device memory allocated
at start-up, after vLLM sized its KV cache: 2 x staging x chunk bytes, logged); a load or store
that finds none free waits for the oldest copy (microseconds to milliseconds of DMA), on its
own thread.

Primitives: `StreamChunkMover`.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, MutableSequence
from contextlib import ExitStack
from dataclasses import dataclass

import torch

from kvtier.core.keys import ChunkKey
from kvtier.integrations.vllm.chunkstore import ChunkStore
from kvtier.integrations.vllm.device import Device, Event
from kvtier.integrations.vllm.loadcost import LoadSample
from kvtier.integrations.vllm.mover import StoreJob
from kvtier.integrations.vllm.paged import PagedKV
from kvtier.integrations.vllm.transfers import ChunkTransfer, chunk_meta

logger = logging.getLogger(__name__)
STAGING = 2  # staging buffers per direction


@dataclass(slots=True)
class _Pending:
    """An inline load's copies, queued: what they hold until `done` is reached."""

    done: Event
    slots: list[torch.Tensor]  # staging buffers
    borrow: ExitStack  # the store's borrow of the host bytes


class StreamChunkMover:
    """Loads and stores of chunks between a store and vLLM's blocks on a device.

    `load` may run on the model runner's thread (inline) and on the load thread at once, each
    with spares of its own (pinned); `store` on one thread at a time; `mark` and `release` on
    the model runner's thread.
    """

    def __init__(self, paged: PagedKV, store: ChunkStore, chunk_bytes: int, load_batch: int,
                 note_state: Callable[[ChunkKey, bool], None], device: Device,
                 staging: int = STAGING) -> None:
        """Args:
            load_batch: chunks per `borrow_many` (cpu.CpuChunkMover's).
            note_state: told, for models with state layers, whether each chunk loaded or
                stored holds the state at its end (any thread), as cpu.CpuChunkMover's.
            device: where `paged` lives; its streams and events order every copy.
            staging: device staging buffers per direction.
        """
        self._paged = paged
        self._note_state = note_state
        self._store = store
        self._device = device
        self._load_batch = load_batch
        self._load_stream = device.new_stream()
        self._store_stream = device.new_stream()
        self._load_slots: queue.Queue[torch.Tensor] = queue.Queue()
        self._store_slots: queue.Queue[torch.Tensor] = queue.Queue()
        for _ in range(staging):
            self._load_slots.put(device.empty(chunk_bytes))
            self._store_slots.put(device.empty(chunk_bytes))
        # Where a chunk the memory tier declines is copied before the lower tiers get it.
        self._spare = device.pinned(chunk_bytes).numpy().data
        self._pending: deque[_Pending] = deque()  # inline loads, oldest first
        self._pending_lock = threading.Lock()
        self._top_tier = store.stats().tiers[0].name
        self.samples: deque[LoadSample] = deque()
        logger.info("kvtier: %s: %d MiB of staging buffers on the device", device.name,
                    2 * staging * chunk_bytes >> 20)

    def mark(self) -> Event:
        """An event at the end of the work queued so far on the calling thread's compute
        stream (model runner thread)."""
        event = self._device.new_event()
        self._device.record(event, self._device.compute_stream())
        return event

    # -- loads ----------------------------------------------------------------------------
    def load(self, transfers: list[ChunkTransfer], spares: MutableSequence[memoryview],
             after: Event | None = None, wait: bool = True) -> int:
        """See mover.ChunkMover.load. `spares` must be pinned host memory."""
        started, lent_by, read_s = time.perf_counter(), Counter[str](), 0.0
        after = after or self.mark()
        inline = not wait
        for first in range(0, len(transfers), self._load_batch):
            batch = transfers[first:first + self._load_batch]
            tried: dict[int, str] = {}  # the tier that failed a read, if one did
            with ExitStack() as borrow:
                reading = time.perf_counter()
                lent = borrow.enter_context(self._store.borrow_many(
                    [t.key for t in batch], spares, [chunk_meta(t) for t in batch], tried))
                copies: deque[tuple[Event, torch.Tensor]] = deque()  # this batch's, queued
                held, in_ram = 0, True
                for transfer in batch:  # each chunk queued as soon as its read lands
                    view = lent[held]
                    read_s += time.perf_counter() - reading
                    if view is None:
                        break
                    if not self._state_fits(transfer, view.data):
                        break
                    held += 1
                    in_ram = in_ram and view.tier == self._top_tier
                    lent_by[view.tier] += 1
                    slot = self._free_slot(copies, inline)
                    # No tensor of the lent bytes outlives its copy in this frame.
                    self._queue_load(transfer, torch.frombuffer(view.data, dtype=torch.uint8),
                                     slot, after)
                    done = self._device.new_event()
                    self._device.record(done, self._load_stream)
                    copies.append((done, slot))
                    reading = time.perf_counter()
                # Spares are the caller's and the next batch reads into them again: an inline
                # load from them waits for its copies, as a load thread does; so does one
                # that stopped at a miss (the borrow's exit waits for reads nobody took).
                if copies and inline and in_ram and held == len(batch):
                    last = copies[-1][0]  # one load stream: the batch's copies are before it
                    self._device.wait(self._device.compute_stream(), last)
                    with self._pending_lock:
                        self._pending.append(_Pending(last, [s for _, s in copies],
                                                      borrow.pop_all()))
                elif copies:
                    copies[-1][0].synchronize()
                    self._give_back([s for _, s in copies], self._load_slots)
            if held < len(batch):
                if held in tried:  # a failed read costs its tier its time, too
                    lent_by[tried[held]] += 1
                    self.samples.append(LoadSample.since(started, lent_by, read_s,
                                                         failed=True))
                return first + held
        self.samples.append(LoadSample.since(started, lent_by, read_s))
        return len(transfers)

    def _state_fits(self, transfer: ChunkTransfer, host: memoryview) -> bool:
        """Note whether a borrowed chunk holds its state (models with state layers); False
        when the load needs one and it has none (a hit must end on a chunk with its state:
        the rest is recomputed), as cpu.CpuChunkMover's load. Reads host bytes: no sync."""
        if not self._paged.state_bytes:
            return True
        has_state = self._paged.has_state(torch.frombuffer(host, dtype=torch.uint8))
        self._note_state(transfer.key, has_state)
        if transfer.state_blocks and not has_state:
            logger.info("kvtier: chunk %s holds no state; recomputed", transfer.key.hex()[:16])
            return False
        return True

    def _queue_load(self, transfer: ChunkTransfer, host: torch.Tensor, slot: torch.Tensor,
                    after: Event) -> None:
        """Host bytes -> `slot` -> the chunk's blocks and its state blocks, on the load
        stream after `after`."""
        paged = self._paged

        def copy_in() -> None:
            slot.copy_(host, non_blocking=True)
            paged.scatter(slot, transfer.block_ids, transfer.first_block,
                          transfer.state_blocks)

        self._device.wait(self._load_stream, after)
        self._device.run(self._load_stream, copy_in)

    # -- stores ---------------------------------------------------------------------------
    def store(self, transfers: list[ChunkTransfer], mode: str,
              after: Event | None = None) -> StoreJob:
        """See mover.ChunkMover.store."""
        start = time.perf_counter()
        self._device.wait(self._store_stream, after or self.mark())
        stored = []
        for transfer in transfers:
            try:
                if self._store_chunk(transfer):
                    stored.append(transfer)
            except Exception:  # a failed store is a future miss, never a dead thread
                logger.exception("kvtier: store of chunk %s failed", transfer.key.hex()[:16])
        return StoreJob(stored, time.perf_counter() - start, mode)

    def _store_chunk(self, transfer: ChunkTransfer) -> bool:
        """Gather one chunk (and its state) on the store stream and DMA it into the store;
        True when stored."""
        slot = self._store_slots.get()
        device, stream, paged = self._device, self._store_stream, self._paged
        copied: list[bool] = []  # whether the copy holds a state, once it is done
        try:
            device.run(stream, lambda: paged.gather(transfer.block_ids, slot,
                                                    transfer.state_blocks))

            def copy_out(view: memoryview) -> None:
                host = torch.frombuffer(view, dtype=torch.uint8)
                device.run(stream, lambda: host.copy_(slot, non_blocking=True))
                done = device.new_event()
                device.record(done, stream)
                done.synchronize()  # the slot is committed with the bytes in it
                copied.append(paged.has_state(host))

            stored = self._store.put_from(transfer.key, copy_out, self._spare,
                                          meta=chunk_meta(transfer))
            if stored and copied and paged.state_bytes:
                self._note_state(transfer.key, copied[0])
            return stored
        finally:
            if not copied:  # no copy taken (held already), or it failed: the gather may
                # still be queued on the slot
                drained = device.new_event()
                device.record(drained, stream)
                drained.synchronize()
            self._store_slots.put(slot)

    # -- buffers --------------------------------------------------------------------------
    def _free_slot(self, copies: deque[tuple[Event, torch.Tensor]],
                   inline: bool) -> torch.Tensor:
        """A free staging buffer: when none is, the oldest of this batch's copies (or, on the
        model runner's thread, of earlier inline loads) is waited for; else another thread's
        copy, which ends in bounded time (its read is done before it takes a buffer)."""
        if inline:
            self.release()
        while True:
            try:
                return self._load_slots.get_nowait()
            except queue.Empty:
                pass
            if copies:
                done, slot = copies.popleft()
                done.synchronize()
                self._load_slots.put(slot)
            elif not (inline and self._release_oldest()):
                return self._load_slots.get()

    @staticmethod
    def _give_back(taken: list[torch.Tensor], slots: queue.Queue[torch.Tensor]) -> None:
        for slot in taken:
            slots.put(slot)

    def release(self) -> None:
        """Return the borrows and buffers of inline loads whose copies are done."""
        while True:
            with self._pending_lock:
                if not self._pending or not self._pending[0].done.query():
                    return
                pending = self._pending.popleft()
            self._finish(pending)

    def _release_oldest(self) -> bool:
        """Wait for the oldest inline load and return what it held; False if there is none."""
        with self._pending_lock:
            if not self._pending:
                return False
            pending = self._pending.popleft()
        pending.done.synchronize()
        self._finish(pending)
        return True

    def _finish(self, pending: _Pending) -> None:
        pending.borrow.close()
        self._give_back(pending.slots, self._load_slots)

    def close(self) -> None:
        """Wait for every queued copy and return what it held."""
        while self._release_oldest():
            pass
