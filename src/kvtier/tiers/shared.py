"""The shared-directory tier: a POSIX directory used by many processes and nodes at once.

The directory itself is the index: a lookup is one stat of the chunk's path, so chunks
written by any process are found by every other. Writes are atomic (see chunkfiles), so
concurrent writers of one chunk are safe. Each hit touches the file's mtime, which makes the
quota's eviction least-recently-used across all processes: when usage (re-measured every
`scan_interval_s`, or sooner when this process's estimate reaches the quota) exceeds the
capacity, the oldest files are deleted down to LOW_WATERMARK of it. Unlike vLLM's FS tier, the
directory never grows without bound, and no separate evictor deployment is needed.
"""

from __future__ import annotations

import errno
import logging
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator

from kvtier.config import TierSettings
from kvtier.core.keys import ChunkKey
from kvtier.core.layout import KVLayout
from kvtier.core.policies import AdmissionFilter
from kvtier.core.tier import (
    CORRUPT, DECLINED, FULL, IO_ERROR, MISSING, OK, TierCounters, TierEvents, TierResult,
    TierStats,
)
from kvtier.errors import CorruptBlock
from kvtier.tiers.chunkfiles import ChunkFiles, FileInventory, FileProbe, scan_tree
from kvtier.tiers.directories import check_directory

log = logging.getLogger(__name__)
LOW_WATERMARK = 0.9  # eviction frees space down to this fraction of the capacity


class SharedTierConfig(TierSettings):
    """A POSIX directory shared by many processes and nodes (NFS, CephFS, Lustre, ...)."""

    kind: Literal["shared"]
    path: Path  # the shared directory; created 0700 when missing (see group_shared)
    group_shared: bool = False  # create directories 0770 / files 0660 for a shared group
    scan_interval_s: float = Field(30.0, gt=0)  # how often usage is re-measured for the quota
    io_threads: int = Field(4, ge=1, le=64)  # parallel reads/writes against this directory

    @field_validator("path")
    @classmethod
    def _usable_directory(cls, path: Path) -> Path:
        # Checked here, not when the tier is built: a bad path used to surface as a raw
        # NotADirectoryError/PermissionError in a vLLM worker ~45 s into start-up (issue 12).
        # A read-only directory is accepted: the tier can still serve hits from it.
        return check_directory(path, read_only_ok=True)


class SharedTier:
    """Chunks as files in a directory shared with other processes. Thread-safe."""

    config_model = SharedTierConfig

    @classmethod
    def probe(cls, config: SharedTierConfig, layouts: Sequence[KVLayout]) -> FileProbe:
        """One stat per layout, off the scheduler's thread: on NFS a stat is a round trip."""
        return FileProbe(config.path, [layout.digest() for layout in layouts], blocking_ok=False)

    @classmethod
    def open_inventory(cls, config: SharedTierConfig) -> FileInventory:
        return FileInventory(config.tier_name, config.kind, config.path)

    def __init__(self, config: SharedTierConfig, layout: KVLayout) -> None:
        self.name = config.tier_name
        self.capacity_bytes = config.capacity
        self.scan_interval_s = config.scan_interval_s
        modes = (0o770, 0o660) if config.group_shared else (0o700, 0o600)
        self.files = ChunkFiles(config.path, layout.digest(), layout.bytes_per_chunk,
                                "auto", *modes)
        self.file_bytes = self.files.file_bytes
        self._admission = AdmissionFilter(config.admit_after)
        self._counters = TierCounters(self.name, config.capacity)
        self.events = TierEvents(self.name)
        self._quota_lock = threading.Lock()
        self._estimate_bytes = 0  # files held + reserved by writes in flight
        self._inflight_bytes = 0  # reserved by writes in flight
        self._scanned_at = 0.0
        self.enforce_quota()

    def contains(self, key: ChunkKey) -> bool:
        return self.files.path_of(key).exists()

    def get_into(self, key: ChunkKey, out: memoryview) -> TierResult:
        start = time.perf_counter()
        try:
            self.files.read_into(key, out)
        except FileNotFoundError:
            self._counters.add(misses=1)
            return MISSING
        except (CorruptBlock, OSError) as exc:
            if isinstance(exc, CorruptBlock):
                if self.files.remove(key):
                    self._forgotten(key)
                self._counters.add(corrupt_reads=1)
            log.warning("shared tier %r: chunk %s unreadable (%s); treated as a miss",
                        self.name, key.hex(), exc)
            self._counters.add(misses=1)
            return CORRUPT if isinstance(exc, CorruptBlock) else IO_ERROR
        self.files.touch(key)
        self._counters.add(hits=1, bytes_read=len(out), read_s=time.perf_counter() - start)
        return OK

    def put(self, key: ChunkKey, data: memoryview) -> TierResult:
        if len(data) != self.files.chunk_bytes:  # see DiskTier.put
            raise ValueError(f"chunk is {len(data)} bytes, this tier stores "
                             f"{self.files.chunk_bytes}")
        path = self.files.path_of(key)
        if path.exists():
            self.files.touch(key)
            return OK
        if self.file_bytes > self.capacity_bytes:
            return FULL
        if not self._admission.offer(key):
            return DECLINED
        if not self._reserve():
            self._counters.add(dropped_writes=1)
            log.warning("shared tier %r: quota held by writes in flight; %s dropped",
                        self.name, key.hex())
            return FULL
        start = time.perf_counter()
        try:
            self.files.write(key, data)
        except OSError as exc:
            self._release(written=False)
            self._counters.add(dropped_writes=1)
            log.warning("shared tier %r: write of %s failed (%s); dropped",
                        self.name, key.hex(), exc)
            # Only a full filesystem is helped by evicting; EACCES or EIO used to evict 10%
            # of everyone's chunks on every failed write (tests/faults/test_write_failures.py).
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                self.enforce_quota(self.file_bytes, force=True)
                return FULL
            return IO_ERROR
        self._release(written=True)
        # chunks/used_bytes used to change only when the directory was re-measured, so stats
        # said 0 bytes used after puts; keep them current between scans.
        self._counters.add(puts=1, bytes_written=len(data), write_s=time.perf_counter() - start,
                           chunks=1, used_bytes=self.file_bytes)
        self.events.stored(key)
        return OK

    def _reserve(self) -> bool:
        """Reserve room for one file in the quota, evicting first when needed; False when
        writes in flight hold the rest. Check and reservation are one step under the lock:
        concurrent puts of this process used to all pass the check and overshoot the quota
        many times over (tests/tiers/test_tier_contract.py, concurrent puts)."""
        with self._quota_lock:
            due = time.monotonic() - self._scanned_at > self.scan_interval_s
            if due or self._estimate_bytes + self.file_bytes > self.capacity_bytes:
                self._enforce_locked(self.file_bytes, force=False)
            if self._estimate_bytes + self.file_bytes > self.capacity_bytes:
                return False
            self._estimate_bytes += self.file_bytes
            self._inflight_bytes += self.file_bytes
            return True

    def _release(self, written: bool) -> None:
        """End a reservation: the file now exists (`written`) or its room is given back."""
        with self._quota_lock:
            self._inflight_bytes -= self.file_bytes
            if not written:
                self._estimate_bytes -= self.file_bytes

    def enforce_quota(self, incoming_bytes: int = 0, force: bool = False) -> None:
        """Measure the whole directory (every layout) and delete least recently used files
        until it fits the capacity with room for `incoming_bytes` and the writes in flight.
        With `force` (the filesystem itself is full), free down to the low watermark of
        what is held even when the quota is met."""
        with self._quota_lock:
            self._enforce_locked(incoming_bytes, force)

    def _enforce_locked(self, incoming_bytes: int, force: bool) -> None:
        files = sorted(scan_tree(self.files.root), key=lambda f: f.mtime)
        used = sum(f.size_bytes for f in files)
        evicted = 0
        needed = used + self._inflight_bytes + incoming_bytes
        if force or needed > self.capacity_bytes:
            # A quota larger than the filesystem used to make `force` free nothing (the
            # target was 90% of the quota, above what the full filesystem held).
            limit = min(used, self.capacity_bytes) if force else self.capacity_bytes
            target = LOW_WATERMARK * limit - incoming_bytes - self._inflight_bytes
            for found in files:
                if used <= target:
                    break
                found.path.unlink(missing_ok=True)  # another process may have won
                used -= found.size_bytes
                evicted += 1
                self.events.removed(found.key)
        self._estimate_bytes = used + self._inflight_bytes
        self._scanned_at = time.monotonic()
        self._counters.add(evictions=evicted)
        self._counters.set(chunks=len(files) - evicted, used_bytes=used)

    def delete(self, key: ChunkKey) -> bool:
        removed = self.files.remove(key)
        if removed:
            self._forgotten(key)
        return removed

    def _forgotten(self, key: ChunkKey) -> None:
        """One chunk file less (deleted, or removed as corrupt): update the usage estimate."""
        with self._quota_lock:
            self._estimate_bytes = max(0, self._estimate_bytes - self.file_bytes)
        self._counters.add(chunks=-1, used_bytes=-self.file_bytes)
        self.events.removed(key)

    def stats(self) -> TierStats:
        return self._counters.snapshot()

    def close(self) -> None:
        pass  # nothing buffered: every put is in the directory when it returns
