"""A prompt whose chunks later prompts evicted, asked again of a real vLLM (issue 45).

One engine (CPU backend, the generated "test" model, 64-token chunks) per tier set: a RAM tier
of four chunks, alone or over a disk tier. Prompt A stores its four chunks, prompt B's four push
them out of RAM, vLLM's own cache is emptied, and A comes back. Each prompt generates one token,
as in `kvtier bench trace`: the engine goes idle as soon as B's stores are reported, so the
scheduler learns of the evictions from that report or not before A's lookup.
  - RAM alone: no tier holds A's chunks any more. kvtier must not offer them: an offer is a
    load that fails (`load_failures`, `lost_hit_tokens{reason="load_failed"}`) and a
    recompute. Evictions reported a report later than B's stores reach the scheduler only
    after A's lookup: all four chunks are offered and every load fails.
  - RAM over disk: the disk still holds them; kvtier offers and loads all four.
Either way A's token is the miss path's.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from vllm_harness import (
    kvtier_counter,
    kvtier_transfer_config,
    random_prompts,
    settle,
    start_engine,
    token_ids,
)

from kvtier.testing.tinymodel import PRESETS

pytestmark = pytest.mark.vllm

CHUNK = 64
CHUNK_BYTES = PRESETS["test"].kv_bytes_per_token() * CHUNK
PROMPT_TOKENS = 300  # four full chunks: 256 tokens a hit would load
HIT_TOKENS = (PROMPT_TOKENS - 1) // CHUNK * CHUNK
COUNTERS = ("lookup_hit_tokens", "loaded_tokens", "load_failures")


@pytest.fixture(scope="module", params=["ram", "ram+disk"])
def engine(request: pytest.FixtureRequest, tiny_model_dir: Path,
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Any, list[Path]]]:
    tiers: list[dict[str, Any]] = [{"kind": "memory", "capacity": 4 * CHUNK_BYTES}]
    disks = []
    if request.param == "ram+disk":
        disks.append(tmp_path_factory.mktemp("disk"))
        tiers.append({"kind": "disk", "path": str(disks[0]), "capacity": "256MiB"})
    with start_engine(tiny_model_dir, kvtier_transfer_config(tiers, CHUNK)) as llm:
        yield llm, disks


def counters() -> dict[str, float]:
    return {name: kvtier_counter(name) for name in COUNTERS} | {
        "lost/load_failed": kvtier_counter("lost_hit_tokens", reason="load_failed")}


def test_a_prompt_whose_chunks_were_evicted_is_a_plain_miss_or_a_lower_tiers_hit(
        engine: tuple[Any, list[Path]]) -> None:
    llm, disks = engine
    a, b = random_prompts([PROMPT_TOKENS, PROMPT_TOKENS], seed=450)
    first = token_ids(llm, [a], max_tokens=1)
    token_ids(llm, [b], max_tokens=1)  # its four chunks evict A's from RAM
    settle(disks)  # the disk's write-behind (nothing to wait for without one)
    assert llm.reset_prefix_cache()
    before = counters()
    assert token_ids(llm, [a], max_tokens=1) == first
    moved = {name: value - before[name] for name, value in counters().items()}
    if disks:  # held by the disk: offered and loaded
        assert moved == {"lookup_hit_tokens": HIT_TOKENS, "loaded_tokens": HIT_TOKENS,
                         "load_failures": 0, "lost/load_failed": 0}
    else:  # held by no tier: not offered, nothing fails
        assert moved == {"lookup_hit_tokens": 0, "loaded_tokens": 0,
                         "load_failures": 0, "lost/load_failed": 0}
