"""An engine's side of `kvtier node`: `NodeStore`, the store the connector's worker and movers
use in node mode (`ChunkStore`), and `NodeProbe`, the scheduler's lookup through the node.

Chunks are lent and filled in place in the node's shared-memory slab, mapped here; only
offsets cross the socket, one round trip per load (`Borrow`, its reply streamed in parts as
the node's reads below RAM land: node/stream.py) and one per step's stores (`Reserve`, from
`plan_puts`); commits and releases are sent without waiting. A load of
chunks whose slots this engine knows (it stored them, or was lent them before) takes no round
trip: it holds the slots by their locks in the slab's file (`kvtier.tiers.shmslab.SlabReader`,
one syscall each on this thread, no wait for the node's thread to be scheduled), reads them
in place, having told the node (`Touch`, no reply awaited: recent for its policy); a slot
that holds another chunk by now is forgotten, and the load borrows as before.

Nothing the node does wrong hurts the engine: every call has a deadline (`timeout_s`); a node
that is down, stopped or answering nonsense is a miss (loads, lookups) or a dropped store,
counted and logged, and then not asked again on the engine's threads (they go on at full
speed, missing) until a watch thread finds it answering (`Status`, every `retry_s`): a stopped
or hung node costs one deadline, not one every `retry_s` on each of the engine's processes
(the scheduler's and the worker's took turns at it: a node stopped for 20 s held the engine
for 20 s). The next call after that reconnects, and a restarted node's new slab is mapped
again. The dead node's slab is let go on every thread as soon as the node answers as a new
generation (`_Slab`), whether the engine asks it something or idles (the node's hang-up of
its connections starts the watch: node/hangups.py): a restarted node on a /dev/shm with room
for one slab can create its own only then. Each thread has its own connection: its leases
end with it.

Primitives: `NodeClient`, `NodeStore`, `NodeProbe`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
import mmap
import os
import select
import socket
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping, MutableSequence, Sequence
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TypeVar

import numpy as np

from kvtier.core.keys import ChunkKey
from kvtier.core.layout import KVLayout
from kvtier.core.loans import Hold, Lending
from kvtier.core.retention import DEFAULT_META, ChunkMeta
from kvtier.core.store import ChunkView, PendingPut, StoreEvent, StoreStats
from kvtier.core.tier import Failure, LinkSpeed, TierCounters
from kvtier.errors import NodeUnavailable
from kvtier.node.dma import register_for_dma, unregister_for_dma
from kvtier.node.hangups import unwatch_hangup, watch_hangup
from kvtier.node.inflight import WritesInFlight
from kvtier.node.protocol import (
    BELOW_TIER,
    HELD,
    MAX_KEYS,
    RAM_TIER,
    SEND,
    SKIPPED,
    Answer,
    Borrow,
    Commit,
    Describe,
    Described,
    Flush,
    Found,
    Hello,
    Lent,
    Lookup,
    MeasureLinks,
    Meta,
    Refused,
    Release,
    Reply,
    Request,
    Reserve,
    Reserved,
    Retain,
    Status,
    Touch,
    Welcome,
    receive_reply,
    send,
)
from kvtier.node.stream import LentStream, PartFuture
from kvtier.tiers.eventfacts import ChunkInfo
from kvtier.tiers.manifest import NamespaceInfo
from kvtier.tiers.prefault import prefault_in_background
from kvtier.tiers.shmslab import SlabReader, SlotStamps

log = logging.getLogger(__name__)
TIER = RAM_TIER  # this engine's traffic with the node (its counters), and its misses
# After the node failed to answer, how long it is not asked (a miss at once meanwhile).
RETRY_S = 2.0
# How long a request the node answers through its tiers below RAM (a lookup of every tier, a
# measure of their links) may take: the caller is off the engine's critical path (the
# scheduler's locator gives up waiting after its own lookup_timeout_s).
SLOW_S = 30.0
# Slots remembered for reads in place (a key and an offset each: ~100 B); the oldest are
# forgotten first (their chunks then borrowed).
KNOWN_SLOTS = 1 << 16
R = TypeVar("R", bound=Reply)


class NodeClient:
    """Connections to one node for one layout: one per thread, each greeted with `Hello`;
    the slab of the node's current generation mapped once. Thread-safe."""

    def __init__(self, socket_path: str, layout: KVLayout, info: NamespaceInfo, *,
                 timeout_s: float = 1.0, retry_s: float = RETRY_S, slow_s: float = SLOW_S,
                 engine: str | None = None) -> None:
        """`engine`: who is asking, as the node's status and its `engine_quota` know this
        engine (default host:pid: one engine process, whatever its threads). `slow_s`: the
        deadline of requests answered through the node's tiers below RAM (`call`)."""
        self.socket_path = socket_path
        self.timeout_s = timeout_s
        self.slow_s = slow_s
        self.retry_s = retry_s
        self._hello = Hello(dataclasses.asdict(layout), info.model, info.fingerprint,
                            info.weight_files,
                            engine or f"{socket.gethostname()}:{os.getpid()}", stamps=True)
        self._local = threading.local()
        self._lock = threading.Lock()
        self._down = False  # not asked on the engine's threads until `_watch` sees it answer
        # Bumped when a connection breaks: every thread's older connection (to the same dead
        # node) is dropped at its next call, without another back-off of its own.
        self._epoch = 0
        self._slab: _Slab | None = None  # the node's current generation's, mapped
        self.welcome: Welcome | None = None
        self.dma_registered = False  # the slab's mapping registered with CUDA (node/dma.py)
        self._stop_prefault = threading.Event()  # the current mapping's (tiers/prefault.py)
        # Every thread's connection, for `close` (a thread's own is in `_local`): the
        # scheduler's lookups run on its thread and on its probe threads. Their slab readers
        # are their slab's (`_Slab.readers`). Each with the thread it is for: a thread's end
        # does not close them (`_forget_ended_threads` does).
        self._open: dict[socket.socket, threading.Thread] = {}
        self._closed = False  # `close` was called: nothing is asked of the node any more
        self._checking = False  # a hang-up's watch asks the node's status (`_hung_up`)
        self.failures = 0  # calls the node did not answer (each a miss or a dropped store)
        # The failure last logged, until a connection is welcomed: the same again is logged
        # at debug. An engine the node refuses (its layout past max_layouts, /dev/shm full)
        # is refused again after every watch, and logged a warning every retry_s before.
        self._reported: str | None = None
        # Copies in flight into slots each connection reserved (`start_writing`): such a
        # connection ended (a call timed out on it, `close`) is kept open until they are
        # done, else the node would free the slots under them (node/inflight.py).
        self._writes = WritesInFlight()
        self.parked = 0  # connections whose close waited for copies into their slots

    def call(self, request: Request, reply: type[R], *, slow: bool = False,
             extra_s: float = 0.0) -> R:
        """`request`'s reply, within `timeout_s` (plus `extra_s`: the time the node is given
        for its own work, a load's budget); or (`slow`) within `slow_s` for a request the
        node answers through its tiers below RAM (a remote store's round trips), whose
        lateness says nothing of the node: it drops only this thread's connection.

        Raises:
            NodeUnavailable: the node is down, stopped or restarting, refused, or was
                marked down and has not answered the watch since; or it did not answer in
                time.
        """
        deadline_s = self.slow_s if slow else self.timeout_s + extra_s
        for retry in (False, True):
            sock = self._connection()
            try:
                if deadline_s != self.timeout_s:
                    sock.settimeout(deadline_s)
                send(sock, request)
                answer = receive_reply(sock)
                if deadline_s != self.timeout_s:
                    sock.settimeout(self.timeout_s)
                break
            except (OSError, NodeUnavailable) as exc:
                # A connection the node closed (it restarted, or dropped us) is tried again
                # at once on a new one; a node that does not answer within the deadline
                # (stopped, overloaded) is not asked twice.
                timed_out = isinstance(exc.__cause__ or exc, TimeoutError)
                if timed_out and slow:
                    self.drop_own()  # its answer would come late on it
                    raise NodeUnavailable(f"no answer within {self.slow_s:g} s") from exc
                self._broken(exc, down=retry or timed_out)
                if retry or timed_out:
                    raise NodeUnavailable(str(exc)) from exc
        if isinstance(answer, Refused) or not isinstance(answer, reply):
            self._broken(RuntimeError(f"the node answered {answer!r}"))
            raise NodeUnavailable(f"the node answered {answer!r}")
        return answer

    def receive(self, reply: type[R], timeout_s: float) -> R | None:
        """The next reply on this thread's connection (a streamed reply's next part) if one
        starts within `timeout_s`, read within `timeout_s` of the connection; else None.

        Raises:
            NodeUnavailable: this thread has no connection; it broke, a reply did not end in
                time, or it is not a `reply` (the caller drops the connection: `drop_own`).
        """
        sock: socket.socket | None = getattr(self._local, "sock", None)
        if sock is None:
            raise NodeUnavailable("this thread's connection is gone")
        poller = select.poll()  # not select(): an engine's sockets may pass FD_SETSIZE
        try:
            poller.register(sock, select.POLLIN)
            if not poller.poll(max(0.0, timeout_s) * 1000):
                return None
        except (OSError, ValueError) as exc:  # closed meanwhile
            raise NodeUnavailable(str(exc)) from exc
        answer = receive_reply(sock)
        if not isinstance(answer, reply):
            raise NodeUnavailable(f"the node answered {answer!r}")
        return answer

    def tell(self, request: Request) -> bool:
        """Send a request that gets no reply (Commit, Release); a failure only marks the
        connection broken (its leases end with it on the node). False: not sent."""
        sock = getattr(self._local, "sock", None)
        if sock is None or self._local.epoch != self._epoch:
            return False  # the connection that holds the lease is gone: so is the lease
        try:
            send(sock, request)
        except OSError as exc:
            self._broken(exc, down=False)  # the next call finds out
            return False
        return True

    def post(self, request: Request) -> bool:
        """Send a request that gets no reply (Describe) on this thread's connection,
        connecting first if need be; False: not sent (the node is unavailable)."""
        try:
            sock = self._connection()
        except NodeUnavailable:
            return False
        try:
            send(sock, request)
        except OSError as exc:
            self._broken(exc, down=False)  # the next call finds out
            return False
        return True

    def welcomed(self) -> Welcome | None:
        """The node's welcome, connecting this thread first if need be; None: the node is
        unavailable (asked again once it answers the watch)."""
        try:
            self._connection()
        except NodeUnavailable:
            return None
        return self.welcome

    def view(self, offset: int = 0, nbytes: int | None = None) -> memoryview:
        """`nbytes` (None: all) of the slab from `offset` (of the generation this thread was
        welcomed by: offsets its connection was given; another thread may have mapped a newer
        one). The view keeps the mapping: a slab let go is unmapped once its last view is
        gone.

        Raises:
            NodeUnavailable: this thread's slab was let go (the node answered as a new
                generation since): its offsets mean nothing now.
        """
        slab: _Slab | None = getattr(self._local, "slab", None)
        data = None if slab is None else slab.data
        if data is None:
            raise NodeUnavailable("the slab of this thread's node generation was let go")
        return data[offset:None if nbytes is None else offset + nbytes].data

    def reader(self) -> tuple[str, SlabReader] | None:
        """This thread's reader of the slab it mapped last, with its generation (reads in
        place); None before this thread connected, or where the slab has no records to
        trust. A node that died since leaves its slab mapped and its chunks whole: they are
        still read in place (the engine serves its hits with no node). Once the node answers
        as a new generation (a restarted node), the old slab is let go (`_let_go`): this
        thread's mapping and connection are the old node's, dropped here (None: its next
        load borrows from the node now serving). The locks of its loans still out are kept
        until they are released."""
        slab: _Slab | None = getattr(self._local, "slab", None)
        if slab is None:
            return None
        if slab.data is None:  # let go: the node restarted
            self._local.reader = self._local.slab = None
            self.drop_own()  # the old node's connection: the next call connects to the new
            return None
        mine: tuple[_Slab, SlabReader | None] | None = getattr(self._local, "reader", None)
        if mine is None or mine[0] is not slab:
            if mine is not None and mine[1] is not None:
                self._close_reader(mine[0], mine[1])  # its loans out keep their locks
            mine = (slab, self._open_reader(slab))
            self._local.reader = mine
        return None if mine[1] is None else (slab.generation, mine[1])

    def _open_reader(self, slab: _Slab) -> SlabReader | None:
        """A reader of `slab` for this thread: the mapped file opened again (a new open file
        description: its locks this thread's own), never the name, which a restarted node
        reuses. None where it cannot be (the slab was let go meanwhile)."""
        with self._lock:
            data = slab.data  # None: let go, its file closed or about to be
            try:
                own = -1 if data is None or slab.fd < 0 else os.open(
                    f"/proc/self/fd/{slab.fd}", os.O_RDONLY | os.O_CLOEXEC)
            except OSError as exc:
                log.info("kvtier: the node's slab cannot be read in place (%s): loads borrow",
                         exc)
                own = -1
        if own < 0 or data is None:
            return None
        try:
            reader = SlabReader(own, data)
        except ValueError as exc:
            log.info("kvtier: the node's slab cannot be read in place (%s): loads borrow", exc)
            return None
        with self._lock:
            live = slab.data is not None  # not let go (nor closed) meanwhile
            if live:
                slab.readers[reader] = threading.current_thread()
        if not live:
            reader.close()
            return None
        return reader

    def _close_reader(self, slab: _Slab, reader: SlabReader) -> None:
        with self._lock:
            slab.readers.pop(reader, None)
        reader.close()

    def generation(self) -> str | None:
        """The node generation of this thread's connection; None: it has none, or its slab
        was let go. A lease or slot of another generation is gone: never filled, released
        or committed (the node after a restart reuses lease numbers and slab offsets for
        others' chunks)."""
        if getattr(self._local, "sock", None) is None:
            return None
        slab: _Slab | None = getattr(self._local, "slab", None)
        return None if slab is None or slab.data is None else slab.generation

    def _connection(self) -> socket.socket:
        sock: socket.socket | None = getattr(self._local, "sock", None)
        slab: _Slab | None = getattr(self._local, "slab", None)
        if sock is not None and self._local.epoch == self._epoch \
                and slab is not None and slab.data is not None:
            return sock
        if sock is not None:
            # Another thread found the node gone, or its slab was let go (a new generation
            # answers): so is this connection.
            self._forget(sock)
            self._local.sock = None
        if self._closed:
            raise NodeUnavailable("this engine's client of the node is closed")
        if self._down:
            raise NodeUnavailable("the node has not answered since it failed")
        self._forget_ended_threads()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout_s)
        try:
            sock.connect(self.socket_path)
            send(sock, self._hello)
            welcome = receive_reply(sock)
        except (OSError, NodeUnavailable) as exc:
            sock.close()
            self._mark_down(exc)
            raise NodeUnavailable(str(exc)) from exc
        if not isinstance(welcome, Welcome):
            sock.close()
            self._mark_down(RuntimeError(f"the node refused: {welcome!r}"))
            raise NodeUnavailable(f"the node refused: {welcome!r}")
        try:
            self._map(welcome)
        except OSError as exc:  # its slab gone, not shared with this container, not ours
            sock.close()
            failure = OSError(exc.errno, f"the node's RAM slab {welcome.shm_path} cannot be "
                                         f"mapped: {exc.strerror or exc}")
            self._mark_down(failure)
            raise NodeUnavailable(str(failure)) from exc
        with self._lock:
            closed = self._closed
            if not closed:
                self._open[sock] = threading.current_thread()
                # Told when the node hangs up on it, idle or not (node/hangups.py): a
                # restarted node's slab is then let go though this engine asks nothing.
                watch_hangup(sock.fileno(), self._hung_up)
        if closed:  # by another thread, meanwhile
            sock.close()
            raise NodeUnavailable("this engine's client of the node is closed")
        self._local.sock, self._local.epoch = sock, self._epoch
        self._reported = None  # welcomed: the next failure is news
        return sock

    def _forget_ended_threads(self) -> None:
        """Close the connections and slab readers of threads that ended: a thread's are its
        own (`_local`), and its end closed neither, so a caller whose threads come and go (a
        pool that replaces them) kept one connection a thread open, its fd here and on the
        node, its leases held there, until `close` (a leak soak: 100 threads, 100 more of
        each). Called as a thread connects: they are never more than the live threads'."""
        with self._lock:
            socks = [sock for sock, thread in self._open.items() if not thread.is_alive()]
            slab = self._slab
            readers = [] if slab is None else [
                reader for reader, thread in slab.readers.items() if not thread.is_alive()]
        for sock in socks:
            self._forget(sock)
        if slab is not None:
            for reader in readers:
                self._close_reader(slab, reader)

    def _forget(self, sock: socket.socket) -> None:
        """Close one of this client's connections, or, while copies into slots it reserved
        are in flight, leave it open and unused until they are done (`end_writing`)."""
        with self._lock:
            self._open.pop(sock, None)
            unwatch_hangup(sock.fileno())  # before its number is another file's
            kept = self._writes.park(sock)
            self.parked += kept
        if not kept:
            sock.close()

    def current_connection(self) -> socket.socket | None:
        """The calling thread's connection (what its Reserve's slots belong to); None: it
        has none."""
        sock: socket.socket | None = getattr(self._local, "sock", None)
        return sock

    def start_writing(self, connection: socket.socket | None, generation: str | None
                      ) -> bool:
        """Whether the calling thread may write the slots `connection` (its connection at
        their Reserve, of the node's `generation`) reserved: only while that is still its
        connection, not to be dropped, of a slab not let go; `connection` is then kept open
        until `end_writing`, however it ends meanwhile (the node frees a connection's
        reserved slots when it ends: a copy into one after would overwrite another engine's
        chunk). False: the reservation is gone or going; nothing may be written."""
        if connection is None or self.current_connection() is not connection \
                or self._local.epoch != self._epoch or self.generation() != generation:
            return False
        with self._lock:
            if self._closed or connection not in self._open:
                return False
            self._writes.start(connection)
        return True

    def end_writing(self, connection: socket.socket) -> None:
        """A write `start_writing` allowed is done, or will never be (any thread, once no
        copy into the slot can still run); the last of a connection ended meanwhile closes it
        (the node frees its slots then)."""
        with self._lock:
            close = self._writes.end(connection)
        if close:
            connection.close()

    def _map(self, welcome: Welcome) -> None:
        """Map the slab of `welcome`'s generation (a restarted node's is a new file), and let
        the last generation's go."""
        with self._lock:
            if self._closed:  # by another thread, meanwhile: `_connection` refuses
                return
            if self._slab is not None and self._slab.generation == welcome.generation:
                self._local.slab = self._slab
                return
            fd = os.open(welcome.shm_path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
            try:  # the whole file: the slots, then their records (reads in place)
                mapping = mmap.mmap(fd, max(os.fstat(fd).st_size, welcome.shm_bytes),
                                    mmap.MAP_SHARED)
            except BaseException:
                os.close(fd)
                raise
            old = self._let_go()
            if old is not None:
                log.info("kvtier: node %r restarted (generation %s): its slab mapped again",
                         welcome.node, welcome.generation)
            registered = register_for_dma(mapping)  # a GPU engine's copies: DMA
            self.dma_registered = registered
            slab = _Slab(welcome.generation, mapping, fd, registered)
            # Its pages mapped in the background (a registered mapping's are): a first copy
            # into or out of each would fault (tiers/prefault.py). The old one's no more.
            self._stop_prefault = threading.Event()
            if not registered and slab.data is not None:
                prefault_in_background(slab.data, f"node {welcome.node!r}'s slab",
                                       self._stop_prefault)
            self._slab = self._local.slab = slab
            self.welcome = welcome
        if old is not None:
            old.close_files()

    def _let_go(self) -> _Slab | None:
        """Let the current slab go (under `_lock`): the node answers as another generation,
        or the client closes. No new view or reader of it starts (`view`, `reader`); its
        file is closed, and each thread's reader's once its loans out end (`close_files`, by
        the caller, outside the lock), and the mapping is unmapped once its last view is
        gone (a load still reading from it finishes first). Before, an engine kept a dead
        node's slab mapped, its pages allocated, until it restarted: on a /dev/shm with room
        for one slab, the restarted node could create none, and refused every engine."""
        slab, self._slab = self._slab, None
        if slab is not None:
            self._stop_prefault.set()
            slab.data = None
        return slab

    def drop_own(self) -> None:
        """Close this thread's connection only (its leases end on the node)."""
        sock = getattr(self._local, "sock", None)
        self._local.sock = None
        if sock is not None:
            self._forget(sock)

    def _broken(self, exc: BaseException, down: bool = True) -> None:
        """This thread's connection failed: closed (the node ends its leases), every other
        thread's connection of its epoch dropped at its next call, and (`down`) the node
        not asked again until it answers the watch."""
        self.drop_own()
        with self._lock:
            first = self._local.epoch == self._epoch
            if first:
                self._epoch += 1
        if first and down:  # a connection older than the break says nothing new
            self._mark_down(exc)

    def _mark_down(self, exc: BaseException) -> None:
        """The node failed a call: not asked on the engine's threads until the watch finds
        it answering (a closed client is not watched: it asks nothing any more)."""
        self.failures += 1
        with self._lock:
            first, self._down = not self._down and not self._closed, True
            again = self._reported == str(exc)
            self._reported = str(exc)
        if first:
            log.log(logging.DEBUG if again else logging.WARNING,
                    "kvtier: node at %s unavailable (%s): misses until it answers again "
                    "(asked every %.1f s, off the engine's threads)", self.socket_path, exc,
                    self.retry_s)
            threading.Thread(target=self._watch, args=(again,), name="kvtier-node-watch",
                             daemon=True).start()

    def _hung_up(self) -> None:
        """The node hung up one of this client's connections (on node/hangups.py's thread: it
        stopped or died, or dropped that one). Its status is asked off the engine's threads
        until it answers (`_watch_hangup`), and a new generation's answer lets the old slab go
        at once: an idle engine kept it mapped until its next request, and a restarted node
        on a /dev/shm with room for one slab refused every engine meanwhile. Not marked down:
        the engine's next call connects again at once, as before."""
        with self._lock:
            start = not (self._closed or self._down or self._checking)
            self._checking = self._checking or start
        if start:
            threading.Thread(target=_watch_hangup, args=(weakref.ref(self),),
                             name="kvtier-node-hangup", daemon=True).start()

    def _watch(self, again: bool = False) -> None:
        """Ask the node for its status every `retry_s` (each ask waits at most as long) until
        it answers; then the engine's threads ask it again. A node that answers but refuses
        this engine (its layout) fails their next call at once, and is watched again (`again`:
        the failure was the one logged before, and its answer is logged at debug too). A
        closed client asks nothing any more: its watch ends at its next tick."""
        while True:
            time.sleep(self.retry_s)
            if self._closed:
                return
            try:
                status = node_status(self.socket_path,
                                     timeout_s=max(self.timeout_s, self.retry_s))
            except NodeUnavailable:
                continue
            self._answers(status.get("generation"))
            log.log(logging.DEBUG if again else logging.INFO,
                    "kvtier: node at %s answers again", self.socket_path)
            return

    def _answers(self, generation: object) -> None:
        """The node answered the watch as `generation`: asked on the engine's threads again,
        and, another generation answering (the node restarted: the old one's slab is dead,
        no node serves it), the old slab let go now, before the engine's threads ask it
        again: a new node on a /dev/shm with room for one slab creates its slab (for their
        Hello) only once this engine stops holding the old one's pages."""
        with self._lock:
            self._down = False
            old = self._let_go() if self._slab is not None and isinstance(
                generation, str) and generation != self._slab.generation else None
        if old is not None:
            old.close_files()
            log.info("kvtier: node at %s restarted (generation %s): the slab of "
                     "generation %s let go", self.socket_path, generation, old.generation)

    def close(self) -> None:
        """End every thread's connection (the node ends their leases and forgets them: its
        status no longer counts this engine's), close the slab readers (each once its loans
        still out end) and the slab's file, and stop mapping its pages; the mapping itself is
        unmapped once no view of it is left. Nothing is asked of the node after: a call
        raises NodeUnavailable. A second close does nothing. Any thread."""
        with self._lock:
            self._closed = True
            self._epoch += 1  # every thread's connection is dropped at its next call
            socks, self._open = list(self._open), {}
            for sock in socks:
                unwatch_hangup(sock.fileno())
            kept = {sock for sock in socks if self._writes.park(sock)}  # copies in flight
            self.parked += len(kept)
            slab = self._let_go()
        for sock in (s for s in socks if s not in kept):
            # shutdown wakes a thread waiting in recv on it (close alone does not)
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()
        if slab is not None:
            slab.close_files()
        self._local.sock = self._local.slab = self._local.reader = None


def _watch_hangup(ref: weakref.ref[NodeClient]) -> None:
    """After a hang-up: ask the node's status every `retry_s` until it answers (`_answers`),
    or its client is closed or gone (held weakly: a client no one holds, as a test's, is not
    kept alive by this thread, which ends with it)."""
    while True:
        client = ref()
        if client is None or client._closed:
            return
        retry_s, timeout_s, path = client.retry_s, client.timeout_s, client.socket_path
        del client
        time.sleep(retry_s)
        try:
            status = node_status(path, timeout_s=max(timeout_s, retry_s))
        except NodeUnavailable:
            continue
        client = ref()
        if client is None:
            return
        try:
            if not client._closed:
                client._answers(status.get("generation"))
        finally:
            client._checking = False
        return


class _Slab:
    """One node generation's slab as a client maps it: its pages (`data`, None once let go),
    the file (open: each thread's reader opens it again, `/proc/self/fd`) and the threads'
    readers of it. Every view of the slab is a slice of `data`, so the mapping lives as long
    as the last of them (a load reading from it when it is let go finishes): once let go, it
    is unmapped when its last view is gone, and a registration for DMA ended just before."""

    def __init__(self, generation: str, mapping: mmap.mmap, fd: int, registered: bool) -> None:
        self.generation = generation
        data = np.frombuffer(mapping, dtype=np.uint8)
        self.data: np.ndarray | None = data
        self.fd = fd
        self.readers: dict[SlabReader, threading.Thread] = {}  # each with its thread
        if registered:
            # Called when `data` (and so every view) is gone, before the mapping's own end
            # (it holds the mapping until then): CUDA must not keep pages no longer mapped.
            weakref.finalize(data, unregister_for_dma, mapping).atexit = False

    def close_files(self) -> None:
        """Close the slab's file and its readers' (each once its loans still out end)."""
        readers, self.readers = list(self.readers), {}
        for reader in readers:
            reader.close()
        fd, self.fd = self.fd, -1
        if fd >= 0:
            os.close(fd)


class _NodeLending(Lending[ChunkView]):
    """A `Lending` of chunks in the node's slab; `end` (once, when it closes) releases the
    node's lease or the slots' locks."""

    def __init__(self, end: Callable[[], None], *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self._end: Callable[[], None] | None = end

    def close(self) -> None:
        try:
            super().close()
        finally:
            end, self._end = self._end, None
            if end is not None:
                end()


@dataclass(slots=True)
class _Planned:
    lease: int
    index: int
    offset: int  # or HELD / SKIPPED / SEND
    generation: str | None  # of the node that reserved it (a restarted node's is gone)
    connection: socket.socket | None  # that reserved it: its slots end with it
    last: bool = False  # the reservation's last slot: its commit is waited for

    @property
    def is_open(self) -> bool:
        """Whether it waits for a commit: a slot to fill, or bytes to send."""
        return self.offset >= 0 or self.offset == SEND


class NodeStore:
    """kvtier's store in node mode (`integrations.vllm.worker.chunkstore.ChunkStore`): every
    tier is the node's. Thread-safe; `lend_as_landed` and stores per thread as the movers
    use them."""

    def __init__(self, client: NodeClient, chunk_bytes: int) -> None:
        self._client = client
        self._chunk_bytes = chunk_bytes
        self._counters = TierCounters(TIER, 0)
        # The chunks the node read from its tiers below RAM for this engine's loads (and the
        # stores RAM had no slot for, sent for those tiers), as the engine's tier
        # `node-below`: `node` counts what came from the node's RAM, and every miss.
        self._below = TierCounters(BELOW_TIER, 0)
        # Calls to the node that failed, by reason (`Failure` value): the `node` tier's
        # `tier_failures` on the engine's /metrics, as the store counts an in-process tier's.
        self._failures: dict[str, int] = {}
        self._failures_lock = threading.Lock()
        self._planned: dict[ChunkKey, _Planned] = {}
        self._planned_lock = threading.Lock()
        # Chunk -> (node generation, slab offset) where this engine stored it or was lent it
        # (reads in place); a slot that holds another chunk by now is forgotten when tried.
        self._slots: OrderedDict[ChunkKey, tuple[str, int]] = OrderedDict()
        self._slots_lock = threading.Lock()
        # Copies of lent chunks whose slot the node had written again by the time the copy
        # was done (a lending taken back: this engine was frozen past the node's
        # lease_timeout_s): failed loads, each recomputed. Logged at the first.
        self.reused_copies = 0

    # -- loads ------------------------------------------------------------------------------
    def lend_as_landed(self, keys: Sequence[ChunkKey], spares: MutableSequence[memoryview],
                       metas: Sequence[ChunkMeta] = (), *, in_order: bool = False,
                       until: float | None = None) -> Lending[ChunkView]:
        """The chunks the node lends, in key order until its first miss (a node unavailable:
        a miss at the first chunk, charged to the tier "node"): one streamed Borrow, each
        chunk lent as soon as its part of the reply comes (node/stream.py). `until`
        (time.monotonic): the node abandons its reads below RAM not landed by then."""
        metas = list(metas) or [DEFAULT_META] * len(keys)
        if len(metas) != len(keys):
            raise ValueError(f"{len(metas)} metas for {len(keys)} keys")
        in_place = self._read_in_place(keys, spares, in_order)
        if in_place is not None:
            return in_place
        start = time.perf_counter()
        budget = None if until is None else max(0.0, until - time.monotonic())
        try:
            # The node abandons its reads below RAM at the budget: it answers by then. The
            # chunks past MAX_KEYS (a node refuses more) are never lent: misses.
            first = self._client.call(Borrow(list(keys[:MAX_KEYS]),
                                             [Meta.of(m) for m in metas[:MAX_KEYS]], budget,
                                             stream=True), Lent, extra_s=budget or 0.0)
        except NodeUnavailable as exc:
            self._failed(exc)
            first, unavailable = Lent(0, [], [], None), True
        else:
            unavailable = False
        generation = self._client.generation()
        try:  # the whole slab, of the generation that lends: kept until the load ends
            slab = None if unavailable else self._client.view()
        except NodeUnavailable as exc:  # let go since the reply (the node restarted)
            self._client.drop_own()  # the lease ends with the connection
            self._failed(exc)
            first, unavailable, slab = Lent(0, [], [], None), True, None
        deadline_s = self._client.timeout_s + (budget or 0.0)

        stamps: list[SlotStamps | None] = []  # the slab's, read once a part carries stamps

        def views_of(part: Lent, first_index: int) -> list[ChunkView]:
            sent = iter(part.data)  # the chunks at SEND offsets: RAM had no slot for them

            def chunk(offset: int) -> memoryview:
                if offset == SEND:
                    return memoryview(next(sent))
                assert slab is not None  # a part came: the borrow was answered
                return slab[offset:offset + self._chunk_bytes]

            if part.stamps and not stamps and slab is not None:
                stamps.append(self._stamps_of(slab))
            marks = part.stamps if len(part.stamps) == len(part.offsets) \
                else [-1] * len(part.offsets)
            views = [ChunkView(chunk(offset).toreadonly(), self._engine_tier(tier),
                               self._unchanged(stamps[0], keys[first_index + n], offset, mark)
                               if stamps and offset >= 0 and mark >= 0 else None)
                     for n, (offset, tier, mark) in enumerate(zip(part.offsets, part.tiers,
                                                                  marks))]
            if generation is not None:
                self._know([(key, generation, offset) for key, offset
                            in zip(keys[first_index:], part.offsets) if offset >= 0])
            below = sum(view.tier == BELOW_TIER for view in views)
            self._counters.add(hits=len(views) - below,
                               bytes_read=(len(views) - below) * self._chunk_bytes)
            self._below.add(hits=below, bytes_read=below * self._chunk_bytes)
            return views

        stream = LentStream(first, views_of,
                            lambda timeout_s: self._client.receive(Lent, timeout_s),
                            self._engine_tier, deadline_s)
        if unavailable:
            stream.failed_tier = RAM_TIER  # the node: a miss at the first chunk

        def release() -> None:
            # The load's time, shared by its chunks' tiers (one reply: not timed apart).
            seconds = (stream.ended_at or time.perf_counter()) - start
            below = sum(view.tier == BELOW_TIER for view in stream.views)
            below_s = seconds * below / len(stream.views) if stream.views else 0.0
            self._counters.add(misses=int(len(stream.views) < len(keys)),
                               read_s=seconds - below_s)
            self._below.add(read_s=below_s)
            if stream.broken:  # the connection failed mid-stream (the node went away)
                self._count_failure(Failure.UNAVAILABLE)
            if not stream.ended and not stream.finish(self._client.timeout_s):
                self._client.drop_own()  # a late part must not answer the next request;
                return  # the lease ends with the connection
            if stream.lease and self._client.generation() == generation:
                self._client.tell(Release(stream.lease))

        # Each chunk not in the first part waits for its part as long as the whole reply
        # could take (the client's timeout and the load's budget, which the node uses).
        return _NodeLending(release, len(keys), spares, in_order=True,
                            lend=lambda i, _hold: stream.views[i] if i < len(stream.views)
                            else None,
                            read=lambda i, hold, _spare: PartFuture(stream, i, hold),
                            timeout_s=deadline_s, late=lambda _tier: None)

    @staticmethod
    def _stamps_of(slab: memoryview) -> SlotStamps | None:
        """The stamps of `slab` (the whole file, as mapped); None for a slab without them."""
        try:
            return SlotStamps(np.frombuffer(slab, dtype=np.uint8))
        except ValueError:
            return None

    def _unchanged(self, stamps: SlotStamps | None, key: ChunkKey, offset: int, stamp: int
                   ) -> Callable[[], bool] | None:
        """A lent chunk's check after its copy (`ChunkView.unchanged`): whether its slot's
        stamp is still the one it was lent with. A slot written again since (the node took
        the lending back, this engine frozen past its lease_timeout_s, and gave the slot to
        another chunk) is counted and logged (the first time; then at debug), and the copy
        a failed load."""
        if stamps is None:
            return None

        def unchanged() -> bool:
            if stamps.unchanged(offset, stamp):
                return True
            self._counters.add(misses=1)
            with self._failures_lock:
                self.reused_copies += 1
                first = self.reused_copies == 1
            log.log(logging.WARNING if first else logging.DEBUG,
                    "kvtier: chunk %s: its slot in the node's slab was given to another chunk "
                    "during its copy (its lending taken back: this engine held it past the "
                    "node's lease_timeout_s); a failed load, recomputed", key.hex()[:16])
            return False

        return unchanged

    def _read_in_place(self, keys: Sequence[ChunkKey], spares: MutableSequence[memoryview],
                       in_order: bool) -> Lending[ChunkView] | None:
        """All of `keys` lent from slots this engine knows, each held by its lock (no
        round trip), or None (nothing held): one is not known, or its slot holds another
        chunk by now (forgotten), or this thread has mapped no slab yet."""
        mapped = self._client.reader()
        if mapped is None or not keys:
            return None
        generation, reader = mapped
        start = time.perf_counter()
        with self._slots_lock:
            known = [self._slots.get(key) for key in keys]
        held: list[int] = []
        for key, slot in zip(keys, known):
            index = None if slot is None or slot[0] != generation \
                else slot[1] // reader.slot_bytes
            if index is None or not reader.lock(index, key):
                for taken in held:
                    reader.unlock(taken)
                if slot is not None:
                    with self._slots_lock:
                        self._slots.pop(key, None)
                return None
            held.append(index)
        try:
            views = [ChunkView(self._client.view(index * reader.slot_bytes,
                                                 self._chunk_bytes).toreadonly(), RAM_TIER)
                     for index in held]
        except NodeUnavailable:  # the slab was let go meanwhile (the node restarted)
            for taken in held:
                reader.unlock(taken)
            return None
        # Recent for the node's policy now, as a borrow is when lent (no reply awaited): a
        # chunk being read is the last the node should pick to evict.
        self._client.tell(Touch(list(keys[:MAX_KEYS])))
        self._counters.add(hits=len(keys), bytes_read=len(keys) * self._chunk_bytes,
                           read_s=time.perf_counter() - start)

        def release() -> None:
            for index in held:
                reader.unlock(index)

        def never(_i: int, _hold: Hold, _spare: memoryview) -> Future[ChunkView | None]:
            raise AssertionError("every chunk is lent in place")

        return _NodeLending(release, len(keys), spares, in_order=in_order,
                            lend=lambda i, _hold: views[i], read=never,
                            timeout_s=self._client.timeout_s, late=lambda _tier: None)

    def _engine_tier(self, node_tier: str) -> str:
        """The engine's name of the node's tier `node_tier` (RAM_TIER or BELOW_TIER: what a
        load costs, for the load-or-recompute rule)."""
        welcome = self._client.welcome
        ram = welcome.tiers[0] if welcome is not None and welcome.tiers else None
        return RAM_TIER if ram is None or node_tier == ram else BELOW_TIER

    def measure_links(self) -> dict[str, LinkSpeed]:
        """The slowest link of the node's remote tiers (`LinkMeasuring`), as BELOW_TIER's:
        the load-or-recompute rule's prior for a load from below the node's RAM (empty: the
        node has none, or is unavailable). Blocking (the node measures them)."""
        try:
            links = self._client.call(MeasureLinks(), Answer, slow=True).value
        except NodeUnavailable:
            return {}
        speeds = [LinkSpeed(float(rtt), float(bps)) for rtt, bps in links.values()] \
            if isinstance(links, dict) else []
        if not speeds:
            return {}
        return {BELOW_TIER: max(speeds, key=lambda s: s.read_s(self._chunk_bytes))}

    def _know(self, slots: Sequence[tuple[ChunkKey, str, int]]) -> None:
        """Remember where chunks lie in the slab: (key, generation, offset)."""
        with self._slots_lock:
            for key, generation, offset in slots:
                self._slots[key] = (generation, offset)
                self._slots.move_to_end(key)
            while len(self._slots) > KNOWN_SLOTS:
                self._slots.popitem(last=False)

    @contextmanager
    def borrow(self, key: ChunkKey, spare: memoryview,
               meta: ChunkMeta = DEFAULT_META) -> Iterator[ChunkView | None]:
        with self.lend_as_landed([key], [spare], [meta]) as lending:
            loan = next(iter(lending), None)
            yield None if loan is None else loan.view

    def get_into(self, key: ChunkKey, out: memoryview,
                 meta: ChunkMeta = DEFAULT_META) -> str | None:
        with self.borrow(key, out, meta) as view:
            if view is None:
                return None
            out[:] = view.data
            return view.tier if view.copied_whole() else None

    def contains(self, key: ChunkKey) -> bool:
        try:
            return self._client.call(Lookup([key]), Found).held[0]
        except NodeUnavailable as exc:
            self._failed(exc)
            return False

    # -- stores -----------------------------------------------------------------------------
    def plan_puts(self, keys: Sequence[ChunkKey], metas: Sequence[ChunkMeta]) -> None:
        """Reserve slots for a step's stores in one round trip (`put_from` / `putting` of
        each key then fills its slot). Slots reserved before and never filled are given
        back."""
        with self._planned_lock:
            stale, self._planned = list(self._planned.values()), {}
        for planned in stale:
            if planned.is_open and planned.generation == self._client.generation():
                self._client.tell(Commit(planned.lease, planned.index, False))
        self._reserve(keys, metas)

    def _reserve(self, keys: Sequence[ChunkKey], metas: Sequence[ChunkMeta]) -> None:
        """Reserve a slot for each key (once: a key twice in a step is reserved for its first
        store, its second a round trip of its own; reserved twice, the first slot was never
        committed nor given back until the connection ended), beside those planned."""
        unique: dict[ChunkKey, ChunkMeta] = {}
        for key, meta in zip(keys, metas):
            unique.setdefault(key, meta)
        keys, metas = list(unique)[:MAX_KEYS], list(unique.values())[:MAX_KEYS]  # the rest:
        if not keys:  # a round trip each
            return
        try:
            reserved = self._client.call(Reserve(list(keys), [Meta.of(m) for m in metas]),
                                         Reserved)
        except NodeUnavailable as exc:
            self._failed(exc)
            return
        generation = self._client.generation()
        connection = self._client.current_connection()
        last = max((i for i, offset in enumerate(reserved.offsets)
                    if offset >= 0 or offset == SEND), default=-1)
        with self._planned_lock:
            for i, (key, offset) in enumerate(zip(keys, reserved.offsets)):
                self._planned[key] = _Planned(reserved.lease, i, offset, generation,
                                              connection, i == last)

    def _slot(self, key: ChunkKey, meta: ChunkMeta) -> _Planned | None:
        with self._planned_lock:
            planned = self._planned.pop(key, None)
        if planned is None:  # not planned: a round trip of its own; the step's others stay
            self._reserve([key], [meta])
            with self._planned_lock:
                planned = self._planned.pop(key, None)
        return planned

    def put_from(self, key: ChunkKey, fill: Callable[[memoryview], None],
                 spare: memoryview, meta: ChunkMeta = DEFAULT_META) -> bool:
        with self.putting(key, spare, meta) as put:
            if put.data is not None:
                fill(put.data)
        return put.stored

    @contextmanager
    def putting(self, key: ChunkKey, spare: memoryview,
                meta: ChunkMeta = DEFAULT_META) -> Iterator[PendingPut]:
        """The chunk's slot in the node's slab to fill (`data`; None: held already, or no
        slot); committed when the block ends, given back if it raises or is cancelled.
        Where the node's RAM has no slot but a tier below it takes the chunk (SEND), `data`
        is `spare`, sent with the commit (not `stored`: not in RAM, as in process)."""
        start = time.perf_counter()
        planned = self._slot(key, meta)
        if planned is not None and planned.is_open and not self._client.start_writing(
                planned.connection, planned.generation):
            # Its connection ended, or is to be dropped (the node frees its slots), or the
            # node restarted since: the slot may be someone else's.
            planned = None
        if planned is None or not planned.is_open:
            held = planned is not None and planned.offset == HELD
            if (planned is not None and planned.offset == SKIPPED) or planned is None:
                self._counters.add(dropped_writes=1)
            yield PendingPut(None, in_place=False, stored=held)
            return
        assert planned.connection is not None  # start_writing said so
        try:  # the connection is kept open until nothing can write the slot any more
            yield from self._fill(key, planned, spare, start)
        finally:
            self._client.end_writing(planned.connection)

    def _fill(self, key: ChunkKey, planned: _Planned, spare: memoryview, start: float
              ) -> Iterator[PendingPut]:
        """`putting`'s block for a slot (or SEND) reserved on a connection kept open."""
        sent = planned.offset == SEND
        try:
            put = PendingPut(spare, in_place=False) if sent else \
                PendingPut(self._client.view(planned.offset, self._chunk_bytes), in_place=True)
        except NodeUnavailable:  # the slab was let go since the check (the node restarted)
            self._counters.add(dropped_writes=1)
            yield PendingPut(None, in_place=False, stored=False)
            return
        filled = False
        try:
            yield put
            filled = not put.cancelled
        finally:
            data = bytes(spare[:self._chunk_bytes]) if sent and filled else None
            commit = Commit(planned.lease, planned.index, filled, reply=planned.last,
                            data=data)
            if not planned.last:
                # Not sent (the node died since the step's Reserve): never stored. It was
                # counted stored, and put_from said True, for a chunk the node never had.
                if not self._client.tell(commit) and filled:
                    self._count_failure(Failure.UNAVAILABLE)
                    filled = False
            else:  # the step's last: every commit before it is done when it is answered
                try:
                    applied = self._client.call(commit, Answer).value
                except NodeUnavailable as exc:
                    self._failed(exc)
                    filled = False  # maybe stored, maybe not: not reported stored
                else:
                    # False: the slot was not the connection's that sent it (the call's
                    # retry, on a new connection, to a node restarted since): not stored.
                    if applied is False and filled:
                        self._count_failure(Failure.UNAVAILABLE)
                        filled = False
        put.stored = filled and not sent
        if put.stored and planned.generation is not None:
            self._know([(key, planned.generation, planned.offset)])
        if filled:
            (self._below if sent else self._counters).add(
                puts=1, bytes_written=self._chunk_bytes, write_s=time.perf_counter() - start)

    def put(self, key: ChunkKey, data: memoryview, meta: ChunkMeta = DEFAULT_META) -> bool:
        def copy(slot: memoryview) -> None:
            slot[:] = data
        return self.put_from(key, copy, data, meta)

    # -- the rest of ChunkStore ---------------------------------------------------------------
    def retain(self, key: ChunkKey, meta: ChunkMeta) -> int:
        try:
            value = self._client.call(Retain(key, Meta.of(meta)), Answer).value
        except NodeUnavailable as exc:
            self._failed(exc)
            return 0
        return value if isinstance(value, int) else 0

    def retire(self) -> int:
        """Nothing: the node's chunks belong to every engine on it; a reset engine's new keys
        never find the old ones (its epoch), which age out of the node's tiers."""
        return 0

    def flush(self, timeout_s: float | None = None) -> bool:
        try:
            return self._client.call(Flush(timeout_s), Answer).value is True
        except NodeUnavailable as exc:
            self._failed(exc)
            return False

    def _failed(self, exc: NodeUnavailable) -> None:
        """Count a call the node failed: `timeout` where it did not answer within the
        deadline, `unavailable` otherwise (down, refused, restarting, or not asked while the
        watch waits for it to answer: the in-process store's open circuit breaker)."""
        cause: BaseException | None = exc
        while cause is not None and not isinstance(cause, TimeoutError):
            cause = cause.__cause__
        self._count_failure(Failure.TIMEOUT if cause is not None else Failure.UNAVAILABLE)

    def _count_failure(self, reason: Failure) -> None:
        with self._failures_lock:
            self._failures[reason.value] = self._failures.get(reason.value, 0) + 1

    def stats(self) -> StoreStats:
        """This engine's traffic with the node, as two tiers (the node's own tiers: its
        status, `kvtier node status`): "node", its RAM (and every miss), and "node-below",
        what the node read from its tiers below RAM and the stores sent for them; and its
        calls the node failed, by reason (a node down or stopped: `StoreStats.failures`, the
        engine's `tier_failures`)."""
        with self._failures_lock:
            failures = {TIER: dict(self._failures)} if self._failures else {}
        return StoreStats(tiers=(self._counters.snapshot(), self._below.snapshot()),
                          queued_writes=0, queue_drops={}, failures=failures)

    def take_events(self) -> list[StoreEvent]:
        return []  # the node announces its own tiers' chunks, once for every engine

    def close(self, flush_timeout_s: float | None = None) -> None:
        self._client.close()


class NodeProbe:
    """The scheduler's lookup through the node (`kvtier.core.tier.Probe`): a chunk counts when
    the node holds it for every layout (tensor-parallel rank). Two of them, as for in-process
    tiers: one of the node's RAM (`ram_only`: an index lookup, asked inline on the
    scheduler's thread) and, where the node has tiers below RAM, one of every tier (a remote
    store's round trips: asked off that thread, `blocking_ok` False). Each call is bounded by
    the client's deadline; a node down raises NodeUnavailable at once (the locator then
    answers from what this engine stored: chunks it still reads in place)."""

    def __init__(self, clients: Sequence[NodeClient], *, ram_only: bool = True) -> None:
        self._clients = list(clients)
        self._ram_only = ram_only
        self.blocking_ok = ram_only

    def below_ram(self) -> bool:
        """Whether the node has tiers below RAM; True when it cannot say now (it may have: it
        is asked again when back). Asked of the node's status, which opens no layout: a
        scheduler side replaced at vLLM's handshake, before any lookup, leaves no layout of
        the namespace it was built in on the node (a slab of the node's RAM tier each:
        tests/connector/test_handshake_rebuild.py)."""
        if not self._clients:
            return True
        client = self._clients[0]
        if client.welcome is not None:
            return len(client.welcome.tiers) != 1
        try:
            tiers = node_status(client.socket_path, client.timeout_s).get("tiers")
        except NodeUnavailable:
            return True
        if not isinstance(tiers, list):  # a node of an older kvtier: its welcome tells
            welcome = client.welcomed()
            return welcome is None or len(welcome.tiers) != 1
        return len(tiers) != 1

    def contains(self, key: ChunkKey) -> bool:
        return self.contains_many([key])[0]

    def contains_many(self, keys: Sequence[ChunkKey]) -> list[bool]:
        """Whether every layout's node holds each key; the keys past MAX_KEYS (a node
        refuses more) are not asked: misses."""
        found = [True] * min(len(keys), MAX_KEYS)
        for client in self._clients:
            held = client.call(Lookup(list(keys[:MAX_KEYS]), self._ram_only), Found,
                               slow=not self._ram_only).held
            found = [f and h for f, h in zip(found, held)]
        return found + [False] * (len(keys) - len(found))

    def close(self) -> None:
        """Close its clients (the scheduler's RAM and below-RAM probes share them: a second
        close does nothing): their connections end, and the node forgets them."""
        for client in self._clients:
            client.close()

    def publishes_events(self) -> bool:
        """Whether the node publishes KV events of its tiers (its welcome says so), and so
        wants each step's `describe`; a node unavailable: False (asked again later)."""
        welcome = self._clients[0].welcomed() if self._clients else None
        return welcome is not None and welcome.events

    def describe(self, chunks: Mapping[ChunkKey, ChunkInfo]) -> None:
        """Send the node the token ids of the chunks a step plans to store, no reply (one
        layout's connection: the node keeps them per model). Scheduler thread."""
        if chunks and self._clients:
            self._clients[0].post(Describe([
                Described(key, info.parent, info.token_ids, info.lora_name, info.cache_salt)
                for key, info in itertools.islice(chunks.items(), MAX_KEYS)]))


def node_status(socket_path: str, timeout_s: float = 5.0) -> dict[str, object]:
    """The node's status document (`kvtier node status`).

    Raises:
        NodeUnavailable: no node answers at `socket_path`.
    """
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout_s)
    try:
        sock.connect(socket_path)
        send(sock, Status())
        answer = receive_reply(sock)
    except OSError as exc:
        raise NodeUnavailable(str(exc)) from exc
    finally:
        sock.close()
    if not isinstance(answer, Answer) or not isinstance(answer.value, dict):
        raise NodeUnavailable(f"the node answered {answer!r}")
    return answer.value
