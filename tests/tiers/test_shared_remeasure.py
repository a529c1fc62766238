"""The shared tier's re-measure runs beside its writer's puts, not inside one (issue 28): the
writer that claims the fleet's re-measure of the directory walks it on a thread of its own,
since a walk of 10^6 files takes a minute of CPU (far longer on NFS) and a put waiting on it
would stall that engine's write-behind. The walk is held on an event here (a fault injected
into `scan_tree`): with the walk inline, the put would not return until it is released."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from tierkit import key, make_tier, put_once_remeasured, tiny_layout

import kvtier.tiers.files.shared as shared_module
from kvtier.tiers.files.quota import QuotaLedger

LAYOUT = tiny_layout()


@contextmanager
def walk_held(tier: Any, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """A re-measure of `tier` on a thread of its own, its walk held from before the block's
    start to its end; the re-measure has ended after the block."""
    walking, release = threading.Event(), threading.Event()
    real_scan = shared_module.scan_tree

    def held_walk(*args: Any, **kwargs: Any) -> Any:
        walking.set()
        release.wait(timeout=10)
        return real_scan(*args, **kwargs)

    monkeypatch.setattr(shared_module, "scan_tree", held_walk)
    remeasure = threading.Thread(target=tier.enforce_quota)
    remeasure.start()
    try:
        assert walking.wait(timeout=10)
        yield
    finally:
        release.set()
        remeasure.join()


def test_a_claimed_remeasure_walks_beside_the_put_that_claimed_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tier: Any = make_tier("shared", tmp_path, LAYOUT, 64, scan_interval_s=0.05)
    assert tier.remeasures == 1  # a new ledger: walked once, at start-up
    data = memoryview(bytes(LAYOUT.bytes_per_chunk))
    assert tier.put(key(0), data)
    walking, release, walked = threading.Event(), threading.Event(), threading.Event()
    real_scan = shared_module.scan_tree

    def held_walk(*args: Any, **kwargs: Any) -> Any:
        walking.set()
        release.wait(timeout=5)
        walked.set()
        return real_scan(*args, **kwargs)

    monkeypatch.setattr(shared_module, "scan_tree", held_walk)
    time.sleep(0.2)  # the next re-measure is due
    assert tier.put(key(1), data)  # claims it, and returns while the walk is held
    assert walking.wait(timeout=10) and not walked.is_set()
    assert tier.put(key(2), data)  # a second put is not held up either, nor walks again
    assert not walked.is_set()
    release.set()
    tier.close()  # waits for the walk in flight
    assert tier.remeasures == 2
    assert tier.stats().chunks == 3 and tier.contains(key(1))


YEAR_NS = 365 * 86400 * 10**9


def full_tier(root: Path) -> Any:
    """A shared tier whose quota of 8 chunks is full, with re-measures due every millisecond
    from now (none while it was filled)."""
    tier: Any = make_tier("shared", root, LAYOUT, 8)
    for i in range(8):
        assert tier.put(key(i), memoryview(bytes(LAYOUT.bytes_per_chunk)))
    tier.scan_interval_s = 0.001
    return tier


def test_a_re_measure_claimed_from_the_future_is_taken_as_claimed_now(tmp_path: Path) -> None:
    """The ledger's `claimed_ns` comes from the clock of whichever node claimed the last
    re-measure. One from years ahead (a node whose clock is wrong, or a corrupt ledger) was
    trusted: no writer claimed another re-measure until then, so a quota full of chunks that
    were deleted behind kvtier's back (`kvtier gc`, an operator) dropped every write for
    ever. A claim further ahead than FUTURE_CLAIM_S is taken as claimed now (counted, logged):
    the next re-measure is due one interval later."""
    tier = full_tier(tmp_path)
    with tier.ledger.locked() as ledger:
        ledger.claimed_ns = time.time_ns() + 100 * YEAR_NS
    for path in (tmp_path / "shared").rglob("*.kvc"):
        path.unlink()  # behind kvtier's back: the ledger still says 8 chunks
    data = memoryview(bytes(LAYOUT.bytes_per_chunk))
    stored = put_once_remeasured(tier, key(100), data)  # full, until a re-measure repairs it
    tier.close()
    assert stored, "no re-measure was claimed: the quota stays full of deleted files"
    assert tier.future_claims == 1
    with QuotaLedger(tmp_path / "shared", 0o600).locked() as ledger:
        assert ledger.claimed_ns <= time.time_ns()
        assert ledger.used_bytes == tier.file_bytes


def test_a_re_measure_claimed_by_a_node_a_little_ahead_is_trusted(tmp_path: Path) -> None:
    tier = full_tier(tmp_path)
    ahead_ns = time.time_ns() + int(shared_module.FUTURE_CLAIM_S * 1e9) // 2
    with tier.ledger.locked() as ledger:
        ledger.claimed_ns = ahead_ns
    assert tier.put(key(8), memoryview(bytes(LAYOUT.bytes_per_chunk)))  # evicts, claims none
    with tier.ledger.locked() as ledger:
        assert ledger.claimed_ns == ahead_ns
    assert tier.future_claims == 0
    tier.close()


def test_writes_during_a_re_measure_are_not_counted_three_times(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A re-measure sets the usage to what its walk saw, plus the bytes reserved since it
    began (files the walk may have passed by), plus the bytes renamed into place since (a
    write in flight when it began, renamed under the walk, can hide both its names from a
    directory listing). Every write during the walk was counted in both, and again if the
    walk saw its file: 30 chunks held and 30 written during a walk of a 100-chunk quota
    counted 120 chunks, and the re-measure evicted 30 real chunks from a directory of 60.
    Only writes in flight when the walk began can hide so: what was renamed since counts up
    to what was then in flight (none here). A write the walk also saw still counts twice."""
    tier: Any = make_tier("shared", tmp_path, LAYOUT, 100)
    data = memoryview(bytes(LAYOUT.bytes_per_chunk))
    for i in range(30):
        assert tier.put(key(i), data)
    with walk_held(tier, monkeypatch):
        for i in range(100, 130):
            assert tier.put(key(i), data)
    assert tier.stats().evictions == 0
    with tier.ledger.locked() as ledger:
        assert ledger.used_bytes <= (60 + 30) * tier.file_bytes
    tier.close()


def test_a_re_measure_far_over_a_lowered_quota_evicts_one_batch_per_hold(
        tmp_path: Path) -> None:
    """Every writer waits on the ledger's lock while an eviction holds it, so an eviction
    frees at most EVICT_BATCH_FILES files per hold and a quota lowered far below the usage is
    reached over many writes. A re-measure evicted all the way down in one hold (at fleet
    scale, millions of unlinks on NFS while every engine's puts waited): 200 chunks, then an
    engine with a quota of 20 re-measured and evicted 182 files under one hold."""
    data = memoryview(bytes(LAYOUT.bytes_per_chunk))
    big: Any = make_tier("shared", tmp_path, LAYOUT, 200)
    for i in range(200):
        assert big.put(key(i), data)
    big.close()
    small: Any = make_tier("shared", tmp_path, LAYOUT, 20)  # the quota lowered
    small.enforce_quota()
    assert small.stats().evictions <= shared_module.EVICT_BATCH_FILES
    for i in range(1000, 1010):  # each put frees the next batch
        small.put(key(i), data)
    with small.ledger.locked() as ledger:
        assert ledger.used_bytes <= small.capacity_bytes
    small.close()


def test_a_walk_recorded_as_lasting_for_years_puts_re_measures_off_a_day_at_most(
        tmp_path: Path) -> None:
    """The next re-measure waits REMEASURE_DUTY times the last walk's recorded duration. A
    corrupt ledger's `walk_ns` (years) put every re-measure off for centuries, and the drift
    they repair (files deleted behind kvtier's back: a usage held high, real chunks evicted
    for it) stayed. The wait is at most REMEASURE_MAX_WAIT_S."""
    tier: Any = make_tier("shared", tmp_path, LAYOUT, 8)
    walks = tier.remeasures
    with tier.ledger.locked() as ledger:
        ledger.walk_ns = 10 * YEAR_NS
        ledger.claimed_ns -= int((shared_module.REMEASURE_MAX_WAIT_S + 60) * 1e9)
    assert tier.put(key(1), memoryview(bytes(LAYOUT.bytes_per_chunk)))  # claims one
    tier.close()  # waits for it
    assert tier.remeasures == walks + 1


def test_a_write_the_walk_also_saw_counts_twice_until_the_next_re_measure(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The bound kvtier.tiers.files.quota states for a write during a walk: what the walk saw
    plus what was reserved since it began counts a file written during the walk and listed by
    it twice. Never low (5 files written while the walk was held, all of them then listed:
    the usage is high by exactly those 5, the bytes reserved during the walk), and not
    carried on: the next re-measure, with no writes during it, counts every file once."""
    tier: Any = make_tier("shared", tmp_path, LAYOUT, 100)
    data = memoryview(bytes(LAYOUT.bytes_per_chunk))
    for i in range(10):
        assert tier.put(key(i), data)
    real_scan = shared_module.scan_tree
    with walk_held(tier, monkeypatch):
        for i in range(100, 105):  # written after the walk began, listed by it
            assert tier.put(key(i), data)
    with tier.ledger.locked() as ledger:
        assert ledger.used_bytes == (15 + 5) * tier.file_bytes
    monkeypatch.setattr(shared_module, "scan_tree", real_scan)
    tier.enforce_quota()
    with tier.ledger.locked() as ledger:
        assert ledger.used_bytes == 15 * tier.file_bytes and ledger.chunks == 15
    tier.close()
