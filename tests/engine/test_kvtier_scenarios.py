"""kvtier's connector in a real vLLM (CPU backend): the serving scenarios of issue 3.

One engine for the module (start ~20-45 s): a memory tier over a disk tier, 64-token chunks
(2 vLLM blocks of 32), 128 vLLM blocks (4,096 tokens of KV, small enough that the preemption
case runs out). Each case uses its own prompts (its own seed), so cases never see each
other's chunks, and empties vLLM's own prefix cache (`reset_prefix_cache()`, which leaves
kvtier alone) whenever a hit must come from kvtier.

What a case asserts, besides the tokens: vLLM's counters (`vllm:external_prefix_cache_hits`,
tokens vLLM took from the connector for new requests; `vllm:num_preemptions`) and kvtier's own
(`kvtier:loaded_tokens`, `kvtier:lookup_hit_tokens`, `kvtier:tier_hits{tier=...}`), read as
deltas around the run.

The reference for "identical outputs" is the miss path of this same engine: the request run
with `kv_transfer_params={"skip_load": True, "skip_store": True}` after emptying vLLM's
cache (kvtier neither serves nor learns anything from it). Different engine
configurations may break near-ties differently on random weights (../shared/VLLM_CPU.md).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from vllm_harness import (
    BLOCK_SIZE,
    NUM_BLOCKS,
    chunk_files,
    kvtier_counter,
    kvtier_transfer_config,
    metric,
    random_prompts,
    start_engine,
    token_ids,
)

pytestmark = pytest.mark.vllm

CHUNK = 64
HITS = "vllm:external_prefix_cache_hits"
SKIP_LOAD = {"skip_load": True}
BYPASS = {"skip_load": True, "skip_store": True}


@pytest.fixture(scope="module")
def disk_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("kvtier-disk")


@pytest.fixture(scope="module")
def llm(tiny_model_dir: Path, disk_dir: Path) -> Iterator[Any]:
    tiers = [{"kind": "memory", "capacity": "64MiB"},
             {"kind": "disk", "path": str(disk_dir), "capacity": "256MiB"}]
    with start_engine(tiny_model_dir, kvtier_transfer_config(tiers, CHUNK)) as engine:
        yield engine


class Counters:
    """Deltas of vLLM's and kvtier's counters since construction."""

    def __init__(self, llm: Any) -> None:
        self._llm = llm
        self._start = self._read()

    def _read(self) -> dict[str, float]:
        return {
            "external_hits": metric(self._llm, HITS),
            "local_hits": metric(self._llm, "vllm:prefix_cache_hits"),
            "preemptions": metric(self._llm, "vllm:num_preemptions"),
            "lookup_hit_tokens": kvtier_counter("lookup_hit_tokens"),
            "loaded_tokens": kvtier_counter("loaded_tokens"),
            "stored_tokens": kvtier_counter("stored_tokens"),
            "load_failures": kvtier_counter("load_failures"),
            "memory_hits": kvtier_counter("tier_hits", tier="memory"),
        }

    def delta(self) -> dict[str, float]:
        now = self._read()
        return {name: now[name] - self._start[name] for name in now}


def loadable(prompt_len: int) -> int:
    """Tokens kvtier can serve of a stored prompt: full chunks before the last token."""
    return (prompt_len - 1) // CHUNK * CHUNK


def reference(llm: Any, prompts: list[dict[str, Any]], max_tokens: int = 16) -> list[list[int]]:
    """The miss path: nothing from vLLM's cache nor from kvtier, one request at a time."""
    outputs = []
    for prompt in prompts:
        assert llm.reset_prefix_cache()
        outputs += token_ids(llm, [prompt], max_tokens, kv_transfer_params=BYPASS)
    return outputs


def test_long_prompts_in_a_batch_are_served_from_kvtier_with_identical_outputs(llm: Any) -> None:
    lengths = [1500, 777, 1000, 64, 65, 129, 10]
    prompts = random_prompts(lengths, seed=11)
    miss = token_ids(llm, prompts)
    # vLLM's own prefix cache serves the second run: the floor to compare with.
    assert token_ids(llm, prompts) == miss
    # Emptied vLLM cache: the prefixes can only come from kvtier's tiers now.
    assert llm.reset_prefix_cache()
    counters = Counters(llm)
    assert token_ids(llm, prompts) == miss
    hit_tokens = sum(loadable(n) for n in lengths)
    delta = counters.delta()
    assert delta["external_hits"] == hit_tokens
    assert delta["lookup_hit_tokens"] == hit_tokens
    assert delta["loaded_tokens"] == hit_tokens
    assert delta["memory_hits"] == hit_tokens // CHUNK
    assert delta["load_failures"] == 0


def test_partial_hits_in_a_mixed_batch_match_the_miss_path(llm: Any) -> None:
    stored = random_prompts([300, 500], seed=12)
    [fresh] = random_prompts([200], seed=13)
    token_ids(llm, stored)
    # A batch of: a stored prompt, one extending a stored prompt with new tokens, one whose
    # first chunk is stored and the rest differs, and a prompt kvtier has never seen.
    extended = {"prompt_token_ids": stored[1]["prompt_token_ids"] + fresh["prompt_token_ids"][:90]}
    diverging = {"prompt_token_ids": stored[0]["prompt_token_ids"][:100]
                 + fresh["prompt_token_ids"][90:]}
    batch = [stored[0], extended, diverging, fresh]
    expected = reference(llm, batch)
    assert llm.reset_prefix_cache()
    counters = Counters(llm)
    assert token_ids(llm, batch) == expected
    # stored[0]: its 4 chunks; extended: 7 chunks of stored[1] (its 8th chunk also holds
    # stored[1]'s first answer tokens); fresh: none. `diverging` shares 100 tokens with
    # stored[0] in the same batch: vLLM's own cache gives it those 3 blocks (96 tokens) from
    # stored[0]'s blocks, more than its one stored chunk, so kvtier adds nothing there.
    delta = counters.delta()
    assert delta["external_hits"] == CHUNK * (4 + 7)
    assert delta["local_hits"] == 3 * BLOCK_SIZE


def test_a_chunk_partly_in_vllms_cache_is_loaded_around_the_shared_blocks(llm: Any) -> None:
    [prompt] = random_prompts([300], seed=14)
    [noise] = random_prompts([60], seed=15)
    expected = token_ids(llm, [prompt])
    assert llm.reset_prefix_cache()
    # Leave vLLM caching exactly 3 blocks (96 tokens) of the prompt: chunk 1 (tokens 64-127)
    # is then half in vLLM's cache; kvtier must load only its second block.
    token_ids(llm, [{"prompt_token_ids": prompt["prompt_token_ids"][:100]
                     + noise["prompt_token_ids"]}])
    counters = Counters(llm)
    assert token_ids(llm, [prompt]) == expected
    assert counters.delta()["external_hits"] == loadable(300) - 3 * BLOCK_SIZE
    assert counters.delta()["loaded_tokens"] == loadable(300) - 3 * BLOCK_SIZE


def test_two_requests_sharing_a_prefix_being_loaded_load_it_once_in_one_step(llm: Any) -> None:
    """A prompt and a longer one starting with it, sent together after vLLM's cache was
    emptied: kvtier loads the shared chunks once, for the first; the second takes them from
    the first's blocks through vLLM's own prefix cache in the same step, rather than
    waiting for (or repeating) the load."""
    [base, tail] = random_prompts([640, 70], seed=21)
    token_ids(llm, [base])  # stored: its prompt and answer
    twin = {"prompt_token_ids": base["prompt_token_ids"] + tail["prompt_token_ids"]}
    expected = reference(llm, [base, twin])
    assert llm.reset_prefix_cache()
    counters = Counters(llm)
    assert token_ids(llm, [base, twin]) == expected
    delta = counters.delta()
    assert delta["loaded_tokens"] == loadable(640)  # once, not twice
    assert delta["external_hits"] == loadable(640)
    # The twin's whole shared prefix (20 blocks) came from the base's fresh blocks.
    assert delta["local_hits"] == 640
    assert delta["load_failures"] == 0


def test_turn_two_loads_turn_ones_prompt_and_answer_from_kvtier(llm: Any) -> None:
    [turn1, new] = random_prompts([300, 50], seed=16)
    [answer] = token_ids(llm, [turn1], max_tokens=100)
    turn2 = {"prompt_token_ids": turn1["prompt_token_ids"] + answer + new["prompt_token_ids"]}
    assert llm.reset_prefix_cache()
    counters = Counters(llm)
    out = token_ids(llm, [turn2], max_tokens=20)
    # Turn 1 computed its prompt and 99 of its 100 answer tokens (the last one was sampled,
    # never fed back): 399 tokens, 6 full chunks, one of them past the original prompt.
    hit = counters.delta()["external_hits"]
    assert hit == (300 + 99) // CHUNK * CHUNK
    assert hit > 300
    # Compare with the miss path of this same turn 2.
    assert out == reference(llm, [turn2], max_tokens=20)


def test_kv_transfer_params_skip_store_skip_load_and_max_offload_tokens(llm: Any,
                                                                        disk_dir: Path) -> None:
    prompts = random_prompts([400, 400, 400, 400], seed=18)
    no_store, limited, nothing, plain = prompts
    params = [{"skip_store": True}, {"max_offload_tokens": 130}, {"max_offload_tokens": 0}, None]
    expected = []
    for prompt, p in zip(prompts, params):
        expected += token_ids(llm, [prompt], kv_transfer_params=p)
    assert llm.reset_prefix_cache()
    counters = Counters(llm)
    assert token_ids(llm, [no_store, nothing]) == [expected[0], expected[2]]
    assert counters.delta()["external_hits"] == 0  # neither was stored
    assert token_ids(llm, [limited]) == [expected[1]]
    assert counters.delta()["external_hits"] == 2 * CHUNK  # 130 tokens: 2 full chunks
    # skip_load: a stored prompt is recomputed, with the same tokens.
    assert llm.reset_prefix_cache()
    before = counters.delta()["external_hits"]
    assert token_ids(llm, [plain], kv_transfer_params=SKIP_LOAD) == [expected[3]]
    assert counters.delta()["external_hits"] == before
    assert llm.reset_prefix_cache()
    assert token_ids(llm, [plain]) == [expected[3]]
    assert counters.delta()["external_hits"] == before + loadable(400)
    assert chunk_files(disk_dir), "the disk tier below memory holds chunks too"


def test_preempted_requests_are_restored_from_kvtier_with_identical_outputs(llm: Any) -> None:
    # 6 requests of 900 + 200 tokens need ~210 blocks of 32; the engine has 128.
    prompts = random_prompts([900] * 6, seed=19)
    assert NUM_BLOCKS * BLOCK_SIZE < 6 * (900 + 200)
    assert llm.reset_prefix_cache()
    counters = Counters(llm)
    pressured = token_ids(llm, prompts, max_tokens=200)
    delta = counters.delta()
    assert delta["preemptions"] > 0
    # Resumed requests came back through kvtier: vLLM counts their external hits apart
    # (not in vllm:external_prefix_cache_hits), kvtier's loads show them. The prompts are
    # all new and distinct, so every load here is a resumed request's.
    assert delta["loaded_tokens"] > 0
    assert delta["load_failures"] == 0
    assert pressured == reference(llm, prompts, max_tokens=200)


def test_different_cache_salts_never_share_chunks(llm: Any) -> None:
    """Tenant B sends tenant A's exact prompt with another cache_salt: no kvtier hit."""
    [prompt] = random_prompts([200], seed=2)
    tenant_a = {**prompt, "cache_salt": "tenant-a"}
    tenant_b = {**prompt, "cache_salt": "tenant-b"}
    expected = token_ids(llm, [tenant_a])
    assert llm.reset_prefix_cache()
    hits_before = metric(llm, "vllm:external_prefix_cache_hits")
    assert token_ids(llm, [tenant_b]) == expected
    assert metric(llm, "vllm:external_prefix_cache_hits") == hits_before
    assert llm.reset_prefix_cache()
    assert token_ids(llm, [tenant_a]) == expected
    assert metric(llm, "vllm:external_prefix_cache_hits") - hits_before == 3 * 64


def test_a_prompt_of_whole_chunks_held_by_kvtier_gives_the_miss_paths_tokens(llm: Any) -> None:
    """lmcache#5151: a stored prompt reported as a full hit restored the wrong context (its
    length a multiple of the chunk size). A prompt of exactly 4 chunks, all 4 held: kvtier
    serves the first 3 (vLLM computes the last token, hence its chunk, for its logits) and
    the tokens are the miss path's, alone and with max_tokens 1 (the prefill's token only)."""
    [prompt] = random_prompts([4 * CHUNK], seed=23)
    expected = reference(llm, [prompt])
    [first] = reference(llm, [prompt], max_tokens=1)
    assert token_ids(llm, [prompt]) == expected  # stores its 4 chunks
    for max_tokens, want in ((16, expected), (1, [first])):
        assert llm.reset_prefix_cache()
        counters = Counters(llm)
        assert token_ids(llm, [prompt], max_tokens=max_tokens) == want
        delta = counters.delta()
        assert delta["external_hits"] == delta["loaded_tokens"] == 3 * CHUNK
        assert delta["lookup_hit_tokens"] == 3 * CHUNK
        assert delta["load_failures"] == 0


def test_an_answer_ending_on_a_chunk_boundary_leaves_its_last_chunk_unstored(llm: Any) -> None:
    """vllm#54288: the last sampled token's KV is never computed. Turn 1's prompt and answer
    end exactly on a chunk boundary (100 + 28 = 128 tokens), so chunk 1's last slot is the last
    answer token's, which no forward wrote: kvtier stores chunk 0 only, and turn 2 (turn 1,
    its answer, new tokens) loads 64 tokens, with the miss path's outputs. (Stored, chunk 1
    would load 128 tokens, one slot of them never written.)"""
    [turn1, new] = random_prompts([100, 40], seed=24)
    [answer] = token_ids(llm, [turn1], max_tokens=2 * CHUNK - 100)
    # A request whose last step stored a chunk keeps its blocks one step longer (vLLM's
    # reset_prefix_cache then returns False): none here, but the case must not depend on it.
    deadline = time.monotonic() + 10
    while not llm.reset_prefix_cache() and time.monotonic() < deadline:
        time.sleep(0.1)
    turn2 = {"prompt_token_ids": turn1["prompt_token_ids"] + answer + new["prompt_token_ids"]}
    expected = reference(llm, [turn2])
    assert llm.reset_prefix_cache()
    counters = Counters(llm)
    assert token_ids(llm, [turn2]) == expected
    assert counters.delta()["external_hits"] == CHUNK



def test_a_prompt_logprobs_request_on_a_stored_prompt_loads_nothing(llm: Any) -> None:
    """vLLM computes a request asking for prompt logprobs whole (it skips prefix-cache reads,
    SamplingParams.skip_reading_prefix_cache), kvtier's hit included: nothing is loaded, and
    every prompt position has the miss path's logprobs (a loaded prefix would have none)."""
    from vllm import SamplingParams

    def asking(kv_transfer_params: dict[str, Any] | None = None) -> Any:
        extra = {"kv_transfer_params": kv_transfer_params} if kv_transfer_params else None
        return SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True,
                              prompt_logprobs=1, extra_args=extra)

    def logprobs(output: Any) -> list[dict[int, float] | None]:
        return [p and {t: lp.logprob for t, lp in p.items()} for p in output.prompt_logprobs]

    [prompt] = random_prompts([300], seed=25)
    token_ids(llm, [prompt], max_tokens=4)  # stores its chunks
    assert llm.reset_prefix_cache()
    counters = Counters(llm)
    [hit] = llm.generate([prompt], asking(), use_tqdm=False)
    delta = counters.delta()
    assert delta["loaded_tokens"] == delta["external_hits"] == 0
    assert llm.reset_prefix_cache()
    [miss] = llm.generate([prompt], asking(BYPASS), use_tqdm=False)
    assert list(hit.outputs[0].token_ids) == list(miss.outputs[0].token_ids)
    assert len(hit.prompt_logprobs) == 300
    assert logprobs(hit) == logprobs(miss)
