"""The file tiers at fleet scale (issue 28): what a shared directory of 10^5-10^6 chunks costs
each writer, and how fast a disk tier over such a directory starts. Not a test.

For each --chunks size, the directory is filled with sparse chunk files of 4 KiB chunks
(8 KiB files) written straight into kvtier's layout, then:

1. one shared tier opens it (a new ledger: the one walk a fleet makes, timed);
2. for each --writers count, that many processes put --rate chunks/s each for --seconds into
   a quota with room for exactly what the directory holds (every put evicts), with
   scan_interval_s --interval: metadata operations per put (the tier's own counters,
   `kvtier.tiers.fsops`), CPU per put and CPU seconds per minute per writer, re-measures;
3. eviction throughput: one tier frees 2,000 files (at most a tenth) under the ledger's lock
   (sampled LRU);
4. a disk tier opens the same directory: time until it serves (constructor return), until
   its index is complete, a lookup while it loads, and RSS per chunk of the loaded index.

Then a projection for NFS: each metadata operation a round trip of --op-latency-ms, at 10^7
chunks and 100 writers. Prints one JSON document.

    python3 -m kvtier.tools.bench.fleet_fs --chunks 100000 1000000 --writers 1 4
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import random
import tempfile
import time
from pathlib import Path
from typing import Any

import blake3

from kvtier.core.chunkformat import stored_size
from kvtier.core.keys import ChunkKey
from kvtier.core.layout import KVLayout
from kvtier.tiers import build_tier
from kvtier.tiers.chunktree import chunk_parts
from kvtier.tiers.storeconfig import StoreConfig

LAYOUT = KVLayout(num_layers=1, num_kv_heads=1, head_size=64, dtype="float16",
                  tokens_per_chunk=16)  # 4 KiB chunks
FILE_BYTES = stored_size(LAYOUT.bytes_per_chunk)
OPS = ("meta_stats", "meta_opens", "meta_unlinks", "meta_dir_reads", "meta_other")


def fill(root: Path, chunks: int) -> float:
    """Sparse chunk files of LAYOUT for keys blake3(0..chunks-1) under root; seconds taken."""
    began = time.monotonic()
    digest = LAYOUT.digest()
    made: set[tuple[str, ...]] = set()
    for i in range(chunks):
        parts = chunk_parts(digest, ChunkKey(blake3.blake3(i.to_bytes(8, "little")).digest(16)))
        directory = root.joinpath(*parts[:-1])
        if parts[:-1] not in made:
            directory.mkdir(parents=True, exist_ok=True, mode=0o700)
            made.add(parts[:-1])
        fd = os.open(directory / parts[-1], os.O_WRONLY | os.O_CREAT, 0o600)
        os.ftruncate(fd, FILE_BYTES)
        os.close(fd)
    return time.monotonic() - began


def shared_tier(root: Path, capacity: int, interval_s: float) -> Any:
    config = StoreConfig.parse({"tiers": [{"kind": "shared", "path": str(root),
                                           "capacity": capacity,
                                           "scan_interval_s": interval_s}]})
    return build_tier(config.tiers[0], LAYOUT)


def writer(root: str, seed: int, capacity: int, args: dict[str, float], start: Any,
           results: Any) -> None:
    """One writer process: --rate puts/s for --seconds; what it cost."""
    tier = shared_tier(Path(root), capacity, args["interval"])
    data = memoryview(bytes(LAYOUT.bytes_per_chunk))
    start.wait(timeout=600)
    before = tier.stats()
    cpu, began, puts, stored = time.process_time(), time.monotonic(), 0, 0
    while (elapsed := time.monotonic() - began) < args["seconds"]:
        name = (int(args["run"]) << 96) + (seed << 64) + puts  # new keys every run
        stored += bool(tier.put(ChunkKey(name.to_bytes(16, "big")), data))
        puts += 1
        ahead = puts / args["rate"] - (time.monotonic() - began)
        if ahead > 0:
            time.sleep(ahead)
    after = tier.stats()
    results.put({"puts": puts, "stored": stored, "cpu_s": time.process_time() - cpu,
                 "run_s": elapsed,
                 "ops": {f: getattr(after, f, 0) - getattr(before, f, 0) for f in OPS},
                 "remeasures": getattr(tier, "remeasures", -1),
                 "evictions": after.evictions - before.evictions})
    tier.close()


def run_writers(root: Path, n: int, capacity: int, args: argparse.Namespace) -> dict[str, Any]:
    context = multiprocessing.get_context("spawn")
    results, start = context.Queue(), context.Barrier(n + 1)
    knobs = {"interval": args.interval, "seconds": args.seconds, "rate": args.rate,
             "run": random.getrandbits(30)}
    # seeds of their own per run: a later run must not put the keys an earlier one stored
    procs = [context.Process(target=writer, args=(str(root), (n << 8) + s, capacity, knobs,
                                                  start, results)) for s in range(1, n + 1)]
    for proc in procs:
        proc.start()
    start.wait(timeout=600)
    reports = [results.get(timeout=1200) for _ in procs]
    for proc in procs:
        proc.join()
    puts = sum(r["puts"] for r in reports)
    ops = {f: sum(r["ops"][f] for r in reports) for f in OPS}
    cpu = sum(r["cpu_s"] for r in reports)
    return {"writers": n, "puts": puts, "stored": sum(r["stored"] for r in reports),
            "ops_per_put": round(sum(ops.values()) / puts, 1),
            "ops_per_put_by_kind": {f[5:]: round(v / puts, 2) for f, v in ops.items()},
            "cpu_ms_per_put": round(1000 * cpu / puts, 3),
            "cpu_s_per_min_per_writer": round(60 * cpu / n / max(r["run_s"] for r in reports),
                                              2),
            "remeasures_all_writers": sum(r["remeasures"] for r in reports),
            "evictions": sum(r["evictions"] for r in reports)}


def eviction_throughput(root: Path, held: int, interval_s: float) -> dict[str, Any]:
    tier = shared_tier(root, held * FILE_BYTES, interval_s)
    files = min(2000, held // 10)
    before = tier.stats()
    with tier.ledger.locked() as ledger:
        began = time.monotonic()
        evicted = tier._evict_locked(ledger, ledger.used_bytes - files * FILE_BYTES)
        wall = time.monotonic() - began
    ops = sum(getattr(tier.stats(), f, 0) - getattr(before, f, 0) for f in OPS)
    tier.close()
    return {"evicted": evicted, "evictions_per_s": round(evicted / wall),
            "ops_per_eviction": round(ops / max(1, evicted), 1)}


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def disk_startup(root: str, results: Any) -> None:
    """In a fresh process: a disk tier over `root`; start-up, index and RSS figures."""
    probe = ChunkKey(blake3.blake3((7).to_bytes(8, "little")).digest(16))
    config = StoreConfig.parse({"tiers": [{"kind": "disk", "path": root,
                                           "capacity": "1TiB"}]})
    rss = _rss_bytes()
    began = time.monotonic()
    tier: Any = build_tier(config.tiers[0], LAYOUT)
    serving_s = time.monotonic() - began
    loading = not getattr(tier, "index_loaded", True)  # builds before issue 28: blocking
    lookup = time.monotonic()
    found = tier.contains(probe)
    lookup_ms = 1000 * (time.monotonic() - lookup)
    getattr(tier, "wait_loaded", lambda: True)()
    indexed_s = time.monotonic() - began
    chunks = tier.stats().chunks
    results.put({"chunks": chunks, "serving_after_s": round(serving_s, 3),
                 "index_complete_s": round(indexed_s, 2),
                 "lookup_while_loading": {"loading": loading, "found": found,
                                          "ms": round(lookup_ms, 3)},
                 "rss_bytes_per_chunk": round((_rss_bytes() - rss) / max(1, chunks))})


def projection(runs: list[dict[str, Any]], op_ms: float, walk_cpu_per_file_us: float,
               ) -> dict[str, Any]:
    """10^7 chunks, 100 writers at --rate each, every metadata op a round trip of op_ms."""
    chunks, writers = 10**7, 100
    per_put = max(r["ops_per_put"] for r in runs)
    walk_ops = chunks + 2 * 65536  # an lstat a file, an open and a read a shard directory
    walk_s = walk_ops * op_ms / 1000
    return {"chunks": chunks, "writers": writers, "op_latency_ms": op_ms,
            "metadata_ms_per_put": round(per_put * op_ms, 1),
            "one_walk_s": round(walk_s), "walk_every_s": round(max(30.0, 100 * walk_s)),
            "walk_cpu_s_local": round(chunks * walk_cpu_per_file_us / 1e6),
            "before_walks_per_30s": writers,
            "before_walk_ops_per_s": round(writers * walk_ops / 30)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chunks", type=int, nargs="+", default=[100_000])
    parser.add_argument("--writers", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--rate", type=float, default=100.0, help="puts/s per writer")
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--interval", type=float, default=2.0, help="scan_interval_s")
    parser.add_argument("--op-latency-ms", type=float, default=0.5)
    parser.add_argument("--dir", help="where to build the directories (default: a temp dir)")
    parser.add_argument("--skip-disk", action="store_true")
    args = parser.parse_args()
    base = Path(args.dir or tempfile.mkdtemp(prefix="kvtier-fleet-"))
    report: dict[str, Any] = {"args": vars(args), "sizes": []}
    for held in args.chunks:
        root = base / f"shared-{held}"
        fill_s = fill(root, held) if not root.exists() else 0.0
        cpu = time.process_time()
        first = shared_tier(root, held * FILE_BYTES, args.interval)
        walk_cpu = time.process_time() - cpu
        # the quota: what the directory holds now (a reused one may hold less than `held`),
        # so that every put evicts
        capacity = min(held * FILE_BYTES, first.stats().used_bytes)
        first.close()
        size: dict[str, Any] = {"chunks": held, "fill_s": round(fill_s, 1),
                                "first_open_cpu_s": round(walk_cpu, 2),
                                "writers": [run_writers(root, n, capacity, args)
                                            for n in args.writers]}
        size["eviction"] = eviction_throughput(root, held, args.interval)
        if not args.skip_disk:
            context = multiprocessing.get_context("spawn")
            results = context.Queue()
            proc = context.Process(target=disk_startup, args=(str(root), results))
            proc.start()
            size["disk"] = results.get(timeout=3600)
            proc.join()
        size["projection"] = projection(size["writers"], args.op_latency_ms,
                                        1e6 * walk_cpu / held)
        report["sizes"].append(size)
        print(json.dumps(size), flush=True)
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
