"""Worker side of the kvtier connector: moves KV bytes between vLLM's paged KV and chunks.

Runs in each vLLM worker process, on the model runner's thread. For every chunk of a plan
(`KVTierMetadata`) it gathers the chunk's blocks from every layer into one contiguous
chunk for the store (after the forward pass), or scatters a chunk of the store into the
blocks (before the forward pass, or on the load thread for asynchronous loads).

Asynchronous stores (`KVTierMetadata.stores_async`): a step's stores are one job on the store
thread, which gathers while the engine goes on with the next step. The job of step N is joined
(waited for, if it is still running: it had a whole step) and reported by the end of step N+1
(`finish_step`), on every rank at the same step, so that tensor-parallel reports agree; vLLM
keeps the blocks of a request that ended meanwhile until then (`held`), and the stores reading
a preempted request's blocks finish before the forward that may overwrite them
(`finish_stores`).

The chunk byte order and vLLM's KV layouts are in `paged.py` (`PagedKV`, re-exported
here). The bytes are moved by one of two movers (mover.py's `ChunkMover`): `cpu.py` (one
copy each way: the scatter reads the memory tier's slot in place, the gather writes into one)
and `streams.py` (a device's side streams and events: CUDA): the same plan, the same threads,
the same store jobs (`StoreJob`) joined and reported the same way. On either, the tiers below
RAM are read on the load thread, never on the model runner's.

A store whose request's prefix depends on a block whose load failed is refused (its KV was
computed over unfilled blocks, see messages.py): every tensor-parallel rank refuses it when
one rank's load failed (`agree`).

Primitives: `ConnectorWorker` (and `ChunkStore`, re-exported from chunkstore.py).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future

from kvtier.core.keys import ChunkKey
from kvtier.core.layout import KVLayout
from kvtier.core.threads import IOPool
from kvtier.integrations.vllm.messages import (
    ChunkTransfer,
    KVTierMetadata,
    KVTierWorkerMetadata,
    chunk_meta,
)
from kvtier.integrations.vllm.metrics import KVTierConnectorStats, StatsDelta
from kvtier.integrations.vllm.worker.chunkstore import ChunkStore, LinkMeasuring, LocalLookup
from kvtier.integrations.vllm.worker.cpu import CpuChunkMover, spare_buffers
from kvtier.integrations.vllm.worker.device import Device, Event
from kvtier.integrations.vllm.worker.mover import ChunkMover, StoreJob
from kvtier.integrations.vllm.worker.paged import PagedKV

__all__ = ["ChunkStore", "ConnectorWorker", "PagedKV"]

logger = logging.getLogger(__name__)
# Chunks read at once by a load by default (its spare buffers): slow tiers' reads run in
# parallel.
LOAD_BATCH = 8
# The connector lets a load read more small chunks at once, up to the store's io_threads,
# while they hold at most this: a small chunk's read has fixed costs (open, header, checksum,
# the disk's latency) that more reads in flight hide; a few large ones keep a disk busy.
READ_AHEAD_BYTES = 32 << 20
# How often the tiers' links are measured (the rule's prior for a tier not yet timed; a few
# round trips and, on the link, redis 3 x 2 x 256 KiB: 0.13 s of a 100 Mbit/s link a minute;
# s3 9 MiB, a shared directory 10 MiB: ~0.8 s of it, tiers/s3/link.py, tiers/files/linkfile.py).
LINK_MEASURE_S = 60.0
# A tier's prior is the best of its last LINK_WINDOW measures, and the first ones come
# LINK_FIRST_S apart: a measure taken while the machine is busy (the engine starting up, a
# burst of writes) reads a link slower than it is, and a tier cut by its prior is not tried
# (offer.py), where one estimated too fast is: its first timed loads correct it.
LINK_WINDOW = 3
LINK_FIRST_S = 10.0
# Removed chunks a report decides on the model runner's thread at most (RAM lookups, ~1 us
# each); more in one report (a flood of evictions) are asked on the report thread.
MAX_REMOVED_INLINE = 1024


def load_batch_for(io_threads: int, chunk_bytes: int) -> int:
    """Chunks a load reads at once: `LOAD_BATCH`, more for chunks under 4 MiB (as many as
    `READ_AHEAD_BYTES` holds), never more than the store's `io_threads` (its read threads).
    16 reads of 2 MiB in flight loaded a 4k-token disk hit inside vLLM 0.84-0.88x as long
    as 8 did here (docs/performance.md)."""
    return min(io_threads, max(LOAD_BATCH, READ_AHEAD_BYTES // chunk_bytes))


def len_blocks(layout: KVLayout, block_size: int) -> int:
    """vLLM blocks per kvtier chunk."""
    return layout.tokens_per_chunk // block_size


class ConnectorWorker:
    """Worker-side logic behind KVTierConnector's worker hooks (model runner thread)."""

    def __init__(self, paged: PagedKV, layout: KVLayout, store: ChunkStore,
                 load_batch: int = LOAD_BATCH,
                 agree: Callable[[list[bool]], list[bool]] | None = None,
                 handoff_timeout_s: float | None = None,
                 io_cores: frozenset[int] | None = None,
                 device: Device | None = None) -> None:
        """Args:
            load_batch: chunks a load reads at once (spare buffers each; also a
                prefetch's): a slow tier's reads run in parallel (8 at a time
                read the VM disk here 25-30% faster than 4).
            agree: under tensor parallelism, ORs a list of flags across the ranks (a
                collective every rank enters with the same list length); None: one rank.
            handoff_timeout_s: a kv_producer's: a step that stored chunks waits until they
                reached every tier, at most this long, so that a prefill's KV is in the
                shared tier when its response returns (the decode instance looks it up
                next); None: lower tiers are written behind, the step does not wait.
            io_cores: where the load, store, prefetch and report threads run (like the
                store's: kvtier/core/threads.py); None: on the model runner's cores.
            device: the device of a `paged` not in host memory (streams.py's mover); None:
                CUDA's for CUDA tensors, the CPU mover for host tensors.
        """
        self._paged = paged
        self._store = store
        self._chunk_bytes = layout.bytes_per_chunk
        # The mover: one of two, by where vLLM's KV lives (the same plan, jobs and reports).
        self._mover: ChunkMover
        if device is None and paged.device.type == "cpu":
            self._mover = CpuChunkMover(paged, store, layout.bytes_per_chunk,
                                        self._note_state)
            pinned = None
        else:
            from kvtier.integrations.vllm.worker.device import CudaDevice
            from kvtier.integrations.vllm.worker.streams import StreamChunkMover

            device = device or CudaDevice(paged.device)
            self._mover = StreamChunkMover(paged, store, layout.bytes_per_chunk,
                                           self._note_state, device)
            pinned = device.pinned  # a device copies from pinned host memory asynchronously
        self._device = device  # None: the CPU mover's host tensors (no streams)
        # Where chunks of tiers that cannot lend (disk, shared, redis) are read, as many at a
        # time.
        self._spares = spare_buffers(load_batch, layout.bytes_per_chunk, pinned)
        # Asynchronous loads (vLLM's WAITING_FOR_REMOTE_KVS) run on one load thread with
        # spares of their own, while the model runner goes on with the other requests.
        self._loader = IOPool(1, "kvtier-load", io_cores)
        self._async_spares = spare_buffers(load_batch, layout.bytes_per_chunk, pinned)
        # Asynchronous stores: a step's stores as one job on the store thread, in order.
        self._saver = IOPool(1, "kvtier-store", io_cores)
        # Jobs not yet joined, oldest first: (epoch, plan step, job). The epoch counts binds
        # and step ends: a step's end joins the jobs of earlier epochs, the ones handed over
        # before the plan it ends was bound or before the previous step's end (vLLM's V2
        # runner with speculative decoding runs wait_for_save after get_finished).
        self._saving: deque[tuple[int, int, Future[StoreJob]]] = deque()
        self._epoch = 0
        self._planned_through = -1  # the newest plan whose stores were handed over
        self._reported_through = -1  # `stores_through` of the last report
        # Reads of chunks into the RAM tier ahead of their load (KVTierMetadata.prefetch), on
        # a thread of their own so that they never queue an asynchronous load behind them.
        self._prefetcher = IOPool(1, "kvtier-prefetch", io_cores)
        self._prefetch_spares = spare_buffers(load_batch, layout.bytes_per_chunk)
        self._prefetch_counts: deque[int] = deque()  # chunks each prefetch batch read
        # Chunks a tier removed that no tier holds any more (reported `removed`, so that the
        # scheduler stops planning loads of them): decided here when RAM can tell
        # (`_report_removed`), else found on a thread of their own.
        self._local = store if isinstance(store, LocalLookup) else None
        self._checker = IOPool(1, "kvtier-report", io_cores)
        self._gone: set[ChunkKey] = set()
        self._gone_lock = threading.Lock()
        self._stored_while_checking: set[ChunkKey] = set()  # stored during a `_find_gone`
        # request id -> (its chunks, the load (chunks loaded, past its budget), when it
        # started)
        self._loading: dict[str, tuple[list[ChunkTransfer], Future[tuple[int, bool]],
                                       float]] = {}
        self._failed_block_ids: set[int] = set()
        self._failed_requests: set[str] = set()  # async loads that failed
        self._state_notes: deque[tuple[ChunkKey, bool]] = deque()  # see _note_state
        # Blocks whose load failed, until the scheduler acknowledges it (a later step).
        self._unfilled: set[int] = set()
        self._agree = agree
        self._handoff_timeout_s = handoff_timeout_s
        self._report = KVTierWorkerMetadata()
        self._stats = StatsDelta(rank=layout.tp_rank)
        # Token counts are the engine's, not the sum of its ranks' (each rank moves its own
        # shard of the same tokens): rank 0 counts them; bytes and seconds add up over ranks.
        self._token_scale = 1 if layout.tp_rank == 0 else 0
        self._block_bytes = layout.bytes_per_chunk // len_blocks(layout, paged.block_size)
        # The remote tiers' links, measured once off this thread: the scheduler's estimate
        # of their restore cost before any load is timed (issue 45; loadcost.py).
        # Measured again every LINK_MEASURE_S: a tier judged slow by its estimate is not
        # tried with users' requests (offer.py), so its estimate must follow its link.
        self._priors_s: dict[str, float] = {}
        self._link_history: dict[str, deque[float]] = {}  # tier -> its last estimates
        self._links = store if isinstance(store, LinkMeasuring) else None
        self._load_batch = load_batch
        self._links_measured_s = -math.inf
        self._link_measures = 0

    def place_states(self, meta: KVTierMetadata) -> None:
        """Copy asynchronously loaded states into the blocks this step's forward reads them
        from (groups.py). Before the forward: vLLM calls start_load_kv after it in a step
        without synchronous loads, too late for these. On a device the copies are queued on
        the compute stream, before the forward (their sources were loaded by a load thread
        that waited for its copies)."""
        if not meta.state_copies:
            return

        def place() -> None:
            for group, source, target in meta.state_copies:
                self._paged.copy_state(group, source, target)

        if self._device is None:
            place()
        else:
            self._device.run(self._device.compute_stream(), place)

    def begin_step(self, meta: KVTierMetadata) -> None:
        """Take the step's plan in (before its forward and loads): forget the failures the
        scheduler has acknowledged (vLLM recomputes those blocks from this step on); after a
        cache reset, retire what this rank's tiers hold; extend the pins and expiries the
        plan asks of held chunks; place loaded states; start the
        asynchronous loads, so that they run beside this step's forward (their blocks belong
        to requests the step does not run; on a device, their copies come after the work
        vLLM has queued so far)."""
        self._unfilled -= meta.acked_failed_blocks
        self._epoch += 1
        if meta.retire:  # the weights changed: what this rank's tiers hold leaves first
            logger.info("kvtier: cache reset: %d tier(s) retire what they hold",
                        self._store.retire())
        for transfer in meta.retains:  # held already: extend the pin / expiry
            self._retain(transfer)
        if meta.state_copies:
            self.place_states(meta)
        self.start_async(meta)

    def load(self, meta: KVTierMetadata) -> None:
        """Load every planned chunk into vLLM's blocks; record failures (before forward)."""
        start = time.perf_counter()
        for req_id, transfers in meta.loads.items():
            started = time.perf_counter()
            until = _until(meta.load_budgets_s.get(req_id))
            loaded = self._mover.load(transfers, self._spares, wait=False, until=until)
            # A request's latency, failed loads included (a stalled tier shows in the p99).
            self._stats.observe("load_request_seconds", time.perf_counter() - started, "sync")
            self._account(transfers, loaded, _past(until))
        self._stats.add("load_seconds", time.perf_counter() - start)
        self._take_samples()  # their read time joins this step's stats

    def _take_samples(self) -> None:
        """Move the movers' load samples (inline and asynchronous loads') into the next
        report, counting their time spent waiting for reads. Model runner thread."""
        while self._mover.samples:
            sample = self._mover.samples.popleft()
            self._stats.add("load_read_seconds", sample.read_s)
            self._report.load_samples.append(sample)

    def start_async(self, meta: KVTierMetadata) -> None:
        """Start the step's asynchronous loads not yet started, on the load thread (model
        runner thread): the tiers below RAM are read there, never on this thread."""
        for req_id, transfers in meta.async_loads.items():
            if req_id in self._loading:
                continue
            # Its budget runs from now: a load queued behind another's spends it waiting.
            until = _until(meta.load_budgets_s.get(req_id))
            done = self._loader.submit(self._load_async, transfers, self._mover.mark(), until)
            self._loading[req_id] = (transfers, done, time.perf_counter())

    def _load_async(self, transfers: list[ChunkTransfer], after: Event | None,
                    until: float | None) -> tuple[int, bool]:
        """The load thread's load: chunks loaded, and whether it ended past `until`."""
        loaded = self._mover.load(transfers, self._async_spares, after, until=until)
        return loaded, _past(until)

    def prefetch(self, transfers: list[ChunkTransfer]) -> None:
        """Read the chunks of `transfers` into the RAM tier on the prefetch thread (a read
        from a lower tier is a promotion), up to the first miss (their load stops there too),
        so that their load, a step or more later, is a memcpy; each read carries its chunk's
        tenant (a sealed chunk opens with its key). Model runner thread; the reads are
        bounded by the store's read deadline like any other."""
        if transfers:
            self._prefetcher.submit(self._prefetch, transfers)

    def _prefetch(self, transfers: list[ChunkTransfer]) -> None:
        read = 0
        with self._store.lend_as_landed([t.key for t in transfers], self._prefetch_spares,
                                        [chunk_meta(t) for t in transfers]) as lending:
            for loan in lending:
                loan.release()
                read += 1
        # Counted on the model runner's thread (take_stats): StatsDelta is not locked.
        self._prefetch_counts.append(read)

    def take_finished_loads(self) -> set[str]:
        """Requests whose asynchronous load ended since the last call, loaded or not
        (vLLM's get_finished: a failure is reported like a synchronous one, through the
        failed block ids and the report). Model runner thread."""
        finished = {req_id for req_id, (_, load, _) in self._loading.items() if load.done()}
        for req_id in finished:
            transfers, load, started = self._loading.pop(req_id)
            try:
                loaded, too_slow = load.result()
            except Exception:  # a bug, not an I/O error (those are misses): recompute
                logger.exception("kvtier: asynchronous load of request %s failed", req_id)
                loaded, too_slow = 0, False
            if self._account(transfers, loaded, too_slow):
                self._failed_requests.add(req_id)
            elapsed_s = time.perf_counter() - started
            self._stats.add("async_load_seconds", elapsed_s)
            self._stats.observe("load_request_seconds", elapsed_s, "async")
        return finished

    def _account(self, transfers: list[ChunkTransfer], loaded: int,
                 too_slow: bool = False) -> bool:
        """Record a request's load of `transfers`, of which the first `loaded` arrived
        (`too_slow`: it ended past its budget); whether it failed."""
        for transfer in transfers[:loaded]:
            self._unfilled.difference_update(transfer.written_blocks())
            if transfer.retain_s is not None or transfer.ttl_s is not None:
                self._retain(transfer)  # a hit of a request that pins its prefix
        if loaded < len(transfers):
            # This chunk and the rest of the request are recomputed by vLLM. Report every
            # chunk of the rest the store no longer holds, not just the first: after an
            # outage the scheduler's index otherwise healed one chunk per request, each a
            # failed load (tests/faults/test_engine_faults.py, Redis killed mid-run).
            self._drain_state_notes()
            stateless = transfers[loaded].key in self._report.without_state
            if not stateless:  # a stateless chunk is held: not missing
                self._report.missing.add(transfers[loaded].key)
            self._report.missing.update(t.key for t in transfers[loaded + 1:]
                                        if not self._store.contains(t.key))
            for failed in transfers[loaded:]:
                unfilled = failed.written_blocks()
                self._failed_block_ids.update(unfilled)
                self._unfilled.update(unfilled)
                self._report.failed_blocks.update(unfilled)
            self._stats.add("load_failures", len(transfers) - loaded)
            # The mover does not say why the read failed (gone, corrupt, a tier erring or
            # stalled): one reason for all of them (metrics.LOST_HIT_REASONS), but a load
            # that ran out of its budget (a miss at the deadline counts as one).
            self._stats.add("lost_hit_tokens", self._tokens(transfers[loaded:]),
                            "no_state" if stateless else
                            "load_too_slow" if too_slow else "load_failed")
        for transfer in transfers[:loaded]:
            blocks = transfer.num_blocks - transfer.first_block
            self._stats.add("loaded_tokens",
                            blocks * self._paged.block_size * self._token_scale)
            self._stats.add("loaded_bytes", blocks * self._block_bytes)
        return loaded < len(transfers)

    def _tokens(self, transfers: list[ChunkTransfer]) -> int:
        """The tokens a load of `transfers` writes (the engine's: 0 on ranks but the first)."""
        blocks = sum(t.num_blocks - t.first_block for t in transfers)
        return blocks * self._paged.block_size * self._token_scale

    def _retain(self, transfer: ChunkTransfer) -> None:
        """Extend a held chunk's pin and expiry to what its request asks."""
        self._store.retain(transfer.key, chunk_meta(transfer))

    def store(self, meta: KVTierMetadata) -> None:
        """Store every planned chunk whose KV the forward pass just computed: as a job on the
        store thread (meta.stores_async; joined by `finish_step` of the next step), or now
        (model runner thread, after the forward)."""
        stores = self._safe_stores(meta.stores)
        self._planned_through = max(self._planned_through, meta.step)
        if meta.stores_async and self._handoff_timeout_s is None:
            if stores:
                self._saving.append((self._epoch, meta.step, self._saver.submit(
                    self._mover.store, stores, "async", self._mover.mark())))
            return
        start = time.perf_counter()
        self._record(self._mover.store(stores, "sync"))
        if self._handoff_timeout_s is not None and meta.stores \
                and not self._store.flush(self._handoff_timeout_s):
            logger.warning("kvtier: a prefill's chunks did not reach every tier within %.1f s "
                           "(the decode instance may miss them)", self._handoff_timeout_s)
        self._stats.add("store_wait_seconds", time.perf_counter() - start)

    def _record(self, job: StoreJob) -> None:
        """Report a finished store job's chunks (written, or held already) and count them:
        `stored_tokens` / `stored_bytes` what this engine wrote, `already_held_tokens` what
        the store held already (model runner thread)."""
        if job.stored or job.held:
            # Held again (e.g. a failed load's chunk, stored once recomputed): a check of
            # `_find_gone` made before this store must not report it removed after it.
            with self._gone_lock:
                stored = {t.key for t in (*job.stored, *job.held)}
                self._gone -= stored
                self._stored_while_checking |= stored
            if self._local is not None:
                # Evicted before its job was joined (the job's own later chunks, a job
                # beside it): that removal may have gone in an earlier report than this
                # store, so it goes in this one too, else the scheduler would believe the
                # chunk held.
                self._report.removed.update(
                    key for key in stored if self._local.contains_without_io(key) is False)
        for transfer in job.stored:
            self._report.stored.add(transfer.key)
            self._stats.add("stored_tokens",
                            transfer.num_blocks * self._paged.block_size * self._token_scale)
            self._stats.add("stored_bytes", self._chunk_bytes)
        for transfer in job.held:  # no bytes written: stored before (node mode: HELD)
            self._report.stored.add(transfer.key)
            self._stats.add("already_held_tokens",
                            transfer.num_blocks * self._paged.block_size * self._token_scale)
        self._stats.add("store_seconds", job.seconds)
        self._stats.observe("store_step_seconds", job.seconds, job.mode)

    def finish_stores(self, before_epoch: int | None = None) -> None:
        """Wait for the store jobs not yet joined (all, or those handed over before
        `before_epoch`) and report them (model runner thread: a preemption, the end of a
        step, close)."""
        start = time.perf_counter()
        joined = False
        while self._saving and (before_epoch is None or self._saving[0][0] < before_epoch):
            self._record(self._saving.popleft()[2].result())
            joined = True
        if joined:
            self._stats.add("store_wait_seconds", time.perf_counter() - start)

    def finish_step(self, held: set[str]) -> set[str]:
        """The end of a step (vLLM's get_finished): join the store jobs handed over before
        this step's plan was bound (or before the previous step's end) and return `held`,
        the requests whose blocks vLLM kept for them (each held request's stores were in
        such a job, done now). Model runner thread."""
        self.finish_stores(before_epoch=self._epoch)
        self._epoch += 1
        return held

    @property
    def stores_through(self) -> int:
        """The newest plan whose stores are all done (joined or run): every plan handed over
        before the oldest job still running."""
        return self._saving[0][1] - 1 if self._saving else self._planned_through

    def _safe_stores(self, stores: list[ChunkTransfer]) -> list[ChunkTransfer]:
        """The stores whose KV was not computed over a failed load (of this rank or, through
        `agree`, of any rank); the others are reported skipped and counted."""
        dependent = [t for t in stores if t.depends_on]
        if not dependent:
            return stores
        unsafe = [not self._unfilled.isdisjoint(t.depends_on) for t in dependent]
        if self._agree is not None:
            unsafe = self._agree(unsafe)
        refused = {t.key for t, bad in zip(dependent, unsafe, strict=True) if bad}
        if not refused:
            return stores
        logger.warning("kvtier: not storing %d chunk(s) computed over a failed load (they "
                       "are stored once vLLM has recomputed them)", len(refused))
        self._report.skipped.update(refused)
        # The same chunks on every rank (agree): counted once, like tokens.
        self._stats.add("unsafe_stores_skipped", len(refused) * self._token_scale)
        return [t for t in stores if t.key not in refused]

    def take_stats(self) -> KVTierConnectorStats | None:
        """Counter deltas since the last call (vLLM's get_kv_connector_stats)."""
        while self._prefetch_counts:
            self._stats.add("prefetched_chunks", self._prefetch_counts.popleft())
        self._stats.observe_store(self._store.stats())
        return self._stats.take()

    def _note_state(self, key: ChunkKey, has_state: bool) -> None:
        """Whether a chunk stored or loaded holds the state at its end; those without one go
        in the next report (any thread: asynchronous loads note from the load thread)."""
        self._state_notes.append((key, has_state))

    def _drain_state_notes(self) -> None:
        """Move the state notes into the report (model runner thread)."""
        while self._state_notes:
            key, has_state = self._state_notes.popleft()
            if not has_state:
                self._report.without_state.add(key)

    def take_failed_block_ids(self) -> set[int]:
        """Block ids whose load failed since the last call (vLLM's
        get_block_ids_with_load_errors). None with several KV cache groups: block ids are
        per group there, and vLLM 0.32 stops with a RuntimeError on any; those models load
        asynchronously and a failure is reported by request (`take_failed_requests`)."""
        failed, self._failed_block_ids = self._failed_block_ids, set()
        return failed if self._paged.kv_cache_groups == 1 else set()

    def take_failed_requests(self) -> set[str]:
        """Requests whose asynchronous load failed since the last call (vLLM's
        failed_recving: the request is recomputed from its first token)."""
        failed, self._failed_requests = self._failed_requests, set()
        return failed if self._paged.kv_cache_groups > 1 else set()

    def take_report(self) -> KVTierWorkerMetadata | None:
        """The stored / missing / removed keys and the tiers' events since the last call,
        or None when there are none."""
        self._drain_state_notes()
        self._mover.release()
        self._report.stores_through = self.stores_through
        removed = []
        for event in self._store.take_events():
            self._report.events.append(event)
            if event.kind == "removed":
                removed.append(event.key)
        now = time.monotonic()
        every_s = LINK_MEASURE_S if self._link_measures >= LINK_WINDOW else LINK_FIRST_S
        if self._links is not None and now >= self._links_measured_s + every_s:
            self._links_measured_s = now
            self._link_measures += 1
            self._checker.submit(self._measure_links, self._links, self._load_batch)
        if removed:
            self._report_removed(list(dict.fromkeys(removed)))
        with self._gone_lock:
            gone, self._gone = self._gone, set()
            priors, self._priors_s = self._priors_s, {}
        self._report.removed |= gone
        self._report.tier_priors_s.update(priors)
        self._take_samples()
        report = self._report
        if not (report.stored or report.missing or report.removed or report.events
                or report.skipped or report.failed_blocks or report.without_state
                or report.load_samples or report.tier_priors_s
                or report.stores_through != self._reported_through):
            return None
        self._report = KVTierWorkerMetadata()
        self._reported_through = report.stores_through
        return report

    def _report_removed(self, keys: list[ChunkKey]) -> None:
        """Report the `keys` (removed from a tier) that no tier holds any more. Those the RAM
        tier answers for (held there or on their way below; no tier below it) are decided now,
        `MAX_REMOVED_INLINE` at most, so that this report, the one of the step whose stores
        evicted them, carries them: an engine that goes idle after it sends no other before
        its next request, and a chunk the scheduler still believes held is offered to that
        request, a load that fails and a recompute (issue 45: 116-145 chunks a run of
        `kvtier bench trace` under LRU; tests/engine/test_evicted_chunks.py). Whether a
        lower tier still holds the others is asked off this thread (its lookup hops through
        the store's stall guard: ~90 us, a third of a chunk's gather); the answer joins a
        later report. Model runner thread."""
        unsure = keys
        if self._local is not None:
            unsure = keys[MAX_REMOVED_INLINE:]
            for key in keys[:MAX_REMOVED_INLINE]:
                held = self._local.contains_without_io(key)
                if held is None:
                    unsure.append(key)
                elif not held:
                    self._report.removed.add(key)
        if unsure:
            self._checker.submit(self._find_gone, unsure)

    def _measure_links(self, store: LinkMeasuring, load_batch: int) -> None:
        """Estimate each remote tier's seconds per chunk from its link, `load_batch` reads
        at once (report thread); the next report carries them (the scheduler logs them)."""
        priors = {}
        for tier, speed in store.measure_links().items():
            history = self._link_history.setdefault(tier, deque(maxlen=LINK_WINDOW))
            history.append(speed.read_s(self._chunk_bytes, load_batch))
            priors[tier] = min(history)
        if priors:
            logger.debug("kvtier: remote tiers' estimated restore seconds per chunk, before "
                        "any load: %s", {tier: round(s, 4) for tier, s in priors.items()})
        with self._gone_lock:
            self._priors_s.update(priors)

    def _find_gone(self, keys: list[ChunkKey]) -> None:
        """Note the `keys` (removed from a tier) that no tier holds any more (checker thread).
        A chunk stored while they are asked (`_record`) is not reported: the scheduler would
        forget a chunk its tiers hold (a damaged chunk removed, then stored again once
        recomputed). The tiers are asked outside the lock: the model runner's `_record` never
        waits for a slow tier."""
        with self._gone_lock:
            self._stored_while_checking = set()
        gone = {key for key in keys if not self._store.contains(key)}  # no lock: may wait
        with self._gone_lock:
            self._gone |= gone - self._stored_while_checking

    def close(self, flush_timeout_s: float | None = None) -> None:
        """Finish the store jobs (memory copies: they end) and the running load (its reads
        bounded by `read_timeout_s`), then, all in at most `flush_timeout_s`: the running
        prefetch and lookups of removed chunks (a call stuck in a tier that stopped answering
        is not waited for past it: those threads end whenever the tier answers), the
        write-behind queues, the store."""
        deadline = None if flush_timeout_s is None else time.monotonic() + flush_timeout_s
        self.finish_stores()
        self._saver.shutdown(wait=True)
        self._loader.shutdown(wait=True, cancel_futures=True)
        for pool in (self._checker, self._prefetcher):
            pool.shutdown(wait=False, cancel_futures=True)
        for pool in (self._checker, self._prefetcher):
            if not pool.join(_left(deadline)):
                logger.warning("kvtier: a %s call still running at the close's deadline; "
                               "not waited for", pool.name)
        self._mover.close()
        self._store.close(_left(deadline))


def _left(deadline: float | None) -> float | None:
    """The seconds left until `deadline` (time.monotonic; None: no deadline), at least 0."""
    return None if deadline is None else max(0.0, deadline - time.monotonic())


def _until(budget_s: float | None) -> float | None:
    """The deadline (time.monotonic) of a load given `budget_s` from now; None: none."""
    return None if budget_s is None else time.monotonic() + budget_s


def _past(until: float | None) -> bool:
    """Whether deadline `until` (time.monotonic; None: none) has passed."""
    return until is not None and time.monotonic() >= until
