"""The scheduler's two lookups through the node, as in process: its RAM asked inline (an
index lookup: never waits for a tier below RAM, which may be a remote store over a slow
link), every tier asked off the scheduler's thread (`NodeProbe(ram_only=False)`,
`blocking_ok` False), built only where the node has tiers below RAM. A load names the node's
tier it came from as the engine's RAM_TIER or BELOW_TIER (the load-or-recompute rule's
costs), and the node's remote tiers' links are the prior of BELOW_TIER.

An in-process node (`running_node`); a tier below RAM that stalls is a fault injected by
patching its lookup.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import pytest
from nodekit import connect, key, node_tiers, put_chunks, wait_for

from kvtier.core.keys import ChunkKey
from kvtier.core.locator import ChunkLocator, Located
from kvtier.core.tier import LinkSpeed
from kvtier.errors import NodeUnavailable
from kvtier.node.links import LINK_WINDOW
from kvtier.node.nodestore import NodeStore
from kvtier.node.probe import NodeProbe
from kvtier.node.protocol import BELOW_TIER, RAM_TIER
from kvtier.node.server import NodeServer

pytestmark = pytest.mark.timeout(120)
Node = Callable[..., AbstractContextManager[NodeServer]]


def _store_twice_ram(engine: NodeStore) -> None:
    """Store chunks 0-7 in two steps into a RAM of 4 slots: 0-3 evicted (on the disk)."""
    assert put_chunks(engine, range(4)) == [True] * 4
    assert put_chunks(engine, range(4, 8)) == [True] * 4


def _evicted_to_disk(node: NodeServer, ids: range) -> None:
    """Wait until the disk tier below RAM holds chunks `ids`."""
    (layout,) = node.layouts.served().values()
    disk = layout.store.tiers[1]
    wait_for(lambda: all(disk.contains(key(i)) for i in ids), 10, "the disk tier's writes")


def test_ram_lookup_never_asks_the_tiers_below(tmp_path: Path, in_process_node: Node,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    with in_process_node(node_tiers(tmp_path, ram_chunks=4, disk_chunks=16)) as node:
        client, engine = connect(node.config.socket_path, timeout_s=30)
        _store_twice_ram(engine)
        _evicted_to_disk(node, range(8))
        ram, every = NodeProbe([client]), NodeProbe([client], ram_only=False)
        assert (ram.blocking_ok, every.blocking_ok, ram.below_ram()) == (True, False, True)
        assert ram.contains_many([key(i) for i in range(8)]) == [False] * 4 + [True] * 4
        assert every.contains_many([key(i) for i in range(8)]) == [True] * 8

        # The disk tier stalls (a remote store over a dead link): the RAM lookup answers.
        (layout,) = node.layouts.served().values()
        release, asked = threading.Event(), threading.Event()

        def stalled(_key: ChunkKey) -> bool:
            asked.set()
            release.wait(30)
            return True

        monkeypatch.setattr(layout.store.tiers[1], "contains", stalled)
        assert ram.contains_many([key(0), key(7)]) == [False, True]
        assert not asked.is_set()
        asking = threading.Thread(target=every.contains_many, args=([key(0)],))
        asking.start()
        assert asked.wait(10)  # the other lookup does ask it, on a connection of its own
        assert ram.contains_many([key(6)]) == [True]
        release.set()
        asking.join(30)


def test_a_slow_lookup_below_ram_is_not_a_node_down(tmp_path: Path, in_process_node: Node,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """A lookup of every tier that outlives its deadline (a remote store stalled) fails,
    and the node's RAM still answers at once: the node is not marked down (which would make
    every lookup and load a miss for `retry_s`)."""
    with in_process_node(node_tiers(tmp_path, ram_chunks=4, disk_chunks=16)) as node:
        # The deadline of the RAM lookups (3 s) is below the node's read deadline (5 s).
        client, engine = connect(node.config.socket_path, timeout_s=3, retry_s=60)
        client.slow_s = 0.5  # and the deadline of a lookup of every tier
        _store_twice_ram(engine)
        _evicted_to_disk(node, range(8))
        (layout,) = node.layouts.served().values()
        release = threading.Event()
        monkeypatch.setattr(layout.store.tiers[1], "contains",
                            lambda _key: release.wait(30))
        try:
            with pytest.raises(NodeUnavailable):  # no answer within 0.5 s: a miss
                NodeProbe([client], ram_only=False).contains_many([key(0)])
            assert NodeProbe([client]).contains_many([key(7)]) == [True]
            assert client.failures == 0
        finally:
            release.set()


def test_a_node_with_ram_only_needs_no_slow_lookup(tmp_path: Path, in_process_node: Node) -> None:
    with in_process_node(node_tiers(tmp_path, ram_chunks=4)) as node:
        client, _ = connect(node.config.socket_path)
        assert not NodeProbe([client]).below_ram()


def test_a_node_down_may_have_tiers_below_ram(tmp_path: Path) -> None:
    client, _ = connect(tmp_path / "no-node.sock", timeout_s=0.5)
    assert NodeProbe([client]).below_ram()  # asked again when it is back


def test_a_load_names_the_tier_it_came_from(tmp_path: Path, in_process_node: Node) -> None:
    with in_process_node(node_tiers(tmp_path, ram_chunks=4, disk_chunks=16)) as node:
        _, engine = connect(node.config.socket_path, timeout_s=30)
        _store_twice_ram(engine)
        _evicted_to_disk(node, range(8))
        _, other = connect(node.config.socket_path, timeout_s=30)  # knows no slot: borrows
        tiers = []
        with other.lend_as_landed([key(7), key(0)], [memoryview(bytearray(4096))],
                                  in_order=True) as lending:
            for loan in lending:
                with loan:
                    tiers.append(loan.view.tier)
        assert tiers == [RAM_TIER, BELOW_TIER]


def test_the_node_measures_its_remote_tiers_links(tmp_path: Path, in_process_node: Node,
                                                  redis_url: str,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """The node measures its tiers' links itself when asked (the first ask waits for the
    measure, the later ones get what is known and a measure in the background), and answers
    MeasureLinks with each tier's best of its last measures: one taken while the node is
    busy does not make the engines' prior slow."""
    config: dict[str, Any] = node_tiers(tmp_path, ram_chunks=4, disk_chunks=16)
    with in_process_node(config) as node:
        _, engine = connect(node.config.socket_path, timeout_s=30)
        assert engine.measure_links() == {}  # a small disk tier has no room to measure in
        assert engine.measure_links() == {}  # nor the next time (not measured again yet)
    config["tiers"].append({"kind": "redis", "url": redis_url, "capacity": "1MiB"})
    with in_process_node(config) as node:
        _, engine = connect(node.config.socket_path, timeout_s=30)
        links = engine.measure_links()  # the first ask: measured before the answer
        assert list(links) == [BELOW_TIER]
        (speed,) = links.values()
        assert 0 < speed.round_trip_s < 5 and speed.bytes_per_s > 0
        # A measure while the node is busy reads the link slow: the answer keeps the best of
        # the measures still in the window (the slow one pushed out the oldest).
        (layout,) = node.layouts.served().values()
        (window,) = layout.links._measures.values()
        measured = list(window)
        assert len(measured) == LINK_WINDOW and speed in measured
        slow = LinkSpeed(9.0, 1.0)
        monkeypatch.setattr(layout.store, "measure_links", lambda: {"redis": slow})
        monkeypatch.setattr(layout.links, "_measured_s", -float("inf"))  # a minute passed
        engine.measure_links()
        wait_for(lambda: not layout.links._running, 10, "the slow measure")
        (kept,) = engine.measure_links().values()
        assert kept == min(measured[1:], key=lambda s: s.read_s(layout.links._chunk_bytes))


def test_the_first_ask_answers_the_best_of_several_measures(tmp_path: Path,
                                                           in_process_node: Node,
                                                           monkeypatch: pytest.MonkeyPatch
                                                           ) -> None:
    """A node just started measures its links while it is busy (its store, its engines'
    first requests): one slow measure as the first answer made the engines judge its tiers
    slower than recompute, and every hit of a run was recomputed."""
    with in_process_node(node_tiers(tmp_path, ram_chunks=4, disk_chunks=16)) as node:
        client, engine = connect(node.config.socket_path, timeout_s=30)
        assert client.welcomed() is not None  # the layout's store is built
        (layout,) = node.layouts.served().values()
        fast = LinkSpeed(0.001, 1e9)
        measures = iter([LinkSpeed(9.0, 1.0), fast, LinkSpeed(5.0, 1.0)])
        monkeypatch.setattr(layout.store, "measure_links", lambda: {"disk": next(measures)})
        assert engine.measure_links() == {BELOW_TIER: fast}


def test_a_chunk_the_node_evicted_is_a_miss_not_a_stale_hit(tmp_path: Path,
                                                           in_process_node: Node) -> None:
    """Node mode's locator asks the node's RAM before its index of this engine's stores
    (`index_first` False): another engine's stores evict them from the node's RAM, and no
    report tells this engine. An evicted chunk is a miss, where the index would offer it (a
    failed load, recomputed). A node down: the index answers (its slab is read in place)."""
    with in_process_node(node_tiers(tmp_path, ram_chunks=4)) as node:
        client, engine = connect(node.config.socket_path, timeout_s=30, retry_s=60)
        _, neighbour = connect(node.config.socket_path, timeout_s=30, engine="neighbour")
        mine = [key(i) for i in range(4)]
        assert put_chunks(engine, range(4)) == [True] * 4
        locators = {first: ChunkLocator({RAM_TIER: NodeProbe([client])}, max_keys=100,
                                        index_first=first) for first in (True, False)}
        for locator in locators.values():
            locator.record_stored(mine)  # the worker's report
            assert locator.locate("a", mine) == Located.prefix(4)
        assert put_chunks(neighbour, range(10, 14)) == [True] * 4  # evicts every one of mine
        assert locators[False].locate("b", mine) == Located.prefix(0)
        assert locators[True].locate("b", mine) == Located.prefix(4)  # stale: what it fixes
        assert locators[False].first_held([key(3), key(12)]) == 1  # not the evicted one
        assert put_chunks(engine, range(2)) == [True] * 2
        assert locators[False].locate("c", mine) == Located.prefix(2)
    # The node is gone: what this engine stored (the index) is offered.
    assert locators[False].locate("d", mine) == Located.prefix(4)
    assert locators[False].first_held([key(9), key(3)]) == 1
