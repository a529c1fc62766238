"""kvtier composed with another connector through vLLM's MultiConnector, on CPU: kvtier and
vLLM's ExampleConnector in one engine (the JSON of docs/sharing.md, "Composing with other
connectors").

MultiConnector stores through every connector and loads through the first (in its list's
order) that offers tokens. One engine (~30 s to start): a prompt's miss stores it in both
(kvtier's counters move; ExampleConnector writes its files under its storage path), and its
repeat, vLLM's own cache emptied, is loaded by kvtier (first in the list) with the miss
path's tokens.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from vllm_harness import (
    kvtier_counter,
    kvtier_transfer_config,
    metric,
    random_prompts,
    start_engine,
    token_ids,
)

pytestmark = pytest.mark.vllm

CHUNK = 64


def multi_connector_config(example_path: Path) -> dict[str, object]:
    kvtier = kvtier_transfer_config([{"kind": "memory", "capacity": "64MiB"}], CHUNK)
    return {"kv_connector": "MultiConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": {"connectors": [
                kvtier,
                {"kv_connector": "ExampleConnector", "kv_role": "kv_both",
                 "kv_connector_extra_config": {"shared_storage_path": str(example_path)}},
            ]}}


def test_kvtier_and_example_connector_both_see_the_request(tiny_model_dir: Path,
                                                            tmp_path: Path) -> None:
    example = tmp_path / "example"
    [prompt] = random_prompts([300], seed=70)
    with start_engine(tiny_model_dir, multi_connector_config(example)) as llm:
        stored = kvtier_counter("stored_tokens")
        miss = token_ids(llm, [prompt])
        # Both connectors stored the prompt: kvtier's full chunks (300 tokens + 15 of the
        # answer: 4 chunks), ExampleConnector its own files.
        assert kvtier_counter("stored_tokens") - stored == 4 * CHUNK
        assert [p for p in example.rglob("*") if p.is_file()], "ExampleConnector stored nothing"

        assert llm.reset_prefix_cache()
        loaded = kvtier_counter("loaded_tokens")
        assert token_ids(llm, [prompt]) == miss
        # kvtier, first in the list, served the repeat: whole chunks but the last token's.
        assert kvtier_counter("loaded_tokens") - loaded == (300 - 1) // CHUNK * CHUNK
        assert metric(llm, "vllm:external_prefix_cache_hits") == (300 - 1) // CHUNK * CHUNK
