"""A chunk read's replies taken off the socket straight into the caller's buffer.

redis-py hands a bulk reply over as a `bytes` object, assembled through its `SocketBuffer`: a
`recv` of `socket_read_size` (a fresh buffer each call), a copy into a `BytesIO`, a copy out
of it, a slice dropping the CRLF; the tier then copies the payload into its destination. For
a 2 MiB chunk that is five copies and ~4 ms of CPU a chunk on this project's VM, most of it
under the GIL (docs/performance.md, "redis reads' copies"). `read_into` sends the tier's read
(an HMGET of the chunk's fields, then its PEXPIRE) on one of the client's pooled connections
and parses the replies itself: each bulk value's bytes are `recv_into`'d where `place` says, a
slice of the destination, one copy by the kernel.

`place` sees each value's length before a byte of it is read, and bounds the read: a value
longer than any the chunk can hold (another application's, a corrupt writer's) is refused
there (the `place` raises) and the connection dropped with the rest of it unread, so a
hostile value of any size costs at most a socket buffer of memory, not its size.

Only the RESP needed here is parsed (arrays of bulk strings or nulls, integers, simple
strings, errors; RESP2 and RESP3). A connection whose parser holds unread bytes, or a parser
this module does not know (hiredis), is not used: `read_into` returns None and the tier reads
through redis-py. Any failure mid-reply disconnects the connection (never returned to the
pool half-read); socket errors come out as redis-py's (ConnectionError, TimeoutError), error
replies as the exception the connection's own redis-py parser makes of them (`parse_error`):
a server still loading its dataset after a restart (LOADING) is a `BusyLoadingError`, one of
redis-py's ConnectionErrors, so the tier backs off from it as from a read through redis-py;
MOVED and ASK are `MovedError`/`AskError`, MASTERDOWN a `ClusterDownError`, OOM an
`OutOfMemoryError`; BUSY (a script running) stays a plain ResponseError, as in redis-py.

Primitives: `read_into`, `Place`; `Replies` (the parser) and `readable` (whether a
connection can be read here), beneath it.
"""

from __future__ import annotations

import socket
from collections.abc import Callable, Sequence
from typing import Any

import redis
from redis._parsers import _RESP2Parser, _RESP3Parser
from redis.connection import Connection

# Where value i of an HMGET reply (`length` bytes) goes, given the values read before it: a
# writable view of exactly that many bytes, or None (a new `bytes`); it raises to refuse the
# value unread (read_into then drops the connection).
Place = Callable[[int, int, list[Any]], memoryview | None]
# What an error reply's text becomes: a parser class's `parse_error` (its table of codes).
ErrorOf = Callable[[str], redis.RedisError]
LINE_READ = 16 << 10  # bytes asked of the socket for a line (a payload's first bytes come along)
MAX_LINE = 64  # a RESP line here: "$<length>" or ":<integer>"; longer is not this protocol


class Replies:
    """RESP replies read from one socket: lines through a small buffer, bulk payloads
    straight into their destination."""

    def __init__(self, sock: socket.socket,
                 error_of: ErrorOf = _RESP2Parser.parse_error) -> None:
        self._sock = sock
        self._buffer = bytearray()
        # The connection's parser's table, not one of ours: a Cluster node's connection
        # knows MOVED and ASK on every redis-py release (older ones set a ClusterParser).
        self._error_of = error_of

    def line(self) -> bytes:
        while (end := self._buffer.find(b"\r\n")) < 0:
            if len(self._buffer) > MAX_LINE:
                raise redis.ConnectionError("a reply line too long: not a RESP reply")
            self._fill()
        line = bytes(self._buffer[:end])
        del self._buffer[: end + 2]
        return line

    def _fill(self) -> None:
        data = self._sock.recv(LINE_READ)
        if not data:
            raise redis.ConnectionError("Connection closed by server.")
        self._buffer += data

    def into(self, view: memoryview) -> None:
        """Exactly len(view) bytes of the stream into `view`, then its CRLF."""
        buffered = min(len(self._buffer), len(view))
        view[:buffered] = self._buffer[:buffered]
        del self._buffer[:buffered]
        view = view[buffered:]
        while view:
            got = self._sock.recv_into(view)
            if not got:
                raise redis.ConnectionError("Connection closed by server.")
            view = view[got:]
        while len(self._buffer) < 2:
            self._fill()
        if self._buffer[:2] != b"\r\n":
            raise redis.ConnectionError("a bulk value not ended by CRLF: not a RESP reply")
        del self._buffer[:2]

    def value(self, index: int, place: Place | None, earlier: list[Any]) -> Any:
        """One reply: an int, a str (simple string), bytes or a placed view, None (null);
        an error reply raises ResponseError."""
        line = self.line()
        kind, rest = line[:1], line[1:]
        if kind in (b"$", b"="):  # bulk string (RESP3 "=": verbatim, same framing)
            length = int(rest)
            if length < 0:
                return None
            view = None if place is None else place(index, length, earlier)
            if view is None:
                view = memoryview(bytearray(length))
                self.into(view)
                return bytes(view)
            if len(view) != length:
                raise ValueError(f"placed {len(view)} bytes for a value of {length}")
            self.into(view)
            return view
        if kind == b"_":  # RESP3 null
            return None
        if kind == b":":
            return int(rest)
        if kind == b"+":
            return rest.decode()
        if kind == b"-":
            raise self._error(rest)
        raise redis.ConnectionError(f"unexpected reply type {kind!r}")

    def _error(self, text: bytes) -> redis.RedisError:
        """The exception of error reply `text` (without its "-"), as redis-py makes it."""
        return self._error_of(text.decode(errors="replace"))

    def array(self, place: Place) -> list[Any] | None:
        line = self.line()
        if line[:1] == b"_" or line == b"*-1":
            return None
        if line[:1] == b"-":
            raise self._error(line[1:])
        if line[:1] != b"*":
            raise redis.ConnectionError(f"expected an array reply, got {line[:16]!r}")
        values: list[Any] = []
        for i in range(int(line[1:])):
            values.append(self.value(i, place, values))
        return values

    @property
    def drained(self) -> bool:
        return not self._buffer


def read_into(client: redis.Redis, name: str, fields: Sequence[str], place: Place,
              ttl_ms: int | None = None) -> list[Any] | None:
    """HMGET `fields` of hash `name` (then PEXPIRE it to `ttl_ms`, when given) in one round
    trip on a pooled connection of `client` (a standalone server's, or one Cluster node's),
    each value read where `place` puts it; the values (None for a missing one, all None for a
    missing hash). None: this client's connection cannot be read here (see the module
    docstring): use redis-py.

    Raises:
        redis.ConnectionError, redis.TimeoutError: the socket failed or timed out, or the
            server is not serving yet (BusyLoadingError: LOADING).
        redis.ResponseError: the server refused a command (WRONGTYPE: `name` is not a hash;
            MovedError, AskError: a Cluster node that does not hold the slot now).
        Whatever `place` raises (the connection is dropped, the value unread).
    """
    pool = client.connection_pool
    conn = pool.get_connection()
    try:
        if not readable(conn):
            return None
        commands: list[tuple[Any, ...]] = [("HMGET", name, *fields)]
        if ttl_ms:
            commands.append(("PEXPIRE", name, ttl_ms))
        packed = conn.pack_commands(commands)  # type: ignore[no-untyped-call]
        conn.send_packed_command(packed)  # type: ignore[no-untyped-call]
        sock = conn._sock  # set by connect(), which send_packed_command ensures
        assert sock is not None
        replies = Replies(sock, type(conn._parser).parse_error)
        try:
            values = replies.array(place)
            for _ in commands[1:]:
                replies.value(0, None, [])
        except TimeoutError as exc:
            raise redis.TimeoutError(f"Timeout reading from socket: {exc}") from exc
        except OSError as exc:
            raise redis.ConnectionError(f"Error while reading from socket: {exc}") from exc
        if not replies.drained:  # more bytes than the replies: the connection is unsure
            raise redis.ConnectionError("bytes after the replies: connection dropped")
        if values is None:
            raise redis.ConnectionError("a null reply to HMGET")
        return values
    except BaseException:
        conn.disconnect()  # type: ignore[no-untyped-call]
        raise
    finally:
        pool.release(conn)


def readable(conn: Connection) -> bool:
    """Whether `conn` has redis-py's own parser (not hiredis) holding no unread bytes."""
    parser = getattr(conn, "_parser", None)
    if not isinstance(parser, (_RESP2Parser, _RESP3Parser)):
        return False
    buffer = parser._buffer  # None until connected: send_packed_command connects
    return buffer is None or buffer.unread_bytes() == 0
