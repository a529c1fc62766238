"""Shared quota with concurrent writers: how far N writer processes push one shared
directory past its quota (issue 12, item 5). Not a test (never collected by pytest).

Each writer is a spawned process with its own `shared` tier on DIR, writing distinct 64 KiB
chunks as fast as it can for --seconds. The parent samples the directory's real usage (sizes
of every regular file below it, temp files included, the ledger excluded) every millisecond,
holding the ledger's flock while it sums (when the ledger exists) so that a sample is one
instant. Prints one JSON line: peak / quota overall, in the first second (cold start) and
after it (steady state), and puts per second.

    python3 -m kvtier.tools.bench.shared_quota --writers 3 --seconds 10 --quota-mib 4
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import multiprocessing
import os
import tempfile
import time
from pathlib import Path

from kvtier.core.layout import KVLayout
from kvtier.tiers import build_tier
from kvtier.tiers.storeconfig import StoreConfig

LAYOUT = KVLayout(num_layers=1, num_kv_heads=1, head_size=64, dtype="float16",
                  tokens_per_chunk=256)  # 64 KiB chunks


def usage_bytes(root: Path) -> int:
    total = 0
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            path = os.path.join(dirpath, name)
            if name != ".kvtier-quota" and os.path.isfile(path) and not os.path.islink(path):
                with contextlib.suppress(FileNotFoundError):
                    total += os.lstat(path).st_size
    return total


def writer(root: str, seed: int, quota: int, seconds: float, start, results) -> None:  # type: ignore[no-untyped-def]
    config = StoreConfig.parse({"tiers": [{"kind": "shared", "path": root, "capacity": quota,
                                           "scan_interval_s": 0.5}]})
    tier = build_tier(config.tiers[0], LAYOUT)
    data = memoryview(bytes(LAYOUT.bytes_per_chunk))
    start.wait(timeout=60)
    puts, i = 0, seed << 32
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        puts += bool(tier.put(i.to_bytes(16, "big"), data))  # type: ignore[arg-type]
        i += 1
    results.put(puts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--writers", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--quota-mib", type=float, default=4.0)
    parser.add_argument("--dir", help="the shared directory (default: a new temp dir)")
    args = parser.parse_args()
    root = Path(args.dir or tempfile.mkdtemp(prefix="kvtier-quota-"))
    quota = int(args.quota_mib * (1 << 20))
    context = multiprocessing.get_context("spawn")
    results, start = context.Queue(), context.Barrier(args.writers + 1)
    procs = [context.Process(target=writer, args=(str(root), s, quota, args.seconds, start,
                                                  results)) for s in range(1, args.writers + 1)]
    for proc in procs:
        proc.start()
    start.wait(timeout=60)
    began = time.monotonic()
    cold = steady = samples = 0
    ledger_path, ledger = root / "shared" / ".kvtier-quota", -1
    while time.monotonic() - began < args.seconds:
        if ledger < 0 and ledger_path.exists():
            ledger = os.open(ledger_path, os.O_RDONLY)
        if ledger >= 0:
            fcntl.flock(ledger, fcntl.LOCK_EX)
        used = usage_bytes(root)
        if ledger >= 0:
            fcntl.flock(ledger, fcntl.LOCK_UN)
        if time.monotonic() - began < 1.0:
            cold = max(cold, used)
        else:
            steady = max(steady, used)
        samples += 1
        time.sleep(0.001)
    puts = sum(results.get(timeout=60) for _ in procs)
    for proc in procs:
        proc.join()
    print(json.dumps({"writers": args.writers, "quota_bytes": quota, "samples": samples,
                      "peak_x": round(max(cold, steady) / quota, 3),
                      "cold_start_peak_x": round(cold / quota, 3),
                      "steady_peak_x": round(steady / quota, 3),
                      "puts_per_s": round(puts / args.seconds)}))


if __name__ == "__main__":
    main()
