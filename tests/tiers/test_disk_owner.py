"""One open disk tier owns its layout directory (tiers/files/owner.py).

Two engines on one host with the same model and disk path (two servers on the default path,
vLLM's data-parallel ranks) each exceeded the capacity by the other's files and evicted the
other's chunks behind its index. Now a second open, in this process or another, is refused in
one line naming the directory, the owner's pid and the remedy; the owner's close, or its
process's death however it dies, lets the next one in. The lock file is no chunk: the start-up
index, walks, inventories and the capacity never count or remove it.
"""

from __future__ import annotations

import errno
import logging
import multiprocessing
import multiprocessing.synchronize
import os
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from tierkit import key, make_tier, tier_settings, tiny_layout

import kvtier.tiers
from kvtier.errors import DirectoryInUse
from kvtier.tiers.files import chunktree, disk, diskscan, owner
from kvtier.tiers.files.chunktree import FileInventory
from kvtier.tiers.storeconfig import StoreConfig

LAYOUT = tiny_layout()


def directory(root: Path) -> Path:
    """The layout directory of the disk tier `make_tier` builds under `root`."""
    return root / "disk" / LAYOUT.digest()


def _hold(root: str, opened: multiprocessing.synchronize.Event,
          done: multiprocessing.synchronize.Event) -> None:
    """Another process's engine: open the disk tier, say so, keep it until `done`."""
    tier = make_tier("disk", Path(root), LAYOUT, capacity_chunks=4)
    opened.set()
    done.wait(60)
    tier.close()


def test_a_second_open_in_this_process_is_refused_until_the_first_closes(
        tmp_path: Path) -> None:
    first = make_tier("disk", tmp_path, LAYOUT, capacity_chunks=4)
    with pytest.raises(DirectoryInUse) as refused:
        make_tier("disk", tmp_path, LAYOUT, capacity_chunks=4)
    message = str(refused.value)
    assert "\n" not in message  # one line in an engine's log
    assert str(directory(tmp_path)) in message
    assert f"this process (pid {os.getpid()})" in message
    assert "a disk path of its own" in message and "kind: shared" in message
    assert isinstance(refused.value, OSError)  # as a directory a tier cannot use is
    first.close()
    again = make_tier("disk", tmp_path, LAYOUT, capacity_chunks=4)
    again.close()


def test_another_process_is_refused_while_the_owner_runs_and_let_in_when_it_closes(
        tmp_path: Path) -> None:
    context = multiprocessing.get_context("spawn")
    opened, done = context.Event(), context.Event()
    holder = context.Process(target=_hold, args=(str(tmp_path), opened, done))
    holder.start()
    try:
        assert opened.wait(60)
        with pytest.raises(DirectoryInUse, match=f"another kvtier process \\(pid "
                                                 f"{holder.pid}\\)"):
            make_tier("disk", tmp_path, LAYOUT, capacity_chunks=4)
    finally:
        done.set()
        holder.join(60)
    assert holder.exitcode == 0
    make_tier("disk", tmp_path, LAYOUT, capacity_chunks=4).close()


def test_an_owner_killed_with_sigkill_leaves_the_directory_free(tmp_path: Path) -> None:
    """A crashed engine never leaves its directory locked: the kernel drops the lock."""
    context = multiprocessing.get_context("spawn")
    opened, done = context.Event(), context.Event()
    holder = context.Process(target=_hold, args=(str(tmp_path), opened, done))
    holder.start()
    assert opened.wait(60)
    with pytest.raises(DirectoryInUse):
        make_tier("disk", tmp_path, LAYOUT, capacity_chunks=4)
    holder.kill()
    holder.join(60)
    assert holder.exitcode == -9
    tier = make_tier("disk", tmp_path, LAYOUT, capacity_chunks=4)
    assert tier.put(key(1), memoryview(bytes(LAYOUT.bytes_per_chunk)))
    tier.close()


def test_the_lock_file_is_no_chunk_and_counts_nowhere(tmp_path: Path) -> None:
    tier = make_tier("disk", tmp_path, LAYOUT, capacity_chunks=4)
    for i in range(2):
        assert tier.put(key(i), memoryview(bytes([i]) * LAYOUT.bytes_per_chunk))
    lock = directory(tmp_path) / owner.OWNER_NAME
    assert lock.read_text() == f"{os.getpid()}\n"
    inventory = FileInventory("disk", "disk", tmp_path / "disk")
    assert sorted(c.key_hex for c in inventory.chunks()) == [key(0).hex(), key(1).hex()]
    assert tier.stats().used_bytes == 2 * tier.file_bytes  # type: ignore[attr-defined]
    assert tier.check() == []  # type: ignore[attr-defined]
    tier.close()
    # The next owner's start-up index neither counts it nor removes it as a damaged chunk.
    again = make_tier("disk", tmp_path, LAYOUT, capacity_chunks=4)
    assert again.stats().chunks == 2 and again.stats().corrupt_reads == 0
    assert inventory.remove(list(inventory.chunks())) == 2
    assert lock.is_file()
    again.close()


def test_without_flock_the_tier_opens_unlocked_with_one_warning(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """A filesystem without flock (ENOLCK) serves as before the lock, and says so."""

    def no_flock(fd: int, operation: int) -> None:
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(owner.fcntl, "flock", no_flock)
    with caplog.at_level(logging.WARNING, logger=owner.__name__):
        tier = make_tier("disk", tmp_path, LAYOUT, capacity_chunks=4)
    [warning] = [r.getMessage() for r in caplog.records if r.name == owner.__name__]
    assert "flock unsupported" in warning and "a path of its own" in warning
    assert tier.put(key(1), memoryview(bytes(LAYOUT.bytes_per_chunk)))
    tier.close()


def test_an_open_that_meets_a_checks_passing_shared_lock_tries_again(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`kvtier serve`'s check (owner.refuse_owned) holds a shared lock for an instant: an
    engine whose tier opens then must not be refused for it."""
    real_flock = owner.fcntl.flock
    met: list[int] = []

    def checked_at_that_instant(fd: int, operation: int) -> None:
        if operation & owner.fcntl.LOCK_EX and not met:
            met.append(fd)
            raise BlockingIOError(errno.EWOULDBLOCK, "Resource temporarily unavailable")
        real_flock(fd, operation)

    monkeypatch.setattr(owner.fcntl, "flock", checked_at_that_instant)
    tier = make_tier("disk", tmp_path, LAYOUT, capacity_chunks=4)
    assert met  # it met the check's lock, and opened
    monkeypatch.undo()
    with pytest.raises(DirectoryInUse):  # owned: by this tier
        make_tier("disk", tmp_path, LAYOUT, capacity_chunks=4)
    tier.close()


def test_a_tier_closed_while_its_index_loads_gives_the_directory_up_once_the_index_stopped(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A closed tier's start-up index must not go on evicting under the next owner: close
    stops it, and a walk that does not stop in time (a stalled directory) keeps the lock
    until it does, and then neither indexes nor evicts."""
    first = make_tier("disk", tmp_path, LAYOUT, capacity_chunks=8)
    for i in range(4):
        assert first.put(key(i), memoryview(bytes([i]) * LAYOUT.bytes_per_chunk))
    first.close()
    gate, real_walk = threading.Event(), chunktree.walk_chunks

    def stalled(files: chunktree.ChunkFilesLike,
                owned: bool = False) -> Iterator[chunktree.FoundChunk]:
        found = list(real_walk(files, owned))
        gate.wait(30)
        yield from found

    monkeypatch.setattr(diskscan, "walk_chunks", stalled)
    monkeypatch.setattr(disk, "INDEX_STOP_S", 0.01)
    smaller = make_tier("disk", tmp_path, LAYOUT, capacity_chunks=2)  # would evict 2
    smaller.close()  # its index still walks
    with pytest.raises(DirectoryInUse):
        make_tier("disk", tmp_path, LAYOUT, capacity_chunks=8)
    gate.set()
    assert smaller.wait_loaded(30)  # type: ignore[attr-defined]
    monkeypatch.undo()
    again = make_tier("disk", tmp_path, LAYOUT, capacity_chunks=8)
    assert again.stats().chunks == 4  # the closed tier evicted none of them
    again.close()



def test_a_store_that_fails_to_open_leaves_its_disk_directory_free(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A store whose opening fails after its tiers were built closes them: a node retrying the
    layout must find its disk directory free, not owned by the failed attempt's tier."""
    config = StoreConfig.parse({"tiers": [tier_settings("disk", tmp_path, LAYOUT, 4)]})

    def broken(*args: object) -> None:
        raise ValueError("injected: the store cannot be composed")

    monkeypatch.setattr(kvtier.tiers, "TieredStore", broken)
    with pytest.raises(ValueError, match="injected"):
        kvtier.tiers.open_store(config, LAYOUT)
    monkeypatch.undo()
    kvtier.tiers.open_store(config, LAYOUT).close()
