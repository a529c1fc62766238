"""The node's own counters: what it lent, reserved, sent and refused, and what it recovered,
each only ever added to. `NodeServer.status` reports them; metrics.py exports them.

Primitives: `COUNTERS`, `NodeCounters`.
"""

from __future__ import annotations

import threading

# The node's own counters (`NodeServer.counters`), each only ever added to.
COUNTERS = ("borrows", "lent_chunks", "read_in_place", "reserved_chunks",
            "committed_chunks",
            "received_chunks", "sent_chunks", "lookups",
            "refused", "refused_messages", "disconnects_with_leases", "leases_expired",
            "expired_chunks", "send_timeouts", "quarantines_ended", "held_below_skipped",
            "recovered_chunks",
            "recovery_dropped_chunks",
            "described_chunks", "events_stored", "events_removed", "stored_unannounced")


class NodeCounters:
    """`COUNTERS`, added to from every connection's thread. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._values = dict.fromkeys(COUNTERS, 0)

    def add(self, name: str, count: int = 1) -> None:
        """Raises KeyError: `name` is not one of COUNTERS."""
        with self._lock:
            self._values[name] += count

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._values)
