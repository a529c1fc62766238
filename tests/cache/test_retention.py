"""Pins and expiry in the memory tier, and through the store's write-behind and promotions.

A pinned chunk (`ChunkMeta.retain_until`) is never evicted by LRU churn until its pin ends;
pinned bytes never pass `max_pinned_share` (a pin beyond it is refused, counted, and the
chunk stored unpinned); an expired chunk (`expires_at`, or the tier's `ttl_s`) is a miss and
its slot is reclaimed. Time is an injected clock: no sleeps.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tierkit import key, tier_settings, tiny_layout

from kvtier.core.retention import DEFAULT_META, ChunkMeta
from kvtier.core.store import TieredStore
from kvtier.core.tier import EventKind
from kvtier.tiers.memory import MemoryTier
from kvtier.tiers.storeconfig import StoreConfig

LAYOUT = tiny_layout()
CHUNK = bytes(range(256)) * (LAYOUT.bytes_per_chunk // 256)
T0 = 1_800_000_000.0


class Clock:
    """Wall-clock seconds that move only when the test says so."""

    def __init__(self) -> None:
        self.now = T0

    def __call__(self) -> float:
        return self.now


def memory(tmp_path: Path, chunks: int, clock: Clock, name: str = "memory",
           **options: Any) -> MemoryTier:
    config = StoreConfig.parse({"tiers": [tier_settings("memory", tmp_path, LAYOUT, chunks,
                                                        name=name, **options)]})
    return MemoryTier(config.tiers[0], LAYOUT, clock=clock)  # type: ignore[arg-type]


def put(tier: MemoryTier, i: int, meta: ChunkMeta = DEFAULT_META) -> bool:
    return bool(tier.put(key(i), memoryview(CHUNK), meta))


def held(tier: MemoryTier, ids: range | list[int]) -> list[int]:
    return [i for i in ids if tier.contains(key(i))]


def test_a_pinned_chunk_survives_an_lru_flood_until_its_pin_ends(tmp_path: Path) -> None:
    clock = Clock()
    tier = memory(tmp_path, 8, clock)
    pin = ChunkMeta(retain_until=T0 + 3600)
    for i in range(2):
        assert put(tier, i, pin)
    for i in range(100, 300):  # a flood of 200 unpinned chunks through 8 slots
        assert put(tier, i)
    assert held(tier, [0, 1]) == [0, 1]
    stats = tier.retention_stats()
    assert (stats.pinned_chunks, stats.pinned_bytes) == (2, 2 * 4096)
    # The pin ends: the chunks go back to LRU and the next flood evicts them.
    clock.now = T0 + 3601
    for i in range(300, 320):
        put(tier, i)
    assert held(tier, [0, 1]) == []
    assert tier.retention_stats().pinned_chunks == 0


def test_without_a_pin_the_flood_evicts_them(tmp_path: Path) -> None:
    tier = memory(tmp_path, 8, Clock())
    for i in range(2):
        put(tier, i, ChunkMeta(tenant="x"))
    for i in range(100, 300):
        put(tier, i)
    assert held(tier, [0, 1]) == []


def test_pinned_bytes_never_pass_max_pinned_share(tmp_path: Path) -> None:
    tier = memory(tmp_path, 8, Clock(), max_pinned_share=0.25)  # 2 of 8 slots
    pin = ChunkMeta(retain_until=T0 + 60)
    for i in range(5):
        assert put(tier, i, pin)  # stored, pinned or not
    stats = tier.retention_stats()
    assert (stats.pinned_chunks, stats.pins_refused) == (2, 3)
    for i in range(100, 200):
        put(tier, i)
    assert held(tier, range(5)) == [0, 1]  # the refused three were stored unpinned


def test_no_pins_at_all_with_a_zero_share(tmp_path: Path) -> None:
    tier = memory(tmp_path, 8, Clock(), max_pinned_share=0)
    put(tier, 0, ChunkMeta(retain_until=T0 + 60))
    assert tier.retention_stats().pins_refused == 1


def test_a_request_ttl_expires_its_chunks(tmp_path: Path) -> None:
    clock = Clock()
    tier = memory(tmp_path, 8, clock)
    removed: list[tuple[EventKind, bytes]] = []
    tier.events.listen(lambda _tier, kind, k, _retired: removed.append((kind, bytes(k))))
    put(tier, 0, ChunkMeta(expires_at=T0 + 600))
    put(tier, 1)
    out = memoryview(bytearray(LAYOUT.bytes_per_chunk))
    clock.now = T0 + 599
    assert tier.get_into(key(0), out)
    clock.now = T0 + 600
    assert not tier.contains(key(0))
    assert not tier.get_into(key(0), out)  # a miss, and the slot is reclaimed
    assert tier.stats().chunks == 1
    assert tier.contains(key(1))  # no TTL: stays
    assert (EventKind.REMOVED, bytes(key(0))) in removed
    assert tier.retention_stats().expired == 1


def test_the_tiers_ttl_applies_to_chunks_whose_request_set_none(tmp_path: Path) -> None:
    clock = Clock()
    tier = memory(tmp_path, 8, clock, ttl_s=30)
    put(tier, 0)
    put(tier, 1, ChunkMeta(expires_at=T0 + 300))  # the request's own TTL wins
    clock.now = T0 + 31
    # Reclaimed without being asked for: the stats call (every engine step) reaps.
    stats = tier.retention_stats()
    assert stats.expired == 1 and tier.stats().chunks == 1
    assert held(tier, [0, 1]) == [1]


def test_an_expired_pin_is_gone_even_while_pinned(tmp_path: Path) -> None:
    # A TTL shorter than the pin: expiry wins (the chunk is a miss once expired).
    clock = Clock()
    tier = memory(tmp_path, 8, clock)
    put(tier, 0, ChunkMeta(retain_until=T0 + 3600, expires_at=T0 + 10))
    clock.now = T0 + 11
    assert not tier.contains(key(0))
    assert tier.retention_stats().pinned_chunks == 0


def test_retain_pins_a_held_chunk_and_extends_it(tmp_path: Path) -> None:
    clock = Clock()
    tier = memory(tmp_path, 4, clock)
    put(tier, 0)
    assert tier.retain(key(0), ChunkMeta(retain_until=T0 + 100))
    assert not tier.retain(key(9), ChunkMeta(retain_until=T0 + 100))  # not held
    tier.retain(key(0), ChunkMeta(retain_until=T0 + 50))  # an earlier end does not shorten it
    clock.now = T0 + 60
    for i in range(10, 30):
        put(tier, i)
    assert tier.contains(key(0))
    meta = tier.meta_of(key(0))
    assert meta is not None and meta.retain_until == T0 + 100


def test_pins_and_expiry_go_down_the_write_behind_and_up_with_promotions(
        tmp_path: Path) -> None:
    clock = Clock()
    top = memory(tmp_path, 2, clock, name="ram")
    lower = memory(tmp_path, 16, clock, name="ram2")
    meta = ChunkMeta(tenant="t", retain_until=T0 + 100, expires_at=T0 + 200)
    with TieredStore([top, lower]) as store:
        assert store.put(key(0), memoryview(CHUNK), meta=meta)
        store.flush()
        assert lower.meta_of(key(0)) == meta  # written behind with its metadata
        for i in range(10, 20):  # unpinned chunks push... nothing pinned out of the top
            store.put(key(i), memoryview(CHUNK))
        store.flush()
        assert top.contains(key(0))
        # Dropped from the top (as by a restart of it), the chunk is promoted back from
        # the lower tier with its pin and expiry.
        top.delete(key(0))
        out = memoryview(bytearray(LAYOUT.bytes_per_chunk))
        assert store.get_into(key(0), out) == "ram2"
        assert top.meta_of(key(0)) == meta
        # A later hit that asks for a longer pin extends it in every tier holding it.
        assert store.retain(key(0), ChunkMeta(retain_until=T0 + 500)) == 2
        assert lower.meta_of(key(0)) == ChunkMeta("t", T0 + 500, T0 + 200)
        clock.now = T0 + 201
        assert store.lookup([key(0)]).num_chunks == 0  # expired everywhere


def test_a_promoted_chunk_carries_its_requests_expiry_not_the_lower_tiers_ttl(
        tmp_path: Path) -> None:
    """docs/retention.md: a tier's `ttl_s` dates the chunks whose request set no expiry,
    from when they reach it. Promoted, a chunk carries its request's expiry up, not the
    date the lower tier's `ttl_s` gave it: the top tier dates it by its own `ttl_s` (here
    longer than the lower tier's, which would expire it first)."""
    clock = Clock()
    top = memory(tmp_path, 4, clock, name="ram", ttl_s=100)
    lower = memory(tmp_path, 16, clock, name="ram2", ttl_s=10)
    with TieredStore([top, lower]) as store:
        assert store.put(key(0), memoryview(CHUNK))  # no expiry of its own
        assert store.put(key(1), memoryview(CHUNK), ChunkMeta(expires_at=T0 + 60))
        store.flush()
        assert lower.meta_of(key(0)) == ChunkMeta()  # the lower tier's date is its own
        for i in range(2):  # dropped from the top (as by a restart of it)
            top.delete(key(i))
        clock.now = T0 + 5
        out = memoryview(bytearray(LAYOUT.bytes_per_chunk))
        assert [store.get_into(key(i), out) for i in range(2)] == ["ram2", "ram2"]
        assert top.meta_of(key(0)) == ChunkMeta()
        assert top.meta_of(key(1)) == ChunkMeta(expires_at=T0 + 60)
        clock.now = T0 + 50  # past the lower tier's ttl_s, within the top's
        assert held(top, [0, 1]) == [0, 1] and held(lower, [0, 1]) == [1]
        clock.now = T0 + 60  # the request's own expiry holds in the top tier too
        assert held(top, [0, 1]) == [0]
        clock.now = T0 + 105  # the top's own ttl_s, from the promotion
        assert held(top, [0, 1]) == []


def test_a_retain_never_shortens_a_chunks_life(tmp_path: Path) -> None:
    clock = Clock()
    tier = memory(tmp_path, 4, clock)
    put(tier, 0)  # never expires
    put(tier, 1, ChunkMeta(expires_at=T0 + 10))
    tier.retain(key(0), ChunkMeta(expires_at=T0 + 5))
    tier.retain(key(1), ChunkMeta(expires_at=T0 + 5))  # earlier: ignored
    tier.retain(key(1), ChunkMeta(expires_at=T0 + 20))  # later: extends
    clock.now = T0 + 15
    assert held(tier, [0, 1]) == [0, 1]
    clock.now = T0 + 21
    assert held(tier, [0, 1]) == [0]


def test_without_settings_or_metadata_the_tier_records_nothing(tmp_path: Path) -> None:
    # The plain path (no quota, no TTL, chunks without metadata) keeps no per-chunk book.
    tier = memory(tmp_path, 4, Clock())
    for i in range(10):
        put(tier, i)
    assert tier.retention_stats().tenants == ()
    with_quota = memory(tmp_path, 4, Clock(), name="q", tenant_quota={"share": 1})
    for i in range(10):
        put(with_quota, i)
    [default] = with_quota.retention_stats().tenants
    assert (default.tenant, default.chunks, default.evictions) == ("default", 4, 6)


def test_a_chunk_stored_again_with_its_expiry_expires_once(tmp_path: Path) -> None:
    """A request's expiry is absolute: a chunk evicted from RAM and promoted back from a lower
    tier comes back with the same `expires_at`, and its first stay's heap entry is still
    there. Both are due at once: it is removed once, not a second time (a KeyError that
    dropped the next chunk's put, escaped `putting` to the engine's gather, and left the
    chunks gauge counting the expired chunk)."""
    clock = Clock()
    top = memory(tmp_path, 1, clock, name="ram")
    lower = memory(tmp_path, 8, clock, name="ram2")
    ttl = ChunkMeta(expires_at=T0 + 60)
    out = memoryview(bytearray(LAYOUT.bytes_per_chunk))
    with TieredStore([top, lower]) as store:
        assert store.put(key(0), memoryview(CHUNK), ttl)
        store.flush()
        assert store.put(key(1), memoryview(CHUNK))  # RAM's one slot: chunk 0 evicted...
        store.flush()
        assert store.get_into(key(0), out) == "ram2"  # ...and promoted back, same expiry
        clock.now = T0 + 61
        assert store.put(key(2), memoryview(CHUNK))  # RAM reclaims chunk 0's slot for it
        with store.putting(key(3), memoryview(bytearray(LAYOUT.bytes_per_chunk))) as pending:
            assert pending.data is not None
            pending.data[:] = CHUNK
        assert pending.stored
        assert held(top, range(4)) == [3]
        assert top.stats().chunks == 1 and top.check() == []
        assert top.retention_stats().expired == 1


def test_a_chunk_back_from_a_pin_or_promoted_extends_its_parent_in_a_prefix_tier(
        tmp_path: Path) -> None:
    """A prefix policy evicts leaves only: a chunk held with its parent must extend it. A
    chunk whose pin ends re-enters the policy, and one promoted from a lower tier enters it,
    under its parent: the one its metadata named (kept by the tier's book), or else the one
    the reader names. Entered as roots, each left its parent a leaf, evicted before it."""
    clock = Clock()
    top = memory(tmp_path, 2, clock, name="ram", eviction="prefix")
    lower = memory(tmp_path, 8, clock, name="ram2")
    with TieredStore([top, lower]) as store:
        assert store.put(key(0), memoryview(CHUNK))
        assert store.put(key(1), memoryview(CHUNK),
                         ChunkMeta(retain_until=T0 + 5, parent=key(0)))
        store.flush()
        clock.now = T0 + 10  # the pin of 1 ended: back in the policy, under 0
        assert store.put(key(2), memoryview(CHUNK), ChunkMeta(parent=key(1)))
        assert held(top, [0, 1, 2]) == [0, 2], "the parent went before its child"
        # Promoted: the lower tier's book names 0 (the pin, lapsed, is what it keeps of 1).
        top.delete(key(2))
        out = memoryview(bytearray(LAYOUT.bytes_per_chunk))
        assert store.get_into(key(1), out) == "ram2"
        assert store.put(key(3), memoryview(CHUNK))
        assert held(top, [0, 1, 3]) == [0, 3]
        # Promoted with metadata that names no parent (a tenant's): the reader's names it.
        assert store.put(key(4), memoryview(CHUNK), ChunkMeta(tenant="t"))
        store.flush()
        top.delete(key(3))
        top.delete(key(4))
        assert store.put(key(5), memoryview(CHUNK))  # the parent, held before its child
        assert store.get_into(key(4), out, ChunkMeta(parent=key(5))) == "ram2"
        assert store.put(key(6), memoryview(CHUNK))
        assert held(top, [4, 5, 6]) == [5, 6]
