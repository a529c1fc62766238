"""KVTierConnector by name (issue 16): after `pip install kvtier`, vLLM finds the connector
through kvtier's `vllm.general_plugins` entry point, with no `kv_connector_module_path`."""

from __future__ import annotations

from importlib.metadata import entry_points
from pathlib import Path

import pytest
from vllm_harness import metric, random_prompts, start_engine, token_ids

pytestmark = pytest.mark.vllm

PLUGINS = {e.name: e.value for e in entry_points(group="vllm.general_plugins")}


@pytest.mark.skipif("kvtier" not in PLUGINS,
                    reason="kvtier's entry point is not installed (pip install -e .)")
def test_vllm_builds_kvtiers_connector_by_name(tiny_model_dir: Path) -> None:
    assert PLUGINS["kvtier"] == "kvtier.integrations.vllm.plugin:register"
    config = {"kv_connector": "KVTierConnector", "kv_role": "kv_both",
              "kv_connector_extra_config": {"tokens_per_chunk": 64,
                                            "tiers": [{"kind": "memory", "capacity": "64MiB"}]}}
    [prompt] = random_prompts([300], seed=140)
    with start_engine(tiny_model_dir, config) as llm:
        first = token_ids(llm, [prompt])
        assert llm.reset_prefix_cache()
        hits = metric(llm, "vllm:external_prefix_cache_hits")
        assert token_ids(llm, [prompt]) == first
        # 4 chunks and the prompt's tail (a block of 32: test_block_hits.py), of 299 tokens.
        assert metric(llm, "vllm:external_prefix_cache_hits") - hits == 288
