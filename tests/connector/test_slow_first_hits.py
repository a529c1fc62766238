"""No hit slower than a miss, from the first request (issue 45).

A fresh engine knows no tier's restore cost until a load is timed, so the rule loaded every
first hit, however slow the tier's link. Here, with real objects on both sides: a worker over a
real store (a small memory tier over a redis tier behind an emulated link,
kvtier.testing.netem) measures the link at start-up and reports each remote tier's estimated
seconds per chunk; the scheduler (real vLLM `Request`s, test_connector_scheduler's `Engine`)
takes them as the rule's prior: a slow link's first hit is recomputed, a fast one's loaded.
And a load that turns out slow is bounded: each load carries a budget (its expected
recompute), and what has not landed by then is abandoned and recomputed, counted as
`load_too_slow`, its blocks never written once abandoned, its tier not marked stalled.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

pytest.importorskip("vllm")

import torch
from redis_server import RedisServer
from test_connector_scheduler import CHUNK, Engine, request
from test_worker_copy import BS, one_allocation_cpu_kv

from kvtier.core.keys import ChunkKey
from kvtier.core.store import StoreEvent, TieredStore
from kvtier.core.tier import EventKind
from kvtier.integrations.vllm.messages import ChunkTransfer, KVTierMetadata
from kvtier.integrations.vllm.scheduler.loadplan import MIN_LOAD_BUDGET_S
from kvtier.integrations.vllm.worker.connector_worker import ConnectorWorker, PagedKV
from kvtier.testing.netem import delayed_proxy
from kvtier.tiers import open_store
from kvtier.tiers.storeconfig import StoreConfig

pytestmark = [pytest.mark.redis]

BLOCKS_PER_CHUNK = 8  # 64 KiB chunks: 26 ms each over a 20 Mbit/s link
CHUNKS = 12
SLOW_GBPS = 0.02


@contextmanager
def worker_over_redis(server: RedisServer, gbps: float | None
                      ) -> Iterator[tuple[ConnectorWorker, TieredStore, PagedKV]]:
    """A worker over a 2-chunk memory tier and a redis tier reached through a link of
    `gbps` (None: uncapped), 0.25 ms each way."""
    paged = PagedKV(one_allocation_cpu_kv(blocks=2 * CHUNKS * BLOCKS_PER_CHUNK), BS)
    layout = paged.layout(BS * BLOCKS_PER_CHUNK)
    with delayed_proxy("127.0.0.1", server.port, 0.25, gbps) as link:
        store = open_store(StoreConfig.parse({"tiers": [
            {"kind": "memory", "capacity": 2 * layout.bytes_per_chunk, "pin": "off"},
            {"kind": "redis", "url": f"redis://{link.host}:{link.port}/0", "capacity": 0,
             "socket_timeout_ms": 10000}]}),
            layout)
        worker = ConnectorWorker(paged, layout, store, load_batch=4)
        try:
            yield worker, store, paged
        finally:
            worker.close()


def priors_reported(worker: ConnectorWorker, timeout_s: float = 20.0) -> dict[str, float]:
    """The tier estimates the worker's start-up measure puts in a report."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        report = worker.take_report()
        if report is not None and report.tier_priors_s:
            return report.tier_priors_s
        time.sleep(0.05)
    raise AssertionError("no tier estimate reported")


def timed_prefills(engine: Engine, seconds: float) -> None:
    """Prefill steps of 200 tokens that take `seconds` each: the engine's recompute cost
    (stepcost.py) is then about `seconds` for a 192-token hit."""
    for i in range(4):
        engine.step(new={f"p{i}": (list(range(7)), 0, 200)})
        time.sleep(seconds)
    engine.step()


@pytest.mark.parametrize("gbps, loaded", [(SLOW_GBPS, False), (None, True)])
def test_a_slow_links_first_hit_is_recomputed_and_a_fast_ones_loaded(
        redis_server: RedisServer, gbps: float | None, loaded: bool) -> None:
    with worker_over_redis(redis_server, gbps) as (worker, _, _):
        priors = priors_reported(worker)
    assert set(priors) == {"redis"}
    engine = Engine(tiers=[{"kind": "memory", "capacity": "64MiB"},
                           {"kind": "redis", "url": redis_server.url, "capacity": 0}])
    engine.admit(request("a", 200), list(range(7)))
    held = engine.store_all(engine.step(new={"a": (list(range(7)), 0, 200)}))
    timed_prefills(engine, 0.05)
    # RAM evicted the prompt (it lives on in redis), and no load was ever timed: the rule
    # has only the worker's estimate of the link (64 KiB chunks: 26 ms each at 20 Mbit/s,
    # 3 chunks against a ~50 ms recompute; well under a millisecond uncapped).
    engine.report(events=[StoreEvent(EventKind.REMOVED, k, "memory") for k in held],
                  tier_priors_s=priors)
    external, _ = engine.sched.get_num_new_matched_tokens(request("b", 200), 0)
    assert external == (3 * CHUNK if loaded else 0)


def keys_in_redis_only(worker: ConnectorWorker, store: TieredStore) -> list[ChunkKey]:
    """CHUNKS chunks stored from blocks 0.., then dropped from RAM: held by redis only."""
    keys = [ChunkKey(b"slow" + i.to_bytes(12, "big")) for i in range(CHUNKS)]
    worker.store(KVTierMetadata(stores=[
        ChunkTransfer(k, tuple(range(i * BLOCKS_PER_CHUNK, (i + 1) * BLOCKS_PER_CHUNK)))
        for i, k in enumerate(keys)]))
    assert store.flush(timeout_s=30)
    for k in keys:
        store.tiers[0].delete(k)
    return keys


def into_second_half(keys: list[ChunkKey]) -> list[ChunkTransfer]:
    """Loads of `keys` into blocks after the stored ones."""
    first = CHUNKS * BLOCKS_PER_CHUNK
    return [ChunkTransfer(k, tuple(range(first + i * BLOCKS_PER_CHUNK,
                                         first + (i + 1) * BLOCKS_PER_CHUNK)))
            for i, k in enumerate(keys)]


def blocks_written(paged: PagedKV, transfers: list[ChunkTransfer]) -> list[bool]:
    """Per chunk: whether its target blocks hold anything but zeros."""
    return [any(bool(t[list(tr.block_ids)].abs().sum() > 0) for t in paged.tensors)
            for tr in transfers]


@pytest.mark.timing  # the budget is a wall-clock bound
@pytest.mark.parametrize("mode", ["inline", "async"])
def test_a_load_past_its_budget_is_abandoned_counted_and_never_written_later(
        redis_server: RedisServer, mode: str) -> None:
    """12 chunks of 64 KiB over a 20 Mbit/s link take ~0.4 s to load; with a budget of
    0.1 s the load gives up at 0.1 s: the chunks landed by then are kept, the rest are
    failed blocks (vLLM recomputes them), lost as load_too_slow, and no block is written
    once the load returned, though its abandoned reads still land."""
    with worker_over_redis(redis_server, SLOW_GBPS) as (worker, store, paged):
        priors_reported(worker)  # the start-up measure is done: the link is ours
        keys = keys_in_redis_only(worker, store)
        transfers = into_second_half(keys)
        for tensor in paged.tensors:
            tensor[CHUNKS * BLOCKS_PER_CHUNK:] = 0
        worker.take_stats()
        meta = KVTierMetadata(load_budgets_s={"r": 0.1})
        started = time.monotonic()
        if mode == "inline":
            meta.loads = {"r": transfers}
            worker.load(meta)
        else:
            meta.async_loads = {"r": transfers}
            worker.start_async(meta)
            while not worker.take_finished_loads():
                time.sleep(0.005)
        elapsed_s = time.monotonic() - started
        assert elapsed_s < 0.35, elapsed_s  # the whole load: ~0.4 s, plus the ramp
        stats = worker.take_stats()
        assert stats is not None
        counters = stats.data["counters"]
        loaded_chunks = counters.get("loaded_tokens", {}).get("", 0) // (BS * BLOCKS_PER_CHUNK)
        assert loaded_chunks < CHUNKS
        assert counters["lost_hit_tokens"] == {
            "load_too_slow": (CHUNKS - loaded_chunks) * BS * BLOCKS_PER_CHUNK}
        failed = worker.take_failed_block_ids()
        assert failed == {b for t in transfers[loaded_chunks:] for b in t.block_ids}
        # The chunks loaded are in their blocks; a chunk landed out of order past the miss
        # may be too (its blocks are failed: vLLM recomputes over them, as after any miss);
        # nothing is written once the load returned, though its reads still land.
        written = blocks_written(paged, transfers)
        assert written[:loaded_chunks] == [True] * loaded_chunks
        assert not all(written)
        after_return = [t.clone() for t in paged.tensors]
        time.sleep(0.6)  # every read abandoned has landed by now
        assert all(torch.equal(t, before) for t, before in zip(paged.tensors, after_return,
                                                                strict=True))
        # Slow for this load, not stalled: the tier is not skipped afterwards.
        assert store.stats().failures.get("redis", {}).get("timeout", 0) == 0


def test_a_loads_budget_is_its_expected_recompute_once_prefills_are_timed() -> None:
    """The plan gives a load the recompute estimate of its tokens; none before the prefills
    are timed, and none under load_when "always" (every hit loaded, however slow)."""
    for settings, budgeted in (({}, True), ({"load_when": "always"}, False)):
        engine = Engine(**settings)
        engine.admit(request("a", 200), list(range(7)))
        engine.store_all(engine.step(new={"a": (list(range(7)), 0, 200)}))
        assert engine.admit(request("b", 200), list(range(10, 17))) == 3 * CHUNK
        assert engine.step(new={"b": (list(range(10, 17)), 192, 8)}).load_budgets_s == {}
        timed_prefills(engine, 0.02)
        assert engine.admit(request("c", 200), list(range(20, 27))) == 3 * CHUNK
        budgets = engine.step(new={"c": (list(range(20, 27)), 192, 8)}).load_budgets_s
        if budgeted:
            assert set(budgets) == {"c"} and budgets["c"] >= MIN_LOAD_BUDGET_S
        else:
            assert budgets == {}
