"""Fault drills on the write path: an unwritable directory, a full filesystem (a real tiny
tmpfs when this machine lets us mount one, and always an injected ENOSPC). Each failed put
is a counted, logged dropped write; nothing half-written is left behind or ever read back;
chunks stored before the fault stay readable; and once the fault is gone (or the tier made
room) puts succeed again.

Tests run as root here, where chmod 0500 does not stop writes: the unwritable directory is
injected (os.open raising EACCES for writes below the tier's directory) or made real by
putting a regular file where a shard directory must go.
"""

from __future__ import annotations

import errno
import logging
import os
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from tierkit import key, make_tier, tiny_layout, write_in_flight

from kvtier.core.keys import ChunkKey
from kvtier.core.layout import KVLayout
from kvtier.core.retention import DEFAULT_META, ChunkMeta
from kvtier.core.tier import FULL, IO_ERROR, OK, TierResult

PERSISTENT = ("disk", "shared")
WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT


def payload(i: int, layout: KVLayout) -> bytes:
    return bytes((i * 5 + j) % 256 for j in range(layout.bytes_per_chunk))


def _readable(tier: object, layout: KVLayout, i: int) -> bool:
    out = bytearray(layout.bytes_per_chunk)
    return tier.get_into(key(i), memoryview(out)) and bytes(out) == payload(i, layout)  # type: ignore[attr-defined]


def _no_temp_files(root: Path) -> bool:
    return not [p for p in root.rglob("*") if p.name.endswith(".tmp")]


@pytest.fixture
def deny_writes_below(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[Path]]:
    """While the yielded list holds directories, opening a file for writing below any of
    them fails with EACCES, as in a directory without write permission."""
    denied: list[Path] = []
    real_open = os.open

    def guarded_open(path: object, flags: int, *args: object, **kwargs: object) -> int:
        where = Path(str(path))
        dir_fd = kwargs.get("dir_fd")
        if dir_fd is not None:  # the tiers open files relative to a directory fd
            where = Path(os.readlink(f"/proc/self/fd/{dir_fd}")) / where
        if flags & WRITE_FLAGS and any(where.is_relative_to(d) for d in denied):
            raise PermissionError(errno.EACCES, "Permission denied (injected)", str(path))
        return real_open(path, flags, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "open", guarded_open)
    yield denied


@pytest.mark.parametrize("kind", PERSISTENT)
def test_an_unwritable_directory_drops_writes_and_keeps_what_it_holds(
    kind: str, tmp_path: Path, layout: KVLayout, deny_writes_below: list[Path],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The directory is nearly full (7 of 8 chunks) when it turns read-only: every put is
    dropped and counted, and - the point - none of the 7 chunks is evicted for nothing:
    they are all still served. When the directory is writable again, puts succeed."""
    tier = make_tier(kind, tmp_path, layout, capacity_chunks=8)
    for i in range(7):
        assert tier.put(key(i), memoryview(payload(i, layout)))
    deny_writes_below.append(tmp_path)
    with caplog.at_level(logging.WARNING):
        for i in range(10, 14):
            assert tier.put(key(i), memoryview(payload(i, layout))) == IO_ERROR
    assert tier.stats().dropped_writes == 4 and tier.stats().puts == 7
    assert "Permission denied" in caplog.text and key(10).hex() in caplog.text
    # One line, not one a chunk (a flood while the directory stays unwritable).
    assert sum("write of" in r.getMessage() for r in caplog.records) == 1
    assert not any(tier.contains(key(i)) for i in range(10, 14))
    assert all(_readable(tier, layout, i) for i in range(7)), "held chunks were lost"
    assert tier.stats().evictions == 0
    deny_writes_below.clear()
    assert tier.put(key(10), memoryview(payload(10, layout)))
    assert _readable(tier, layout, 10)
    assert _no_temp_files(tmp_path)


def test_a_full_disk_tier_made_unwritable_evicts_no_chunk_for_writes_that_fail(
    tmp_path: Path, layout: KVLayout, deny_writes_below: list[Path],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Full when its directory turns read-only, its writes behind RAM several at once: each
    put that found no room evicted a held chunk, then its write failed (a node's disk went from
    8 to 6 chunks). After one such failure, a put that needs room is dropped without evicting
    for a while; once a write succeeds again, puts evict as before."""
    tier = make_tier("disk", tmp_path, layout, capacity_chunks=8)
    for i in range(8):
        assert tier.put(key(i), memoryview(payload(i, layout)))
    deny_writes_below.append(tmp_path)
    assert tier.put(key(10), memoryview(payload(10, layout))) == IO_ERROR  # evicted one
    assert tier.stats().evictions == 1
    # A write in flight holds the room the eviction made; the next put finds none.
    with write_in_flight(tier, monkeypatch,
                         lambda: tier.put(key(11), memoryview(payload(11, layout)))):
        assert tier.put(key(12), memoryview(payload(12, layout))) == IO_ERROR
    assert tier.stats().evictions == 1  # 2 before: the second put's eviction was for nothing
    assert sum(bool(_readable(tier, layout, i)) for i in range(8)) == 7
    deny_writes_below.clear()
    assert tier.put(key(20), memoryview(payload(20, layout)))  # fits: tried, and stored
    assert tier.put(key(21), memoryview(payload(21, layout)))  # full: evicts again
    assert tier.stats().evictions == 2
    assert _readable(tier, layout, 21)
    assert sum(bool(_readable(tier, layout, i)) for i in (*range(8), 20, 21)) == 8  # full


@pytest.mark.parametrize("kind", PERSISTENT)
def test_a_file_where_a_shard_directory_belongs_drops_only_that_shards_writes(
    kind: str, tmp_path: Path, layout: KVLayout,
) -> None:
    """A real, permission-independent unwritable spot: a regular file occupies the shard
    directory of one key. Its put is dropped and counted; other keys are unaffected."""
    tier = make_tier(kind, tmp_path, layout, capacity_chunks=8)
    shard = tier.files.path_of(key(1)).parent  # type: ignore[attr-defined]
    shard.parent.mkdir(parents=True, exist_ok=True)
    shard.write_bytes(b"not a directory")
    assert tier.put(key(1), memoryview(payload(1, layout))) == IO_ERROR
    assert tier.stats().dropped_writes == 1
    assert not tier.get_into(key(1), memoryview(bytearray(layout.bytes_per_chunk)))
    elsewhere = ChunkKey(b"\xff" * 16)  # another shard directory
    assert tier.files.path_of(elsewhere).parent != shard  # type: ignore[attr-defined]
    assert tier.put(elsewhere, memoryview(payload(2, layout)))
    out = bytearray(layout.bytes_per_chunk)
    assert tier.get_into(elsewhere, memoryview(out)) and bytes(out) == payload(2, layout)


@pytest.mark.parametrize("kind", PERSISTENT)
def test_an_injected_enospc_is_a_dropped_write_that_leaves_nothing_behind(
    kind: str, tmp_path: Path, layout: KVLayout, monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The filesystem fills up before the tier's quota does: pwritev fails with ENOSPC.
    The put is dropped and counted, its temp file removed, earlier chunks (except those
    evicted to make room, which are counted) stay intact, and the next put succeeds."""
    tier = make_tier(kind, tmp_path, layout, capacity_chunks=64)
    for i in range(8):
        assert tier.put(key(i), memoryview(payload(i, layout)))
    real_pwritev = os.pwritev

    def full_disk(*args: object, **kwargs: object) -> int:
        raise OSError(errno.ENOSPC, "No space left on device (injected)")

    monkeypatch.setattr(os, "pwritev", full_disk)
    with caplog.at_level(logging.WARNING):
        assert tier.put(key(100), memoryview(payload(100, layout))) == FULL
    stats = tier.stats()
    assert stats.dropped_writes == 1 and "No space left" in caplog.text
    assert not tier.contains(key(100)) and _no_temp_files(tmp_path)
    held = [i for i in range(8) if tier.contains(key(i))]
    assert 8 - len(held) == stats.evictions
    assert all(_readable(tier, layout, i) for i in held)
    monkeypatch.setattr(os, "pwritev", real_pwritev)
    assert tier.put(key(101), memoryview(payload(101, layout)))
    assert _readable(tier, layout, 101)


@pytest.fixture
def tiny_tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A real 1 MiB tmpfs, mounted for the test (root and mount permission needed)."""
    mountpoint = tmp_path / "tiny-fs"
    mountpoint.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1M", "tmpfs", str(mountpoint)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        yield mountpoint
    finally:
        subprocess.run(["umount", "-l", str(mountpoint)], check=False)


@pytest.mark.parametrize("kind", PERSISTENT)
def test_a_real_full_filesystem_smaller_than_the_quota_keeps_accepting_puts(
    kind: str, tiny_tmpfs: Path, caplog: pytest.LogCaptureFixture,
) -> None:
    """The operator gave the tier 64 MiB on a filesystem that holds 1 MiB (about 12 chunk
    files of 68 KiB). Writing 40 chunks fills it: each write that hits the full filesystem
    is dropped and counted, the tier evicts to make room, and the write after a drop
    succeeds - the tier never gets stuck refusing every put (it used to: a short write was
    reported as EIO, so it never evicted). Whatever it holds reads back exactly."""
    layout = tiny_layout(256)  # 64 KiB chunks
    tier = make_tier(kind, tiny_tmpfs, layout, capacity_chunks=1000, capacity="64MiB")
    outcomes = []
    with caplog.at_level(logging.WARNING):
        for i in range(40):
            outcomes.append(tier.put(key(i), memoryview(payload(i, layout))))
    stats = tier.stats()
    assert stats.dropped_writes == outcomes.count(FULL) > 0, "the filesystem never filled"
    assert stats.puts == outcomes.count(OK)
    assert stats.evictions > 0
    assert all(outcomes[i + 1] for i, ok in enumerate(outcomes[:-1]) if not ok), outcomes
    after_full = outcomes[outcomes.index(FULL):]
    assert after_full.count(OK) >= 0.6 * len(after_full), outcomes  # most puts still land
    held = [i for i in range(40) if tier.contains(key(i))]
    assert held and all(_readable(tier, layout, i) for i in held)
    assert _no_temp_files(tiny_tmpfs)


@pytest.mark.timing
def test_a_slow_disk_at_close_costs_the_unwritten_chunks_only(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture):
    """vLLM kills a stopping worker a few seconds in, so closing the store waits for the
    write-behind queue only until its deadline: what is written stays readable, the rest is
    dropped and logged, and no half-written file is left."""
    import time

    from tierkit import tier_settings

    from kvtier.tiers import open_store
    from kvtier.tiers.files.disk import DiskTier
    from kvtier.tiers.storeconfig import StoreConfig

    layout = tiny_layout()
    config = StoreConfig.parse({"write_queue_depth": 64, "tiers": [
        tier_settings("memory", tmp_path, layout, 64),
        tier_settings("disk", tmp_path, layout, 64, io_threads=1)]})
    real_put = DiskTier.put

    def slow_put(self: DiskTier, k: ChunkKey, data: memoryview,
                 meta: ChunkMeta = DEFAULT_META) -> TierResult:
        time.sleep(0.1)  # injected: a disk writing 10 chunks a second
        return real_put(self, k, data, meta)

    monkeypatch.setattr(DiskTier, "put", slow_put)
    store = open_store(config, layout)
    for i in range(20):
        assert store.put(key(i), memoryview(payload(i, layout)))
    start = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="kvtier.core.store"):
        store.close(flush_timeout_s=0.3)
    assert time.monotonic() - start < 1.5  # not the 2 s the whole queue needs
    assert "queued writes not finished" in caplog.text
    for thread in threading.enumerate():  # a write running at the deadline ends on its own
        if thread.name.startswith("kvtier-write-"):
            thread.join(5)

    monkeypatch.setattr(DiskTier, "put", real_put)
    reopened = make_tier("disk", tmp_path, layout, 64)
    written = [i for i in range(20) if reopened.contains(key(i))]
    assert 1 <= len(written) < 20
    assert written == list(range(len(written)))  # the queue drains in order
    assert all(_readable(reopened, layout, i) for i in written)
    assert _no_temp_files(tmp_path / "disk")
