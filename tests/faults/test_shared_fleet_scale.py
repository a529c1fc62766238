"""The shared tier's metadata work per write does not grow with the directory (issue 28).

Four writer processes put into one shared directory holding 10^3, then 3 x 10^4 chunks, with the
quota full, so that every put also evicts. Before issue 28 each writer walked the whole
directory every `scan_interval_s` (an lstat per file: 5.2x the CPU per put at 10^5 than at
10^3) and evicted from a sorted list built by that walk. Now the usage comes from the ledger,
one writer re-measures for all when the ledger says it is due, and eviction samples a few
shard directories.

The directory is filled by writing files straight into kvtier's layout (sparse chunk files of
the right size: a chunk's content is only read by a hit, and none is read here), then one
tier re-measures it, as the first engine on a directory does (a walk of 3 x 10^4 files: a few
seconds of this test's ~15; the first test has no wall-clock premise, only counts). The
counts are the tiers' own (`TierStats.meta_*`, `kvtier.tiers.files.fsops`): opens, stats,
unlinks, directory reads and the rest, per put, summed over the writers.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.synchronize
import os
import time
from pathlib import Path
from typing import Any

import blake3
import pytest
from tierkit import key, make_tier, tiny_layout

from kvtier.core.chunkformat import MAGIC, stored_size
from kvtier.core.keys import ChunkKey
from kvtier.tiers.files.chunktree import chunk_parts
from kvtier.tiers.files.quota import QuotaLedger

WRITERS = 4
PUTS = 150  # per writer
INTERVAL_S = 1.0  # scan_interval_s: short, so that a re-measure per writer would show
LAYOUT = tiny_layout()  # 4 KiB chunks, 8 KiB files
FILE_BYTES = stored_size(LAYOUT.bytes_per_chunk)
LARGE = 30_000  # chunks held in the large directory (the small one: 1,000)


def fill(root: Path, chunks: int) -> None:
    """`chunks` sparse chunk files of LAYOUT under root/shared, as kvtier lays them out (each
    begins with a header's magic: a real chunk's, as `filetree.counted_bytes` counts it)."""
    digest = LAYOUT.digest()
    made: set[tuple[str, ...]] = set()
    for i in range(chunks):
        parts = chunk_parts(digest, ChunkKey(blake3.blake3(i.to_bytes(8, "little")).digest(16)))
        directory = root.joinpath("shared", *parts[:-1])
        if parts[:-1] not in made:
            directory.mkdir(parents=True, exist_ok=True, mode=0o700)
            made.add(parts[:-1])
        fd = os.open(directory / parts[-1], os.O_WRONLY | os.O_CREAT, 0o600)
        os.pwrite(fd, MAGIC, 0)  # a sparse file without it counts what it allocates
        os.ftruncate(fd, FILE_BYTES)
        os.close(fd)


def _writer(root: str, seed: int, capacity: int, start: multiprocessing.synchronize.Barrier,
            results: multiprocessing.Queue) -> None:  # type: ignore[type-arg]
    tier = make_tier("shared", Path(root), LAYOUT, capacity_chunks=0, capacity=capacity,
                     scan_interval_s=INTERVAL_S)
    data = memoryview(bytes(LAYOUT.bytes_per_chunk))
    start.wait(timeout=120)
    before, began = tier.stats(), time.monotonic()
    cpu = time.process_time()
    stored = sum(bool(tier.put(key((seed << 64) + i), data)) for i in range(PUTS))
    cpu = time.process_time() - cpu
    after = tier.stats()
    ops = {f: getattr(after, f) - getattr(before, f)
           for f in ("meta_stats", "meta_opens", "meta_unlinks", "meta_dir_reads",
                     "meta_other")}
    results.put({"stored": stored, "ops": ops, "cpu_s": cpu, "run_s": time.monotonic() - began,
                 "remeasures": tier.remeasures, "evictions": after.evictions})  # type: ignore[attr-defined]
    tier.close()


def run_writers(root: Path, held: int) -> dict[str, Any]:
    """Fill to `held` chunks, re-measure once, then let WRITERS processes put PUTS each into
    a quota with room for `held` files: what they did, summed."""
    fill(root, held)
    capacity = held * FILE_BYTES
    first = make_tier("shared", root, LAYOUT, capacity_chunks=0, capacity=capacity,
                      scan_interval_s=INTERVAL_S)
    assert first.remeasures == 1  # type: ignore[attr-defined]  # a new ledger: walked once
    assert first.stats().chunks == held
    first.close()
    context = multiprocessing.get_context("spawn")
    results, start = context.Queue(), context.Barrier(WRITERS + 1)
    procs = [context.Process(target=_writer, args=(str(root), s, capacity, start, results))
             for s in range(1, WRITERS + 1)]
    for proc in procs:
        proc.start()
    start.wait(timeout=120)
    reports = [results.get(timeout=120) for _ in procs]
    for proc in procs:
        proc.join(timeout=60)
        assert proc.exitcode == 0
    stored = sum(r["stored"] for r in reports)
    ops = {f: sum(r["ops"][f] for r in reports) for f in reports[0]["ops"]}
    return {"stored": stored, "per_put": {f: n / stored for f, n in ops.items()},
            "ops_per_put": sum(ops.values()) / stored,
            "remeasures": sum(r["remeasures"] for r in reports),
            "run_s": max(r["run_s"] for r in reports),
            "cpu_ms_per_put": 1000 * sum(r["cpu_s"] for r in reports) / stored,
            "evictions": sum(r["evictions"] for r in reports)}


def usage_bytes(root: Path) -> int:
    return sum(p.lstat().st_size for p in root.rglob("*") if p.is_file() and not p.is_symlink()
               and p.name != ".kvtier-quota")


@pytest.mark.slow  # ~15 s: 3 x 10^4 files written, walked once, then 600 puts by 4 processes
def test_metadata_ops_per_put_do_not_grow_with_the_directory(tmp_path: Path) -> None:
    """10^3 and 3 x 10^4 chunks held, the quota full: the writers' metadata operations per put
    (every put evicts) stay within a constant of each other, a re-measure happens at most
    once per interval across all writers, and the quota holds with sampled eviction."""
    small = run_writers(tmp_path / "small", 1_000)
    large = run_writers(tmp_path / "large", LARGE)
    print(f"\n10^3: {small}\n{LARGE}: {large}")
    for run in (small, large):
        assert run["stored"] == WRITERS * PUTS
        assert run["evictions"] >= run["stored"] * 0.9, run  # the quota was full: each evicts
        # At most one re-measure per interval for the fleet (each writer alone would make
        # WRITERS per interval); +1: the interval running when they started.
        assert run["remeasures"] <= run["run_s"] / INTERVAL_S + 1, run
    # The large directory is 30x the small one; the work per put is the same (a sample of
    # 64 files per 16 victims in both) and would be ~30x with a walk per interval.
    assert large["ops_per_put"] <= 1.5 * small["ops_per_put"] + 5, (small, large)
    assert large["per_put"]["meta_stats"] <= 1.5 * small["per_put"]["meta_stats"] + 2
    for name, held in (("small", 1_000), ("large", LARGE)):
        root = tmp_path / name / "shared"
        with QuotaLedger(root, 0o600).locked() as ledger:
            real = usage_bytes(root)
            assert real <= held * FILE_BYTES, "over the quota"
            assert ledger.used_bytes >= real, "the ledger is not an upper bound"


def _busy_writer(root: str, seed: int, start: multiprocessing.synchronize.Barrier,
                 results: multiprocessing.Queue) -> None:  # type: ignore[type-arg]
    tier = make_tier("shared", Path(root), LAYOUT, capacity_chunks=50, scan_interval_s=0.2)
    data = memoryview(bytes(LAYOUT.bytes_per_chunk))
    start.wait(timeout=120)
    began, i = time.monotonic(), 0
    while time.monotonic() - began < 3.0:
        tier.put(key((seed << 64) + i), data)
        i += 1
    results.put(tier.remeasures)  # type: ignore[attr-defined]
    tier.close()


@pytest.mark.timing
def test_one_writer_re_measures_for_all_per_interval(tmp_path: Path) -> None:
    """Four writers, a 50-chunk quota, scan_interval_s 0.2 for 3 s: the directory is walked
    at most 3 / 0.2 + 1 = 16 times by all of them together (each on its own clock: ~60),
    and at least once (the ledger does ask for re-measures)."""
    context = multiprocessing.get_context("spawn")
    results, start = context.Queue(), context.Barrier(WRITERS + 1)
    procs = [context.Process(target=_busy_writer, args=(str(tmp_path), s, start, results))
             for s in range(1, WRITERS + 1)]
    for proc in procs:
        proc.start()
    start.wait(timeout=120)
    remeasures = [results.get(timeout=120) for _ in procs]
    for proc in procs:
        proc.join(timeout=60)
        assert proc.exitcode == 0
    # the first writer's start-up walk (a new ledger) is one of them
    assert 1 <= sum(remeasures) <= 3.0 / 0.2 + 1 + 1, remeasures
