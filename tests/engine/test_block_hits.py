"""Hits at vLLM's block granularity (issue 44, item 6): a hit ends at any block boundary.

kvtier's chunks are 256 tokens here (8 vLLM blocks of 32, the harness's block size), but a
request stores the tail of its prompt and of its whole sequence (the full blocks past its last
full chunk, keys.tail_key), so that the same prompt again, or the next turn of a chat, hits up
to its last full block rather than its last full chunk.

One engine for the module: a memory tier of two chunks over a disk tier, so hits come from
files too. Each case uses its own prompts (its own seed) and empties vLLM's own prefix cache
(`reset_prefix_cache()`, which leaves kvtier alone) before a hit must come from kvtier.
Asserted: vLLM's `vllm:external_prefix_cache_hits` (tokens vLLM took from the connector),
kvtier's counters, and outputs equal to this engine's miss path (the request with
kv_transfer_params skip_load and skip_store, after emptying vLLM's cache).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from vllm_harness import (
    BLOCK_SIZE,
    chunk_files,
    flip_byte,
    kvtier_counter,
    kvtier_transfer_config,
    metric,
    random_prompts,
    settle,
    start_engine,
    token_ids,
)

pytestmark = pytest.mark.vllm

CHUNK = 256
MAX_TOKENS = 16
HITS = "vllm:external_prefix_cache_hits"
BYPASS = {"skip_load": True, "skip_store": True}


@pytest.fixture(scope="module")
def disk_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("kvtier-disk")


@pytest.fixture(scope="module")
def llm(tiny_model_dir: Path, disk_dir: Path) -> Iterator[Any]:
    tiers = [{"kind": "memory", "capacity": "256KiB"},  # two 256-token chunks of this model
             {"kind": "disk", "path": str(disk_dir), "capacity": "256MiB"}]
    config = kvtier_transfer_config(tiers, CHUNK, tail_chunks=True)  # the connector's default
    with start_engine(tiny_model_dir, config) as engine:
        yield engine


def miss_path(llm: Any, prompt: dict[str, list[int]]) -> list[int]:
    llm.reset_prefix_cache()
    return token_ids(llm, [prompt], MAX_TOKENS, kv_transfer_params=BYPASS)[0]


def run_from_kvtier(llm: Any, prompt: dict[str, list[int]]) -> tuple[list[int], float]:
    """The prompt's output with vLLM's own cache emptied, and the tokens vLLM took from
    kvtier for it."""
    llm.reset_prefix_cache()
    before = metric(llm, HITS)
    [out] = token_ids(llm, [prompt], MAX_TOKENS)
    return out, metric(llm, HITS) - before


def test_a_repeated_prompt_hits_up_to_its_last_full_block(llm: Any, disk_dir: Path) -> None:
    # 400 tokens: one full chunk (256), then 4 full blocks (to 384) and 16 tokens. The last
    # token is always recomputed, so the hit can reach 384: the chunk and the prompt's tail.
    [prompt] = random_prompts([400], seed=4401)
    clean = miss_path(llm, prompt)
    first, _ = run_from_kvtier(llm, prompt)
    settle([disk_dir])
    lookup_hits = kvtier_counter("lookup_hit_tokens")
    loaded = kvtier_counter("loaded_tokens")
    again, external = run_from_kvtier(llm, prompt)
    assert external == 384 == 256 + 4 * BLOCK_SIZE  # not 256, the last full chunk's end
    assert kvtier_counter("lookup_hit_tokens") - lookup_hits == 384
    assert kvtier_counter("loaded_tokens") - loaded == 384
    assert first == again == clean


def test_the_next_turn_hits_through_the_previous_turns_tail(llm: Any) -> None:
    # Turn 1: 350 tokens and 16 generated; its sequence's KV is computed to 365 tokens, so
    # its end stores the tail of 3 blocks past chunk 0 (to 352). Turn 2 is turn 1, its
    # answer and 40 tokens more: it hits the chunk and that tail, 352 tokens.
    [turn1] = random_prompts([350], seed=4402)
    [more] = random_prompts([40], seed=4403)
    answer = token_ids(llm, [turn1], MAX_TOKENS)[0]
    turn2 = {"prompt_token_ids": turn1["prompt_token_ids"] + answer + more["prompt_token_ids"]}
    clean = miss_path(llm, turn2)
    hits = kvtier_counter("lookup_hit_tokens")
    out, external = run_from_kvtier(llm, turn2)
    assert external == 352 == 256 + 3 * BLOCK_SIZE
    assert kvtier_counter("lookup_hit_tokens") - hits == 352
    assert out == clean


def test_a_corrupt_tail_is_a_counted_miss_and_recomputed(llm: Any, disk_dir: Path) -> None:
    # 200 tokens: no full chunk; its one chunk file is its tail of 6 blocks (192 tokens),
    # the prompt's and the sequence's alike (215 tokens computed: 6 full blocks).
    [prompt] = random_prompts([200], seed=4404)
    clean = miss_path(llm, prompt)
    before = set(chunk_files(disk_dir))
    token_ids(llm, [prompt], MAX_TOKENS)
    settle([disk_dir])
    [tail_file] = set(chunk_files(disk_dir)) - before
    flip_byte(tail_file)
    # Two more chunks push the tail out of the memory tier (two chunks): it loads from disk.
    for seed in (4405, 4406):
        token_ids(llm, random_prompts([300], seed=seed), MAX_TOKENS)
    failures = kvtier_counter("load_failures")
    lost = kvtier_counter("lost_hit_tokens")
    out, external = run_from_kvtier(llm, prompt)
    assert external == 192  # offered; the load failed and vLLM recomputed it
    assert kvtier_counter("load_failures") - failures == 1
    assert kvtier_counter("lost_hit_tokens") - lost == 192
    assert out == clean
    # Recomputed and stored again: the next run loads it.
    settle([disk_dir])
    loaded = kvtier_counter("loaded_tokens")
    again, external = run_from_kvtier(llm, prompt)
    assert (external, kvtier_counter("loaded_tokens") - loaded) == (192, 192)
    assert again == clean
