"""One existence check per write: "is this chunk already stored?" is the tier's `put`'s.

On a shared NFS directory every stat is a round trip to the server: a write that asks the
write-behind, the store and the tier in turn pays for each (issue 24, item 3). These tests
count the stat calls one write makes on a real shared directory under tmp_path, through the
tier itself and through the store's write-behind, for a chunk not held yet and for one held
already (beside a chunk stored before, so that the directories on its path exist: a check
that finds a directory missing stops before its stat). The counters wrap `os.stat`,
`os.lstat` and `os.path.exists` and delegate to them: they observe, they change nothing.
Before the fix the counts were 2 (a put of a new chunk: the put's check, then a stat before
the rename) and 3 through the write-behind (its own `contains` first).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from tierkit import key, make_tier

from kvtier.core.layout import KVLayout
from kvtier.core.store import StoreSettings, TieredStore
from kvtier.core.tier import OK, Tier


class StatCounter:
    """How many stat calls ran while `counting`, from any thread."""

    def __init__(self) -> None:
        self.calls = 0
        self.counting = False

    def wrap(self, real: Callable[..., Any]) -> Callable[..., Any]:
        def counted(*args: Any, **kwargs: Any) -> Any:
            if self.counting:
                self.calls += 1
            return real(*args, **kwargs)
        return counted


@pytest.fixture
def stats(monkeypatch: pytest.MonkeyPatch) -> Iterator[StatCounter]:
    counter = StatCounter()
    monkeypatch.setattr(os, "stat", counter.wrap(os.stat))
    monkeypatch.setattr(os, "lstat", counter.wrap(os.lstat))
    monkeypatch.setattr(os.path, "exists", counter.wrap(os.path.exists))
    yield counter


def shared_tier(tmp_path: Path, layout: KVLayout) -> Tier:
    # A long scan interval: a re-measure of the directory is upkeep, not part of a write.
    return make_tier("shared", tmp_path, layout, capacity_chunks=8, scan_interval_s=3600)


def chunk(layout: KVLayout, i: int) -> memoryview:
    return memoryview(bytes([i]) * layout.bytes_per_chunk)


def test_a_put_to_the_shared_tier_checks_existence_once(
        tmp_path: Path, layout: KVLayout, stats: StatCounter) -> None:
    """A new chunk: one check, then the write. A held chunk: one check, nothing written."""
    tier = shared_tier(tmp_path, layout)
    assert tier.put(key(0), chunk(layout, 0)) == OK  # its directories exist from now on
    stats.counting = True
    assert tier.put(key(1), chunk(layout, 1)) == OK
    stats.counting = False
    assert stats.calls == 1, f"{stats.calls} stat calls for a put of a new chunk"
    stats.calls, stats.counting = 0, True
    assert tier.put(key(1), chunk(layout, 1)) == OK
    stats.counting = False
    assert stats.calls == 1, f"{stats.calls} stat calls for a put of a held chunk"
    tier.close()


def test_a_write_behind_to_the_shared_tier_checks_existence_once(
        tmp_path: Path, layout: KVLayout, stats: StatCounter) -> None:
    """Through the store (memory on top, shared below, written behind): the write-behind
    and the store ask nothing of the shared tier; its put asks once."""
    top = make_tier("memory", tmp_path, layout, capacity_chunks=8)
    store = TieredStore([top, shared_tier(tmp_path, layout)], StoreSettings())
    assert store.put(key(0), chunk(layout, 0)) and store.flush(10.0)
    stats.counting = True
    assert store.put(key(2), chunk(layout, 2))
    assert store.flush(10.0)
    stats.counting = False
    assert stats.calls == 1, f"{stats.calls} stat calls for a write-behind of a new chunk"
    top.delete(key(2))  # held below only: the next put writes behind to a tier holding it
    stats.calls, stats.counting = 0, True
    assert store.put(key(2), chunk(layout, 2))
    assert store.flush(10.0)
    stats.counting = False
    assert stats.calls == 1, f"{stats.calls} stat calls for a write-behind of a held chunk"
    store.close()
