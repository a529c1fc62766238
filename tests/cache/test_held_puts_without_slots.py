"""A store whose top tier has no slots to reserve (a disk-only store: `tiers: [disk]`, or a
shared directory) fills the caller's spare and puts it: whether the chunk was held already is
known only from that put. The second store of a chunk must read as held (`PendingPut.held`:
the worker counts it as `already_held_tokens`, not as `stored_tokens` / `stored_bytes`), and
the first as stored. The tier answers it (its index; Redis its EXISTS, S3 its HEAD or its
conditional PUT): no lookup ahead of the put."""

from __future__ import annotations

from pathlib import Path

import pytest
from tierkit import key, tier_settings, tiny_layout

from kvtier.tiers import open_store
from kvtier.tiers.storeconfig import StoreConfig

LAYOUT = tiny_layout()


def payload(i: int) -> bytes:
    return bytes([i % 251]) * LAYOUT.bytes_per_chunk


@pytest.mark.parametrize(("kind", "options"), [
    ("disk", {}), ("shared", {}),
    pytest.param("redis", {}, marks=pytest.mark.redis),
    pytest.param("s3", {}, marks=pytest.mark.s3),
    pytest.param("s3", {"conditional_put": False}, marks=pytest.mark.s3)])
def test_a_second_store_of_a_chunk_is_held_not_stored(
        tmp_path: Path, kind: str, options: dict[str, object],
        request: pytest.FixtureRequest) -> None:
    """Two puts of chunk 1 and one of chunk 2 into a one-tier store of `kind`: the second put
    of chunk 1 is held (nothing written: the tier's puts and bytes written stay as they were),
    chunk 2 stored. Redis and S3 (both `conditional_put` forms) tell it from their EXISTS,
    HEAD or conditional PUT."""
    if kind == "redis":
        request.getfixturevalue("redis_url")
    if kind == "s3":
        request.getfixturevalue("s3_session")
    tier = tier_settings(kind, tmp_path, LAYOUT, 8, **options)
    store = open_store(StoreConfig.parse({"tiers": [tier]}), LAYOUT)
    spare = memoryview(bytearray(LAYOUT.bytes_per_chunk))
    try:
        with store.putting(key(1), spare) as first:
            assert first.data is spare and not first.in_place
            spare[:] = payload(1)
        assert first.stored and not first.held
        written = store.stats().tiers[0]
        with store.putting(key(1), spare) as again:
            assert again.data is spare  # no lookup ahead: the put tells
            spare[:] = payload(1)
        assert again.stored and again.held
        after = store.stats().tiers[0]
        assert (after.puts, after.bytes_written) == (written.puts, written.bytes_written)
        with store.putting(key(2), spare) as other:
            spare[:] = payload(2)
        assert other.stored and not other.held
        out = memoryview(bytearray(LAYOUT.bytes_per_chunk))
        assert store.get_into(key(1), out) == kind and bytes(out) == payload(1)
    finally:
        store.close()


def test_held_is_a_success_equal_to_ok_and_told_apart_by_its_flag() -> None:
    """HELD is OK for every caller that asks whether a put succeeded (`== OK`, truthiness);
    only `held` tells it apart."""
    from kvtier.core.tier import HELD, OK  # here: the scenario above runs without HELD

    assert HELD == OK and HELD and HELD.ok
    assert HELD.held and not OK.held
