"""The preemption model: unique prompts under KV pressure, with and without a CPU tier.

A small GPU pool (2,000 blocks of 16 tokens = 32k tokens) and 400 unique 512-token prompts
that each generate 256 tokens, all submitted at once: 64 requests fit at a time but their
decode outgrows the pool, so the newest are preempted and re-admitted later.
"""

from __future__ import annotations

from itertools import pairwise

import pytest

from kvtier.tools.sim.batch import BatchConfig, BatchResult, run_batch

SMALL = BatchConfig(requests=400, output_tokens=256, max_num_seqs=64, kv_blocks=2000)
GB = 10**9
BLOCK_BYTES = 16 * 128 * 1024  # Llama-3.1-8B: 128 KiB of KV per token, 16-token blocks


@pytest.fixture(scope="module")
def runs() -> dict[float, BatchResult]:
    return {gb: run_batch(SMALL, int(gb * GB)) for gb in (0, 0.5, 2, 4, 64)}


def test_without_a_cpu_tier_preempted_requests_recompute(runs) -> None:  # type: ignore[no-untyped-def]
    base = runs[0]
    assert base.preemptions > 0
    assert base.loaded_tokens == 0
    # Every preemption throws away at least the prompt's KV less what the GPU cache still
    # holds; what is not found there is recomputed.
    assert base.recomputed_tokens > 0
    assert base.recomputed_tokens + base.gpu_resume_tokens >= base.preemptions * 512
    assert 0 < base.recompute_share < 1


def test_a_bigger_cpu_tier_recomputes_less_and_runs_faster(runs) -> None:  # type: ignore[no-untyped-def]
    # Up to the size that holds what the preempted requests need (the 64 GB tier's figures:
    # only unfinished last blocks are recomputed; 4 GB already holds it all with the memory
    # tier's default policy, prefix), then the same.
    ordered = [runs[gb] for gb in sorted(runs)]
    full = ordered[-1]
    recomputed = [r.recomputed_tokens for r in ordered]
    assert all(a > b or a == b == full.recomputed_tokens
               for a, b in pairwise(recomputed)), recomputed
    loaded = [r.loaded_tokens for r in ordered]
    assert all(a < b or a == b == full.loaded_tokens for a, b in pairwise(loaded)), loaded
    # Throughput rises with the tier's size. Turning offload on costs a little per step
    # (connector, store copies), which a 0.5 GB tier (256 blocks) does not win back.
    with_tier = [r.throughput_tok_s for r in ordered[1:]]
    assert all(a < b or a == b == full.throughput_tok_s
               for a, b in pairwise(with_tier)), with_tier
    assert with_tier[-1] > ordered[0].throughput_tok_s * 1.05


def test_a_tier_that_holds_every_request_leaves_almost_nothing_to_recompute(runs) -> None:  # type: ignore[no-untyped-def]
    big = runs[64]
    assert big.cpu_bytes // BLOCK_BYTES > SMALL.requests * (512 + 256) // 16  # holds it all
    # What is left is each resumed request's unfinished last block (never stored).
    assert big.recomputed_tokens <= big.preemptions * SMALL.block_tokens
    assert big.loaded_tokens > 0.9 * runs[0].recomputed_tokens


def test_no_pressure_no_preemption_and_the_tier_changes_nothing() -> None:
    roomy = BatchConfig(requests=100, output_tokens=64, max_num_seqs=16, kv_blocks=2000)
    off, on = run_batch(roomy, 0), run_batch(roomy, 16 * GB)
    assert off.preemptions == on.preemptions == 0
    assert off.recomputed_tokens == on.recomputed_tokens == on.loaded_tokens == 0
    assert on.throughput_tok_s <= off.throughput_tok_s  # the connector only costs here
