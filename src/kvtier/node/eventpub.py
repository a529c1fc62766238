"""A ZMQ publisher of KV events in vLLM's wire format, without vLLM: kvtier's own, beside the
engine's.

`kvtier node` publishes its tiers' events on one (`kvtier.node.events`, topic
`kv@node:<node>@<model>`); an engine's scheduler publishes its shared tiers' events on one
(`pool_events`, topic `kv@pool:<name>@<model>`: `kvtier.integrations.vllm.scheduler
.routerevents`). Both send as vLLM's `ZmqEventPublisher` does: a batch is one multipart
message `[topic, seq, payload]` (`kvtier.node.eventwire.frames`), `seq` counted from 0 per
topic; a `tcp://HOST:PORT` endpoint is connected to (llm-d's EPP binds a SUB there for every
engine), `tcp://*:PORT`, `tcp://[::]:PORT` and `ipc://PATH` are bound; the high-water mark is
vLLM's (100,000 messages: past it a batch is dropped, never waited for).

An `ipc://PATH` is a socket file: libzmq replaces whatever is at PATH when it binds, and leaves
its file behind when it closes. So a publisher refuses a PATH another process still listens
on (a second node would take a live node's routers) or where something other than a socket
is (a file named by mistake: libzmq deleted it), and removes its file when it closes if the
file is still its own (not a successor's).

Primitives: `ALLOWED`, `check_endpoint`, `ipc_path`, `EventPublisher`.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import socket
import stat
import time
from collections.abc import Sequence

import zmq

from kvtier.errors import ConfigError
from kvtier.node.eventwire import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch, frames

_TCP = re.compile(r"tcp://(\*|\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9._-]+):([0-9]{1,5})")
ALLOWED = ("tcp://HOST:PORT (kvtier connects to a subscriber bound there, as vLLM's "
           "publisher does: llm-d's EPP), tcp://*:PORT or tcp://[::]:PORT (bound on every "
           "interface) or ipc://PATH (bound)")
Event = BlockStored | BlockRemoved | AllBlocksCleared


def check_endpoint(endpoint: str, field: str = "events_endpoint") -> str:
    """`endpoint`, if kvtier can publish there.

    Raises:
        ConfigError: naming `field`, the value and what is allowed.
    """
    tcp = _TCP.fullmatch(endpoint)
    if tcp is not None and 1 <= int(tcp.group(2)) <= 65535:
        return endpoint
    if endpoint.startswith("ipc://") and len(endpoint) > len("ipc://"):
        return endpoint
    raise ConfigError(field, endpoint, ALLOWED)


class EventPublisher:
    """A PUB socket and each topic's next seq. One thread at a time (its owner's)."""

    def __init__(self, endpoint: str, field: str = "events_endpoint",
                 ipc_mode: int | None = None) -> None:
        """`ipc_mode`: an ipc:// socket file's mode once bound (None: as the umask leaves
        it; libzmq binds it 0777 less the umask).

        Raises:
            ConfigError: a bad `endpoint` (naming `field`).
            OSError: it cannot be bound (a port in use, a directory missing).
        """
        self.endpoint = check_endpoint(endpoint, field)
        self._seq: dict[str, int] = {}
        self._context = zmq.Context()
        self._pub = self._context.socket(zmq.PUB)
        self._pub.set_hwm(100_000)
        self._ipc_file: tuple[str, int, int] | None = None  # (path, st_dev, st_ino) bound
        path = ipc_path(endpoint)
        try:
            if path is not None:
                _refuse_a_file(path, endpoint)
                _refuse_a_live_listener(path, endpoint)
            if endpoint.startswith("ipc://") or "*" in endpoint or "::" in endpoint:
                self._pub.bind(endpoint)
            else:
                self._pub.connect(endpoint)
        except (zmq.ZMQError, OSError) as exc:
            self._pub.close(linger=0)
            self._context.term()
            if isinstance(exc, zmq.ZMQError):
                raise OSError(exc.errno,
                              f"cannot publish KV events on {endpoint}: {exc}") from exc
            raise
        if path is not None:
            with contextlib.suppress(OSError):
                if ipc_mode is not None:
                    os.chmod(path, ipc_mode)
                bound = os.stat(path)
                self._ipc_file = (path, bound.st_dev, bound.st_ino)

    def publish(self, topic: str, events: Sequence[Event]) -> None:
        """Send `events` as one batch on `topic` (nothing when there are none)."""
        if not events:
            return
        seq = self._seq.get(topic, 0)
        self._seq[topic] = seq + 1
        # data_parallel_rank 0: what vLLM's publisher of a one-rank engine sends.
        self._pub.send_multipart(frames(topic.encode(), seq, KVEventBatch(
            ts=time.time(), events=list(events), data_parallel_rank=0)))

    def close(self, linger_ms: int = 500) -> None:
        """Close the socket: the last batches go out within `linger_ms`, or are dropped.
        An ipc:// socket file is removed if it is still the one this publisher bound."""
        self._pub.close(linger=linger_ms)
        self._context.term()
        if self._ipc_file is not None:
            path, dev, ino = self._ipc_file
            self._ipc_file = None
            with contextlib.suppress(FileNotFoundError):
                found = os.stat(path)
                if (found.st_dev, found.st_ino) == (dev, ino):  # not a successor's
                    os.unlink(path)


def ipc_path(endpoint: str) -> str | None:
    """The socket file of an `ipc://PATH` endpoint (None: another transport, or Linux's
    abstract namespace, `ipc://@NAME`, which has no file)."""
    if not endpoint.startswith("ipc://"):
        return None
    path = endpoint[len("ipc://"):]
    return None if path.startswith("@") else path


def _refuse_a_file(path: str, endpoint: str) -> None:
    """Raises OSError (EEXIST) where something other than a socket is at `path` (a file, a
    link, a directory): libzmq unlinks whatever is there as it binds, and an ipc:// path
    naming a file by mistake (the node's config, a typo) deleted it
    (tests/node/test_node_events_ipc.py). Never replaced, as the node's own socket's path."""
    try:
        found = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(found.st_mode):
        raise OSError(errno.EEXIST, f"cannot publish KV events on {endpoint}: {path} exists "
                                    "and is not a socket: not replaced")


def _refuse_a_live_listener(path: str, endpoint: str) -> None:
    """Raises OSError (EADDRINUSE) where a process listens on the socket file `path`: binding
    would replace its file, and its subscribers would connect here from then on. A file no one
    listens on (left by a killed node) is let be: the bind replaces it."""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.settimeout(1.0)
        probe.connect(path)
    except TimeoutError:  # a listener whose backlog is full: live
        pass
    except OSError:  # nothing there, not a socket, or no one listening: the bind may go on
        return
    finally:
        probe.close()
    raise OSError(errno.EADDRINUSE, f"cannot publish KV events on {endpoint}: another process "
                                    f"(a running node?) publishes there")
