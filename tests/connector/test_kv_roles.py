"""vLLM's `kv_role` in kvtier's connector: a prefill instance ("kv_producer") only stores, a
decode instance ("kv_consumer") only loads, "kv_both" does both.

The scheduler side is driven as vLLM drives it (test_connector_scheduler's `Engine`, with
the role given); the worker side of a producer is shown waiting for its write to a slow
lower tier (the shared tier the decode instance reads), which a kv_both worker leaves
behind. No engine; importing vllm takes a few seconds.
"""

from __future__ import annotations

import time

import pytest

pytest.importorskip("vllm")

import torch
from test_connector_scheduler import BLOCK, CHUNK, Engine, request

from kvtier.core.keys import ChunkKey
from kvtier.core.locator import ChunkLocator
from kvtier.core.retention import DEFAULT_META, ChunkMeta
from kvtier.core.store import TieredStore
from kvtier.core.tier import TierResult
from kvtier.integrations.vllm.config import ConnectorConfig, RequestControls
from kvtier.integrations.vllm.messages import ChunkTransfer, KVTierMetadata
from kvtier.integrations.vllm.scheduler.connector_scheduler import ConnectorScheduler
from kvtier.integrations.vllm.worker.connector_worker import ConnectorWorker, PagedKV
from kvtier.tiers.example import ExampleTier, ExampleTierConfig


class RoleEngine(Engine):
    """The scheduler of an engine started with `kv_role`."""

    def __init__(self, kv_role: str) -> None:
        self.locator = ChunkLocator({}, max_keys=1024)
        self.sched = ConnectorScheduler(ConnectorConfig.parse({"tokens_per_chunk": CHUNK}),
                                        block_size=BLOCK, model_id="tiny",
                                        layout_digest="0" * 32, locator=self.locator,
                                        kv_role=kv_role)


def stored_by_a_prefill(engine: Engine) -> list[ChunkKey]:
    """A 200-token prompt's prefill on `engine`; the chunk keys its workers stored."""
    engine.admit(request("prefill", 200), list(range(7)))
    stored = engine.store_all(engine.step(new={"prefill": (list(range(7)), 0, 200)}))
    engine.sched.request_finished(request("prefill", 200))
    return stored


def test_a_producer_stores_every_full_chunk_and_never_offers_a_load() -> None:
    producer = RoleEngine("kv_producer")
    assert len(stored_by_a_prefill(producer)) == 3
    # The same prompt again: the chunks are held, yet a producer recomputes (it is the
    # prefill instance: loading is the decode instance's job)...
    assert producer.admit(request("again", 200), list(range(10, 17))) == 0
    # ...and the per-request switch cannot turn loads back on.
    assert producer.admit(request("asked", 200, params={"skip_load": False}),
                          list(range(20, 27))) == 0


def test_a_consumer_loads_what_is_held_and_never_stores() -> None:
    consumer = RoleEngine("kv_consumer")
    # What a producer stored reaches the consumer's index (here: the workers' report; in a
    # deployment, its probe of the shared tier).
    consumer.report(stored=set(stored_by_a_prefill(RoleEngine("kv_producer"))))
    req = request("decode", 260)
    blocks = list(range(10, 19))
    assert consumer.admit(req, blocks) == 192
    meta = consumer.step(new={"decode": (blocks, 192, 68)})
    assert len(meta.loads["decode"]) == 3
    assert meta.stores == []  # chunk 3 completes in this step: a kv_both engine stores it
    # Nor does a decode step that completes a chunk store anything.
    for computed in range(260, 320):
        req.append_output_token_ids(7)
        assert consumer.step(cached={"decode": ([], computed, 1)}).stores == []


@pytest.mark.parametrize(("extra", "role", "expected"), [
    ({}, "kv_consumer", "always"),  # a decode instance loads what its prefill stored
    ({}, "kv_both", "faster"),
    ({}, None, "faster"),
    ({"load_when": "faster"}, "kv_consumer", "faster"),  # as the operator set it
    ({"load_when": "always"}, "kv_both", "always"),
])
def test_a_consumer_loads_every_hit_unless_told_otherwise(
        extra: dict[str, str], role: str | None, expected: str) -> None:
    # On a small model the rule found the decode instance's own prefill of a short prompt
    # faster than its load from the shared tier, and recomputed what the prefill instance had
    # stored (test_disagg_prefill's salted case, 2 of 6 CI runs).
    assert ConnectorConfig.parse(extra).load_when_for(role) == expected


def test_kv_both_loads_and_stores_and_keeps_the_per_request_switches() -> None:
    both = RoleEngine("kv_both")
    assert len(stored_by_a_prefill(both)) == 3
    assert both.admit(request("b", 200), list(range(10, 17))) == 192
    assert both.admit(request("c", 200, params={"skip_load": True}), list(range(20, 27))) == 0
    assert RequestControls().within_role(None) == RequestControls()
    assert RequestControls(skip_store=True).within_role("kv_producer") == RequestControls(
        skip_load=True, skip_store=True)


class SlowTier(ExampleTier):
    """A lower tier whose writes take a while (a shared directory on a busy NFS server)."""

    def put(self, key: ChunkKey, data: memoryview,
            meta: ChunkMeta = DEFAULT_META) -> TierResult:
        time.sleep(0.3)
        return super().put(key, data, meta)


@pytest.mark.timing
@pytest.mark.parametrize("handoff", [True, False], ids=["kv_producer", "kv_both"])
def test_a_producer_step_returns_once_its_chunks_reached_the_lower_tier(handoff: bool) -> None:
    kv = {f"l{i}": torch.randn(4, 2, BLOCK, 2 * 16).to(torch.bfloat16) for i in range(2)}
    paged = PagedKV(kv, BLOCK)
    layout = paged.layout(BLOCK)  # one block per chunk
    capacity = 8 * layout.bytes_per_chunk
    ram = ExampleTier(ExampleTierConfig(kind="example", name="ram", capacity=capacity), layout)
    shared = SlowTier(ExampleTierConfig(kind="example", name="shared", capacity=capacity),
                      layout)
    with TieredStore([ram, shared]) as store:
        worker = ConnectorWorker(paged, layout, store,
                                 handoff_timeout_s=10.0 if handoff else None)
        keys = [ChunkKey(bytes([i]) * 16) for i in range(2)]
        worker.store(KVTierMetadata(stores=[ChunkTransfer(k, (i,)) for i, k in enumerate(keys)]))
        # The decode instance looks the prompt up as soon as the prefill's response is back.
        assert all(shared.contains(k) for k in keys) is handoff
        worker.close(flush_timeout_s=10)
