"""`kvtier bench mover`: what the device mover's ordering protocol costs on the host, measured
without a GPU.

The same chunks are stored and loaded through the same paged KV (vLLM 0.33's LBNHC views,
bench/vllmviews.py) and the same store (one memory tier) by two movers: the CPU mover
(cpu.py: copies done inline, no ordering) and the device mover (streams.py) on the stand-in
device with no delay (bench/standin.py: each stream a thread, each event a flag), whose copies
are the same host copies but pass through the protocol: stream queues, events, waits, staging
buffers. The ratio device / CPU per chunk is the protocol's overhead on the host, the part of
a GPU load or store that is not the DMA. Stores, inline loads (the model runner's thread; the
forward is ordered after the copies) and load-thread loads (waited for) are timed each.

Host work a chunk (issue 47): the device mover is run twice on the stand-in, in batches (its
default) and a chunk at a time (`batch=1`, as it moved every chunk before batches), and for
each operation the calling thread's CPU time (`time.thread_time`: the mover's Python, the
store's reservations and loans, the device calls; not the stand-in's copies, which run on its
stream threads as a GPU's run on the GPU) and its calls of the device (`StandInDevice.calls`:
events, records, waits, runs, each a CUDA call on a GPU) and index uploads and index kernels
(`StreamChunkMover.index_counts`) are reported a chunk, batched against a chunk at a time.
Each chunk also takes one DMA call either way (not counted). The stand-in queues each piece
of work whole here (`split_work=False`, as it did before it split work as CUDA does): its
recording of tensor ops (Python, dearer than a CUDA launch) and its checks of host buffers
are the stand-in's costs, not a GPU's, and the figures stay comparable with the earlier ones.

Primitives: `MoverBenchConfig`, `MoverBenchResult`, `HostFigure`, `run_mover_bench`.
"""

from __future__ import annotations

import json
import statistics
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path

import torch

from kvtier.errors import ConfigError
from kvtier.integrations.vllm.worker.streams import STAGING_BYTES
from kvtier.tools.bench.headroom import MemoryNeed, require_memory
from kvtier.units import format_size


@dataclass(frozen=True, slots=True)
class MoverBenchConfig:
    """What to move."""

    chunks: int = 32  # chunks each way per trial
    layers: int = 8
    kv_heads: int = 8
    head_size: int = 128
    block_size: int = 16
    tokens_per_chunk: int = 64  # 4 blocks: 2 MiB chunks with the defaults
    trials: int = 5

    def validate(self) -> None:
        """Raises ConfigError naming the first bad field; NotEnoughMemory where the run's
        buffers (`memory_need`) do not fit in the memory available."""
        for name in ("chunks", "layers", "kv_heads", "head_size", "block_size",
                     "tokens_per_chunk", "trials"):
            if getattr(self, name) < 1:
                raise ConfigError(name, getattr(self, name), "a positive integer")
        if self.tokens_per_chunk % self.block_size:
            raise ConfigError("tokens_per_chunk", self.tokens_per_chunk,
                              f"a multiple of the block size {self.block_size}")
        require_memory(self.memory_need())

    def memory_need(self) -> MemoryNeed:
        """The paged KV (the chunks stored from, the chunks loaded into), the memory tier's
        slots, the loads' 8 spares (bf16), and the two stand-in device movers' staging
        (STAGING_BYTES a direction, at least two chunks)."""
        chunk = self.tokens_per_chunk * self.layers * 2 * self.kv_heads * self.head_size * 2
        staging = 2 * 2 * max(STAGING_BYTES, 2 * chunk)
        return MemoryNeed("--chunks", self.chunks, (3 * self.chunks + 10) * chunk + staging, 0,
                          f"{self.chunks} chunks of {format_size(chunk)}: --layers x "
                          "--tokens-per-chunk, 3 copies")


@dataclass(frozen=True, slots=True)
class MoverFigure:
    """One operation through one mover: seconds per chunk, the median of the trials."""

    operation: str  # "store", "inline load", "load-thread load"
    mover: str  # "cpu" or "stand-in device"
    seconds_per_chunk: float


@dataclass(frozen=True, slots=True)
class HostFigure:
    """One operation through a device mover on the stand-in: the host's work a chunk, the
    median of the trials (see the module docstring)."""

    operation: str
    mover: str  # BATCHED or PER_CHUNK
    host_s_per_chunk: float  # the calling thread's CPU time
    calls_per_chunk: dict[str, float]  # device calls by kind, "index uploads", "index kernels"

    @property
    def total_calls(self) -> float:
        return sum(self.calls_per_chunk.values())


@dataclass(frozen=True, slots=True)
class MoverBenchResult:
    config: MoverBenchConfig
    chunk_bytes: int
    figures: tuple[MoverFigure, ...]
    verified: bool  # every load put the stored bytes back
    host: tuple[HostFigure, ...] = ()

    def host_ratio(self, operation: str) -> float:
        """Batched / a chunk at a time: host CPU time a chunk for `operation`."""
        by = {(f.operation, f.mover): f.host_s_per_chunk for f in self.host}
        return by[(operation, BATCHED)] / by[(operation, PER_CHUNK)]

    def ratio(self, operation: str) -> float:
        """Device mover / CPU mover seconds per chunk for `operation`."""
        by = {(f.operation, f.mover): f.seconds_per_chunk for f in self.figures}
        return by[(operation, "stand-in device")] / by[(operation, "cpu")]

    def write_json(self, path: Path) -> None:
        data = asdict(self)
        data["ratios"] = {op: self.ratio(op) for op in OPERATIONS}
        data["host_ratios"] = {op: self.host_ratio(op) for op in OPERATIONS}
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(data, indent=2) + "\n")


OPERATIONS = ("store", "inline load", "load-thread load")
BATCHED, PER_CHUNK = "stand-in device", "stand-in device, a chunk at a time"


def run_mover_bench(config: MoverBenchConfig,
                    progress: Callable[[str], None] = lambda _text: None) -> MoverBenchResult:
    """Measure; see the module docstring.

    Raises:
        ConfigError: a bad setting.
    """
    from kvtier.core.keys import ChunkKey
    from kvtier.integrations.vllm.transfers import ChunkTransfer
    from kvtier.integrations.vllm.worker.cpu import CpuChunkMover, spare_buffers
    from kvtier.integrations.vllm.worker.mover import ChunkMover
    from kvtier.integrations.vllm.worker.paged import PagedKV
    from kvtier.integrations.vllm.worker.streams import StreamChunkMover
    from kvtier.testing.standin import StandInDevice
    from kvtier.testing.vllmviews import VllmCacheSpec, vllm_kv_caches
    from kvtier.tiers import open_store
    from kvtier.tiers.storeconfig import StoreConfig

    config.validate()
    bpc = config.tokens_per_chunk // config.block_size
    num_blocks = 2 * config.chunks * bpc + 1
    spec = VllmCacheSpec(config.block_size, config.kv_heads, config.head_size,
                         config.head_size, torch.bfloat16)
    kv = vllm_kv_caches(spec, config.layers, num_blocks, "LBNHC")
    paged = PagedKV(kv, config.block_size, content="halves", torch_ops=False)
    layout = paged.layout(config.tokens_per_chunk)
    slot = -(-layout.bytes_per_chunk // 4096) * 4096
    half = config.chunks * bpc
    stores = [ChunkTransfer(key=ChunkKey(i.to_bytes(16, "big")),
                            block_ids=tuple(range(i * bpc, (i + 1) * bpc)))
              for i in range(config.chunks)]
    loads = [ChunkTransfer(key=t.key, block_ids=tuple(b + half for b in t.block_ids))
             for t in stores]
    figures: list[MoverFigure] = []
    host: list[HostFigure] = []
    verified = True
    for name in ("cpu", PER_CHUNK, BATCHED):
        store = open_store(StoreConfig.parse({"tiers": [
            {"kind": "memory", "capacity": (config.chunks + 2) * slot, "pin": "off"}]}), layout)
        # Work queued whole: the stand-in's recording of tensor ops and its checks of host
        # buffers are not a GPU's host work.
        device = StandInDevice(max_delay_s=0.0, split_work=False) if name != "cpu" else None
        mover: ChunkMover = (
            CpuChunkMover(paged, store, layout.bytes_per_chunk, lambda _k, _s: None)
            if device is None else
            StreamChunkMover(paged, store, layout.bytes_per_chunk, lambda _k, _s: None,
                             device, batch=1 if name == PER_CHUNK else None))
        spares = spare_buffers(8, layout.bytes_per_chunk)
        timings: dict[str, list[float]] = {op: [] for op in OPERATIONS}
        cpu_s: dict[str, list[float]] = {op: [] for op in OPERATIONS}
        calls: dict[str, Counter[str]] = {op: Counter() for op in OPERATIONS}

        try:
            for trial in range(config.trials):
                progress(f"{name}: trial {trial + 1} of {config.trials}")
                for key in (t.key for t in stores):  # each trial stores them anew
                    store.tiers[0].delete(key)
                start = time.perf_counter()
                cpu_s["store"].append(_measured(device, mover, calls["store"], partial(
                    mover.store, stores, "sync")))
                timings["store"].append(time.perf_counter() - start)
                start = time.perf_counter()
                cpu = _measured(device, mover, calls["inline load"], partial(
                    mover.load, loads, spares, wait=False))
                if device is not None:
                    device.drain()
                cpu_s["inline load"].append(cpu + _measured(device, mover, calls["inline load"],
                                                            mover.release))
                timings["inline load"].append(time.perf_counter() - start)
                start = time.perf_counter()
                cpu_s["load-thread load"].append(_measured(
                    device, mover, calls["load-thread load"], partial(
                        mover.load, loads, spares, wait=True)))
                timings["load-thread load"].append(time.perf_counter() - start)
            verified &= all(torch.equal(v.view(torch.uint8)[:half],
                                        v.view(torch.uint8)[half:2 * half])
                            for v in paged.block_views)
        finally:
            mover.close()
            store.close()
            if device is not None:
                device.close()
        figures += [MoverFigure(op, name, statistics.median(timings[op]) / config.chunks)
                    for op in OPERATIONS]
        if device is not None:
            moved = config.chunks * config.trials
            host += [HostFigure(op, name, statistics.median(cpu_s[op]) / config.chunks,
                                {kind: n / moved for kind, n in sorted(calls[op].items())})
                     for op in OPERATIONS]
    return MoverBenchResult(config, layout.bytes_per_chunk, tuple(figures), verified,
                            tuple(host))


def _measured(device: object, mover: object, calls: Counter[str],
              work: Callable[[], object]) -> float:
    """Run `work`, add its calls to `calls`; the CPU seconds it took on this thread."""
    before, cpu = _calls(device, mover), time.thread_time()
    work()
    seconds = time.thread_time() - cpu
    calls.update(_calls(device, mover) - before)
    return seconds


def _calls(device: object, mover: object) -> Counter[str]:
    """The device's calls and the mover's index uploads and kernels so far."""
    counts = Counter(getattr(device, "calls", Counter()))
    counts.update(getattr(mover, "index_counts", Counter()))
    return counts

