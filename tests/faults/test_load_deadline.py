"""A load's own deadline (issue 45): `lend_as_landed(..., until=...)` gives up on the reads
not landed by then, like a read past the store's deadline, but the tier is only slow for that
load, not stalled: no timeout is counted, the next load reads it as usual. Faults injected with
test_stalled_tier's tier whose reads block until released."""

from __future__ import annotations

import time

import pytest
from test_stalled_tier import CHUNK, TIMEOUT_S, HangingTier, example, hanging, spares
from tierkit import key

from kvtier.core.store import StoreSettings, TieredStore

__all__ = ["hanging"]  # the fixture, used by name


@pytest.mark.timing
def test_a_load_past_its_deadline_stops_there_and_the_tier_is_not_stalled(
        hanging: HangingTier) -> None:
    store = TieredStore([example("ram"), hanging], StoreSettings(read_timeout_s=10 * TIMEOUT_S))
    for i in range(3):
        hanging.put(key(i), memoryview(bytes([i]) * CHUNK))
    store.put(key(0), memoryview(bytes([0]) * CHUNK))  # RAM holds the first
    hanging.hang.set()
    buffers = spares(2)
    start = time.monotonic()
    with store.lend_as_landed([key(i) for i in range(3)], buffers,
                              until=start + TIMEOUT_S) as lending:
        assert [loan.index for loan in lending] == [0]  # RAM's, lent in place
        assert lending.stopped_at == 1 and lending.expired and lending.failed_tier == "nfs"
    assert time.monotonic() - start < TIMEOUT_S + 0.2
    assert store.stats().failures.get("nfs", {}).get("timeout", 0) == 0
    # A deadline already past starts no read at all.
    calls = hanging.calls
    with store.lend_as_landed([key(1)], buffers, until=time.monotonic()) as lending:
        assert list(lending) == [] and lending.expired and lending.failed_tier is None
    assert hanging.calls == calls
    # Not stalled: the next load without a deadline reads it once it answers.
    hanging.hang.clear()
    hanging.release.set()
    with store.lend_as_landed([key(1), key(2)], buffers) as lending:
        assert sorted(loan.index for loan in lending) == [0, 1]
