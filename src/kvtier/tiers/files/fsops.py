"""Counts of the metadata operations a file tier asks of its filesystem (issue 28).

On NFS or Lustre every stat, open, unlink and directory read is a round trip to a server that
the whole fleet shares: what kvtier costs a filesystem is these counts, not its bytes. Each
file tier (`disk`, `shared`) owns one `FsOps`; the functions of `kvtier.tiers.files.filetree` and
`kvtier.tiers.files.chunkfiles` that touch a path count what they ask through it, and the tier
reports the totals in its `TierStats` (`meta_*`), which `/metrics` exports per tier.

What counts (one per call, whatever it returns, errors included):
    stats      stat/lstat of a path, and each entry a directory listing stats
    opens      open of a file or directory (an O_EXCL create included)
    unlinks    unlink of a file
    dir_reads  a directory listing (one `scandir`, however many getdents it takes)
    other      rename, mkdir, utime (the touch of a hit), ftruncate

Primitives: `FsOps`, `NO_OPS`.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class OpCounts:
    """A snapshot of one `FsOps`."""

    stats: int = 0
    opens: int = 0
    unlinks: int = 0
    dir_reads: int = 0
    other: int = 0

    def total(self) -> int:
        return self.stats + self.opens + self.unlinks + self.dir_reads + self.other

    def minus(self, earlier: OpCounts) -> OpCounts:
        return OpCounts(self.stats - earlier.stats, self.opens - earlier.opens,
                        self.unlinks - earlier.unlinks, self.dir_reads - earlier.dir_reads,
                        self.other - earlier.other)


class FsOps:
    """Thread-safe counters of metadata operations. `add(stats=1)` counts one stat."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts = {"stats": 0, "opens": 0, "unlinks": 0, "dir_reads": 0, "other": 0}

    def add(self, **deltas: int) -> None:
        """Count operations; an unknown name raises KeyError (a typo must not vanish)."""
        with self._lock:
            for name, delta in deltas.items():
                self._counts[name] += delta

    def snapshot(self) -> OpCounts:
        with self._lock:
            return OpCounts(**self._counts)


class _NoOps(FsOps):
    """Counts nothing: the default of code that reads a tree without a tier."""

    def add(self, **deltas: int) -> None:
        pass


NO_OPS: FsOps = _NoOps()
