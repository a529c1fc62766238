"""Every stored chunk gets its stored event with its token ids, however many prompts wait.

With KV events on, the scheduler remembers each chunk's token ids when its key is made (at
a lookup) and puts them in the stored event of its later store. They were kept for the
16,384 most recently keyed chunks only: 80 waiting 64k-token prompts looked up made 20,400,
and the first request, scheduled after, kept none of its 255 chunks' ids, so its stores
published no stored events (a router never learned those chunks were cached). Now a live
request holds its chunks' ids, and an ended one's stay among the recent for stores still in
flight. Real vLLM `Request`s, the scheduler side alone (test_connector_scheduler's driver).
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from test_connector_scheduler import Engine, request
from vllm.distributed.kv_events import BlockStored
from vllm.v1.outputs import KVConnectorOutput

from kvtier.core.keys import ChunkKey
from kvtier.core.locator import ChunkLocator
from kvtier.core.store import StoreEvent
from kvtier.core.tier import EventKind
from kvtier.integrations.vllm.config import ConnectorConfig
from kvtier.integrations.vllm.messages import KVTierWorkerMetadata
from kvtier.integrations.vllm.scheduler.connector_scheduler import ConnectorScheduler

TPC, BLOCK = 256, 16
PROMPT = 255 * TPC + 100  # 255 full chunks: a 64k-token prompt
PROMPTS = 80


def events_engine() -> Engine:
    """A scheduler side of an engine that publishes KV events, with one memory tier."""
    engine = Engine()
    config = ConnectorConfig.parse({"tokens_per_chunk": TPC})
    engine.sched = ConnectorScheduler(config, block_size=BLOCK, model_id="tiny",
                                      layout_digest="0" * 32,
                                      locator=ChunkLocator({}, max_keys=1024),
                                      tier_kinds={"memory": "memory"}, emit_events=True)
    return engine


def stored_events(engine: Engine, keys: list[ChunkKey]) -> tuple[list[ChunkKey], list[int]]:
    """The workers stored `keys` in the memory tier: the chunks announced stored, and their
    token ids, in the order of the events."""
    engine.sched.update_connector_output(KVConnectorOutput(
        kv_connector_worker_meta=KVTierWorkerMetadata(
            stored=set(keys), events=[StoreEvent(EventKind.STORED, k, "memory") for k in keys],
            stores_through=engine.last_plan.step if engine.last_plan else 0)))
    announced: list[ChunkKey] = []
    token_ids: list[int] = []
    for event in engine.sched.take_events():
        assert isinstance(event, BlockStored)
        announced += [ChunkKey(h) for h in event.block_hashes]
        token_ids += event.token_ids
    return announced, token_ids


def test_every_stored_chunk_of_80_waiting_long_prompts_is_announced_with_its_tokens() -> None:
    engine = events_engine()
    blocks = list(range(PROMPT // BLOCK + 1))
    requests = [request(f"r{i}", PROMPT, first=i * 10**6) for i in range(PROMPTS)]
    for req in requests:  # every prompt looked up while waiting: a miss, its keys made
        assert engine.admit(req, blocks) == 0
    for n, req in enumerate((requests[0], requests[-1])):
        meta = engine.step(new={req.request_id: (blocks, 0, PROMPT)})
        keys = [t.key for t in meta.stores]
        # 255 chunks, and the tail of the last 100 tokens (6 blocks): at the events' block
        # size of a chunk (the default) a tail is not announced (test_router_events.py).
        assert len(keys) == 256
        announced, token_ids = stored_events(engine, keys)
        assert announced == keys[:255], f"request {n}: stored chunks without their event"
        first = int(req.request_id[1:]) * 10**6
        assert token_ids == list(range(first, first + 255 * TPC))
    for req in requests:
        engine.sched.request_finished(req)


def test_a_store_reported_after_its_request_ended_is_announced() -> None:
    """An asynchronous store may be reported after vLLM finished the request: its chunks'
    ids stay among the recent ones, and the live requests' hold no more."""
    engine = events_engine()
    req = request("a", 4 * TPC + 40)
    blocks = list(range(4 * TPC // BLOCK + 3))
    assert engine.admit(req, blocks) == 0
    keys = [t.key for t in engine.step(new={"a": (blocks, 0, 4 * TPC + 40)}).stores]
    engine.sched.request_finished(req)
    assert stored_events(engine, keys) == (keys[:4], list(range(1000, 1000 + 4 * TPC)))
    assert len(engine.sched._events._chunk_tokens) == 0  # nothing live holds them
