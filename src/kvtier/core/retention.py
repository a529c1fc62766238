"""Per-chunk tenant, pin and expiry, and per-tenant quotas: what a tier needs to honour them.

A chunk stored for a request carries a `ChunkMeta`: its tenant (`tenant_id` of the
request's vLLM `cache_salt`, a hash: the salt itself never reaches a tier; None is the
default tenant), until when it is pinned (`retain_until`: eviction never picks it before
then) and when it expires (`expires_at`: from then on it is a miss and its space is
reclaimed). Times are wall-clock seconds (`time.time()`), so that a deadline means the same
in every process and survives a restart where a tier persists it.

Every tier call about a chunk carries its `ChunkMeta` (`Tier.put`, `Tier.get_into`, ...;
`DEFAULT_META` for a chunk of the default tenant with neither pin nor expiry): a tier that
seals chunks per tenant reads the tenant there, a tier that keeps retention (the optional
`kvtier.core.tier.MetaKeeper`) records all of it. A tier's own bookkeeping is a
`RetentionBook` (tier-independent, not thread-safe: the tier locks): per-tenant usage and
LRU order, pins bounded by `max_pinned_share` of the tier, expiry, and the counters behind
`RetentionStats`.

Salts never reach logs or metrics: `tenant_label` gives a bounded-cardinality label (a
prefix of the tenant id, "other" beyond MAX_TENANT_LABELS distinct tenants).

Primitives: `ChunkMeta`, `DEFAULT_META`, `TenantQuota`, `RetentionBook`, `RetentionStats`,
`TenantUsage`, `tenant_id`, `tenant_label` (through `TENANT_LABELS`, a `TenantLabels`),
`DEFAULT_TENANT`.
"""

from __future__ import annotations

import hashlib
import heapq
import math
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from kvtier.core.keys import ChunkKey

DEFAULT_TENANT = "default"  # the label of chunks of requests without a cache salt
OTHER_TENANTS = "other"  # the label of every tenant past MAX_TENANT_LABELS
MAX_TENANT_LABELS = 32  # distinct tenant labels per process (bounded metric cardinality)


@dataclass(frozen=True, slots=True)
class ChunkMeta:
    """What a request asks of its chunks' lifetime in the tiers, and whose they are."""

    tenant: str | None = None  # tenant_id(the request's cache_salt); None: the default tenant
    retain_until: float | None = None  # wall-clock s: never evicted before then (a pin)
    expires_at: float | None = None  # wall-clock s: a miss from then on, space reclaimed
    # The key of the chunk before it in its prompt (its prefix ends there); None: the first
    # chunk, or not known. Not a request's ask: only the "prefix" eviction policy reads it
    # (kvtier.core.policies.prefix), and `is_default` ignores it.
    parent: ChunkKey | None = None
    # The engine that stored it through a kvtier node (set by the node, from the engine's
    # connection); None in process. Only a memory tier's `engine_quota` reads it.
    engine: str | None = None

    @classmethod
    def for_request(cls, cache_salt: str | None, retain_s: float | None, ttl_s: float | None,
                    now_s: float) -> ChunkMeta:
        """The metadata of the chunks of a request with `cache_salt`, stored at `now_s`
        (wall clock)."""
        return cls(tenant=tenant_id(cache_salt),
                   retain_until=None if retain_s is None else now_s + retain_s,
                   expires_at=None if ttl_s is None else now_s + ttl_s)

    @property
    def is_default(self) -> bool:
        """Whether it asks nothing: the default tenant, no pin, no expiry."""
        return self.tenant is None and self.retain_until is None and self.expires_at is None

    def __repr__(self) -> str:  # short, and never more of the tenant than its label
        return (f"ChunkMeta(tenant={tenant_label(self.tenant)}, "
                f"retain_until={self.retain_until}, expires_at={self.expires_at}, "
                f"parent={None if self.parent is None else self.parent.hex()[:12]})")


DEFAULT_META = ChunkMeta()  # the default tenant's chunk, neither pinned nor dated


@dataclass(frozen=True, slots=True)
class TenantQuota:
    """How much of a tier one tenant may hold: a share of its capacity or a cap in bytes
    (exactly one of them; checked by the tier's config model)."""

    share: float | None = None  # (0, 1]: at most this share of the tier's capacity
    cap_bytes: int | None = None  # at most this many bytes

    def limit_bytes(self, capacity_bytes: int) -> int:
        if self.cap_bytes is not None:
            return self.cap_bytes
        return int(capacity_bytes * (self.share if self.share is not None else 1.0))


@dataclass(frozen=True, slots=True)
class TenantUsage:
    """One tenant's part of a tier (labels are bounded: see `tenant_label`)."""

    tenant: str  # label: "default", "t-<first 8 hex digits of its tenant_id>", or "other"
    used_bytes: int  # bytes its chunks take now
    chunks: int  # chunks it holds now
    evictions: int  # its chunks evicted so far (by its own quota or the tier's LRU)


@dataclass(frozen=True, slots=True)
class RetentionStats:
    """A tier's pins, expiries and per-tenant usage (a snapshot)."""

    pinned_bytes: int = 0  # bytes of chunks pinned now
    pinned_chunks: int = 0  # chunks pinned now
    pins_refused: int = 0  # pins refused (beyond max_pinned_share): stored unpinned
    expired: int = 0  # chunks removed because their expiry passed
    quota_evictions: int = 0  # chunks evicted because their tenant was at its quota
    tenants: tuple[TenantUsage, ...] = ()


def tenant_id(cache_salt: str | None) -> str | None:
    """The tenant of a request with `cache_salt`, as tiers know it: a domain-separated
    SHA-256 of the salt (64 hex digits; the same in every process and after a restart), or
    None for no salt (the default tenant)."""
    if cache_salt is None:
        return None
    return hashlib.sha256(b"kvtier-tenant-v1|" + cache_salt.encode()).hexdigest()


def _is_tenant_id(text: str) -> bool:
    return len(text) == 64 and all(c in "0123456789abcdef" for c in text)


class TenantLabels:
    """Tenant -> bounded label, first come first served (the first `max_labels` tenants a
    process sees get their own label, later ones "other"). Thread-safe."""

    def __init__(self, max_labels: int) -> None:
        self._lock = threading.Lock()
        self._labels: dict[str, str] = {}
        self._max = max_labels

    def label(self, tenant: str | None) -> str:
        if tenant is None:
            return DEFAULT_TENANT
        ident = tenant if _is_tenant_id(tenant) else tenant_id(tenant)
        assert ident is not None
        with self._lock:
            found = self._labels.get(ident)
            if found is None:
                if len(self._labels) >= self._max:
                    return OTHER_TENANTS
                found = self._labels[ident] = "t-" + ident[:8]
            return found


TENANT_LABELS = TenantLabels(MAX_TENANT_LABELS)


def tenant_label(tenant: str | None) -> str:
    """A label naming a tenant in metrics and logs without revealing its salt: "default"
    (None), "t-" + the first 8 hex digits of its `tenant_id` (stable across processes and
    restarts; `tenant` may be the id or the salt: the same label), or "other" once
    MAX_TENANT_LABELS tenants have labels in this process."""
    return TENANT_LABELS.label(tenant)


class _Tenant:
    """One tenant's chunks in a `RetentionBook`."""

    __slots__ = ("chunks", "evictions", "order", "used_bytes")

    def __init__(self) -> None:
        self.used_bytes = 0
        self.chunks = 0
        self.evictions = 0
        # Its unpinned chunks, least recently used first (its own victims under a quota).
        self.order: OrderedDict[ChunkKey, None] = OrderedDict()


class RetentionBook:
    """Tenant, pin and expiry of every chunk of one tier, and per-tenant usage.

    Chunks are recorded when their metadata asks something (not `is_default`), or always
    once the tier has a quota or a default TTL (`records_all`): without those, default
    chunks cost nothing here (the tier leaves them out, `records`), so the plain path is
    unchanged.

    Not thread-safe: the owning tier calls it under its own lock. The tier keeps its own
    eviction policy over *unpinned* chunks only: `record` says whether a new chunk is pinned
    (then the tier leaves it out of its policy), and `lapsed_pins` hands back chunks whose
    pin ended (the tier puts them back into its policy).
    """

    def __init__(self, capacity_bytes: int, *, quota: TenantQuota | None = None,
                 max_pinned_share: float = 0.5, ttl_s: float | None = None,
                 clock: Callable[[], float]) -> None:
        """Args:
            capacity_bytes: the tier's capacity (shares are of it).
            quota: per-tenant limit, or None (no quota).
            max_pinned_share: pinned bytes never exceed this share of the capacity.
            ttl_s: the tier's default expiry for chunks whose request set none (None: never).
            clock: wall-clock seconds (`time.time`; a fake in tests).
        """
        self.clock = clock
        self._quota_bytes = None if quota is None else quota.limit_bytes(capacity_bytes)
        self._max_pinned_bytes = int(capacity_bytes * max_pinned_share)
        self._ttl_s = ttl_s
        # Whether every chunk must be recorded (a quota counts all of a tenant's chunks, a
        # default TTL dates all of them); else only chunks that carry metadata.
        self.records_all = quota is not None or ttl_s is not None
        self._tenant_of: dict[ChunkKey, str | None] = {}
        self._size: dict[ChunkKey, int] = {}
        self._tenants: dict[str | None, _Tenant] = {}
        self._pinned: dict[ChunkKey, float] = {}  # key -> pinned until
        self._pin_heap: list[tuple[float, ChunkKey]] = []
        self._expires: dict[ChunkKey, float] = {}  # key -> expires at
        self._expiry_heap: list[tuple[float, ChunkKey]] = []
        # Keys whose expiry is the tier's ttl_s, not their request's: not theirs to carry to
        # another tier or across a restart (`meta_of`, docs/retention.md).
        self._tier_dated: set[ChunkKey] = set()
        # key -> the chunk before it in its prompt, where its metadata named one: a pinned
        # chunk re-enters a prefix policy under it when its pin ends, and a promoted chunk
        # carries it up (without it, either was a root its parent could leave before).
        self._parent: dict[ChunkKey, ChunkKey] = {}
        self.pinned_bytes = 0
        self.pins_refused = 0
        self.expired_count = 0
        self.quota_evictions = 0
        self._gone: dict[str | None, int] = {}  # evictions of tenants holding nothing now

    # -- chunks in and out -------------------------------------------------------------------
    def records(self, meta: ChunkMeta) -> bool:
        """Whether a chunk stored with `meta` is recorded here (see the class doc)."""
        return self.records_all or not meta.is_default

    def record(self, key: ChunkKey, meta: ChunkMeta, size_bytes: int) -> bool:
        """A chunk became resident; True when it is pinned (leave it out of the policy)."""
        tenant = meta.tenant
        self._tenant_of[key] = tenant
        self._size[key] = size_bytes
        account = self._tenants.get(tenant)
        if account is None:
            account = self._tenants[tenant] = _Tenant()
            account.evictions = self._gone.pop(tenant, 0)
        account.used_bytes += size_bytes
        account.chunks += 1
        if meta.parent is not None:
            self._parent[key] = meta.parent
        expires_at = meta.expires_at
        if expires_at is None and self._ttl_s is not None:
            expires_at = self.clock() + self._ttl_s
            self._tier_dated.add(key)
        if expires_at is not None:
            self._set_expiry(key, expires_at)
        until = meta.retain_until
        if until is not None and self._pin(key, until):
            return True
        account.order[key] = None
        return False

    def forget(self, key: ChunkKey, *, evicted: bool = False) -> None:
        """A chunk left (deleted, evicted, expired, corrupt); `evicted` counts it against its
        tenant's evictions."""
        if key not in self._tenant_of:
            return
        tenant = self._tenant_of.pop(key)
        size = self._size.pop(key)
        account = self._tenants[tenant]
        account.used_bytes -= size
        account.chunks -= 1
        account.order.pop(key, None)
        if evicted:
            account.evictions += 1
        if key in self._pinned:
            del self._pinned[key]
            self.pinned_bytes -= size
        self._expires.pop(key, None)
        self._tier_dated.discard(key)
        self._parent.pop(key, None)
        if account.chunks == 0:
            del self._tenants[tenant]
            self._gone[tenant] = account.evictions
            if len(self._gone) > 4 * MAX_TENANT_LABELS:  # bounded: oldest forgotten
                del self._gone[next(iter(self._gone))]

    def touch(self, key: ChunkKey) -> None:
        """A resident chunk was read (its tenant's LRU order)."""
        tenant = self._tenant_of.get(key, None)
        account = self._tenants.get(tenant)
        if account is not None and key in account.order:
            account.order.move_to_end(key)

    def retain(self, key: ChunkKey, meta: ChunkMeta, size_bytes: int) -> bool:
        """Extend a resident chunk's pin and expiry: a later pin or expiry wins, and a chunk
        that never expires keeps never expiring (a retain never shortens a chunk's life). An
        expiry later than the one the tier's ttl_s gave becomes the chunk's own; an earlier
        one leaves it without one (docs/retention.md: a restart without ttl_s keeps it).
        True when the chunk has just become pinned (the tier takes it out of its policy).
        A chunk not recorded yet (stored without metadata) is the default tenant's."""
        if key not in self._tenant_of:
            if meta.retain_until is None:
                return False
            return self.record(key, ChunkMeta(None, meta.retain_until, None, meta.parent),
                               size_bytes)
        if meta.expires_at is not None and meta.expires_at > self._expires.get(key, math.inf):
            self._set_expiry(key, meta.expires_at)
            self._tier_dated.discard(key)  # the request's expiry now
        if meta.retain_until is None:
            return False
        if key in self._pinned:
            if meta.retain_until > self._pinned[key]:
                self._pinned[key] = meta.retain_until
                heapq.heappush(self._pin_heap, (meta.retain_until, key))
            return False
        if self._pin(key, meta.retain_until):
            self._tenants[self._tenant_of[key]].order.pop(key, None)
            return True
        return False

    # -- what to evict -----------------------------------------------------------------------
    def tenant_of(self, key: ChunkKey) -> str | None:
        return self._tenant_of.get(key)

    def meta_of(self, key: ChunkKey) -> ChunkMeta | None:
        """A recorded chunk's own metadata: its tenant, its pin and expiry, its parent; what
        it carries to another tier (a promotion) and across a restart (a persistent tier's
        journal). Not an expiry the tier's own ttl_s gave it: that is the tier's, and a tier
        it reaches, or this one restarted, dates it by its own ttl_s (docs/retention.md)."""
        if key not in self._tenant_of:
            return None
        expires_at = None if key in self._tier_dated else self._expires.get(key)
        return ChunkMeta(self._tenant_of[key], self._pinned.get(key), expires_at,
                         self._parent.get(key))

    def metas(self) -> list[tuple[ChunkKey, ChunkMeta]]:
        """Every recorded chunk's `meta_of` (a persistent tier's journal, compacted)."""
        return [(key, meta) for key in self._tenant_of
                if (meta := self.meta_of(key)) is not None]

    def expires_at(self, key: ChunkKey) -> float | None:
        """When a recorded chunk expires here: its own expiry, else the one the tier's ttl_s
        gave it (None: never, or not recorded)."""
        return self._expires.get(key)

    def parent_of(self, key: ChunkKey) -> ChunkKey | None:
        """The parent a recorded chunk's metadata named (None: none, or not recorded)."""
        return self._parent.get(key)

    def __len__(self) -> int:
        return len(self._tenant_of)

    def is_pinned(self, key: ChunkKey) -> bool:
        return key in self._pinned

    def over_quota(self, tenant: str | None, size_bytes: int) -> bool:
        """Whether storing `size_bytes` more for `tenant` would pass its quota."""
        if self._quota_bytes is None:
            return False
        account = self._tenants.get(tenant)
        used = account.used_bytes if account is not None else 0
        return used + size_bytes > self._quota_bytes

    def own_victim(self, tenant: str | None,
                   evictable: Callable[[ChunkKey], bool] | None = None) -> ChunkKey | None:
        """The tenant's least recently used unpinned chunk (that `evictable` allows: pins
        another book keeps), counted as a quota eviction (the tier evicts it and calls
        `forget`), or None when it has none."""
        account = self._tenants.get(tenant)
        if account is None:
            return None
        key = next((k for k in account.order if evictable is None or evictable(k)), None)
        if key is not None:
            self.quota_evictions += 1
        return key

    def usage(self) -> dict[str | None, tuple[int, int, int]]:
        """Each tenant's (used bytes, chunks, evictions), by its own name: for books whose
        tenants are not secret (a node's engines), unlike `stats`' labels."""
        usage = {tenant: (0, 0, evictions) for tenant, evictions in self._gone.items()}
        usage.update({tenant: (a.used_bytes, a.chunks, a.evictions)
                      for tenant, a in self._tenants.items()})
        return usage

    def is_expired(self, key: ChunkKey) -> bool:
        """Whether a resident chunk's expiry has passed (a miss; the tier reclaims it)."""
        at = self._expires.get(key)
        return at is not None and at <= self.clock()

    def due_expiries(self) -> list[ChunkKey]:
        """Resident chunks whose expiry has passed (the tier removes them and calls
        `forget`), each once; counted as expired. (The heap may hold one entry of a key
        twice: a chunk forgotten and recorded again with the same `expires_at`, as one
        evicted and promoted back from a lower tier is, leaves its old entry behind.)"""
        now = self.clock()
        due: dict[ChunkKey, None] = {}
        while self._expiry_heap and self._expiry_heap[0][0] <= now:
            at, key = heapq.heappop(self._expiry_heap)
            if self._expires.get(key) == at:
                due[key] = None
        self.expired_count += len(due)
        return list(due)

    def lapsed_pins(self) -> list[ChunkKey]:
        """Chunks whose pin has ended (now unpinned: the tier puts them back in its policy,
        under `parent_of`)."""
        now = self.clock()
        lapsed: list[ChunkKey] = []
        while self._pin_heap and self._pin_heap[0][0] <= now:
            until, key = heapq.heappop(self._pin_heap)
            if self._pinned.get(key) == until:
                del self._pinned[key]
                self.pinned_bytes -= self._size[key]
                self._tenants[self._tenant_of[key]].order[key] = None
                lapsed.append(key)
        return lapsed

    @property
    def has_deadlines(self) -> bool:
        """Whether any chunk has a pin or an expiry (else nothing needs checking)."""
        return bool(self._pin_heap or self._expiry_heap)

    def stats(self) -> RetentionStats:
        usage: dict[str, list[int]] = {}
        for tenant, account in self._tenants.items():
            row = usage.setdefault(tenant_label(tenant), [0, 0, 0])
            row[0] += account.used_bytes
            row[1] += account.chunks
            row[2] += account.evictions
        for tenant, evictions in self._gone.items():
            usage.setdefault(tenant_label(tenant), [0, 0, 0])[2] += evictions
        return RetentionStats(
            pinned_bytes=self.pinned_bytes, pinned_chunks=len(self._pinned),
            pins_refused=self.pins_refused, expired=self.expired_count,
            quota_evictions=self.quota_evictions,
            tenants=tuple(TenantUsage(label, *row) for label, row in sorted(usage.items())))

    # -- helpers -----------------------------------------------------------------------------
    def _pin(self, key: ChunkKey, until: float) -> bool:
        if until <= self.clock():
            return False
        size = self._size[key]
        if self.pinned_bytes + size > self._max_pinned_bytes:
            self.pins_refused += 1
            return False
        self._pinned[key] = until
        self.pinned_bytes += size
        heapq.heappush(self._pin_heap, (until, key))
        if len(self._pin_heap) > 2 * len(self._pinned) + 1024:
            self._pin_heap = [(t, k) for k, t in self._pinned.items()]
            heapq.heapify(self._pin_heap)
        return True

    def _set_expiry(self, key: ChunkKey, at: float) -> None:
        self._expires[key] = at
        heapq.heappush(self._expiry_heap, (at, key))
        # Entries of chunks gone or re-dated stay until their time: rebuild when they
        # outnumber the live ones, so that churn under a long TTL keeps the heap bounded.
        if len(self._expiry_heap) > 2 * len(self._expires) + 1024:
            self._expiry_heap = [(t, k) for k, t in self._expires.items()]
            heapq.heapify(self._expiry_heap)
