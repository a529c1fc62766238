"""The tiny model generator writes a loadable config and tokenizer, and caches by digest.

These tests stay away from vLLM (tests/engine loads the model for real); a 1-layer, 32-wide
model writes in well under a second.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvtier.testing.tinymodel import FIRST_WORD_ID, PRESETS, TinyModelSpec, make_tiny_model

SMALL = dict(num_layers=1, hidden_size=64, num_heads=2, num_kv_heads=1, intermediate_size=64,
             vocab_size=40, max_position_embeddings=128)


def test_writes_a_llama_config_with_the_requested_shape(tmp_path: Path) -> None:
    model_dir = make_tiny_model(tmp_path, **SMALL)
    config = json.loads((model_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["num_hidden_layers"] == 1
    assert config["num_key_value_heads"] == 1
    assert config["head_dim"] == 32
    assert config["vocab_size"] == 40
    assert (model_dir / "model.safetensors").stat().st_size > 0


def test_tokenizer_maps_words_to_their_ids_and_back(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(make_tiny_model(tmp_path, **SMALL))
    assert tok("w3 w17 w39")["input_ids"] == [3, 17, 39]
    assert tok.decode([FIRST_WORD_ID, 17]) == "w3 w17"
    assert tok.eos_token_id == 2


def test_same_parameters_reuse_the_directory_and_other_ones_do_not(tmp_path: Path) -> None:
    first = make_tiny_model(tmp_path, **SMALL)
    stamp = (first / "model.safetensors").stat().st_mtime_ns
    again = make_tiny_model(tmp_path, **SMALL)
    assert again == first
    assert (again / "model.safetensors").stat().st_mtime_ns == stamp  # not rewritten
    other = make_tiny_model(tmp_path, **{**SMALL, "seed": 1})
    assert other != first
    # No temporary directories are left behind.
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([first.name, other.name])


def test_weights_depend_only_on_the_seed(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    a = load_file(make_tiny_model(tmp_path / "a", **SMALL) / "model.safetensors")
    b = load_file(make_tiny_model(tmp_path / "b", **SMALL) / "model.safetensors")
    assert a.keys() == b.keys()
    assert all((a[k] == b[k]).all() for k in a)


def test_an_interrupted_write_is_rebuilt(tmp_path: Path) -> None:
    model_dir = make_tiny_model(tmp_path, **SMALL)
    (model_dir / "kvtier-tiny-model.json").unlink()  # as if killed before the marker
    assert make_tiny_model(tmp_path, **SMALL) == model_dir
    assert (model_dir / "kvtier-tiny-model.json").is_file()


def test_bad_shapes_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="num_heads"):
        make_tiny_model(tmp_path, **{**SMALL, "hidden_size": 65})
    with pytest.raises(TypeError):
        make_tiny_model(tmp_path, hidden_sise=64)


def test_presets_have_distinct_digests_and_sane_kv_sizes() -> None:
    assert PRESETS["test"].digest() != PRESETS["bench"].digest()
    spec = TinyModelSpec(num_layers=2, hidden_size=128, num_heads=4, num_kv_heads=2)
    assert spec.kv_bytes_per_token() == 2 * 2 * 2 * 32 * 2  # K+V, layers, heads, dim, bf16


def test_the_qwen3_next_preset_alternates_linear_and_full_attention(tmp_path: Path) -> None:
    spec = PRESETS["qwen3-next"]
    config = json.loads((make_tiny_model(tmp_path, **{
        **SMALL, "architecture": "qwen3_next", "num_layers": 2}) / "config.json").read_text())
    assert config["architectures"] == ["Qwen3NextForCausalLM"]
    assert config["layer_types"] == ["linear_attention", "full_attention"]
    # KV of its 2 full-attention layers only; states of its 2 linear ones: conv (3 inputs of
    # q, k, v: 3 x 768) and recurrent (2 heads of 128 x 128), bfloat16.
    assert spec.kv_bytes_per_token() == 2 * 2 * 2 * 32 * 2
    assert spec.state_bytes() == 2 * (3 * 768 + 2 * 128 * 128) * 2
    assert PRESETS["test"].state_bytes() == 0
