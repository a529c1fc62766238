"""Fault drill: temp files in the shared directory (issue 12, item 3).

The shared tier's start-up sweep used to delete every `*.tmp` older than 600 s anywhere under
its path: other people's files. Now only kvtier's own temp files (its name pattern, in its own
layout) are ever removed. And a writer killed mid-write leaves its temp file behind: that file
counts against the quota and is swept by the periodic quota scan once it is older than
TEMP_STALE_S, not only at a restart.
"""

from __future__ import annotations

import multiprocessing
import os
import time
from pathlib import Path

from tierkit import key, make_tier, tiny_layout

from kvtier.core.layout import KVLayout

OLD_S = 100_000.0  # older than any sweep threshold, old (600 s) or new (TEMP_STALE_S)


def _age(path: Path, seconds: float) -> None:
    then = time.time() - seconds
    os.utime(path, (then, then), follow_symlinks=False)


def test_foreign_temp_files_are_never_deleted(tmp_path: Path, layout: KVLayout) -> None:
    root = tmp_path / "shared"
    root.mkdir()
    digest = layout.digest()
    foreign = [
        root / "notes.tmp",  # beside the layouts
        root / "project" / "build.tmp",  # in someone's directory
        root / digest / "upload.tmp",  # in kvtier's layout directory, not kvtier's pattern
        root / digest / "00" / "00" / "other.tmp",  # in a shard directory, not the pattern
        root / digest / "00" / "00" / f".{'0' * 32}.kvc.tmp",  # almost the pattern
    ]
    for path in foreign:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"precious")
        _age(path, OLD_S)
    tier = make_tier("shared", tmp_path, layout, capacity_chunks=8, scan_interval_s=0.01)
    for i in range(4):
        assert tier.put(key(i), memoryview(bytes(layout.bytes_per_chunk)))
        time.sleep(0.02)  # each put re-measures (and would sweep)
    tier.enforce_quota()  # type: ignore[attr-defined]
    assert all(p.read_bytes() == b"precious" for p in foreign), "deleted someone's file"


def _killed_writer(root: str) -> None:
    """Reserve and start a write, then die as if killed (no cleanup)."""
    layout = tiny_layout(256)
    tier = make_tier("shared", Path(root), layout, capacity_chunks=4)
    tier._reserve(key(100))  # type: ignore[attr-defined]
    os._exit(0)


def test_a_killed_writers_temp_file_counts_and_is_swept_by_the_periodic_scan(
        tmp_path: Path) -> None:
    from kvtier.tiers.files.filetree import TEMP_STALE_S

    layout = tiny_layout(256)  # 64 KiB chunks
    tier = make_tier("shared", tmp_path, layout, capacity_chunks=4, scan_interval_s=0.01)
    context = multiprocessing.get_context("spawn")
    writer = context.Process(target=_killed_writer, args=(str(tmp_path),))
    writer.start()
    writer.join(60)
    temps = list((tmp_path / "shared").rglob(".*.tmp"))
    assert len(temps) == 1 and temps[0].stat().st_size == tier.file_bytes  # type: ignore[attr-defined]
    # It holds one chunk's room: only 3 more chunks fit in a 4-chunk quota.
    for i in range(4):
        assert tier.put(key(i), memoryview(bytes(layout.bytes_per_chunk)))
        time.sleep(0.02)
    assert tier.stats().evictions >= 1, "the dead writer's temp file was not counted"
    assert temps[0].exists(), "a fresh temp file (a live writer's, maybe) was swept"
    _age(temps[0], TEMP_STALE_S + 1)
    # Swept by the running writer, no restart: by its next re-measure (due once
    # scan_interval_s and 100x the last walk's duration have passed: issue 28) or by an
    # eviction's sample that meets it, whichever comes first.
    deadline, i = time.monotonic() + 5.0, 10
    while temps[0].exists() and time.monotonic() < deadline:
        assert tier.put(key(i), memoryview(bytes(layout.bytes_per_chunk)))
        i += 1
        time.sleep(0.01)
    assert not temps[0].exists(), "the stale temp file was not swept by the periodic scan"
