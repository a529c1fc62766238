"""A node that is down or stopped is counted as a failing tier on the engine's side: the
`node` tier's `StoreStats.failures` (what the engine's /metrics exports as
`vllm:kvtier_tier_failures_total{tier="node",reason=...}`, which the shipped alerts
KVTierTierDown and KVTierTierStalled and the dashboard's "Tier availability" panel read), as
the in-process store counts a tier whose server is down (`unavailable`) or does not answer in
time (`timeout`). Before, a node-mode engine's failures were always empty: a dead node, the
engine's only tier, left those alerts and that panel at 0.

Real `kvtier node serve` processes (stopped with SIGSTOP), and no node at all.
"""

from __future__ import annotations

import socket
from collections.abc import Callable
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
)

from kvtier.core.retention import DEFAULT_META

pytestmark = pytest.mark.timeout(120)


def test_a_healthy_node_counts_no_failure(tmp_path: Path,
                                          start_node: Callable[..., NodeProcess]):
    node = start_node(node_tiers(tmp_path, ram_chunks=8))
    client, engine = connect(node.socket_path)
    assert put_chunks(engine, [0, 1]) == [True, True]
    assert lend(borrower(client), [key(0), key(1)]).chunks == expected([0, 1])
    assert engine.contains(key(0))
    assert engine.flush(timeout_s=5)
    assert engine.stats().failures == {}


def test_no_node_at_the_socket_counts_unavailable_calls(socket_path: Path):
    _client, engine = connect(socket_path)  # no file there
    assert put_chunks(engine, [0]) == [False]
    assert lend(engine, [key(0)]).chunks == []
    assert not engine.contains(key(0))
    assert engine.retain(key(0), DEFAULT_META) == 0
    assert not engine.flush(timeout_s=1)
    failures = engine.stats().failures
    assert set(failures) == {"node"}
    assert set(failures["node"]) == {"unavailable"}
    assert failures["node"]["unavailable"] >= 5  # one a call, at least
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(str(socket_path))  # a socket file no one listens on (a node killed)
    stale.close()
    _client, fresh = connect(socket_path)
    assert put_chunks(fresh, [0]) == [False]
    assert fresh.stats().failures["node"]["unavailable"] >= 1


def test_a_stopped_node_counts_a_timeout_then_unavailable_calls(
        tmp_path: Path, start_node: Callable[..., NodeProcess]):
    node = start_node(node_tiers(tmp_path, ram_chunks=8))
    client, engine = connect(node.socket_path, timeout_s=1.0, retry_s=60.0)
    assert put_chunks(engine, [0]) == [True]
    node.pause()
    try:
        store = borrower(client)  # knows no slot: its loads ask the node
        lent = lend(store, [key(0)])  # waits out the client's deadline
        assert (lent.chunks, lent.stopped_at, lent.failed_tier) == ([], 0, "node")
        assert store.stats().failures == {"node": {"timeout": 1}}
        # Marked down now: the next calls are not sent, each is a miss counted unavailable.
        assert lend(store, [key(0)]).chunks == []
        assert put_chunks(store, [1]) == [False]
        counted = store.stats().failures["node"]
        assert counted["timeout"] == 1 and counted["unavailable"] >= 2
        assert store.stats().tiers[0].dropped_writes == 1
        assert engine.stats().failures == {}  # its calls were all answered
    finally:
        node.resume()


def test_a_store_planned_before_the_node_was_killed_is_not_counted_stored(
        tmp_path: Path, start_node: Callable[..., NodeProcess]):
    """A step's slots reserved, then the node killed (SIGKILL) before its chunks were filled:
    each commit but the step's last is sent without an answer, and one that could not be sent
    was still reported stored."""
    node = start_node(node_tiers(tmp_path, ram_chunks=8))
    _client, engine = connect(node.socket_path)
    keys = [key(1), key(2), key(3)]
    engine.plan_puts(keys, [DEFAULT_META] * len(keys))
    node.kill()
    spare = memoryview(bytearray(LAYOUT.bytes_per_chunk))
    stored = [engine.put_from(k, lambda slot: slot.__setitem__(slice(None), payload(9)), spare)
              for k in keys]
    assert stored == [False] * 3  # before: [True, False, False], the first one "stored"
    stats = engine.stats()
    assert stats.tiers[0].puts == 0
    assert stats.failures["node"]["unavailable"] >= 1
