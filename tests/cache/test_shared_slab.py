"""The memory tier's slab in named shared memory (tiers/shmslab.py), without a node: records
kept per slot, and a successor on the same name recovering exactly the chunks held whole; a
successor with no room for its slab beside its predecessor's starts cold rather than not at
all, and never leaves the old file behind."""

from __future__ import annotations

import errno
import mmap
import os
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest
from tierkit import key, tiny_layout

from kvtier.core.retention import ChunkMeta, tenant_id
from kvtier.tiers.memory import MemoryTier, MemoryTierConfig
from kvtier.tiers.shmslab import SHM_DIR, SharedSlab, SlabReader

LAYOUT = tiny_layout()


@pytest.fixture
def name() -> Iterator[str]:
    name = f"kvtier-test-slab-{os.getpid()}"
    yield name
    for path in SHM_DIR.glob(f"{name}*"):
        path.unlink(missing_ok=True)


def tier(name: str, chunks: int = 8) -> MemoryTier:
    return MemoryTier(MemoryTierConfig(kind="memory", capacity=chunks * 4096 * 2,
                                       shared_memory=name), LAYOUT)


def chunk(i: int) -> memoryview:
    return memoryview(bytes([i]) * LAYOUT.bytes_per_chunk)


def test_a_successor_recovers_what_was_held_and_nothing_else(name: str) -> None:
    first = tier(name)
    assert os.stat(first.shared_memory_path).st_mode & 0o777 == 0o660  # type: ignore[arg-type]
    for i in range(4):
        assert first.put(key(i), chunk(i)).ok
    assert first.delete(key(1))  # gone before the restart: not brought back
    first.keep_shared_memory = True
    first.close()

    second = tier(name)
    assert second.recover() == (3, 0)
    out = bytearray(LAYOUT.bytes_per_chunk)
    for i in (0, 2, 3):
        assert second.get_into(key(i), memoryview(out)).ok and out == chunk(i)
    assert not second.contains(key(1))
    assert sorted(p.name for p in SHM_DIR.glob(f"{name}*")) == [name]  # the old one removed
    second.close()
    assert not list(SHM_DIR.glob(f"{name}*"))  # not kept: removed


def test_a_smaller_successor_counts_the_chunks_it_kept(name: str) -> None:
    """A node restarted with half the RAM recovers what fits, and says so (it counted every
    chunk it put back, 8 where 4 were held)."""
    first = tier(name)
    for i in range(first.num_slots):
        assert first.put(key(i), chunk(i)).ok
    first.keep_shared_memory = True
    first.close()
    second = tier(name, chunks=4)
    assert second.num_slots == first.num_slots // 2
    assert second.recover() == (second.num_slots, 0)
    assert sum(second.contains(key(i)) for i in range(first.num_slots)) == second.num_slots
    second.close()


def test_a_successor_keeps_each_chunks_tenant_pin_expiry_and_parent(name: str) -> None:
    """A pinned system prompt stays pinned across a node's restart, a tenant's chunks stay
    its own, the prefix policy keeps its tree; a chunk expired meanwhile is not recovered."""
    now = time.time()
    tenant = tenant_id("tenant-a")
    first = tier(name)
    assert first.put(key(0), chunk(0), ChunkMeta(tenant=tenant)).ok
    assert first.put(key(1), chunk(1), ChunkMeta(tenant=tenant, parent=key(0))).ok
    assert first.put(key(2), chunk(2), ChunkMeta(expires_at=now + 3600)).ok
    assert first.put(key(3), chunk(3), ChunkMeta(expires_at=now + 0.3)).ok
    assert first.put(key(4), chunk(4)).ok
    assert first.retain(key(4), ChunkMeta(retain_until=now + 3600))  # pinned after its put
    first.keep_shared_memory = True
    first.close()
    time.sleep(0.4)  # key 3 expires

    slab = SharedSlab(name, first.slot_bytes, first.num_slots, first.chunk_bytes)
    metas = {k: meta for k, _, meta in slab.recoverable(time.time())}
    slab.close(keep=False)
    assert metas == {key(0): ChunkMeta(tenant=tenant),
                     key(1): ChunkMeta(tenant=tenant, parent=key(0)),
                     key(2): ChunkMeta(expires_at=now + 3600),
                     key(4): ChunkMeta(retain_until=now + 3600)}


def test_a_recovered_pin_holds_against_a_flood(name: str) -> None:
    first = tier(name)
    assert first.put(key(0), chunk(0), ChunkMeta(retain_until=time.time() + 3600)).ok
    first.keep_shared_memory = True
    first.close()

    second = tier(name)
    assert second.recover() == (1, 0)
    assert second.meta_of(key(0)).retain_until is not None  # type: ignore[union-attr]
    for i in range(1, 3 * second.num_slots):  # three tiers' worth of other chunks
        assert second.put(key(i), chunk(i % 250)).ok
    assert second.contains(key(0))
    second.close()


def test_a_damaged_slot_is_dropped(name: str) -> None:
    first = tier(name)
    for i in range(3):
        assert first.put(key(i), chunk(i)).ok
    first.keep_shared_memory = True
    first.close()
    path = SHM_DIR / name
    data = bytearray(path.read_bytes())
    data[data.find(bytes(chunk(1))) + 7] ^= 1
    path.write_bytes(data)

    second = tier(name)
    assert second.recover() == (2, 1)
    assert second.contains(key(0)) and not second.contains(key(1)) and second.contains(key(2))
    second.close()


def test_a_slab_of_another_layout_is_not_recovered(name: str) -> None:
    first = tier(name)
    assert first.put(key(0), chunk(0)).ok
    first.keep_shared_memory = True
    first.close()
    other = MemoryTier(MemoryTierConfig(kind="memory", capacity=8 * 8192 * 2,
                                        shared_memory=name), tiny_layout(tokens_per_chunk=32))
    assert other.recover() == (0, 0)
    other.close()


def _fallocate_fails(monkeypatch: pytest.MonkeyPatch, times: int) -> list[int]:
    """`posix_fallocate` says ENOSPC (no room in /dev/shm) its next `times` calls: the fault
    injected. The list counts every call."""
    calls: list[int] = []
    real = os.posix_fallocate

    def fallocate(fd: int, offset: int, length: int) -> None:
        calls.append(length)
        if len(calls) <= times:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real(fd, offset, length)

    monkeypatch.setattr(os, "posix_fallocate", fallocate)
    return calls


def test_a_restart_without_room_for_two_slabs_starts_cold_and_leaves_no_old_file(
        name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    first = tier(name)
    assert first.put(key(0), chunk(0)).ok
    first.keep_shared_memory = True
    first.close()

    calls = _fallocate_fails(monkeypatch, times=1)  # room for one slab, not two
    second = tier(name)
    assert len(calls) == 2  # the first try failed; the old file gave its room up
    assert second.recover() == (0, 0) and not second.contains(key(0))
    assert sorted(p.name for p in SHM_DIR.glob(f"{name}*")) == [name]
    assert second.put(key(1), chunk(1)).ok
    second.close()


def test_a_restart_with_no_room_at_all_fails_and_leaves_no_file(
        name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    first = tier(name)
    assert first.put(key(0), chunk(0)).ok
    first.keep_shared_memory = True
    first.close()

    _fallocate_fails(monkeypatch, times=2)  # no room at all: both tries fail
    with pytest.raises(OSError) as raised:
        tier(name)
    assert raised.value.errno == errno.ENOSPC
    monkeypatch.undo()
    assert [p.name for p in SHM_DIR.glob(f"{name}*")] == []  # the old one gave its room up
    assert tier(name).recover() == (0, 0)  # room again: a cold start


def _reader(tier: MemoryTier) -> tuple[SlabReader, mmap.mmap]:
    """An engine's reader of the tier's slab (its own open file, as another process's)."""
    fd = os.open(str(tier.shared_memory_path), os.O_RDWR)
    mapping = mmap.mmap(fd, os.fstat(fd).st_size, mmap.MAP_SHARED)
    return SlabReader(fd, mapping), mapping


def _slot_of(tier: MemoryTier, k: bytes) -> int:
    with tier.borrow(k) as view:  # type: ignore[arg-type]
        assert view is not None
        offset = tier.offset_of(view)
    assert offset is not None
    return offset // tier.slot_bytes


def test_a_slot_read_in_place_keeps_its_chunk_until_released(name: str) -> None:
    """While an engine holds a slot (SlabReader.lock), its chunk may leave the tier but the
    slot is neither written nor handed out; once released, the next put that needs it
    reclaims it. The kernel's OFD locks: a reader's own open file."""
    store = tier(name, chunks=4)
    for i in range(4):
        assert store.put(key(i), chunk(i)).ok
    reader, mapping = _reader(store)
    index = _slot_of(store, key(0))
    assert not reader.lock(index, key(1))  # the record names another chunk
    assert reader.lock(index, key(0))
    view = memoryview(mapping)[index * store.slot_bytes:][:store.chunk_bytes]
    for i in range(4, 16):  # a flood: key 0 leaves, its slot is not reused while held
        assert store.put(key(i), chunk(i)).ok
        assert view == chunk(0)
        assert store.check() == []
    assert not store.contains(key(0))
    reader.unlock(index)
    assert store.put(key(16), chunk(16)).ok  # reclaimed: the slot goes round again
    for i in range(17, 21):
        assert store.put(key(i), chunk(i)).ok
    assert store.check() == []
    assert bytes(view) != bytes(chunk(0))  # reused
    assert not reader.lock(index, key(0))
    view.release()
    reader.close()
    store.close()


def test_a_slot_lent_twice_stays_held_until_its_last_loan_is_released(name: str) -> None:
    """Two loans of one slot on one reader (two requests of a step sharing a prefix, their
    copies in flight together): an OFD lock does not count, so the first release unlocked
    the slot under the second loan's copy; and a reader closed with a loan out keeps it."""
    store = tier(name, chunks=2)
    assert store.put(key(0), chunk(0)).ok
    reader, mapping = _reader(store)
    index = _slot_of(store, key(0))
    assert reader.lock(index, key(0)) and reader.lock(index, key(0))
    assert not reader.lock(index, key(1))  # another chunk's name: refused, the slot held
    reader.unlock(index)  # the first loan ends
    reader.close()  # its thread moves to another slab: the second loan is still out
    view = memoryview(mapping)[index * store.slot_bytes:][:store.chunk_bytes]
    for i in range(1, 6):  # key 0 leaves; its slot is not reused while the loan is out
        assert store.put(key(i), chunk(i)).ok
        assert view == chunk(0)
    reader.unlock(index)  # the last loan ends: the slot is let go, the file closed
    for i in range(6, 10):
        assert store.put(key(i), chunk(i)).ok
    assert bytes(view) != bytes(chunk(0))  # reused
    view.release()
    store.close()


def test_a_deleted_chunk_read_in_place_is_freed_once_released(name: str) -> None:
    store = tier(name, chunks=2)
    assert store.put(key(0), chunk(0)).ok
    reader, _ = _reader(store)
    index = _slot_of(store, key(0))
    assert reader.lock(index, key(0))
    assert store.delete(key(0))
    assert store.check() == []
    reader.unlock(index)
    reader.close()
    for i in range(1, 5):
        assert store.put(key(i), chunk(i)).ok
    assert store.check() == []
    store.close()


def test_a_killed_reader_leaks_no_slot(name: str) -> None:
    """A process holding a slot killed -9: the kernel drops its lock, the slot is reclaimed."""
    store = tier(name, chunks=2)
    assert store.put(key(0), chunk(0)).ok
    index = _slot_of(store, key(0))
    child = subprocess.Popen([sys.executable, "-c", (
        "import mmap, os, sys, time\n"
        "from kvtier.tiers.shmslab import SlabReader\n"
        f"path = {str(store.shared_memory_path)!r}\n"
        "fd = os.open(path, os.O_RDWR)\n"
        "m = mmap.mmap(fd, os.fstat(fd).st_size, mmap.MAP_SHARED)\n"
        f"assert SlabReader(fd, m).lock({index}, bytes.fromhex({key(0).hex()!r}))\n"
        "print('held', flush=True)\n"
        "time.sleep(60)\n")], stdout=subprocess.PIPE, text=True)
    assert child.stdout is not None and child.stdout.readline() == "held\n"
    slots = store.num_slots
    for i in range(1, 2 * slots):  # key 0 leaves; its slot is not among those taken
        assert store.put(key(i), chunk(i)).ok
    assert not store.contains(key(0)) and store.check() == []
    assert sum(store.contains(key(k)) for k in range(2 * slots)) == slots - 1
    child.kill()
    child.wait()
    for i in range(2 * slots, 4 * slots):
        assert store.put(key(i), chunk(i)).ok
    assert sum(store.contains(key(k)) for k in range(4 * slots)) == slots  # every slot again
    assert store.check() == []
    store.close()


def test_a_chunk_that_left_is_not_read_in_place_again_nor_recovered(name: str) -> None:
    """Deleted while one engine reads it: that read goes on, no other starts, and a successor
    does not bring it back. An expired chunk is not read in place either."""
    store = tier(name, chunks=2)
    assert store.put(key(0), chunk(0)).ok
    assert store.put(key(1), chunk(1), ChunkMeta(expires_at=time.time() + 1.0)).ok
    expiring = _slot_of(store, key(1))  # while it is held: within its second
    first, _ = _reader(store)
    second, _ = _reader(store)
    index = _slot_of(store, key(0))
    assert first.lock(index, key(0))
    assert store.delete(key(0))
    assert not second.lock(index, key(0))
    time.sleep(1.1)  # past its expiry, whatever the machine's load
    assert not second.lock(expiring, key(1))
    store.keep_shared_memory = True
    store.close()
    successor = tier(name, chunks=2)
    assert successor.recover() == (0, 0)
    first.close()
    second.close()
    successor.close()


def test_a_successor_dates_the_tiers_ttl_anew(name: str) -> None:
    """The tier's own `ttl_s` is not a chunk's expiry: a retain records the chunk's pin in
    the slab, not the expiry the tier's ttl_s gave it (a successor, which may have another
    ttl_s, dates it anew, as a restarted disk tier does: docs/retention.md)."""
    first = MemoryTier(MemoryTierConfig(kind="memory", capacity=8 * 4096 * 2,
                                        shared_memory=name, ttl_s=3600), LAYOUT)
    until = time.time() + 600
    assert first.put(key(0), chunk(0)).ok
    assert first.retain(key(0), ChunkMeta(retain_until=until))
    first.keep_shared_memory = True
    first.close()

    slab = SharedSlab(name, first.slot_bytes, first.num_slots, first.chunk_bytes)
    metas = {k: meta for k, _, meta in slab.recoverable(time.time())}
    slab.close(keep=False)
    assert metas == {key(0): ChunkMeta(retain_until=until)}
