"""The device mover in batches (issue 47) on a real GPU, and a kvtier node's shared-memory RAM
slab registered for DMA.

Batches: test_cuda_copy.py's bodies, run with 12 chunks of staging in batches of 4 (one index
upload, one gather or scatter, one event per copy stream a batch): every vLLM 0.33 cache
(gpurig.CASES: layouts, MLA, kernel blocks, fp8) stored and loaded back bit-exact, inline, on
a load thread and from disk with a local prefix hit; a miss stops a load; the ordering
scenarios and, on a device that loses the waits, their controls; batches from two threads at
once. Each runs on "cuda" (skipped without a GPU) and on "standin", as test_cuda_copy.py's.

The node's slab: an engine maps its node's RAM tier (a memory tier with `shared_memory`, a
file in /dev/shm) and copies chunks between it and the GPU. Pageable, each copy is staged by
the driver; registered (`cudaHostRegister`) it is DMA'd like pinned memory. The test
registers such a slab's mapping and times 2 MiB chunk copies both ways against a pinned
in-process slab (the figures printed; scripts/gpu-check.sh keeps them). CUDA only.
"""

from __future__ import annotations

import mmap
import os
import statistics
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from gpurig import CASE_IDS, CASES, NEEDS_CUDA, Backend, Case
from test_cuda_copy import PLAIN, SCENARIOS, LosesWaits, Rig
from test_cuda_copy import test_a_miss_stops_the_load_and_writes_nothing_of_it as miss_body
from test_cuda_copy import test_chunks_stored_from_the_device_load_back_bit_exact as bytes_body
from test_cuda_copy import test_many_chunks_through_two_staging_buffers as threads_body

from kvtier.core.layout import KVLayout
from kvtier.tiers import open_store
from kvtier.tiers.storeconfig import StoreConfig

STAGING, BATCH = 12, 4  # 3 staging buffers of 4 chunks a direction


@pytest.fixture
def batched_factory(tmp_path: Path, backend: Backend) -> Iterator[Callable[..., Rig]]:
    """Makes rigs whose mover moves chunks in batches (closed before the backend is)."""
    rigs: list[Rig] = []

    def make(case: Case = PLAIN, ram_chunks: int = 32) -> Rig:
        rigs.append(Rig(backend, case, tmp_path, ram_chunks, staging=STAGING, batch=BATCH))
        return rigs[-1]

    yield make
    for rig in rigs:
        rig.close()


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_batches_store_and_load_back_bit_exact(backend: Backend, case: Case,
                                               batched_factory: Any) -> None:
    bytes_body(backend, case, batched_factory)


def test_a_miss_in_a_batch_stops_the_load(backend: Backend, batched_factory: Any) -> None:
    miss_body(backend, batched_factory)


@pytest.mark.parametrize("name", SCENARIOS)
def test_batches_are_ordered_after_vllms_work_and_vllm_after_them(
        backend: Backend, batched_factory: Any, name: str) -> None:
    assert SCENARIOS[name][0](batched_factory()) == []


@pytest.mark.parametrize("name", SCENARIOS)
def test_without_the_wait_a_batched_scenario_reads_the_wrong_bytes(
        backend: Backend, batched_factory: Any, name: str) -> None:
    scenario, on_compute = SCENARIOS[name]
    backend.device = LosesWaits(backend.device, on_compute)
    assert scenario(batched_factory()) != []


def test_batches_from_two_threads_at_once(backend: Backend, batched_factory: Any) -> None:
    threads_body(backend, batched_factory)


# -- the node's slab, registered for DMA -----------------------------------------------------
CHUNK_MIB, CHUNKS = 2, 64  # 128 MiB each way


def _gbps(copy: Callable[[], None], nbytes: int) -> float:
    """GB/s of `copy` (queued on the current stream), the median of 3 timed runs."""
    copy()
    torch.cuda.synchronize()
    runs = []
    for _ in range(3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        copy()
        end.record()
        end.synchronize()
        runs.append(nbytes / (start.elapsed_time(end) / 1e3) / 1e9)
    return statistics.median(runs)


def _chunk_copies(host: torch.Tensor, device: torch.Tensor) -> dict[str, float]:
    """GB/s of 2 MiB chunk copies host -> device ("load") and device -> host ("store")."""
    size = CHUNK_MIB << 20

    def load() -> None:
        for i in range(CHUNKS):
            device[i * size:(i + 1) * size].copy_(host[i * size:(i + 1) * size],
                                                  non_blocking=True)

    def store() -> None:
        for i in range(CHUNKS):
            host[i * size:(i + 1) * size].copy_(device[i * size:(i + 1) * size],
                                                non_blocking=True)

    return {"load": _gbps(load, CHUNKS * size), "store": _gbps(store, CHUNKS * size)}


@pytest.mark.gpu
@NEEDS_CUDA
def test_a_node_slab_registered_for_dma_copies_at_pinned_speed() -> None:
    name = f"kvtier-gpu-test-{os.getpid()}"
    chunk_bytes = CHUNK_MIB << 20
    # A node's RAM tier of 2 MiB chunks (1 layer, 512 tokens of 1 bf16 head of 1024 K and V).
    layout = KVLayout(num_layers=1, num_kv_heads=1, head_size=1024, dtype="bfloat16",
                      tokens_per_chunk=512)
    assert layout.bytes_per_chunk == chunk_bytes
    store = open_store(StoreConfig.parse({"tiers": [
        {"kind": "memory", "capacity": CHUNKS * chunk_bytes, "shared_memory": name}]}), layout)
    tier: Any = store.tiers[0]
    cudart = torch.cuda.cudart()
    try:
        assert tier.shared_memory_path is not None
        fd = os.open(tier.shared_memory_path, os.O_RDWR)  # as an engine maps it
        try:
            mapping = mmap.mmap(fd, CHUNKS * chunk_bytes, mmap.MAP_SHARED)
        finally:
            os.close(fd)
        slab = torch.frombuffer(mapping, dtype=torch.uint8)
        device = torch.empty(CHUNKS * chunk_bytes, dtype=torch.uint8, device="cuda")
        pageable = _chunk_copies(slab, device)
        ptr, nbytes = slab.data_ptr(), slab.numel()
        assert int(cudart.cudaHostRegister(ptr, nbytes, 0)) == 0  # cudaHostRegisterDefault
        try:
            assert slab.is_pinned()
            registered = _chunk_copies(slab, device)
            slab[:4096].fill_(7)
            device[:4096].zero_()
            device[:4096].copy_(slab[:4096], non_blocking=True)
            torch.cuda.synchronize()
            assert bool(torch.all(device[:4096] == 7))  # the same bytes the node holds
        finally:
            assert int(cudart.cudaHostUnregister(ptr)) == 0
        pinned = _chunk_copies(torch.empty(CHUNKS * chunk_bytes, dtype=torch.uint8,
                                           pin_memory=True), device)
        del slab
        mapping.close()
    finally:
        store.close()
    print(f"\nnode slab, {CHUNK_MIB} MiB chunks, GB/s: "
          + "; ".join(f"{op}: registered {registered[op]:.1f}, pinned in-process "
                      f"{pinned[op]:.1f} ({registered[op] / pinned[op]:.2f}x), pageable "
                      f"{pageable[op]:.1f}" for op in ("load", "store")))
    for op in ("load", "store"):
        assert registered[op] >= 0.8 * pinned[op], (op, registered, pinned)
