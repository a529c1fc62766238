"""The disk tier's index in memory: which chunks its layout directory holds (key -> its file's
bytes), the bytes used and reserved by writes in flight, the eviction order, and the files it
owes the directory (removals that failed). The tier (tiers/files/disk.py) is built on it,
with its retention (diskretention.py) between them.

The index is a dict of 16-byte keys (file sizes interned) beside the policy's order:
docs/performance.md, "The shared tier at fleet scale", has its bytes per chunk. It is filled
at start-up by the index thread (`_index_scanned`, batches under the lock: hits proceed
between them); meanwhile a chunk removed is noted (`_dropped`) so that the thread does not
add it back.

Primitives: `DiskIndex`, `MAX_UNREMOVED`, `REMOVE_BATCH`, `INDEX_BATCH`.
"""

from __future__ import annotations

import itertools
import threading
from collections import Counter
from collections.abc import Callable

from kvtier.core.keys import ChunkKey
from kvtier.core.policies import Generations, make_policy
from kvtier.core.policies.clock import ClockPolicy
from kvtier.core.tier import TierCounters, TierEvents
from kvtier.tiers.files.chunkfiles import ChunkFiles
from kvtier.tiers.files.chunktree import walk_chunks
from kvtier.tiers.files.diskscan import ScannedChunks
from kvtier.tiers.files.filetree import FileId
from kvtier.tiers.retention import RetentionTierSettings, book_problems, build_book

# Files owed their removal (see DiskIndex._remove_owed), at most (past it, left to a restart's
# index, as before); and how many a successful write retries, under the tier's lock.
MAX_UNREMOVED = 1 << 16
REMOVE_BATCH = 64
INDEX_BATCH = 20_000  # chunks indexed per hold of the lock (hits proceed between batches)


class DiskIndex:
    """What a disk tier holds, as it counts it; the methods named `_*` run with `_lock`
    held unless they say otherwise."""

    def __init__(self, config: RetentionTierSettings, capacity_bytes: int, files: ChunkFiles,
                 clock: Callable[[], float]) -> None:
        """`clock`: wall-clock seconds for pins and expiry (the retention book's)."""
        self.name = config.tier_name
        self.capacity_bytes = capacity_bytes
        self.files = files
        self.file_bytes = files.file_bytes  # a chunk stored as is (encoded: at most)
        self._index: dict[ChunkKey, int] = {}  # key -> its file's bytes
        self._used_bytes = 0  # held + reserved by writes in flight
        self._in_flight_bytes = 0  # reserved by writes in flight
        # Keys with writes in flight, and those of them whose file was removed meanwhile
        # (deleted, evicted as another writer's copy): such a write checks its file is there
        # before indexing it, or the index held a chunk without a file.
        self._writing: Counter[ChunkKey] = Counter()
        self._clobbered: set[ChunkKey] = set()
        # "lru" is CLOCK here (second chance): an OrderedDict a chunk took ~116 B more, and
        # the index must fit 2 million chunks (issue 28; kvtier.core.policies.clock).
        self._policy: Generations[ChunkKey] = Generations(ClockPolicy) \
            if config.eviction == "lru" \
            else make_policy(config.eviction, capacity_bytes // self.file_bytes)
        self._lock = threading.Lock()
        self._counters = TierCounters(self.name, capacity_bytes)
        self.events = TierEvents(self.name)
        # Tenants, pins, expiry (kvtier.core.retention); the policy holds unpinned chunks.
        self._book = build_book(config, capacity_bytes, clock)
        self._dropped: set[ChunkKey] = set()  # removed while the index loads: not indexed
        # Let go, their files not removed (EROFS), oldest first: see _remove_owed.
        self._unremoved: dict[ChunkKey, None] = {}
        self._closing = threading.Event()
        self._loaded = threading.Event()

    @property
    def index_loaded(self) -> bool:
        """Whether every chunk in the directory at start-up is indexed."""
        return self._loaded.is_set()

    def wait_loaded(self, timeout_s: float | None = None) -> bool:
        """Wait for the start-up index; True when it is complete. Any thread."""
        return self._loaded.wait(timeout_s)

    def _index_scanned(self, scanned: ScannedChunks) -> bool:
        """Index the chunks the start-up walk found, oldest first, in batches under the lock
        (not held by the caller); False when the tier closed meanwhile. The index thread."""
        order = scanned.oldest_first()
        interned: dict[int, int] = {}
        for start in range(0, len(order), INDEX_BATCH):
            if self._closing.is_set():
                return False
            with self._lock:
                for i in order[start:start + INDEX_BATCH].tolist():
                    key = scanned.keys[i]
                    if key in self._index or key in self._dropped:
                        continue  # stored or removed since the walk saw it
                    size = interned.setdefault(scanned.sizes[i], scanned.sizes[i])
                    self._index[key] = size
                    self._policy.insert(key)
                    self._used_bytes += size
        return True

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
        """The held chunks and bytes into the counters. Takes the lock."""
        with self._lock:
            # held bytes, without writes in flight (a sum over the index was O(chunks) a put)
            chunks, used = len(self._index), self._used_bytes - self._in_flight_bytes
        self._counters.set(chunks=chunks, used_bytes=used)

    def _forget(self, key: ChunkKey, corrupt: bool, read: FileId | None = None,
                absent: bool = False) -> bool:
        """Drop a chunk from the index and the directory; whether either held it. With `read`
        (the `file_id` of a file that failed its read: corrupt, EIO), nothing if a copy stored
        since (indexed) is there; with `absent` (its file was found missing), nothing if a
        file is there now: a put that landed since (it dropped that fresh copy, a miss; a
        write still in flight lands after the removal, as before). Takes the lock."""
        with self._lock:  # the file and the event too: a put of the key may be landing
            kept = (read is not None and self.files.replaced(key, read)) \
                or (absent and self.files.exists(key))
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
