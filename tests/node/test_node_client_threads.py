"""A node client used by threads that come and go: each thread's connection (and slab reader)
is its own, and a thread's end closed neither. A caller whose pool replaces its threads kept
one connection a thread open until `close`: its fd in the engine and on the node, a session
in the node's status, and whatever leases it held (a leak soak: 100 short-lived threads, 100
connections). Now the connections of threads that ended are closed as another connects.

An in-process node (its sockets are this process's fds too); the threads are the test's.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path

import pytest
from nodekit import connect, key, lend, node_tiers, put_chunks, wait_for

from kvtier.node.server import NodeServer

pytestmark = pytest.mark.timeout(120)
Node = Callable[..., AbstractContextManager[NodeServer]]
THREADS = 200
SLACK_FDS = 8  # the last thread's connection (closed when the next connects), and spares


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_the_connections_of_threads_that_ended_do_not_pile_up(
        tmp_path: Path, in_process_node: Node) -> None:
    with in_process_node(node_tiers(tmp_path, ram_chunks=16)) as node:
        client, store = connect(node.config.socket_path)
        put_chunks(store, range(4))  # this thread's connection, its chunks read in place
        lend(store, [key(1), key(2)])
        before = open_fds()

        def one_call(i: int) -> None:  # a load (in place: a slab reader) and a store
            lend(store, [key(1), key(2)])
            put_chunks(store, [100 + i % 8])

        for i in range(THREADS):
            thread = threading.Thread(target=one_call, args=(i,))
            thread.start()
            thread.join()
        assert open_fds() <= before + SLACK_FDS, "a connection kept per ended thread"
        wait_for(lambda: node.status()["connections"] <= 2, 10,
                 "this thread's connection and the last one's")
        client.close()
        wait_for(lambda: node.status()["connections"] == 0, 10, "every connection ended")
