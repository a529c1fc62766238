"""The disk tier's tenants, pins and expiry (`MetaKeeper`; `kvtier.core.retention`, settings
`tenant_quota`, `ttl_s`, `max_pinned_share`), as the memory tier keeps them, and kept across
restarts: each chunk's metadata is appended to a retention journal in the layout directory
(`tiers/files/retention_journal.py`), applied to the chunks the start-up index finds, then
rewritten compacted.

The tier (tiers/files/disk.py) is built on this class, which is built on its index
(diskindex.py).

Primitives: `DiskRetention`.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

from kvtier.core.keys import ChunkKey
from kvtier.core.retention import DEFAULT_META, ChunkMeta, RetentionStats
from kvtier.tiers.files.chunkfiles import ChunkFiles
from kvtier.tiers.files.diskindex import DiskIndex
from kvtier.tiers.files.retention_journal import RetentionJournal
from kvtier.tiers.retention import RetentionTierSettings


class DiskRetention(DiskIndex):
    """A disk tier's index with its chunks' tenants, pins and expiries, and their journal."""

    def __init__(self, config: RetentionTierSettings, capacity_bytes: int, files: ChunkFiles,
                 clock: Callable[[], float]) -> None:
        super().__init__(config, capacity_bytes, files, clock)
        # tenant -> bytes its writes in flight reserved (with a tenant_quota only): the
        # write-behind puts several chunks at once (io_threads), and each one's quota check
        # must count the others', or a tenant's concurrent writes each passed it.
        self._tenant_in_flight: Counter[str | None] | None = \
            Counter() if config.tenant_quota is not None else None
        self._journal = RetentionJournal(files.directory, files.writable)

    def retain(self, key: ChunkKey, meta: ChunkMeta) -> bool:
        """Extend a held chunk's pin and expiry (`MetaKeeper`); False when not held."""
        with self._lock:
            size = self._index.get(key)
            if size is None:
                return False
            if self._book.retain(key, meta, size):
                self._policy.remove(key)  # pinned now: out of the policy
        self._journal_append(key)
        return True

    def meta_of(self, key: ChunkKey) -> ChunkMeta | None:
        with self._lock:
            return self._book.meta_of(key)

    def retention_stats(self) -> RetentionStats:
        """Pins, expiries and per-tenant usage (expired chunks are reclaimed first)."""
        with self._lock:
            self._reap()
            stats = self._book.stats()
        self._publish_usage()
        return stats

    def _restore_retention(self, owned: bool) -> None:
        """Apply the journal to the chunks found at start-up: an expired one is removed, and
        a tenant over its quota (lowered since, or the capacity) evicts its own least
        recently used unpinned chunks down to it. Then rewrite the journal compacted (killed
        rewrites' temp files swept first, when this tier owns the directory: `owned`).
        Start-up only (the index thread, lock held)."""
        self._journal.sweep_temps(owned)
        entries = self._journal.load()
        # Every chunk, oldest first, where every chunk is recorded (a tenant's own LRU order
        # is its files', as the policy's is); else the journal's chunks alone.
        keys = list(self._index) if self._book.records_all \
            else [key for key in entries if key in self._index]
        for key in keys:
            meta = entries.get(key, DEFAULT_META)
            if meta.expires_at is not None and meta.expires_at <= self._book.clock():
                self._used_bytes -= self._index.pop(key)
                self._policy.remove(key)
                self.files.remove(key)
                self._book.expired_count += 1
            elif self._book.record(key, meta, self._index[key]):
                self._policy.remove(key)
        for tenant in list(self._book.usage()):
            self._make_tenant_room(tenant, 0)  # pinned chunks stay, over it if need be
        self._journal.rewrite((k, m) for k, m in self._book.metas() if k in entries)

    def _journal_append(self, key: ChunkKey) -> None:
        """`key`'s metadata appended to the journal (compacted when it grew). Takes the lock."""
        with self._lock:
            meta = self._book.meta_of(key)
            live = len(self._book)
        if meta is not None and self._journal.append(key, meta, live):
            self._compact_journal()

    def _compact_journal(self) -> None:
        """The journal rewritten with the held chunks' metadata alone. Takes the lock."""
        with self._lock:
            metas = self._book.metas()
        self._journal.rewrite(metas)

    def _expire(self, key: ChunkKey) -> None:
        """Remove `key`, past its expiry. Takes the lock."""
        with self._lock:
            self._book.expired_count += key in self._index
        self._forget(key, corrupt=False)

    def _tenant_writing(self, tenant: str | None) -> int:
        """Bytes `tenant`'s writes in flight reserved (0 without a quota). Lock held."""
        return 0 if self._tenant_in_flight is None else self._tenant_in_flight[tenant]

    def _tenant_wrote(self, tenant: str | None, size: int) -> None:
        """`size` bytes more (or, negative, fewer) of `tenant`'s in flight. Lock held."""
        if self._tenant_in_flight is not None:
            self._tenant_in_flight[tenant] += size
            if self._tenant_in_flight[tenant] <= 0:
                del self._tenant_in_flight[tenant]

    def _make_tenant_room(self, tenant: str | None, size: int) -> bool:
        """Evict `tenant`'s own LRU chunks while storing `size` bytes more would pass its
        quota; False when only pinned ones are left. Reaps pins and expiries first. Caller
        holds the lock."""
        self._reap()
        while self._book.over_quota(tenant, size):
            victim = self._book.own_victim(tenant)
            if victim is None:
                return False
            self._policy.remove(victim)
            self._drop(victim, evicted=True)
        return True

    def _reap(self) -> None:
        """Put chunks whose pin ended back in the policy; remove expired ones. Lock held."""
        if not self._book.has_deadlines:
            return
        for key in self._book.lapsed_pins():
            self._policy.insert(key, self._book.parent_of(key))
        for key in self._book.due_expiries():
            if key in self._index:
                self._policy.remove(key)
                self._drop(key, evicted=False)

    def _drop(self, key: ChunkKey, evicted: bool) -> None:
        """Remove a held chunk (just taken out of the policy: its `left_retired` is the
        chunk's). Lock held."""
        retired = self._policy.left_retired
        self._used_bytes -= self._index.pop(key, 0)
        self._book.forget(key, evicted=evicted)
        self._remove_file(key)
        if evicted:
            self._counters.add(evictions=1)
        self.events.removed(key, retired=retired)
