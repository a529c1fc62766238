"""A prompt served in node mode is announced by the node: a real vLLM engine (no KV events of
its own) with `"node": SOCKET`, a real `kvtier node serve --events-endpoint`, and a router's
SUB socket decoding with vLLM's decoder. The engine's scheduler describes each step's stores
to the node (`Describe`); the node publishes their BlockStored on `kv@node:<name>@<model>`
with the prompt's token ids, chained by parent (issue 43).
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from vllm_harness import random_prompts, start_engine, token_ids, transfer_config

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "node"))  # nodekit, eventsub
from eventsub import Subscriber
from nodekit import NodeProcess, short_dir, unique_name, wait_for

pytestmark = pytest.mark.vllm

CHUNK = 64


@pytest.fixture
def subscriber() -> Iterator[Subscriber]:
    sub = Subscriber()
    yield sub
    sub.close()


@pytest.fixture
def node(tmp_path: Path, subscriber: Subscriber) -> Iterator[NodeProcess]:
    """A node publishing its tiers' events to `subscriber` (bound: the node connects)."""
    config = tmp_path / "node.yaml"
    config.write_text(yaml.safe_dump({"tiers": [{"kind": "memory", "capacity": "64MiB"}]}))
    node = NodeProcess(config, short_dir(tmp_path) / "node.sock", unique_name(tmp_path),
                       tmp_path / "node.log", args=("--events-endpoint", subscriber.endpoint))
    try:
        yield node.start()
    finally:
        node.kill()


def test_a_prompt_served_in_node_mode_is_announced_on_the_nodes_topic(
        tiny_model_dir: Path, node: NodeProcess, subscriber: Subscriber) -> None:
    [prompt] = random_prompts([300], seed=7)
    config = transfer_config({"node": str(node.socket_path), "tokens_per_chunk": CHUNK})
    with start_engine(tiny_model_dir, config) as llm:
        token_ids(llm, [prompt])
        # 300 prompt tokens + 16 generated: 4 full chunks, each announced once.
        stored = wait_for(lambda: len(s := subscriber.stored()) >= 4 and s, 30,
                          "four BlockStored from the node")
    [layout] = node.status()["layouts"].values()
    assert {topic for topic, _ in subscriber.events()} == {
        f"kv@node:{node.name}@{layout['model']}"}
    assert len(stored) == 4
    tokens = prompt["prompt_token_ids"]
    chain = [e for e in stored.values() if e.parent_block_hash is None]
    for _ in range(3):  # each chunk's parent is the one before it
        chain += [e for e in stored.values() if e.parent_block_hash == chain[-1].block_hashes[0]]
    assert [e.token_ids for e in chain] == [tokens[i * CHUNK:(i + 1) * CHUNK] for i in range(4)]
    assert all((e.block_size, e.medium, e.ownership) == (CHUNK, "CPU", "kvtier/memory")
               for e in chain)
