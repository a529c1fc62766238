"""An engine reads the chunks whose slots it knows (it stored them, or was lent them before)
in place, with no round trip to the node: it holds each slot by a lock in the slab's file
(`kvtier.tiers.shmslab.SlabReader`) and tells the node afterwards (`Touch`: recent for its
policy, counted `read_in_place`). What it must never do: read a slot that holds another chunk
by now (it borrows instead), or let the node rewrite a slot it is reading (the node leaves a
held slot alone until the lock is gone).

An in-process node (`running_node`) where its tier's invariants are checked, a node process
where it is stopped.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path

import pytest
from nodekit import (
    LAYOUT,
    NodeProcess,
    borrower,
    connect,
    expected,
    key,
    lend,
    node_tiers,
    payload,
    put_chunks,
    wait_for,
)

from kvtier.node.server import NodeServer
from kvtier.tiers.memory import MemoryTier

pytestmark = pytest.mark.timeout(120)


def _memory(node: NodeServer) -> MemoryTier:
    (layout,) = node.layouts.served().values()
    return layout.memory


def _counters(node: NodeServer) -> dict[str, int]:
    counters: dict[str, int] = node.status()["counters"]
    return counters


def test_an_engine_reads_what_it_stored_in_place_and_learns_its_neighbours_slots(
        tmp_path: Path, in_process_node: Callable[..., AbstractContextManager[NodeServer]]):
    with in_process_node(node_tiers(tmp_path, ram_chunks=8)) as node:
        _, engine = connect(node.config.socket_path, engine="a")
        _, neighbour = connect(node.config.socket_path, engine="b")
        assert put_chunks(engine, range(4)) == [True] * 4
        assert put_chunks(neighbour, [5]) == [True]
        assert lend(engine, [key(i) for i in range(4)]).chunks == expected(range(4))
        wait_for(lambda: _counters(node)["read_in_place"] == 4, 10, "four reads told")
        assert _counters(node)["borrows"] == 0
        # The neighbour's chunk: borrowed once (its slot then known), then read in place.
        assert lend(engine, [key(5)]).chunks == expected([5])
        assert _counters(node)["borrows"] == 1
        assert lend(engine, [key(5)]).chunks == expected([5])
        wait_for(lambda: _counters(node)["read_in_place"] == 5, 10, "the fifth read told")
        assert _counters(node)["borrows"] == 1
        assert _memory(node).stats().hits == 6  # each read is recent for the node's policy
        wait_for(lambda: node.status()["leases"] == 0, 10, "no lease left")


def test_a_slot_that_holds_another_chunk_by_now_is_never_read_as_the_old_one(
        tmp_path: Path, in_process_node: Callable[..., AbstractContextManager[NodeServer]]):
    with in_process_node(node_tiers(tmp_path, ram_chunks=4)) as node:
        _, engine = connect(node.config.socket_path, engine="a")
        _, neighbour = connect(node.config.socket_path, engine="b")
        assert put_chunks(engine, [0]) == [True]
        # The neighbour's stores push chunk 0 out; its slot now holds another chunk.
        for i in range(10, 18):
            assert put_chunks(neighbour, [i]) == [True]
        assert not _memory(node).contains(key(0))
        lent = lend(engine, [key(0)])
        assert (lent.chunks, lent.stopped_at) == ([], 0)  # a miss, from a borrow
        assert _counters(node)["borrows"] == 1 and _counters(node)["read_in_place"] == 0
        # Stored again (another slot, maybe): read in place again, its own bytes.
        assert put_chunks(engine, [0]) == [True]
        assert lend(engine, [key(0)]).chunks == expected([0])
        assert _memory(node).check() == []


def test_a_slot_read_in_place_is_not_rewritten_while_held(
        tmp_path: Path, in_process_node: Callable[..., AbstractContextManager[NodeServer]]):
    with in_process_node(node_tiers(tmp_path, ram_chunks=4)) as node:
        _, engine = connect(node.config.socket_path, engine="a")
        _, neighbour = connect(node.config.socket_path, engine="b")
        assert put_chunks(engine, [0, 1]) == [True, True]
        with engine.lend_as_landed([key(0), key(1)], [memoryview(bytearray(4096))],
                                   in_order=True) as lending:
            loans = list(lending)
            assert _counters(node)["borrows"] == 0  # held in place, no lease
            # A flood of the neighbour's stores: chunks 0 and 1 leave, their slots stay.
            for i in range(20, 36):
                put_chunks(neighbour, [i])
                assert [bytes(loan.view.data) for loan in loans] == [payload(0), payload(1)]
            assert _memory(node).check() == []
            for loan in loans:
                loan.release()
        # Released: the next stores reuse every slot (the held two reclaimed).
        assert put_chunks(neighbour, range(40, 44)) == [True] * 4
        assert lend(neighbour, [key(i) for i in range(40, 44)]).chunks == \
            expected(range(40, 44))
        assert _memory(node).check() == []


def test_a_stopped_node_does_not_stop_reads_in_place(
        tmp_path: Path, start_node: Callable[..., NodeProcess]):
    node = start_node(node_tiers(tmp_path, ram_chunks=8))
    # A deadline no read could reach by chance: asking the stopped node would wait it out.
    _, engine = connect(node.socket_path, timeout_s=60.0)
    assert put_chunks(engine, range(3)) == [True] * 3
    node.pause()
    try:
        start = time.monotonic()
        assert lend(engine, [key(i) for i in range(3)]).chunks == expected(range(3))
        assert time.monotonic() - start < 30  # the node was not asked
    finally:
        node.resume()
    wait_for(lambda: node.status()["counters"]["read_in_place"] == 3, 10,
             "the reads told once the node runs again")



def test_a_slab_removed_under_a_running_node_ends_no_lease_still_read(
        tmp_path: Path, in_process_node: Callable[..., AbstractContextManager[NodeServer]]):
    """The slab's file removed while its node runs (an operator, systemd's RemoveIPC): a
    thread that then loads must not close its connection to let the slab go, which ended
    the leases of chunks it was still reading (an earlier load's loans, held until its
    copies are done): the node gave their slots to other chunks under the reads."""
    with in_process_node(node_tiers(tmp_path, ram_chunks=4)) as node:
        client, _ = connect(node.config.socket_path, engine="a")
        reading = borrower(client)
        _, neighbour = connect(node.config.socket_path, engine="b")
        assert put_chunks(neighbour, range(4)) == [True] * 4
        assert lend(reading, [key(3)]).chunks == expected([3])  # an earlier step's
        held = reading.lend_as_landed([key(0)], [memoryview(bytearray(LAYOUT.bytes_per_chunk))],
                                      in_order=True)
        [loan] = list(held)
        _memory(node).shared_memory_path.unlink()
        assert lend(reading, [key(1)]).chunks == expected([1])  # the step's next load
        for i in range(10, 18):  # other chunks come
            put_chunks(neighbour, [i])
        assert loan.view.data.tobytes() == payload(0)  # still chunk 0's bytes
        held.close()
