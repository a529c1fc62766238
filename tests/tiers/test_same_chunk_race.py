"""Two writers of one chunk, both past `Tier.put`'s one existence check: the first rename
places the chunk and the second, finding it there, removes its own copy (`PendingWrite.
complete` never replaces: `filetree.rename_new`). The shared tier's quota ledger then counts
the chunk once: with replacing renames it counted both copies until the next re-measure, and
two processes hammering 24 keys under a 10-chunk quota ended with 10 chunks counted for 4
files, evicting real chunks for phantom ones (test_shared_two_processes). The race is made
certain by a writer whose existence check says "not held" (the fault injected). And a reader
that finds a chunk's file gone while a put of it lands keeps the put's copy."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
from tierkit import key, make_tier, tiny_layout

from kvtier.core.store import TieredStore
from kvtier.tiers.files import filetree
from kvtier.tiers.files.chunkfiles import ChunkFiles

LAYOUT = tiny_layout()


def chunk_files(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.is_file() and not p.name.startswith(".")]


def test_the_second_shared_writer_of_a_chunk_is_counted_once(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    first: Any = make_tier("shared", tmp_path, LAYOUT, 8)
    late: Any = make_tier("shared", tmp_path, LAYOUT, 8)  # another engine on the directory
    data = memoryview(bytes(range(256)) * (LAYOUT.bytes_per_chunk // 256))
    assert first.put(key(5), data)
    one_file = first.stats().used_bytes
    assert one_file > 0 and len(chunk_files(tmp_path)) == 1
    monkeypatch.setattr(late.files, "exists", lambda _key: False)  # it checked too early
    assert late.put(key(5), data)  # held: the put succeeded, by the other writer's copy
    assert late.stats().used_bytes == one_file and late.stats().chunks == 1
    assert len(chunk_files(tmp_path)) == 1
    assert not list(tmp_path.rglob("*.tmp"))  # the second copy removed, not left behind
    out = bytearray(LAYOUT.bytes_per_chunk)
    assert first.get_into(key(5), memoryview(out)) and out == data
    first.close()
    late.close()


@pytest.mark.parametrize("kind", ["disk", "shared"])
def test_a_chunk_file_written_twice_leaves_one_file(kind: str, tmp_path: Path) -> None:
    tier: Any = make_tier(kind, tmp_path, LAYOUT, 8)
    files: ChunkFiles = tier.files
    data = memoryview(bytes(LAYOUT.bytes_per_chunk))
    racing = [files.prepare_write(key(7)) for _ in range(2)]  # both before either renames
    for pending in racing:
        pending.fill(data)
    assert racing[0].complete()
    assert not racing[1].complete()  # the first copy stays in place...
    assert racing[1].abort() > 0  # ...and the second is removed by its writer
    assert len(chunk_files(tmp_path)) == 1 and not list(tmp_path.rglob("*.tmp"))
    tier.close()


def test_where_renames_cannot_refuse_a_hard_link_places_the_first_copy_only(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """NFS, CephFS and some FUSE mounts refuse RENAME_NOREPLACE (EINVAL): a replacing rename
    let the second copy replace the first, and the shared quota's ledger counted both until
    the next re-measure (at fleet scale hours apart, while many engines store the same
    popular prefixes at once). A hard link refuses to replace (EEXIST) where they can make
    one: the first copy stays, the second is removed by its writer, counted once."""
    monkeypatch.setattr(filetree, "_renames_new", [False])
    first: Any = make_tier("shared", tmp_path, LAYOUT, 8)
    late: Any = make_tier("shared", tmp_path, LAYOUT, 8)
    data = memoryview(bytes(range(256)) * (LAYOUT.bytes_per_chunk // 256))
    assert first.put(key(5), data)
    one_file = first.stats().used_bytes
    monkeypatch.setattr(late.files, "exists", lambda _key: False)  # it checked too early
    assert late.put(key(5), data)
    assert late.stats().used_bytes == one_file and late.stats().chunks == 1
    assert len(chunk_files(tmp_path)) == 1 and not list(tmp_path.rglob("*.tmp"))
    assert next(iter(chunk_files(tmp_path))).stat().st_nlink == 1
    first.close()
    late.close()


def test_where_neither_renames_nor_links_can_refuse_the_second_copy_replaces_the_first(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without hard links either (some FUSE mounts): the write still lands, replacing the
    identical copy (the ledger stays high by one copy until a re-measure)."""
    monkeypatch.setattr(filetree, "_renames_new", [False])
    monkeypatch.setattr(filetree, "_links_new", [False])
    tier: Any = make_tier("disk", tmp_path, LAYOUT, 8)
    data = memoryview(bytes(LAYOUT.bytes_per_chunk))
    racing = [tier.files.prepare_write(key(7)) for _ in range(2)]
    for pending in racing:
        pending.fill(data)
        assert pending.complete()
    assert len(chunk_files(tmp_path)) == 1 and not list(tmp_path.rglob("*.tmp"))
    tier.close()


def _landing(tier: Any, monkeypatch: pytest.MonkeyPatch, i: int) -> tuple[Any, Any]:
    """A put of chunk `i` on a thread of its own, held after its file is in place and before
    the tier indexes it; (the thread, the event that lets it finish)."""
    written, finish = threading.Event(), threading.Event()
    real_write = tier.files.write

    def write_then_wait(*args: object) -> None:
        real_write(*args)
        written.set()
        finish.wait(30)

    monkeypatch.setattr(tier.files, "write", write_then_wait)
    data = memoryview(bytes(range(256)) * (LAYOUT.bytes_per_chunk // 256))
    landing = threading.Thread(target=tier.put, args=(key(i), data))
    landing.start()
    assert written.wait(30)
    monkeypatch.setattr(tier.files, "write", real_write)
    return landing, finish


def test_a_chunk_deleted_while_its_write_lands_is_not_indexed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The delete removes the file the put just placed: the put, landing after it, must not
    index a chunk whose file is gone (it counted against the capacity until a lookup found
    it missing)."""
    tier: Any = make_tier("disk", tmp_path, LAYOUT, 8)
    landing, finish = _landing(tier, monkeypatch, 1)
    assert tier.delete(key(1))
    finish.set()
    landing.join()
    assert tier.check() == []
    assert tier.stats().chunks == 0 and tier.stats().used_bytes == 0
    tier.close()


def test_a_chunk_evicted_while_its_second_writer_lands_is_not_indexed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two writers of one chunk (the write-behind's threads): the first indexes it, and its
    eviction removes the one file before the second lands; the second must not index it
    again without a file (nor report it stored again: it is not)."""
    tier: Any = make_tier("disk", tmp_path, LAYOUT, 2)  # one chunk and one write in flight
    store = TieredStore([make_tier("memory", tmp_path, LAYOUT, 0), tier])
    landing, finish = _landing(tier, monkeypatch, 1)
    data = memoryview(bytes(LAYOUT.bytes_per_chunk))
    assert tier.put(key(1), data)  # the first writer: the second's file is there, indexed
    assert tier.put(key(2), data)  # no room: chunk 1 evicted, its one file removed
    finish.set()
    landing.join()
    assert [tier.contains(key(i)) for i in (1, 2)] == [False, True]
    assert tier.check() == []
    assert [(e.kind, e.key) for e in store.take_events()] == [
        ("stored", key(1)), ("removed", key(1)), ("stored", key(2))]
    store.close()


def _evicted_then_stored_again(tier: Any, monkeypatch: pytest.MonkeyPatch, i: int,
                               fresh: memoryview) -> None:
    """The fault: chunk i's file goes (an eviction, `kvtier gc`) after the tier found it
    indexed, and a put of the same chunk lands before the reader's miss is taken in."""
    files: ChunkFiles = tier.files
    read_into, exists = files.read_into, files.exists
    calls = {"read": 0, "exists": 0}

    def racing_read(key_: Any, out: memoryview, *args: Any, **kwargs: Any) -> None:
        calls["read"] += 1
        if calls["read"] == 1:
            files.remove(key_)
            try:
                read_into(key_, out, *args, **kwargs)
            finally:
                assert tier.put(key_, fresh)
        read_into(key_, out, *args, **kwargs)

    def racing_exists(key_: Any) -> bool:
        calls["exists"] += 1
        if calls["exists"] == 1 and key_ == key(i):
            files.remove(key_)
            found = exists(key_)
            assert tier.put(key_, fresh)
            return found
        return exists(key_)

    monkeypatch.setattr(files, "read_into", racing_read)
    monkeypatch.setattr(files, "exists", racing_exists)


@pytest.mark.parametrize("path", ["get_into", "contains"])
def test_a_copy_stored_while_a_reader_found_the_file_gone_is_kept(
        path: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A reader that finds a chunk's file gone drops the chunk; a put of it that landed
    meanwhile stored a fresh copy, which it dropped too (a miss for good, the file removed)."""
    tier: Any = make_tier("disk", tmp_path, LAYOUT, 8)
    old = memoryview(bytes(LAYOUT.bytes_per_chunk))
    fresh = memoryview(bytes([7]) * LAYOUT.bytes_per_chunk)
    assert tier.put(key(3), old)
    _evicted_then_stored_again(tier, monkeypatch, 3, fresh)
    out = bytearray(LAYOUT.bytes_per_chunk)
    if path == "get_into":
        assert not tier.get_into(key(3), memoryview(out))  # its read found no file: a miss
    else:
        assert tier.contains(key(3))  # the fresh copy, landed as it looked
    monkeypatch.undo()
    assert tier.contains(key(3)) and tier.get_into(key(3), memoryview(out)) and out == fresh
    assert tier.check() == []
    tier.close()
