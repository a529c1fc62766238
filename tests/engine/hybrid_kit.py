"""Generated hybrid models and the checks their tests share (test_hybrid_models.py: sliding
window + full attention; test_state_models.py: short convolutions + full attention).

  - `SHAPE`, `save_model(model, out)`: the models' common shape; save one with a tokenizer.
  - `chunk_after_hit(llm, prompt, salt, chunk, load=...)`: the file of the chunk that a run
    computes right after a 5-chunk prefix (`prefix_chunks`) that kvtier loads (or vLLM's own
    prefix cache holds, or neither: from scratch).
  - `difference(a, b)`: relative mean |difference| of two chunk files' KV.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from vllm_harness import (
    chunk_files,
    chunk_payload,
    kvtier_counter,
    settle,
    token_ids,
    wait_for_new_file,
)

from kvtier.tools.tinymodel import BOS_ID, EOS_ID, UNK_ID, write_tokenizer

SHAPE: dict[str, Any] = dict(
    vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
    bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=UNK_ID)
# Relative mean |difference| of two computations of one chunk's KV (test_failed_loads.py).
NOISE = 0.02
BYPASS = {"skip_load": True, "skip_store": True}


def save_model(model: Any, out: Path) -> Path:
    """Save a generated model in bfloat16 with the tests' tokenizer; its directory."""
    import torch

    model.to(torch.bfloat16).save_pretrained(out, safe_serialization=True)
    write_tokenizer(SHAPE["vocab_size"], out)
    return out


def chunk_after_hit(llm: Any, prompt: list[int], salt: str, chunk: int, *, load: bool,
                    local: bool = False, prefix_chunks: int = 5) -> Path:
    """Chunk 5's file of `prompt` (6 chunks + 1 token) under `salt`: chunks 0-4 are stored
    first (a 5-chunk prefix), then the whole prompt runs (loading chunks 0-4 from kvtier, or
    not; `local`: from vLLM's own prefix cache) and stores chunk 5 only. `prefix_chunks`:
    another prefix length than 5 chunks (n: chunk n's file, of a prompt of n + 1 chunks + 1
    token). `llm.disk_dir`: its disk tier."""
    n = prefix_chunks
    disk = llm.disk_dir
    token_ids(llm, [{"prompt_token_ids": prompt[:n * chunk + 1], "cache_salt": salt}], 1)
    settle([disk])
    if not local:
        assert llm.reset_prefix_cache()
    before = {f.name for f in chunk_files(disk)}
    loaded = kvtier_counter("loaded_tokens")
    params = None if load else {"skip_load": True}
    token_ids(llm, [{"prompt_token_ids": prompt, "cache_salt": salt}], 1, params)
    assert kvtier_counter("loaded_tokens") - loaded == (n * chunk if load else 0)
    return next(disk.rglob(wait_for_new_file(disk, before)))


def difference(ours: Path, ref: Path) -> float:
    """Relative mean |difference| of two chunk files' contents (as bfloat16 values)."""
    a, b = chunk_payload(ours), chunk_payload(ref)
    return float((a - b).abs().mean() / b.abs().mean())
