"""The connector's CUDA data path (`integrations/vllm/cuda.py`) on a real GPU.

Skipped where torch sees no CUDA device (CI, the CPU machines). A flash-layout paged KV on
the GPU is stored through `ConnectorWorker` into a pinned memory tier and loaded back into
other blocks; the loaded blocks must equal the stored ones byte for byte, blocks below a
local hit must stay untouched, and a miss must be reported without touching any block.
Throughput is measured by `kvtier bench copy`, not here.
"""

from __future__ import annotations

import time

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
pytest.importorskip("vllm")

from tierkit import key

from kvtier.config import StoreConfig
from kvtier.core.keys import ChunkKey
from kvtier.core.store import TieredStore
from kvtier.integrations.vllm.messages import ChunkTransfer, KVTierMetadata
from kvtier.integrations.vllm.worker import ConnectorWorker, PagedKV
from kvtier.tiers import open_store

LAYERS, BLOCKS, HEADS, BS, DIM, PER_CHUNK = 4, 64, 8, 16, 128, 4


@pytest.fixture
def worker() -> tuple[ConnectorWorker, dict[str, torch.Tensor], TieredStore]:
    base = torch.randn(LAYERS, 2, BLOCKS, BS, HEADS, DIM, device="cuda").to(torch.bfloat16)
    kv = {f"model.layers.{i}.self_attn.attn": base[i] for i in range(LAYERS)}
    paged = PagedKV(kv, BS)
    layout = paged.layout(PER_CHUNK * BS)
    store = open_store(StoreConfig.parse(
        {"tiers": [{"kind": "memory", "capacity": "64MiB", "pin": "on"}]}), layout)
    assert store.tiers[0].pinned  # type: ignore[attr-defined]
    return ConnectorWorker(paged, layout, store), kv, store


def stored_keys(w: ConnectorWorker, expected: set[ChunkKey],
                timeout_s: float = 10) -> set[ChunkKey]:
    """Collect reports until `expected` or the timeout (a synchronous store reports its
    chunks in its own step)."""
    got: set[ChunkKey] = set()
    deadline = time.monotonic() + timeout_s
    while got != expected and time.monotonic() < deadline:
        report = w.take_report()
        if report is not None:
            got |= report.stored
        time.sleep(0.001)
    return got


def test_blocks_stored_from_the_gpu_load_back_into_other_blocks(worker) -> None:  # type: ignore[no-untyped-def]
    w, kv, _store = worker
    src = [(3, 17, 9, 40), (0, 63, 5, 22)]
    dst = [(1, 2, 4, 6), (10, 11, 12, 13)]
    keys = [key(0), key(1)]
    w.store(KVTierMetadata(stores=[ChunkTransfer(k, b) for k, b in zip(keys, src)]))
    assert stored_keys(w, set(keys)) == set(keys)
    before = {name: t.clone() for name, t in kv.items()}
    # Chunk 1 loads from block index 1 on: block 10 is a local prefix hit.
    w.load(KVTierMetadata(loads={"r": [ChunkTransfer(keys[0], dst[0]),
                                       ChunkTransfer(keys[1], dst[1], first_block=1)]}))
    torch.cuda.synchronize()
    assert w.take_failed_block_ids() == set()
    for name, t in kv.items():
        bytes_ = t.view(torch.uint8)
        for s, d in zip(src[0] + src[1][1:], dst[0] + dst[1][1:]):
            assert torch.equal(bytes_[:, d], bytes_[:, s]), (name, s, d)
        assert torch.equal(t[:, 10], before[name][:, 10])
    w.close()


def test_a_missing_chunk_fails_its_blocks_and_writes_nothing(worker) -> None:  # type: ignore[no-untyped-def]
    w, kv, _store = worker
    before = {name: t.clone() for name, t in kv.items()}
    w.load(KVTierMetadata(loads={"r": [ChunkTransfer(key(99), (1, 2, 3, 4))]}))
    torch.cuda.synchronize()
    assert w.take_failed_block_ids() == {1, 2, 3, 4}
    for name, t in kv.items():
        assert torch.equal(t, before[name])
    w.close()


def test_more_stores_than_staging_buffers_all_complete(worker) -> None:  # type: ignore[no-untyped-def]
    """12 chunks through 4 staging buffers: the call waits for free buffers (back-pressure)
    and every key is stored."""
    w, _kv, _store = worker
    transfers = [ChunkTransfer(key(100 + i), tuple(range(4 * (i % 8), 4 * (i % 8) + 4)))
                 for i in range(12)]
    w.store(KVTierMetadata(stores=transfers))
    assert stored_keys(w, {t.key for t in transfers}) == {t.key for t in transfers}
    w.close()


def test_async_stores_are_joined_like_the_cpu_store_threads(worker) -> None:  # type: ignore[no-untyped-def]
    """The same protocol as on the CPU (tests/vllm/test_async_stores.py): a step's stores are
    one job (device gathers now, DMA into the memory tier's pinned slots on the completion
    thread), joined and reported by the end of the next step, loaded back byte for byte."""
    w, kv, _store = worker
    src, dst = (5, 6, 7, 8), (20, 21, 22, 23)
    w.store(KVTierMetadata(stores=[ChunkTransfer(key(200), src)], stores_async=True))
    assert w.finish_step(set()) == set()  # this step's own job is not waited for
    assert w.finish_step({"held"}) == {"held"}  # the next step joins it
    report = w.take_report()
    assert report is not None and report.stored == {key(200)}
    w.load(KVTierMetadata(loads={"r": [ChunkTransfer(key(200), dst)]}))
    torch.cuda.synchronize()
    for t in kv.values():
        bytes_ = t.view(torch.uint8)
        for s, d in zip(src, dst):
            assert torch.equal(bytes_[:, d], bytes_[:, s])
    w.close()
