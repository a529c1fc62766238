"""tokens_per_chunk and vLLM's block size (issue 25): models with state layers get large blocks
(vLLM's "align" mode sizes an attention page to hold a state page: 288 tokens for the tiny
Qwen3-Next of tests/engine/test_state_models.py, 4,224 for a 256-wide one), which the default
of 256 tokens is no multiple of. Unset, the chunk grows to a multiple of the block; set, it is
the operator's and a bad value is refused."""

from __future__ import annotations

import pytest

from kvtier.errors import ConfigError
from kvtier.integrations.vllm.config import TOKENS_PER_CHUNK, ConnectorConfig


@pytest.mark.parametrize(("block_size", "chunk"), [
    (16, TOKENS_PER_CHUNK), (32, TOKENS_PER_CHUNK), (256, 256),  # the default divides
    (384, 384), (4224, 4224), (96, 288),  # the smallest multiple of the block from 256 up
])
def test_an_unset_chunk_size_becomes_a_multiple_of_the_block(block_size: int,
                                                             chunk: int) -> None:
    config = ConnectorConfig.parse({}).for_block_size(block_size)
    assert config.tokens_per_chunk == chunk and chunk % block_size == 0


def test_a_chunk_size_the_operator_set_is_kept_or_refused() -> None:
    config = ConnectorConfig.parse({"tokens_per_chunk": 8448})
    assert config.for_block_size(4224) is config
    with pytest.raises(ConfigError, match=r"tokens_per_chunk.*multiple of vLLM's block_size "
                       r"\(4224\)"):
        ConnectorConfig.parse({"tokens_per_chunk": 256}).for_block_size(4224)


def test_a_refused_chunk_size_names_the_field_value_block_and_multiples_near_it() -> None:
    """The README's config with tokens_per_chunk 100 on an engine of 16-token blocks: the
    refusal at engine start says what to write instead."""
    with pytest.raises(ConfigError) as refused:
        ConnectorConfig.parse({"tokens_per_chunk": 100}).for_block_size(16)
    message = str(refused.value)
    assert "kv_connector_extra_config.tokens_per_chunk=100" in message
    assert "multiple of vLLM's block_size (16), e.g. 96 or 112" in message
    assert "--block-size" in message and "leave it unset" in message
