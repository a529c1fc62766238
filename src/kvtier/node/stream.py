"""A streamed `Borrow`'s reply, on the engine's side: the parts the node sends as a load's chunks
land (`Lent.more`), read off the borrowing thread's connection as its lending needs them, so
that the engine copies a load's first chunks while the node still reads the rest from below
its RAM (one reply after the last read made every load wait for its slowest chunk, then copy
them all).

The lending (`kvtier.core.loans.Lending`, in key order) lends chunk i at once when a part has
brought it, else waits on a `PartFuture`, whose `result` reads parts until chunk i comes, the
stream ends before it (a miss: the node stopped there), or its deadline passes. A stream left
unfinished (the borrower stopped early, or gave up waiting) is read to its end when the
lending closes, within the client's timeout; if it does not end then, the connection is
closed, after every loan is released: a late part would otherwise be read as the next
request's reply, and closing it ends the lease of slots the engine was still copying from.

Primitives: `LentStream`, `PartFuture`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout

from kvtier.core.loans import Hold
from kvtier.core.store import ChunkView
from kvtier.errors import NodeUnavailable
from kvtier.node.protocol import BELOW_TIER, RAM_TIER, Lent


class LentStream:
    """The parts of one streamed Borrow's reply, read on the borrowing thread."""

    def __init__(self, first: Lent, views_of: Callable[[Lent, int], list[ChunkView]],
                 receive: Callable[[float], Lent | None], tier_of: Callable[[str], str],
                 timeout_s: float) -> None:
        """Args:
            first: the reply's first part (the Borrow's answer).
            views_of: the chunks of a part whose first is chunk n of the load.
            receive: the connection's next reply, if one starts within a timeout (else
                None); raises NodeUnavailable (the connection broke, garbage).
            tier_of: the engine's name of a node's tier (the failed one).
            timeout_s: how long `wait_for` waits when given no timeout.
        """
        self.views: list[ChunkView] = []
        self.lease = 0
        self.failed_tier: str | None = None  # the engine's name of the tier that failed
        self.ended = False  # the last part came
        self.broken = False  # the connection failed mid-stream: the rest are misses
        self.ended_at: float | None = None  # time.perf_counter() of the last part
        self._views_of = views_of
        self._receive = receive
        self._tier_of = tier_of
        self._timeout_s = timeout_s
        self._take(first)

    @property
    def over(self) -> bool:
        """No part will come any more."""
        return self.ended or self.broken

    def _take(self, part: Lent) -> None:
        self.views += self._views_of(part, len(self.views))
        if not part.more:
            self.ended, self.ended_at, self.lease = True, time.perf_counter(), part.lease
            self.failed_tier = None if part.failed_tier is None \
                else self._tier_of(part.failed_tier)

    def wait_for(self, count: int, timeout_s: float | None) -> bool:
        """Read parts until `count` chunks came or no part will; False: `timeout_s` (None:
        the client's timeout) passed first."""
        deadline = time.monotonic() + (self._timeout_s if timeout_s is None else timeout_s)
        while len(self.views) < count and not self.over:
            try:
                part = self._receive(max(0.0, deadline - time.monotonic()))
            except NodeUnavailable:  # the node went away, or answered garbage
                self.broken, self.failed_tier = True, RAM_TIER
                break
            if part is None:  # late: the connection is kept (and read again at close)
                return False
            self._take(part)
        return True

    def finish(self, timeout_s: float) -> bool:
        """Read the parts left until the last (at most `timeout_s`); whether it came."""
        return self.wait_for(1 << 30, timeout_s) and self.ended


class PartFuture(Future[ChunkView | None]):
    """Chunk `index` of a stream, for a `Lending` in key order (which waits on it by
    `result` alone): `result` reads parts until it comes; None when the stream ended before
    it (`hold.tier`: the tier that failed it)."""

    def __init__(self, stream: LentStream, index: int, hold: Hold) -> None:
        super().__init__()
        self._stream = stream
        self._index = index
        self._hold = hold
        hold.tier = BELOW_TIER  # what a late part waits on: the node's reads below RAM

    def done(self) -> bool:
        return self._index < len(self._stream.views) or self._stream.over

    def result(self, timeout: float | None = None) -> ChunkView | None:
        if not self._stream.wait_for(self._index + 1, timeout):
            raise FutureTimeout
        if self._index < len(self._stream.views):
            return self._stream.views[self._index]
        self._hold.tier = self._stream.failed_tier
        return None
