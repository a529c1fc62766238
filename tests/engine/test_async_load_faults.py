"""Asynchronous loads that go wrong, in real vLLM (issue 13's test list): a load slower than
its deadline, a request aborted while its load is in flight, preemption under a small KV
cache, and an engine shut down with a load in flight.

The disk tier's chunk reads are made slow inside vLLM's processes (tests/engine/slow_files.py:
reads only, so lookups and the write-behind run at full speed). The RAM tier holds two
chunks, so hits come from the disk, and `load_mode` "async" loads every hit on the worker's
load thread while the request waits in WAITING_FOR_REMOTE_KVS.

What must hold: outputs equal the miss path's; a late load is abandoned and recomputed within
its deadline; an aborted request's blocks are not handed to another request while its load
may still write them, and are freed once it ends (the engine's KV usage returns to where it
was); shutdown does not wait on a stuck read.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from slow_files import SlowFlag, slow_files
from vllm_harness import (
    chunk_files,
    greedy,
    kvtier_counter,
    kvtier_transfer_config,
    metric,
    random_prompts,
    settle,
    start_engine,
    token_ids,
)

pytestmark = [pytest.mark.vllm, pytest.mark.timing]  # a read deadline and a shutdown, timed

CHUNK = 64
MAX_TOKENS = 8
TIMEOUT_S = 1.5  # the engine's read deadline
USAGE = "vllm:kv_cache_usage_perc"
IDLE_DEADLINE_S = 120.0  # a failed load's request, alone: it ends long before (~1 s)


def config(disk: Path) -> dict[str, Any]:
    transfer = kvtier_transfer_config([{"kind": "memory", "capacity": "64KiB"},  # two chunks
                                       {"kind": "disk", "path": str(disk), "capacity": "256MiB"}],
                                      CHUNK)
    # load_when "always": the fault path under test loads every hit, however the last loads
    # went (the rule that stops loading from a slow tier: test_load_or_recompute.py).
    transfer["kv_connector_extra_config"].update(load_mode="async", read_timeout_s=TIMEOUT_S,
                                                 load_when="always")
    return transfer


@pytest.fixture(scope="module")
def disk(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("slow-disk")


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory,
           engine_exit: contextlib.ExitStack, disk: Path) -> Iterator[tuple[Any, SlowFlag]]:
    with slow_files(disk, tmp_path_factory.mktemp("inject"), reads_only=True) as flag:
        yield engine_exit.enter_context(start_engine(tiny_model_dir, config(disk))), flag
        engine_exit.close()  # the engine stops before the slow reads are undone


def stored_clean(llm: Any, prompts: list[dict[str, list[int]]], max_tokens: int = MAX_TOKENS,
                 ) -> list[list[int]]:
    """The miss path's outputs, one prompt at a time (each stores its chunks behind)."""
    outs = []
    for prompt in prompts:
        assert llm.reset_prefix_cache()
        outs += token_ids(llm, [prompt], max_tokens)
    time.sleep(0.5)  # the write-behind reaches the disk
    assert llm.reset_prefix_cache()
    return outs


def settled_usage(llm: Any, probe: dict[str, list[int]]) -> float:
    """The engine's KV usage once a small request has run to its end (the gauge is updated
    with each step; the last step of the request frees its blocks before reporting)."""
    token_ids(llm, [probe], 2, {"skip_load": True, "skip_store": True})
    return metric(llm, USAGE)


def test_a_load_slower_than_its_deadline_is_recomputed(engine: tuple[Any, SlowFlag]) -> None:
    llm, flag = engine
    [prompt] = random_prompts([400], seed=131)
    [clean] = stored_clean(llm, [prompt])
    failures = kvtier_counter("load_failures")
    flag.on(4 * TIMEOUT_S)
    try:
        start = time.monotonic()
        assert token_ids(llm, [prompt], MAX_TOKENS) == [clean]
        took_s = time.monotonic() - start
    finally:
        flag.off()
    assert kvtier_counter("load_failures") > failures
    print(f"\nasync load with reads {4 * TIMEOUT_S:g} s slow, deadline {TIMEOUT_S:g} s: "
          f"the request took {took_s:.2f} s")
    assert took_s < TIMEOUT_S + 4.0  # the deadline, then a recompute (not the slow read)
    time.sleep(4 * TIMEOUT_S)  # the abandoned reads return; the tier answers again
    assert llm.reset_prefix_cache()
    loaded = kvtier_counter("loaded_tokens")
    assert token_ids(llm, [prompt], MAX_TOKENS) == [clean]
    assert kvtier_counter("loaded_tokens") > loaded  # loaded again, once the tier answers


def test_a_request_aborted_while_its_load_is_in_flight(engine: tuple[Any, SlowFlag]) -> None:
    llm, flag = engine
    aborted, other, probe = random_prompts([450, 400, 40], seed=132)
    clean_aborted, clean_other = stored_clean(llm, [aborted, other])
    [clean_other_alone] = token_ids(llm, [other], MAX_TOKENS, {"skip_load": True})
    assert clean_other_alone == clean_other
    before = settled_usage(llm, probe)
    assert llm.reset_prefix_cache()

    flag.on(TIMEOUT_S / 2)  # slow, within the deadline: the load succeeds, late
    loaded, failures = kvtier_counter("loaded_tokens"), kvtier_counter("load_failures")
    try:
        engine_api = llm.llm_engine
        engine_api.add_request("abort-me", aborted, greedy(MAX_TOKENS))
        time.sleep(0.2)  # scheduled: waiting for its KV, the read in flight
        engine_api.abort_request(["abort-me"])
        # Another request right away (its prefix recomputed: no load of its own): it must
        # not get the aborted request's blocks while the late load may still write them.
        assert token_ids(llm, [other], MAX_TOKENS, {"skip_load": True}) == [clean_other]
    finally:
        flag.off()
    time.sleep(TIMEOUT_S)  # the late load ends; vLLM frees the blocks it held
    assert settled_usage(llm, probe) == before  # no block leaked
    # The aborted request's load did run to its end, late, and succeeded.
    assert kvtier_counter("loaded_tokens") > loaded
    assert kvtier_counter("load_failures") == failures
    assert llm.reset_prefix_cache()
    assert token_ids(llm, [aborted], MAX_TOKENS) == [clean_aborted]


def test_preemption_with_async_loads(engine: tuple[Any, SlowFlag]) -> None:
    llm, _ = engine
    # Four prompts of 960 tokens and 160 generated each: 4,480 tokens > the 4,096 of the
    # engine's KV cache, so vLLM preempts some while others (and their loads) run.
    prompts = random_prompts([960] * 4, seed=133)
    stored_clean(llm, prompts, max_tokens=160)
    # The miss path under the same batch and preemptions (no kvtier load, no store): on this
    # machine's kernels a batch with preemptions differs from one prompt at a time at late
    # tokens (near-ties of the random weights), with or without kvtier.
    batch_miss = token_ids(llm, prompts, 160, {"skip_load": True, "skip_store": True})
    assert llm.reset_prefix_cache()
    preemptions = metric(llm, "vllm:num_preemptions")
    loaded = kvtier_counter("loaded_tokens")
    assert token_ids(llm, prompts, 160) == batch_miss
    assert metric(llm, "vllm:num_preemptions") > preemptions
    assert kvtier_counter("loaded_tokens") > loaded


def test_a_failed_load_on_an_idle_engine_is_recomputed_at_once(
        engine: tuple[Any, SlowFlag], disk: Path) -> None:
    """local-inference-lab/vllm#191: a request rescheduled after a failed KV load sat in
    WAITING on an otherwise idle engine until the next request arrived (minutes). Here one
    request, alone, loads a hit whose chunk files were deleted between its lookup's index and
    its load (a peer's eviction, `kvtier gc`): the load fails on the load thread, kvtier reports
    the request's load ended with its blocks failed, and vLLM recomputes it at once. No other
    request is sent; the deadline is generous (a hang is what it catches, not a slow step)."""
    llm, _ = engine
    [prompt] = random_prompts([400], seed=135)
    before = {f.name for f in chunk_files(disk)}
    [clean] = stored_clean(llm, [prompt])
    settle([disk])
    deleted = [f for f in chunk_files(disk) if f.name not in before]
    assert len(deleted) == 6  # the prompt's 6 chunks (the RAM tier keeps only the last 2)
    for path in deleted:
        path.unlink()
    failures = kvtier_counter("load_failures")
    outputs: list[list[list[int]]] = []
    alone = threading.Thread(target=lambda: outputs.append(token_ids(llm, [prompt], MAX_TOKENS)),
                             daemon=True)
    alone.start()
    alone.join(timeout=IDLE_DEADLINE_S)
    assert not alone.is_alive(), f"the request did not end within {IDLE_DEADLINE_S} s"
    assert outputs == [[clean]]
    assert kvtier_counter("load_failures") > failures


def test_shutdown_with_a_load_in_flight(engine: tuple[Any, SlowFlag],
                                        engine_exit: contextlib.ExitStack) -> None:
    """The module's engine, shut down here: this test is the module's last."""
    llm, flag = engine
    [prompt] = random_prompts([400], seed=134)
    stored_clean(llm, [prompt])
    flag.on(60.0)  # a read that never returns within the test
    llm.llm_engine.add_request("in-flight", prompt, greedy(MAX_TOKENS))
    time.sleep(0.5)
    start = time.monotonic()
    engine_exit.close()
    shutdown_s = time.monotonic() - start
    print(f"\nengine shutdown with a load stuck in a read: {shutdown_s:.2f} s")
    assert shutdown_s < 20.0
