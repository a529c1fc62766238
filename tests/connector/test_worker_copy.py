"""The connector's worker copies: vLLM's paged KV <-> kvtier chunk byte order.

Pure torch on vLLM-shaped tensors (no engine); importing vllm takes a few seconds. The
vectorized copies (`PagedKV`: one op over all layers when they share an allocation, one op
per layer otherwise) are checked against a plain per-layer, per-block reference written
from the documented layouts, on the CPU backend's layout and on vLLM 0.33's CUDA views
(FlashAttention's LBNHC, built by vLLM's own stride rules: kvtier/testing/vllmviews.py).
"""

from __future__ import annotations

import random
import warnings

import pytest
import torch

pytest.importorskip("vllm")

from kvtier.errors import ConfigError
from kvtier.integrations.vllm.config import ConnectorConfig, RequestControls
from kvtier.integrations.vllm.worker.connector_worker import PagedKV

LAYERS, BLOCKS, HEADS, BS, DIM = 2, 8, 2, 32, 16


def cpu_kv() -> dict[str, torch.Tensor]:
    """Layers shaped like the CPU backend's: [blocks, heads, block_size, 2*dim]."""
    gen = torch.Generator().manual_seed(0)
    return {f"model.layers.{i}.self_attn.attn":
            torch.randn(BLOCKS, HEADS, BS, 2 * DIM, generator=gen).to(torch.bfloat16)
            for i in range(LAYERS)}


def test_chunk_holds_per_layer_block_head_k_then_v_rows() -> None:
    kv = cpu_kv()
    paged = PagedKV(kv, BS)
    chunk = torch.empty(LAYERS, 2, HEADS, 2, BS, DIM, dtype=torch.bfloat16)
    paged.gather((5, 2), chunk)
    layer1 = kv["model.layers.1.self_attn.attn"]
    # The CPU kernel's view: per block and head, K rows [0, BS) then V rows [BS, 2*BS).
    rows = layer1.view(BLOCKS, HEADS, 2 * BS, DIM)
    assert torch.equal(chunk[1, 0, 1, 0, 3], rows[5, 1, 3])  # K, token 3 (block 5)
    assert torch.equal(chunk[1, 0, 1, 1, 3], rows[5, 1, BS + 3])  # V, token 3
    assert torch.equal(chunk[1, 1, 0, 1, 7], rows[2, 0, BS + 7])  # V, token BS + 7 (block 2)
    # A (layer, block) of the chunk is that block of that layer, byte for byte.
    assert torch.equal(chunk[0, 1].reshape(-1), kv["model.layers.0.self_attn.attn"][2].reshape(-1))


def test_scatter_restores_gathered_blocks_and_spares_the_local_ones() -> None:
    kv = cpu_kv()
    paged = PagedKV(kv, BS)
    chunk = torch.empty(LAYERS, 2, HEADS, 2, BS, DIM, dtype=torch.bfloat16)
    paged.gather((0, 1), chunk)
    before = {name: t.clone() for name, t in kv.items()}
    paged.scatter(chunk, (6, 7), first_block=1)  # block 6 is a local hit: untouched
    for name, t in kv.items():
        assert torch.equal(t[7], before[name][1])
        assert torch.equal(t[6], before[name][6])
    layout = paged.layout(64)
    assert layout.bytes_per_chunk == chunk.numel() * 2


def test_unknown_kv_shapes_and_bad_settings_are_refused() -> None:
    with pytest.raises(ConfigError, match="shape"):
        PagedKV({"l0": torch.zeros(4, 3, 5)}, BS)
    with pytest.raises(ConfigError, match="tokens_per_chunk"):
        ConnectorConfig.parse({"tokens_per_chunk": 48}).check_block_size(32)
    with pytest.raises(ConfigError, match="tokens_per_chunk"):
        ConnectorConfig.parse({"tokens_per_chunk": "64"})
    with pytest.raises(ConfigError, match="tiers"):
        ConnectorConfig.parse({"tiers": []})
    controls = RequestControls.from_params({"skip_load": "yes", "max_offload_tokens": 128})
    assert controls == RequestControls(skip_load=False, max_offload_tokens=128)


def one_allocation_cpu_kv(layers: int = LAYERS, blocks: int = BLOCKS) -> dict[str, torch.Tensor]:
    """Like the CPU backend's LBHNC: every layer a slice of one tensor, layer outermost."""
    gen = torch.Generator().manual_seed(1)
    base = torch.randn(layers, blocks, HEADS, BS, 2 * DIM, generator=gen).to(torch.bfloat16)
    return {f"model.layers.{i}.self_attn.attn": base[i] for i in range(layers)}


def lbnhc_kv(one_allocation: bool) -> dict[str, torch.Tensor]:
    """vLLM 0.33's FlashAttention views: logical [blocks, heads, block_size, 2*dim] per layer
    (K and V the halves of each token's content), physically [L, B, N, H, C]."""
    from kvtier.testing.vllmviews import VllmCacheSpec, vllm_kv_caches

    spec = VllmCacheSpec(BS, HEADS, DIM, DIM, torch.bfloat16)
    kv = vllm_kv_caches(spec, LAYERS, BLOCKS, "LBNHC", fill=False)
    gen = torch.Generator().manual_seed(2)
    for t in kv.values():
        t.copy_(torch.randn(t.shape, generator=gen))
    return kv if one_allocation else {name: t.clone() for name, t in kv.items()}


def reference_block(kv: dict[str, torch.Tensor], layer: int, block: int) -> torch.Tensor:
    """Block `block` of layer `layer` as [heads, 2, block_size, dim], from the layout docs."""
    t = list(kv.values())[layer]
    if t.is_contiguous():  # CPU: per head, K rows [0, BS) then V rows [BS, 2*BS)
        return t[block].reshape(HEADS, 2, BS, DIM)
    # vLLM 0.33: [H, BS, 2D], K and V the halves of the last dimension -> [H, 2, BS, D]
    return torch.stack([t[block][..., :DIM], t[block][..., DIM:]], dim=1)


def reference_gather(kv: dict[str, torch.Tensor], block_ids: tuple[int, ...]) -> torch.Tensor:
    """[layers, blocks, heads, 2, block_size, dim]: the documented chunk order."""
    return torch.stack([torch.stack([reference_block(kv, layer, b) for b in block_ids])
                        for layer in range(len(kv))])


KV_CASES = {
    "cpu, layers apart": cpu_kv,
    "cpu, one allocation": one_allocation_cpu_kv,
    "vLLM 0.33 LBNHC, layers apart": lambda: lbnhc_kv(False),
    "vLLM 0.33 LBNHC, one allocation": lambda: lbnhc_kv(True),
}


# The accelerators' path (torch index_select / index_copy_ over the same strided views) is
# checked on CPU tensors too: no GPU is at hand where these tests run.
OPS = {"numpy (CPU)": False, "torch index ops (accelerators)": True}


@pytest.mark.parametrize("ops", OPS)
@pytest.mark.parametrize("case", KV_CASES)
def test_gather_matches_the_per_block_reference(case: str, ops: str) -> None:
    kv = KV_CASES[case]()
    paged = PagedKV(kv, BS, torch_ops=OPS[ops], content="halves" if "LBNHC" in case else "rows")
    assert paged.single_allocation == ("one allocation" in case)
    rng = random.Random(case)
    for _ in range(5):
        block_ids = tuple(rng.sample(range(BLOCKS), 3))
        chunk = torch.empty(LAYERS, 3, HEADS, 2, BS, DIM, dtype=torch.bfloat16)
        paged.gather(block_ids, chunk)
        assert torch.equal(chunk, reference_gather(kv, block_ids))


@pytest.mark.parametrize("ops", OPS)
@pytest.mark.parametrize("case", KV_CASES)
def test_scatter_from_a_read_only_byte_buffer_writes_only_its_blocks(case: str, ops: str) -> None:
    kv = KV_CASES[case]()
    paged = PagedKV(kv, BS, torch_ops=OPS[ops], content="halves" if "LBNHC" in case else "rows")
    before = {name: t.clone() for name, t in kv.items()}
    gen = torch.Generator().manual_seed(3)
    chunk = torch.randn(LAYERS, 3, HEADS, 2, BS, DIM, generator=gen).to(torch.bfloat16)
    # As the worker gets it from a borrowed slot: read-only uint8 bytes.
    lent = memoryview(chunk.view(torch.uint8).numpy().tobytes()).toreadonly()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch: "the given buffer is not writable"
        raw = torch.frombuffer(lent, dtype=torch.uint8)
    paged.scatter(raw, (4, 0, 6), first_block=1)  # block 4: a local hit, left alone
    for layer in range(LAYERS):
        for j, block in enumerate((0, 6), start=1):
            assert torch.equal(reference_block(kv, layer, block), chunk[layer, j])
    untouched = [b for b in range(BLOCKS) if b not in (0, 6)]
    for name, t in kv.items():
        if t.ndim == 4:
            assert torch.equal(t[untouched], before[name][untouched])
        else:
            assert torch.equal(t[:, untouched], before[name][:, untouched])


def test_a_gathered_chunk_scatters_back_to_the_same_bytes_elsewhere() -> None:
    kv = one_allocation_cpu_kv()
    paged = PagedKV(kv, BS)
    chunk = torch.empty(paged.layout(2 * BS).bytes_per_chunk, dtype=torch.uint8)
    paged.gather((1, 2), chunk)
    paged.scatter(chunk, (5, 7), first_block=0)
    for t in kv.values():
        assert torch.equal(t[5], t[1]) and torch.equal(t[7], t[2])
    with pytest.raises(RuntimeError):  # a non-contiguous chunk would gather into a copy
        paged.gather((1, 2), torch.empty(2 * chunk.numel(), dtype=torch.uint8)[::2])


def halves_from_cpu(kv: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The same K and V in CUDA vLLM 0.33's layout: [blocks, heads, block_size, 2*dim] with K
    and V as the halves of each token's last dimension (CPU: all K rows, then all V rows)."""
    return {name: t.view(BLOCKS, HEADS, 2, BS, DIM).permute(0, 1, 3, 2, 4)
            .reshape(BLOCKS, HEADS, BS, 2 * DIM).contiguous() for name, t in kv.items()}


def test_same_shape_other_meaning_the_halves_layout_yields_the_cpu_layouts_chunks() -> None:
    """A CUDA engine (halves) and a CPU engine holding the same KV store identical chunks, so
    they can share a cache; and a halves chunk scatters back to its own layout."""
    cpu = cpu_kv()
    halves = halves_from_cpu(cpu)
    from_cpu = torch.empty(LAYERS, 2, HEADS, 2, BS, DIM, dtype=torch.bfloat16)
    from_halves = torch.empty_like(from_cpu)
    PagedKV(cpu, BS).gather((5, 2), from_cpu)
    paged = PagedKV(halves, BS, content="halves", torch_ops=True)  # as on CUDA
    paged.gather((5, 2), from_halves)
    assert torch.equal(from_cpu, from_halves)
    assert torch.equal(from_halves[1, 0, 1, 0, 3], list(halves.values())[1][5, 1, 3, :DIM])  # K
    assert torch.equal(from_halves[1, 0, 1, 1, 3], list(halves.values())[1][5, 1, 3, DIM:])  # V
    paged.scatter(from_cpu, (0, 1), first_block=0)
    for t in halves.values():
        assert torch.equal(t[0], t[5]) and torch.equal(t[1], t[2])


def test_a_content_that_does_not_fit_the_format_is_refused() -> None:
    with pytest.raises(ConfigError, match="kv cache content"):
        PagedKV(cpu_kv(), BS, content="latent")  # a K/V format


def test_loads_from_disk_come_in_batches_and_stop_at_the_first_miss(tmp_path) -> None:
    """Chunks on the disk tier come back through the worker in batches of 2 (read in
    parallel, into the memory tier's reserved slots or the worker's spares); a chunk missing
    from disk ends the load there: the chunks before it are in their blocks, its blocks and
    the rest are reported failed."""
    from kvtier.core.keys import ChunkKey
    from kvtier.integrations.vllm.messages import ChunkTransfer, KVTierMetadata
    from kvtier.integrations.vllm.worker.connector_worker import ConnectorWorker
    from kvtier.tiers import open_store
    from kvtier.tiers.storeconfig import StoreConfig

    kv = one_allocation_cpu_kv(blocks=32)
    paged = PagedKV(kv, BS)
    layout = paged.layout(BS)  # one block per chunk
    store = open_store(StoreConfig.parse({"tiers": [
        {"kind": "memory", "capacity": 2 * layout.bytes_per_chunk, "pin": "off"},  # 2 slots
        {"kind": "disk", "path": str(tmp_path / "disk"), "capacity": "64MiB"}]}), layout)
    worker = ConnectorWorker(paged, layout, store, load_batch=2)
    keys = [ChunkKey(b"ahead" + i.to_bytes(11, "big")) for i in range(7)]
    worker.store(KVTierMetadata(stores=[ChunkTransfer(k, (i,)) for i, k in enumerate(keys)]))
    assert store.flush(timeout_s=10)
    for k in keys:  # only the disk holds them now
        store.tiers[0].delete(k)
    store.tiers[1].delete(keys[5])  # the sixth chunk is lost
    worker.load(KVTierMetadata(loads={"r": [ChunkTransfer(k, (16 + i,))
                                            for i, k in enumerate(keys)]}))
    for t in kv.values():
        for i in range(5):
            assert torch.equal(t[16 + i], t[i])
    assert worker.take_failed_block_ids() == {21, 22}
    worker.close()


def test_a_load_is_timed_by_tier_and_a_failed_one_charges_the_tier_that_failed(
        tmp_path, monkeypatch) -> None:
    """The workers' load samples (loadcost.py): chunks counted by the tier that lent them; a
    load that stops at a read a tier failed (erred, down, late) counts that chunk for that
    tier, so a tier whose reads fail or time out is seen as slow; a chunk found lost or
    damaged says nothing of its tier's speed."""
    from kvtier.core.keys import ChunkKey
    from kvtier.core.tier import Failure, TierResult
    from kvtier.integrations.vllm.messages import ChunkTransfer, KVTierMetadata
    from kvtier.integrations.vllm.worker.connector_worker import ConnectorWorker
    from kvtier.tiers import open_store
    from kvtier.tiers.storeconfig import StoreConfig

    kv = one_allocation_cpu_kv(blocks=32)
    paged = PagedKV(kv, BS)
    layout = paged.layout(BS)
    store = open_store(StoreConfig.parse({"tiers": [
        {"kind": "memory", "capacity": 4 * layout.bytes_per_chunk, "pin": "off"},
        {"kind": "disk", "path": str(tmp_path / "disk"), "capacity": "64MiB"}]}), layout)
    worker = ConnectorWorker(paged, layout, store, load_batch=2)
    keys = [ChunkKey(b"timed" + i.to_bytes(11, "big")) for i in range(4)]
    worker.store(KVTierMetadata(stores=[ChunkTransfer(k, (i,)) for i, k in enumerate(keys)]))
    assert store.flush(timeout_s=10)
    worker.take_report()
    for k in keys[:2]:
        store.tiers[0].delete(k)  # keys 2, 3 in memory (and disk), keys 0, 1 on disk only
    worker.take_stats()
    worker.load(KVTierMetadata(loads={"r": [ChunkTransfer(k, (16 + i,))
                                            for i, k in enumerate(keys)]}))
    # the wait for the reads is in this step's stats (vLLM takes them after the forward)
    stats = worker.take_stats()
    assert stats is not None
    read_s = stats.data["counters"]["load_read_seconds"][""]
    report = worker.take_report()
    assert report is not None and len(report.load_samples) == 1
    assert dict(report.load_samples[0].chunks) == {"disk": 2, "memory": 2}
    # of the load's time, the wait for the reads (the disk's two): the rest is the scatter
    assert 0 < report.load_samples[0].read_s == read_s < report.load_samples[0].seconds
    store.tiers[0].delete(keys[0])
    store.tiers[1].delete(keys[0])  # lost everywhere: the first read misses
    worker.load(KVTierMetadata(loads={"s": [ChunkTransfer(keys[0], (20,))]}))
    report = worker.take_report()
    assert report is not None and report.load_samples == []
    store.tiers[0].delete(keys[1])  # on disk only, and the disk fails its read
    monkeypatch.setattr(store.tiers[1], "get_into", lambda *a: TierResult(Failure.IO_ERROR))
    worker.load(KVTierMetadata(loads={"t": [ChunkTransfer(keys[1], (20,))]}))
    report = worker.take_report()
    assert report is not None
    assert [(dict(s.chunks), s.failed) for s in report.load_samples] == [({"disk": 1}, True)]
    worker.close()
