"""Calls into tiers that may stall, bounded in time: a tier that does not answer is skipped.

A dead hard-mounted NFS server blocks a `stat` or a `read` in the kernel for ever; a server
that accepts and never replies does the same to a socket without a timeout. Inside vLLM such
a call on the engine's thread is a hung engine. So the store runs every call into a tier
below the top one on these threads and waits at most `timeout_s`: a call that has not
returned by then is abandoned (its thread is left to finish whenever the tier answers), the
caller gets a miss, and the tier is marked stalled: skipped at once by every caller, retried
by one probe after a backoff (`Guard`), used again as soon as any call to it returns.

The threads are replaced when a call is abandoned, so that stalled calls never queue the
next ones behind them; abandoned threads are as many as the stalled calls, which the
backoff keeps few.

A call made once, where no guard is kept (a tier's directory checked when its config is read,
or stat-ed before it is opened), is bounded the same way by `call_within`. Calls made often
where no guard is kept (the node's question to the tiers below RAM at each store) go through
`CallSlots`: a few threads, and a call asked while every one is held (by calls a hung tier
never answers) is not made, so that the calls left to finish cannot grow without bound.

Primitives: `StallGuard` (usable, answered, stalled, call, submit, start_threads, close),
`call_within`, `CallSlots`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import ParamSpec, TypeVar

from kvtier.core.guard import Guard
from kvtier.core.threads import IOPool, start_threads

log = logging.getLogger(__name__)
P = ParamSpec("P")
R = TypeVar("R")


class StallGuard:
    """Bounded calls into tiers, named by the tier's name. Thread-safe."""

    def __init__(self, threads: int, timeout_s: float, *, min_backoff_s: float = 1.0,
                 max_backoff_s: float = 60.0, cores: frozenset[int] | None = None) -> None:
        """Args:
            threads: calls in flight at once.
            timeout_s: how long a caller waits for a call before abandoning it.
            min_backoff_s, max_backoff_s: how long a stalled tier is skipped before one call
                probes it again (doubling from the first to the second).
            cores: where the threads run (core/threads.py; None: where their starter runs).
        """
        self.timeout_s = timeout_s
        self._threads = threads
        self._cores = cores
        self._guard = Guard("stall", min_backoff_s, max_backoff_s)
        self._lock = threading.Lock()
        self._pool = self._new_pool()
        self._abandoned = 0
        self._marked: dict[str, float] = {}  # tier -> when it was last marked stalled

    def _new_pool(self) -> IOPool:
        return IOPool(self._threads, "kvtier-read", self._cores)

    def start_threads(self) -> None:
        """Start every call thread now (`threads.start_threads`; blocks until they run)."""
        with self._lock:
            pool = self._pool
        start_threads(pool, self._threads)

    def usable(self, tier: str) -> bool:
        """Whether a call to `tier` may go out now (False while it is stalled; the first
        True after its backoff makes the caller its probe: report with `answered`)."""
        return self._guard.allow(tier)

    def answered(self, tier: str) -> None:
        """A call to `tier` returned (whatever it returned): the tier answers."""
        self._guard.succeeded(tier)

    def stalled(self, tier: str) -> bool:
        """A call to `tier` was abandoned: skip the tier, and give later calls new threads;
        whether this began a stall (or a probe failed). A call abandoned within `timeout_s`
        of the tier being marked stalled was in flight then: the same stall, which neither
        doubles the backoff again nor needs new threads (each chunk of a load is a call of
        its own: all of a load's late reads would have backed the tier off 2^n times)."""
        now = time.monotonic()
        with self._lock:
            self._abandoned += 1
            marked = self._marked.get(tier)
            if marked is not None and now - marked < self.timeout_s \
                    and not self._guard.is_up(tier):
                return False
            self._marked[tier] = now
            self._guard.failed(tier, TimeoutError(f"no answer within {self.timeout_s:g} s"))
            old, self._pool = self._pool, self._new_pool()
        old.shutdown(wait=False)
        return True

    def submit(self, fn: Callable[P, R], *args: P.args, **kwargs: P.kwargs) -> Future[R]:
        """Run `fn` on a call thread (the caller waits, with `timeout_s`, and reports)."""
        with self._lock:
            return self._pool.submit(fn, *args, **kwargs)

    def call(self, tier: str, default: R, fn: Callable[P, R], *args: P.args,
             **kwargs: P.kwargs) -> R:
        """`fn(*args)` for `tier`, or `default` when the tier is stalled or does not answer
        within `timeout_s` (then it is marked stalled). What `fn` raises propagates."""
        if not self.usable(tier):
            return default
        future = self.submit(fn, *args, **kwargs)
        try:
            result = future.result(timeout=self.timeout_s)
        except FutureTimeout:
            self.stalled(tier)
            return default
        self.answered(tier)
        return result

    @property
    def abandoned(self) -> int:
        """Calls abandoned so far."""
        return self._abandoned

    def close(self) -> None:
        """Stop the threads: wait for the running calls unless some were abandoned (a
        stalled call may never return)."""
        with self._lock:
            pool, wait = self._pool, self._abandoned == 0
        pool.shutdown(wait=wait, cancel_futures=True)


def call_within(fn: Callable[[], R], timeout_s: float, name: str) -> tuple[bool, R | None]:
    """`fn()` on a daemon thread (named `name`), waited for at most `timeout_s`: (True, what
    it returned), or (False, None) when it has not returned by then (it is left to finish
    whenever it does: a daemon thread holds no process's exit). What it raises is raised."""
    future: Future[R] = Future()

    def run() -> None:
        try:
            future.set_result(fn())
        except BaseException as exc:  # handed to the caller
            future.set_exception(exc)

    threading.Thread(target=run, name=name, daemon=True).start()
    try:
        return True, future.result(timeout_s)
    except FutureTimeout:
        return False, None


class CallSlots:
    """At most `threads` calls in flight at once, each on a daemon thread of a pool of that
    many: a call a hung tier never answers keeps its thread (and its slot) until it returns,
    and one asked while every slot is held is not made (`submit` returns None). A thread
    per call, as `call_within` starts, let a tier below the node's RAM that hangs (a redis
    behind a stalled link, which answers a batch only at its deadline: its lookup_timeout_ms;
    a file tier on a dead NFS mount, never) pile up a thread per store for as long as it hung
    (tests/node/test_node_held_below_bounded.py).
    Thread-safe."""

    def __init__(self, threads: int, name: str) -> None:
        """Args:
            threads: calls in flight at once, each on a thread named `name`_N.
        """
        self._pool = IOPool(threads, name)
        self._free = threading.BoundedSemaphore(threads)
        self._lock = threading.Lock()
        self._closed = False

    def submit(self, fn: Callable[[], R]) -> Future[R] | None:
        """`fn()` on a free thread (the caller waits for its future, with a timeout of its
        own); None, and nothing done, when every slot is held or the slots are closed."""
        if not self._free.acquire(blocking=False):
            return None
        with self._lock:
            future = None if self._closed else self._pool.submit(fn)
        if future is None:
            self._free.release()
            return None
        future.add_done_callback(lambda _: self._free.release())
        return future

    def close(self) -> None:
        """No call from now on; the threads end once their calls return (never waited for:
        a hung call may never return)."""
        with self._lock:
            self._closed = True
            self._pool.shutdown(wait=False, cancel_futures=True)
