"""A warning that a failing medium repeats at every chunk (a disk made unwritable: every write
fails, thousands a second): logged at once, then at most once per interval, with how many like
it were not, so that the log says what happens without drowning what else it says.

Primitives: `ThrottledWarning`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

EVERY_S = 10.0  # at most one line per interval, per warning


class ThrottledWarning:
    """One kind of warning of one logger (one per call site and tier). Thread-safe."""

    def __init__(self, logger: logging.Logger, every_s: float = EVERY_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._logger = logger
        self._every_s = every_s
        self._clock = clock
        self._lock = threading.Lock()
        self._next_at = float("-inf")
        self._held_back = 0

    def warning(self, message: str, *args: object) -> None:
        """Log `message % args` now, or count it when one was logged less than `every_s` ago
        (the next line says how many were not)."""
        now = self._clock()
        with self._lock:
            if now < self._next_at:
                self._held_back += 1
                return
            held_back, self._held_back = self._held_back, 0
            self._next_at = now + self._every_s
        if held_back:
            message += " (and %d more like it since the last, not logged)"
            args = (*args, held_back)
        self._logger.warning(message, *args)
