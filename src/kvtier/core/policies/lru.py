"""Least-recently-used eviction."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)


class LRUPolicy(Generic[K]):
    """Evicts the key read or inserted longest ago."""

    def __init__(self) -> None:
        self._order: OrderedDict[K, None] = OrderedDict()

    def insert(self, key: K, parent: K | None = None) -> None:
        self._order[key] = None
        self._order.move_to_end(key)

    def touch(self, key: K) -> None:
        if key in self._order:
            self._order.move_to_end(key)

    def remove(self, key: K) -> None:
        self._order.pop(key, None)

    def evict(self, keep: Callable[[K], bool] | None = None) -> K | None:
        if keep is None:
            return self._order.popitem(last=False)[0] if self._order else None
        victim = next((key for key in self._order if not keep(key)), None)
        if victim is not None:
            del self._order[victim]
        return victim

    def __len__(self) -> int:
        return len(self._order)
