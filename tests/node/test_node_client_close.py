"""`NodeClient.close` ends every thread's connection, not only its caller's: the scheduler asks
the node on its own thread and on its probe threads, and a scheduler side replaced at vLLM's
handshake (tests/connector/test_handshake_rebuild.py) left the others' connections open, each
a session on the node. A closed client asks nothing more (a miss, NodeUnavailable), and a
second close does nothing.

An in-process node; the engine's threads are plain threads of the test.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path

import pytest
from nodekit import connect, key, node_tiers, wait_for

from kvtier.errors import NodeUnavailable
from kvtier.node.probe import NodeProbe
from kvtier.node.server import NodeServer

pytestmark = pytest.mark.timeout(60)
Node = Callable[..., AbstractContextManager[NodeServer]]


def test_close_ends_the_connections_of_every_thread(tmp_path: Path,
                                                    in_process_node: Node) -> None:
    with in_process_node(node_tiers(tmp_path, ram_chunks=4)) as node:
        client, _store = connect(node.config.socket_path)
        probe = NodeProbe([client])
        asked, done = threading.Event(), threading.Event()

        def probe_thread() -> None:  # asks once, then lives on (its connection with it)
            probe.contains_many([key(0)])
            asked.set()
            done.wait(30)

        other = threading.Thread(target=probe_thread)
        other.start()
        try:
            assert asked.wait(10)
            assert probe.contains_many([key(0)]) == [False]  # this thread's connection
            wait_for(lambda: node.status()["connections"] == 2, 10, "both connections")
            client.close()
            wait_for(lambda: node.status()["connections"] == 0, 10, "every connection ended")
            with pytest.raises(NodeUnavailable):
                probe.contains_many([key(0)])
            probe.close()  # closes the client again: nothing
            assert node.status()["connections"] == 0
        finally:
            done.set()
            other.join()


def test_close_ends_the_watch_of_a_node_down(socket_path: Path) -> None:
    """A client marked down watches the node (`Status` every retry_s) until it answers; a
    closed client asks nothing any more, so its watch ends at its next tick. Before: the
    watch thread polled the socket of a node that never came back for the process's life."""
    client, _store = connect(socket_path, timeout_s=0.2, retry_s=0.05)  # no node there
    before = set(threading.enumerate())
    with pytest.raises(NodeUnavailable):
        NodeProbe([client]).contains_many([key(0)])
    watches = [t for t in set(threading.enumerate()) - before
               if t.name == "kvtier-node-watch"]
    assert len(watches) == 1, "the client is marked down, its watch running"
    client.close()
    wait_for(lambda: not watches[0].is_alive(), 10, "the closed client's watch to end")
