"""Sharing across engines: engine B gets hits on prompts engine A computed, through one Redis
and through one shared directory, with B's own miss-path tokens.

Two engines, one after the other, each in its own engine-core process (start ~20-45 s each),
with no PYTHONHASHSEED in their environment (kvtier's keys are blake3 hashes of token ids,
the same in every process):
  - engine A (memory + shared + redis tiers) computes the "redis" prompts and the "shared"
    prompts (the miss path), writing their chunks behind to both lower tiers; to make each
    case's source unambiguous, the "redis" prompts' shared files and the "shared" prompts'
    Redis values are deleted once written;
  - engine B is a new engine on the same directory and server, whose memory tier holds no
    chunk, so whatever it loads was stored by A. Its scheduler finds A's chunks through its
    probes (a stat of the shared directory, an EXISTS on Redis).
Each case asserts B's outputs equal A's and B's own miss path (`skip_load`), and that vLLM
counted external hits and kvtier counted them on the expected tier.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from redis_server import RedisServer
from vllm_harness import (
    chunk_files,
    kvtier_counter,
    kvtier_transfer_config,
    metric,
    random_prompts,
    start_engine,
    token_ids,
)

pytestmark = [pytest.mark.vllm, pytest.mark.redis]

CHUNK = 64
MAX_TOKENS = 16
HITS = "vllm:external_prefix_cache_hits"
PREFIX = "kvtier-sharing:"
PROMPTS = {"redis": [500, 300], "shared": [400, 200]}  # source tier -> prompt lengths


@dataclass
class Computed:
    """Prompts engine A computed, and A's tokens for them."""

    prompts: list[dict[str, list[int]]]
    outputs: list[list[int]]


def stored_chunks(prompt_len: int) -> int:
    """Chunks a run stores: its computed tokens (prompt + all answer tokens but the last)."""
    return (prompt_len + MAX_TOKENS - 1) // CHUNK


def loadable(prompt_len: int) -> int:
    """Tokens kvtier can serve of a prompt: whole chunks, never the last token."""
    return (prompt_len - 1) // CHUNK * CHUNK


def redis_headers(server: RedisServer) -> set[bytes]:
    """The chunk headers kvtier wrote under this module's key prefix."""
    return set(server.client().scan_iter(match=PREFIX + "*:c", count=1000))


def wait_until(condition: Any, what: str, timeout_s: float = 30.0) -> None:
    """Poll `condition()` (write-behind is asynchronous); fail with `what` after timeout_s."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


@pytest.fixture(scope="module", autouse=True)
def no_hash_seed() -> Iterator[None]:
    """Engines inherit this environment: make sure nothing pins Python's hash seed."""
    saved = os.environ.pop("PYTHONHASHSEED", None)
    yield
    if saved is not None:
        os.environ["PYTHONHASHSEED"] = saved


@pytest.fixture(scope="module")
def redis_for_sharing(redis_session: RedisServer) -> RedisServer:
    for key in redis_session.client().scan_iter(match=PREFIX + "*", count=1000):
        redis_session.client().delete(key)
    return redis_session


def tiers(shared: Path, redis_url: str, memory: str) -> list[dict[str, Any]]:
    return [{"kind": "memory", "capacity": memory},
            {"kind": "shared", "path": str(shared), "capacity": "256MiB"},
            {"kind": "redis", "url": redis_url, "key_prefix": PREFIX, "capacity": "256MiB"}]


@pytest.fixture(scope="module")
def computed_by_a(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory,
                  redis_for_sharing: RedisServer) -> tuple[Path, dict[str, Computed]]:
    """Engine A runs every prompt once (the miss path); its chunks land in both tiers."""
    shared = tmp_path_factory.mktemp("kvtier-shared")
    server = redis_for_sharing
    out: dict[str, Computed] = {}
    config = kvtier_transfer_config(tiers(shared, server.url, "64MiB"), CHUNK)
    with start_engine(tiny_model_dir, config) as llm:
        for seed, (name, lengths) in enumerate(PROMPTS.items(), start=60):
            prompts = random_prompts(lengths, seed=seed)
            files_before, headers_before = set(chunk_files(shared)), redis_headers(server)
            outputs = token_ids(llm, prompts, MAX_TOKENS)
            expected = sum(stored_chunks(n) for n in lengths)
            wait_until(lambda f=files_before, n=expected: len(set(chunk_files(shared)) - f) >= n,
                       f"{expected} shared files")
            wait_until(lambda h=headers_before, n=expected: len(redis_headers(server) - h) >= n,
                       f"{expected} redis chunks")
            new_files = set(chunk_files(shared)) - files_before
            new_headers = redis_headers(server) - headers_before
            assert len(new_files) == len(new_headers) == expected
            if name == "redis":  # B may find these in Redis only
                for f in new_files:
                    f.unlink()
            else:  # ...and these in the shared directory only
                client = server.client()
                for header in new_headers:
                    base = header[:-1]  # "...:{key}:" + "h"
                    client.delete(*client.scan_iter(match=base + b"*", count=1000))
            out[name] = Computed(prompts, outputs)
    return shared, out


@pytest.fixture(scope="module")
def engine_b(tiny_model_dir: Path, computed_by_a: tuple[Path, dict[str, Computed]],
             redis_for_sharing: RedisServer) -> Iterator[Any]:
    """A second engine on A's directory and server; its memory tier holds no chunk."""
    shared, _ = computed_by_a
    config = kvtier_transfer_config(tiers(shared, redis_for_sharing.url, "16KiB"), CHUNK)
    with start_engine(tiny_model_dir, config) as llm:
        yield llm


@pytest.mark.parametrize("source", ["redis", "shared"])
def test_engine_b_is_served_the_prompts_engine_a_computed(
        source: str, engine_b: Any, computed_by_a: tuple[Path, dict[str, Computed]]) -> None:
    run = computed_by_a[1][source]
    hits, tier_hits = metric(engine_b, HITS), kvtier_counter("tier_hits", tier=source)
    outputs = token_ids(engine_b, run.prompts, MAX_TOKENS)
    expected = sum(loadable(len(p["prompt_token_ids"])) for p in run.prompts)
    assert metric(engine_b, HITS) - hits == expected
    assert kvtier_counter("tier_hits", tier=source) - tier_hits == expected // CHUNK
    assert outputs == run.outputs

    # B's own miss path (nothing loaded, vLLM's cache emptied) gives the same tokens.
    assert engine_b.reset_prefix_cache()
    hits = metric(engine_b, HITS)
    assert token_ids(engine_b, run.prompts, MAX_TOKENS, {"skip_load": True}) == outputs
    assert metric(engine_b, HITS) == hits
