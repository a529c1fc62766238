"""Small random-weight Llama models that vLLM can load with no downloads.

kvtier's end-to-end tests and benchmarks need a real model inside a real vLLM, and the
machines that run them cannot download one. This module writes one: a transformers
`LlamaForCausalLM` with random weights drawn from a fixed seed, saved as safetensors, and next to it
what a client needs to talk to it in text: a byte-level BPE tokenizer (any text, any
language, round-trips; built offline by `write_tokenizer`, no download), a chat template
(ChatML-style, on <s>/</s>) and generation defaults (greedy, at most 128 new tokens).

Random weights at the usual initializer range give near-uniform logits, so greedy decoding
breaks near-ties differently when two code paths round differently (see
../shared/VLLM_CPU.md). Two knobs make the logits decisive, so that "identical outputs with
and without the cache" is a meaningful check:
  - `lm_head_scale` multiplies the output head, which spreads the logits far apart;
  - `initializer_range` (larger than Llama's 0.02) sharpens attention, so that the output
    depends on the whole context and a wrongly loaded KV block changes the tokens.

Primitives:
  - `TinyModelSpec`: the frozen parameters of a model; `.digest()` names its directory.
  - `PRESETS`: "test" (fast start-up), "bench" (an 8k-token prefill takes >= 2 s on a
    2-core CPU, for `kvtier bench ttft`), "mla" (a DeepSeek-V2-style MLA model) and
    "qwen3-next" (a Qwen3-Next-style gated DeltaNet hybrid, `kvtier bench ttft --model`).
  - `make_tiny_model(root, ...)`: write (or reuse) the model directory and return its path.
  - `make_preset_model(name, root)`: the same for a preset.
  - `served_name(model_dir)`: the short name `kvtier serve` gives a generated model
    ("kvtier-tiny", "kvtier-bench", ...), or None for any other directory.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import LlamaConfig

# Bump when the files written change, so that cached directories from an older layout are
# not reused.
# 2: the byte-level tokenizer, chat template and greedy generation_config.json.
_FORMAT_VERSION = 2
# Written last; a directory without it is an interrupted write and is rebuilt.
_COMPLETE_MARKER = "kvtier-tiny-model.json"
# Token ids 0..2 are special; prompts should use ids >= FIRST_WORD_ID.
UNK_ID, BOS_ID, EOS_ID = 0, 1, 2
FIRST_WORD_ID = 3
# The tokenizer's 256 byte tokens take ids 3..258; merges of common pairs fill the rest.
MIN_VOCAB_SIZE = FIRST_WORD_ID + 256
# A chat template on the model's own specials: each message "<s>role\ncontent</s>\n", then
# "<s>assistant\n" for the reply (ChatML's layout, with <s>/</s> for its markers).
CHAT_TEMPLATE = ("{% for message in messages %}<s>{{ message['role'] }}\n"
                 "{{ message['content'] }}</s>\n{% endfor %}"
                 "{% if add_generation_prompt %}<s>assistant\n{% endif %}")
# generation_config.json's sampling defaults, which vLLM applies to a request that leaves
# them out (--generation-config auto): greedy, so that a client sending no temperature gets
# the same reply twice, and a short reply (random weights seldom say </s>).
GENERATION_DEFAULTS = {"do_sample": False, "temperature": 0.0, "max_new_tokens": 128}


@dataclass(frozen=True, slots=True)
class TinyModelSpec:
    """Parameters of a tiny random Llama; every field is part of the cache digest."""

    # Decoder layers; kvtier stores KV for each, so more layers = more bytes per token.
    num_layers: int = 2
    # Model width; must be divisible by num_heads.
    hidden_size: int = 128
    # Query heads.
    num_heads: int = 4
    # KV heads (GQA when < num_heads); with head_size this sets the KV bytes per token.
    num_kv_heads: int = 2
    # MLP width.
    intermediate_size: int = 256
    # Vocabulary size, special tokens included.
    vocab_size: int = 512
    # Longest sequence vLLM will accept (max_model_len defaults to it).
    max_position_embeddings: int = 4096
    # Seed of the random weights.
    seed: int = 0
    # Weight dtype written to config.json, a torch name ("bfloat16", "float32", "float16").
    dtype: str = "bfloat16"
    # Std of the random init; larger than Llama's 0.02 so that attention is peaked.
    initializer_range: float = 0.1
    # Multiplier on the output head after init; makes the greedy choice decisive.
    lm_head_scale: float = 8.0
    # "llama"; "deepseek_v2": DeepSeek-V2-style MLA attention (latent KV), dense MLPs;
    # "qwen3_next": gated DeltaNet linear-attention layers alternating with full-attention
    # ones (the first of each pair linear), a small MoE.
    architecture: str = "llama"
    # MLA only: the latent width (kv_lora_rank) and the rotary part of each head
    # (qk_rope_head_dim); vLLM caches kv_lora_rank + qk_rope_head_dim per token and layer.
    # vllm-cpu's CPU_MLA kernel compiles only for 512 + 64 (DeepSeek-V2/V3's sizes).
    kv_lora_rank: int = 512
    qk_rope_head_dim: int = 64

    @property
    def head_size(self) -> int:
        """Size of one attention head."""
        return self.hidden_size // self.num_heads

    def digest(self) -> str:
        """Return a short hex digest of every parameter and the file format version."""
        fields = dataclasses.asdict(self)
        if self.architecture == "llama":  # the Llama digests predate the MLA fields
            for name in ("architecture", "kv_lora_rank", "qk_rope_head_dim"):
                del fields[name]
        fields["_format_version"] = _FORMAT_VERSION
        text = json.dumps(fields, sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def kv_bytes_per_token(self) -> int:
        """Bytes of K and V for one token over all layers (what a KV cache holds)."""
        itemsize = {"bfloat16": 2, "float16": 2, "float32": 4}[self.dtype]
        if self.architecture == "deepseek_v2":  # one latent per token, no heads, no K/V split
            return self.num_layers * (self.kv_lora_rank + self.qk_rope_head_dim) * itemsize
        layers = self.num_layers // 2 if self.architecture == "qwen3_next" else self.num_layers
        return 2 * layers * self.num_kv_heads * self.head_size * itemsize

    def state_bytes(self) -> int:
        """Bytes of one request's states at one position over all layers (0 without state
        layers): each gated DeltaNet layer's conv state (kernel - 1 inputs of its q, k, v
        projections) and recurrent state (a key x value matrix per head), in the model's
        dtype, which vLLM keeps by default."""
        if self.architecture != "qwen3_next":
            return 0
        itemsize = {"bfloat16": 2, "float16": 2, "float32": 4}[self.dtype]
        conv_dim = 2 * _LINEAR_HEADS * _LINEAR_HEAD_DIM + _LINEAR_HEADS * _LINEAR_HEAD_DIM
        per_layer = ((_LINEAR_CONV_KERNEL - 1) * conv_dim
                     + _LINEAR_HEADS * _LINEAR_HEAD_DIM * _LINEAR_HEAD_DIM)
        return self.num_layers // 2 * per_layer * itemsize


# Qwen3-Next's linear-attention layers: heads of 128 (vllm-cpu's gated delta rule kernel
# refuses smaller ones: "Unexpected head dim size"), as many key as value heads.
_LINEAR_HEADS, _LINEAR_HEAD_DIM, _LINEAR_CONV_KERNEL = 2, 128, 4


PRESETS: dict[str, TinyModelSpec] = {
    # Starts in a few seconds; short prompts. Used by tests/engine.
    "test": TinyModelSpec(),
    # Sized so that an 8k-token prefill takes >= 2 s on the 2-core CI machine (measured in
    # docs/vllm-connector-notes.md: 8k tokens in 4.3-4.7 s); 8 KiB of KV per token.
    "bench": TinyModelSpec(
        num_layers=8,
        hidden_size=512,
        num_heads=8,
        num_kv_heads=4,
        intermediate_size=1536,
        vocab_size=1024,
        max_position_embeddings=20480,
        initializer_range=0.05,
    ),
    # DeepSeek-V2-style MLA (latent KV of 512 + 64 per token and layer; dense MLPs, no MoE),
    # served by vllm-cpu's CPU_MLA backend (block size forced to 16). Used by
    # tests/engine/test_mla_model.py.
    "mla": TinyModelSpec(architecture="deepseek_v2", num_heads=2, num_kv_heads=2),
    # The shape of tests/engine/test_linear_attention_models.py's model: 2 gated DeltaNet +
    # 2 full-attention layers, 4 experts; vLLM's "align" mode raises its block to 288
    # tokens. 512 bytes of KV a token, 140,288 bytes of states a request.
    "qwen3-next": TinyModelSpec(architecture="qwen3_next", num_layers=4,
                                initializer_range=0.3, lm_head_scale=1.0),
}


def make_tiny_model(root: str | os.PathLike[str], **params: object) -> Path:
    """Write a tiny random Llama under `root` (or reuse the one already there).

    Args:
        root: cache directory; the model goes to `root/tiny-llama-<digest>`.
        **params: fields of `TinyModelSpec` (num_layers, hidden_size, num_heads,
            num_kv_heads, vocab_size, max_position_embeddings, seed, ...).

    Returns:
        The model directory, loadable by vLLM and transformers with no downloads.

    Raises:
        TypeError: on an unknown parameter name.
        ValueError: when hidden_size is not divisible by num_heads, or num_heads by
            num_kv_heads, or vocab_size is below MIN_VOCAB_SIZE (259: 3 specials and
            the 256 bytes).

    Safe to call from several processes: the model is written to a temporary directory and
    renamed into place, and a complete directory is never rewritten.
    """
    spec = TinyModelSpec(**params)  # type: ignore[arg-type]
    return write_model(spec, Path(root))


def make_preset_model(name: str, root: str | os.PathLike[str]) -> Path:
    """Write (or reuse) the preset model `name` (a key of `PRESETS`) under `root`.

    Raises:
        KeyError: on an unknown preset name.
    """
    return write_model(PRESETS[name], Path(root))


def write_model(spec: TinyModelSpec, root: Path) -> Path:
    """Write (or reuse) the model of `spec` under `root`; see `make_tiny_model`."""
    _validate(spec)
    final = root / f"tiny-llama-{spec.digest()}"
    if (final / _COMPLETE_MARKER).is_file():
        return final
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-tiny-llama-", dir=root))
    try:
        _write_weights(spec, tmp)
        write_tokenizer(spec.vocab_size, tmp)
        _write_generation_defaults(tmp)
        marker = {"spec": dataclasses.asdict(spec), "format_version": _FORMAT_VERSION}
        (tmp / _COMPLETE_MARKER).write_text(json.dumps(marker, indent=2))
        if final.exists():
            # An interrupted earlier write (no marker): replace it. A concurrent writer that
            # finished first also lands here only if its marker is missing, so this is safe.
            if (final / _COMPLETE_MARKER).is_file():
                return final
            shutil.rmtree(final)
        try:
            os.rename(tmp, final)
        except OSError:
            # Another process renamed its copy into place first; use that one.
            if not (final / _COMPLETE_MARKER).is_file():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return final


def _validate(spec: TinyModelSpec) -> None:
    if spec.architecture not in ("llama", "deepseek_v2", "qwen3_next"):
        raise ValueError(f"architecture={spec.architecture!r}: 'llama', 'deepseek_v2' or "
                         "'qwen3_next'")
    if spec.hidden_size % spec.num_heads:
        raise ValueError(f"hidden_size={spec.hidden_size} not divisible by num_heads")
    if spec.num_heads % spec.num_kv_heads:
        raise ValueError(f"num_heads={spec.num_heads} not divisible by num_kv_heads")
    if spec.vocab_size < MIN_VOCAB_SIZE:
        raise ValueError(f"vocab_size={spec.vocab_size}: at least {MIN_VOCAB_SIZE} (3 "
                         "special tokens and 256 bytes)")


def _llama_config(spec: TinyModelSpec) -> LlamaConfig:
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        head_dim=spec.head_size,
        max_position_embeddings=spec.max_position_embeddings,
        initializer_range=spec.initializer_range,
        tie_word_embeddings=False,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=UNK_ID,
        torch_dtype=spec.dtype,  # type: ignore[call-arg]  # a config.json field vLLM reads
    )


def _deepseek_v2_config(spec: TinyModelSpec) -> Any:
    """A DeepSeek-V2 config: MLA attention (no query LoRA), every layer's MLP dense
    (`first_k_dense_replace` = num_layers, so the MoE fields are never used)."""
    from transformers import DeepseekV2Config

    config = DeepseekV2Config(
        vocab_size=spec.vocab_size, hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size, num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads, num_key_value_heads=spec.num_kv_heads,
        kv_lora_rank=spec.kv_lora_rank, q_lora_rank=None, qk_rope_head_dim=spec.qk_rope_head_dim,
        qk_nope_head_dim=spec.head_size, v_head_dim=spec.head_size,
        first_k_dense_replace=spec.num_layers, n_routed_experts=4, n_shared_experts=1,
        num_experts_per_tok=2, moe_intermediate_size=spec.intermediate_size // 4,
        max_position_embeddings=spec.max_position_embeddings,
        initializer_range=spec.initializer_range, tie_word_embeddings=False,
        bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=UNK_ID,
        torch_dtype=spec.dtype)  # type: ignore[call-arg]  # a config.json field vLLM reads
    config.architectures = ["DeepseekV2ForCausalLM"]
    return config


def _qwen3_next_config(spec: TinyModelSpec) -> Any:
    """A Qwen3-Next config: linear-attention and full-attention layers in turn, every MLP
    a 4-expert MoE with a shared expert."""
    from transformers import Qwen3NextConfig

    config = Qwen3NextConfig(
        vocab_size=spec.vocab_size, hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size, num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads, num_key_value_heads=spec.num_kv_heads,
        head_dim=spec.head_size, layer_types=["linear_attention", "full_attention"]
        * (spec.num_layers // 2), linear_conv_kernel_dim=_LINEAR_CONV_KERNEL,
        linear_num_key_heads=_LINEAR_HEADS, linear_num_value_heads=_LINEAR_HEADS,
        linear_key_head_dim=_LINEAR_HEAD_DIM, linear_value_head_dim=_LINEAR_HEAD_DIM,
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=spec.intermediate_size // 4,
        shared_expert_intermediate_size=spec.intermediate_size // 4,
        max_position_embeddings=spec.max_position_embeddings,
        initializer_range=spec.initializer_range, tie_word_embeddings=False,
        bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=UNK_ID,
        torch_dtype=spec.dtype)  # type: ignore[call-arg]  # a config.json field vLLM reads
    config.architectures = ["Qwen3NextForCausalLM"]
    return config


def _write_weights(spec: TinyModelSpec, out: Path) -> None:
    import torch
    from transformers import DeepseekV2ForCausalLM, LlamaForCausalLM, Qwen3NextForCausalLM

    # Seed a private generator state: the weights depend on the spec only, not on what
    # the caller's process drew from torch's global RNG before.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(spec.seed)
        model: Any
        if spec.architecture == "deepseek_v2":
            model = DeepseekV2ForCausalLM(_deepseek_v2_config(spec))
        elif spec.architecture == "qwen3_next":
            model = Qwen3NextForCausalLM(_qwen3_next_config(spec))
        else:
            model = LlamaForCausalLM(_llama_config(spec))
        with torch.no_grad():
            model.lm_head.weight.mul_(spec.lm_head_scale)
    model = model.to(getattr(torch, spec.dtype))
    model.save_pretrained(out, safe_serialization=True)


def default_model_root() -> Path:
    """Where the tools generate their models: $XDG_CACHE_HOME/kvtier/models, or
    ~/.cache/kvtier/models."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "kvtier" / "models"


def preset_named(name: str) -> str | None:
    """The preset a served name names ("kvtier-tiny": "test", "kvtier-bench": "bench", ...),
    or None."""
    for preset in PRESETS:
        if name == ("kvtier-tiny" if preset == "test" else f"kvtier-{preset}"):
            return preset
    return None


def served_name(model_dir: str | os.PathLike[str]) -> str | None:
    """The short name to serve a generated model under: "kvtier-tiny" for the "test"
    preset, "kvtier-<preset>" for another preset, "kvtier-tiny-<digest>" for any other
    spec; None when `model_dir` is not a model this module wrote (no complete marker)."""
    try:
        marker = json.loads((Path(model_dir) / _COMPLETE_MARKER).read_text())
        spec = TinyModelSpec(**marker["spec"])
    except (OSError, ValueError, TypeError, KeyError):
        return None
    for name, preset in PRESETS.items():
        if preset == spec:
            return "kvtier-tiny" if name == "test" else f"kvtier-{name}"
    return f"kvtier-tiny-{spec.digest()[:8]}"


def write_tokenizer(vocab_size: int, out: Path) -> None:
    """Save a byte-level BPE tokenizer of exactly `vocab_size` ids to `out`
    (tokenizer.json, tokenizer_config.json, and CHAT_TEMPLATE as chat_template.jinja).

    Ids 0, 1, 2 are <unk>, <s>, </s>; ids 3..258 the 256 bytes (GPT-2's byte-to-unicode
    alphabet), so any text encodes and decodes back unchanged; the rest are merges of
    common pairs in a fixed order (space + letter, letter pairs, then digits), so English
    words take a few tokens each. Built from constants: no corpus, no download, the same
    file on every machine.

    Raises:
        ValueError: vocab_size below MIN_VOCAB_SIZE.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    if vocab_size < MIN_VOCAB_SIZE:
        raise ValueError(f"vocab_size={vocab_size}: at least {MIN_VOCAB_SIZE}")
    specials = ["<unk>", "<s>", "</s>"]
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {tok: i for i, tok in enumerate([*specials, *alphabet])}
    merges: list[tuple[str, str]] = []
    for left, right in _merge_candidates():
        if len(vocab) >= vocab_size:
            break
        if left + right not in vocab:
            merges.append((left, right))
            vocab[left + right] = len(vocab)
    extra = vocab_size - len(vocab)  # only past ~1,800 ids: unused special tokens
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t in [*specials, *(f"<extra_{i}>" for i in range(extra))]])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<unk>",
        model_max_length=1 << 30,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)


def _merge_candidates() -> list[tuple[str, str]]:
    """The BPE merges in rank order, as pairs of byte-level symbols ("Ġ" is the space)."""
    lower, upper = "abcdefghijklmnopqrstuvwxyz", "ABCDEFGHIJKLMNOPQRSTUVWXYZ"
    digits = "0123456789"
    pairs = [("Ġ", c) for c in lower]
    pairs += [(a, b) for a in lower for b in lower]
    pairs += [("Ġ", c) for c in upper]
    pairs += [(a, b) for a in upper for b in lower]
    pairs += [("Ġ", c) for c in digits]
    pairs += [(a, b) for a in digits for b in digits]
    return pairs


def _write_generation_defaults(out: Path) -> None:
    """Add GENERATION_DEFAULTS to the generation_config.json save_pretrained wrote."""
    path = out / "generation_config.json"
    config = json.loads(path.read_text()) if path.is_file() else {}
    path.write_text(json.dumps({**config, **GENERATION_DEFAULTS}, indent=2) + "\n")
