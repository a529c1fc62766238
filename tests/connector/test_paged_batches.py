"""A batch of chunks through `PagedBatches` (worker/pagedbatch.py) holds and writes exactly the
bytes `PagedKV.gather` / `scatter` do chunk by chunk: every vLLM 0.33 layout, one or two KV
cache groups, layers in one allocation or each its own, a local prefix hit (`first_block`)
and vLLM's null block, which a load never writes. CPU tensors through the accelerators'
torch index ops; no vLLM.
"""

from __future__ import annotations

import pytest
import torch
from tierkit import key

from kvtier.integrations.vllm.transfers import ChunkTransfer
from kvtier.integrations.vllm.worker.paged import PagedKV
from kvtier.integrations.vllm.worker.pagedbatch import PagedBatches
from kvtier.testing.vllmviews import LAYOUTS, VllmCacheSpec, vllm_kv_caches

BS, HEADS, DIM, LAYERS, BLOCKS, BPC, CHUNKS = 16, 2, 8, 4, 40, 2, 3
NULL = 0  # vLLM's null block


def rig(layout: str, groups: int, own_allocations: bool) -> tuple[PagedKV, PagedBatches, int]:
    kv = vllm_kv_caches(VllmCacheSpec(BS, HEADS, DIM, DIM, torch.bfloat16), LAYERS, BLOCKS,
                        layout)
    if own_allocations:  # layers not evenly spaced in one allocation: a view each
        kv = {name: t.clone() for name, t in kv.items()}
    paged = PagedKV(kv, BS, content="halves", torch_ops=True,
                    group_sizes=(2, 2) if groups == 2 else None, null_block=NULL)
    chunk_bytes = paged.layout(BS * BPC).bytes_per_chunk
    return paged, PagedBatches(paged, chunk_bytes), chunk_bytes


def as_bits(paged: PagedKV) -> list[torch.Tensor]:
    """Every layer's bytes (bf16 holds NaNs: compared as integers)."""
    return [t.view(torch.int16).clone() for t in paged.tensors]


def restore(paged: PagedKV, bits: list[torch.Tensor]) -> None:
    for t, b in zip(paged.tensors, bits):
        t.view(torch.int16).copy_(b)


@pytest.mark.parametrize("own_allocations", [False, True], ids=["one-allocation", "own"])
@pytest.mark.parametrize("groups", [1, 2])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_batch_moves_the_bytes_chunk_by_chunk_moves(layout: str, groups: int,
                                                      own_allocations: bool) -> None:
    paged, batches, size = rig(layout, groups, own_allocations)
    per = BPC * groups
    sources = [ChunkTransfer(key(i), tuple(range(1 + i * per, 1 + (i + 1) * per)))
               for i in range(CHUNKS)]
    staged = torch.zeros(CHUNKS * size, dtype=torch.uint8)
    batches.gather(batches.plan_gather(sources), staged)
    for i, t in enumerate(sources):
        alone = torch.zeros(size, dtype=torch.uint8)
        paged.gather(t.block_ids, alone)
        assert torch.equal(staged[i * size:(i + 1) * size], alone), (i, t.block_ids)

    shifted = [tuple(b + 20 for b in t.block_ids) for t in sources]
    whole = [ChunkTransfer(t.key, ids) for t, ids in zip(sources, shifted)]
    partial = [ChunkTransfer(sources[0].key, shifted[0]),
               ChunkTransfer(sources[1].key, shifted[1], first_block=1),  # a prefix hit
               ChunkTransfer(sources[2].key, (NULL, *shifted[2][1:]))]  # a window's null block
    original = as_bits(paged)  # random bytes, unlike the chunks' in the target blocks
    for targets in (whole, partial):
        restore(paged, original)
        batches.scatter(batches.plan_scatter(targets), staged)
        batched = as_bits(paged)
        restore(paged, original)
        for i, t in enumerate(targets):
            paged.scatter(staged[i * size:(i + 1) * size], t.block_ids, t.first_block)
        assert all(torch.equal(a, b) for a, b in zip(batched, as_bits(paged)))


def test_a_batch_is_one_index_upload_and_one_kernel_where_one_allocation_holds_it() -> None:
    _paged, batches, _size = rig("LBNHC", 1, own_allocations=False)
    transfers = [ChunkTransfer(key(i), (2 * i + 1, 2 * i + 2)) for i in range(CHUNKS)]
    batches.plan_gather(transfers)
    batches.plan_scatter([ChunkTransfer(t.key, t.block_ids) for t in transfers])
    assert dict(batches.counts) == {"index uploads": 2, "index kernels": 2}
