"""Fault drill: the disk tier's retention journal rewritten (at start-up, or compacted) by a
process that dies, or a machine that loses power.

A rewrite writes `.retention.jsonl.<pid>.tmp` and renames it over the journal. A process
killed between the two left the temp file for ever: a later rewrite only removed a temp file
of its own pid. The tier's start-up now sweeps them by the rule of its chunk temp files
(every one where it holds the owner lock, else those older than TEMP_STALE_S). And the temp
file is fsync'd before the rename: renamed unsynced, a power loss could leave the journal
empty (every pin and expiry lost). The power loss itself cannot be staged here: the fsync is
observed (os.fsync and os.replace recorded, then done).
"""

from __future__ import annotations

import multiprocessing
import os
import time
from pathlib import Path

import pytest
from tierkit import key, make_tier, tiny_layout

from kvtier.core.retention import ChunkMeta
from kvtier.tiers.files import owner
from kvtier.tiers.files.filetree import TEMP_STALE_S
from kvtier.tiers.files.retention_journal import JOURNAL_NAME

LAYOUT = tiny_layout()
CHUNK = memoryview(bytes(LAYOUT.bytes_per_chunk))
PIN = ChunkMeta(tenant="t", retain_until=4_000_000_000.0)


def _killed_in_a_rewrite(root: str) -> None:
    """Open the disk tier, pin a chunk (a journal line), and die inside a compaction, its
    temp file written and not yet renamed (no cleanup, no close)."""
    tier = make_tier("disk", Path(root), LAYOUT, capacity_chunks=8)
    assert tier.wait_loaded(30)  # type: ignore[attr-defined]
    assert tier.put(key(0), CHUNK, PIN)  # type: ignore[call-arg]
    os.replace = lambda *args, **kwargs: os._exit(0)  # type: ignore[assignment]
    tier._compact_journal()  # type: ignore[attr-defined]
    os._exit(1)  # not reached: the rename is where it dies


def journal_temps(root: Path) -> list[Path]:
    return sorted((root / "disk").rglob(f".{JOURNAL_NAME}.*.tmp"))


def crash_in_a_rewrite(root: Path) -> int:
    """Run `_killed_in_a_rewrite` in a process of its own; its (dead) pid."""
    writer = multiprocessing.get_context("spawn").Process(
        target=_killed_in_a_rewrite, args=(str(root),))
    writer.start()
    writer.join(60)
    assert writer.exitcode == 0 and writer.pid is not None
    return writer.pid


def test_a_dead_rewrites_temp_file_is_swept_at_the_next_start(tmp_path: Path) -> None:
    pid = crash_in_a_rewrite(tmp_path)
    [temp] = journal_temps(tmp_path)
    assert temp.name == f".{JOURNAL_NAME}.{pid}.tmp" and temp.stat().st_size > 0
    tier = make_tier("disk", tmp_path, LAYOUT, capacity_chunks=8)  # restarted at once
    assert tier.wait_loaded(30)  # type: ignore[attr-defined]
    assert journal_temps(tmp_path) == [], "a killed rewrite's temp file was kept"
    assert tier.meta_of(key(0)) == PIN  # type: ignore[attr-defined]  # the journal's line
    tier.close()


def test_without_the_owner_lock_only_an_old_temp_file_is_swept(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the filesystem has no flock another engine may be rewriting its journal: a
    young temp file is left to its age, as chunk temp files are."""
    crash_in_a_rewrite(tmp_path)
    [young] = journal_temps(tmp_path)
    old = young.with_name(f".{JOURNAL_NAME}.99999999.tmp")  # no live pid: by its age
    old.write_text(young.read_text())
    long_ago = time.time() - 2 * TEMP_STALE_S
    os.utime(old, (long_ago, long_ago))

    def unsupported(fd: int) -> None:
        raise OSError(95, "Operation not supported")

    monkeypatch.setattr(owner, "_lock_exclusive", unsupported)
    tier = make_tier("disk", tmp_path, LAYOUT, capacity_chunks=8)
    assert tier.wait_loaded(30)  # type: ignore[attr-defined]
    assert journal_temps(tmp_path) == [young]
    tier.close()


def test_the_rewritten_journal_is_on_disk_before_its_rename(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tier = make_tier("disk", tmp_path, LAYOUT, capacity_chunks=8)
    assert tier.wait_loaded(30)  # type: ignore[attr-defined]
    assert tier.put(key(0), CHUNK, PIN)  # type: ignore[call-arg]
    tier.close()
    calls: list[tuple[str, str]] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd: int) -> None:
        calls.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    def replace(src: str | os.PathLike[str], dst: str | os.PathLike[str],
                **kwargs: object) -> None:
        calls.append(("replace", os.fspath(src)))
        real_replace(src, dst, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    again = make_tier("disk", tmp_path, LAYOUT, capacity_chunks=8)  # rewrites at start-up
    assert again.wait_loaded(30)  # type: ignore[attr-defined]
    monkeypatch.undo()
    renames = [i for i, (call, path) in enumerate(calls)
               if call == "replace" and JOURNAL_NAME in path]
    assert renames, "the start-up did not rewrite the journal"
    temp = calls[renames[0]][1]
    assert ("fsync", temp) in calls[:renames[0]], \
        f"the journal's temp file was renamed unsynced: {calls}"
    assert again.meta_of(key(0)) == PIN  # type: ignore[attr-defined]
    again.close()
