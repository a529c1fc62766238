"""An engine's connection to `kvtier node` (`NodeClient`): one connection a thread, the node's
shared-memory slab mapped here (its chunks are lent and filled in place: node/nodestore.py's
`NodeStore`, the scheduler's lookups node/probe.py's `NodeProbe`), and what a call to a node
that fails costs.

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
end with it, but while copies into slots it reserved are in flight (node/inflight.py).

Primitives: `NodeClient`, `node_status`, `default_engine_name`, `engine_pid`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import mmap
import os
import secrets
import select
import socket
import threading
import time
import weakref
from typing import TypeVar

import numpy as np

from kvtier.core.layout import KVLayout
from kvtier.errors import NodeUnavailable
from kvtier.node.dma import register_for_dma, unregister_for_dma
from kvtier.node.hangups import unwatch_hangup, watch_hangup
from kvtier.node.inflight import WritesInFlight
from kvtier.node.protocol import (
    RAM_TIER,
    Answer,
    Hello,
    Refused,
    Reply,
    Request,
    Status,
    Welcome,
    receive_reply,
    send,
)
from kvtier.tiers.manifest import NamespaceInfo
from kvtier.tiers.prefault import prefault_in_background
from kvtier.tiers.shmslab import SlabReader

log = logging.getLogger(__name__)
TIER = RAM_TIER  # this engine's traffic with the node (its counters), and its misses
# After the node failed to answer, how long it is not asked (a miss at once meanwhile).
RETRY_S = 2.0
# How long a request the node answers through its tiers below RAM (a lookup of every tier, a
# measure of their links) may take: the caller is off the engine's critical path (the
# scheduler's locator gives up waiting after its own lookup_timeout_s).
SLOW_S = 30.0
R = TypeVar("R", bound=Reply)
# Drawn once a process: engines in pods that share the host's network (and so its hostname)
# may have one pid in their own pid namespaces, and host:pid alone named them as one engine
# (one status row, one engine_quota). A forked child differs by its pid.
_PROCESS_TAG = secrets.token_hex(2)


def default_engine_name() -> str:
    """This process as the node names an engine: host:pid:tag (tag: 4 hex digits drawn once
    a process)."""
    return f"{socket.gethostname()}:{os.getpid()}:{_PROCESS_TAG}"


def engine_pid(name: str) -> int | None:
    """The pid a `default_engine_name` names (in its own pid namespace); None for a name
    given otherwise."""
    parts = name.rsplit(":", 2)
    return int(parts[1]) if len(parts) == 3 and parts[1].isdigit() else None


class NodeClient:
    """Connections to one node for one layout: one per thread, each greeted with `Hello`;
    the slab of the node's current generation mapped once. Thread-safe."""

    def __init__(self, socket_path: str, layout: KVLayout, info: NamespaceInfo, *,
                 timeout_s: float = 1.0, retry_s: float = RETRY_S, slow_s: float = SLOW_S,
                 engine: str | None = None) -> None:
        """`engine`: who is asking, as the node's status and its `engine_quota` know this
        engine (default `default_engine_name()`: one engine process, whatever its threads).
        `slow_s`: the deadline of requests answered through the node's tiers below RAM
        (`call`)."""
        self.socket_path = socket_path
        self.timeout_s = timeout_s
        self.slow_s = slow_s
        self.retry_s = retry_s
        self._hello = Hello(dataclasses.asdict(layout), info.model, info.fingerprint,
                            info.weight_files,
                            engine or default_engine_name(), stamps=True)
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
        if ended_by_node(sock):
            self._broken(ConnectionResetError("the node ended the connection"), down=False)
            return False
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


def ended_by_node(sock: socket.socket) -> bool:
    """Whether the node has ended its side of `sock` (`POLLRDHUP`: a stalled connection's,
    shut for writing while the node reads and drops what comes: a commit sent on it would
    be taken for sent, its chunk reported stored; or the node stopped). One poll, no wait."""
    poller = select.poll()
    poller.register(sock, select.POLLRDHUP)
    return bool(poller.poll(0))
