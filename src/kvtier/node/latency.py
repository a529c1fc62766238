"""How long the node's Borrows take (`kvtier node status`, `kvtier_node_borrow_seconds`): counts
in fixed buckets per source, "ram" (every chunk lent from the RAM slab) or "below" (a tier
below RAM read, or failed, for it). A Borrow that reads below RAM is what a load from disk,
shared storage, redis or S3 costs an engine in node mode; its tail is what an operator sizes
`load_budget` and the node's cores against.

Primitives: `Latencies`, `BUCKETS_S`, `SOURCES`.
"""

from __future__ import annotations

import bisect
import threading
from typing import Any

# Upper bounds, seconds (Prometheus' "le"); the last bucket, +Inf, is implied.
BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
SOURCES = ("ram", "below")


class Latencies:
    """Seconds observed per source, bucketed. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts = {source: [0] * (len(BUCKETS_S) + 1) for source in SOURCES}
        self._sums = dict.fromkeys(SOURCES, 0.0)

    def observe(self, source: str, seconds: float) -> None:
        """Raises KeyError: `source` is not one of SOURCES."""
        bucket = bisect.bisect_left(BUCKETS_S, seconds)
        with self._lock:
            self._counts[source][bucket] += 1
            self._sums[source] += seconds

    def snapshot(self) -> dict[str, dict[str, Any]]:
        """Per source: "buckets", [[le, cumulative count], ...] ending with ["+Inf", count],
        "sum" (seconds) and "count"."""
        with self._lock:
            counts = {source: list(c) for source, c in self._counts.items()}
            sums = dict(self._sums)
        out: dict[str, dict[str, Any]] = {}
        for source, per_bucket in counts.items():
            cumulative, total = [], 0
            for le, count in zip([*BUCKETS_S, "+Inf"], per_bucket):
                total += count
                cumulative.append([le, total])
            out[source] = {"buckets": cumulative, "sum": sums[source], "count": total}
        return out
