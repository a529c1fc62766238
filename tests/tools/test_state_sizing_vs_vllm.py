"""`kvtier plan`'s state sizes (tools/ops/statesize.py) against vLLM's own shape and dtype
functions (`MambaStateShapeCalculator`, `MambaStateDtypeCalculator`), called the way each model
class calls them, for every state family and at TP sizes that split or replicate groups
(issue 25). The sizing must never drift from what vLLM allocates and kvtier stores."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from kvtier.tools.ops.modelspec import load_model_spec, parse_model_config

mamba_utils = pytest.importorskip("vllm.model_executor.layers.mamba.mamba_utils")
torch = pytest.importorskip("torch")
Shapes = mamba_utils.MambaStateShapeCalculator
Dtypes = mamba_utils.MambaStateDtypeCalculator
CONFIGS = Path(__file__).parents[1] / "data" / "configs"


def _bytes(shapes: tuple[tuple[int, ...], ...], dtypes: tuple[torch.dtype, ...]) -> int:
    return sum(math.prod(s) * d.itemsize for s, d in zip(shapes, dtypes, strict=True))


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_gated_deltanet_matches_vllm(tp):
    spec = load_model_spec(CONFIGS / "qwen3-next-80b-a3b.json")
    shapes = Shapes.gated_delta_net_state_shape(tp, 16, 32, 128, 128, 4)
    dtypes = Dtypes.gated_delta_net_state_dtype(torch.bfloat16, "auto", "auto")
    assert spec.state is not None and spec.state.bytes_per_rank(tp) == _bytes(shapes, dtypes)


@pytest.mark.parametrize("tp", [1, 2, 8, 16])
def test_nemotron_h_mamba2_matches_vllm(tp):
    spec = load_model_spec(CONFIGS / "nemotron-h-8b.json")
    shapes = Shapes.mamba2_state_shape(tp_world_size=tp, intermediate_size=128 * 64, n_groups=8,
                                       num_heads=128, head_dim=64, state_size=128,
                                       conv_kernel=4)
    # NemotronHForCausalLMConfig turns mamba_ssm_cache_dtype "auto" into float32
    dtypes = Dtypes.mamba2_state_dtype(torch.bfloat16, "auto", "float32")
    assert spec.state is not None and spec.state.bytes_per_rank(tp) == _bytes(shapes, dtypes)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_short_conv_matches_vllm(tp):
    spec = parse_model_config({"model_type": "lfm2", "hidden_size": 2048,
                               "num_hidden_layers": 2, "num_attention_heads": 32,
                               "num_key_value_heads": 8, "conv_L_cache": 3,
                               "layer_types": ["conv", "full_attention"]})
    shapes = Shapes.short_conv_state_shape(tp, 2048, 3)
    dtypes = Dtypes.short_conv_state_dtype(torch.bfloat16, "auto")
    assert spec.state is not None and spec.state.bytes_per_rank(tp) == _bytes(shapes, dtypes)


def test_mamba1_matches_vllm():
    spec = parse_model_config({"model_type": "jamba", "hidden_size": 4096,
                               "num_hidden_layers": 8, "num_attention_heads": 32,
                               "attn_layer_period": 8, "attn_layer_offset": 4,
                               "mamba_d_conv": 4, "mamba_d_state": 16, "mamba_expand": 2})
    shapes = Shapes.mamba1_state_shape(2, 8192, 16, 4)
    dtypes = Dtypes.mamba1_state_dtype(torch.bfloat16, "auto", "auto")
    assert spec.state is not None and spec.state.bytes_per_rank(2) == _bytes(shapes, dtypes)
