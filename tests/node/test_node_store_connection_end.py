"""A store step whose mid-step call to the node fails while earlier chunks are still being
copied into their reserved slots: the engine must not end the connection that holds those
slots until the copies into them are done, else the node frees them, another engine stores
its chunks there, and the late copies overwrite them (a mix of two chunks served as KV).

The device mover on the stand-in device (its DMAs run late, on a stream thread; here held by
a gate until the test opens it); a real node (in process); the step stores a chunk twice
(the second is not reserved in advance: a round trip of its own, mid-step), and that
`Reserve` is held by the node past the engine's deadline (a fault injected at the node).
Meanwhile a neighbour engine stores as many chunks as RAM takes. Before, the engine closed
its connection at the timeout: the node gave the neighbour the slots the engine's DMAs
were still to write, and the neighbour's chunks came back with the engine's bytes.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch
from nodekit import borrower, connect, expected, lend, put_chunks, wait_for
from tierkit import key

from kvtier.integrations.vllm.transfers import ChunkTransfer
from kvtier.integrations.vllm.worker.cpu import CpuChunkMover
from kvtier.integrations.vllm.worker.paged import PagedKV
from kvtier.integrations.vllm.worker.streams import StreamChunkMover
from kvtier.node.config import NodeConfig
from kvtier.node.server import NodeServer, running_node
from kvtier.testing.standin import StandInDevice
from kvtier.testing.vllmviews import VllmCacheSpec, vllm_kv_caches
from kvtier.tiers.storeconfig import StoreConfig

pytestmark = pytest.mark.timeout(120)
BS, BPC, RAM_CHUNKS = 16, 2, 6


class GatedDevice(StandInDevice):
    """The stand-in device whose store DMAs wait for `gate` (a slow copy engine)."""

    def __init__(self) -> None:
        super().__init__(seed=5)
        self.gate = threading.Event()

    def run(self, stream: Any, work: Callable[[], Any]) -> None:
        if stream.name == "store copy":
            self.enqueue(stream, lambda: self.gate.wait(timeout=60))
        super().run(stream, work)


def _paged() -> PagedKV:
    kv = vllm_kv_caches(VllmCacheSpec(BS, 2, 8, 8, torch.bfloat16), 2, 16, "LBNHC")
    return PagedKV(kv, BS, content="halves", torch_ops=True)


@pytest.fixture
def node(socket_path: Path, node_name: str) -> Iterator[NodeServer]:
    layout = _paged().layout(BS * BPC)
    slot = -(-layout.bytes_per_chunk // 4096) * 4096
    config = NodeConfig(StoreConfig.parse({"tiers": [
        {"kind": "memory", "capacity": RAM_CHUNKS * slot}]}), socket_path, name=node_name)
    with running_node(config) as running:
        yield running


def test_slots_still_being_copied_into_are_never_freed_for_another_engine(
        node: NodeServer) -> None:
    paged = _paged()
    layout = paged.layout(BS * BPC)
    nbytes = layout.bytes_per_chunk
    client, store = connect(str(node.config.socket_path), layout, timeout_s=0.5,
                            engine="engine")
    neighbour_client, neighbour = connect(str(node.config.socket_path), layout,
                                          engine="neighbour")
    # The node holds the engine's second Reserve (the one made mid-step) until told.
    go, answered, disconnected = threading.Event(), threading.Event(), threading.Event()
    reserve, disconnect = node.reserve, node.disconnected
    reserves = 0

    def slow_reserve(owner: int, *args: Any, **kwargs: Any) -> Any:
        nonlocal reserves
        if node.book.engine_of(owner) == "engine":
            reserves += 1
            if reserves == 2:
                go.wait(timeout=60)
                try:
                    return reserve(owner, *args, **kwargs)
                finally:
                    answered.set()
        return reserve(owner, *args, **kwargs)

    def noted_disconnect(owner: int) -> None:
        mine = node.book.engine_of(owner) == "engine"
        disconnect(owner)
        if mine:
            disconnected.set()

    node.reserve = slow_reserve  # type: ignore[method-assign]
    node.disconnected = noted_disconnect  # type: ignore[method-assign]
    device = GatedDevice()
    mover = StreamChunkMover(paged, store, nbytes, lambda _k, _s: None, device=device,
                             staging=4, batch=1)
    # Chunk 0 twice: its second store is not reserved in advance (a round trip mid-step).
    transfers = [ChunkTransfer(key=key(i), block_ids=(i * BPC, i * BPC + 1)) for i in (0, 1, 0)]
    try:
        with ThreadPoolExecutor(1) as store_thread:  # the worker's store thread
            job = store_thread.submit(mover.store, transfers, "async")
            wait_for(lambda: client.failures >= 1, 30, "the engine's Reserve to time out")
            go.set()
            wait_for(answered.is_set, 30, "the node to answer the late Reserve")
            # Either the node saw the connection end (it frees what it held), or the engine
            # kept it open for its copies in flight.
            wait_for(lambda: disconnected.is_set() or client.parked >= 1, 30,
                     "the engine's connection to end or be kept for its copies")
            stored = put_chunks(neighbour, range(100, 100 + RAM_CHUNKS), nbytes)
            device.gate.set()
            job.result(timeout=60)
        device.drain()
        ids = [100 + i for i, ok in enumerate(stored) if ok]
        assert ids, "the neighbour stored nothing: the test shows nothing"
        # No DMA wrote a slot after the host (the neighbour) had written it: on a GPU that
        # late DMA would have overwritten the neighbour's chunk (the stand-in raises
        # HostBufferRaced instead, and leaves the bytes).
        assert device.take_errors() == []
        # Every chunk the neighbour stored holds its own bytes.
        assert lend(borrower(neighbour_client, layout), [key(i) for i in ids],
                    nbytes).chunks == expected(ids, nbytes)
        # Once its copies were done, the engine's connection ended: nothing stays held.
        wait_for(lambda: "engine" not in node.status()["held"], 30,
                 "the engine's slots to be freed")
    finally:
        device.gate.set()
        mover.close()
        device.close()
        client.close()
        neighbour_client.close()


def test_a_client_closed_mid_gather_frees_the_slot_only_once_the_gather_is_done(
        node: NodeServer) -> None:
    """The CPU mover gathers straight into its reserved slot; the client closed meanwhile (by
    another thread: the engine shutting down) keeps that connection open until the gather
    is done. Before, the node freed the slot at the close, the neighbour stored a chunk
    there, and the gather, finishing, overwrote it."""
    paged = PagedKV(vllm_kv_caches(VllmCacheSpec(BS, 2, 8, 8, torch.bfloat16), 2, 16,
                                   "LBNHC"), BS, content="halves")
    layout = paged.layout(BS * BPC)
    nbytes = layout.bytes_per_chunk
    client, store = connect(str(node.config.socket_path), layout, engine="engine")
    neighbour_client, neighbour = connect(str(node.config.socket_path), layout,
                                          engine="neighbour")
    gathering, gate = threading.Event(), threading.Event()
    gather = paged.gather

    def slow_gather(*args: Any, **kwargs: Any) -> Any:  # a gather slow to finish
        gathering.set()
        gate.wait(timeout=60)
        return gather(*args, **kwargs)

    paged.gather = slow_gather  # type: ignore[method-assign]
    mover = CpuChunkMover(paged, store, nbytes, lambda _k, _s: None)
    try:
        with ThreadPoolExecutor(1) as store_thread:
            job = store_thread.submit(
                mover.store, [ChunkTransfer(key=key(0), block_ids=(0, 1))], "async")
            wait_for(gathering.is_set, 30, "the gather into the reserved slot")
            client.close()
            wait_for(lambda: "engine" not in node.status()["held"] or client.parked >= 1, 30,
                     "the node to free the slot, or the engine to keep its connection")
            stored = put_chunks(neighbour, range(100, 100 + RAM_CHUNKS), nbytes)
            gate.set()
            assert job.result(timeout=60).stored == []  # its client closed: not committed
        ids = [100 + i for i, ok in enumerate(stored) if ok]
        # Every chunk the neighbour stored holds its own bytes, none the late gather's...
        assert lend(borrower(neighbour_client, layout), [key(i) for i in ids],
                    nbytes).chunks == expected(ids, nbytes)
        # ...and it got every slot but the one being gathered into.
        assert len(ids) == RAM_CHUNKS - 1
        wait_for(lambda: "engine" not in node.status()["held"], 30,
                 "the engine's slot to be freed")
    finally:
        gate.set()
        neighbour_client.close()
