"""The node's cache as its engines see it: chunks stored through one round trip per step
(`plan_puts`, `put_from`) are lent back in order with their bytes, up to the first miss; one
engine's chunks are lent to another of the same layout (the point of a node: one cache for
every engine on it), never to an engine of another layout (another namespace, another slab);
and chunks pushed below RAM come back through RAM (promotion), since an engine can only see
the node's RAM slab.

A real `kvtier node serve` process where sharing crosses processes; `running_node` for
promotion (the tiers' work, not the process boundary, is what is tested there).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path

import pytest
from nodekit import (
    LAYOUT,
    OTHER_LAYOUT,
    NodeProcess,
    connect,
    expected,
    key,
    lend,
    memory_tier,
    node_tiers,
    payload,
    put_chunks,
    wait_for,
)

from kvtier.node.probe import NodeProbe
from kvtier.node.server import NodeServer
from kvtier.tiers.shmslab import SHM_DIR

pytestmark = pytest.mark.timeout(120)  # a hang fails here, not at the suite's 900 s

MISSING = 99  # a chunk no test stores


def test_chunks_stored_by_one_engine_are_lent_to_another_of_its_layout_only(
        tmp_path: Path, start_node: Callable[..., NodeProcess]):
    node = start_node(node_tiers(tmp_path, ram_chunks=16))
    client_a, engine_a = connect(node.socket_path)
    client_b, engine_b = connect(node.socket_path)
    keys = [key(i) for i in range(5)]

    # Engine A stores a step of five chunks: one Reserve, five fills in the node's slab.
    assert put_chunks(engine_a, range(5)) == [True] * 5
    assert NodeProbe([client_a]).contains_many([*keys, key(MISSING)]) == [True] * 5 + [False]

    # They come back in order with their bytes, in one round trip.
    lent = lend(engine_a, keys)
    assert lent.chunks == expected(range(5))
    assert (lent.stopped_at, lent.failed_tier) == (5, None)

    # A run stops at its first miss: chunk 3 is held, but not lent past the gap.
    lent = lend(engine_a, [key(0), key(1), key(MISSING), key(3)])
    assert lent.chunks == expected([0, 1])
    assert (lent.stopped_at, lent.failed_tier) == (2, None)

    # Engine B (same layout, its own connection) is lent A's chunks, and A is lent B's.
    assert lend(engine_b, keys).chunks == expected(range(5))
    assert put_chunks(engine_b, [5]) == [True]
    assert lend(engine_a, [key(5)]).chunks == expected([5])
    assert client_a.welcome is not None and client_b.welcome is not None
    assert client_a.welcome.shm_path == client_b.welcome.shm_path

    # Engine C, of another layout: its own namespace (A's keys are not there) and slab.
    client_c, engine_c = connect(node.socket_path, OTHER_LAYOUT)
    assert NodeProbe([client_c]).contains_many(keys) == [False] * 5
    lent = lend(engine_c, keys, OTHER_LAYOUT.bytes_per_chunk)
    assert (lent.chunks, lent.stopped_at) == ([], 0)
    other_bytes = OTHER_LAYOUT.bytes_per_chunk
    assert put_chunks(engine_c, [100], other_bytes) == [True]
    assert client_c.welcome is not None
    assert client_c.welcome.shm_path != client_a.welcome.shm_path
    assert {Path(client_a.welcome.shm_path).parent, Path(client_c.welcome.shm_path).parent} \
        == {SHM_DIR}
    assert lend(engine_c, [key(100)], other_bytes).chunks == [(0, payload(100, other_bytes))]
    assert NodeProbe([client_a]).contains_many([key(100)]) == [False]
    # A chunk counts for a scheduler when the node holds it for every layout (TP rank).
    assert NodeProbe([client_a, client_c]).contains_many([key(0), key(100)]) == [False, False]

    status = node.status()
    assert set(status["layouts"]) == {LAYOUT.digest(), OTHER_LAYOUT.digest()}
    assert memory_tier(status)["chunks"] == 6
    assert memory_tier(status, OTHER_LAYOUT)["chunks"] == 1
    for client in (client_a, client_b, client_c):
        client.close()
    wait_for(lambda: node.status()["leases"] == 0, 10, "every lease released")


def test_chunks_below_ram_are_promoted_into_it_when_borrowed(
        tmp_path: Path, in_process_node: Callable[..., AbstractContextManager[NodeServer]]):
    with in_process_node(node_tiers(tmp_path, ram_chunks=3, disk_chunks=32)) as node:
        client, engine = connect(node.config.socket_path)
        # Steps of at most RAM's three slots (a step's slots are reserved at once).
        for step in ([0, 1, 2], [3, 4, 5]):
            assert put_chunks(engine, step) == [True] * 3
        assert engine.flush(timeout_s=10)  # the writes behind RAM are on disk
        ram, disk = node.status()["layouts"][LAYOUT.digest()]["tiers"]
        assert (ram["chunks"], disk["chunks"]) == (3, 6)
        every_tier = NodeProbe([client], ram_only=False)
        assert every_tier.contains_many([key(i) for i in range(6)]) == [True] * 6

        # Chunks 0-2 were evicted from RAM: read from disk into RAM slots, lent there.
        lent = lend(engine, [key(0), key(1), key(2)])
        assert (lent.chunks, lent.stopped_at) == (expected([0, 1, 2]), 3)
        wait_for(lambda: node.status()["leases"] == 0, 10, "the loans released")
        ram_after, disk_after = node.status()["layouts"][LAYOUT.digest()]["tiers"]
        assert disk_after["hits"] == disk["hits"] + 3

        # Promoted: lent from RAM the next time, without reading the disk again.
        assert lend(engine, [key(0), key(1), key(2)]).chunks == expected([0, 1, 2])
        # (RAM counts a hit when the loan ends: the release is sent without waiting.)
        wait_for(lambda: memory_tier(node.status())["hits"] == ram_after["hits"] + 3, 10,
                 "three RAM hits")
        assert node.status()["layouts"][LAYOUT.digest()]["tiers"][1]["hits"] \
            == disk_after["hits"]
        client.close()
