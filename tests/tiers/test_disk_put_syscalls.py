"""A disk tier's put asks the filesystem for no stat: its chunks are its own, and their ages
never matter to it. The shared tier reads the filesystem's clock off the mtime of the files it
creates (`ChunkFiles.fs_now`: other nodes' temp files are stale by that clock); the disk tier
never reads that clock, and an fstat per write is a round trip on a network mount.

A real disk tier on `tmp_path`; its metadata operations as its `FsOps` counts them.
"""

from __future__ import annotations

from pathlib import Path

from tierkit import key, make_tier, tiny_layout

from kvtier.tiers.files.disk import DiskTier
from kvtier.tiers.files.shared import SharedTier

LAYOUT = tiny_layout()


def test_a_disk_put_stats_nothing(tmp_path: Path) -> None:
    tier = make_tier("disk", tmp_path, LAYOUT, 64)
    assert isinstance(tier, DiskTier) and tier.wait_loaded(30)
    data = memoryview(bytes(LAYOUT.bytes_per_chunk))
    try:
        before = tier.files.ops.snapshot().stats
        for i in range(8):
            assert tier.put(key(i), data).ok
        assert tier.files.ops.snapshot().stats == before
    finally:
        tier.close()


def test_the_shared_tier_still_reads_the_filesystems_clock(tmp_path: Path) -> None:
    tier = make_tier("shared", tmp_path, LAYOUT, 64)
    assert isinstance(tier, SharedTier)
    data = memoryview(bytes(LAYOUT.bytes_per_chunk))
    try:
        before = tier.files.ops.snapshot().stats
        assert tier.put(key(1), data).ok
        assert tier.files.ops.snapshot().stats > before
    finally:
        tier.close()
