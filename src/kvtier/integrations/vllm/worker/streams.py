"""Chunk loads and stores for a `PagedKV` on a device (CUDA), ordered by streams and events: the
device mover, beside cpu.py's (mover.ChunkMover). It orders its work only through the `Device`
protocol (device.py), so CI runs this very code against a CPU stand-in device whose copies run
late, on threads, and any missing wait corrupts data a test checks (tests/connector/
test_stream_mover.py); scripts/gpu-check.sh runs it on a GPU.

Loads. The worker calls `load` on its load thread (asynchronous loads: a hit below RAM is read
there, never on the model runner's thread) or inline on the model runner's thread (hits in
RAM). The chunks are borrowed from the store as they land (`TieredStore.lend_as_landed`, as
the CPU mover's: the memory tier lends its pinned slots; a slower tier is read, in parallel,
into pinned spares); the chunks go in batches (`batch_chunks`), a batch queued once full or
once it holds every spare: on the load copy stream copy each chunk's host bytes -> its place
in a device staging buffer; on the load stream wait for those copies and for `after` (vLLM's
work queued when the load was planned: the blocks may have belonged to a request whose
kernels are still queued), scatter the whole batch into its blocks (one index upload and one
kernel: pagedbatch.py), record `done`. The copy engine moves batch i+1 while the SMs scatter
batch i (one stream for both ran them one after the other: 0.85x a raw copy at 32 MiB chunks
on an H200). Batches, not chunks, because at 2 MiB a chunk's host work (a reservation, an
index upload, a kernel, a DMA, two events, a stream wait: ~100-130 us on an H200) outlasted
its DMA (~40 us) (issue 47). On the load thread the call waits
for `done` before the load is reported (vLLM schedules the request only then). Inline, the
compute stream waits for `done` instead, so the forward starts no earlier than its KV is in
place and the host never waits for the copy (but for chunks a node lent: their slots'
stamps are checked once their copy is done, before the load is reported, as on the load
thread: `ChunkView.unchanged`); the loans (which keep the RAM slots from being
reused) and the staging buffers are returned once `done` is reached (`release`, once a step).
Each chunk stays lent until its batch's `done` (`Loan.release_after`): its spare then takes
another read.

States (models with state layers, groups.py): a chunk's state region rides in the same
staging buffer as its KV, and `PagedKV.scatter` / `gather` copy it in the same queued work as
the KV, so it is ordered by the same waits and events. Whether a chunk holds a state is read
from the host bytes before its copy is queued (a load that needs one stops at a chunk without,
as the CPU mover's does), and from the host bytes once a store's DMA is done.

Stores. The worker calls `store` on its store thread with `after` marked on the model runner's
thread by `wait_for_save` (the forward that wrote the blocks). The step's places are planned
in one round (`plan_puts`: the node's store reserves them in one round trip), then each
chunk's place is reserved in the memory tier (`TieredStore.putting`: a pinned slot, no host
staging copy; nothing is copied when the tier holds the chunk already); a batch of reserved
chunks is gathered on the store stream into a staging buffer after `after` (one index upload,
one kernel), and on the store copy stream each chunk is DMA'd straight into its slot. Up to one
batch per staging buffer is in flight: the store thread waits for the oldest batch's DMAs and
commits its chunks (none before its `done`) while later batches are gathered and copied (one
chunk at a time, waited for before the next, ran at 0.1-0.6x a raw copy on an H200); the model
runner never waits, whatever the step's number of chunks. A chunk whose place cannot be
reserved is not stored; a batch whose gather cannot be queued is not stored at all (logged:
future misses), and what it held is given back. The blocks cannot change meanwhile: a
request that ends keeps its blocks until the worker has joined the job (vLLM's
finished_sending), and a preemption joins it before the next forward (worker.py).

Staging buffers are a small pool per direction (`staging_buffers`: 64 MiB of device memory
per direction, 2 to 32 chunks, cut into buffers of a batch, at least 2; allocated at start-up,
after vLLM sized its KV cache, logged); a load or store that finds none free waits for the
oldest copy (microseconds to milliseconds of DMA), on its own thread.

Primitives: `StreamChunkMover`, `staging_buffers`, `batch_chunks`.
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
from kvtier.core.loans import Loan
from kvtier.core.store import ChunkView, PendingPut
from kvtier.integrations.vllm.transfers import ChunkTransfer, LoadSample, chunk_meta
from kvtier.integrations.vllm.worker.chunkstore import ChunkStore
from kvtier.integrations.vllm.worker.device import Device, Event
from kvtier.integrations.vllm.worker.mover import StoreJob
from kvtier.integrations.vllm.worker.paged import PagedKV
from kvtier.integrations.vllm.worker.pagedbatch import PagedBatches

logger = logging.getLogger(__name__)
MiB = 1 << 20
STAGING_BYTES = 64 * MiB  # device staging memory per direction, at least 2 buffers


def staging_buffers(chunk_bytes: int) -> int:
    """Chunks of staging per direction for chunks of `chunk_bytes`: 64 MiB of them, at least
    2 (a copy overlaps a scatter) and at most 32: small chunks need more in flight to keep the
    copy engine busy."""
    return max(2, min(32, STAGING_BYTES // chunk_bytes))


def batch_chunks(staging: int) -> int:
    """Chunks a batch for `staging` chunks of staging per direction: a quarter of them, so
    that four batches are in flight (two threads load at once, and an inline load's buffers
    stay out until its copies are done), at least 1."""
    return max(1, staging // 4)


def _log_failed_store(transfer: ChunkTransfer) -> None:
    """Log the exception being handled: the chunk is not stored (a future miss)."""
    logger.exception("kvtier: store of chunk %s failed", transfer.key.hex()[:16])


@dataclass(slots=True)
class _Reserved:
    """A store's chunk whose place is reserved (its `putting` block open)."""

    transfer: ChunkTransfer
    put: PendingPut
    exits: ExitStack  # the `putting` block: closing it stores the chunk


@dataclass(slots=True)
class _Storing:
    """A batch of a store's chunks in flight: one gather and their DMAs queued."""

    chunks: list[_Reserved]
    slot: torch.Tensor  # staging buffer, the chunks one after the other
    done: Event  # every DMA into the chunks' `put.data` is done
    hosts: list[torch.Tensor]  # their `put.data`


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
                 staging: int | None = None, batch: int | None = None) -> None:
        """Args:
            note_state: told, for models with state layers, whether each chunk loaded or
                stored holds the state at its end (any thread), as cpu.CpuChunkMover's.
            device: where `paged` lives; its streams and events order every copy.
            staging: chunks of device staging per direction (None: `staging_buffers`).
            batch: chunks a batch (None: `batch_chunks`); the staging is cut into buffers of
                a batch, at least 2.
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
        self._batch = batch or batch_chunks(staging)
        self._batches = PagedBatches(paged, chunk_bytes)
        self._chunk_bytes = chunk_bytes
        buffers = max(2, staging // self._batch)
        self._load_slots: queue.Queue[torch.Tensor] = queue.Queue()
        self._store_slots: list[torch.Tensor] = []  # one store at a time
        for _ in range(buffers):
            self._load_slots.put(device.empty(self._batch * chunk_bytes))
            self._store_slots.append(device.empty(self._batch * chunk_bytes))
        # Where a chunk the memory tier declines is copied before the lower tiers get it.
        self._spare = device.pinned(chunk_bytes).numpy().data
        self._pending: deque[_Pending] = deque()  # inline loads, oldest first
        self._pending_lock = threading.Lock()
        self.samples: deque[LoadSample] = deque()
        logger.info("kvtier: %s: %d MiB of staging buffers on the device (%d per direction, "
                    "%d chunks each)", device.name, 2 * buffers * self._batch * chunk_bytes >> 20,
                    buffers, self._batch)

    @property
    def index_counts(self) -> Counter[str]:
        """Index uploads and index kernels queued so far (`kvtier bench mover`)."""
        return self._batches.counts

    def mark(self) -> Event:
        """An event at the end of the work queued so far on the calling thread's compute
        stream (model runner thread)."""
        event = self._device.new_event()
        self._device.record(event, self._device.compute_stream())
        return event

    # -- loads ----------------------------------------------------------------------------
    def load(self, transfers: list[ChunkTransfer], spares: MutableSequence[memoryview],
             after: Event | None = None, wait: bool = True, until: float | None = None) -> int:
        """See mover.ChunkMover.load. `spares` must be pinned host memory (`spare_buffers`
        with the device's allocator: a spare replaced after an abandoned read stays pinned)."""
        started, lent_by, read_s = time.perf_counter(), Counter[str](), 0.0
        self._device.wait(self._load_stream, after or self.mark())
        inline = not wait
        copies: deque[tuple[Event, torch.Tensor]] = deque()  # this load's batches, queued
        batch: list[Loan[ChunkView]] = []  # landed, not queued yet
        in_spares = 0  # of them, read into the caller's spares
        stateless: int | None = None  # a chunk that holds no state the load needs
        in_place = True  # every chunk lent where it lies (none in a spare)
        # Chunks whose slot may be another chunk's by the end of their copy (a node's
        # lending taken back): checked once the copies are done, before the load is reported.
        checked: list[tuple[int, ChunkView]] = []
        with ExitStack() as held:
            # Chunks are queued a batch at a time as their reads land, the first landed first
            # (in order for models with state layers, as the CPU mover's); their host bytes
            # stay lent until their batch's copy is done, and a spare then takes the next
            # read. A batch holding every spare is queued at once: the lending needs one back.
            lending = held.enter_context(self._store.lend_as_landed(
                [t.key for t in transfers], spares, [chunk_meta(t) for t in transfers],
                in_order=bool(self._paged.state_bytes), until=until))
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
                if loan.view.unchanged is not None:
                    checked.append((loan.index, loan.view))
                batch.append(loan)
                in_spares += not loan.in_place
                if len(batch) == self._batch or in_spares >= len(spares):
                    self._queue_loads(batch, transfers, copies, inline)
                    batch, in_spares = [], 0
                reading = time.perf_counter()
            else:
                read_s += time.perf_counter() - reading
            if batch:
                self._queue_loads(batch, transfers, copies, inline)
            loaded = lending.stopped_at if stateless is None else stateless
            # Spares are the caller's and its next load reads into them again: an inline
            # load from them waits for its copies, as a load thread does; so does one that
            # stopped at a miss. An inline load of chunks lent in place (RAM) does not: the
            # compute stream waits for its copies, and the loans (which keep the RAM slots
            # from being reused) and staging buffers are returned once they are done
            # (`release`, once a step). Chunks a node lent do not go that way: a lending
            # the node took back (this engine frozen past its lease_timeout_s) may have had
            # its slot written again under the copy, which only a check once the copy is
            # done tells, before vLLM is told the load is done.
            if copies and inline and in_place and loaded == len(transfers) and not checked:
                last = copies[-1][0]  # one load stream: the load's copies are before it
                self._device.wait(self._device.compute_stream(), last)
                with self._pending_lock:
                    self._pending.append(_Pending(last, [s for _, s in copies],
                                                  held.pop_all()))
            elif copies:
                copies[-1][0].synchronize()
                self._give_back([s for _, s in copies], self._load_slots)
                for index, view in checked:  # in key order, as node lendings are
                    if index < loaded and not view.copied_whole():
                        loaded = index  # its blocks and the rest are recomputed
                        break
        if loaded < len(transfers):
            if stateless is None and lending.failed_tier is not None:
                lent_by[lending.failed_tier] += 1  # a failed read costs its tier its time
                self.samples.append(LoadSample.since(started, lent_by, read_s,
                                                     failed=not lending.expired))
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

    def _queue_loads(self, loans: list[Loan[ChunkView]], transfers: list[ChunkTransfer],
                     copies: deque[tuple[Event, torch.Tensor]], inline: bool) -> None:
        """A batch: each chunk's host bytes -> a staging buffer on the load copy stream, then
        the buffer -> the chunks' blocks and state blocks in one scatter on the load stream
        (after the load's `after`); the loans end once it is done."""
        device, batches, size = self._device, self._batches, self._chunk_bytes
        plan = batches.plan_scatter([transfers[loan.index] for loan in loans])
        slot = self._free_slot(copies, inline)
        # No tensor of the lent bytes outlives its copy in this frame.
        hosts = [torch.frombuffer(loan.view.data, dtype=torch.uint8) for loan in loans]

        def dma() -> None:
            for i, host in enumerate(hosts):
                slot[i * size:(i + 1) * size].copy_(host, non_blocking=True)

        device.run(self._load_copy_stream, dma)
        copied = device.new_event()
        device.record(copied, self._load_copy_stream)
        device.wait(self._load_stream, copied)
        device.run(self._load_stream, lambda: batches.scatter(plan, slot))
        done = device.new_event()
        device.record(done, self._load_stream)
        copies.append((done, slot))
        for loan in loans:
            loan.release_after(done)

    # -- stores ---------------------------------------------------------------------------
    def store(self, transfers: list[ChunkTransfer], mode: str,
              after: Event | None = None) -> StoreJob:
        """See mover.ChunkMover.store. The chunks go a batch at a time, up to one batch per
        staging buffer in flight: the gather of one, the DMAs of another and the commits of
        a third overlap."""
        start = time.perf_counter()
        self._device.wait(self._store_stream, after or self.mark())
        self._store.plan_puts([t.key for t in transfers], [chunk_meta(t) for t in transfers])
        stored: list[ChunkTransfer] = []
        held: list[ChunkTransfer] = []  # held already: nothing copied, or nothing written
        flight: deque[_Storing] = deque()  # oldest first
        batch: list[_Reserved] = []  # reserved, not queued yet
        try:
            for transfer in transfers:
                if not batch and not self._store_slots:
                    self._end_stores(flight.popleft(), stored, held)
                try:
                    reserved = self._reserve(transfer, held)
                except Exception:  # a failed store is a future miss, never a dead thread
                    _log_failed_store(transfer)
                    continue
                if reserved is None:
                    continue
                batch.append(reserved)
                in_spare = not reserved.put.in_place  # the one spare: ends before the next
                if len(batch) == self._batch or in_spare:
                    self._queue_stores(batch, flight)
                    batch = []
                    while in_spare and flight:
                        self._end_stores(flight.popleft(), stored, held)
            if batch:
                self._queue_stores(batch, flight)
                batch = []
        finally:
            for reserved in batch:  # an exception left them unqueued: nothing writes them
                reserved.put.cancel()
                reserved.exits.close()
            while flight:
                self._end_stores(flight.popleft(), stored, held)
        return StoreJob(stored, time.perf_counter() - start, mode, held)

    def _reserve(self, transfer: ChunkTransfer, held: list[ChunkTransfer]) -> _Reserved | None:
        """Reserve the chunk's place in the store; None when there is nothing to copy (the
        store holds it already: then it goes in `held`, or takes it nowhere)."""
        exits = ExitStack()
        put = exits.enter_context(self._store.putting(transfer.key, self._spare,
                                                      chunk_meta(transfer)))
        if put.data is None:
            exits.close()
            if put.held:
                held.append(transfer)
            return None
        return _Reserved(transfer, put, exits)

    def _queue_stores(self, batch: list[_Reserved], flight: deque[_Storing]) -> None:
        """Queue a batch's gather into a staging buffer (store stream) and each chunk's DMA
        into its place (store copy stream). A batch that cannot be queued is not stored
        (logged; future misses), its places and buffer given back."""
        device, batches, size = self._device, self._batches, self._chunk_bytes
        slot = self._store_slots.pop()
        try:
            plan = batches.plan_gather([reserved.transfer for reserved in batch])
            device.run(self._store_stream, lambda: batches.gather(plan, slot))
            gathered = device.new_event()
            device.record(gathered, self._store_stream)
            hosts = [torch.frombuffer(r.put.data, dtype=torch.uint8) for r in batch
                     if r.put.data is not None]

            def dma() -> None:
                for i, host in enumerate(hosts):
                    host.copy_(slot[i * size:(i + 1) * size], non_blocking=True)

            device.wait(self._store_copy_stream, gathered)
            device.run(self._store_copy_stream, dma)
            done = device.new_event()
            device.record(done, self._store_copy_stream)
        except BaseException as error:
            self._abandon(batch, slot)
            if not isinstance(error, Exception):
                raise
            for reserved in batch:
                _log_failed_store(reserved.transfer)
            return
        flight.append(_Storing(batch, slot, done, hosts))

    def _end_stores(self, storing: _Storing, stored: list[ChunkTransfer],
                    held: list[ChunkTransfer]) -> None:
        """Wait for a batch's DMAs and store its chunks (the blocks of their `putting`
        end): no chunk is committed before its bytes are in place. Each goes in `stored`,
        or in `held` when the store found it held (a top tier without slots)."""
        try:
            storing.done.synchronize()
        except Exception:
            for reserved in storing.chunks:
                _log_failed_store(reserved.transfer)
            self._abandon(storing.chunks, storing.slot)
            return
        try:
            for reserved, host in zip(storing.chunks, storing.hosts):
                self._commit(reserved, host, stored, held)
        finally:
            self._store_slots.append(storing.slot)

    def _commit(self, reserved: _Reserved, host: torch.Tensor,
                stored: list[ChunkTransfer], held: list[ChunkTransfer]) -> None:
        """Store one chunk whose DMA is done; one that fails is logged and not stored."""
        has_state = False
        try:
            has_state = bool(self._paged.state_bytes) and self._paged.has_state(host)
        except Exception:
            _log_failed_store(reserved.transfer)
            reserved.put.cancel()
        try:
            reserved.exits.close()
        except Exception:
            _log_failed_store(reserved.transfer)
            return
        if reserved.put.stored:
            (held if reserved.put.held else stored).append(reserved.transfer)
            if self._paged.state_bytes:
                self._note_state(reserved.transfer.key, has_state)

    def _abandon(self, chunks: list[_Reserved], slot: torch.Tensor) -> None:
        """End puts without storing them, once nothing queued writes into them or `slot`."""
        try:
            for stream in (self._store_stream, self._store_copy_stream):
                drained = self._device.new_event()
                self._device.record(drained, stream)
                drained.synchronize()
        finally:
            try:
                for reserved in chunks:
                    reserved.put.cancel()
                    reserved.exits.close()  # stores nothing
            finally:
                self._store_slots.append(slot)

    # -- buffers --------------------------------------------------------------------------
    def _free_slot(self, copies: deque[tuple[Event, torch.Tensor]],
                   inline: bool) -> torch.Tensor:
        """A free staging buffer: when none is, the oldest of this load's copies (or, on the
        model runner's thread, of earlier inline loads) is waited for; else another thread's
        copy, which ends in bounded time (its read is done before it takes a buffer). An
        inline load's buffers are taken back as soon as its copies are done, on any thread:
        its loans wait for `release`, its buffers need not (a load thread could otherwise
        wait for the model runner's next step)."""
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
                try:
                    return self._load_slots.get(timeout=0.001)
                except queue.Empty:
                    self._reclaim_buffers()

    def _reclaim_buffers(self) -> None:
        """Take back the staging buffers of inline loads whose copies are done (any thread;
        their loans stay out until `release`)."""
        with self._pending_lock:
            done = [p for p in self._pending if p.slots and p.done.query()]
            taken = [slot for p in done for slot in p.slots]
            for p in done:
                p.slots = []
        self._give_back(taken, self._load_slots)

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
