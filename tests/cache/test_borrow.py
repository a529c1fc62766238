"""Moving a chunk without copying it: `MemoryTier.borrow` / `reserve` and the store's
`borrow` / `lend_as_landed` / `put_from`.

The vLLM worker scatters a loaded chunk straight from the memory tier's slab into the paged
KV (issue 3, "data path speed"), so a borrowed slot must stay intact while it is read, even
when puts evict or delete its chunk meanwhile; a chunk found only in a slower tier is read
straight into a slot the memory tier reserves (else into the caller's spare buffer). Stores
gather straight into a reserved slot: a reservation is stored only when committed, and its
slot stays intact until it is left.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest
from tierkit import footprint_bytes, key, tier_settings, tiny_layout

from kvtier.core.keys import ChunkKey
from kvtier.core.loans import Lending
from kvtier.core.store import ChunkView, TieredStore
from kvtier.core.tier import FULL, OK, Failure, InPlace, TierResult
from kvtier.tiers import open_store
from kvtier.tiers.memory import MemoryTier, MemoryTierConfig
from kvtier.tiers.storeconfig import StoreConfig

LAYOUT = tiny_layout(4)  # 1 KiB chunks


def payload(i: int) -> bytes:
    return bytes((i * 31 + j) % 256 for j in range(LAYOUT.bytes_per_chunk))


def memory_tier(slots: int) -> MemoryTier:
    capacity = slots * footprint_bytes("memory", LAYOUT)
    return MemoryTier(MemoryTierConfig(kind="memory", capacity=capacity, pin="off"), LAYOUT)


def test_a_borrowed_chunk_is_not_evicted_while_lent() -> None:
    """A lent chunk is being read (a load): evicting it frees no slot until the loan ends and
    loses a chunk in use, so puts evict the others. Before: every put evicted the lent chunk
    (its slot orphaned until returned) and the next victim with it."""
    tier = memory_tier(3)
    for i in range(3):
        tier.put(key(i), memoryview(payload(i)))
    with tier.borrow(key(0)) as view:
        assert view is not None and view.readonly and bytes(view) == payload(0)
        for i in (3, 4, 5):  # the policy's victims: keys 1, 2, 0 (lent: skipped), then 3
            assert tier.put(key(i), memoryview(payload(i))) == OK
        assert tier.contains(key(0)) and bytes(view) == payload(0)
        assert [i for i in range(6) if tier.contains(key(i))] == [0, 4, 5]
        assert tier.stats().evictions == 3  # one a put
    with tier.borrow(key(0)) as view:
        assert view is not None and bytes(view) == payload(0)


def test_a_put_finding_every_chunk_lent_is_declined_and_loses_none() -> None:
    tier = memory_tier(2)
    for i in range(2):
        tier.put(key(i), memoryview(payload(i)))
    with tier.borrow(key(0)), tier.borrow(key(1)):
        assert tier.put(key(2), memoryview(payload(2))) == FULL
        assert tier.contains(key(0)) and tier.contains(key(1))
        assert tier.stats().evictions == 0
    assert tier.put(key(2), memoryview(payload(2))) == OK  # lent no more: one evicted
    assert tier.stats().evictions == 1 and not tier.check()


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
    return open_store(StoreConfig.parse({"tiers": tiers}), LAYOUT)


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
        # Read straight into a memory-tier slot it reserved (that read is the promotion),
        # not into the spare and then copied.
        assert bytes(lent.data) == payload(0) and bytes(spare) != payload(0)
    # The disk hit was promoted: the next borrow is served by memory.
    with store.borrow(key(0), spare) as lent:
        assert lent is not None and lent.tier == "memory"
    with store.borrow(key(7), spare) as lent:
        assert lent is None
    store.close()


def lent_tiers(lending: Lending[ChunkView]) -> list[tuple[int, str]]:
    """(index, tier) of each chunk in the order lent, each released once lent."""
    lent = []
    for loan in lending:
        with loan:
            lent.append((loan.index, loan.view.tier))
    return lent


def test_a_lending_lends_memory_in_place_reads_disk_in_parallel_and_stops_at_a_miss(
        two_tier_store: TieredStore) -> None:
    store = two_tier_store
    spares = [memoryview(bytearray(LAYOUT.bytes_per_chunk)) for _ in range(4)]
    store.put(key(0), memoryview(payload(0)))
    store.put(key(1), memoryview(payload(1)))  # memory holds one chunk: key 0 is on disk only
    store.put(key(2), memoryview(payload(2)))  # and now key 1
    store.put(key(1), memoryview(payload(1)))  # key 1 in memory, keys 0 and 2 on disk
    assert store.flush(timeout_s=5)
    with store.lend_as_landed([key(1), key(0), key(5), key(2)], spares, in_order=True) as lending:
        loans = list(lending)  # all held: memory's one slot stays lent
        # Memory's one slot is lent (pinned), so it has none to reserve for key 0: the
        # disk read goes to the spare. Key 2, past the miss, is never lent.
        assert [(loan.index, loan.view.tier, loan.in_place) for loan in loans] == [
            (0, "memory", True), (1, "disk", False)]
        assert bytes(loans[0].view.data) == payload(1) and bytes(spares[0]) != payload(1)
        assert bytes(loans[1].view.data) == payload(0)
        assert payload(0) in [bytes(spare) for spare in spares]
        assert (lending.stopped_at, lending.failed_tier) == (2, None)  # absent: no tier's fault
    store.close()


def test_a_lending_names_the_tier_that_failed_a_read_not_one_that_lacked_the_chunk(
        two_tier_store: TieredStore, monkeypatch: pytest.MonkeyPatch) -> None:
    """What a failed load's time is charged to (loadcost.py): a tier that failed the read
    (erred, down, or late). A chunk absent or damaged says nothing of its tier's speed."""
    store = two_tier_store
    spares = [memoryview(bytearray(LAYOUT.bytes_per_chunk)) for _ in range(4)]
    for i in range(4):
        store.put(key(i), memoryview(payload(i)))  # keys 0-2 on disk only
    assert store.flush(timeout_s=5)
    disk = store.tiers[1]
    read = disk.get_into
    faults = {key(1): TierResult(Failure.IO_ERROR), key(2): TierResult(Failure.CORRUPT)}
    monkeypatch.setattr(disk, "get_into", lambda k, *a: faults[k] if k in faults else read(k, *a))
    for keys, lent, failed in [([0, 1, 2], [(0, "disk")], ("disk", 1)),
                               ([2, 1], [], (None, 0)),  # corrupt
                               ([5], [], (None, 0))]:  # absent
        with store.lend_as_landed([key(i) for i in keys], spares) as lending:
            assert lent_tiers(lending) == lent
            assert (lending.failed_tier, lending.stopped_at) == failed
    store.close()


def test_a_lending_lends_the_first_landed_first_and_waits_for_the_rest_on_exit(
        two_tier_store: TieredStore, monkeypatch: pytest.MonkeyPatch) -> None:
    """The CPU mover scatters chunk i while later chunks are still being read (issue 26: a
    disk hit's copy overlaps its reads), whichever lands first (a late read holds up no
    other); reads the borrower never took are finished before the lending ends (they may
    write into the caller's spares)."""
    store = two_tier_store
    spares = [memoryview(bytearray(LAYOUT.bytes_per_chunk)) for _ in range(3)]
    for i in range(4):
        store.put(key(i), memoryview(payload(i)))  # keys 0-2 on disk only
    assert store.flush(timeout_s=5)
    disk = store.tiers[1]
    read = disk.get_into
    gates = {key(1): threading.Event(), key(2): threading.Event()}
    landed: list[int] = []

    def gated_read(k: ChunkKey, *args: Any) -> TierResult:
        if k in gates:
            gates[k].wait(3)
        result = read(k, *args)
        landed.append(int.from_bytes(bytes(k), "big"))
        return result

    monkeypatch.setattr(disk, "get_into", gated_read)
    with store.lend_as_landed([key(0), key(1), key(2)], spares) as lending:
        first = next(lending)
        assert first.index == 0 and bytes(first.view.data) == payload(0)
        assert landed == [0]  # chunks 1 and 2 are still being read
        gates[key(2)].set()
        second = next(lending)  # chunk 2 landed first: lent before chunk 1
        assert second.index == 2 and bytes(second.view.data) == payload(2)
        threading.Timer(0.2, gates[key(1)].set).start()
    assert sorted(landed) == [0, 1, 2]  # chunk 1, never asked for, landed before the exit
    store.close()


def gated_disk_read(store: TieredStore, monkeypatch: pytest.MonkeyPatch, held: ChunkKey,
                    wait_s: float) -> threading.Event:
    """Chunks 0-2 put (0 and 1 on disk only, 2 in memory); the disk's read of `held` waits
    for the event returned (at most `wait_s`)."""
    for i in range(3):
        store.put(key(i), memoryview(payload(i)))
    assert store.flush(timeout_s=5)
    disk = store.tiers[1]
    read = disk.get_into
    gate = threading.Event()

    def gated_read(k: ChunkKey, *args: Any) -> TierResult:
        if k == held:
            gate.wait(wait_s)
        return read(k, *args)

    monkeypatch.setattr(disk, "get_into", gated_read)
    return gate


def test_a_lending_in_order_waits_for_each_chunk_in_turn(
        two_tier_store: TieredStore, monkeypatch: pytest.MonkeyPatch) -> None:
    """Models with state layers take their chunks in key order: chunk 1, landed first, waits
    for chunk 0."""
    store = two_tier_store
    spares = [memoryview(bytearray(LAYOUT.bytes_per_chunk)) for _ in range(2)]
    gate = gated_disk_read(store, monkeypatch, key(0), 3)
    threading.Timer(0.2, gate.set).start()
    with store.lend_as_landed([key(0), key(1)], spares, in_order=True) as lending:
        assert lent_tiers(lending) == [(0, "disk"), (1, "disk")]
    store.close()


def test_a_lending_says_whether_its_next_chunk_has_landed(
        two_tier_store: TieredStore, monkeypatch: pytest.MonkeyPatch) -> None:
    """`ready`: what a node checks before sending a part of its reply (node/stream.py)."""
    store = two_tier_store
    spares = [memoryview(bytearray(LAYOUT.bytes_per_chunk)) for _ in range(3)]
    gate = gated_disk_read(store, monkeypatch, key(1), 10)
    with store.lend_as_landed([key(0), key(1), key(2)], spares, in_order=True) as lending:
        assert next(lending).index == 0
        assert not lending.ready()  # chunk 1's read is held
        gate.set()
        deadline = time.monotonic() + 10
        while not lending.ready() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert lending.ready()
        assert next(lending).index == 1
        assert lending.ready()  # chunk 2 is in memory: lent where it lies
        assert next(lending).index == 2
        assert not lending.ready()  # nothing left
    store.close()


class Reached:
    """A `Completion` (a device's event) reached when the test says so."""

    def __init__(self) -> None:
        self.reached = threading.Event()
        self.waited = False

    def query(self) -> bool:
        return self.reached.is_set()

    def synchronize(self) -> None:
        self.waited = True
        assert self.reached.wait(3)


def test_a_loan_keeps_its_spare_until_released_and_one_in_place_keeps_none(
        tmp_path: Path) -> None:
    """The borrower decides how long a chunk stays lent (the device mover: until its copy is
    done). A chunk read into a spare keeps it: with one spare, the next read waits for the
    loan released after an event, and a borrower that keeps every spare is told so. Chunks
    lent in place (RAM) keep no spare: any number may stay lent."""
    tiers = [tier_settings("memory", tmp_path, LAYOUT, 4),
             tier_settings("disk", tmp_path, LAYOUT, 8, o_direct="off")]
    store = open_store(StoreConfig.parse({"tiers": tiers}), LAYOUT)
    for i in range(6):
        store.put(key(i), memoryview(payload(i)))  # keys 0 and 1 on disk only
    assert store.flush(timeout_s=5)
    spare = [memoryview(bytearray(LAYOUT.bytes_per_chunk))]
    with store.lend_as_landed([key(i) for i in range(2, 6)], spare, in_order=True) as lending:
        loans = list(lending)  # none released
        assert [(loan.index, loan.in_place) for loan in loans] == [(i, True) for i in range(4)]
        assert [bytes(loan.view.data) for loan in loans] == [payload(i) for i in range(2, 6)]
    with store.lend_as_landed([key(0), key(1)], spare, in_order=True) as lending:
        first = next(lending)
        assert not first.in_place
        with pytest.raises(RuntimeError, match="lent"):
            next(lending)  # the only spare is lent, and not after an event
        copied = Reached()
        first.release_after(copied)
        threading.Timer(0.1, copied.reached.set).start()
        second = next(lending)
        assert copied.waited and second.index == 1 and bytes(second.view.data) == payload(1)
    store.close()


class Boom(Exception):
    pass


def test_a_reserved_slot_is_stored_on_commit_and_stays_intact_until_left() -> None:
    tier = memory_tier(2)
    assert isinstance(tier, InPlace)
    with tier.reserve(key(0)) as slot:
        assert not isinstance(slot, TierResult) and not slot.data.readonly
        slot.data[:] = payload(0)
        assert not tier.contains(key(0))  # not before the commit
        slot.commit()
        assert tier.contains(key(0))
        # Two puts: key 1 takes the free slot, key 2 key 1's (key 0, its slot pinned while
        # the reservation is open, is not evicted); what the block reads never changes.
        tier.put(key(1), memoryview(payload(1)))
        tier.put(key(2), memoryview(payload(2)))
        assert tier.contains(key(0)) and not tier.contains(key(1))
        assert bytes(slot.data) == payload(0)
    assert tier.stats().puts == 3 and tier.stats().chunks == 2
    assert tier.put(key(3), memoryview(payload(3)))
    assert tier.stats().chunks == 2 and tier.stats().evictions == 2 and not tier.check()


def test_a_reservation_left_without_a_commit_or_by_an_error_stores_nothing() -> None:
    tier = memory_tier(1)
    with tier.reserve(key(0)) as slot:
        assert not isinstance(slot, TierResult)
        slot.data[:] = payload(0)
    with pytest.raises(Boom), tier.reserve(key(1)) as slot:
        raise Boom
    assert not tier.contains(key(0)) and not tier.contains(key(1))
    assert tier.stats().puts == 0
    assert tier.put(key(2), memoryview(payload(2)))  # the only slot was freed both times


def test_a_reservation_that_evicted_and_was_left_leaves_the_gauges_true() -> None:
    """A store given up (a node's reserved slot never committed) after its reservation evicted
    a chunk: the tier's chunks and bytes say what it holds (they said 2 chunks, holding 1)."""
    tier = memory_tier(2)
    for i in range(2):
        assert tier.put(key(i), memoryview(payload(i)))
    with tier.reserve(key(5)) as slot:
        assert not isinstance(slot, TierResult)  # evicted a chunk for it; never committed
    held = sum(tier.contains(key(i)) for i in range(2))
    assert held == 1
    assert (tier.stats().chunks, tier.stats().used_bytes) == (held, held * tier.slot_bytes)


def test_a_borrows_read_time_leaves_out_how_long_it_is_held(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A node's engine holds a lent chunk while it copies it: the tier's read seconds were
    that hold (3 s held read 3 s)."""
    clock = [100.0]
    monkeypatch.setattr("kvtier.tiers.memory.time.perf_counter", lambda: clock[0])
    tier = memory_tier(1)
    assert tier.put(key(0), memoryview(payload(0)))
    with tier.borrow(key(0)) as view:
        assert view is not None
        clock[0] += 3.0  # the borrower copies for 3 s
    assert tier.stats().hits == 1
    assert tier.stats().read_s == 0.0


def test_no_slot_for_a_held_chunk_nor_when_every_slot_is_pinned() -> None:
    tier = memory_tier(1)
    tier.put(key(0), memoryview(payload(0)))
    with tier.reserve(key(0)) as slot:
        assert slot == OK  # held already: not a dropped write
    assert tier.stats().dropped_writes == 0
    with tier.borrow(key(0)), tier.reserve(key(1)) as slot:
        assert slot == FULL
    assert tier.stats().dropped_writes == 1


def test_two_writers_of_one_chunk_store_it_once() -> None:
    tier = memory_tier(2)
    with tier.reserve(key(0)) as first, tier.reserve(key(0)) as second:
        assert not isinstance(first, TierResult) and not isinstance(second, TierResult)
        first.data[:] = payload(0)
        second.data[:] = payload(0)
        first.commit()
        second.commit()  # another writer stored it meanwhile: this slot is spare
    assert tier.stats().chunks == 1 and tier.stats().puts == 1
    assert tier.put(key(1), memoryview(payload(1)))  # the spare slot is free again
    assert tier.stats().chunks == 2


def test_put_from_fills_the_memory_slot_in_place_and_the_disk_behind(
        two_tier_store: TieredStore, tmp_path: Path) -> None:
    store = two_tier_store
    spare = memoryview(bytearray(LAYOUT.bytes_per_chunk))
    filled: list[int] = []

    def fill(i: int):
        def write(view: memoryview) -> None:
            filled.append(i)
            view[:] = payload(i)
        return write

    assert store.put_from(key(0), fill(0), spare)
    assert bytes(spare) != payload(0)  # gathered straight into the slot
    assert store.flush(timeout_s=5)
    out = memoryview(bytearray(LAYOUT.bytes_per_chunk))
    assert store.tiers[0].get_into(key(0), out) and bytes(out) == payload(0)
    assert store.tiers[1].get_into(key(0), out) and bytes(out) == payload(0)
    # Held everywhere: nothing to gather.
    assert store.put_from(key(0), fill(0), spare) and filled == [0]
    # A fill that fails stores nothing and frees the slot.
    with pytest.raises(Boom):
        store.put_from(key(1), lambda view: (_ for _ in ()).throw(Boom()), spare)
    assert not store.contains(key(1))
    store.close()


def test_put_from_writes_lower_tiers_when_the_top_declines(tmp_path: Path) -> None:
    tiers = [tier_settings("memory", tmp_path, LAYOUT, 2, admit_after=2),
             tier_settings("disk", tmp_path, LAYOUT, 4, o_direct="off")]
    store = open_store(StoreConfig.parse({"tiers": tiers}), LAYOUT)
    spare = memoryview(bytearray(LAYOUT.bytes_per_chunk))

    def fill(view: memoryview) -> None:
        view[:] = payload(3)

    # First sighting: memory's admission filter declines, the disk still gets the chunk.
    assert not store.put_from(key(3), fill, spare)
    assert store.flush(timeout_s=5)
    assert not store.tiers[0].contains(key(3)) and store.tiers[1].contains(key(3))
    # Second sighting: admitted to memory.
    assert store.put_from(key(3), fill, spare) and store.tiers[0].contains(key(3))
    store.close()


def test_puts_kept_open_together_store_each_chunk_once_filled(tmp_path: Path) -> None:
    """`putting` blocks open at once (a device's DMAs in flight): each reserves its own slot
    (the memory tier's two), nothing is visible before its block ends; a third, with every
    slot reserved, is filled in the spare for the disk alone; a cancelled one stores nothing
    anywhere."""
    tiers = [tier_settings("memory", tmp_path, LAYOUT, 2),
             tier_settings("disk", tmp_path, LAYOUT, 4, o_direct="off")]
    store = open_store(StoreConfig.parse({"tiers": tiers}), LAYOUT)
    spare = memoryview(bytearray(LAYOUT.bytes_per_chunk))
    with store.putting(key(10), spare) as a, store.putting(key(11), spare) as b, \
            store.putting(key(12), spare) as c:
        assert a.in_place and b.in_place and not c.in_place and c.data is spare
        assert a.data is not None and b.data is not None
        a.data[:], b.data[:] = payload(10), payload(11)
        c.cancel()  # its fill failed
        assert not store.contains(key(10)) and not store.contains(key(11))
    assert a.stored and b.stored and not c.stored
    assert store.flush(timeout_s=5)
    out = memoryview(bytearray(LAYOUT.bytes_per_chunk))
    for i in (10, 11):
        assert store.tiers[0].get_into(key(i), out) and bytes(out) == payload(i)
        assert store.tiers[1].get_into(key(i), out) and bytes(out) == payload(i)
    assert not store.tiers[0].contains(key(12)) and not store.tiers[1].contains(key(12))
    with store.putting(key(10), spare) as held:  # held already: nothing to fill
        assert held.data is None
    assert held.stored
    store.close()


def test_lendings_on_many_threads_read_disk_into_reserved_slots_without_mixing_chunks(
        tmp_path: Path) -> None:
    """Four threads borrow runs of disk-held chunks while a writer keeps evicting: every
    view holds its own chunk's bytes for as long as it is lent, whether it landed in a
    reserved memory slot or, when none was free, in the spare."""
    tiers = [tier_settings("memory", tmp_path, LAYOUT, 4),
             tier_settings("disk", tmp_path, LAYOUT, 64, o_direct="off")]
    store = open_store(StoreConfig.parse({"tiers": tiers}), LAYOUT)
    for i in range(24):
        store.put(key(i), memoryview(payload(i)))
    assert store.flush(timeout_s=10)
    errors: list[str] = []

    def reader(seed: int) -> None:
        spares = [memoryview(bytearray(LAYOUT.bytes_per_chunk)) for _ in range(3)]
        for n in range(60):
            ids = [(seed * 7 + n * 3 + j) % 24 for j in range(3)]
            with store.lend_as_landed([key(i) for i in ids], spares) as lending:
                loans = list(lending)  # each kept until the lending ends
                if len(loans) != len(ids):
                    errors.append(f"chunk {ids[lending.stopped_at]}: missing")
                for loan in loans:
                    if bytes(loan.view.data) != payload(ids[loan.index]):
                        errors.append(f"chunk {ids[loan.index]}: {loan.view.tier}")

    def writer() -> None:
        for n in range(200):
            store.put(key(100 + n % 8), memoryview(payload(100 + n % 8)))

    threads = [threading.Thread(target=reader, args=(s,)) for s in range(4)]
    threads.append(threading.Thread(target=writer))
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    store.close()
    assert errors == []
