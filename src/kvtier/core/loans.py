"""What `TieredStore.borrow_many` lends: a batch's chunks, each as soon as its read lands.

`loans[i]` is chunk i's view (None: a miss), waiting for its read if it is still running,
at most until the batch's deadline; a read past it is abandoned (`abandon`: counted, its
spare replaced) and its tier reported stalled, once per tier. Iterating lends the chunks in
key order, each as it lands, so a caller copies chunk i while the later ones are still
being read: a batch of reads and its copies overlap instead of running one after the other.
Reads the caller never asked for are waited for (to the same deadline) when the borrow ends.
`landed` says whether taking a view would wait; `Loans.wait_any` waits for the first of
several batches to land (a borrower with several batches open takes whichever is ready).

Primitives: `Loans`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator, MutableMapping, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, wait
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, Generic, TypeVar, overload

V = TypeVar("V")


class Loans(Sequence["V | None"], Generic[V]):
    """A batch's views in key order, each lent once its read has landed (one thread: the
    borrower's)."""

    def __init__(self, views: list[V | None], reads: dict[int, Future[V | None]],
                 timeout_s: float, *, reading: MutableMapping[int, str],
                 abandon: Callable[[int], str | None], stalled: Callable[[str], None],
                 tried: MutableMapping[int, str] | None = None) -> None:
        """Args:
            views: one per key: those lent at once, None where `reads` has a read running.
            reads: key index -> its read (returns the view or None).
            timeout_s: how long from now the reads may take, all together.
            reading: key index -> the tier its read waits on, or that failed it (kept by
                the reads themselves).
            abandon: gives up key i's late read (counts it, replaces its spare); the tier
                it was waiting on, if it had started.
            stalled: told, once per tier, that a tier let a read run past the deadline.
            tried: filled, for each key whose read failed because a tier did, with that tier.
        """
        self._views = views
        self._reads = reads
        self._deadline = time.monotonic() + timeout_s
        self._reading = reading
        self._abandon = abandon
        self._stalled = stalled
        self._late: set[str] = set()
        self._tried = tried

    def __len__(self) -> int:
        return len(self._views)

    @overload
    def __getitem__(self, i: int) -> V | None: ...

    @overload
    def __getitem__(self, i: slice) -> list[V | None]: ...

    def __getitem__(self, i: int | slice) -> V | list[V | None] | None:
        if isinstance(i, slice):
            return [self[j] for j in range(len(self))[i]]
        i = range(len(self))[i]  # negative indices; IndexError past the end
        read = self._reads.pop(i, None)
        if read is not None:
            self._land(i, read)
        return self._views[i]

    def __iter__(self) -> Iterator[V | None]:
        return (self[i] for i in range(len(self)))

    def __eq__(self, other: object) -> bool:
        """Equal to a list (or `Loans`) of the same views in order, as the list `borrow_many`
        once lent was (waits for every read)."""
        if isinstance(other, list | Loans):
            return list(self) == list(other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]  # a sequence of views: unhashable

    def landed(self) -> bool:
        """Whether every view can be taken without waiting: each read has returned, or the
        deadline has passed (a late read is then abandoned at once)."""
        return all(read.done() for read in self._reads.values()) \
            or time.monotonic() >= self._deadline

    @staticmethod
    def wait_any(batches: Iterable[Loans[Any]]) -> None:
        """Wait until one of `batches` has `landed` (at most until the earliest deadline)."""
        batches = list(batches)
        while batches and not any(batch.landed() for batch in batches):
            reads = [read for batch in batches for read in batch._reads.values()]
            deadline = min(batch._deadline for batch in batches)
            wait(reads, max(0.0, deadline - time.monotonic()), FIRST_COMPLETED)

    def settle(self) -> None:
        """Wait for the reads nobody asked for (to the deadline): none may outlive the borrow
        with a spare of the caller's."""
        for i in sorted(self._reads):
            self._land(i, self._reads.pop(i))

    def _land(self, i: int, read: Future[V | None]) -> None:
        try:
            view = read.result(timeout=max(0.0, self._deadline - time.monotonic()))
        except FutureTimeout:
            if read.done():  # the read itself raised it
                raise
            tier = self._abandon(i)
            if tier is not None:
                self._note_failed(i, tier)
                if tier not in self._late:
                    self._late.add(tier)
                    self._stalled(tier)
            return
        self._views[i] = view
        if view is None and i in self._reading:
            self._note_failed(i, self._reading[i])

    def _note_failed(self, i: int, tier: str) -> None:
        if self._tried is not None:
            self._tried[i] = tier
