"""Leases: the RAM slots an engine holds on the node (chunks lent for a load, slots reserved
for its stores) end with its connection, so an engine killed mid-load or mid-store leaks no
slot of a cache its neighbours share; two engines storing one chunk at once store it once;
and a node whose RAM is all lent turns a store away (a dropped write, counted) instead of
blocking the engine.

The killed engine is a real process killed with SIGKILL (no clean-up of its own can run); the
node is a real `kvtier node serve` there, `running_node` elsewhere.
"""

from __future__ import annotations

import dataclasses
import json
import signal
import subprocess
import sys
import threading
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path

import pytest
from nodekit import (
    LAYOUT,
    Lines,
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

from kvtier.core.retention import DEFAULT_META
from kvtier.node.server import NodeServer

pytestmark = pytest.mark.timeout(120)  # a hang fails here, not at the suite's 900 s

# An engine that stores chunks 0 and 1, reads chunk 0 in place (its slot's lock held) and
# borrows chunk 1 (a loan held), reserves slots for chunks 2 and 3 (never filled), says so on
# stdout, and waits to be killed.
ENGINE = """
import json, sys
sys.path[:0] = [sys.argv[3], sys.argv[4]]  # tests/node, tests
from nodekit import borrower, connect, key, put_chunks
from kvtier.core.layout import KVLayout
from kvtier.core.retention import DEFAULT_META
layout = KVLayout(**json.loads(sys.argv[2]))
client, store = connect(sys.argv[1], layout)
assert put_chunks(store, [0, 1]) == [True, True]
in_place = store.lend_as_landed([key(0)], [memoryview(bytearray(4096))])
borrowed = borrower(client, layout).lend_as_landed([key(1)], [memoryview(bytearray(4096))])
loans = list(in_place.__enter__()) + list(borrowed.__enter__())
store.plan_puts([key(2), key(3)], [DEFAULT_META] * 2)
print(json.dumps({"lent": len(loans)}), flush=True)
sys.stdin.read()  # until killed
"""


def test_an_engine_killed_holding_loans_and_slots_leaks_none(
        tmp_path: Path, start_node: Callable[..., NodeProcess]):
    node = start_node(node_tiers(tmp_path, ram_chunks=6))
    _client, neighbour = connect(node.socket_path)
    engine = subprocess.Popen(
        [sys.executable, "-c", ENGINE, str(node.socket_path),
         json.dumps(dataclasses.asdict(LAYOUT)), str(Path(__file__).parent),
         str(Path(__file__).parent.parent)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert engine.stdout is not None
        assert json.loads(Lines(engine.stdout).next(30, "the engine")) == {"lent": 2}
        # 4 of the node's 6 slots are the engine's: 1 read in place, 1 lent, 2 reserved (a
        # lease for the loan, one for the reservation).
        assert node.status()["leases"] == 2
        # The neighbour works meanwhile, in the 2 slots left.
        assert put_chunks(neighbour, [10]) == [True]
        assert lend(neighbour, [key(0), key(10)]).chunks == expected([0, 10])
        engine.send_signal(signal.SIGKILL)
        engine.wait(timeout=20)
    finally:
        engine.kill()
        engine.wait(timeout=20)
        assert engine.stdin is not None and engine.stdout is not None
        engine.stdin.close()
        engine.stdout.close()

    # The node's log names the engine (host:pid:tag) whose connection ended holding them,
    # just after their end (which the status shows at once).
    wait_for(lambda: node.status()["leases"] == 0 and "ended holding" in node.log_path.read_text(),
             10, "the killed engine's leases ended, and logged")
    assert node.status()["counters"]["disconnects_with_leases"] == 1
    ended = [line for line in node.log_path.read_text().splitlines() if "ended holding" in line]
    assert len(ended) == 1 and f":{engine.pid}:" in ended[0], ended
    assert "2 lease(s) of 3 chunk(s)" in ended[0]  # the loan, the 2 slots reserved
    # Every slot is usable again: a step of 6 stores fills RAM, and all 6 are lent at once.
    assert put_chunks(neighbour, range(20, 26)) == [True] * 6
    assert lend(neighbour, [key(i) for i in range(20, 26)]).chunks == expected(range(20, 26))
    assert memory_tier(node.status())["chunks"] == 6


def test_two_engines_storing_one_chunk_at_once_store_it_once(
        tmp_path: Path, in_process_node: Callable[..., AbstractContextManager[NodeServer]]):
    with in_process_node(node_tiers(tmp_path, ram_chunks=8)) as node:
        engines = [connect(node.config.socket_path)[1] for _ in range(2)]
        reserved = threading.Barrier(2, timeout=10)  # both hold a slot before either fills
        results: list[bool] = []

        def store(engine_index: int) -> None:
            engine = engines[engine_index]
            engine.plan_puts([key(7)], [DEFAULT_META])
            reserved.wait()

            def fill(slot: memoryview) -> None:
                slot[:] = payload(7)
            results.append(engine.put_from(key(7), fill, memoryview(bytearray(4096))))

        threads = [threading.Thread(target=store, args=(i,)) for i in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=20)
        assert results == [True, True]
        # Both reserved a slot (neither knew of the other's), one of them holds the chunk.
        assert node.status()["counters"]["reserved_chunks"] == 2
        wait_for(lambda: node.status()["counters"]["committed_chunks"] == 2, 10,
                 "both commits")
        wait_for(lambda: node.status()["leases"] == 0, 10, "no lease left")
        assert memory_tier(node.status())["chunks"] == 1
        assert lend(engines[0], [key(7)]).chunks == expected([7])
        # The spare slot went back: the other 7 still take a step of stores.
        assert put_chunks(engines[1], range(30, 37)) == [True] * 7
        assert lend(engines[1], [key(7), *(key(i) for i in range(30, 37))]).stopped_at == 8


def test_a_store_into_a_ram_all_lent_is_dropped_and_nothing_waits(
        tmp_path: Path, in_process_node: Callable[..., AbstractContextManager[NodeServer]]):
    with in_process_node(node_tiers(tmp_path, ram_chunks=4)) as node:
        client, engine = connect(node.config.socket_path)
        assert put_chunks(engine, range(4)) == [True] * 4
        keys = [key(i) for i in range(4)]
        with engine.lend_as_landed(keys, [memoryview(bytearray(4096))]) as lending:
            loans = list(lending)  # every slot lent, and held
            assert len(loans) == 4
            assert put_chunks(engine, [50]) == [False]  # Reserved: SKIPPED
            assert engine.stats().tiers[0].dropped_writes == 1
            assert client.failures == 0  # the node answered (no deadline passed)
            for loan in loans:
                loan.release()
        wait_for(lambda: node.status()["leases"] == 0, 10, "the loans released")
        # Lent no more: the store is taken now (evicting a chunk no one holds).
        assert put_chunks(engine, [50]) == [True]
        assert lend(engine, [key(50)]).chunks == expected([50])


def test_a_tier_that_raises_mid_reserve_leaks_no_slot(
        tmp_path: Path, in_process_node: Callable[..., AbstractContextManager[NodeServer]],
        monkeypatch: pytest.MonkeyPatch):
    with in_process_node(node_tiers(tmp_path, ram_chunks=4)) as node:
        # A long back-off: after the failed Reserve this engine asks the node nothing more.
        _client, engine = connect(node.config.socket_path, retry_s=30)
        assert put_chunks(engine, [0]) == [True]  # the layout's store exists now
        [layout] = node.layouts.served().values()
        real = layout.store.putting

        def raises_on_the_third_key(keys_done: list[int]):  # type: ignore[no-untyped-def]
            def putting(*args, **kwargs):  # type: ignore[no-untyped-def]
                keys_done.append(1)
                if len(keys_done) % 3 == 0:
                    raise RuntimeError("a tier failed")  # the fault injected
                return real(*args, **kwargs)
            return putting

        done: list[int] = []
        monkeypatch.setattr(layout.store, "putting", raises_on_the_third_key(done))
        # Each Reserve of the step fails on the node at its third key (after two slots were
        # reserved): the engine drops its stores, nothing hangs.
        assert put_chunks(engine, [1, 2, 3]) == [False] * 3
        assert len(done) >= 3
        monkeypatch.setattr(layout.store, "putting", real)
        wait_for(lambda: node.status()["leases"] == 0, 10, "no lease left")
        # The slots reserved before the fault were given back (explicitly: not left to the
        # garbage collector closing the blocks with the handler's frame): RAM takes chunks.
        _fresh_client, fresh = connect(node.config.socket_path)
        assert put_chunks(fresh, [4, 5, 6]) == [True] * 3
        assert lend(fresh, [key(i) for i in (4, 5, 6)]).chunks == expected([4, 5, 6])


def test_a_node_that_stops_hands_out_no_slot_an_engine_still_reads(
        tmp_path: Path, in_process_node: Callable[..., AbstractContextManager[NodeServer]]):
    """A stop ends every connection while their engines live on: a loan's slot is not given
    back (a store of another engine, answered before its own connection ends, would write
    into the slot the first still copies from: wrong bytes, seen at SIGTERM under load), and
    no request is answered once the stop has begun."""
    with in_process_node(node_tiers(tmp_path, ram_chunks=4)) as node:
        _client, engine = connect(node.config.socket_path)
        assert put_chunks(engine, range(4)) == [True] * 4
        _other_client, borrower_engine = connect(node.config.socket_path, engine="borrower")
        with borrower_engine.lend_as_landed([key(0)], [memoryview(bytearray(4096))]) as lending:
            [loan] = list(lending)
            assert node.status()["leases"] == 1
            node.shutdown()
            wait_for(lambda: node.status()["connections"] == 0, 10, "every connection ended")
            assert node.status()["leases"] == 1  # kept: its slot is not handed out again
            assert bytes(loan.view.data) == payload(0)
            loan.release()
        assert put_chunks(engine, [9]) == [False]  # not answered: a dropped store
