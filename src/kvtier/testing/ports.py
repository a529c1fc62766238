"""Ports for the servers that tests and benchmarks start on 127.0.0.1.

A port is picked free, then given to a server that binds it a moment later. Picked by the
kernel (bind to port 0) it comes from the ephemeral range, where every other process's bind to
port 0 and every outgoing connection takes ports too: vLLM's own processes take several while
a server starts (torch.distributed's store, the engine's sockets), and once took the port just
picked for a second server started beside the first ("Address already in use"). Picked here, a
port lies below that range, where only explicit binds go, at random from the operating system's
entropy: vLLM seeds Python's global generator (seed 0) in every process that builds an engine,
and two test processes drawing from it picked the same port for servers started at once.
"""

from __future__ import annotations

import random
import socket
from contextlib import ExitStack
from pathlib import Path

EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
LOWEST = 10_000  # under it: well-known and registered services' ports
TRIES = 200
_DRAW = random.SystemRandom()  # no seed reaches it


def ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (Linux's default 32768 where unread)."""
    try:
        return int(EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32_768


def free_port(host: str = "127.0.0.1", *, also: tuple[int, ...] = ()) -> int:
    """A TCP port free on `host` now, below the ephemeral range, with each `port + offset`
    for the offsets in `also` free too (Redis Cluster's bus port: `also=(10000,)`). Another
    picker can still take it before use, as with any pick; only no kernel pick can. Where
    the range leaves no room below it, the kernel's own pick (without `also`)."""
    top = ephemeral_low() - max(also, default=0)
    if top - LOWEST < 1000:
        if also:
            raise RuntimeError(f"no room below the ephemeral range ({EPHEMERAL_RANGE}) for "
                               f"ports {also} above another")
        return _kernel_pick(host)
    for port in _DRAW.sample(range(LOWEST, top), min(TRIES, top - LOWEST)):
        if _all_free(host, (port, *(port + offset for offset in also))):
            return port
    raise RuntimeError(f"no free port on {host} among {TRIES} tried in {LOWEST}-{top - 1}")


def _all_free(host: str, ports: tuple[int, ...]) -> bool:
    with ExitStack() as stack:
        try:
            for port in ports:
                sock = stack.enter_context(socket.socket())
                sock.bind((host, port))
        except OSError:
            return False
    return True


def _kernel_pick(host: str) -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])
