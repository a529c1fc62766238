"""A node restarted on the same name recovers the RAM tier's chunks its predecessor held whole
(tiers/shmslab.py): after a crash (SIGKILL) or a clean stop, every chunk whose slot still
hashes to the checksum recorded at its commit is back in RAM for the engines, a torn or
scribbled slot is dropped (counted), a chunk evicted before the crash stays gone, and
`--drop-ram` leaves nothing to recover. Real `kvtier node serve` processes on one name."""

from __future__ import annotations

import gc
import struct
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from nodekit import (
    LAYOUT,
    NodeProcess,
    connect,
    expected,
    key,
    lend,
    memory_tier,
    node_tiers,
    payload,
    put_chunks,
    shm_files,
    wait_for,
)

from kvtier.node.nodestore import NodeStore

pytestmark = pytest.mark.timeout(120)


def crash(node: NodeProcess) -> None:
    """SIGKILL, leaving its slabs in /dev/shm (NodeProcess.kill would remove them)."""
    assert node.process is not None
    node.process.kill()
    node.process.wait(timeout=20)


def recovered(node: NodeProcess, total: int) -> dict[str, int]:
    """The node's counters once its recovery has dealt with `total` chunks."""
    return wait_for(lambda: (c := node.status()["counters"])["recovered_chunks"]
                    + c["recovery_dropped_chunks"] >= total and c, 30, "the recovery")


def filled_then_crashed(start_node: Callable[..., NodeProcess], config: dict[str, Any],
                        *steps: range | list[int]) -> NodeProcess:
    """A node whose engine stored each step of chunks (every put succeeding), then SIGKILLed."""
    node = start_node(config)
    _client, engine = connect(node.socket_path)
    for ids in steps:
        assert put_chunks(engine, ids) == [True] * len(ids)
    crash(node)
    return node


def restarted(start_node: Callable[..., NodeProcess], config: dict[str, Any], total: int
              ) -> tuple[NodeProcess, dict[str, int]]:
    """A node started on the crashed one's name, and its counters once its recovery has dealt
    with `total` chunks (it starts at the layout's first engine's hello)."""
    node = start_node(config)
    _client, engine = connect(node.socket_path)
    engine.contains(key(0))
    return node, recovered(node, total)


def stored_on_another_thread(store: NodeStore, ids: list[int]) -> list[bool]:
    """`put_chunks` on a thread of its own (an engine's store thread: its own connection)."""
    out: list[list[bool]] = []
    thread = threading.Thread(target=lambda: out.append(put_chunks(store, ids)))
    thread.start()
    thread.join(60)
    return out[0]


def test_a_crashed_nodes_chunks_are_back_in_ram_after_a_restart(
        tmp_path: Path, start_node: Callable[..., NodeProcess]) -> None:
    config = node_tiers(tmp_path, ram_chunks=8)
    filled_then_crashed(start_node, config, range(5))
    node, counters = restarted(start_node, config, 5)
    assert (counters["recovered_chunks"], counters["recovery_dropped_chunks"]) == (5, 0)
    _client, engine = connect(node.socket_path)
    assert lend(engine, [key(i) for i in range(5)]).chunks == expected(range(5))
    assert [p.name.endswith(".old") for p in shm_files(node.name)] == [False]  # removed


def test_a_torn_slot_is_dropped_and_the_others_recovered(
        tmp_path: Path, start_node: Callable[..., NodeProcess]) -> None:
    config = node_tiers(tmp_path, ram_chunks=8)
    node = filled_then_crashed(start_node, config, range(5))
    [slab] = shm_files(node.name)
    data = bytearray(slab.read_bytes())
    at = data.find(payload(2))
    assert at >= 0
    data[at + 100] ^= 0xFF  # a write torn by the crash, or a scribble
    slab.write_bytes(data)

    node, counters = restarted(start_node, config, 5)
    assert (counters["recovered_chunks"], counters["recovery_dropped_chunks"]) == (4, 1)
    _client, engine = connect(node.socket_path)
    assert lend(engine, [key(i) for i in range(5)]).chunks == expected([0, 1])  # stops at 2
    assert lend(engine, [key(3), key(4)]).chunks == expected([3, 4])


def test_an_evicted_chunk_is_not_brought_back(
        tmp_path: Path, start_node: Callable[..., NodeProcess]) -> None:
    config = node_tiers(tmp_path, ram_chunks=4)
    filled_then_crashed(start_node, config, range(4), [4, 5])  # 0 and 1 evicted for 4, 5
    node, counters = restarted(start_node, config, 4)
    assert counters["recovered_chunks"] == 4
    _client, engine = connect(node.socket_path)
    assert lend(engine, [key(0)]).chunks == []
    assert lend(engine, [key(i) for i in range(2, 6)]).chunks == expected(range(2, 6))


def test_a_clean_stop_keeps_ram_for_the_next_node_unless_told_to_drop_it(
        tmp_path: Path, start_node: Callable[..., NodeProcess]) -> None:
    config = node_tiers(tmp_path, ram_chunks=8)
    node = start_node(config)
    _client, engine = connect(node.socket_path)
    assert put_chunks(engine, range(3)) == [True] * 3
    assert node.stop() == 0
    assert len(shm_files(node.name)) == 1  # kept

    node, counters = restarted(start_node, config, 3)
    assert counters["recovered_chunks"] == 3
    _client, engine = connect(node.socket_path)
    assert lend(engine, [key(i) for i in range(3)]).chunks == expected(range(3))


def test_an_engine_reading_in_place_lets_the_old_slab_go_after_a_restart(
        tmp_path: Path, start_node: Callable[..., NodeProcess]) -> None:
    """An engine thread that only reads in place (it knows its chunks' slots) asked the node
    nothing, so after a restart it read the old node's slab for ever (removed from /dev/shm
    by the new node, still mapped: a whole RAM tier kept alive beside the new one). Once
    another of the engine's threads has mapped the new node's slab, its next load borrows
    from the node now serving."""
    config = node_tiers(tmp_path, ram_chunks=8)
    node = start_node(config)
    client, engine = connect(node.socket_path)
    assert put_chunks(engine, range(3)) == [True] * 3
    first = client.generation()
    assert lend(engine, [key(i) for i in range(3)]).chunks == expected(range(3))
    # Read in place: the node told (Touch, no reply awaited), nothing asked.
    wait_for(lambda: node.status()["counters"]["read_in_place"] == 3, 30, "the touches")
    assert node.stop() == 0

    node, counters = restarted(start_node, config, 3)
    assert counters["recovered_chunks"] == 3
    assert [p.name.endswith(".old") for p in shm_files(node.name)] == [False]  # removed
    # The engine's store thread stores its next step: connected to the new node, whose slab
    # it maps. Then the load thread loads.
    assert stored_on_another_thread(engine, [5]) == [True]
    assert lend(engine, [key(i) for i in range(3)]).chunks == expected(range(3))
    assert client.generation() not in (None, first)  # the new node's slab
    # Lent by the node now serving (its counters: once its tier has counted the loan).
    wait_for(lambda: memory_tier(node.status())["hits"] == 3, 30, "the new node's 3 hits")
    gc.collect()
    maps = Path("/proc/self/maps").read_text()
    assert f"{node.name}.old" not in maps and f"{node.name} (deleted)" not in maps


def test_drop_ram_removes_the_slab_at_a_clean_stop(
        tmp_path: Path, start_node: Callable[..., NodeProcess]) -> None:
    config = node_tiers(tmp_path, ram_chunks=8)
    node = start_node(config, args=("--drop-ram",))
    _client, engine = connect(node.socket_path)
    assert put_chunks(engine, range(3)) == [True] * 3
    assert shm_files(node.name)
    assert node.stop() == 0
    assert shm_files(node.name) == []



def test_drop_ram_names_the_slabs_of_layouts_it_never_opened_at_its_stop(
        tmp_path: Path, start_node: Callable[..., NodeProcess]) -> None:
    """A node started with --drop-ram to be stopped cold, whose engines never came back,
    removes no slab of its predecessor (a layout it never opened: its model may come back),
    and its stop says so, naming the file. Before, it logged "RAM slabs removed" and left a
    whole RAM tier in /dev/shm for the operator to find."""
    config = node_tiers(tmp_path, ram_chunks=8)
    node = start_node(config)
    _client, engine = connect(node.socket_path)
    assert put_chunks(engine, range(3)) == [True] * 3
    assert node.stop() == 0
    [slab] = shm_files(node.name)

    node = start_node(config, args=("--drop-ram",))
    assert node.stop() == 0
    assert shm_files(node.name) == [slab]  # not its own: kept
    stopped = node.log_path.read_text().splitlines()[-1]
    assert "stopped" in stopped and str(slab) in stopped, stopped
    assert "RAM slabs removed)" not in stopped

def test_a_load_held_in_place_survives_its_thread_letting_the_old_slab_go(
        tmp_path: Path, start_node: Callable[..., NodeProcess]) -> None:
    """A device mover's inline load keeps its in-place loans until the step ends, while the
    model runner's thread loads the step's next request: if that load finds the restarted
    node's slab mapped by another thread (its stores), its thread's reader is closed under the
    held loans, whose release then unlocked through a closed fd (ValueError out of the
    worker's take_report: the engine crashed)."""
    config = node_tiers(tmp_path, ram_chunks=8)
    node = start_node(config)
    _client, engine = connect(node.socket_path)
    assert put_chunks(engine, range(3)) == [True] * 3
    held = engine.lend_as_landed([key(0)], [memoryview(bytearray(LAYOUT.bytes_per_chunk))],
                                 in_order=True)
    [loan] = list(held)
    assert loan.view.data.tobytes() == payload(0)
    assert node.stop() == 0
    node, _counters = restarted(start_node, config, 3)
    assert [p.name.endswith(".old") for p in shm_files(node.name)] == [False]  # removed
    assert stored_on_another_thread(engine, [5]) == [True]  # the new node's slab mapped
    assert lend(engine, [key(1), key(2)]).chunks == expected([1, 2])  # the next request
    held.close()  # the step's end: the first request's loans go back


def test_a_slab_of_an_older_format_is_said_so_and_not_recovered(
        tmp_path: Path, start_node: Callable[..., NodeProcess]) -> None:
    """A node upgraded to stamped slabs (KVTSLAB3) finds its predecessor's slab of the format
    before (records, no stamps): not recovered, and the log says it is an upgrade, once.
    Before, it said "not a slab of this layout", which sent an operator looking for a
    model or layout change."""
    config = node_tiers(tmp_path, ram_chunks=8)
    node = filled_then_crashed(start_node, config, range(3))
    [slab] = shm_files(node.name)
    data = slab.read_bytes()
    footer = struct.Struct("<8sQQQ32x")  # magic, slot_bytes, num_slots, chunk_bytes
    _magic, slot_bytes, num_slots, chunk_bytes = footer.unpack(data[-footer.size:])
    slab.write_bytes(data[:num_slots * (slot_bytes + 96)]  # the slots and their records
                     + footer.pack(b"KVTSLAB2", slot_bytes, num_slots, chunk_bytes))
    node = start_node(config)
    _client, engine = connect(node.socket_path)
    assert not engine.contains(key(0))

    def said() -> list[str]:
        return [line for line in node.log_path.read_text().splitlines() if "KVTSLAB2" in line]

    [line] = wait_for(said, 30, "the node's word on the older slab")
    assert "older kvtier's format" in line and "empty RAM" in line, line
    assert node.status()["counters"]["recovered_chunks"] == 0
