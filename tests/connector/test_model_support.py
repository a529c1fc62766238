"""Which models kvtier serves (issue 11, item 3): the decision on a model's traits, without vLLM.
A refused model gets one line naming it, the reason and what to run instead; the real start-up
refusal of an LFM2-style model is tests/engine/test_hybrid_models.py."""

from __future__ import annotations

import pytest

from kvtier.errors import ConfigError
from kvtier.integrations.vllm.models import ModelTraits, check_supported, unsupported_reason


def _traits(**fields: object) -> ModelTraits:
    return ModelTraits(model="/models/m", architecture="SomeForCausalLM", **fields)  # type: ignore[arg-type]


@pytest.mark.parametrize("layer_types", [
    (),  # Llama: no layer_types
    ("full_attention",) * 4,
    ("sliding_attention", "full_attention") * 2,  # Gemma 3 / GPT-OSS: two KV cache groups
])
def test_attention_only_models_are_served(layer_types: tuple[str, ...]) -> None:
    assert unsupported_reason(_traits(layer_types=layer_types)) is None
    check_supported(_traits(layer_types=layer_types))


def test_a_gated_deltanet_hybrid_is_served_with_prefix_caching() -> None:
    """Qwen3-Next: linear attention (gated DeltaNet) and full attention layers."""
    check_supported(ModelTraits(
        model="/models/q3n", architecture="Qwen3NextForCausalLM", hybrid=True,
        layer_types=("linear_attention", "full_attention") * 2, state_prefix_caching=True))


def test_a_conv_hybrid_is_served_with_prefix_caching_and_refused_without_in_one_line() -> None:
    lfm2 = dict(model="/models/lfm2", architecture="Lfm2ForCausalLM", hybrid=True,
                layer_types=("conv", "full_attention") * 2)
    check_supported(ModelTraits(**lfm2, state_prefix_caching=True))  # type: ignore[arg-type]
    with pytest.raises(ConfigError) as caught:
        check_supported(ModelTraits(**lfm2))  # type: ignore[arg-type]
    message = str(caught.value)
    assert "\n" not in message
    assert "/models/lfm2" in message and "Lfm2ForCausalLM" in message
    assert "conv state layers without prefix caching" in message
    assert "turn prefix caching on" in message


@pytest.mark.parametrize(("traits", "reason"), [
    # vLLM's registry knows a Mamba hybrid even when its config has no layer_types (Jamba).
    (dict(hybrid=True, state_prefix_caching=True),
     "Mamba/SSM, conv or linear-attention state layers"),
    # layer_types alone tell a state layer: Granite-4 hybrids' Mamba2 layers ("mamba"),
    # whose states kvtier does not store (groups.STORED_STATE_KINDS).
    (dict(layer_types=("mamba", "attention"), state_prefix_caching=True), "mamba state"),
    # Qwen3-Next's gated DeltaNet layers are stored, with prefix caching only.
    (dict(layer_types=("linear_attention", "full_attention")),
     "linear_attention state layers without prefix caching"),
    (dict(attention_free=True), "attention-free"),
    (dict(encoder_decoder=True), "encoder-decoder"),
])
def test_every_kind_of_refusal_names_its_reason(traits: dict[str, object], reason: str) -> None:
    found = unsupported_reason(_traits(**traits))
    assert found is not None and reason in found[0]


@pytest.mark.parametrize("split", ["pipeline_parallel_size=2", "decode_context_parallel_size=2",
                                   "prefill_context_parallel_size=4"])
def test_parallelism_other_than_tensor_parallel_is_refused(split: str) -> None:
    """A chunk's layout names its tensor-parallel rank only: two pipeline stages of one shape
    (an even split of the layers) wrote and read each other's chunks under one key on a shared
    tier, another stage's KV loaded, every checksum good. Refused in one line until layouts
    name the stage."""
    with pytest.raises(ConfigError) as refused:
        check_supported(_traits(other_parallelism=(split,)))
    assert split in refused.value.allowed and "tensor parallelism only" in refused.value.allowed
    assert unsupported_reason(_traits()) is None


def test_the_engines_parallelism_is_read_from_its_config() -> None:
    from types import SimpleNamespace

    from kvtier.integrations.vllm.models import model_traits

    def traits(**parallel: int) -> ModelTraits:
        model = SimpleNamespace(hf_text_config=SimpleNamespace(), use_mla=False, model="m",
                                architecture="LlamaForCausalLM", is_attention_free=False,
                                is_hybrid=False, is_encoder_decoder=False)
        config = SimpleNamespace(model_config=model,
                                 cache_config=SimpleNamespace(mamba_cache_mode="none"),
                                 parallel_config=SimpleNamespace(tensor_parallel_size=2,
                                                                 **parallel))
        return model_traits(config)  # type: ignore[arg-type]

    assert traits(pipeline_parallel_size=1).other_parallelism == ()
    assert traits(pipeline_parallel_size=2, decode_context_parallel_size=1).other_parallelism \
        == ("pipeline_parallel_size=2",)


def test_a_pooling_model_vllm_serves_without_prefix_caching_is_refused() -> None:
    """MEAN pooling reads every prompt token's hidden state: a loaded prefix has none
    (tests/engine/test_pooling_models.py). LAST pooling, for which vLLM caches prefixes, is
    served."""
    from types import SimpleNamespace

    from kvtier.integrations.vllm.models import model_traits

    def traits(pooling: str, prefix_caching: bool) -> ModelTraits:
        pooler = SimpleNamespace(seq_pooling_type=pooling, tok_pooling_type="ALL")
        model = SimpleNamespace(hf_text_config=SimpleNamespace(), use_mla=False, model="m",
                                architecture="LlamaModel", is_attention_free=False,
                                is_hybrid=False, is_encoder_decoder=False, attn_type="decoder",
                                pooler_config=pooler,
                                is_prefix_caching_supported=prefix_caching)
        config = SimpleNamespace(model_config=model,
                                 cache_config=SimpleNamespace(mamba_cache_mode="none"),
                                 parallel_config=SimpleNamespace())
        return model_traits(config)  # type: ignore[arg-type]

    assert unsupported_reason(traits("LAST", True)) is None
    with pytest.raises(ConfigError, match=r"pooling model \(seq_pooling_type=MEAN"):
        check_supported(traits("MEAN", False))
