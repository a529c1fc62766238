"""A real engine frozen in the middle of a load from a `kvtier node` (its copy held: a wedged
worker) past the node's `--lease-timeout-s`: the node takes its lending back, a neighbour
engine fills the node's RAM again (the lent chunks' slots written with its chunks), and the
engine, once it goes on, copies bytes that are no longer its chunks. Its check after the copy
(each slot's stamp) makes that load a failed one: vLLM recomputes the prompt, and its answer is
token for token the one computed without any cache. Before, the node never took a lending
back (a frozen engine pinned its slots); taking it back without the check would have handed
the engine the neighbour's KV as its prompt's.

A real node (`kvtier node serve`, a RAM of a few dozen chunks), engine 1 in a process of its
own (node_engine.py: its load held by a file), engine 2 in the test's process.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from node_engine_pair import MAX_TOKENS, Engine1, engine_pair
from test_node_mode import CHUNK
from vllm_harness import random_prompts, token_ids

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "node"))  # nodekit
from nodekit import NodeProcess, short_dir, unique_name, wait_for

pytestmark = pytest.mark.vllm
LEASE_TIMEOUT_S = 2.0


@pytest.fixture
def node(tmp_path: Path) -> Iterator[NodeProcess]:
    config = tmp_path / "node.yaml"
    config.write_text(yaml.safe_dump({"tiers": [{"kind": "memory", "capacity": "1MiB"}]}))
    node = NodeProcess(config, short_dir(tmp_path) / "node.sock", unique_name(tmp_path),
                       tmp_path / "node.log", args=("--lease-timeout-s", str(LEASE_TIMEOUT_S)))
    try:
        yield node.start()
    finally:
        node.kill()


@pytest.fixture
def engines(tiny_model_dir: Path, node: NodeProcess,
            tmp_path: Path) -> Iterator[tuple[Engine1, Any]]:
    with engine_pair(tiny_model_dir, node, tmp_path / "engine1") as pair:
        yield pair


def _ram_slots(node: NodeProcess) -> int:
    [layout] = node.status()["layouts"].values()
    tier = layout["tiers"][0]
    return int(tier["capacity_bytes"]) // -(-int(layout["chunk_bytes"]) // 4096 * 4096)


def test_an_engine_frozen_mid_load_past_the_lease_recomputes_what_it_lost_exactly(
        engines: tuple[Engine1, Any], node: NodeProcess) -> None:
    one, two = engines
    [prompt] = random_prompts([400], seed=61)
    computed = token_ids(two, [prompt], MAX_TOKENS)  # the miss path: no cache yet; stored
    wait_for(lambda: not node.status()["leases"], 30, "engine 2's stores committed")

    # Engine 1 finds the prompt's chunks on the node (it never stored them: it borrows,
    # a lease) and is frozen with them lent, before its copy.
    failures = _counter(one, "load_failures")
    one.hold("loads")
    one.send({"generate": [prompt], "max_tokens": MAX_TOKENS})
    assert one.read() == {"holding": "load"}
    wait_for(lambda: node.status()["counters"]["leases_expired"] >= 1, 30,
             "the node taking engine 1's lending back")
    # Engine 2 fills the node's RAM twice over (two prompts a call: a step's stores within
    # RAM): the prompt's chunks leave, and their slots hold engine 2's chunks.
    slots = _ram_slots(node)
    committed = node.status()["counters"]["committed_chunks"]
    churn = random_prompts([CHUNK * 8] * (2 * slots // 8 + 2), seed=62)
    for pair in range(0, len(churn), 2):
        token_ids(two, churn[pair:pair + 2], 1)
    wait_for(lambda: node.status()["counters"]["committed_chunks"] - committed >= 2 * slots,
             60, "engine 2's chunks stored")

    one.release("loads")
    # Its copies were of engine 2's chunks: failed loads, recomputed, the same answer.
    assert one.read() == {"tokens": computed}
    assert _counter(one, "load_failures") > failures


def _counter(one: Engine1, name: str) -> float:
    one.send({"counter": name})
    value: float = one.read()["counter"]
    return value
