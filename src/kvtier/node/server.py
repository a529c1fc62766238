"""`kvtier node`: one cache per node, shared by its engines, outliving their restarts.

The node owns the tier stack (RAM, disk, shared, redis, s3: a `TieredStore` per KV layout its
engines bring, built from the node's config), its index, eviction and write-behind. The RAM
tier's slab lives in named shared memory (`MemoryTierConfig.shared_memory`): engines map it
and copy blocks straight into and out of its slots, so a RAM hit through the node costs the
copies of an in-process hit plus one control round trip per request.

Each engine thread holds one connection (a Unix stream socket, mode 0660: the node's group);
a connection's leases (chunks lent for a load, slots reserved for stores) end with it, so an
engine killed mid-load or mid-store leaks nothing; a load's lease ends too once held past
`NodeConfig.lease_timeout_s` (an engine frozen or hung), each lent slot's stamp telling the
engine, if it wakes, whether the slot was written again under its copy. Each connection is
served on a thread of its own: a slow tier read for one engine holds up no other engine; a
reply a frozen engine takes nothing of for `lease_timeout_s` is given up and its connection
closed, what the engine may still write kept until its process is gone (quarantine.py).

With an events endpoint (`NodeConfig.events_endpoint`), the node publishes its tiers' KV
events for cache-aware routers, once for all its engines (events.py).

Its parts: config.py (`NodeConfig`), counters.py, hostfiles.py (its name's lock, its socket's
file), layouts.py (the layouts it serves, each built at its first engine's Hello: its tiers
opened, started, recovered), leasebook.py (its engines' connections and their leases:
entered, ended, taken back, quarantined), leases.py (what a lease holds), quarantine.py (a
frozen engine's leases, kept past its connection), refusals.py (why an engine was refused,
logged), connection.py (the socket and a connection's requests); here, the node's start and
stop, its status, and what each request does to its stores.

Primitives: `NodeServer`, `running_node`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import secrets
import socket
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import TimeoutError as FutureTimeout
from pathlib import Path
from typing import Any

from kvtier.core.keys import ChunkKey
from kvtier.core.stall import CallSlots
from kvtier.node.config import NodeConfig
from kvtier.node.connection import ConnectionHandler, NodeSocketServer, send_timeout
from kvtier.node.counters import NodeCounters
from kvtier.node.events import NodeEvents
from kvtier.node.hostfiles import clear_stale_socket, hold_name, let_go_of_name
from kvtier.node.latency import Latencies
from kvtier.node.layouts import ServedLayout, ServedLayouts
from kvtier.node.leasebook import LeaseBook
from kvtier.node.leases import Puts, end_lease, sendable, spare_buffers
from kvtier.node.protocol import (
    HELD,
    MAX_FRAME,
    SEND,
    SKIPPED,
    Borrow,
    Commit,
    Describe,
    Hello,
    Lent,
    Refused,
    Reserve,
    Reserved,
)

log = logging.getLogger(__name__)
# What a Reserve may spend asking the tiers below RAM whether they hold the chunks RAM has no
# slot for (an index lookup and a stat a disk tier, a batch a remote one); past it they are
# sent, as without the question: a tier below RAM gone slow must not make the engine's
# store call (its deadline: lookup_timeout_s, 1 s by default) wait for its read timeout.
HELD_BELOW_BUDGET_S = 0.1
# Those questions in flight at once (`CallSlots`): one a tier below RAM never answers keeps
# its thread until it does, and a store asked while all are held is not asked about (its
# chunks stay SENDs; counted: `held_below_skipped`).
HELD_BELOW_THREADS = 4


class NodeServer:
    """The node: serves `NodeConfig.socket_path` until `shutdown`. Thread-safe."""

    def __init__(self, config: NodeConfig) -> None:
        """Raises:
            OSError: the socket cannot be bound (a live node there: EADDRINUSE; a file that
                is not a socket: EEXIST), nor the events endpoint (events.py); a running
                node has this node's name (EBUSY: their slabs would be one).
        """
        self.config = config
        self.generation = secrets.token_hex(8)
        self._closing = False  # `shutdown` has begun
        self._closed = threading.Event()  # set when `shutdown` has closed everything
        self.counters = NodeCounters()
        self.book = LeaseBook(config.lease_timeout_s, self.counters)  # connections, leases
        self.borrow_seconds = Latencies()  # per source: RAM alone, or a tier below it
        self._held_below_calls = CallSlots(HELD_BELOW_THREADS, "kvtier-node-held-below")
        self._name_lock: int | None = hold_name(config.name)
        self.events: NodeEvents | None = None
        try:
            if config.events_endpoint is not None:
                self.events = NodeEvents(config.events_endpoint, config.name,
                                         {t.tier_name: t.kind for t in config.store.tiers},
                                         self.counters.add, block_size=config.event_block_size)
            clear_stale_socket(config.socket_path)
            self._server = _listen(config.socket_path)
        except BaseException:
            if self.events is not None:
                self.events.close()
            let_go_of_name(config.name, self._name_lock)
            self._name_lock = None
            raise
        self.layouts = ServedLayouts(config, self.generation, self.events, self.counters)
        self._server.node = self
        os.chmod(config.socket_path, 0o660)  # the node's group: its engines
        bound = config.socket_path.stat()
        self._socket_file = (bound.st_dev, bound.st_ino)  # removed at the end if still ours
        threading.Thread(target=self.book.take_back_overdue, name="kvtier-node-leases",
                         daemon=True).start()

    def serve_forever(self) -> None:
        """Serve until `shutdown` (from another thread: a signal's handler) has finished."""
        log.info("kvtier node %r: listening on %s (generation %s)", self.config.name,
                 self.config.socket_path, self.generation)
        self._server.serve_forever(poll_interval=0.2)
        # Returning earlier let `kvtier node serve` exit on SIGTERM before the stores were
        # closed: the socket and the /dev/shm slab were left behind, queued writes lost
        # (tests/node/test_node_down.py).
        self._closed.wait()

    def shutdown(self) -> None:
        """Stop serving, end every engine's connection (their leases with them; the engines
        miss, then find the next node), close every store (writes behind RAM are flushed)
        and remove the socket and the shared memory."""
        try:
            self._closing = True
            self.layouts.stop()
            self.book.stop()
            self._server.shutdown()
            self._server.server_close()
            layouts = self.layouts.take_all()
            # Else their threads go on serving from closed stores.
            for sock in self.book.sockets():
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
            deadline = time.monotonic() + self.config.stop_flush_s
            for layout in layouts:
                layout.store.close(max(0.0, deadline - time.monotonic()))
            if self.events is not None:
                self.events.close()  # after the stores: what their closing stored goes out
            with contextlib.suppress(FileNotFoundError):
                found = self.config.socket_path.stat()
                if (found.st_dev, found.st_ino) == self._socket_file:  # not a successor's
                    self.config.socket_path.unlink()
        finally:
            self.book.close()
            self._held_below_calls.close()
            if self._name_lock is not None:  # a second shutdown: the name is another's now
                let_go_of_name(self.config.name, self._name_lock)
                self._name_lock = None
            self._closed.set()

    @property
    def closing(self) -> bool:
        """Whether `shutdown` has begun (no request is answered from then on)."""
        return self._closing

    def status(self) -> dict[str, Any]:
        """What `kvtier node status` prints: engines, leases (and what each engine holds),
        counters and each layout's tiers."""
        layouts = self.layouts.served()
        book = self.book.holdings()
        return {
            "node": self.config.name, "generation": self.generation,
            "socket": str(self.config.socket_path), "engines": book.engines,
            "events_endpoint": self.config.events_endpoint,
            "event_block_size": self.config.event_block_size,
            "tiers": [tier.tier_name for tier in self.config.store.tiers],
            "connections": book.connections, "leases": book.leases, "held": book.held,
            "quarantined": book.quarantined,
            "counters": self.counters.snapshot(),
            "borrow_seconds": self.borrow_seconds.snapshot(),
            "layouts": {digest: {
                "model": layout.model, "shm_path": layout.welcome.shm_path,
                "chunk_bytes": layout.welcome.chunk_bytes,
                "engines": layout.memory.engine_usage(),
                "tiers": [s.as_dict() for s in layout.store.stats().tiers]}
                for digest, layout in layouts.items()},
        }

    # -- requests ---------------------------------------------------------------------------
    def layout_for(self, hello: Hello) -> ServedLayout | Refused:
        """The store of the engine's layout, built at its first engine's hello
        (`ServedLayouts.layout_for`)."""
        return self.layouts.layout_for(hello)

    def borrow(self, owner: int, layout: ServedLayout, request: Borrow, spares: list[memoryview],
               part: Callable[[Lent], None] | None = None) -> Lent:
        """Lend the request's chunks in order until the first miss, each in the RAM slab
        (a chunk below RAM is promoted by its read); a chunk RAM cannot take (read into a
        spare, which the engine cannot see) goes in the reply's `data` (SEND), up to half
        a frame's bound, where the run ends. `part` (a streamed Borrow): sent each part of the
        reply but the last (returned) as soon as the next chunk has not landed yet."""
        keys = [ChunkKey(k) for k in request.keys]
        if self.book.lending_open(owner):
            # The connection's spares may still take an earlier lending's late reads (a run
            # cut at the frame's bound): this one reads into spares of its own.
            spares = []
        if len(spares) < len(keys):
            spares.extend(spare_buffers(len(keys) - len(spares), layout.memory.chunk_bytes))
        started = time.monotonic()
        until = None if request.budget_s is None else started + request.budget_s
        # The connection's own list: a spare a late read may still write into is replaced
        # in it by the lending (an abandoned read), never handed to the next Borrow.
        lending = layout.store.lend_as_landed(keys, spares,
                                              [m.chunk_meta() for m in request.metas],
                                              in_order=True, until=until)
        reply = Lent(0, [], [], None)  # the part not sent yet
        lent = sent = 0
        ram = layout.memory.name
        below = False  # a chunk came from below RAM
        with contextlib.ExitStack() as undo:
            undo.callback(lending.close)
            for loan in lending:
                offset = layout.memory.offset_of(loan.view.data)
                if offset is None:
                    if (sent + 1) * len(loan.view.data) > MAX_FRAME // 2:
                        break
                    reply.data.append(bytes(loan.view.data))  # the spare is the next Borrow's
                    sent += 1
                    offset = SEND
                reply.offsets.append(offset)
                stamp = None if offset == SEND else layout.memory.stamp_at(offset)
                reply.stamps.append(-1 if stamp is None else stamp)  # read while lent
                reply.tiers.append(loan.view.tier)
                below = below or loan.view.tier != ram
                lent += 1
                if part is not None and lent < lending.stopped_at and not lending.ready():
                    reply.more = True
                    try:
                        part(reply)
                    except BaseException:
                        # The engine has the earlier parts' offsets: the load is its lease,
                        # ended with its connection, or quarantined with it (a send timed
                        # out: an engine that checks no stamps may copy them when it wakes).
                        undo.pop_all()
                        self.book.lease(owner, lending)
                        raise
                    reply = Lent(0, [], [], None)
            failed = lending.failed_tier if lending.stopped_at == lent else None
            self.counters.add("borrows")
            self.counters.add("lent_chunks", lent - sent)
            self.counters.add("sent_chunks", sent)
            below = below or failed not in (None, ram)
            self.borrow_seconds.observe("below" if below else "ram",
                                        time.monotonic() - started)
            reply.failed_tier = failed
            if not lent:
                return reply
            undo.pop_all()  # kept until Release, or the connection's end
        reply.lease = self.book.lease(owner, lending)
        return reply

    def reserve(self, owner: int, layout: ServedLayout, request: Reserve, spare: memoryview
                ) -> Reserved:
        """A RAM slot per key for the engine to fill, or HELD (stored already, in RAM or,
        where RAM has no slot, below it: the pin and expiry of its meta applied), SEND (no
        RAM slot: declined, full, or the engine at its `engine_quota` with every chunk of its
        own pinned, but a tier below RAM takes the bytes the engine sends with its commit)
        or SKIPPED (no tier takes it). Each chunk is the engine's (`ChunkMeta.engine`: its
        quota's)."""
        offsets: list[int] = []
        puts = Puts([], 0, layout.memory.chunk_bytes)
        engine = self.book.engine_of(owner)
        try:
            for key, meta in zip(request.keys, request.metas):
                chunk_meta = dataclasses.replace(meta.chunk_meta(), engine=engine)
                block = layout.store.putting(ChunkKey(key), spare, chunk_meta)
                put = block.__enter__()
                offset = None if put.data is None or not put.in_place \
                    else layout.memory.offset_of(put.data)
                if offset is None and (put.data is None or not sendable(put)):
                    put.cancel()  # held, or no tier takes it (or its bytes cannot come)
                    block.__exit__(None, None, None)
                    offsets.append(HELD if put.stored else SKIPPED)
                    puts.blocks.append(None)
                    continue
                # A RAM slot, or (RAM has none) the lower tiers' bytes to come with the commit.
                offsets.append(SEND if offset is None else offset)
                puts.blocks.append((block, put))
                puts.open += 1
            self._held_below(layout, request, engine, offsets, puts)
        except BaseException:
            end_lease(puts)  # slots reserved before a tier raised are given back, not leaked
            raise
        self.counters.add("reserved_chunks", puts.open)
        return Reserved(self.book.lease(owner, puts) if puts.open else 0, offsets)

    def _held_below(self, layout: ServedLayout, request: Reserve, engine: str | None,
                    offsets: list[int], puts: Puts) -> None:
        """Turn each SEND whose chunk a tier below RAM holds already (or a write behind
        carries) into HELD, its `putting` ended: the engine ships no bytes the node has (the
        disk's put would drop them), and RAM, which has no slot, gets no promotion. One
        batch per remote tier (`contains_many`), only for the SENDs: rare, RAM gives most
        chunks a slot. Its meta's pin and expiry go to the tiers that hold it, as a HELD in
        RAM gets them from `reserve`. All within `HELD_BELOW_BUDGET_S`, else they stay SENDs,
        as they do when `HELD_BELOW_THREADS` questions are in flight already (a tier below
        RAM hanging)."""
        sends = [i for i, offset in enumerate(offsets) if offset == SEND]
        if not sends:
            return
        keys = [ChunkKey(request.keys[i]) for i in sends]
        metas = [dataclasses.replace(request.metas[i].chunk_meta(), engine=engine)
                 for i in sends]

        def held_below() -> list[bool]:
            found = layout.store.contains_many(keys)
            for key, meta, held in zip(keys, metas, found):
                if held and not meta.is_default:
                    layout.store.retain(key, meta)
            return found

        asked = self._held_below_calls.submit(held_below)
        if asked is None:
            self.counters.add("held_below_skipped")
            return
        try:
            found = asked.result(HELD_BELOW_BUDGET_S)
        except FutureTimeout:
            return
        for i, held in zip(sends, found):
            taken = puts.blocks[i]
            if not held or taken is None:
                continue
            block, put = taken
            put.cancel()
            block.__exit__(None, None, None)
            puts.blocks[i], offsets[i] = None, HELD
            puts.open -= 1

    def commit(self, owner: int, request: Commit) -> bool:
        """Commit (or give back) slot `request.index` of connection `owner`'s reservation;
        False: no such slot of its (another connection's lease, one ended, a lease of a node
        before a restart), nothing done."""
        puts = self.book.puts_of(owner, request.lease)
        if puts is None:
            return False
        if not 0 <= request.index < len(puts.blocks):
            return False
        taken, puts.blocks[request.index] = puts.blocks[request.index], None
        if taken is None:
            return False
        block, put = taken
        if not put.in_place:  # a SEND: the bytes come with the commit (the spare is shared)
            if request.data is not None and len(request.data) == puts.chunk_bytes:
                put.data = memoryview(request.data)
                self.counters.add("received_chunks", int(request.filled))
            else:
                put.cancel()
        if not request.filled:
            put.cancel()
        block.__exit__(None, None, None)  # stores it (and queues the writes behind RAM)
        self.counters.add("committed_chunks", int(request.filled))
        if request.reply and self.events is not None:
            self.events.wake()  # the step's last commit: its chunks are announced now
        puts.open -= 1
        if puts.open == 0:
            self.book.committed(request.lease)
        return True

    def describe(self, layout: ServedLayout, request: Describe) -> None:
        """Token ids of chunks an engine of `layout`'s model plans to store, for the events."""
        if self.events is not None:
            self.events.describe(layout.model, request.chunks)

    # -- a connection's lifecycle and its leases: the book's ---------------------------------
    def opened(self, owner: int, sock: socket.socket) -> None:
        """A connection accepted (ended by `shutdown` if still open then). Its sends give up
        after `lease_timeout_s` without progress (`stalled`): a frozen engine's reply held
        its thread for as long as it stayed frozen, a 32 MiB reply's for ever."""
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO,
                        send_timeout(self.config.lease_timeout_s))
        self.book.opened(owner, sock)

    def connected(self, owner: int, engine: str, stamps: bool) -> None:
        """Connection `owner` is `engine`'s (`LeaseBook.connected`)."""
        self.book.connected(owner, engine, stamps)

    def disconnected(self, owner: int) -> None:
        """A connection ended: its leases end (`LeaseBook.disconnected`)."""
        self.book.disconnected(owner)

    def stalled(self, owner: int) -> bool:
        """A reply went unread for `lease_timeout_s`: the connection's leases quarantined
        (`LeaseBook.stalled`); True: the caller awaits its hang-up."""
        return self.book.stalled(owner)

    def hung_up(self, owner: int) -> None:
        """A stalled connection's engine closed its end (`LeaseBook.hung_up`)."""
        self.book.hung_up(owner)

    def release(self, owner: int, lease: int) -> None:
        """End connection `owner`'s `lease` (`LeaseBook.release`)."""
        self.book.release(owner, lease)


def _listen(path: Path) -> NodeSocketServer:
    """The node's listening socket at `path`.

    Raises:
        OSError: it cannot be bound, naming `path` (a bind's error names no file: a
            directory the node may not write, a /run/kvtier of another user's, said only
            "[Errno 13] Permission denied": tests/node/test_node_config.py).
    """
    try:
        return NodeSocketServer(str(path), ConnectionHandler)
    except OSError as exc:
        if exc.filename is not None:
            raise
        raise OSError(exc.errno, f"socket_path {path}: cannot listen there "
                                 f"({exc.strerror or exc})") from exc


@contextlib.contextmanager
def running_node(config: NodeConfig) -> Iterator[NodeServer]:
    """A node serving on a thread of this process until the block ends (tests, benches)."""
    node = NodeServer(config)
    thread = threading.Thread(target=node.serve_forever, name="kvtier-node", daemon=True)
    thread.start()
    try:
        yield node
    finally:
        node.shutdown()
        thread.join(timeout=10)
