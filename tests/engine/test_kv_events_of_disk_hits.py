"""A prompt a new engine reads back from disk is announced stored in its RAM, tail and all.

A first engine leaves a prompt on disk and stops; a second one on the same directory (a new
process: its scheduler never saw the prompt) hits it: its full chunks and the tail past them
(a block: keys.tail_key) are read and promoted into RAM, and each promotion is a stored event
for RAM, whose token ids come from the request that reads it. The tail's were kept only at
its store (by the first engine), not at the lookup that hit it: its promotion went out
unannounced, and routers never learnt that RAM held the prompt's end. Events at vLLM's block
size (32), where a tail is announced as its block; a real ZMQ subscriber, as in
test_kv_events.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import zmq
from test_kv_events import CHUNK_BYTES, TPC, _blocks, _kvtier_events, _until_subscribed
from vllm_harness import BLOCK_SIZE, kvtier_transfer_config, random_prompts, settle, start_engine
from vllm_harness import token_ids as generate

pytestmark = pytest.mark.vllm
PROMPT = 300  # 4 chunks of 64, then a tail of one 32-token block (and 12 tokens past it)
HIT = 4 * TPC + BLOCK_SIZE
MAX_TOKENS = 4  # no block completes past the tail: the reader stores nothing of its own


def connector(disk: Path) -> dict[str, Any]:
    config = kvtier_transfer_config(
        [{"kind": "memory", "capacity": 8 * CHUNK_BYTES},
         {"kind": "disk", "path": str(disk), "capacity": "64MiB"}], tail_chunks=True)
    config["kv_connector_extra_config"]["event_block_size"] = BLOCK_SIZE
    return config


def test_a_prompt_read_back_from_disk_is_announced_in_ram_with_its_tail(
        tiny_model_dir: Path, tmp_path: Path) -> None:
    disk = tmp_path / "disk"
    [prompt] = random_prompts([PROMPT], seed=41)
    with start_engine(tiny_model_dir, connector(disk)) as writer:
        generate(writer, [prompt], MAX_TOKENS)
        settle([disk])

    endpoint = f"ipc://{tmp_path}/kv-events.sock"
    events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": endpoint,
              "topic": "kv@127.0.0.1:8000@test"}
    context = zmq.Context()
    sub = context.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv@")
    try:
        with start_engine(tiny_model_dir, connector(disk), kv_events_config=events) as reader:
            sub.connect(endpoint)
            _until_subscribed(reader, sub)
            generate(reader, [prompt], MAX_TOKENS)
            ours = _kvtier_events(sub)
    finally:
        sub.close(linger=0)
        context.term()
    # The prompt's blocks announced stored in RAM (the subscription's own short prompts
    # aside): its 8 chunk blocks and its tail's, each with its tokens.
    tokens = prompt["prompt_token_ids"]
    block_of = {tuple(tokens[i:i + BLOCK_SIZE]): i // BLOCK_SIZE
                for i in range(0, HIT, BLOCK_SIZE)}
    in_ram = [e for e in ours if type(e).__name__ == "BlockStored" and e.medium == "CPU"]
    announced = sorted(block_of[t] for _, _, ids in _blocks(in_ram)
                       if (t := tuple(ids)) in block_of)
    assert announced == list(range(HIT // BLOCK_SIZE)), "blocks read back, unannounced"
