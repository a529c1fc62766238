"""Why a found hit was not loaded (issue 46): `lost_hit_tokens` by reason, counted where each
decision is made.

The scheduler side driven as vLLM drives it (test_connector_scheduler's `Engine`, real vLLM
`Request`s, no engine): the load-or-recompute rule's cut and vLLM taking fewer tokens than
offered, each counted once vLLM allocates. The worker side on a real store (a memory tier over
a disk tier in a temp dir): a chunk gone between lookup and load loses it and the rest of its
request's hit. And the Prometheus export: every reason's series starts at 0.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("vllm")

from prometheus_client import REGISTRY, Counter, Gauge, Histogram
from test_connector_scheduler import CHUNK, Engine, request
from test_worker_copy import BS, one_allocation_cpu_kv

from kvtier.core.keys import ChunkKey
from kvtier.integrations.vllm.messages import ChunkTransfer, KVTierMetadata
from kvtier.integrations.vllm.metrics import LOST_HIT_REASONS, KVTierPromMetrics
from kvtier.integrations.vllm.scheduler.losthits import LookupHit
from kvtier.integrations.vllm.transfers import LoadSample
from kvtier.integrations.vllm.worker.connector_worker import ConnectorWorker, PagedKV
from kvtier.tiers import open_store
from kvtier.tiers.storeconfig import StoreConfig


def lost(engine: Engine) -> dict[str, float]:
    """The scheduler's lost tokens by reason since the last call."""
    stats = engine.sched.take_stats()
    return dict(stats.data["counters"].get("lost_hit_tokens", {})) if stats else {}


def allocate(engine: Engine, req: Any, blocks: list[int], external: int) -> None:
    engine.sched.update_state_after_alloc(
        req, SimpleNamespace(get_block_ids=lambda: (blocks,)), external)


def stored_prompt(engine: Engine) -> None:
    """Request "a" of 200 tokens runs and the workers store its three full chunks."""
    engine.admit(request("a", 200), list(range(7)))
    engine.store_all(engine.step(new={"a": (list(range(7)), 0, 200)}))
    lost(engine)


def test_a_hit_loaded_whole_loses_nothing() -> None:
    engine = Engine()
    stored_prompt(engine)
    assert engine.admit(request("b", 200), list(range(10, 17))) == 3 * CHUNK
    assert lost(engine) == {}


def test_tokens_vllm_does_not_take_are_counted_declined_once_however_often_it_asks() -> None:
    """vLLM asks again while a request waits for blocks; the allocation counts the last
    lookup, once. It may take fewer tokens than offered (its own cache's partial block, a
    sliding-window replay) or none (a request that skips prefix-cache reads)."""
    engine = Engine()
    stored_prompt(engine)
    req = request("b", 200)
    for _ in range(3):  # no blocks yet: asked again
        assert engine.sched.get_num_new_matched_tokens(req, 0) == (3 * CHUNK, False)
    allocate(engine, req, list(range(10, 17)), 2 * CHUNK)
    assert lost(engine) == {"vllm_declined": CHUNK}
    other = request("c", 200)
    assert engine.sched.get_num_new_matched_tokens(other, 0) == (3 * CHUNK, False)
    allocate(engine, other, list(range(20, 27)), 0)
    assert lost(engine) == {"vllm_declined": 3 * CHUNK}


def test_a_request_that_skips_prefix_cache_reads_is_offered_nothing_and_its_hit_declined(
        ) -> None:
    """Prompt logprobs need every prompt token's logits: vLLM computes the request whole
    (`skip_reading_prefix_cache`), and kvtier offers nothing rather than rely on vLLM's
    scheduler to drop the hit (test_connector_scheduler: nor reads it ahead)."""
    from vllm import SamplingParams
    from vllm.v1.request import Request

    engine = Engine()
    stored_prompt(engine)
    req = Request("b", list(range(1000, 1200)), SamplingParams(max_tokens=4, prompt_logprobs=1),
                  None)
    assert req.skip_reading_prefix_cache
    assert engine.sched.get_num_new_matched_tokens(req, 0) == (0, False)
    allocate(engine, req, list(range(10, 17)), 0)
    assert lost(engine) == {"vllm_declined": 3 * CHUNK}


def test_tokens_in_vllms_own_cache_are_not_found_so_never_lost() -> None:
    engine = Engine()
    stored_prompt(engine)
    # vLLM's cache holds the first 96 tokens: kvtier finds the other 96 and loads them.
    assert engine.admit(request("b", 200), list(range(10, 17)), local_tokens=96) == 96
    assert lost(engine) == {}


def test_a_hit_cut_by_the_rule_is_counted_recompute_faster() -> None:
    """Once the engine's prefill is timed and the RAM tier's loads failed (an infinitely slow
    tier, loadcost.py), the rule recomputes the hit: every found token is lost to it."""
    engine = Engine()
    stored_prompt(engine)
    for i in range(4):  # prefills the scheduler times (stepcost.py)
        engine.step(new={f"p{i}": (list(range(7)), 0, 200)})
    engine.report(load_samples=[LoadSample((("memory", 1),), 1.0, failed=True)])
    req = request("b", 200)
    assert engine.sched.get_num_new_matched_tokens(req, 0) == (0, False)
    allocate(engine, req, list(range(10, 17)), 0)
    assert lost(engine) == {"recompute_faster": 3 * CHUNK}


def test_a_lookup_hit_splits_what_was_found_by_reason() -> None:
    hit = LookupHit(found_tokens=256, offered_tokens=128)
    assert hit.lost(128) == {"recompute_faster": 128}
    assert hit.lost(64) == {"recompute_faster": 128, "vllm_declined": 64}
    assert LookupHit(256, 256).lost(256) == {}


def test_a_chunk_gone_between_lookup_and_load_loses_it_and_the_rest_of_the_hit(
        tmp_path: Any) -> None:
    """Seven chunks of one block (32 tokens) each, on disk only; the sixth deleted after the
    lookup: the load stops there, and the sixth and seventh chunks' 64 tokens are lost."""
    paged = PagedKV(one_allocation_cpu_kv(blocks=32), BS)
    layout = paged.layout(BS)  # one block per chunk
    store = open_store(StoreConfig.parse({"tiers": [
        {"kind": "memory", "capacity": 2 * layout.bytes_per_chunk, "pin": "off"},
        {"kind": "disk", "path": str(tmp_path / "disk"), "capacity": "64MiB"}]}), layout)
    worker = ConnectorWorker(paged, layout, store, load_batch=2)
    keys = [ChunkKey(b"lost" + i.to_bytes(12, "big")) for i in range(7)]
    worker.store(KVTierMetadata(stores=[ChunkTransfer(k, (i,)) for i, k in enumerate(keys)]))
    assert store.flush(timeout_s=10)
    for k in keys:
        store.tiers[0].delete(k)
    store.tiers[1].delete(keys[5])
    worker.take_stats()
    worker.load(KVTierMetadata(loads={"r": [ChunkTransfer(k, (16 + i,))
                                            for i, k in enumerate(keys)]}))
    stats = worker.take_stats()
    assert stats is not None
    counters = stats.data["counters"]
    assert counters["lost_hit_tokens"] == {"load_failed": 2 * BS}
    assert counters["loaded_tokens"] == {"": 5 * BS}
    worker.close()


def test_every_reason_is_exported_from_zero() -> None:
    class VllmConfig:
        kv_transfer_config = None

    prom = KVTierPromMetrics(VllmConfig(), {Counter: Counter, Gauge: Gauge, Histogram: Histogram},
                             ["model_name", "engine"], {0: ["tiny", 0]})
    labels = {"model_name": "tiny", "engine": "0"}
    for reason in LOST_HIT_REASONS:
        assert REGISTRY.get_sample_value("vllm:kvtier_lost_hit_tokens_total",
                                         {**labels, "reason": reason}) == 0
    prom.observe({"counters": {"lost_hit_tokens": {"load_failed": 64}}, "gauges": {}})
    assert REGISTRY.get_sample_value("vllm:kvtier_lost_hit_tokens_total",
                                     {**labels, "reason": "load_failed"}) == 64
