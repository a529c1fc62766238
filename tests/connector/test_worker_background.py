"""What the worker does off the model runner's thread, besides asynchronous loads.

- The report of chunks no tier holds any more (`KVTierWorkerMetadata.removed`): when the RAM
  tier evicts a chunk the scheduler must learn whether any tier still holds it, else it plans
  loads that fail. What RAM alone can tell (RAM is the only tier) goes in the report of the
  step whose store evicted the chunk (issue 45: a report later, an idle engine's next request
  had been offered it); lower tiers are asked on a thread of their own (a lower tier's lookup
  goes through the store's stall guard: ~90 us per evicted chunk, a third of a chunk's gather,
  paid once per store when RAM is full), so that answer arrives in a later report.
- Prefetch (`KVTierMetadata.prefetch`): chunks below RAM of requests waiting for blocks are
  read into the RAM tier, so that their load is a memcpy.

Pure torch on CPU tensors and real tiers; no engine.
"""

from __future__ import annotations

import time

import pytest
import torch

pytest.importorskip("vllm")


from kvtier.core.locator import MISS, ChunkLocator, Located
from kvtier.integrations.vllm.messages import ChunkTransfer, KVTierMetadata
from kvtier.integrations.vllm.worker import connector_worker
from kvtier.integrations.vllm.worker.connector_worker import ConnectorWorker, PagedKV
from kvtier.tiers import open_store
from kvtier.tiers.storeconfig import StoreConfig

LAYERS, BLOCKS, HEADS, BS, DIM = 2, 8, 2, 32, 16
TOKENS_PER_CHUNK = 64  # two blocks


def worker(tiers: list[dict[str, object]]) -> ConnectorWorker:
    kv = {f"model.layers.{i}.self_attn.attn":
          torch.randn(BLOCKS, HEADS, BS, 2 * DIM).to(torch.bfloat16) for i in range(LAYERS)}
    paged = PagedKV(kv, BS)
    layout = paged.layout(TOKENS_PER_CHUNK)
    return ConnectorWorker(paged, layout, open_store(StoreConfig.parse({"tiers": tiers}), layout))


def store(w: ConnectorWorker, key: bytes, blocks: tuple[int, ...]) -> None:
    w.store(KVTierMetadata(stores=[ChunkTransfer(key=key, block_ids=blocks)]))


def removed_within(w: ConnectorWorker, seconds: float,
                   expected: set[bytes] | None = None) -> set[bytes]:
    """Everything reported removed until `seconds` have passed, or (`expected`) once all of
    `expected` was (a background check's report: 30 s on a loaded machine, not 1)."""
    found: set[bytes] = set()
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and not (expected is not None and found >= expected):
        report = w.take_report()
        if report is not None:
            found |= report.removed
        time.sleep(0.01)
    return found


def ram_of(chunks: int, tiers: list[dict[str, object]]) -> list[dict[str, object]]:
    chunk = LAYERS * HEADS * 2 * TOKENS_PER_CHUNK * DIM * 2
    return [{"kind": "memory", "capacity": chunks * -(-chunk // 4096) * 4096}, *tiers]


def store_prompt(w: ConnectorWorker, keys: list[bytes]) -> None:
    """A step's stores of a prompt's chunks, two blocks each."""
    w.store(KVTierMetadata(stores=[ChunkTransfer(key=k, block_ids=(2 * i, 2 * i + 1))
                                   for i, k in enumerate(keys)]))


def learn(locator: ChunkLocator, w: ConnectorWorker) -> set[bytes]:
    """Feed the worker's next report to `locator` as the scheduler does; its removed keys."""
    report = w.take_report()
    assert report is not None
    locator.record_stored(report.stored)
    locator.record_missing(report.removed)
    return report.removed


def test_a_chunk_evicted_from_the_only_tier_is_reported_removed() -> None:
    w = worker(ram_of(1, []))
    a, b = b"a" * 16, b"b" * 16
    store(w, a, (0, 1))
    store(w, b, (2, 3))  # evicts a: nothing else holds it
    assert removed_within(w, 30.0, {a}) == {a}
    w.close()


def test_a_chunk_a_lower_tier_still_holds_is_not() -> None:
    w = worker(ram_of(1, [{"kind": "example", "capacity": "1MiB"}]))
    a, b = b"a" * 16, b"b" * 16
    store(w, a, (0, 1))
    assert w._store.flush(5.0)  # a reached the lower tier
    store(w, b, (2, 3))  # evicts a from RAM only
    assert removed_within(w, 1.0) == set()
    w.close()


def test_the_report_of_the_store_that_evicts_a_chunk_says_it_is_gone() -> None:
    """Issue 45: RAM of two chunks, the only tier; a prompt's two chunks, then another's
    evict them. The report of that store (an idle engine sends no other before its next
    request) says they are gone, so a locator fed with the reports, as the scheduler is,
    offers the first prompt nothing: no load of an evicted chunk to fail."""
    w = worker(ram_of(2, []))
    locator = ChunkLocator({}, max_keys=64)
    first, second = [b"a" * 16, b"b" * 16], [b"c" * 16, b"d" * 16]
    store_prompt(w, first)
    assert learn(locator, w) == set()
    assert locator.locate("first", first) == Located.prefix(2)
    store_prompt(w, second)
    assert learn(locator, w) == set(first)
    assert locator.locate("first again", first) == MISS
    assert locator.locate("second", second) == Located.prefix(2)
    w.close()


def test_a_chunk_its_own_store_job_evicted_is_reported_gone_with_its_store() -> None:
    """An asynchronous store job (the store thread) whose later chunk evicts an earlier one
    from RAM, the only tier: the eviction reaches a report taken while the job is not yet
    joined, its store the report of the step that joins it. The store's report says the
    chunk is gone too: a scheduler told of the removal first, then of the store, would
    believe it held."""
    w = worker(ram_of(1, []))
    locator = ChunkLocator({}, max_keys=64)
    a, b = b"a" * 16, b"b" * 16
    w.store(KVTierMetadata(stores=[ChunkTransfer(key=a, block_ids=(0, 1)),
                                   ChunkTransfer(key=b, block_ids=(2, 3))],
                           stores_async=True, step=1))
    w._saving[0][2].result(5.0)  # the job ran; not joined
    assert learn(locator, w) == {a}  # its events: a stored, then evicted by b
    w.finish_stores()  # joined: a and b reported stored
    learn(locator, w)
    assert locator.locate("a", [a]) == MISS
    assert locator.locate("b", [b]) == Located.prefix(1)
    w.close()


def test_removals_past_a_reports_bound_are_reported_later(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A report decides at most MAX_REMOVED_INLINE removed chunks on the model runner's
    thread (here 1 of 2); the others are checked on the report thread, for a later report."""
    monkeypatch.setattr(connector_worker, "MAX_REMOVED_INLINE", 1)
    w = worker(ram_of(2, []))
    first, second = [b"a" * 16, b"b" * 16], [b"c" * 16, b"d" * 16]
    store_prompt(w, first)
    w.take_report()
    store_prompt(w, second)
    report = w.take_report()
    assert report is not None and len(report.removed) == 1
    assert report.removed | removed_within(w, 30.0, set(first) - report.removed) \
        == set(first)
    w.close()


def test_a_chunk_ram_evicts_that_a_lower_tier_holds_stays_offered() -> None:
    """The same over a lower tier: the evicted chunks are still held there (on their way or
    written), so no report says they are gone and the locator still offers them."""
    w = worker(ram_of(2, [{"kind": "example", "capacity": "1MiB"}]))
    locator = ChunkLocator({}, max_keys=64)
    first, second = [b"a" * 16, b"b" * 16], [b"c" * 16, b"d" * 16]
    store_prompt(w, first)
    learn(locator, w)
    store_prompt(w, second)  # evicts the first prompt's chunks from RAM only
    assert learn(locator, w) | removed_within(w, 1.0) == set()
    assert not any(w._store.tiers[0].contains(k) for k in first)
    assert locator.locate("first again", first) == Located.prefix(2)
    w.close()


def test_prefetched_chunks_are_promoted_into_ram_and_counted() -> None:
    w = worker([{"kind": "memory", "capacity": "1MiB"},
                {"kind": "example", "capacity": "1MiB"}])
    keys = [bytes([i]) * 16 for i in range(3)]
    for i, key in enumerate(keys):
        store(w, key, (2 * i, 2 * i + 1))
    assert w._store.flush(5.0)
    ram = w._store.tiers[0]
    for key in keys:
        ram.delete(key)  # evicted from RAM: held by the lower tier only
    # and one no tier holds
    w.prefetch([ChunkTransfer(key=k, block_ids=()) for k in [*keys, b"z" * 16]])
    deadline = time.monotonic() + 5
    while not all(ram.contains(k) for k in keys) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert all(ram.contains(k) for k in keys)
    w._prefetcher.submit(lambda: None).result(5.0)  # one thread: the prefetch has ended
    stats = w.take_stats()
    assert stats is not None and stats.data["counters"]["prefetched_chunks"][""] == 3
    w.close()
