"""KV events: a router subscribed to vLLM's ZMQ publisher sees kvtier's chunks come and go.

kvtier's tier events travel through vLLM's own publisher (`--kv-events-config`), in vLLM's
msgpack wire format; this test decodes them with vLLM's `KVEventBatch` in a real ZMQ SUB
socket. Chunks are 64 tokens; the memory tier holds 4 of them, so a second prompt evicts.
With event_block_size 16 a salted request's chunks score for NVIDIA Dynamo's router (its rules:
tests/node/dynamorules.py) for that salt only; with pool_events the shared tier's chunks go out
on kvtier's own publisher, on the pool's topic, and score for every engine by llm-d's rules
(tests/node/llmdrules.py).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq
from vllm_harness import random_prompts, start_engine, token_ids

from kvtier.testing.tinymodel import PRESETS

pytestmark = pytest.mark.vllm
TPC = 64
CHUNK_BYTES = PRESETS["test"].kv_bytes_per_token() * TPC


@pytest.fixture(scope="module")
def engine_and_subscriber(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory,
                          ) -> Iterator[tuple[Any, zmq.Socket]]:
    # vLLM's publisher binds wildcard and ipc endpoints (its default is tcp://*:5557, every
    # interface); an ipc socket keeps the test on this machine with the same topology:
    # engines bind, routers connect.
    endpoint = f"ipc://{tmp_path_factory.mktemp('events')}/kv-events.sock"
    kvtier = {"kv_connector": "KVTierConnector",
              "kv_connector_module_path": "kvtier.integrations.vllm",
              "kv_role": "kv_both",
              # Tails off: the cases count whole chunks and their evictions.
              "kv_connector_extra_config": {"tokens_per_chunk": TPC, "tail_chunks": False,
                                            "tiers": [{"kind": "memory",
                                                       "capacity": 4 * CHUNK_BYTES}]}}
    # kv@<pod>@<model>: llm-d's scorer subscribes to "kv@" and reads pod and model from it.
    events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": endpoint,
              "topic": "kv@127.0.0.1:8000@test"}
    context = zmq.Context()
    sub = context.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv@")
    try:
        with start_engine(tiny_model_dir, kvtier, kv_events_config=events) as llm:
            sub.connect(endpoint)  # the engine's publisher is bound by now
            _until_subscribed(llm, sub)
            yield llm, sub
    finally:
        sub.close(linger=0)
        context.term()


def _until_subscribed(llm: Any, sub: zmq.Socket) -> None:
    """Send short prompts (under a chunk: nothing kvtier stores) until vLLM's own events for
    them arrive: the subscription has reached the publisher (a PUB drops what it sends before
    it does), then drain them."""
    for seed in range(1000, 1060):
        token_ids(llm, random_prompts([TPC // 2], seed=seed))
        if sub.poll(timeout=500):
            _kvtier_events(sub, wait_s=0.5)
            return
    raise AssertionError("no KV event reached the subscriber in 60 prompts")


def _kvtier_events(sub: zmq.Socket, wait_s: float = 3.0) -> list[Any]:
    """Every kvtier event published until the stream has been quiet for a moment."""
    from vllm.distributed.kv_events import KVEventBatch

    decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
    found: list[Any] = []
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        if sub.poll(timeout=200):
            _topic, _seq, payload = sub.recv_multipart()
            batch = decoder.decode(payload)
            found += [e for e in batch.events
                      if (getattr(e, "ownership", None) or "").startswith("kvtier/")]
    return found


def _blocks(stored: list[Any]) -> list[tuple[bytes, bytes | None, list[int]]]:
    """(hash, parent, token ids) of every block the BlockStored events announce, in order (an
    event announces a run of a prompt's chunks: kvtier.tiers.eventblocks)."""
    blocks = []
    for e in stored:
        parent = e.parent_block_hash
        for j, block in enumerate(e.block_hashes):
            blocks.append((block, parent, e.token_ids[j * e.block_size:(j + 1) * e.block_size]))
            parent = block
    return blocks


def test_routers_see_stored_chunks_with_their_tokens_then_their_eviction(
        engine_and_subscriber: tuple[Any, zmq.Socket]) -> None:
    llm, sub = engine_and_subscriber
    [first] = random_prompts([300], seed=11)
    token_ids(llm, [first])
    stored = [e for e in _kvtier_events(sub) if type(e).__name__ == "BlockStored"]
    # 300 prompt tokens + 16 generated: 4 full chunks, each announced once, with its tokens,
    # parents first.
    blocks = _blocks(stored)
    assert len(blocks) == 4
    tokens = first["prompt_token_ids"]
    assert [b[2] for b in blocks] == [tokens[i * TPC:(i + 1) * TPC] for i in range(4)]
    assert all(e.block_size == TPC and e.medium == "CPU" and e.locality == "LOCAL"
               for e in stored)
    assert blocks[0][1] is None
    assert [b[1] for b in blocks[1:]] == [b[0] for b in blocks[:-1]]

    # A second prompt's chunks push the first prompt's out of the 4-chunk memory tier.
    token_ids(llm, random_prompts([300], seed=12))
    events = _kvtier_events(sub)
    removed = {bytes(h) for e in events if type(e).__name__ == "BlockRemoved"
               for h in e.block_hashes}
    assert {bytes(b[0]) for b in blocks} <= removed


def test_a_salted_prompt_announced_at_dynamos_block_size_scores_for_its_salt(
        tiny_model_dir: Path, tmp_path: Path) -> None:
    """event_block_size 16: NVIDIA Dynamo's router (its rules: tests/node/dynamorules.py)
    indexes the chunks of a salted request and matches a query of the same salt only."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "node"))
    pytest.importorskip("xxhash")
    from dynamorules import DynamoIndexer
    from vllm.distributed.kv_events import KVEventBatch

    endpoint = f"ipc://{tmp_path}/kv-events.sock"
    kvtier = {"kv_connector": "KVTierConnector",
              "kv_connector_module_path": "kvtier.integrations.vllm", "kv_role": "kv_both",
              # Tails off: the chunks' blocks are counted (a tail's events:
              # tests/connector/test_router_events.py). Stores in the step: the prompt's
              # chunks are one run, one event (Dynamo reads an event's cache namespace from
              # its first block, which only a prompt's first chunk carries; async stores
              # landing across two reports split the run, and the rest scored no match).
              "kv_connector_extra_config": {"tokens_per_chunk": TPC, "event_block_size": 16,
                                            "tail_chunks": False, "store_mode": "sync",
                                            "tiers": [{"kind": "memory",
                                                       "capacity": 8 * CHUNK_BYTES}]}}
    events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": endpoint,
              "topic": "kv@127.0.0.1:8000@test"}
    salt = "dynamo-cache-salt:tenant-a"  # as Dynamo's vLLM handler hands the salt to vLLM
    [prompt] = random_prompts([300], seed=21)
    context = zmq.Context()
    sub = context.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv@")
    try:
        with start_engine(tiny_model_dir, kvtier, kv_events_config=events) as llm:
            sub.connect(endpoint)
            _until_subscribed(llm, sub)
            token_ids(llm, [{**prompt, "cache_salt": salt}])
            ours = _kvtier_events(sub)
    finally:
        sub.close(linger=0)
        context.term()
    stored = [e for e in ours if type(e).__name__ == "BlockStored"]
    assert len(_blocks(stored)) == 16 and {e.block_size for e in stored} == {16}
    assert stored[0].extra_keys[0] == (salt,)
    dynamo = DynamoIndexer(kv_block_size=16)
    dynamo.receive("A", msgspec.msgpack.encode(KVEventBatch(ts=0.0, events=ours)))
    tokens = prompt["prompt_token_ids"]
    assert dynamo.score(tokens, namespace="tenant-a") == {"A": 16}
    assert dynamo.score(tokens) == {} and dynamo.score(tokens, namespace="tenant-b") == {}


def test_a_prompt_in_the_shared_tier_is_announced_for_the_pool_and_scores_for_every_engine(
        tiny_model_dir: Path, tmp_path: Path) -> None:
    """pool_events: the shared tier's chunks go out on kvtier's own publisher, topic
    kv@pool:<pool>@<model>; by llm-d's rules (tests/node/llmdrules.py) engine B, which never
    saw the prompt, scores it. The memory tier's stay on vLLM's stream."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "node"))
    from eventsub import Subscriber
    from nodekit import wait_for

    subscriber = Subscriber()
    kvtier = {"kv_connector": "KVTierConnector",
              "kv_connector_module_path": "kvtier.integrations.vllm", "kv_role": "kv_both",
              "kv_connector_extra_config": {
                  "tokens_per_chunk": TPC, "tail_chunks": False,  # counts whole chunks
                  "pool_events": {"endpoint": subscriber.endpoint, "pool": "fleet",
                                  "model": "test"},
                  "tiers": [{"kind": "memory", "capacity": 8 * CHUNK_BYTES},
                            {"kind": "shared", "path": str(tmp_path / "shared"),
                             "capacity": "64MiB"}]}}
    [prompt] = random_prompts([300], seed=31)
    try:
        with start_engine(tiny_model_dir, kvtier) as llm:
            wait_for(lambda: subscriber.handshakes >= 1, 30, "the engine's pool publisher")
            # Until the subscription has reached the publisher (a PUB drops what it sends
            # before), a new one-chunk prompt at a time, each stored in the shared tier.
            seed = 1000
            while not subscriber.stored():
                seed += 1
                assert seed < 1060, "no pool event reached the subscriber in 60 prompts"
                token_ids(llm, random_prompts([TPC], seed=seed))
                time.sleep(0.2)
            token_ids(llm, [prompt])
            # The shared tier's writes are reported in a later step (the worker's report):
            # a prompt shorter than a chunk (nothing stored) steps the engine meanwhile.
            short = random_prompts([TPC // 4], seed=7)
            wait_for(lambda: token_ids(llm, short) and score(subscriber, prompt) == SHARED,
                     30, "the shared tier's 4 chunks")
    finally:
        subscriber.close()
    assert {topic for topic, _ in subscriber.events()} == {"kv@pool:fleet@test"}
    assert {e.ownership for e in subscriber.stored().values()} == {"kvtier/shared"}
    assert score(subscriber, prompt) == pytest.approx(SHARED)


# 4 chunks of 64 = 16 of the router's blocks, at the pool's 0.4: for B as for A.
ENDPOINTS = {"10.0.0.1:8000": "n1", "10.0.0.2:8000": "n2"}  # A, and B on another node
SHARED = dict.fromkeys(ENDPOINTS, 16 * 0.4)


def score(subscriber: Any, prompt: dict[str, Any]) -> dict[str, float]:
    """The prompt's score by llm-d's rules (tests/node/llmdrules.py), from every frame the
    pool's publisher sent so far."""
    from llmdrules import Indexer
    router = Indexer(block_size=16, weights={"gpu": 1.0, "cpu": 0.8, "shared_storage": 0.4})
    for frame in subscriber.frames:
        router.receive(*frame)
    return {k: round(v, 6) for k, v in router.score(prompt["prompt_token_ids"], "test",
                                                    ENDPOINTS).items()}
