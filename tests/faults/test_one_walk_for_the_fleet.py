"""Fault drill: a new or corrupt quota ledger is walked by one process, not by every one.

A ledger that is not valid (new, torn, garbage) keeps no claim of a re-measure (an invalid
state is not written back), so every writer of every process claimed one at start-up and at
every put: N engines starting on one NFS directory each walked its millions of files, at
once. The walk is now also claimed by a flock of ROOT/.kvtier-quota-walk, held for the whole
walk: the others see it held and go on without walking (their puts dropped until the walker's
usage is in the ledger), and a walker killed mid-walk holds it no longer.

Real processes (spawned), each with its own ledger handle, on one directory; the walker's walk
is held on an event (a fault injected into its `scan_tree`) so that the others start while it
walks. Walks are counted by each tier (`SharedTier.remeasures`).
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.synchronize
import os
import signal
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from tierkit import key, make_tier, put_once_remeasured, tiny_layout

from kvtier.tiers.files.quota import LEDGER_NAME, QuotaLedger

LAYOUT = tiny_layout()
CAPACITY_CHUNKS = 64
OTHERS = 3  # engines started while the walker walks
CONTEXT = multiprocessing.get_context("spawn")


def _walker(root: str, walking: multiprocessing.synchronize.Event,
            release: multiprocessing.synchronize.Event,
            results: multiprocessing.Queue) -> None:  # type: ignore[type-arg]
    """An engine whose start-up walk of the directory (claimed: the ledger is not valid) is
    held until `release`."""
    import kvtier.tiers.files.shared as shared_module

    real_scan = shared_module.scan_tree

    def held_scan(*args: Any, **kwargs: Any) -> Any:
        walking.set()
        release.wait(timeout=120)
        return real_scan(*args, **kwargs)

    shared_module.scan_tree = held_scan  # type: ignore[assignment]
    tier: Any = make_tier("shared", Path(root), LAYOUT, CAPACITY_CHUNKS, scan_interval_s=3600)
    results.put(("walker", tier.remeasures, 0))
    tier.close()


def _other(root: str, seed: int, results: multiprocessing.Queue) -> None:  # type: ignore[type-arg]
    """An engine started while another walks: its walks and puts stored."""
    tier: Any = make_tier("shared", Path(root), LAYOUT, CAPACITY_CHUNKS, scan_interval_s=3600)
    data = memoryview(bytes(LAYOUT.bytes_per_chunk))
    stored = sum(bool(tier.put(key((seed << 32) + i), data)) for i in range(5))
    results.put(("other", tier.remeasures, stored))
    tier.close()


def corrupt_directory(root: Path) -> None:
    """Four chunks stored, then the ledger torn (10 bytes of junk: not a ledger)."""
    tier: Any = make_tier("shared", root, LAYOUT, CAPACITY_CHUNKS)
    for i in range(4):
        assert tier.put(key(i), memoryview(bytes(LAYOUT.bytes_per_chunk)))
    tier.close()
    (root / "shared" / LEDGER_NAME).write_bytes(b"\xff" * 10)


@contextmanager
def held_walker(root: Path) -> Iterator[tuple[Any, Any, Any]]:
    """A walker process, walking (held) when the block starts; (process, release, results)."""
    walking, release, results = CONTEXT.Event(), CONTEXT.Event(), CONTEXT.Queue()
    walker = CONTEXT.Process(target=_walker, args=(str(root), walking, release, results))
    walker.start()
    try:
        assert walking.wait(timeout=120), "the walker never walked"
        yield walker, release, results
    finally:
        release.set()
        walker.join(timeout=120)
        if walker.is_alive():
            walker.kill()
            walker.join()


def test_engines_started_on_a_corrupt_ledger_walk_it_once(tmp_path: Path) -> None:
    corrupt_directory(tmp_path)
    with held_walker(tmp_path) as (walker, release, results):
        others = [CONTEXT.Process(target=_other, args=(str(tmp_path), seed, results))
                  for seed in range(1, OTHERS + 1)]
        for proc in others:
            proc.start()
        reports = [results.get(timeout=120) for _ in others]
        # and a tier of this process, its own ledger handle, built while the walk is held
        here: Any = make_tier("shared", tmp_path, LAYOUT, CAPACITY_CHUNKS, scan_interval_s=3600)
        assert here.remeasures == 0, "walked beside the walker"
        assert not here.put(key(100), memoryview(bytes(LAYOUT.bytes_per_chunk)))
        for proc in others:
            proc.join(timeout=60)
            assert proc.exitcode == 0
        release.set()
        reports.append(results.get(timeout=120))
    assert walker.exitcode == 0
    walks = {role: 0 for role in ("walker", "other")}
    for role, remeasures, stored in reports:
        walks[role] += remeasures
        assert role == "walker" or stored == 0  # dropped until the walker's usage is in
    assert walks == {"walker": 1, "other": 0}, f"walked {walks} times"
    assert here.remeasures == 0
    assert here.put(key(100), memoryview(bytes(LAYOUT.bytes_per_chunk)))  # measured now
    assert here.remeasures == 0
    here.close()
    with QuotaLedger(tmp_path / "shared", 0o600).locked() as ledger:
        assert ledger.valid and ledger.chunks == 5


def test_a_walker_killed_mid_walk_does_not_stop_re_measures(tmp_path: Path) -> None:
    corrupt_directory(tmp_path)
    with held_walker(tmp_path) as (walker, _, _):
        os.kill(walker.pid, signal.SIGKILL)
        walker.join(timeout=60)
    assert walker.exitcode == -signal.SIGKILL
    tier: Any = make_tier("shared", tmp_path, LAYOUT, CAPACITY_CHUNKS, scan_interval_s=3600)
    assert tier.remeasures == 1, "the dead walker's claim stopped every re-measure"
    assert put_once_remeasured(tier, key(100), memoryview(bytes(LAYOUT.bytes_per_chunk)))
    tier.close()
    with QuotaLedger(tmp_path / "shared", 0o600).locked() as ledger:
        assert ledger.valid and ledger.chunks == 5


def test_one_claim_of_the_walk_per_process_whatever_the_handle(tmp_path: Path) -> None:
    """Two ledger handles of one process (two tiers on one directory) share one walk lock
    file: on NFS a flock is a POSIX lock, held by the process, so a second file description
    of this process would not exclude the first; the process's claim does."""
    first, second = QuotaLedger(tmp_path, 0o600), QuotaLedger(tmp_path, 0o600)
    assert first.try_walk()
    assert not second.try_walk() and not first.try_walk()
    first.end_walk()
    assert second.try_walk()
    second.end_walk()
    first.close()
    second.close()
