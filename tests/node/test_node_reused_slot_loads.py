"""A load whose lending the node took back (the engine frozen past `lease_timeout_s` between
the node's answer and its copies), its slots given to other chunks meanwhile: each mover
checks every lent chunk's slot stamp once its copy is done, and reports the load failed at
the first chunk whose slot was written again (vLLM recomputes it and the rest), before the
load is reported: the CPU mover after its scatter, the device mover after its copies' event
(on its load thread, and inline: a node's chunks are waited for there, where RAM chunks of
its own tiers are not). Without the check, each mover took the other chunks' bytes for the
load's KV.

A real node (in process), a neighbour filling its RAM, vLLM's KV in vLLM 0.33's layout (on
the CPU stand-in device for the device mover); the freeze is injected (the engine's
`lend_as_landed` held until the node has taken its lending back and the neighbour has
churned RAM).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, MutableSequence, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch
from nodekit import connect, put_chunks, wait_for
from tierkit import key

from kvtier.core.keys import ChunkKey
from kvtier.core.loans import Lending
from kvtier.core.store import ChunkView
from kvtier.integrations.vllm.transfers import ChunkTransfer
from kvtier.integrations.vllm.worker.cpu import CpuChunkMover, spare_buffers
from kvtier.integrations.vllm.worker.paged import PagedKV
from kvtier.integrations.vllm.worker.streams import StreamChunkMover
from kvtier.node.config import NodeConfig
from kvtier.node.nodestore import NodeStore
from kvtier.node.server import NodeServer, running_node
from kvtier.testing.standin import StandInDevice
from kvtier.testing.vllmviews import VllmCacheSpec, vllm_kv_caches
from kvtier.tiers.storeconfig import StoreConfig

pytestmark = pytest.mark.timeout(120)
BS, BPC, CHUNKS, RAM_CHUNKS = 16, 2, 3, 8
LOADED_AT = 24  # the blocks the loads fill


def _paged(torch_ops: bool) -> PagedKV:
    kv = vllm_kv_caches(VllmCacheSpec(BS, 2, 8, 8, torch.bfloat16), 2, 48, "LBNHC")
    return PagedKV(kv, BS, content="halves", torch_ops=torch_ops)


def _transfers(first_block: int, base: int) -> list[ChunkTransfer]:
    return [ChunkTransfer(key=key(base + i), block_ids=tuple(
        range(first_block + i * BPC, first_block + (i + 1) * BPC))) for i in range(CHUNKS)]


class FrozenLoads(NodeStore):
    """An engine's store whose loads borrow (it knows no slot), and, when `frozen`, is
    stopped right after the node answered each: until the node has taken the lending back
    and `meanwhile` (the neighbour) has run."""

    def __init__(self, store: NodeStore, node: NodeServer,
                 meanwhile: Callable[[], None]) -> None:
        super().__init__(store._client, store._chunk_bytes)
        self.frozen = False
        self._node = node
        self._meanwhile = meanwhile

    def lend_as_landed(self, keys: Sequence[ChunkKey], spares: MutableSequence[memoryview],
                       metas: Sequence[Any] = (), *, in_order: bool = False,
                       until: float | None = None) -> Lending[ChunkView]:
        taken = self._node.counters.snapshot()["leases_expired"]
        lending = super().lend_as_landed(keys, spares, metas, in_order=in_order, until=until)
        if self.frozen:
            wait_for(lambda: self._node.counters.snapshot()["leases_expired"] > taken, 30,
                     "the node taking the lending back")
            self._meanwhile()
        return lending


@pytest.fixture
def node(tmp_path: Path, socket_path: Path, node_name: str) -> Iterator[NodeServer]:
    layout = _paged(False).layout(BS * BPC)
    slot = -(-layout.bytes_per_chunk // 4096) * 4096
    config = NodeConfig(StoreConfig.parse({"tiers": [
        {"kind": "memory", "capacity": RAM_CHUNKS * slot}]}), socket_path, name=node_name,
        lease_timeout_s=0.3)
    with running_node(config) as running:
        yield running


def _load(mover_kind: str, node: NodeServer, frozen: bool) -> tuple[int, bool, int]:
    """Store CHUNKS chunks through one engine's mover, then load them into other blocks
    through a store that borrows (`frozen`: stopped past the lease timeout after the node
    answered, the neighbour churning RAM meanwhile); the chunks loaded, whether their blocks
    hold the stored KV, and the copies counted reused."""
    paged = _paged(torch_ops=mover_kind != "cpu")
    layout = paged.layout(BS * BPC)
    client, store = connect(str(node.config.socket_path), layout, engine="engine")
    _, neighbour = connect(str(node.config.socket_path), layout, engine="neighbour")

    def churn() -> None:  # RAM filled twice over with the neighbour's chunks
        for step in range(4):
            ids = range(100 + step * RAM_CHUNKS, 100 + (step + 1) * RAM_CHUNKS)
            assert put_chunks(neighbour, ids, layout.bytes_per_chunk) == [True] * RAM_CHUNKS

    loads = FrozenLoads(store, node, churn)
    device = StandInDevice(seed=3, delays={"load": 0.005}) if mover_kind != "cpu" else None
    try:
        stores: CpuChunkMover | StreamChunkMover
        if device is None:
            stores = CpuChunkMover(paged, store, layout.bytes_per_chunk, lambda _k, _s: None)
            mover: CpuChunkMover | StreamChunkMover = CpuChunkMover(
                paged, loads, layout.bytes_per_chunk, lambda _k, _s: None)
            spares = spare_buffers(2, layout.bytes_per_chunk)
        else:
            stores = StreamChunkMover(paged, store, layout.bytes_per_chunk,
                                      lambda _k, _s: None, device=device, staging=2)
            mover = StreamChunkMover(paged, loads, layout.bytes_per_chunk,
                                     lambda _k, _s: None, device=device, staging=2)
            spares = spare_buffers(2, layout.bytes_per_chunk, device.pinned)
        base = 10 if frozen else 0  # chunks of its own each run
        assert len(stores.store(_transfers(0, base), "sync").stored) == CHUNKS
        loads.frozen = frozen
        if mover_kind == "device-thread":
            with ThreadPoolExecutor(1) as load_thread:  # the worker's load thread
                loaded = load_thread.submit(mover.load, _transfers(LOADED_AT, base), spares,
                                            mover.mark(), True).result()
        else:
            loaded = mover.load(_transfers(LOADED_AT, base), spares, wait=False)
        if device is not None:
            device.drain()
        mover.release()
        views = [v.view(torch.uint8) for v in paged.block_views]
        blocks = CHUNKS * BPC
        same = all(torch.equal(v[:blocks], v[LOADED_AT:LOADED_AT + blocks]) for v in views)
        return loaded, same, loads.reused_copies
    finally:
        for closing in (mover, stores):
            closing.close()
        if device is not None:
            device.close()
        client.close()


@pytest.mark.parametrize("mover_kind", ["cpu", "device-inline", "device-thread"])
def test_a_load_whose_slots_were_reused_under_it_fails_and_is_never_taken_for_kv(
        node: NodeServer, mover_kind: str) -> None:
    # Unfrozen, the load is whole (the check passes what it should).
    assert _load(mover_kind, node, frozen=False) == (CHUNKS, True, 0)
    loaded, same, reused = _load(mover_kind, node, frozen=True)
    # Every chunk's slot holds a neighbour's chunk by the copy: the load fails at its first
    # chunk, counted, and vLLM recomputes every block of it.
    assert (loaded, reused) == (0, 1)
    assert not same  # what was copied is not the KV: the check, not luck, kept it out
    assert node.counters.snapshot()["leases_expired"] >= 1
