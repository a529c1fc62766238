"""Fault drill: a read-only shared directory (issue 12, item 9).

A common deployment pre-warms a shared cache and mounts it read-only on the serving nodes.
The tier constructor used to raise an OSError about a `.probe` file (after logging "O_DIRECT
not supported"). By choice a read-only `shared` directory is served read-only: hits are
served, every put is a counted dropped write with Failure.READ_ONLY, nothing is evicted or
swept. Tested on a real read-only mount (a tmpfs remounted ro: needs root); skipped where
this machine cannot mount.
"""

from __future__ import annotations

import logging
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from tierkit import key, make_tier, tier_settings

from kvtier.core.layout import KVLayout
from kvtier.core.tier import Failure, LinkProbe
from kvtier.tiers import build_probe
from kvtier.tiers.storeconfig import StoreConfig


def payload(i: int, layout: KVLayout) -> bytes:
    return bytes((i * 13 + j) % 256 for j in range(layout.bytes_per_chunk))


def _mount(*args: str) -> None:
    done = subprocess.run(["mount", *args], capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount here (root and mount permission needed): "
                    f"{done.stderr.strip()}")


@pytest.fixture
def remountable(tmp_path: Path) -> Iterator[Path]:
    """A real tmpfs, writable until the test remounts it read-only."""
    mountpoint = tmp_path / "ro-fs"
    mountpoint.mkdir()
    _mount("-t", "tmpfs", "-o", "size=8M", "tmpfs", str(mountpoint))
    try:
        yield mountpoint
    finally:
        subprocess.run(["umount", "-l", str(mountpoint)], check=False)


def test_a_read_only_mount_serves_hits_and_counts_dropped_writes(
        remountable: Path, layout: KVLayout, caplog: pytest.LogCaptureFixture) -> None:
    writer = make_tier("shared", remountable, layout, capacity_chunks=8)
    for i in range(4):
        assert writer.put(key(i), memoryview(payload(i, layout)))
    writer.close()  # no file open for writing: the remount needs that
    _mount("-o", "remount,ro", str(remountable))
    with caplog.at_level(logging.WARNING):
        tier = make_tier("shared", remountable, layout, capacity_chunks=2)  # quota < content
    assert "read-only" in caplog.text
    out = bytearray(layout.bytes_per_chunk)
    for i in range(4):  # nothing evicted although the quota holds 2: a read-only tier
        assert tier.contains(key(i))
        assert tier.get_into(key(i), memoryview(out)) and bytes(out) == payload(i, layout)
    result = tier.put(key(9), memoryview(payload(9, layout)))
    assert result.failure is Failure.READ_ONLY
    stats = tier.stats()
    assert stats.dropped_writes == 1 and stats.hits == 4 and stats.evictions == 0
    config = StoreConfig.parse({"tiers": [tier_settings("shared", remountable, layout, 8)]})
    probe = build_probe(config.tiers[0], [layout])
    assert probe is not None and probe.contains(key(0)) and not probe.contains(key(9))


def test_a_read_only_mount_without_this_layout_is_all_misses(
        remountable: Path, layout: KVLayout) -> None:
    """The layout's directory was never created there (another model's cache): the tier
    starts, every read misses, every write is dropped."""
    (remountable / "shared").mkdir()
    _mount("-o", "remount,ro", str(remountable))
    tier = make_tier("shared", remountable, layout, capacity_chunks=8)
    assert not tier.contains(key(1))
    assert tier.get_into(key(1), memoryview(bytearray(layout.bytes_per_chunk))).failure \
        is Failure.MISSING
    assert tier.put(key(1), memoryview(payload(1, layout))).failure is Failure.READ_ONLY


def test_a_read_only_mount_measures_no_link_and_says_why(
        remountable: Path, layout: KVLayout, caplog: pytest.LogCaptureFixture) -> None:
    """The link probe writes a probe file (tiers/files/linkfile.py): read-only, none is
    written and no estimate given (issue 45: the first loads are timed instead)."""
    make_tier("shared", remountable, layout, capacity_chunks=8).close()
    _mount("-o", "remount,ro", str(remountable))
    tier = make_tier("shared", remountable, layout, capacity_chunks=8)
    assert isinstance(tier, LinkProbe)
    with caplog.at_level(logging.INFO):
        assert tier.measure_link() is None
    assert "read-only: no probe file can be written" in caplog.text
