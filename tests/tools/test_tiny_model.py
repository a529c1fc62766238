"""The tiny model generator writes a loadable config and tokenizer, and caches by digest.

These tests stay away from vLLM (tests/engine loads the model for real); a 1-layer, 32-wide
model writes in well under a second.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.testing.tinymodel import (
    BOS_ID,
    EOS_ID,
    MIN_VOCAB_SIZE,
    PRESETS,
    TinyModelSpec,
    make_tiny_model,
    preset_named,
    served_name,
    write_tokenizer,
)

SMALL = dict(num_layers=1, hidden_size=64, num_heads=2, num_kv_heads=1, intermediate_size=64,
             vocab_size=320, max_position_embeddings=128)


def test_writes_a_llama_config_with_the_requested_shape(tmp_path: Path) -> None:
    model_dir = make_tiny_model(tmp_path, **SMALL)
    config = json.loads((model_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["num_hidden_layers"] == 1
    assert config["num_key_value_heads"] == 1
    assert config["head_dim"] == 32
    assert config["vocab_size"] == 320
    assert (model_dir / "model.safetensors").stat().st_size > 0


@pytest.fixture(scope="module")
def test_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The "test" preset's tokenizer (512 ids), as AutoTokenizer loads it."""
    from transformers import AutoTokenizer

    out = tmp_path_factory.mktemp("tok")
    write_tokenizer(PRESETS["test"].vocab_size, out)
    return AutoTokenizer.from_pretrained(out)


@settings(max_examples=200, deadline=None)
@given(text=st.text())
def test_any_text_round_trips_through_the_tokenizer(test_tokenizer: Any, text: str) -> None:
    ids = test_tokenizer(text)["input_ids"]
    assert all(0 <= i < PRESETS["test"].vocab_size for i in ids)
    assert test_tokenizer.decode(ids) == text


def test_english_words_get_distinct_known_tokens(test_tokenizer: Any) -> None:
    words = ["the", "cache", "keeps", "every", "block", "a", "model", "computed", "once",
             "Hello", "World", "2026"]
    encoded = [tuple(test_tokenizer(" " + w)["input_ids"]) for w in words]
    assert len(set(encoded)) == len(words)
    assert all(test_tokenizer.unk_token_id not in ids for ids in encoded)
    assert len(test_tokenizer(" the cache")["input_ids"]) < len(" the cache")  # merges


def test_every_preset_vocabulary_is_filled_exactly(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    for size in sorted({MIN_VOCAB_SIZE, *(p.vocab_size for p in PRESETS.values()), 4096}):
        write_tokenizer(size, tmp_path / str(size))
        tok = AutoTokenizer.from_pretrained(tmp_path / str(size))
        assert len(tok) == size
        assert (tok.bos_token_id, tok.eos_token_id) == (BOS_ID, EOS_ID)
    with pytest.raises(ValueError, match="259"):
        make_tiny_model(tmp_path, **{**SMALL, "vocab_size": MIN_VOCAB_SIZE - 1})


def test_the_model_has_a_chat_template_and_greedy_defaults(tmp_path: Path) -> None:
    from transformers import AutoTokenizer, GenerationConfig

    model_dir = make_tiny_model(tmp_path, **SMALL)
    tok = AutoTokenizer.from_pretrained(model_dir)
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    assert tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) == (
        "<s>system\nBe brief.</s>\n<s>user\nHi!</s>\n<s>assistant\n")
    ids = tok.apply_chat_template(chat, add_generation_prompt=True)
    ids = ids["input_ids"] if isinstance(ids, Mapping) else ids
    assert ids[0] == BOS_ID and ids.count(EOS_ID) == 2
    generation = GenerationConfig.from_pretrained(model_dir)
    assert (generation.do_sample, generation.temperature) == (False, 0.0)
    assert generation.max_new_tokens == 128
    assert (generation.bos_token_id, generation.eos_token_id) == (BOS_ID, EOS_ID)


def test_a_generated_model_has_a_short_served_name(tmp_path: Path) -> None:
    assert served_name(make_tiny_model(tmp_path, **SMALL)).startswith("kvtier-tiny-")
    assert served_name(tmp_path) is None  # not a generated model
    for preset, name in (("test", "kvtier-tiny"), ("bench", "kvtier-bench")):
        fake = tmp_path / preset  # served_name reads only the marker
        fake.mkdir()
        (fake / "kvtier-tiny-model.json").write_text(json.dumps(
            {"spec": dataclasses.asdict(PRESETS[preset])}))
        assert served_name(fake) == name


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


def test_kvtier_serve_generates_the_embedded_model_it_is_named(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
        ) -> None:
    """`kvtier serve kvtier-tiny`: the README's generated model, with no directory to make
    first (a user found no documented way to make one)."""
    from kvtier.tools.cli.main import main

    assert (preset_named("kvtier-tiny"), preset_named("kvtier-bench")) == ("test", "bench")
    assert preset_named("kvtier-nope") is None and preset_named("test") is None
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    args = ["serve", "kvtier-tiny", "--dry-run", "--memory", "64MiB", "--disk", "0"]
    assert main(args) == 0
    printed = capsys.readouterr().out
    [model_dir] = (tmp_path / "cache" / "kvtier" / "models").iterdir()
    assert served_name(model_dir) == "kvtier-tiny"
    assert f"--model {model_dir}" in printed
    assert f"--served-model-name kvtier-tiny {model_dir}" in printed
    assert main(args) == 0  # the same directory again, not written anew
    assert list((tmp_path / "cache" / "kvtier" / "models").iterdir()) == [model_dir]
