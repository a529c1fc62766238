"""The shared-directory tier: a POSIX directory used by many processes and nodes at once.

The directory itself is the index: a lookup is one stat of the chunk's path, so chunks
written by any process are found by every other. Writes are atomic (see chunkfiles), so
concurrent writers of one chunk are safe. Each hit touches the file's mtime, which makes the
quota's eviction least-recently-used across all processes, approximately: when a write would
pass the capacity, files are deleted down to LOW_WATERMARK of it (at most EVICT_BATCH_FILES
per hold of the ledger's lock), the oldest of a random sample of the tree each time
(`kvtier.tiers.files.victims`, as Redis samples its keyspace). Unlike vLLM's FS tier, the directory
never grows without bound, and no separate evictor deployment is needed.

The quota's bound, for N writer processes on N nodes: the bytes of kvtier's chunk files AND
temp files (writes in flight, or left by killed writers) in the directory never exceed the
capacity (usage <= quota, no per-writer slack): every write reserves its room in the
directory's ledger and creates its full-size temp file under one lock, evicting first
(`kvtier.tiers.files.quota` states the proof and the conditions: every writer a kvtier with the
ledger, a coherent `flock` between nodes, nothing else adding files). Measured:
docs/performance.md, "Shared quota with concurrent writers".

At fleet scale (issue 28: a hundred engines, 10^7 chunks on NFS, where every stat is a round
trip) the work per write is a constant, not a walk: the usage is the ledger's, which every
writer keeps (reservations, renames, unlinks), so a re-measure of the directory (a walk and an
lstat of every file) is a repair of its drift (files deleted behind kvtier's back, a chunk
written twice by racing writers), not a heartbeat. One writer re-measures for the whole
fleet: the ledger records when a re-measure was last claimed and how long its walk took,
and a writer claims the next one under the lock only when `scan_interval_s` has passed AND
REMEASURE_DUTY times that walk's duration has (a walk of 10^7 files is not repeated every
30 s), or a day has (REMEASURE_MAX_WAIT_S), and no one walks now (the ledger's walk lock,
which alone keeps a new or corrupt ledger, holding no claim, from being walked by every
writer at once); the others read its result. The claiming writer
walks on a thread of its own, so its puts go on meanwhile (a walk of 10^6 files takes a
minute of CPU; on NFS far longer). The re-measure also deletes kvtier's temp files older
than `filetree.TEMP_STALE_S` (120 s), and so does eviction where it samples: a killed
writer's leftovers count against the quota until one of them finds them. Files that are not
kvtier's own names in kvtier's own layout are never counted, swept or deleted. A write asks
whether its chunk is held once (one stat), and the tier counts every metadata operation it
makes (`kvtier.tiers.files.fsops`, `TierStats.meta_*`, on /metrics).

A read-only directory (a pre-warmed read-only mount) is served read-only: hits are served,
every put is a dropped write with Failure.READ_ONLY, nothing is evicted.

With a `codec` (and/or encryption, `kvtier.tiers.encoding`) a chunk is encoded before its
room is reserved in the ledger, which counts the bytes its file really takes. Readers decode
any codec they know, whatever their own setting: engines sharing the directory may differ.
"""

from __future__ import annotations

import errno
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import ClassVar, Literal

from pydantic import Field, field_validator

from kvtier.config import PositiveByteSize
from kvtier.core.chunkformat import Encoded, failure_of
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
    TierCounters,
    TierEvents,
    TierResult,
    TierStats,
)
from kvtier.errors import CorruptChunk, KeyNotHeld
from kvtier.tiers.encoding import EncodedTierSettings, build_encoder
from kvtier.tiers.files.chunkfiles import ChunkFiles, PendingWrite
from kvtier.tiers.files.chunktree import FileInventory, FileProbe, key_of, scan_tree
from kvtier.tiers.files.directories import TierDirectory, check_directory
from kvtier.tiers.files.filetree import FileId, sweep_layout_temps, unlink_file
from kvtier.tiers.files.linkfile import measure_directory, probe_bytes
from kvtier.tiers.files.manifests import write_file_manifest
from kvtier.tiers.files.quota import LedgerState, QuotaLedger
from kvtier.tiers.files.victims import VictimSampler
from kvtier.tiers.links import LINK_DEADLINE_S, BoundedMeasure
from kvtier.tiers.manifest import NamespaceManifest

log = logging.getLogger(__name__)
LOW_WATERMARK = 0.9  # eviction frees space down to this fraction of the capacity
EVICT_BATCH_FILES = 64  # at most this many files freed per eviction (the lock is held)
EVICT_MISSES = 32  # candidates in a row that freed nothing end an eviction
STALE_MISSES = 4  # candidates in a row that freed nothing: the sample is stale, resample
# A re-measure of the directory waits at least this many times the last walk's duration:
# the fleet spends at most 1/REMEASURE_DUTY of one writer's time walking, whatever it holds.
REMEASURE_DUTY = 100
# ...but at most this long: a walk_ns of years (a corrupt ledger) put every re-measure off
# for centuries. A walk of 10^7 files on NFS (half an hour) is then repeated daily (2%).
REMEASURE_MAX_WAIT_S = 86400.0
# A re-measure claimed (`claimed_ns`, stamped by the filesystem's clock: `_now_ns`) further
# ahead than this is taken as claimed now: trusted, no re-measure was due until then (a claim
# of the year 2100: never), and the drift a re-measure repairs stayed. A corrupt ledger, or
# an older kvtier that stamped claims by its node's clock, on a node this far ahead (which
# then walks more often than the interval: each claim of its is taken back, and logged).
FUTURE_CLAIM_S = 60.0
CLOSE_WAIT_S = 10.0  # close() waits this long for a re-measure in flight
NOT_OURS_KEPT = 4096  # keys remembered as sealed under a key this process lacks


class SharedTierConfig(EncodedTierSettings):
    """A POSIX directory shared by many processes and nodes (NFS, CephFS, Lustre, ...)."""

    kind: Literal["shared"]
    capacity: PositiveByteSize  # bytes this tier may hold, e.g. "200GiB"
    path: TierDirectory  # the shared directory; created 0700 when missing (see group_shared)
    group_shared: bool = False  # create directories 0770 / files 0660 for a shared group
    scan_interval_s: float = Field(30.0, gt=0)  # how often usage is re-measured for the quota
    io_threads: int = Field(4, ge=1, le=64)  # parallel reads/writes against this directory
    # Its quota evicts the chunk files least recently used (their mtimes): no other policy.
    eviction: Literal["lru"] = "lru"
    # `capacity` is the whole directory's quota (every layout, engine and node: one ledger),
    # never split by rank (SharedTier.capacity_split_by_rank).

    @field_validator("path")
    @classmethod
    def _usable_directory(cls, path: Path) -> Path:
        # Checked here, not when the tier is built: a bad path would surface as a raw
        # NotADirectoryError/PermissionError in a vLLM worker ~45 s into start-up (issue 12).
        # A read-only directory is accepted: the tier can still serve hits from it.
        return check_directory(path, read_only_ok=True)


def _modes(config: SharedTierConfig) -> tuple[int, int]:
    """The (directory, file) modes of what the tier creates (see `group_shared`)."""
    return (0o770, 0o660) if config.group_shared else (0o700, 0o600)


class SharedTier:
    """Chunks as files in a directory shared with other processes. Thread-safe."""

    # One directory for every engine and node; its quota is one ledger that every writer
    # enforces together, so a TP rank enforces all of it, not a share.
    medium: ClassVar[Medium] = Medium.STORAGE
    locality: ClassVar[Locality] = Locality.REMOTE
    has_path: ClassVar[bool] = True
    has_server: ClassVar[bool] = False
    capacity_split_by_rank: ClassVar[bool] = False

    config_model = SharedTierConfig

    @classmethod
    def probe(cls, config: SharedTierConfig, layouts: Sequence[KVLayout]) -> FileProbe:
        """One stat per layout, off the scheduler's thread: on NFS a stat is a round trip."""
        return FileProbe(config.path, [layout.digest() for layout in layouts], blocking_ok=False)

    @classmethod
    def open_inventory(cls, config: SharedTierConfig) -> FileInventory:
        return FileInventory(config.tier_name, config.kind, config.path, _modes(config)[1])

    def __init__(self, config: SharedTierConfig, layout: KVLayout) -> None:
        self.name = config.tier_name
        # Each repeats at every chunk while its cause lasts (tests/faults/
        # test_shared_log_floods.py): a line now and then, with how many were held back.
        self._write_failed = ThrottledWarning(log)  # every write, on an unwritable directory
        self._quota_full = ThrottledWarning(log)  # every put, while nothing can be evicted
        self._evict_failed = ThrottledWarning(log)  # every victim, evictions refused (EACCES)
        self._read_failed = ThrottledWarning(log)  # every read, on a failing mount (EIO)
        self.capacity_bytes = config.capacity
        self.scan_interval_s = config.scan_interval_s
        modes = _modes(config)
        self.files = ChunkFiles(config.path, layout.digest(), layout.bytes_per_chunk,
                                "auto", *modes, encoder=build_encoder(config, layout),
                                fs_clock=True)
        self.file_bytes = self.files.file_bytes
        self._admission = AdmissionFilter(config.admit_after)
        self._counters = TierCounters(self.name, config.capacity)
        self.events = TierEvents(self.name)
        # A read-only directory (a pre-warmed read-only mount) is served read-only: hits
        # are served, every put is a dropped write (Failure.READ_ONLY), and no OSError about
        # a `.probe` file fails the constructor (tests/faults/test_read_only.py).
        self.ledger = QuotaLedger(self.files.root, modes[1]) if self.files.writable else None
        self._scan_lock = threading.Lock()  # one re-measure at a time in this process
        self._sampler = VictimSampler(self.files.root, self.files.ops,
                                      clock=self.files.fs_now)
        self.remeasures = 0  # re-measures of the directory this process ran
        self.future_claims = 0  # claims found further ahead than FUTURE_CLAIM_S, taken back
        self._claim_ahead = ThrottledWarning(log)  # every put, while a node's clock is ahead
        self._remeasuring: threading.Thread | None = None  # a claimed re-measure, running
        self._link = BoundedMeasure(self.name)
        # Chunks lately found sealed under a key this process lacks (another secret's: a
        # rotated one): kept for whoever holds it, but never touched by this process's puts,
        # so that they age out and this process's own copy is stored once they have gone.
        self._not_ours: OrderedDict[ChunkKey, None] = OrderedDict()
        self._not_ours_lock = threading.Lock()
        self._open_quota()

    def _open_quota(self) -> None:
        """Start-up: the usage from the ledger; a re-measure only when the ledger asks for
        one (new, invalid, or due): a fleet's engines starting at once walk it once."""
        if self.ledger is None:
            self.enforce_quota()
            return
        # The layout directory's own stale temp files (a killed writer's manifest or probe):
        # a re-measure sweeps them, but a restart need not walk the tree any more.
        sweep_layout_temps(self.files.root, self.files.layout_digest, self.files.ops,
                           self.files.fs_now())
        claimed = False
        try:
            with self.ledger.locked() as ledger:
                claimed = self._claim_locked(ledger)
                self._publish(ledger)
            if claimed:
                self.enforce_quota()
        finally:
            if claimed:  # walked, or never to be: the next claim is anyone's
                self.ledger.end_walk()

    def keep_manifest(self, manifest: NamespaceManifest) -> None:
        """Write the namespace's manifest.json beside its chunks (`ManifestKeeper`);
        a read-only directory keeps the one it has. Never raises."""
        if self.files.writable:
            write_file_manifest(self.files.root, manifest, self.files.file_mode)

    def contains(self, key: ChunkKey) -> bool:
        return self.files.exists(key)

    def get_into(self, key: ChunkKey, out: memoryview,
                 meta: ChunkMeta = DEFAULT_META) -> TierResult:
        start = time.perf_counter()
        try:
            self.files.read_into(key, out, meta.tenant, touch=True)
        except FileNotFoundError:
            self._counters.add(misses=1)
            return MISSING
        except KeyNotHeld as exc:  # not tampering: another engine may hold the key
            log.info("shared tier %r: chunk %s: %s; a miss, kept", self.name, key.hex(), exc)
            self._counters.add(misses=1)
            with self._not_ours_lock:
                self._not_ours[key] = None
                if len(self._not_ours) > NOT_OURS_KEPT:
                    self._not_ours.popitem(last=False)
            return TierResult(Failure.NO_KEY)
        except (CorruptChunk, OSError) as exc:
            if isinstance(exc, CorruptChunk):  # the file read: a copy placed since stays
                freed = self._unlink(key, exc.file_id)
                if freed is not None:
                    self._forgotten(key, freed)
                self._counters.add(corrupt_reads=1)
            self._read_failed.warning("shared tier %r: chunk %s unreadable (%s); treated as a "
                                      "miss", self.name, key.hex(), exc)
            self._counters.add(misses=1)
            return TierResult(failure_of(exc)) if isinstance(exc, CorruptChunk) else IO_ERROR
        if self._not_ours:
            with self._not_ours_lock:
                self._not_ours.pop(key, None)  # its copy now is one this process reads
        self._counters.add(hits=1, bytes_read=len(out), read_s=time.perf_counter() - start)
        return OK

    def put(self, key: ChunkKey, data: memoryview, meta: ChunkMeta = DEFAULT_META) -> TierResult:
        """`Tier.put`: the write's one existence check is the `exists` here (one stat of
        the chunk's path; on NFS a round trip), and the file's mtime is the only metadata a
        held chunk gets (its LRU order; pins and expiry are not kept here)."""
        if len(data) != self.files.chunk_bytes:  # see DiskTier.put
            raise ValueError(f"chunk is {len(data)} bytes, this tier stores "
                             f"{self.files.chunk_bytes}")
        if self.files.exists(key):
            if self._not_ours:
                with self._not_ours_lock:
                    if key in self._not_ours:  # left to age out (see __init__): not stored
                        return DECLINED
            self.files.touch(key)
            return HELD
        if self._not_ours:
            with self._not_ours_lock:
                self._not_ours.pop(key, None)  # gone: the next copy stored is this process's
        if self.ledger is None:
            self._counters.add(dropped_writes=1)
            return READ_ONLY
        if self.files.max_file_bytes > self.capacity_bytes:
            return FULL
        if not self._admission.offer(key):
            return DECLINED
        start = time.perf_counter()
        # compressed / sealed here, off the engine
        encoded = self.files.encode(key, data, meta.tenant)
        size = self.files.size_of(encoded)
        try:
            pending, claimed, measuring = self._reserve(key, size)
            try:
                if pending is None:
                    self._counters.add(dropped_writes=1)
                    if measuring:
                        self._quota_full.warning("shared tier %r: the directory's usage is "
                                                 "being measured (a new or reset quota "
                                                 "ledger); %s dropped until it is", self.name,
                                                 key.hex())
                    else:
                        self._quota_full.warning("shared tier %r: quota full and nothing left "
                                                 "to evict; %s dropped", self.name, key.hex())
                    return FULL
                self._write(pending, encoded)
            finally:
                # After the write: a walk of millions of files can outlast TEMP_STALE_S, and
                # would sweep this write's own temp file.
                if claimed:  # this writer re-measures the directory for the fleet
                    self._remeasure_behind()
        except OSError as exc:
            self._counters.add(dropped_writes=1)
            self._write_failed.warning("shared tier %r: write of %s failed (%s); dropped",
                                       self.name, key.hex(), exc)
            # Only a full filesystem is helped by evicting; EACCES or EIO must not evict 10%
            # of everyone's chunks on every failed write (tests/faults/test_write_failures.py).
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                self._free_filesystem(size)
                return FULL
            return IO_ERROR
        self._counters.add(puts=1, bytes_written=len(data), write_s=time.perf_counter() - start)
        self.events.stored(key)
        return OK

    def _reserve(self, key: ChunkKey, size: int | None = None,
                 ) -> tuple[PendingWrite | None, bool, bool]:
        """Reserve room for one file in the shared quota (evicting first when needed) and
        create its full-size temp file, as one step under the ledger's lock (see
        kvtier.tiers.files.quota: that is what bounds the usage with many writers). Returns the
        pending write (None when nothing is left to evict, or the usage is not measured yet),
        whether this writer claimed the directory's re-measure (`_claim_locked`; the caller
        runs it, unlocked), and whether the usage was not measured yet (a new or reset ledger).
        Raises OSError when the temp file cannot be created."""
        assert self.ledger is not None
        claimed = False
        try:
            with self.ledger.locked() as ledger:
                measuring = not ledger.valid
                pending, claimed = self._reserve_locked(ledger, key, size or self.file_bytes)
        except BaseException:
            if claimed:  # the ledger was not written back: no walk follows, none is held
                self.ledger.end_walk()
            raise
        return pending, claimed, measuring

    def _reserve_locked(self, ledger: LedgerState, key: ChunkKey, size: int,
                        ) -> tuple[PendingWrite | None, bool]:
        """`_reserve` of a file of `size` bytes, the ledger's lock held."""
        if not ledger.valid:  # new, or reset by someone: re-measure before writing
            return None, self._claim_locked(ledger)
        before = ledger.used_bytes
        if ledger.used_bytes + size > self.capacity_bytes:
            self._evict_locked(ledger, self._evict_target(ledger, size))
        if ledger.used_bytes + size > self.capacity_bytes:
            # Still over: a dropped write. Far over (a quota lowered), the next writes
            # evict the next batches; nothing freed: the usage may have drifted high.
            ledger.repair = int(ledger.repair or ledger.used_bytes == before)
            self._publish(ledger)
            return None, self._claim_locked(ledger)
        pending = self.files.prepare_write(key, size)
        ledger.used_bytes += size
        ledger.reserved_total += size
        self._publish(ledger)
        return pending, self._claim_locked(ledger)

    def _free_filesystem(self, incoming_bytes: int) -> None:
        """The filesystem itself is full: evict (sampled) down to the low watermark of what
        is held, even when the quota is met; no walk (every writer hits ENOSPC at once).
        With a quota larger than the filesystem, 90% of the quota is above what the full
        filesystem holds (would free nothing)."""
        assert self.ledger is not None
        with self.ledger.locked() as ledger:
            if ledger.valid:
                limit = min(ledger.used_bytes, self.capacity_bytes)
                self._evict_locked(ledger, max(LOW_WATERMARK * limit - incoming_bytes,
                                               ledger.used_bytes - EVICT_BATCH_FILES
                                               * self.files.max_file_bytes))
                self._publish(ledger)

    def _evict_target(self, ledger: LedgerState, incoming_bytes: int) -> float:
        """The usage an eviction for `incoming_bytes` frees down to: LOW_WATERMARK of the
        capacity, but at most EVICT_BATCH_FILES files per lock hold (the fleet waits on it;
        a quota lowered far below the usage is reached over many writes)."""
        batch = ledger.used_bytes - EVICT_BATCH_FILES * self.files.max_file_bytes
        return max(LOW_WATERMARK * self.capacity_bytes - incoming_bytes, batch)

    def _claim_locked(self, ledger: LedgerState) -> bool:
        """Whether this writer re-measures the directory now: one is due by the ledger, no
        one walks it (the ledger's walk lock, `QuotaLedger.try_walk`, taken here and held
        until the re-measure ends: the caller runs it, then `end_walk`), and claiming it in
        the ledger (`claimed_ns`) makes every other writer wait for the next one.
        Due `scan_interval_s` after the last claim, or REMEASURE_DUTY times the last walk's
        duration if longer (a walk of 10^7 files is not repeated every 30 s; at most
        REMEASURE_MAX_WAIT_S), or at once when the ledger is not valid: a new or corrupt
        ledger keeps no claim (it is not written back), and the walk lock alone keeps the
        fleet from walking it N times over (tests/faults/test_one_walk_for_the_fleet.py).
        Caller holds the ledger's lock."""
        assert self.ledger is not None
        now = self._now_ns()
        if ledger.valid:
            self._bound_claim(ledger, now)
            wait_ns = self.scan_interval_s * 1e9
            if not ledger.repair:
                wait_ns = max(wait_ns, min(REMEASURE_DUTY * ledger.walk_ns,
                                           REMEASURE_MAX_WAIT_S * 1e9))
            if now < ledger.claimed_ns + wait_ns:
                return False
        if not self.ledger.try_walk():
            return False  # walked by another process (or thread) now
        ledger.claimed_ns = now
        return True

    def _now_ns(self) -> int:
        """Now (unix ns) by the filesystem's clock (`ChunkFiles.fs_now`), which every node
        reads alike: claims stamped by a node's own clock, minutes ahead, put every other
        writer's next re-measure off (tests/faults/test_clock_skew.py)."""
        return int(self.files.fs_now() * 1e9)

    def _bound_claim(self, ledger: LedgerState, now_ns: int) -> None:
        """Take a claim from further ahead than FUTURE_CLAIM_S as claimed at `now_ns`
        (counted in `future_claims`, logged). Caller holds the lock."""
        ahead_s = (ledger.claimed_ns - now_ns) / 1e9
        if ahead_s > FUTURE_CLAIM_S:
            self.future_claims += 1
            self._claim_ahead.warning(
                "shared tier %r: %s's last re-measure was claimed %.0f s ahead of the "
                "filesystem's clock (a corrupt ledger, or a writer of an older kvtier on a node "
                "whose clock is wrong); taken as claimed now", self.name, self.files.root,
                ahead_s)
            ledger.claimed_ns = now_ns

    def _write(self, pending: PendingWrite, data: Encoded) -> None:
        """Fill the reserved temp file (unlocked), then rename it into place under the lock.
        Raises OSError; the temp file is gone and its reservation given back."""
        assert self.ledger is not None
        try:
            pending.fill(data)
            with self.ledger.locked() as ledger:
                if pending.complete():
                    ledger.chunks += 1
                else:  # another writer placed the same chunk: its copy is the one counted
                    ledger.used_bytes -= pending.abort()
                ledger.completed_total += pending.size_bytes  # placed, or given back
                self._publish(ledger)
        except BaseException:
            with self.ledger.locked() as ledger:
                ledger.used_bytes -= pending.abort()
                ledger.completed_total += pending.size_bytes
                self._publish(ledger)
            raise

    def _remeasure_behind(self) -> None:
        """Run the re-measure this writer claimed on a thread of its own: a walk of millions
        of files (minutes on NFS) must not hold up this writer's puts, which go on under the
        ledger's usage meanwhile. At most one at a time per process: the claim holds the
        walk lock (`_claim_locked`) until the thread has walked."""
        self._remeasuring = threading.Thread(target=self._remeasure_quietly, daemon=True,
                                             name=f"kvtier-remeasure-{self.name}")
        self._remeasuring.start()

    def _remeasure_quietly(self) -> None:
        assert self.ledger is not None
        try:
            self.enforce_quota()
        except Exception as exc:  # a directory gone or the tier closed meanwhile
            log.warning("shared tier %r: re-measure of %s failed (%s); the next one is due "
                        "after scan_interval_s", self.name, self.files.root, exc)
        finally:
            self.ledger.end_walk()

    def enforce_quota(self, incoming_bytes: int = 0, force: bool = False) -> None:
        """Re-measure the whole directory (every layout), then evict (sampled LRU) until it
        fits the capacity with room for `incoming_bytes`, one batch at most (the writes that
        follow free the next). With `force` (the filesystem
        itself is full), free down to the low watermark of what is held even when the quota
        is met. Sweeps kvtier's stale temp files (filetree.TEMP_STALE_S). Called by the
        writer that claimed the re-measure (`_claim_locked`), not on every writer's clock:
        one walk per interval for the whole fleet."""
        with self._scan_lock:
            if self.ledger is None:  # read-only: count only
                scan = scan_tree(self.files.root, sweep=False, ops=self.files.ops)
                self._counters.set(chunks=len(scan.chunks),
                                   used_bytes=sum(f.size_bytes for f in scan.chunks))
                return
            self.remeasures += 1
            self.ledger.verify_path()  # the directory emptied or made again: its new ledger
            with self.ledger.locked() as ledger:
                reserved_before, completed_before = ledger.reserved_total, ledger.completed_total
                generation = self.ledger.generation
            in_flight = max(0, reserved_before - completed_before)  # writes not yet ended
            began = time.monotonic_ns()
            scan = scan_tree(self.files.root, ops=self.files.ops, now_s=self.files.fs_now())
            walk_ns = time.monotonic_ns() - began
            with self.ledger.locked() as ledger:
                if self.ledger.generation != generation:  # another file now: its totals are
                    return  # not those; it is new, and the next put re-measures it
                # Every file present now was seen by the scan, or reserved since it started,
                # or was in flight then and renamed into place under it (a listing may miss
                # both its names): an upper bound of the usage (kvtier.tiers.files.quota).
                # Writes ended since count up to what was in flight: all of them counted every
                # write during the walk twice more (tests/tiers/test_shared_remeasure.py).
                ended = ledger.completed_total - completed_before
                measured = (sum(f.size_bytes for f in scan.chunks) + scan.temp_bytes
                            + ledger.reserved_total - reserved_before + min(ended, in_flight))
                if scan.unreadable:  # what it holds was not seen: no lower than the ledger
                    self._unreadable_parts(scan.unreadable)
                    measured = max(measured, ledger.used_bytes if ledger.valid else 0)
                ledger.used_bytes = measured
                ledger.chunks = max(len(scan.chunks), ledger.chunks if scan.unreadable else 0)
                now_ns = self._now_ns()
                self._bound_claim(ledger, now_ns)
                ledger.claimed_ns = max(ledger.claimed_ns, now_ns - walk_ns)
                ledger.walk_ns, ledger.repair, ledger.valid = walk_ns, 0, True
                self._sampler.forget()
                if force or ledger.used_bytes + incoming_bytes > self.capacity_bytes:
                    # `force` aims below what is held: with a quota larger than the filesystem,
                    # 90% of the quota is above what the full filesystem holds (frees nothing).
                    limit = min(ledger.used_bytes, self.capacity_bytes) if force else \
                        self.capacity_bytes
                    # One batch per hold, as `_evict_target`: far over (a quota lowered), the
                    # next writes free the rest while the fleet's puts go on between them.
                    batch = ledger.used_bytes - EVICT_BATCH_FILES * self.files.max_file_bytes
                    self._evict_locked(ledger, max(LOW_WATERMARK * limit - incoming_bytes,
                                                   batch))
                self._publish(ledger)

    def _unreadable_parts(self, paths: list[str]) -> None:
        """Say that a re-measure could not read `paths` (below the root): their files were
        not counted, and the usage is kept no lower than the ledger's (an engine of another
        user whose directories its group cannot read: the root is not setgid to the group,
        tests/faults/test_shared_unreadable_directories.py). Lock held."""
        log.warning("shared tier %r: the re-measure of %s could not read %d directories "
                    "(%s%s; another user's, not readable by this one: make the root setgid "
                    "to the engines' common group, docs/sharing.md); the usage is kept no "
                    "lower than the ledger's", self.name, self.files.root, len(paths),
                    ", ".join(paths[:3]), ", ..." if len(paths) > 3 else "")

    def _evict_locked(self, ledger: LedgerState, target_bytes: float) -> int:
        """Delete sampled least recently used files (`VictimSampler`, every layout) until
        the ledger's usage is <= target (or no candidate is left); the number of chunks
        deleted. Caller holds the ledger's lock."""
        evicted = freed_own = misses = 0
        while ledger.used_bytes > target_bytes and misses < EVICT_MISSES:
            try:
                victim = self._sampler.take()
                if victim is None:
                    break
                freed = unlink_file(self.files.root, victim.parts(), self.files.ops,
                                    not_after=victim.mtime)
            except OSError as exc:
                self._evict_failed.warning("shared tier %r: cannot evict from %s (%s)",
                                           self.name, self.files.root, exc)
                misses += 1
                continue
            if freed is None:  # read since it was sampled, or evicted by another process
                misses += 1
                if misses % STALE_MISSES == 0:  # the candidates are stale (other writers
                    self._sampler.forget()  # evict the same oldest files): sample afresh
                continue
            misses = 0
            ledger.used_bytes -= freed
            if victim.temp:  # a killed writer's temp file
                continue
            ledger.chunks -= 1
            evicted += 1
            key = key_of(victim.name)
            if victim.layout_digest == self.files.layout_digest and key is not None:
                freed_own += freed
                self.events.removed(key)
        self._counters.add(evictions=evicted)
        return evicted

    def _unlink(self, key: ChunkKey, same_file: FileId | None = None) -> int | None:
        """Delete this layout's chunk file (with `same_file`, only that file: a corrupt one
        read, not a good copy another writer placed since), accounted in the ledger; the
        bytes that freed, None if none was there."""
        if self.ledger is None:
            return self.files.remove(key, same_file=same_file)
        with self.ledger.locked() as ledger:
            freed = self.files.remove(key, same_file=same_file)
            if freed is not None:
                ledger.used_bytes -= freed
                ledger.chunks -= 1
            self._publish(ledger)
        return freed

    def _publish(self, ledger: LedgerState) -> None:
        """The directory's usage as the ledger has it, into this tier's stats."""
        self._counters.set(chunks=max(0, ledger.chunks), used_bytes=max(0, ledger.used_bytes))

    def delete(self, key: ChunkKey) -> bool:
        freed = self._unlink(key)
        if freed is not None:
            self._forgotten(key, freed)
        return freed is not None

    def _forgotten(self, key: ChunkKey, freed_bytes: int) -> None:
        """One chunk file less (deleted, or removed as corrupt; the ledger counted it)."""
        if self.ledger is None:
            self._counters.add(chunks=-1, used_bytes=-freed_bytes)
        self.events.removed(key)

    def measure_link(self) -> LinkSpeed | None:
        """See core.tier.LinkProbe: a probe file in the layout directory, written then read
        as a load reads (tiers/files/linkfile.py), within links.LINK_DEADLINE_S. Its bytes are
        reserved in the quota's ledger as a write's are, never evicting for it
        (`linkfile.probe_bytes`). None (logged) when the directory is read-only, the quota
        has too little room, or the measure fails or is late. Any thread."""
        return self._link.measure(self._measure_with_probe_file)

    def _measure_with_probe_file(self, deadline: float) -> LinkSpeed:
        """`measure_directory` with its file's bytes reserved in the ledger meanwhile.
        Raises OSError (EROFS: read-only; ENOSPC: no room in the quota, or its usage not
        known), LinkTimeout."""
        if self.ledger is None:
            raise OSError(errno.EROFS, "read-only: no probe file can be written")
        with self.ledger.locked() as ledger:
            size = probe_bytes(self.capacity_bytes - ledger.used_bytes if ledger.valid else 0)
            ledger.used_bytes += size
            ledger.reserved_total += size
            self._publish(ledger)
        try:
            return measure_directory(self.files.root, self.files.layout_digest,
                                     self.files.o_direct, self.files.file_mode, deadline, size)
        finally:
            with self.ledger.locked() as ledger:
                ledger.used_bytes -= size
                ledger.completed_total += size  # given back: not in flight any more
                self._publish(ledger)

    def stats(self) -> TierStats:
        ops = self.files.ops.snapshot()
        return replace(self._counters.snapshot(), meta_stats=ops.stats, meta_opens=ops.opens,
                       meta_unlinks=ops.unlinks, meta_dir_reads=ops.dir_reads,
                       meta_other=ops.other)

    def close(self) -> None:
        # Nothing buffered: every put is in the directory when it returns. A re-measure in
        # flight is waited for a while (it holds the ledger's lock at its end), and so is a
        # link measure (it removes its probe file and gives its bytes back to the ledger).
        self._link.wait_idle(LINK_DEADLINE_S)
        if self._remeasuring is not None:
            self._remeasuring.join(timeout=CLOSE_WAIT_S)
        if self.ledger is not None:
            self.ledger.close()
