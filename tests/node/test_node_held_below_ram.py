"""A store of a chunk the node holds only below RAM (on its disk tier), while RAM has no slot
for it: the node answers HELD, and the engine sends no bytes. Before, the node answered SEND
(RAM has no slot, a tier below takes it), the engine shipped the chunk over the socket with
its commit, and the disk's put found it held and dropped it: a chunk's bytes copied and sent
for nothing at each store of a prefix the node already holds. The chunk is not promoted into
RAM (it has no slot), and it is reported stored (held), as a chunk RAM holds.

A real node process (`kvtier node serve`) with a RAM tier of 4 chunks over a disk tier. RAM
has no slot because its 4 chunks are all lent (a load in flight). The question is bounded in
time: a tier below RAM gone slow costs the store nothing but the sent bytes (an in-process
node, its disk's lookup hung by fault injection).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path

import pytest
from nodekit import NodeProcess, connect, expected, key, lend, node_tiers, put_chunks, wait_for

from kvtier.core.keys import ChunkKey
from kvtier.node.server import NodeServer
from kvtier.tiers.files.disk import DiskTier

pytestmark = pytest.mark.timeout(120)


def _disk_chunks(node: NodeProcess) -> int:
    (layout,) = node.status()["layouts"].values()
    return int(layout["tiers"][1]["chunks"])


def test_a_chunk_held_below_a_ram_without_slots_is_held_not_sent(
        tmp_path: Path, start_node: Callable[..., NodeProcess]) -> None:
    node = start_node(node_tiers(tmp_path, ram_chunks=4, disk_chunks=16))
    client, engine = connect(node.socket_path)
    try:
        assert put_chunks(engine, range(4)) == [True] * 4
        in_ram = [key(i) for i in range(4)]
        with engine.lend_as_landed(in_ram, [memoryview(bytearray(4096))]) as lending:
            loans = list(lending)  # every RAM slot lent: none for a store
            # Chunk 50: RAM has no slot, so the bytes go to the disk (SEND: not stored in RAM).
            assert put_chunks(engine, [50]) == [False]
            wait_for(lambda: _disk_chunks(node) == 5, 10, "the disk tier's writes")
            assert node.status()["counters"]["received_chunks"] == 1
            sent = engine.stats().tiers[1]
            assert (sent.puts, sent.bytes_written) == (1, 4096)
            # Stored again (the same prefix computed by another request): on the disk alone.
            assert put_chunks(engine, [50]) == [True]  # held: reported stored
            after = engine.stats().tiers[1]
            assert (after.puts, after.bytes_written) == (1, 4096)  # nothing sent
            counters = node.status()["counters"]
            assert counters["received_chunks"] == 1
            for loan in loans:
                loan.release()
        assert node.status()["leases"] == 0
        assert lend(engine, [key(50)]).chunks == expected([50])
    finally:
        client.close()


@pytest.mark.timing
def test_a_tier_below_ram_gone_slow_costs_the_store_no_deadline(
        tmp_path: Path, in_process_node: Callable[..., AbstractContextManager[NodeServer]],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The disk tier's lookup of chunk 50 hangs (a dead mount, injected): the node asks it
    no longer than `HELD_BELOW_BUDGET_S` and answers SEND, within the engine's 1 s deadline
    (a question without that bound waits for the store's read timeout, 5 s: the engine's
    call fails, counted as a `timeout`, and the node is taken for down)."""
    hung, answer = key(50), threading.Event()
    real_contains = DiskTier.contains

    def hung_contains(self: DiskTier, k: ChunkKey) -> bool:
        if k == hung:
            answer.wait(30)
        return real_contains(self, k)

    monkeypatch.setattr(DiskTier, "contains", hung_contains)
    with in_process_node(node_tiers(tmp_path, ram_chunks=4, disk_chunks=16)) as node:
        client, engine = connect(node.config.socket_path, timeout_s=1.0)
        try:
            assert put_chunks(engine, range(4)) == [True] * 4
            in_ram = [key(i) for i in range(4)]
            with engine.lend_as_landed(in_ram, [memoryview(bytearray(4096))]) as lending:
                loans = list(lending)  # every RAM slot lent
                assert put_chunks(engine, [50]) == [False]  # SEND: its bytes went below RAM
                assert engine.stats().failures == {}
                assert node.status()["counters"]["received_chunks"] == 1
                for loan in loans:
                    loan.release()
        finally:
            answer.set()
            client.close()
