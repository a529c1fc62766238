"""Node mode (the index does not say what the tiers below RAM hold): a request's lookup asks
the slow probes about its chunks (`locate`) and, meanwhile, about its tail (`first_held`).
The tail's probe asks one batch; the chunks' probe may take several round trips and answer
later. The scheduler's lookup while the chunks' probe still runs (RETRY) asks `first_held`
again only to start the tail's probe: an answer that landed by then must not be taken and
thrown away there, or the lookup that follows asks the tiers again and answers RETRY a step
more (two probes of the same tails, and a step of latency, on every miss below RAM).

A memory tier stands for the node's RAM and one for its tiers below it (real tiers; the
chunks' lookup below RAM is held back, a fault injected, until the tail's has answered).
"""

from __future__ import annotations

import threading
from collections import Counter
from concurrent.futures import Future

import pytest
from tierkit import footprint_bytes, key, tiny_layout

from kvtier.core.keys import ChunkKey
from kvtier.core.locator import ChunkLocator, LookupStatus
from kvtier.tiers.memory import MemoryTier, MemoryTierConfig
from kvtier.tiers.probe import TierProbe

LAYOUT = tiny_layout(4)


def _memory() -> MemoryTier:
    capacity = 8 * footprint_bytes("memory", LAYOUT)
    return MemoryTier(MemoryTierConfig(kind="memory", capacity=capacity, pin="off"), LAYOUT)


def _lookup(locator: ChunkLocator, chunks: list[ChunkKey], tails: list[ChunkKey]
            ) -> tuple[int, int | None] | None:
    """One lookup as the scheduler makes it in node mode (ConnectorScheduler
    .get_num_new_matched_tokens): None while kvtier answers RETRY."""
    located = locator.locate("r", chunks)
    if located.status is LookupStatus.RETRY:
        locator.first_held(tails, "r")  # the tail's probe, started meanwhile
        return None
    tail = locator.first_held(tails, "r")
    if tail is LookupStatus.RETRY:
        return None
    return located.num_chunks, tail


def _until_done(future: Future[object]) -> None:
    """Wait for a probe's answer (30 s at most): a sync point, no assertion on time."""
    done = threading.Event()
    future.add_done_callback(lambda _future: done.set())
    assert done.wait(30)


def test_a_tails_miss_that_landed_during_a_retry_answers_the_next_lookup(
        monkeypatch: pytest.MonkeyPatch) -> None:
    ram, below = _memory(), _memory()
    chunks, tails = [key(i) for i in range(4)], [key(10), key(11)]
    asked: Counter[ChunkKey] = Counter()
    release = threading.Event()
    contains = below.contains

    def slow_contains(k: ChunkKey) -> bool:  # the fault: the chunks' lookup waits
        asked[k] += 1
        if k in chunks:
            release.wait(30)
        return contains(k)

    monkeypatch.setattr(below, "contains", slow_contains)
    locator = ChunkLocator({"ram": TierProbe([ram], blocking_ok=True),
                            "below": TierProbe([below], blocking_ok=False)},
                           max_keys=64, timeout_s=60, index_first=False)
    try:
        assert _lookup(locator, chunks, tails) is None  # both probes started
        _until_done(locator._firsts["r"][1])  # the tail's probe answered; the chunks' waits
        assert _lookup(locator, chunks, tails) is None  # the chunks' probe: RETRY
        release.set()
        _until_done(locator._pending["r"][1])
        # The chunks' probe answered (none below RAM); the tail's had answered before.
        assert _lookup(locator, chunks, tails) == (0, None)
        assert asked[tails[0]] == 1 and asked[tails[1]] == 1
    finally:
        release.set()
        locator.close()
