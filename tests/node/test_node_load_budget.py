"""A load's budget reaches the node (issue 45 in node mode): the engine's `lend_as_landed(...,
until=...)` becomes the Borrow's `budget_s`, and the node abandons its reads below RAM not
landed by then: the engine gets what landed at once and recomputes the rest, where without
the budget it waited for the slow tier. Faults injected: the disk tier's reads made slow.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import pytest
from nodekit import connect, expected, key, lend, node_tiers, put_chunks, wait_for

from kvtier.node.server import NodeServer
from kvtier.tiers.files.disk import DiskTier

pytestmark = [pytest.mark.timeout(120), pytest.mark.timing]
SLOW_S = 1.5  # each disk read, once slowed
BUDGET_S = 0.2


def _disk(node: NodeServer) -> dict[str, Any]:
    (layout,) = node.status()["layouts"].values()
    tier: dict[str, Any] = layout["tiers"][1]
    return tier


def test_a_load_past_its_budget_returns_what_landed_and_the_node_serves_on(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        in_process_node: Callable[..., AbstractContextManager[NodeServer]]) -> None:
    with in_process_node(node_tiers(tmp_path, ram_chunks=1, disk_chunks=8)) as node:
        _, engine = connect(node.config.socket_path)
        # One step: chunk 0 takes RAM's one slot, 1 and 2 are sent below it; the disk gets
        # all three.
        assert put_chunks(engine, [0, 1, 2]) == [True, False, False]
        wait_for(lambda: _disk(node)["chunks"] == 3, 10, "the disk tier's writes")

        release = threading.Event()
        real = DiskTier.get_into

        def slow(self: DiskTier, *args: Any, **kwargs: Any) -> Any:
            release.wait(SLOW_S)
            return real(self, *args, **kwargs)

        monkeypatch.setattr(DiskTier, "get_into", slow)
        keys = [key(0), key(1), key(2)]
        spare = [memoryview(bytearray(4096))]
        start = time.monotonic()
        with engine.lend_as_landed(keys, spare, in_order=True,
                                   until=start + BUDGET_S) as lending:
            lent = [loan.index for loan in lending]
        took = time.monotonic() - start
        assert lent == [0] and lending.stopped_at == 1  # RAM's chunk; the disk's abandoned
        assert took < SLOW_S - 0.3, took  # not the slow reads' time
        # No budget: the node waits for the slow reads (the control).
        start = time.monotonic()
        assert lend(engine, keys).chunks == expected([0, 1, 2])
        assert time.monotonic() - start >= SLOW_S - 0.1
        release.set()
        assert lend(engine, keys).chunks == expected([0, 1, 2])  # the tier is not stalled


def test_a_load_given_more_than_the_clients_deadline_is_waited_for(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        in_process_node: Callable[..., AbstractContextManager[NodeServer]]) -> None:
    """A budget past the client's deadline (a long prompt's recompute against a 2 s lookup
    timeout) is the node's to use: reads below RAM that take longer than the deadline but
    land within the budget are lent, and the node is not marked down."""
    with in_process_node(node_tiers(tmp_path, ram_chunks=1, disk_chunks=8)) as node:
        client, engine = connect(node.config.socket_path, timeout_s=0.5, retry_s=60)
        assert put_chunks(engine, [0, 1]) == [True, False]
        wait_for(lambda: _disk(node)["chunks"] == 2, 10, "the disk tier's writes")
        real = DiskTier.get_into

        def slow(self: DiskTier, *args: Any, **kwargs: Any) -> Any:
            time.sleep(1.0)  # twice the client's deadline
            return real(self, *args, **kwargs)

        monkeypatch.setattr(DiskTier, "get_into", slow)
        with engine.lend_as_landed([key(1)], [memoryview(bytearray(4096))], in_order=True,
                                   until=time.monotonic() + 30) as lending:
            assert [loan.index for loan in lending] == [0]
        assert client.failures == 0
