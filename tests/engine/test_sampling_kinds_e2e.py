"""Parallel sampling (n > 1) and beam search over kvtier hits, in a real vLLM (CPU backend).

vLLM runs a request of n samples as n child requests of one prompt, and beam search as a
series of one-token requests, each beam's prompt the last one's plus its tokens: both load a
prompt's chunks from kvtier like any request. Each case first runs its prompt on the miss
path (kvtier neither serves nor stores: `BYPASS`), then once to store its chunks, then, vLLM's
own cache emptied, over kvtier's hit: the outputs equal the miss path's and kvtier loaded the
prompt's chunks.

One engine (a memory tier, 64-token chunks), in this process.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from vllm_harness import kvtier_counter, kvtier_transfer_config, random_prompts, start_engine

pytestmark = pytest.mark.vllm

CHUNK = 64
BYPASS = {"skip_load": True, "skip_store": True}
PROMPT_TOKENS = 200  # 3 loadable chunks


@pytest.fixture(scope="module")
def llm(tiny_model_dir: Path) -> Iterator[Any]:
    config = kvtier_transfer_config([{"kind": "memory", "capacity": "64MiB"}], CHUNK)
    with start_engine(tiny_model_dir, config) as engine:
        yield engine


def test_n_samples_of_a_seeded_request_over_a_hit_equal_the_miss_paths(llm: Any) -> None:
    from vllm import SamplingParams

    def samples(kv_transfer_params: dict[str, Any] | None = None) -> list[list[int]]:
        extra = {"kv_transfer_params": kv_transfer_params} if kv_transfer_params else None
        params = SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=8, ignore_eos=True,
                                extra_args=extra)
        [output] = llm.generate([prompt], params, use_tqdm=False)
        return [list(sample.token_ids) for sample in output.outputs]

    [prompt] = random_prompts([PROMPT_TOKENS], seed=480)
    assert llm.reset_prefix_cache()
    miss = samples(BYPASS)
    assert llm.reset_prefix_cache()
    samples()  # stores the prompt's chunks
    assert llm.reset_prefix_cache()
    loaded = kvtier_counter("loaded_tokens")
    hit = samples()
    assert kvtier_counter("loaded_tokens") - loaded >= 3 * CHUNK
    assert hit == miss


def test_beam_search_over_a_hit_equals_the_miss_paths(llm: Any) -> None:
    from vllm.sampling_params import BeamSearchParams

    def beams() -> list[tuple[list[int], float]]:
        params = BeamSearchParams(beam_width=2, max_tokens=6, ignore_eos=True)
        [output] = llm.beam_search([prompt], params)
        return [(list(seq.tokens), seq.cum_logprob) for seq in output.sequences]

    [prompt] = random_prompts([PROMPT_TOKENS], seed=481)
    assert llm.reset_prefix_cache()
    miss = beams()  # the first run: nothing of this prompt in kvtier yet
    assert llm.reset_prefix_cache()
    loaded = kvtier_counter("loaded_tokens")
    hit = beams()
    assert kvtier_counter("loaded_tokens") - loaded >= 3 * CHUNK
    assert [tokens for tokens, _ in hit] == [tokens for tokens, _ in miss]
    assert [lp for _, lp in hit] == pytest.approx([lp for _, lp in miss], abs=1e-2)
