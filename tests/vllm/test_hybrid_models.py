"""Hybrid models in a real vLLM (CPU backend) with kvtier, issue 11 item 3.

Two generated random-weight models, two engine starts:
  - Gemma-3 style, sliding-window + full attention layers (`layer_types`, window 64): served
    with vLLM's hybrid KV cache manager on (kvtier is `SupportsHMA`): two KV cache groups, the
    sliding group's blocks below the window freed (null). Checked: hits give the miss path's
    tokens; the KV a step computes over a hit (chunk 5 over loaded chunks 0-4) equals the same
    chunk computed from scratch, within the engine's noise, while a prompt with another first
    chunk gives a chunk far from it (the check can fail); a damaged chunk (corrupt or deleted)
    is recomputed by request (vLLM 0.32 stops on block-level failures with several groups),
    the engine lives on, and the prefix loads again once recomputed.
  - LFM2 style, short-convolution + full attention layers: its conv state is not per-token
    KV, vLLM cannot promote it ("Failed to promote local KV cache specs to one unified type"
    before kvtier refused it). kvtier refuses it at start-up, in one line naming the model,
    the reason and the alternative (kvtier/integrations/vllm/models.py).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from vllm_harness import (
    chunk_files,
    chunk_payload,
    flip_byte,
    kvtier_counter,
    kvtier_transfer_config,
    random_prompts,
    settle,
    start_engine,
    token_ids,
    wait_for_new_file,
)

from kvtier.bench.tinymodel import BOS_ID, EOS_ID, UNK_ID, write_tokenizer

pytestmark = pytest.mark.vllm

CHUNK = 64
# Relative mean |difference| of two computations of one chunk's KV (test_failed_loads.py).
NOISE = 0.02
BYPASS = {"skip_load": True, "skip_store": True}
SHAPE: dict[str, Any] = dict(
    vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
    bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=UNK_ID)


def _save(model: Any, out: Path) -> Path:
    import torch

    model.to(torch.bfloat16).save_pretrained(out, safe_serialization=True)
    write_tokenizer(SHAPE["vocab_size"], out)
    return out


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
    return _save(Gemma3ForCausalLM(config), tmp_path_factory.mktemp("gemma3-style"))


@pytest.fixture(scope="module")
def lfm2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An LFM2 style model: short-convolution and full attention layers. The `conv_dim` and
    `block_*` keys are the names vLLM 0.32's Lfm2 reads (transformers 5 writes others)."""
    import torch
    from transformers import Lfm2Config, Lfm2ForCausalLM

    hidden, ffn = SHAPE["hidden_size"], SHAPE["intermediate_size"]
    extra: dict[str, Any] = dict(  # config.json keys the config class does not declare
        torch_dtype="bfloat16", conv_dim=hidden, conv_dim_out=hidden, block_dim=hidden,
        block_ff_dim=ffn)
    config = Lfm2Config(
        **SHAPE, layer_types=["conv", "full_attention"] * 2, block_multiple_of=ffn,
        block_ffn_dim_multiplier=1.0, block_auto_adjust_ff_dim=False, **extra)
    model_class: Any = Lfm2ForCausalLM  # untyped in transformers
    torch.manual_seed(0)
    return _save(model_class(config), tmp_path_factory.mktemp("lfm2-style"))


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


def test_a_conv_hybrid_model_is_refused_by_kvtier_in_one_line(
        lfm2_dir: Path, capfd: pytest.CaptureFixture[str]) -> None:
    """The engine does not start, and the reason is kvtier's one line, not vLLM's
    "Failed to promote local KV cache specs to one unified type". (First in the module: the
    other case's engine is not running yet, so one engine at a time.)"""
    config = kvtier_transfer_config([{"kind": "memory", "capacity": "8MiB"}], CHUNK)
    with (pytest.raises(RuntimeError, match="Engine core initialization failed"),
          start_engine(lfm2_dir, config)):
        pass
    captured = capfd.readouterr()
    output = captured.out + captured.err
    [line] = {line.split("ConfigError: ", 1)[1] for line in output.splitlines()
              if "ConfigError: " in line and "kvtier cannot serve it" in line}
    assert str(lfm2_dir) in line and "Lfm2ForCausalLM" in line
    assert "conv state layers besides attention" in line
    assert "without kvtier's connector" in line and "OffloadingConnector" in line
    assert "Failed to promote" not in output


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


def _chunk_five(llm: Any, prompt: list[int], salt: str, *, load: bool) -> Path:
    """Chunk 5's file of `prompt` (6 chunks + 1 token) under `salt`: chunks 0-4 are stored
    first (a 5-chunk prefix), then the whole prompt runs (loading chunks 0-4 from kvtier, or
    not) and stores chunk 5 only."""
    disk = llm.disk_dir
    token_ids(llm, [{"prompt_token_ids": prompt[:5 * CHUNK + 1], "cache_salt": salt}], 1)
    settle([disk])
    assert llm.reset_prefix_cache()
    before = {f.name for f in chunk_files(disk)}
    loaded = kvtier_counter("loaded_tokens")
    params = None if load else {"skip_load": True}
    token_ids(llm, [{"prompt_token_ids": prompt, "cache_salt": salt}], 1, params)
    assert kvtier_counter("loaded_tokens") - loaded == (5 * CHUNK if load else 0)
    return next(disk.rglob(wait_for_new_file(disk, before)))


def _difference(ours: Path, ref: Path) -> float:
    a, b = chunk_payload(ours), chunk_payload(ref)
    return float((a - b).abs().mean() / b.abs().mean())


def test_kv_computed_over_a_hybrid_hit_equals_kv_computed_from_scratch(gemma3: Any) -> None:
    [prompt] = [p["prompt_token_ids"] for p in random_prompts([6 * CHUNK + 1], seed=33)]
    over_hit = _chunk_five(gemma3, prompt, "hit", load=True)
    scratch = _chunk_five(gemma3, prompt, "scratch", load=False)
    other = _chunk_five(gemma3, [7] * CHUNK + prompt[CHUNK:], "control", load=False)
    assert _difference(over_hit, scratch) < NOISE
    assert _difference(other, scratch) > 5 * NOISE  # another prefix: far off


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
