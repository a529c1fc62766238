"""kvtier's KV events as llm-d's precise prefix-cache scorer reads them: the frames a router's
socket receives, decoded, indexed and scored by llm-d's own rules (ported in llmdrules.py, each
citing the llm-d file and commit it comes from).

A prompt that engine A stored in the `kvtier node` of its Kubernetes node is announced on the
node pseudo-pod's topic `kv@node:<node>@<model>` (llm-d-router PR #2586): the router scores
it for engine B on the same node, which never saw the prompt, and not for an engine on another
node; a chunk whose parent was never announced is not indexed; one the node evicts stops
counting. On an engine's own topic, the topic must be `kv@<pod>@<model>` (a plain `kv`, what
kvtier's docs once said, is never indexed), and a `STORAGE` tier with no configured weight
counts like a GPU hit (docs/sharing.md says to set it).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from eventsub import Subscriber
from llmdrules import Indexer, parse_topic
from nodekit import LAYOUT, NodeProcess, connect, key, node_tiers, put_chunks, wait_for

from kvtier.core.keys import ChunkKey
from kvtier.node.eventwire import BlockStored, KVEventBatch, frames
from kvtier.node.probe import NodeProbe
from kvtier.tiers.eventfacts import ChunkInfo

pytest.importorskip("vllm.distributed.kv_events")  # the Subscriber decodes with vLLM's too
pytestmark = pytest.mark.timeout(120)

TPC = LAYOUT.tokens_per_chunk  # 16
ROUTER_BLOCK = 8  # llm-d's tokenProcessorConfig.blockSize: two of its keys per kvtier chunk
MODEL = "node-test-model"


def tokens(i: int) -> list[int]:
    return list(range(i * TPC, (i + 1) * TPC))


def prompt(ids: list[int]) -> list[int]:
    return [t for i in ids for t in tokens(i)] + [99_999] * 5  # and a partial block


def describe(probe: NodeProbe, ids: list[int], parent: int | None) -> None:
    """What engine A's scheduler sends at a step: chunks `ids` of one prompt, in order."""
    chunks = {}
    for i in ids:
        chunks[key(i)] = ChunkInfo(None if parent is None else key(parent),
                                   np.asarray(tokens(i), dtype="<i4").tobytes(), None, None)
        parent = i
    probe.describe(chunks)


def test_a_prompt_engine_a_stored_in_the_node_scores_for_engine_b_on_that_node(
        tmp_path: Path, start_node: Callable[..., NodeProcess]) -> None:
    subscriber = Subscriber()
    try:
        node = start_node(node_tiers(tmp_path, ram_chunks=4),
                          args=("--events-endpoint", subscriber.endpoint))
        subscriber.wait_connected()
        endpoints = {"10.0.0.1:8000": node.name, "10.0.0.2:8000": node.name,  # A and B
                     "10.0.0.3:8000": "another-node"}
        client, engine_a = connect(node.socket_path)
        probe = NodeProbe([client])
        # Key 0 is all zero bytes, which llm-d reads as "no parent": prompts start at chunk 1.
        describe(probe, [1, 2, 3, 4], parent=None)
        assert put_chunks(engine_a, [1, 2, 3, 4]) == [True] * 4
        wait_for(lambda: len(subscriber.stored()) == 4, 10, "four BlockStored")

        router = Indexer(block_size=ROUTER_BLOCK)
        for topic, payload in subscriber.frames:
            router.receive(topic, payload)
        assert {parse_topic(t) for t, _ in subscriber.frames} == {(f"node:{node.name}", MODEL)}
        scores = router.score(prompt([1, 2, 3, 4]), MODEL, endpoints)
        # 4 chunks = 8 of the router's blocks, each a "cpu" hit (the node's RAM): 0.8 each.
        assert scores == pytest.approx({"10.0.0.1:8000": 6.4, "10.0.0.2:8000": 6.4})
        # A prompt sharing the first two chunks scores their four blocks.
        assert router.score(prompt([1, 2, 9]), MODEL, endpoints)["10.0.0.2:8000"] == (
            pytest.approx(3.2))

        # A chunk whose parent (6) was never announced: the node holds it back a while (its
        # parent may yet land), then sends it, and llm-d skips it. Storing it pushes the least
        # recent chunk (1) out of the node's 4-chunk RAM: a BlockRemoved, sent at once.
        describe(probe, [7], parent=6)
        assert put_chunks(engine_a, [7]) == [True]
        wait_for(lambda: subscriber.removed(), 10, "a BlockRemoved")
        wait_for(lambda: key(7) in subscriber.stored(), 10, "chunk 7, after its hold")
        removed_at = len(subscriber.frames)
        router = Indexer(block_size=ROUTER_BLOCK)
        for topic, payload in subscriber.frames[:removed_at]:
            router.receive(topic, payload)
        assert router.skipped_orphans == 1
        assert subscriber.removed() == [key(1)]
        # Without the prompt's first chunk nothing matches from its start.
        assert router.score(prompt([1, 2, 3, 4]), MODEL, endpoints) == {}
        client.close()
    finally:
        subscriber.close()


def _batch(topic: str, medium: str) -> tuple[str, bytes]:
    _, _, payload = frames(topic.encode(), 0, KVEventBatch(ts=time.time(), events=[
        BlockStored([ChunkKey(bytes(range(1, 17)))], None, tokens(1), TPC, None, medium, None,
                    ownership="kvtier/disk")]))
    return topic, payload


def test_an_engine_topic_must_name_pod_and_model_and_storage_needs_its_weight() -> None:
    endpoints = {"10.0.0.1:8000": "n1", "10.0.0.2:8000": "n1"}
    router = Indexer(block_size=ROUTER_BLOCK)
    router.receive(*_batch("kv", "STORAGE"))  # what docs/sharing.md once said to publish
    assert router.dropped_topics == ["kv"] and router.entries == {}

    router.receive(*_batch("kv@10.0.0.1:8000@m", "STORAGE"))
    # llm-d has no weight for "storage": a disk chunk counts as GPU blocks would (1.0 each).
    assert router.score(tokens(1), "m", endpoints) == {"10.0.0.1:8000": 2.0}
    weighted = Indexer(block_size=ROUTER_BLOCK, weights={"gpu": 1.0, "cpu": 0.8, "storage": 0.3})
    weighted.receive(*_batch("kv@10.0.0.1:8000@m", "STORAGE"))
    assert weighted.score(tokens(1), "m", endpoints) == {"10.0.0.1:8000": pytest.approx(0.6)}
