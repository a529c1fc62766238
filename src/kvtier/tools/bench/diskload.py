"""`kvtier bench disk-load`: a disk-tier hit's load, the worker's own path, against a raw
O_DIRECT read of the same bytes, without an engine; and a miss's store of the same chunks
against a raw O_DIRECT write.

The same chunks a `kvtier bench ttft` disk hit loads (2 MiB: 256 tokens of its bench model) are
stored in a disk tier behind a 2-chunk memory tier, as that bench configures it, then loaded by
the CPU mover (cpu.py: `lend_as_landed` reads as many chunks in parallel as it has spares, each
chunk is scattered into the paged KV as its read lands) into other blocks of the same paged KV,
vLLM 0.33's layout (bench/vllmviews.py). Each trial first times a raw read of the same bytes
(one file per chunk, O_DIRECT, one thread, one page-aligned buffer: the ceiling the issue's
target names), then empties the memory tier and times the load, so both see the machine in the
same state. The load is split as the worker reports it on /metrics: the wait for reads and the
copy into blocks (`LoadSample.read_s`). Every load is checked byte for byte.

Stores: each trial also times a raw write of the same bytes (one new file per chunk,
O_DIRECT, one thread), then the mover's store of as many new chunks from the same blocks (the
worker's path on a miss: gathered into the memory tier, copied for the write-behind, written
to the disk tier with its header and checksum), until the disk holds them (`flush`), and the
process's CPU time over it (every thread: the store's cost to a machine that also runs the
engine). The stored chunks are deleted after each trial.

This is the load's own cost; `kvtier bench ttft` measures the hit in a real engine, where
the step around it adds its noise.

Primitives: `DiskLoadConfig`, `DiskLoadPoint`, `DiskLoadResult`, `run_disk_load_bench`.
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from kvtier.errors import ConfigError
from kvtier.tools.bench.headroom import MemoryNeed, require_memory
from kvtier.tools.bench.subjects import aligned_buffer, direct_read_s, direct_write_s
from kvtier.units import format_size

if TYPE_CHECKING:
    from kvtier.core.store import TieredStore
    from kvtier.integrations.vllm.transfers import ChunkTransfer
    from kvtier.integrations.vllm.worker.cpu import CpuChunkMover
    from kvtier.integrations.vllm.worker.paged import PagedKV

TARGET_VS_RAW = 1.5  # a disk hit's load <= 1.5x the raw O_DIRECT read (issue 26)


@dataclass(frozen=True, slots=True)
class DiskLoadConfig:
    """What to load."""

    chunks: tuple[int, ...] = (4, 16)  # chunks a load, per point (1k and 4k tokens)
    layers: int = 4
    kv_heads: int = 4
    head_size: int = 128
    block_size: int = 16
    tokens_per_chunk: int = 256  # 2 MiB a chunk with the defaults, as `bench ttft`'s disk hit
    trials: int = 15
    directory: Path | None = None  # where the disk tier and the raw files go (a temp dir)

    def validate(self) -> None:
        """Raises ConfigError naming the first bad field; NotEnoughMemory where the run's
        buffers (`memory_need`) do not fit in the memory available."""
        for name in ("layers", "kv_heads", "head_size", "block_size", "tokens_per_chunk",
                     "trials"):
            if getattr(self, name) < 1:
                raise ConfigError(name, getattr(self, name), "a positive integer")
        if not self.chunks or min(self.chunks) < 1:
            raise ConfigError("chunks", self.chunks, "one or more positive chunk counts")
        if len(set(self.chunks)) < len(self.chunks):  # a count twice was two identical rows
            raise ConfigError("chunks", ",".join(map(str, self.chunks)), "each count once")
        if self.tokens_per_chunk % self.block_size:
            raise ConfigError("tokens_per_chunk", self.tokens_per_chunk,
                              f"a multiple of the block size {self.block_size}")
        require_memory(self.memory_need())

    def memory_need(self) -> MemoryNeed:
        """The paged KV of the largest point (its chunks stored from, as many loaded into),
        the memory tier's two slots and the loads' 8 spares (bf16)."""
        chunk = self.tokens_per_chunk * self.layers * 2 * self.kv_heads * self.head_size * 2
        most = max(self.chunks)
        return MemoryNeed("--chunks", most, (2 * most + 11) * chunk, 0,
                          f"{most} chunks of {format_size(chunk)}, 2 copies")


@dataclass(frozen=True, slots=True)
class DiskLoadPoint:
    """One load size: medians over the trials, in seconds."""

    chunks: int
    nbytes: int
    load_s: float  # the mover's whole load
    read_wait_s: float  # of it, the wait for the reads
    raw_s: float  # the raw O_DIRECT read of the same bytes, timed right before each load
    ratio: float  # median over trials of load / raw (paired)
    store_s: float  # the mover's store of as many new chunks, until on disk
    store_cpu_s: float  # the process's CPU time over it (all threads)
    raw_write_s: float  # the raw O_DIRECT write of the same bytes, timed right before
    store_ratio: float  # median over trials of store / raw write (paired)

    @property
    def copy_s(self) -> float:
        return self.load_s - self.read_wait_s

    @property
    def meets_target(self) -> bool:
        return self.ratio <= TARGET_VS_RAW


@dataclass(frozen=True, slots=True)
class DiskLoadResult:
    config: DiskLoadConfig
    chunk_bytes: int
    o_direct: bool  # the disk tier read with O_DIRECT (the filesystem allows it)
    points: tuple[DiskLoadPoint, ...]
    verified: bool  # every load put the stored bytes back

    def write_json(self, path: Path) -> None:
        data = asdict(self)
        data["points"] = [dict(asdict(p), copy_s=p.copy_s, meets_target=p.meets_target)
                          for p in self.points]
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(data, indent=2, default=str) + "\n")


def run_disk_load_bench(config: DiskLoadConfig,
                        progress: Callable[[str], None] = lambda _text: None,
                        ) -> DiskLoadResult:
    """Measure; see the module docstring.

    Raises:
        ConfigError: a bad setting.
    """
    config.validate()
    if config.directory is not None:
        Path(config.directory).mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="kvtier-disk-load-", dir=config.directory) as tmp:
        return _run(config, Path(tmp), progress)


def _run(config: DiskLoadConfig, root: Path, progress: Callable[[str], None]
         ) -> DiskLoadResult:
    from kvtier.core.keys import ChunkKey
    from kvtier.integrations.vllm.transfers import ChunkTransfer
    from kvtier.integrations.vllm.worker.cpu import CpuChunkMover, spare_buffers
    from kvtier.integrations.vllm.worker.paged import PagedKV
    from kvtier.testing.vllmviews import VllmCacheSpec, vllm_kv_caches
    from kvtier.tiers import open_store
    from kvtier.tiers.files.disk import DiskTier
    from kvtier.tiers.storeconfig import StoreConfig

    most = max(config.chunks)
    per_chunk = config.tokens_per_chunk // config.block_size
    spec = VllmCacheSpec(config.block_size, config.kv_heads, config.head_size,
                         config.head_size, torch.bfloat16)
    kv = vllm_kv_caches(spec, config.layers, 2 * most * per_chunk + 1, "LBNHC")
    for view in kv.values():
        view.view(torch.uint8).random_(0, 256, generator=torch.Generator().manual_seed(0))
    paged = PagedKV(kv, config.block_size, content="halves", torch_ops=False)
    layout = paged.layout(config.tokens_per_chunk)
    slot = -(-layout.bytes_per_chunk // 4096) * 4096
    store = open_store(StoreConfig.parse({"write_queue_depth": 4 * most, "tiers": [
        {"kind": "memory", "capacity": 2 * slot, "pin": "off"},
        {"kind": "disk", "path": str(root / "disk"), "capacity": 2 * most * slot + 2**26}]}),
        layout)
    raw = _RawFiles(root / "raw", layout.bytes_per_chunk, most)
    points, verified = [], True
    try:
        mover = CpuChunkMover(paged, store, layout.bytes_per_chunk, lambda _k, _s: None)
        spares = spare_buffers(8, layout.bytes_per_chunk)
        half = most * per_chunk
        for n in config.chunks:
            stored = [ChunkTransfer(key=ChunkKey(os.urandom(16)),
                                    block_ids=tuple(range(i * per_chunk, (i + 1) * per_chunk)))
                      for i in range(n)]
            progress(f"{n} chunks: storing")
            mover.store(stored, "sync")
            if not store.flush(timeout_s=60):
                raise RuntimeError("the disk tier's write-behind did not finish in 60 s")
            loads = [ChunkTransfer(key=t.key, block_ids=tuple(b + half for b in t.block_ids))
                     for t in stored]
            loads_s, waits_s, raws_s, stores = [], [], [], []
            for trial in range(config.trials + 1):  # the first is a warm-up
                progress(f"{n} chunks: trial {trial} of {config.trials}")
                store_timing = _timed_store(mover, store, raw, stored)
                raw_s = raw.time_s(n)
                for t in loads:
                    store.tiers[0].delete(t.key)  # every chunk comes from the disk
                start = time.perf_counter()
                loaded = mover.load(loads, spares)
                load_s = time.perf_counter() - start
                sample = mover.samples.pop()
                verified &= loaded == n and _same_halves(paged, n * per_chunk, half)
                if trial:
                    loads_s.append(load_s)
                    waits_s.append(sample.read_s)
                    raws_s.append(raw_s)
                    stores.append(store_timing)
            store_s, cpu_s, raw_write_s = (statistics.median(column) for column in zip(*stores))
            points.append(DiskLoadPoint(
                n, n * layout.bytes_per_chunk, statistics.median(loads_s),
                statistics.median(waits_s), statistics.median(raws_s),
                statistics.median(ld / rw for ld, rw in zip(loads_s, raws_s)),
                store_s, cpu_s, raw_write_s,
                statistics.median(st / rw for st, _, rw in stores)))
        disk = store.tiers[1]
        assert isinstance(disk, DiskTier)
        o_direct = disk.files.o_direct
    finally:
        store.close()
    return DiskLoadResult(config, layout.bytes_per_chunk, o_direct, tuple(points), verified)


def _timed_store(mover: CpuChunkMover, store: TieredStore, raw: _RawFiles,
                 like: list[ChunkTransfer]) -> tuple[float, float, float]:
    """(store, its CPU time, raw write), seconds: new chunks from the blocks of `like`."""
    from kvtier.core.keys import ChunkKey
    from kvtier.integrations.vllm.transfers import ChunkTransfer

    raw_write_s = raw.write_s(len(like))
    fresh = [ChunkTransfer(key=ChunkKey(os.urandom(16)), block_ids=t.block_ids) for t in like]
    cpu, start = time.process_time(), time.perf_counter()
    mover.store(fresh, "sync")
    if not store.flush(timeout_s=60):
        raise RuntimeError("the disk tier's write-behind did not finish in 60 s")
    store_s, cpu_s = time.perf_counter() - start, time.process_time() - cpu
    for t in fresh:
        for tier in store.tiers:
            tier.delete(t.key)
    return store_s, cpu_s, raw_write_s


def _same_halves(paged: PagedKV, blocks: int, half: int) -> bool:
    """The first `blocks` blocks equal the `blocks` blocks from `half` on, in every view."""
    return all(torch.equal(v.view(torch.uint8)[:blocks], v.view(torch.uint8)[half:half + blocks])
               for v in paged.block_views)


class _RawFiles:
    """O_DIRECT reads of chunk-sized files (one per chunk, as the disk tier stores them) into
    one page-aligned buffer, one thread: the ceiling; and writes of new ones."""

    def __init__(self, directory: Path, chunk_bytes: int, count: int) -> None:
        self._chunk = -(-chunk_bytes // 4096) * 4096
        self._buffer = aligned_buffer(self._chunk)
        self._directory = directory
        directory.mkdir(parents=True, exist_ok=True)
        self._paths = [directory / f"{i}.raw" for i in range(count)]
        noise = os.urandom(self._chunk)
        for path in self._paths:
            path.write_bytes(noise)

    def time_s(self, chunks: int) -> float:
        return direct_read_s(self._paths[:chunks], self._buffer)

    def write_s(self, chunks: int) -> float:
        """A raw write of `chunks` new files (deleted afterwards, untimed)."""
        paths = [self._directory / f"{i}.new" for i in range(chunks)]
        try:
            return direct_write_s(paths, self._buffer)
        finally:
            for path in paths:
                path.unlink(missing_ok=True)
