"""Chunk loads and stores for a `PagedKV` in host memory (vLLM's CPU backend): the CPU mover,
beside streams.py's device mover (mover.ChunkMover). The worker (worker.py) decides what moves
and when, and on which thread; a mover moves the bytes.

Loads borrow each chunk on its own (`TieredStore.borrow_many`), as many at once as the caller
has spare buffers: the memory tier lends its slots and the scatter reads them in place, and a
slower tier's chunks are read in parallel into slots the memory tier reserves (or into the
spares), so a load is one copy; each chunk is scattered as soon as its read lands, the first
landed first, while the next reads run. Stores gather straight into a slot the memory tier
reserves (`TieredStore.put_from`), one copy too. Every complete load is timed (`LoadSample`, for
load_mode "auto": loadcost.py).

Primitives: `CpuChunkMover`.
"""

from __future__ import annotations

import logging
import mmap
import time
import warnings
from collections import Counter, deque
from collections.abc import Callable, Generator, MutableSequence
from contextlib import ExitStack, closing
from dataclasses import dataclass

import torch

from kvtier.core.keys import ChunkKey
from kvtier.core.loans import Loans
from kvtier.core.store import ChunkView
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
                  allocate: Callable[[int], torch.Tensor] | None = None) -> list[memoryview]:
    """`count` chunk buffers: of `allocate(nbytes)` (a device's pinned memory), or plain host
    memory, page-aligned so that a disk tier reads into them with O_DIRECT (torch's own
    allocations are 64-byte aligned: each read then landed in a staging buffer and was copied
    once more) and allocated lazily by the OS (untouched until a slow tier is read into it)."""
    if allocate is not None:
        return [allocate(chunk_bytes).numpy().data for _ in range(count)]
    return [memoryview(mmap.mmap(-1, chunk_bytes)) for _ in range(count)]


@dataclass(slots=True)
class _Borrow:
    """One chunk's borrow (`TieredStore.borrow_many` of one key) into its spare `slot`."""

    lent: Loans[ChunkView]
    tried: dict[int, str]
    stack: ExitStack
    slot: int

    def close(self) -> int:
        """End the borrow (a read still running is waited for); its slot, free again."""
        self.stack.close()
        return self.slot


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
             after: Event | None = None, wait: bool = True) -> int:
        """Scatter a request's chunks from the store into their blocks, slower tiers' reads
        landing in `spares` (the caller's: as many reads run at once); the number loaded
        before the first miss (the blocks of any chunk scattered after it are recomputed by
        vLLM, as the miss's are). Done when it returns (`after`, `wait`: unused).

        Raises:
            ValueError: no spare buffer.
        """
        if not spares:
            raise ValueError("a load needs at least one spare buffer")
        started, lent_by, read_s = time.perf_counter(), Counter[str](), 0.0
        reading = started
        with closing(self._lent_as_landed(transfers, spares)) as chunks:
            # Each chunk is scattered as soon as its read lands, while later ones are still
            # read. One thread: memory bandwidth, not the CPU, bounds a scatter; two threads
            # scattered 1.25x slower than one here (docs/performance.md).
            for index, view, failed_tier in chunks:
                read_s += time.perf_counter() - reading
                transfer = transfers[index]
                if view is None:
                    if failed_tier is not None:  # a failed read costs its tier its time, too
                        lent_by[failed_tier] += 1
                        self.samples.append(LoadSample.since(started, lent_by, read_s,
                                                             failed=True))
                    return index
                lent_by[view.tier] += 1
                chunk = torch.frombuffer(view.data, dtype=torch.uint8)
                if self._paged.state_bytes:
                    has_state = self._paged.has_state(chunk)
                    self._note_state(transfer.key, has_state)
                    if transfer.state_blocks and not has_state:
                        # A hit must end on a chunk with its state (one found by a probe
                        # after a restart may have none): recompute, then back off.
                        logger.info("kvtier: chunk %s holds no state; recomputed",
                                    transfer.key.hex()[:16])
                        return index
                self._paged.scatter(chunk, transfer.block_ids, transfer.first_block,
                                    transfer.state_blocks)
                reading = time.perf_counter()
        self.samples.append(LoadSample.since(started, lent_by, read_s))
        return len(transfers)

    def _lent_as_landed(self, transfers: list[ChunkTransfer],
                        spares: MutableSequence[memoryview],
                        ) -> Generator[tuple[int, ChunkView | None, str | None]]:
        """(i, chunk i lent or None, the tier that failed its read or None), each chunk as
        soon as its read lands, the first landed first; a chunk lent stays valid until the
        next one is asked for. A None comes once every chunk before it was lent, and ends
        the loan: no chunk after it is read any more, nor lent once the miss is known.

        Each chunk is borrowed on its own into a free spare, as many at once as there are
        spares, and the next as soon as one is free: a read that lands late holds up no
        other (a batch waited for its slowest read before the next batch's reads started;
        taken in order, chunks that had landed waited behind it). Models with state layers
        take them in order (a chunk's state goes into the request's state blocks: none may
        be written past a miss). A spare a borrow replaced (an abandoned read may still
        write into the old one) is handed back to `spares` when the generator ends."""
        in_order = bool(self._paged.state_bytes)
        slots = [[spare] for spare in spares]  # borrow_many replaces an abandoned one
        free = list(range(len(slots)))
        open_: dict[int, _Borrow] = {}
        following, end = 0, len(transfers)  # no read starts at `end`, the first miss, or past it
        missed: str | None = None  # the tier that failed the read at `end`, if one did
        try:
            while following < end or open_:
                while free and following < end:
                    open_[following] = self._borrow(transfers[following], slots, free.pop())
                    following += 1
                if not open_:
                    break
                if in_order:
                    i = min(open_)
                else:
                    Loans.wait_any(borrow.lent for borrow in open_.values())
                    i = min(j for j, borrow in open_.items() if borrow.lent.landed())
                borrow = open_.pop(i)
                view = borrow.lent[0]
                if view is None:
                    end, missed = i, borrow.tried.get(0)
                    for j in [j for j in open_ if j > i]:  # lent past a miss: never used
                        free.append(open_.pop(j).close())
                else:
                    yield i, view, None
                free.append(borrow.close())
            if end < len(transfers):
                yield end, None, missed
        finally:
            for borrow in open_.values():
                borrow.close()
            spares[:len(slots)] = [slot[0] for slot in slots]

    def _borrow(self, transfer: ChunkTransfer, slots: list[list[memoryview]], slot: int,
                ) -> _Borrow:
        """Borrow `transfer`'s chunk alone, read (if it must be) into spare `slot`."""
        tried: dict[int, str] = {}  # the tier that failed the read, if one did
        stack = ExitStack()  # nothing to close if the borrow raises
        lent = stack.enter_context(self._store.borrow_many(
            [transfer.key], slots[slot], [chunk_meta(transfer)], tried))
        return _Borrow(lent, tried, stack, slot)

    def store(self, transfers: list[ChunkTransfer], mode: str,
              after: Event | None = None) -> StoreJob:
        """Gather and put `transfers` in order (model runner thread: mode "sync", or the
        store thread: "async"). A chunk that raises is logged and not stored: a cache misses
        it later, the engine goes on."""
        start = time.perf_counter()
        stored = []
        for transfer in transfers:
            try:
                # A chunk the top tier holds already (e.g. a prefix vLLM itself had cached)
                # counts as stored without a copy; lower tiers are asked off this thread.
                if self._store_chunk(transfer):
                    stored.append(transfer)
            except Exception:
                logger.exception("kvtier: store of chunk %s failed", transfer.key.hex()[:16])
        return StoreJob(stored, time.perf_counter() - start, mode)

    def release(self) -> None:
        """Nothing is held past a call (mover.ChunkMover)."""

    def close(self) -> None:
        """Nothing is queued (mover.ChunkMover)."""

    def _store_chunk(self, transfer: ChunkTransfer) -> bool:
        """Gather one chunk and put it in the store; True when stored."""
        gathered: list[bool] = []

        def gather(view: memoryview) -> None:
            chunk = torch.frombuffer(view, dtype=torch.uint8)
            self._paged.gather(transfer.block_ids, chunk, transfer.state_blocks)
            gathered.append(self._paged.has_state(chunk))

        # Straight into a memory-tier slot (one copy), or into the mover's buffer first.
        stored = self._store.put_from(transfer.key, gather, self._buffer,
                                      meta=chunk_meta(transfer))
        if stored and gathered and self._paged.state_bytes:
            self._note_state(transfer.key, gathered[0])
        return stored
