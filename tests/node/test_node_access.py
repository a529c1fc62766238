"""Who may reach the node, and what it does with what it cannot serve: the socket and each
/dev/shm slab are mode 0660 whatever the node's umask (its engines are its group, nobody
else); `kvtier node status --json` shows the engines and layouts it serves; a frame that is
garbage (not msgpack, a reply sent as a request, past MAX_FRAME) gets a `Refused` on that
connection only, the node serving every other; and a layout past `max_layouts` is refused,
which its engine sees as misses, never as an exception.

A real `kvtier node serve` process (its umask, its socket, `kvtier node status` as a command);
`running_node` for max_layouts (a setting the command does not expose).
"""

from __future__ import annotations

import json
import os
import socket
import stat
import struct
import subprocess
import sys
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path

import msgspec
import pytest
from nodekit import (
    LAYOUT,
    OTHER_LAYOUT,
    NodeProcess,
    connect,
    expected,
    key,
    lend,
    node_tiers,
    put_chunks,
)

from kvtier.errors import NodeUnavailable
from kvtier.node.client import default_engine_name, engine_pid
from kvtier.node.probe import NodeProbe
from kvtier.node.protocol import MAX_FRAME, Found, Lookup, Refused, Welcome, receive_reply, send
from kvtier.node.server import NodeServer

pytestmark = pytest.mark.timeout(120)  # a hang fails here, not at the suite's 900 s


def kvtier_node(*args: str) -> subprocess.CompletedProcess[str]:
    """`python -m kvtier.node ARGS` (the node's own entry point; `kvtier node`, the tools',
    is tested in tests/tools)."""
    return subprocess.run([sys.executable, "-m", "kvtier.node", *args],
                          capture_output=True, text=True, timeout=60)


def test_socket_and_slab_are_for_the_nodes_group_and_status_shows_its_engines(
        tmp_path: Path, start_node: Callable[..., NodeProcess]):
    node = start_node(node_tiers(tmp_path, ram_chunks=8), umask=0o077)
    client, engine = connect(node.socket_path)
    assert put_chunks(engine, [0]) == [True]
    assert client.welcome is not None
    socket_mode = os.stat(node.socket_path).st_mode
    slab_mode = os.stat(client.welcome.shm_path).st_mode
    assert stat.S_ISSOCK(socket_mode) and stat.S_IMODE(socket_mode) == 0o660
    assert stat.S_ISREG(slab_mode) and stat.S_IMODE(slab_mode) == 0o660

    shown = kvtier_node("status", "--socket", str(node.socket_path))
    assert shown.returncode == 0, shown.stderr
    status = json.loads(shown.stdout)
    assert status["engines"] == [default_engine_name()]
    assert default_engine_name().startswith(f"{socket.gethostname()}:{os.getpid()}:")
    assert status["node"] == node.name and status["connections"] == 1
    layout = status["layouts"][LAYOUT.digest()]
    assert layout["shm_path"] == client.welcome.shm_path
    assert layout["chunk_bytes"] == LAYOUT.bytes_per_chunk
    assert (layout["tiers"][0]["chunks"], layout["tiers"][0]["puts"]) == (1, 1)
    # The table form prints too; no node at a socket: exit status 1.
    assert kvtier_node("status", "--socket", str(tmp_path / "none.sock")).returncode == 1


SAME_PID = """
import os, sys
pid = int(sys.argv[2])
os.getpid = lambda: pid  # the fault: another pid namespace's process with this pid
from nodekit import connect, put_chunks
client, engine = connect(sys.argv[1])
assert put_chunks(engine, [1]) == [True]
print("connected", flush=True)
sys.stdin.read()
"""


def test_engines_of_one_host_with_one_pid_are_two_engines(
        tmp_path: Path, start_node: Callable[..., NodeProcess]):
    """Pods sharing the host's network share its hostname, and their pid namespaces may give
    their engines one pid: host:pid named them as one engine (one row, one quota)."""
    node = start_node(node_tiers(tmp_path, ram_chunks=8))
    _, engine = connect(node.socket_path)
    assert put_chunks(engine, [0]) == [True]
    other = subprocess.Popen(
        [sys.executable, "-c", SAME_PID, str(node.socket_path), str(os.getpid())],
        cwd=Path(__file__).parent, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        env=os.environ | {"PYTHONPATH": os.pathsep.join(sys.path)})
    try:
        assert other.stdout is not None and other.stdout.readline() == "connected\n"
        shown = kvtier_node("status", "--socket", str(node.socket_path))
        engines = json.loads(shown.stdout)["engines"]
    finally:
        other.communicate("", timeout=30)
    assert len(engines) == 2 and default_engine_name() in engines
    assert all(name.startswith(f"{socket.gethostname()}:{os.getpid()}:") for name in engines)
    assert [engine_pid(name) for name in engines] == [os.getpid()] * 2
    assert engine_pid("frozen") is None and engine_pid("a:b:c") is None


def garbage_answer(socket_path: Path, frame: bytes) -> tuple[object, bytes]:
    """What the node answers `frame` on a connection of its own, and what it sends after
    (b"": it closed the connection)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(10)
        sock.connect(str(socket_path))
        sock.sendall(frame)
        answer = receive_reply(sock)
        return answer, sock.recv(16)


def test_garbage_on_one_connection_is_refused_and_the_node_serves_on(
        tmp_path: Path, start_node: Callable[..., NodeProcess]):
    node = start_node(node_tiers(tmp_path, ram_chunks=8))
    client, engine = connect(node.socket_path)
    assert put_chunks(engine, [0]) == [True]

    not_msgpack = b"\xc1" * 8  # 0xc1: a byte MessagePack never uses
    a_reply = msgspec.msgpack.encode(Welcome("/dev/shm/x", 1, 1, "g", "n"))
    for frame in (struct.pack(">I", len(not_msgpack)) + not_msgpack,
                  struct.pack(">I", len(a_reply)) + a_reply,
                  struct.pack(">I", MAX_FRAME + 1)):
        answer, after = garbage_answer(node.socket_path, frame)
        assert isinstance(answer, Refused) and "bad message" in answer.reason
        assert after == b""
    # A request before Hello is refused too, and that connection stays usable.
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(10)
        sock.connect(str(node.socket_path))
        send(sock, Lookup([key(0)]))
        answer = receive_reply(sock)
        assert isinstance(answer, Refused) and "Hello" in answer.reason

    # The engine connected throughout is served; so is a new one.
    assert lend(engine, [key(0)]).chunks == expected([0])
    _other_client, other = connect(node.socket_path)
    assert lend(other, [key(0)]).chunks == expected([0])
    assert client.failures == 0
    assert node.process is not None and node.process.poll() is None


def test_a_layout_past_max_layouts_is_refused_and_its_engine_misses(
        tmp_path: Path, in_process_node: Callable[..., AbstractContextManager[NodeServer]]):
    with in_process_node(node_tiers(tmp_path, ram_chunks=8), max_layouts=1) as node:
        client, engine = connect(node.config.socket_path)
        assert put_chunks(engine, [0]) == [True]
        other_client, other = connect(node.config.socket_path, OTHER_LAYOUT)
        other_bytes = OTHER_LAYOUT.bytes_per_chunk
        lent = lend(other, [key(0)], other_bytes)
        assert (lent.chunks, lent.stopped_at, lent.failed_tier) == ([], 0, "node")
        assert put_chunks(other, [1], other_bytes) == [False]
        with pytest.raises(NodeUnavailable):  # the scheduler: a miss (nothing stored)
            NodeProbe([other_client]).contains_many([key(0)])
        assert other_client.failures >= 1 and other_client.welcome is None
        assert node.status()["counters"]["refused"] >= 1
        assert list(node.status()["layouts"]) == [LAYOUT.digest()]
        # The layout it holds is served as before.
        assert client.call(Lookup([key(0)]), Found).held == [True]
        assert lend(engine, [key(0)]).chunks == expected([0])
