"""Why a found hit was not loaded, in real vLLM (issue 46): `lost_hit_tokens` by reason.

One engine (CPU backend, the generated "test" model, 64-token chunks of 32 KiB) on a RAM tier
of two chunks over a disk tier, so that a prompt's first chunks live on disk only. Each case
runs a 400-token prompt on the miss path (six chunks stored), empties vLLM's own cache, and
asks it again, so that kvtier finds all six chunks (384 tokens, `lookup_hit_tokens`):
  - vllm_declined: the request skips prefix-cache reads (`skip_reading_prefix_cache`, as vLLM
    sets for prompt logprobs): kvtier offers the hit, vLLM takes none of it;
  - load_failed: the prompt's chunk files are deleted between its two runs (a peer's
    eviction or `kvtier gc` on a shared directory does it in normal operation): the scheduler
    still believes them held, the load stops at the first chunk and the whole hit is lost.
Each reason moves by the hit's tokens exactly, no other reason moves, and nothing is loaded.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from vllm_harness import (
    chunk_files,
    kvtier_counter,
    kvtier_transfer_config,
    random_prompts,
    settle,
    start_engine,
    token_ids,
)

from kvtier.integrations.vllm.metrics import LOST_HIT_REASONS

pytestmark = pytest.mark.vllm

CHUNK = 64
PROMPT_TOKENS = 400
HIT_TOKENS = (PROMPT_TOKENS - 1) // CHUNK * CHUNK  # the last token is always recomputed


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[tuple[Any, Path]]:
    disk = tmp_path_factory.mktemp("disk")
    tiers = [{"kind": "memory", "capacity": "64KiB"},  # two chunks: the newest two
             {"kind": "disk", "path": str(disk), "capacity": "256MiB"}]
    with start_engine(tiny_model_dir, kvtier_transfer_config(tiers, CHUNK)) as llm:
        yield llm, disk


def counters() -> dict[str, float]:
    names = {f"lost/{r}": kvtier_counter("lost_hit_tokens", reason=r) for r in LOST_HIT_REASONS}
    return names | {name: kvtier_counter(name) for name in ("lookup_hit_tokens",
                                                            "loaded_tokens")}


def moved(before: dict[str, float]) -> dict[str, float]:
    """The counters that moved since `before`, by how much."""
    return {name: value - before[name] for name, value in counters().items()
            if value != before[name]}


def stored_prompt(llm: Any, disk: Path, seed: int) -> tuple[dict[str, list[int]], set[Path]]:
    """A prompt run on the miss path, and the chunk files it added to the disk tier."""
    [prompt] = random_prompts([PROMPT_TOKENS], seed=seed)
    before = set(chunk_files(disk))
    token_ids(llm, [prompt], max_tokens=4)
    settle([disk])
    added = set(chunk_files(disk)) - before
    assert len(added) == HIT_TOKENS // CHUNK
    assert llm.reset_prefix_cache()
    return prompt, added


def test_a_hit_vllm_does_not_take_is_lost_as_declined(engine: tuple[Any, Path]) -> None:
    from vllm import SamplingParams

    llm, disk = engine
    prompt, _ = stored_prompt(llm, disk, seed=460)
    before = counters()
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True,
                            skip_reading_prefix_cache=True)
    llm.generate([prompt], params, use_tqdm=False)
    assert moved(before) == {"lookup_hit_tokens": HIT_TOKENS,
                             "lost/vllm_declined": HIT_TOKENS}


def test_a_hit_deleted_between_lookup_and_load_is_lost_as_failed(
        engine: tuple[Any, Path]) -> None:
    llm, disk = engine
    prompt, files = stored_prompt(llm, disk, seed=461)
    for f in files:  # the scheduler still believes them held
        f.unlink()
    before = counters()
    token_ids(llm, [prompt], max_tokens=4)
    assert moved(before) == {"lookup_hit_tokens": HIT_TOKENS,
                             "lost/load_failed": HIT_TOKENS}
