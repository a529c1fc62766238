"""The example tier: chunks in a plain dict of bytes. A tutorial, and a test double.

Not for production (it copies every chunk into a new `bytes` and forgets everything on exit;
use `memory` for RAM). It is registered as kind "example" so that it is built exactly as
real tiers are, but the registry keeps it out of the kinds offered to operators.

How to write a tier, by the example of this one:

1. Write its config model: a `kvtier.tiers.storeconfig.TierSettings` subclass with `kind:
   Literal["<kind>"]` and one commented field per setting. pydantic validates it; every bad
   value becomes a ConfigError naming the field (`tiers.0.<kind>.<field>`), the value and
   what is allowed. `name`, `capacity`, `eviction` and `admit_after` come with the base.
2. Write the tier class, with `config_model = <the model>`, the facts of its kind as class
   attributes (`medium`, `locality`, ...: see `kvtier.core.tier.Tier`) and a constructor
   `__init__(config, layout)`: the store's registry builds every tier that way.
3. Implement the `kvtier.core.tier.Tier` protocol: `contains`, `get_into(key, out, meta)`,
   `put(key, data, meta)`, `delete`, `stats`, `close` (each method below says what it must
   do). `meta` (a `ChunkMeta`: tenant, pin, expiry; `DEFAULT_META` when it asks nothing)
   comes with every write and every read: it is all a tier learns about whose chunk it is.
   `put` is idempotent and is the one place that decides whether the chunk is held already
   (nobody asks `contains` before it). Reads and writes never raise for I/O: they return a
   `TierResult` whose `failure` says why they failed (`MISSING`, `CORRUPT`, `IO_ERROR`,
   `UNAVAILABLE`, `FULL`, `DECLINED`, `NO_KEY`, ...), and the store counts the failures per
   reason. Keep a `TierCounters` for `stats()`.
4. Offer the optional abilities that fit, each a whole protocol of `kvtier.core.tier`,
   never a stub that raises. This tier offers every one of them, to show their shape:
   - `BatchLookup`: `contains_many` (one round trip for many lookups: remote stores);
   - `InPlace`: `borrow` lends a read-only view of a held chunk, `reserve` hands out the
     space of a chunk to fill and commit (memory that is read and written where it lies);
   - `EventSource`: `events`, a `TierEvents` told of every chunk stored and removed;
   - `MetaKeeper`: `retain`, `meta_of`, `retention_stats` (it keeps each chunk's tenant,
     pin and expiry, in a `kvtier.core.retention.RetentionBook`);
   - `ManifestKeeper`: `keep_manifest` (which model the namespace's chunks belong to);
   - `Retiring`: `retire` (what is held now leaves first: this engine's weights changed;
     only for a tier this engine alone writes, never a shared one); a retired chunk's
     removal event says so (`TierEvents.removed(key, retired=...)`, from the policy's
     `left_retired`);
   - `Checkable`: `check` (its books against its storage; the contract suite runs it);
   - on the class, `ProbeSource`: `probe(config, layouts)`, a side-effect-free "is this
     chunk stored?" for processes that do not own the tier, and `InventorySource`:
     `open_inventory(config)`, what the storage holds, for `kvtier inspect` and `kvtier gc`.
     A real tier reads its storage there (files, a server) without building the tier; this
     one can only see the live tiers of its process (`_LIVE`).
5. Add one line to `kvtier.tiers.registry.TIER_CLASSES`, and the kind to the contract suite
   (tests/tierkit.py): every tier passes the same tests.

Primitives: `ExampleTier`, `ExampleTierConfig`.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import ClassVar, Literal

from kvtier.core.keys import ChunkKey
from kvtier.core.layout import KVLayout
from kvtier.core.policies import AdmissionFilter, Generations, make_policy
from kvtier.core.retention import DEFAULT_META, ChunkMeta, RetentionBook, RetentionStats
from kvtier.core.tier import (
    DECLINED,
    FULL,
    MISSING,
    OK,
    Locality,
    Medium,
    NamespaceManifest,
    StoredChunk,
    TierCounters,
    TierEvents,
    TierResult,
    TierStats,
)
from kvtier.tiers.retention import book_problems
from kvtier.tiers.storeconfig import TierSettings


class ExampleTierConfig(TierSettings):
    """A dict of bytes in this process (the tutorial tier; tests and docs only)."""

    kind: Literal["example"]


# The live example tiers of this process, by name, then layout digest: what its probes and
# inventories see (a real tier's see its files or its server instead).
_LIVE: dict[str, weakref.WeakValueDictionary[str, ExampleTier]] = {}


class ExampleTier:
    """Chunks as `bytes` values of a dict, within `capacity` bytes. Thread-safe: one lock
    guards the dict, the eviction policy and the events (a chunk is a few MiB at most, so
    copying under the lock is acceptable for a tutorial; `memory` does better)."""

    # The facts every tier class states (kvtier.core.tier.Tier): a dict in this process's RAM.
    medium: ClassVar[Medium] = Medium.CPU
    locality: ClassVar[Locality] = Locality.LOCAL
    has_path: ClassVar[bool] = False
    has_server: ClassVar[bool] = False
    capacity_split_by_rank: ClassVar[bool] = True

    config_model = ExampleTierConfig

    # -- class abilities: ProbeSource, InventorySource ----------------------------------
    @classmethod
    def probe(cls, config: ExampleTierConfig, layouts: Sequence[KVLayout]) -> ExampleProbe:
        """`ProbeSource`: a probe of the tier `config` names, for chunks of every layout."""
        return ExampleProbe(config.tier_name, [layout.digest() for layout in layouts])

    @classmethod
    def open_inventory(cls, config: ExampleTierConfig) -> ExampleInventory:
        """`InventorySource`: what the tier `config` names holds, every layout."""
        return ExampleInventory(config.tier_name)

    def __init__(self, config: ExampleTierConfig, layout: KVLayout, *,
                 clock: Callable[[], float] = time.time) -> None:
        """`clock`: wall-clock seconds for pins and expiry (a fake in tests)."""
        # `name` is the tier's name in stats, logs and events: unique within a store.
        self.name = config.tier_name
        self.chunk_bytes = layout.bytes_per_chunk
        self.capacity_chunks = config.capacity // self.chunk_bytes
        self.namespace = layout.digest()
        self._chunks: dict[ChunkKey, bytes] = {}
        # A policy orders the unpinned keys for eviction; the tier owns the data and the
        # locking.
        self._policy: Generations[ChunkKey] = make_policy(config.eviction,
                                                              self.capacity_chunks)
        self._admission = AdmissionFilter(config.admit_after)
        self._lock = threading.Lock()
        self._counters = TierCounters(self.name, self.capacity_chunks * self.chunk_bytes)
        # EventSource: the store listens here for what this tier stores and removes.
        self.events = TierEvents(self.name)
        # MetaKeeper: each chunk's tenant, pin and expiry (pins bounded to half the tier).
        self._book = RetentionBook(self.capacity_chunks * self.chunk_bytes, clock=clock)
        self.manifest: NamespaceManifest | None = None  # ManifestKeeper: the last one kept
        _LIVE.setdefault(self.name, weakref.WeakValueDictionary())[self.namespace] = self

    # -- the Tier protocol ------------------------------------------------------------------
    def contains(self, key: ChunkKey) -> bool:
        """Cheap and side-effect free: the store calls it for every lookup. An expired
        chunk is not held (it is removed by the next write)."""
        return key in self._chunks and not self._book.is_expired(key)

    def get_into(self, key: ChunkKey, out: memoryview,
                 meta: ChunkMeta = DEFAULT_META) -> TierResult:
        """Copy the chunk into the caller's buffer. A miss is data (MISSING), not an
        exception. A tier that reads from outside the process verifies what it read
        (`kvtier.core.chunkformat`: a tier that seals chunks opens them with `meta.tenant`'s
        key) and answers CORRUPT after removing a bad copy, NO_KEY (keeping it) when it
        holds no key for the tenant. Chunks in this process are in clear: `meta` is unused."""
        start = time.perf_counter()
        with self._lock:
            data = self._chunks.get(key) if self.contains(key) else None
            if data is not None:
                out[:] = data
                self._policy.touch(key)
                self._book.touch(key)
        if data is None:
            self._counters.add(misses=1)
            return MISSING
        self._counters.add(hits=1, bytes_read=len(data), read_s=time.perf_counter() - start)
        return OK

    def put(self, key: ChunkKey, data: memoryview, meta: ChunkMeta = DEFAULT_META) -> TierResult:
        """Store a copy (the caller reuses its buffer once this returns) with its tenant,
        pin and expiry. Already held is success, and the held chunk gets `meta`'s later pin
        or expiry (the one decision: nobody asks `contains` first); admission may decline;
        a full tier evicts by policy first. A wrong size is the caller's bug: ValueError,
        before anything changes."""
        if len(data) != self.chunk_bytes:
            raise ValueError(f"chunk is {len(data)} bytes, this tier stores {self.chunk_bytes}")
        refused = self._admit(key, meta)
        if refused is not None:
            return refused
        return OK if self._insert(key, bytes(data), meta) else FULL

    def _admit(self, key: ChunkKey, meta: ChunkMeta) -> TierResult | None:
        """None when the chunk is to be stored; else what `put` answers without storing:
        OK when held (and `meta` applied to it), FULL or DECLINED."""
        if self.contains(key):
            self.retain(key, meta)
            return OK
        if self.capacity_chunks == 0:
            self._counters.add(dropped_writes=1)
            return FULL
        return None if self._admission.offer(key) else DECLINED

    def _insert(self, key: ChunkKey, data: bytes, meta: ChunkMeta) -> bool:
        """Store `data`, evicting first; False when every chunk is pinned (FULL)."""
        start = time.perf_counter()
        with self._lock:
            self._reap()
            if key in self._chunks:  # another thread stored it meanwhile
                return True
            while len(self._chunks) >= self.capacity_chunks:
                victim = self._policy.evict()
                if victim is None:  # every chunk held is pinned
                    self._counters.add(dropped_writes=1)
                    return False
                self._remove(victim, evicted=True)
                self._counters.add(evictions=1)
            self._chunks[key] = data
            if not self._book.records(meta) or not self._book.record(key, meta, len(data)):
                self._policy.insert(key)  # pinned chunks stay out of the policy
            self.events.stored(key)
            held = len(self._chunks)
        self._counters.add(puts=1, bytes_written=len(data), write_s=time.perf_counter() - start)
        self._counters.set(chunks=held, used_bytes=held * self.chunk_bytes)
        return True

    def delete(self, key: ChunkKey) -> bool:
        """Remove one chunk; True if it was held. Removals are events too."""
        with self._lock:
            held = key in self._chunks
            if held:
                self._remove(key)
            count = len(self._chunks)
        self._counters.set(chunks=count, used_bytes=count * self.chunk_bytes)
        return held

    def _remove(self, key: ChunkKey, evicted: bool = False) -> None:
        """Drop a held chunk (deleted, evicted or expired). Lock held."""
        del self._chunks[key]
        if not evicted:
            self._policy.remove(key)
        self._book.forget(key, evicted=evicted)
        # Out of the policy just now (removed here, or evicted by the caller): retired or not.
        self.events.removed(key, retired=self._policy.left_retired)

    def _reap(self) -> None:
        """Put chunks whose pin ended back in the policy; remove expired ones. Lock held."""
        for key in self._book.lapsed_pins():
            self._policy.insert(key, self._book.parent_of(key))
        for key in self._book.due_expiries():
            if key in self._chunks:
                self._remove(key)

    def stats(self) -> TierStats:
        """A snapshot of the counters: the store and the connector's metrics read them."""
        return self._counters.snapshot()

    def close(self) -> None:
        """Release resources. A dict has none to release but its contents."""
        with self._lock:
            self._chunks.clear()

    # -- BatchLookup ------------------------------------------------------------------------
    def contains_many(self, keys: Sequence[ChunkKey]) -> list[bool]:
        """`contains` of each key, in one call (a remote tier: one round trip)."""
        return [self.contains(key) for key in keys]

    # -- InPlace ----------------------------------------------------------------------------
    @contextmanager
    def borrow(self, key: ChunkKey,
               meta: ChunkMeta = DEFAULT_META) -> Iterator[memoryview | None]:
        """A read-only view of the chunk, or None (a miss). A `bytes` value never changes
        and lives while viewed, so an eviction or a delete meanwhile cannot touch it."""
        with self._lock:
            data = self._chunks.get(key) if self.contains(key) else None
            if data is not None:
                self._policy.touch(key)
                self._book.touch(key)
        self._counters.add(**({"hits": 1, "bytes_read": len(data)} if data is not None
                              else {"misses": 1}))
        yield None if data is None else memoryview(data)

    @contextmanager
    def reserve(self, key: ChunkKey,
                meta: ChunkMeta = DEFAULT_META) -> Iterator[ExampleSlot | TierResult]:
        """Space to fill for `key` (stored with `meta` on commit), or what `put` would
        answer without it: OK (held, `meta` applied), DECLINED or FULL."""
        refused = self._admit(key, meta)
        if refused is not None:
            yield refused
            return
        yield ExampleSlot(memoryview(bytearray(self.chunk_bytes)),
                          lambda data: self._insert(key, data, meta))

    def check(self) -> list[str]:
        """`Checkable`: every chunk evictable or pinned, within the capacity."""
        with self._lock:
            problems = book_problems(self._chunks.keys(), self._policy, self._book)
            if len(self._chunks) > self.capacity_chunks:
                problems.append(f"{len(self._chunks)} chunks over the capacity "
                                f"{self.capacity_chunks}")
            return problems

    def retire(self) -> None:
        """`Retiring`: what is held now is evicted before what is stored from now on."""
        with self._lock:
            self._policy.retire()

    # -- MetaKeeper -------------------------------------------------------------------------
    def retain(self, key: ChunkKey, meta: ChunkMeta) -> bool:
        """Extend a held chunk's pin and expiry to `meta`'s; False when not held."""
        with self._lock:
            if key not in self._chunks:
                return False
            if self._book.retain(key, meta, self.chunk_bytes):
                self._policy.remove(key)  # pinned now: out of the policy
            return True

    def meta_of(self, key: ChunkKey) -> ChunkMeta | None:
        with self._lock:
            return self._book.meta_of(key)

    def retention_stats(self) -> RetentionStats:
        with self._lock:
            self._reap()
            return self._book.stats()

    # -- ManifestKeeper ---------------------------------------------------------------------
    def keep_manifest(self, manifest: NamespaceManifest) -> None:
        """Record which model the namespace belongs to (a persistent tier writes it beside
        its chunks: kvtier.tiers.manifest)."""
        self.manifest = manifest


class ExampleSlot:
    """The space `ExampleTier.reserve` hands out (`kvtier.core.tier.Slot`)."""

    def __init__(self, data: memoryview, store: Callable[[bytes], bool]) -> None:
        self.data = data
        self._store = store

    def commit(self) -> None:
        self._store(bytes(self.data))


class ExampleProbe:
    """`kvtier.core.tier.Probe` of the example tiers named `name`: held when the live tier
    of every layout holds the chunk."""

    blocking_ok = True  # a dict lookup

    def __init__(self, name: str, digests: Sequence[str]) -> None:
        self._name, self._digests = name, list(digests)

    def contains(self, key: ChunkKey) -> bool:
        tiers = _LIVE.get(self._name)
        return tiers is not None and all((tier := tiers.get(d)) is not None and tier.contains(key)
                   for d in self._digests)

    def close(self) -> None:
        """Nothing to release: the live tiers are their owners'."""


class ExampleInventory:
    """`kvtier.core.tier.Inventory` of the live example tiers named `name`."""

    kind = "example"

    def __init__(self, name: str) -> None:
        self.name = name

    def chunks(self) -> Iterator[StoredChunk]:
        now = time.time()
        tiers = _LIVE.get(self.name)
        for digest, tier in list(tiers.items() if tiers is not None else ()):
            for key in list(tier._chunks):
                yield StoredChunk(digest, key.hex(), tier.chunk_bytes, now, ())

    def remove(self, chunks: Sequence[StoredChunk]) -> int:
        tiers = _LIVE.get(self.name)
        return sum(tier.delete(ChunkKey(bytes.fromhex(c.key_hex))) for c in chunks
                   if tiers is not None and (tier := tiers.get(c.namespace)) is not None)

    def close(self) -> None:
        return None
