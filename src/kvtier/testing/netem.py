"""A network emulated on loopback: a delaying, bandwidth-capped TCP proxy on 127.0.0.1.

`kvtier bench interference --tier redis` puts it between the engine's redis tier and a
private redis-server, so that the loads cross "a network" (issue 13); the engine tests of the
load-or-recompute rule put it under a redis tier (tests/engine/test_load_or_recompute.py).
In each direction:
  - a link of `bandwidth_gbps` SHARED by every connection (one full-duplex NIC): the bytes
    are serialized in the order the proxy received them, across connections; a piece of
    n bytes received at t is on the wire until free = max(t, free) + 8 n / (gbps * 1e9);
  - then a one-way delay: the piece is written to the other side no earlier than
    free + delay_ms (a request and its reply pay it twice). No cap (None): t + delay_ms.
Bytes go through intact and in order; an end of stream is passed on (half-close) after the
bytes before it; a connection is closed when both directions ended or either side failed.
The proxy's own hop (Python relaying on the same cores) adds to these figures.

It runs in a child process (`python -m kvtier.testing.netem`), so that relaying takes no
GIL from the caller (the bench times tokens in its own process); the child exits when its
stdin closes: at the context's exit, or when the caller dies. `Endpoint.set_link` changes
the delay and the cap while it runs (a link that degrades and recovers), through the same
stdin, one line "DELAY_MS GBPS" per change.

Primitives: `Endpoint`, `delayed_proxy`."""

from __future__ import annotations

import asyncio
import math
import selectors
import socket
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import IO

from kvtier.errors import ConfigError

READ_BYTES = 256 * 1024  # the most one recv takes (the pieces the link paces)
QUEUE_PIECES = 64  # pieces in flight per connection and direction (<= 16 MiB)
STOP_TIMEOUT_S = 5.0


@dataclass(frozen=True, slots=True)
class Endpoint:
    """Where the proxy listens, and its link's controls."""

    host: str
    port: int
    control: IO[bytes] | None = field(default=None, compare=False, repr=False)

    def set_link(self, delay_ms: float, bandwidth_gbps: float | None) -> None:
        """From now on, delay and cap the link so (pieces already queued keep their times).

        Raises:
            ConfigError: a delay < 0 or a cap <= 0.
        """
        _check_link(delay_ms, bandwidth_gbps)
        assert self.control is not None, "not a running proxy"
        self.control.write(f"{delay_ms!r} {bandwidth_gbps or 0.0!r}\n".encode())
        self.control.flush()


def _check_link(delay_ms: float, bandwidth_gbps: float | None) -> None:
    if not (math.isfinite(delay_ms) and delay_ms >= 0):
        raise ConfigError("delay_ms", delay_ms, "milliseconds >= 0")
    if bandwidth_gbps is not None and not (math.isfinite(bandwidth_gbps) and bandwidth_gbps > 0):
        raise ConfigError("bandwidth_gbps", bandwidth_gbps, "Gbit/s > 0, or None (no cap)")


@contextmanager
def delayed_proxy(target_host: str, target_port: int, delay_ms: float,
                  bandwidth_gbps: float | None) -> Iterator[Endpoint]:
    """A proxy on 127.0.0.1 to `target_host:target_port` (see the module docstring) for the
    `with` block; yields where it listens. Connections still open at the exit are cut.

    Raises:
        ConfigError: a delay < 0, a cap <= 0, a port outside 1-65535.
        RuntimeError: the proxy process did not start.
    """
    if not 0 < target_port < 65536:
        raise ConfigError("target_port", target_port, "a port, 1-65535")
    _check_link(delay_ms, bandwidth_gbps)
    # A session of its own: the network, not a share of the caller's CPU group (with Linux's
    # autogroup, a session is one; kvtier.tools.bench.node.BenchNode.start says why).
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvtier.testing.netem", target_host, str(target_port),
         repr(delay_ms), repr(bandwidth_gbps or 0.0)], stdin=subprocess.PIPE,
        stdout=subprocess.PIPE, start_new_session=True)
    assert proc.stdin is not None and proc.stdout is not None
    try:
        line = proc.stdout.readline()  # the port, once it listens; b"" if it died
        if not line.strip().isdigit():
            raise RuntimeError(f"the delaying proxy did not start (exit {proc.poll()})")
        yield Endpoint("127.0.0.1", int(line), proc.stdin)
    finally:
        proc.stdin.close()
        try:
            proc.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        proc.stdout.close()


# -- the child process ---------------------------------------------------------------------

@dataclass(slots=True)
class _Link:
    """One direction of the emulated network, shared by every connection."""

    delay_s: float
    bytes_per_s: float  # 0: no cap
    free_at: float = 0.0  # when the link is done serializing what it took so far

    def due(self, now: float, size: int) -> float:
        """When a piece of `size` bytes received `now` may be written on the other side."""
        if self.bytes_per_s:
            self.free_at = max(now, self.free_at) + size / self.bytes_per_s
            return self.free_at + self.delay_s
        return now + self.delay_s


async def _pipe(src: socket.socket, dst: socket.socket, link: _Link) -> None:
    """Relay `src` to `dst` through `link` until `src`'s end of stream."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue(QUEUE_PIECES)

    async def receive() -> None:
        while data := await loop.sock_recv(src, READ_BYTES):
            await queue.put((link.due(loop.time(), len(data)), data))
        await queue.put((0.0, b""))

    async def deliver() -> None:
        while True:
            due, data = await queue.get()
            if not data:  # src's end of stream, after every byte before it
                dst.shutdown(socket.SHUT_WR)
                return
            while (now := loop.time()) < due:  # never early: the loop may wake a bit before
                await asyncio.sleep(due - now)
            await loop.sock_sendall(dst, data)

    async with asyncio.TaskGroup() as group:
        group.create_task(receive())
        group.create_task(deliver())


async def _connection(client: socket.socket, target: tuple[str, int], up: _Link,
                      down: _Link) -> None:
    loop = asyncio.get_running_loop()
    upstream = socket.socket()
    upstream.setblocking(False)
    try:
        await loop.sock_connect(upstream, target)
        for s in (client, upstream):  # no Nagle: small requests pay the emulated delay only
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        async with asyncio.TaskGroup() as group:
            group.create_task(_pipe(client, upstream, up))
            group.create_task(_pipe(upstream, client, down))
    except* OSError:
        pass  # refused, or reset by one side: what a network passes on by closing the other
    finally:
        client.close()
        upstream.close()


async def _serve(target: tuple[str, int], delay_s: float, bytes_per_s: float) -> None:
    """Accept on 127.0.0.1 (the port goes to stdout) until stdin closes, taking each line of
    it as a new "DELAY_MS GBPS", then cut the connections (their tasks close their sockets)
    before the listener closes."""
    loop = asyncio.get_running_loop()
    up, down = _Link(delay_s, bytes_per_s), _Link(delay_s, bytes_per_s)
    connections: set[asyncio.Task[None]] = set()  # references, or tasks may be collected

    async def accept(listener: socket.socket) -> None:
        while True:
            client, _ = await loop.sock_accept(listener)
            task = asyncio.create_task(_connection(client, target, up, down))
            connections.add(task)
            task.add_done_callback(connections.discard)

    with socket.create_server(("127.0.0.1", 0)) as listener:
        listener.setblocking(False)
        acceptor = asyncio.create_task(accept(listener))
        print(listener.getsockname()[1], flush=True)
        while line := await loop.run_in_executor(None, sys.stdin.buffer.readline):
            delay_ms, gbps = (float(x) for x in line.split())
            for link in (up, down):
                link.delay_s, link.bytes_per_s = delay_ms / 1e3, gbps * 1e9 / 8
        for task in (acceptor, *connections):
            task.cancel()
        await asyncio.gather(acceptor, *connections, return_exceptions=True)


if __name__ == "__main__":
    # python -m kvtier.testing.netem TARGET_HOST TARGET_PORT DELAY_MS GBPS (0: no cap)
    host, port, delay_ms, gbps = sys.argv[1:5]
    # select(), not epoll: epoll's timeouts are whole milliseconds, select()'s microseconds
    # (a 0.25 ms delay slept as 1 ms); the proxy watches a handful of sockets.
    with asyncio.Runner(loop_factory=lambda: asyncio.SelectorEventLoop(
            selectors.SelectSelector())) as runner:
        runner.run(_serve((host, int(port)), float(delay_ms) / 1e3, float(gbps) * 1e9 / 8))
