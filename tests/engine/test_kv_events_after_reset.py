"""After a weight update's cache reset, a router goes on crediting RAM with a prompt stored again.

`reset_prefix_cache(reset_connector=True)`: vLLM publishes AllBlocksCleared (every block of
the engine gone, kvtier's tiers' with them), kvtier's RAM retires what it holds, and the same
prompt, run again, is stored under new keys and announced. llm-d keys a block by its tokens
(its rules: tests/node/llmdrules.py): when the retired old copy was evicted, its
BlockRemoved took the new copy off llm-d's index too, and the prompt stopped matching RAM
while RAM held it. A real engine (CPU backend, its core in this process), its events read
from vLLM's ZMQ publisher by a real SUB socket; the GPU's weight is 0 so that a score counts
kvtier's RAM alone.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import pytest
import zmq
from vllm_harness import BLOCK_SIZE, greedy, random_prompts, start_engine, token_ids

from kvtier.testing.tinymodel import PRESETS

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "node"))  # the router's side
from llmdrules import Indexer

pytestmark = pytest.mark.vllm
TPC = 64
CHUNK_BYTES = PRESETS["test"].kv_bytes_per_token() * TPC
POD, MODEL = "127.0.0.1:8000", "test"
PROMPT = 150  # and 16 generated: 2 chunks stored (128 of the prompt's tokens)
IN_RAM = 2 * TPC / BLOCK_SIZE  # the chunks' router blocks at RAM's weight, 1.0


class Router:
    """llm-d's index over a real subscription to the engine's publisher."""

    def __init__(self, endpoint: str) -> None:
        self.context = zmq.Context()
        self.sub = self.context.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"kv@")
        self.sub.connect(endpoint)
        self.index = Indexer(block_size=BLOCK_SIZE, weights={"gpu": 0.0, "cpu": 1.0})

    def score(self, prompt: dict[str, list[int]]) -> float:
        """The prompt's stored part's score, after the messages received so far."""
        while self.sub.poll(timeout=0):
            topic, _seq, payload = self.sub.recv_multipart()
            self.index.receive(topic.decode(), payload)
        tokens = prompt["prompt_token_ids"][:2 * TPC]
        return self.index.score(tokens, MODEL, {POD: "n1"}).get(POD, 0.0)

    def wait_score(self, prompt: dict[str, list[int]], expected: float,
                   timeout_s: float = 30.0) -> float:
        deadline = time.monotonic() + timeout_s
        while (got := self.score(prompt)) != pytest.approx(expected) \
                and time.monotonic() < deadline:
            self.sub.poll(timeout=200)
        return got

    def close(self) -> None:
        self.sub.close(linger=0)
        self.context.term()


def test_evicting_a_retired_copy_leaves_the_prompt_stored_again_credited(
        tiny_model_dir: Path, tmp_path: Path) -> None:
    endpoint = f"ipc://{tmp_path}/kv-events.sock"
    kvtier = {"kv_connector": "KVTierConnector",
              "kv_connector_module_path": "kvtier.integrations.vllm", "kv_role": "kv_both",
              # RAM holds 4 chunks: a third 2-chunk prompt evicts. Tails off: whole chunks.
              "kv_connector_extra_config": {"tokens_per_chunk": TPC, "tail_chunks": False,
                                            "tiers": [{"kind": "memory",
                                                       "capacity": 4 * CHUNK_BYTES}]}}
    events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": endpoint,
              "topic": f"kv@{POD}@{MODEL}"}
    a, b, c = random_prompts([PROMPT] * 3, seed=51)
    router: Router | None = None
    try:
        with start_engine(tiny_model_dir, kvtier, kv_events_config=events) as llm:
            router = Router(endpoint)
            _until_subscribed(llm, router, a)
            assert router.wait_score(a, IN_RAM) == pytest.approx(IN_RAM)
            # Every block is free (the harness steps while vLLM keeps any): vLLM's reset
            # succeeds, its AllBlocksCleared goes out with the next step's events.
            assert llm.reset_prefix_cache(reset_connector=True)
            token_ids(llm, [a])  # the same prompt again: new keys, announced in RAM
            assert router.wait_score(a, IN_RAM) == pytest.approx(IN_RAM)

            token_ids(llm, [b])  # RAM makes room: the retired copies of "a" leave
            assert router.wait_score(b, IN_RAM) == pytest.approx(IN_RAM)
            assert router.score(a) == pytest.approx(IN_RAM), "the new copy taken off too"

            token_ids(llm, [c])  # then the new copies of "a": their removal goes out
            assert router.wait_score(c, IN_RAM) == pytest.approx(IN_RAM)
            assert router.wait_score(a, 0.0) == 0.0
    finally:
        if router is not None:
            router.close()


def _until_subscribed(llm: Any, router: Router, prompt: dict[str, list[int]]) -> None:
    """Run `prompt` until its chunks' events reach the router: a PUB drops what it sends
    before the subscription reaches it, and a prompt stored already is announced again only
    once evicted, so short prompts (under a chunk) first, until vLLM's own events arrive."""
    for seed in range(1000, 1060):
        token_ids(llm, random_prompts([TPC // 2], seed=seed))
        if router.sub.poll(timeout=500):
            token_ids(llm, [prompt])
            return
    raise AssertionError("no KV event reached the subscriber in 60 prompts")


def test_a_reset_vllm_refuses_leaves_the_old_copies_removals_announced(
        tiny_model_dir: Path, tmp_path: Path) -> None:
    """A request holds blocks: vLLM's own reset fails (False) and clears nothing, so the
    router still credits RAM with the old copies; when they leave, it hears so."""
    endpoint = f"ipc://{tmp_path}/kv-events.sock"
    kvtier = {"kv_connector": "KVTierConnector",
              "kv_connector_module_path": "kvtier.integrations.vllm", "kv_role": "kv_both",
              "kv_connector_extra_config": {"tokens_per_chunk": TPC, "tail_chunks": False,
                                            "tiers": [{"kind": "memory",
                                                       "capacity": 4 * CHUNK_BYTES}]}}
    events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": endpoint,
              "topic": f"kv@{POD}@{MODEL}"}
    a, b, c, running = random_prompts([PROMPT] * 4, seed=61)
    router: Router | None = None
    try:
        with start_engine(tiny_model_dir, kvtier, kv_events_config=events) as llm:
            router = Router(endpoint)
            _until_subscribed(llm, router, a)
            assert router.wait_score(a, IN_RAM) == pytest.approx(IN_RAM)
            engine = llm.llm_engine
            engine.add_request("running", running, greedy(max_tokens=8))
            engine.step()  # scheduled: its blocks are in use
            assert not llm.reset_prefix_cache(reset_connector=True)
            while engine.has_unfinished_requests():
                engine.step()

            token_ids(llm, [b])
            token_ids(llm, [c])  # RAM evicted the old copies of "a" (and of "running")
            assert router.wait_score(c, IN_RAM) == pytest.approx(IN_RAM)
            assert router.wait_score(a, 0.0) == 0.0, "a removal after no clear unannounced"
    finally:
        if router is not None:
            router.close()
