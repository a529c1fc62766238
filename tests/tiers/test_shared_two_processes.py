"""Two processes share one directory at the same time: both write and read the same keys,
with content derived from the key, under a quota small enough that they also evict each
other's files. No read may ever return a torn chunk or another chunk's bytes."""

from __future__ import annotations

import multiprocessing
import multiprocessing.synchronize
import random
import time
from pathlib import Path

import blake3
import pytest
from tierkit import key, make_tier, tiny_layout

LAYOUT = tiny_layout(256)  # 64 KiB chunks: a torn write would be easy to catch
KEYS = 24
RUN_S = 1.5


def content(k: bytes) -> bytes:
    """The only correct bytes for key `k` (any other process derives the same)."""
    return blake3.blake3(k).digest(length=LAYOUT.bytes_per_chunk)


def _worker(root: str, seed: int, start: multiprocessing.synchronize.Barrier,
            results: multiprocessing.Queue) -> None:  # type: ignore[type-arg]
    tier = make_tier("shared", Path(root), LAYOUT, capacity_chunks=10, scan_interval_s=0.05)
    start.wait(timeout=60)  # both run at the same time, however long each took to start
    rng = random.Random(seed)
    out = bytearray(LAYOUT.bytes_per_chunk)
    hits = misses = wrong = puts = 0
    deadline = time.monotonic() + RUN_S
    while time.monotonic() < deadline:
        i = rng.randrange(KEYS)
        tier.put(key(i), memoryview(content(key(i))))
        puts += 1
        j = rng.randrange(KEYS)
        if tier.get_into(key(j), memoryview(out)):
            hits += 1
            wrong += bytes(out) != content(key(j))
        else:
            misses += 1
    results.put({"seed": seed, "hits": hits, "misses": misses, "wrong": wrong, "puts": puts,
                 "corrupt": tier.stats().corrupt_reads})


@pytest.mark.timing  # both must run through the same 1.5 s (hits > 20 each): no engine beside
def test_two_processes_never_see_a_torn_or_wrong_chunk(tmp_path: Path) -> None:
    """Both processes hammer 24 keys for 1.5 s; every hit in either process holds exactly
    the bytes its key derives, and no file was ever found corrupt."""
    context = multiprocessing.get_context("spawn")
    results, start = context.Queue(), context.Barrier(2)
    workers = [context.Process(target=_worker, args=(str(tmp_path), seed, start, results))
               for seed in (1, 2)]
    for worker in workers:
        worker.start()
    reports = [results.get(timeout=60) for _ in workers]
    for worker in workers:
        worker.join(timeout=30)
        assert worker.exitcode == 0
    for report in reports:
        assert report["wrong"] == 0, report
        assert report["corrupt"] == 0, report
        assert report["hits"] > 20, report
        assert report["misses"] > 0, report  # the quota made them evict each other
    # Whatever is left in the directory is intact and within the quota.
    reader = make_tier("shared", tmp_path, LAYOUT, capacity_chunks=10)
    out = bytearray(LAYOUT.bytes_per_chunk)
    left = [i for i in range(KEYS) if reader.contains(key(i))]
    assert left
    for i in left:
        assert reader.get_into(key(i), memoryview(out)) and bytes(out) == content(key(i))
    # Both writers exited cleanly: every temp file was renamed into place or removed.
    assert not list(tmp_path.rglob("*.tmp"))
