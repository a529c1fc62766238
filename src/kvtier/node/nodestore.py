"""kvtier's store in node mode (`NodeStore`): the chunks the connector's worker and movers
load and store live in the node's shared-memory slab, mapped here through a `NodeClient`.

Chunks are lent and filled in place in the slab; only offsets cross the socket, one round
trip per load (`Borrow`, its reply streamed in parts as the node's reads below RAM land:
node/stream.py) and one per step's stores (`Reserve`, from `plan_puts`); commits and
releases are sent without waiting. A load of chunks whose slots this engine knows (it stored
them, or was lent them before) takes no round trip: it holds the slots by their locks in the
slab's file (`kvtier.tiers.shmslab.SlabReader`, one syscall each on this thread, no wait for
the node's thread to be scheduled), reads them in place, having told the node (`Touch`, no
reply awaited: recent for its policy); a slot that holds another chunk by now is forgotten,
and the load borrows as before. A lent chunk's slot stamp is checked once its copy is done
(a lending the node took back: a failed load). A failed call is a miss or a dropped store,
counted (the client's deadlines: node/client.py).

Primitives: `NodeStore`.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, MutableSequence, Sequence
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np

from kvtier.core.keys import ChunkKey
from kvtier.core.loans import Hold, Lending
from kvtier.core.retention import DEFAULT_META, ChunkMeta
from kvtier.core.store import ChunkView, PendingPut, StoreEvent, StoreStats
from kvtier.core.tier import Failure, LinkSpeed, TierCounters
from kvtier.errors import NodeUnavailable
from kvtier.node.client import TIER, NodeClient
from kvtier.node.protocol import (
    BELOW_TIER,
    HELD,
    MAX_KEYS,
    RAM_TIER,
    SEND,
    SKIPPED,
    Answer,
    Borrow,
    Commit,
    Flush,
    Found,
    Lent,
    Lookup,
    MeasureLinks,
    Meta,
    Release,
    Reserve,
    Reserved,
    Retain,
    Touch,
)
from kvtier.node.stream import LentStream, PartFuture
from kvtier.tiers.shmslab import SlotStamps

log = logging.getLogger(__name__)
# Slots remembered for reads in place (a key and an offset each: ~100 B); the oldest are
# forgotten first (their chunks then borrowed).
KNOWN_SLOTS = 1 << 16


class _NodeLending(Lending[ChunkView]):
    """A `Lending` of chunks in the node's slab; `end` (once, when it closes) releases the
    node's lease or the slots' locks."""

    def __init__(self, end: Callable[[], None], *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self._end: Callable[[], None] | None = end

    def close(self) -> None:
        try:
            super().close()
        finally:
            end, self._end = self._end, None
            if end is not None:
                end()


@dataclass(slots=True)
class _Planned:
    lease: int
    index: int
    offset: int  # or HELD / SKIPPED / SEND
    generation: str | None  # of the node that reserved it (a restarted node's is gone)
    connection: socket.socket | None  # that reserved it: its slots end with it
    last: bool = False  # the reservation's last slot: its commit is waited for

    @property
    def is_open(self) -> bool:
        """Whether it waits for a commit: a slot to fill, or bytes to send."""
        return self.offset >= 0 or self.offset == SEND


class NodeStore:
    """kvtier's store in node mode (`integrations.vllm.worker.chunkstore.ChunkStore`): every
    tier is the node's. Thread-safe; `lend_as_landed` and stores per thread as the movers
    use them."""

    def __init__(self, client: NodeClient, chunk_bytes: int) -> None:
        self._client = client
        self._chunk_bytes = chunk_bytes
        self._counters = TierCounters(TIER, 0)
        # The chunks the node read from its tiers below RAM for this engine's loads (and the
        # stores RAM had no slot for, sent for those tiers), as the engine's tier
        # `node-below`: `node` counts what came from the node's RAM, and every miss.
        self._below = TierCounters(BELOW_TIER, 0)
        # Calls to the node that failed, by reason (`Failure` value): the `node` tier's
        # `tier_failures` on the engine's /metrics, as the store counts an in-process tier's.
        self._failures: dict[str, int] = {}
        self._failures_lock = threading.Lock()
        self._planned: dict[ChunkKey, _Planned] = {}
        self._planned_lock = threading.Lock()
        # Chunk -> (node generation, slab offset) where this engine stored it or was lent it
        # (reads in place); a slot that holds another chunk by now is forgotten when tried.
        self._slots: OrderedDict[ChunkKey, tuple[str, int]] = OrderedDict()
        self._slots_lock = threading.Lock()
        # Copies of lent chunks whose slot the node had written again by the time the copy
        # was done (a lending taken back: this engine was frozen past the node's
        # lease_timeout_s): failed loads, each recomputed. Logged at the first.
        self.reused_copies = 0

    # -- loads ------------------------------------------------------------------------------
    def lend_as_landed(self, keys: Sequence[ChunkKey], spares: MutableSequence[memoryview],
                       metas: Sequence[ChunkMeta] = (), *, in_order: bool = False,
                       until: float | None = None) -> Lending[ChunkView]:
        """The chunks the node lends, in key order until its first miss (a node unavailable:
        a miss at the first chunk, charged to the tier "node"): one streamed Borrow, each
        chunk lent as soon as its part of the reply comes (node/stream.py). `until`
        (time.monotonic): the node abandons its reads below RAM not landed by then."""
        metas = list(metas) or [DEFAULT_META] * len(keys)
        if len(metas) != len(keys):
            raise ValueError(f"{len(metas)} metas for {len(keys)} keys")
        in_place = self._read_in_place(keys, spares, in_order)
        if in_place is not None:
            return in_place
        start = time.perf_counter()
        budget = None if until is None else max(0.0, until - time.monotonic())
        try:
            # The node abandons its reads below RAM at the budget: it answers by then. The
            # chunks past MAX_KEYS (a node refuses more) are never lent: misses.
            first = self._client.call(Borrow(list(keys[:MAX_KEYS]),
                                             [Meta.of(m) for m in metas[:MAX_KEYS]], budget,
                                             stream=True), Lent, extra_s=budget or 0.0)
        except NodeUnavailable as exc:
            self._failed(exc)
            first, unavailable = Lent(0, [], [], None), True
        else:
            unavailable = False
        generation = self._client.generation()
        try:  # the whole slab, of the generation that lends: kept until the load ends
            slab = None if unavailable else self._client.view()
        except NodeUnavailable as exc:  # let go since the reply (the node restarted)
            self._client.drop_own()  # the lease ends with the connection
            self._failed(exc)
            first, unavailable, slab = Lent(0, [], [], None), True, None
        deadline_s = self._client.timeout_s + (budget or 0.0)

        stamps: list[SlotStamps | None] = []  # the slab's, read once a part carries stamps

        def views_of(part: Lent, first_index: int) -> list[ChunkView]:
            sent = iter(part.data)  # the chunks at SEND offsets: RAM had no slot for them

            def chunk(offset: int) -> memoryview:
                if offset == SEND:
                    return memoryview(next(sent))
                assert slab is not None  # a part came: the borrow was answered
                return slab[offset:offset + self._chunk_bytes]

            if part.stamps and not stamps and slab is not None:
                stamps.append(self._stamps_of(slab))
            marks = part.stamps if len(part.stamps) == len(part.offsets) \
                else [-1] * len(part.offsets)
            views = [ChunkView(chunk(offset).toreadonly(), self._engine_tier(tier),
                               self._unchanged(stamps[0], keys[first_index + n], offset, mark)
                               if stamps and offset >= 0 and mark >= 0 else None)
                     for n, (offset, tier, mark) in enumerate(zip(part.offsets, part.tiers,
                                                                  marks))]
            if generation is not None:
                self._know([(key, generation, offset) for key, offset
                            in zip(keys[first_index:], part.offsets) if offset >= 0])
            below = sum(view.tier == BELOW_TIER for view in views)
            self._counters.add(hits=len(views) - below,
                               bytes_read=(len(views) - below) * self._chunk_bytes)
            self._below.add(hits=below, bytes_read=below * self._chunk_bytes)
            return views

        stream = LentStream(first, views_of,
                            lambda timeout_s: self._client.receive(Lent, timeout_s),
                            self._engine_tier, deadline_s)
        if unavailable:
            stream.failed_tier = RAM_TIER  # the node: a miss at the first chunk

        def release() -> None:
            # The load's time, shared by its chunks' tiers (one reply: not timed apart).
            seconds = (stream.ended_at or time.perf_counter()) - start
            below = sum(view.tier == BELOW_TIER for view in stream.views)
            below_s = seconds * below / len(stream.views) if stream.views else 0.0
            self._counters.add(misses=int(len(stream.views) < len(keys)),
                               read_s=seconds - below_s)
            self._below.add(read_s=below_s)
            if stream.broken:  # the connection failed mid-stream (the node went away)
                self._count_failure(Failure.UNAVAILABLE)
            if not stream.ended and not stream.finish(self._client.timeout_s):
                self._client.drop_own()  # a late part must not answer the next request;
                return  # the lease ends with the connection
            if stream.lease and self._client.generation() == generation:
                self._client.tell(Release(stream.lease))

        # Each chunk not in the first part waits for its part as long as the whole reply
        # could take (the client's timeout and the load's budget, which the node uses).
        return _NodeLending(release, len(keys), spares, in_order=True,
                            lend=lambda i, _hold: stream.views[i] if i < len(stream.views)
                            else None,
                            read=lambda i, hold, _spare: PartFuture(stream, i, hold),
                            timeout_s=deadline_s, late=lambda _tier: None)

    @staticmethod
    def _stamps_of(slab: memoryview) -> SlotStamps | None:
        """The stamps of `slab` (the whole file, as mapped); None for a slab without them."""
        try:
            return SlotStamps(np.frombuffer(slab, dtype=np.uint8))
        except ValueError:
            return None

    def _unchanged(self, stamps: SlotStamps | None, key: ChunkKey, offset: int, stamp: int
                   ) -> Callable[[], bool] | None:
        """A lent chunk's check after its copy (`ChunkView.unchanged`): whether its slot's
        stamp is still the one it was lent with. A slot written again since (the node took
        the lending back, this engine frozen past its lease_timeout_s, and gave the slot to
        another chunk) is counted and logged (the first time; then at debug), and the copy
        a failed load."""
        if stamps is None:
            return None

        def unchanged() -> bool:
            if stamps.unchanged(offset, stamp):
                return True
            self._counters.add(misses=1)
            with self._failures_lock:
                self.reused_copies += 1
                first = self.reused_copies == 1
            log.log(logging.WARNING if first else logging.DEBUG,
                    "kvtier: chunk %s: its slot in the node's slab was given to another chunk "
                    "during its copy (its lending taken back: this engine held it past the "
                    "node's lease_timeout_s); a failed load, recomputed", key.hex()[:16])
            return False

        return unchanged

    def _read_in_place(self, keys: Sequence[ChunkKey], spares: MutableSequence[memoryview],
                       in_order: bool) -> Lending[ChunkView] | None:
        """All of `keys` lent from slots this engine knows, each held by its lock (no
        round trip), or None (nothing held): one is not known, or its slot holds another
        chunk by now (forgotten), or this thread has mapped no slab yet."""
        mapped = self._client.reader()
        if mapped is None or not keys:
            return None
        generation, reader = mapped
        start = time.perf_counter()
        with self._slots_lock:
            known = [self._slots.get(key) for key in keys]
        held: list[int] = []
        for key, slot in zip(keys, known):
            index = None if slot is None or slot[0] != generation \
                else slot[1] // reader.slot_bytes
            if index is None or not reader.lock(index, key):
                for taken in held:
                    reader.unlock(taken)
                if slot is not None:
                    with self._slots_lock:
                        self._slots.pop(key, None)
                return None
            held.append(index)
        try:
            views = [ChunkView(self._client.view(index * reader.slot_bytes,
                                                 self._chunk_bytes).toreadonly(), RAM_TIER)
                     for index in held]
        except NodeUnavailable:  # the slab was let go meanwhile (the node restarted)
            for taken in held:
                reader.unlock(taken)
            return None
        # Recent for the node's policy now, as a borrow is when lent (no reply awaited): a
        # chunk being read is the last the node should pick to evict.
        self._client.tell(Touch(list(keys[:MAX_KEYS])))
        self._counters.add(hits=len(keys), bytes_read=len(keys) * self._chunk_bytes,
                           read_s=time.perf_counter() - start)

        def release() -> None:
            for index in held:
                reader.unlock(index)

        def never(_i: int, _hold: Hold, _spare: memoryview) -> Future[ChunkView | None]:
            raise AssertionError("every chunk is lent in place")

        return _NodeLending(release, len(keys), spares, in_order=in_order,
                            lend=lambda i, _hold: views[i], read=never,
                            timeout_s=self._client.timeout_s, late=lambda _tier: None)

    def _engine_tier(self, node_tier: str) -> str:
        """The engine's name of the node's tier `node_tier` (RAM_TIER or BELOW_TIER: what a
        load costs, for the load-or-recompute rule)."""
        welcome = self._client.welcome
        ram = welcome.tiers[0] if welcome is not None and welcome.tiers else None
        return RAM_TIER if ram is None or node_tier == ram else BELOW_TIER

    def measure_links(self) -> dict[str, LinkSpeed]:
        """The slowest link of the node's remote tiers (`LinkMeasuring`), as BELOW_TIER's:
        the load-or-recompute rule's prior for a load from below the node's RAM (empty: the
        node has none, or is unavailable). Blocking (the node measures them)."""
        try:
            links = self._client.call(MeasureLinks(), Answer, slow=True).value
        except NodeUnavailable:
            return {}
        speeds = [LinkSpeed(float(rtt), float(bps)) for rtt, bps in links.values()] \
            if isinstance(links, dict) else []
        if not speeds:
            return {}
        return {BELOW_TIER: max(speeds, key=lambda s: s.read_s(self._chunk_bytes))}

    def _know(self, slots: Sequence[tuple[ChunkKey, str, int]]) -> None:
        """Remember where chunks lie in the slab: (key, generation, offset)."""
        with self._slots_lock:
            for key, generation, offset in slots:
                self._slots[key] = (generation, offset)
                self._slots.move_to_end(key)
            while len(self._slots) > KNOWN_SLOTS:
                self._slots.popitem(last=False)

    @contextmanager
    def borrow(self, key: ChunkKey, spare: memoryview,
               meta: ChunkMeta = DEFAULT_META) -> Iterator[ChunkView | None]:
        with self.lend_as_landed([key], [spare], [meta]) as lending:
            loan = next(iter(lending), None)
            yield None if loan is None else loan.view

    def get_into(self, key: ChunkKey, out: memoryview,
                 meta: ChunkMeta = DEFAULT_META) -> str | None:
        with self.borrow(key, out, meta) as view:
            if view is None:
                return None
            out[:] = view.data
            return view.tier if view.copied_whole() else None

    def contains(self, key: ChunkKey) -> bool:
        try:
            return self._client.call(Lookup([key]), Found).held[0]
        except NodeUnavailable as exc:
            self._failed(exc)
            return False

    # -- stores -----------------------------------------------------------------------------
    def plan_puts(self, keys: Sequence[ChunkKey], metas: Sequence[ChunkMeta]) -> None:
        """Reserve slots for a step's stores in one round trip (`put_from` / `putting` of
        each key then fills its slot). Slots reserved before and never filled are given
        back."""
        with self._planned_lock:
            stale, self._planned = list(self._planned.values()), {}
        for planned in stale:
            if planned.is_open and planned.generation == self._client.generation():
                self._client.tell(Commit(planned.lease, planned.index, False))
        self._reserve(keys, metas)

    def _reserve(self, keys: Sequence[ChunkKey], metas: Sequence[ChunkMeta]) -> None:
        """Reserve a slot for each key (once: a key twice in a step is reserved for its first
        store, its second a round trip of its own; reserved twice, the first slot was never
        committed nor given back until the connection ended), beside those planned."""
        unique: dict[ChunkKey, ChunkMeta] = {}
        for key, meta in zip(keys, metas):
            unique.setdefault(key, meta)
        keys, metas = list(unique)[:MAX_KEYS], list(unique.values())[:MAX_KEYS]  # the rest:
        if not keys:  # a round trip each
            return
        try:
            reserved = self._client.call(Reserve(list(keys), [Meta.of(m) for m in metas]),
                                         Reserved)
        except NodeUnavailable as exc:
            self._failed(exc)
            return
        generation = self._client.generation()
        connection = self._client.current_connection()
        last = max((i for i, offset in enumerate(reserved.offsets)
                    if offset >= 0 or offset == SEND), default=-1)
        with self._planned_lock:
            for i, (key, offset) in enumerate(zip(keys, reserved.offsets)):
                self._planned[key] = _Planned(reserved.lease, i, offset, generation,
                                              connection, i == last)

    def _slot(self, key: ChunkKey, meta: ChunkMeta) -> _Planned | None:
        with self._planned_lock:
            planned = self._planned.pop(key, None)
        if planned is None:  # not planned: a round trip of its own; the step's others stay
            self._reserve([key], [meta])
            with self._planned_lock:
                planned = self._planned.pop(key, None)
        return planned

    def put_from(self, key: ChunkKey, fill: Callable[[memoryview], None],
                 spare: memoryview, meta: ChunkMeta = DEFAULT_META) -> bool:
        with self.putting(key, spare, meta) as put:
            if put.data is not None:
                fill(put.data)
        return put.stored

    @contextmanager
    def putting(self, key: ChunkKey, spare: memoryview,
                meta: ChunkMeta = DEFAULT_META) -> Iterator[PendingPut]:
        """The chunk's slot in the node's slab to fill (`data`; None: held already, or no
        slot); committed when the block ends, given back if it raises or is cancelled.
        Where the node's RAM has no slot but a tier below it takes the chunk (SEND), `data`
        is `spare`, sent with the commit (not `stored`: not in RAM, as in process)."""
        start = time.perf_counter()
        planned = self._slot(key, meta)
        if planned is not None and planned.is_open and not self._client.start_writing(
                planned.connection, planned.generation):
            # Its connection ended, or is to be dropped (the node frees its slots), or the
            # node restarted since: the slot may be someone else's.
            planned = None
        if planned is None or not planned.is_open:
            held = planned is not None and planned.offset == HELD
            if (planned is not None and planned.offset == SKIPPED) or planned is None:
                self._counters.add(dropped_writes=1)
            yield PendingPut(None, in_place=False, stored=held)
            return
        assert planned.connection is not None  # start_writing said so
        try:  # the connection is kept open until nothing can write the slot any more
            yield from self._fill(key, planned, spare, start)
        finally:
            self._client.end_writing(planned.connection)

    def _fill(self, key: ChunkKey, planned: _Planned, spare: memoryview, start: float
              ) -> Iterator[PendingPut]:
        """`putting`'s block for a slot (or SEND) reserved on a connection kept open."""
        sent = planned.offset == SEND
        try:
            put = PendingPut(spare, in_place=False) if sent else \
                PendingPut(self._client.view(planned.offset, self._chunk_bytes), in_place=True)
        except NodeUnavailable:  # the slab was let go since the check (the node restarted)
            self._counters.add(dropped_writes=1)
            yield PendingPut(None, in_place=False, stored=False)
            return
        filled = False
        try:
            yield put
            filled = not put.cancelled
        finally:
            data = bytes(spare[:self._chunk_bytes]) if sent and filled else None
            commit = Commit(planned.lease, planned.index, filled, reply=planned.last,
                            data=data)
            if not planned.last:
                # Not sent (the node died since the step's Reserve): never stored. It was
                # counted stored, and put_from said True, for a chunk the node never had.
                if not self._client.tell(commit) and filled:
                    self._count_failure(Failure.UNAVAILABLE)
                    filled = False
            else:  # the step's last: every commit before it is done when it is answered
                try:
                    applied = self._client.call(commit, Answer).value
                except NodeUnavailable as exc:
                    self._failed(exc)
                    filled = False  # maybe stored, maybe not: not reported stored
                else:
                    # False: the slot was not the connection's that sent it (the call's
                    # retry, on a new connection, to a node restarted since): not stored.
                    if applied is False and filled:
                        self._count_failure(Failure.UNAVAILABLE)
                        filled = False
        put.stored = filled and not sent
        if put.stored and planned.generation is not None:
            self._know([(key, planned.generation, planned.offset)])
        if filled:
            (self._below if sent else self._counters).add(
                puts=1, bytes_written=self._chunk_bytes, write_s=time.perf_counter() - start)

    def put(self, key: ChunkKey, data: memoryview, meta: ChunkMeta = DEFAULT_META) -> bool:
        def copy(slot: memoryview) -> None:
            slot[:] = data
        return self.put_from(key, copy, data, meta)

    # -- the rest of ChunkStore ---------------------------------------------------------------
    def retain(self, key: ChunkKey, meta: ChunkMeta) -> int:
        try:
            value = self._client.call(Retain(key, Meta.of(meta)), Answer).value
        except NodeUnavailable as exc:
            self._failed(exc)
            return 0
        return value if isinstance(value, int) else 0

    def retire(self) -> int:
        """Nothing: the node's chunks belong to every engine on it; a reset engine's new keys
        never find the old ones (its epoch), which age out of the node's tiers."""
        return 0

    def flush(self, timeout_s: float | None = None) -> bool:
        try:
            return self._client.call(Flush(timeout_s), Answer).value is True
        except NodeUnavailable as exc:
            self._failed(exc)
            return False

    def _failed(self, exc: NodeUnavailable) -> None:
        """Count a call the node failed: `timeout` where it did not answer within the
        deadline, `unavailable` otherwise (down, refused, restarting, or not asked while the
        watch waits for it to answer: the in-process store's open circuit breaker)."""
        cause: BaseException | None = exc
        while cause is not None and not isinstance(cause, TimeoutError):
            cause = cause.__cause__
        self._count_failure(Failure.TIMEOUT if cause is not None else Failure.UNAVAILABLE)

    def _count_failure(self, reason: Failure) -> None:
        with self._failures_lock:
            self._failures[reason.value] = self._failures.get(reason.value, 0) + 1

    def stats(self) -> StoreStats:
        """This engine's traffic with the node, as two tiers (the node's own tiers: its
        status, `kvtier node status`): "node", its RAM (and every miss), and "node-below",
        what the node read from its tiers below RAM and the stores sent for them; and its
        calls the node failed, by reason (a node down or stopped: `StoreStats.failures`, the
        engine's `tier_failures`)."""
        with self._failures_lock:
            failures = {TIER: dict(self._failures)} if self._failures else {}
        return StoreStats(tiers=(self._counters.snapshot(), self._below.snapshot()),
                          queued_writes=0, queue_drops={}, failures=failures)

    def take_events(self) -> list[StoreEvent]:
        return []  # the node announces its own tiers' chunks, once for every engine

    def close(self, flush_timeout_s: float | None = None) -> None:
        self._client.close()
