"""Adaptive Replacement Cache (Megiddo & Modha, FAST'03), counted in chunks.

T1 holds keys seen once recently, T2 keys seen at least twice; ghost lists B1/B2 remember
recent victims of each, and a hit on a ghost shifts the target size `p` of T1 toward the list
that would have kept it. Scans (one-shot prompts) thus cannot flush frequently reused prefixes,
which plain LRU lets them do.

Deviation from the paper: the tier asks for a victim before it inserts the new key, so REPLACE
cannot see whether that key is a B2 ghost; the tie case `|T1| == p` then evicts from T2.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)


class ARCPolicy(Generic[K]):
    """ARC over a tier holding at most `capacity` chunks."""

    def __init__(self, capacity: int) -> None:
        self.capacity = max(1, capacity)
        self.p = 0.0  # target size of T1
        self._t1: OrderedDict[K, None] = OrderedDict()
        self._t2: OrderedDict[K, None] = OrderedDict()
        self._b1: OrderedDict[K, None] = OrderedDict()
        self._b2: OrderedDict[K, None] = OrderedDict()

    def insert(self, key: K, parent: K | None = None) -> None:
        if key in self._t1 or key in self._t2:
            self.touch(key)
            return
        if key in self._b1:
            self.p = min(self.capacity, self.p + max(len(self._b2) / len(self._b1), 1.0))
            del self._b1[key]
            self._t2[key] = None
        elif key in self._b2:
            self.p = max(0.0, self.p - max(len(self._b1) / len(self._b2), 1.0))
            del self._b2[key]
            self._t2[key] = None
        else:
            self._t1[key] = None
        self._trim_ghosts()

    def touch(self, key: K) -> None:
        if key in self._t1:
            del self._t1[key]
            self._t2[key] = None
        elif key in self._t2:
            self._t2.move_to_end(key)

    def remove(self, key: K) -> None:
        for resident in (self._t1, self._t2):
            resident.pop(key, None)

    def evict(self, keep: Callable[[K], bool] | None = None) -> K | None:
        """REPLACE: the LRU end of T1 while T1 is over its target (or T2 is empty), else of
        T2; a list whose every key is kept yields to the other."""
        lists = [(self._t1, self._b1), (self._t2, self._b2)]
        if not (self._t1 and (len(self._t1) > self.p or not self._t2)):
            lists.reverse()
        for resident, ghosts in lists:
            key = next((k for k in resident if keep is None or not keep(k)), None)
            if key is not None:
                del resident[key]
                ghosts[key] = None
                self._trim_ghosts()
                return key
        return None

    def _trim_ghosts(self) -> None:
        while self._b1 and len(self._t1) + len(self._b1) > self.capacity:
            self._b1.popitem(last=False)
        while self._b2 and len(self) + len(self._b1) + len(self._b2) > 2 * self.capacity:
            self._b2.popitem(last=False)

    def __len__(self) -> int:
        return len(self._t1) + len(self._t2)
