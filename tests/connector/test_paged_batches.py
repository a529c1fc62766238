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


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_chunks_tail_is_its_blocks_then_its_last_again_and_loads_into_its_blocks_only(
        layout: str) -> None:
    """A tail (fewer blocks than a chunk: keys.tail_key) is stored in a whole chunk's bytes,
    the rest its last block again; a load writes its own blocks, no further, chunk by chunk
    (torch and numpy) and batched."""
    paged, _, _ = rig(layout, 1, False)
    bpc4 = PagedKV(dict(zip(paged.layer_names, paged.tensors)), BS, content="halves",
                   torch_ops=True)
    size = bpc4.layout(BS * 4).bytes_per_chunk
    batches = PagedBatches(bpc4, size)
    tail = ChunkTransfer(key(1), (5, 9, 7))  # 3 of a chunk's 4 blocks
    full = ChunkTransfer(key(2), (5, 9, 7, 7))
    alone, padded = torch.zeros(size, dtype=torch.uint8), torch.zeros(size, dtype=torch.uint8)
    bpc4.gather(tail.block_ids, alone)
    bpc4.gather(full.block_ids, padded)
    assert torch.equal(alone, padded)
    staged = torch.zeros(2 * size, dtype=torch.uint8)
    batches.gather(batches.plan_gather([tail, full]), staged)
    assert torch.equal(staged[:size], alone) and torch.equal(staged[size:], alone)
    before = as_bits(bpc4)
    blocks_before = [v.clone().view(torch.int16) for v in bpc4.block_views]
    for scatter in ("torch", "numpy", "batch"):
        restore(bpc4, before)
        target = ChunkTransfer(key(1), (20, 21, 22), first_block=1)
        if scatter == "batch":
            batches.scatter(batches.plan_scatter([target]), alone)
        else:
            PagedKV(dict(zip(paged.layer_names, paged.tensors)), BS, content="halves",
                    torch_ops=scatter == "torch").scatter(alone, target.block_ids, 1)
        for old, view in zip(blocks_before, bpc4.block_views):
            new = view.clone().view(torch.int16)
            changed = {i for i in range(view.shape[0]) if not torch.equal(new[i], old[i])}
            assert changed == {21, 22}, (scatter, changed)
        back = torch.zeros(size, dtype=torch.uint8)
        bpc4.gather((5, 21, 22), back)
        assert torch.equal(back, alone), scatter


@pytest.mark.parametrize(("dtype", "dim", "width"), [
    (torch.bfloat16, DIM, torch.int64),  # 16 bytes a head's row: 2 int64, not 8 int16
    (torch.uint8, DIM, torch.int64),  # fp8: 1 int64, not 8 uint8
    (torch.bfloat16, 3, torch.int16),  # 6 bytes a row: no wider integer divides it
])
@pytest.mark.parametrize("layout", ["LBNHC", "BLHNC"])
def test_the_kernels_move_the_widest_integers_the_rows_allow(layout: str, dtype: torch.dtype,
                                                             dim: int, width: torch.dtype
                                                             ) -> None:
    """The gather / scatter kernels cost per element on a GPU (issue 47: a load lost ~6 ns
    an element a chunk): a batch moves as few elements as the layout allows, bit for bit."""
    kv = vllm_kv_caches(VllmCacheSpec(BS, HEADS, dim, dim, dtype), LAYERS, BLOCKS, layout)
    paged = PagedKV(kv, BS, content="halves", torch_ops=True, null_block=NULL)
    size = paged.layout(BS * BPC).bytes_per_chunk
    batches = PagedBatches(paged, size)
    rows = batches._sources[0].rows
    assert rows.dtype == width
    assert rows[0].numel() * rows.element_size() == HEADS * 2 * BS * dim * dtype.itemsize
    before = [t.view(torch.uint8).clone() for t in paged.tensors]
    sources = [ChunkTransfer(key(i), tuple(range(1 + i * BPC, 1 + (i + 1) * BPC)))
               for i in range(CHUNKS)]
    staged = torch.zeros(CHUNKS * size, dtype=torch.uint8)
    batches.gather(batches.plan_gather(sources), staged)
    targets = [ChunkTransfer(t.key, tuple(b + 20 for b in t.block_ids)) for t in sources]
    batches.scatter(batches.plan_scatter(targets), staged)
    for t, b in zip(paged.tensors, before):
        v = t.view(torch.uint8)
        for s, d in zip(sources, targets):
            for bs, bd in zip(s.block_ids, d.block_ids):
                assert torch.equal(v[bd], b[bs])
