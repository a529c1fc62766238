"""Fault drill: a disk tier's process killed mid-write, restarted at once (a supervisor's
restart of a crashed `kvtier node`, a crash loop).

A write in flight when the process dies leaves its temp file (full size, sparse) in the
tier's directory, outside the index and the capacity. The start-up index swept only temp
files older than TEMP_STALE_S (120 s): a tier restarted sooner kept them for its whole life,
and each crash added more (a leak soak of a node SIGKILLed and restarted: one to three files
a kill, never removed). The tier that holds the directory's owner lock knows no writer of
them is alive: it sweeps them all as it indexes.
"""

from __future__ import annotations

import multiprocessing
import os
from pathlib import Path

import pytest
from tierkit import key, make_tier, tiny_layout

from kvtier.tiers.files import owner

LAYOUT = tiny_layout()
CRASHES = 3


def _killed_writer(root: str, first: int) -> None:
    """Open the disk tier, start two writes, and die as if killed (no cleanup, no close)."""
    tier = make_tier("disk", Path(root), LAYOUT, capacity_chunks=8)
    tier.files.prepare_write(key(first))  # type: ignore[attr-defined]
    tier.files.prepare_write(key(first + 1))  # type: ignore[attr-defined]
    os._exit(0)


def temp_files(root: Path) -> list[Path]:
    return sorted((root / "disk").rglob(".*.tmp"))


def crash(root: Path, first: int) -> None:
    writer = multiprocessing.get_context("spawn").Process(
        target=_killed_writer, args=(str(root), first))
    writer.start()
    writer.join(60)
    assert writer.exitcode == 0


def test_temp_files_of_a_crashed_process_do_not_pile_up_across_restarts(
        tmp_path: Path) -> None:
    for n in range(CRASHES):
        crash(tmp_path, 10 * n)
        assert len(temp_files(tmp_path)) == 2  # the dead writes' (and no older one's)
        tier = make_tier("disk", tmp_path, LAYOUT, capacity_chunks=8)  # restarted at once
        assert tier.wait_loaded(30)  # type: ignore[attr-defined]
        assert temp_files(tmp_path) == [], "a crashed process's temp files were kept"
        assert tier.put(key(100 + n), memoryview(bytes(LAYOUT.bytes_per_chunk)))
        tier.close()
    assert [p.name for p in temp_files(tmp_path)] == []


def test_without_the_owner_lock_young_temp_files_are_left_to_their_age(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the filesystem has no flock, another engine may be writing them: kept."""
    crash(tmp_path, 0)

    def unsupported(fd: int) -> None:
        raise OSError(95, "Operation not supported")

    monkeypatch.setattr(owner, "_lock_exclusive", unsupported)
    tier = make_tier("disk", tmp_path, LAYOUT, capacity_chunks=8)
    assert tier.wait_loaded(30)  # type: ignore[attr-defined]
    assert len(temp_files(tmp_path)) == 2
    tier.close()
