"""The links of a node's tiers below RAM, measured by the node itself (`NodeLinks`): the prior
of the engines' `node-below` tier (load-or-recompute, issue 45) before a load from it is timed.

Each layout's are measured on a `MeasureLinks` (an engine's worker asks at start-up, then
every 10 s, then every minute, on a thread of its own), at most once a LINK_MEASURE_S. The
first ask waits for LINK_WINDOW measures taken back to back: a node just restarted would
otherwise answer nothing (an engine whose next ask came after its first loads judged them
with no prior, and one stalled first load cut the tier for the run), or one measure taken
while it was busy starting (a tier judged slower than recompute by its prior alone is not
tried: every hit of the run recomputed). The later asks get what is known at once and a
measure in the background. Each tier's answer is the best of its last LINK_WINDOW measures: a
measure taken while the node is busy (engines starting, their stores going to disk, reads for
other engines) reads a link slower than it is; one judged too fast is tried, and its first
timed loads correct it.

Primitives: `NodeLinks`.
"""

from __future__ import annotations

import threading
import time
from collections import deque

from kvtier.core.store import TieredStore
from kvtier.core.tier import LinkSpeed

LINK_MEASURE_S = 10.0  # a measure at most this often (engines ask every 10-60 s)
LINK_WINDOW = 3  # measures a tier's best is taken from


class NodeLinks:
    """One layout's tiers' links (see the module docstring). Thread-safe."""

    def __init__(self, store: TieredStore, chunk_bytes: int) -> None:
        self._store = store
        self._chunk_bytes = chunk_bytes
        self._lock = threading.Lock()
        self._measures: dict[str, deque[LinkSpeed]] = {}
        self._measured_s = -float("inf")
        self._running = False

    def refresh(self) -> None:
        """Measure again on a thread of its own, unless one runs or LINK_MEASURE_S has not
        passed since the last."""
        with self._lock:
            if self._running or time.monotonic() < self._measured_s + LINK_MEASURE_S:
                return
            self._running = True
            self._measured_s = time.monotonic()
        threading.Thread(target=self._measure, daemon=True, name="kvtier-node-links").start()

    def current(self) -> dict[str, LinkSpeed]:
        """`best`, after measuring now when nothing is measured yet (the asking engine's
        thread waits: its worker asks off the model runner's thread); else `refresh`."""
        if self.best():
            self.refresh()
            return self.best()
        with self._lock:  # nothing yet: measure on this thread (one at a time, when due)
            due = not self._running and time.monotonic() >= self._measured_s + LINK_MEASURE_S
            if due:
                self._running = True
                self._measured_s = time.monotonic()
        if due:  # several: one taken while the node is busy (just started) reads slow
            self._measure(LINK_WINDOW)
        return self.best()

    def best(self) -> dict[str, LinkSpeed]:
        """Each measured tier's fastest link of its last LINK_WINDOW measures (for a chunk)."""
        with self._lock:
            return {tier: min(speeds, key=lambda s: s.read_s(self._chunk_bytes))
                    for tier, speeds in self._measures.items() if speeds}

    def _measure(self, times: int = 1) -> None:
        try:
            for _ in range(times):
                speeds = self._store.measure_links()  # never raises for I/O
                with self._lock:
                    for tier, speed in speeds.items():
                        self._measures.setdefault(tier, deque(maxlen=LINK_WINDOW)).append(speed)
        finally:
            with self._lock:
                self._running = False
