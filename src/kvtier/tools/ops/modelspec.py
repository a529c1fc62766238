"""What a model costs in memory, read from its Hugging Face `config.json`.

Primitives:
    ModelSpec, MlaSpec     -- the architecture numbers the sizing math needs (frozen)
    load_model_spec(path)  -- read a config.json file (no downloads)
    parse_model_config(d)  -- the same from an already-parsed dict
    kv_dtype_bytes(name)   -- bytes per KV element for a plain `--kv-cache-dtype` value
    attention_token_bytes(spec, kv_dtype, tp) -- one token in one attention layer, one rank
                              (packed quantized dtypes too: kvdtypes.py)
    KVFootprint, kv_footprint(spec, kv_dtype, tp, hybrid_manager)
                           -- per-rank KV bytes per token, split by layer kind
    session_kv_bytes(fp, tokens) -- one sequence's KV on one rank at `tokens` context (HBM)
    hma_padding_layers(full, sliding) -- padding layers of vLLM's hybrid manager's groups
    stored_kv_bytes(fp, tokens)  -- the same as an offload tier stores it (no window)
    hf_layer_types(spec)   -- the layers as HF `layer_types` names (kvtier's model check)

Layer kinds: "full" attention keeps KV for every token; "sliding" attention keeps at most
`sliding_window` tokens (Llama 4's chunked local attention, at most `attention_chunk_size`:
its NoPE layers are full, the others see only their own chunk). In HBM vLLM's hybrid manager
pads each kind to whole groups of equal size (`hma_padding_layers`); an offload tier stores a
sliding layer's every chunk (`stored_kv_bytes`). With `--disable-hybrid-kv-cache-manager`
vLLM allocates sliding layers like full ones, but only in a model that has both kinds
(`_promote_local_kv_cache_specs` promotes only when full and sliding layers are present): a
model whose layers are all sliding (Mistral-7B v0.1) keeps the window either way;
"linear" (Mamba, gated DeltaNet, short convolution) keeps a fixed state per sequence and no
per-token KV (statesize.py: vLLM's state shapes and dtypes; the per-rank split).

MLA (DeepSeek-V2/V3): vLLM caches the compressed latent `kv_lora_rank + qk_rope_head_dim`
per layer per token, once (no separate K and V), and every TP rank holds the whole latent.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from kvtier.errors import ConfigError
from kvtier.tools.ops.kvdtypes import layer_token_bytes, plain_dtype_bytes
from kvtier.tools.ops.modelparams import MlaSpec, ParamCount, count_params, linear_state_bytes
from kvtier.tools.ops.statesize import StateShape, state_shape

LayerKind = Literal["full", "sliding", "linear"]

_TORCH_DTYPE_BYTES = {"bfloat16": 2.0, "float16": 2.0, "float32": 4.0, "float8_e4m3fn": 1.0}
# config.json `layer_types` / `layers_block_type` values -> our kinds.
_LAYER_TYPE_NAMES: dict[str, LayerKind] = {
    "full_attention": "full", "attention": "full", "global": "full",
    "sliding_attention": "sliding", "local": "sliding", "chunked_attention": "sliding",
    "linear_attention": "linear", "mamba": "linear", "mamba2": "linear", "conv": "linear",
}


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """The architecture numbers of one model that KV and weight sizing need."""

    name: str  # display name (file's parent folder or `_name_or_path`)
    model_type: str  # HF `model_type`
    hidden_size: int  # residual stream width
    num_attention_heads: int  # query heads
    num_kv_heads: int  # key/value heads (== query heads for MHA, fewer for GQA/MQA)
    head_dim: int  # per-head width of K and V
    layer_kinds: tuple[LayerKind, ...]  # one entry per decoder layer
    sliding_window: int | None  # tokens kept by "sliding" layers; None when there are none
    mla: MlaSpec | None  # set for DeepSeek-style latent attention
    linear_state_bytes: int  # fixed per-sequence state of ONE "linear" layer, all ranks
    param_count: int  # total parameters
    active_param_count: int  # parameters used per token (differs for MoE)
    embedding_param_count: int  # input embedding + LM head, included in both counts above
    weight_bytes_per_param: float  # 2 for BF16, 1 for FP8 checkpoints, 0.5 for 4-bit
    max_position_embeddings: int  # longest context the model was built for
    architecture: str = ""  # HF `architectures[0]`, e.g. "LlamaForCausalLM"; "" if absent
    encoder_decoder: bool = False  # HF `is_encoder_decoder`: cross-attention over an encoder
    params_estimated: bool = True  # param_count estimated from shapes, not given by the user
    state: StateShape | None = None  # one "linear" layer's state shape; None without them
    # every layer runs a state mixer beside its attention (Falcon-H1): layer_kinds say "full"
    parallel_state: bool = False
    # the "sliding" layers are Llama 4's chunked local attention (window: the chunk; vLLM's
    # ChunkedLocalAttentionSpec), not a sliding window
    chunked_attention: bool = False

    @property
    def num_layers(self) -> int:
        return len(self.layer_kinds)

    @property
    def attention_kind(self) -> str:
        """"mla", "mha", "mqa" or "gqa"."""
        if self.mla is not None:
            return "mla"
        if self.num_kv_heads == self.num_attention_heads:
            return "mha"
        return "mqa" if self.num_kv_heads == 1 else "gqa"

    def count(self, kind: LayerKind) -> int:
        """Number of decoder layers of `kind`."""
        return sum(1 for k in self.layer_kinds if k == kind)

    @property
    def state_layers(self) -> int:
        """Layers that keep a Mamba/linear-attention state (Falcon-H1: all of them)."""
        return self.num_layers if self.parallel_state else self.count("linear")

    @property
    def hybrid(self) -> bool:
        """Mixes layer kinds (sliding + full, state + attention): vLLM's hybrid manager."""
        return len(set(self.layer_kinds)) > 1 or self.parallel_state

    @property
    def weights_bytes(self) -> int:
        return int(self.param_count * self.weight_bytes_per_param)


@dataclass(frozen=True, slots=True)
class KVFootprint:
    """KV cost on ONE tensor-parallel rank; multiply by `tp` for the whole instance."""

    full_bytes_per_token: int  # all layers that keep every token
    sliding_bytes_per_token: int  # sliding layers, paid for at most `sliding_window` tokens
    sliding_window: int | None  # None when no sliding layers are capped
    state_bytes_per_seq: int  # linear/Mamba layers: fixed per sequence
    tp: int  # ranks the instance has
    # vLLM's hybrid manager pads each layer kind to a whole number of equal-size KV cache
    # groups (hma_padding_layers): padding layers in HBM only, of a full / a sliding group
    full_padding_bytes_per_token: int = 0
    sliding_padding_bytes_per_token: int = 0

    @property
    def bytes_per_token(self) -> int:
        """Bytes per token while the context is shorter than the sliding window."""
        return self.full_bytes_per_token + self.sliding_bytes_per_token


def kv_dtype_bytes(kv_dtype: str) -> int:
    """Bytes per cached element for a `--kv-cache-dtype` value ("auto" means BF16).

    Raises:
        ConfigError: for an unknown dtype, and for a packed one (`nvfp4`, `turboquant_*`):
            its size is per (token, head) slot, kvtier.tools.ops.kvdtypes.layer_token_bytes.
    """
    return plain_dtype_bytes(kv_dtype)


def attention_token_bytes(spec: ModelSpec, kv_dtype: str, tp: int = 1) -> int:
    """Bytes one token takes in one attention layer of `spec` on one rank (kvdtypes.py)."""
    latent = spec.mla.kv_lora_rank + spec.mla.qk_rope_head_dim if spec.mla else None
    return layer_token_bytes(kv_dtype, spec.head_dim, max(1, spec.num_kv_heads // tp), latent)


def kv_footprint(
    spec: ModelSpec, kv_dtype: str = "bf16", tp: int = 1, hybrid_manager: bool = True
) -> KVFootprint:
    """Return the per-rank KV cost of `spec` at tensor-parallel size `tp`.

    GQA heads are split across ranks; when there are fewer KV heads than ranks vLLM keeps one
    replicated head per rank. MLA latents are replicated on every rank. With
    `hybrid_manager=False` (vLLM `--disable-hybrid-kv-cache-manager`) sliding layers are
    allocated for the whole context like full layers when the model also has full-attention
    layers; a model of sliding layers only keeps its window (vLLM promotes only mixed ones).

    Raises:
        ConfigError: when `tp` < 1 or the dtype is unknown.
    """
    if tp < 1:
        raise ConfigError("tp", tp, "an integer >= 1")
    per_layer = attention_token_bytes(spec, kv_dtype, tp)
    full, sliding = spec.count("full"), spec.count("sliding")
    # vLLM promotes sliding layers to full ones only beside full layers (kv_cache_utils.py,
    # _promote_local_kv_cache_specs): all-sliding Mistral keeps its window without HMA (#14).
    capped = (sliding > 0 and spec.sliding_window is not None
              and (hybrid_manager or full == 0))
    if not capped:
        full, sliding = full + sliding, 0
    full_pad, sliding_pad = hma_padding_layers(full, sliding) if capped else (0, 0)
    state = spec.state_layers * (spec.state.bytes_per_rank(tp) if spec.state else
                                    -(-spec.linear_state_bytes // tp))
    return KVFootprint(
        full_bytes_per_token=full * per_layer,
        sliding_bytes_per_token=sliding * per_layer,
        sliding_window=spec.sliding_window if capped else None,
        state_bytes_per_seq=state,
        tp=tp,
        full_padding_bytes_per_token=full_pad * per_layer,
        sliding_padding_bytes_per_token=sliding_pad * per_layer,
    )


# vLLM (0.32, 0.33) kv_cache_planning.py `_get_kv_cache_groups_uniform_page_size`: a layer
# kind is split into groups of `group_size` layers, the fewest layers of any kind, or the most
# when that is below 1.5 x the fewest; the last group of a kind is padded up to it.
_HMA_GROUP_SIZE_SPREAD = 1.5


def hma_padding_layers(full: int, sliding: int) -> tuple[int, int]:
    """(full, sliding) padding layers vLLM's hybrid manager adds to `full` full-attention and
    `sliding` sliding-window layers: a padding layer takes a real layer's memory in every
    block of its group. Gemma 3 27B's 10 full + 52 sliding layers: groups of 10, the sliding
    ones 6 groups = 60 layers, 8 of them padding (vLLM logs "Add 8 padding layers")."""
    if not full or not sliding:
        return 0, 0
    fewest, most = min(full, sliding), max(full, sliding)
    group = most if most < fewest * _HMA_GROUP_SIZE_SPREAD else fewest
    return -full % group, -sliding % group


# A state family's name in HF `layer_types` (what kvtier's model check reads, models.py):
# Mamba layers are "mamba" there, refused; LFM2's are "conv", Qwen3-Next's "linear_attention".
STATE_LAYER_TYPE = {"gdn": "linear_attention", "short_conv": "conv", "mamba2": "mamba",
                     "mamba1": "mamba"}
_ATTENTION_LAYER_TYPE = {"full": "full_attention", "sliding": "sliding_attention"}


def hf_layer_types(spec: ModelSpec) -> tuple[str, ...]:
    """The model's layers as HF `layer_types` names; state layers of no known family are
    "mamba" (which kvtier refuses); a parallel state mixer (Falcon-H1) adds its name once."""
    state = STATE_LAYER_TYPE[spec.state.family] if spec.state else "mamba"
    names = tuple(_ATTENTION_LAYER_TYPE.get(k, state) for k in spec.layer_kinds)
    return (*names, state) if spec.parallel_state else names


def session_kv_bytes(fp: KVFootprint, tokens: int) -> int:
    """Bytes one sequence of `tokens` tokens holds on ONE rank (KV plus linear state)."""
    window = tokens if fp.sliding_window is None else min(tokens, fp.sliding_window)
    full = fp.full_bytes_per_token + fp.full_padding_bytes_per_token
    sliding = fp.sliding_bytes_per_token + fp.sliding_padding_bytes_per_token
    return full * tokens + sliding * window + fp.state_bytes_per_seq


def stored_kv_bytes(fp: KVFootprint, tokens: int) -> int:
    """Bytes one sequence of `tokens` tokens takes in an offload tier on ONE rank: every
    token of every attention layer, a sliding layer's too (HBM frees what leaves its window;
    a tier stored each chunk as it was computed), plus one copy of the linear state."""
    return fp.bytes_per_token * tokens + fp.state_bytes_per_seq


def load_model_spec(path: str | Path, param_count: int | None = None) -> ModelSpec:
    """Read a Hugging Face `config.json` (or a folder holding one).

    Args:
        path: the file, or a model folder containing `config.json`.
        param_count: overrides the parameter count estimated from the shapes.
    Raises:
        ConfigError: when the file is missing, not JSON, or lacks required fields.
    """
    p = Path(path)
    try:
        if p.is_dir():
            p = p / "config.json"
        raw = json.loads(p.read_bytes().decode("utf-8"))
    except FileNotFoundError as exc:
        raise ConfigError("model", str(path), "a path to an existing config.json") from exc
    except UnicodeDecodeError as exc:
        raise ConfigError("model", str(path), f"UTF-8 JSON text (byte {exc.start} is not)") \
            from exc
    except json.JSONDecodeError as exc:
        raise ConfigError("model", str(path), f"valid JSON ({exc.msg})") from exc
    except RecursionError as exc:
        raise ConfigError("model", str(path), "JSON nested less deeply") from exc
    except (OSError, ValueError) as exc:  # too long a name; ValueError: a NUL byte
        reason = exc.strerror if isinstance(exc, OSError) else str(exc)
        raise ConfigError("model", str(path), f"a readable config.json ({reason})") from exc
    if not isinstance(raw, dict):
        raise ConfigError("model", str(path), "a JSON object")
    name = str(raw.get("_name_or_path") or p.parent.name or p.stem)
    return parse_model_config(raw, name=name, param_count=param_count)


def parse_model_config(
    raw: Mapping[str, Any], name: str = "model", param_count: int | None = None
) -> ModelSpec:
    """Build a ModelSpec from a parsed config.json (multimodal `text_config` is unwrapped).

    Raises:
        ConfigError: when hidden_size, num_hidden_layers or num_attention_heads is missing,
            or any field has a value of the wrong type (e.g. `text_config: 5`,
            `sliding_window: "x"`).
    """
    text_config = raw.get("text_config")
    if text_config is not None and not isinstance(text_config, Mapping):
        raise ConfigError("config.json:text_config", text_config, "a JSON object")
    _check_numbers(text_config or raw)
    try:
        return _parse_model_config(raw, text_config or raw, name, param_count)
    except ConfigError:
        raise
    except (TypeError, ValueError, OverflowError, ZeroDivisionError, AttributeError) as exc:
        # The config is untrusted input read by many int()/float() conversions below; a
        # value of the wrong type anywhere is the caller's mistake, not a crash (issue 14).
        raise ConfigError("config.json", name, f"numbers where numbers belong ({exc})") \
            from exc


# Numeric fields the sizing reads; a value of another type is named in the error (the
# generic fallback above can only say which conversion failed).
_NUMERIC_FIELDS = ("sliding_window", "sliding_window_pattern", "head_dim", "num_key_value_heads",
                   "max_position_embeddings", "intermediate_size", "vocab_size",
                   "full_attention_interval", "attn_layer_period", "attn_layer_offset",
                   "attention_chunk_size", "no_rope_layer_interval",
                   "kv_lora_rank", "q_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim",
                   "v_head_dim", "num_experts", "n_routed_experts", "num_experts_per_tok",
                   "moe_intermediate_size")


def _check_numbers(cfg: Mapping[str, Any]) -> None:
    for key in _NUMERIC_FIELDS:
        value = cfg.get(key)
        if value is not None and (isinstance(value, bool)
                                  or not isinstance(value, int | float)):
            raise ConfigError(f"config.json:{key}", value, "a number (or null)")


def _parse_model_config(raw: Mapping[str, Any], cfg: Mapping[str, Any], name: str,
                        param_count: int | None) -> ModelSpec:
    outer_quant = raw.get("quantization_config")
    hidden = _req_int(cfg, "hidden_size")
    heads = _req_int(cfg, "num_attention_heads")
    kinds = _layer_kinds(cfg, _req_int(cfg, "num_hidden_layers"))
    mla = _mla(cfg)
    head_dim = int(cfg.get("head_dim") or hidden // heads)
    chunked = "sliding" in kinds and bool(cfg.get("attention_chunk_size"))
    spec_window = (cfg.get("attention_chunk_size") if chunked else cfg.get("sliding_window")) \
        if "sliding" in kinds else None
    counted = count_params(cfg, kinds, mla, head_dim)
    return ModelSpec(
        name=name,
        model_type=str(raw.get("model_type") or cfg.get("model_type") or "unknown"),
        hidden_size=hidden,
        num_attention_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=head_dim,
        layer_kinds=kinds,
        sliding_window=int(spec_window) if spec_window else None,
        mla=mla,
        linear_state_bytes=linear_state_bytes(cfg, hidden),
        param_count=param_count or counted.total,
        active_param_count=min(counted.active, param_count) if param_count else counted.active,
        embedding_param_count=counted.embedding,
        weight_bytes_per_param=_weight_bytes(cfg, outer_quant or cfg.get("quantization_config"),
                                             counted),
        max_position_embeddings=int(cfg.get("max_position_embeddings") or 0),
        architecture=_architecture(raw),
        encoder_decoder=bool(raw.get("is_encoder_decoder") or cfg.get("is_encoder_decoder")),
        params_estimated=not param_count,
        chunked_attention=chunked,
        state=state_shape(cfg, hidden),
        # Falcon-H1 declares no layer pattern: attention and Mamba2 run side by side in each
        parallel_state=bool(cfg.get("mamba_d_ssm") or _model_type_of(raw, cfg) == "falcon_h1"),
    )


def _model_type_of(raw: Mapping[str, Any], cfg: Mapping[str, Any]) -> str:
    return str(raw.get("model_type") or cfg.get("model_type") or "").lower()


def _architecture(raw: Mapping[str, Any]) -> str:
    names = raw.get("architectures")
    return str(names[0]) if isinstance(names, list) and names else ""


# Larger than any real model's layer count, width or head count: a typo, and a layer list of
# 10**9 entries would take minutes to build.
_MAX_DIMENSION = 1 << 20


def _req_int(cfg: Mapping[str, Any], key: str) -> int:
    value = cfg.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ConfigError(f"config.json:{key}", value, "a positive integer")
    if value > _MAX_DIMENSION:
        raise ConfigError(f"config.json:{key}", value, f"at most {_MAX_DIMENSION}")
    return value


def _layer_kinds(cfg: Mapping[str, Any], n: int) -> tuple[LayerKind, ...]:
    """Per-layer kinds from whichever convention the config uses."""
    listed = cfg.get("layer_types") or cfg.get("layers_block_type")
    if isinstance(listed, list) and len(listed) == n:
        try:
            return tuple(_LAYER_TYPE_NAMES[str(t).lower()] for t in listed)
        except KeyError as exc:
            raise ConfigError("config.json:layer_types", exc.args[0],
                              f"one of {', '.join(sorted(_LAYER_TYPE_NAMES))}") from exc
    pattern = cfg.get("hybrid_override_pattern")  # Nemotron-H: M=Mamba, *=attention, -=MLP
    if isinstance(pattern, str):
        return tuple("full" if c == "*" else "linear" for c in pattern if c in "M*")
    if cfg.get("full_attention_interval"):  # Qwen3-Next: every k-th layer is attention
        k = int(cfg["full_attention_interval"])
        return _pattern(n, lambda i: (i + 1) % k == 0, "full", "linear")
    if cfg.get("attn_layer_period"):  # Jamba
        period, offset = int(cfg["attn_layer_period"]), int(cfg.get("attn_layer_offset", 0))
        return _pattern(n, lambda i: i % period == offset, "full", "linear")
    if cfg.get("attention_chunk_size"):  # Llama 4: chunked local attention, NoPE layers full
        no_rope = cfg.get("no_rope_layers") or []
        if not (isinstance(no_rope, list) and len(no_rope) == n):  # transformers' default
            every = int(cfg.get("no_rope_layer_interval") or 4)
            no_rope = [int((i + 1) % every != 0) for i in range(n)]
        return _pattern(n, lambda i: no_rope[i] == 0, "full", "sliding")
    if not cfg.get("sliding_window") or cfg.get("use_sliding_window") is False:
        return _pattern(n, lambda _: True, "full", "full")
    # Gemma 2 alternates local/global; Gemma 3 has `sliding_window_pattern` local:global.
    every = int(cfg.get("sliding_window_pattern") or (2 if cfg.get("model_type") == "gemma2"
                                                       else 0))
    if every:
        return _pattern(n, lambda i: (i + 1) % every == 0, "full", "sliding")
    return _pattern(n, lambda _: True, "sliding", "sliding")  # Mistral: window everywhere


def _pattern(
    n: int, is_hit: Callable[[int], bool], hit: LayerKind, miss: LayerKind
) -> tuple[LayerKind, ...]:
    return tuple(hit if is_hit(i) else miss for i in range(n))


def _mla(cfg: Mapping[str, Any]) -> MlaSpec | None:
    if not cfg.get("kv_lora_rank"):
        return None
    return MlaSpec(
        kv_lora_rank=int(cfg["kv_lora_rank"]),
        qk_rope_head_dim=int(cfg.get("qk_rope_head_dim") or 64),
        qk_nope_head_dim=int(cfg.get("qk_nope_head_dim") or 128),
        v_head_dim=int(cfg.get("v_head_dim") or 128),
        q_lora_rank=int(cfg["q_lora_rank"]) if cfg.get("q_lora_rank") else None,
    )


def _weight_bytes(cfg: Mapping[str, Any], quant: Any, counted: ParamCount) -> float:
    """Bytes a weight takes on average, from the checkpoint's `quantization_config` (else its
    dtype).

    A quantization covers vLLM's linear layers only: the input embedding and the LM head
    (VocabParallelEmbedding / ParallelLMHead, not LinearBase) stay in the checkpoint's dtype,
    unless the config quantizes the head (GPTQ's `lm_head`). MXFP4 covers the routed experts
    only (quantization/mxfp4.py). Read as all-quantized, Llama-3.1-8B FP8 was 8.0 GB (its
    checkpoint: 9.1 GB), its AWQ INT4 4.0 GB (5.7 GB), gpt-oss-120b 57.8 GiB (60.8 GiB).
    """
    dtype = _dtype_bytes(cfg)
    quantized = _quantized_bytes(quant) if isinstance(quant, Mapping) else None
    if quantized is None or not counted.total:
        return dtype if quantized is None else quantized
    assert isinstance(quant, Mapping)
    if str(quant.get("quant_method", "")).lower() == "mxfp4":
        covered = counted.routed_experts or counted.total
    else:
        input_embedding = int(cfg.get("vocab_size") or 0) * int(cfg["hidden_size"])
        head_quantized = quant.get("lm_head") is True and counted.embedding > input_embedding
        covered = counted.total - (input_embedding if head_quantized else counted.embedding)
    return (covered * quantized + (counted.total - covered) * dtype) / counted.total


def _quantized_bytes(quant: Mapping[str, Any]) -> float | None:
    """Bytes of a quantized weight in `quant`'s format; None when it quantizes no weights.

    The 4-bit formats other than GPTQ/AWQ's `bits` were read as the dtype's 2 bytes: GPT-OSS's
    MXFP4 (120B: "217.5 GiB a GPU", refused on the one H100 it is made for), bitsandbytes,
    compressed-tensors' W4A16 and ModelOpt's NVFP4.
    """
    method = str(quant.get("quant_method", "")).lower()
    bits = quant.get("bits") or quant.get("w_bit") or _compressed_tensors_bits(quant)
    if isinstance(bits, int | float) and not isinstance(bits, bool) and bits > 0:
        return float(bits) / 8
    if method == "mxfp4":  # 4-bit values and a shared 8-bit scale per 32: 4.25 bits
        return 4.25 / 8
    if method == "bitsandbytes":
        return 0.5 if quant.get("load_in_4bit") or quant.get("_load_in_4bit") else 1.0
    if method == "modelopt" and "fp4" in str(quant.get("quant_algo", "")).lower():
        return 0.5
    if "fp8" in method or method in ("fbgemm_fp8", "modelopt"):
        return 1.0
    return None


def _dtype_bytes(cfg: Mapping[str, Any]) -> float:
    """Bytes a weight of the checkpoint's `torch_dtype` takes (2 when unsaid)."""
    dtype = str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16")
    return _TORCH_DTYPE_BYTES.get(dtype, 2.0)


def _compressed_tensors_bits(quant: Mapping[str, Any]) -> Any:
    """The weights' `num_bits` of a compressed-tensors config (its first group), or None."""
    groups = quant.get("config_groups")
    if not isinstance(groups, Mapping):
        return None
    for group in groups.values():
        weights = group.get("weights") if isinstance(group, Mapping) else None
        if isinstance(weights, Mapping):
            return weights.get("num_bits")
    return None
