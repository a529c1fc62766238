"""A Prefix LM (non-causal prefill attention) in a real vLLM on the CPU backend: refused.

vLLM 0.32 runs HRM-Text's attention layers as `PrefillPrefixLMAttention`: a prompt's tokens
attend to each other both ways within its prefill, so the KV of a prompt's first tokens depends
on the tokens after them. vLLM tags their spec `non_causal` and turns its own prefix cache
off. kvtier, which keys a chunk by the tokens up to its end, served such a model: a prompt
sharing 150 tokens with a stored one loaded two chunks of the other prompt's KV and generated
other tokens than the miss path's (found in this hunt, 8 of 8 tokens differed). It is refused
at start-up now (groups.py `NON_CAUSAL_REASON`).

One engine in this process (the refusal raises kvtier's ConfigError here), on a generated
HRM-Text model (random weights, the harness's tokenizer).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from hybrid_kit import SHAPE, save_model
from vllm_harness import kvtier_transfer_config, start_engine

from kvtier.errors import ConfigError

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def prefix_lm_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A generated HRM-Text model: its attention layers are vLLM's PrefillPrefixLMAttention."""
    import torch
    from transformers import HrmTextConfig, HrmTextForCausalLM

    shape = {k: v for k, v in SHAPE.items() if k != "num_key_value_heads"}  # MHA only
    config = HrmTextConfig(**shape, head_dim=SHAPE["hidden_size"] // SHAPE["num_attention_heads"],
                           num_layers_per_stack=1, H_cycles=2, L_cycles=1, L_bp_cycles=[1],
                           embedding_scale=1.0, initializer_range=0.3)
    torch.manual_seed(0)
    return save_model(HrmTextForCausalLM(config), tmp_path_factory.mktemp("prefix-lm"))


def test_a_prefix_lm_is_refused_naming_its_non_causal_attention(prefix_lm_dir: Path) -> None:
    config = kvtier_transfer_config([{"kind": "memory", "capacity": "8MiB"}])
    with pytest.raises(ConfigError, match="non-causal") as caught, \
            start_engine(prefix_lm_dir, config):
        pass
    message = str(caught.value)
    assert str(prefix_lm_dir) in message and "Prefix LM" in message
    assert "without a KV cache connector" in message
