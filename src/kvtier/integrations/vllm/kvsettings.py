"""Engine settings outside a model's HF config and checkpoint files that change its KV, for
the model's fingerprint (core/fingerprint.py `settings`, `weight_globs`): two engines of one
checkpoint and one config that compute other KV must never share a namespace
(tests/engine/test_engine_settings_e2e.py). Empty for most engines, whose digest is then the
one a fingerprint without settings had.

Primitives: `kv_settings`, `loaded_weights`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vllm.config import VllmConfig

# The checkpoint files vLLM's loader reads for a --load-format that does not read the
# safetensors files the fingerprint samples by default (default_loader.py): a directory that
# holds both kinds is fingerprinted by the ones the engine loads.
_LOADED_WEIGHTS = {"pt": ("*.pt",), "npcache": ("*.bin",)}
# RoPE types whose factors vLLM picks by the engine's max_model_len (Phi-3's LongRoPE: the long
# factors whenever max_model_len > original_max_position_embeddings, for every position).
_LONGROPE_TYPES = ("longrope", "su")


def kv_settings(vllm_config: VllmConfig) -> dict[str, str]:
    """Engine settings outside the HF config and the checkpoint's files that change the KV, for
    the fingerprint (core/fingerprint.py `settings`); empty for most engines.

    - "longrope": "long" or "short", the factors of a LongRoPE model: vLLM rotates every
      position by the long ones when --max-model-len exceeds the model's
      original_max_position_embeddings (phi3_long_rope_scaled_rope.py), so engines of one
      checkpoint with a max_model_len on either side of it compute other KV for every token;
    - "load_format": "dummy" for weights vLLM makes up rather than reads (benchmarks): the
      checkpoint's files on disk, which the fingerprint samples, are not what it computes with;
    - "attn_temperature_tuning": "on" or "off", Llama 4's scaling of its NoPE layers' queries
      by position (from position floor_scale on, 8192 by default): vLLM turns it on when
      --max-model-len exceeds 32768 unless the generation config (or
      --override-generation-config) says otherwise (models/llama4.py), and writes its choice
      into the config only as a worker builds the model, so the config cannot carry it.
    """
    model = vllm_config.model_config
    settings: dict[str, str] = {}
    originals = _longrope_originals(model.hf_text_config)
    if originals:
        long = any(model.max_model_len > original for original in originals)
        settings["longrope"] = "long" if long else "short"
    if _load_format(vllm_config) == "dummy":
        settings["load_format"] = "dummy"
    architectures = getattr(model.hf_config, "architectures", None) or []
    if any(str(name).startswith("Llama4") for name in architectures):
        generation = dict(model.try_get_generation_config() or {})
        generation.update(model.override_generation_config or {})
        tuning = generation.get("attn_temperature_tuning", _built_max_len(model) > 32768)
        settings["attn_temperature_tuning"] = "on" if tuning else "off"
    return settings


def _built_max_len(model: Any) -> int:
    """The max_model_len the workers built the model with: under --max-model-len -1 (fit to
    memory) vLLM lowers max_model_len after its profile, once the model is built with the
    length the config allows (what Llama 4 decided its tuning by)."""
    if getattr(model, "original_max_model_len", None) == -1:
        try:
            return int(model.get_and_verify_max_len(-1))
        except (ValueError, TypeError):  # vLLM refuses it: the length it runs with
            pass
    return int(model.max_model_len)


def _load_format(vllm_config: VllmConfig) -> str:
    """vLLM's --load-format ("auto", "dummy", "pt", ...)."""
    load_format = getattr(vllm_config.load_config, "load_format", None)
    return str(getattr(load_format, "value", load_format))


def _longrope_originals(text_config: Any) -> list[int]:
    """original_max_position_embeddings of each LongRoPE parameter set of a model's text config
    (its rope_parameters, or per layer type, or a legacy rope_scaling), as vLLM's get_rope
    reads it (the config's own value where the set lacks it)."""
    found: list[int] = []
    for name in ("rope_parameters", "rope_scaling"):
        params = getattr(text_config, name, None)
        if not isinstance(params, dict):
            continue
        sets = [p for p in params.values() if isinstance(p, dict)] or [params]
        for rope in sets:
            if rope.get("rope_type", rope.get("type")) in _LONGROPE_TYPES:
                original = rope.get("original_max_position_embeddings",
                                    getattr(text_config, "original_max_position_embeddings", 0))
                found.append(int(original or 0))
    return found


def loaded_weights(vllm_config: VllmConfig) -> tuple[str, ...] | None:
    """The checkpoint files the engine's --load-format reads where they are not the ones the
    fingerprint samples by default (None: those)."""
    return _LOADED_WEIGHTS.get(_load_format(vllm_config))
