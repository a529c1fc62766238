"""What `TieredStore.lend_as_landed` lends: a run of chunks, each as soon as its read lands.

A `Lending` starts the chunks in key order, as many ahead of its borrower as it has spare
buffers: a chunk an `InPlace` tier holds is lent where it lies at once (its spare is free
again as soon as it is lent), any other is read on the store's read threads into a spare,
which it keeps until its loan is released. Iterating yields each chunk's `Loan` as soon as
its read has landed, the first landed first (a late read holds up no other), or in key
order (`in_order`: a model with state layers writes each chunk's state into the request's
state blocks, and none may be written past a miss). It stops at the first miss: no chunk
after it is started any more, nor lent once the miss is known; every chunk before it is lent
first. `stopped_at` and `failed_tier` then say where it stopped and which tier failed that
read (what a failed load's time is charged to), and `expired` whether its deadline did.

Each read may take the store's read deadline from its start; a read past it is abandoned (a
miss, charged to the tier it waits on, which is reported late) and its spare replaced in the
caller's list by a new buffer, since the read may still write into the old one; it pins
nothing once it ends (`Hold`). A lending may have a deadline of its own (`until`: the
borrower's load is worth no more than its recompute, issue 45): a read not landed by then is
abandoned the same way, a miss charged to its tier but not reported late (the tier is slow
for this load, not stalled), and no read starts after it. Reads nobody took are waited for
(to their deadlines) when the lending ends: none may outlive it with a spare of the caller's.

The borrower decides how long each chunk stays lent: `release` now (a host copy done), or
`release_after` an event (a device copy queued: the lending releases it once the event is
reached, and waits for the oldest when it needs the spare back). Leaving the lending releases
every loan still out.

A caller whose spares are not plain host memory (a device mover's: pinned, so that its copies
are asynchronous) passes them as `SpareBuffers`, which carry their allocator: a replacement is
made by it (plain memory there would make every later copy through that spare a staged,
synchronous one on a GPU).

Primitives: `Lending`, `Loan`, `Hold`, `Completion`, `SpareBuffers`.
"""

from __future__ import annotations

import math
import mmap
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, MutableSequence
from concurrent.futures import FIRST_COMPLETED, Future, wait
from concurrent.futures import TimeoutError as FutureTimeout
from contextlib import AbstractContextManager, ExitStack
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

T = TypeVar("T")
V = TypeVar("V")


class Completion(Protocol):
    """Something a loan may be released after (a device's event)."""

    def query(self) -> bool:
        """Whether it is reached (no wait)."""
        ...

    def synchronize(self) -> None:
        """Wait until it is reached."""
        ...


class SpareBuffers(list[memoryview]):
    """A caller's chunk buffers (a list) and the allocator they came from, which makes the
    replacement of one an abandoned read may still write into (see the module docstring)."""

    def __init__(self, buffers: Iterable[memoryview],
                 allocate: Callable[[int], memoryview]) -> None:
        super().__init__(buffers)
        self.allocate = allocate  # nbytes -> a new buffer of their kind


def _replacement(spares: MutableSequence[memoryview], nbytes: int) -> memoryview:
    """A new spare for `spares`: of their allocator's (`SpareBuffers`), else plain memory
    (page-aligned)."""
    if isinstance(spares, SpareBuffers):
        return spares.allocate(nbytes)
    return memoryview(mmap.mmap(-1, nbytes))


class Hold:
    """What one lent chunk keeps until it is released (an `InPlace` tier's pin, a slot the
    top tier reserved for its read), entered from the borrower's thread or a read thread;
    and the tier its read waits on. A read that finishes after the hold was released (its
    lending gave up waiting) pins nothing: what it enters is exited at once."""

    def __init__(self) -> None:
        self._stack = ExitStack()
        self._lock = threading.Lock()
        self._closed = False
        # The tier the read waits on while it runs (a late read is charged to it); after a
        # miss, the tier that failed it, if one did (written by the read).
        self.tier: str | None = None

    def enter_context(self, cm: AbstractContextManager[T]) -> T | None:
        """`cm` entered and kept until `close`; None (and `cm` exited) once closed."""
        with self._lock:
            if not self._closed:
                return self._stack.enter_context(cm)
        with cm:
            return None

    def close(self) -> None:
        """Exit everything kept (once)."""
        with self._lock:
            self._closed = True
        self._stack.close()


class Loan(Generic[V]):
    """Chunk `index` of a `Lending`, lent until released (or until the lending ends); a
    context manager that releases it on exit."""

    __slots__ = ("_hold", "_lending", "_slot", "in_place", "index", "view")

    def __init__(self, index: int, view: V, hold: Hold, slot: int | None,
                 lending: Lending[V]) -> None:
        self.index = index  # the chunk's position in the keys lent
        self.view = view
        # Lent where it lies by an `InPlace` tier (else read into a spare or a reserved slot)
        self.in_place = slot is None
        self._hold = hold
        self._slot = slot  # the spare it keeps (None: it keeps none)
        self._lending: Lending[V] | None = lending

    def release(self) -> None:
        """End the loan now: its view must not be used any more. Idempotent."""
        lending, self._lending = self._lending, None
        if lending is not None:
            lending._release(self._hold, self._slot)

    def release_after(self, done: Completion) -> None:
        """End the loan once `done` is reached (a copy of the view queued on a device)."""
        if self._lending is not None:
            self._lending._deferred.append((done, self))

    def __enter__(self) -> Loan[V]:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


@dataclass(slots=True)
class _Started(Generic[V]):
    """A chunk started and not yet lent: lent in place (`view`), or being read."""

    hold: Hold
    slot: int  # its spare
    view: V | None = None
    read: Future[V | None] | None = None
    deadline: float = 0.0  # when its read is abandoned
    failed: str | None = None  # after a miss: the tier that failed it, if one did


class Lending(Generic[V]):
    """An iterator of `Loan`s in the order their reads land (see the module docstring), and a
    context manager that ends every loan. One thread: the borrower's."""

    def __init__(self, count: int, spares: MutableSequence[memoryview], *, in_order: bool,
                 lend: Callable[[int, Hold], V | None],
                 read: Callable[[int, Hold, memoryview], Future[V | None]],
                 timeout_s: float, late: Callable[[str], None],
                 until: float | None = None) -> None:
        """Args:
            count: chunks to lend (0 .. count-1).
            spares: the caller's chunk buffers, one per read in flight; one an abandoned read
                may still write into is replaced by a new buffer.
            in_order: lend in key order (else the first landed first).
            lend: chunk i lent where it lies, kept on the hold; None when no tier lends it.
            read: starts chunk i's read into a spare (the view, or None on a miss; the read
                names its tier on the hold).
            timeout_s: how long each read may take from its start.
            late: told the tier an abandoned read was waiting on.
            until: when the whole lending gives up (time.monotonic); None: never.

        Raises:
            ValueError: no spare buffer.
        """
        if not spares:
            raise ValueError("a lending needs at least one spare buffer")
        self._spares = spares
        self._in_order = in_order
        self._lend = lend
        self._read = read
        self._timeout_s = timeout_s
        self._late = late
        self._until = math.inf if until is None else until
        self._free = list(range(len(spares)))[::-1]  # spares no chunk holds
        self._next = 0  # the next chunk to start
        self._started: dict[int, _Started[V]] = {}
        self._out: dict[Hold, int | None] = {}  # loans not yet released: hold -> spare
        self._deferred: deque[tuple[Completion, Loan[V]]] = deque()  # release_after, oldest first
        self._closed = False
        self.stopped_at = count  # the first chunk not lent (a miss); count: none
        self.failed_tier: str | None = None  # the tier that failed the read at `stopped_at`
        self.expired = False  # it stopped at `until` (a read not landed by then, or unstarted)

    def __iter__(self) -> Lending[V]:
        return self

    def __next__(self) -> Loan[V]:
        """The next chunk landed. Waits for a read at most until its deadline, and, when the
        borrower holds every spare, for the oldest `release_after` loan.

        Raises:
            StopIteration: every chunk up to `stopped_at` was lent.
            RuntimeError: the borrower holds every spare and none is released after an event.
        """
        while not self._closed:
            self._start()
            if not self._started:
                if self._next >= self.stopped_at:
                    break
                self._make_room()
                continue
            i = self._pick()
            started = self._started.pop(i)
            view = started.view if started.read is None else self._land(started)
            if view is not None:
                slot = None if started.read is None else started.slot
                if slot is None:
                    self._free.append(started.slot)
                self._out[started.hold] = slot
                return Loan(i, view, started.hold, slot, self)
            self._stop(i, started)
        raise StopIteration

    def ready(self) -> bool:
        """Whether the next chunk to lend has landed (`__next__` returns it without waiting
        for a read); False also when none is started."""
        if self._in_order:
            return bool(self._started) and _landed(self._started[min(self._started)])
        return any(_landed(started) for started in self._started.values())

    def _start(self) -> None:
        """Start chunks in key order while a spare is free: those lent in place first, so
        that no read started with them takes (evicts) the slot of one of them."""
        if not self._free:
            while self._deferred and self._deferred[0][0].query():
                self._deferred.popleft()[1].release()
        reads: list[tuple[int, Hold, int]] = []
        while self._free and self._next < self.stopped_at:
            i, slot, hold = self._next, self._free.pop(), Hold()
            self._next += 1
            view = self._lend(i, hold)
            if view is not None:
                self._started[i] = _Started(hold, slot, view=view)
            else:
                reads.append((i, hold, slot))
        for n, (i, hold, slot) in enumerate(reads):
            now = time.monotonic()
            if now >= self._until:  # given up: chunk i and every one after it missed
                self.expired = True
                for _, later, spare in reads[n + 1:]:
                    self._drop(_Started(later, spare))
                self._stop(i, _Started(hold, slot))
                return
            read = self._read(i, hold, self._spares[slot])
            self._started[i] = _Started(hold, slot, read=read,
                                        deadline=min(now + self._timeout_s, self._until))

    def _make_room(self) -> None:
        """Every spare is lent: wait for the oldest loans released after an event."""
        while not self._free:
            if not self._deferred:
                raise RuntimeError("every spare buffer is lent: release a loan first")
            done, loan = self._deferred.popleft()
            done.synchronize()
            loan.release()

    def _pick(self) -> int:
        """The chunk to lend next: the first started (in order), else the first of those
        landed (or past their deadline), waiting for one if none has."""
        if self._in_order:
            return min(self._started)
        while True:
            now = time.monotonic()
            landed = [i for i, s in self._started.items()
                      if s.read is None or s.read.done() or now >= s.deadline]
            if landed:
                return min(landed)
            reads = [s.read for s in self._started.values() if s.read is not None]
            deadline = min(s.deadline for s in self._started.values())
            wait(reads, max(0.0, deadline - now), FIRST_COMPLETED)

    def _land(self, started: _Started[V]) -> V | None:
        """The read's view, waiting for it until its deadline; None on a miss (`failed`: the
        tier that failed it) or once abandoned."""
        assert started.read is not None
        try:
            view = started.read.result(timeout=max(0.0, started.deadline - time.monotonic()))
        except FutureTimeout:
            if started.read.done():  # the read itself raised it
                raise
            started.failed = tier = started.hold.tier
            started.hold.close()  # a late reserved slot is released by the read itself
            spare = self._spares[started.slot]
            self._spares[started.slot] = _replacement(self._spares, len(spare))
            if started.deadline >= self._until:  # the lending's deadline, not the read's
                self.expired = True
            elif tier is not None:
                self._late(tier)
            return None
        if view is None:
            started.failed = started.hold.tier
        return view

    def _stop(self, i: int, missed: _Started[V]) -> None:
        """Chunk i missed: lend nothing after it (reads past it are finished, unused)."""
        self.stopped_at, self.failed_tier = i, missed.failed
        self._drop(missed)
        for j in sorted(j for j in self._started if j > i):
            started = self._started.pop(j)
            if started.read is not None:
                self._land(started)
            self._drop(started)

    def _drop(self, started: _Started[V]) -> None:
        started.hold.close()
        self._free.append(started.slot)

    def _release(self, hold: Hold, slot: int | None) -> None:
        hold.close()
        if self._out.pop(hold, None) is not None and slot is not None:
            self._free.append(slot)

    @property
    def outstanding(self) -> int:
        """Loans not released yet (what the borrower holds: a `kvtier node status` shows
        each engine's). Any thread."""
        return len(self._out)

    def close(self) -> None:
        """End the lending: wait for the reads nobody took (to their deadlines), wait for
        the events loans are released after, release every loan. Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            for i in sorted(self._started):
                started = self._started.pop(i)
                if started.read is not None:
                    self._land(started)
                self._drop(started)
        finally:
            for done, _loan in self._deferred:
                if not done.query():
                    done.synchronize()
            self._deferred.clear()
            for hold in list(self._out):
                self._release(hold, self._out[hold])

    def __enter__(self) -> Lending[V]:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _landed(started: _Started[V]) -> bool:
    return started.read is None or started.read.done()
