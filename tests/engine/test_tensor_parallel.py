"""kvtier at tensor parallel size 2 in a real vLLM (CPU backend), issue 11 item 4.

One engine, TP 2 (start ~60 s on 2 cores): a memory tier of 8 MiB over a disk tier of 16 MiB,
64-token chunks. Capacities are per engine, the total of its ranks (like vLLM's
`cpu_bytes_to_use`): each rank's store holds half of each, and stores its own shard of every
chunk (its KV head) under its own layout directory.

vLLM's CPU backend binds each worker's OpenMP threads to its own cores. Its automatic binding
wants one NUMA node per worker ("Not enough allowed NUMA nodes to bind threads of 2 local
CPUWorkers", vllm/utils/ompmultiprocessing.py), and a test machine has one: the workers are
bound explicitly with VLLM_CPU_OMP_THREADS_BIND (half of this process's cores each).

The reference for "identical outputs" is the miss path of this same engine (kvtier bypassed
with `skip_load`/`skip_store`, vLLM's own prefix cache emptied).
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import psutil
import pytest
from vllm_harness import (
    chunk_files,
    kvtier_counter,
    kvtier_transfer_config,
    metric,
    random_prompts,
    start_engine,
    token_ids,
)

from kvtier.testing.vllmshm import vllm_shm_maps

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

CHUNK = 64
MIB = 1024**2
MEMORY_BYTES, DISK_BYTES = 8 * MIB, 16 * MIB
BYPASS = {"skip_load": True, "skip_store": True}


def _worker_binding() -> str:
    """VLLM_CPU_OMP_THREADS_BIND for two workers: this process's cores, split in halves."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip(f"TP 2 on the CPU backend needs a core per worker; {len(cpus)} available")
    half = len(cpus) // 2
    return "|".join(",".join(map(str, part)) for part in (cpus[:half], cpus[half:]))


@pytest.fixture(scope="module")
def disk_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("kvtier-tp2-disk")


@pytest.fixture(scope="module")
def running(tiny_model_dir: Path, disk_dir: Path) -> Iterator[tuple[Any, ExitStack]]:
    """The engine, and the stack whose close shuts it down (the module's last test does,
    to see what it leaves; else the module's end)."""
    tiers = [{"kind": "memory", "capacity": MEMORY_BYTES},
             {"kind": "disk", "path": str(disk_dir), "capacity": DISK_BYTES}]
    with ExitStack() as stack:
        env = stack.enter_context(pytest.MonkeyPatch.context())
        env.setenv("VLLM_CPU_OMP_THREADS_BIND", _worker_binding())
        yield stack.enter_context(start_engine(
            tiny_model_dir, kvtier_transfer_config(tiers, CHUNK), tensor_parallel_size=2,
            processes=True)), stack


@pytest.fixture(scope="module")
def llm(running: tuple[Any, ExitStack]) -> Any:
    return running[0]


def _gauge(llm: Any, name: str, tier: str) -> float:
    """One of kvtier's gauges for `tier`, as the engine exports it (summed over TP ranks)."""
    return float(sum(m.value for m in llm.get_metrics()
                     if m.name == name and m.labels.get("tier") == tier))


def test_hits_at_tp_2_give_the_outputs_of_the_miss_path(llm: Any) -> None:
    """Both ranks store their shard of each chunk; after vLLM's own cache is emptied the
    prompts load every full chunk but the last token's from kvtier, with unchanged tokens."""
    prompts = random_prompts([300, 200], seed=21)
    miss = token_ids(llm, prompts, kv_transfer_params=BYPASS)
    llm.reset_prefix_cache()
    first = token_ids(llm, prompts)
    llm.reset_prefix_cache()
    loaded, external = kvtier_counter("loaded_tokens"), metric(
        llm, "vllm:external_prefix_cache_hits")
    second = token_ids(llm, prompts)
    loadable = sum((len(p["prompt_token_ids"]) - 1) // CHUNK * CHUNK for p in prompts)
    assert first == miss and second == miss
    # Counted once per engine, not once per rank.
    assert kvtier_counter("loaded_tokens") - loaded == loadable
    assert metric(llm, "vllm:external_prefix_cache_hits") - external == loadable


def test_each_rank_holds_half_of_the_engines_capacity(llm: Any, disk_dir: Path) -> None:
    """The engine exports its tiers' capacities summed over its ranks: the configured totals,
    not twice them; on disk each rank keeps its own shard of each chunk."""
    token_ids(llm, random_prompts([260], seed=22))
    memory = _gauge(llm, "vllm:kvtier_tier_capacity_bytes", "memory")
    assert MEMORY_BYTES - 2 * 64 * 1024 < memory <= MEMORY_BYTES  # each rank: whole slots
    assert _gauge(llm, "vllm:kvtier_tier_capacity_bytes", "disk") == DISK_BYTES
    assert _gauge(llm, "vllm:kvtier_tier_used_bytes", "disk") <= DISK_BYTES
    deadline = time.monotonic() + 30  # the disk tier is written behind
    while True:
        by_rank: dict[str, set[str]] = {}
        for path in chunk_files(disk_dir):
            by_rank.setdefault(path.relative_to(disk_dir).parts[0], set()).add(path.name)
        shards = list(by_rank.values())
        if (len(shards) == 2 and shards[0] == shards[1]) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert len(shards) == 2  # one layout directory per rank
    assert shards[0] == shards[1]  # the same chunks, one shard each


def test_the_engine_leaves_no_shared_memory_behind(running: tuple[Any, ExitStack]) -> None:
    """Its ranks' files for vLLM's CPU all-reduce (/dev/shm/vllm_dist_*, one a rank, which
    vLLM's shutdown leaves) are gone once the engine is shut down (the harness removes
    them: kvtier.testing.vllmshm). Last in the module: it shuts the engine down."""
    llm, stack = running
    token_ids(llm, random_prompts([130], seed=23))
    maps = vllm_shm_maps(p.pid for p in psutil.Process().children(recursive=True))
    files = set().union(*maps.values())  # the engine core's RPC queues (psm_*) too
    ranks = {pid: {path for path in paths if path.name.startswith("vllm_dist_")}
             for pid, paths in maps.items()}
    dist = set().union(*ranks.values())
    assert sum(1 for paths in ranks.values() if paths) == len(dist) == 2  # a file a rank
    assert all(path.exists() for path in files)
    stack.close()
    assert [path for path in files if path.exists()] == []
