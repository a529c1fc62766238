"""Hybrid models in a real vLLM (CPU backend) with kvtier, issue 11 item 3.

A generated random-weight model (test_state_models.py: short-convolution hybrids):
  - Gemma-3 style, sliding-window + full attention layers (`layer_types`, window 64): served
    with vLLM's hybrid KV cache manager on (kvtier is `SupportsHMA`): two KV cache groups, the
    sliding group's blocks below the window freed (null). Checked: hits give the miss path's
    tokens; the KV a step computes over a hit (chunk 5 over loaded chunks 0-4) equals the same
    chunk computed from scratch, within the engine's noise, while a prompt with another first
    chunk gives a chunk far from it (the check can fail); a damaged chunk (corrupt or deleted)
    is recomputed by request (vLLM 0.32 stops on block-level failures with several groups),
    the engine lives on, and the prefix loads again once recomputed.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hybrid_kit import BYPASS, NOISE, SHAPE, chunk_after_hit, difference, save_model
from vllm_harness import (
    chunk_files,
    flip_byte,
    kvtier_counter,
    kvtier_transfer_config,
    random_prompts,
    settle,
    start_engine,
    token_ids,
)

pytestmark = pytest.mark.vllm

CHUNK = 64
@pytest.fixture(scope="module")
def gemma3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Gemma-3 style model: sliding-window (64 tokens) and full attention layers."""
    import torch
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    extra: dict[str, Any] = dict(  # config.json keys the config class does not declare
        torch_dtype="bfloat16")
    config = Gemma3TextConfig(
        **SHAPE, head_dim=32, sliding_window=64, initializer_range=0.1,
        layer_types=["sliding_attention", "full_attention"] * 2, **extra)
    torch.manual_seed(0)
    return save_model(Gemma3ForCausalLM(config), tmp_path_factory.mktemp("gemma3-style"))


@pytest.fixture(scope="module")
def gemma3(gemma3_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """The hybrid KV cache manager on: two KV cache groups (sliding, full) sharing one block
    pool (blocks enough for max_model_len in both). RAM holds 2 chunks of 64 KiB: the rest
    are read from the disk tier (`disk_dir`), where a test can damage them."""
    disk = tmp_path_factory.mktemp("gemma3-disk")
    config = kvtier_transfer_config([{"kind": "memory", "capacity": "128KiB"},
                                     {"kind": "disk", "path": str(disk), "capacity": "64MiB"}],
                                    CHUNK)
    with start_engine(gemma3_dir, config, num_gpu_blocks_override=160) as engine:
        engine.disk_dir = disk
        yield engine


def test_sliding_window_and_full_attention_hits_give_the_miss_paths_tokens(gemma3: Any) -> None:
    """Prompts longer than the window: every full chunk but the last token's loads from
    kvtier, and the tokens are those of the miss path (kvtier bypassed)."""
    assert gemma3.llm_engine.vllm_config.scheduler_config.disable_hybrid_kv_cache_manager \
        is False
    prompts = random_prompts([300, 200], seed=31)
    miss = token_ids(gemma3, prompts, kv_transfer_params=BYPASS)
    gemma3.reset_prefix_cache()
    first = token_ids(gemma3, prompts)
    gemma3.reset_prefix_cache()
    loaded = kvtier_counter("loaded_tokens")
    second = token_ids(gemma3, prompts)
    assert first == miss and second == miss
    loadable = sum((len(p["prompt_token_ids"]) - 1) // CHUNK * CHUNK for p in prompts)
    assert kvtier_counter("loaded_tokens") - loaded == loadable


def test_kv_computed_over_a_hybrid_hit_equals_kv_computed_from_scratch(gemma3: Any) -> None:
    [prompt] = [p["prompt_token_ids"] for p in random_prompts([6 * CHUNK + 1], seed=33)]
    over_hit = chunk_after_hit(gemma3, prompt, "hit", CHUNK, load=True)
    scratch = chunk_after_hit(gemma3, prompt, "scratch", CHUNK, load=False)
    other = chunk_after_hit(gemma3, [7] * CHUNK + prompt[CHUNK:], "control", CHUNK, load=False)
    assert difference(over_hit, scratch) < NOISE
    assert difference(other, scratch) > 5 * NOISE  # another prefix: far off


def test_a_failed_hybrid_load_is_recomputed_and_the_prefix_stored_again(gemma3: Any) -> None:
    prompts = random_prompts([300, 200], seed=34)
    disk = gemma3.disk_dir
    miss = token_ids(gemma3, prompts, kv_transfer_params=BYPASS)
    assert gemma3.reset_prefix_cache()
    before = {f.name for f in chunk_files(disk)}
    assert token_ids(gemma3, prompts) == miss
    settle([disk])
    for i, f in enumerate(f for f in chunk_files(disk) if f.name not in before):
        if i % 2:
            f.unlink()
        else:
            flip_byte(f)
    failures = kvtier_counter("load_failures")
    assert gemma3.reset_prefix_cache()
    assert token_ids(gemma3, prompts) == miss  # recomputed; the engine lives on
    assert kvtier_counter("load_failures") > failures
    # Each failed load reports the chunks the store knows to be gone; a file deleted behind
    # the disk tier's back is found gone when a load reaches it: the prefix heals a chunk or
    # more per pass, the outputs right all along.
    loadable = sum((len(p["prompt_token_ids"]) - 1) // CHUNK * CHUNK for p in prompts)
    for _ in range(4):
        settle([disk])
        assert gemma3.reset_prefix_cache()
        loaded = kvtier_counter("loaded_tokens")
        assert token_ids(gemma3, prompts) == miss
        if kvtier_counter("loaded_tokens") - loaded == loadable:
            return  # stored again, whole
    raise AssertionError("the damaged prefix was not stored again in 4 passes")
