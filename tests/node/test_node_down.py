"""A node that is not there, stopped or restarting never hurts its engines: every call is a
miss (loads, lookups) or a dropped store, none raises, none waits past the client's deadline,
and the calls during the back-off after a failure do not wait at all (an engine goes on at
full speed without its cache); once the node answers again the same client works again, and
after a restart it maps the new node's slab by itself.

Real `kvtier node serve` processes, stopped with SIGSTOP and restarted with SIGTERM: what is
tested is what an engine sees of another process's faults. `running_node` restarted in-process
for the races of a restart with an engine's threads: a slot or a loan of the old node must
never touch the new node's slab or leases (offsets and lease numbers start again there).
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path

import pytest
from nodekit import (
    NodeProcess,
    borrower,
    connect,
    expected,
    key,
    lend,
    node_tiers,
    payload,
    put_chunks,
    shm_files,
    wait_for,
)

from kvtier.core.retention import DEFAULT_META
from kvtier.errors import NodeUnavailable
from kvtier.node.probe import NodeProbe
from kvtier.node.server import NodeServer

pytestmark = pytest.mark.timeout(120)  # a hang fails here, not at the suite's 900 s


def assert_node_missed(socket_path: Path) -> None:
    """Every call of a client of a node that cannot answer misses without raising."""
    client, engine = connect(socket_path)
    lent = lend(engine, [key(0), key(1)])
    assert (lent.chunks, lent.stopped_at, lent.failed_tier) == ([], 0, "node")
    assert put_chunks(engine, [0]) == [False]
    assert engine.stats().tiers[0].dropped_writes == 1
    with pytest.raises(NodeUnavailable):  # the scheduler's locator: its index, then
        NodeProbe([client]).contains_many([key(0), key(1)])
    assert not engine.contains(key(0))
    assert engine.retain(key(0), DEFAULT_META) == 0
    assert not engine.flush(timeout_s=1)
    assert client.failures >= 1


def test_no_node_at_the_socket_is_a_miss(tmp_path: Path, socket_path: Path):
    assert_node_missed(socket_path)  # no file there
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(str(socket_path))  # a socket file no one listens on (a node killed)
    stale.close()
    assert_node_missed(socket_path)


def test_a_slab_an_engine_cannot_map_is_a_miss(
        tmp_path: Path, node_name: str,
        in_process_node: Callable[..., AbstractContextManager[NodeServer]]):
    """The node's slab removed from /dev/shm under it (an operator, systemd's RemoveIPC), or
    not shared with the engine's container: a new engine's calls miss, as with no node.
    Before: FileNotFoundError out of every call (the scheduler's lookups too)."""
    with in_process_node(node_tiers(tmp_path, ram_chunks=8)) as node:
        _client, engine = connect(node.config.socket_path)
        assert put_chunks(engine, [0]) == [True]
        [slab] = shm_files(node_name)
        slab.unlink()
        assert_node_missed(node.config.socket_path)


@pytest.mark.timing
def test_a_stopped_node_costs_one_deadline_then_nothing_until_it_answers_again(
        tmp_path: Path, start_node: Callable[..., NodeProcess]):
    node = start_node(node_tiers(tmp_path, ram_chunks=8))
    timeout_s, retry_s = 1.0, 2.0
    client, engine = connect(node.socket_path, timeout_s=timeout_s, retry_s=retry_s)
    assert put_chunks(engine, [0]) == [True]
    assert lend(engine, [key(0)]).chunks == expected([0])

    node.pause()
    # What this engine stored it reads in place: the stopped node is not asked.
    start = time.monotonic()
    assert lend(engine, [key(0)]).chunks == expected([0])
    assert time.monotonic() - start < timeout_s / 2
    # A load that needs the node (a chunk's slot not known here) waits out the deadline.
    start = time.monotonic()
    lent = lend(borrower(client), [key(0)])
    assert time.monotonic() - start < timeout_s + 2.0  # the deadline, and slack for a busy host
    assert (lent.chunks, lent.stopped_at, lent.failed_tier) == ([], 0, "node")
    # Within retry_s of that failure no call waits for the node.
    start = time.monotonic()
    assert put_chunks(engine, [1]) == [False]
    with pytest.raises(NodeUnavailable):
        NodeProbe([client]).contains_many([key(0)])
    assert lend(borrower(client), [key(0)]).stopped_at == 0
    assert lend(engine, [key(0)]).chunks == expected([0])  # in place, still
    assert time.monotonic() - start < timeout_s / 2
    # Nor later, while it stays stopped: its watch asks it, off the engine's threads. Before,
    # each call after every retry_s waited out a deadline again (each process of an engine
    # in turn: a node stopped for 20 s held the engine for 20 s).
    time.sleep(retry_s * 1.5)
    start = time.monotonic()
    assert lend(borrower(client), [key(0)]).stopped_at == 0
    assert put_chunks(engine, [1]) == [False]
    assert time.monotonic() - start < timeout_s / 2

    node.resume()
    # The same client, once its back-off has passed: lent again, stores again.
    wait_for(lambda: lend(borrower(client), [key(0)]).chunks == expected([0]), retry_s + 10,
             "chunk 0 lent again after SIGCONT")
    assert put_chunks(engine, [1]) == [True]
    assert lend(engine, [key(0), key(1)]).chunks == expected([0, 1])
    # The borrow the stopped node answered late went to a closed connection: released.
    wait_for(lambda: node.status()["leases"] == 0, 10, "no lease left")


def test_a_restarted_node_is_found_again_with_its_new_slab(
        tmp_path: Path, start_node: Callable[..., NodeProcess], node_name: str):
    config = node_tiers(tmp_path, ram_chunks=8)
    node = start_node(config)
    client, engine = connect(node.socket_path, timeout_s=2.0, retry_s=0.2)
    assert put_chunks(engine, [0]) == [True]
    assert lend(engine, [key(0)]).chunks == expected([0])
    assert client.welcome is not None
    first = client.welcome.generation
    assert len(shm_files(node_name)) == 1

    assert node.stop() == 0
    # A clean stop removes its socket; its slab stays for the next node to recover from
    # (test_node_recovery.py; --drop-ram removes it).
    assert not node.socket_path.exists()
    assert len(shm_files(node_name)) == 1

    restarted = start_node(config)
    # The client (not rebuilt) reconnects by itself once a call fails on the old connection.
    wait_for(lambda: engine.flush(timeout_s=1), 15, "the client answered by the new node")
    assert client.welcome.generation != first
    assert client.welcome.generation == restarted.status()["generation"]
    # The new slab is another file: chunk 0 comes back only through its recovery.
    wait_for(lambda: restarted.status()["counters"]["recovered_chunks"] == 1, 30,
             "chunk 0 recovered")
    assert lend(engine, [key(0)]).chunks == expected([0])
    # Stores go into the new slab: another engine, mapping it afresh, is lent their bytes.
    assert put_chunks(engine, [1]) == [True]
    assert lend(engine, [key(1)]).chunks == expected([1])
    _fresh_client, fresh = connect(restarted.socket_path)
    assert lend(fresh, [key(1)]).chunks == expected([1])


def test_a_node_shut_down_in_process_ends_its_engines_connections(
        tmp_path: Path, in_process_node: Callable[..., AbstractContextManager[NodeServer]]):
    config = node_tiers(tmp_path, ram_chunks=8)
    with in_process_node(config) as node:
        client, engine = connect(node.config.socket_path, retry_s=0.2)
        assert put_chunks(engine, [0]) == [True]
        first = node.generation
    # Its connection ended with it: the engine misses (the node's fault), and is not answered
    # by the closed stores of a node that is gone.
    assert client.failures == 0
    with pytest.raises(NodeUnavailable):
        NodeProbe([client]).contains_many([key(0)])
    assert client.failures == 1
    lent = lend(borrower(client), [key(0)])
    assert (lent.chunks, lent.stopped_at, lent.failed_tier) == ([], 0, "node")
    # What the engine stored it still reads in place: the slab it mapped, its chunks whole
    # (kept in /dev/shm for the next node; any node's claims are gone with it).
    assert lend(engine, [key(0)]).chunks == expected([0])
    with in_process_node(config) as restarted:
        wait_for(lambda: engine.flush(timeout_s=1), 15, "the client answered by the new node")
        assert client.welcome is not None
        assert client.welcome.generation == restarted.generation != first
        assert put_chunks(engine, [1]) == [True]
        assert lend(engine, [key(1)]).chunks == expected([1])





@pytest.mark.parametrize("remapped_by", ["load thread", "store thread"])
def test_a_slot_reserved_before_a_restart_is_never_filled_in_the_new_slab(
        tmp_path: Path, socket_path: Path, remapped_by: str,
        in_process_node: Callable[..., AbstractContextManager[NodeServer]]):
    """An engine's store thread reserves a slot (offset 0 of the node's slab); the node
    restarts; another engine stores a chunk in the new slab (at offset 0 too), and the first
    engine maps the new slab (on its load thread, or on the store thread itself). The store
    thread's fill of its old slot must not land on the other engine's chunk."""
    config = node_tiers(tmp_path, ram_chunks=8)
    _client, engine = connect(socket_path, retry_s=0.2)
    with in_process_node(config):
        engine.plan_puts([key(1)], [DEFAULT_META])  # a slot of the first node
    with in_process_node(config):
        _other_client, other = connect(socket_path)
        assert put_chunks(other, [2]) == [True]
        if remapped_by == "load thread":
            loaded: list[object] = []
            load_thread = threading.Thread(
                target=lambda: loaded.append(lend(engine, [key(2)]).chunks))
            load_thread.start()
            load_thread.join(timeout=20)
            assert loaded == [expected([2])]
        else:
            wait_for(lambda: engine.flush(timeout_s=1), 15, "the new node answering")

        def fill(slot: memoryview) -> None:
            slot[:] = payload(1)
        stored = engine.put_from(key(1), fill, memoryview(bytearray(4096)))
        # (On the load thread's way, its commit, sent without waiting, is lost with the old
        # connection: put_from cannot know it and says True. What matters: the new slab.)
        assert not stored or remapped_by == "load thread"
        assert lend(other, [key(2)]).chunks == expected([2])
        assert lend(other, [key(1)]).stopped_at == 0


def test_a_loan_from_before_a_restart_releases_nothing_of_the_new_node(
        tmp_path: Path, socket_path: Path,
        in_process_node: Callable[..., AbstractContextManager[NodeServer]]):
    """Lease numbers start again in a restarted node: an engine's lending that outlived the
    node it came from must not, when it ends, release another engine's loan of the same
    number in the new node (its chunk would be evicted and overwritten while lent)."""
    config = node_tiers(tmp_path, ram_chunks=8)
    _client, engine = connect(socket_path, retry_s=0.2)
    with in_process_node(config):
        assert put_chunks(engine, [0]) == [True]  # lease 1
        old_lending = borrower(_client).lend_as_landed([key(0)], [memoryview(bytearray(4096))])
        assert len(list(old_lending)) == 1  # lease 2, held
    with in_process_node(config) as restarted:
        other_client, other = connect(socket_path)
        assert put_chunks(other, [2]) == [True]  # lease 1
        with borrower(other_client).lend_as_landed([key(2)],
                                                   [memoryview(bytearray(4096))]) as lending:
            assert len(list(lending)) == 1  # lease 2, held
            wait_for(lambda: engine.flush(timeout_s=1), 15, "the new node answering")
            old_lending.close()
            assert engine.flush(timeout_s=1)  # after anything it sent before
            assert restarted.status()["leases"] == 1
