"""PHASE 1 ONLY: a dict-backed chunk store standing in for `kvtier.core.store.TieredStore`.

It offers the two calls the worker needs from the real store, with the same meaning:
`get_into(key, out) -> tier name | None` and `put(key, data) -> bool`, plus `stats()`.
It lives in the worker process; the scheduler learns what it holds from the keys the worker
reports back (see scheduler.py). Delete this module when the connector is wired to
TieredStore.

Primitives: `PlaceholderStore`.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

from kvtier.core.keys import ChunkKey


class PlaceholderStore:
    """An LRU dict of chunk bytes with a byte budget. Thread-safe."""

    def __init__(self, bytes_per_chunk: int, capacity_bytes: int) -> None:
        self._bytes_per_chunk = bytes_per_chunk
        self._max_chunks = max(1, capacity_bytes // bytes_per_chunk)
        self._chunks: OrderedDict[ChunkKey, bytes] = OrderedDict()
        self._lock = threading.Lock()
        self._hits = self._misses = self._puts = self._evictions = 0

    def get_into(self, key: ChunkKey, out: memoryview) -> str | None:
        """Copy the chunk into `out`; return "placeholder" on a hit, None on a miss."""
        with self._lock:
            data = self._chunks.get(key)
            if data is None:
                self._misses += 1
                return None
            self._chunks.move_to_end(key)
            self._hits += 1
        out[: len(data)] = data
        return "placeholder"

    def put(self, key: ChunkKey, data: memoryview) -> bool:
        """Store a copy of `data` (exactly bytes_per_chunk bytes); return True when stored."""
        if data.nbytes != self._bytes_per_chunk:
            return False
        copy = bytes(data)
        with self._lock:
            self._chunks[key] = copy
            self._chunks.move_to_end(key)
            self._puts += 1
            while len(self._chunks) > self._max_chunks:
                self._chunks.popitem(last=False)
                self._evictions += 1
        return True

    def stats(self) -> dict[str, dict[str, int]]:
        """Per-tier counters, shaped like TieredStore.stats()."""
        with self._lock:
            return {"placeholder": {"hits": self._hits, "misses": self._misses,
                                    "puts": self._puts, "evictions": self._evictions,
                                    "chunks": len(self._chunks)}}

    def close(self) -> None:
        with self._lock:
            self._chunks.clear()
