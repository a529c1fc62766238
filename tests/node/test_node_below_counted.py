"""An engine's counters of its traffic with the node say which of the node's tiers served it,
as the engine's two tiers `node` (the node's RAM) and `node-below` (its tiers below RAM): the
chunks a load was lent from below RAM are `node-below`'s hits and bytes read (and its share of
the load's time), a store RAM had no slot for, sent for the tiers below it, is
`node-below`'s write. Before, every hit and byte was the `node` tier's and `node-below`'s
counters (exported on the engine's /metrics as `vllm:kvtier_tier_hits_total{tier=
"node-below"}`, ...) stayed at 0, while the scheduler's `tier_hit_decisions` counted those
very chunks as `node-below`'s.

An in-process node (`running_node`) with RAM and a disk tier.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path

import pytest
from nodekit import LAYOUT, borrower, connect, key, node_tiers, put_chunks, wait_for

from kvtier.core.tier import TierStats
from kvtier.node.server import NodeServer

pytestmark = pytest.mark.timeout(120)
CHUNK = LAYOUT.bytes_per_chunk


def _node_tier(node: NodeServer, index: int) -> dict[str, object]:
    (layout,) = node.status()["layouts"].values()
    return dict(layout["tiers"][index])


def _tiers(stats: tuple[TierStats, ...]) -> dict[str, TierStats]:
    return {tier.name: tier for tier in stats}


def test_chunks_lent_from_below_the_nodes_ram_are_node_belows_hits(
        tmp_path: Path, in_process_node: Callable[..., AbstractContextManager[NodeServer]]):
    with in_process_node(node_tiers(tmp_path, ram_chunks=4, disk_chunks=16)) as node:
        client, engine = connect(node.config.socket_path)
        assert put_chunks(engine, range(4)) == [True] * 4
        assert put_chunks(engine, range(4, 8)) == [True] * 4  # RAM keeps these 4
        wait_for(lambda: _node_tier(node, 1)["chunks"] == 8, 10, "the disk tier's writes")
        assert engine.stats().tiers[0].puts == 8
        store = borrower(client)  # knows no slot: a Borrow, answered from RAM and below it
        served: list[str] = []
        with store.lend_as_landed([key(i) for i in range(8)],
                                  [memoryview(bytearray(CHUNK))], in_order=True) as lending:
            for loan in lending:
                with loan:
                    served.append(loan.view.tier)
        assert len(served) == 8
        from_below = served.count("node-below")
        assert from_below >= 4  # chunks 0-3 had left RAM: the disk tier's
        assert from_below == _node_tier(node, 1)["hits"]  # as the node counts them
        tiers = _tiers(store.stats().tiers)
        assert set(tiers) == {"node", "node-below"}
        assert (tiers["node-below"].hits, tiers["node-below"].bytes_read) == (
            from_below, from_below * CHUNK)
        assert (tiers["node"].hits, tiers["node"].bytes_read) == (
            8 - from_below, (8 - from_below) * CHUNK)
        assert tiers["node-below"].read_s > 0
        assert tiers["node"].misses == tiers["node-below"].misses == 0


def test_a_store_ram_declines_is_node_belows_write(
        tmp_path: Path, in_process_node: Callable[..., AbstractContextManager[NodeServer]]):
    config = node_tiers(tmp_path, ram_chunks=8, disk_chunks=16)
    config["tiers"][0]["admit_after"] = 2  # RAM takes a chunk at its second offer
    with in_process_node(config) as node:
        _, engine = connect(node.config.socket_path)
        assert put_chunks(engine, range(3)) == [False] * 3  # SEND: to the disk tier
        assert put_chunks(engine, [10]) == [False]
        assert put_chunks(engine, [10]) == [True]  # its second offer: RAM takes it
        tiers = _tiers(engine.stats().tiers)
        assert (tiers["node-below"].puts, tiers["node-below"].bytes_written) == (4, 4 * CHUNK)
        assert (tiers["node"].puts, tiers["node"].bytes_written) == (1, CHUNK)
        assert node.status()["counters"]["received_chunks"] == 4
