"""`Retiring` (a cache reset after a weight update in place): the tiers this engine alone
writes put what they hold behind anything stored later; shared tiers never offer it.

Real tiers built through the registry, on real files.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from tierkit import key, make_tier, tiny_layout

from kvtier.core.store import TieredStore
from kvtier.core.tier import OK, Locality, Retiring

RETIRING = ["memory", "disk", "example"]


@pytest.mark.parametrize("kind", RETIRING)
def test_chunks_held_at_a_retire_are_evicted_before_any_stored_after(
        kind: str, tmp_path: Path) -> None:
    """Capacity 4: chunks 0-3, chunk 0 read often; retire; chunks 4-5 evict two of the
    retired ones (never 4 or 5 themselves), and chunks 6-7 the other two, read or not."""
    layout = tiny_layout()
    tier = make_tier(kind, tmp_path, layout, capacity_chunks=4)
    payload = memoryview(bytes(layout.bytes_per_chunk))
    out = memoryview(bytearray(layout.bytes_per_chunk))
    for i in range(4):
        assert tier.put(key(i), payload) == OK
    for _ in range(3):
        assert tier.get_into(key(0), out) == OK
    assert isinstance(tier, Retiring)
    tier.retire()
    for i in (4, 5):
        assert tier.put(key(i), payload) == OK
        assert tier.get_into(key(i), out) == OK
    assert sum(tier.contains(key(i)) for i in range(4)) == 2
    for i in (6, 7):
        assert tier.put(key(i), payload) == OK
    assert [i for i in range(8) if tier.contains(key(i))] == [4, 5, 6, 7]
    tier.close()


@pytest.mark.parametrize("kind", ["shared"])
def test_a_tier_other_engines_write_does_not_retire(kind: str, tmp_path: Path) -> None:
    """A shared directory holds other engines' chunks (the old weights' included): a reset
    of one engine never reorders or removes them."""
    tier = make_tier(kind, tmp_path, tiny_layout(), capacity_chunks=4)
    assert tier.locality is Locality.REMOTE and not isinstance(tier, Retiring)
    tier.close()


def test_a_store_retires_its_retiring_tiers_and_removes_nothing(tmp_path: Path) -> None:
    layout = tiny_layout()
    tiers = [make_tier(kind, tmp_path, layout, capacity_chunks=4)
             for kind in ("memory", "disk", "shared")]
    with TieredStore(tiers) as store:
        assert store.put(key(1), memoryview(bytes(layout.bytes_per_chunk)))
        assert store.flush(timeout_s=10)
        assert store.retire() == 2
        assert all(tier.contains(key(1)) for tier in tiers)
