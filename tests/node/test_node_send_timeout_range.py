"""A node whose lease_timeout_s is past a C long's seconds (1e20: "never take a lending
back", which the config accepts: a finite number above 0). Each connection's send timeout
(`SO_SNDTIMEO`) is set from it as the connection opens; packed as given, it overflowed, and
every connection was closed as it opened: the node started, and served no engine, not even
its status. Now the send timeout is the longest a timeval holds.

An in-process node and a real engine's client.
"""

from __future__ import annotations

from pathlib import Path

from nodekit import connect, expected, key, lend, node_tiers, put_chunks

from kvtier.node.client import node_status
from kvtier.node.config import NodeConfig
from kvtier.node.server import running_node
from kvtier.tiers.storeconfig import StoreConfig


def test_a_lease_timeout_past_a_long_serves_engines(
        tmp_path: Path, socket_path: Path, node_name: str) -> None:
    config = NodeConfig(StoreConfig.parse(node_tiers(tmp_path, ram_chunks=4)), socket_path,
                        name=node_name, lease_timeout_s=1e20)
    with running_node(config):
        assert node_status(str(socket_path), timeout_s=5)["engines"] == []
        client, store = connect(socket_path, engine="engine")
        assert put_chunks(store, [1, 2]) == [True, True]
        assert lend(store, [key(1), key(2)]).chunks == expected([1, 2])
        client.close()
