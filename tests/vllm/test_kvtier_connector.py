"""kvtier's connector inside a real vLLM (CPU backend), backed by its tiered store.

One engine for the module (start ~20 s); each case runs in about a second. Chunks are 64
tokens (2 vLLM blocks of 32). Every case uses its own prompts (its own seed) so that cases
do not see each other's chunks.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from vllm_harness import metric, random_prompts, start_engine, token_ids

pytestmark = pytest.mark.vllm

KVTIER = {
    "kv_connector": "KVTierConnector",
    "kv_connector_module_path": "kvtier.integrations.vllm",
    "kv_role": "kv_both",
    "kv_connector_extra_config": {"tokens_per_chunk": 64},
}


@pytest.fixture(scope="module")
def llm(tiny_model_dir: Path) -> Iterator[Any]:
    with start_engine(tiny_model_dir, KVTIER) as engine:
        yield engine


def test_a_repeated_prompt_is_served_from_kvtier_with_identical_outputs(llm: Any) -> None:
    prompts = random_prompts([300, 150, 40], seed=1)
    hits_before = metric(llm, "vllm:external_prefix_cache_hits")
    miss = token_ids(llm, prompts)
    # vLLM's own prefix cache serves the second run: the floor to compare with.
    local_hit = token_ids(llm, prompts)
    assert local_hit == miss
    # Emptied vLLM cache: now the prefix can only come from kvtier.
    assert llm.reset_prefix_cache()
    kvtier_hit = token_ids(llm, prompts)
    assert kvtier_hit == miss
    # Full chunks below the last prompt token: 299 -> 4 chunks, 149 -> 2, 39 -> 0.
    assert metric(llm, "vllm:external_prefix_cache_hits") - hits_before == 64 * (4 + 2)


def test_different_cache_salts_never_share_chunks(llm: Any) -> None:
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
