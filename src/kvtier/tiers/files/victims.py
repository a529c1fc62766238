"""The shared tier's eviction victims, by sampling: an approximate LRU over the whole tree.

A global LRU order of a directory that a fleet writes would need the mtime of every file: a
walk of 10^7 files per eviction (issue 28). Redis faces the same with its keyspace and
samples instead: a few random keys, the oldest of them goes. `VictimSampler` does that over
the chunk-file tree: it reads random shard directories (`filetree.sample_shards`) until it has
seen SAMPLE_FILES files, and hands out the oldest 1/POOL_SHARE of them, oldest first; when
they are used up it samples again. Each victim is among the oldest quarter of a random sample
of 64, whatever the tree holds; a tree of fewer files is sampled whole, so a small quota
evicts in exact LRU order. kvtier's temp files older than `filetree.TEMP_STALE_S` found on the
way (a killed writer's) come first: deleting them frees room too.

The cost of a victim is a constant: SAMPLE_FILES / (SAMPLE_FILES // POOL_SHARE) = 4 lstats of
sampled files, plus about as many directory opens and reads (fewer once shard directories
hold several files each), whatever the directory holds. Empty shard directories met on the
way (eviction leaves them) are removed, so that a sample does not pay for them: the caller
holds the ledger's lock, under which every kvtier writer creates its files.

Primitives: `VictimSampler`, `SAMPLE_FILES`, `POOL_SHARE`.
"""

from __future__ import annotations

import contextlib
import random
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path

from kvtier.tiers.files.filetree import TEMP_STALE_S, Entry, sample_shards
from kvtier.tiers.files.fsops import FsOps

SAMPLE_FILES = 64  # files read per sample
POOL_SHARE = 4  # the oldest 1/POOL_SHARE of a sample become victims


class VictimSampler:
    """Eviction candidates of the tree under `root`, every layout. Not thread-safe: the
    shared tier calls it under its ledger's lock."""

    def __init__(self, root: Path, ops: FsOps, rng: random.Random | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        """`clock`: now by the clock of the files' mtimes (`ChunkFiles.fs_now`)."""
        self.root = Path(root)
        self.ops = ops
        self._clock = clock
        self.samples = 0  # samples taken (for tests and the bench)
        self._rng = rng or random.Random()
        self._pool: deque[Entry] = deque()

    def take(self) -> Entry | None:
        """The next candidate (a chunk file, or a stale temp file), oldest first; None
        when the tree holds none. The caller checks it is unchanged before deleting it.

        Raises:
            OSError: the root cannot be read.
        """
        if not self._pool:
            self._sample()
        return self._pool.popleft() if self._pool else None

    def forget(self) -> None:
        """Drop the candidates held (after a re-measure: sample afresh)."""
        self._pool.clear()

    def _sample(self) -> None:
        self.samples += 1
        stale_before = self._clock() - TEMP_STALE_S
        chunks: list[Entry] = []
        stale: list[Entry] = []
        with contextlib.closing(sample_shards(self.root, self._rng, self.ops,
                                                     SAMPLE_FILES, prune=True)) as shards:
            for files in shards:
                for entry in files:
                    if not entry.temp:
                        chunks.append(entry)
                    elif entry.mtime < stale_before:
                        stale.append(entry)
                if len(chunks) >= SAMPLE_FILES:
                    break
        chunks.sort(key=lambda e: e.mtime)
        self._pool = deque(stale + chunks[: max(1, len(chunks) // POOL_SHARE)])
