"""The connector in node mode: engines that keep their cache in `kvtier node`, a separate
process on the node (issue 43).

A real node (`kvtier node serve`, a subprocess: RAM in shared memory + a disk tier) and real
vLLM engines in this process, one after the other, all with `"node": SOCKET`:
  - the first engine computes the prompts (the miss path) and its chunks go to the node;
  - it is shut down (a restart, a rolling deploy) and a second engine starts: the prompts are
    hits in the node's RAM, loaded whole, with the first engine's tokens;
  - the node is killed under the running engine: requests keep being served with the same
    tokens (never an error): the chunks the engine knows from the slab it mapped, read in
    place, the others as misses; a new node on the same socket is found again by itself, and
    what the engine stores into it is a hit again.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from vllm_harness import (
    kvtier_counter,
    metric,
    random_prompts,
    start_engine,
    token_ids,
    transfer_config,
)

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "node"))  # nodekit
from nodekit import NodeProcess, short_dir, unique_name, wait_for

from kvtier.node.client import RETRY_S

pytestmark = pytest.mark.vllm

CHUNK = 64
HITS = "vllm:external_prefix_cache_hits"


def loadable(prompt_len: int) -> int:
    return (prompt_len - 1) // CHUNK * CHUNK


@pytest.fixture
def node(tmp_path: Path) -> Iterator[NodeProcess]:
    """A node (RAM in shared memory + a disk tier) as a `kvtier node serve` subprocess."""
    config = tmp_path / "node.yaml"
    config.write_text(yaml.safe_dump({"tiers": [
        {"kind": "memory", "capacity": "64MiB"},
        {"kind": "disk", "path": str(tmp_path / "disk"), "capacity": "256MiB"}]}))
    node = NodeProcess(config, short_dir(tmp_path) / "node.sock", unique_name(tmp_path),
                       tmp_path / "node.log")
    try:
        yield node.start()
    finally:
        node.kill()


def ram_chunks(node: NodeProcess) -> int:
    return sum(layout["tiers"][0]["chunks"] for layout in node.status()["layouts"].values())


def node_config(node: NodeProcess) -> dict[str, Any]:
    # Tails off, as vllm_harness.kvtier_transfer_config: these cases count chunk-sized hits.
    return transfer_config({"node": str(node.socket_path), "tokens_per_chunk": CHUNK,
                            "load_when": "always", "lookup_timeout_s": 1.0,
                            "tail_chunks": False})


def test_an_engine_restarted_on_the_node_hits_the_ram_of_the_one_before(
        tiny_model_dir: Path, node: NodeProcess) -> None:
    prompts = random_prompts([700, 300, 200], seed=43)
    [unasked] = random_prompts([300], seed=45)  # stored by the first engine only
    with start_engine(tiny_model_dir, node_config(node)) as first:
        computed = token_ids(first, prompts)
        [unasked_answer] = token_ids(first, [unasked])
        assert metric(first, HITS) == 0
    # Every full chunk of every prompt (and of its answer) is in the node's RAM.
    wait_for(lambda: ram_chunks(node) >= sum(len(p["prompt_token_ids"]) // CHUNK
                                             for p in prompts), 30, "the first engine's chunks")

    with start_engine(tiny_model_dir, node_config(node)) as second:
        assert token_ids(second, prompts) == computed
        assert metric(second, HITS) == sum(loadable(len(p["prompt_token_ids"]))
                                           for p in prompts)

        # The node dies under the running engine: the same tokens, no error. The chunks the
        # engine was lent before it reads in place from the slab it mapped (whole: no node
        # is left to claim a slot); the first engine's other prompt needs the node: a miss.
        node.kill()
        second.reset_prefix_cache()  # vLLM's own cache: these must come from kvtier again
        failures, hits = kvtier_counter("load_failures"), metric(second, HITS)
        assert token_ids(second, [*prompts, unasked]) == [*computed, unasked_answer]
        assert kvtier_counter("load_failures") - failures == 0
        assert metric(second, HITS) - hits == sum(loadable(len(p["prompt_token_ids"]))
                                                  for p in prompts)

        # A new node on the same socket: found again once the client's back-off ends (until
        # then each run's stores are dropped, and planned again by the next run), filled,
        # hit again.
        node.start()
        fresh = random_prompts([400], seed=44)
        answer = token_ids(second, fresh)

        def stored_in_the_new_node() -> bool:
            assert token_ids(second, fresh) == answer
            return ram_chunks(node) >= 400 // CHUNK

        wait_for(stored_in_the_new_node, 10 * RETRY_S, "the new node's chunks")
        second.reset_prefix_cache()  # vLLM's own cache: the next run must come from the node
        before = metric(second, HITS)
        assert token_ids(second, fresh) == answer
        assert metric(second, HITS) - before == loadable(400)
