"""Two copies of a prompt in a node's tier: the removal of one leaves a router crediting the other.

An engine reset by a weight update (`reset_prefix_cache(reset_connector=True)`) keys its
chunks in a new epoch: the same prompt, run again, is stored in the node's RAM under new keys
beside the old copy, which the node keeps (other engines on the old weights may read it; the
node's tiers never retire). llm-d keys a block by its tokens (its rules: llmdrules.py), so both
copies are one entry of the node pseudo-pod: when the node evicted the old copy, its
BlockRemoved took the prompt off the router's index while the new copy was still in RAM. Now a
removal is not announced while the tier holds another chunk of the same tokens; the last
copy's is.

A real `kvtier node serve --events-endpoint` process, a real ZMQ subscriber as a router's,
its frames indexed by llm-d's rules.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from eventsub import Subscriber
from llmdrules import Indexer
from nodekit import LAYOUT, NodeProcess, connect, key, node_tiers, put_chunks, wait_for

from kvtier.node.probe import NodeProbe
from kvtier.tiers.eventfacts import ChunkInfo

pytest.importorskip("vllm.distributed.kv_events")  # the Subscriber decodes with vLLM's too
pytestmark = pytest.mark.timeout(120)

TPC = LAYOUT.tokens_per_chunk  # 16
ROUTER_BLOCK = 8  # two of llm-d's keys per kvtier chunk
MODEL = "node-test-model"  # nodekit.INFO's
ENGINE = "10.0.0.1:8000"


def tokens(prompt: int, i: int) -> list[int]:
    """Chunk i's token ids of prompt `prompt`."""
    return list(range((prompt * 10 + i) * TPC, (prompt * 10 + i + 1) * TPC))


def store(probe: NodeProbe, engine: object, prompt: int, ids: list[int]) -> None:
    """An engine's step: describe chunks `ids` (the keys; a chain) as the two chunks of
    prompt `prompt`, then store them."""
    chunks, parent = {}, None
    for i, k in enumerate(ids):
        chunks[key(k)] = ChunkInfo(parent, np.asarray(tokens(prompt, i), dtype="<i4").tobytes(),
                                   None, None)
        parent = key(k)
    probe.describe(chunks)
    assert put_chunks(engine, ids) == [True] * len(ids)  # type: ignore[arg-type]


def test_evicting_the_old_copy_of_a_prompt_leaves_the_new_one_credited(
        tmp_path: Path, start_node: Callable[..., NodeProcess]) -> None:
    subscriber = Subscriber()
    router = Indexer(block_size=ROUTER_BLOCK)
    seen = [0]

    def score(prompt: int) -> float:
        for topic, payload in subscriber.frames[seen[0]:]:
            router.receive(topic, payload)
        seen[0] = len(subscriber.frames)
        ids = [t for i in range(2) for t in tokens(prompt, i)]
        return router.score(ids, MODEL, {ENGINE: node.name}).get(ENGINE, 0.0)

    try:
        node = start_node(node_tiers(tmp_path, ram_chunks=4),
                          args=("--events-endpoint", subscriber.endpoint))
        subscriber.wait_connected()
        client, engine = connect(node.socket_path)
        probe = NodeProbe([client])
        # Key 0 is all zero bytes, which llm-d reads as "no parent": keys from 1.
        store(probe, engine, prompt=1, ids=[1, 2])  # the prompt, before the reset
        wait_for(lambda: score(1) == pytest.approx(3.2), 10, "the prompt credited")
        store(probe, engine, prompt=1, ids=[11, 12])  # after it: new keys, the same tokens
        wait_for(lambda: len(subscriber.stored()) == 4, 10, "the new copy announced")

        store(probe, engine, prompt=2, ids=[21, 22])  # RAM is full: the old copy leaves
        wait_for(lambda: score(2) == pytest.approx(3.2), 10, "the other prompt credited")
        assert score(1) == pytest.approx(3.2), "the new copy taken off with the old"
        assert subscriber.removed() == []

        store(probe, engine, prompt=3, ids=[31, 32])  # then the new copy: the last one
        wait_for(lambda: score(3) == pytest.approx(3.2), 10, "a third prompt credited")
        wait_for(lambda: score(1) == 0.0, 10, "the last copy's removal")
        assert set(subscriber.removed()) == {key(11), key(12)}
        client.close()
    finally:
        subscriber.close()
