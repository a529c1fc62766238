"""The node's socket and its engines' connections: the listening socket (bound the node's
alone, then given to its group), and a connection's requests read in order on a thread of its
own. Here a request is dispatched; what it does to the node's stores and leases is the
server's (`RequestServer`, the contract `NodeServer` keeps: the server imports this module,
never the reverse).

Primitives: `RequestServer`, `NodeSocketServer`, `ConnectionHandler`, `reply_to`,
`send_timeout`.
"""

from __future__ import annotations

import itertools
import logging
import mmap
import os
import socket
import socketserver
import struct
from collections.abc import Callable
from typing import Any, Protocol

import msgspec

from kvtier.core.keys import ChunkKey
from kvtier.node.counters import NodeCounters
from kvtier.node.layouts import ServedLayout
from kvtier.node.protocol import (
    Answer,
    Borrow,
    Commit,
    Describe,
    Flush,
    Found,
    Hello,
    Lent,
    Lookup,
    MeasureLinks,
    Refused,
    Release,
    Reply,
    Request,
    Reserve,
    Reserved,
    Retain,
    Status,
    Touch,
    receive_request,
    send,
)
from kvtier.node.quarantine import await_hang_up

log = logging.getLogger(__name__)
# Each connection's number, as the node's leases, engines and quarantines know it: never
# reused. `id()` of its handler was, as soon as the handler was gone (CPython hands its memory
# to the next object): a later engine's connection could be a quarantined one's, its leases
# shown as the frozen engine's, kept and ended with them (tests/node/test_node_owner_numbers.py).
_OWNERS = itertools.count(1)
# The longest send timeout set on a connection (68 years: a C long's seconds on any Linux);
# a longer lease_timeout_s gives it this one.
MAX_SEND_TIMEOUT_S = 2**31 - 1


class RequestServer(Protocol):
    """What a connection asks of its node (`NodeServer`): the connection's lifecycle, and
    what each request does to the node's layouts, leases and stores."""

    counters: NodeCounters

    @property
    def closing(self) -> bool: ...
    def opened(self, owner: int, sock: socket.socket) -> None: ...
    def connected(self, owner: int, engine: str, stamps: bool) -> None: ...
    def disconnected(self, owner: int) -> None: ...
    def stalled(self, owner: int) -> bool: ...
    def hung_up(self, owner: int) -> None: ...
    def layout_for(self, hello: Hello) -> ServedLayout | Refused: ...
    def status(self) -> dict[str, Any]: ...
    def release(self, owner: int, lease: int) -> None: ...
    def commit(self, owner: int, request: Commit) -> bool: ...
    def describe(self, layout: ServedLayout, request: Describe) -> None: ...
    def borrow(self, owner: int, layout: ServedLayout, request: Borrow,
               spares: list[memoryview], part: Callable[[Lent], None] | None = None
               ) -> Lent: ...
    def reserve(self, owner: int, layout: ServedLayout, request: Reserve, spare: memoryview
                ) -> Reserved: ...


class NodeSocketServer(socketserver.ThreadingUnixStreamServer):
    """The node's listening socket: a thread per connection, `node` serving them."""

    daemon_threads = True
    request_queue_size = socket.SOMAXCONN  # engines reconnecting at once after a restart
    node: RequestServer

    def server_bind(self) -> None:
        """Bind the socket's file as the node's alone (0600, narrowed by the umask; Linux
        takes a unix socket's file mode from its inode), widened to its group by `NodeServer`
        once bound: bound with the process's mode bits, under umask 0 the file was 0777 until
        that chmod, and any user of the host who connected meanwhile kept a connection
        (tests/node/test_node_socket_bind.py)."""
        os.fchmod(self.socket.fileno(), 0o600)
        super().server_bind()


class ConnectionHandler(socketserver.BaseRequestHandler):
    """One connection: its requests in order, on its own thread."""

    server: NodeSocketServer

    def handle(self) -> None:
        node = self.server.node
        owner = next(_OWNERS)  # atomic under the GIL
        sock: socket.socket = self.request
        layout: ServedLayout | None = None
        spares: list[memoryview] = []
        scratch: memoryview | None = None
        engine = "an engine not said yet"  # its Hello's, for the log
        stalled = False
        node.opened(owner, sock)
        try:
            while True:
                try:
                    request = receive_request(sock)
                except (msgspec.MsgspecError, ValueError) as exc:
                    # Logged and counted: an engine never sends one (a list past MAX_KEYS,
                    # garbage), so one is another kvtier's, or a hostile user's of the group.
                    node.counters.add("refused_messages")
                    log.warning("kvtier node: a message from %s refused (%s); its connection "
                                "closed", engine, exc)
                    send(sock, Refused(f"bad message: {exc}"))
                    return
                if request is None or node.closing:
                    return
                if isinstance(request, Hello):
                    answer = node.layout_for(request)
                    if isinstance(answer, Refused):
                        node.counters.add("refused")
                        send(sock, answer)
                        continue
                    layout, engine = answer, request.engine
                    node.connected(owner, request.engine, request.stamps)
                    send(sock, layout.welcome)
                    continue
                if isinstance(request, Release):
                    node.release(owner, request.lease)
                    continue
                if isinstance(request, Touch):
                    if layout is not None:
                        layout.memory.touch([ChunkKey(k) for k in request.keys])
                        node.counters.add("read_in_place", len(request.keys))
                    continue
                if isinstance(request, Commit):
                    applied = node.commit(owner, request)
                    if request.reply:
                        send(sock, Answer(applied))
                    continue
                if isinstance(request, Status):
                    send(sock, Answer(node.status()))
                    continue
                if isinstance(request, Describe):
                    if layout is not None:
                        node.describe(layout, request)
                    continue
                if layout is None:
                    send(sock, Refused("say Hello first"))
                    continue
                if scratch is None:
                    scratch = memoryview(mmap.mmap(-1, layout.memory.chunk_bytes))
                send(sock, reply_to(node, owner, layout, request, spares, scratch,
                                    lambda part: send(sock, part)))
        except BlockingIOError:  # a send's timeout (SO_SNDTIMEO): the engine reads nothing
            stalled = node.stalled(owner)
            return
        except OSError:
            return  # the engine went away mid-message
        finally:
            node.disconnected(owner)
            if stalled:  # what it may still write is quarantined until it hangs up
                await_hang_up(sock)
                node.hung_up(owner)


def reply_to(node: RequestServer, owner: int, layout: ServedLayout, request: Request,
             spares: list[memoryview], scratch: memoryview,
             part: Callable[[Lent], None]) -> Reply:
    """The reply to a request about the connection's layout (`part`: sends a part of a
    streamed one)."""
    if isinstance(request, Lookup):
        node.counters.add("lookups")
        keys = [ChunkKey(k) for k in request.keys]
        if request.ram_only:
            return Found([layout.memory.contains(key) for key in keys])
        # One batch per remote tier below RAM, not a round trip per key.
        return Found(layout.store.contains_many(keys))
    if isinstance(request, MeasureLinks):  # measured now the first time, then when due
        return Answer({name: [speed.round_trip_s, speed.bytes_per_s]
                       for name, speed in layout.links.current().items()})
    if isinstance(request, Borrow):
        return node.borrow(owner, layout, request, spares, part if request.stream else None)
    if isinstance(request, Reserve):
        return node.reserve(owner, layout, request, scratch)
    if isinstance(request, Retain):
        return Answer(layout.store.retain(ChunkKey(request.key), request.meta.chunk_meta()))
    if isinstance(request, Flush):
        return Answer(layout.store.flush(request.timeout_s))
    return Refused(f"unexpected {type(request).__name__}")


def send_timeout(seconds: float) -> bytes:
    """`SO_SNDTIMEO`'s struct timeval for `seconds`: its whole seconds a C long, at most
    `MAX_SEND_TIMEOUT_S` (NodeConfig bounds lease_timeout_s at a year: a value past a long's
    range failed every connection as it was opened, and the node served no engine), and never
    zero (a zero timeval is no timeout at all: a lease_timeout_s under a microsecond)."""
    micros = max(1, min(round(seconds * 1e6), MAX_SEND_TIMEOUT_S * 1_000_000))
    return struct.pack("ll", *divmod(micros, 1_000_000))
