"""Asynchronous stores in real vLLM (issue 13's test list): a step's stores are gathered on the
worker's store thread while the engine goes on (store_mode "auto", the default), and vLLM keeps
the blocks a gather may still read.

One engine whose store thread can be made slow (tests/engine/slow_stores.py: each gather waits
before it reads, as if the thread had lost its core), so that gathers are in flight while
requests end, are preempted or are aborted. What must hold: outputs equal the miss path's, the
KV stored meanwhile is right (a later hit of it gives the miss path's outputs too), the
engine's KV usage returns to where it was (no block leaked or held forever), and shutdown with
stores in flight finishes them (bounded) down to the disk tier.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from slow_stores import StoreFlag, slow_stores
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

pytestmark = [pytest.mark.vllm, pytest.mark.timing]  # a shutdown, timed

CHUNK = 64
MAX_TOKENS = 8
HITS = "vllm:external_prefix_cache_hits"
USAGE = "vllm:kv_cache_usage_perc"
NO_KVTIER = {"skip_load": True, "skip_store": True}


def config(disk: Path) -> dict[str, Any]:
    return kvtier_transfer_config([{"kind": "memory", "capacity": "32MiB"},
                                   {"kind": "disk", "path": str(disk), "capacity": "256MiB"}],
                                  CHUNK)


@pytest.fixture(scope="module")
def disk(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The module engine's disk tier."""
    return tmp_path_factory.mktemp("async-store-disk")


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory, disk: Path,
           engine_exit: contextlib.ExitStack) -> Iterator[tuple[Any, StoreFlag]]:
    with slow_stores(tmp_path_factory.mktemp("flag"), tmp_path_factory.mktemp("inject")) as flag:
        yield engine_exit.enter_context(start_engine(tiny_model_dir, config(disk))), flag
        engine_exit.close()  # the engine stops before the slow stores are undone


def reset(llm: Any, timeout_s: float = 10.0) -> None:
    """vLLM's prefix cache emptied. A request whose last step stored chunks is held one more
    engine step (its blocks are in use until then): the reset waits for that step."""
    deadline = time.monotonic() + timeout_s
    while not llm.reset_prefix_cache():
        assert time.monotonic() < deadline, "blocks still in use"
        time.sleep(0.05)


def clean_outputs(llm: Any, prompts: list[dict[str, list[int]]],
                  max_tokens: int = MAX_TOKENS) -> list[list[int]]:
    """The miss path's outputs (kvtier off for these requests), one prompt at a time."""
    outs = []
    for prompt in prompts:
        reset(llm)
        outs += token_ids(llm, [prompt], max_tokens, NO_KVTIER)
    return outs


def settled_usage(llm: Any, probe: dict[str, list[int]]) -> float:
    """The engine's KV usage once a small request without kvtier has run to its end."""
    token_ids(llm, [probe], 2, NO_KVTIER)
    return metric(llm, USAGE)


def hits_alone(llm: Any, prompts: list[dict[str, list[int]]],
               max_tokens: int = MAX_TOKENS) -> list[list[int]]:
    """Each prompt alone with vLLM's cache empty: served by kvtier's stored chunks."""
    outs = []
    for prompt in prompts:
        reset(llm)
        hits = metric(llm, HITS)
        outs += token_ids(llm, [prompt], max_tokens)
        assert metric(llm, HITS) > hits
    return outs


def test_requests_that_store_in_their_last_step_are_held_one_step(
        engine: tuple[Any, StoreFlag]) -> None:
    llm, flag = engine
    prompts = random_prompts([300, 500, 200], seed=140)
    probe = random_prompts([40], seed=141)[0]
    clean = clean_outputs(llm, prompts, 1)
    before = settled_usage(llm, probe)
    held = kvtier_counter("held_requests")
    flag.on(0.05)  # each gather in flight a while
    try:
        reset(llm)
        # One token each: a request ends in the step that stores its prompt's chunks.
        assert token_ids(llm, prompts, 1) == clean
    finally:
        flag.off()
    assert kvtier_counter("held_requests") - held == len(prompts)
    assert settled_usage(llm, probe) == before  # freed one step later
    assert hits_alone(llm, prompts, 1) == clean


def test_preemption_with_stores_in_flight(engine: tuple[Any, StoreFlag]) -> None:
    llm, flag = engine
    # Four prompts of 960 tokens and 160 generated each: 4,480 tokens > the 4,096 of the
    # engine's KV cache, so vLLM preempts some while the others' and their own stores run.
    prompts = random_prompts([960] * 4, seed=142)
    clean = clean_outputs(llm, prompts, 160)
    preemptions = metric(llm, "vllm:num_preemptions")
    stored = kvtier_counter("stored_tokens")
    flag.on(0.02)
    try:
        reset(llm)
        assert token_ids(llm, prompts, 160) == clean
    finally:
        flag.off()
    assert metric(llm, "vllm:num_preemptions") > preemptions
    assert kvtier_counter("stored_tokens") > stored
    # What was stored around the preemptions is the right KV: hits give the same outputs.
    assert hits_alone(llm, prompts, 160) == clean


def test_a_request_aborted_while_its_stores_are_in_flight(
        engine: tuple[Any, StoreFlag]) -> None:
    llm, flag = engine
    aborted, other, probe = random_prompts([700, 400, 40], seed=143)
    [clean_other] = clean_outputs(llm, [other])
    before = settled_usage(llm, probe)
    reset(llm)
    flag.on(0.3)  # its prefill's ten chunks take 3 s to gather
    try:
        engine_api = llm.llm_engine
        engine_api.add_request("abort-me", aborted, greedy(64))
        flag.wait_for_a_slow_gather()  # its prefill ran; its gathers are in flight
        engine_api.abort_request(["abort-me"])
        # Another request right away: its outputs are intact.
        assert token_ids(llm, [other], MAX_TOKENS, NO_KVTIER) == [clean_other]
    finally:
        flag.off()
    assert settled_usage(llm, probe) == before  # no block leaked


def test_shutdown_with_stores_in_flight(engine: tuple[Any, StoreFlag], disk: Path,
                                        engine_exit: contextlib.ExitStack) -> None:
    """The module's engine, shut down here: this test is the module's last. Its prompt's ten
    chunks are new on the disk: the files the earlier tests left are counted out."""
    llm, flag = engine
    [prompt] = random_prompts([640], seed=144)  # ten chunks
    settle([disk])
    before = set(chunk_files(disk))
    flag.on(0.2)  # two seconds of gathers
    llm.llm_engine.add_request("in-flight", prompt, greedy(200))
    flag.wait_for_a_slow_gather()  # prefilled: its stores in flight
    start = time.monotonic()
    engine_exit.close()
    shutdown_s = time.monotonic() - start
    settle([disk])
    written = set(chunk_files(disk)) - before
    print(f"\nengine shutdown with 2 s of gathers in flight: {shutdown_s:.2f} s, "
          f"{len(written)} chunks on disk")
    assert shutdown_s < 20.0
    assert len(written) == 10  # finished and written down before the exit
