"""The local-disk tier (NVMe): one file per chunk, bounded in bytes, persistent.

The index (key -> file size) lives in memory and is rebuilt from the directory at start-up,
in the files' modification-time order, so the tier survives restarts with its LRU order. Hits
touch the file's mtime for the same reason. The rebuild runs on a thread of its own and does
not hold up start-up (issue 28: 1.7 s at 80,000 chunks, ~40 s at 2 million): the constructor
waits at most INDEX_WAIT_S for it (a small directory is indexed by then), and meanwhile a
lookup of a key not indexed yet asks the directory (one stat, as `contains` confirms a held
key anyway), so hits are served while the index fills; puts wait for it (the capacity is
only known once every file is counted; the write-behind queue drops meanwhile, counted).
The index is a dict of 16-byte keys (file sizes interned) beside the policy's order:
docs/performance.md, "The shared tier at fleet scale", has its bytes per chunk.

Capacity is reserved before a write so concurrent writes cannot overshoot it; a full
filesystem (ENOSPC) evicts and counts the write as dropped; a victim's file that cannot be
removed (the directory gone read-only) is removed once a write succeeds again, not left
beyond the capacity until a restart. One open tier owns the layout
directory, from its opening to its `close` or its process's end (an flock:
tiers/files/owner.py): a second open, in another process or this one, raises
DirectoryInUse. A directory several engines write is a `shared` tier's.

With a `codec` (and/or encryption, `kvtier.tiers.encoding`) a chunk is encoded on the
write-behind thread that puts it, before its room is reserved: the capacity counts the bytes
files really take, so a compressed tier holds more chunks in the same capacity.

Tenants, pins and expiry (`kvtier.core.retention`, settings `tenant_quota`, `ttl_s`,
`max_pinned_share`) work as in the memory tier; each chunk's metadata is appended to a
retention journal in the layout directory (`tiers/files/retention_journal.py`) so that a restart
keeps pins and expiries.
"""

from __future__ import annotations

import errno
import itertools
import logging
import threading
import time
from array import array
from collections import Counter
from collections.abc import Callable, Collection, Sequence
from dataclasses import replace
from pathlib import Path
from typing import ClassVar, Literal

import numpy as np
from pydantic import Field, ValidationInfo, field_validator

from kvtier.config import PositiveByteSize, reading_only
from kvtier.core.chunkformat import ALIGN_BYTES, HEADER_BYTES, failure_of
from kvtier.core.keys import ChunkKey
from kvtier.core.layout import KVLayout
from kvtier.core.policies import AdmissionFilter, Generations, make_policy
from kvtier.core.policies.clock import ClockPolicy
from kvtier.core.retention import DEFAULT_META, ChunkMeta, RetentionStats
from kvtier.core.throttled import ThrottledWarning
from kvtier.core.tier import (
    DECLINED,
    FULL,
    HELD,
    IO_ERROR,
    MISSING,
    OK,
    READ_ONLY,
    Failure,
    LinkSpeed,
    Locality,
    Medium,
    TierCounters,
    TierEvents,
    TierResult,
    TierStats,
)
from kvtier.errors import CorruptChunk, KeyNotHeld
from kvtier.tiers.encoding import EncodedTierSettings, build_encoder
from kvtier.tiers.files.chunkfiles import ChunkFiles
from kvtier.tiers.files.chunktree import FileInventory, FileProbe, walk_chunks
from kvtier.tiers.files.directories import TierDirectory, check_directory, check_owned
from kvtier.tiers.files.filetree import FileId
from kvtier.tiers.files.linkfile import measure_directory, probe_bytes
from kvtier.tiers.files.manifests import write_file_manifest
from kvtier.tiers.files.owner import DirectoryOwner, refuse_owned
from kvtier.tiers.files.retention_journal import RetentionJournal
from kvtier.tiers.links import LINK_DEADLINE_S, BoundedMeasure
from kvtier.tiers.manifest import NamespaceManifest
from kvtier.tiers.retention import RetentionTierSettings, book_problems, build_book

log = logging.getLogger(__name__)
ENOSPC_EVICT_CHUNKS = 4  # chunks evicted when the filesystem itself is full
# After a write failed for want of permission (EACCES, EPERM, EROFS: a directory made read-only
# under the tier), puts that would evict a held chunk to make room are dropped for this long
# (a put that fits is still tried): each one evicted a chunk for a write that then failed.
UNWRITABLE_BACKOFF_S = 5.0
_NO_PERMISSION = frozenset({errno.EACCES, errno.EPERM, errno.EROFS})
# Files owed their removal (see DiskTier._remove_owed), at most (past it, left to a restart's
# index, as before); and how many a successful write retries, under the tier's lock.
MAX_UNREMOVED = 1 << 16
REMOVE_BATCH = 64
INDEX_WAIT_S = 0.5  # the constructor waits this long for the index (then it fills behind)
INDEX_BATCH = 20_000  # chunks indexed per hold of the lock (hits proceed between batches)
INDEX_STOP_S = 5.0  # close waits this long for the start-up index to stop (then see close)


class DiskTierConfig(EncodedTierSettings, RetentionTierSettings):
    """A local directory (NVMe): one file per chunk, bounded, indexed at start-up."""

    kind: Literal["disk"]
    capacity: PositiveByteSize  # bytes this tier may hold, e.g. "200GiB"
    path: TierDirectory  # directory; created 0700 when missing
    o_direct: Literal["auto", "on", "off"] = "auto"  # bypass the page cache when supported
    io_threads: int = Field(4, ge=1, le=64)  # parallel reads/writes against this directory

    @field_validator("path")
    @classmethod
    def _usable_directory(cls, path: Path, info: ValidationInfo) -> Path:
        # Checked here, not when the tier is built: a bad path would surface as a raw
        # NotADirectoryError/PermissionError in a vLLM worker ~45 s into start-up (issue 12).
        # Read-only is for commands that only read it (kvtier inspect), not for an engine.
        return check_directory(path, read_only_ok=reading_only(info))


class DiskTier:
    """Chunks as files in a local directory, within `capacity` bytes. Thread-safe."""

    # A node-local directory; each TP rank enforces its share of the capacity.
    medium: ClassVar[Medium] = Medium.STORAGE
    locality: ClassVar[Locality] = Locality.LOCAL
    has_path: ClassVar[bool] = True
    has_server: ClassVar[bool] = False
    capacity_split_by_rank: ClassVar[bool] = True

    config_model = DiskTierConfig

    @classmethod
    def probe(cls, config: DiskTierConfig, layouts: Sequence[KVLayout]) -> FileProbe:
        """One stat per layout: cheap enough for the scheduler's thread (a local disk)."""
        return FileProbe(config.path, [layout.digest() for layout in layouts], blocking_ok=True)

    @classmethod
    def open_inventory(cls, config: DiskTierConfig) -> FileInventory:
        return FileInventory(config.tier_name, config.kind, config.path)

    @classmethod
    def refuse_owned(cls, config: DiskTierConfig, models: Collection[str]) -> None:
        """`DirectoryOwnerSource`: raise DirectoryInUse where another open disk tier owns a
        layout directory of one of `models` under `config.path` (owner.refuse_owned)."""
        refuse_owned(config.tier_name, config.path, models)

    def __init__(self, config: DiskTierConfig, layout: KVLayout, *,
                 clock: Callable[[], float] = time.time) -> None:
        """`clock`: wall-clock seconds for pins and expiry (a fake in tests: the start-up
        index applies the journal's pins and expiries by it).

        Raises:
            DirectoryInUse: another open disk tier owns the layout directory (until it
                closes, or its process ends); OSError: the directory cannot be used;
            ConfigError: another user could have put chunk files in it (`check_owned`).
        """
        self.name = config.tier_name
        self._write_failed = ThrottledWarning(log)  # every write, on an unwritable disk
        self.capacity_bytes = config.capacity
        self.files = ChunkFiles(config.path, layout.digest(), layout.bytes_per_chunk,
                                config.o_direct, encoder=build_encoder(config, layout))
        check_owned(f"{self.name}.path", self.files.root, self.files.directory)
        self.file_bytes = self.files.file_bytes  # a chunk stored as is (encoded: at most)
        self._index: dict[ChunkKey, int] = {}  # key -> its file's bytes
        self._used_bytes = 0  # held + reserved by writes in flight
        self._in_flight_bytes = 0  # reserved by writes in flight
        # tenant -> bytes its writes in flight reserved (with a tenant_quota only): the
        # write-behind puts several chunks at once (io_threads), and each one's quota check
        # must count the others', or a tenant's concurrent writes each passed it.
        self._tenant_in_flight: Counter[str | None] | None = \
            Counter() if config.tenant_quota is not None else None
        # Keys with writes in flight, and those of them whose file was removed meanwhile
        # (deleted, evicted as another writer's copy): such a write checks its file is there
        # before indexing it, or the index held a chunk without a file.
        self._writing: Counter[ChunkKey] = Counter()
        self._clobbered: set[ChunkKey] = set()
        # "lru" is CLOCK here (second chance): an OrderedDict a chunk took ~116 B more, and
        # the index must fit 2 million chunks (issue 28; kvtier.core.policies.clock).
        self._policy: Generations[ChunkKey] = Generations(ClockPolicy) \
            if config.eviction == "lru" \
            else make_policy(config.eviction, config.capacity // self.file_bytes)
        self._admission = AdmissionFilter(config.admit_after)
        self._unwritable_until = 0.0  # see UNWRITABLE_BACKOFF_S (time.monotonic)
        self._lock = threading.Lock()
        self._counters = TierCounters(self.name, config.capacity)
        self.events = TierEvents(self.name)
        # Tenants, pins, expiry (kvtier.core.retention); the policy holds unpinned chunks.
        self._book = build_book(config, config.capacity, clock)
        self._journal = RetentionJournal(self.files.directory, self.files.writable)
        self._dropped: set[ChunkKey] = set()  # removed while the index loads: not indexed
        # Let go, their files not removed (EROFS), oldest first: see _remove_owed.
        self._unremoved: dict[ChunkKey, None] = {}
        self._link = BoundedMeasure(self.name)
        # The directory's one owner (tiers/files/owner.py), before the index, which evicts,
        # is built; a read-only directory, which this tier cannot change, takes none.
        self._owner = DirectoryOwner(self.name, self.files.root, self.files.layout_digest,
                                     self.files.file_mode) if self.files.writable else None
        self._closing = threading.Event()
        self._loaded = threading.Event()
        self._loader = threading.Thread(target=self._rebuild_index, daemon=True,
                                        name=f"kvtier-index-{self.name}")
        self._loader.start()
        self._loaded.wait(INDEX_WAIT_S)

    @property
    def index_loaded(self) -> bool:
        """Whether every chunk in the directory at start-up is indexed."""
        return self._loaded.is_set()

    def wait_loaded(self, timeout_s: float | None = None) -> bool:
        """Wait for the start-up index; True when it is complete. Any thread."""
        return self._loaded.wait(timeout_s)

    def _rebuild_index(self) -> None:
        """The index thread: walk the directory, then index its chunks oldest first, in
        batches under the lock; then retention, and eviction to the capacity."""
        try:
            keys, sizes, mtimes, corrupt = self._scan_compact()
            order = np.argsort(np.asarray(mtimes, dtype=np.float64), kind="stable")
            interned: dict[int, int] = {}
            for start in range(0, len(order), INDEX_BATCH):
                if self._closing.is_set():
                    return
                with self._lock:
                    for i in order[start:start + INDEX_BATCH].tolist():
                        key = keys[i]
                        if key in self._index or key in self._dropped:
                            continue  # stored or removed since the walk saw it
                        size = interned.setdefault(sizes[i], sizes[i])
                        self._index[key] = size
                        self._policy.insert(key)
                        self._used_bytes += size
            del keys, sizes, mtimes, order
            if self._closing.is_set():
                return
            with self._lock:
                self._restore_retention()
                self._evict_to(self.capacity_bytes)
                self._dropped.clear()
            self._counters.add(corrupt_reads=corrupt)
            self._publish_usage()
            log.info("disk tier %r: %d chunks (%d B) found in %s", self.name,
                     len(self._index), self._used_bytes, self.files.directory)
        except Exception:  # a bug or an unreadable directory: serve what is indexed
            log.exception("disk tier %r: the start-up index failed; serving without the "
                          "chunks it had not indexed", self.name)
        finally:
            if self._closing.is_set():  # closed meanwhile, and not waited for: see close
                self._give_up_directory()
            self._loaded.set()

    def _scan_compact(self) -> tuple[list[ChunkKey], array[int], array[float], int]:
        """(keys, file sizes, mtimes) of this layout's chunk files, as compact as Python
        allows (no object per file but its key), and how many were removed as corrupt."""
        keys: list[ChunkKey] = []
        sizes, mtimes = array("q"), array("d")
        corrupt = 0
        owned = self._owner is not None and self._owner.locked  # every temp file is dead
        for found in walk_chunks(self.files, owned):
            if self._closing.is_set():
                break
            # Any size a chunk of this layout can take (encoded chunks are smaller, sealed
            # ones a page larger); the content is verified when read.
            size = found.size_bytes
            if size % ALIGN_BYTES or not HEADER_BYTES < size <= self.files.max_file_bytes:
                self.files.remove(found.key)
                corrupt += 1
                continue
            keys.append(found.key)
            sizes.append(size)
            mtimes.append(found.mtime)
        return keys, sizes, mtimes, corrupt

    def _evict_to(self, limit_bytes: int) -> None:
        """Evict by policy until usage <= limit. Caller holds the lock."""
        while self._used_bytes > limit_bytes:
            victim = self._policy.evict()
            if victim is None:
                return
            self._used_bytes -= self._index.pop(victim, 0)
            self._book.forget(victim, evicted=True)
            self._remove_file(victim)
            self._counters.add(evictions=1)
            self.events.removed(victim, retired=self._policy.left_retired)

    def _publish_usage(self) -> None:
        with self._lock:
            # held bytes, without writes in flight (a sum over the index was O(chunks) a put)
            chunks, used = len(self._index), self._used_bytes - self._in_flight_bytes
        self._counters.set(chunks=chunks, used_bytes=used)

    def keep_manifest(self, manifest: NamespaceManifest) -> None:
        """Write the namespace's manifest.json beside its chunks (`ManifestKeeper`);
        a read-only directory keeps the one it has. Never raises."""
        if self.files.writable:
            write_file_manifest(self.files.root, manifest, self.files.file_mode)

    def contains(self, key: ChunkKey) -> bool:
        """Index lookup, confirmed by one stat: a file deleted behind the tier's back (an
        operator, `kvtier gc` from another process) must not stay "held": the worker would skip
        storing it again and the next load would fail (tests/engine/test_kvtier_restart.py).
        While the start-up index fills, a key not indexed yet is looked up by that stat."""
        if key not in self._index:
            return not self._loaded.is_set() and self.files.exists(key)
        if self._book.has_deadlines and self._book.is_expired(key):
            self._expire(key)
            return False
        if self.files.exists(key):  # a regular file, reached without following a link
            return True
        self._forget(key, corrupt=False)
        return False

    def get_into(self, key: ChunkKey, out: memoryview,
                 meta: ChunkMeta = DEFAULT_META) -> TierResult:
        if key in self._index and self._book.has_deadlines and self._book.is_expired(key):
            self._expire(key)
        # While the start-up index fills, a key not indexed yet may still be on disk: read.
        if key not in self._index and self._loaded.is_set():
            self._counters.add(misses=1)
            return MISSING
        start = time.perf_counter()
        try:
            self.files.read_into(key, out, meta.tenant, touch=True)
        except KeyNotHeld as exc:  # not tampering: another reader may hold the key
            log.info("disk tier %r: chunk %s: %s; a miss, kept", self.name, key.hex(), exc)
            self._counters.add(misses=1)
            return TierResult(Failure.NO_KEY)
        except (CorruptChunk, OSError) as exc:
            self._forget(key, corrupt=isinstance(exc, CorruptChunk),
                         read=exc.file_id if isinstance(exc, CorruptChunk) else None)
            # Gone: evicted (or removed by `kvtier gc`) since its lookup, a race not a fault.
            (log.info if isinstance(exc, FileNotFoundError) else log.warning)(
                "disk tier %r: chunk %s unreadable (%s); treated as a miss", self.name,
                key.hex(), exc)
            self._counters.add(misses=1)
            if isinstance(exc, CorruptChunk):
                return TierResult(failure_of(exc))
            return MISSING if isinstance(exc, FileNotFoundError) else IO_ERROR
        with self._lock:
            if key in self._index:
                self._policy.touch(key)
                self._book.touch(key)
        self._counters.add(hits=1, bytes_read=len(out), read_s=time.perf_counter() - start)
        return OK

    def _forget(self, key: ChunkKey, corrupt: bool, read: FileId | None = None) -> bool:
        """Drop a chunk from the index and the directory; whether either held it. With `read`
        (a corrupt file's `file_id`), nothing if a copy stored since (indexed) is there."""
        with self._lock:  # the file and the event too: a put of the key may be landing
            kept = read is not None and self.files.replaced(key, read)
            if not self._loaded.is_set() and not kept:
                self._dropped.add(key)  # the index thread must not add it back
            held = key in self._index and not kept
            if held:
                self._used_bytes -= self._index.pop(key)
                self._policy.remove(key)
                self._book.forget(key)
            removed = not kept and self._remove_file(key, read) is not None
            if held:
                self.events.removed(key, retired=self._policy.left_retired)
        if corrupt:
            self._counters.add(corrupt_reads=1)
        self._publish_usage()
        return held or removed

    def put(self, key: ChunkKey, data: memoryview, meta: ChunkMeta = DEFAULT_META) -> TierResult:
        """`Tier.put`: a held chunk (the index, confirmed by one stat) is not rewritten but
        gets `meta`'s pin and expiry; a new one is stored with its tenant, pin and expiry."""
        # Checked first, as the memory tier does: a wrong size would be stored zero-padded
        # (shorter) or raise IndexError after reserving capacity, leaking the reservation
        # (tests/tiers/test_tier_contract.py).
        if len(data) != self.files.chunk_bytes:
            raise ValueError(f"chunk is {len(data)} bytes, this tier stores "
                             f"{self.files.chunk_bytes}")
        self._loaded.wait()  # the capacity is known once the start-up index is complete
        if self.contains(key):
            if not meta.is_default:
                self.retain(key, meta)
            return HELD
        if not self.files.writable or (self._owner is not None and not self._owner.keep()):
            self._counters.add(dropped_writes=1)  # read-only; or removed, another's now
            return IO_ERROR if self.files.writable else READ_ONLY
        if self.files.max_file_bytes > self.capacity_bytes:
            return FULL
        if not self._admission.offer(key):
            return DECLINED
        start = time.perf_counter()
        # compressed / sealed here, off the engine
        encoded = self.files.encode(key, data, meta.tenant)
        size = self.files.size_of(encoded)
        with self._lock:
            tenant_bytes = size + self._tenant_writing(meta.tenant)
            if time.monotonic() < self._unwritable_until and (
                    self._used_bytes + size > self.capacity_bytes
                    or self._book.over_quota(meta.tenant, tenant_bytes)):
                self._counters.add(dropped_writes=1)
                return IO_ERROR  # writes failed lately: no chunk evicted for this one
            if not self._make_tenant_room(meta.tenant, tenant_bytes):
                self._counters.add(dropped_writes=1)
                return FULL  # the tenant is at its quota with pinned chunks only
            self._evict_to(self.capacity_bytes - size)
            # Eviction cannot free room reserved by writes in flight: reserving anyway would
            # overshoot the capacity under concurrent puts (tests/tiers/test_tier_contract.py).
            full = self._used_bytes + size > self.capacity_bytes
            if not full:
                self._used_bytes += size  # reserve before writing
                self._in_flight_bytes += size
                self._tenant_wrote(meta.tenant, size)
                self._writing[key] += 1
        if full:
            self._counters.add(dropped_writes=1)
            log.warning("disk tier %r: capacity held by writes in flight; %s dropped",
                        self.name, key.hex())
            return FULL
        try:
            self.files.write(key, encoded)
        except OSError as exc:
            with self._lock:
                self._used_bytes -= size
                self._in_flight_bytes -= size
                self._tenant_wrote(meta.tenant, -size)
                self._wrote(key)
                if exc.errno == errno.ENOSPC:  # the filesystem is fuller than our quota
                    self._evict_to(self._used_bytes - ENOSPC_EVICT_CHUNKS * self.file_bytes)
                if exc.errno in _NO_PERMISSION:
                    self._unwritable_until = time.monotonic() + UNWRITABLE_BACKOFF_S
            self._counters.add(dropped_writes=1)
            self._publish_usage()
            self._write_failed.warning("disk tier %r: write of %s failed (%s); dropped",
                                       self.name, key.hex(), exc)
            return FULL if exc.errno in (errno.ENOSPC, errno.EDQUOT) else IO_ERROR
        with self._lock:
            self._in_flight_bytes -= size
            self._tenant_wrote(meta.tenant, -size)
            self._unwritable_until = 0.0  # writable again
            if self._unremoved:
                self._remove_owed()
            compact = False
            clobbered = self._wrote(key)
            if key in self._index:  # a concurrent put of the same key won
                self._used_bytes -= size
            elif clobbered and not self.files.exists(key):
                self._used_bytes -= size  # stored, then removed (deleted, evicted) meanwhile
            else:
                self._index[key] = size
                if not self._book.records(meta) or not self._book.record(key, meta, size):
                    self._policy.insert(key, meta.parent)  # pinned chunks stay out of it
                self.events.stored(key)
                # The journal's pin or expiry of this key, if any, was an earlier chunk's
                # (evicted or deleted since): voided now, before a retain of this one (which
                # takes the lock first) appends its own.
                compact = meta.is_default and self._journal.forget(key, len(self._book))
        if not meta.is_default:
            self._journal_append(key)
        elif compact:
            self._compact_journal()
        self._counters.add(puts=1, bytes_written=len(data), write_s=time.perf_counter() - start)
        self._publish_usage()
        return OK

    def check(self) -> list[str]:
        """`Checkable`: the index against the directory (one file a chunk, of the indexed
        size), the used bytes against the index, the eviction order against the index."""
        self._loaded.wait()
        on_disk = {found.key: found.size_bytes for found in walk_chunks(self.files)}
        with self._lock:
            problems = book_problems(self._index.keys(), self._policy, self._book)
            missing = self._index.keys() - on_disk.keys()
            if missing:
                problems.append(f"{len(missing)} indexed chunks have no file")
            unindexed = on_disk.keys() - self._index.keys()
            if unindexed:
                problems.append(f"{len(unindexed)} chunk files are not indexed")
            resized = sum(on_disk[key] != size for key, size in self._index.items()
                          if key in on_disk)
            if resized:
                problems.append(f"{resized} chunk files differ from their indexed size")
            held = sum(self._index.values())
            if self._used_bytes - self._in_flight_bytes != held:
                problems.append(f"used bytes {self._used_bytes - self._in_flight_bytes} are not "
                                f"the indexed chunks' {held}")
            if self._in_flight_bytes:
                problems.append(f"{self._in_flight_bytes} bytes reserved by writes in flight")
            if held > self.capacity_bytes:
                problems.append(f"{held} bytes held over the capacity {self.capacity_bytes}")
            return problems

    def retire(self) -> None:
        """`Retiring`: what is held now is evicted before what is stored from now on."""
        with self._lock:
            self._policy.retire()

    # -- tenants, pins, expiry (MetaKeeper) ---------------------------------------------------
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

    def _restore_retention(self) -> None:
        """Apply the journal to the chunks found at start-up: an expired one is removed, and
        a tenant over its quota (lowered since, or the capacity) evicts its own least
        recently used unpinned chunks down to it. Then rewrite the journal compacted (killed
        rewrites' temp files swept first). Start-up only (the index thread, lock held)."""
        self._journal.sweep_temps(self._owner is not None and self._owner.locked)
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
        with self._lock:
            meta = self._book.meta_of(key)
            live = len(self._book)
        if meta is not None and self._journal.append(key, meta, live):
            self._compact_journal()

    def _compact_journal(self) -> None:
        with self._lock:
            metas = self._book.metas()
        self._journal.rewrite(metas)

    def _expire(self, key: ChunkKey) -> None:
        with self._lock:
            self._book.expired_count += key in self._index
        self._forget(key, corrupt=False)

    def _remove_file(self, key: ChunkKey, same_file: FileId | None = None) -> int | None:
        """`files.remove` (with `same_file`, that file only), noted for a write of the key in
        flight (`_wrote`); one that cannot be removed is owed it (`_remove_owed`). Lock held."""
        if key in self._writing:
            self._clobbered.add(key)
        return self.files.remove(key, self._unremoved if len(self._unremoved) < MAX_UNREMOVED
                                 else None, same_file)

    def _remove_owed(self) -> None:
        """Remove the files whose removal failed (an eviction in a directory that went
        read-only, EIO): the index no longer counted them, and each stayed on disk beyond
        the capacity until a restart's index (a leak soak: one more file per read-only
        episode). Called once a write succeeds (the directory is writable again), at most
        REMOVE_BATCH files a time; a key stored again is the new chunk's file, kept. Lock
        held.

        A removal that fails again ends the batch (the directory still read-only: one
        failed unlink a write) and puts its key last: one file that never goes (EIO on its
        inode, a shard directory made read-only) was tried first at every write, and the
        files owed after it stayed for good."""
        for key in list(itertools.islice(self._unremoved, REMOVE_BATCH)):
            del self._unremoved[key]
            if key in self._index or key in self._writing:
                continue
            self.files.remove(key, self._unremoved)
            if key in self._unremoved:  # still failing, now last: the next write goes on
                return

    def _wrote(self, key: ChunkKey) -> bool:
        """A write of `key` ended; whether its file was removed while it was in flight.
        Lock held."""
        clobbered = key in self._clobbered
        self._writing[key] -= 1
        if self._writing[key] <= 0:
            del self._writing[key]
            self._clobbered.discard(key)
        return clobbered

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

    def delete(self, key: ChunkKey) -> bool:
        return self._forget(key, corrupt=False)

    def measure_link(self) -> LinkSpeed | None:
        """See core.tier.LinkProbe. A local disk too: behind a "disk" may be a network block
        device (a cloud volume of 125 MB/s restores a 4k-token hit of an 8B model slower than
        a GPU recomputes it), and on a fast one the rule knows a hit's cost from the first
        request. A probe file in the layout directory, written then read as a load reads
        (tiers/files/linkfile.py), within links.LINK_DEADLINE_S, its bytes reserved in the
        capacity as a write's are, never evicting for it. None (logged) when the directory is
        read-only, the index still loads, the capacity has too little room, or the measure
        fails or is late. Any thread."""
        return self._link.measure(self._measure_with_probe_file)

    def _measure_with_probe_file(self, deadline: float) -> LinkSpeed:
        """`measure_directory` with its file's bytes reserved meanwhile. Raises OSError
        (EROFS: read-only; ENOSPC: no room; EAGAIN: the index still loads, the room is not
        known), LinkTimeout."""
        if not self.files.writable:
            raise OSError(errno.EROFS, "read-only: no probe file can be written")
        if not self._loaded.is_set():
            raise OSError(errno.EAGAIN, "the index is still loading: the room left in the "
                          "capacity is not known yet")
        with self._lock:
            size = probe_bytes(self.capacity_bytes - self._used_bytes)
            self._used_bytes += size  # a write in flight: not in the published usage
            self._in_flight_bytes += size
        try:
            return measure_directory(self.files.root, self.files.layout_digest,
                                     self.files.o_direct, self.files.file_mode, deadline, size)
        finally:
            with self._lock:
                self._used_bytes -= size
                self._in_flight_bytes -= size

    def stats(self) -> TierStats:
        ops = self.files.ops.snapshot()
        return replace(self._counters.snapshot(), meta_stats=ops.stats, meta_opens=ops.opens,
                       meta_unlinks=ops.unlinks, meta_dir_reads=ops.dir_reads,
                       meta_other=ops.other)

    def close(self) -> None:
        """Give the directory up to its next owner. Nothing is buffered: every put is on
        disk when it returns. The start-up index stops (within a file or a batch: it evicts
        and rewrites the journal, which the next owner's own index must not see happen) and
        a link measure in flight is waited for a while (it removes its probe file); an
        index not stopped within INDEX_STOP_S (a stalled directory) gives the directory up
        when it stops."""
        self._closing.set()
        self._loader.join(INDEX_STOP_S)
        self._link.wait_idle(LINK_DEADLINE_S)
        if not self._loader.is_alive():
            self._give_up_directory()

    def _give_up_directory(self) -> None:
        if self._owner is not None:
            self._owner.release()

