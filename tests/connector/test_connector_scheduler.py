"""The connector's scheduler side, driven the way vLLM's scheduler drives it, step by step.

Pure logic on real vLLM `Request`s (importing vllm takes a few seconds; no engine): what it
offers to load, where loads land, which chunks each step stores, how a failed load is kept
out of the cache, and the per-request controls. Chunks of 64 tokens over vLLM blocks of 32.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("vllm")

from vllm import SamplingParams
from vllm.v1.outputs import KVConnectorOutput
from vllm.v1.request import Request

from kvtier.core.keys import ChunkKey
from kvtier.core.locator import ChunkLocator
from kvtier.integrations.vllm.config import ConnectorConfig
from kvtier.integrations.vllm.messages import KVTierMetadata, KVTierWorkerMetadata
from kvtier.integrations.vllm.scheduler.connector_scheduler import ConnectorScheduler
from kvtier.integrations.vllm.scheduler.storeplan import stores_async
from kvtier.integrations.vllm.transfers import chunk_meta

CHUNK, BLOCK = 64, 32


def request(rid: str, num_tokens: int, salt: str | None = None,
            params: dict[str, Any] | None = None, first: int = 1000) -> Request:
    """A prompt of `num_tokens` consecutive token ids from `first` (equal prefixes for
    equal `first`)."""
    extra = {"kv_transfer_params": params} if params else None
    return Request(rid, list(range(first, first + num_tokens)),
                   SamplingParams(max_tokens=16, extra_args=extra), None, cache_salt=salt)


class Engine:
    """vLLM's side of the conversation: lookups, allocations, steps and worker reports."""

    last_plan: KVTierMetadata | None = None  # the plan of the last step

    def __init__(self, locator: ChunkLocator | None = None, **settings: Any) -> None:
        self.locator = locator or ChunkLocator({}, max_keys=1024)
        config = ConnectorConfig.parse({"tokens_per_chunk": CHUNK, **settings})
        self.sched = ConnectorScheduler(config,
                                        block_size=BLOCK, model_id="tiny",
                                        layout_digest="0" * 32, locator=self.locator)

    def admit(self, req: Request, blocks: list[int], local_tokens: int = 0) -> int:
        """Ask how much kvtier can load beyond vLLM's `local_tokens`, allocate `blocks`."""
        external, is_async = self.sched.get_num_new_matched_tokens(req, local_tokens)
        assert external is not None and not is_async
        self.sched.update_state_after_alloc(
            req, SimpleNamespace(get_block_ids=lambda: (blocks,)), external)
        return external

    def step(self, new: dict[str, tuple[list[int], int, int]] | None = None,
             cached: dict[str, tuple[list[int], int, int]] | None = None,
             preempted: set[str] | None = None, resumed: set[str] | None = None
             ) -> KVTierMetadata:
        """One step's plan. `new`/`cached`: req id -> (new block ids, computed tokens before
        the step, tokens the step computes)."""
        new, cached = new or {}, cached or {}
        output = SimpleNamespace(
            scheduled_new_reqs=[SimpleNamespace(req_id=r, block_ids=(b,), num_computed_tokens=c)
                                for r, (b, c, _) in new.items()],
            scheduled_cached_reqs=SimpleNamespace(
                req_ids=list(cached), new_block_ids=[(b,) if b else None
                                                     for b, _, _ in cached.values()],
                num_computed_tokens=[c for _, c, _ in cached.values()],
                resumed_req_ids=resumed or set()),
            num_scheduled_tokens={r: n for r, (_, _, n) in (new | cached).items()},
            preempted_req_ids=preempted or set())
        self.last_plan = self.sched.build_connector_meta(output)  # type: ignore[arg-type]
        return self.last_plan

    def report(self, **fields: Any) -> None:
        """A worker's report at the end of the last step: its synchronous stores are done, or
        (asynchronous) those of the plans before it (`stores_through`)."""
        plan = self.last_plan
        lag = 1 if plan is not None and plan.stores_async else 0
        fields.setdefault("stores_through", (plan.step if plan is not None else 0) - lag)
        self.sched.update_connector_output(
            KVConnectorOutput(kv_connector_worker_meta=KVTierWorkerMetadata(**fields)))

    def store_all(self, meta: KVTierMetadata) -> list[ChunkKey]:
        """A worker that stores every planned chunk and says so."""
        keys = [t.key for t in meta.stores]
        self.report(stored=set(keys))
        return keys


class NodeRam:
    """A node's RAM as the scheduler's inline probe sees it: what it holds now (it evicts
    without telling this engine)."""

    blocking_ok = True

    def __init__(self) -> None:
        self.held: set[ChunkKey] = set()

    def contains(self, key: ChunkKey) -> bool:
        return key in self.held

    def close(self) -> None:
        return


def test_in_node_mode_a_chunk_the_node_lost_is_stored_again_once_computed_again() -> None:
    """The node evicted (or lost in a restart) the chunks this engine stored: the prompt
    misses, is recomputed, and its chunks are stored again. Before: the engine's index of what
    it stored (which answers only while the node is down) kept them from being stored ever
    again, and the prompt missed on this engine for good (found by trying)."""
    ram = NodeRam()
    engine = Engine(ChunkLocator({"node": ram}, max_keys=1024, index_first=False))
    a = request("a", 200)
    assert engine.admit(a, list(range(7))) == 0
    stored = engine.store_all(engine.step(new={"a": (list(range(7)), 0, 200)}))
    assert len(stored) == 3
    engine.sched.request_finished(a)
    ram.held |= set(stored)
    assert engine.admit(request("b", 200), list(range(10, 17))) == 192
    ram.held.clear()  # evicted by other engines' stores, or the node restarted empty
    c = request("c", 200)
    assert engine.admit(c, list(range(20, 27))) == 0
    meta = engine.step(new={"c": (list(range(20, 27)), 0, 200)})
    assert [t.key for t in meta.stores] == stored


def test_a_new_prompt_misses_and_its_prefill_stores_every_full_chunk() -> None:
    engine = Engine()
    req = request("a", 200)
    assert engine.admit(req, list(range(7))) == 0
    meta = engine.step(new={"a": (list(range(7)), 0, 200)})
    assert meta.loads == {}
    # 200 tokens: chunks 0-2 are full (192 tokens), the last 8 tokens are not stored.
    assert [t.block_ids for t in meta.stores] == [(0, 1), (2, 3), (4, 5)]
    assert all(t.depends_on == () for t in meta.stores)
    # Each chunk names the one its prefix ends with, for the "prefix" eviction policy.
    keys = [t.key for t in meta.stores]
    assert [t.parent for t in meta.stores] == [None, *keys[:-1]]
    assert [chunk_meta(t).parent for t in meta.stores] == [None, *keys[:-1]]


def test_a_returning_prompt_loads_whole_chunks_and_the_step_stores_what_follows() -> None:
    engine = Engine()
    first = request("a", 200)
    engine.admit(first, list(range(7)))
    stored = engine.store_all(engine.step(new={"a": (list(range(7)), 0, 200)}))
    engine.sched.request_finished(first)
    # The same 200 tokens and 60 more: 3 chunks held, the 4th completes in this step.
    again = request("b", 260)
    blocks = list(range(10, 19))
    assert engine.admit(again, blocks) == 192
    meta = engine.step(new={"b": (blocks, 192, 68)})
    assert [(t.key, t.block_ids, t.first_block) for t in meta.loads["b"]] == [
        (stored[0], (10, 11), 0), (stored[1], (12, 13), 0), (stored[2], (14, 15), 0)]
    # Each names its parent, as its store did: promoted from a lower tier into a "prefix"
    # policy's RAM, a chunk extends its prefix there rather than make its parent a leaf.
    assert [chunk_meta(t).parent for t in meta.loads["b"]] == [None, *stored[:-1]]
    [store] = meta.stores
    assert store.block_ids == (16, 17)
    # Its KV is computed over the loaded blocks: it names them, should a load fail.
    assert store.depends_on == (10, 11, 12, 13, 14, 15)


def test_loads_start_after_vllms_own_cached_blocks() -> None:
    engine = Engine()
    engine.admit(request("a", 200), list(range(7)))
    engine.store_all(engine.step(new={"a": (list(range(7)), 0, 200)}))
    # vLLM holds 3 blocks (96 tokens) itself: chunk 1's first block is not written.
    again = request("b", 200)
    assert engine.admit(again, [0, 1, 2, 20, 21, 22, 23], local_tokens=96) == 96
    meta = engine.step(new={"b": ([0, 1, 2, 20, 21, 22, 23], 192, 8)})
    assert [(t.block_ids, t.first_block) for t in meta.loads["b"]] == [((2, 20), 1), ((21, 22), 0)]


def test_a_failed_load_is_never_stored_and_is_stored_once_recomputed() -> None:
    engine = Engine()
    engine.admit(request("a", 200), list(range(7)))
    held = engine.store_all(engine.step(new={"a": (list(range(7)), 0, 200)}))
    req = request("b", 260)
    blocks = list(range(10, 19))
    engine.admit(req, blocks)
    meta = engine.step(new={"b": (blocks, 192, 68)})
    later = meta.stores[0].key
    # The worker: chunk 1 was corrupt (blocks 12-15 unfilled), so it refused the store of
    # chunk 3 computed over them.
    engine.report(missing={held[1]}, skipped={later}, failed_blocks={12, 13, 14, 15})
    # vLLM recomputes from block 12 (token 64): the next plan acknowledges the failure to
    # the workers, and stores the corrupt chunk 1 and the refused chunk 3 once this step has
    # recomputed them (chunk 2 is still held: its load was only abandoned after chunk 1's).
    meta = engine.step(cached={"b": ([], 64, 196)})
    assert meta.acked_failed_blocks == {12, 13, 14, 15}
    assert [t.key for t in meta.stores] == [held[1], later]
    assert engine.step().acked_failed_blocks == set()


def test_a_decode_token_that_completes_a_chunk_stores_it() -> None:
    engine = Engine()
    req = request("a", 100)
    engine.admit(req, [0, 1, 2, 3])
    # Chunk 0, and the prompt's tail: its block past chunk 0 (tokens 64-96).
    assert [t.block_ids for t in engine.step(new={"a": ([0, 1, 2, 3], 0, 100)}).stores] \
        == [(0, 1), (2,)]
    for computed in range(100, 128):
        req.append_output_token_ids(7)
        meta = engine.step(cached={"a": ([], computed, 1)})
        assert len(meta.stores) == (1 if computed == 127 else 0)
    assert meta.stores[0].block_ids == (2, 3)


def test_a_preempted_request_stores_its_unstored_chunks_from_its_new_blocks() -> None:
    engine = Engine()
    req = request("a", 200)
    engine.admit(req, list(range(7)))
    meta = engine.step(new={"a": (list(range(7)), 0, 128)})  # chunked prefill: 2 chunks
    engine.report(stored={meta.stores[0].key})  # chunk 1's store was dropped
    engine.step(preempted={"a"})
    engine.report()  # asynchronous stores: the step after theirs reports them (none)
    meta = engine.step(cached={"a": (list(range(30, 37)), 0, 200)}, resumed={"a"})
    assert [t.block_ids for t in meta.stores] == [(32, 33), (34, 35)]  # chunks 1 and 2


def test_skip_load_skip_store_and_max_offload_tokens() -> None:
    engine = Engine()
    engine.admit(request("a", 200), list(range(7)))
    engine.store_all(engine.step(new={"a": (list(range(7)), 0, 200)}))
    assert engine.admit(request("b", 200, params={"skip_load": True}), list(range(7))) == 0
    skip = request("c", 300, params={"skip_store": True}, first=5000)
    engine.admit(skip, list(range(20, 30)))
    assert engine.step(new={"c": (list(range(20, 30)), 0, 300)}).stores == []
    capped = request("d", 300, params={"max_offload_tokens": 130}, first=9000)
    engine.admit(capped, list(range(40, 50)))
    assert len(engine.step(new={"d": (list(range(40, 50)), 0, 300)}).stores) == 2


def test_different_cache_salts_never_share_chunks() -> None:
    engine = Engine()
    engine.admit(request("a", 200, salt="tenant-a"), list(range(7)))
    engine.store_all(engine.step(new={"a": (list(range(7)), 0, 200)}))
    assert engine.admit(request("b", 200, salt="tenant-b"), list(range(10, 17))) == 0
    assert engine.admit(request("c", 200, salt="tenant-a"), list(range(20, 27))) == 192


def two_tiers(path: Any) -> dict[str, Any]:
    """Settings of a RAM tier over a disk tier at `path`."""
    return {"tiers": [{"kind": "memory", "capacity": "64MiB"},
                      {"kind": "disk", "path": str(path), "capacity": "64MiB"}]}


def test_a_hit_held_in_ram_loads_inline_and_one_below_it_loads_async(tmp_path: Any) -> None:
    from kvtier.core.store import StoreEvent
    from kvtier.core.tier import EventKind

    engine = Engine(**two_tiers(tmp_path))
    engine.admit(request("a", 200), list(range(7)))
    held = engine.store_all(engine.step(new={"a": (list(range(7)), 0, 200)}))
    # In RAM (the workers reported the stores): a memcpy, loaded within the step.
    assert engine.sched.get_num_new_matched_tokens(request("b", 200), 0) == (192, False)
    # RAM evicted chunk 1 (it lives on in a lower tier): the hit is loaded while the engine
    # runs the other requests, and the plan carries it apart.
    engine.report(events=[StoreEvent(EventKind.REMOVED, held[1], "memory")])
    late = request("c", 200)
    assert engine.sched.get_num_new_matched_tokens(late, 0) == (192, True)
    engine.sched.update_state_after_alloc(
        late, SimpleNamespace(get_block_ids=lambda: (list(range(10, 17)),)), 192)
    meta = engine.step()
    assert meta.loads == {} and [t.key for t in meta.async_loads["c"]] == held


def test_auto_weighs_a_hit_by_the_measured_cost_of_loads_and_steps(tmp_path: Any) -> None:
    """Once the workers' loads and the engine's steps are timed (loadcost.py), a hit below
    RAM that loads quickly is loaded inline while others run, and a RAM hit whose loads take
    long is loaded asynchronously."""
    from kvtier.core.store import StoreEvent
    from kvtier.core.tier import EventKind
    from kvtier.integrations.vllm.scheduler.stepcost import MIN_STEPS
    from kvtier.integrations.vllm.transfers import LoadSample

    for ram_s, lower_s, evicted, loads_async in ((1e-9, 1e-9, True, False),
                                                 (30.0, 30.0, False, True)):
        engine = Engine(**two_tiers(tmp_path), load_when="always")
        engine.admit(request("a", 200), list(range(7)))
        held = engine.store_all(engine.step(new={"a": (list(range(7)), 0, 200)}))
        for _ in range(MIN_STEPS):  # "a" decodes: steps the scheduler times
            engine.step(cached={"a": ([], 200, 1)})
        if evicted:  # chunk 1 lives on below RAM only
            engine.report(events=[StoreEvent(EventKind.REMOVED, held[1], "memory")])
        # Before any load is timed: by where the hit lives.
        assert engine.sched.get_num_new_matched_tokens(request("b", 200), 0) == (192, evicted)
        engine.report(load_samples=[LoadSample((("memory", 3),), 3 * ram_s),
                                    LoadSample((("disk", 3),), 3 * lower_s)])
        assert engine.sched.get_num_new_matched_tokens(request("c", 200), 0) == (192, loads_async)


def test_load_mode_forces_either_way_and_a_failed_load_is_not_asked_again() -> None:
    engine = Engine(load_mode="async")
    engine.admit(request("a", 200), list(range(7)))
    held = engine.store_all(engine.step(new={"a": (list(range(7)), 0, 200)}))
    req = request("b", 200)
    assert engine.sched.get_num_new_matched_tokens(req, 0) == (192, True)
    engine.sched.update_state_after_alloc(
        req, SimpleNamespace(get_block_ids=lambda: (list(range(10, 17)),)), 192)
    assert "b" in engine.step().async_loads
    engine.report(missing={held[0]}, failed_blocks=set(range(10, 16)))
    # vLLM frees its blocks and asks again: kvtier says recompute (a stalled tier would fail
    # again and keep the request waiting).
    assert engine.sched.get_num_new_matched_tokens(req, 0) == (0, False)
    with pytest.raises(Exception, match="load_mode"):
        ConnectorConfig.parse({"load_mode": "sometimes"})


def test_an_idle_engine_loads_even_a_disk_hit_inline() -> None:
    """No other request runs: there is no batch to protect, and an asynchronous load would
    cost the request one more step."""
    from kvtier.core.store import StoreEvent
    from kvtier.core.tier import EventKind

    engine = Engine()
    first = request("a", 200)
    engine.admit(first, list(range(7)))
    held = engine.store_all(engine.step(new={"a": (list(range(7)), 0, 200)}))
    engine.report(events=[StoreEvent(EventKind.REMOVED, key, "memory") for key in held])
    engine.sched.request_finished(first)
    assert engine.sched.get_num_new_matched_tokens(request("b", 200), 0) == (192, False)


def test_a_hit_below_ram_waiting_for_blocks_is_prefetched_into_ram_once(tmp_path: Any) -> None:
    """vLLM looked the request up but had no blocks for it (no update_state_after_alloc):
    its chunks below RAM are read into RAM ahead of the load, each asked once; once the
    workers report them in RAM, the load is inline."""
    from kvtier.core.store import StoreEvent
    from kvtier.core.tier import EventKind

    engine = Engine(**two_tiers(tmp_path))
    first = request("a", 200)
    engine.admit(first, list(range(7)))
    held = engine.store_all(engine.step(new={"a": (list(range(7)), 0, 200)}))
    engine.report(events=[StoreEvent(EventKind.REMOVED, key, "memory") for key in held[1:]])
    waiting = request("b", 200)
    assert engine.sched.get_num_new_matched_tokens(waiting, 0) == (192, True)
    prefetch = engine.step(cached={"a": ([], 200, 1)}).prefetch
    assert [t.key for t in prefetch] == held[1:]  # not chunk 0: in RAM
    assert [t.parent for t in prefetch] == held[:-1]
    # Still waiting next step (asked again): not prefetched twice.
    engine.sched.get_num_new_matched_tokens(waiting, 0)
    assert engine.step(cached={"a": ([], 201, 1)}).prefetch == []
    # The prefetch promoted them: the load is a memcpy, inline, and nothing is prefetched.
    engine.report(events=[StoreEvent(EventKind.STORED, key, "memory") for key in held[1:]])
    assert engine.sched.get_num_new_matched_tokens(waiting, 0) == (192, False)
    engine.sched.update_state_after_alloc(
        waiting, SimpleNamespace(get_block_ids=lambda: (list(range(10, 17)),)), 192)
    meta = engine.step(new={"b": (list(range(10, 17)), 192, 8)})
    assert meta.prefetch == [] and [t.key for t in meta.loads["b"]] == held


def test_a_request_that_skips_prefix_cache_reads_is_neither_offered_nor_prefetched(
        tmp_path: Any) -> None:
    """A request asking for prompt logprobs (vLLM's `skip_reading_prefix_cache`: computed
    whole, vLLM drops any connector hit) waits for blocks: kvtier offers it nothing and reads
    none of its chunks below RAM ahead (before, an asynchronous hit was offered and read)."""
    from kvtier.core.store import StoreEvent
    from kvtier.core.tier import EventKind

    engine = Engine(**two_tiers(tmp_path))
    first = request("a", 200)
    engine.admit(first, list(range(7)))
    held = engine.store_all(engine.step(new={"a": (list(range(7)), 0, 200)}))
    engine.report(events=[StoreEvent(EventKind.REMOVED, key, "memory") for key in held[1:]])
    logprobs = Request("b", list(range(1000, 1200)),
                       SamplingParams(max_tokens=4, prompt_logprobs=1), None)
    assert engine.sched.get_num_new_matched_tokens(logprobs, 0) == (0, False)
    assert engine.step(cached={"a": ([], 200, 1)}).prefetch == []


def test_a_prefetch_carries_its_requests_tenant(tmp_path: Any) -> None:
    """A tier that seals a tenant's chunks opens them with that tenant's key: the prefetch of
    a salted request's chunks says whose they are (before, bare keys: a process that had not
    seen the tenant read them as unsalted, and the chunks failed to open)."""
    from kvtier.core.store import StoreEvent
    from kvtier.core.tier import EventKind

    engine = Engine(**two_tiers(tmp_path))
    engine.admit(request("a", 200, salt="tenant-a"), list(range(7)))
    held = engine.store_all(engine.step(new={"a": (list(range(7)), 0, 200)}))
    engine.report(events=[StoreEvent(EventKind.REMOVED, key, "memory") for key in held])
    assert engine.sched.get_num_new_matched_tokens(request("b", 200, salt="tenant-a"), 0)[0]
    prefetch = engine.step(cached={"a": ([], 200, 1)}).prefetch
    assert [t.key for t in prefetch] == held
    assert {t.tenant for t in prefetch} == {"tenant-a"}


def test_an_allocated_or_finished_request_is_not_prefetched(tmp_path: Any) -> None:
    from kvtier.core.store import StoreEvent
    from kvtier.core.tier import EventKind

    engine = Engine(**two_tiers(tmp_path))
    engine.admit(request("a", 200), list(range(7)))
    held = engine.store_all(engine.step(new={"a": (list(range(7)), 0, 200)}))
    engine.report(events=[StoreEvent(EventKind.REMOVED, key, "memory") for key in held])
    allocated, gone = request("b", 200), request("c", 200)
    assert engine.sched.get_num_new_matched_tokens(allocated, 0) == (192, True)
    engine.sched.update_state_after_alloc(
        allocated, SimpleNamespace(get_block_ids=lambda: (list(range(10, 17)),)), 192)
    engine.sched.get_num_new_matched_tokens(gone, 0)
    engine.sched.request_finished(gone)
    assert engine.step().prefetch == []


def test_a_prefetched_chunk_ram_evicts_again_is_prefetched_again() -> None:
    from kvtier.core.store import StoreEvent
    from kvtier.core.tier import EventKind

    engine = Engine()
    engine.admit(request("a", 200), list(range(7)))
    held = engine.store_all(engine.step(new={"a": (list(range(7)), 0, 200)}))
    engine.report(events=[StoreEvent(EventKind.REMOVED, key, "memory") for key in held])
    waiting = request("b", 200)
    engine.sched.get_num_new_matched_tokens(waiting, 0)
    assert [t.key for t in engine.step(cached={"a": ([], 200, 1)}).prefetch] == held
    # Prefetched, then evicted again before vLLM had blocks for the request: asked again.
    engine.report(events=[StoreEvent(kind, key, "memory") for key in held
                          for kind in (EventKind.STORED, EventKind.REMOVED)])
    engine.sched.get_num_new_matched_tokens(waiting, 0)
    assert [t.key for t in engine.step(cached={"a": ([], 201, 1)}).prefetch] == held


def test_a_request_ending_while_its_stores_may_run_is_held_one_step() -> None:
    """Asynchronous stores (store_mode "auto"): a request whose chunks the last two plans
    stored may still be gathered when it ends; vLLM keeps its blocks until the workers report
    it (the next plan names it). One whose stores are older is freed at once."""
    engine = Engine()
    quick, slow = request("a", 200), request("b", 100, first=5000)
    engine.admit(quick, list(range(7)))
    engine.admit(slow, list(range(10, 14)))
    meta = engine.step(new={"a": (list(range(7)), 0, 200), "b": (list(range(10, 14)), 0, 100)})
    assert meta.stores_async and len(meta.stores) == 5  # a: 3 chunks, b: 1 and its tail
    assert engine.sched.request_finished(quick) is True  # its stores are this step's
    meta = engine.step(cached={"b": ([], 100, 1)})
    assert meta.held == {"a"} and meta.stores == []
    engine.step(cached={"b": ([], 101, 1)})
    assert engine.sched.request_finished(slow) is False  # its store ran two steps ago
    assert engine.step().held == set()


def test_store_mode_sync_holds_nothing_and_async_is_refused_where_blocks_move() -> None:
    engine = Engine()
    engine.sched = ConnectorScheduler(
        ConnectorConfig.parse({"tokens_per_chunk": CHUNK, "store_mode": "sync"}),
        block_size=BLOCK, model_id="tiny", layout_digest="0" * 32, locator=engine.locator)
    req = request("a", 200)
    engine.admit(req, list(range(7)))
    assert not engine.step(new={"a": (list(range(7)), 0, 200)}).stores_async
    assert engine.sched.request_finished(req) is False
    assert stores_async("auto", several_groups=False, kv_role="kv_both")
    assert not stores_async("auto", several_groups=True, kv_role="kv_both")  # sliding windows
    assert not stores_async("async", several_groups=True, kv_role="kv_both")
    assert not stores_async("auto", several_groups=False, kv_role="kv_producer")
    with pytest.raises(Exception, match="store_mode"):
        ConnectorConfig.parse({"store_mode": "later"})


def test_a_preempted_request_is_named_in_the_plan_and_its_inflight_store_not_planned_twice(
) -> None:
    engine = Engine()
    first, twin = request("a", 200), request("b", 200)  # the same tokens
    engine.admit(first, list(range(7)))
    stores = engine.step(new={"a": (list(range(7)), 0, 200)}).stores
    # The twin arrives before the stores are reported (asynchronous: a step later).
    engine.admit(twin, list(range(10, 17)))
    meta = engine.step(new={"b": (list(range(10, 17)), 0, 200)}, preempted={"a"})
    assert meta.preempted == {"a"}
    assert meta.stores == []  # the same chunks are in flight: not gathered twice
    engine.report(stored={t.key for t in stores})
    assert engine.admit(request("c", 200), list(range(20, 27))) == 192


def test_a_cache_reset_offers_no_chunk_stored_before_and_retires_once() -> None:
    """vLLM's reset_prefix_cache(reset_connector=True) after a weight update in place (issue
    41): a prompt stored before is a miss, from the index and from every tier (new keys); the
    next plan, and only it, has the workers retire their tiers' chunks; the new chunks are
    stored and hit again."""
    engine = Engine()
    first = request("a", 200)
    engine.admit(first, list(range(7)))
    old = engine.store_all(engine.step(new={"a": (list(range(7)), 0, 200)}))
    engine.sched.request_finished(first)
    assert len(old) == 3 and engine.admit(request("z", 200), list(range(7))) == 192
    engine.sched.request_finished(request("z", 200))
    assert engine.sched.reset_cache() is True
    again = request("b", 200)
    assert engine.admit(again, list(range(7))) == 0
    meta = engine.step(new={"b": (list(range(7)), 0, 200)})
    assert meta.retire and not engine.step().retire
    new = [t.key for t in meta.stores]
    assert len(new) == 3 and not set(new) & set(old)
    engine.report(stored=set(new))
    assert engine.admit(request("c", 200), list(range(7))) == 192  # the new weights' chunks


def test_a_request_holding_kv_from_before_a_reset_is_never_stored_and_a_waiting_one_is_rekeyed(
        ) -> None:
    """A request whose blocks hold KV computed before the reset (old weights) would store it
    under the new weights' keys: it is never stored or looked up again (counted). One still
    waiting (no KV yet) is keyed anew and stored as usual."""
    engine = Engine()
    running, waiting = request("a", 200), request("w", 200, first=5000)
    engine.admit(running, list(range(7)))
    engine.step(new={"a": (list(range(7)), 0, 128)})  # prefilled 128 of its 200 tokens
    running.num_computed_tokens = 128
    assert engine.admit(waiting, []) == 0  # looked up, no blocks yet
    engine.sched.reset_cache()
    meta = engine.step(new={"w": (list(range(10, 17)), 0, 200)},
                       cached={"a": ([], 128, 72)})
    assert [t.block_ids for t in meta.stores] == [(10, 11), (12, 13), (14, 15)]
    assert engine.sched.get_num_new_matched_tokens(running, 0) == (0, False)
    assert engine.sched.take_stats().data["counters"]["uncacheable_requests"] == {"": 1}
