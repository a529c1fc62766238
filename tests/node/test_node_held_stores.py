"""A store the node answers HELD (another engine stored that chunk: no bytes copied) is not
this engine's write: `stored_tokens` / `stored_bytes` count what the engine wrote, and a chunk
held already is `already_held_tokens` (reported stored all the same: the scheduler learns it is
held). Before, a HELD answer counted as stored, and two engines sharing a node both counted
the chunk only one of them wrote. In process the same: a chunk the RAM tier holds already is
held, not written again.

Workers (`ConnectorWorker`, the CPU mover) over vLLM-shaped CPU tensors; an in-process node
(`running_node`) with RAM and a disk tier; no engine.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, ExitStack
from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm")

from nodekit import connect, key, node_tiers

from kvtier.integrations.vllm.messages import ChunkTransfer, KVTierMetadata
from kvtier.integrations.vllm.worker.connector_worker import ConnectorWorker, PagedKV
from kvtier.node.server import NodeServer
from kvtier.tiers import open_store
from kvtier.tiers.storeconfig import StoreConfig

pytestmark = pytest.mark.timeout(120)
LAYERS, BLOCKS, HEADS, BS, DIM = 2, 8, 2, 16, 8
TOKENS_PER_CHUNK = 32  # two blocks
CHUNK = 2 * LAYERS * HEADS * TOKENS_PER_CHUNK * DIM * 2  # K and V, bf16: a chunk's bytes


def _paged(seed: int) -> PagedKV:
    gen = torch.Generator().manual_seed(seed)
    return PagedKV({f"model.layers.{i}.self_attn.attn":
                    torch.randn(BLOCKS, HEADS, BS, 2 * DIM, generator=gen).to(torch.bfloat16)
                    for i in range(LAYERS)}, BS)


def _store_chunk_1(worker: ConnectorWorker) -> tuple[set[object], dict[str, float]]:
    """One synchronous step storing chunk 1 (blocks 0-1): what the worker reported stored,
    and its counters' totals."""
    worker.store(KVTierMetadata(stores=[ChunkTransfer(key=key(1), block_ids=(0, 1))]))
    report = worker.take_report()
    stats = worker.take_stats()
    counters = {} if stats is None else stats.data["counters"]
    return (set() if report is None else set(report.stored),
            {name: sum(by.values()) for name, by in counters.items()})


@pytest.fixture
def workers(tmp_path: Path, in_process_node: Callable[..., AbstractContextManager[NodeServer]]
            ) -> Iterator[tuple[NodeServer, ConnectorWorker, ConnectorWorker]]:
    """Two engines' workers (their own KV, their own connections) on one node."""
    layout = _paged(0).layout(TOKENS_PER_CHUNK)
    assert layout.bytes_per_chunk == CHUNK
    with ExitStack() as stack:
        node = stack.enter_context(in_process_node(
            node_tiers(tmp_path, ram_chunks=8, disk_chunks=16, layout=layout)))
        engines = []
        for seed, name in ((1, "engine-a"), (2, "engine-b")):
            _, store = connect(node.config.socket_path, layout, timeout_s=30, engine=name)
            worker = ConnectorWorker(_paged(seed), layout, store)
            stack.callback(worker.close, 5)
            engines.append(worker)
        yield node, engines[0], engines[1]


def test_a_chunk_another_engine_stored_is_held_not_stored(workers) -> None:  # type: ignore[no-untyped-def]
    node, first, second = workers
    reported, counted = _store_chunk_1(first)
    assert reported == {key(1)}
    assert (counted["stored_tokens"], counted["stored_bytes"]) == (TOKENS_PER_CHUNK, CHUNK)
    assert "already_held_tokens" not in counted
    # The second engine computed the same chunk: the node answers HELD, nothing is copied.
    reported, counted = _store_chunk_1(second)
    assert reported == {key(1)}  # held: the scheduler learns so
    assert counted.get("stored_tokens", 0) == counted.get("stored_bytes", 0) == 0
    assert counted["already_held_tokens"] == TOKENS_PER_CHUNK
    assert node.status()["counters"]["committed_chunks"] == 1  # the first engine's alone


@pytest.mark.parametrize("ram", [True, False], ids=["ram-and-disk", "disk-only"])
def test_in_process_a_chunk_held_already_is_counted_alike(tmp_path: Path, ram: bool) -> None:
    """Also with a disk-only store (`tiers: [disk]`), whose put alone finds the chunk held
    (no RAM slot to reserve): before, its second store counted as stored."""
    paged = _paged(1)
    layout = paged.layout(TOKENS_PER_CHUNK)
    tiers = [{"kind": "memory", "capacity": "1MiB"}] if ram else []
    tiers.append({"kind": "disk", "path": str(tmp_path / "disk"), "capacity": "16MiB"})
    worker = ConnectorWorker(paged, layout, open_store(StoreConfig.parse({"tiers": tiers}),
                                                       layout))
    try:
        assert _store_chunk_1(worker)[1]["stored_tokens"] == TOKENS_PER_CHUNK
        reported, counted = _store_chunk_1(worker)  # its top tier holds it: nothing written
        assert reported == {key(1)}
        assert counted.get("stored_tokens", 0) == 0
        assert counted["already_held_tokens"] == TOKENS_PER_CHUNK
    finally:
        worker.close(5)
