"""The example tier: chunks in a plain dict of bytes. A tutorial, and a test double.

Not for production (it copies every chunk into a new `bytes` and forgets everything on exit;
use `memory` for RAM). It is registered as kind "example" so that it is built exactly as
real tiers are, but the registry keeps it out of the kinds offered to operators.

How to write a tier, by the example of this one:

1. Write its config model: a `kvtier.tiers.storeconfig.TierSettings` subclass with `kind:
   Literal["<kind>"]` and one commented field per setting. pydantic validates it; every bad
   value becomes a ConfigError naming the field (`tiers.0.<kind>.<field>`), the value and
   what is allowed. `name`, `capacity`, `eviction` and `admit_after` come with the base.
2. Write the tier class, with `config_model = <the model>`, the kind's facts as class
   attributes (`medium`, `locality`, `has_path`, `has_server`, `capacity_split_by_rank`:
   KV events, doctor, the simulator and the TP split read them) and a constructor
   `__init__(config, layout)`: the store's registry builds every tier that way.
3. Implement the `kvtier.core.tier.Tier` protocol (each method below says what it must do).
   Reads and writes never raise for I/O: they return a `TierResult` whose `failure` says why
   they failed (`MISSING`, `CORRUPT`, `IO_ERROR`, `UNAVAILABLE`, `FULL`, `DECLINED`), and the
   store counts the failures per reason. Keep a `TierCounters` for `stats()`.
4. Offer the optional abilities that fit, as whole protocols, never as stubs that raise:
   `EventSource` (this tier: report what is stored and removed), `Lender`/`Reserver`
   (memory that can be lent or filled in place), `BatchLookup` (one round trip for many
   lookups), and on the class `probe` (other processes can see the contents) or
   `open_inventory` (persistent storage an operator can inspect and gc).
5. Add one line to `kvtier.tiers.registry.TIER_CLASSES`, and the kind to the contract suite
   (tests/tierkit.py): every tier passes the same tests.

Primitives: `ExampleTier`, `ExampleTierConfig`.
"""

from __future__ import annotations

import threading
import time
from typing import ClassVar, Literal

from kvtier.core.keys import ChunkKey
from kvtier.core.layout import KVLayout
from kvtier.core.policies import AdmissionFilter, EvictionPolicy, make_policy
from kvtier.core.tier import (
    DECLINED,
    FULL,
    MISSING,
    OK,
    Locality,
    Medium,
    TierCounters,
    TierEvents,
    TierResult,
    TierStats,
)
from kvtier.tiers.storeconfig import TierSettings


class ExampleTierConfig(TierSettings):
    """A dict of bytes in this process (the tutorial tier; tests and docs only)."""

    kind: Literal["example"]


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

    def __init__(self, config: ExampleTierConfig, layout: KVLayout) -> None:
        # `name` is the tier's name in stats, logs and events: unique within a store.
        self.name = config.tier_name
        self.chunk_bytes = layout.bytes_per_chunk
        self.capacity_chunks = config.capacity // self.chunk_bytes
        self._chunks: dict[ChunkKey, bytes] = {}
        # A policy orders the keys for eviction; the tier owns the data and the locking.
        self._policy: EvictionPolicy[ChunkKey] = make_policy(config.eviction,
                                                              self.capacity_chunks)
        self._admission = AdmissionFilter(config.admit_after)
        self._lock = threading.Lock()
        self._counters = TierCounters(self.name, self.capacity_chunks * self.chunk_bytes)
        # EventSource: the store listens here for what this tier stores and removes.
        self.events = TierEvents(self.name)

    def contains(self, key: ChunkKey) -> bool:
        """Cheap and side-effect free: the store calls it for every lookup."""
        return key in self._chunks

    def get_into(self, key: ChunkKey, out: memoryview) -> TierResult:
        """Copy the chunk into the caller's buffer. A miss is data (MISSING), not an
        exception. A tier that reads from outside the process verifies what it read
        (`kvtier.core.chunkformat`) and answers CORRUPT, after removing the bad copy."""
        start = time.perf_counter()
        with self._lock:
            data = self._chunks.get(key)
            if data is not None:
                out[:] = data
                self._policy.touch(key)
        if data is None:
            self._counters.add(misses=1)
            return MISSING
        self._counters.add(hits=1, bytes_read=len(data), read_s=time.perf_counter() - start)
        return OK

    def put(self, key: ChunkKey, data: memoryview) -> TierResult:
        """Store a copy (the caller reuses its buffer once this returns). Already held is
        success; admission may decline; a full tier evicts by policy first. A wrong size is
        the caller's bug: ValueError, before anything changes."""
        if len(data) != self.chunk_bytes:
            raise ValueError(f"chunk is {len(data)} bytes, this tier stores {self.chunk_bytes}")
        if key in self._chunks:
            return OK
        if self.capacity_chunks == 0:
            self._counters.add(dropped_writes=1)
            return FULL
        if not self._admission.offer(key):
            return DECLINED
        start = time.perf_counter()
        with self._lock:
            while len(self._chunks) >= self.capacity_chunks:
                victim = self._policy.evict()
                if victim is None:
                    break
                del self._chunks[victim]
                self._counters.add(evictions=1)
                self.events.removed(victim)
            if key not in self._chunks:  # another thread may have stored it meanwhile
                self._chunks[key] = bytes(data)
                self._policy.insert(key)
                self.events.stored(key)
            held = len(self._chunks)
        self._counters.add(puts=1, bytes_written=len(data), write_s=time.perf_counter() - start)
        self._counters.set(chunks=held, used_bytes=held * self.chunk_bytes)
        return OK

    def delete(self, key: ChunkKey) -> bool:
        """Remove one chunk; True if it was held. Removals are events too."""
        with self._lock:
            held = self._chunks.pop(key, None) is not None
            if held:
                self._policy.remove(key)
                self.events.removed(key)
            count = len(self._chunks)
        self._counters.set(chunks=count, used_bytes=count * self.chunk_bytes)
        return held

    def stats(self) -> TierStats:
        """A snapshot of the counters: the store and the connector's metrics read them."""
        return self._counters.snapshot()

    def close(self) -> None:
        """Release resources. A dict has none to release but its contents."""
        with self._lock:
            self._chunks.clear()
