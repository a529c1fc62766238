"""An engine frozen (SIGSTOP, a hung process) holding leases: chunks lent for a load, slots
reserved for its stores. The node takes the lending back once held past its
`--lease-timeout-s`, and its neighbours get those slots back; each lent slot's stamp, read
again by the engine once its copy is done, tells the engine when it wakes that the slot was
given to another chunk meanwhile: that copy is a failed load (recomputed), never used as its
chunk. Its reserved slots are not taken back (it may write them when it wakes): its late
writes and commits store its own chunks, and corrupt none of its neighbours'. Before, the
node took nothing back: a frozen engine pinned its lent slots until it woke or died, and
the RAM tier served everyone with that many slots fewer. The node's status names what each
engine holds (`held`).

A real `kvtier node serve`, and a real engine process stopped with SIGSTOP.
"""

from __future__ import annotations

import dataclasses
import json
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from nodekit import (
    LAYOUT,
    Lines,
    NodeProcess,
    borrower,
    connect,
    expected,
    key,
    lend,
    memory_tier,
    node_tiers,
    put_chunks,
    wait_for,
)

pytestmark = pytest.mark.timeout(120)
LEASE_TIMEOUT_S = 1.0

# An engine that stores chunks 0-2, borrows 0 and 1 (two loans), reserves slots for 4 and 5
# (not filled yet), says so, and on its next line of input copies its loans and says whether
# each copy is its chunk's bytes and whether its check after the copy says so; then fills
# and commits its reserved slots (late) and gives everything back.
ENGINE = """
import json, sys
sys.path[:0] = [sys.argv[3], sys.argv[4]]  # tests/node, tests
from nodekit import borrower, connect, key, payload, put_chunks
from kvtier.core.layout import KVLayout
from kvtier.core.retention import DEFAULT_META
layout = KVLayout(**json.loads(sys.argv[2]))
client, store = connect(sys.argv[1], layout, engine="frozen", timeout_s=30.0)
assert put_chunks(store, [0, 1, 2]) == [True] * 3
loads = borrower(client, layout)
lending = loads.lend_as_landed([key(0), key(1)], [memoryview(bytearray(4096))])
loans = list(lending.__enter__())
store.plan_puts([key(4), key(5)], [DEFAULT_META] * 2)
print(json.dumps({"lent": len(loans)}), flush=True)
sys.stdin.readline()  # stopped here
copies = [bytes(loan.view.data) for loan in loans]
checked = [loan.view.copied_whole() for loan in loans]
lending.__exit__(None, None, None)
spare = memoryview(bytearray(4096))
def fill(i):
    def write(slot):
        slot[:] = payload(i)
    return write
late = [store.put_from(key(i), fill(i), spare) for i in (4, 5)]
print(json.dumps({"whole": [c == payload(i) for i, c in enumerate(copies)],
                  "checked": checked, "reused_copies": loads.reused_copies,
                  "late_puts": late}), flush=True)
sys.stdin.read()
"""


def test_a_frozen_engines_lending_is_taken_back_and_its_late_copies_fail_not_lie(
        tmp_path: Path, start_node: Callable[..., NodeProcess]) -> None:
    node = start_node(node_tiers(tmp_path, ram_chunks=8),
                      args=("--lease-timeout-s", str(LEASE_TIMEOUT_S)))
    _, neighbour = connect(node.socket_path, engine="neighbour")
    engine = subprocess.Popen(
        [sys.executable, "-c", ENGINE, str(node.socket_path),
         json.dumps(dataclasses.asdict(LAYOUT)), str(Path(__file__).parent),
         str(Path(__file__).parent.parent)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert engine.stdin is not None and engine.stdout is not None
        said = Lines(engine.stdout)
        assert json.loads(said.next(30, "the engine")) == {"lent": 2}
        engine.send_signal(signal.SIGSTOP)
        # Past the bound, its lending (2 chunks) is taken back; its 2 reserved slots stay.
        wait_for(lambda: node.status()["held"] == {"frozen": {"leases": 1, "chunks": 2}},
                 30, "the frozen engine's lending taken back")
        counters = node.status()["counters"]
        assert (counters["leases_expired"], counters["expired_chunks"]) == (1, 2)
        # The neighbour works on in the 6 slots left, through many evictions: chunks 0-2
        # leave, and their slots are written again with its chunks.
        for step in range(10):
            ids = [10 + 2 * step, 11 + 2 * step]
            assert put_chunks(neighbour, ids) == [True, True]
            assert lend(neighbour, [key(i) for i in ids]).chunks == expected(ids)
        # A step of 6 stores, all lent back at once: 6 slots are the neighbour's (4 before,
        # with the frozen engine's lending still pinning 2).
        ids = list(range(30, 36))
        assert put_chunks(neighbour, ids) == [True] * 6
        assert lend(neighbour, [key(i) for i in ids]).chunks == expected(ids)
        assert memory_tier(node.status())["chunks"] == 6

        engine.send_signal(signal.SIGCONT)
        engine.stdin.write("wake\n")
        engine.stdin.flush()
        woken = json.loads(said.next(30, "the engine, woken"))
        # Its copies are the neighbour's chunks now, and its check after each copy says so:
        # failed loads (counted), never its chunks' KV.
        assert woken["whole"] == [False, False]
        assert woken["checked"] == [False, False]
        assert woken["reused_copies"] == 2
        # Its late writes went into its own reserved slots: its chunks are stored whole, and
        # every chunk of the neighbour's is still its own.
        assert woken["late_puts"] == [True, True]
        assert lend(neighbour, [key(4), key(5)]).chunks == expected([4, 5])
        wait_for(lambda: node.status()["held"] == {}, 10, "the woken engine's leases ended")
        survivors = [i for i in ids if lend(neighbour, [key(i)]).chunks]
        assert survivors  # RAM of 8: some of the 6 are still held, beside chunks 4 and 5
        for i in survivors:
            assert lend(neighbour, [key(i)]).chunks == expected([i])
    finally:
        engine.send_signal(signal.SIGCONT)
        engine.kill()
        engine.wait(timeout=20)
        for stream in (engine.stdin, engine.stdout):
            if stream is not None:
                stream.close()
    # Every slot is the neighbour's again: a step of 8 stores, all lent back at once.
    ids = list(range(40, 48))
    assert put_chunks(neighbour, ids) == [True] * 8
    assert lend(neighbour, [key(i) for i in ids]).chunks == expected(ids)


def test_a_lending_of_an_engine_that_checks_no_stamps_is_never_taken_back(
        tmp_path: Path, start_node: Callable[..., NodeProcess]) -> None:
    """An engine of an older kvtier (its Hello says nothing of stamps) would copy a slot given
    to another chunk as its own: its lendings stay its own, however long it holds them."""
    node = start_node(node_tiers(tmp_path, ram_chunks=8),
                      args=("--lease-timeout-s", str(LEASE_TIMEOUT_S)))
    older, _ = connect(node.socket_path, engine="older")
    older._hello.stamps = False  # as an older kvtier's Hello decodes: the field's default
    newer, newer_store = connect(node.socket_path, engine="newer")
    assert put_chunks(newer_store, [0, 1]) == [True, True]
    with borrower(older).lend_as_landed([key(0)], [memoryview(bytearray(4096))]) as old:
        assert [loan.view.tier for loan in old] == ["node"]
        with borrower(newer).lend_as_landed([key(1)], [memoryview(bytearray(4096))]) as new:
            assert [loan.view.tier for loan in new] == ["node"]
            # The newer engine's lending, taken after the older one's, is taken back...
            wait_for(lambda: node.status()["counters"]["leases_expired"] == 1, 30,
                     "the newer engine's lending taken back")
            # ...and the older engine's is still held.
            assert node.status()["held"] == {"older": {"leases": 1, "chunks": 1}}
    wait_for(lambda: node.status()["held"] == {}, 10, "the older engine's lending released")
    for client in (older, newer):
        client.close()
