"""A model fingerprint: what about the model decides its KV, cheap enough for a 100+ GB model.

Part of every key's namespace, so that an updated checkpoint at the same path (or another
`--revision`, dtype, quantization, RoPE setting) never hits KV computed with the old one, and
the same checkpoint at another path, on another node, does.

It covers:
- the revision and code revision, quantization method and model dtype, as given;
- engine settings outside the config and the checkpoint files that change the KV (`settings`,
  gathered by the connector: integrations/vllm/connector.py `kv_settings`), e.g. which LongRoPE
  factors the engine's `--max-model-len` selects, or weights not read from the files at all
  (`--load-format dummy`); none for most engines, which then keep the digest they had;
- the HF config keys in `KV_CONFIG_KEYS` (and the same keys in the sub-config of a multimodal
  model's language model, `LANGUAGE_CONFIGS`): what shapes the hidden states, hence the K/V of
  every layer after the first;
- the checkpoint's own config files (`config.json`, Mistral's `params.json`), whole
  (`config_files_digest`): a key `KV_CONFIG_KEYS` does not name (a `trust_remote_code` model's
  own, a family's name the list lacks: GPT-J's `rotary_dim` was one) edited in place still
  changes the namespace. When in doubt, miss: an edit that changes no KV costs one cold start;
- the checkpoint's content, sampled (`weights_digest`): per `*.safetensors` file (sorted by
  file name) its name, size, a blake3 of its JSON header (names, dtypes, shapes, offsets) and
  the first 4 KiB of up to 256 of its tensors, spread evenly; where there is no safetensors
  file, per `*.bin`/`*.pt`/`*.pth` file its name, size and its first and last MiB (or the
  files the engine loads where it names another kind: `weight_globs`, `--load-format pt`'s
  `*.pt`). A re-trained or re-quantized checkpoint changes these; an edit confined to bytes
  that are not sampled (one element deep inside a tensor) does not: the samples bound start-up
  reads (a few MB per file) rather than prove equality.
Never paths or mtimes: nodes mount models at different paths and copy them at different times.

No vllm or torch here: the connector gathers the inputs (integrations/vllm/connector.py).
Both of its sides need the fingerprint (the scheduler for keys and probes, each worker for
the storage namespace of the tiers it opens, in another process): `cached_model_fingerprint`
computes it once per process, again only when a checkpoint file's size or mtime changed (an
update in place; the mtimes decide when to look again, never what the fingerprint is).

A LoRA adapter is keyed the same way, by what it holds rather than by its name or path
(`adapter_fingerprint`): every file of its directory, whole (adapters are MBs, not GBs), so that
two adapters served under one name never share KV and one adapter at two paths does.

Primitives: `KV_CONFIG_KEYS`, `ModelFingerprint`, `model_fingerprint`,
`cached_model_fingerprint`, `weights_digest`, `config_files_digest`, `adapter_fingerprint`.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import blake3

# HF config keys that change the KV (names across model families; absent keys are skipped).
KV_CONFIG_KEYS = (
    "model_type", "architectures",
    "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
    "hidden_size", "intermediate_size", "hidden_act", "vocab_size",
    "rms_norm_eps", "layer_norm_eps", "layer_norm_epsilon",
    "rope_theta", "rope_scaling", "rope_parameters", "partial_rotary_factor",
    "max_position_embeddings", "original_max_position_embeddings",
    "sliding_window", "layer_types", "attention_bias", "attention_multiplier",
    "query_pre_attn_scalar", "attn_logit_softcapping", "embedding_multiplier",
    "residual_multiplier", "tie_word_embeddings", "qk_layernorm", "use_qk_norm",
    "kv_lora_rank", "q_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim",
    "num_experts", "num_local_experts", "num_experts_per_tok", "moe_intermediate_size",
    "quantization_config",
    # Other families' names for what shapes the hidden states with the same weights (vLLM's
    # model code reads them; a config edited in one of them at the same path changed the KV
    # under the same fingerprint: tests/engine/test_engine_settings_e2e.py). Absent keys are
    # skipped, so a model without them keeps its digest. Never a key vLLM's model code writes
    # into the config as it builds the model (Llama 4's attn_temperature_tuning): the workers
    # would fingerprint another config than the scheduler.
    "activation_function", "hidden_activation", "hidden_act_param", "norm_eps",
    "scale_attn_weights", "scale_attn_by_inverse_layer_idx", "use_parallel_residual",
    "parallel_attn", "new_decoder_architecture", "alibi",
    "apply_residual_connection_post_layernorm", "do_layer_norm_before",
    "scale_emb", "scale_depth", "dim_model_base", "layer_rope_theta", "llama_4_scaling",
    "attention_chunk_size", "no_rope_layers", "floor_scale", "attn_scale",
    "dual_chunk_attention_config",
    "routed_scaling_factor", "norm_topk_prob", "scoring_func", "topk_method", "n_group",
    "topk_group",
    # RoPE, window, norm and scaling keys that transformers keeps as they are (it folds GPT-NeoX's
    # rotary_pct into rope_parameters, not GPT-J's rotary_dim): an edit of GPT-J's rotary_dim at
    # the same path was served the old chunks (tests/engine/test_engine_settings_e2e.py).
    "rotary_dim", "rope_local_base_freq", "rope_local_theta", "swa_rope_theta",
    "swa_rope_parameters", "rope_ratio", "partial_rotary_factors", "use_rope_layers",
    "rope_scaling_layers", "interleaved_sliding_window", "sliding_window_size", "sliding_windows",
    "layernorm_epsilon", "post_norm_eps", "mixer_rms_eps", "attention_in_multiplier",
    "attention_out_multiplier", "key_multiplier", "ssm_in_multiplier", "ssm_out_multiplier",
    "ssm_multipliers", "mlp_multipliers", "attention_value_scale", "mup_scale_factor",
    "embedding_scale", "moe_routed_scaling_factor", "moe_router_scaling_factor", "route_scale",
    "position_embedding_type",  # Granite-4 hybrid: "rope" or "nope"
    "sliding_window_pattern", "compress_rope_theta", "hc_eps",
)
# Sub-configs that hold a multimodal model's language model, whose KV_CONFIG_KEYS count as the
# top level's (and a `text_config` inside them: Qwen2.5-Omni's thinker_config.text_config);
# an edit inside InternVL's llm_config was not seen.
LANGUAGE_CONFIGS = ("text_config", "llm_config", "language_config", "thinker_config")
# Keys of those sub-configs (other than text_config) left out: vLLM's model code sets them in
# the workers' copy of the config only (see model_fingerprint).
_SUB_CONFIG_SKIPPED = ("architectures",)
# A checkpoint's config files, read whole (HF's; Mistral's format), less what says where and
# by which transformers version they were saved (copies elsewhere, re-saved: the same KV).
CONFIG_FILES = ("config.json", "params.json")
_CONFIG_FILE_SKIPPED = ("_name_or_path", "_commit_hash", "transformers_version")
SAMPLE_BYTES = 4096  # bytes read at the start of each sampled safetensors tensor
SAMPLED_TENSORS_PER_FILE = 256
OPAQUE_SAMPLE_BYTES = 1 << 20  # bytes read at each end of a .bin/.pt file
_MAX_HEADER_BYTES = 100 << 20  # a larger safetensors header is treated as an opaque file
_MEMO_ENTRIES = 8  # fingerprints kept per process (models served by one process: one)
_memo: dict[str, ModelFingerprint] = {}
_memo_lock = threading.Lock()
_ADAPTER_MEMO_ENTRIES = 256  # adapter fingerprints kept per process
_adapter_memo: dict[tuple[str, tuple[tuple[str, int, int], ...]], str] = {}


@dataclass(frozen=True, slots=True)
class ModelFingerprint:
    """A model's fingerprint and what went into it."""

    digest: str  # 32 hex chars
    weight_files: int  # checkpoint files sampled; 0: weights not fingerprinted


def model_fingerprint(model_dir: str | os.PathLike[str] | None, config: Mapping[str, Any], *,
                      revision: str | None = None, code_revision: str | None = None,
                      quantization: str | None = None, dtype: str | None = None,
                      settings: Mapping[str, Any] | None = None,
                      weight_globs: Sequence[str] | None = None) -> ModelFingerprint:
    """The fingerprint of a model (reads a few MB per checkpoint file; run once at start-up).

    Args:
        model_dir: the checkpoint's directory (or single file); None when not on disk.
        config: the model's HF config as a dict.
        revision, code_revision, quantization, dtype: as the engine was given them.
        settings: engine settings beyond these that change the KV (JSON values); empty or
            None: none (the digest is then the one a fingerprint without settings had).
        weight_globs: the checkpoint files the engine loads (`weights_digest`), where not
            the default.

    Raises:
        OSError: a checkpoint file could not be read.
    """
    weights = weights_digest(model_dir, weight_globs) if model_dir is not None else None
    config_files = config_files_digest(model_dir) if model_dir is not None else None
    picked = {"model": _kv_config(config)}
    for name in LANGUAGE_CONFIGS:
        nested = config.get(name)
        if isinstance(nested, Mapping):
            if name == "text_config":  # as before LANGUAGE_CONFIGS: the digests it had
                picked["text"] = _kv_config(nested)
                continue
            # Not their `architectures`: vLLM's model code writes it as a worker builds the
            # model (Qwen3-Omni's thinker: thinker_config.architectures = the model's), and a
            # tensor-parallel engine's scheduler, which never builds it, would disagree.
            picked[name] = _kv_config(nested, skip=_SUB_CONFIG_SKIPPED)
            inner = nested.get("text_config")
            if isinstance(inner, Mapping):
                picked[f"{name}.text_config"] = _kv_config(inner, skip=_SUB_CONFIG_SKIPPED)
    document = {
        "revision": revision, "code_revision": code_revision, "quantization": quantization,
        "dtype": dtype, "config": picked, "weights": weights[0] if weights else None,
    }
    if settings:  # absent otherwise: the digests of fingerprints made before settings existed
        document["settings"] = dict(settings)
    if config_files is not None:  # absent: a single-file checkpoint, a model not on disk
        document["config_files"] = config_files
    encoded = json.dumps(document, sort_keys=True, default=str).encode()
    return ModelFingerprint(digest=blake3.blake3(b"kvtier-model-v1" + encoded).hexdigest(16),
                            weight_files=weights[1] if weights else 0)


def cached_model_fingerprint(
        model_dir: str | os.PathLike[str] | None, config: Mapping[str, Any], *,
        revision: str | None = None, code_revision: str | None = None,
        quantization: str | None = None, dtype: str | None = None,
        settings: Mapping[str, Any] | None = None, weight_globs: Sequence[str] | None = None,
        on_computed: Callable[[ModelFingerprint], None] | None = None) -> ModelFingerprint:
    """`model_fingerprint`, computed once per process for the same arguments and checkpoint
    files (names, sizes, mtimes); `on_computed` is called when it was computed now (to log it
    once). Any thread.

    Raises:
        OSError: a checkpoint file could not be read.
    """
    files = _checkpoint_files(Path(model_dir), weight_globs) if model_dir is not None else []
    if model_dir is not None and Path(model_dir).is_dir():  # edited in place: read again
        files += [path for name in CONFIG_FILES if (path := Path(model_dir) / name).is_file()]
    stats = []
    for path in files:
        info = path.stat()
        stats.append((path.name, info.st_size, info.st_mtime_ns))
    memo_key = json.dumps([str(model_dir), stats, revision, code_revision, quantization, dtype,
                           dict(config), dict(settings or {}), list(weight_globs or [])],
                          sort_keys=True, default=str)
    with _memo_lock:
        found = _memo.get(memo_key)
    if found is not None:
        return found
    fingerprint = model_fingerprint(model_dir, config, revision=revision,
                                    code_revision=code_revision, quantization=quantization,
                                    dtype=dtype, settings=settings, weight_globs=weight_globs)
    with _memo_lock:
        if len(_memo) >= _MEMO_ENTRIES:
            _memo.clear()
        _memo[memo_key] = fingerprint
    if on_computed is not None:
        on_computed(fingerprint)
    return fingerprint


def weights_digest(model_dir: str | os.PathLike[str],
                   weight_globs: Sequence[str] | None = None) -> tuple[str, int] | None:
    """(hex digest, number of files) of a checkpoint's sampled content, or None when the
    directory holds no checkpoint file kvtier knows. `weight_globs`: the files to sample
    (those an engine told to load another kind loads); None: its safetensors files, else its
    pickled ones.

    Raises:
        OSError: a checkpoint file could not be read.
    """
    files = _checkpoint_files(Path(model_dir), weight_globs)
    if not files:
        return None
    hasher = blake3.blake3(b"kvtier-weights-v1")
    for path in files:
        name = path.name.encode()
        hasher.update(len(name).to_bytes(4, "little") + name)
        hasher.update(_file_digest(path))
    return hasher.hexdigest(16), len(files)


def config_files_digest(model_dir: str | os.PathLike[str]) -> str | None:
    """A hex digest of the checkpoint's config files (`CONFIG_FILES`), each parsed and written
    again with its keys sorted, less `_CONFIG_FILE_SKIPPED` (a file that is not a JSON object:
    its bytes); None when `model_dir` is not a directory or holds none of them.

    Raises:
        OSError: a config file could not be read.
    """
    root = Path(model_dir)
    if not root.is_dir():
        return None
    hasher = blake3.blake3(b"kvtier-config-files-v1")
    found = False
    for name in CONFIG_FILES:
        try:
            raw = (root / name).read_bytes()
        except FileNotFoundError:
            continue
        try:
            parsed = json.loads(raw)
        except ValueError:
            parsed = None
        data = (json.dumps({k: v for k, v in parsed.items() if k not in _CONFIG_FILE_SKIPPED},
                           sort_keys=True).encode() if isinstance(parsed, dict) else raw)
        hasher.update(name.encode() + b"\0" + blake3.blake3(data).digest())
        found = True
    return hasher.hexdigest(16) if found else None


def adapter_fingerprint(directory: str | os.PathLike[str]) -> str | None:
    """The fingerprint (32 hex chars) of a LoRA adapter's directory: the relative path, size
    and whole content of every regular file below it, in path order; None when `directory`
    is not a local directory. Computed once per process for the same files (paths, sizes,
    mtimes: an adapter rewritten in place is read again; the mtimes decide when to look
    again, never what the fingerprint is). Any thread.

    Raises:
        OSError: a file could not be listed or read.
    """
    root = Path(directory)
    if not root.is_dir():
        return None
    files = sorted((path.relative_to(root).as_posix(), path) for path in root.rglob("*")
                   if path.is_file())
    stats = []
    for name, path in files:
        info = path.stat()
        stats.append((name, info.st_size, info.st_mtime_ns))
    memo_key = (str(root.resolve()), tuple(stats))
    with _memo_lock:
        found = _adapter_memo.get(memo_key)
    if found is not None:
        return found
    hasher = blake3.blake3(b"kvtier-adapter-v1")
    for name, path in files:
        encoded = name.encode()
        hasher.update(len(encoded).to_bytes(4, "little") + encoded)
        content = blake3.blake3()
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                content.update(block)
        hasher.update(content.digest())
    digest = hasher.hexdigest(16)
    with _memo_lock:
        if len(_adapter_memo) >= _ADAPTER_MEMO_ENTRIES:
            _adapter_memo.clear()
        _adapter_memo[memo_key] = digest
    return digest


def _checkpoint_files(root: Path, weight_globs: Sequence[str] | None = None) -> list[Path]:
    """The checkpoint files `weights_digest` samples, sorted by name (none: [])."""
    if root.is_file():
        return [root]
    if not root.is_dir():
        return []
    if weight_globs:
        return sorted({p for pattern in weight_globs for p in root.glob(pattern)},
                      key=lambda p: p.name)
    files = sorted(root.glob("*.safetensors"), key=lambda p: p.name)
    if not files:
        files = sorted((p for ext in ("*.bin", "*.pt", "*.pth") for p in root.glob(ext)),
                       key=lambda p: p.name)
    return files


def _kv_config(config: Mapping[str, Any], skip: tuple[str, ...] = ()) -> dict[str, Any]:
    return {key: config[key] for key in KV_CONFIG_KEYS if key in config and key not in skip}


def _file_digest(path: Path) -> bytes:
    """Size and samples of one checkpoint file (a safetensors file's header and tensors)."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        hasher = blake3.blake3(size.to_bytes(8, "little"))
        tensors = _safetensors_tensors(f, size) if path.suffix == ".safetensors" else None
        if tensors is not None:
            header, data_start, spans = tensors
            hasher.update(b"header" + blake3.blake3(header).digest())
            step = max(1, len(spans) / SAMPLED_TENSORS_PER_FILE)
            for i in range(min(len(spans), SAMPLED_TENSORS_PER_FILE)):
                begin, end = spans[int(i * step)]
                hasher.update(os.pread(f.fileno(), min(SAMPLE_BYTES, end - begin),
                                       data_start + begin))
        else:
            hasher.update(b"opaque" + os.pread(f.fileno(), OPAQUE_SAMPLE_BYTES, 0))
            tail = max(0, size - OPAQUE_SAMPLE_BYTES)
            hasher.update(os.pread(f.fileno(), OPAQUE_SAMPLE_BYTES, tail))
    return hasher.digest()


def _safetensors_tensors(f: Any, size: int) -> tuple[bytes, int, list[tuple[int, int]]] | None:
    """(header bytes, data start, tensor [begin, end) spans by offset), or None where the file
    is not a well-formed safetensors file (it is then sampled as an opaque file)."""
    prefix = os.pread(f.fileno(), 8, 0)
    if len(prefix) < 8:
        return None
    length = int.from_bytes(prefix, "little")
    if length > min(_MAX_HEADER_BYTES, size - 8):
        return None
    header = os.pread(f.fileno(), length, 8)
    try:
        entries = json.loads(header)
        spans = sorted(
            (int(e["data_offsets"][0]), int(e["data_offsets"][1]))
            for name, e in entries.items() if name != "__metadata__")
    except (ValueError, TypeError, KeyError, IndexError, AttributeError):
        return None
    if any(not 0 <= b <= e <= size - 8 - length for b, e in spans):
        return None
    return header, 8 + length, spans
