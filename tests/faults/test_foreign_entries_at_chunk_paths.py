"""Fault drill: something kvtier did not write sits at a chunk's path when kvtier stores that
chunk (a directory someone made, a socket, a FIFO, a symlink).

A write is a temp file renamed into place without replacing (`filetree.rename_new`); the
rename's EEXIST was taken for "another writer placed the same chunk", so `put` answered OK,
counted a put and announced the chunk as stored, and nothing was stored: a directory there
made every store of that key a silent no-op for ever (its reads: a miss, on the disk tier not
counted at all). Now a chunk path holding anything but a regular file is cleared when that is
kvtier's to clear (a link, a socket, a FIFO, a device, an empty directory: what `unlink_file`
and the readers already remove from kvtier's layout) and the chunk is stored; a directory with
something in it is never deleted: the write is a counted dropped write whose warning names
the path. A socket at a chunk path is a corrupt entry for a reader (removed), not an I/O error
repeated on every read.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
from pathlib import Path

import pytest
from tierkit import key, make_tier

from kvtier.core.layout import KVLayout
from kvtier.core.tier import CORRUPT, OK, EventKind

PERSISTENT = ("disk", "shared")


def payload(i: int, layout: KVLayout) -> bytes:
    return bytes((i * 11 + j) % 256 for j in range(layout.bytes_per_chunk))


def _place(path: Path, what: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    if what in ("directory", "empty directory"):
        path.mkdir()
        if what == "directory":
            (path / "notes.txt").write_text("not kvtier's\n")
    elif what == "socket":
        # bound by its name from its directory: a test's full path passes AF_UNIX's 108 bytes
        with contextlib.chdir(path.parent), socket.socket(socket.AF_UNIX) as sock:
            sock.bind(path.name)
    elif what == "fifo":
        os.mkfifo(path, 0o600)
    else:  # a dangling symlink
        os.symlink("/nonexistent/kvtier-chunk", path)


def _stored_events(tier: object) -> list[bytes]:
    stored: list[bytes] = []
    tier.events.listen(  # type: ignore[attr-defined]
        lambda _tier, kind, k, _retired: stored.append(k) if kind is EventKind.STORED else None)
    return stored


@pytest.mark.parametrize("kind", PERSISTENT)
def test_a_directory_at_a_chunk_path_is_a_counted_dropped_write_and_kept(
        kind: str, tmp_path: Path, layout: KVLayout,
        caplog: pytest.LogCaptureFixture) -> None:
    tier = make_tier(kind, tmp_path, layout, capacity_chunks=8)
    stored = _stored_events(tier)
    path = tier.files.path_of(key(1))  # type: ignore[attr-defined]
    _place(path, "directory")

    with caplog.at_level(logging.WARNING):
        result = tier.put(key(1), memoryview(payload(1, layout)))
    assert not result, "nothing was stored: the put must not say OK"
    stats = tier.stats()
    assert (stats.puts, stats.dropped_writes, stats.chunks) == (0, 1, 0)
    assert stored == [], "no chunk was stored: no stored event for routers or the index"
    assert str(path) in caplog.text, "the warning names the directory in the way"
    assert (path / "notes.txt").read_text() == "not kvtier's\n", "never deleted"
    assert [p.name for p in path.parent.iterdir()] == [path.name], "no temp file left"
    assert not tier.contains(key(1))
    # The tier goes on with other keys.
    assert tier.put(key(2), memoryview(payload(2, layout))) == OK
    out = bytearray(layout.bytes_per_chunk)
    assert tier.get_into(key(2), memoryview(out)) == OK and bytes(out) == payload(2, layout)
    if kind == "shared":  # the ledger counted the temp file's bytes back
        with tier.ledger.locked() as ledger:  # type: ignore[attr-defined]
            assert ledger.used_bytes == tier.files.file_bytes  # type: ignore[attr-defined]


@pytest.mark.parametrize("what", ["empty directory", "socket", "fifo", "symlink"])
@pytest.mark.parametrize("kind", PERSISTENT)
def test_an_entry_kvtier_may_clear_at_a_chunk_path_gives_way_to_the_chunk(
        kind: str, what: str, tmp_path: Path, layout: KVLayout) -> None:
    tier = make_tier(kind, tmp_path, layout, capacity_chunks=8)
    stored = _stored_events(tier)
    path = tier.files.path_of(key(1))  # type: ignore[attr-defined]
    _place(path, what)

    assert tier.put(key(1), memoryview(payload(1, layout))) == OK
    assert path.is_file() and not path.is_symlink()
    assert stored == [key(1)]
    out = bytearray(layout.bytes_per_chunk)
    assert tier.get_into(key(1), memoryview(out)) == OK and bytes(out) == payload(1, layout)
    stats = tier.stats()
    assert (stats.puts, stats.dropped_writes, stats.chunks) == (1, 0, 1)


@pytest.mark.parametrize("kind", PERSISTENT)
def test_a_socket_at_a_chunk_path_is_a_corrupt_entry_for_a_reader(
        kind: str, tmp_path: Path, layout: KVLayout) -> None:
    """Opening a socket fails with ENXIO: it was an I/O error on every read, and the shared
    tier, which removes only what it finds corrupt, kept it there for ever."""
    tier = make_tier(kind, tmp_path, layout, capacity_chunks=8)
    assert tier.put(key(1), memoryview(payload(1, layout))) == OK
    path = tier.files.path_of(key(1))  # type: ignore[attr-defined]
    path.unlink()
    _place(path, "socket")

    assert tier.get_into(key(1), memoryview(bytearray(layout.bytes_per_chunk))) == CORRUPT
    assert not os.path.lexists(path), "removed from kvtier's layout"
    assert tier.stats().corrupt_reads == 1


@pytest.mark.parametrize("what", ["directory", "fifo", "symlink"])
def test_something_else_at_the_quota_ledgers_path_is_named_with_what_to_do(
        what: str, tmp_path: Path, layout: KVLayout) -> None:
    """The shared tier's ledger (ROOT/.kvtier-quota) found as a directory, a FIFO or a link
    failed the tier's start with "Is a directory", "Illegal seek" (no path) or "Too many
    levels of symbolic links": now one error naming the path, what is there and the remedy;
    once it is removed, the tier starts and stores."""
    ledger = tmp_path / "shared" / ".kvtier-quota"
    _place(ledger, "empty directory" if what == "directory" else what)
    with pytest.raises(OSError, match="remove it") as caught:
        make_tier("shared", tmp_path, layout, capacity_chunks=8)
    assert caught.value.filename == str(ledger)
    if ledger.is_dir() and not ledger.is_symlink():
        ledger.rmdir()
    else:
        ledger.unlink()
    tier = make_tier("shared", tmp_path, layout, capacity_chunks=8)
    assert tier.put(key(1), memoryview(payload(1, layout))) == OK
    tier.close()
