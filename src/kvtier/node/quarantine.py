"""The leases of an engine whose connection the node closed while the engine lives: kept
until its process is gone.

The node closes a connection whose engine has taken nothing of a reply for the send timeout
(frozen: SIGSTOP, a debugger, a hung process; its thread would otherwise block in the send
for as long as the engine stays frozen). The engine may still wake and write the slots it
reserved on that connection (in place, from its movers) or copy chunks lent on it: were they
freed now, another chunk given one of them meanwhile would be overwritten (reserved slots),
or read as this engine's (the lendings of an engine that checks no stamps). So those leases
are quarantined: held, shown in the status as the engine's, until the process that opened
the connection is gone (its pid from `SO_PEERCRED`, watched through a pidfd: a pid reused
by another process is never taken for it), or, for an engine that checks stamps, until it
closes its end of the connection (`await_hang_up`): such an engine closes a connection only
once no copy into its slots is in flight (node/inflight.py), and writes no slot reserved on
a connection it closed; and a process's end closes its sockets, whatever pid namespace it
lives in. An older engine whose pid the node cannot see (another pid namespace: 0) or watch
keeps them until the node stops.

Primitives: `Quarantine`, `peer_pid`, `await_hang_up`.
"""

from __future__ import annotations

import os
import select
import socket
import struct
from dataclasses import dataclass

_CREDENTIALS = struct.Struct("3i")  # struct ucred: pid, uid, gid


def peer_pid(sock: socket.socket) -> int:
    """The pid of the process that connected `sock` (0: not visible from this pid
    namespace, or not known)."""
    try:
        pid, _uid, _gid = _CREDENTIALS.unpack(
            sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CREDENTIALS.size))
    except OSError:
        return 0
    return int(pid)


@dataclass
class Quarantine:
    """A closed connection's engine: its name (the status's), pid and pidfd (-1: not
    watched), whether its hang-up ends it (`checking`: an engine that checks stamps), and its
    socket, shut for writing, until the engine closes its end."""

    engine: str
    pid: int
    pidfd: int
    checking: bool
    sock: socket.socket
    exited: bool = False  # gone before it could be watched

    @classmethod
    def of(cls, engine: str, sock: socket.socket, checking: bool) -> Quarantine:
        """The quarantine of `sock`'s peer, watched from now (while its connection is still
        open: its pid is still its own)."""
        pid = peer_pid(sock)
        pidfd, exited = -1, False
        if pid > 0:
            try:
                pidfd = os.pidfd_open(pid)
            except ProcessLookupError:
                exited = True
            except (OSError, AttributeError):  # Linux < 5.3: not watched
                pass
        return cls(engine, pid, pidfd, checking, sock, exited)

    @property
    def watched(self) -> bool:
        """Whether its end will be seen: its process is watched (or gone already), or it
        closes its end of the connection when nothing can write its slots any more; if not,
        its leases are kept until the node stops."""
        return self.pidfd >= 0 or self.exited or self.checking

    def gone(self) -> bool:
        """Whether the engine's process has exited (a pidfd is readable then)."""
        if self.pidfd < 0:
            return self.exited
        poller = select.poll()
        poller.register(self.pidfd, select.POLLIN)
        return bool(poller.poll(0))

    def close(self) -> None:
        fd, self.pidfd = self.pidfd, -1
        if fd >= 0:
            os.close(fd)


def await_hang_up(sock: socket.socket) -> None:
    """Shut `sock` for writing (the engine, when it wakes, reads what was sent, then the
    end of the connection) and return once the engine has closed its end: its process
    exited, or it closed the connection. What it sends meanwhile is read and dropped (a
    commit's bytes must not block it in its send). Returns at once where the socket is shut
    already (the node stops: `NodeServer.shutdown`)."""
    try:
        sock.shutdown(socket.SHUT_WR)
        while sock.recv(65536):
            pass
    except OSError:
        pass  # reset, or shut by the node's shutdown: ended either way
