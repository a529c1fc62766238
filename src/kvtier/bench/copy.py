"""`kvtier bench copy`: the connector worker's copy path against a raw copy of the same bytes.

A vLLM-shaped paged KV tensor (default Llama-3-8B: 32 layers, 8 KV heads, head 128, bf16,
block size 16; vLLM 0.33's LBNHC views on CUDA, the CPU backend's layout on CPU, every layer a
slice of one allocation as vLLM allocates it) holds `blocks` scattered blocks of real data.
Through kvtier's own worker code (`ConnectorWorker` + `TieredStore` with one memory tier,
pinned when CUDA is present) the blocks are stored (gather + put: device -> host) and loaded
back into other scattered blocks (borrow + scatter: host -> device), then checked byte for
byte. The ceiling is a raw copy of the same bytes between one contiguous buffer and another
(on CUDA: device <-> pinned host, `copy_(non_blocking=True)`; on CPU: a single-threaded numpy
memcpy between two host buffers). A ratio is kvtier's GB/s over the ceiling's, per trial, then
the median.

The steps are also timed one by one on CPU (`steps`): the vectorized gather and scatter,
the store's put and get_into memcpys, and the earlier per-layer, per-block loop, so a change
in one step shows where it came from.

Primitives: `CopyBenchConfig`, `CopyBenchResult`, `run_copy_bench`, `TARGET_RATIO`.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvtier.config import StoreConfig
from kvtier.core.keys import ChunkKey
from kvtier.errors import ConfigError
from kvtier.integrations.vllm.config import TOKENS_PER_CHUNK

TARGET_RATIO = 0.8  # issue 3, "GPU": kvtier's copy path >= 0.8x a raw pinned copy
GB = 1e9


@dataclass(frozen=True, slots=True)
class CopyBenchConfig:
    """What one `kvtier bench copy` run measures. Validated by `validate`."""

    device: str = "auto"  # "cuda", "cpu", or "auto" (cuda when available)
    layers: int = 32  # Llama-3-8B
    kv_heads: int = 8
    head_size: int = 128
    dtype: str = "bfloat16"
    block_size: int = 16  # vLLM's block size in tokens
    tokens_per_chunk: int = TOKENS_PER_CHUNK  # kvtier chunk (16 blocks: 32 MiB, Llama-3-8B)
    blocks: int = 512  # scattered blocks moved each way (1 GiB for Llama-3-8B)
    trials: int = 5  # timed trials after one warm-up; figures are medians
    threads: int | None = None  # torch CPU threads (None: torch's default)

    def validate(self) -> None:
        """Raises ConfigError naming the first bad field."""
        for name in ("layers", "kv_heads", "head_size", "block_size", "tokens_per_chunk",
                     "blocks", "trials"):
            if getattr(self, name) < 1:
                raise ConfigError(name, getattr(self, name), "a positive integer")
        if self.tokens_per_chunk % self.block_size:
            raise ConfigError("tokens_per_chunk", self.tokens_per_chunk,
                              f"a multiple of block_size ({self.block_size})")
        if self.blocks % (self.tokens_per_chunk // self.block_size):
            raise ConfigError("blocks", self.blocks, "a whole number of chunks "
                              f"({self.tokens_per_chunk // self.block_size} blocks each)")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ConfigError("device", self.device, "auto, cpu or cuda")
        if self.device == "cuda" and not torch.cuda.is_available():
            raise ConfigError("device", self.device, "cpu (torch sees no CUDA device)")

    def resolved_device(self) -> str:
        if self.device == "auto":
            return "cuda" if torch.cuda.is_available() else "cpu"
        return self.device

    @property
    def blocks_per_chunk(self) -> int:
        return self.tokens_per_chunk // self.block_size


@dataclass(frozen=True, slots=True)
class Figure:
    """One thing timed: seconds of each trial and the bytes each trial moved."""

    name: str  # "store", "load", "raw d2h", "step: gather", ...
    bytes_moved: int
    trials_s: tuple[float, ...]

    @property
    def gbps(self) -> float:
        return self.bytes_moved / statistics.median(self.trials_s) / GB


@dataclass(frozen=True, slots=True)
class CopyBenchResult:
    """Everything one run measured."""

    config: CopyBenchConfig
    device: str  # "cuda:0 (NVIDIA H100 ...)" or "cpu"
    kv_layout: str  # vLLM's layout: "LBNHC" (CUDA, vLLM 0.33) or "cpu"
    single_allocation: bool  # whether PagedKV moved all layers in one op
    figures: tuple[Figure, ...]
    ratios: dict[str, float]  # "store" / "load" -> median per-trial ratio to the raw copy
    verified: bool  # loaded blocks equal the stored blocks, byte for byte
    machine: dict[str, Any] = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        return self.verified and all(r >= TARGET_RATIO for r in self.ratios.values())

    def write_json(self, path: Path) -> None:
        data = asdict(self)
        data["figures"] = [dict(asdict(f), gbps=f.gbps) for f in self.figures]
        data["passed"] = self.passed
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


def _kv_layout(device: torch.device) -> str:
    """vLLM's KV layout on `device`: FlashAttention's LBNHC (vLLM 0.33) on CUDA, the CPU
    backend's own on CPU."""
    return "LBNHC" if device.type == "cuda" else "cpu"


def _paged_kv(config: CopyBenchConfig, device: torch.device) -> dict[str, torch.Tensor]:
    """vLLM-shaped layers, all slices of one allocation: vLLM 0.33's views (vllmviews.py) on
    CUDA, the CPU backend's layout on CPU."""
    dtype = getattr(torch, config.dtype)
    num_blocks = 2 * config.blocks + 1
    h, bs, d = config.kv_heads, config.block_size, config.head_size
    if device.type == "cuda":
        from kvtier.bench.vllmviews import VllmCacheSpec, vllm_kv_caches

        return vllm_kv_caches(VllmCacheSpec(bs, h, d, d, dtype), config.layers, num_blocks,
                              _kv_layout(device), device=device)
    shape = (num_blocks, h, bs, 2 * d)
    base = torch.empty((config.layers, *shape), dtype=dtype, device=device)
    base.view(torch.uint8).random_(0, 256, generator=None)  # any bytes: copies do not care
    return {f"model.layers.{i}.self_attn.attn": base[i] for i in range(config.layers)}


def run_copy_bench(config: CopyBenchConfig,
                   progress: Callable[[str], None] = lambda _text: None) -> CopyBenchResult:
    """Measure; see the module docstring. Needs vllm installed (the connector's modules).

    Raises:
        ConfigError: a bad setting.
    """
    from kvtier.integrations.vllm.messages import ChunkTransfer, KVTierMetadata
    from kvtier.integrations.vllm.worker import ConnectorWorker, PagedKV

    config.validate()
    if config.threads is not None:
        torch.set_num_threads(config.threads)
    device = torch.device(config.resolved_device())
    sync = _Sync(device)
    paged = PagedKV(_paged_kv(config, device), config.block_size)
    layout = paged.layout(config.tokens_per_chunk)
    chunks = config.blocks // config.blocks_per_chunk
    from kvtier.tiers import open_store

    slot_bytes = -(-layout.bytes_per_chunk // 4096) * 4096
    store = open_store(StoreConfig.parse(
        {"tiers": [{"kind": "memory", "capacity": chunks * slot_bytes, "pin": "auto"}]}), layout)
    worker = ConnectorWorker(paged, layout, store)
    # Scattered blocks: even ids are stored, odd ids are loaded into, in a shuffled order.
    order = torch.randperm(config.blocks, generator=torch.Generator().manual_seed(0)).tolist()
    src_blocks = [2 * i for i in order]
    dst_blocks = [2 * i + 1 for i in order]
    per = config.blocks_per_chunk
    keys = [ChunkKey(b"bench-copy" + i.to_bytes(6, "big")) for i in range(chunks)]
    stores = [ChunkTransfer(k, tuple(src_blocks[i * per:(i + 1) * per]))
              for i, k in enumerate(keys)]
    loads = [ChunkTransfer(k, tuple(dst_blocks[i * per:(i + 1) * per]))
             for i, k in enumerate(keys)]
    total = chunks * layout.bytes_per_chunk

    def store_all() -> None:
        for k in keys:  # a fresh put each trial, not "already held"
            store.tiers[0].delete(k)
        worker.store(KVTierMetadata(stores=stores))
        pending = set(keys)
        while pending:  # CUDA stores complete on a side thread
            report = worker.take_report()
            if report is not None:
                pending -= report.stored
            elif pending:
                time.sleep(0.0002)

    def load_all() -> None:
        worker.load(KVTierMetadata(loads={"bench": loads}))
        if worker.take_failed_block_ids():
            raise RuntimeError("a chunk stored by this bench was not found")

    raw_src = torch.empty(total, dtype=torch.uint8, device=device)
    raw_host = torch.empty(total, dtype=torch.uint8, pin_memory=device.type == "cuda")
    raw_out, raw_in = _raw_copies(raw_src, raw_host)
    figures: dict[str, list[float]] = {n: [] for n in ("store", "load", "raw out", "raw in")}
    ratios: dict[str, list[float]] = {"store": [], "load": []}
    for trial in range(config.trials + 1):  # trial 0 warms up (page faults, allocator)
        progress(f"trial {trial}/{config.trials}")
        t = {"store": _timed(store_all, sync),
             "raw out": _timed(raw_out, sync),
             "load": _timed(load_all, sync),
             "raw in": _timed(raw_in, sync)}
        if trial:
            for name, seconds in t.items():
                figures[name].append(seconds)
            ratios["store"].append(t["raw out"] / t["store"])
            ratios["load"].append(t["raw in"] / t["load"])
    sync()
    verified = _verify(paged, src_blocks, dst_blocks)
    steps = _steps(paged, layout.bytes_per_chunk, stores, store, config.trials) \
        if device.type == "cpu" else []
    worker.close()
    name = str(device) if device.type == "cpu" else \
        f"{device} ({torch.cuda.get_device_name(device)})"
    return CopyBenchResult(
        config=config, device=name, kv_layout=_kv_layout(device),
        single_allocation=paged.single_allocation,
        figures=tuple(Figure(n, total, tuple(s)) for n, s in figures.items()) + tuple(steps),
        ratios={k: statistics.median(v) for k, v in ratios.items()}, verified=verified,
        machine={"cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(),
                 "loadavg": os.getloadavg(), "torch": torch.__version__})


def _raw_copies(device_buf: torch.Tensor,
                host_buf: torch.Tensor) -> tuple[Callable[[], object], Callable[[], object]]:
    """The ceilings: one contiguous copy each way. On CUDA an async copy to and from pinned
    memory; on CPU a single-threaded numpy memcpy (torch's CPU copy_ runs on OpenMP threads,
    which lose time to spin-waits on a busy machine: the fastest raw copy is the ceiling)."""
    if device_buf.device.type == "cuda":
        return (lambda: host_buf.copy_(device_buf, non_blocking=True),
                lambda: device_buf.copy_(host_buf, non_blocking=True))
    a, b = device_buf.numpy(), host_buf.numpy()
    return lambda: np.copyto(b, a), lambda: np.copyto(a, b)


def _verify(paged: Any, src_blocks: list[int], dst_blocks: list[int]) -> bool:
    src = torch.tensor(src_blocks, device=paged.device)
    dst = torch.tensor(dst_blocks, device=paged.device)
    # Block-major views (any vLLM layout); bytes: random bytes include NaN, and NaN != NaN.
    return all(torch.equal(v.view(torch.uint8).index_select(0, src),
                           v.view(torch.uint8).index_select(0, dst)) for v in paged.block_views)


def _steps(paged: Any, chunk_bytes: int, stores: list[Any], store: Any,
           trials: int) -> list[Figure]:
    """CPU only: each step of the data path on its own, over the same chunks."""
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
