"""A TCP proxy on 127.0.0.1 that cuts its connections after a set number of bytes, in either
direction: a connection dropped between a transaction's MULTI and its EXEC, or in the middle
of a reply, as a network or a server restart drops it. (Not named conftest.py: see tierkit.)

Primitives: `CuttingProxy`.
"""

from __future__ import annotations

import contextlib
import socket
import threading

from kvtier.testing import ports

CHUNK = 4096  # bytes forwarded per recv: the cut lands within one of these


class CuttingProxy:
    """Forwards 127.0.0.1:`port` to 127.0.0.1:`upstream_port`. `cut(up=n)` drops every
    connection once `n` more bytes went client-to-server (the first `n` forwarded, not one
    more); `cut(down=n)` likewise server-to-client. `close` stops it and its connections."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.port = ports.free_port()
        self._listener = socket.create_server(("127.0.0.1", self.port))
        self._lock = threading.Lock()
        self._budget: dict[str, int | None] = {"up": None, "down": None}
        self._sockets: list[socket.socket] = []
        self.cuts = 0  # connections cut so far
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def cut(self, up: int | None = None, down: int | None = None) -> None:
        with self._lock:
            self._budget = {"up": up, "down": down}

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.upstream_port))
            with self._lock:
                self._sockets += [client, upstream]
            threading.Thread(target=self._pump, args=(client, upstream, "up"),
                             daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, "down"),
                             daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket, direction: str) -> None:
        try:
            while data := source.recv(CHUNK):
                with self._lock:
                    budget = self._budget[direction]
                    if budget is not None:
                        self._budget[direction] = budget - min(budget, len(data))
                if budget is not None and budget < len(data):
                    sink.sendall(data[:budget])
                    self.cuts += 1
                    break
                sink.sendall(data)
        except OSError:
            pass
        for sock in (source, sink):
            _drop(sock)

    def close(self) -> None:
        self._listener.close()
        with self._lock:
            for sock in self._sockets:
                _drop(sock)


def _drop(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
    sock.close()
