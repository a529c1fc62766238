"""The number the node knows a connection by (its leases' owner, its engine, a quarantine of
a frozen engine's leases) is never another connection's. It was the `id()` of the
connection's handler object, which CPython hands to the next object once the handler is
gone: of 100 connections one after another, 46 numbers. A connection that came after a
quarantined one (node/quarantine.py: its engine frozen, its reserved slots kept until its
process is gone) could so be the quarantined one to the node: its leases shown as the
frozen engine's, kept with them past its own end, and ended with them when the frozen
process went (its commits not applied; a slot it still wrote given to another chunk).

An in-process node; the numbers are read as the node is told of each connection (`opened`),
observed, not changed.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path

import pytest
from nodekit import node_tiers

from kvtier.node.client import node_status
from kvtier.node.server import NodeServer

CONNECTIONS = 100


def test_each_connection_has_a_number_of_its_own(
        tmp_path: Path, socket_path: Path, monkeypatch: pytest.MonkeyPatch,
        in_process_node: Callable[..., AbstractContextManager[NodeServer]]) -> None:
    owners: list[int] = []
    opened = NodeServer.opened

    def observed(node: NodeServer, owner: int, sock: object) -> None:
        owners.append(owner)
        opened(node, owner, sock)  # type: ignore[arg-type]

    monkeypatch.setattr(NodeServer, "opened", observed)
    with in_process_node(node_tiers(tmp_path, ram_chunks=4)):
        # Connections one after another, each gone before the next comes.
        for _ in range(CONNECTIONS):
            node_status(str(socket_path))
    assert len(owners) == CONNECTIONS
    assert len(set(owners)) == CONNECTIONS
