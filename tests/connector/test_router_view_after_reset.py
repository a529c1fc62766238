"""After a cache reset, evicting an old copy of a prompt leaves a router crediting the new one.

`reset_prefix_cache(reset_connector=True)` (a weight update in place): vLLM announces every
block of the engine gone (AllBlocksCleared), kvtier's tiers retire what they hold, and the
same prompt is stored again under new keys and announced. llm-d keys a block by its tokens,
not kvtier's key (tests/node/llmdrules.py): when the retired old copy was later evicted from
RAM, its BlockRemoved took the new copy of the same prompt off llm-d's index for RAM too,
and the prompt scored as if RAM held none of it. The clear had already told the router the
old copy was gone: a retired chunk's removal is not announced after it. When vLLM's own
reset failed (a request held blocks: no clear went out), the router still holds the old
copies, and their removals are announced as before; but not those of copies a clear before
it took off (a failed reset clears nothing, and credits nothing again).

The scheduler side with a real store (RAM over disk, files in tmp_path) standing in for the
worker, retiring its tiers when a plan says so; the router is llm-d's rules, fed the
events as vLLM's publisher sends them (AllBlocksCleared first, as vLLM's reset queues it).
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import msgspec
import pytest

pytest.importorskip("vllm")

from test_connector_scheduler import Engine, request
from test_events_of_promoted_chunks import BLOCK, CHUNK, LAYOUT, events_engine
from tierkit import tier_settings
from vllm.distributed.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
    KVEventBatch,
)
from vllm.v1.outputs import KVConnectorOutput

from kvtier.core.keys import ChunkKey
from kvtier.core.store import StoreEvent, TieredStore
from kvtier.core.tier import EventKind
from kvtier.integrations.vllm.messages import KVTierMetadata, KVTierWorkerMetadata
from kvtier.tiers import open_store
from kvtier.tiers.storeconfig import StoreConfig

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "node"))  # the router's side
from llmdrules import Indexer

PROMPT = 2 * CHUNK + 8  # two chunks (8 of vLLM's blocks), and no tail
BLOCKS = CHUNK // BLOCK  # a chunk's blocks in its events (event_block_size)
POD, MODEL = "10.0.0.1:8000", "m"
TOPIC = f"kv@{POD}@{MODEL}"
WEIGHTS = {"gpu": 1.0, "cpu": 0.8, "storage": 0.2}
IN_RAM, ON_DISK = 8 * 0.8, 8 * 0.2  # the prompt's 8 blocks in RAM (and disk), on disk only


class Worker:
    """The worker side over a real store (RAM: 4 chunks, disk: 64): retires its tiers when a
    plan says so, stores what it plans, reports the tiers' events; vLLM's publisher sends
    them to a router running llm-d's rules."""

    def __init__(self, engine: Engine, tmp_path: Path) -> None:
        self.engine = engine
        self.store: TieredStore = open_store(StoreConfig.parse({"tiers": [
            tier_settings("memory", tmp_path, LAYOUT, 4),
            tier_settings("disk", tmp_path, LAYOUT, 64)]}), LAYOUT)
        self.chunk = bytearray(LAYOUT.bytes_per_chunk)
        self.router = Indexer(block_size=BLOCK, weights=WEIGHTS)
        self.published: list[KVCacheEvent] = []
        self.cleared = False  # vLLM's reset succeeded: its clear goes out with the next batch

    def run(self, meta: KVTierMetadata) -> None:
        if meta.retire:
            self.store.retire()
        for transfer in meta.stores:
            assert self.store.put(transfer.key, memoryview(self.chunk))
        assert self.store.flush(timeout_s=30)
        # The plan's stores are done: the blocks kept for them are free (finished_sending).
        self.engine.sched.update_connector_output(KVConnectorOutput(
            finished_sending=set(meta.held), kv_connector_worker_meta=KVTierWorkerMetadata(
                stored={t.key for t in meta.stores}, events=self.store.take_events(),
                stores_through=meta.step)))
        events: list[KVCacheEvent] = [AllBlocksCleared()] if self.cleared else []
        self.cleared = False
        events += self.engine.sched.take_events()
        self.published += events
        self.router.receive(TOPIC, msgspec.msgpack.encode(KVEventBatch(ts=0.0, events=events)))

    def prefill(self, rid: str, first: int, settle: bool = True) -> None:
        """The prompt from `first`, computed and ended; `settle`: then vLLM steps on while
        its blocks are kept for its stores, and idles (a reset finds every block free)."""
        req = request(rid, PROMPT, first=first)
        blocks = list(range(PROMPT // BLOCK + 1))
        assert self.engine.admit(req, blocks) == 0
        self.run(self.engine.step(new={rid: (blocks, 0, PROMPT)}))
        assert self.engine.sched.request_finished(req)  # stores in flight: blocks kept
        for _ in range(2 if settle else 0):
            self.run(self.engine.step())

    def score(self, first: int) -> float | None:
        return self.router.score(list(range(first, first + PROMPT)), MODEL, {POD: "n1"}).get(POD)

    def report(self, *events: StoreEvent) -> None:
        """Tier events the store did not make here (a write-behind landing late), reported."""
        self.engine.sched.update_connector_output(KVConnectorOutput(
            kv_connector_worker_meta=KVTierWorkerMetadata(events=list(events))))
        self.published += self.engine.sched.take_events()

    def stored_keys(self) -> list[ChunkKey]:
        """The chunks announced stored in RAM (a chunk's last block hash is its key)."""
        return [ChunkKey(h) for e in self.published if isinstance(e, BlockStored)
                and e.medium == "CPU" for h in e.block_hashes][BLOCKS - 1::BLOCKS]

    def removed(self) -> list[ChunkKey]:
        return [ChunkKey(h) for e in self.published if isinstance(e, BlockRemoved)
                for h in e.block_hashes]


@pytest.fixture
def worker(tmp_path: Path) -> Iterator[Worker]:
    worker = Worker(events_engine(), tmp_path)
    yield worker
    worker.store.close()


def test_evicting_the_retired_copy_of_a_prompt_leaves_its_new_copy_credited(
        worker: Worker) -> None:
    worker.prefill("a", first=1000)
    assert worker.score(1000) == pytest.approx(IN_RAM)
    assert worker.engine.sched.reset_cache()
    worker.cleared = True  # vLLM's reset succeeded: every block of the engine gone
    worker.prefill("again", first=1000)  # the same prompt under new keys, announced
    assert worker.score(1000) == pytest.approx(IN_RAM)

    # Another prompt fills RAM: the retired old copy of "a" leaves first.
    worker.prefill("b", first=10**6)
    assert worker.score(1000) == pytest.approx(IN_RAM), "the new copy taken off with the old"
    assert worker.removed() == []  # the clear told the router already

    # The new copy leaves RAM in turn: that removal goes out.
    worker.prefill("c", first=2 * 10**6)
    assert worker.score(1000) == pytest.approx(ON_DISK)
    assert len(worker.removed()) == 8


def test_when_vllms_reset_failed_the_retired_copies_removals_still_go_out(
        worker: Worker) -> None:
    """A request holds blocks at the reset: vLLM's own reset fails, no clear goes out."""
    worker.prefill("a", first=1000)
    hold_blocks(worker, "running", first=5 * 10**6)
    assert worker.engine.sched.reset_cache()
    assert worker.score(1000) == pytest.approx(IN_RAM)  # the old copy, as the router knows

    worker.prefill("b", first=10**6)
    worker.prefill("c", first=2 * 10**6)
    # RAM evicted the retired copy of "a": the router hears it (it was never cleared).
    assert worker.score(1000) == pytest.approx(ON_DISK)
    assert len(worker.removed()) == 8


def test_a_reset_while_an_ended_requests_blocks_are_kept_announces_removals(
        worker: Worker) -> None:
    """vLLM keeps an ended request's blocks until its stores are done (finished_sending):
    a reset before then fails in vLLM, and the old copies' removals go out."""
    worker.prefill("a", first=1000, settle=False)
    assert worker.engine.sched.reset_cache()
    worker.prefill("b", first=10**6)
    worker.prefill("c", first=2 * 10**6)
    assert worker.score(1000) == pytest.approx(ON_DISK)
    assert len(worker.removed()) == 8

    # The next reset finds every block free: vLLM clears, and retired copies leave quietly.
    assert worker.engine.sched.reset_cache()
    worker.cleared = True
    worker.prefill("b again", first=10**6)
    worker.prefill("d", first=3 * 10**6)  # RAM evicts the retired "c"
    assert worker.score(2 * 10**6) is None  # cleared (RAM and disk), never stored since
    assert worker.score(10**6) == pytest.approx(IN_RAM)
    assert len(worker.removed()) == 8


def test_a_chunk_of_before_the_reset_landing_after_it_is_removed_unannounced(
        worker: Worker) -> None:
    """A write-behind of an old chunk lands on disk after the tiers retired (so it is not
    retired there) and is never announced; its later removal is no news to the router
    either, which the clear told that every old chunk is gone."""
    worker.prefill("a", first=1000)
    old = worker.stored_keys()
    assert len(old) == 2
    assert worker.engine.sched.reset_cache()
    worker.cleared = True
    worker.prefill("again", first=1000)
    assert worker.score(1000) == pytest.approx(IN_RAM)
    worker.report(*(StoreEvent(EventKind.STORED, k, "disk") for k in old),
                  *(StoreEvent(EventKind.REMOVED, k, "disk") for k in old))
    assert worker.removed() == []
    assert worker.score(1000) == pytest.approx(IN_RAM)


def hold_blocks(worker: Worker, rid: str, first: int) -> None:
    """A request computing its prompt, holding blocks: vLLM's own reset fails now."""
    running = request(rid, PROMPT, first=first)
    blocks = list(range(PROMPT // BLOCK + 1))
    assert worker.engine.admit(running, blocks) == 0
    worker.run(worker.engine.step(new={rid: (blocks, 0, BLOCK)}))
    running.num_computed_tokens = BLOCK  # as vLLM's scheduler counts the step's tokens


def test_a_failed_reset_after_a_clear_leaves_the_cleared_copies_removals_unannounced(
        worker: Worker) -> None:
    """The clear told the router every chunk of before it was gone; a failed reset after it
    clears nothing, and brings none of them back: the retired copy of "a" from before the
    clear leaves RAM quietly, and the copy keyed between the two resets (still credited)
    is announced removed."""
    worker.prefill("a", first=1000)
    assert worker.engine.sched.reset_cache()
    worker.cleared = True
    worker.prefill("again", first=1000)  # the same prompt under new keys, announced
    hold_blocks(worker, "running", first=5 * 10**6)
    assert worker.engine.sched.reset_cache()  # vLLM's failed: no clear goes out
    assert worker.score(1000) == pytest.approx(IN_RAM)

    worker.prefill("b", first=10**6)  # RAM evicts the retired copy of "a" of before the clear
    assert worker.removed() == []
    assert worker.score(1000) == pytest.approx(IN_RAM), "the credited copy taken off with it"
    worker.prefill("c", first=2 * 10**6)  # and the copy "again", credited since the clear
    assert worker.score(1000) == pytest.approx(ON_DISK)
    assert len(worker.removed()) == 8


def test_a_chunk_keyed_before_a_failed_reset_is_removed_unannounced_after_the_next_clear(
        worker: Worker) -> None:
    """A failed reset between two clears: the chunks keyed before it are forgotten by the
    router at the second clear, and their late removal (a write-behind landing then) is no
    news, as for those keyed just before the clear."""
    worker.prefill("a", first=1000)
    first_copy = worker.stored_keys()
    assert worker.engine.sched.reset_cache()
    worker.cleared = True
    worker.prefill("again", first=1000, settle=False)  # its blocks kept for its stores
    second_copy = worker.stored_keys()[len(first_copy):]
    assert len(second_copy) == 2
    assert worker.engine.sched.reset_cache()  # vLLM's failed: "again" still credited
    for _ in range(2):  # its stores are done: its blocks are free
        worker.run(worker.engine.step())
    assert worker.engine.sched.reset_cache()
    worker.cleared = True
    worker.prefill("third", first=1000)
    assert worker.score(1000) == pytest.approx(IN_RAM)
    worker.report(*(StoreEvent(EventKind.STORED, k, "disk") for k in first_copy + second_copy),
                  *(StoreEvent(EventKind.REMOVED, k, "disk") for k in first_copy + second_copy))
    assert worker.removed() == []
    assert worker.score(1000) == pytest.approx(IN_RAM)


def test_a_reset_while_an_aborted_requests_load_is_in_flight_announces_removals(
        tmp_path: Path) -> None:
    """A request waiting for its asynchronous load is aborted: vLLM keeps its blocks until
    the load is reported done (finished_recving), so a reset before then fails in vLLM. vLLM
    marks the request finished before it tells the connector, so the request's status never
    said WAITING_FOR_REMOTE_KVS there: the reset was taken as cleared, and the retired copies'
    removals were dropped while the router still credited them."""
    from vllm.v1.request import RequestStatus

    from kvtier.core.locator import ChunkLocator
    from kvtier.integrations.vllm.config import ConnectorConfig
    from kvtier.integrations.vllm.scheduler.connector_scheduler import ConnectorScheduler

    engine = events_engine()
    engine.sched = ConnectorScheduler(
        ConnectorConfig.parse({"tokens_per_chunk": CHUNK, "event_block_size": BLOCK,
                               "load_mode": "async"}),
        block_size=BLOCK, model_id="tiny", layout_digest="0" * 32,
        locator=ChunkLocator({}, max_keys=1024), tier_kinds={"memory": "memory", "disk": "disk"},
        emit_events=True)
    worker = Worker(engine, tmp_path)
    try:
        worker.prefill("a", first=1000)
        loading = request("loading", PROMPT, first=1000)
        hit, load_async = engine.sched.get_num_new_matched_tokens(loading, 0)
        assert hit == 2 * CHUNK and load_async
        blocks = list(range(100, 100 + PROMPT // BLOCK + 1))
        engine.sched.update_state_after_alloc(
            loading, SimpleNamespace(get_block_ids=lambda: (blocks,)), hit)
        loading.status = RequestStatus.WAITING_FOR_REMOTE_KVS
        plan = engine.step()
        assert "loading" in plan.async_loads
        worker.run(plan)  # the load is under way on the worker: not reported done yet
        # Aborted, as vLLM's finish_requests does it: status first, then the connector.
        loading.status = RequestStatus.FINISHED_ABORTED
        assert not engine.sched.request_finished(loading)
        assert engine.sched.reset_cache()  # vLLM's own failed: the loading blocks are kept

        worker.prefill("b", first=10**6)
        worker.prefill("c", first=2 * 10**6)
        # RAM evicted the retired copy of "a": the router hears it (it was never cleared).
        assert worker.score(1000) == pytest.approx(ON_DISK)
        assert len(worker.removed()) == 8
    finally:
        worker.store.close()
