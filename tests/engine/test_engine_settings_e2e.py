"""Engine settings that change the KV never share a persistent tier's chunks (a restart with
other settings on the same disk tier), in a real vLLM (CPU backend) with kvtier.

kvtier's namespace names the model by its fingerprint (core/fingerprint.py): its KV-relevant
config, dtype, quantization, revision and sampled checkpoint files. Three changes it missed,
each a restart that was served the old engine's chunks, and tokens its own miss path never
gives (found by trying):
  - LongRoPE (Phi-3's, here on the "test" Llama): vLLM rotates every position by the long
    factors when --max-model-len exceeds original_max_position_embeddings, by the short ones
    otherwise; one checkpoint, one config, other KV (kvsettings.kv_settings);
  - --load-format dummy: weights vLLM makes up (benchmarks), not the files the fingerprint
    samples (a benchmark on a production tier wrote its KV under the production namespace);
  - --load-format pt on a directory that holds safetensors files too: vLLM loads its *.pt
    files, the fingerprint sampled the safetensors ones;
  - a config edited at the same path in a key the fingerprint did not read: GPT-2's
    `activation_function` (Gemma's `hidden_activation`, DeepSeek's and Qwen-MoE's routing
    keys alike: fingerprint.KV_CONFIG_KEYS), and GPT-J's `rotary_dim` (RoPE over part of each
    head, a key transformers keeps as it is).
Each case: engine A stores its prompts to a disk tier and stops; engine B (other settings, the
same tier) serves them: no hit, and the tokens of its own miss path (kvtier bypassed:
`skip_load`/`skip_store`), which differ from A's (the control that the setting changes the
KV). An engine with A's settings again hits A's chunks with A's tokens (the chunks were there
to take). Engines one at a time, their cores in this process.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from vllm_harness import (
    kvtier_transfer_config,
    metric,
    random_prompts,
    settle,
    start_engine,
    token_ids,
)

pytestmark = pytest.mark.vllm

CHUNK = 64
BYPASS = {"skip_load": True, "skip_store": True}
PROMPTS = random_prompts([300, 260, 330], seed=43)
ORIGINAL_LEN = 1024  # the LongRoPE model's original_max_position_embeddings


def tiers(root: Path) -> list[dict[str, Any]]:
    return [{"kind": "disk", "path": str(root), "capacity": "64MiB"}]


def reset(llm: Any) -> None:
    """Empty vLLM's own prefix cache (refused while a store holds a block: a step settles it),
    so that every hit is kvtier's."""
    for _ in range(50):
        if llm.reset_prefix_cache():
            return
        llm.generate([{"prompt_token_ids": [5, 6]}], use_tqdm=False)
    pytest.fail("vLLM's reset_prefix_cache never succeeded")


def served(model_dir: Path, root: Path, **settings: Any) -> tuple[list[list[int]],
                                                                 list[list[int]], float]:
    """An engine on the disk tier at `root`: the prompts' tokens on its miss path (kvtier
    bypassed), then served as usual, and the tokens kvtier provided for the latter."""
    # vLLM caches rotary embeddings per process by their config, not by max_model_len, which
    # LongRoPE's factors depend on: an engine in this process would reuse the previous one's
    # (vLLM's own processes each build theirs).
    from vllm.model_executor.layers import rotary_embedding

    rotary_embedding._ROPE_DICT.clear()
    with start_engine(model_dir, kvtier_transfer_config(tiers(root), CHUNK), **settings) as llm:
        miss = token_ids(llm, PROMPTS, kv_transfer_params=BYPASS)
        reset(llm)
        before = metric(llm, "vllm:external_prefix_cache_hits")
        tokens = token_ids(llm, PROMPTS)
        hits = metric(llm, "vllm:external_prefix_cache_hits") - before
        settle([root])
    return miss, tokens, hits


def stored_then_restarted(model_dir: Path, root: Path, first: dict[str, Any],
                          then: dict[str, Any], edit: Any = None) -> list[list[int]]:
    """Engine A (settings `first`) stores; `edit` (if any) changes the model's files; engine B
    (settings `then`) must neither hit nor differ from its miss path, and must differ from A.
    Returns A's tokens."""
    miss_a, tokens_a, _ = served(model_dir, root, **first)
    assert tokens_a == miss_a
    if edit is not None:
        edit(model_dir)
    miss_b, tokens_b, hits_b = served(model_dir, root, **then)
    assert hits_b == 0, "kvtier served KV computed under other engine settings"
    assert tokens_b == miss_b
    assert miss_b != tokens_a, "control: the setting must change the outputs"
    return tokens_a


def longrope_model(tiny_model_dir: Path, root: Path) -> Path:
    """The "test" model with Phi-3's LongRoPE: short factors 1, long factors 4."""
    model = root / "longrope"
    shutil.copytree(tiny_model_dir, model)
    config = json.loads((model / "config.json").read_text())
    half = config["head_dim"] // 2
    config["original_max_position_embeddings"] = ORIGINAL_LEN
    config["rope_parameters"] = {"rope_type": "longrope", "rope_theta": 10000.0,
                                 "short_factor": [1.0] * half, "long_factor": [4.0] * half,
                                 "original_max_position_embeddings": ORIGINAL_LEN}
    (model / "config.json").write_text(json.dumps(config, indent=2))
    return model


def test_longrope_factors_chosen_by_max_model_len_never_share(
        tiny_model_dir: Path, tmp_path: Path) -> None:
    model = longrope_model(tiny_model_dir, tmp_path)
    long = {"max_model_len": 2 * ORIGINAL_LEN}
    tokens_a = stored_then_restarted(model, tmp_path / "disk", long,
                                     {"max_model_len": ORIGINAL_LEN})
    _, again, hits = served(model, tmp_path / "disk", **long)
    assert hits > 0 and again == tokens_a


def test_dummy_weights_never_share_with_the_checkpoint(tiny_model_dir: Path,
                                                       tmp_path: Path) -> None:
    tokens_a = stored_then_restarted(tiny_model_dir, tmp_path / "disk", {},
                                     {"load_format": "dummy"})
    _, again, hits = served(tiny_model_dir, tmp_path / "disk")
    assert hits > 0 and again == tokens_a


def test_pt_files_loaded_beside_safetensors_never_share_with_them(tiny_model_dir: Path,
                                                                  tmp_path: Path) -> None:
    """The directory holds the "test" model's safetensors and other weights as model.pt."""
    import torch
    from safetensors.torch import load_file

    model = tmp_path / "both"
    shutil.copytree(tiny_model_dir, model)
    weights = load_file(model / "model.safetensors")
    name = next(n for n in weights if "embed_tokens" in n)
    noise = torch.randn(weights[name].shape, generator=torch.Generator().manual_seed(7))
    weights[name] = (weights[name].float() + noise * weights[name].float().std()).to(
        weights[name].dtype)
    torch.save(weights, model / "model.pt")
    stored_then_restarted(model, tmp_path / "disk", {}, {"load_format": "pt"})


def saved_decisive(model: Any, tiny_model_dir: Path, directory: Path) -> Path:
    """`model` in bfloat16, its embeddings scaled (decisive logits), saved in `directory`
    with the "test" model's tokenizer."""
    import torch

    model = model.to(torch.bfloat16)
    with torch.no_grad():
        model.transformer.wte.weight.mul_(3.0)
    model.save_pretrained(directory)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_model_dir / name, directory / name)
    return directory


def edit_config(model_dir: Path, key: str, before: object, after: object) -> None:
    """config.json edited in place (`key` from `before` to `after`), the same weights."""
    path = model_dir / "config.json"
    config = json.loads(path.read_text())
    assert config[key] == before
    path.write_text(json.dumps(config | {key: after}, indent=2))


def gpt2_model(tiny_model_dir: Path, root: Path) -> Path:
    """A tiny random GPT-2 (bfloat16, the "test" model's tokenizer), logits made decisive."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(n_embd=128, n_layer=2, n_head=4, n_inner=256, vocab_size=512,
                        n_positions=4096, initializer_range=0.1, bos_token_id=1,
                        eos_token_id=2)
    return saved_decisive(GPT2LMHeadModel(config), tiny_model_dir, root / "gpt2")


def relu(model_dir: Path) -> None:
    """Another activation."""
    edit_config(model_dir, "activation_function", "gelu_new", "relu")


def test_a_config_edited_at_the_same_path_never_shares(tiny_model_dir: Path,
                                                       tmp_path: Path) -> None:
    model = gpt2_model(tiny_model_dir, tmp_path)
    stored_then_restarted(model, tmp_path / "disk", {}, {}, edit=relu)


def gptj_model(tiny_model_dir: Path, root: Path) -> Path:
    """A tiny random GPT-J (bfloat16, the "test" model's tokenizer) rotating the first 16 of
    each head's 32 dimensions, logits made decisive."""
    import torch
    from transformers import GPTJConfig, GPTJForCausalLM

    torch.manual_seed(0)
    config = GPTJConfig(n_embd=128, n_layer=2, n_head=4, n_inner=256, rotary_dim=16,
                        vocab_size=512, n_positions=4096, initializer_range=0.1,
                        bos_token_id=1, eos_token_id=2)
    return saved_decisive(GPTJForCausalLM(config), tiny_model_dir, root / "gptj")


def whole_heads_rotated(model_dir: Path) -> None:
    """GPT-J's rotary_dim (which transformers keeps as it is, unlike GPT-NeoX's rotary_pct)
    from 16 to all 32 dimensions of each head."""
    edit_config(model_dir, "rotary_dim", 16, 32)


def test_gptjs_rotary_dim_edited_at_the_same_path_never_shares(tiny_model_dir: Path,
                                                               tmp_path: Path) -> None:
    model = gptj_model(tiny_model_dir, tmp_path)
    stored_then_restarted(model, tmp_path / "disk", {}, {}, edit=whole_heads_rotated)
