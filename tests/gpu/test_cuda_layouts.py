"""Gather and scatter (integrations/vllm/worker/paged.py) on vLLM 0.33's KV caches on the device:
every physical layout, MLA's 4-D views, a block split into r=4 kernel blocks, bf16 and fp8.

A gathered chunk must be, byte for byte, the chunk order built independently from vLLM's
logical views (gpurig.reference_chunk): what a CPU engine would store for the same KV. A
scatter of it into other blocks must reproduce the source blocks exactly and write nothing
else, nor the blocks before `first_block` (a local prefix hit).

Each test runs on "cuda" (skipped without a GPU) and on "standin" (the same torch index ops on
CPU tensors), so that CI executes these bodies. No vLLM.
"""

from __future__ import annotations

import pytest
import torch
from gpurig import BS, CASE_IDS, CASES, Backend, Case, reference_chunk

from kvtier.integrations.vllm.worker.paged import PagedKV

LAYERS, BLOCKS = 3, 24
SRC, DST = (5, 17, 2, 11), (20, 1, 8, 14)  # a chunk of 4 blocks
TOKENS_PER_CHUNK = len(SRC) * BS


def block_bytes(paged: PagedKV) -> list[torch.Tensor]:
    """Every layer's blocks as uint8, block-major."""
    return [v.view(torch.uint8) for v in paged.block_views]


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_a_gathered_chunk_is_the_reference_chunk_order(backend: Backend, case: Case) -> None:
    kv = backend.kv_caches(case, LAYERS, BLOCKS)
    paged = backend.paged(case, kv)
    chunk = torch.empty(paged.layout(TOKENS_PER_CHUNK).bytes_per_chunk, dtype=torch.uint8,
                        device=backend.torch_device)
    paged.gather(SRC, chunk)
    assert torch.equal(chunk, reference_chunk(kv, SRC, case))
    assert paged.single_allocation  # one op for all layers, in every layout


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_a_scatter_writes_the_source_blocks_bytes_and_nothing_else(backend: Backend,
                                                                  case: Case) -> None:
    kv = backend.kv_caches(case, LAYERS, BLOCKS)
    paged = backend.paged(case, kv)
    chunk = torch.empty(paged.layout(TOKENS_PER_CHUNK).bytes_per_chunk, dtype=torch.uint8,
                        device=backend.torch_device)
    paged.gather(SRC, chunk)
    before = [v.clone() for v in block_bytes(paged)]
    paged.scatter(chunk, DST, first_block=1)  # DST[0] is a local prefix hit
    after = block_bytes(paged)
    written = set(DST[1:])
    for old, new in zip(before, after):
        for s, d in zip(SRC, DST):
            assert torch.equal(new[d], old[s] if d in written else old[d]), (s, d)
        for b in set(range(BLOCKS)) - written:
            assert torch.equal(new[b], old[b]), b

