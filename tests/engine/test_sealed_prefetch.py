"""Chunks encrypted at rest, read back by a restarted engine's prefetch (issue 24, item 2).

A tenant's chunks are sealed on disk under the tenant's key. The engine restarts (a new
process: it has seen no tenant yet) and gets more of that tenant's prompts than its KV cache
holds at once, so requests wait for blocks and their hits below RAM are prefetched into RAM
ahead of their load. The prefetch must open the chunks with the tenant's key (the plan carries
it): the hits load, the outputs are those of the miss path, no chunk fails to open, and every
chunk file is still on disk. Before, the prefetch carried bare keys, read the chunks as
unsalted, took that for tampering and deleted the valid files.
"""

from __future__ import annotations

from pathlib import Path

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

pytestmark = pytest.mark.vllm

CHUNK = 64
MAX_TOKENS = 8
PROMPTS = [{**p, "cache_salt": "tenant-a"} for p in random_prompts([620] * 6, seed=171)]
SECRET = b"sealed-prefetch-secret-0123456789abcdefghijkl"


def test_a_restarted_engines_prefetch_opens_sealed_chunks_and_deletes_none(
        tiny_model_dir: Path, tmp_path: Path) -> None:
    secret = tmp_path / "secret"
    secret.write_bytes(SECRET)
    secret.chmod(0o600)
    disk = tmp_path / "disk"
    tiers = [{"kind": "memory", "capacity": "128KiB"},  # four chunks: the hits are below it
             {"kind": "disk", "path": str(disk), "capacity": "256MiB",
              "encryption_secret_file": str(secret)}]
    config = kvtier_transfer_config(tiers, CHUNK)
    # 65 blocks of 32 tokens (and the null block): three prompts at a time, the others wait
    # for blocks.
    with start_engine(tiny_model_dir, config, num_gpu_blocks_override=66) as llm:
        expected = []
        for prompt in PROMPTS:  # the miss path, one at a time: each stores its chunks
            expected += token_ids(llm, [prompt], MAX_TOKENS)
        settle([disk])
    stored = set(chunk_files(disk))
    assert len(stored) >= len(PROMPTS) * (620 // CHUNK)
    with start_engine(tiny_model_dir, config, num_gpu_blocks_override=66) as llm:
        failures = kvtier_counter("tier_failures")
        assert token_ids(llm, PROMPTS, MAX_TOKENS) == expected
        assert kvtier_counter("tier_failures") == failures, "a sealed chunk did not open"
        assert stored <= set(chunk_files(disk)), "a valid sealed chunk was deleted"
        assert kvtier_counter("prefetched_chunks") > 0, "nothing prefetched"
        assert kvtier_counter("load_failures") == 0
        assert kvtier_counter("loaded_tokens") >= len(PROMPTS) * 512
