"""After a cache reset, routers hear nothing stored of the chunks keyed before it.

`reset_prefix_cache(reset_connector=True)` (a weight update in place): kvtier never offers
this engine a chunk keyed before it again, and vLLM's own reset publishes AllBlocksCleared
(every block of the engine gone, kvtier's with them for llm-d: tests/node/llmdrules.py).
A store of an old chunk reported after the reset (a write-behind to disk landing later) was
announced with the ids the scheduler still kept, after the clear: a router credited this
engine with a prompt it would recompute. Now it is not; its removal still is, and the same
prompt after the reset, under its new keys, is announced as any. Driven as vLLM's scheduler
drives it (test_connector_scheduler's Engine), the worker's tier events reported as it
reports them.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from test_connector_scheduler import Engine, request
from test_events_of_promoted_chunks import BLOCK, CHUNK, events_engine, stored_in
from vllm.distributed.kv_events import BlockRemoved, KVCacheEvent
from vllm.v1.outputs import KVConnectorOutput

from kvtier.core.keys import ChunkKey
from kvtier.core.store import StoreEvent
from kvtier.core.tier import EventKind
from kvtier.integrations.vllm.messages import KVTierWorkerMetadata

PROMPT = 2 * CHUNK + 8  # two chunks (and no tail: fewer than a block past them)


def report(engine: Engine, kind: EventKind, tier: str, keys: list[ChunkKey]
           ) -> list[KVCacheEvent]:
    """The workers' tier `tier` stored or removed `keys`: the KV events made of it."""
    engine.sched.update_connector_output(KVConnectorOutput(
        kv_connector_worker_meta=KVTierWorkerMetadata(
            stored=set(keys) if kind is EventKind.STORED else set(),
            events=[StoreEvent(kind, key, tier) for key in keys],
            stores_through=engine.last_plan.step if engine.last_plan else 0)))
    return engine.sched.take_events()


def prefill(engine: Engine, rid: str) -> list[ChunkKey]:
    """The prompt computed and ended: the keys of its planned stores."""
    req = request(rid, PROMPT)
    blocks = list(range(PROMPT // BLOCK + 1))
    assert engine.admit(req, blocks) == 0
    keys = [t.key for t in engine.step(new={rid: (blocks, 0, PROMPT)}).stores]
    engine.sched.request_finished(req)
    return keys


def test_a_chunk_of_before_a_reset_stored_on_disk_after_it_is_not_announced() -> None:
    engine = events_engine()
    old = prefill(engine, "a")
    hashes, _ = stored_in(report(engine, EventKind.STORED, "memory", old), "CPU")
    assert hashes[3::4] == old  # announced in RAM before the reset (a chunk: 4 blocks)
    assert engine.sched.reset_cache()
    # The write-behind to disk lands after the reset: nothing announced.
    assert report(engine, EventKind.STORED, "disk", old) == []
    # Its eviction from RAM is announced (a router that ignored the clear drops it).
    removed = report(engine, EventKind.REMOVED, "memory", old[:1])
    assert [type(e) for e in removed] == [BlockRemoved]

    # The same prompt after the reset: new keys, announced with its tokens.
    new = prefill(engine, "b")
    assert set(new).isdisjoint(old)
    hashes, tokens = stored_in(report(engine, EventKind.STORED, "memory", new), "CPU")
    assert hashes[3::4] == new  # a chunk's last block is its key
    assert tokens == list(range(1000, 1000 + 2 * CHUNK))

