"""The host-RAM tier: one preallocated slab cut into fixed-size slots, with an index.

The production reference tier (the tutorial, and the double of the store's unit tests, is
`tiers/example.py`, a dict of bytes). The slab is allocated once (page-locked when CUDA is
present, so GPU copies can be asynchronous) and never grows; a full tier evicts by policy.
Slots are page-aligned, so the disk tiers can write them with O_DIRECT without a bounce copy.

Besides the `Tier` contract it is `InPlace`: `borrow(key)` lends a read-only view of a slot,
pinned (never overwritten or reused) until the borrower leaves, so the vLLM worker scatters
straight from the slab; and `reserve(key, meta)` hands out a free slot to fill in place (the
worker's gather, a slower tier's read), so a store or a promotion is one copy. `put` is a
reservation filled by a copy.

It is also a `MetaKeeper` (`kvtier.core.tier`): chunks carry their tenant (`tenant_id` of the
cache salt), pin and expiry. With `tenant_quota`, a tenant at its limit evicts its own least
recently used chunk to make room, so one tenant's flood cannot push another's warm set out;
pinned chunks are left out of the eviction policy until their pin ends (pinned bytes bounded
by `max_pinned_share`); an expired chunk is a miss and its slot is reclaimed (`ttl_s`, or
the request's own).

In a kvtier node, several engines store into one memory tier: with `engine_quota`, an engine
at its limit evicts its own least recently used chunk (`ChunkMeta.engine`: the node sets it),
so one engine's flood of new prompts cannot push its neighbours' warm sets out.
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import ClassVar, Literal

import numpy as np
from pydantic import Field

from kvtier.core.chunkformat import ALIGN_BYTES
from kvtier.core.keys import ChunkKey
from kvtier.core.layout import KVLayout
from kvtier.core.policies import AdmissionFilter, Generations, make_policy
from kvtier.core.retention import DEFAULT_META, ChunkMeta, RetentionBook, RetentionStats
from kvtier.core.tier import (
    DECLINED,
    FULL,
    HELD,
    MISSING,
    OK,
    Locality,
    Medium,
    TierCounters,
    TierEvents,
    TierResult,
    TierStats,
)
from kvtier.errors import ConfigError
from kvtier.tiers.prefault import available_bytes, prefault_in_background
from kvtier.tiers.retention import (
    RetentionTierSettings,
    TenantQuotaSettings,
    book_problems,
    build_book,
)
from kvtier.tiers.shmslab import SharedSlab
from kvtier.units import format_size

log = logging.getLogger(__name__)


class MemoryTierConfig(RetentionTierSettings):
    """Host RAM: one preallocated slab of fixed-size slots (pinned when CUDA is present)."""

    kind: Literal["memory"]
    # RAM's default is the prefix policy: on Mooncake's conversation trace 2.06x LRU's hits
    # at 1M tokens, on the simulator's agent, RAG and chat traffic at least 0.98x (most often
    # far more); its heap costs O(log n) a put or hit of the slab's few thousand slots
    # (docs/performance.md, "Replaying a trace"). A disk tier keeps LRU (CLOCK: its index
    # must fit millions of chunks).
    eviction: Literal["lru", "arc", "prefix"] = "prefix"
    pin: Literal["auto", "on", "off"] = "auto"  # page-locked memory for async GPU copies
    # Commit the slab's RAM in the background from the start (tiers/prefault.py), so that
    # no store pays a first-touch page fault; False: pages are committed as they are used.
    prefault: bool = True
    # The slab in a named shared-memory file, /dev/shm/<name> (mode 0660: the node's group),
    # that other processes map: `kvtier node` sets it for its engines (kvtier.node). None:
    # the slab is this process's own memory.
    shared_memory: str | None = Field(None, pattern=r"^[A-Za-z0-9._-]{1,200}$")
    # In a kvtier node: what one engine's stores may hold of the tier, e.g. {"share": 0.5}
    # or {"cap": "8GiB"}; an engine at its limit evicts its own least recently used chunks
    # first (a chunk any engine reads is recent for the engine that stored it). None: no
    # limit. In process the engine is the tier's only writer (the connector refuses it).
    engine_quota: TenantQuotaSettings | None = None


class _Slot:
    """A reserved slot (see `kvtier.core.tier.InPlace.reserve`)."""

    __slots__ = ("commit", "data")

    def __init__(self, data: memoryview, commit: Callable[[], None]) -> None:
        self.data = data
        self.commit = commit


class MemoryTier:
    """Chunks in a host-RAM slab. Thread-safe. `get_into` copies under the tier's lock so a
    slot is never reused while it is read (a 32 MiB copy holds the lock for a few ms); borrowed
    and reserved slots are pinned instead, and filled or read without the lock."""

    # In this process's RAM; each TP rank holds its own chunks.
    medium: ClassVar[Medium] = Medium.CPU
    locality: ClassVar[Locality] = Locality.LOCAL
    has_path: ClassVar[bool] = False
    has_server: ClassVar[bool] = False
    capacity_split_by_rank: ClassVar[bool] = True

    config_model = MemoryTierConfig

    def __init__(self, config: MemoryTierConfig, layout: KVLayout, *,
                 clock: Callable[[], float] = time.time) -> None:
        """`clock`: wall-clock seconds for pins and expiry (a fake in tests)."""
        self.name = config.tier_name
        self.chunk_bytes = layout.bytes_per_chunk
        self.slot_bytes = -(-self.chunk_bytes // ALIGN_BYTES) * ALIGN_BYTES
        self.num_slots = config.capacity // self.slot_bytes
        if self.num_slots == 0:
            log.warning("memory tier %r: capacity %d B holds no %d B chunk; it will store nothing",
                        self.name, config.capacity, self.slot_bytes)
        self.pinned = False
        # The slab in /dev/shm/<config.shared_memory> (tiers/shmslab.py), with a record per
        # slot for a successor to recover from; None: this process's own memory.
        self._shared: SharedSlab | None = None
        self.shared_memory_path: Path | None = None
        self.keep_shared_memory = False  # `close` leaves the file for the next node
        if config.shared_memory:
            self._shared = SharedSlab(config.shared_memory, self.slot_bytes, self.num_slots,
                                      self.chunk_bytes)
            self.shared_memory_path = self._shared.path
            self._slab = self._shared.slots
        else:
            self._slab = self._allocate(self.num_slots * self.slot_bytes, config.pin)
        self._stop_prefault = threading.Event()
        self.prefaulting: threading.Thread | None = None  # running or finished; None: off
        # A shared slab's pages exist (allocated with its file), but not in this process's
        # page tables: a first write into each still faults (7x slower than into a mapped
        # page here, docs/performance.md).
        if config.prefault and not self.pinned and self._slab.nbytes and self._fits_in_ram():
            self.prefaulting = prefault_in_background(
                self._slab, f"memory tier {self.name!r}", self._stop_prefault)
        self._index: dict[ChunkKey, int] = {}
        self._free = list(range(self.num_slots - 1, -1, -1))
        self._policy: Generations[ChunkKey] = make_policy(config.eviction, self.num_slots)
        self._admission = AdmissionFilter(config.admit_after)
        self._lock = threading.Lock()
        self._counters = TierCounters(self.name, self.num_slots * self.slot_bytes)
        self.events = TierEvents(self.name)
        # Borrowed slots: slot -> borrowers now reading it. A pinned slot is never handed
        # out for writing; one evicted or deleted while pinned is freed by its last borrower.
        self._pins: dict[int, int] = {}
        self._orphans: set[int] = set()
        # Slots of chunks that left while an engine read them in place from the shared slab
        # (`SharedSlab.claim` failed): freed by `_reclaim` once no engine holds them.
        self._read_in_place: set[int] = set()
        self._config = config
        # Tenants, pins and expiry of the chunks held (kvtier.core.retention). The policy
        # holds unpinned chunks only: a pinned one re-enters it when its pin ends.
        self._book = build_book(config, self.num_slots * self.slot_bytes, clock)
        # Each node engine's chunks (`engine_quota`): tenants are engines here, pins are the
        # tenants' book's. None: no engine quota.
        self._engines = self._engine_book(clock)
        self._reserving: Counter[str] = Counter()  # engine -> its slots reserved, not stored
        # tenant -> its slots reserved, not stored (with a tenant_quota only): a tenant's
        # puts in flight at once (a worker's gathers) count against its quota, as an
        # engine's do, or each took a slot of its own past the quota.
        self._tenant_reserving: Counter[str | None] = Counter()

    def _engine_book(self, clock: Callable[[], float]) -> RetentionBook | None:
        quota = self._config.engine_quota
        return None if quota is None else RetentionBook(
            self.num_slots * self.slot_bytes, quota=quota.quota(), max_pinned_share=0.0,
            clock=clock)

    def _fits_in_ram(self) -> bool:
        """Whether this process's own slab fits in the RAM the host has available now (a
        container: that its cgroup's memory limit leaves, `available_bytes`), so
        that committing it in the background is safe. One larger (a capacity copied from a
        bigger host: 20 GiB maps on a 23.5 GiB host with 17 available) would be committed
        whole by the prefault at start-up, until the kernel's OOM killer ended a process,
        this engine's or another's: it is warned of, naming the capacity, and left to commit
        as chunks fill it. A node's slab in /dev/shm exists already (mapping it takes no
        RAM)."""
        available = None if self._shared is not None else available_bytes()
        if available is None or self._slab.nbytes <= available:
            return True
        log.warning("memory tier %r: capacity %s is more than the %s of RAM this host has "
                    "available (or its cgroup's memory limit leaves): its pages are not "
                    "committed ahead of use, and once chunks fill what the host has, the "
                    "kernel's OOM killer ends a process (this engine or another); lower its "
                    "capacity", self.name,
                    format_size(self._slab.nbytes), format_size(available))
        return False

    def _allocate(self, size_bytes: int, pin: str) -> np.ndarray:
        if pin != "off":
            try:
                import torch

                if torch.cuda.is_available():
                    buffer = torch.empty(max(size_bytes, 1), dtype=torch.uint8, pin_memory=True)
                    self._torch_slab = buffer  # keep the pinned allocation alive
                    self.pinned = True
                    return buffer.numpy()[:size_bytes]
            except ImportError:
                pass
            if pin == "on":
                log.warning("memory tier %r: pin=on but CUDA is not available; using pageable RAM",
                            self.name)
        # mmap gives page-aligned, lazily committed memory.
        try:
            self._mmap = mmap.mmap(-1, max(size_bytes, 1))
        except OSError as exc:
            if exc.errno != errno.ENOMEM:
                raise
            # The kernel refused the mapping outright (its overcommit heuristic refuses one
            # larger than RAM and swap): a capacity this host cannot hold, named as such
            # rather than an OSError's traceback in vLLM's worker.
            ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
            raise ConfigError(f"{self.name}.capacity", format_size(size_bytes),
                              f"a slab this host can map: it has {format_size(ram)} of RAM "
                              "(the kernel refused the mapping: ENOMEM); a capacity is per "
                              "engine, each TP rank mapping its share") from None
        return np.frombuffer(self._mmap, dtype=np.uint8)[:size_bytes]

    def offset_of(self, view: memoryview) -> int | None:
        """Where `view` starts in the slab (a chunk this tier lent or reserved), in bytes;
        None when it lies elsewhere (a caller's spare)."""
        base = self._slab.ctypes.data
        start = np.frombuffer(view, dtype=np.uint8).ctypes.data
        offset = start - base
        return offset if offset >= 0 and offset + len(view) <= self._slab.nbytes else None

    def stamp_at(self, offset: int) -> int | None:
        """The stamp of the slot at `offset` in the shared slab (bumped before the slot is
        written again: `SharedSlab.clear`), for a lending of its chunk, read while it is
        lent; None for a slab not shared (no engine copies out of it)."""
        return None if self._shared is None else self._shared.stamp(offset // self.slot_bytes)

    def slot(self, index: int) -> np.ndarray:
        """The bytes of slot `index` (chunk_bytes long)."""
        start = index * self.slot_bytes
        return self._slab[start : start + self.chunk_bytes]

    def contains(self, key: ChunkKey) -> bool:
        return key in self._index and not (self._book.has_deadlines
                                           and self._book.is_expired(key))

    def get_into(self, key: ChunkKey, out: memoryview,
                 meta: ChunkMeta = DEFAULT_META) -> TierResult:
        start = time.perf_counter()
        with self._lock:
            index = self._held(key)
            if index is not None:
                np.copyto(np.frombuffer(out, dtype=np.uint8), self.slot(index))
                self._touch(key)
        if index is None:
            self._counters.add(misses=1)
            return MISSING
        self._counters.add(hits=1, bytes_read=self.chunk_bytes, read_s=time.perf_counter() - start)
        return OK

    @contextmanager
    def borrow(self, key: ChunkKey,
               meta: ChunkMeta = DEFAULT_META) -> Iterator[memoryview | None]:
        """Lend a read-only view of the chunk's slot (see `kvtier.core.tier.InPlace`); None
        on a miss. The slot is pinned, not locked: puts, gets and other borrowers go on.
        (Chunks in RAM are in clear: `meta` opens nothing here.)"""
        start = time.perf_counter()
        with self._lock:
            index = self._held(key)
            if index is not None:
                self._pins[index] = self._pins.get(index, 0) + 1
                self._touch(key)
        if index is None:
            self._counters.add(misses=1)
            yield None
            return
        view = self.slot(index).data.toreadonly()
        found_s = time.perf_counter() - start  # a read's time, not how long it is held
        try:
            yield view
        finally:
            self._unpin(index)
            self._counters.add(hits=1, bytes_read=self.chunk_bytes, read_s=found_s)

    def touch(self, keys: Sequence[ChunkKey]) -> int:
        """Engines read these chunks in place from the shared slab, without a borrow
        (`SlabReader`): each one held is recent, as a read is. How many were held."""
        with self._lock:
            held = [key for key in keys if key in self._index]
            for key in held:
                self._touch(key)
        self._counters.add(hits=len(held), bytes_read=len(held) * self.chunk_bytes)
        return len(held)

    def _touch(self, key: ChunkKey) -> None:
        """A held chunk was read: recent for the policy and its tenant's and engine's
        quotas. Lock held."""
        self._policy.touch(key)
        self._book.touch(key)
        if self._engines is not None:
            self._engines.touch(key)

    def _unpin(self, index: int) -> None:
        with self._lock:
            self._pins[index] -= 1
            if self._pins[index] == 0:
                del self._pins[index]
                if index in self._orphans:
                    self._orphans.discard(index)
                    self._free.append(index)

    def _held(self, key: ChunkKey) -> int | None:
        """The slot of a held, unexpired chunk (an expired one is removed). Lock held."""
        index = self._index.get(key)
        if index is not None and self._book.has_deadlines and self._book.is_expired(key):
            self._remove(key)
            self._book.expired_count += 1
            self._publish()
            return None
        return index

    def put(self, key: ChunkKey, data: memoryview, meta: ChunkMeta = DEFAULT_META) -> TierResult:
        """`Tier.put`: a reservation (which decides whether the chunk is held, and gives a
        held one `meta`'s pin and expiry) filled by a copy."""
        if len(data) != self.chunk_bytes:
            raise ValueError(f"chunk is {len(data)} bytes, this tier stores {self.chunk_bytes}")
        with self.reserve(key, meta) as slot:
            if isinstance(slot, TierResult):
                return slot
            np.copyto(np.frombuffer(slot.data, dtype=np.uint8), np.frombuffer(data, dtype=np.uint8))
            slot.commit()
        return OK

    @contextmanager
    def reserve(self, key: ChunkKey,
                meta: ChunkMeta = DEFAULT_META) -> Iterator[_Slot | TierResult]:
        """A free slot for `key`, stored with `meta` once committed and pinned until the
        block exits (see `InPlace.reserve`); else why there is none: HELD (`meta`'s pin
        and expiry applied, as by `retain`), DECLINED or FULL."""
        if self.contains(key):
            if not meta.is_default:
                self.retain(key, meta)
            yield HELD
            return
        if not self._admission.offer(key):
            yield DECLINED
            return
        start = time.perf_counter()
        with self._lock:
            held = self._held(key) is not None
            index = None if held else self._take_slot(meta)
            if index is not None:
                self._pins[index] = 1  # in neither the index nor the free list: ours alone
                if self._engines is not None and meta.engine is not None:
                    self._reserving[meta.engine] += 1
                if self._config.tenant_quota is not None:
                    self._tenant_reserving[meta.tenant] += 1
                if self._shared is not None:
                    self._shared.clear(index)  # about to be written
        if index is None:
            if held or key in self._index:
                yield HELD
                return
            self._counters.add(dropped_writes=1)
            yield FULL
            return
        committed = False

        def commit() -> None:
            nonlocal committed
            committed = True
            self._commit(key, index, start, meta)

        try:
            yield _Slot(self.slot(index).data, commit)
        finally:
            if not committed:
                with self._lock:
                    self._orphans.add(index)  # freed by the unpin below
                    self._reserved_done(meta)
            self._unpin(index)

    def _commit(self, key: ChunkKey, index: int, start: float, meta: ChunkMeta) -> None:
        # The slot is ours (pinned) and whole now: its checksum, off the lock.
        checksum = None if self._shared is None \
            else self._shared.checksum(self.slot(index).data)
        with self._lock:
            self._reserved_done(meta)
            if key in self._index:  # another writer stored it meanwhile: this slot is spare
                self._orphans.add(index)
                return
            self._index[key] = index
            if self._shared is not None and checksum is not None:
                self._shared.record(index, key, checksum, meta)
            if not self._book.records(meta) \
                    or not self._book.record(key, meta, self.slot_bytes):
                self._policy.insert(key, meta.parent)  # pinned chunks stay out of the policy
            if self._engines is not None and meta.engine is not None:
                self._engines.record(key, ChunkMeta(meta.engine), self.slot_bytes)
            self.events.stored(key)
            held = len(self._index)
        self._counters.add(puts=1, bytes_written=self.chunk_bytes,
                           write_s=time.perf_counter() - start)
        self._counters.set(chunks=held, used_bytes=held * self.slot_bytes)

    def _take_slot(self, meta: ChunkMeta) -> int | None:
        """A free slot for a chunk stored with `meta`: one of its engine's own chunks when
        that engine is at its quota, or one of its tenant's own when the tenant is at its
        quota (None when all of them are pinned or lent), else a free one, else one evicted
        by policy (never a pinned or lent chunk). Caller holds the lock."""
        self._reap()
        if self._engines is not None and meta.engine is not None and self._engines.over_quota(
                meta.engine, self.slot_bytes * (1 + self._reserving[meta.engine])):
            victim = self._engines.own_victim(
                meta.engine, lambda key: not self._book.is_pinned(key) and not self._lent(key))
            if victim is None:
                return None
            return self._evict_own(victim)
        if self._book.over_quota(
                meta.tenant, self.slot_bytes * (1 + self._tenant_reserving[meta.tenant])):
            victim = self._book.own_victim(meta.tenant, lambda key: not self._lent(key))
            if victim is None:
                return None
            return self._evict_own(victim)
        return self._free_or_evicted()

    def _reserved_done(self, meta: ChunkMeta) -> None:
        """A slot reserved for `meta.engine` and `meta.tenant` was filled or given back.
        Lock held."""
        if self._engines is not None and meta.engine is not None:
            self._reserving[meta.engine] -= 1
            if self._reserving[meta.engine] <= 0:
                del self._reserving[meta.engine]
        if self._config.tenant_quota is not None:
            self._tenant_reserving[meta.tenant] -= 1
            if self._tenant_reserving[meta.tenant] <= 0:
                del self._tenant_reserving[meta.tenant]

    def _evict_own(self, victim: ChunkKey) -> int | None:
        """The slot of a quota's own victim, or (the victim is being read) any slot."""
        self._policy.remove(victim)
        index = self._evict(victim)
        return index if index is not None else self._free_or_evicted()

    def _lent(self, key: ChunkKey) -> bool:
        """Whether held chunk `key` is lent out (`borrow`: a load reads it now). Evicting it
        frees its slot only when the loan ends and loses a chunk in use for nothing (every
        lent victim went so, each put taking the next victim as well): no eviction takes
        it. Lock held."""
        return self._index.get(key, -1) in self._pins

    def _free_or_evicted(self) -> int | None:
        """A free slot, else one evicted by policy; None when every chunk is lent. The policy
        passes lent chunks over (`_lent`), leaving them where they rank (a prefix policy's
        parent under a lent chunk is no candidate meanwhile; ARC counts no ghost)."""
        if self._read_in_place:
            self._reclaim()
        if self._free:
            return self._free.pop()
        while (victim := self._policy.evict(keep=self._lent)) is not None:
            index = self._evict(victim)
            if index is not None:
                return index
        return None

    def _evict(self, victim: ChunkKey) -> int | None:
        """Evict `victim` (just taken out of the policy: its `left_retired` is the victim's);
        its slot, or None when it is being read (its last borrower frees it). Caller holds
        the lock."""
        self._counters.add(evictions=1)
        self.events.removed(victim, retired=self._policy.left_retired)
        self._book.forget(victim, evicted=True)
        if self._engines is not None:
            self._engines.forget(victim, evicted=True)
        index = self._index.pop(victim)
        self._publish()  # held now: the slot's next chunk may never come (a store given up)
        if not self._claim(index):
            return None
        if index not in self._pins:
            return index
        self._orphans.add(index)
        return None

    def _remove(self, key: ChunkKey) -> None:
        """Remove a held chunk (deleted or expired) and free its slot. Caller holds the
        lock; the caller publishes the counters."""
        index = self._index.pop(key)
        self._policy.remove(key)
        retired = self._policy.left_retired
        self._book.forget(key)
        if self._engines is not None:
            self._engines.forget(key)
        if self._claim(index):  # else an engine reads it in place: freed by `_reclaim`
            if index in self._pins:
                self._orphans.add(index)
            else:
                self._free.append(index)
        self.events.removed(key, retired=retired)

    def _claim(self, index: int) -> bool:
        """A chunk left slot `index`: its shared-memory record cleared, unless an engine
        reads the slot in place (`SharedSlab.claim`): then the slot waits in `_read_in_place`,
        neither free nor orphaned, bytes and record untouched, and False. Lock held."""
        if self._shared is None or self._shared.claim(index):
            return True
        self._read_in_place.add(index)
        return False

    def _reclaim(self) -> None:
        """Free the slots engines were reading in place when their chunks left, where no
        engine reads them now. Lock held."""
        assert self._shared is not None
        for index in [i for i in self._read_in_place if self._shared.claim(i)]:
            self._read_in_place.discard(index)
            if index in self._pins:
                self._orphans.add(index)
            else:
                self._free.append(index)

    def _reap(self) -> None:
        """Put chunks whose pin ended back in the policy; remove expired ones. Lock held."""
        if not self._book.has_deadlines:
            return
        for key in self._book.lapsed_pins():
            self._policy.insert(key, self._book.parent_of(key))
        expired = [key for key in self._book.due_expiries() if key in self._index]
        for key in expired:
            self._remove(key)
        if expired:
            self._publish()

    def _publish(self) -> None:
        held = len(self._index)
        self._counters.set(chunks=held, used_bytes=held * self.slot_bytes)

    def check(self) -> list[str]:
        """`Checkable`: every slot is held by one chunk, free, or being read; every chunk
        is evictable or pinned; the tenants' books name held chunks only."""
        with self._lock:
            held = list(self._index.values())
            free = set(self._free)
            problems = []
            if len(set(held)) != len(held):
                problems.append("two chunks share a slot")
            if len(free) != len(self._free) or free & set(held):
                problems.append("a free slot is listed twice or also held")
            lost = self.num_slots - len(set(held) | free | self._orphans
                                        | self._read_in_place)
            if lost:
                problems.append(f"{lost} slots neither held, free nor being read")
            if self._orphans - self._pins.keys():
                problems.append("slots of evicted chunks not freed though nobody reads them")
            problems += book_problems(self._index.keys(), self._policy, self._book)
            return problems

    def retire(self) -> None:
        """`Retiring`: what is held now is evicted before what is stored from now on."""
        with self._lock:
            self._policy.retire()

    # -- MetaKeeper: tenants, pins, expiry ---------------------------------------------------
    def retain(self, key: ChunkKey, meta: ChunkMeta) -> bool:
        """Extend a held chunk's pin and expiry (`MetaKeeper`); False when not held."""
        with self._lock:
            if self._held(key) is None:
                return False
            if self._book.retain(key, meta, self.slot_bytes):
                self._policy.remove(key)  # pinned now: out of the policy
            kept = self._book.meta_of(key)  # a successor dates the tier's ttl_s anew
            if self._shared is not None and kept is not None:
                self._shared.record_meta(self._index[key], kept)
            return True

    def meta_of(self, key: ChunkKey) -> ChunkMeta | None:
        with self._lock:
            return self._book.meta_of(key)

    def retention_stats(self) -> RetentionStats:
        """Pins, expiries and per-tenant usage; expired chunks are reclaimed first, so the
        figures are current (the vLLM worker asks every step)."""
        with self._lock:
            self._reap()
            return self._book.stats()

    def engine_usage(self) -> dict[str, dict[str, int]]:
        """Per engine that stored chunks through a node (`engine_quota`; else empty): the
        bytes and chunks it holds now, its chunks evicted so far, and its quota's limit."""
        if self._engines is None or self._config.engine_quota is None:
            return {}
        limit = self._config.engine_quota.quota().limit_bytes(self.num_slots * self.slot_bytes)
        with self._lock:
            usage = self._engines.usage()
        return {str(engine): {"used_bytes": used, "chunks": chunks, "evictions": evictions,
                              "quota_bytes": limit}
                for engine, (used, chunks, evictions) in usage.items()}

    def delete(self, key: ChunkKey) -> bool:
        with self._lock:
            if key not in self._index:
                return False
            self._remove(key)
            self._publish()
        return True

    def stats(self) -> TierStats:
        with self._lock:
            horizon = self._policy.horizon_ops
        return replace(self._counters.snapshot(), policy_horizon_ops=horizon)

    def recover(self) -> tuple[int, int]:
        """Put into this slab the chunks a predecessor's shared slab held whole (kvtier
        node, restarted on the same name: tiers/shmslab.py); (recovered, dropped: torn or
        damaged). Any thread; the tier serves meanwhile. Each keeps its tenant, pin, expiry
        and parent (one expired by now is not recovered); not its engine."""
        if self._shared is None:
            return 0, 0
        put = [key for key, data, meta in self._shared.recoverable(time.time())
               if self.put(key, data, meta)]
        # Held at the end: a smaller RAM than the predecessor's evicts some as others come.
        return sum(map(self.contains, put)), self._shared.dropped

    def close(self) -> None:
        self._stop_prefault.set()
        if self._shared is not None:
            self._shared.close(keep=self.keep_shared_memory)
        with self._lock:
            self._index.clear()
            # A late read's promotion may still reserve a slot (a read abandoned by a stalled
            # tier lands whenever it does): the policy forgets the chunks the index did.
            self._policy = make_policy(self._config.eviction, self.num_slots)
            self._book = build_book(self._config, self.num_slots * self.slot_bytes,
                                    self._book.clock)
            self._engines = self._engine_book(self._book.clock)
            self._orphans = set(self._pins)
            self._read_in_place.clear()
            self._free = [i for i in range(self.num_slots - 1, -1, -1) if i not in self._pins]
