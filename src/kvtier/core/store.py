"""The tiered store: tiers composed fastest first, with lookup, get-and-promote and
write-behind.

- `lookup(keys)`: the longest prefix of `keys` held by any tier, and which tier holds each.
- `get_into(key, out, meta)`: read from the highest tier that holds the chunk (a failed or
  corrupt read falls through to the next tier), then promote the chunk to the tiers above it.
- `borrow(key, spare, meta)`: the same as a read-only view for the duration of a `with`
  block: a tier that lends views (`InPlace`: the memory tier) is read in place, without a
  copy; any other tier is read straight into a slot the top tier reserves (the read is the
  promotion), else into `spare` (and promoted).
- `lend_as_landed(keys, spares, metas)`: the read path of loads. The same for a run of
  chunks, each lent as soon as its read lands (`loans.Lending`): the slower tiers' chunks are
  read in parallel into the caller's spares, each waited for at most `read_timeout_s`; it
  stops at the first miss; the borrower decides how long each chunk stays lent.
- `put(key, data, meta)`: store in the top tier at once; lower tiers are written behind, on
  their own threads, through bounded queues (`writebehind.WriteBehind`): when a queue is
  full the write is dropped and counted, never blocking the caller. `put_from(key, fill,
  spare, meta)` has the chunk written straight into a reserved slot of the top tier (the
  vLLM worker's gather); `putting` is the same in two halves, for a caller that keeps
  several chunks in flight (a device's DMAs).
Every call carries the chunk's `ChunkMeta` (tenant, pin, expiry; `DEFAULT_META` by default)
down to each tier it reaches: a sealed chunk opens, and is sealed, with its tenant's key.
Whether a tier holds a chunk already is its own `put`'s (or `reserve`'s) decision: the store
and the write-behind never ask first.
A tier call that fails is counted per tier and per `Failure` reason (`StoreStats.failures`);
a tier that raises is skipped for that call (logged, counted as `Failure.RAISED`): a broken
tier costs hits, never the engine. A tier below the top one that does not answer in time
(a dead NFS mount, a server that never replies) is abandoned for that call, counted as
`Failure.TIMEOUT`, and skipped until it answers again (`stall.StallGuard`): a stalled tier
costs hits, never a hung engine. Only the top tier (RAM) is called on the caller's thread;
`get_into`, `borrow` and `lookup` are the unbounded exceptions, for tools and tests.

The store receives its tiers already built (`kvtier.tiers.open_store` builds them from a
config): the core does not know which tiers exist.

Primitives: `TieredStore`, `StoreSettings`, `LookupResult`, `ChunkView`, `PendingPut`,
`StoreEvent`, `StoreStats`.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping, MutableSequence, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field, replace
from typing import TypeVar

from kvtier.core.copies import CopyPool
from kvtier.core.keys import ChunkKey
from kvtier.core.loans import Hold, Lending
from kvtier.core.retention import DEFAULT_META, ChunkMeta, RetentionStats
from kvtier.core.stall import StallGuard, call_within
from kvtier.core.tier import (
    BatchLookup,
    EventKind,
    EventSource,
    Failure,
    InPlace,
    LinkProbe,
    LinkSpeed,
    MetaKeeper,
    Retiring,
    Tier,
    TierResult,
    TierStats,
    Warmable,
)
from kvtier.core.writebehind import FailureCounts, WriteBehind

log = logging.getLogger(__name__)
T = TypeVar("T")
MAX_PENDING_EVENTS = 1 << 16
CLOSE_GRACE_S = 1.0  # a lower tier's close, at least, under a close's deadline


@dataclass(frozen=True, slots=True)
class StoreSettings:
    """How the store runs its tiers (the store-wide part of
    `kvtier.tiers.storeconfig.StoreConfig`)."""

    write_queue_depth: int = 64  # chunks waiting per lower tier before writes are dropped
    io_threads: int = 16  # threads for parallel reads (`lend_as_landed`)
    io_cores: frozenset[int] | None = None  # where the store's threads run (None: inherit)
    # A read (or lookup) of a tier below the top not finished by then is abandoned: a miss,
    # and the tier is skipped until it answers again.
    read_timeout_s: float = 5.0
    # tier name -> threads writing behind to it; a lower tier missing here gets one
    write_threads: Mapping[str, int] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class LookupResult:
    """The longest available prefix of the keys asked about."""

    num_chunks: int  # keys[:num_chunks] are all held somewhere
    tiers: tuple[str, ...]  # the name of the (fastest) tier holding each of them


@dataclass(frozen=True, slots=True)
class ChunkView:
    """A chunk lent by `TieredStore.borrow`: valid only inside its `with` block."""

    data: memoryview  # the payload, read-only (a tier's own memory, or the caller's spare)
    tier: str  # the name of the tier that served it
    # Asked once a copy out of `data` is done: False when its bytes may have been another
    # chunk's meanwhile (a node's lending taken back, its slot written again: node/client.py),
    # so that copy is a failed load, never used. None: nothing can change them while lent.
    unchanged: Callable[[], bool] | None = None

    def copied_whole(self) -> bool:
        """Whether a copy out of `data`, done now, is this chunk (`unchanged`)."""
        return self.unchanged is None or self.unchanged()


@dataclass(slots=True)
class PendingPut:
    """A chunk being stored by `TieredStore.putting`: valid only inside its `with` block."""

    data: memoryview | None  # where the caller writes the chunk; None: nothing to write
    in_place: bool  # `data` is the top tier's own slot (else the caller's spare, or None)
    stored: bool = False  # set when the block ends: as `put_from` returns
    cancelled: bool = False
    # Set when the block ends: a top tier without slots (a disk-only store) found it held
    # by its put (`TierResult.held`): `data` was filled, but nothing written.
    found_held: bool = False

    def cancel(self) -> None:
        """Store nothing when the block ends (the fill failed or never finished)."""
        self.cancelled = True

    @property
    def held(self) -> bool:
        """Whether the store held the chunk already: `stored`, and nothing was filled (no
        bytes copied) or the top tier wrote nothing (`found_held`); the worker counts it
        apart from the chunks it wrote."""
        return self.stored and (self.data is None or self.found_held)


@dataclass(frozen=True, slots=True)
class StoreEvent:
    """A chunk a tier stored or removed (evicted, deleted, found corrupt)."""

    kind: EventKind  # a str enum: compares equal to "stored" / "removed"
    key: ChunkKey
    tier: str  # the tier's name
    # A removal of a chunk the tier held when it last retired (`Retiring`: this engine's
    # cache reset) and not stored since: vLLM's AllBlocksCleared announced it gone already.
    retired: bool = False


@dataclass(frozen=True, slots=True)
class StoreStats:
    """Counters of every tier, fastest first, plus what the store itself saw fail."""

    tiers: tuple[TierStats, ...]
    queued_writes: int  # write-behind jobs waiting or running now
    queue_drops: dict[str, int]  # tier name -> writes dropped because its queue was full
    # tier name -> Failure value -> tier calls made by the store that failed for that reason
    failures: dict[str, dict[str, int]] = field(default_factory=dict)
    # tier name -> its pins, expiries and per-tenant usage (tiers that are MetaKeepers)
    retention: dict[str, RetentionStats] = field(default_factory=dict)


class TieredStore:
    """Tiers in order, fastest first. Every method is safe to call from any thread."""

    def __init__(self, tiers: Sequence[Tier], settings: StoreSettings | None = None) -> None:
        """Compose `tiers` (built, fastest first; the store owns them from now on: `close`
        closes them). `kvtier.tiers.open_store` builds them from a config.

        Raises:
            ValueError: no tiers, or two with one name.
        """
        names = [tier.name for tier in tiers]
        if not names or len(set(names)) != len(names):
            raise ValueError(f"a store needs one or more tiers with distinct names: {names}")
        self.settings = settings = settings or StoreSettings()
        self.tiers: list[Tier] = list(tiers)
        self._failures = FailureCounts()
        self._copies = CopyPool()  # the write-behind's copies of chunks
        self._below = [
            WriteBehind(tier, settings.write_queue_depth,
                         settings.write_threads.get(tier.name, 1), self._failures,
                         settings.io_cores)
            for tier in self.tiers[1:]
        ]
        self._calls = StallGuard(settings.io_threads, settings.read_timeout_s,
                                 cores=settings.io_cores)
        # Each tier's optional abilities, checked once: a runtime Protocol isinstance costs
        # ~3 us, and loads asked it per chunk per tier (a quarter of a memory-tier borrow).
        self._lenders: dict[int, InPlace] = {
            id(t): t for t in self.tiers if isinstance(t, InPlace)}
        # A top tier that reserves space is filled in place: by the caller's gather
        # (`put_from`) and by reads of slower tiers (promotion without a copy).
        self._reserver = self._lenders.get(id(self.tiers[0]))
        self._batched = [t for t in self.tiers if isinstance(t, BatchLookup)]
        self._remote = {id(t) for t in self._batched}  # read without a lookup first
        # Tiers that keep each chunk's tenant, pin and expiry (kvtier.core.retention).
        self._keepers: dict[int, MetaKeeper] = {
            id(t): t for t in self.tiers if isinstance(t, MetaKeeper)}
        # What tiers stored and removed, until `take_events`; bounded so that a store nobody
        # drains keeps only the newest events.
        self._events: deque[StoreEvent] = deque(maxlen=MAX_PENDING_EVENTS)
        for tier in self.tiers:
            if isinstance(tier, EventSource):
                tier.events.listen(self._on_tier_event)
        warmable = [t for t in self.tiers if isinstance(t, Warmable)]
        if warmable:  # connections for the reads in flight, before the first load needs them
            threading.Thread(target=_warm, args=(warmable, settings.io_threads), daemon=True,
                             name="kvtier-warm").start()

    def _on_tier_event(self, tier: str, kind: EventKind, key: ChunkKey, retired: bool) -> None:
        self._events.append(StoreEvent(kind, key, tier, retired))  # deque.append: thread-safe

    def take_events(self) -> list[StoreEvent]:
        """Chunks stored in and removed from each tier since the last call, in order."""
        events = []
        while self._events:
            events.append(self._events.popleft())
        return events

    # -- lookups ---------------------------------------------------------------------------
    def lookup(self, keys: Sequence[ChunkKey]) -> LookupResult:
        """The longest prefix of `keys` held by some tier. Stats one file per key per tier
        at most (shared directory); index lookups elsewhere; one batch per remote tier."""
        # A tier with BatchLookup (a remote store) answers every key in one round trip up
        # front, rather than one round trip per key.
        batched = {id(t): self._contains_many(t, keys) for t in self._batched}
        holders: list[str] = []
        for i, key in enumerate(keys):
            tier = next((t for t in self.tiers if (batched[id(t)][i] if id(t) in batched
                                                   else self._contains(t, key))), None)
            if tier is None:
                break
            holders.append(tier.name)
        return LookupResult(len(holders), tuple(holders))

    def contains(self, key: ChunkKey) -> bool:
        """Whether some tier holds the chunk, or a write behind to one is on its way (index
        lookups; one stat for a shared tier). Tiers below the top are asked with the read
        deadline (a stalled one: False)."""
        return (self._contains(self.tiers[0], key)
                or any(key in writer.inflight for writer in self._below)
                or any(self._calls.call(tier.name, False, self._contains, tier, key)
                       for tier in self.tiers[1:]))

    def contains_without_io(self, key: ChunkKey) -> bool | None:
        """`contains` as far as the top tier (RAM) and the write-behind queues can tell,
        without asking a lower tier: True when the top tier holds the chunk or a write
        behind carries it, False when there is no lower tier, else None (only `contains`
        can tell). Never waits: fit for a latency-critical thread."""
        if self._contains(self.tiers[0], key) or any(key in w.inflight for w in self._below):
            return True
        return False if not self._below else None

    def contains_many(self, keys: Sequence[ChunkKey]) -> list[bool]:
        """`contains` of each key, with one batch per remote tier (`BatchLookup`) rather
        than a round trip per key."""
        batched = {id(t): self._contains_many(t, keys) for t in self._batched}
        return [self._contains(self.tiers[0], key)
                or any(key in writer.inflight for writer in self._below)
                or any(batched[id(tier)][i] if id(tier) in batched
                       else self._calls.call(tier.name, False, self._contains, tier, key)
                       for tier in self.tiers[1:])
                for i, key in enumerate(keys)]

    def _contains_many(self, tier: BatchLookup, keys: Sequence[ChunkKey]) -> list[bool]:
        try:
            return tier.contains_many(keys)
        except Exception as exc:
            log.warning("tier %r: batch lookup failed (%s); treated as misses",
                        getattr(tier, "name", "?"), exc)
            return [False] * len(keys)

    def _contains(self, tier: Tier, key: ChunkKey) -> bool:
        try:
            return tier.contains(key)
        except Exception as exc:
            log.warning("tier %r: lookup failed (%s); treated as a miss", tier.name, exc)
            return False

    # -- reads -----------------------------------------------------------------------------
    def get_into(self, key: ChunkKey, out: memoryview,
                 meta: ChunkMeta = DEFAULT_META) -> str | None:
        """Copy the chunk (whose tenant `meta` names) into `out`; return the name of the tier
        that served it, or None.

        A tier whose copy is missing, corrupt, unreadable or sealed under a key this
        process lacks is skipped for the next one. `out` holds undefined bytes when this
        returns None.
        """
        for level, tier in enumerate(self.tiers):
            if not self._contains(tier, key):
                continue
            if self._get(tier, key, out, meta):
                self._promote(level, key, out, meta)
                return tier.name
        return None

    def _get(self, tier: Tier, key: ChunkKey, out: memoryview, meta: ChunkMeta) -> bool:
        """`tier.get_into`, its failure (or exception) counted; True on a hit."""
        try:
            result = tier.get_into(key, out, meta)
        except Exception as exc:
            log.warning("tier %r: read of %s failed (%s: %s); trying the next", tier.name,
                        key.hex(), type(exc).__name__, exc)
            result = TierResult(Failure.RAISED)
        return self._counted(tier, result)

    def _counted(self, tier: Tier, result: TierResult, faults: list[str] | None = None,
                 ) -> bool:
        """Count `result`'s failure, if any (and note the tier in `faults` when the failure
        is the tier's); whether it succeeded."""
        if result.failure is not None:
            self._failures.add(tier.name, result.failure)
            if faults is not None and result.failure.of_the_tier:
                faults.append(tier.name)
        return result.failure is None

    @contextmanager
    def borrow(self, key: ChunkKey, spare: memoryview,
               meta: ChunkMeta = DEFAULT_META) -> Iterator[ChunkView | None]:
        """Lend the chunk (whose tenant `meta` names) read-only, from the fastest tier that
        holds it; None on a miss.

        An `InPlace` tier (the memory tier) lends its own memory, pinned until the block
        exits: no copy. Any other tier is read into `spare` (one chunk long, the caller's
        buffer), promoted as by `get_into`, and `spare` is lent. Tiers that fail or hold a
        corrupt copy are skipped, as by `get_into`, and so are stalled ones. Any thread; the
        read is not bounded in time (`lend_as_landed`'s are).
        """
        hold = Hold()
        try:
            yield self._lend(hold, key, meta) or self._read(hold, key, meta, spare)
        finally:
            hold.close()

    def lend_as_landed(self, keys: Sequence[ChunkKey], spares: MutableSequence[memoryview],
                       metas: Sequence[ChunkMeta] = (), *, in_order: bool = False,
                       until: float | None = None) -> Lending[ChunkView]:
        """Lend `keys`' chunks (`metas[i]` is chunk i's; empty: every chunk `DEFAULT_META`)
        each as soon as its read lands, until the first miss (`loans.Lending`: iterate it
        inside a `with` block; each `Loan` stays lent until released).

        Chunks an `InPlace` tier holds are lent in place; the others are read in parallel on
        the store's read threads, as many at once as there are `spares` (the caller's chunk
        buffers), each into a slot the top tier reserves (the read is the promotion) or into
        a spare; the first landed is lent first, unless `in_order`. A read not finished
        within `read_timeout_s` is abandoned (a miss, counted as `Failure.TIMEOUT`, the tier
        marked stalled), and the spare it may still write into is replaced in `spares` by a
        new buffer; so is one not landed by `until` (time.monotonic; None: no limit), after
        which no read starts (a miss, its tier not marked stalled). After a miss, the
        lending's `failed_tier` names the tier that failed the read (it erred, was down or
        did not answer in time; `Failure.of_the_tier`): what a failed load's time is
        charged to. A chunk absent or damaged says nothing of its
        tier's speed. Any thread; the lending, one.

        Raises:
            ValueError: `metas` is neither empty nor one per key; no spare buffer.
        """
        metas = list(metas) or [DEFAULT_META] * len(keys)
        if len(metas) != len(keys):
            raise ValueError(f"{len(metas)} metas for {len(keys)} keys")
        return Lending(
            len(keys), spares, in_order=in_order,
            lend=lambda i, hold: self._lend(hold, keys[i], metas[i]),
            read=lambda i, hold, spare: self._calls.submit(self._read, hold, keys[i],
                                                           metas[i], spare),
            timeout_s=self._calls.timeout_s, late=self._late, until=until)

    def _late(self, tier: str) -> None:
        """A read of `tier` was abandoned: counted, and the tier marked stalled."""
        self._failures.add(tier, Failure.TIMEOUT)
        if self._calls.stalled(tier):  # once a stall, not once a late read
            log.warning("tier %r: reads took over %.3g s; abandoned (misses), the tier is "
                        "skipped until it answers again", tier, self._calls.timeout_s)

    def _lend(self, hold: Hold, key: ChunkKey, meta: ChunkMeta) -> ChunkView | None:
        """The chunk (of `meta`'s tenant) lent where it lies by the fastest `InPlace` tier
        holding it, pinned on `hold` until it closes; None when no such tier holds it.
        Index lookups only: no I/O, never waits for a slow tier."""
        for level, tier in enumerate(self.tiers):
            lender = self._lenders.get(id(tier))
            if lender is None or not self._contains(tier, key):
                continue
            try:
                view = hold.enter_context(lender.borrow(key, meta))
            except Exception as exc:
                log.warning("tier %r: read of %s failed (%s: %s); trying the next",
                            tier.name, key.hex(), type(exc).__name__, exc)
                self._failures.add(tier.name, Failure.RAISED)
                continue
            if view is None:
                self._failures.add(tier.name, Failure.MISSING)
                continue
            self._promote(level, key, view, meta)
            return ChunkView(view.toreadonly(), tier.name)
        return None

    def _read(self, hold: Hold, key: ChunkKey, meta: ChunkMeta,
              spare: memoryview) -> ChunkView | None:
        """The chunk (of `meta`'s tenant) read from the fastest tier that holds it and lends
        nothing (disk, shared, remote), skipping stalled ones: into a slot the top tier
        reserves (kept on `hold`: the read is the promotion) or into `spare`. None on a miss.
        `hold.tier` names the tier the read waits on while it runs (a late read is charged
        to it), and after a miss the last tier that failed it, if one did."""
        faults: list[str] = []  # tiers that failed the read (Failure.of_the_tier)
        for level, tier in enumerate(self.tiers):
            if id(tier) in self._lenders or not self._calls.usable(tier.name):
                continue
            hold.tier = tier.name
            # A remote tier (BatchLookup) is read without asking first: its read says
            # "missing" in the round trip a lookup would take (one round trip, not two: each
            # is a wait for the GIL on a thread beside the model runner).
            remote = id(tier) in self._remote
            if not remote:
                held = self._contains(tier, key)
                self._calls.answered(tier.name)
                if not held:
                    continue
            in_place = level > 0 and self._reserver is not None
            try:
                if in_place:
                    assert self._reserver is not None
                    view = self._read_in_place(hold, self._reserver, tier, key, meta, spare,
                                               faults)
                else:
                    view = spare if self._counted(tier, tier.get_into(key, spare, meta),
                                                  faults) else None
            except Exception as exc:
                log.warning("tier %r: read of %s failed (%s: %s); trying the next",
                            tier.name, key.hex(), type(exc).__name__, exc)
                self._failures.add(tier.name, Failure.RAISED)
                faults.append(tier.name)
                view = None
            if remote:
                self._calls.answered(tier.name)
            if view is not None:
                self._promote(level, key, view, meta, top=not in_place)
                return ChunkView(view.toreadonly(), tier.name)
        hold.tier = faults[-1] if faults else None
        return None

    def _read_in_place(self, hold: Hold, top: InPlace, tier: Tier, key: ChunkKey,
                       meta: ChunkMeta, spare: memoryview, faults: list[str] | None = None,
                       ) -> memoryview | None:
        """Read `tier`'s chunk straight into a slot the top tier reserves (the read is the
        promotion: no copy; the slot stays pinned on `hold`), or into `spare` when the top
        tier gives none (declined, full, or holding it already). None when the read fails,
        or when the loan it was for was abandoned meanwhile (the slot is released)."""
        with ExitStack() as reservation:
            slot = reservation.enter_context(
                top.reserve(key, self._promoted_meta(tier, key, meta)))
            target = spare if isinstance(slot, TierResult) else slot.data
            if not self._counted(tier, tier.get_into(key, target, meta), faults):
                return None  # the slot is released here
            if not isinstance(slot, TierResult):
                slot.commit()
            if hold.enter_context(reservation.pop_all()) is None:
                return None  # abandoned: `reservation` released the slot (it was committed)
            return target

    def _promote(self, level: int, key: ChunkKey, data: memoryview, meta: ChunkMeta,
                 top: bool = True) -> None:
        """Copy a chunk found at `level` into the faster tiers above it (the top one too
        unless `top` is False: it was filled in place), with its tenant, pin and expiry
        where the tier it came from keeps them, else with the reader's `meta`
        (`_promoted_meta`)."""
        if level == 0:
            return
        meta = self._promoted_meta(self.tiers[level], key, meta)
        if top:
            self._put_top(key, data, meta)
        if level > 1:
            copy = self._copies.copy(data)
            for writer in self._below[: level - 1]:
                writer.submit(key, copy, meta)

    def _meta_of(self, tier: Tier, key: ChunkKey) -> ChunkMeta | None:
        keeper = self._keepers.get(id(tier))
        return None if keeper is None else self._guarded(tier, None, keeper.meta_of, key)

    def _promoted_meta(self, tier: Tier, key: ChunkKey, meta: ChunkMeta) -> ChunkMeta:
        """What a chunk read from `tier` by a reader with `meta` is promoted with: the
        tenant, pin and expiry `tier` keeps of it, else `meta`'s (its own: an expiry `tier`'s
        `ttl_s` gave stays there, the top tier dates it by its own); its parent `tier`'s, else
        the reader's (a tier's book may know none: it was restarted, or stored without one).
        Without its parent a promoted chunk is a root in a prefix policy above, and its parent
        could leave before it (tests/cache/test_retention.py)."""
        kept = self._meta_of(tier, key)
        if kept is None:
            return meta
        return kept if kept.parent is not None else replace(kept, parent=meta.parent)

    # -- writes ----------------------------------------------------------------------------
    def plan_puts(self, keys: Sequence[ChunkKey], metas: Sequence[ChunkMeta]) -> None:
        """Nothing to do ahead: each put takes its slot as it comes (the node's store,
        kvtier.node.nodestore.NodeStore, reserves a step's slots in one round trip here)."""

    def put(self, key: ChunkKey, data: memoryview, meta: ChunkMeta = DEFAULT_META) -> bool:
        """Store a chunk (exactly layout.bytes_per_chunk bytes) with its tenant, pin and
        expiry (`meta`): in the top tier now, in the lower tiers behind (each tier's `put`
        decides whether it holds the chunk already). True when the top tier stored it (or
        already held it)."""
        stored = self._put_top(key, data, meta).ok
        self._write_behind(key, data, meta)
        return stored

    def _write_behind(self, key: ChunkKey, data: memoryview, meta: ChunkMeta) -> None:
        """Queue a copy of the chunk for each usable lower tier (see `_writers`)."""
        pending = self._writers()
        if pending:
            copy = self._copies.copy(data)  # the caller may reuse `data` once we return
            for writer in pending:
                writer.submit(key, copy, meta)

    def retain(self, key: ChunkKey, meta: ChunkMeta) -> int:
        """Extend a held chunk's pin and expiry to `meta`'s in every tier that keeps them
        and holds it (a hit of a request that asks to retain its prefix); the number of
        tiers that did. Tiers below the top are asked with the read deadline. Any thread."""
        done = 0
        for level, tier in enumerate(self.tiers):
            keeper = self._keepers.get(id(tier))
            if keeper is None:
                continue
            if level == 0:
                done += self._guarded(tier, False, keeper.retain, key, meta)
            else:
                done += self._calls.call(tier.name, False, self._guarded, tier, False,
                                         keeper.retain, key, meta)
        return done

    def retire(self) -> int:
        """This engine's weights changed in place: in every tier it alone writes (`Retiring`:
        RAM, a local disk), the chunks held now leave before any stored from now on. Nothing
        is removed and no tier is read or written (O(1) a tier). The number of tiers retired.
        Any thread."""
        retiring = [tier for tier in self.tiers if isinstance(tier, Retiring)]
        for tier in retiring:
            self._guarded(tier, None, tier.retire)
        return len(retiring)

    def _guarded(self, tier: Tier, default: T, fn: Callable[..., T], *args: object) -> T:
        """`fn(*args)`, or `default` (logged) when it raises: a broken tier costs its
        metadata, never the caller."""
        try:
            return fn(*args)
        except Exception as exc:
            log.warning("tier %r: %s failed (%s)", tier.name, getattr(fn, "__name__", fn), exc)
            return default

    def _writers(self) -> list[WriteBehind]:
        """The lower tiers to write behind to: all but the stalled ones (whether one holds
        the chunk already is asked on its own threads, where a stall blocks nobody)."""
        return [w for w in self._below if self._calls.usable(w.tier.name)]

    def put_from(self, key: ChunkKey, fill: Callable[[memoryview], None],
                 spare: memoryview, meta: ChunkMeta = DEFAULT_META) -> bool:
        """`put` of a chunk that `fill(view)` writes into a chunk-long view: straight into
        a slot of the top tier when it is `InPlace` (one copy in all), else into `spare`
        (the caller's buffer), then stored as by `put`. True when the top tier stored it
        (or held it already: then nothing is filled, its lower tiers had it written behind
        when it was stored). `fill` runs on the calling thread; what it raises propagates
        and nothing is stored. `meta` as for `put`."""
        with self.putting(key, spare, meta) as put:
            if put.data is not None:
                fill(put.data)
        return put.stored

    @contextmanager
    def putting(self, key: ChunkKey, spare: memoryview,
                meta: ChunkMeta = DEFAULT_META) -> Iterator[PendingPut]:
        """`put_from` in two halves, for a caller that fills chunks asynchronously (a DMA)
        and keeps several open: the block yields a `PendingPut` whose `data` the caller
        fills before the block ends (None: nothing to fill; the top tier holds the chunk
        already or no tier takes it); the block's end stores it, and sets `stored` as
        `put_from` returns it. A block left by an exception, or after `cancel`, stores
        nothing. `data` is `spare` when the top tier has no slot for it (`in_place` False):
        the caller must not open another put on the same spare before this one ends."""
        if self._reserver is None:
            put = PendingPut(spare, in_place=False)
            yield put
            if not put.cancelled:
                result = self._put_top(key, spare, meta)
                self._write_behind(key, spare, meta)
                put.stored, put.found_held = result.ok, result.held
            return
        with self._reserver.reserve(key, meta) as slot:
            if isinstance(slot, TierResult):
                self._counted(self.tiers[0], slot)
            pending = self._writers()
            if isinstance(slot, TierResult) and (slot.ok or not pending):
                # held (`reserve` applied `meta` to it), or no lower tier to write
                yield (put := PendingPut(None, in_place=False, stored=slot.ok))
                return
            put = PendingPut(spare, in_place=False) if isinstance(slot, TierResult) \
                else PendingPut(slot.data, in_place=True)
            yield put
            data = put.data
            assert data is not None
            if put.cancelled:
                return
            # The lower tiers' copy is taken before the commit makes the slot evictable.
            copy = self._copies.copy(data) if pending else data
            if not isinstance(slot, TierResult):
                slot.commit()
        for writer in pending:
            writer.submit(key, copy, meta)
        put.stored = put.in_place

    def _put_top(self, key: ChunkKey, data: memoryview, meta: ChunkMeta) -> TierResult:
        """The top tier's put, its failure (or exception) counted."""
        top = self.tiers[0]
        try:
            result = top.put(key, data, meta)
        except Exception as exc:
            log.warning("tier %r: write of %s failed (%s); dropped", top.name, key.hex(), exc)
            result = TierResult(Failure.RAISED)
        self._counted(top, result)
        return result

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait until every write-behind queue is empty, `timeout_s` in all; False on
        timeout."""
        if timeout_s is None:
            return all(writer.flush() for writer in self._below)
        deadline = time.monotonic() + timeout_s
        return all(writer.flush(max(0.0, deadline - time.monotonic())) for writer in self._below)

    # -- upkeep ----------------------------------------------------------------------------
    def start_reads(self) -> None:
        """Start the read threads now, in the background: a long-lived store (a node's)
        whose first load should not pay for them; otherwise each starts with a read that
        finds no idle one."""
        def start() -> None:
            with contextlib.suppress(RuntimeError):  # the store closed meanwhile: none
                self._calls.start_threads()

        threading.Thread(target=start, daemon=True, name="kvtier-start-reads").start()

    def measure_links(self) -> dict[str, LinkSpeed]:
        """The speed of each tier that can measure its link (`LinkProbe`: redis, s3, a
        shared directory, a disk) and answers now. Blocking (a few round trips each, at most
        tiers.links.LINK_DEADLINE_S for a file or s3 tier): any thread but a
        latency-sensitive one."""
        speeds = {}
        for tier in self.tiers:
            if isinstance(tier, LinkProbe):
                speed = self._guarded(tier, None, tier.measure_link)
                if speed is not None:
                    speeds[tier.name] = speed
        return speeds

    def stats(self) -> StoreStats:
        """A snapshot of every tier's counters and of the store's own. Any thread."""
        return StoreStats(
            tiers=tuple(tier.stats() for tier in self.tiers),
            queued_writes=sum(w.pending for w in self._below),
            queue_drops={w.tier.name: w.drops for w in self._below},
            failures=self._failures.snapshot(),
            retention={tier.name: self._guarded(tier, RetentionStats(), keeper.retention_stats)
                       for tier in self.tiers
                       if (keeper := self._keepers.get(id(tier))) is not None},
        )

    def close(self, flush_timeout_s: float | None = None) -> None:
        """Finish queued writes (waiting at most `flush_timeout_s`; the writes still queued
        then are dropped and logged, and those still running are not waited for: a tier that
        stopped answering may hold them for ever), stop the store's threads and close every
        tier. Under a `flush_timeout_s`, a tier below the top whose own close (a measure of
        its link in flight, its index's last update) has not ended by then, or
        `CLOSE_GRACE_S` after the flush, is left to end on its own."""
        deadline = None if flush_timeout_s is None else time.monotonic() + flush_timeout_s
        if not self.flush(flush_timeout_s):
            for writer in self._below:
                if writer.pending:
                    log.warning("tier %r: %d queued writes not finished within %.1f s of "
                                "closing; dropped (a cache: those chunks miss later)",
                                writer.tier.name, writer.pending, flush_timeout_s)
        for writer in self._below:
            writer.close(wait=writer.pending == 0)
        self._calls.close()
        self.tiers[0].close()
        for tier in self.tiers[1:]:
            if deadline is None:
                tier.close()
                continue
            left_s = max(CLOSE_GRACE_S, deadline - time.monotonic())
            if not call_within(tier.close, left_s, f"kvtier-close-{tier.name}")[0]:
                log.warning("tier %r: its close had not ended %.1f s later (a tier that "
                            "stopped answering); not waited for", tier.name, left_s)

    def __enter__(self) -> TieredStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _warm(tiers: Sequence[Warmable], connections: int) -> None:
    """Open each tier's connections for `connections` reads at once (`Warmable`)."""
    for tier in tiers:
        try:
            tier.warm(connections)
        except Exception:  # never raises, by contract: a bug costs the warm-up only
            log.exception("kvtier: warming up a tier's connections failed")
