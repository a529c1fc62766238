"""Pooling (embedding) models in a real vLLM on the CPU backend, with kvtier's connector.

The generated "test" model run as an embedding model (`runner="pooling"`, `convert="embed"`):
  - with LAST pooling (vLLM keeps its prefix cache on): a prompt's embedding over a kvtier hit
    (three chunks loaded) equals the one computed whole;
  - with MEAN pooling vLLM turns its own prefix cache off: its pooler reads every prompt
    token's hidden state, and a loaded prefix has none. kvtier served it, and the second
    embedding of a stored prompt stopped vLLM 0.32's engine ("RuntimeError: partial prefill
    is not supported with MEAN pooling"). It is refused at start-up now (models.py).

One engine at a time, in this process (the refusal raises kvtier's ConfigError here).
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import pytest
from vllm_harness import kvtier_counter, kvtier_transfer_config, random_prompts, start_engine

from kvtier.errors import ConfigError

pytestmark = pytest.mark.vllm

CHUNK = 64


def embedding_engine(model_dir: Path, pooling: str) -> AbstractContextManager[Any]:
    config = kvtier_transfer_config([{"kind": "memory", "capacity": "8MiB"}], CHUNK)
    return start_engine(model_dir, config, runner="pooling", convert="embed",
                        pooler_config={"seq_pooling_type": pooling})


def test_a_last_pooling_embedding_over_a_kvtier_hit_equals_the_miss_paths(
        tiny_model_dir: Path) -> None:
    [prompt] = random_prompts([200], seed=470)
    with embedding_engine(tiny_model_dir, "LAST") as llm:
        [miss] = llm.embed([prompt], use_tqdm=False)
        assert llm.reset_prefix_cache()
        loaded = kvtier_counter("loaded_tokens")
        [hit] = llm.embed([prompt], use_tqdm=False)
        assert kvtier_counter("loaded_tokens") - loaded == 3 * CHUNK
    assert hit.outputs.embedding == miss.outputs.embedding


def test_a_mean_pooling_model_is_refused_naming_its_pooler(tiny_model_dir: Path) -> None:
    with pytest.raises(ConfigError, match="seq_pooling_type=MEAN") as caught, \
            embedding_engine(tiny_model_dir, "MEAN"):
        pass
    message = str(caught.value)
    assert str(tiny_model_dir) in message and "pooling model" in message
    assert "without a KV cache connector" in message
