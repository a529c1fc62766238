"""The Tier contract, checked the same way against every tier kind.

Every test is parametrized over TIER_KINDS (tests/tierkit.py): memory, a local disk
directory and a shared directory, both on a real filesystem under tmp_path. A new tier kind
(e.g. redis) joins by adding its kind there. After every test, each tier that keeps books of
what it holds (`Checkable`) must find them in agreement with its storage.
"""

from __future__ import annotations

import mmap
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import tierkit
from tierkit import PERIODIC_CAPACITY, TIER_KINDS, footprint_bytes, key, make_tier, tiny_layout

from kvtier.core.layout import KVLayout
from kvtier.core.retention import ChunkMeta, tenant_id
from kvtier.core.tier import (
    DECLINED,
    MISSING,
    OK,
    Checkable,
    InPlace,
    MetaKeeper,
    Tier,
    TierResult,
)

pytestmark = pytest.mark.parametrize("kind", TIER_KINDS)


@pytest.fixture(autouse=True)
def books_agree_with_storage(kind: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Each tier the test builds is checked (`Checkable.check`) as it is closed, or at
    teardown if the test left it open. The kinds that keep books must offer the check."""
    problems: list[str] = []
    built: list[Tier] = []  # not closed yet
    kinds_checked: set[bool] = set()

    def checked(tier: Tier) -> None:
        kinds_checked.add(isinstance(tier, Checkable))
        if isinstance(tier, Checkable):
            problems.extend(f"{tier.name}: {line}" for line in tier.check())

    def closing_checked(tier: Tier, close: Callable[[], None]) -> Callable[[], None]:
        def close_after_check() -> None:
            built.remove(tier)
            checked(tier)
            close()
        return close_after_check

    def make(*args: Any, **kwargs: Any) -> Tier:
        tier = tierkit.make_tier(*args, **kwargs)
        tier.close = closing_checked(tier, tier.close)  # type: ignore[method-assign]
        built.append(tier)
        return tier

    monkeypatch.setattr(sys.modules[__name__], "make_tier", make)
    yield
    for tier in list(built):
        tier.close()
    assert kind not in BOOK_KEEPERS or kinds_checked <= {True}
    assert not problems, problems


BOOK_KEEPERS = ("memory", "disk", "example")  # the kinds with an index of their own



def payload(i: int, layout: KVLayout) -> bytes:
    """Deterministic, distinct content for chunk i (so a mixed-up chunk is noticed)."""
    return bytes((i * 31 + j * 7) % 251 for j in range(layout.bytes_per_chunk))


def held_keys(tier: Tier, count: int) -> list[int]:
    return [i for i in range(count) if tier.contains(key(i))]


def stored_bytes_on_disk(tmp_path: Path) -> int:
    return sum(p.stat().st_size for p in tmp_path.rglob("*.kvc"))


@pytest.mark.parametrize("tokens_per_chunk", [16, 3], ids=["aligned-4KiB", "unaligned-768B"])
def test_a_put_chunk_is_got_back_byte_for_byte(kind: str, tmp_path: Path,
                                               tokens_per_chunk: int) -> None:
    """Store two chunks, read them back into fresh buffers: exactly the bytes written, for a
    page-aligned chunk size and for one that needs a bounce buffer."""
    layout = tiny_layout(tokens_per_chunk)
    tier = make_tier(kind, tmp_path, layout, capacity_chunks=8)
    for i in (1, 2):
        assert tier.put(key(i), memoryview(payload(i, layout))) == OK
    for i in (2, 1):
        out = bytearray(layout.bytes_per_chunk)
        assert tier.get_into(key(i), memoryview(out)) == OK
        assert bytes(out) == payload(i, layout)
    tier.close()


def test_a_page_aligned_output_buffer_is_filled_exactly(kind: str, tmp_path: Path,
                                                        layout: KVLayout) -> None:
    """Engines read into pinned, page-aligned buffers (the disk tiers' zero-copy path)."""
    tier = make_tier(kind, tmp_path, layout, capacity_chunks=4)
    aligned_in = mmap.mmap(-1, layout.bytes_per_chunk)
    aligned_in[:] = payload(5, layout)
    assert tier.put(key(5), memoryview(aligned_in))
    aligned_out = mmap.mmap(-1, layout.bytes_per_chunk)
    assert tier.get_into(key(5), memoryview(aligned_out))
    assert aligned_out[:] == payload(5, layout)


def test_contains_and_delete_follow_what_was_put(kind: str, tmp_path: Path,
                                                 layout: KVLayout) -> None:
    """A chunk is held after put, not after delete; deleting twice reports it gone."""
    tier = make_tier(kind, tmp_path, layout, capacity_chunks=4)
    assert tier.contains(key(1)) is False
    tier.put(key(1), memoryview(payload(1, layout)))
    tier.put(key(2), memoryview(payload(2, layout)))
    assert tier.contains(key(1)) and tier.contains(key(2))
    assert tier.delete(key(1)) is True
    assert tier.delete(key(1)) is False
    assert tier.contains(key(1)) is False and tier.contains(key(2)) is True
    assert tier.get_into(key(1), memoryview(bytearray(layout.bytes_per_chunk))) == MISSING
    assert tier.stats().chunks == 1


def test_a_get_of_an_absent_key_is_a_counted_miss(kind: str, tmp_path: Path,
                                                  layout: KVLayout) -> None:
    tier = make_tier(kind, tmp_path, layout, capacity_chunks=4)
    before = tier.stats()
    assert tier.get_into(key(99), memoryview(bytearray(layout.bytes_per_chunk))) == MISSING
    after = tier.stats()
    assert (after.misses, after.hits, after.bytes_read) == (before.misses + 1, 0, 0)


def test_counters_move_with_puts_hits_and_misses(kind: str, tmp_path: Path,
                                                 layout: KVLayout) -> None:
    """Three puts (one a repeat), two hits, one miss: every counter says exactly that."""
    tier = make_tier(kind, tmp_path, layout, capacity_chunks=8)
    chunk = layout.bytes_per_chunk
    for i in (1, 2, 1):
        assert tier.put(key(i), memoryview(payload(i, layout)))
    out = memoryview(bytearray(chunk))
    assert tier.get_into(key(1), out) and tier.get_into(key(2), out)
    assert not tier.get_into(key(3), out)
    stats = tier.stats()
    assert stats.name == kind
    assert (stats.puts, stats.bytes_written) == (2, 2 * chunk)
    assert (stats.hits, stats.misses, stats.bytes_read) == (2, 1, 2 * chunk)
    assert (stats.evictions, stats.corrupt_reads, stats.dropped_writes) == (0, 0, 0)
    assert stats.chunks == 2
    assert stats.used_bytes == 2 * footprint_bytes(kind, layout)
    assert stats.capacity_bytes == 8 * footprint_bytes(kind, layout)
    assert stats.read_s >= 0 and stats.write_s > 0
    assert set(stats.as_dict()) >= {"hits", "misses", "used_bytes", "capacity_bytes"}


def test_capacity_is_never_exceeded_and_evictions_are_counted(kind: str, tmp_path: Path,
                                                              layout: KVLayout) -> None:
    """Write 20 chunks into room for 4: after every put the tier holds at most 4 (by its
    stats, by `contains`, and on disk), and every chunk that left is counted as evicted."""
    if kind in PERIODIC_CAPACITY:
        pytest.skip(f"{kind} bounds capacity by a periodic listing (its own tests)")
    capacity_chunks, total = 4, 20
    tier = make_tier(kind, tmp_path, layout, capacity_chunks=capacity_chunks)
    capacity = tier.stats().capacity_bytes
    for i in range(total):
        assert tier.put(key(i), memoryview(payload(i, layout)))
        stats = tier.stats()
        held = held_keys(tier, total)
        assert stats.used_bytes <= capacity
        assert len(held) <= capacity_chunks and stats.chunks == len(held)
        assert stats.evictions == i + 1 - len(held)
        assert stored_bytes_on_disk(tmp_path) <= capacity
    # The newest chunk is always kept, and whatever is held reads back correctly.
    assert (total - 1) in held
    out = bytearray(layout.bytes_per_chunk)
    for i in held:
        assert tier.get_into(key(i), memoryview(out)) and bytes(out) == payload(i, layout)


def test_least_recently_used_chunk_is_evicted_first(kind: str, tmp_path: Path,
                                                    layout: KVLayout) -> None:
    """Room for 3: a, b, c stored, a read; storing d must evict b (least recently used),
    never a. The shared tier orders by file mtime, so give the clock a tick between steps."""
    if kind in PERIODIC_CAPACITY:
        pytest.skip(f"{kind} bounds capacity by a periodic listing (its own tests)")
    import time

    tier = make_tier(kind, tmp_path, layout, capacity_chunks=3)
    out = memoryview(bytearray(layout.bytes_per_chunk))
    for i in (1, 2, 3):
        tier.put(key(i), memoryview(payload(i, layout)))
        time.sleep(0.02)
    assert tier.get_into(key(1), out)
    time.sleep(0.02)
    tier.put(key(4), memoryview(payload(4, layout)))
    assert tier.contains(key(1)) and tier.contains(key(4))
    assert not tier.contains(key(2))


@pytest.mark.parametrize("size_delta", [-1, +1, -256])
def test_a_put_of_the_wrong_size_raises_value_error(kind: str, tmp_path: Path,
                                                    layout: KVLayout, size_delta: int) -> None:
    """A chunk of another size is a caller bug (a wrong layout): it must raise, not be
    stored padded or truncated, and leave the tier as it was."""
    tier = make_tier(kind, tmp_path, layout, capacity_chunks=4)
    with pytest.raises(ValueError):
        tier.put(key(1), memoryview(bytes(layout.bytes_per_chunk + size_delta)))
    assert not tier.contains(key(1))
    assert tier.stats().puts == 0
    # The tier still has all its room.
    for i in range(4):
        tier.put(key(10 + i), memoryview(payload(i, layout)))
    assert len(held_keys(tier, 20)) == 4 and tier.stats().evictions == 0


def test_admission_stores_a_chunk_on_its_second_offer(kind: str, tmp_path: Path,
                                                      layout: KVLayout) -> None:
    """admit_after=2: a one-shot chunk is declined (not a dropped write), a repeated one
    is stored."""
    tier = make_tier(kind, tmp_path, layout, capacity_chunks=4, admit_after=2)
    data = memoryview(payload(1, layout))
    assert tier.put(key(1), data) == DECLINED and not tier.contains(key(1))
    assert tier.put(key(1), data) == OK and tier.contains(key(1))
    assert tier.stats().dropped_writes == 0 and tier.stats().puts == 1


def test_concurrent_puts_from_many_threads_stay_within_capacity(kind: str, tmp_path: Path,
                                                                layout: KVLayout) -> None:
    """The store writes behind on several threads: 8 threads x 12 distinct chunks into room
    for 3. Capacity holds at the end and every held chunk is intact."""
    if kind in PERIODIC_CAPACITY:
        pytest.skip(f"{kind} bounds capacity by a periodic listing (its own tests)")
    tier = make_tier(kind, tmp_path, layout, capacity_chunks=3)
    capacity = tier.stats().capacity_bytes
    start = threading.Barrier(8)

    def writer(thread: int) -> None:
        start.wait()
        for n in range(12):
            i = thread * 100 + n
            tier.put(key(i), memoryview(payload(i, layout)))

    threads = [threading.Thread(target=writer, args=(t,)) for t in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    held = held_keys(tier, 800)
    assert len(held) <= 3
    assert tier.stats().used_bytes <= capacity
    assert stored_bytes_on_disk(tmp_path) <= capacity
    out = bytearray(layout.bytes_per_chunk)
    for i in held:
        assert tier.get_into(key(i), memoryview(out)) and bytes(out) == payload(i, layout)
    assert not [p for p in tmp_path.rglob("*.tmp")], "temp files left behind"
    assert os.path.exists(tmp_path)


def test_put_with_meta_is_idempotent_and_a_later_pin_applies_to_a_held_chunk(
        kind: str, tmp_path: Path, layout: KVLayout) -> None:
    """`put(key, data, meta)` is the one place that decides "held already?": a second put
    of a held chunk is OK and rewrites nothing, and a tier that keeps metadata takes the
    later pin of the second `meta`. A read carrying the chunk's meta gets it back."""
    tier = make_tier(kind, tmp_path, layout, capacity_chunks=4)
    now = time.time()
    first = ChunkMeta(tenant_id("salt-a"), retain_until=None, expires_at=now + 3600)
    later = ChunkMeta(tenant_id("salt-a"), retain_until=now + 600, expires_at=now + 7200)
    assert tier.put(key(1), memoryview(payload(1, layout)), first) == OK
    written = tier.stats().bytes_written
    assert tier.put(key(1), memoryview(payload(2, layout)), later) == OK
    assert tier.stats().bytes_written == written and tier.stats().puts == 1
    out = bytearray(layout.bytes_per_chunk)
    assert tier.get_into(key(1), memoryview(out), later) == OK
    assert bytes(out) == payload(1, layout)
    if isinstance(tier, MetaKeeper):
        assert tier.meta_of(key(1)) == later
    tier.close()


def test_reserve_with_meta_is_put_filled_in_place(kind: str, tmp_path: Path,
                                                  layout: KVLayout) -> None:
    """An InPlace tier's `reserve(key, meta)`: a slot stored with `meta` on commit; for a
    held chunk no slot but OK, with the later pin applied (the same decision as `put`)."""
    tier = make_tier(kind, tmp_path, layout, capacity_chunks=4)
    if not isinstance(tier, InPlace):
        pytest.skip(f"{kind} is not InPlace")
    now = time.time()
    meta = ChunkMeta(tenant_id("salt-b"), retain_until=None, expires_at=now + 3600)
    with tier.reserve(key(3), meta) as slot:
        assert not isinstance(slot, TierResult)
        slot.data[:] = payload(3, layout)
        slot.commit()
    pinned = ChunkMeta(tenant_id("salt-b"), retain_until=now + 600, expires_at=now + 3600)
    with tier.reserve(key(3), pinned) as slot:
        assert slot == OK
    with tier.borrow(key(3), meta) as view:
        assert view is not None and bytes(view) == payload(3, layout)
    if isinstance(tier, MetaKeeper):
        assert tier.meta_of(key(3)) == pinned
    tier.close()
