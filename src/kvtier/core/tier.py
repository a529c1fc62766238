"""The contract every tier implements, and the counters every tier keeps.

A tier holds whole chunks of one layout, addressed by ChunkKey. It never raises for I/O on
its data path: a failed or corrupt read is a miss, a failed write is a dropped write; both
come back as a `TierResult` whose `failure` says why (and are counted, logged).
`tiers/example.py` is the tutorial (a dict of bytes); `tiers/memory.py` the production
reference.

Primitives: `Tier` (protocol), `TierResult` + `Failure` (what a get or put did),
`StoredChunk` + `Inventory` (what a persistent tier's storage holds, for operators),
`BatchLookup` (optional protocol: many lookups in one round trip),
`Lender` (optional protocol: lend a read-only view of a held chunk, no copy),
`Reserver` + `Slot` (optional protocol: hand out the space of a chunk to fill in place),
`EventSource` (optional protocol: report chunks stored and removed), `TierEvents`,
`TierStats` (snapshot), `TierCounters` (thread-safe counters), `EventKind`. Facts of a tier
kind, class attributes of every tier: `Medium`, `Locality` (and the flags on `Tier`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, fields
from enum import StrEnum
from typing import Any, ClassVar, Protocol, runtime_checkable

from kvtier.core.keys import ChunkKey


class Medium(StrEnum):
    """Where a tier's chunks live, in the names of vLLM's KV events (`medium`) and offload
    tiers (`vllm.v1.kv_offload.base.Medium`)."""

    CPU = "CPU"  # this host's RAM
    STORAGE = "STORAGE"  # files or a server's memory, reached through I/O calls


class Locality(StrEnum):
    """Whether other engines reach a tier's chunks, in the names of vLLM's KV events
    (`locality`) and offload tiers (`vllm.v1.kv_offload.base.Locality`)."""

    LOCAL = "LOCAL"  # this engine's own (its process memory, a node-local directory)
    REMOTE = "REMOTE"  # one store that every engine configured with it reads and writes


class Failure(StrEnum):
    """Why a tier's get or put did not succeed. The values name the store's stats counters."""

    MISSING = "missing"  # not held (absent, evicted, or a part lost by a server)
    CORRUPT = "corrupt"  # read back but failed verification (and was removed)
    IO_ERROR = "io_error"  # the medium or server failed the call (EIO, EACCES, an error reply)
    UNAVAILABLE = "unavailable"  # the server is down or timed out (circuit breaker open)
    TIMEOUT = "timeout"  # no answer within the store's read deadline (the call was abandoned)
    FULL = "full"  # no room: capacity held by writes in flight, or the filesystem/server full
    DECLINED = "declined"  # admission: not offered often enough yet (by design, not a fault)
    READ_ONLY = "read_only"  # a write to storage this process may only read (a read-only mount)
    RAISED = "raised"  # the tier raised instead of returning (a bug; the store logs it)
    # A chunk whose codec this reader does not know, or whose bytes did not decode to the
    # payload its header describes (core/codecs.py; removed like a corrupt one).
    CODEC = "codec"
    # A sealed chunk that failed authentication under its key (core/sealing.py; removed like
    # a corrupt one).
    AUTH = "auth"
    # A sealed chunk under a key this reader does not hold (its tenant unknown here, another
    # tenant's or secret's): a miss, and the chunk is kept (another reader may hold the key).
    NO_KEY = "no_key"


@dataclass(frozen=True, slots=True)
class TierResult:
    """What one `get_into` or `put` did: `failure` is None on success.

    Truthy when it succeeded, so `if tier.put(key, data):` reads naturally.
    """

    failure: Failure | None = None

    @property
    def ok(self) -> bool:
        return self.failure is None

    def __bool__(self) -> bool:
        return self.failure is None


OK = TierResult()
MISSING = TierResult(Failure.MISSING)
CORRUPT = TierResult(Failure.CORRUPT)
IO_ERROR = TierResult(Failure.IO_ERROR)
UNAVAILABLE = TierResult(Failure.UNAVAILABLE)
FULL = TierResult(Failure.FULL)
DECLINED = TierResult(Failure.DECLINED)
READ_ONLY = TierResult(Failure.READ_ONLY)
CODEC = TierResult(Failure.CODEC)
AUTH = TierResult(Failure.AUTH)


@dataclass(frozen=True, slots=True)
class TierStats:
    """A snapshot of one tier's counters."""

    name: str
    hits: int = 0  # get_into calls that returned data
    misses: int = 0  # get_into calls that did not (absent, corrupt, unreadable)
    bytes_read: int = 0  # payload bytes returned by hits
    bytes_written: int = 0  # payload bytes stored by puts
    read_s: float = 0.0  # seconds spent in get_into
    write_s: float = 0.0  # seconds spent in put
    puts: int = 0  # chunks stored
    evictions: int = 0  # chunks removed to make room
    corrupt_reads: int = 0  # reads that failed verification (and were removed)
    dropped_writes: int = 0  # puts not stored: I/O error, no space, queue full
    chunks: int = 0  # chunks held now
    used_bytes: int = 0  # bytes held now (as stored, headers included)
    capacity_bytes: int = 0  # the tier's bound

    def as_dict(self) -> dict[str, float | int | str]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


class TierCounters:
    """Thread-safe accumulators behind TierStats: `add(hits=1, bytes_read=n)`, `set(...)`.

    A plain dict under a lock: `dataclasses.replace` on every update cost ~18 us per put
    (kvtier bench storage, memory tier). An unknown counter name raises KeyError.
    """

    def __init__(self, name: str, capacity_bytes: int) -> None:
        self._lock = threading.Lock()
        self._name = name
        self._values: dict[str, Any] = {f.name: 0 for f in fields(TierStats) if f.name != "name"}
        self._values["capacity_bytes"] = capacity_bytes

    def add(self, **deltas: Any) -> None:
        with self._lock:
            for counter, delta in deltas.items():
                self._values[counter] += delta

    def set(self, **values: Any) -> None:
        with self._lock:
            for counter, value in values.items():
                if counter not in self._values:
                    raise KeyError(counter)
                self._values[counter] = value

    def snapshot(self) -> TierStats:
        with self._lock:
            return TierStats(name=self._name, **self._values)


@runtime_checkable
class Tier(Protocol):
    """A store of whole chunks of one layout. Safe to call from any thread."""

    name: str  # unique within a store, e.g. "memory", "disk", "shared"
    # Facts of the kind, class attributes of every tier class: events, doctor, the simulator
    # and the TP capacity split read them (through `kvtier.tiers.registry.tier_class`);
    # nothing derives them from a kind string.
    medium: ClassVar[Medium]  # vLLM KV events' medium; CPU: it takes this host's RAM
    locality: ClassVar[Locality]  # REMOTE: shared by every engine configured with it
    has_path: ClassVar[bool]  # its config names a directory (`path`) it must be able to write
    has_server: ClassVar[bool]  # it reaches a server (`url`) that must answer
    # Whether each tensor-parallel rank enforces `capacity` on its own chunks, so that an
    # engine's ranks split it (`StoreConfig.per_rank`); False for a quota that every writer
    # enforces together (the shared directory's ledger).
    capacity_split_by_rank: ClassVar[bool]

    def contains(self, key: ChunkKey) -> bool:
        """Whether the chunk is (probably) held. Cheap: an index lookup or one stat call."""
        ...

    def get_into(self, key: ChunkKey, out: memoryview) -> TierResult:
        """Copy the chunk's payload into `out` (exactly one chunk long); OK on a hit.

        A verified hit only: absent, corrupt or unreadable data is a miss whose `failure`
        says which (and corrupt data is removed). Never raises for I/O.
        """
        ...

    def put(self, key: ChunkKey, data: memoryview) -> TierResult:
        """Store one chunk's payload; OK when it is stored (or already was).

        A failure when the tier declined (admission) or could not store it (counted as a
        dropped write). Evicts older chunks to stay within capacity. Never raises for I/O;
        raises ValueError when `data` is not exactly one chunk (the caller's bug).
        """
        ...

    def delete(self, key: ChunkKey) -> bool:
        """Remove a chunk; True if it was held."""
        ...

    def stats(self) -> TierStats:
        """A snapshot of this tier's counters."""
        ...

    def close(self) -> None:
        """Release resources; later calls may fail."""
        ...


@runtime_checkable
class BatchLookup(Protocol):
    """An optional ability of a tier: `contains` for many keys at once, for tiers where each
    call is a network round trip (remote stores). `TieredStore.lookup` uses it when present."""

    def contains_many(self, keys: Sequence[ChunkKey]) -> list[bool]:
        """`contains` of each key, in order, in one round trip (or one per server). A key
        whose server cannot answer is reported absent. Never raises for I/O."""
        ...


@runtime_checkable
class Lender(Protocol):
    """An optional ability of a tier whose chunks already sit in addressable memory (the
    memory tier): lend a read-only view of a chunk instead of copying it out, so that the
    vLLM worker scatters straight from the tier into the paged KV (one copy, not two)."""

    def borrow(self, key: ChunkKey) -> AbstractContextManager[memoryview | None]:
        """A context manager yielding a read-only view of the chunk's payload, or None when
        the chunk is not held (a miss, counted as by `get_into`).

        The chunk's storage is pinned while the block runs: it is neither overwritten nor
        reused, even if the chunk is evicted or deleted meanwhile (its space is freed when
        the last borrower leaves). The view must not be used after the block. Never raises
        for I/O. Any thread; borrowers do not block each other.
        """
        ...


class Slot(Protocol):
    """The space `Reserver.reserve` hands out for one chunk."""

    data: memoryview  # writable, exactly one chunk long

    def commit(self) -> None:
        """Store what `data` holds under the reserved key: visible to lookups from now on,
        still pinned until the reservation's block exits."""
        ...


@runtime_checkable
class Reserver(Protocol):
    """An optional ability of a tier whose chunks sit in addressable memory (the memory
    tier): hand out the space for a chunk so that it is filled in place, by a gather from
    vLLM's paged KV or a read from a slower tier, rather than filled elsewhere and copied
    in by `put` (one copy, not two)."""

    def reserve(self, key: ChunkKey) -> AbstractContextManager[Slot | None]:
        """A context manager yielding free space for `key`, or None when the tier holds
        the chunk already, declines it (admission) or has no free space (a dropped write).

        Fill `slot.data`, then `slot.commit()` to store it. The space stays pinned until
        the block exits (neither overwritten nor reused, as by `Lender.borrow`), so the
        caller may read it back; a block left without a commit stores nothing. Never
        raises for I/O. Any thread.
        """
        ...


class EventKind(StrEnum):
    """What happened to a chunk in a tier."""

    STORED = "stored"
    REMOVED = "removed"  # evicted, deleted, or found corrupt


# (tier name, kind, key). Called on the tier's thread, possibly under its lock: a listener
# must only record, never block or call back into the tier.
TierListener = Callable[[str, EventKind, ChunkKey], None]


class TierEvents:
    """Where a tier reports the chunks it stored and removed (evicted, deleted, corrupt)."""

    def __init__(self, tier_name: str) -> None:
        self.tier_name = tier_name
        self._listener: TierListener | None = None

    def listen(self, listener: TierListener | None) -> None:
        self._listener = listener

    def stored(self, key: ChunkKey) -> None:
        if self._listener is not None:
            self._listener(self.tier_name, EventKind.STORED, key)

    def removed(self, key: ChunkKey) -> None:
        if self._listener is not None:
            self._listener(self.tier_name, EventKind.REMOVED, key)


@runtime_checkable
class EventSource(Protocol):
    """An optional ability: the tier reports what it stores and removes (KV events, and the
    scheduler's index of what is held). Tiers whose contents change behind their back
    (a server's own eviction) cannot offer it."""

    events: TierEvents


@dataclass(frozen=True, slots=True)
class StoredChunk:
    """One chunk as a persistent tier's storage holds it (see `Inventory`)."""

    namespace: str  # the layout digest
    key_hex: str  # the chunk key
    size_bytes: int  # bytes it takes in the tier (file size; Redis MEMORY USAGE of its values)
    last_used_s: float  # unix time of its last write or hit (mtime; LRU index or idle time)
    locations: tuple[str, ...]  # its file path, or its Redis value names


class Inventory(Protocol):
    """The chunks a persistent tier's storage holds, every namespace, read without building
    the tier (building one evicts to its quota; `kvtier inspect` must change nothing), and a
    way to remove some (`kvtier gc`)."""

    name: str  # the tier's name in the store config
    kind: str  # the tier's kind

    def chunks(self) -> Iterator[StoredChunk]:
        """Every chunk stored, every namespace.

        Raises:
            OSError, redis.RedisError (or the medium's own error): storage unreachable.
        """
        ...

    def remove(self, chunks: Sequence[StoredChunk]) -> int:
        """Delete these chunks; the number that were still there."""
        ...

    def close(self) -> None: ...


@runtime_checkable
class InventorySource(Protocol):
    """An optional ability of a persistent tier's CLASS: open an `Inventory` of the storage
    a tier config names, without building the tier."""

    @classmethod
    def open_inventory(cls, config: Any) -> Inventory: ...
