"""Which live requests have each chunk key, and where: so that a worker report naming a few
chunks that failed to load or store (loadfailures.py) costs those chunks, not a walk of every
request's planned keys (256 requests of 64k tokens: 1.3 ms a report, paid every step while a
tier keeps failing; tests/connector/test_load_failure_scaling.py).

Every key a request's chain has is indexed as it is made (`RequestTable.keys_for`): whether
a plan covers it is its request's `num_planned_chunks`, read when a report names it, so the
index need not follow each plan. Tails (keys.tail_key) are indexed as a lookup finds one or a
plan stores one. A request's keys leave with it (or with its chain, at a cache reset).

Scheduler side, one thread. Primitives: `PlannedKeys`.
"""

from __future__ import annotations

from collections.abc import Iterable

from kvtier.core.keys import ChunkKey

__all__ = ["PlannedKeys"]


class PlannedKeys:
    """Chunk key -> the requests whose chain has it, at which position; tail key -> the
    requests that found or stored it (request ids; scheduler thread)."""

    def __init__(self) -> None:
        self._chunks: dict[ChunkKey, dict[str, int]] = {}
        self._tails: dict[ChunkKey, set[str]] = {}
        self._tails_of: dict[str, set[ChunkKey]] = {}  # to forget them with their request

    def add_chunks(self, request_id: str, first: int, keys: Iterable[ChunkKey]) -> None:
        """The request's chain has `keys` from position `first` on."""
        for position, key in enumerate(keys, first):
            self._chunks.setdefault(key, {})[request_id] = position

    def add_tail(self, request_id: str, key: ChunkKey) -> None:
        """The request found or stores tail `key` (kept until the request is forgotten: a
        tail it no longer has is skipped when a report names it)."""
        self._tails.setdefault(key, set()).add(request_id)
        self._tails_of.setdefault(request_id, set()).add(key)

    def chunk_holders(self, key: ChunkKey) -> dict[str, int]:
        """Request id -> the position of `key` in its chain (read only)."""
        return self._chunks.get(key, {})

    def tail_holders(self, key: ChunkKey) -> set[str]:
        """Ids of the requests that found or stored tail `key` (read only)."""
        return self._tails.get(key, set())

    def forget_chunks(self, request_id: str, keys: Iterable[ChunkKey]) -> None:
        """The request's chain, `keys`, is gone (it ended, or a reset re-keys it)."""
        for key in keys:
            holders = self._chunks.get(key)
            if holders is not None:
                holders.pop(request_id, None)
                if not holders:
                    del self._chunks[key]

    def forget_tails(self, request_id: str) -> None:
        """The request's tails are gone."""
        for key in self._tails_of.pop(request_id, ()):
            holders = self._tails[key]
            holders.discard(request_id)
            if not holders:
                del self._tails[key]

    def __len__(self) -> int:
        """Keys indexed, chunks and tails."""
        return len(self._chunks) + len(self._tails)
