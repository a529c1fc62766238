"""A store step that names a chunk twice (as a mover's step may): the chunk is reserved once,
its second store is a round trip of its own (held: the first committed it), and the step's
other chunks keep the slots reserved for them. Before, the step's Reserve reserved the chunk
twice and the engine kept only the second slot: the first was never committed nor given back
(held by the engine until its connection ended); and the second store's own round trip gave
back every slot of the step not filled yet, so each chunk after it was a round trip too.

A real node, in process.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path

from nodekit import connect, expected, key, lend, node_tiers, put_chunks

from kvtier.node.server import NodeServer


def test_a_chunk_twice_in_a_step_is_reserved_once_and_the_rest_keep_their_slots(
        tmp_path: Path, socket_path: Path,
        in_process_node: Callable[..., AbstractContextManager[NodeServer]]) -> None:
    with in_process_node(node_tiers(tmp_path, ram_chunks=8)) as node:
        client, store = connect(socket_path, engine="engine")
        try:
            # Chunk 1's second store finds it held (stored by its first).
            assert put_chunks(store, [1, 2, 1, 3, 4]) == [True] * 5
            # Nothing is left reserved once the step is done.
            assert node.status()["held"] == {}
            # 4 slots for the step (none for chunk 1's second store: held), and not one more
            # for the chunks after it.
            assert node.status()["counters"]["reserved_chunks"] == 4
            assert lend(store, [key(i) for i in (1, 2, 3, 4)]).chunks == expected([1, 2, 3, 4])
        finally:
            client.close()
