"""Asynchronous loads from every tier below RAM in real vLLM (issue 13: "hits from each tier"):
a shared directory and Redis, with the miss path's outputs (tests/engine/test_async_loads.py
covers the disk tier).

One engine with load_mode "async": a RAM tier of two chunks in front of a shared directory and
a real redis-server on 127.0.0.1, so that hits come from below RAM; the shared directory's
chunks are then deleted, so that the same prompts load from Redis.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from redis_server import RedisServer
from vllm_harness import (
    chunk_files,
    kvtier_counter,
    kvtier_transfer_config,
    random_prompts,
    settle,
    start_engine,
    token_ids,
)

pytestmark = [pytest.mark.vllm, pytest.mark.redis]

CHUNK = 64
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory,
           redis_session: RedisServer) -> Iterator[tuple[Any, Path, RedisServer]]:
    shared = tmp_path_factory.mktemp("async-shared")
    redis_session.client().flushall()
    tiers = [{"kind": "memory", "capacity": "64KiB"},  # two 32 KiB chunks
             {"kind": "shared", "path": str(shared), "capacity": "256MiB"},
             {"kind": "redis", "url": redis_session.url}]
    config = kvtier_transfer_config(tiers, CHUNK)
    config["kv_connector_extra_config"]["load_mode"] = "async"
    with start_engine(tiny_model_dir, config) as llm:
        yield llm, shared, redis_session


def chunks_in_redis(server: RedisServer) -> int:
    return sum(1 for _ in server.client().scan_iter(match="*:c"))


def test_hits_load_async_from_the_shared_directory_then_from_redis(
        engine: tuple[Any, Path, RedisServer]) -> None:
    llm, shared, server = engine
    prompts = random_prompts([500, 300, 420], seed=150)
    clean = []
    for prompt in prompts:  # the miss path, one at a time (each stores its chunks)
        assert llm.reset_prefix_cache()
        clean += token_ids(llm, [prompt], MAX_TOKENS)
    chunks = sum((len(p["prompt_token_ids"]) - 1) // CHUNK for p in prompts)
    settle([shared])
    assert len(chunk_files(shared)) >= chunks
    assert chunks_in_redis(server) >= chunks

    for tier in ("shared", "redis"):
        if tier == "redis":  # the shared directory loses them: Redis serves
            for path in chunk_files(shared):
                path.unlink()
        hits, asyncs = kvtier_counter("tier_hits", tier=tier), kvtier_counter("async_loads")
        assert llm.reset_prefix_cache()
        assert token_ids(llm, prompts, MAX_TOKENS) == clean  # one batch, three loads
        assert kvtier_counter("async_loads") - asyncs == len(prompts)
        assert kvtier_counter("tier_hits", tier=tier) - hits >= chunks - 2, tier
