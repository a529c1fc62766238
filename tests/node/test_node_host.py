"""Nodes on one host never take each other's files: a node's name is its slabs' (two running
nodes of one name would lend each other's slots, unchecked: RAM chunks carry no checksum), its
socket path is its own (a file there that is not a socket is never replaced, a successor's socket
is never removed) and a start never hangs on a node that stopped answering. Many engines that
connect at once (a node's restart) are all answered.

In-process nodes (`running_node`) on sockets of the test's own directory, found by trying (the
38th session's operators' hunt): each case failed before its fix.
"""

from __future__ import annotations

import contextlib
import errno
import socket
import threading
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from pathlib import Path

import pytest
from nodekit import connect, expected, key, lend, node_tiers, put_chunks, shm_files

from kvtier.node.config import NodeConfig
from kvtier.node.server import NodeServer, running_node
from kvtier.tiers.shmslab import SHM_DIR
from kvtier.tiers.storeconfig import StoreConfig

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def node_at(tmp_path: Path, node_name: str) -> Callable[..., AbstractContextManager[NodeServer]]:
    """node_at(socket_path, name=this test's): a running node of 8 RAM chunks there."""
    config = StoreConfig.parse(node_tiers(tmp_path, ram_chunks=8))

    def run(socket_path: Path, name: str = node_name) -> AbstractContextManager[NodeServer]:
        return running_node(NodeConfig(config, socket_path, name=name))

    return run


def test_a_second_node_of_a_running_nodes_name_is_refused(
        socket_path: Path, node_name: str,
        node_at: Callable[..., AbstractContextManager[NodeServer]]) -> None:
    """Before: the second node's first layout moved the first's live slab aside and made its
    own under the same name; the first kept welcoming engines to that name, and they wrote
    into the second's slots."""
    other_socket = socket_path.with_name("other.sock")
    with node_at(socket_path):
        _client, engine = connect(socket_path)
        assert put_chunks(engine, [0, 1]) == [True, True]
        with pytest.raises(OSError, match="give each node its own --name") as refused:
            NodeServer(NodeConfig(StoreConfig.parse({"tiers": [{"kind": "memory",
                                                                "capacity": "1MiB"}]}),
                                  other_socket, name=node_name))
        assert refused.value.errno == errno.EBUSY
        assert not other_socket.exists()
        _new_client, new_engine = connect(socket_path, engine="restarted")
        assert lend(new_engine, [key(0), key(1)]).chunks == expected([0, 1])
    # A node of a name that only starts like it (slabs kvtier-<name>-x-<digest>) is not it.
    with node_at(socket_path, name=f"{node_name}-x"):
        _client, engine = connect(socket_path)
        assert put_chunks(engine, [0]) == [True]
        with node_at(other_socket):
            pass


def test_a_second_node_of_a_name_is_refused_before_either_holds_a_slab(
        socket_path: Path, node_name: str,
        node_at: Callable[..., AbstractContextManager[NodeServer]]) -> None:
    """Both started before any engine came (a host's reboot): the second is refused at its
    start, not at its first layout, where two first engines at once could race for the name's
    slab; once the first stops, the name is free again."""
    other_socket = socket_path.with_name("other.sock")
    with node_at(socket_path) as first:
        with pytest.raises(OSError, match="give each node its own --name"), \
                node_at(other_socket):
            pass
        _client, engine = connect(socket_path)
        assert put_chunks(engine, [0, 1]) == [True, True]
        assert len(shm_files(node_name)) == 1
        first.shutdown()
        first.shutdown()  # a second stop lets go of nothing that is not its own
        with node_at(other_socket), \
                pytest.raises(OSError, match="give each node its own --name"), \
                node_at(socket_path):
            pass


def test_a_file_at_the_socket_path_that_is_not_a_socket_is_never_replaced(
        socket_path: Path, node_at: Callable[..., AbstractContextManager[NodeServer]]) -> None:
    socket_path.write_text("an operator's file")
    with pytest.raises(OSError, match="is not a socket") as refused, node_at(socket_path):
        pass
    assert refused.value.errno == errno.EEXIST
    assert socket_path.read_text() == "an operator's file"


def test_a_stopping_node_leaves_a_successors_socket(
        socket_path: Path, node_name: str,
        node_at: Callable[..., AbstractContextManager[NodeServer]]) -> None:
    """Its socket file removed by hand while it ran, and a node of another name started at the
    path: the first one's stop removes only its own file."""
    with node_at(socket_path) as first:
        socket_path.unlink()
        with node_at(socket_path, name=f"{node_name}-b") as successor:
            first.shutdown()
            assert socket_path.exists()
            client, engine = connect(socket_path)
            assert put_chunks(engine, [0]) == [True]
            assert client.welcome is not None
            assert client.welcome.node == successor.config.name
    assert not socket_path.exists()


@contextlib.contextmanager
def stopped_listener(path: Path) -> Iterator[None]:
    """A process that listens at `path` and never accepts (a node stopped with SIGSTOP), its
    queue of connections full: a connect there blocks."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    listener.listen(0)
    pending = []
    try:
        while True:
            queued = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            queued.setblocking(False)
            try:
                queued.connect(str(path))
            except BlockingIOError:
                queued.close()
                break
            pending.append(queued)
        yield
    finally:
        for queued in pending:
            queued.close()
        listener.close()


def test_a_start_beside_a_node_that_stopped_answering_is_refused_not_hung(
        socket_path: Path, node_at: Callable[..., AbstractContextManager[NodeServer]]) -> None:
    """Before: the start's probe of the socket waited in connect() for ever."""
    with stopped_listener(socket_path):
        with pytest.raises(OSError, match="does not accept") as refused, node_at(socket_path):
            pass
        assert refused.value.errno == errno.EADDRINUSE
        assert socket_path.exists()


def test_engines_that_connect_at_once_are_all_answered(
        socket_path: Path, node_at: Callable[..., AbstractContextManager[NodeServer]]) -> None:
    """48 engines' first calls at once (their node restarted). Before: the node's queue of
    connections held 5; the rest were refused (EAGAIN) and missed for their back-off."""
    with node_at(socket_path):
        _client, engine = connect(socket_path)
        assert put_chunks(engine, [0]) == [True]
        engines = [connect(socket_path, engine=f"engine-{i}", timeout_s=30)[1]
                   for i in range(48)]
        found: list[bool] = []
        start = threading.Barrier(len(engines))

        def ask(store: object) -> None:
            start.wait()
            found.append(store.contains(key(0)))  # type: ignore[attr-defined]

        threads = [threading.Thread(target=ask, args=(store,)) for store in engines]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert found == [True] * len(engines)


def test_a_node_that_fails_to_start_lets_go_of_its_name(
        tmp_path: Path, socket_path: Path, node_name: str,
        node_at: Callable[..., AbstractContextManager[NodeServer]]) -> None:
    """Its events endpoint cannot be bound: the start fails, and the name is free (it was
    held, its lock file left in /dev/shm, until the process ended)."""
    config = NodeConfig(StoreConfig.parse({"tiers": [{"kind": "memory", "capacity": "1MiB"}]}),
                        socket_path, name=node_name,
                        events_endpoint=f"ipc://{tmp_path}/no-such-directory/events")
    with pytest.raises(OSError):
        NodeServer(config)
    assert not (SHM_DIR / f"kvtier-{node_name}.lock").exists()
    with node_at(socket_path):
        pass
