"""The file tiers at fleet scale (issue 28): what a shared directory of 10^5-10^6 chunks costs
each writer, and how fast a disk tier over such a directory starts. Not a test.

For each --chunks size, the directory is filled with sparse chunk files of 4 KiB chunks
(8 KiB files) written straight into kvtier's layout, then:

1. one shared tier opens it (a new ledger: the one walk a fleet makes, timed);
2. for each --writers count, that many processes put --rate chunks/s each for --seconds into
   a quota with room for exactly what the directory holds (every put evicts), with
   scan_interval_s --interval: metadata operations per put (the tier's own counters,
   `kvtier.tiers.files.fsops`), CPU per put and CPU seconds per minute per writer, re-measures;
3. eviction throughput: one tier frees 2,000 files (at most a tenth) under the ledger's lock
   (sampled LRU);
4. a disk tier opens the same directory: time until it serves (constructor return), until
   its index is complete, a lookup while it loads, and RSS per chunk of the loaded index.

Then a projection for NFS: each metadata operation a round trip of --op-latency-ms, at 10^7
chunks and 100 writers. `kvtier bench fleet` (tools/cli/bench_fleet.py) runs it:

    kvtier bench fleet --chunks 100000 1000000 --writers 1 4

Primitives: `FleetConfig`, `run_fleet_bench(config, progress)`.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import random
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import blake3

from kvtier.core.chunkformat import MAGIC, stored_size
from kvtier.core.keys import ChunkKey
from kvtier.core.layout import KVLayout
from kvtier.errors import ConfigError, ShimUnavailable
from kvtier.tiers import build_tier
from kvtier.tiers.files.chunktree import chunk_parts
from kvtier.tiers.storeconfig import StoreConfig
from kvtier.tools.bench.emulators.fslatency import build_shim, shim_env
from kvtier.tools.bench.headroom import MemoryNeed, require_memory

LAYOUT = KVLayout(num_layers=1, num_kv_heads=1, head_size=64, dtype="float16",
                  tokens_per_chunk=16)  # 4 KiB chunks
FILE_BYTES = stored_size(LAYOUT.bytes_per_chunk)
OPS = ("meta_stats", "meta_opens", "meta_unlinks", "meta_dir_reads", "meta_other")
# A tier's index of a chunk file, at most (docs/performance.md: the disk tier's, 149 B a
# chunk over 2 million chunks, its target <= 200): what a directory of --chunks costs in RAM.
INDEX_BYTES_PER_CHUNK = 200


@dataclass(frozen=True, slots=True)
class FleetConfig:
    """What `run_fleet_bench` measures (the CLI's flags)."""

    chunks: Sequence[int] = (100_000,)  # directory sizes, in chunks
    writers: Sequence[int] = (1, 4)  # writer processes per run
    rate: float = 100.0  # puts/s per writer
    seconds: float = 10.0  # each run of the writers
    interval: float = 2.0  # the shared tier's scan_interval_s
    op_latency_ms: float = 0.5  # the projection's metadata round trip
    # the writers' metadata calls really wait op_latency_ms each (fslatency's LD_PRELOAD
    # shim: an emulated NFS), instead of only the projection multiplying by it
    emulate_latency: bool = False
    # where the directories are built, kept for a later run (None: a temp dir, removed)
    directory: Path | None = None
    skip_disk: bool = False  # no disk-tier start-up figures

    def validate(self) -> None:
        """Raises ConfigError naming the first bad setting; NotEnoughMemory where the indexes
        of the largest directory (`memory_need`) do not fit in the RAM available."""
        if not self.chunks or min(self.chunks) < 100:
            raise ConfigError("chunks", list(self.chunks), "sizes of at least 100 chunks")
        if not self.writers or min(self.writers) < 1:
            raise ConfigError("writers", list(self.writers), "counts of at least 1")
        for name in ("chunks", "writers"):  # one given twice was a second, identical run
            values = list(getattr(self, name))
            if len(set(values)) < len(values):
                raise ConfigError(name, values, "each once")
        for name in ("rate", "seconds", "interval"):
            if not getattr(self, name) > 0:
                raise ConfigError(name, getattr(self, name), "a number above 0")
        if not self.op_latency_ms >= 0:
            raise ConfigError("op_latency_ms", self.op_latency_ms, "0 or more")
        require_memory(self.memory_need())
        if self.emulate_latency:
            try:
                build_shim()  # before any work: one line where none builds
            except ShimUnavailable as exc:
                raise ConfigError("emulate_latency", True, str(exc)) from None


    def memory_need(self) -> MemoryNeed:
        """The disk tier's index of the largest directory at its start-up (none with
        --skip-disk), INDEX_BYTES_PER_CHUNK a chunk: the part of the run measured to grow
        with --chunks."""
        most = max(self.chunks)
        index = 0 if self.skip_disk else most * INDEX_BYTES_PER_CHUNK
        return MemoryNeed("--chunks", most, index, 0,
                          f"a disk tier's index of {most} chunks, {INDEX_BYTES_PER_CHUNK} B each")


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
        os.pwrite(fd, MAGIC, 0)  # a sparse file without it counts what it allocates
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
    put_s = 0.0
    while (elapsed := time.monotonic() - began) < args["seconds"]:
        name = (int(args["run"]) << 96) + (seed << 64) + puts  # new keys every run
        putting = time.perf_counter()
        stored += bool(tier.put(ChunkKey(name.to_bytes(16, "big")), data))
        put_s += time.perf_counter() - putting
        puts += 1
        ahead = puts / args["rate"] - (time.monotonic() - began)
        if ahead > 0:
            time.sleep(ahead)
    after = tier.stats()
    results.put({"puts": puts, "stored": stored, "cpu_s": time.process_time() - cpu,
                 "run_s": elapsed, "put_s": put_s,
                 "ops": {f: getattr(after, f, 0) - getattr(before, f, 0) for f in OPS},
                 "remeasures": getattr(tier, "remeasures", -1),
                 "evictions": after.evictions - before.evictions})
    tier.close()


def run_writers(root: Path, n: int, capacity: int, args: FleetConfig) -> dict[str, Any]:
    context = multiprocessing.get_context("spawn")
    results, start = context.Queue(), context.Barrier(n + 1)
    knobs = {"interval": args.interval, "seconds": args.seconds, "rate": args.rate,
             "run": random.getrandbits(30)}
    # seeds of their own per run: a later run must not put the keys an earlier one stored
    procs = [context.Process(target=writer, args=(str(root), (n << 8) + s, capacity, knobs,
                                                  start, results)) for s in range(1, n + 1)]
    with _ended(procs):
        with _latency(root, args):
            for proc in procs:
                proc.start()
        start.wait(timeout=600)
        reports = [results.get(timeout=1200) for _ in procs]
    puts = sum(r["puts"] for r in reports)
    ops = {f: sum(r["ops"][f] for r in reports) for f in OPS}
    cpu = sum(r["cpu_s"] for r in reports)
    return {"writers": n, "puts": puts, "stored": sum(r["stored"] for r in reports),
            "ops_per_put": round(sum(ops.values()) / puts, 1),
            "ops_per_put_by_kind": {f[5:]: round(v / puts, 2) for f, v in ops.items()},
            "cpu_ms_per_put": round(1000 * cpu / puts, 3),
            "put_ms": round(1000 * sum(r["put_s"] for r in reports) / puts, 2),
            "cpu_s_per_min_per_writer": round(60 * cpu / n / max(r["run_s"] for r in reports),
                                              2),
            "remeasures_all_writers": sum(r["remeasures"] for r in reports),
            "evictions": sum(r["evictions"] for r in reports)}


@contextlib.contextmanager
def _ended(procs: Sequence[multiprocessing.process.BaseProcess]) -> Iterator[None]:
    """`procs` joined at the block's end; on an error or a signal, those still running are
    terminated first. Joined as they were (multiprocessing joins its children at exit), a
    run stopped by SIGTERM had its writers put on for the rest of --seconds, into the
    directory the run had removed meanwhile: they made it again, left in the temp dir."""
    try:
        yield
    except BaseException:
        for proc in procs:
            if proc.pid is not None and proc.is_alive():
                proc.terminate()
        raise
    finally:
        for proc in procs:
            if proc.pid is not None:
                proc.join()


@contextlib.contextmanager
def _latency(root: Path, config: FleetConfig) -> Iterator[None]:
    """With `config.emulate_latency`, processes started inside run their metadata calls on
    `root` with `op_latency_ms` each (fslatency's shim); otherwise nothing."""
    if not config.emulate_latency:
        yield
        return
    saved = dict(os.environ)
    os.environ.update(shim_env(root, config.op_latency_ms))
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


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


def run_fleet_bench(config: FleetConfig,
                    progress: Callable[[str], None] = lambda _text: None) -> dict[str, Any]:
    """Every size of `config.chunks`, in order; the report (JSON-ready): the settings and,
    per size, the figures listed in the module docstring."""
    config.validate()
    if config.directory is not None:
        return _run_sizes(config, config.directory, progress)
    # No --dir: directories of 10^5-10^6 chunk files of the run's own, removed after it.
    base = Path(tempfile.mkdtemp(prefix="kvtier-fleet-"))
    try:
        return _run_sizes(config, base, progress)
    finally:
        shutil.rmtree(base, ignore_errors=True)


def _run_sizes(config: FleetConfig, base: Path, progress: Callable[[str], None],
               ) -> dict[str, Any]:
    """`run_fleet_bench` with its directories under `base`."""
    report: dict[str, Any] = {"config": {**asdict(config), "directory": str(base)},
                              "sizes": []}
    for held in config.chunks:
        root = base / f"shared-{held}"
        progress(f"{held:,} chunks: filling the directory")
        fill_s = fill(root, held) if not root.exists() else 0.0
        progress(f"{held:,} chunks: the fleet's first walk")
        cpu = time.process_time()
        first = shared_tier(root, held * FILE_BYTES, config.interval)
        walk_cpu = time.process_time() - cpu
        # the quota: what the directory holds now (a reused one may hold less than `held`),
        # so that every put evicts
        capacity = min(held * FILE_BYTES, first.stats().used_bytes)
        first.close()
        size: dict[str, Any] = {"chunks": held, "fill_s": round(fill_s, 1),
                                "first_open_cpu_s": round(walk_cpu, 2), "writers": []}
        for n in config.writers:
            progress(f"{held:,} chunks: {n} writer(s) for {config.seconds:g} s")
            size["writers"].append(run_writers(root, n, capacity, config))
        progress(f"{held:,} chunks: eviction")
        size["eviction"] = eviction_throughput(root, held, config.interval)
        if not config.skip_disk:
            progress(f"{held:,} chunks: a disk tier's start-up")
            context = multiprocessing.get_context("spawn")
            results = context.Queue()
            proc = context.Process(target=disk_startup, args=(str(root), results))
            with _ended([proc]):
                proc.start()
                size["disk"] = results.get(timeout=3600)
        size["projection"] = projection(size["writers"], config.op_latency_ms,
                                        1e6 * walk_cpu / held)
        report["sizes"].append(size)
    return report
