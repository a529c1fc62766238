"""A stalled engine that checks stamps and held nothing the node keeps (only its load's
lending, taken back with the connection): its connection's thread awaits the engine's
hang-up, reading and dropping what it sends, with no quarantine left to name its socket.
Before, the node's stop shut the sockets of open and quarantined connections only: that
thread, and its socket, stayed for as long as the frozen engine lived, past the node's end
(an in-process node: a thread and an fd per stalled engine, the engine's writes read by a
node that was gone). Now the node's stop ends it too: the engine's next sends fail.
"""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
from nodekit import connect, key, node_tiers, put_chunks, wait_for

from kvtier.core.retention import DEFAULT_META
from kvtier.node.config import NodeConfig
from kvtier.node.protocol import Borrow, Meta, send
from kvtier.node.server import running_node
from kvtier.tiers.storeconfig import StoreConfig

pytestmark = pytest.mark.timeout(120)
RAM, DISK, LOADED = 8, 600, 512  # chunks: the load's reply carries most of 512 x 4 KiB


def _peer_gone(sock: socket.socket) -> bool:
    """Whether a send on `sock` finds the node's end closed (not merely shut for writing:
    a node's thread still reading takes it)."""
    try:
        sock.send(b"\0" * 4096)
    except (BrokenPipeError, ConnectionResetError):
        return True
    return False


def test_the_node_stop_ends_a_stalled_connection_awaiting_its_hang_up(
        tmp_path: Path, socket_path: Path, node_name: str) -> None:
    config = NodeConfig(StoreConfig.parse(node_tiers(tmp_path, RAM, DISK)), socket_path,
                        name=node_name, lease_timeout_s=1.0)
    with running_node(config) as node:
        neighbour_client, neighbour = connect(socket_path, engine="neighbour")
        assert sum(put_chunks(neighbour, range(LOADED))) == RAM
        assert neighbour.flush(30)
        neighbour_client.close()
        client, _store = connect(socket_path, engine="frozen", timeout_s=30.0)
        sock = client._connection()  # its Hello said (stamps checked)
        send(sock, Borrow([key(i) for i in range(LOADED)],
                          [Meta.of(DEFAULT_META)] * LOADED))  # its reply never read
        wait_for(lambda: node.status()["counters"].get("send_timeouts") == 1, 30,
                 "the node to give up its reply")
        # Nothing kept: its lending was taken back with the connection.
        wait_for(lambda: "frozen" not in node.status()["held"], 30, "its lending ended")
        assert node.status()["quarantined"] == {}
    sock.settimeout(5.0)
    wait_for(lambda: _peer_gone(sock), 30, "the stopped node's end of the stalled connection "
             "closed")
    client.close()
