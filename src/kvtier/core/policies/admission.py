"""Admission: store a chunk only once it has been offered `threshold` times.

A tier behind a slow medium (disk, network) can skip one-shot prompts this way; the offer
counts live in a bounded LRU table so memory stays flat under unique traffic.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Hashable


class AdmissionFilter:
    """`offer(key)` is True from the `threshold`-th offer of a key on. Thread-safe."""

    def __init__(self, threshold: int = 1, remembered_keys: int = 1 << 16) -> None:
        self.threshold = threshold
        self._remembered = remembered_keys
        self._counts: OrderedDict[Hashable, int] = OrderedDict()
        self._lock = threading.Lock()

    def offer(self, key: Hashable) -> bool:
        if self.threshold <= 1:
            return True
        with self._lock:
            count = self._counts.pop(key, 0) + 1
            self._counts[key] = count
            while len(self._counts) > self._remembered:
                self._counts.popitem(last=False)
            return count >= self.threshold
