"""Chunks a redis tier let go whose delete did not reach their server: owed a delete.

With a `capacity`, the tier's LRU index pops the chunks beyond it from its sorted set, and
the tier then deletes their hashes, in a second round trip (tiers/redis/index.py). A delete
that fails (the server marked down by another thread's failed call, a timeout under load, a
Cluster node down while the index's answers) left the hashes on the server outside the index:
never evicted by it, uncounted, for ever where no `ttl_s` ends them (a server with
`noeviction` then fills up one day; a leak soak of Redis faults found more chunks held than
the capacity after each fault). They are kept here and deleted with a later eviction's.

Bounded (MAX_OWED; past it the oldest are forgotten, left to the server as before). A chunk
owed a delete that is put again is written anew and indexed (a HELD would leave it uncounted),
and owes none once written (`discard`). A delete already under way for it then (another
thread's eviction), or another engine storing it meanwhile, is not seen: that copy is
deleted, a later miss (counted), never wrong KV.

Primitives: `OwedDeletes`, `MAX_OWED`.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterable

MAX_OWED = 1 << 16  # chunks owed a delete, at most (~100 B each)


class OwedDeletes:
    """Chunks (hex keys) whose delete failed, oldest first. Thread-safe."""

    def __init__(self, max_keys: int = MAX_OWED) -> None:
        self._keys: OrderedDict[str, None] = OrderedDict()
        self._max_keys = max_keys
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._keys)

    def __contains__(self, hex_key: object) -> bool:
        return hex_key in self._keys

    def owe(self, hex_keys: Iterable[str]) -> None:
        """Their deletes failed: delete them later."""
        with self._lock:
            for hex_key in hex_keys:
                self._keys[hex_key] = None
            while len(self._keys) > self._max_keys:
                self._keys.popitem(last=False)

    def take(self) -> list[str]:
        """Every chunk owed a delete, now the caller's to delete (or `owe` again)."""
        with self._lock:
            keys = list(self._keys)
            self._keys.clear()
        return keys

    def discard(self, hex_key: str) -> None:
        """The chunk is stored again: its delete is no longer owed."""
        with self._lock:
            self._keys.pop(hex_key, None)
