"""An engine frozen (SIGSTOP) while the node sends it a large reply (a load's chunks carried
in the reply: RAM had no free slot for them). Before, the node's thread for that connection
blocked in the send for as long as the engine stayed frozen. Now the send gives up after
`--lease-timeout-s` without progress and the connection is closed; but the slots the engine
reserved on it are not freed while its process lives (it may wake and write them in place:
another chunk given one meanwhile would be overwritten): they stay its own until the process
is gone, then go back to the RAM tier; or, for an engine that checks stamps (it closes a
connection only once nothing can write its slots), until it closes its end of the connection.

A real `kvtier node serve`, and a real engine process stopped with SIGSTOP.
"""

from __future__ import annotations

import dataclasses
import json
import logging
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
    node_tiers,
    older_hello,
    put_chunks,
    wait_for,
)

from kvtier.core.retention import DEFAULT_META
from kvtier.node.config import NodeConfig
from kvtier.node.protocol import Borrow, Meta, send
from kvtier.node.server import running_node
from kvtier.tiers.storeconfig import StoreConfig

pytestmark = pytest.mark.timeout(120)
RAM, DISK, LOADED = 8, 600, 512  # chunks: the load's reply carries 512 x 4 KiB

# An engine that reserves every RAM slot for its stores (not written yet), asks for a load
# whose chunks come in the reply (RAM has no slot for them) and reads none of it, says so,
# and on its next line of input writes its reserved slots (late) and says what it stored.
ENGINE = """
import json, sys
sys.path[:0] = [sys.argv[3], sys.argv[4]]  # tests/node, tests
from nodekit import connect, key, payload
from kvtier.core.layout import KVLayout
from kvtier.core.retention import DEFAULT_META
from kvtier.node.protocol import Borrow, Meta, send
layout = KVLayout(**json.loads(sys.argv[2]))
ram, loaded = int(sys.argv[5]), int(sys.argv[6])
if sys.argv[7] == "older":  # its Hello says nothing of stamps
    import kvtier.node.client
    from nodekit import older_hello
    kvtier.node.client.Hello = older_hello
client, store = connect(sys.argv[1], layout, engine="frozen", timeout_s=30.0)
mine = [1000 + i for i in range(ram)]
store.plan_puts([key(i) for i in mine], [DEFAULT_META] * ram)
send(client._local.sock, Borrow([key(i) for i in range(loaded)],
                                [Meta.of(DEFAULT_META)] * loaded))  # its reply never read
print(json.dumps({"asked": True}), flush=True)
sys.stdin.readline()  # stopped here
spare = memoryview(bytearray(4096))
def fill(i):
    def write(slot):
        slot[:] = payload(i)
    return write
late = [store.put_from(key(i), fill(i), spare) for i in mine]
print(json.dumps({"late_puts": late}), flush=True)
sys.stdin.read()
"""


def held_by_frozen(held: dict[str, dict[str, int]], kind: str) -> bool:
    """Whether `held` (the node's status's) is the frozen engine's reserved slots (every RAM
    slot), and for an older engine its load's lending too."""
    if kind == "current":
        return held == {"frozen": {"leases": 1, "chunks": RAM}}
    return set(held) == {"frozen"} and held["frozen"]["leases"] == 2 \
        and held["frozen"]["chunks"] > RAM


@pytest.mark.parametrize("kind", ["current", "older"])
def test_a_reply_a_frozen_engine_never_reads_ends_its_connection_not_its_slots(
        tmp_path: Path, start_node: Callable[..., NodeProcess], kind: str) -> None:
    node = start_node(node_tiers(tmp_path, ram_chunks=RAM, disk_chunks=DISK),
                      args=("--lease-timeout-s", "1"))
    neighbour_client, neighbour = connect(node.socket_path, engine="neighbour")
    # The chunks of the load: RAM's first, the rest (sent with their commits) on disk.
    assert sum(put_chunks(neighbour, range(LOADED))) == RAM
    assert neighbour.flush(30)
    engine = subprocess.Popen(
        [sys.executable, "-c", ENGINE, str(node.socket_path),
         json.dumps(dataclasses.asdict(LAYOUT)), str(Path(__file__).parent),
         str(Path(__file__).parent.parent), str(RAM), str(LOADED), kind],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert engine.stdin is not None and engine.stdout is not None
        said = Lines(engine.stdout)
        assert json.loads(said.next(30, "the engine")) == {"asked": True}
        engine.send_signal(signal.SIGSTOP)
        # The node gives up the send (a second without progress) and closes the connection.
        wait_for(lambda: node.status()["counters"].get("send_timeouts") == 1, 30,
                 "the node to give up its reply to the frozen engine")
        wait_for(lambda: "frozen" not in node.status()["engines"], 10,
                 "the frozen engine's connection closed")
        # Its reserved slots (every RAM slot) are still its own: the neighbour's next
        # chunks find no RAM slot (they go to disk), none is given a slot the engine may
        # still write. An older engine's lending too (it may copy its slots when it wakes,
        # checking no stamp): as many chunks as the reply carried before it stalled.
        assert held_by_frozen(node.status()["held"], kind)
        # The status says whose they are: the engine closed, by its pid (to kill it).
        assert node.status()["quarantined"] == {"frozen": engine.pid}
        ids = list(range(2000, 2000 + RAM))
        assert put_chunks(neighbour, ids) == [False] * RAM
        assert neighbour.flush(30)  # on disk
        # The engine wakes and writes its reserved slots, late: none of the neighbour's
        # chunks is overwritten (its connection is gone: none of its chunks is stored).
        engine.send_signal(signal.SIGCONT)
        engine.stdin.write("wake\n")
        engine.stdin.flush()
        assert json.loads(said.next(30, "the engine, woken")) == {"late_puts": [False] * RAM}
        assert lend(neighbour, [key(i) for i in ids]).chunks == expected(ids)
        if kind == "older":  # it may write them after closing: kept while it lives
            # (the neighbour's own lending may still be held: its release is sent, not awaited)
            assert held_by_frozen({"frozen": node.status()["held"]["frozen"]}, kind)
    finally:
        if kind == "older":
            engine.send_signal(signal.SIGCONT)
            engine.kill()
            engine.wait(timeout=20)
    # Its process gone (or, an engine that checks stamps, its connection closed once it
    # woke, found the node's end shut and wrote nothing more): its slots are freed, and a
    # step of RAM stores all land in RAM again.
    try:
        wait_for(lambda: "frozen" not in node.status()["held"], 30, "the engine's slots freed")
        assert node.status()["counters"]["quarantines_ended"] == 1
        assert node.status()["quarantined"] == {}
        # The node's log says why they were kept and when they were freed.
        log = node.log_path.read_text()
        until = {"current": "kept until it closes the connection or its process is gone",
                 "older": "kept until its process is gone"}[kind]
        why = {"current": "closed its connection; the 1 lease(s)",
               "older": "process ended; the 2 lease(s)"}[kind]
        assert "frozen (pid " in log and until in log
        assert f"frozen: {why} kept since its connection was closed" in log
    finally:
        engine.kill()
        engine.wait(timeout=20)
        for stream in (engine.stdin, engine.stdout):
            if stream is not None:
                stream.close()
    ids = list(range(3000, 3000 + RAM))
    assert put_chunks(neighbour, ids) == [True] * RAM
    assert lend(neighbour, [key(i) for i in ids]).chunks == expected(ids)
    neighbour_client.close()


def test_a_stalled_engine_the_node_cannot_watch_is_freed_when_it_closes_its_connection(
        tmp_path: Path, socket_path: Path, node_name: str, caplog: pytest.LogCaptureFixture,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """An engine in another pid namespace than the node's (the shipped Kubernetes deployment:
    its peer pid reads 0) cannot be watched by its pid; but an engine that checks stamps
    closes a connection only once nothing can write its slots, and a process's end closes
    its sockets in any namespace: the node keeps its end open (shut for writing) and frees
    what the engine holds when it hangs up. Before, those slots stayed until the node
    stopped (an incident's stores, for the node's life). The fault: the pid not visible."""
    monkeypatch.setattr("kvtier.node.quarantine.peer_pid", lambda _sock: 0)
    caplog.set_level(logging.INFO, logger="kvtier.node")
    config = NodeConfig(StoreConfig.parse(node_tiers(tmp_path, RAM, DISK)), socket_path,
                        name=node_name, lease_timeout_s=1.0)
    with running_node(config) as node:
        neighbour_client, neighbour = connect(socket_path, engine="neighbour")
        assert sum(put_chunks(neighbour, range(LOADED))) == RAM
        assert neighbour.flush(30)
        client, store = connect(socket_path, engine="unwatched", timeout_s=30.0)
        mine = [key(1000 + i) for i in range(RAM)]
        store.plan_puts(mine, [DEFAULT_META] * RAM)
        send(client._local.sock, Borrow([key(i) for i in range(LOADED)],
                                        [Meta.of(DEFAULT_META)] * LOADED))  # never read
        wait_for(lambda: node.status()["counters"]["send_timeouts"] == 1, 30,
                 "the node to give up its reply")
        assert node.status()["quarantined"] == {"unwatched": 0}
        assert node.status()["held"]["unwatched"] == {"leases": 1, "chunks": RAM}
        [said] = [r.getMessage() for r in caplog.records if "took nothing" in r.getMessage()]
        assert "(pid not visible)" in said, said
        assert "kept until it closes the connection or its process is gone" in said, said
        client.close()  # the engine hangs up (as its process's end would)
        wait_for(lambda: "unwatched" not in node.status()["held"], 30,
                 "the slots of the engine that hung up freed")
        assert node.status()["quarantined"] == {}
        # Said once the leases are freed (and counted): the log line may come a moment after.
        wait_for(lambda: any("unwatched: closed its connection; the 1 lease(s) kept"
                             in r.getMessage() for r in caplog.records), 30,
                 "the node to say it freed them")
        assert node.status()["counters"]["quarantines_ended"] == 1
        ids = list(range(3000, 3000 + RAM))  # RAM's every slot is the neighbour's to take
        assert put_chunks(neighbour, ids) == [True] * RAM
        assert lend(neighbour, [key(i) for i in ids]).chunks == expected(ids)
        neighbour_client.close()


def test_a_stalled_older_engine_the_node_cannot_watch_is_said_kept_until_the_node_stops(
        tmp_path: Path, socket_path: Path, node_name: str, caplog: pytest.LogCaptureFixture,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """An older engine (it says nothing of stamps: it may write a slot after closing a
    connection) in another pid namespace keeps what it holds until the node stops, and the
    node's log and status say so, even once it has closed its connection."""
    monkeypatch.setattr("kvtier.node.quarantine.peer_pid", lambda _sock: 0)
    monkeypatch.setattr("kvtier.node.client.Hello", older_hello)
    caplog.set_level(logging.WARNING, logger="kvtier.node")
    config = NodeConfig(StoreConfig.parse(node_tiers(tmp_path, RAM, DISK)), socket_path,
                        name=node_name, lease_timeout_s=1.0)
    with running_node(config) as node:
        neighbour_client, neighbour = connect(socket_path, engine="neighbour")
        assert sum(put_chunks(neighbour, range(LOADED))) == RAM
        assert neighbour.flush(30)
        client, store = connect(socket_path, engine="older", timeout_s=30.0)
        store.plan_puts([key(1000 + i) for i in range(RAM)], [DEFAULT_META] * RAM)
        send(client._local.sock, Borrow([key(i) for i in range(LOADED)],
                                        [Meta.of(DEFAULT_META)] * LOADED))  # never read
        wait_for(lambda: node.status()["counters"]["send_timeouts"] == 1, 30,
                 "the node to give up its reply")
        [said] = [r.getMessage() for r in caplog.records if "took nothing" in r.getMessage()]
        assert "(pid not visible)" in said and "kept until the node stops" in said, said
        client.close()
        # Its hang-up frees nothing: the status still says whose they are.
        assert put_chunks(neighbour, [2000]) == [False]
        assert node.status()["quarantined"] == {"older": 0}
        assert node.status()["held"]["older"]["leases"] == 2  # its stores' and its load
        neighbour_client.close()
