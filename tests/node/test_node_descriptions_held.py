"""A chunk's description (its token ids, for the node's stored events) is kept as long as a
tier of the node holds the chunk, however many chunks the engines describe meanwhile: a
chunk pushed out of RAM, its description followed by 16,384 others', and read back from disk
into RAM, is announced stored in RAM again, with its tokens. Before, the node kept the last
16,384 descriptions of a model only: the move back into RAM went out unannounced
(`stored_unannounced`), and routers never learnt the chunk was in RAM again."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
from eventsub import Subscriber
from nodekit import (
    LAYOUT,
    NodeProcess,
    connect,
    expected,
    key,
    lend,
    node_tiers,
    put_chunks,
    wait_for,
)

from kvtier.core.keys import ChunkKey
from kvtier.node.probe import NodeProbe
from kvtier.tiers.eventfacts import ChunkInfo

pytest.importorskip("vllm.distributed.kv_events")  # the subscriber's decoder
pytestmark = pytest.mark.timeout(180)

TPC = LAYOUT.tokens_per_chunk
FLOOD = 16384 + 100  # descriptions of other chunks, more than the node kept


@pytest.fixture
def subscriber() -> Iterator[Subscriber]:
    sub = Subscriber()
    yield sub
    sub.close()


def info(i: int) -> ChunkInfo:
    return ChunkInfo(None, np.arange(i * TPC, (i + 1) * TPC, dtype="<i4").tobytes(), None, None)


def ram_stores(subscriber: Subscriber, chunk: ChunkKey) -> list[list[int]]:
    """The token ids of every BlockStored of `chunk` in the node's RAM."""
    return [list(e.token_ids) for _, e in subscriber.events()
            if type(e).__name__ == "BlockStored" and chunk in e.block_hashes
            and e.medium == "CPU"]


def test_a_chunk_read_back_into_ram_is_announced_after_many_descriptions(
        tmp_path: Path, start_node: Callable[..., NodeProcess], subscriber: Subscriber) -> None:
    node = start_node(node_tiers(tmp_path, ram_chunks=2, disk_chunks=16),
                      args=("--events-endpoint", subscriber.endpoint))
    subscriber.wait_connected()
    client, engine = connect(node.socket_path)
    probe = NodeProbe([client])
    assert probe.publishes_events()
    probe.describe({key(0): info(0)})
    assert put_chunks(engine, [0]) == [True]
    # In RAM, then written behind to disk: two stored events, with its tokens.
    wait_for(lambda: node.status()["counters"]["events_stored"] >= 2, 30, "RAM and disk")
    assert ram_stores(subscriber, key(0)) == [list(range(TPC))]
    # Busy engines describe many other chunks (never stored here).
    for start in range(1000, 1000 + FLOOD, 4096):
        probe.describe({key(i): info(i) for i in range(start, min(start + 4096, 1000 + FLOOD))})
    wait_for(lambda: node.status()["counters"]["described_chunks"] >= FLOOD + 1, 30,
             "the descriptions taken")
    # Two chunks no one described push chunk 0 out of RAM; it stays on disk.
    assert put_chunks(engine, [1, 2]) == [True, True]
    wait_for(lambda: node.status()["counters"]["events_removed"] >= 1, 30, "chunk 0 out of RAM")
    assert not probe.contains_many([key(0)])[0]  # not in RAM (the probe asks RAM only)
    # Read back: from disk, into RAM again, announced with its tokens.
    assert lend(engine, [key(0)]).chunks == expected([0])
    wait_for(lambda: len(ram_stores(subscriber, key(0))) == 2, 30,
             "chunk 0 announced stored in RAM again")
    assert ram_stores(subscriber, key(0))[1] == list(range(TPC))
    # Chunks 1 and 2, in RAM and on disk (their writes behind may land after the read).
    wait_for(lambda: node.status()["counters"]["stored_unannounced"] >= 4, 30, "1 and 2")
    assert node.status()["counters"]["stored_unannounced"] == 4
    engine.close()
