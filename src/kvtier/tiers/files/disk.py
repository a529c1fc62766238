"""The local-disk tier (NVMe): one file per chunk, bounded in bytes, persistent.

The index (key -> file size) lives in memory and is rebuilt from the directory at start-up,
in the files' modification-time order, so the tier survives restarts with its LRU order. Hits
touch the file's mtime for the same reason. The rebuild runs on a thread of its own and does
not hold up start-up (issue 28: 1.7 s at 80,000 chunks, ~40 s at 2 million): the constructor
waits at most INDEX_WAIT_S for it (a small directory is indexed by then), and meanwhile a
lookup of a key not indexed yet asks the directory (one stat, as `contains` confirms a held
key anyway), so hits are served while the index fills; puts wait for it (the capacity is
only known once every file is counted; the write-behind queue drops meanwhile, counted).
The walk is tiers/files/diskscan.py's, the index in memory tiers/files/diskindex.py's.

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
keeps pins and expiries (tiers/files/diskretention.py).

This module: the config, the tier's facts, its start-up, and the data path (lookups, reads,
writes, the link's measure). Primitives: `DiskTierConfig`, `DiskTier`.
"""

from __future__ import annotations

import errno
import logging
import threading
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import replace
from pathlib import Path
from typing import ClassVar, Literal

from pydantic import Field, ValidationInfo, field_validator

from kvtier.config import PositiveByteSize, reading_only
from kvtier.core.chunkformat import failure_of
from kvtier.core.keys import ChunkKey
from kvtier.core.layout import KVLayout
from kvtier.core.policies import AdmissionFilter
from kvtier.core.retention import DEFAULT_META, ChunkMeta
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
    TierResult,
    TierStats,
)
from kvtier.errors import CorruptChunk, KeyNotHeld, UnreadableChunk
from kvtier.tiers.encoding import EncodedTierSettings, build_encoder
from kvtier.tiers.files.chunkfiles import ChunkFiles
from kvtier.tiers.files.chunktree import FileInventory, FileProbe
from kvtier.tiers.files.directories import TierDirectory, check_directory, check_owned
from kvtier.tiers.files.diskretention import DiskRetention
from kvtier.tiers.files.diskscan import scan_chunk_files
from kvtier.tiers.files.linkfile import measure_directory, probe_bytes
from kvtier.tiers.files.manifests import write_file_manifest
from kvtier.tiers.files.owner import DirectoryOwner, refuse_owned
from kvtier.tiers.links import LINK_DEADLINE_S, BoundedMeasure
from kvtier.tiers.manifest import NamespaceManifest
from kvtier.tiers.retention import RetentionTierSettings

log = logging.getLogger(__name__)
ENOSPC_EVICT_CHUNKS = 4  # chunks evicted when the filesystem itself is full
# After a write failed for want of permission (EACCES, EPERM, EROFS: a directory made read-only
# under the tier), puts that would evict a held chunk to make room are dropped for this long
# (a put that fits is still tried): each one evicted a chunk for a write that then failed.
UNWRITABLE_BACKOFF_S = 5.0
_NO_PERMISSION = frozenset({errno.EACCES, errno.EPERM, errno.EROFS})
INDEX_WAIT_S = 0.5  # the constructor waits this long for the index (then it fills behind)
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


class DiskTier(DiskRetention):
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
        files = ChunkFiles(config.path, layout.digest(), layout.bytes_per_chunk,
                           config.o_direct, encoder=build_encoder(config, layout))
        check_owned(f"{config.tier_name}.path", files.root, files.directory)
        # The index, the retention book and journal (diskindex.py, diskretention.py).
        super().__init__(config, config.capacity, files, clock)
        self._write_failed = ThrottledWarning(log)  # every write, on an unwritable disk
        self._admission = AdmissionFilter(config.admit_after)
        self._unwritable_until = 0.0  # see UNWRITABLE_BACKOFF_S (time.monotonic)
        self._link = BoundedMeasure(self.name)
        # The directory's one owner (tiers/files/owner.py), before the index, which evicts,
        # is built; a read-only directory, which this tier cannot change, takes none.
        self._owner = DirectoryOwner(self.name, self.files.root, self.files.layout_digest,
                                     self.files.file_mode) if self.files.writable else None
        self._loader = threading.Thread(target=self._rebuild_index, daemon=True,
                                        name=f"kvtier-index-{self.name}")
        self._loader.start()
        self._loaded.wait(INDEX_WAIT_S)

    def _rebuild_index(self) -> None:
        """The index thread: walk the directory, then index its chunks oldest first, in
        batches under the lock; then retention, and eviction to the capacity."""
        try:
            scanned = scan_chunk_files(self.files, self._owns_directory(), self._closing)
            if not self._index_scanned(scanned):
                return
            corrupt = scanned.corrupt
            del scanned
            if self._closing.is_set():
                return
            with self._lock:
                self._restore_retention(self._owns_directory())
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

    def _owns_directory(self) -> bool:
        """Whether this tier holds the directory's lock: every temp file in it is then a dead
        writer's, removed by the walk and the journal's sweep."""
        return self._owner is not None and self._owner.locked

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
        self._forget(key, corrupt=False, absent=True)
        return key in self._index  # a copy a racing put landed meanwhile is kept

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
            # The file read (corrupt, or EIO once open) goes, not a copy a put landed since.
            read = exc.file_id if isinstance(exc, (CorruptChunk, UnreadableChunk)) else None
            self._forget(key, corrupt=isinstance(exc, CorruptChunk), read=read,
                         absent=isinstance(exc, FileNotFoundError))
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

    def retire(self) -> None:
        """`Retiring`: what is held now is evicted before what is stored from now on."""
        with self._lock:
            self._policy.retire()

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

