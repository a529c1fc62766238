"""The node's book of its engines' connections and what each holds: which engine a
connection is, whether it checks lent slots' stamps, its socket, its leases (chunks lent for
a load, slots reserved for stores) and, once the node closed it for a reply never read, its
quarantine. Apart from the server, which does what each request asks of the stores: here a
lease is entered and ended, with its connection, with a Release, past `lease_timeout_s` or
with a quarantine, each under one lock that no store is ever called under (a lease's end
releases its loans and gives back its slots after the lock is let go).

Primitives: `LeaseBook`, `Holdings`.
"""

from __future__ import annotations

import itertools
import logging
import socket
import threading
import time
from dataclasses import dataclass

from kvtier.core.loans import Lending
from kvtier.core.store import ChunkView
from kvtier.node.counters import NodeCounters
from kvtier.node.leases import Lease, Puts, chunks_held, end_lease, held_by, overdue
from kvtier.node.quarantine import Quarantine

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Holdings:
    """The book's part of the node's status, read under one hold of its lock."""

    engines: list[str]  # the engines of the open connections, sorted
    connections: int  # the open connections
    leases: int  # the leases not ended yet (those ending too: their slots are not free yet)
    held: dict[str, dict[str, int]]  # engine -> {"leases", "chunks"} (leases.held_by)
    # Engines whose connection was closed (a reply never read), by pid (0: not visible,
    # their leases kept until the node stops).
    quarantined: dict[str, int]


class LeaseBook:
    """A node's connections and leases, from a connection's opening to the end of the last
    lease it held. Thread-safe: each connection's thread, the node's `take_back_overdue`
    thread and its `shutdown` call it."""

    def __init__(self, lease_timeout_s: float, counters: NodeCounters) -> None:
        self.lease_timeout_s = lease_timeout_s
        self.counters = counters
        self._lock = threading.Lock()
        self._stopping = False  # `stop`: the node stops, its engines' leases end with it
        self._closed = threading.Event()  # `close`: `take_back_overdue` returns
        self._leases: dict[int, Lease] = {}
        # Leases taken out of `_leases` by whoever ends them (a Release, a connection's end,
        # the lease timeout: one of them ends each), until ended: still counted by
        # `holdings` (shown held until their slots are free), and their connection's spares
        # still theirs (`lending_open`).
        self._ending: dict[int, Lease] = {}
        self._lease_ids = itertools.count(1)
        self._connections: dict[int, str] = {}  # connection id -> engine
        # Connections whose engine checks lent slots' stamps after its copies (`Hello.stamps`):
        # only their lendings are taken back (`take_back_overdue`).
        self._checking: set[int] = set()
        self._sockets: dict[int, socket.socket] = {}  # connection id -> its socket
        # Connections closed for a reply their engine took nothing of within
        # lease_timeout_s (`stalled`), whose leases the engine may still write or copy: kept
        # until its process is gone (node/quarantine.py).
        self._quarantined: dict[int, Quarantine] = {}
        # Stalled connections whose thread awaits the engine's hang-up (`stalled` to
        # `hung_up`), quarantined or not (a quarantine that kept nothing ends with the
        # connection): shut by `shutdown`, else the thread and its socket outlive the node.
        self._awaiting: dict[int, socket.socket] = {}

    # -- the node's lifecycle ----------------------------------------------------------------
    def stop(self) -> None:
        """The node stops (`NodeServer.shutdown` has begun): from now on a connection's end
        ends none of its leases (their engines live: a slot one of them still copies from
        must not go to another's store meanwhile; the next node recovers the slab as its
        records say), no connection is quarantined and no lending taken back."""
        with self._lock:
            self._stopping = True

    def sockets(self) -> list[socket.socket]:
        """The sockets of the open connections, of the quarantined ones and of those
        awaiting their engine's hang-up (shut by `shutdown`: else their threads go on
        serving from closed stores, or reading a frozen engine's bytes past the node's end)."""
        with self._lock:
            return [*self._sockets.values(), *(q.sock for q in self._quarantined.values()),
                    *self._awaiting.values()]

    def close(self) -> None:
        """The node has stopped: the quarantines' watches are let go and
        `take_back_overdue` returns."""
        with self._lock:
            quarantined, self._quarantined = list(self._quarantined.values()), {}
        for quarantine in quarantined:
            quarantine.close()
        self._closed.set()

    def holdings(self) -> Holdings:
        """The status's engines, connections, leases, what each engine holds and the
        quarantined engines."""
        with self._lock:
            every = [*self._leases.values(), *self._ending.values()]
            holders = [(self._engine_name(lease.owner), lease.held) for lease in every]
            return Holdings(
                engines=sorted(set(self._connections.values())),
                connections=len(self._connections), leases=len(every),
                held=held_by(holders),
                quarantined={q.engine: q.pid for q in self._quarantined.values()})

    # -- a connection's lifecycle -------------------------------------------------------------
    def opened(self, owner: int, sock: socket.socket) -> None:
        """A connection accepted: its socket, shut by `shutdown` if still open then, and
        quarantined with its leases if a send of it gives up (`stalled`)."""
        with self._lock:
            self._sockets[owner] = sock

    def connected(self, owner: int, engine: str, stamps: bool) -> None:
        """Connection `owner` is `engine`'s; `stamps`: it checks lent slots' stamps after
        its copies (its lendings may be taken back: `take_back_overdue`)."""
        with self._lock:
            self._connections[owner] = engine
            if stamps:
                self._checking.add(owner)
            else:
                self._checking.discard(owner)

    def engine_of(self, owner: int) -> str | None:
        """Connection `owner`'s engine, as its Hello said (None: no Hello yet, or ended)."""
        with self._lock:
            return self._connections.get(owner)

    def disconnected(self, owner: int) -> None:
        """A connection ended (the engine closed it, exited or was killed): its leases end,
        logged naming the engine; not once the node stops (`stop`)."""
        with self._lock:
            engine = self._connections.pop(owner, None) or "an engine not said"
            checking = owner in self._checking
            self._checking.discard(owner)
            self._sockets.pop(owner, None)
            if self._stopping:
                return
            quarantined = owner in self._quarantined
            # A stalled engine's reserved slots, and the lendings of one that checks no
            # stamps, stay its own until its process is gone (`stalled`).
            mine = [lease for lease, entry in self._leases.items() if entry.owner == owner
                    and not (quarantined and (isinstance(entry.held, Puts) or not checking))]
            kept = quarantined and any(entry.owner == owner for lease, entry
                                       in self._leases.items() if lease not in mine)
            if quarantined and not kept:
                self._quarantined.pop(owner).close()
            held = {lease: chunks_held(self._leases[lease].held) for lease in mine}
        ended = self._end(mine, "disconnects_with_leases")  # counted while they end: a
        if ended:  # status that shows no lease shows their slots free
            log.info("kvtier node: a connection of %s ended holding %d lease(s) of %d "
                     "chunk(s) (closed, exited or killed); released", engine, len(ended),
                     sum(held[lease] for lease in ended))

    def stalled(self, owner: int) -> bool:
        """Connection `owner`'s engine took nothing of a reply within `lease_timeout_s`
        (frozen: SIGSTOP, a hung process): the connection is closed (its thread would
        otherwise stay in the send for as long as the engine stays frozen), and its leases
        that the engine may still write or copy when it wakes are quarantined until its
        process is gone or, for an engine that checks stamps, until it closes its end of the
        connection (`hung_up`); True: the caller awaits that hang-up."""
        with self._lock:  # one hold: a `shutdown` meanwhile shuts its socket too
            sock = self._sockets.get(owner)
            engine = self._engine_name(owner)
            checking = owner in self._checking
            if sock is None or self._stopping:
                return False
            quarantine = self._quarantined[owner] = Quarantine.of(engine, sock, checking)
            if checking:
                self._awaiting[owner] = sock
        self.counters.add("send_timeouts")
        until = ("it closes the connection or its process is gone" if checking else
                 "its process is gone" if quarantine.watched else
                 "the node stops (its process cannot be watched from here: another pid "
                 "namespace, or a kernel before 5.3)")
        log.warning("kvtier node: %s (pid %s) took nothing of a reply for %g s (frozen or "
                    "hung?): its connection closed; the slots it may still write are kept "
                    "until %s", engine, quarantine.pid or "not visible",
                    self.lease_timeout_s, until)
        return checking

    def hung_up(self, owner: int) -> None:
        """The engine of stalled connection `owner` closed its end (it exited, or closed the
        connection with no copy into its slots in flight): its quarantined leases end; not
        once the node stops (`shutdown` shut its socket: the engine may still write them,
        and the next node recovers the slab as its records say, as `disconnected`)."""
        with self._lock:
            self._awaiting.pop(owner, None)
        if not self._stopping:
            self._release_quarantined([owner], "closed its connection")

    # -- leases -------------------------------------------------------------------------------
    def lease(self, owner: int, held: Lending[ChunkView] | Puts) -> int:
        """Enter connection `owner`'s lease of `held`; its number (never reused)."""
        with self._lock:
            lease = next(self._lease_ids)
            self._leases[lease] = Lease(owner, held, time.monotonic())
            return lease

    def lending_open(self, owner: int) -> bool:
        """Whether a lending of connection `owner` is not ended yet."""
        with self._lock:
            return any(entry.owner == owner and not isinstance(entry.held, Puts)
                       for entry in (*self._leases.values(), *self._ending.values()))

    def puts_of(self, owner: int, lease: int) -> Puts | None:
        """The slots reserved by connection `owner`'s lease `lease` (None: no such lease of
        its: another connection's, one ended, a lease of a node before a restart, a
        lending)."""
        with self._lock:
            entry = self._leases.get(lease)
        if entry is None or entry.owner != owner or not isinstance(entry.held, Puts):
            return None
        return entry.held

    def committed(self, lease: int) -> None:
        """Every slot of reservation `lease` is committed or given back: nothing is left
        to end."""
        with self._lock:
            self._leases.pop(lease, None)

    def release(self, owner: int, lease: int) -> None:
        """End connection `owner`'s `lease` (another connection's is not its to end; one
        taken back meanwhile is ended already)."""
        with self._lock:
            entry = self._leases.get(lease)
            if entry is None or entry.owner != owner:
                return
        self._end([lease])

    def take_back_overdue(self) -> None:
        """Take back every lending held past `lease_timeout_s` (checked a few times a
        timeout, at most every second) by an engine that checks its slots' stamps (an older
        one's never: it would take another chunk's bytes for its own), until the node
        stops: an engine frozen or hung with its connection open pins their slots no
        longer. Its copies, if it wakes, find their slots' stamps changed where a slot was
        written again since (a failed load, recomputed: `Lent.stamps`). The node's own
        thread, which also ends the quarantines of engines whose process is gone."""
        timeout_s = self.lease_timeout_s
        while not self._closed.wait(min(1.0, timeout_s / 4)):
            self._release_quarantined()
            now = time.monotonic()
            with self._lock:
                if self._stopping:
                    return
                due = [lease for lease, entry in self._leases.items()
                       if entry.owner in self._checking and overdue(entry, now, timeout_s)]
                held = {lease: chunks_held(self._leases[lease].held) for lease in due}
            ended = self._end(due) if due else {}
            if not ended:
                continue
            chunks = sum(held[lease] for lease in ended)
            with self._lock:
                engines = sorted({self._connections.get(entry.owner, "an engine not said")
                                  for entry in ended.values()})
            self.counters.add("leases_expired", len(ended))
            self.counters.add("expired_chunks", chunks)
            log.warning("kvtier node: %d lending(s) of %d chunk(s) held past %g s taken back "
                        "from %s (frozen or hung?): their slots may be reused; if it wakes, "
                        "its copies of reused slots are failed loads", len(ended), chunks,
                        timeout_s, ", ".join(engines))

    def _end(self, leases: list[int], counted: str | None = None) -> dict[int, Lease]:
        """End `leases` (those still held: another thread may have taken one first); those
        this call ended. Ended, then uncounted, and `counted` added to at once where
        one was ended: a status that shows no lease shows its slots free and its counter
        added to."""
        with self._lock:
            mine = {lease: self._leases.pop(lease) for lease in leases if lease in self._leases}
            self._ending.update(mine)
        try:
            for entry in mine.values():
                end_lease(entry.held)
        finally:
            with self._lock:
                for lease in mine:
                    self._ending.pop(lease, None)
                if mine and counted is not None:
                    self.counters.add(counted)
        return mine

    def _release_quarantined(self, owners: list[int] | None = None,
                             why: str = "process ended") -> None:
        """End the quarantined leases of `owners` (None: of the engines whose process is
        gone: the node's own thread)."""
        with self._lock:
            if owners is None:
                owners = [owner for owner, q in self._quarantined.items() if q.gone()]
            owners = [owner for owner in owners if owner in self._quarantined]
            ended = [self._quarantined.pop(owner) for owner in owners]
            leases = [lease for lease, entry in self._leases.items() if entry.owner in owners]
        for quarantine in ended:
            quarantine.close()
        self._end(leases)
        if ended:
            self.counters.add("quarantines_ended", len(ended))
            log.info("kvtier node: %s: %s; the %d lease(s) kept since its connection was "
                     "closed freed", ", ".join(q.engine for q in ended), why, len(leases))

    def _engine_name(self, owner: int) -> str:
        """Connection `owner`'s engine, as the status and the log name it (under `_lock`)."""
        quarantined = self._quarantined.get(owner)
        return quarantined.engine if quarantined is not None else self._connections.get(
            owner, "an engine not said")
