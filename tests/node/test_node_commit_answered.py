"""A step's last commit reaching a node that no longer holds its slot (the node restarted
between the step's Reserve and its last commit): the node answers that it committed nothing,
and the engine does not report the chunk stored. Before, the engine's call, finding its
connection closed, sent the commit again on a new connection to the new node, which ignored
it (not that connection's lease) and answered True: the engine counted stored, and told
vLLM so, a chunk no node had.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path

from nodekit import connect, node_tiers, payload, put_chunks
from tierkit import key

from kvtier.core.retention import DEFAULT_META
from kvtier.node.server import NodeServer


def test_a_last_commit_the_node_did_not_apply_is_not_reported_stored(
        tmp_path: Path, socket_path: Path,
        in_process_node: Callable[..., AbstractContextManager[NodeServer]]) -> None:
    config = node_tiers(tmp_path, ram_chunks=4)
    # retry_s: its hang-up watch asks nothing during the test (the old slab is not let go).
    client, store = connect(socket_path, retry_s=60.0)
    try:
        with in_process_node(config):
            assert put_chunks(store, [0]) == [True]  # the normal case, answered True
            store.plan_puts([key(1)], [DEFAULT_META])  # the step's Reserve
        with in_process_node(config) as restarted:
            spare = memoryview(bytearray(len(payload(1))))

            def fill(slot: memoryview) -> None:
                slot[:] = payload(1)

            # Its slot was the old node's: the new one commits nothing, and says so.
            assert store.put_from(key(1), fill, spare) is False
            assert restarted.counters.snapshot()["committed_chunks"] == 0
            assert store.stats().tiers[0].puts == 1  # chunk 0's only
    finally:
        client.close()
