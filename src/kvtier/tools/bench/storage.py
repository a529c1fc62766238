"""`kvtier bench storage`: tier put/get throughput against the machine's own ceilings.

For each chunk size, every subject of `kvtier.tools.bench.subjects` (the ceilings `copy`,
`direct` and `direct_1file`, the tiers, optionally LMCache) moves the same chunks once per
*round*: all puts, then all gets, each tier right beside its ceiling, in an order rotated
every round. Rounds repeat `trials` times after one untimed warm-up. A point's figure is the
median of its trials; a tier's ratio to its ceiling is the median of the per-round ratios, so
load from other processes on a small shared machine hits tiers and ceilings alike.
Throughput is payload bytes over wall time, in GB/s (1e9 B/s).

Primitives: `BenchConfig`, `Measurement`, `Verdict`, `BenchResult`, `run_bench`, `TARGETS`,
`size_label`.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kvtier.errors import ConfigError
from kvtier.tiers.registry import tier_class
from kvtier.tools.bench.headroom import MemoryNeed, require_memory
from kvtier.tools.bench.subjects import LMCacheProcess, SizeBench, Subject
from kvtier.units import format_size

MIB = 1024**2
TIERS = ("memory", "disk", "shared", "redis", "s3")
DEFAULT_TIERS = TIERS[:3]  # redis and s3 only when asked: each starts a private server
# (tier, op) -> (ceiling it is held to, the minimum ratio); for chunks >= TARGET_MIN.
# lmcache and shared have no target in the issue (0.0): their ratios are for information.
TARGETS: dict[tuple[str, str], tuple[str, float]] = {
    ("memory", "put"): ("copy", 0.5), ("memory", "get"): ("copy", 0.5),
    ("disk", "put"): ("direct", 0.8), ("disk", "get"): ("direct", 0.8),
    ("shared", "put"): ("direct", 0.0), ("shared", "get"): ("direct", 0.0),
    ("lmcache", "put"): ("direct", 0.0), ("lmcache", "get"): ("direct", 0.0),
    ("redis", "put"): ("redis_raw", 0.7), ("redis", "get"): ("redis_raw", 0.7),
    ("s3", "put"): ("s3_raw", 0.8), ("s3", "get"): ("s3_raw", 0.8),
}
TARGET_MIN_BYTES = 2 * MIB  # the targets apply to chunks of at least this size


@dataclass(frozen=True, slots=True)
class BenchConfig:
    """What one `kvtier bench storage` run measures. Validated by `validate`."""

    directory: Path  # a temp dir is made in it for the file tiers and O_DIRECT ceilings
    sizes_bytes: tuple[int, ...] = (MIB // 2, 2 * MIB, 8 * MIB, 32 * MIB)  # chunk sizes
    tiers: tuple[str, ...] = DEFAULT_TIERS  # which tiers to measure
    trials: int = 7  # timed rounds per size; figures are medians over them
    trial_bytes: int = 512 * MIB  # payload bytes each subject moves per round (per size)
    min_chunks: int = 4  # at least this many chunks per round, whatever trial_bytes says
    threads: int = 1  # threads issuing the file subjects' chunks (O_DIRECT, disk, shared, LMCache)
    lmcache_python: str | None = None  # interpreter with lmcache installed, or None

    def validate(self) -> None:
        """Raises ConfigError naming the first bad field; NotEnoughMemory where a round's
        buffers (`memory_need`) do not fit in the memory available."""
        for size in self.sizes_bytes:
            if size <= 0 or size % 4096:
                raise ConfigError("sizes", size, "positive multiples of 4 KiB (O_DIRECT)")
        if len(set(self.sizes_bytes)) < len(self.sizes_bytes):  # results are keyed by size
            raise ConfigError("sizes", ",".join(size_label(s) for s in self.sizes_bytes),
                              "each size once")
        for tier in self.tiers:
            if tier not in TIERS:
                raise ConfigError("tier", tier, f"one of {TIERS}")
        if self.trials < 1:
            raise ConfigError("trials", self.trials, "at least 1")
        if self.min_chunks < 1:
            raise ConfigError("min_chunks", self.min_chunks, "at least 1")
        if not 1 <= self.threads <= 64:
            raise ConfigError("threads", self.threads, "1 to 64")
        require_memory(self.memory_need())

    def memory_need(self) -> MemoryNeed:
        """The largest size's round (its sizes are measured one after another): the chunks'
        source and destination buffers, and a round's copy in each tier that holds it in
        RAM (the memory tier; the private Redis server and S3 emulator, a tier's and a raw
        subject's keys at once). Named by what sizes it: --trial-bytes where a round holds
        more than `min_chunks` chunks, else the chunk size of --sizes."""
        size = max(self.sizes_bytes, key=lambda s: self.chunks_for(s) * s)
        round_bytes = self.chunks_for(size) * size
        copies = 2 + ("memory" in self.tiers) + 2 * ("redis" in self.tiers) \
            + 2 * ("s3" in self.tiers)
        what = f"{self.chunks_for(size)} chunks of {format_size(size)}, {copies} copies"
        if self.chunks_for(size) > self.min_chunks:
            return MemoryNeed("--trial-bytes", self.trial_bytes, copies * round_bytes, 0, what)
        return MemoryNeed("--sizes", size_label(size), copies * round_bytes, 0, what)

    def chunks_for(self, size_bytes: int) -> int:
        return max(self.min_chunks, self.trial_bytes // size_bytes)


@dataclass(frozen=True, slots=True)
class Measurement:
    """One subject's put or get at one chunk size: the seconds of each timed trial."""

    subject: str  # "copy", "direct", "direct_1file", "memory", "disk", "shared", "lmcache"
    op: str  # "put" (for the ceilings: copy, O_DIRECT write) or "get" (copy, O_DIRECT read)
    size_bytes: int  # chunk size
    chunks: int  # chunks moved per trial
    trial_s: tuple[float, ...]  # wall seconds of each trial

    @property
    def gbps(self) -> float:
        """Median throughput over the trials, in GB/s (1e9 bytes per second)."""
        return self.size_bytes * self.chunks / statistics.median(self.trial_s) / 1e9

    @property
    def spread(self) -> float:
        """(max - min) / median of the trials' throughput: how noisy the point was."""
        rates = [self.size_bytes * self.chunks / s for s in self.trial_s]
        return (max(rates) - min(rates)) / statistics.median(rates)


@dataclass(frozen=True, slots=True)
class Verdict:
    """A tier's put or get at one size, against its ceiling and the issue's target."""

    tier: str
    op: str  # "put" or "get"
    size_bytes: int
    gbps: float  # median over trials
    ceiling: str  # the subject it is held to, same op and size ("copy" or "direct")
    ceiling_gbps: float  # median over trials
    ratio: float  # median over trials of tier rate / ceiling rate in the same round
    target: float | None  # the minimum ratio, or None when no target applies
    passed: bool | None  # None when no target applies


@dataclass(frozen=True, slots=True)
class BenchResult:
    """Everything a run measured, plus where and under what load."""

    config: BenchConfig
    measurements: tuple[Measurement, ...]
    verdicts: tuple[Verdict, ...]
    machine: dict[str, Any]  # cpus, load averages and PSI before/after, filesystem
    lmcache: dict[str, Any] | None  # the driver's versions, or {"error": why it did not run}
    wall_s: float
    # --tier s3: seconds to look up a 512-chunk prefix (s3_baseline.lookup_figures)
    s3_lookup: dict[str, float] | None = None

    def as_json(self, command: str = "") -> dict[str, Any]:
        config = asdict(self.config)
        config["directory"] = str(self.config.directory)
        return {
            "benchmark": "kvtier bench storage",
            "command": command,
            "config": config,
            "machine": self.machine,
            "lmcache": self.lmcache,
            "wall_s": self.wall_s,
            "measurements": [
                {"subject": m.subject, "op": m.op, "size_bytes": m.size_bytes,
                 "chunks": m.chunks,
                 "gbps": m.gbps, "spread": m.spread, "trial_s": list(m.trial_s)}
                for m in self.measurements
            ],
            "verdicts": [asdict(v) for v in self.verdicts],
            "s3_lookup": self.s3_lookup,
        }

    def write_json(self, path: Path, command: str = "") -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.as_json(command), indent=2) + "\n")


def size_label(size_bytes: int) -> str:
    """A chunk size for a table: "0.5 MiB", "32 MiB"; under 256 KiB in KiB ("4 KiB", where
    MiB read "0.00390625 MiB")."""
    if size_bytes < MIB // 4:
        return f"{size_bytes / 1024:g} KiB"
    return f"{size_bytes / MIB:g} MiB"


def rounds_total(config: BenchConfig) -> int:
    """How many rounds `run_bench` reports to `on_round` (warm-ups included)."""
    return len(config.sizes_bytes) * (config.trials + 1)


def run_bench(config: BenchConfig, on_round: Callable[[str], None] = lambda _: None
              ) -> BenchResult:
    """Measure every subject at every size; see the module docstring.

    Args:
        config: what to measure; a temp dir is made inside `config.directory` (created if
            missing) and removed when the run ends.
        on_round: called after each round with a short description (for a progress bar).

    Raises:
        ConfigError: a bad config value.
        OSError: the directory is unusable or O_DIRECT fails there (the ceilings need it).
        RuntimeError: a tier dropped a put or missed a get, or the LMCache driver failed
            during the run (one that cannot start is reported in `BenchResult.lmcache`).
    """
    config.validate()
    started = time.perf_counter()
    machine = machine_info(config.directory)
    samples: dict[tuple[str, str, int], list[float]] = {}  # (subject, op, size) -> seconds
    measurements: list[Measurement] = []
    lmcache_info: dict[str, Any] | None = None
    s3_lookup: dict[str, float] | None = None
    # Here, not at the top: redis-py takes ~0.3 s to import, and `kvtier` imports this
    # module to build its parser (tests/tools/test_startup.py).
    from kvtier.tools.bench.redis_baseline import local_redis, redis_subjects

    with ExitStack() as stack:
        config.directory.mkdir(parents=True, exist_ok=True)
        # A fresh directory of our own inside it, removed at the end whatever happens.
        work = Path(tempfile.mkdtemp(prefix=".kvtier-bench-", dir=config.directory))
        stack.callback(shutil.rmtree, work, ignore_errors=True)
        redis_url = stack.enter_context(local_redis(work)) if "redis" in config.tiers else None
        s3_at = None
        if "s3" in config.tiers:  # here: boto3 and moto load only for --tier s3
            from kvtier.tools.bench.s3_baseline import local_s3, lookup_figures, s3_subjects
            s3_at = stack.enter_context(local_s3())
            s3_lookup = lookup_figures(*s3_at)
        lmcache = None
        if config.lmcache_python:
            try:
                lmcache = LMCacheProcess(config.lmcache_python, work / "lmcache")
            except RuntimeError as exc:  # not installed, or cannot start here: say why
                lmcache_info = {"error": str(exc)}
            else:
                stack.callback(lmcache.close)
                lmcache_info = lmcache.info
        for size in config.sizes_bytes:
            chunks = config.chunks_for(size)
            with ExitStack() as size_stack:
                bench = SizeBench(work, size, chunks, config.threads, size_stack)
                size_stack.callback(shutil.rmtree, bench.raw_dir, ignore_errors=True)
                files = [bench.direct()] + [bench.tier(k, size_stack) for k in config.tiers
                                            if tier_class(k).has_path]
                if lmcache is not None and (found := lmcache.subject(size, chunks, config.threads)):
                    files.append(found)
                groups = [[bench.copy()], [bench.direct_1file()], files]
                if redis_url is not None:  # the tier next to raw SET/GET on the same server
                    groups.append(redis_subjects(bench, redis_url, size_stack))
                if s3_at is not None:  # the tier next to raw PUT/GET on the same server
                    groups.append(s3_subjects(bench, *s3_at, size_stack))
                if "memory" in config.tiers:
                    groups[0].append(bench.tier("memory", size_stack))
                settle = bench.copy()  # untimed, before the RAM group (see _run_round)
                for trial in range(config.trials + 1):  # round 0 is the untimed warm-up
                    _run_round(groups, trial, size, samples if trial else None, settle)
                    on_round(f"{size_label(size)}, round {trial}/{config.trials}")
            measurements += [Measurement(subject, op, size, chunks, tuple(seconds))
                             for (subject, op, at), seconds in samples.items() if at == size]
    machine["loadavg_after"] = list(os.getloadavg())
    machine["pressure_after"] = pressure()
    return BenchResult(config, tuple(measurements), verdicts(measurements), machine,
                       lmcache_info, time.perf_counter() - started, s3_lookup)


def _run_round(groups: list[list[Subject]], trial: int, size: int,
               samples: dict[tuple[str, str, int], list[float]] | None,
               settle: Subject) -> None:
    """Every subject's put, then every subject's get, then cleanup.

    A tier runs right next to its ceiling (the groups), in an order rotated each trial, so
    a burst of load from another process hits both alike and `verdicts` can pair them.
    The first group (copy and the memory tier) comes after the O_DIRECT groups of the op
    before: `settle`, an untimed copy of the same bytes, runs first. On a VM the first large
    copy after disk I/O (or an idle second) runs at half speed, whichever subject makes it,
    so the two alternated at 0.5x and 1.5x each other round by round, and the memory tier
    read 0.33-0.54x a copy; settled, 0.76-1.00x at the first chunk size of a run (as in a
    loop of its own), though a later size still read 0.53-0.59x (docs/performance.md).
    """
    for op in ("put", "get"):
        settle.put() if op == "put" else settle.get()
        for group in groups:
            shift = trial % len(group)
            for subject in group[shift:] + group[:shift]:
                seconds = subject.put() if op == "put" else subject.get()
                if samples is not None:
                    samples.setdefault((subject.name, op, size), []).append(seconds)
    for group in groups:
        for subject in group:
            subject.clean()


def verdicts(measurements: list[Measurement]) -> tuple[Verdict, ...]:
    """Each tier point against its ceiling at the same size and op (see TARGETS).

    The ratio is the median, over trials, of the tier's rate over the ceiling's rate in the
    same round: a pair measured moments apart, robust to load that comes and goes.
    """
    by_key = {(m.subject, m.op, m.size_bytes): m for m in measurements}
    found = []
    for m in measurements:
        if (m.subject, m.op) not in TARGETS:
            continue
        ceiling_name, target = TARGETS[(m.subject, m.op)]
        ceiling = by_key[(ceiling_name, m.op, m.size_bytes)]
        ratio = statistics.median(c / t for c, t in zip(ceiling.trial_s, m.trial_s,
                                                          strict=True))
        applies = target > 0 and m.size_bytes >= TARGET_MIN_BYTES
        found.append(Verdict(m.subject, m.op, m.size_bytes, m.gbps, ceiling_name,
                             ceiling.gbps, ratio, target if applies else None,
                             ratio >= target if applies else None))
    return tuple(found)


def machine_info(directory: Path) -> dict[str, Any]:
    """CPU count, load averages, and the filesystem `directory` lives on."""
    return {
        "cpus": os.cpu_count(), "loadavg_before": list(os.getloadavg()),
        "pressure_before": pressure(),
        "filesystem": filesystem_of(directory), "python": sys.version.split()[0],
        "numpy": np.__version__,
    }


def pressure() -> dict[str, float]:
    """Linux PSI: % of the last 60 s some task waited for CPU / I/O / memory (if known)."""
    found = {}
    for resource in ("cpu", "io", "memory"):
        try:
            line = Path(f"/proc/pressure/{resource}").read_text().splitlines()[0]
        except (OSError, IndexError):
            continue
        fields = dict(part.split("=") for part in line.split()[1:])
        found[f"{resource}_some_avg60"] = float(fields.get("avg60", "nan"))
    return found


def filesystem_of(directory: Path) -> dict[str, str]:
    """The mount (device, mount point, type) holding `directory`, from /proc/mounts."""
    target = Path(os.path.abspath(directory))
    best: dict[str, str] = {"device": "?", "mount": "/", "type": "?"}
    try:
        lines = Path("/proc/mounts").read_text().splitlines()
    except OSError:
        return best
    for line in lines:
        device, mount, fstype = line.split()[:3]
        if (target == Path(mount) or Path(mount) in target.parents) and \
                len(mount) >= len(best["mount"]):
            best = {"device": device, "mount": mount, "type": fstype}
    return best
