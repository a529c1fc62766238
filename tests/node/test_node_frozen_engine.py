"""An engine frozen (SIGSTOP, a hung process) holding leases: chunks lent for a load, slots
reserved for its stores. The node never takes them back while its connection lives: a frozen
engine may be in the middle of its copies, and a slot given to another chunk under them would
be copied as the wrong KV when it wakes (no check after a copy could tell). So its neighbours
work on in the slots left, churning RAM; its lent chunks stay whole in their slots, and what it
copies when it wakes is right; its leases end when it releases them (or dies: see
test_node_leases.py). The node's status names what each engine holds (`held`), so that an
operator finds the frozen engine behind a RAM tier that holds fewer chunks than it should.

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

# An engine that stores chunks 0-2, borrows 0 and 1 (two loans), reserves slots for 4 and 5
# (never filled), says so, and on its next line of input copies its loans and says whether
# each copy is its chunk's bytes, then gives everything back.
ENGINE = """
import json, sys
sys.path[:0] = [sys.argv[3], sys.argv[4]]  # tests/node, tests
from nodekit import borrower, connect, key, payload, put_chunks
from kvtier.core.layout import KVLayout
from kvtier.core.retention import DEFAULT_META
layout = KVLayout(**json.loads(sys.argv[2]))
client, store = connect(sys.argv[1], layout, engine="frozen", timeout_s=30.0)
assert put_chunks(store, [0, 1, 2]) == [True] * 3
lending = borrower(client, layout).lend_as_landed([key(0), key(1)],
                                                  [memoryview(bytearray(4096))])
loans = list(lending.__enter__())
store.plan_puts([key(4), key(5)], [DEFAULT_META] * 2)
print(json.dumps({"lent": len(loans)}), flush=True)
sys.stdin.readline()  # stopped here
copies = [bytes(loan.view.data) == payload(i) for i, loan in enumerate(loans)]
lending.__exit__(None, None, None)
store.plan_puts([], [])  # the reserved slots given back, never filled
print(json.dumps({"whole": copies}), flush=True)
sys.stdin.read()
"""


def test_a_frozen_engine_keeps_its_leases_whole_and_the_status_names_them(
        tmp_path: Path, start_node: Callable[..., NodeProcess]) -> None:
    node = start_node(node_tiers(tmp_path, ram_chunks=8))
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
        # 4 of the 8 slots are the frozen engine's: 2 lent, 2 reserved.
        assert node.status()["held"] == {"frozen": {"leases": 2, "chunks": 4}}
        # The neighbour works on in the 4 slots left, through many evictions.
        for step in range(10):
            ids = [10 + 2 * step, 11 + 2 * step]
            assert put_chunks(neighbour, ids) == [True, True]
            assert lend(neighbour, [key(i) for i in ids]).chunks == expected(ids)
        assert memory_tier(node.status())["chunks"] <= 6
        assert node.status()["held"]["frozen"] == {"leases": 2, "chunks": 4}

        engine.send_signal(signal.SIGCONT)
        engine.stdin.write("wake\n")
        engine.stdin.flush()
        assert json.loads(said.next(30, "the engine, woken")) == {"whole": [True, True]}
        wait_for(lambda: node.status()["held"] == {}, 10, "the woken engine's leases ended")
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
