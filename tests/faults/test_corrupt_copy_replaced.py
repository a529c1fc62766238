"""A corrupt chunk file replaced by a good copy between a reader's failed read and its removal.

A reader that finds a chunk file corrupt removes it (so that a good copy can be stored), but
it removed whatever sat at the chunk's path by then: two engines reading a corrupt file of
a popular prefix at once, the first removed it, its engine recomputed and stored the chunk
again, and the second, its removal late (it waits for the shared directory's ledger lock,
which the fleet holds in turn), deleted that good copy. A reader now removes the file it
read, and only that one (its device and inode), on the shared and the disk tier; the disk
tier, which drops a file that fails to read (EIO), drops that file only too.

The race is made certain by running the other engine's steps inside the reader's failed
read (the fault injected); the files, the tiers and the corruption are real.
"""

from __future__ import annotations

import errno
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from tierkit import key, make_tier, tiny_layout

from kvtier.core.tier import Failure
from kvtier.errors import CorruptChunk

LAYOUT = tiny_layout()
CHUNK = bytes(range(256)) * (LAYOUT.bytes_per_chunk // 256)


def corrupt(path: Path) -> None:
    """Flip one byte of the chunk's body (its checksum fails)."""
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))


def after_a_tick(path: Path) -> None:
    """Return once the filesystem's clock stamps a later change time than `path`'s (a
    file's identity is its inode, which ext4 gives the next file at once, and its change
    time, which the kernel's coarse clock ticks every few ms): the other engine recomputed
    the chunk before storing it again, which takes longer than that."""
    before = path.stat().st_ctime_ns
    probe = path.with_name("tick-probe")
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        probe.write_bytes(b"")
        later = probe.stat().st_ctime_ns > before
        probe.unlink()
        if later:
            return
    raise AssertionError("the filesystem's clock did not tick in 10 s")


def race_the_read(tier: Any, monkeypatch: pytest.MonkeyPatch,
                  meanwhile: Callable[[], None]) -> None:
    """`tier`'s reads run `meanwhile` once after they find a chunk corrupt."""
    real_read = tier.files.read_into

    def raced_read(*args: Any, **kwargs: Any) -> None:
        try:
            real_read(*args, **kwargs)
        except CorruptChunk:
            meanwhile()
            raise

    monkeypatch.setattr(tier.files, "read_into", raced_read)


def test_a_shared_reader_removes_the_corrupt_file_not_the_good_copy_stored_since(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    reader: Any = make_tier("shared", tmp_path, LAYOUT, capacity_chunks=8)
    other: Any = make_tier("shared", tmp_path, LAYOUT, capacity_chunks=8)
    assert reader.put(key(1), memoryview(CHUNK))
    path = reader.files.path_of(key(1))
    corrupt(path)

    def other_engine_recomputes() -> None:  # it read the corrupt file too, removed it first
        after_a_tick(path)
        assert other.delete(key(1))
        assert other.put(key(1), memoryview(CHUNK))

    race_the_read(reader, monkeypatch, other_engine_recomputes)
    out = memoryview(bytearray(LAYOUT.bytes_per_chunk))
    assert reader.get_into(key(1), out).failure is Failure.CORRUPT
    monkeypatch.undo()
    assert path.exists(), "the reader deleted the good copy another engine stored since"
    assert reader.get_into(key(1), out) and bytes(out) == CHUNK
    with reader.ledger.locked() as ledger:  # the good copy is counted, once
        assert ledger.used_bytes == reader.file_bytes and ledger.chunks == 1
    reader.close()
    other.close()


def test_a_disk_reader_keeps_the_good_copy_its_own_write_stored_since(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """One engine, two threads: a load finds the chunk corrupt, and before it removes it the
    chunk is forgotten and stored again (another load of it, then the store's write)."""
    tier: Any = make_tier("disk", tmp_path, LAYOUT, capacity_chunks=8)
    assert tier.put(key(1), memoryview(CHUNK))
    path = tier.files.path_of(key(1))
    corrupt(path)

    def stored_again() -> None:
        after_a_tick(path)
        assert tier.delete(key(1))
        assert tier.put(key(1), memoryview(CHUNK))

    race_the_read(tier, monkeypatch, stored_again)
    out = memoryview(bytearray(LAYOUT.bytes_per_chunk))
    assert tier.get_into(key(1), out).failure is Failure.CORRUPT
    monkeypatch.undo()
    assert path.exists(), "the load deleted the good copy stored since"
    assert tier.contains(key(1))
    assert tier.get_into(key(1), out) and bytes(out) == CHUNK
    assert tier.check() == []
    tier.close()


def test_a_disk_reader_failing_with_eio_keeps_the_copy_stored_since(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same race with a read error instead of corruption (EIO from the medium once the
    file is open): the tier drops the file it read, not the copy stored since; a file that
    fails so with no copy stored since is dropped (a miss, counted)."""
    tier: Any = make_tier("disk", tmp_path, LAYOUT, capacity_chunks=8)
    assert tier.put(key(1), memoryview(CHUNK)) and tier.put(key(2), memoryview(CHUNK))
    path = tier.files.path_of(key(1))

    def stored_again() -> None:
        after_a_tick(path)
        assert tier.delete(key(1))
        assert tier.put(key(1), memoryview(CHUNK))

    def failing_read(read_key: Any, *args: Any) -> None:  # the file is open: the medium fails
        if read_key == key(1):
            stored_again()
        raise OSError(errno.EIO, "Input/output error (injected)")

    monkeypatch.setattr(tier.files, "_read_open", failing_read)
    out = memoryview(bytearray(LAYOUT.bytes_per_chunk))
    assert tier.get_into(key(1), out).failure is Failure.IO_ERROR
    assert tier.get_into(key(2), out).failure is Failure.IO_ERROR
    monkeypatch.undo()
    assert path.exists(), "the failed read dropped the copy stored since"
    assert tier.contains(key(1)) and tier.get_into(key(1), out) and bytes(out) == CHUNK
    assert not tier.files.path_of(key(2)).exists() and not tier.contains(key(2))
    assert tier.stats().misses == 2 and tier.check() == []
    tier.close()
