"""The s3 tier under real vLLM (CPU backend): two engines, one after the other, sharing one
bucket of moto's S3 server (an emulator on 127.0.0.1; or KVTIER_TEST_S3_* for a real one).

  - engine A (memory + s3 tiers) computes the prompts (the miss path); its chunks are
    written behind to the bucket, one object each;
  - engine B, a new engine on the same bucket and prefix whose memory tier holds no chunk,
    is served those prompts from the s3 tier: vLLM counts the external hits, kvtier counts
    them on the s3 tier, and B's outputs equal A's and B's own recompute (`skip_load`).

Two engine start-ups in all (~45-80 s each here).
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from s3_server import S3Endpoint
from vllm_harness import (
    kvtier_counter,
    kvtier_transfer_config,
    metric,
    random_prompts,
    start_engine,
    token_ids,
)

pytestmark = [pytest.mark.vllm, pytest.mark.s3]

CHUNK = 64
MAX_TOKENS = 16
HITS = "vllm:external_prefix_cache_hits"
LENGTHS = [400, 200]


@pytest.fixture(scope="module", autouse=True)
def no_hash_seed() -> Iterator[None]:
    """Engines inherit this environment: make sure nothing pins Python's hash seed."""
    saved = os.environ.pop("PYTHONHASHSEED", None)
    yield
    if saved is not None:
        os.environ["PYTHONHASHSEED"] = saved


def tiers(endpoint: S3Endpoint, prefix: str, memory: str) -> list[dict[str, Any]]:
    return [{"kind": "memory", "capacity": memory},
            {"kind": "s3", **endpoint.settings(prefix), "request_timeout_s": 10.0,
             "lookup_timeout_s": 5.0}]


def chunk_objects(endpoint: S3Endpoint, prefix: str) -> list[str]:
    pages = endpoint.client().get_paginator("list_objects_v2").paginate(
        Bucket=endpoint.bucket, Prefix=prefix + "/")
    return [o["Key"] for page in pages for o in page.get("Contents", [])
            if not o["Key"].endswith("manifest.json")]


def test_engine_b_is_served_from_the_bucket_what_engine_a_computed(
        tiny_model_dir: Path, s3_session: S3Endpoint) -> None:
    prefix = f"e2e-{uuid.uuid4().hex[:8]}"
    prompts = random_prompts(LENGTHS, seed=71)
    stored = sum((n + MAX_TOKENS - 1) // CHUNK for n in LENGTHS)
    with start_engine(tiny_model_dir,
                      kvtier_transfer_config(tiers(s3_session, prefix, "64MiB"), CHUNK)) as a:
        computed = token_ids(a, prompts, MAX_TOKENS)
        deadline = time.monotonic() + 60
        while len(chunk_objects(s3_session, prefix)) < stored:
            assert time.monotonic() < deadline, "engine A's chunks never reached the bucket"
            time.sleep(0.2)
    assert len(chunk_objects(s3_session, prefix)) == stored

    with start_engine(tiny_model_dir,
                      kvtier_transfer_config(tiers(s3_session, prefix, "16KiB"), CHUNK)) as b:
        hits, tier_hits = metric(b, HITS), kvtier_counter("tier_hits", tier="s3")
        served = token_ids(b, prompts, MAX_TOKENS)
        loadable = sum((n - 1) // CHUNK * CHUNK for n in LENGTHS)
        assert metric(b, HITS) - hits == loadable
        assert kvtier_counter("tier_hits", tier="s3") - tier_hits == loadable // CHUNK
        assert served == computed
        # B's own miss path (nothing loaded, vLLM's cache emptied): the same tokens.
        assert b.reset_prefix_cache()
        hits = metric(b, HITS)
        assert token_ids(b, prompts, MAX_TOKENS, {"skip_load": True}) == computed
        assert metric(b, HITS) == hits
