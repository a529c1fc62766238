"""The local-disk tier (NVMe): one file per chunk, bounded in bytes, persistent.

The index (key -> file size) lives in memory and is rebuilt from the directory at start-up,
in the files' modification-time order, so the tier survives restarts with its LRU order. Hits
touch the file's mtime for the same reason. Capacity is reserved before a write so concurrent
writes cannot overshoot it; a full filesystem (ENOSPC) evicts and counts the write as dropped.
Assumes one store owns the directory; for a directory shared by processes use `shared`.

With a `codec` (and/or encryption, `kvtier.tiers.encoding`) a chunk is encoded on the
write-behind thread that puts it, before its room is reserved: the capacity counts the bytes
files really take, so a compressed tier holds more chunks in the same capacity.
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

from kvtier.core.chunkformat import ALIGN_BYTES, HEADER_BYTES, failure_of
from kvtier.core.keys import ChunkKey
from kvtier.core.layout import KVLayout
from kvtier.core.policies import AdmissionFilter, EvictionPolicy, make_policy
from kvtier.core.tier import (
    DECLINED,
    FULL,
    IO_ERROR,
    MISSING,
    OK,
    READ_ONLY,
    TierCounters,
    TierEvents,
    TierResult,
    TierStats,
)
from kvtier.errors import CorruptBlock
from kvtier.tiers.chunkfiles import ChunkFiles, FileInventory, FileProbe
from kvtier.tiers.directories import check_directory
from kvtier.tiers.encoding import EncodedTierSettings, build_encoder

log = logging.getLogger(__name__)
ENOSPC_EVICT_CHUNKS = 4  # chunks evicted when the filesystem itself is full


class DiskTierConfig(EncodedTierSettings):
    """A local directory (NVMe): one file per chunk, bounded, indexed at start-up."""

    kind: Literal["disk"]
    path: Path  # directory; created 0700 when missing
    o_direct: Literal["auto", "on", "off"] = "auto"  # bypass the page cache when supported
    io_threads: int = Field(4, ge=1, le=64)  # parallel reads/writes against this directory

    @field_validator("path")
    @classmethod
    def _usable_directory(cls, path: Path) -> Path:
        # Checked here, not when the tier is built: a bad path used to surface as a raw
        # NotADirectoryError/PermissionError in a vLLM worker ~45 s into start-up (issue 12).
        return check_directory(path, read_only_ok=False)


class DiskTier:
    """Chunks as files in a local directory, within `capacity` bytes. Thread-safe."""

    config_model = DiskTierConfig

    @classmethod
    def probe(cls, config: DiskTierConfig, layouts: Sequence[KVLayout]) -> FileProbe:
        """One stat per layout: cheap enough for the scheduler's thread (a local disk)."""
        return FileProbe(config.path, [layout.digest() for layout in layouts], blocking_ok=True)

    @classmethod
    def open_inventory(cls, config: DiskTierConfig) -> FileInventory:
        return FileInventory(config.tier_name, config.kind, config.path)

    def __init__(self, config: DiskTierConfig, layout: KVLayout) -> None:
        self.name = config.tier_name
        self.capacity_bytes = config.capacity
        self.files = ChunkFiles(config.path, layout.digest(), layout.bytes_per_chunk,
                                config.o_direct, encoder=build_encoder(config, layout))
        self.file_bytes = self.files.file_bytes  # a chunk stored as is (encoded: at most)
        self._index: dict[ChunkKey, int] = {}  # key -> its file's bytes
        self._used_bytes = 0  # held + reserved by writes in flight
        self._policy: EvictionPolicy[ChunkKey] = make_policy(
            config.eviction, config.capacity // self.file_bytes)
        self._admission = AdmissionFilter(config.admit_after)
        self._lock = threading.Lock()
        self._counters = TierCounters(self.name, config.capacity)
        self.events = TierEvents(self.name)
        self._rebuild_index()

    def _rebuild_index(self) -> None:
        corrupt = 0
        for found in sorted(self.files.scan().chunks, key=lambda f: f.mtime):
            # Any size a chunk of this layout can take (encoded chunks are smaller, sealed
            # ones a page larger); the content is verified when read.
            size = found.size_bytes
            if size % ALIGN_BYTES or not HEADER_BYTES < size <= self.files.max_file_bytes:
                self.files.remove(found.key)
                corrupt += 1
                continue
            self._index[found.key] = size
            self._policy.insert(found.key)
            self._used_bytes += size
        with self._lock:
            self._evict_to(self.capacity_bytes)
        self._counters.add(corrupt_reads=corrupt)
        self._publish_usage()
        log.info("disk tier %r: %d chunks (%d B) found in %s", self.name, len(self._index),
                 self._used_bytes, self.files.directory)

    def _evict_to(self, limit_bytes: int) -> None:
        """Evict by policy until usage <= limit. Caller holds the lock."""
        while self._used_bytes > limit_bytes:
            victim = self._policy.evict()
            if victim is None:
                return
            self._used_bytes -= self._index.pop(victim, 0)
            self.files.remove(victim)
            self._counters.add(evictions=1)
            self.events.removed(victim)

    def _publish_usage(self) -> None:
        with self._lock:
            chunks, used = len(self._index), sum(self._index.values())
        self._counters.set(chunks=chunks, used_bytes=used)

    def contains(self, key: ChunkKey) -> bool:
        """Index lookup, confirmed by one stat: a file deleted behind the tier's back (an
        operator, `kvtier gc` from another process) used to stay "held", so the worker skipped
        storing it again and the next load failed (tests/vllm/test_kvtier_restart.py)."""
        if key not in self._index:
            return False
        if self.files.exists(key):  # a regular file, reached without following a link
            return True
        self._forget(key, corrupt=False)
        return False

    def get_into(self, key: ChunkKey, out: memoryview) -> TierResult:
        if key not in self._index:
            self._counters.add(misses=1)
            return MISSING
        start = time.perf_counter()
        try:
            self.files.read_into(key, out)
        except (CorruptBlock, OSError) as exc:
            self._forget(key, corrupt=isinstance(exc, CorruptBlock))
            log.warning("disk tier %r: chunk %s unreadable (%s); treated as a miss",
                        self.name, key.hex(), exc)
            self._counters.add(misses=1)
            if isinstance(exc, CorruptBlock):
                return TierResult(failure_of(exc))
            return MISSING if isinstance(exc, FileNotFoundError) else IO_ERROR
        with self._lock:
            self._policy.touch(key)
        self.files.touch(key)
        self._counters.add(hits=1, bytes_read=len(out), read_s=time.perf_counter() - start)
        return OK

    def _forget(self, key: ChunkKey, corrupt: bool) -> None:
        with self._lock:
            held = key in self._index
            if held:
                self._used_bytes -= self._index.pop(key)
                self._policy.remove(key)
        self.files.remove(key)
        if held:
            self.events.removed(key)
        if corrupt:
            self._counters.add(corrupt_reads=1)
        self._publish_usage()

    def put(self, key: ChunkKey, data: memoryview) -> TierResult:
        # Checked first, as the memory tier does: a wrong size used to be stored zero-padded
        # (shorter) or to raise IndexError after reserving capacity, leaking the reservation
        # (tests/tiers/test_tier_contract.py).
        if len(data) != self.files.chunk_bytes:
            raise ValueError(f"chunk is {len(data)} bytes, this tier stores "
                             f"{self.files.chunk_bytes}")
        if self.contains(key):
            return OK
        if not self.files.writable:  # a read-only directory: serve what it holds
            self._counters.add(dropped_writes=1)
            return READ_ONLY
        if self.files.max_file_bytes > self.capacity_bytes:
            return FULL
        if not self._admission.offer(key):
            return DECLINED
        start = time.perf_counter()
        encoded = self.files.encode(key, data)  # compressed / sealed here, off the engine
        size = self.files.size_of(encoded)
        with self._lock:
            self._evict_to(self.capacity_bytes - size)
            # Eviction cannot free room reserved by writes in flight: reserving anyway used to
            # overshoot the capacity under concurrent puts (tests/tiers/test_tier_contract.py).
            full = self._used_bytes + size > self.capacity_bytes
            if not full:
                self._used_bytes += size  # reserve before writing
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
                if exc.errno == errno.ENOSPC:  # the filesystem is fuller than our quota
                    self._evict_to(self._used_bytes - ENOSPC_EVICT_CHUNKS * self.file_bytes)
            self._counters.add(dropped_writes=1)
            self._publish_usage()
            log.warning("disk tier %r: write of %s failed (%s); dropped", self.name, key.hex(), exc)
            return FULL if exc.errno in (errno.ENOSPC, errno.EDQUOT) else IO_ERROR
        with self._lock:
            if key in self._index:  # a concurrent put of the same key won
                self._used_bytes -= size
            else:
                self._index[key] = size
                self._policy.insert(key)
                self.events.stored(key)
        self._counters.add(puts=1, bytes_written=len(data), write_s=time.perf_counter() - start)
        self._publish_usage()
        return OK

    def delete(self, key: ChunkKey) -> bool:
        held = key in self._index
        self._forget(key, corrupt=False)
        return held

    def stats(self) -> TierStats:
        return self._counters.snapshot()

    def close(self) -> None:
        pass  # nothing buffered: every put is on disk when it returns

