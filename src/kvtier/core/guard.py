"""Circuit breakers for tiers: a server (or a tier) that fails is skipped at once, retried with
exponential backoff, and used again as soon as a retry succeeds.

A remote tier asks `Guard.allow(endpoint)` before each call. While the endpoint is up, every
call goes through. The first failure (connection refused, timeout, auth failure) marks it down
for `backoff_s`; until then `allow` answers False in microseconds, so a lookup misses and a
write is dropped without touching the network. When the backoff has passed, exactly one caller
is let through as the probe: success marks the endpoint up, failure doubles the backoff (up to
`max_backoff_s`). Nothing here blocks: how long a probe may take is bounded by the tier's own
socket timeouts.

Endpoints are strings (a server, or one Redis Cluster node), so one dead node of a cluster
costs only the chunks it holds.

Primitives: `Guard` (allow, succeeded, failed, is_up, down_endpoints).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

log = logging.getLogger(__name__)


@dataclass(slots=True)
class _Breaker:
    backoff_s: float  # the wait after the next failure
    retry_at: float = 0.0  # monotonic time from which a probe may go through
    down: bool = False
    probing: bool = False  # a probe is in flight: everyone else still fails fast
    failures: int = 0  # consecutive failures


class Guard:
    """Per-endpoint circuit breakers of one tier. Thread-safe."""

    def __init__(self, name: str, min_backoff_s: float = 0.5, max_backoff_s: float = 30.0,
                 *, effect: str = "lookups miss and writes are dropped") -> None:
        """Args:
            name: the tier's name, for logs.
            min_backoff_s: wait before the first retry of an endpoint that failed.
            max_backoff_s: the longest wait between retries.
            effect: what an endpoint down costs, for the warning of each outage (a guard of
                one kind of call says that only those calls are skipped).
        """
        self.name = name
        self.effect = effect
        self.min_backoff_s = min(min_backoff_s, max_backoff_s)
        self.max_backoff_s = max_backoff_s
        self._lock = threading.Lock()
        self._breakers: dict[str, _Breaker] = {}

    def allow(self, endpoint: str) -> bool:
        """Whether a call to `endpoint` may go out now. A True for a down endpoint makes the
        caller its probe, which must report back with `succeeded` or `failed`."""
        with self._lock:
            breaker = self._breakers.get(endpoint)
            if breaker is None or not breaker.down:
                return True
            if breaker.probing or time.monotonic() < breaker.retry_at:
                return False
            breaker.probing = True
            return True

    def succeeded(self, endpoint: str) -> None:
        """A call to `endpoint` worked: mark it up (a no-op when it already was)."""
        with self._lock:
            breaker = self._breakers.get(endpoint)
            if breaker is None or not breaker.down:
                return
            del self._breakers[endpoint]
        log.warning("tier %r: %s is back after %d failed attempt(s)", self.name, endpoint,
                    breaker.failures)

    def failed(self, endpoint: str, error: BaseException) -> None:
        """A call to `endpoint` failed for want of the server: mark it down and back off."""
        with self._lock:
            breaker = self._breakers.setdefault(endpoint, _Breaker(self.min_backoff_s))
            wait_s = breaker.backoff_s
            breaker.backoff_s = min(wait_s * 2, self.max_backoff_s)
            breaker.retry_at = time.monotonic() + wait_s
            breaker.failures += 1
            first = not breaker.down
            breaker.down, breaker.probing = True, False
        # Once per outage at warning level; the retries' failures only at debug.
        if first:
            log.warning("tier %r: %s is unavailable (%s: %s); %s until it answers again "
                        "(retry in %.2g s)", self.name, endpoint, type(error).__name__, error,
                        self.effect, wait_s)
        else:
            log.debug("tier %r: %s still unavailable (%s); retry in %.2g s", self.name,
                      endpoint, error, wait_s)

    def is_up(self, endpoint: str) -> bool:
        """Whether `endpoint` is believed up (no failure since its last success)."""
        with self._lock:
            breaker = self._breakers.get(endpoint)
            return breaker is None or not breaker.down

    def down_endpoints(self) -> list[str]:
        """The endpoints marked down now."""
        with self._lock:
            return [name for name, b in self._breakers.items() if b.down]
