"""A Borrow of chunks below the node's RAM is answered in parts as they land (node/stream.py):
the engine copies a load's first chunks while the node still reads the rest, where one reply
after the last read made every load wait for its slowest chunk. A borrower that stops early
reads the stream to its end and keeps its connection; a part that comes too late is a miss,
and the connection is closed only after the chunks lent before it were released (the lease
ends with it).

An in-process node (`running_node`); faults injected: one disk read held until the test
releases it.
"""

from __future__ import annotations

import os
import resource
import threading
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from nodekit import LAYOUT, connect, expected, key, lend, node_tiers, put_chunks, wait_for

from kvtier.core.keys import ChunkKey
from kvtier.node.nodestore import NodeStore
from kvtier.node.protocol import BELOW_TIER
from kvtier.node.server import NodeServer
from kvtier.tiers.files.disk import DiskTier

pytestmark = pytest.mark.timeout(120)
HELD_S = 20.0  # the held read's own bound, past every wait below (the test releases it)
KEYS = [key(i) for i in range(3)]


@dataclass
class HeldRead:
    """Chunk 2's disk read, held until `release` is set; `finished` once it returned."""

    release: threading.Event
    finished: threading.Event


@pytest.fixture
def below_ram(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
              in_process_node: Callable[..., AbstractContextManager[NodeServer]]
              ) -> Iterator[tuple[NodeServer, HeldRead]]:
    """A node whose chunks 0-2 are on its disk only (RAM takes a chunk at its second offer),
    chunk 2's read held."""
    # The node waits for the held read (no stall marked by its own read deadline, which
    # would make the next Borrow skip the disk): what is tested is the engine's deadline.
    config = {**node_tiers(tmp_path, ram_chunks=8, disk_chunks=16), "read_timeout_s": 30}
    config["tiers"][0]["admit_after"] = 2
    with in_process_node(config) as node:
        _, engine = connect(node.config.socket_path)
        assert put_chunks(engine, range(3)) == [False] * 3
        wait_for(lambda: _disk(node)["chunks"] == 3, 10, "the disk tier's writes")
        held = HeldRead(threading.Event(), threading.Event())
        real = DiskTier.get_into

        def held_read(self: DiskTier, chunk: ChunkKey, *args: Any, **kwargs: Any) -> Any:
            if chunk != key(2):
                return real(self, chunk, *args, **kwargs)
            held.release.wait(HELD_S)
            try:
                return real(self, chunk, *args, **kwargs)
            finally:
                held.finished.set()

        monkeypatch.setattr(DiskTier, "get_into", held_read)
        yield node, held
        held.release.set()


def _disk(node: NodeServer) -> dict[str, Any]:
    (layout,) = node.status()["layouts"].values()
    tier: dict[str, Any] = layout["tiers"][1]
    return tier


def _spare() -> list[memoryview]:
    return [memoryview(bytearray(LAYOUT.bytes_per_chunk))]


def test_a_borrows_first_chunks_are_lent_while_the_node_still_reads_the_rest(
        below_ram: tuple[NodeServer, HeldRead]) -> None:
    node, held = below_ram
    _, engine = connect(node.config.socket_path)
    got = []
    with engine.lend_as_landed(KEYS, _spare(), in_order=True) as lending:
        for loan in lending:
            with loan:
                got.append((loan.index, bytes(loan.view.data), held.finished.is_set()))
            if loan.index == 1:
                held.release.set()
    assert [(i, data) for i, data, _ in got] == expected(range(3))
    # Chunks 0 and 1 came while chunk 2 was being read (one reply: all after its read).
    assert [finished for *_, finished in got] == [False, False, True]
    assert lending.stopped_at == 3
    wait_for(lambda: node.status()["leases"] == 0, 10, "the lease released")


def test_a_borrower_that_stops_early_reads_the_stream_to_its_end_and_keeps_its_connection(
        below_ram: tuple[NodeServer, HeldRead]) -> None:
    node, held = below_ram
    client, engine = connect(node.config.socket_path)
    with engine.lend_as_landed(KEYS, _spare(), in_order=True) as lending:
        first = next(lending)
        assert (first.index, bytes(first.view.data)) == expected([0])[0]
        first.release()
        held.release.set()  # the rest comes while the lending closes
    # The last part (the lease) was read and released: nothing left on the connection, which
    # the next Borrow uses as is.
    wait_for(lambda: node.status()["leases"] == 0, 10, "the lease released")
    assert lend(NodeStore(client, LAYOUT.bytes_per_chunk), KEYS).chunks == expected(range(3))
    counters = node.status()["counters"]
    assert counters.get("disconnects_with_leases", 0) == 0
    assert client.failures == 0


def test_a_part_past_the_deadline_is_a_miss_and_the_connection_closes_after_the_loans(
        below_ram: tuple[NodeServer, HeldRead]) -> None:
    node, held = below_ram
    client, engine = connect(node.config.socket_path, timeout_s=2.0)  # the first parts come at once
    got = []
    with engine.lend_as_landed(KEYS, _spare(), in_order=True) as lending:
        for loan in lending:
            with loan:
                got.append((loan.index, bytes(loan.view.data)))
    assert got == expected(range(2))
    assert (lending.stopped_at, lending.failed_tier) == (2, BELOW_TIER)
    assert not held.finished.is_set()  # chunk 2's part could not have come
    # The part never came in time: the connection was closed (ending the lease on the node)
    # rather than left to answer the next request with it. The node finds out when its read
    # ends and its answer cannot be sent.
    held.release.set()
    wait_for(lambda: node.status()["counters"].get("disconnects_with_leases") == 1, 10,
             "the node seeing the connection end with its lease")
    assert node.status()["leases"] == 0
    assert lend(engine, KEYS).chunks == expected(range(3))  # on a new connection
    assert client.failures == 0  # the node was never taken for down


def test_a_stream_is_read_on_a_socket_past_fd_setsize(
        below_ram: tuple[NodeServer, HeldRead]) -> None:
    """An engine process holds many files (vLLM's, its clients'): a connection's descriptor
    past select()'s FD_SETSIZE (1024) still reads its parts."""
    node, held = below_ram
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 1200:
        pytest.skip(f"this process may open {hard} files, not 1,200")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 1200), hard))
    padding = [os.open(os.devnull, os.O_RDONLY) for _ in range(1100)]
    try:
        client, engine = connect(node.config.socket_path)
        got = []
        with engine.lend_as_landed(KEYS, _spare(), in_order=True) as lending:
            for loan in lending:
                with loan:
                    got.append((loan.index, bytes(loan.view.data)))
                if loan.index == 1:
                    held.release.set()  # chunk 2 comes in a part of its own
        assert got == expected(range(3))
        assert client.failures == 0
    finally:
        for fd in padding:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
