"""The contract every tier implements, and the counters every tier keeps.

A tier holds whole chunks of one layout, addressed by ChunkKey. It never raises for I/O on
its data path: a failed or corrupt read is a miss, a failed write is a dropped write; both
come back as a `TierResult` whose `failure` says why (and are counted, logged).

Everything a tier needs to know about a chunk arrives with the call: its `ChunkMeta`
(kvtier.core.retention: tenant, pin, expiry; `DEFAULT_META` when it asks nothing) is passed
to every write and to every read that may have to open a sealed chunk. `put` (and
`reserve`) is the one place that decides whether a chunk is held already: it is
idempotent, and a held chunk is not rewritten but gets `meta`'s later pin or expiry.

This module is the whole contract. `tiers/example.py` is the tutorial (a dict of bytes that
offers every optional ability); `tiers/memory.py` the production reference.

The protocol every tier implements: `Tier`. The optional abilities, each a whole protocol
(a tier offers it or not; none has a method a tier may refuse):
  - `BatchLookup`: many lookups in one round trip (remote stores);
  - `InPlace` + `Slot`: lend a read-only view of a held chunk, and hand out the space of a
    chunk to fill, both without a copy (memory);
  - `EventSource` + `TierEvents`: report the chunks stored and removed;
  - `MetaKeeper`: keep each chunk's tenant, pin and expiry (retain, report them);
  - `Retiring`: put every chunk held now behind anything stored later for eviction (this
    engine's weights were updated in place: what it holds is useless to it);
  - `Checkable`: compare the tier's own bookkeeping with its storage (index, files, used
    bytes, eviction order), for tests and operators;
  - `ManifestKeeper` + `NamespaceManifest`: record which model a namespace holds;
  - on the tier's CLASS, `ProbeSource` + `Probe`: "is this chunk stored?" for processes that
    do not own the tier, and `InventorySource` + `Inventory` + `StoredChunk`: what a
    persistent tier's storage holds, for operators (`Removal`: what a removal guarded by use
    did, tools/admin/inventory.py `UnusedRemoval`).
Results and counters: `TierResult` + `Failure`, `TierStats` (snapshot), `TierCounters`
(thread-safe counters), `EventKind`. Facts of a tier kind, class attributes of every tier:
`Medium`, `Locality` (and the flags on `Tier`).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Collection, Iterator, Sequence
from contextlib import AbstractContextManager
from dataclasses import asdict, dataclass, field, fields, replace
from enum import StrEnum
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, runtime_checkable

from kvtier import __version__
from kvtier.core.keys import ChunkKey
from kvtier.core.retention import DEFAULT_META, ChunkMeta, RetentionStats

if TYPE_CHECKING:
    from kvtier.core.layout import KVLayout

MANIFEST_FORMAT = 1  # "kvtier_manifest": the manifest document's version


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

    @property
    def of_the_tier(self) -> bool:
        """The tier failed (it erred, was down or did not answer in time), not the chunk
        (absent, damaged, or not this reader's): a sign of how the tier serves."""
        return self in (Failure.IO_ERROR, Failure.UNAVAILABLE, Failure.TIMEOUT,
                        Failure.RAISED)


@dataclass(frozen=True, slots=True)
class TierResult:
    """What one `get_into` or `put` did: `failure` is None on success.

    Truthy when it succeeded, so `if tier.put(key, data):` reads naturally.
    """

    failure: Failure | None = None
    # A put that succeeded without writing: the tier held the chunk already (`HELD`). The
    # store reports it apart from the chunks it wrote (`PendingPut.held`): a store whose top
    # tier has no slots to reserve learns it only from the put. Not compared: HELD == OK
    # (both a success), told apart by this field alone.
    held: bool = field(default=False, compare=False)

    @property
    def ok(self) -> bool:
        return self.failure is None

    def __bool__(self) -> bool:
        return self.failure is None


OK = TierResult()
HELD = TierResult(held=True)
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
    # Lookups whose reply was not in within the tier's lookup budget: misses (redis
    # lookup_timeout_ms, s3 lookup_timeout_s)
    lookup_timeouts: int = 0
    dropped_writes: int = 0  # puts not stored: I/O error, no space, queue full
    chunks: int = 0  # chunks held now
    used_bytes: int = 0  # bytes held now (as stored, headers included)
    capacity_bytes: int = 0  # the tier's bound
    # The eviction policy's reuse horizon, in operations: what `eviction: prefix` learned from
    # the traffic (kvtier.core.policies.prefix); 0 for the other policies, or none learned yet.
    policy_horizon_ops: float = 0.0
    # Metadata operations asked of the filesystem by a file tier (kvtier.tiers.files.fsops; 0 for
    # the others): on NFS each is a round trip to the server the fleet shares.
    meta_stats: int = 0  # stat/lstat calls
    meta_opens: int = 0  # opens of files and directories
    meta_unlinks: int = 0  # unlinks
    meta_dir_reads: int = 0  # directory listings
    meta_other: int = 0  # renames, mkdirs, utimes, ftruncates

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

    def get_into(self, key: ChunkKey, out: memoryview,
                 meta: ChunkMeta = DEFAULT_META) -> TierResult:
        """Copy the chunk's payload into `out` (exactly one chunk long); OK on a hit.
        `meta`: whose chunk it is (a sealed chunk opens with its tenant's key only).

        A verified hit only: absent, corrupt or unreadable data is a miss whose `failure`
        says which (and corrupt data is removed; a sealed chunk this reader holds no key
        for is NO_KEY, and kept). Never raises for I/O.
        """
        ...

    def put(self, key: ChunkKey, data: memoryview,
            meta: ChunkMeta = DEFAULT_META) -> TierResult:
        """Store one chunk's payload with its tenant, pin and expiry (`meta`); OK when it
        is stored, HELD (also a success) when it already was.

        The one place that decides whether the chunk is held: a held chunk is not
        rewritten (a tier that keeps metadata extends its pin and expiry to `meta`'s, as
        `MetaKeeper.retain`). A failure when the tier declined (admission) or could not
        store it (counted as a dropped write). Evicts older chunks to stay within capacity.
        Never raises for I/O; raises ValueError when `data` is not exactly one chunk (the
        caller's bug).
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
class Warmable(Protocol):
    """An optional ability of a tier reached through connections (remote stores): open them
    ahead of the first reads. `TieredStore` asks once, on a thread of its own, as it starts,
    so that an engine's (or a node's) first load does not pay for a connection per read in
    flight, each a round trip or more, taken while the load waits."""

    def warm(self, connections: int) -> None:
        """Open up to `connections` connections for reads. May block (a server slow to
        answer); stops at the first failure; never raises."""
        ...


class Slot(Protocol):
    """The space `InPlace.reserve` hands out for one chunk."""

    data: memoryview  # writable, exactly one chunk long

    def commit(self) -> None:
        """Store what `data` holds under the reserved key: visible to lookups from now on,
        still pinned until the reservation's block exits."""
        ...


@runtime_checkable
class InPlace(Protocol):
    """An optional ability of a tier whose chunks sit in addressable memory (the memory
    tier): chunks are read and written where they lie. `borrow` lends a view of a chunk,
    so the vLLM worker scatters straight from the tier into the paged KV; `reserve` hands
    out the space for a chunk, filled in place by a gather from the paged KV or a read from
    a slower tier rather than filled elsewhere and copied in by `put` (one copy, not two)."""

    def borrow(self, key: ChunkKey,
               meta: ChunkMeta = DEFAULT_META) -> AbstractContextManager[memoryview | None]:
        """A context manager yielding a read-only view of the chunk's payload, or None when
        the chunk is not held (a miss, counted as by `get_into`, which `meta` is for).

        The chunk's storage is pinned while the block runs: it is neither overwritten nor
        reused, even if the chunk is evicted or deleted meanwhile (its space is freed when
        the last borrower leaves). The view must not be used after the block. Never raises
        for I/O. Any thread; borrowers do not block each other.
        """
        ...

    def reserve(self, key: ChunkKey, meta: ChunkMeta = DEFAULT_META,
                ) -> AbstractContextManager[Slot | TierResult]:
        """A context manager yielding free space for `key`, stored with `meta` once
        committed; or, when there is none, the `TierResult` `put` would have returned: OK
        when the tier holds the chunk already (`meta` applied to it, as by `put`: the same
        one decision), DECLINED (admission) or FULL (no free space: a dropped write).

        Fill `slot.data`, then `slot.commit()` to store it. The space stays pinned until
        the block exits (neither overwritten nor reused, as by `borrow`), so the caller may
        read it back; a block left without a commit stores nothing. Never raises for I/O.
        Any thread.
        """
        ...


class EventKind(StrEnum):
    """What happened to a chunk in a tier."""

    STORED = "stored"
    REMOVED = "removed"  # evicted, deleted, or found corrupt


# (tier name, kind, key, retired). Called on the tier's thread, possibly under its lock: a
# listener must only record, never block or call back into the tier.
TierListener = Callable[[str, EventKind, ChunkKey, bool], None]


class TierEvents:
    """Where a tier reports the chunks it stored and removed (evicted, deleted, corrupt)."""

    def __init__(self, tier_name: str) -> None:
        self.tier_name = tier_name
        self._listener: TierListener | None = None

    def listen(self, listener: TierListener | None) -> None:
        self._listener = listener

    def stored(self, key: ChunkKey) -> None:
        if self._listener is not None:
            self._listener(self.tier_name, EventKind.STORED, key, False)

    def removed(self, key: ChunkKey, retired: bool = False) -> None:
        """`key` left the tier; `retired`: it was held when the tier last retired what it
        held (`Retiring`) and not stored since (the engine's reset told routers it was gone:
        vLLM's AllBlocksCleared)."""
        if self._listener is not None:
            self._listener(self.tier_name, EventKind.REMOVED, key, retired)


@runtime_checkable
class EventSource(Protocol):
    """An optional ability: the tier reports what it stores and removes (KV events, and the
    scheduler's index of what is held). Tiers whose contents change behind their back
    (a server's own eviction) cannot offer it."""

    events: TierEvents


@runtime_checkable
class Retiring(Protocol):
    """An optional ability of a tier this engine alone writes (RAM, a local disk): after a
    weight update in place, the chunks it holds leave first when space is needed."""

    def retire(self) -> None:
        """Every chunk held now is evicted before any chunk stored from now on; none is
        removed yet (a restart on the old weights may use them). O(1), no I/O. When one
        leaves, its removal event says it was retired (`TierEvents.removed`)."""
        ...


@runtime_checkable
class Checkable(Protocol):
    """An optional ability of a tier that keeps books of what it holds (an index, used
    bytes, an eviction order): it can check them against its storage."""

    def check(self) -> list[str]:
        """What disagrees between the books and the storage (a chunk indexed without its
        bytes or the reverse, used bytes that are not the sum of the chunks, a chunk neither
        evictable nor pinned), one line each; empty when they agree. Meant at rest (no call
        in flight: a write on its way is reported); reads the whole index (and, for files,
        walks the directory): not for a hot path. Any thread."""
        ...


@runtime_checkable
class MetaKeeper(Protocol):
    """An optional ability of a tier: it keeps each chunk's `ChunkMeta` (the tenant for
    quotas, the pin, the expiry) that `put` and `reserve` bring, and reports them."""

    def retain(self, key: ChunkKey, meta: ChunkMeta) -> bool:
        """Extend a held chunk's pin and expiry to `meta`'s (a later pin or expiry wins; a
        pin beyond the tier's bound is refused and counted): a hit of a request that asks
        to retain its prefix. False when not held."""
        ...

    def meta_of(self, key: ChunkKey) -> ChunkMeta | None:
        """A held chunk's own metadata, carried along when it is promoted: its request's
        tenant, pin and expiry, and its parent; not an expiry the tier's own `ttl_s` gave it
        (the tier above dates it by its own). None: not held, or nothing recorded."""
        ...

    def retention_stats(self) -> RetentionStats:
        """Pins, expiries and per-tenant usage now."""
        ...


@dataclass(frozen=True, slots=True)
class NamespaceManifest:
    """Which model a storage namespace's chunks are the KV of (kvtier.tiers.manifest has
    the document's format and where each tier keeps it)."""

    namespace: str  # the layout digest it describes
    model: str  # the model's name as served
    fingerprint: str  # the model's fingerprint, "" when none
    weight_files: int  # checkpoint files in the fingerprint; 0: weights not fingerprinted
    layout: dict[str, Any] = field(hash=False)  # the KVLayout's fields
    kvtier_version: str = __version__  # the kvtier that wrote it
    created_s: float = 0.0  # unix time it was first written

    def same_as(self, other: NamespaceManifest | None) -> bool:
        """Equal but for `created_s` (no rewrite needed)."""
        return other is not None and replace(other, created_s=self.created_s) == self

    def to_json(self) -> bytes:
        return json.dumps({"kvtier_manifest": MANIFEST_FORMAT, **asdict(self)},
                          sort_keys=True).encode()


@runtime_checkable
class ManifestKeeper(Protocol):
    """An optional ability of a persistent tier: record the manifest of the namespace it
    holds (`kvtier.tiers.open_store` calls it once, after building the tier)."""

    def keep_manifest(self, manifest: NamespaceManifest) -> None:
        """Write `manifest` now or later, if missing or different. Never raises."""
        ...


class Probe(Protocol):
    """A side-effect-free "is this chunk stored?" for one tier, for a process that does not
    own it (vLLM's scheduler: kvtier.core.locator)."""

    blocking_ok: bool  # cheap enough to call on a latency-critical thread

    def contains(self, key: ChunkKey) -> bool: ...

    def close(self) -> None:
        """Release what asking opened (connections, threads, mappings); nothing else is
        asked of it after. Its owner (the scheduler's `ChunkLocator`) calls it, from its own
        close: a scheduler side rebuilt in another namespace leaked its probes' connections
        otherwise (tests/connector/test_handshake_rebuild.py)."""
        ...


@runtime_checkable
class DirectoryOwnerSource(Protocol):
    """An optional ability of a tier CLASS whose open takes its directory for itself (disk:
    one engine at a time): refuse, without opening a tier, where another process's open tier
    owns the directory a model's engine would open (`kvtier serve`, before vLLM starts)."""

    @classmethod
    def refuse_owned(cls, config: Any, models: Collection[str]) -> None:
        """Raises:
            DirectoryInUse: another process's open tier owns a directory of one of `models`
                (a model's name as served) in the tier `config` names.
            OSError: the tier's directory cannot be listed.
        """
        ...


@runtime_checkable
class ProbeSource(Protocol):
    """An optional ability of a tier CLASS whose contents other processes can see (files,
    remote stores): build a `Probe` for the tier a config names, with no side effects."""

    @classmethod
    def probe(cls, config: Any, layouts: Sequence[KVLayout]) -> Probe:
        """A probe for chunks of all `layouts` (e.g. every TP rank's): a chunk counts only
        when every layout's copy is held."""
        ...


@dataclass(frozen=True, slots=True)
class StoredChunk:
    """One chunk as a persistent tier's storage holds it (see `Inventory`)."""

    namespace: str  # the layout digest
    key_hex: str  # the chunk key
    size_bytes: int  # bytes it takes in the tier (file size; Redis MEMORY USAGE of its values)
    last_used_s: float  # unix time of its last write or hit (mtime; LRU index or idle time)
    locations: tuple[str, ...]  # its file path, or its Redis value names


@dataclass(frozen=True, slots=True)
class Removal:
    """What a removal guarded by use (`UnusedRemoval.remove_unused`) did."""

    removed: int  # chunks deleted (those still there, unused since they were listed)
    kept_used: tuple[StoredChunk, ...] = ()  # kept: read or written since they were listed


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


@dataclass(frozen=True, slots=True)
class LinkSpeed:
    """What reaching a remote tier costs, measured by its `LinkProbe`."""

    round_trip_s: float  # one request's round trip with no payload
    bytes_per_s: float  # payload bytes a second, one direction

    def read_s(self, nbytes: int, parallel: int = 1) -> float:
        """Expected seconds a read of `nbytes` adds to a load whose reads run `parallel` at
        once: the round trips overlap, the bytes share the link."""
        return self.round_trip_s / max(1, parallel) + nbytes / self.bytes_per_s


@runtime_checkable
class LinkProbe(Protocol):
    """An optional ability of a tier whose reads cross a link (a network, a network
    filesystem, a disk that may be a network volume): measure it in a few round trips (no
    chunk read or written; redis: pings and echoes, shared / disk: a probe file, s3: a probe
    object), so that a load's cost is estimated before its first load is timed (issue 45: a
    slow link's first hits are recomputed, not loaded)."""

    def measure_link(self) -> LinkSpeed | None:
        """The link's speed now; None when the tier does not answer, or not within the
        tier's deadline (kvtier.tiers.links). Never raises for I/O. Any thread; takes a few
        round trips (blocking)."""
        ...
