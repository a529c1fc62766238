"""What per-tenant accounting, quotas, pins and TTL cost the memory tier (issue 15). Not a
test (never collected by pytest).

Three subjects move the same chunks in the same run, in alternating rounds:
  - `copy`: numpy copyto of each chunk into a slab slot and back (the memory tier's ceiling);
  - `plain`: a memory tier without retention settings, chunks stored without metadata
    (what every store did before issue 15; the tier still keeps its per-tenant book);
  - `tenants`: a memory tier with `tenant_quota` {share: 0.1}, `ttl_s` and chunks of 8
    tenants (round robin) of which one in 8 is pinned: quota evictions, pins and expiry
    deadlines all in play.
  - `before` (with `--before REV`): the memory tier of git revision REV (e.g. the commit
    before issue 15's, 97940cb), chunks stored with `put`: no per-tenant book at all.
Each round puts `--chunks` chunks into a tier of a quarter as many slots (so puts evict:
steady state) and reads back the chunks still held (hits only: the timed reads). Prints
a table (GB/s for put and get,
median of the rounds, and each subject's ratio to `plain`) and one JSON line.

    python3 -m kvtier.tools.bench.tenant_accounting --chunk-mib 2 --chunks 256 --rounds 7 \
        --before 97940cb
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import time
import types
from collections.abc import Callable
from typing import Any

import numpy as np

from kvtier.core.keys import ChunkKey
from kvtier.core.layout import KVLayout
from kvtier.core.retention import DEFAULT_META, ChunkMeta
from kvtier.tiers.memory import MemoryTier
from kvtier.tiers.storeconfig import StoreConfig

TENANTS = 8


def layout_for(chunk_bytes: int) -> KVLayout:
    tokens = chunk_bytes // 256  # 1 layer x 1 head x 64 fp16, K and V: 256 B a token
    return KVLayout(num_layers=1, num_kv_heads=1, head_size=64, dtype="float16",
                    tokens_per_chunk=tokens)


def tier(slots: int, layout: KVLayout, cls: Any = MemoryTier, **options: Any) -> Any:
    config = StoreConfig.parse({"tiers": [{"kind": "memory", "pin": "off",
                                           "capacity": slots * layout.bytes_per_chunk,
                                           **options}]})
    built = cls(config.tiers[0], layout)
    if built.prefaulting is not None:
        built.prefaulting.join()  # measure copies, not first-touch faults
    return built


def key(round_no: int, i: int) -> ChunkKey:
    return ChunkKey(round_no.to_bytes(8, "big") + i.to_bytes(8, "big"))


def old_memory_tier(revision: str) -> Any:
    """The MemoryTier class of `revision`'s src/kvtier/tiers/memory.py."""
    text = subprocess.run(["git", "show", f"{revision}:src/kvtier/tiers/memory.py"],
                          check=True, capture_output=True, text=True).stdout
    module = types.ModuleType("memory_before")
    exec(compile(text, f"{revision}:memory.py", "exec"), module.__dict__)
    return module.MemoryTier


class _Plain:
    """An old tier seen through `put(key, data, meta)` (it takes no metadata)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.chunk_bytes = inner.chunk_bytes

    def put(self, key: ChunkKey, data: memoryview, meta: ChunkMeta) -> Any:
        return self.inner.put(key, data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def run_tier(t: Any, source: np.ndarray, chunks: int, round_no: int,
             meta: Callable[[int], ChunkMeta]) -> tuple[float, float, int]:
    """(put seconds, get seconds, chunks read back)."""
    size = t.chunk_bytes
    out = memoryview(bytearray(size))
    start = time.perf_counter()
    for i in range(chunks):
        t.put(key(round_no, i), source[i % 4 * size:(i % 4 + 1) * size].data,
                   meta(i))
    put_s = time.perf_counter() - start
    held = [key(round_no, i) for i in range(chunks) if t.contains(key(round_no, i))]
    start = time.perf_counter()
    read = sum(bool(t.get_into(k, out)) for k in held)
    return put_s, time.perf_counter() - start, read


def run_copy(slab: np.ndarray, source: np.ndarray, chunks: int, size: int,
             slots: int) -> tuple[float, float, int]:
    out = np.empty(size, dtype=np.uint8)
    start = time.perf_counter()
    for i in range(chunks):
        j = i % slots
        np.copyto(slab[j * size:(j + 1) * size], source[i % 4 * size:(i % 4 + 1) * size])
    put_s = time.perf_counter() - start
    start = time.perf_counter()
    for i in range(chunks - slots, chunks):
        j = i % slots
        np.copyto(out, slab[j * size:(j + 1) * size])
    return put_s, time.perf_counter() - start, slots


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--chunk-mib", type=float, default=2.0)
    parser.add_argument("--chunks", type=int, default=256, help="chunks put per round")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--before", metavar="REV",
                        help="also measure the memory tier of this git revision")
    args = parser.parse_args()
    layout = layout_for(int(args.chunk_mib * (1 << 20)))
    size = layout.bytes_per_chunk
    slots = max(8, args.chunks // 4)
    source = np.random.default_rng(0).integers(0, 255, 4 * size, dtype=np.uint8)
    plain = tier(slots, layout)
    tenants = tier(slots, layout, tenant_quota={"share": 0.1}, ttl_s=3600)
    slab = np.zeros(slots * size, dtype=np.uint8)
    slab[::4096] = 1  # first touch outside the timing
    now = time.time()
    metas = [ChunkMeta(tenant=f"tenant-{t}", expires_at=now + 600,
                       retain_until=now + 600 if t == 0 else None) for t in range(TENANTS)]
    results: dict[str, list[tuple[float, float, int]]] = {"copy": [], "plain": [], "tenants": []}
    before = None
    if args.before:
        before = _Plain(tier(slots, layout, old_memory_tier(args.before)))
        results["before"] = []
    for round_no in range(args.rounds):
        results["copy"].append(run_copy(slab, source, args.chunks, size, slots))
        if before is not None:
            results["before"].append(run_tier(before, source, args.chunks, round_no,
                                              lambda i: DEFAULT_META))
        results["plain"].append(run_tier(plain, source, args.chunks, round_no,
                                         lambda i: DEFAULT_META))
        results["tenants"].append(run_tier(tenants, source, args.chunks, round_no,
                                           lambda i: metas[i % TENANTS]))
    summary: dict[str, dict[str, float]] = {}
    for name, rounds in results.items():
        put = statistics.median(args.chunks * size / p / 1e9 for p, _, _ in rounds)
        get = statistics.median(n * size / g / 1e9 for _, g, n in rounds)
        summary[name] = {"put_GBps": round(put, 2), "get_GBps": round(get, 2),
                         "chunks_read": rounds[-1][2]}
    for name in summary:
        summary[name]["put_vs_plain"] = round(summary[name]["put_GBps"]
                                              / summary["plain"]["put_GBps"], 3)
        summary[name]["get_vs_plain"] = round(summary[name]["get_GBps"]
                                              / summary["plain"]["get_GBps"], 3)
    stats = tenants.retention_stats()
    print(f"{'subject':10} {'put GB/s':>9} {'get GB/s':>9} {'put/plain':>10} {'get/plain':>10}")
    for name, row in summary.items():
        print(f"{name:10} {row['put_GBps']:9.2f} {row['get_GBps']:9.2f} "
              f"{row['put_vs_plain']:10.3f} {row['get_vs_plain']:10.3f}")
    print(f"tenants tier: {stats.quota_evictions} quota evictions, {stats.pinned_chunks} "
          f"pinned, {stats.pins_refused} pins refused, {len(stats.tenants)} tenants")
    print(json.dumps({"chunk_bytes": size, "chunks_per_round": args.chunks, "slots": slots,
                      "rounds": args.rounds, "subjects": summary}))


if __name__ == "__main__":
    main()
