"""A tier below the node's RAM that hangs (a redis behind a stalled link: its batch lookup
answers only at its socket timeout, or never) while the engines store chunks RAM has no slot
for: each store asks the tiers below RAM whether they hold those chunks already. Before, each
store started a thread of its own for the question, left behind when it did not answer within
its budget: a thread per store piled up in the node for as long as the tier hung. Now the
questions go to a few threads (`HELD_BELOW_THREADS`); a store asked while all of them are
held is not asked about (its chunks are SENDs, their bytes sent, as without the question),
and counted (`held_below_skipped`).

An in-process node over a real redis-server, its redis tier's batch lookup hung by fault
injection; RAM has no slot because its chunks are all lent (a load in flight).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from pathlib import Path

import pytest
from nodekit import connect, key, node_tiers, put_chunks

from kvtier.core.keys import ChunkKey
from kvtier.node.server import HELD_BELOW_THREADS, NodeServer
from kvtier.tiers.redis.tier import RedisTier

pytestmark = pytest.mark.timeout(120)
STORES = 12  # each with one chunk RAM has no slot for


def _question_threads() -> int:
    return sum(t.name.startswith("kvtier-node-held-below") for t in threading.enumerate())


def test_a_hung_tier_below_ram_holds_a_few_threads_not_one_a_store(
        tmp_path: Path, redis_url: str,
        in_process_node: Callable[..., AbstractContextManager[NodeServer]],
        monkeypatch: pytest.MonkeyPatch) -> None:
    answer = threading.Event()

    def hung_contains_many(self: RedisTier, keys: Sequence[ChunkKey]) -> list[bool]:
        answer.wait(60)
        return [False] * len(keys)

    config = node_tiers(tmp_path, ram_chunks=4)
    config["tiers"].append({"kind": "redis", "url": redis_url, "capacity": "1MiB"})
    with in_process_node(config) as node:
        client, engine = connect(node.config.socket_path)
        try:
            assert put_chunks(engine, range(4)) == [True] * 4
            in_ram = [key(i) for i in range(4)]
            with engine.lend_as_landed(in_ram, [memoryview(bytearray(4096))]) as lending:
                loans = list(lending)  # every RAM slot lent
                monkeypatch.setattr(RedisTier, "contains_many", hung_contains_many)
                for i in range(STORES):
                    # SEND: its bytes go below RAM, whether or not the node asked.
                    assert put_chunks(engine, [100 + i]) == [False]
                    assert _question_threads() <= HELD_BELOW_THREADS
                counters = node.status()["counters"]
                assert counters["received_chunks"] == STORES
                assert counters["held_below_skipped"] == STORES - HELD_BELOW_THREADS
                for loan in loans:
                    loan.release()
        finally:
            answer.set()
            client.close()
