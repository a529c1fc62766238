"""The shared tier's re-measure runs beside its writer's puts, not inside one (issue 28): the
writer that claims the fleet's re-measure of the directory walks it on a thread of its own,
since a walk of 10^6 files takes a minute of CPU (far longer on NFS) and a put waiting on it
would stall that engine's write-behind. The walk is held on an event here (a fault injected
into `scan_tree`): with the walk inline, the put would not return until it is released."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest
from tierkit import key, make_tier, tiny_layout

import kvtier.tiers.files.shared as shared_module

LAYOUT = tiny_layout()


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
