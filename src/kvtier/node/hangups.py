"""Hang-ups of the node's connections, noticed while their engine is idle.

A node that stops (or dies) closes every engine's connection. An engine that asks the node
nothing after that would learn of it only at its next request: until then it kept the dead
node's slab mapped, and a restarted node on a /dev/shm with room for one slab could create
none, refusing every engine (tests/node/test_node_idle_lets_go.py). So every connection a
`NodeClient` holds is watched for its peer's hang-up (`EPOLLRDHUP`: no wake-up for replies,
which its own thread reads), by one thread for the whole process, started with the first
connection and ended once none is left (it sleeps until a hang-up, or its last connection's
end wakes it); a hang-up is handed to the connection's client (`NodeClient._hung_up`, on
this thread: it must not block). Registering costs one `epoll_ctl` at a connection's start
and end: nothing on a request's path.

Primitives: `watch_hangup`, `unwatch_hangup`.
"""

from __future__ import annotations

import contextlib
import os
import select
import threading
import weakref
from collections.abc import Callable


class _Hangups:
    """The process's watch: an epoll of the connections and the callbacks of their owners."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._epoll: select.epoll | None = None
        self._thread: threading.Thread | None = None
        self._wake = -1  # a pipe's write end: wakes the thread when no connection is left
        # fd -> the owner's callback (weak: a client nobody holds is not kept for it)
        self._owners: dict[int, weakref.WeakMethod[Callable[[], None]]] = {}

    def watch(self, fd: int, on_hangup: Callable[[], None]) -> None:
        """Call `on_hangup` (a bound method) once the peer of connection `fd` hangs up."""
        with self._lock:
            if self._epoll is None:
                self._epoll = select.epoll()
                wake_read, self._wake = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
                self._epoll.register(wake_read, select.EPOLLIN)
                self._thread = threading.Thread(
                    target=self._run, args=(self._epoll, wake_read, self._wake),
                    name="kvtier-node-hangups", daemon=True)
                self._thread.start()
            try:
                self._epoll.register(fd, select.EPOLLRDHUP | select.EPOLLONESHOT)
            except OSError:  # closed meanwhile: its owner finds out at its next call
                if not self._owners:  # the thread just started ends
                    with contextlib.suppress(OSError):
                        os.write(self._wake, b"\0")
                return
            self._owners[fd] = weakref.WeakMethod(on_hangup)

    def unwatch(self, fd: int) -> None:
        """Stop watching `fd` (before it is closed: its number is then another file's)."""
        with self._lock:
            if self._owners.pop(fd, None) is not None and self._epoll is not None:
                with contextlib.suppress(OSError):
                    self._epoll.unregister(fd)
                if not self._owners:  # the thread ends
                    with contextlib.suppress(OSError):
                        os.write(self._wake, b"\0")

    def _run(self, epoll: select.epoll, wake_read: int, wake_write: int) -> None:
        while True:
            try:
                events = epoll.poll()
            except OSError:
                events = []
            owners = []
            with self._lock:
                for fd, _mask in events:
                    if fd == wake_read:
                        with contextlib.suppress(OSError):
                            os.read(wake_read, 4096)
                        continue
                    owner = self._owners.pop(fd, None)
                    if owner is not None:
                        with contextlib.suppress(OSError):
                            epoll.unregister(fd)
                        owners.append(owner)
                done = not self._owners
                if done:  # the next connection starts another thread
                    self._thread, self._epoll, self._wake = None, None, -1
                    epoll.close()
                    os.close(wake_read)
                    os.close(wake_write)
            for owner in owners:
                callback = owner()
                if callback is not None:
                    callback()
            if done:
                return

    def reset_after_fork(self) -> None:
        """A forked child has none of its parent's threads: it starts its own."""
        self._lock = threading.Lock()
        self._epoll, self._thread, self._owners, self._wake = None, None, {}, -1


_HANGUPS = _Hangups()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_HANGUPS.reset_after_fork)


def watch_hangup(fd: int, on_hangup: Callable[[], None]) -> None:
    """Call `on_hangup` (a bound method, on the watch's thread: it must not block) once the
    peer of connection `fd` hangs up; `unwatch_hangup(fd)` before `fd` is closed."""
    _HANGUPS.watch(fd, on_hangup)


def unwatch_hangup(fd: int) -> None:
    """Stop watching connection `fd`; call it before closing `fd`."""
    _HANGUPS.unwatch(fd)
