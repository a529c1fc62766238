"""CLOCK (second chance): least-recently-used, approximately, in a third of LRUPolicy's memory.

The disk tier indexes every chunk on its disk, 2 million and more on an NVMe tier. An
`OrderedDict` (LRUPolicy) costs ~116 B a key on top of the tier's own index, which put the
disk tier at 258 B a chunk (issue 28; the target is 200). Here a key costs a slot in a list
(8 B), an entry in a map of residents (~42 B) and, while it was read since the hand last
passed it, one in a map of referenced keys. The maps are dicts of keys to None, not sets: the
garbage collector does not track a dict of bytes keys and None values, while it walks a set
at every full collection (2 million keys: ~105 ms, every thread of the process stopped; a set
costs ~34 B a key). The ring is a list, which it walks (~30 ms at 2 million) unless the heap
was frozen with it in (vLLM's engines, `kvtier node`): it is rebuilt in place.

Keys sit on a ring in insertion order; a hit marks its key referenced. To evict, the hand
walks the ring: a referenced key loses its mark and is passed (its second chance), the first
unmarked resident is the victim. A never-read chunk therefore leaves in insertion order, and
a chunk read since the hand's last pass outlives every unread one: the LRU order whenever
each chunk is read at most once between passes (the disk tier's tests of LRU order hold).
Removed keys leave stale slots, skipped by the hand and dropped when the ring is rebuilt (once
it is twice the residents): amortised O(1) per call. (A key removed and inserted again before
a rebuild may be taken at its old slot: earlier than LRU would; rare, and still correct.)

Primitives: `ClockPolicy`.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)


class ClockPolicy(Generic[K]):
    """Evicts an unreferenced key in ring order, passing (and unmarking) referenced ones."""

    def __init__(self) -> None:
        self._ring: list[K | None] = []  # insertion order; removed keys stay (stale slots)
        self._hand = 0
        self._free: int | None = None  # the slot the last victim left, just behind the hand
        # Sets as dicts of keys to None: untracked by the collector (module docstring).
        self._resident: dict[K, None] = {}
        self._referenced: dict[K, None] = {}

    def insert(self, key: K, parent: K | None = None) -> None:
        if key in self._resident:
            self._referenced[key] = None
            return
        self._resident[key] = None
        if self._free is not None and self._ring[self._free] is None:
            self._ring[self._free] = key  # the last the hand reaches: the newest key
        else:
            self._ring.append(key)
        self._free = None
        self._compact_if_stale()

    def touch(self, key: K) -> None:
        if key in self._resident:
            self._referenced[key] = None

    def remove(self, key: K) -> None:
        self._resident.pop(key, None)
        self._referenced.pop(key, None)
        self._compact_if_stale()

    def evict(self, keep: Callable[[K], bool] | None = None) -> K | None:
        """The first unmarked resident from the hand on, not kept: kept keys are passed,
        marks and all; None when every resident is kept (two turns of the hand)."""
        steps = 2 * len(self._ring) + 1  # a turn clears the marks, the next finds a victim
        while self._resident and steps:
            steps -= 1
            if self._hand >= len(self._ring):
                self._hand = 0
            key = self._ring[self._hand]
            if key is None or key not in self._resident:  # a free or stale slot
                self._hand += 1
                continue
            if keep is not None and keep(key):
                self._hand += 1
                continue
            if key in self._referenced:  # its second chance
                del self._referenced[key]
                self._hand += 1
                continue
            del self._resident[key]
            self._ring[self._hand] = None
            self._free = self._hand
            self._hand += 1
            self._compact_if_stale()
            return key
        return None

    def _compact_if_stale(self) -> None:
        """Rebuild the ring from the hand on when it is mostly stale slots."""
        if len(self._ring) <= 2 * len(self._resident) + 64:
            return
        seen: set[K] = set()
        ring: list[K | None] = []
        order = self._ring[self._hand:] + self._ring[: self._hand]
        for key in reversed(order):  # a key inserted twice keeps its later slot
            if key is not None and key in self._resident and key not in seen:
                seen.add(key)
                ring.append(key)
        ring.reverse()
        # In place: a ring frozen out of the collector's walks (vLLM freezes an engine's heap
        # once started, a node its own once a layout's tiers are built) stays so.
        self._ring[:] = ring
        self._hand, self._free = 0, None

    def __len__(self) -> int:
        return len(self._resident)
