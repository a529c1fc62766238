"""The write-behind of a tiered store: each tier below the top gets the chunks stored in
the top one through a bounded queue drained by its own threads, off the caller's thread.

A full queue drops the write (counted) rather than block the engine; a key is `inflight`
from the moment it is queued until its write ended, so the store still answers "held" for a
chunk the top tier evicted while its copy is on its way down. Whether the tier holds the
chunk already is its `put`'s decision (which also applies a later pin or expiry to a held
one): asking first would cost a second round trip per write on a shared or remote tier.

Primitives: `WriteBehind`, `FailureCounts`.
"""

from __future__ import annotations

import logging
import threading

from kvtier.core.keys import ChunkKey
from kvtier.core.retention import DEFAULT_META, ChunkMeta
from kvtier.core.threads import IOPool
from kvtier.core.tier import Failure, Tier

log = logging.getLogger(__name__)


class FailureCounts:
    """tier name -> Failure -> count, thread-safe (readers and writers count at once)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: dict[str, dict[str, int]] = {}

    def add(self, tier: str, failure: Failure) -> None:
        with self._lock:
            by_reason = self._counts.setdefault(tier, {})
            by_reason[failure.value] = by_reason.get(failure.value, 0) + 1

    def snapshot(self) -> dict[str, dict[str, int]]:
        with self._lock:
            return {tier: dict(reasons) for tier, reasons in self._counts.items()}


class WriteBehind:
    """A bounded queue of writes to one lower tier, drained by its own threads."""

    def __init__(self, tier: Tier, depth: int, threads: int, failures: FailureCounts,
                 cores: frozenset[int] | None = None) -> None:
        self.tier = tier
        self.drops = 0
        self._failures = failures
        self._slots = threading.BoundedSemaphore(depth)
        self._pool = IOPool(threads, f"kvtier-write-{tier.name}", cores)
        self._idle = threading.Condition()
        self._pending = 0
        # Keys queued or being written: held for `TieredStore.contains` (a chunk the top tier
        # evicts while its copy is on its way down is not lost).
        self.inflight: set[ChunkKey] = set()

    def submit(self, key: ChunkKey, data: memoryview, meta: ChunkMeta = DEFAULT_META) -> bool:
        """Queue a write of the chunk with its tenant, pin and expiry (`meta`, passed on to
        the tier's `put`); False when the queue is full (dropped, counted)."""
        if not self._slots.acquire(blocking=False):  # full: drop rather than block
            self.drops += 1
            return False
        with self._idle:
            self._pending += 1
            self.inflight.add(key)
        self._pool.submit(self._write, key, data, meta)
        return True

    def _write(self, key: ChunkKey, data: memoryview, meta: ChunkMeta) -> None:
        try:
            result = self.tier.put(key, data, meta)  # off the caller's thread: may block
            if result.failure is not None:
                self._failures.add(self.tier.name, result.failure)
        except Exception:  # a broken tier must not kill the writer thread
            log.exception("tier %r: write-behind of %s failed", self.tier.name, key.hex())
            self._failures.add(self.tier.name, Failure.RAISED)
        finally:
            self._slots.release()
            with self._idle:
                self._pending -= 1
                self.inflight.discard(key)
                self._idle.notify_all()

    @property
    def pending(self) -> int:
        return self._pending

    def flush(self, timeout_s: float | None = None) -> bool:
        with self._idle:
            return self._idle.wait_for(lambda: self._pending == 0, timeout_s)

    def close(self, wait: bool = True) -> None:
        """Stop the threads: writes not started yet are dropped; running ones finish, waited
        for unless `wait` is False (a tier that stopped answering holds them for as long as
        it does: they end whenever it answers)."""
        self._pool.shutdown(wait=wait, cancel_futures=True)
