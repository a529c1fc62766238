"""Chunk loads and stores for a `PagedKV` on a device (CUDA), ordered by streams and events: the
device mover, beside cpu.py's (mover.ChunkMover). It orders its work only through the `Device`
protocol (device.py), so CI runs this very code against a CPU stand-in device whose copies run
late, on threads, and any missing wait corrupts data a test checks (tests/connector/
test_stream_mover.py); scripts/gpu-check.sh runs it on a GPU.

Loads. The worker calls `load` on its load thread (asynchronous loads: a hit below RAM is read
there, never on the model runner's thread) or inline on the model runner's thread (hits in
RAM). The chunks are borrowed from the store as they land (`TieredStore.lend_as_landed`, as
the CPU mover's: the memory tier lends its pinned slots; a slower tier is read, in parallel,
into pinned spares); for each chunk, as soon as it lands: on the load copy stream copy host ->
a device staging buffer; on the load stream wait for that copy and for
`after` (vLLM's work queued when the load was planned: the blocks may have belonged to a
request whose kernels are still queued), scatter into the blocks, record `done`. The copy
engine moves chunk i+1 while the SMs scatter chunk i (one stream for both ran them one after
the other: 0.85x a raw copy at 32 MiB chunks on an H200). On the load thread the call waits
for `done` before the load is reported (vLLM schedules the request only then). Inline, the
compute stream waits for `done` instead, so the forward starts no earlier than its KV is in
place and the host never waits for the copy; the loans (which keep the RAM slots from being
reused) and the staging buffers are returned once `done` is reached (`release`, once a step).
Each chunk stays lent until its copy's `done` (`Loan.release_after`): its spare then takes
another read.

States (models with state layers, groups.py): a chunk's state region rides in the same
staging buffer as its KV, and `PagedKV.scatter` / `gather` copy it in the same queued work as
the KV, so it is ordered by the same waits and events. Whether a chunk holds a state is read
from the host bytes before its copy is queued (a load that needs one stops at a chunk without,
as the CPU mover's does), and from the host bytes once a store's DMA is done.

Stores. The worker calls `store` on its store thread with `after` marked on the model runner's
thread by `wait_for_save` (the forward that wrote the blocks). Each chunk's place is reserved in
the memory tier first (`TieredStore.putting`: a pinned slot, no host staging copy; nothing is
copied when the tier holds the chunk already); on the store stream it is gathered into a
staging buffer after `after`, and on the store copy stream DMA'd straight into that slot. Up to
one chunk per staging buffer is in flight: the store thread waits for the oldest DMA and
commits its chunk while later chunks are gathered and copied (one chunk at a time, waited for
before the next, ran at 0.1-0.6x a raw copy on an H200); the model runner never waits, whatever
the step's number of chunks. The blocks cannot change meanwhile: a request that ends keeps its
blocks until the worker has joined the job (vLLM's finished_sending), and a preemption joins
it before the next forward (worker.py).

Staging buffers are a small pool per direction (`staging_buffers`: 64 MiB of device memory
per direction, 2 to 16 buffers, allocated at start-up, after vLLM sized its KV cache, logged);
a load or store that finds none free waits for the oldest copy (microseconds to milliseconds
of DMA), on its own thread.

Primitives: `StreamChunkMover`, `staging_buffers`.
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
from kvtier.core.store import PendingPut
from kvtier.integrations.vllm.transfers import ChunkTransfer, LoadSample, chunk_meta
from kvtier.integrations.vllm.worker.chunkstore import ChunkStore
from kvtier.integrations.vllm.worker.device import Device, Event
from kvtier.integrations.vllm.worker.mover import StoreJob
from kvtier.integrations.vllm.worker.paged import PagedKV

logger = logging.getLogger(__name__)
MiB = 1 << 20
STAGING_BYTES = 64 * MiB  # device staging memory per direction, at least 2 buffers


def staging_buffers(chunk_bytes: int) -> int:
    """Staging buffers per direction for chunks of `chunk_bytes`: 64 MiB of them, at least 2
    (a copy overlaps a scatter) and at most 16: small chunks need more in flight to keep the
    copy engine busy."""
    return max(2, min(16, STAGING_BYTES // chunk_bytes))


def _log_failed_store(transfer: ChunkTransfer) -> None:
    """Log the exception being handled: the chunk is not stored (a future miss)."""
    logger.exception("kvtier: store of chunk %s failed", transfer.key.hex()[:16])


@dataclass(slots=True)
class _Storing:
    """A store's chunk in flight: its gather and DMA queued, its place reserved."""

    transfer: ChunkTransfer
    slot: torch.Tensor  # staging buffer
    done: Event  # the DMA into `put.data` is done
    host: torch.Tensor  # `put.data`
    put: PendingPut
    exits: ExitStack  # the `putting` block: closing it stores the chunk


@dataclass(slots=True)
class _Pending:
    """An inline load's copies, queued: what they hold until `done` is reached."""

    done: Event
    slots: list[torch.Tensor]  # staging buffers
    loans: ExitStack  # the store's lending of the host bytes


class StreamChunkMover:
    """Loads and stores of chunks between a store and vLLM's blocks on a device.

    `load` may run on the model runner's thread (inline) and on the load thread at once, each
    with spares of its own (pinned); `store` on one thread at a time; `mark` and `release` on
    the model runner's thread.
    """

    def __init__(self, paged: PagedKV, store: ChunkStore, chunk_bytes: int,
                 note_state: Callable[[ChunkKey, bool], None], device: Device,
                 staging: int | None = None) -> None:
        """Args:
            note_state: told, for models with state layers, whether each chunk loaded or
                stored holds the state at its end (any thread), as cpu.CpuChunkMover's.
            device: where `paged` lives; its streams and events order every copy.
            staging: device staging buffers per direction (None: `staging_buffers`).
        """
        self._paged = paged
        self._note_state = note_state
        self._store = store
        self._device = device
        # A copy engine moves the bytes while the SMs scatter or gather the chunk before or
        # after: each on its own stream, so that the two overlap from chunk to chunk.
        self._load_copy_stream = device.new_stream("load copy")
        self._load_stream = device.new_stream("load")
        self._store_stream = device.new_stream("store")
        self._store_copy_stream = device.new_stream("store copy")
        staging = staging or staging_buffers(chunk_bytes)
        self._load_slots: queue.Queue[torch.Tensor] = queue.Queue()
        self._store_slots: list[torch.Tensor] = []  # one store at a time
        for _ in range(staging):
            self._load_slots.put(device.empty(chunk_bytes))
            self._store_slots.append(device.empty(chunk_bytes))
        # Where a chunk the memory tier declines is copied before the lower tiers get it.
        self._spare = device.pinned(chunk_bytes).numpy().data
        self._pending: deque[_Pending] = deque()  # inline loads, oldest first
        self._pending_lock = threading.Lock()
        self.samples: deque[LoadSample] = deque()
        logger.info("kvtier: %s: %d MiB of staging buffers on the device (%d per direction)",
                    device.name, 2 * staging * chunk_bytes >> 20, staging)

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
        self._device.wait(self._load_stream, after or self.mark())
        inline = not wait
        copies: deque[tuple[Event, torch.Tensor]] = deque()  # this load's, queued
        stateless: int | None = None  # a chunk that holds no state the load needs
        in_place = True  # every chunk lent where it lies (none in a spare)
        with ExitStack() as held:
            # Each chunk's copy is queued as soon as its read lands, the first landed first
            # (in order for models with state layers, as the CPU mover's); its host bytes
            # stay lent until its copy is done, and its spare then takes the next read.
            lending = held.enter_context(self._store.lend_as_landed(
                [t.key for t in transfers], spares, [chunk_meta(t) for t in transfers],
                in_order=bool(self._paged.state_bytes)))
            reading = time.perf_counter()
            for loan in lending:
                read_s += time.perf_counter() - reading
                transfer = transfers[loan.index]
                if not self._state_fits(transfer, loan.view.data):
                    stateless = loan.index
                    loan.release()
                    break
                in_place = in_place and loan.in_place
                lent_by[loan.view.tier] += 1
                slot = self._free_slot(copies, inline)
                # No tensor of the lent bytes outlives its copy in this frame.
                self._queue_load(transfer, torch.frombuffer(loan.view.data, dtype=torch.uint8),
                                 slot)
                done = self._device.new_event()
                self._device.record(done, self._load_stream)
                copies.append((done, slot))
                loan.release_after(done)
                reading = time.perf_counter()
            else:
                read_s += time.perf_counter() - reading
            loaded = lending.stopped_at if stateless is None else stateless
            # Spares are the caller's and its next load reads into them again: an inline
            # load from them waits for its copies, as a load thread does; so does one that
            # stopped at a miss. An inline load of chunks lent in place (RAM) does not: the
            # compute stream waits for its copies, and the loans (which keep the RAM slots
            # from being reused) and staging buffers are returned once they are done
            # (`release`, once a step).
            if copies and inline and in_place and loaded == len(transfers):
                last = copies[-1][0]  # one load stream: the load's copies are before it
                self._device.wait(self._device.compute_stream(), last)
                with self._pending_lock:
                    self._pending.append(_Pending(last, [s for _, s in copies],
                                                  held.pop_all()))
            elif copies:
                copies[-1][0].synchronize()
                self._give_back([s for _, s in copies], self._load_slots)
        if loaded < len(transfers):
            if stateless is None and lending.failed_tier is not None:
                lent_by[lending.failed_tier] += 1  # a failed read costs its tier its time
                self.samples.append(LoadSample.since(started, lent_by, read_s, failed=True))
            return loaded
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

    def _queue_load(self, transfer: ChunkTransfer, host: torch.Tensor,
                    slot: torch.Tensor) -> None:
        """Host bytes -> `slot` on the load copy stream, then `slot` -> the chunk's blocks
        and its state blocks on the load stream (after the load's `after`)."""
        device, paged = self._device, self._paged
        device.run(self._load_copy_stream, lambda: slot.copy_(host, non_blocking=True))
        copied = device.new_event()
        device.record(copied, self._load_copy_stream)
        device.wait(self._load_stream, copied)
        device.run(self._load_stream, lambda: paged.scatter(
            slot, transfer.block_ids, transfer.first_block, transfer.state_blocks))

    # -- stores ---------------------------------------------------------------------------
    def store(self, transfers: list[ChunkTransfer], mode: str,
              after: Event | None = None) -> StoreJob:
        """See mover.ChunkMover.store. Up to one chunk per staging buffer is in flight: the
        gather of one, the DMA of another and the commit of a third overlap."""
        start = time.perf_counter()
        self._device.wait(self._store_stream, after or self.mark())
        self._store.plan_puts([t.key for t in transfers], [chunk_meta(t) for t in transfers])
        stored: list[ChunkTransfer] = []
        flight: deque[_Storing] = deque()  # oldest first
        try:
            for transfer in transfers:
                if not self._store_slots:
                    self._end_store(flight.popleft(), stored)
                try:
                    storing = self._begin_store(transfer, stored)
                except Exception:  # a failed store is a future miss, never a dead thread
                    _log_failed_store(transfer)
                    continue
                if storing is not None:
                    flight.append(storing)
                    if not storing.put.in_place:  # in the one spare: ends before the next
                        while flight:
                            self._end_store(flight.popleft(), stored)
        finally:
            while flight:
                self._end_store(flight.popleft(), stored)
        return StoreJob(stored, time.perf_counter() - start, mode)

    def _begin_store(self, transfer: ChunkTransfer,
                     stored: list[ChunkTransfer]) -> _Storing | None:
        """Reserve the chunk's place in the store, queue its gather (store stream) and its
        DMA into that place (store copy stream); None when there is nothing to copy (the
        store holds it already: then it counts as stored, or takes it nowhere)."""
        device, paged = self._device, self._paged
        exits = ExitStack()
        put = exits.enter_context(self._store.putting(transfer.key, self._spare,
                                                      chunk_meta(transfer)))
        if put.data is None:
            exits.close()
            if put.stored:
                stored.append(transfer)
            return None
        slot = self._store_slots.pop()
        try:
            device.run(self._store_stream, lambda: paged.gather(
                transfer.block_ids, slot, transfer.state_blocks))
            gathered = device.new_event()
            device.record(gathered, self._store_stream)
            host = torch.frombuffer(put.data, dtype=torch.uint8)
            device.wait(self._store_copy_stream, gathered)
            device.run(self._store_copy_stream, lambda: host.copy_(slot, non_blocking=True))
            done = device.new_event()
            device.record(done, self._store_copy_stream)
        except BaseException:
            self._abandon(put, exits, slot)
            raise
        return _Storing(transfer, slot, done, host, put, exits)

    def _end_store(self, storing: _Storing, stored: list[ChunkTransfer]) -> None:
        """Wait for a chunk's DMA and store it (the block of its `putting` ends)."""
        try:
            storing.done.synchronize()
            has_state = bool(self._paged.state_bytes) and self._paged.has_state(storing.host)
        except Exception:
            _log_failed_store(storing.transfer)
            self._abandon(storing.put, storing.exits, storing.slot)
            return
        try:
            storing.exits.close()
        except Exception:
            _log_failed_store(storing.transfer)
            return
        finally:
            self._store_slots.append(storing.slot)
        if storing.put.stored:
            stored.append(storing.transfer)
            if self._paged.state_bytes:
                self._note_state(storing.transfer.key, has_state)

    def _abandon(self, put: PendingPut, exits: ExitStack, slot: torch.Tensor) -> None:
        """End a put without storing it, once nothing queued writes into it or its slot."""
        try:
            for stream in (self._store_stream, self._store_copy_stream):
                drained = self._device.new_event()
                self._device.record(drained, stream)
                drained.synchronize()
        finally:
            put.cancel()
            exits.close()  # stores nothing
            self._store_slots.append(slot)

    # -- buffers --------------------------------------------------------------------------
    def _free_slot(self, copies: deque[tuple[Event, torch.Tensor]],
                   inline: bool) -> torch.Tensor:
        """A free staging buffer: when none is, the oldest of this load's copies (or, on the
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
        """Return the loans and buffers of inline loads whose copies are done."""
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
        pending.loans.close()
        self._give_back(pending.slots, self._load_slots)

    def close(self) -> None:
        """Wait for every queued copy and return what it held."""
        while self._release_oldest():
            pass
