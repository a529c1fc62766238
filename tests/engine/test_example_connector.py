"""Smoke test of the harness: vLLM's own ExampleConnector stores and reloads KV on CPU.

This proves the pieces kvtier's connector relies on work on this machine: the generated
model loads, a connector loads through `kv_connector_module_path`, KV round-trips through
the connector, and vLLM counts external prefix-cache hits. Engine start ~20 s; case ~1 s.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from vllm_harness import metric, random_prompts, start_engine, token_ids

pytestmark = pytest.mark.vllm


def test_example_connector_reloads_kv_with_identical_outputs(tiny_model_dir: Path,
                                                             tmp_path: Path) -> None:
    config = {
        "kv_connector": "ExampleConnector",
        "kv_connector_module_path":
            "vllm.distributed.kv_transfer.kv_connector.v1.example_connector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"shared_storage_path": str(tmp_path)},
    }
    prompts = random_prompts([200, 100])
    with start_engine(tiny_model_dir, config) as llm:
        # First run: a miss; ExampleConnector writes the prompts' KV to tmp_path.
        miss = token_ids(llm, prompts)
        assert any(tmp_path.iterdir()), "ExampleConnector stored nothing"
        # Empty vLLM's own prefix cache, so that a hit can only come from the connector.
        assert llm.reset_prefix_cache()
        hit = token_ids(llm, prompts)
        assert hit == miss
        assert metric(llm, "vllm:external_prefix_cache_hits") > 0
        assert metric(llm, "vllm:prefix_cache_hits") == 0
