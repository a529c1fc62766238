"""Borrowing a chunk without copying it: `MemoryTier.borrow` and `TieredStore.borrow`.

The vLLM worker scatters a loaded chunk straight from the memory tier's slab into the paged
KV (issue 3, "data path speed"), so a borrowed slot must stay intact while it is read, even
when puts evict or delete its chunk meanwhile; and a chunk found only in a slower tier is
read into the caller's spare buffer instead.
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
from tierkit import footprint_bytes, tier_settings, tiny_layout

from kvtier.config import MemoryTierConfig, StoreConfig
from kvtier.core.keys import ChunkKey
from kvtier.core.store import TieredStore
from kvtier.core.tier import Lender
from kvtier.tiers.memory import MemoryTier

LAYOUT = tiny_layout(4)  # 1 KiB chunks


def key(i: int) -> ChunkKey:
    return ChunkKey(b"borrow" + i.to_bytes(10, "big"))


def payload(i: int) -> bytes:
    return bytes((i * 31 + j) % 256 for j in range(LAYOUT.bytes_per_chunk))


def memory_tier(slots: int) -> MemoryTier:
    capacity = slots * footprint_bytes("memory", LAYOUT)
    return MemoryTier(MemoryTierConfig(kind="memory", capacity=capacity, pin="off"), LAYOUT)


def test_a_borrowed_slot_survives_eviction_and_is_freed_by_its_borrower() -> None:
    tier = memory_tier(2)
    assert isinstance(tier, Lender)
    tier.put(key(0), memoryview(payload(0)))
    tier.put(key(1), memoryview(payload(1)))
    with tier.borrow(key(0)) as view:
        assert view is not None and view.readonly and bytes(view) == payload(0)
        # Two more puts evict both chunks; key 0's slot is pinned, so both land in key 1's
        # slot, one after the other, and what the borrower reads never changes.
        tier.put(key(2), memoryview(payload(2)))
        tier.put(key(3), memoryview(payload(3)))
        assert not tier.contains(key(0))
        assert bytes(view) == payload(0)
    # Key 0's slot is free again once the borrower left: the next put takes it.
    tier.put(key(4), memoryview(payload(4)))
    assert tier.contains(key(3)) and tier.contains(key(4))
    with tier.borrow(key(4)) as view:
        assert view is not None and bytes(view) == payload(4)


def test_a_chunk_deleted_while_borrowed_keeps_its_bytes_until_returned() -> None:
    tier = memory_tier(1)
    tier.put(key(0), memoryview(payload(0)))
    with tier.borrow(key(0)) as view:
        assert tier.delete(key(0))
        assert not tier.put(key(1), memoryview(payload(1)))  # the only slot is still lent
        assert view is not None and bytes(view) == payload(0)
    assert tier.put(key(1), memoryview(payload(1)))


def test_a_missing_chunk_lends_none_and_counts_a_miss() -> None:
    tier = memory_tier(1)
    with tier.borrow(key(9)) as view:
        assert view is None
    assert tier.stats().misses == 1 and tier.stats().hits == 0


def test_borrowers_on_many_threads_read_their_own_chunks_while_puts_evict() -> None:
    tier = memory_tier(4)
    errors: list[str] = []

    def reader(i: int) -> None:
        for _ in range(200):
            tier.put(key(i), memoryview(payload(i)))
            with tier.borrow(key(i)) as view:
                if view is not None and bytes(view) != payload(i):
                    errors.append(f"chunk {i} changed while lent")

    threads = [threading.Thread(target=reader, args=(i,)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []


@pytest.fixture
def two_tier_store(tmp_path: Path) -> TieredStore:
    tiers = [tier_settings("memory", tmp_path, LAYOUT, 1),
             tier_settings("disk", tmp_path, LAYOUT, 4, o_direct="off")]
    return TieredStore(StoreConfig.parse({"tiers": tiers}), LAYOUT)


def test_the_store_lends_memory_in_place_and_disk_through_the_spare(
        two_tier_store: TieredStore) -> None:
    store = two_tier_store
    spare = memoryview(bytearray(LAYOUT.bytes_per_chunk))
    store.put(key(0), memoryview(payload(0)))
    store.put(key(1), memoryview(payload(1)))  # evicts key 0 from memory
    assert store.flush(timeout_s=5)
    with store.borrow(key(1), spare) as lent:
        assert lent is not None and lent.tier == "memory"
        assert bytes(lent.data) == payload(1) and bytes(spare) != payload(1)  # no copy
    with store.borrow(key(0), spare) as lent:
        assert lent is not None and lent.tier == "disk"
        assert bytes(lent.data) == payload(0) == bytes(spare)
    # The disk hit was promoted: the next borrow is served by memory.
    with store.borrow(key(0), spare) as lent:
        assert lent is not None and lent.tier == "memory"
    with store.borrow(key(7), spare) as lent:
        assert lent is None
    store.close()


def test_a_batch_lends_memory_in_place_reads_disk_in_parallel_and_marks_misses(
        two_tier_store: TieredStore) -> None:
    store = two_tier_store
    spares = [memoryview(bytearray(LAYOUT.bytes_per_chunk)) for _ in range(3)]
    store.put(key(0), memoryview(payload(0)))
    store.put(key(1), memoryview(payload(1)))  # memory holds one chunk: key 0 is on disk only
    assert store.flush(timeout_s=5)
    with store.borrow_many([key(1), key(0), key(5)], spares) as lent:
        assert [v.tier if v else None for v in lent] == ["memory", "disk", None]
        assert lent[0] is not None and bytes(lent[0].data) == payload(1)
        assert lent[1] is not None and bytes(lent[1].data) == payload(0) == bytes(spares[1])
        assert bytes(spares[0]) != payload(1)  # lent in place, not copied
    store.close()
