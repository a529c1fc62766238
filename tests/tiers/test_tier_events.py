"""Tiers report what they store and remove; the store queues those events in order.

The vLLM connector turns them into KV events for routers and into its scheduler's index of
what is held, so a chunk evicted from every tier stops being offered as a hit.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from tierkit import key, make_tier

from kvtier.core.keys import ChunkKey
from kvtier.core.layout import KVLayout
from kvtier.core.store import StoreEvent
from kvtier.core.tier import EventKind, EventSource, Retiring
from kvtier.tiers import open_store
from kvtier.tiers.storeconfig import StoreConfig

LAYOUT = KVLayout(num_layers=1, num_kv_heads=1, head_size=64, dtype="float16", tokens_per_chunk=16)
CHUNK = LAYOUT.bytes_per_chunk  # 4 KiB


def _data(i: int) -> memoryview:
    return memoryview(np.full(CHUNK, i % 251, dtype=np.uint8))


@pytest.mark.parametrize("kind", ["memory", "disk", "shared"])
def test_a_full_tier_reports_each_store_and_each_eviction(kind: str, tmp_path: Path) -> None:
    """Three chunks into a tier that holds two: three stored events, the oldest removed."""
    stored_bytes = CHUNK if kind == "memory" else CHUNK + 4096  # files carry a 4 KiB header
    tier: dict[str, object] = {"kind": kind, "capacity": 2 * stored_bytes}
    if kind != "memory":
        tier["path"] = str(tmp_path / kind)
    with open_store(StoreConfig.parse({"tiers": [tier]}), LAYOUT) as store:
        for i in range(3):
            store.put(key(i), _data(i))
        events = store.take_events()
        assert [e for e in events if e.kind is EventKind.STORED] == [
            StoreEvent(EventKind.STORED, key(i), kind) for i in range(3)]
        assert StoreEvent(EventKind.REMOVED, key(0), kind) in events
        assert store.take_events() == []  # drained


def test_deleting_and_corruption_are_removals(tmp_path: Path) -> None:
    config = StoreConfig.parse({"tiers": [
        {"kind": "disk", "path": str(tmp_path / "d"), "capacity": "1MiB"}]})
    with open_store(config, LAYOUT) as store:
        store.put(key(1), _data(1))
        store.put(key(2), _data(2))
        store.take_events()
        assert store.tiers[0].delete(key(1))
        path = store.tiers[0].files.path_of(key(2))  # type: ignore[attr-defined]
        raw = bytearray(path.read_bytes())
        raw[-1] ^= 0xFF
        path.write_bytes(bytes(raw))
        assert store.get_into(key(2), memoryview(bytearray(CHUNK))) is None
        assert store.take_events() == [StoreEvent(EventKind.REMOVED, key(1), "disk"),
                                       StoreEvent(EventKind.REMOVED, key(2), "disk")]


def test_write_behind_reports_per_tier(tmp_path: Path) -> None:
    """A put lands in memory at once and on disk behind it: one stored event per tier."""
    config = StoreConfig.parse({"tiers": [
        {"kind": "memory", "capacity": "64KiB"},
        {"kind": "disk", "path": str(tmp_path / "d"), "capacity": "1MiB"}]})
    with open_store(config, LAYOUT) as store:
        store.put(key(7), _data(7))
        store.flush()
        assert sorted((e.tier, e.kind) for e in store.take_events()) == [
            ("disk", "stored"), ("memory", "stored")]


@pytest.mark.parametrize("kind", ["redis", "s3"])
def test_a_remote_tier_reports_its_stores_evictions_and_deletes(kind: str,
                                                                tmp_path: Path) -> None:
    """What this client stores, evicts to the tier's capacity (redis: its LRU index; s3: its
    capacity listing) and deletes, whoever stored the chunk: routers credit them for every
    engine (pool_events). What the server drops alone (maxmemory, a TTL, a lifecycle rule)
    is not seen."""
    tier = make_tier(kind, tmp_path, LAYOUT, capacity_chunks=2)
    assert isinstance(tier, EventSource)
    seen: list[tuple[EventKind, ChunkKey]] = []
    tier.events.listen(lambda _tier, event, k, _retired: seen.append((event, k)))
    try:
        for i in range(3):
            assert tier.put(key(i), _data(i)).ok
        assert tier.put(key(2), _data(2)).ok  # held already: not stored again
        if kind == "s3":  # its capacity listing, now: after the one a put may have started
            listing = getattr(tier, "_listing", None)
            if listing is not None:
                listing.join(30)
            tier.enforce_capacity()  # type: ignore[attr-defined]
        assert [k for event, k in seen if event is EventKind.STORED] == [key(0), key(1), key(2)]
        assert [k for event, k in seen if event is EventKind.REMOVED] == [key(0)]
        assert tier.delete(key(2))
        assert not tier.delete(key(0))  # gone already: nothing more to announce
        assert seen[-1] == (EventKind.REMOVED, key(2))
        assert [k for event, k in seen if event is EventKind.REMOVED] == [key(0), key(2)]
    finally:
        tier.close()


@pytest.mark.parametrize("kind", ["memory", "disk", "example"])
def test_a_retired_chunks_removal_says_so_and_a_chunk_stored_since_does_not(
        kind: str, tmp_path: Path) -> None:
    """A tier that retires (this engine's cache reset: routers were told every chunk it held
    is gone) marks the removals of the chunks it held then, evicted or deleted; a chunk
    stored since, or stored again since, leaves unmarked (its removal is news to a router)."""
    tier = make_tier(kind, tmp_path, LAYOUT, capacity_chunks=3)
    assert isinstance(tier, EventSource) and isinstance(tier, Retiring)
    removed: list[tuple[ChunkKey, bool]] = []
    tier.events.listen(lambda _tier, event, k, retired: removed.append((k, retired))
                       if event is EventKind.REMOVED else None)
    try:
        for i in range(3):
            assert tier.put(key(i), _data(i)).ok
        tier.retire()
        assert tier.delete(key(0))
        assert tier.put(key(3), _data(3)).ok
        assert tier.put(key(4), _data(4)).ok  # room made: the retired key(1) leaves
        assert tier.delete(key(3))
        assert tier.put(key(2), _data(2)).ok  # held already
        assert removed == [(key(0), True), (key(1), True), (key(3), False)]
        for i in (5, 6, 7):
            assert tier.put(key(i), _data(i)).ok
        assert removed[3:] == [(key(2), True), (key(4), False)]
    finally:
        tier.close()
