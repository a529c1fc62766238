"""A chunk the node's RAM has no slot for still reaches the tiers below it, as in process: the
node answers SEND and the engine sends the bytes with its commit (a copy over the socket,
where a RAM slot costs none); and one read from below RAM that RAM has no slot for comes back
with the node's reply. Two ways RAM has no slot: its admission filter declines a
chunk's first offer (`admit_after`), and every slot is lent. The chunk comes back later from
the disk tier, through RAM, with its bytes; it is not reported stored (it is not in RAM, as in
process) and the node counts it received. A node without a tier below RAM answers SKIPPED:
nothing is sent.

An in-process node (`running_node`): what the tiers do with a store RAM declines is tested,
not the process boundary.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import pytest
from nodekit import connect, expected, key, lend, node_tiers, put_chunks, wait_for

from kvtier.node.server import NodeServer

pytestmark = pytest.mark.timeout(120)


def _disk_tier(node: NodeServer) -> dict[str, Any]:
    (layout,) = node.status()["layouts"].values()
    tier: dict[str, Any] = layout["tiers"][1]
    return tier


def test_a_chunk_ram_declines_is_sent_to_the_disk_tier_and_comes_back(
        tmp_path: Path, in_process_node: Callable[..., AbstractContextManager[NodeServer]]):
    config = node_tiers(tmp_path, ram_chunks=8, disk_chunks=16)
    config["tiers"][0]["admit_after"] = 2  # RAM takes a chunk at its second offer
    with in_process_node(config) as node:
        _, engine = connect(node.config.socket_path)
        # First offer: RAM declines, the bytes go below it (not reported stored: not in RAM).
        assert put_chunks(engine, range(3)) == [False] * 3
        counters = node.status()["counters"]
        assert (counters["received_chunks"], counters["committed_chunks"]) == (3, 3)
        assert node.status()["leases"] == 0
        wait_for(lambda: _disk_tier(node)["chunks"] == 3, 10, "the disk tier's writes")
        assert engine.stats().tiers[0].dropped_writes == 0
        # They come back from the disk through RAM, whole, in a Borrow timed as one from
        # below RAM (kvtier_node_borrow_seconds{source="below"}).
        assert lend(engine, [key(i) for i in range(3)]).chunks == expected(range(3))
        borrows = node.status()["borrow_seconds"]
        assert (borrows["below"]["count"], borrows["ram"]["count"]) == (1, 0)
        assert borrows["below"]["sum"] > 0


def test_a_store_into_a_ram_all_lent_goes_below_it(
        tmp_path: Path, in_process_node: Callable[..., AbstractContextManager[NodeServer]]):
    with in_process_node(node_tiers(tmp_path, ram_chunks=4, disk_chunks=16)) as node:
        _, engine = connect(node.config.socket_path)
        assert put_chunks(engine, range(4)) == [True] * 4
        keys = [key(i) for i in range(4)]
        with engine.lend_as_landed(keys, [memoryview(bytearray(4096))]) as lending:
            loans = list(lending)  # every RAM slot lent
            assert put_chunks(engine, [50]) == [False]  # SEND: to the disk, not RAM
            for loan in loans:
                loan.release()
        assert node.status()["counters"]["received_chunks"] == 1
        wait_for(lambda: _disk_tier(node)["chunks"] == 5, 10, "the disk tier's writes")
        assert lend(engine, [key(50)]).chunks == expected([50])


def test_a_node_with_ram_only_asks_for_no_bytes(
        tmp_path: Path, in_process_node: Callable[..., AbstractContextManager[NodeServer]]):
    config = node_tiers(tmp_path, ram_chunks=4)
    config["tiers"][0]["admit_after"] = 2
    with in_process_node(config) as node:
        _, engine = connect(node.config.socket_path)
        assert put_chunks(engine, [1]) == [False]  # SKIPPED: nothing would store it
        assert engine.stats().tiers[0].dropped_writes == 1
        assert node.status()["counters"]["received_chunks"] == 0
        assert lend(engine, [key(1)]).chunks == []


def test_a_load_ram_has_no_slot_for_comes_with_the_reply(
        tmp_path: Path, in_process_node: Callable[..., AbstractContextManager[NodeServer]]):
    with in_process_node(node_tiers(tmp_path, ram_chunks=4, disk_chunks=16)) as node:
        _, engine = connect(node.config.socket_path)
        # One step of 8: RAM takes 4, the other 4 are sent below it; the disk gets all 8.
        assert put_chunks(engine, range(8)) == [True] * 4 + [False] * 4
        wait_for(lambda: _disk_tier(node)["chunks"] == 8, 10, "the disk tier's writes")
        in_ram = [key(i) for i in range(4)]
        with engine.lend_as_landed(in_ram, [memoryview(bytearray(4096))]) as lending:
            # Every RAM slot held (read in place: this engine stored them), none for a
            # promotion.
            loans = list(lending)
            assert len(loans) == 4
            # Chunks 4-7 are read from the disk into the node's spares: their bytes come back
            # in the reply, whole and in order.
            assert lend(engine, [key(i) for i in range(4, 8)]).chunks == \
                [(i, chunk) for i, (_, chunk) in enumerate(expected(range(4, 8)))]
            for loan in loans:
                loan.release()
        wait_for(lambda: node.status()["counters"]["read_in_place"] == 4, 10,
                 "the reads in place told")
        counters = node.status()["counters"]
        assert (counters["sent_chunks"], counters["lent_chunks"]) == (4, 0)
        wait_for(lambda: node.status()["leases"] == 0, 10, "every lease ended")
