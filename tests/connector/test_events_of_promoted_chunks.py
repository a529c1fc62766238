"""A chunk read back into RAM long after it was stored is announced stored there, with its
tokens.

A stored event carries its chunk's token ids, which the scheduler keeps while the request
that made its key lives and for the `recent_chunks` ended ones after. A chunk stored an hour
ago, evicted from RAM since, is read back from disk by a new request: the read promotes it
into RAM, and the RAM tier's stored event needs its tokens again, long after the storing
request's were dropped. The reading request has them: its lookup made the keys of its full
chunks from its own tokens, and of the tail it hit (the blocks past its last full chunk:
keys.tail_key). A tail's were not kept at a lookup, only at its store: its promotion into
RAM went out unannounced, and routers never learnt that RAM held the prompt's end.

The scheduler side with a real store (memory over disk, files in tmp_path) standing in for
the worker: its tiers' own events are reported, as the worker reports them. Events at vLLM's
block size (event_block_size), where a tail is announced as its blocks.
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("vllm")

from test_connector_scheduler import Engine, request
from tierkit import tier_settings, tiny_layout
from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVCacheEvent
from vllm.v1.outputs import KVConnectorOutput

from kvtier.core.keys import ChunkKey
from kvtier.core.locator import ChunkLocator
from kvtier.core.store import TieredStore
from kvtier.integrations.vllm.config import ConnectorConfig
from kvtier.integrations.vllm.messages import KVTierMetadata, KVTierWorkerMetadata
from kvtier.integrations.vllm.scheduler.connector_scheduler import ConnectorScheduler
from kvtier.tiers import open_store
from kvtier.tiers.storeconfig import StoreConfig

CHUNK, BLOCK = 128, 32  # 4 blocks a chunk: tails of 1-3 blocks
LAYOUT = tiny_layout(CHUNK)
RECENT = 8  # ended requests' chunks whose tokens are kept
PROMPT = 2 * CHUNK + 3 * BLOCK + 8  # 2 chunks and a tail of 3 blocks, 8 tokens past it


class Worker:
    """The worker side over a real store: stores and loads what a plan says, and reports
    the tiers' events."""

    def __init__(self, engine: Engine, tmp_path: Path) -> None:
        self.engine = engine
        self.store: TieredStore = open_store(StoreConfig.parse({"tiers": [
            tier_settings("memory", tmp_path, LAYOUT, 4),
            tier_settings("disk", tmp_path, LAYOUT, 64)]}), LAYOUT)
        self.chunk = bytearray(LAYOUT.bytes_per_chunk)

    def run(self, meta: KVTierMetadata) -> list[KVCacheEvent]:
        """The plan's loads (a read from disk promotes into RAM), then its stores (through
        to disk); the report, and the KV events the scheduler makes of it."""
        for transfers in meta.loads.values():
            for transfer in transfers:
                assert self.store.get_into(transfer.key, memoryview(self.chunk))
        for transfer in meta.stores:
            assert self.store.put(transfer.key, memoryview(self.chunk))
        assert self.store.flush(timeout_s=30)
        self.engine.sched.update_connector_output(KVConnectorOutput(
            kv_connector_worker_meta=KVTierWorkerMetadata(
                stored={t.key for t in meta.stores}, events=self.store.take_events(),
                stores_through=meta.step)))
        return self.engine.sched.take_events()

    def prefill(self, rid: str, first: int, tokens: int = PROMPT) -> list[KVCacheEvent]:
        """A request of `tokens` tokens from `first`, looked up, computed and ended."""
        req = request(rid, tokens, first=first)
        blocks = list(range(tokens // BLOCK + 1))
        hit = self.engine.admit(req, blocks)
        events = self.run(self.engine.step(new={rid: (blocks, hit, tokens - hit)}))
        self.engine.sched.request_finished(req)
        return events


def events_engine() -> Engine:
    engine = Engine()
    config = ConnectorConfig.parse({"tokens_per_chunk": CHUNK, "event_block_size": BLOCK})
    engine.sched = ConnectorScheduler(config, block_size=BLOCK, model_id="tiny",
                                      layout_digest="0" * 32,
                                      locator=ChunkLocator({}, max_keys=1024),
                                      tier_kinds={"memory": "memory", "disk": "disk"},
                                      emit_events=True, recent_chunks=RECENT)
    return engine


def stored_in(events: list[KVCacheEvent], medium: str) -> tuple[list[ChunkKey], list[int]]:
    """The block hashes announced stored in `medium`, and their tokens, in order."""
    hashes: list[ChunkKey] = []
    tokens: list[int] = []
    for event in events:
        if isinstance(event, BlockStored) and event.medium == medium:
            hashes += [ChunkKey(h) for h in event.block_hashes]
            tokens += event.token_ids
    return hashes, tokens


def test_a_prompt_read_back_from_disk_long_after_is_announced_in_ram_tail_and_all(
        tmp_path: Path) -> None:
    engine = events_engine()
    worker = Worker(engine, tmp_path)
    try:
        stored = worker.prefill("a", first=1000)
        keys, tokens = stored_in(stored, "CPU")
        assert len(keys) == 2 * 4 + 3  # two chunks of 4 blocks, the tail's 3
        assert tokens == list(range(1000, 1000 + 2 * CHUNK + 3 * BLOCK))
        assert stored_in(stored, "STORAGE") == (keys, tokens)  # written through to disk
        # Other prompts since: RAM (4 chunks) evicted all of "a", and the scheduler kept
        # the tokens of none of its chunks (more than RECENT chunks ended after them).
        events = [e for i in range(3) for e in worker.prefill(f"other{i}", 10**6 * (i + 1))]
        removed = {ChunkKey(h) for e in events if isinstance(e, BlockRemoved)
                   for h in e.block_hashes}
        assert removed >= set(keys)

        # "a"'s prompt again: all of it is read back from disk and promoted into RAM.
        req = request("b", PROMPT, first=1000)
        blocks = list(range(PROMPT // BLOCK + 1))
        assert engine.admit(req, blocks) == 2 * CHUNK + 3 * BLOCK
        promoted = worker.run(engine.step(new={"b": (blocks, 2 * CHUNK + 3 * BLOCK, 8)}))
        assert stored_in(promoted, "CPU") == (keys, tokens), "RAM's copies unannounced"
        assert stored_in(promoted, "STORAGE") == ([], [])  # the disk's copies stayed
        engine.sched.request_finished(req)
    finally:
        worker.store.close()
