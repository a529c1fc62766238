"""A tier's link measured within a deadline (`kvtier.core.tier.LinkProbe`), for the tiers
whose medium can hang a thread: a hard-mounted network filesystem that stops answering
blocks a read for ever, and an S3 endpoint that trickles its reply never trips a socket
timeout. The measure runs on a thread of its own; the caller waits at most the deadline, and
a measure that fails or is late gives no estimate (the load-or-recompute rule then waits for
a timed load, as without a probe), logged with the reason (issue 45).

The steps a measure is made of (`best_of`, `in_parallel`) keep to the deadline as well: a
timing is repeated only while the deadline leaves room for one more as long as the last (a
slow link is measured once rather than not at all), and parallel reads run on daemon threads
(a read blocked in a hung mount must not hold up the interpreter's exit).

Primitives: `BoundedMeasure`, `LINK_DEADLINE_S`, `check_deadline`, `best_of`,
`in_parallel`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence

from kvtier.core.tier import LinkSpeed
from kvtier.errors import LinkTimeout

log = logging.getLogger(__name__)
# A measure moves 5-10 MiB (a probe file's write and a round of reads; an s3 probe's PUT and
# a round of GETs): 5 s covers a link down to ~20 Mbit/s to a directory, ~10 Mbit/s to s3;
# a slower one (or a hung mount) gives no estimate.
LINK_DEADLINE_S = 5.0


class BoundedMeasure:
    """Runs one tier's link measures, each on a daemon thread, waiting at most `deadline_s`.

    A measure still running at the deadline is abandoned: the caller gets None at once and
    the thread ends when its blocked call does (cleaning up after itself); until then a new
    measure gives None without starting another thread, so a hung medium holds one thread
    per tier, never one per minute. Thread-safe.
    """

    def __init__(self, tier_name: str, deadline_s: float = LINK_DEADLINE_S) -> None:
        self.tier_name = tier_name
        self.deadline_s = deadline_s
        self._lock = threading.Lock()
        self._idle = threading.Event()  # no measure running (one abandoned included)
        self._idle.set()
        self._last_failure = ""  # said as a warning once; again only when it changes

    def measure(self, steps: Callable[[float], LinkSpeed]) -> LinkSpeed | None:
        """`steps(deadline)` (`deadline`: a `time.monotonic()` it should check between its
        steps, raising `LinkTimeout` past it) on a thread of its own; its LinkSpeed, or None
        when it raised, was late, or an earlier measure is still blocked (each logged).
        Never raises. Any thread; blocks at most `deadline_s`."""
        deadline = time.monotonic() + self.deadline_s
        result: list[LinkSpeed | None] = [None]
        abandoned = [False]  # the caller gave up: a LinkTimeout then is said once, by it
        done = threading.Event()

        def run() -> None:
            try:
                result[0] = steps(deadline)
                self._failed("")
            except LinkTimeout:
                with self._lock:
                    quiet = abandoned[0]
                if not quiet:
                    self._failed(f"passed its {self.deadline_s:.1f} s deadline")
            except Exception as exc:  # a probe is advice: any failure is "no estimate"
                self._failed(f"failed ({type(exc).__name__}: {exc})")
            finally:
                with self._lock:
                    done.set()
                    self._idle.set()

        with self._lock:
            blocked = not self._idle.is_set()
            if not blocked:
                self._idle.clear()
                threading.Thread(target=run, daemon=True,
                                 name=f"kvtier-link-{self.tier_name}").start()
        if blocked:
            self._failed("not started: the last one is still blocked in the medium")
            return None
        done.wait(self.deadline_s)
        with self._lock:
            if not done.is_set():
                abandoned[0] = True
        if abandoned[0]:
            self._failed(f"still running after its {self.deadline_s:.1f} s deadline")
        return result[0]

    def _failed(self, reason: str) -> None:
        """Log why a measure gave no estimate ("": it gave one): a warning when the reason
        is new, a debug line when it repeats (a read-only directory, refused credentials:
        every minute)."""
        with self._lock:
            repeated, self._last_failure = reason == self._last_failure, reason
        if reason:
            log.log(logging.DEBUG if repeated else logging.WARNING, "tier %r: link measure "
                    "%s; no estimate (the first loads are timed instead)", self.tier_name,
                    reason)

    def wait_idle(self, timeout_s: float) -> bool:
        """Wait at most `timeout_s` for no measure to be running (an abandoned one ended,
        its probe removed): the tier's `close` calls it before closing what a measure uses.
        Whether none is running."""
        return self._idle.wait(timeout_s)


def check_deadline(deadline: float) -> None:
    """Raises LinkTimeout when `deadline` (monotonic) has passed."""
    if time.monotonic() > deadline:
        raise LinkTimeout


def best_of(rounds: int, timed: Callable[[], float], deadline: float) -> float:
    """The least of up to `rounds` results of `timed()` (seconds): the first once the
    deadline is checked, each next only while the deadline leaves room for one more as long
    as the last. Raises LinkTimeout, and what `timed` raises."""
    check_deadline(deadline)
    best = last = timed()
    for _ in range(rounds - 1):
        if time.monotonic() + last > deadline:
            break
        last = timed()
        best = min(best, last)
    return best


def in_parallel(calls: Sequence[Callable[[], object]]) -> None:
    """Run the calls at once, each on a daemon thread, and wait for all. Raises the first
    exception a call raised, once every call returned."""
    errors: list[BaseException] = []

    def run(call: Callable[[], object]) -> None:
        try:
            call()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(call,), daemon=True, name="kvtier-link-read")
               for call in calls]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
