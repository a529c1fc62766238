"""Fault drill: several writer processes against one shared quota (issue 12, item 5).

3 processes with a 4 MiB quota used to peak at 2.56x the quota at cold start and 1.17x in
steady state: each wrote against a usage it had measured before the others' writes. The
bound stated in kvtier/tiers/files/shared.py is usage <= quota (chunk files and temp files, any
number of writers). Three spawned processes write distinct chunks as fast as they can for
RUN_S seconds; the test samples the directory's real usage (the sum of the sizes of every
regular file below it, temp files included) under the ledger's lock, so that each sample is
one instant (no writer reserves, renames or evicts meanwhile), and asserts the maximum.
"""

from __future__ import annotations

import fcntl
import multiprocessing
import multiprocessing.synchronize
import os
import time
from pathlib import Path

import pytest
from tierkit import key, make_tier, tiny_layout

WRITERS = 3
RUN_S = 5.0
QUOTA_BYTES = 4 << 20
LAYOUT = tiny_layout(256)  # 64 KiB chunks (68 KiB files)


def usage_bytes(root: Path) -> int:
    """The sizes of every regular file below `root` but the ledger (links not followed)."""
    total = 0
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            if name == ".kvtier-quota":
                continue
            try:
                info = os.lstat(os.path.join(dirpath, name))
            except FileNotFoundError:
                continue
            total += info.st_size if os.path.isfile(os.path.join(dirpath, name)) else 0
    return total


def _writer(root: str, seed: int, start: multiprocessing.synchronize.Barrier,
            results: multiprocessing.Queue) -> None:  # type: ignore[type-arg]
    tier = make_tier("shared", Path(root), LAYOUT, capacity_chunks=0, capacity=QUOTA_BYTES,
                     scan_interval_s=0.5)
    data = memoryview(bytes(LAYOUT.bytes_per_chunk))
    start.wait(timeout=60)
    puts = 0
    deadline = time.monotonic() + RUN_S
    i = seed << 32
    while time.monotonic() < deadline:
        puts += bool(tier.put(key(i), data))
        i += 1
    results.put(puts)


@pytest.mark.timing
def test_three_writers_never_pass_the_quota(tmp_path: Path) -> None:
    root = tmp_path / "shared"
    context = multiprocessing.get_context("spawn")
    results, start = context.Queue(), context.Barrier(WRITERS + 1)
    writers = [context.Process(target=_writer, args=(str(tmp_path), s, start, results))
               for s in range(1, WRITERS + 1)]
    for writer in writers:
        writer.start()
    start.wait(timeout=60)
    ledger = -1
    peak = samples = 0
    deadline = time.monotonic() + RUN_S
    while time.monotonic() < deadline:
        if ledger < 0 and (root / ".kvtier-quota").exists():
            ledger = os.open(root / ".kvtier-quota", os.O_RDONLY)
        if ledger >= 0:
            fcntl.flock(ledger, fcntl.LOCK_EX)
        try:
            peak = max(peak, usage_bytes(root))
        finally:
            if ledger >= 0:
                fcntl.flock(ledger, fcntl.LOCK_UN)
        samples += 1
        time.sleep(0.001)
    puts = [results.get(timeout=60) for _ in writers]
    for writer in writers:
        writer.join(timeout=30)
        assert writer.exitcode == 0
    assert samples > 100 and min(puts) > 50, (samples, puts)
    assert sum(puts) * (68 << 10) > 3 * QUOTA_BYTES, "the writers never filled the quota"
    assert peak <= QUOTA_BYTES, f"peak {peak / QUOTA_BYTES:.3f}x the quota"
