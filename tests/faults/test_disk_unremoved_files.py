"""Fault drill: a disk tier whose evictions cannot remove their files for a while (the
directory read-only after a filesystem error, EIO), then can again.

An eviction takes the chunk out of the index and then unlinks its file. Where the unlink
failed, the file stayed on disk, no longer counted: beyond the capacity until a restart's
index found it (a leak soak: one more file after each read-only episode of a disk tier under
a live engine). Now the tier owes those files their removal and removes them once a write
succeeds again; a chunk stored again meanwhile keeps its file.

Real files in a temp dir; the fault (an unlink that fails with EROFS) is injected.
"""

from __future__ import annotations

import errno
from pathlib import Path
from typing import Any

import pytest
from tierkit import key, make_tier, tiny_layout

from kvtier.tiers.files import chunkfiles

LAYOUT = tiny_layout()
CAPACITY = 4
DATA = memoryview(bytes(LAYOUT.bytes_per_chunk))


def chunk_files(root: Path) -> int:
    return len(list((root / "disk").rglob("*.kvc")))


@pytest.fixture
def read_only_unlinks(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """While its one flag is set, every chunk file's unlink fails with EROFS."""
    failing = [False]
    real = chunkfiles.unlink_file

    def unlink_file(*args: Any, **kwargs: Any) -> int | None:
        if failing[0]:
            raise OSError(errno.EROFS, "Read-only file system (injected)")
        return real(*args, **kwargs)

    monkeypatch.setattr(chunkfiles, "unlink_file", unlink_file)
    return failing


def test_files_an_eviction_could_not_remove_are_removed_once_it_can(
        tmp_path: Path, read_only_unlinks: list[bool]) -> None:
    tier = make_tier("disk", tmp_path, LAYOUT, capacity_chunks=CAPACITY)
    for i in range(CAPACITY):
        assert tier.put(key(i), DATA)
    read_only_unlinks[0] = True
    for i in range(10, 13):  # each evicts one, whose file stays
        assert tier.put(key(i), DATA)
    assert chunk_files(tmp_path) == CAPACITY + 3
    read_only_unlinks[0] = False
    assert tier.put(key(20), DATA)
    assert chunk_files(tmp_path) == CAPACITY == tier.stats().chunks
    assert tier.check() == []  # type: ignore[attr-defined]
    tier.close()


def test_a_chunk_stored_again_keeps_its_file(
        tmp_path: Path, read_only_unlinks: list[bool]) -> None:
    tier = make_tier("disk", tmp_path, LAYOUT, capacity_chunks=CAPACITY)
    for i in range(CAPACITY):
        assert tier.put(key(i), DATA)
    read_only_unlinks[0] = True
    assert tier.put(key(10), DATA)  # evicts key(0): its file stays
    read_only_unlinks[0] = False
    assert tier.put(key(0), DATA)  # stored again (its file is the new chunk's)
    assert tier.put(key(30), DATA)
    assert tier.contains(key(0))
    out = memoryview(bytearray(LAYOUT.bytes_per_chunk))
    assert tier.get_into(key(0), out).ok
    assert chunk_files(tmp_path) == CAPACITY
    assert tier.check() == []  # type: ignore[attr-defined]
    tier.close()


def test_one_file_that_never_goes_does_not_keep_the_others(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A file whose unlink keeps failing once the directory is writable again (EIO on its
    inode, a shard directory another user made read-only) was tried first at every write,
    and the retries stopped at it: the files owed after it stayed, for good."""
    failed: set[tuple[str, ...]] = set()  # the files whose unlink failed in the episode
    stuck: list[tuple[str, ...]] = []  # the first of them tried again: fails for ever
    read_only = [False]
    real = chunkfiles.unlink_file

    def unlink_file(root: Path, parts: Any, *args: Any, **kwargs: Any) -> int | None:
        path = tuple(parts)
        if not read_only[0] and path in failed and not stuck:
            stuck.append(path)
        if read_only[0] or path in stuck:
            failed.add(path)
            raise OSError(errno.EIO, "Input/output error (injected)")
        return real(root, parts, *args, **kwargs)

    monkeypatch.setattr(chunkfiles, "unlink_file", unlink_file)
    tier = make_tier("disk", tmp_path, LAYOUT, capacity_chunks=CAPACITY)
    for i in range(CAPACITY):
        assert tier.put(key(i), DATA)
    read_only[0] = True
    for i in range(10, 13):  # each evicts one, whose file stays
        assert tier.put(key(i), DATA)
    read_only[0] = False
    for i in range(20, 26):
        assert tier.put(key(i), DATA)
    assert len(stuck) == 1
    assert chunk_files(tmp_path) == CAPACITY + 1  # the stuck one only
    assert tier.stats().chunks == CAPACITY
    tier.close()
